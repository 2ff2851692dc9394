"""Review of the hardware / throughput area with simulated devices (no GPU): MFU arithmetic checked by
hand, peaks under torchrun when the ranks' GPUs differ, and what the preflight report claims."""

import json
import types

import pytest
import torch

from nanochat import platform as P
from nanochat import preflight, step_meter
from nanochat.platform import DEVICE_TABLE, PatchContext, SimpleProps, apply_patches, detect_device
from nanochat.training import StepMeter, StepResult

GB = 10**9
GB10 = SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True)
H100 = SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 * GB)
A100 = SimpleProps("NVIDIA A100-SXM4-80GB", 8, 0, 108, 80 * GB)
UNKNOWN = SimpleProps("NVIDIA Imaginary X1", 9, 0, 100, 40 * GB)


# ------------------------------------------------------------------ MFU by hand

def test_mfu_by_hand_one_gpu_and_eight_with_gradient_accumulation():
    """H100, 2.6e9 FLOPs/token. One GPU: 32 x 2048 tokens per micro-batch, 8 accumulated = 524,288
    tokens in 2.8 s -> 187,245.7 tok/s -> 4.8684e14 FLOP/s = 49.21% of 989.4e12; fp8 util is against
    1978.9e12. Eight GPUs, one micro-batch each (same 524,288 tokens per step) in 0.35 s: the same
    FLOP/s per GPU, so the same MFU (the log's tok/s is all ranks' tokens)."""
    h100 = detect_device(props=H100)
    bf16, fp8 = P.peaks(h100, "fp8")
    one = StepMeter(2.6e9, 1, peak_bf16=bf16, peak_active=fp8, precision="fp8", warmup_steps=0)
    m = one.update(StepResult(0, 3.0, 1.0, 2.8, 32 * 2048 * 8))
    assert m["tok_per_sec"] == pytest.approx(187245.71, rel=1e-6)
    assert m["mfu"] == pytest.approx(100 * 2.6e9 * 524288 / 2.8 / 989.4e12, rel=1e-9)
    assert m["mfu"] == pytest.approx(49.206, abs=1e-3)
    assert m["util"] == pytest.approx(100 * 2.6e9 * 524288 / 2.8 / 1978.9e12, rel=1e-9)
    eight = StepMeter(2.6e9, 8, peak_bf16=bf16, peak_active=fp8, precision="fp8", warmup_steps=0)
    m8 = eight.update(StepResult(0, 3.0, 1.0, 0.35, 524288))
    assert m8["tok_per_sec"] == pytest.approx(8 * m["tok_per_sec"])
    assert m8["mfu"] == pytest.approx(m["mfu"]) and m8["util"] == pytest.approx(m["util"])
    assert "mfu 49.21% | util(fp8) 24.60%" in eight.log_line(m8, 10)


def test_gb10_and_mig_slice_mfu_by_hand():
    """GB10 (spec-derived 125 TFLOP/s bf16): 1.0e9 FLOPs/token at 25,000 tok/s = 2.5e13 = 20%; a
    1g.10gb H100 slice (16 of 132 SMs -> 119.9 TFLOP/s) at 20,000 tok/s of 1e9 FLOPs/token = 16.68%."""
    gb10 = detect_device(props=GB10)
    meter = StepMeter(1e9, 1, peak_bf16=P.peak_flops(gb10, "bf16"), warmup_steps=0)
    assert meter.update(StepResult(0, 1.0, 1.0, 1.0, 25000))["mfu"] == pytest.approx(20.0)
    mig = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9, 0, 16, 10 * GB))
    assert mig.bandwidth_gbs == pytest.approx(3350 / 8, abs=0.1) and P.peak_flops(mig, "bf16") == 119.9e12
    meter = StepMeter(1e9, 1, peak_bf16=P.peak_flops(mig, "bf16"), warmup_steps=0)
    assert meter.update(StepResult(0, 1.0, 1.0, 1.0, 20000))["mfu"] == pytest.approx(100 * 2e13 / 119.9e12)


