"""nanochat/platform.py: device table, peak FLOPs, and which workaround each simulated device gets."""

import re
import types
from pathlib import Path

import pytest
import torch

from nanochat import platform as P
from nanochat import preflight
from nanochat.platform import PatchContext, SimpleProps, apply_patches, detect_device, peak_flops

GB10 = SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9, is_integrated=True)
H100 = SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 * 10**9)
H100_PCIE = SimpleProps("NVIDIA H100 PCIe", 9, 0, 114, 85 * 10**9)
RTX5090 = SimpleProps("NVIDIA GeForce RTX 5090", 12, 0, 170, 32 * 10**9)
A100 = SimpleProps("NVIDIA A100-SXM4-80GB", 8, 0, 108, 80 * 10**9)
UNKNOWN = SimpleProps("NVIDIA Imaginary X1", 9, 0, 100, 40 * 10**9)


def fake_ctx(triton_version="3.6.0", bundled=(13, 0), candidates=(), env=None, torch_version="2.10.0"):
    """A PatchContext over plain objects: nothing global is touched. torch 2.10 by default: the last
    release whose false-positive sm_121 warning sm121_warning filters (2.11+ get no such patch)."""
    inductor_utils = types.SimpleNamespace(is_big_gpu=lambda *_: False)
    return PatchContext(
        env={} if env is None else env,
        dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
        inductor_modules=[inductor_utils],
        triton_version=triton_version,
        bundled_ptxas_version=bundled,
        ptxas_candidates=list(candidates),
        filter_warning=lambda *a, **k: None,
        torch_version=torch_version,
    )


def test_table_lookup_and_peaks():
    gb10 = detect_device(props=GB10)
    assert gb10.key == "gb10" and gb10.cc == (12, 1) and gb10.sms == 48 and gb10.unified_memory
    assert peak_flops(gb10, "bf16") == pytest.approx(125e12)
    assert peak_flops(gb10, "nvfp4") == pytest.approx(500e12)
    h100 = detect_device(props=H100)
    assert h100.key == "h100-sxm" and not h100.unified_memory
    assert peak_flops(h100, "bf16") == pytest.approx(989.4e12)
    assert peak_flops(h100, "fp8") == pytest.approx(1978.9e12)
    assert peak_flops(h100, "nvfp4") is None          # Hopper has no fp4 path
    assert peak_flops(h100, "tf32") == peak_flops(h100, "fp32")
    assert detect_device(props=H100_PCIE).key == "h100-pcie"
    assert detect_device(props=RTX5090).key == "rtx-5090"
    assert peak_flops(detect_device(props=A100), "fp8") is None


def test_unknown_gpu_and_cpu_give_none():
    spec = detect_device(props=UNKNOWN)
    assert spec.key == "unknown" and spec.sms == 100 and spec.peak_tflops == {}
    assert peak_flops(spec, "bf16") is None
    assert peak_flops(spec, "bf16", override=123e12) == 123e12
    cpu = detect_device("cpu")
    assert cpu.key == "cpu" and peak_flops(cpu) is None
    with pytest.raises(ValueError, match="--precision"):
        peak_flops(cpu, "int3")
    with pytest.raises(ValueError, match="--peak-flops"):
        peak_flops(cpu, "bf16", override=-1.0)


def test_integrated_unknown_gpu_counts_as_unified():
    spec = detect_device(props=SimpleProps("NVIDIA Thor", 11, 0, 20, 64 * 10**9, is_integrated=True))
    assert spec.unified_memory and spec.key == "unknown"


