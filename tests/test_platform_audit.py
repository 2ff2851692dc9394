"""Audit of the platform layer with simulated devices (no GPU): device-table variants, version-gated
workarounds, the memory budget's edges, TE's nvfp4 recipe checks and the preflight report's verdicts."""

import json
import logging
import types

import pytest
import torch

from nanochat import platform as P
from nanochat import precision as PR
from nanochat import preflight
from nanochat.errors import RequestError
from nanochat.platform import DEVICE_TABLE, PatchContext, SimpleProps, apply_patches, detect_device, peak_flops
from nanochat.precision_te import build_te_recipe

GB = 10**9
GB10 = SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True)
T4 = SimpleProps("Tesla T4", 7, 5, 40, 16 * GB)


def spec(name, major, minor, sms, mem_gb, integrated=False):
    return detect_device(props=SimpleProps(name, major, minor, sms, mem_gb * GB, is_integrated=integrated))


def ctx(triton="3.5.1", bundled=(12, 8), candidates=(), env=None, torch_version="2.10.0", filters=None):
    return PatchContext(env={} if env is None else env, dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
                        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
                        inductor_modules=[types.SimpleNamespace(is_big_gpu=lambda *_: False)],
                        triton_version=triton, bundled_ptxas_version=bundled, ptxas_candidates=list(candidates),
                        filter_warning=(lambda *a, **k: filters.append(k)) if filters is not None else None,
                        torch_version=torch_version)


# ------------------------------------------------------------------ the device table

def test_design_facts_match_the_table():
    """DESIGN.md section 3, entry by entry."""
    gb10 = detect_device(props=GB10)
    assert (gb10.key, gb10.cc, gb10.sms, gb10.bandwidth_gbs, gb10.unified_memory) == ("gb10", (12, 1), 48, 273, True)
    assert [peak_flops(gb10, p) / 1e12 for p in ("bf16", "fp8", "nvfp4")] == [125, 250, 500]
    assert "spec-derived" in gb10.source
    h100, h200 = DEVICE_TABLE["h100-sxm"], DEVICE_TABLE["h200"]
    assert (h100.sms, h100.bandwidth_gbs, h200.bandwidth_gbs, h200.memory_gb) == (132, 3350, 4800, 141)
    assert h200.peak_tflops == h100.peak_tflops and "nvfp4" not in h200.peak_tflops
    b200 = DEVICE_TABLE["b200"]
    assert (b200.sms, b200.bandwidth_gbs, b200.peak_tflops["nvfp4"]) == (148, 8000, 9000)
    assert (DEVICE_TABLE["rtx-5090"].sms, DEVICE_TABLE["rtx-pro-6000"].sms) == (170, 188)


def test_h200_nvl_gets_its_own_lower_peaks():
    """The H200 NVL (600 W PCIe card) matched the SXM H200 and divided MFU by 989 TFLOP/s, not its 835."""
    nvl = spec("NVIDIA H200 NVL", 9, 0, 132, 150)
    assert nvl.key == "h200-nvl" and nvl.bandwidth_gbs == 4800
    assert peak_flops(nvl, "bf16") == pytest.approx(835e12) and peak_flops(nvl, "fp8") == pytest.approx(1670e12)
    assert spec("NVIDIA H200", 9, 0, 132, 150).key == "h200"


@pytest.mark.parametrize("name,mem,key,bandwidth", [
    ("NVIDIA A100-SXM4-80GB", 80, "a100", 2039), ("NVIDIA A100-SXM4-40GB", 40, "a100-40gb", 1555),
    ("NVIDIA A100-PCIE-40GB", 40, "a100-40gb", 1555), ("NVIDIA A100 80GB PCIe", 80, "a100-pcie", 1935)])
def test_a100_variants_report_their_own_bandwidth(name, mem, key, bandwidth):
    """Every A100 got the 80 GB SXM's 2039 GB/s (the 40 GB parts have 1555): bandwidth utilisation in
    the decode / roofline benchmarks was 24% low there. Peaks are the same; no fp8, no nvfp4."""
    a100 = spec(name, 8, 0, 108, mem)
    assert (a100.key, a100.bandwidth_gbs) == (key, bandwidth)
    assert peak_flops(a100, "bf16") == pytest.approx(312e12) and peak_flops(a100, "fp8") is None
    with pytest.raises(ValueError, match="^--precision fp8: needs .*cc 8.0"):
        PR.resolve("fp8", "auto", a100, te_available=True)


@pytest.mark.parametrize("name,cc,sms", [("NVIDIA GeForce RTX 5090 Laptop GPU", (12, 0), 82),
                                         ("NVIDIA GeForce RTX 4090 Laptop GPU", (8, 9), 76)])