# ------------------------------------------------------------------ torchrun with GPUs of different kinds

@pytest.fixture
def two_ranks(monkeypatch):
    """Rank 0 of a 2-process CUDA run whose rank 1 has another GPU: detect_device answers rank 0's
    GPU, all_gather_object hands back both ranks' answers (rank 1's computed as rank 1 would)."""
    import torch.distributed as dist

    def use(own, other):
        monkeypatch.setattr(P, "detect_device", lambda device=None, props=None: detect_device(props=own))
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        gathered = []

        def all_gather_object(out, obj, group=None):
            spec = detect_device(props=other)
            bf16, act = P.peaks(spec, use.precision, use.override)
            out[:] = [obj, (bf16, act, spec.name)]
            gathered.append(obj)
        monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
        use.gathered = gathered
        return types.SimpleNamespace(device=torch.device("cuda", 0), device_type="cuda", world_size=2, rank=0)
    use.precision, use.override = "bf16", None
    return use


def test_mixed_gpus_mfu_divides_by_the_sum_of_the_ranks_peaks(two_ranks):
    """An H100 and an A100 in one torchrun: MFU divided all ranks' FLOP/s by rank 0's 989.4 TFLOP/s
    times 2 (the A100 has 312): it printed 33% where the GPUs ran at 50% of what they have together."""
    rt = two_ranks(H100, A100)
    warned = []
    bf16, act, name = step_meter.resolve_peak_flops(rt, "bf16", None, warn=warned.append)
    assert two_ranks.gathered and not warned
    assert bf16 == pytest.approx((989.4e12 + 312e12) / 2) and act == pytest.approx(bf16)
    assert "H100" in name and "A100" in name
    meter = StepMeter(1e9, 2, peak_bf16=bf16, peak_active=act, warmup_steps=0)
    flops_s = 0.5 * (989.4e12 + 312e12)   # half of the two GPUs' summed peak
    assert meter.update(StepResult(0, 1.0, 1.0, 1.0, int(flops_s / 1e9)))["mfu"] == pytest.approx(50.0, abs=1e-3)


def test_unknown_gpu_on_another_rank_is_not_silent(two_ranks):
    """Rank 1's GPU not in the table: its warning went through print0 (rank 0 only, so nobody saw it)
    and rank 0 printed an MFU against its own H100 alone as if every rank had one."""
    rt = two_ranks(H100, UNKNOWN)
    warned = []
    bf16, act, _ = step_meter.resolve_peak_flops(rt, "fp8", None, warn=warned.append)
    assert (bf16, act) == (None, None)
    assert len(warned) == 1 and "Imaginary X1" in warned[0] and "--peak-flops" in warned[0]


def test_same_gpus_on_every_rank_keep_their_peak_and_name(two_ranks):
    rt = two_ranks(H100, H100)
    two_ranks.precision = "fp8"
    assert step_meter.resolve_peak_flops(rt, "fp8", None, warn=pytest.fail) == (
        989.4e12, 1978.9e12, "NVIDIA H100 80GB HBM3")


# ------------------------------------------------------------------ the preflight report's patch list

def _ctx(triton, bundled, candidates):
    return PatchContext(env={}, dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
                        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
                        inductor_modules=[types.SimpleNamespace(is_big_gpu=lambda *_: False)],
                        triton_version=triton, bundled_ptxas_version=bundled, ptxas_candidates=list(candidates),
                        filter_warning=lambda *a, **k: None, torch_version="2.10.0")