def test_gb10_patches_with_old_triton():
    """GB10 + Triton 3.5 (bundled ptxas 12.8): ptxas redirect, is_big_gpu, expandable segments."""
    ctx = fake_ctx("3.5.1", (12, 8), candidates=[("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    applied = apply_patches(detect_device(props=GB10), kernel="current", compile=True, ctx=ctx)
    assert applied == ["expandable_segments", "ptxas", "is_big_gpu", "sm121_warning"]
    assert ctx.env["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"
    assert ctx.env["TRITON_PTXAS_PATH"] == "/usr/local/cuda-13.0/bin/ptxas"
    assert ctx.inductor_modules[0].is_big_gpu() is True
    assert ctx.dynamo_config.capture_scalar_outputs is False


def test_gb10_new_triton_liger_no_compile():
    ctx = fake_ctx("3.6.0", (13, 0))
    applied = apply_patches(detect_device(props=GB10), kernel="liger", compile=False, ctx=ctx)
    assert applied == ["expandable_segments", "sm121_warning"]   # no compile: no dynamo/inductor patch
    ctx = fake_ctx("3.6.0", (13, 0), env={"PYTORCH_ALLOC_CONF": "expandable_segments:False"})
    applied = apply_patches(detect_device(props=GB10), kernel="liger", compile=True, ctx=ctx)
    assert applied == ["is_big_gpu", "capture_scalar_outputs", "sm121_warning"]
    assert ctx.env["PYTORCH_ALLOC_CONF"] == "expandable_segments:False"   # user's choice kept
    assert ctx.dynamo_config.capture_scalar_outputs is True


def test_gb10_old_triton_without_cuda13_raises_with_hint():
    ctx = fake_ctx("3.4.0", None, candidates=[("/usr/bin/ptxas", (12, 4))])
    with pytest.raises(RuntimeError, match="TRITON_PTXAS_PATH"):
        apply_patches(detect_device(props=GB10), kernel="triton", compile=True, ctx=ctx)
    # ... but a run that never uses Triton does not need it
    assert "ptxas" not in apply_patches(detect_device(props=GB10), kernel="current", compile=False, ctx=ctx)
    # ... and a user-provided path is respected
    ctx = fake_ctx("3.4.0", None, env={"TRITON_PTXAS_PATH": "/opt/ptxas"})
    assert "ptxas(user)" in apply_patches(detect_device(props=GB10), compile=True, ctx=ctx)
    assert ctx.env["TRITON_PTXAS_PATH"] == "/opt/ptxas"


def test_h100_and_rtx5090_and_cpu_patches():
    ctx = fake_ctx("3.6.0", (12, 9))
    assert apply_patches(detect_device(props=H100), kernel="current", compile=True, ctx=ctx) == []
    assert ctx.env == {} and ctx.inductor_modules[0].is_big_gpu() is False
    ctx = fake_ctx("3.6.0", (12, 9))
    assert apply_patches(detect_device(props=H100), kernel="liger", compile=True, ctx=ctx) == [
        "capture_scalar_outputs"]
    # RTX 5090: sm_120 with a 12.8 ptxas is fine, 170 SMs is "big"
    ctx = fake_ctx("3.3.1", (12, 8))
    assert apply_patches(detect_device(props=RTX5090), kernel="triton", compile=True, ctx=ctx) == []
    ctx = fake_ctx("3.2.0", (12, 4), candidates=[("/cuda13/ptxas", (13, 0))])
    assert apply_patches(detect_device(props=RTX5090), compile=True, ctx=ctx) == ["ptxas"]
    ctx = fake_ctx("3.6.0", None)
    assert apply_patches(detect_device("cpu"), kernel="liger", compile=True, ctx=ctx) == []
    with pytest.raises(ValueError, match="--kernel"):
        apply_patches(detect_device("cpu"), kernel="fast", ctx=ctx)


def test_max_autotune_and_real_config_restored():
    """The real inductor module is patched and restored (global state left as found)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.utils as inductor_utils

    original, before = inductor_utils.is_big_gpu, inductor_config.max_autotune_gemm
    try:
        ctx = fake_ctx()
        ctx.inductor_modules, ctx.inductor_config = [inductor_utils], inductor_config
        assert "is_big_gpu" in apply_patches(detect_device(props=GB10), compile=True,
                                             max_autotune=True, ctx=ctx)
        assert inductor_utils.is_big_gpu(0) is True and inductor_config.max_autotune_gemm is True
    finally:
        inductor_utils.is_big_gpu, inductor_config.max_autotune_gemm = original, before


def test_configure_env_before_cuda():
    env = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}
    no_filter = lambda *a, **k: None   # noqa: E731
    assert P.configure_env_before_cuda("gb10", env, no_filter, "2.10.0") == ["expandable_segments", "sm121_warning"]
    assert env["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    env = {}
    assert P.configure_env_before_cuda("h100-sxm", env, no_filter) == [] and env == {}
    with pytest.raises(ValueError, match="spec_hint"):
        P.configure_env_before_cuda("gb11", {})


def test_memory_budget_reads_memavailable_on_unified():
    meminfo = "MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   100000000 kB\n"
    budget = P.memory_budget_bytes(detect_device(props=GB10), meminfo=meminfo, headroom=0.1, cgroup_root=None)  # not this machine's limit
    assert budget == int(100000000 * 1024 * 0.9)
    assert P.memory_budget_bytes(detect_device("cpu")) is None


def test_ptxas_rules():
    assert P.required_ptxas((12, 1)) == (12, 9)
    assert P.required_ptxas((12, 0)) == (12, 8)
    assert P.required_ptxas((9, 0)) < (12, 0)


@pytest.mark.cuda
def test_real_device_detected_and_attention_probe():
    spec = detect_device()
    assert spec.cc == torch.cuda.get_device_capability()
    results = preflight.probe_attention_backends()
    assert results["sdpa-flash"] == "ok" or results["sdpa-cudnn"] == "ok"


# ------------------------------------------------------------------ CPU: oneDNN AMX workaround

AMX_FLAGS = "fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8"


def test_cpu_amx_capped_when_probe_dies_with_sigill():
    env = {}
    assert P.patch_cpu_amx(env, AMX_FLAGS, probe=lambda: 4) == "cpu_amx"
    assert env == {P.ONEDNN_ISA_ENV: "AVX512_CORE_BF16"}


@pytest.mark.parametrize("probe_result", [0, None, 11])
def test_cpu_amx_left_alone_when_probe_runs_or_cannot_tell(probe_result):
    env = {}
    assert P.patch_cpu_amx(env, AMX_FLAGS, probe=lambda: probe_result) is None
    assert env == {}


def test_cpu_amx_not_probed_without_amx_or_with_user_cap():
    def probe():
        raise AssertionError("must not probe")
    assert P.patch_cpu_amx({}, "fpu sse avx2 avx512f", probe=probe) is None
    user = {P.ONEDNN_ISA_ENV: "AVX2"}
    assert P.patch_cpu_amx(user, AMX_FLAGS, probe=probe) is None
    assert user == {P.ONEDNN_ISA_ENV: "AVX2"}


def test_cpu_bf16_matmul_probe_runs_in_a_child():
    # The real probe on this machine: 0 (bf16 works) or 4 (SIGILL); the parent survives either way,
    # and after conftest's patch a bf16 matmul in this process works.
    assert P._bf16_matmul_in_child() in (0, 4)
    a = torch.ones(8, 16, dtype=torch.bfloat16)
    assert (a @ a.T).float().sum().item() == 8 * 8 * 16


def test_usable_sms_under_an_mps_thread_percentage():
    """A grid-barrier kernel must not outnumber the SMs MPS lets the process hold: the share of
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in whole TPCs; all SMs without it; a bad value names it."""
    from nanochat.platform import usable_sms

    assert usable_sms(132, {}) == 132
    assert usable_sms(132, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": ""}) == 132
    assert usable_sms(132, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}) == 66
    assert usable_sms(48, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "33.3"}) == 14  # 15.98 -> 14 (TPC pairs)
    assert usable_sms(132, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}) == 132
    assert usable_sms(48, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "1"}) == 1
    for bad in ("0", "150", "half"):
        with pytest.raises(ValueError, match="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):
            usable_sms(132, {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": bad})


def test_prepare_te_import_points_te_at_torchs_cudnn(tmp_path):
    """TE loads the first cuDNN it finds (system paths before pip) and names each cuDNN sub-library
    by soname; the patch sets CUDNN_HOME to torch's folder and loads torch's libraries globally,
    dependencies first and libcudnn.so last, and leaves a user's own choice (or no pip cuDNN) alone."""
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libcudnn.so.9", "libcudnn_cnn.so.9", "libcudnn_graph.so.9", "libcudnn_ops.so.9",
                 "libcudnn_adv.so.9", "libcudnn_engines_precompiled.so.9", "libcudnn_new_thing.so.9"):
        (lib / name).touch()
    env: dict[str, str] = {}
    loaded: list[str] = []
    assert P.prepare_te_import(env, cudnn_dir=str(tmp_path), loader=loaded.append, te_installed=True) == "te_cudnn"
    assert env == {"CUDNN_HOME": str(tmp_path)}
    names = [Path(p).name for p in loaded]
    assert names[:2] == ["libcudnn_graph.so.9", "libcudnn_ops.so.9"] and names[-1] == "libcudnn.so.9"
    assert names.index("libcudnn_cnn.so.9") > names.index("libcudnn_engines_precompiled.so.9")
    assert sorted(names) == sorted(p.name for p in lib.iterdir())   # every library, unknown ones too
    loaded.clear()
    assert P.prepare_te_import(env, cudnn_dir="/elsewhere", loader=loaded.append, te_installed=True) is None
    assert not loaded
    user = {"CUDNN_PATH": "/opt/cudnn"}
    assert P.prepare_te_import(user, cudnn_dir=str(tmp_path), loader=loaded.append, te_installed=True) is None
    assert "CUDNN_HOME" not in user and not loaded
    assert P.prepare_te_import({}, cudnn_dir="", loader=loaded.append, te_installed=True) is None
    # without TE nothing is loaded or set, even with torch's cuDNN at hand
    assert P.prepare_te_import(fresh := {}, cudnn_dir=str(tmp_path), loader=loaded.append, te_installed=False) is None
    assert fresh == {} and not loaded
    found = P.torch_cudnn_dir()   # this environment's torch wheel: a folder with lib/, or no pip cuDNN
    assert found is None or (Path(found) / "lib").is_dir()


# ------------------------------------------------------------------ Triton's FP-fusion default

def test_triton_fp_fusion_pinned_from_39_unless_user_set():
    gb10 = detect_device(props=GB10)
    ctx = fake_ctx(triton_version="3.9.0")
    assert P.patch_triton_fp_fusion(gb10, ctx, uses_triton=True) == "fp_fusion"
    assert ctx.env["TRITON_DEFAULT_FP_FUSION"] == "1"
    assert "fp_fusion" in apply_patches(gb10, kernel="triton", compile=False, ctx=fake_ctx(triton_version="3.10.1"))
    user = fake_ctx(triton_version="3.9.0", env={"TRITON_DEFAULT_FP_FUSION": "0"})
    assert P.patch_triton_fp_fusion(gb10, user, uses_triton=True) is None
    assert user.env["TRITON_DEFAULT_FP_FUSION"] == "0"                      # the user's choice stands
    for quiet in (fake_ctx(triton_version="3.6.0"), fake_ctx(triton_version=None)):
        assert P.patch_triton_fp_fusion(gb10, quiet, uses_triton=True) is None and not quiet.env
    assert P.patch_triton_fp_fusion(gb10, fake_ctx(triton_version="3.9.0"), uses_triton=False) is None
    # a CPU gets nothing (detect_device(props=None) was the real device: fp_fusion on the GPU box)
    assert P.patch_triton_fp_fusion(detect_device("cpu"), fake_ctx(triton_version="3.9.0"), True) is None


# ------------------------------------------------------------------ audit: MFU peaks, warnings, idempotence

@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), float("-inf")])
def test_peak_flops_override_must_be_a_finite_positive_number(bad):
    """--peak-flops nan passed `<= 0` and printed MFU nan%; inf printed 0%: both are refused."""
    with pytest.raises(ValueError, match="--peak-flops: got .*accepted: a finite number > 0"):
        peak_flops(detect_device(props=UNKNOWN), "bf16", override=bad)