def test_laptop_gpus_are_not_the_desktop_cards(name, cc, sms):
    """A laptop 'RTX 5090' (another chip, laptop clocks, 896 GB/s) matched the desktop card: its
    desktop bandwidth and SM-scaled desktop peaks were printed as facts. It is not in the table."""
    laptop = spec(name, *cc, sms, 24)
    assert laptop.key == "unknown" and laptop.bandwidth_gbs is None and peak_flops(laptop, "bf16") is None
    assert "--peak-flops" in preflight._peak_source(laptop)


def test_rtx_pro_6000_max_q_is_below_the_workstation_card():
    maxq = spec("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", 12, 0, 188, 96)
    full = spec("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 12, 0, 188, 96)
    assert (maxq.key, full.key) == ("rtx-pro-6000-maxq", "rtx-pro-6000")
    assert peak_flops(maxq, "bf16") < peak_flops(full, "bf16") and "spec-derived" in maxq.source


def test_unknown_name_with_a_known_cc_is_not_guessed():
    """cc 9.0 spans the H20 (148 TFLOP/s) to the H100 SXM (989): a name outside the table stays
    unknown (MFU n/a, --peak-flops asked for); its cc still drives the patches and the precision."""
    odd = spec("NVIDIA Graphics Device", 12, 1, 48, 128, integrated=True)
    assert odd.key == "unknown" and odd.peak_tflops == {} and odd.unified_memory
    assert "sm121_warning" in apply_patches(odd, compile=False, ctx=ctx(triton="3.6.0", bundled=(13, 0)))
    assert PR.resolve("fp8", "auto", odd, te_available=False).backend == "native"


# ------------------------------------------------------------------ workarounds and their versions

def test_sm121_warning_filter_only_on_the_torch_releases_that_print_it(caplog):
    """torch >= 2.11 has no 'Minimum and Maximum cuda capability' text: the patch was listed as
    applied and logged 'warning filtered' on every torch, outside the 2.9-2.10 it targets."""
    gb10 = detect_device(props=GB10)
    for version, expected in (("2.9.1", True), ("2.10.0", True), ("2.11.0", False), ("2.15.0+cu132", False)):
        filters = []
        applied = apply_patches(gb10, compile=False, ctx=ctx(triton="3.6.0", bundled=(13, 0), torch_version=version,
                                                             filters=filters))
        assert ("sm121_warning" in applied) is expected and bool(filters) is expected, version
    filters = []
    assert P.configure_env_before_cuda("gb10", {}, lambda *a, **k: filters.append(k),
                                       torch_version="2.15.0") == ["expandable_segments"] and not filters
    assert P.PatchContext(env={}).torch_version == torch.__version__   # the real one by default


def test_ptxas_user_blackwell_variable_is_kept():
    """Triton >= 3.6 reads TRITON_PTXAS_BLACKWELL_PATH for sm_100+; a user who set only that one had
    it overwritten by the patch with whatever ptxas it found."""
    env = {"TRITON_PTXAS_BLACKWELL_PATH": "/opt/cuda-13.1/bin/ptxas"}
    c = ctx(env=env, candidates=[("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    assert P.patch_ptxas(detect_device(props=GB10), c, uses_triton=True) == "ptxas(user)"
    assert env["TRITON_PTXAS_BLACKWELL_PATH"] == "/opt/cuda-13.1/bin/ptxas"   # the user's, not the one found
    assert env["TRITON_PTXAS_PATH"] == "/opt/cuda-13.1/bin/ptxas"   # carried to the other name (test_platform_review)
    # ours, applied again, is still ours
    c = ctx(candidates=[("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    assert P.patch_ptxas(detect_device(props=GB10), c, True) == P.patch_ptxas(detect_device(props=GB10), c, True) == "ptxas"


def test_ptxas_rule_when_the_bundled_binary_cannot_be_probed(caplog):
    """Without a probe only cc >= 12.1 on Triton < 3.6 counted as too old: an RTX 5090 (sm_120 needs
    12.8) on Triton 3.2 (ships 12.x < 12.8) got nothing; the log line printed 'ptxas None < (12, 9)'."""
    cuda13 = [("/usr/local/cuda-13.0/bin/ptxas", (13, 0))]
    rtx5090 = spec("NVIDIA GeForce RTX 5090", 12, 0, 170, 32)
    assert P.patch_ptxas(rtx5090, ctx(triton="3.2.0", bundled=None, candidates=cuda13), True) == "ptxas"
    assert P.patch_ptxas(rtx5090, ctx(triton="3.4.0", bundled=None, candidates=cuda13), True) is None
    assert P.patch_ptxas(rtx5090, ctx(triton="3.6.0", bundled=None, candidates=cuda13), True) is None
    P._LOGGED.discard("ptxas")
    with caplog.at_level(logging.WARNING, logger="nanochat.platform"):
        assert P.patch_ptxas(detect_device(props=GB10), ctx(triton="3.5.0", bundled=None, candidates=cuda13),
                             True) == "ptxas"
    assert "None" not in caplog.text and "not probed; Triton 3.5.0 ships <= 12.8" in caplog.text
    assert "< 12.9 needed by sm_121" in caplog.text


def test_thor_sm110_needs_a_cuda13_ptxas():
    """sm_110 (Thor, renamed from sm_101 in CUDA 13.0) needs ptxas 13.0; it was held to 12.8."""
    assert P.required_ptxas((11, 0)) == (13, 0)
    thor = spec("NVIDIA Thor", 11, 0, 20, 64, integrated=True)
    c = ctx(triton="3.5.1", bundled=(12, 9), candidates=[("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    assert "ptxas" in apply_patches(thor, kernel="triton", compile=True, ctx=c)


def test_missing_ptxas_is_a_request_error_and_still_a_runtime_error():
    """Scripts print a RequestError as one line (exit 2) where this was a traceback;
    apply_runtime_patches turns it into a warning and applies the other patches."""
    with pytest.raises(RequestError, match="cannot target sm_121") as info:
        apply_patches(detect_device(props=GB10), kernel="triton", ctx=ctx(candidates=[]))
    assert isinstance(info.value, RuntimeError)
    assert "ptxas" not in P.apply_runtime_patches(detect_device(props=GB10), ctx=ctx(candidates=[]))


# ------------------------------------------------------------------ memory budget

MEMINFO = "MemTotal:       131072000 kB\nMemFree:        1000 kB\nMemAvailable:   {} kB\n"


def test_memory_budget_edges():
    gb10 = detect_device(props=GB10)
    assert P.memory_budget_bytes(gb10, meminfo=MEMINFO.format(0), cgroup_root=None) == 0
    assert P.memory_budget_bytes(gb10, meminfo=MEMINFO.format(1000), cgroup_root=None, headroom=0.0) == 1000 * 1024
    assert P.memory_budget_bytes(gb10, meminfo=MEMINFO.format(1000), cgroup_root=None, headroom=0.5) == 512000
    for bad in (1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="headroom"):
            P.memory_budget_bytes(gb10, meminfo=MEMINFO.format(1000), headroom=bad)
    with pytest.raises(RuntimeError, match="MemAvailable"):
        P.memory_budget_bytes(gb10, meminfo="MemTotal: 1 kB\n")


def test_memory_budget_on_mps_does_not_read_proc_meminfo():
    """MPS_SPEC is unified memory, so the budget read /proc/meminfo (absent on macOS: an OSError,
    here a Linux figure for an Apple GPU); the docstring promises None for CPU/MPS."""
    assert P.memory_budget_bytes(P.MPS_SPEC) is None
    assert P.memory_budget_bytes(P.MPS_SPEC, meminfo=MEMINFO.format(1000)) is None


# ------------------------------------------------------------------ precision: TE's nvfp4 recipe

def test_te_without_nvfp4_recipe_is_refused_before_any_model():
    """TE < 2.8 (no NVFP4BlockScaling) resolved to nvfp4/te and then died with an AttributeError in
    build_te_recipe, after the model was built; on sm_12x a recipe without disable_rht was a
    RuntimeError there. Both are a RequestError at resolve now, naming --precision nvfp4."""
    gb10, b200 = detect_device(props=GB10), DEVICE_TABLE["b200"]
    old_te = types.SimpleNamespace(Float8CurrentScaling=object)
    with pytest.raises(RequestError, match=r"^--precision nvfp4: .*NVFP4BlockScaling.*TE >= 2.8"):
        PR.resolve("nvfp4", "auto", gb10, te_available=True, te_recipe=old_te)
    with pytest.raises(RequestError, match=r"^--precision nvfp4: .*NVFP4BlockScaling"):
        build_te_recipe("nvfp4", gb10, old_te)

    class NoRht:
        model_fields = {"backward_override": None}
    partial_te = types.SimpleNamespace(NVFP4BlockScaling=NoRht)
    with pytest.raises(RequestError, match=r"disable_rht.*sm_12x"):
        PR.resolve("nvfp4", "te", gb10, te_available=True, te_recipe=partial_te)
    assert PR.resolve("nvfp4", "te", b200, te_available=True, te_recipe=partial_te).backend == "te"
    # emulation needs no TE at all
    assert PR.resolve("nvfp4", "emulated", gb10, te_available=True, te_recipe=old_te).backend == "emulated"


# ------------------------------------------------------------------ the preflight report on simulated GPUs

@pytest.fixture
def simulated(monkeypatch):
    """Run preflight_report as on a simulated GPU: CUDA calls answered, the order of calls kept."""
    calls = []

    def use(props, budget=64 * GB):
        device = detect_device(props=props)
        monkeypatch.setattr(preflight, "configure_env_before_cuda", lambda: calls.append("configure_env"))
        monkeypatch.setattr(preflight, "detect_device", lambda: calls.append("detect") or device)
        monkeypatch.setattr(preflight, "apply_patches", lambda s, **kw: apply_patches(s, ctx=ctx("3.6.0", (13, 0)), **kw))
        monkeypatch.setattr(preflight, "memory_budget_bytes", lambda s: budget)
        monkeypatch.setattr(preflight, "probe_attention_backends", lambda: {"sdpa-cudnn": "ok"})
        monkeypatch.setattr(preflight, "triton_ptxas_in_use", lambda s: "simulated")
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_120"])
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
        return device
    use.calls = calls
    return use


def test_preflight_on_a_gb10_reports_bandwidth_and_starts_cuda_after_the_env(simulated, capsys):
    """The report had no bandwidth; and detect_device (which initialises CUDA) ran before the
    allocator environment and torch's sm_121 warning filter were in place (init_runtime does it first)."""
    simulated(GB10)
    assert preflight.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bandwidth_gbs"] == 273 and report["table_key"] == "gb10" and report["unified_memory"]
    assert report["precision"]["precision"] == "bf16" and report["kernel"] == "current"
    assert simulated.calls[:2] == ["configure_env", "detect"]


def test_preflight_on_a_gpu_without_bf16(simulated, capsys):
    """A T4 (cc 7.5): `auto` reported bf16 (the run uses fp32) and an explicit --precision bf16
    passed with exit 0 (init_runtime refuses it)."""
    simulated(T4)
    assert preflight.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"]["precision"] == "fp32"
    assert preflight.main(["--json", "--precision", "bf16"]) == 2
    out, err = capsys.readouterr()
    assert "no native bf16" in json.loads(out)["precision"] and err.startswith("preflight: error: --precision bf16")
    assert preflight.main(["--json", "--precision", "fp32"]) == 0
    capsys.readouterr()
    assert preflight.main(["--json", "--precision", "fp8"]) == 2          # the fp8 message, not the bf16 one
    assert "compute capability >= 8.9" in capsys.readouterr().err


def test_preflight_refuses_an_explicit_kernel_that_cannot_run(monkeypatch, capsys):
    """`--kernel liger` on a machine where Liger cannot run printed a clean report and exit 0."""
    monkeypatch.setattr(preflight, "detect_device", lambda: P.CPU_SPEC)
    assert preflight.main(["--json", "--kernel", "liger"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["kernel"].startswith("unavailable: --kernel liger")
    assert err.strip() == err.strip().splitlines()[0] and "preflight: error: --kernel liger" in err
    assert preflight.main(["--json", "--kernel", "triton"]) == 0          # its CPU path runs here
    assert json.loads(capsys.readouterr().out)["kernel"] == "triton"
    assert preflight.check_kernel_here("triton", P.MPS_SPEC).startswith("unavailable: --kernel triton")


def test_preflight_reports_a_missing_ptxas_instead_of_a_traceback(simulated, monkeypatch, capsys):
    """GB10 + Triton 3.5 without a CUDA 13 ptxas: apply_patches' RuntimeError ended the report with a
    traceback; now the report says it and exits 2, as the training run with compile would stop."""
    simulated(GB10)
    monkeypatch.setattr(preflight, "apply_patches",
                        lambda s, **kw: apply_patches(s, ctx=ctx("3.5.1", (12, 8), candidates=[]), **kw))
    assert preflight.main(["--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["patches"].startswith("unavailable: Triton 3.5.1")
    assert "preflight: error: Triton 3.5.1's bundled ptxas (12.8) cannot target sm_121" in err


def test_preflight_names_the_ptxas_triton_really_runs(monkeypatch):
    """Triton 3.9 runs its `ptxas-blackwell` from sm_90 on; the report named the older `ptxas` for
    Hopper ("bundled with triton (CUDA (12, 9))"). Ask Triton itself which one it takes."""
    compiler = pytest.importorskip("triton.backends.nvidia.compiler")
    if not hasattr(compiler, "get_ptxas"):
        pytest.skip("this Triton has no get_ptxas(arch)")
    for var in P.PTXAS_ENV:
        monkeypatch.delenv(var, raising=False)
    for device in (DEVICE_TABLE["h100-sxm"], detect_device(props=GB10)):
        tool = compiler.get_ptxas(device.cc[0] * 10 + device.cc[1])
        assert preflight.triton_ptxas_in_use(device) == f"{tool.path} (CUDA {tool.version})"
    assert preflight.triton_ptxas_in_use(P.CPU_SPEC) == "n/a"