def test_preflight_no_compile_lists_the_patches_every_cuda_process_gets(monkeypatch, capsys):
    """`--no-compile` on a GB10 with Triton 3.5: the report listed only training's patches
    (expandable_segments, sm121_warning), but init_runtime applies the ptxas and is_big_gpu patches to
    every CUDA process (apply_runtime_patches), so the run had patches the report did not name."""
    device = detect_device(props=GB10)
    cuda13 = [("/usr/local/cuda-13.0/bin/ptxas", (13, 0))]
    monkeypatch.setattr(preflight, "configure_env_before_cuda", lambda: None)
    monkeypatch.setattr(preflight, "detect_device", lambda: device)
    monkeypatch.setattr(preflight, "apply_patches",
                        lambda s, **kw: apply_patches(s, ctx=_ctx("3.5.1", (12, 8), cuda13), **kw))
    monkeypatch.setattr(preflight, "memory_budget_bytes", lambda s: 64 * GB)
    monkeypatch.setattr(preflight, "probe_attention_backends", lambda: {"sdpa-cudnn": "ok"})
    monkeypatch.setattr(preflight, "triton_ptxas_in_use", lambda s: "simulated")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_120"])
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    assert preflight.main(["--json", "--no-compile"]) == 0
    patches = json.loads(capsys.readouterr().out)["patches"]
    assert sorted(patches) == ["expandable_segments", "is_big_gpu", "ptxas", "sm121_warning"]
    # with compile, the same set (no name twice)
    assert preflight.main(["--json"]) == 0
    assert sorted(json.loads(capsys.readouterr().out)["patches"]) == sorted(patches)
    # no CUDA 13 ptxas: a --no-compile run starts (init_runtime warns) and so does the report
    monkeypatch.setattr(preflight, "apply_patches",
                        lambda s, **kw: apply_patches(s, ctx=_ctx("3.5.1", (12, 8), []), **kw))
    P._LOGGED.discard("ptxas")
    assert preflight.main(["--json", "--no-compile"]) == 0
    assert "ptxas" not in json.loads(capsys.readouterr().out)["patches"]
    assert preflight.main(["--json", "--compile"]) == 2      # a compiled run stops there
    capsys.readouterr()


def test_a_cpu_report_gets_no_patches_and_no_cuda_call(monkeypatch, capsys):
    from nanochat import cpu_patches
    monkeypatch.setattr(preflight, "detect_device", lambda: P.CPU_SPEC)
    # a CPU with no AMX problem (conftest caps oneDNN on VMs whose bf16 AMX kernels crash: reported then)
    monkeypatch.setattr(preflight, "patch_cpu_amx", lambda *a, **k: None)
    monkeypatch.setattr(cpu_patches, "_CAPPED", [])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("CUDA call on a CPU"))
    assert preflight.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["patches"] == [] and "memory_budget_gb" not in report and report["table_key"] == "cpu"


def test_table_rows_for_the_named_devices():
    rows = {"NVIDIA GB10": ("gb10", 125.0, 273), "NVIDIA H100 80GB HBM3": ("h100-sxm", 989.4, 3350),
            "NVIDIA H200": ("h200", 989.4, 4800), "NVIDIA B200": ("b200", 2250.0, 8000),
            "NVIDIA GeForce RTX 5090": ("rtx-5090", 209.5, 1792)}
    for name, (key, bf16, bw) in rows.items():
        entry = DEVICE_TABLE[key]
        spec = detect_device(props=SimpleProps(name, *entry.cc, entry.sms, int(entry.memory_gb * GB)))
        assert (spec.key, spec.peak_tflops["bf16"], spec.bandwidth_gbs) == (key, bf16, bw), name


# ------------------------------------------------------------------ --peak-flops at the library's door

@pytest.mark.parametrize("bad", ["989e12", None.__class__, [1e15], 989.0, 5])
def test_peak_flops_override_refuses_non_numbers_and_tflops_figures(bad):
    """A string (e.g. from a JSON config) raised a bare TypeError from math.isfinite, and 989 (TFLOP/s
    where FLOP/s is meant) was taken as 989 FLOP/s: MFU ~1e13 %. The scripts check their flag; the
    function every one of them divides by now refuses both with the flag's name."""
    with pytest.raises(ValueError, match="--peak-flops: got .*accepted: a finite number > 0"):
        P.peak_flops(detect_device(props=UNKNOWN), "bf16", override=bad)
    import numpy as np
    assert P.peak_flops(P.CPU_SPEC, "bf16", override=np.float32(2e12)) == pytest.approx(2e12)
    assert P.peak_flops(P.CPU_SPEC, "bf16", override=10**15) == 1e15