def test_mig_slice_peaks_scale_with_its_sms():
    """A MIG slice reports its own SMs (here 16 of an H100's 132): the peak it divides MFU by is the
    slice's, not the whole board's (which would print an eighth of the real MFU)."""
    full = detect_device(props=H100)
    part = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3 MIG 2g.20gb", 9, 0, 16, 20 * 10**9))
    assert part.key == "h100-sxm" and part.sms == 16
    assert peak_flops(part, "bf16") == pytest.approx(peak_flops(full, "bf16") * 16 / 132, rel=1e-3)
    assert peak_flops(part, "fp8") == pytest.approx(1978.9e12 * 16 / 132, rel=1e-3)
    assert "16 of 132 SMs" in part.source
    assert peak_flops(full, "bf16") == pytest.approx(989.4e12) and "SMs" not in full.source
    # nvidia-smi parsing gives no SM count (0): the table's peaks stand
    assert P.spec_from_props(SimpleProps("NVIDIA GB10", 12, 1, 0, 0)).peak_tflops == P.DEVICE_TABLE["gb10"].peak_tflops


# torch 2.9-2.10's text for a GB10 with a wheel built up to sm_120 (torch/cuda/__init__.py, old_gpu_warn)
TORCH_SM121_WARNING = ("\n    Found GPU0 NVIDIA GB10 which is of cuda capability 12.1.\n"
                       "    Minimum and Maximum cuda capability supported by this version of PyTorch is\n"
                       "    (8.0) - (12.0)\n    ")