# ------------------------------------------------------------------ the allocator patch and the user's env

@pytest.mark.parametrize("user", ["expandable_segments_handle_type:posix_fd",
                                  "max_split_size_mb:512, expandable_segments_reserve:64"])
def test_expandable_segments_not_mistaken_for_a_torch_option_that_contains_its_name(user):
    """torch 2.15 has options whose names start with `expandable_segments` (_handle_type, _reserve):
    a substring test took them for the user's own expandable_segments choice and left the GB10 without
    expandable segments (the patch reported nothing). Their value is kept, the setting is added."""
    gb10 = detect_device(props=GB10)
    env = {"PYTORCH_ALLOC_CONF": user}
    ctx = _ctx("3.6.0", (13, 0), [])
    ctx.env = env
    assert P.patch_expandable_segments(gb10, ctx) == "expandable_segments"
    assert env["PYTORCH_ALLOC_CONF"] == user + ",expandable_segments:True"
    assert P.patch_expandable_segments(gb10, ctx) == "expandable_segments"       # idempotent
    assert env["PYTORCH_ALLOC_CONF"] == user + ",expandable_segments:True"
    for own in ("expandable_segments:False", "max_split_size_mb:64, expandable_segments : False"):
        env = {"PYTORCH_ALLOC_CONF": own}
        ctx.env = env
        assert P.patch_expandable_segments(gb10, ctx) is None and env == {"PYTORCH_ALLOC_CONF": own}


# ------------------------------------------------------------------ the preflight's dtype and $NANOCHAT_DTYPE

def test_preflight_precision_follows_nanochat_dtype_as_the_run_does(monkeypatch, capsys):
    """init_runtime resolves `auto` from $NANOCHAT_DTYPE first and refuses an explicit dtype that
    conflicts with it (base_train sets the dtype from --precision); the report ignored the variable:
    NANOCHAT_DTYPE=fp32 on an H100 said `auto -> bf16` and `--precision bf16` passed with exit 0."""
    h100 = detect_device(props=H100)
    monkeypatch.setenv("NANOCHAT_DTYPE", "fp32")
    assert preflight.run_dtype("auto", h100) == "fp32"
    assert preflight.run_dtype("fp32", h100) == "fp32"
    with pytest.raises(ValueError, match="NANOCHAT_DTYPE=fp32"):
        preflight.run_dtype("bf16", h100)
    with pytest.raises(ValueError, match="NANOCHAT_DTYPE=fp32"):
        preflight.run_dtype("fp8", h100)            # fp8 runs its non-matmul work in bf16
    monkeypatch.setenv("NANOCHAT_DTYPE", "bfloat16")
    assert preflight.run_dtype("auto", P.CPU_SPEC) == "bf16" and preflight.run_dtype("fp8", h100) == "bf16"
    monkeypatch.setenv("NANOCHAT_DTYPE", "fp16")
    with pytest.raises(ValueError, match="NANOCHAT_DTYPE: got 'fp16'; accepted: auto|bf16|fp32"):
        preflight.run_dtype("auto", h100)
    # end to end on a CPU: the report and its exit code
    monkeypatch.setattr(preflight, "detect_device", lambda: P.CPU_SPEC)
    monkeypatch.setenv("NANOCHAT_DTYPE", "bf16")
    assert preflight.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"]["precision"] == "bf16"
    assert preflight.main(["--json", "--precision", "fp32"]) == 2
    assert "NANOCHAT_DTYPE=bf16" in capsys.readouterr().err
    monkeypatch.setenv("NANOCHAT_DTYPE", "half")
    assert preflight.main(["--json"]) == 2      # init_runtime refuses the value whatever the flags
    assert "NANOCHAT_DTYPE: got 'half'" in capsys.readouterr().err
    monkeypatch.delenv("NANOCHAT_DTYPE")
    assert preflight.run_dtype("auto", h100) == "bf16" and preflight.run_dtype("auto", P.CPU_SPEC) == "fp32"