def _warns_after_patch(message: str) -> bool:
    """Whether `message` still shows after patch_sm121_warning installed its filter (real warnings)."""
    import warnings
    with warnings.catch_warnings(record=True) as seen:   # restores the filters on exit
        warnings.simplefilter("always")
        ctx = fake_ctx()
        ctx.filter_warning = warnings.filterwarnings
        assert P.patch_sm121_warning(detect_device(props=GB10), ctx) == "sm121_warning"
        warnings.warn(message, UserWarning)
    return bool(seen)


def test_sm121_filter_silences_torchs_multiline_false_positive_only():
    """The filter is matched against the whole message from its first character (re.match): torch's
    text starts with a newline, which the old `.*(capability|sm_121).*` could not cross, so the
    warning still printed. A genuinely unsupported build (max 9.0, or no sm_12x code) keeps warning."""
    assert not _warns_after_patch(TORCH_SM121_WARNING)
    assert _warns_after_patch(TORCH_SM121_WARNING.replace("(12.0)", "(9.0)"))
    assert _warns_after_patch("\nNVIDIA GB10 with CUDA capability sm_121 is not compatible with the current "
                              "PyTorch installation.\n")


def test_configure_env_before_cuda_filters_the_sm121_warning_before_cuda_starts():
    """torch warns when CUDA initialises (init_runtime's set_device), before apply_patches runs: the
    filter has to be in place from configure_env_before_cuda on."""
    calls = []
    env = {}
    applied = P.configure_env_before_cuda("gb10", env, filter_warning=lambda *a, **k: calls.append(k),
                                          torch_version="2.10.0")
    assert applied == ["expandable_segments", "sm121_warning"] and len(calls) == 1
    assert P.configure_env_before_cuda("h100-sxm", {}, filter_warning=lambda *a, **k: calls.append(k)) == []
    assert len(calls) == 1


def test_patches_applied_twice_report_and_leave_the_same_state():
    """bench_train / benchmark_kernels set up every configuration with apply_patches: the second
    call found its own TRITON_PTXAS_PATH and called it the user's, and dropped expandable_segments
    and fp_fusion from the list (already in the environment), though all were in effect."""
    ctx = fake_ctx("3.9.0", (12, 8), candidates=[("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    gb10 = detect_device(props=GB10)
    first = apply_patches(gb10, kernel="triton", compile=True, ctx=ctx)
    env_after_first = dict(ctx.env)
    assert first == ["expandable_segments", "ptxas", "is_big_gpu", "sm121_warning", "fp_fusion"]
    assert apply_patches(gb10, kernel="triton", compile=True, ctx=ctx) == first
    assert ctx.env == env_after_first
    # init_runtime's configure_env_before_cuda sets the allocator first: the banner still lists it
    env = {}
    P.configure_env_before_cuda("gb10", env, filter_warning=lambda *a, **k: None)
    assert "expandable_segments" in apply_patches(gb10, compile=False, ctx=fake_ctx(env=env))
    # what the user set stays theirs
    user = fake_ctx("3.4.0", None, env={"TRITON_PTXAS_PATH": "/opt/ptxas", "TRITON_DEFAULT_FP_FUSION": "1",
                                         "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert apply_patches(gb10, compile=True, ctx=user) == ["ptxas(user)", "is_big_gpu", "sm121_warning"]


@pytest.mark.parametrize("patch", ["patch_ptxas", "patch_is_big_gpu", "patch_expandable_segments",
                                   "patch_capture_scalar_outputs", "patch_sm121_warning",
                                   "patch_triton_fp_fusion", "patch_cpu_amx", "prepare_te_import"])
def test_each_patch_states_the_versions_it_targets(patch):
    doc = getattr(P, patch).__doc__
    assert re.search(r"(torch|Triton|TE|Liger|Transformer Engine)[^.]*\d+\.\d+", doc), doc


# ------------------------------------------------------------------ audit: the preflight command line

def test_preflight_rejects_unknown_values_and_stray_flags(capsys):
    """`--precision bogus` printed a report and exited 0 ("unavailable: ..."): an unknown value is a
    ValueError naming the flag, before any report (`python -m nanochat.platform`: one line, exit 2,
    tests/test_script_flags.py); --nccl-procs means nothing without --nccl; _ spellings work."""
    for argv, flag in ((["--precision", "bogus"], "--precision"), (["--precision-backend", "x"], "--precision-backend"),
                       (["--nccl-procs", "2"], "--nccl-procs"), (["--nccl_procs", "2"], "--nccl-procs")):
        with pytest.raises(ValueError, match=flag):
            preflight.main(argv)
        assert capsys.readouterr().out == ""


def test_preflight_exit_code_says_whether_an_explicit_precision_can_run(monkeypatch, capsys):
    """An explicit --precision the device cannot run: the report, then one error line and exit 2
    (the GPU box's te_preflight step passed with TE missing); auto never fails."""
    import json
    monkeypatch.setattr(preflight, "detect_device", lambda: P.CPU_SPEC)
    assert preflight.main(["--json", "--precision", "fp8", "--no_compile"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["precision"].startswith("unavailable: --precision fp8")
    assert err.strip().splitlines() == [err.strip()] and err.startswith("preflight: error: --precision fp8: needs")
    assert preflight.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"]["precision"] == "fp32"   # auto on a CPU says what it chose
    assert preflight.main(["--json", "--precision", "nvfp4", "--precision-backend", "emulated"]) == 0


def test_preflight_says_where_the_mfu_peak_comes_from():
    """An unknown GPU's report asks for --peak-flops; a MIG slice's says its peaks were scaled."""
    assert "--peak-flops" in preflight._peak_source(detect_device(props=UNKNOWN))
    mig = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 9, 0, 60, 40 * 10**9))
    assert "60 of 132 SMs" in preflight._peak_source(mig)
    assert preflight._peak_source(P.CPU_SPEC) == "n/a"


def test_runtime_patches_cover_processes_that_do_not_train(caplog):
    """init_runtime applies the Triton workarounds for chat / eval / benchmarks too (only training's
    set-up did): a GB10 with Triton 3.5 gets the CUDA 13 ptxas; where none exists it is one warning,
    not an error, since a process may launch no Triton kernel at all."""
    ctx = fake_ctx("3.5.1", (12, 8), candidates=[("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    assert "ptxas" in P.apply_runtime_patches(detect_device(props=GB10), ctx=ctx)
    assert ctx.env["TRITON_PTXAS_PATH"] == "/usr/local/cuda-13.0/bin/ptxas"
    P._LOGGED.discard("ptxas")
    ctx = fake_ctx("3.5.1", (12, 8), candidates=[])
    with caplog.at_level("WARNING"):   # the other patches still apply (they stopped at the missing ptxas)
        assert P.apply_runtime_patches(detect_device(props=GB10), ctx=ctx) == [
            "expandable_segments", "is_big_gpu", "sm121_warning"]
    assert "cannot target sm_121" in caplog.text and "TRITON_PTXAS_PATH" not in ctx.env
    with pytest.raises(RuntimeError, match="cannot target sm_121"):
        P.apply_patches(detect_device(props=GB10), compile=True, ctx=fake_ctx("3.5.1", (12, 8)))
