"""Review 11 of the GB10 (DGX Spark) support, pitfall by pitfall (DESIGN.md s4), on simulated device
properties (no GPU): Triton's ptxas by release (s4.1: 3.6 ships a 12.9 Blackwell ptxas, which
serves sm_121 but not Thor's sm_110; 3.5 reads only TRITON_PTXAS_PATH), whether the torch build
has code for the GPU (s4.4), the TE recipe the preflight report shows (s4.7), and two guards that
had no test failing without them: the precision start-up check's zero / non-finite gradient stop
(s4.7, TE's all-zero stochastic rounding) and the GEMM benchmark's synchronise before the clock (s4.10)."""

import dataclasses
import enum
import json
import stat
import sys
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat import platform as P
from nanochat import precision as PR
from nanochat import preflight
from nanochat.platform import PatchContext, PtxasMissing, SimpleProps, apply_patches, detect_device
from nanochat.precision_te import build_te_recipe

GB = 10**9
GB10 = SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True)
THOR = SimpleProps("NVIDIA Thor", 11, 0, 20, 128 * GB, is_integrated=True)
B200 = SimpleProps("NVIDIA B200", 10, 0, 148, 180 * GB)
CUDA13 = [("/usr/local/cuda-13.0/bin/ptxas", (13, 0))]


def ctx(env=None, triton="3.6.0", bundled=None, candidates=CUDA13, probe=None):
    extra = {} if probe is None else {"ptxas_version_of": probe}
    return PatchContext(env={} if env is None else env,
                        dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
                        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
                        inductor_modules=[types.SimpleNamespace(is_big_gpu=lambda *_: False)],
                        triton_version=triton, bundled_ptxas_version=bundled, ptxas_candidates=list(candidates),
                        torch_version="2.10.0", **extra)


def fake_ptxas(path, release):
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


# ------------------------------------------------------------------ s4.1: Triton's ptxas by release

def test_unprobed_bundled_ptxas_follows_the_triton_release():
    """Without a probe of the bundled binary, Triton 3.6 was taken to ship a CUDA 13 ptxas: a Thor
    (sm_110, needs 13.0) got no redirect and met 'sm_110a is not defined' in 3.6's 12.9 ptxas-blackwell.
    3.7 ships 13.1 (fine for Thor); GB10's sm_121 needs only 12.9 (fine from 3.6, redirected up to 3.5)."""
    thor, gb10 = detect_device(props=THOR), detect_device(props=GB10)
    assert P._bundled_ptxas_by_triton("3.6.0") == (12, 9) and P._bundled_ptxas_by_triton("3.7.1") >= (13, 0)
    c = ctx(triton="3.6.0")
    assert P.patch_ptxas(thor, c, uses_triton=True) == "ptxas"
    assert c.env["TRITON_PTXAS_BLACKWELL_PATH"] == CUDA13[0][0]
    assert P.patch_ptxas(thor, ctx(triton="3.7.0"), uses_triton=True) is None
    assert P.patch_ptxas(gb10, ctx(triton="3.6.0"), uses_triton=True) is None
    assert P.patch_ptxas(gb10, ctx(triton="3.5.1"), uses_triton=True) == "ptxas"
    with pytest.raises(PtxasMissing, match=r"Triton 3\.6\.0 ships <= 12\.9\) cannot target sm_110"):
        apply_patches(thor, kernel="triton", ctx=ctx(triton="3.6.0", candidates=[]))


def test_triton_3_5_checks_the_ptxas_variable_it_reads(tmp_path):
    """Triton 3.5's wheel has no ptxas-blackwell and reads TRITON_PTXAS_PATH for every arch (the
    Blackwell variable came with 3.6): a GB10 user with a stale TRITON_PTXAS_PATH beside a good
    TRITON_PTXAS_BLACKWELL_PATH was told the good one was used while Triton ran the stale one."""
    good = fake_ptxas(tmp_path / "ptxas-13.0", "13.0")
    stale = str(tmp_path / "gone" / "ptxas")
    env = {"TRITON_PTXAS_PATH": stale, "TRITON_PTXAS_BLACKWELL_PATH": good}
    with pytest.raises(PtxasMissing, match=r"^TRITON_PTXAS_PATH=.*gone/ptxas does not run"):
        P.patch_ptxas(detect_device(props=GB10), ctx(dict(env), triton="3.5.1", bundled=(12, 8),
                                                     probe=P.ptxas_version), uses_triton=True)
    # 3.6+ reads the Blackwell one from sm_100 on (Thor still needs a redirect from 3.6's 12.9)
    assert P.patch_ptxas(detect_device(props=THOR), ctx(dict(env), triton="3.6.0", bundled=(12, 9),
                                                        probe=P.ptxas_version), uses_triton=True) == "ptxas(user)"


def test_preflight_names_triton_ptxas_path_for_a_triton_without_get_ptxas(monkeypatch):
    """A Triton without get_ptxas (<= 3.5) reads only TRITON_PTXAS_PATH; the report named the
    Blackwell variable, which such a Triton never reads."""
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.compiler", types.ModuleType("compiler"))
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/a/ptxas")
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", "/b/ptxas")
    assert preflight.triton_ptxas_in_use(detect_device(props=GB10)) == "/a/ptxas (from TRITON_PTXAS_PATH)"


# ------------------------------------------------------------------ s4.4: code for the GPU in the torch build

def test_arch_support_says_whether_the_torch_build_runs_on_the_gpu():
    """The report listed the arch list and left the reader to work out whether sm_120 code runs on a
    12.1 GPU (it does: the warning torch 2.9-2.10 prints is a false positive) or a cu126-era build
    without sm_12x code can run at all (it cannot)."""
    ok = preflight.arch_support((12, 1), ["sm_80", "sm_90", "sm_120"])
    assert ok.startswith("ok: sm_120 code runs on this cc 12.1") and "false positive" in ok
    assert preflight.arch_support((12, 1), ["sm_120", "sm_121"]) == "ok: sm_121 code for this cc 12.1"
    assert preflight.arch_support((12, 1), ["sm_80", "sm_90", "compute_90"]).startswith("PTX only (compute_90)")
    none = preflight.arch_support((12, 1), ["sm_80", "sm_90"])
    assert none.startswith("no code for this cc 12.1") and "cu130" in none
    assert preflight.arch_support((12, 1), ["sm_120a"]).startswith("no code")   # arch-specific: 12.0 only
    assert preflight.arch_support((12, 0), ["sm_121"]).startswith("no code")    # newer minor: no
    assert preflight.arch_support((9, 0), ["sm_90a"]) == "ok: sm_90a code for this cc 9.0"


# ------------------------------------------------------------------ s4.7: the TE recipe as built

class Format(enum.Enum):
    E4M3 = 0
    HYBRID = 1
    E2M1 = 2


def fake_te(**nvfp4_defaults):
    """TE's recipe module with the real fields (pydantic-free dataclasses; defaults as the NVTE_*
    environment would set them)."""
    def dc(name, fields):
        return dataclasses.make_dataclass(name, [(k, object, dataclasses.field(default=v)) for k, v in fields.items()])
    fields = {"disable_rht": False, "disable_stochastic_rounding": False, "disable_2d_quantization": False,
              "row_scaled_activation": False, "nvfp4_4over6": "none", "fp4_format": Format.E2M1,
              "backward_override": None, **nvfp4_defaults}
    fp8 = dc("Float8CurrentScaling", {"fp8_format": Format.HYBRID, "backward_override": None})
    return types.SimpleNamespace(Format=Format, Float8CurrentScaling=fp8, DelayedScaling=fp8,
                                 NVFP4BlockScaling=dc("NVFP4BlockScaling", fields))


def test_te_recipe_reports_the_env_driven_nvfp4_forward_options():
    """NVTE_NVFP4_ROW_SCALED_ACTIVATION / NVTE_NVFP4_4OVER6 change the forward's quantisation of a
    newer TE's NVFP4BlockScaling through field defaults; the banner left them out."""
    _, desc = build_te_recipe("nvfp4", detect_device(props=GB10),
                              fake_te(row_scaled_activation=True, nvfp4_4over6="weights"))
    assert desc["row_scaled_activation"] == "True" and desc["nvfp4_4over6"] == "weights"
    assert desc["disable_rht"] == desc["disable_stochastic_rounding"] == "True"


@pytest.fixture
def simulated_te(monkeypatch):
    """preflight_report on a simulated GPU with a (fake) Transformer Engine installed."""
    def use(props, te):
        device = detect_device(props=props)
        monkeypatch.setattr(preflight, "configure_env_before_cuda", lambda: None)
        monkeypatch.setattr(preflight, "detect_device", lambda: device)
        monkeypatch.setattr(preflight, "apply_patches", lambda s, **kw: apply_patches(s, ctx=ctx(bundled=(13, 1)), **kw))
        monkeypatch.setattr(preflight, "memory_budget_bytes", lambda s: 100 * GB)
        monkeypatch.setattr(preflight, "probe_attention_backends", lambda: {"sdpa-cudnn": "ok"})
        monkeypatch.setattr(preflight, "triton_ptxas_in_use", lambda s: "simulated")
        monkeypatch.setattr(preflight, "_te_version", lambda: "2.15 (simulated)")
        monkeypatch.setattr(PR, "_te_importable", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_120"])
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
        pkg, common = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
        pkg.common, common.recipe = common, te
        for name, module in (("transformer_engine", pkg), ("transformer_engine.common", common),
                             ("transformer_engine.common.recipe", te)):
            monkeypatch.setitem(sys.modules, name, module)
        return device
    return use


def test_preflight_shows_the_nvfp4_recipe_a_gb10_run_builds(simulated_te, capsys):
    """`python -m nanochat.platform --precision nvfp4` on a GB10 with TE showed the recipe as
    {'recipe': 'NVFP4BlockScaling'}: not whether RHT and stochastic rounding are off (s4.7) or the
    backward bf16. It now shows the recipe training builds, read back; a TE that drops a field is
    the run's stop, exit 2."""
    simulated_te(GB10, fake_te())
    assert preflight.main(["--json", "--precision", "nvfp4"]) == 0
    report = json.loads(capsys.readouterr().out)
    recipe = report["precision"]["recipe"]
    assert recipe["recipe"] == "NVFP4BlockScaling" and recipe["backward_override"] == "high_precision"
    assert recipe["disable_rht"] == recipe["disable_stochastic_rounding"] == "True"
    assert report["arch_support"].startswith("ok: sm_120 code runs on this cc 12.1")
    simulated_te(B200, fake_te())            # Blackwell DC: RHT and stochastic rounding stay on
    assert preflight.main(["--json", "--precision", "nvfp4"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"]["recipe"]["disable_rht"] == "False"

    class Dropping:   # declares the fields, ignores the keywords (a pydantic recipe's failure mode)
        model_fields = dict.fromkeys(["disable_rht", "disable_stochastic_rounding", "backward_override"])
        disable_rht = disable_stochastic_rounding = False
        backward_override = None

        def __init__(self, **kwargs):
            pass
    te = fake_te()
    te.NVFP4BlockScaling = Dropping
    simulated_te(GB10, te)
    assert preflight.main(["--json", "--precision", "nvfp4"]) == 2
    assert "disable_rht = False after construction" in capsys.readouterr().err


# ------------------------------------------------------------------ s4.7: the start-up check's stop

class _ScaledGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, factor):
        ctx.factor = factor
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def _broken_layer(kind):
    """convert_model stand-in: the layer's weight gradient comes back all zero (TE's sm_12x stochastic
    rounding bug) or NaN, or its output is off by 2x."""
    def convert(model, plan, spec, compile=True):
        old = model[0]

        class Broken(nn.Linear):
            def forward(self, x):
                if kind == "output":
                    return 2 * F.linear(x, self.weight)
                return F.linear(x, _ScaledGrad.apply(self.weight, 0.0 if kind == "zero" else float("nan")))
        new = Broken.__new__(Broken)
        new.__dict__.update(old.__dict__)
        model[0] = new
        return plan
    return convert


@pytest.mark.parametrize("kind, match", [("zero", "zero or non-finite gradients"),
                                         ("nan", "zero or non-finite gradients"),
                                         ("output", r"relative error 1\.000 > 0\.25")])
def test_startup_check_stops_a_precision_whose_layer_is_broken(monkeypatch, kind, match):
    """The guard against s4.7's all-zero FP4 gradients had no test that failed without it."""
    cpu = detect_device("cpu")
    plan = PR.resolve("nvfp4", "emulated", cpu)
    assert PR.startup_check(plan, cpu, torch.device("cpu"), torch.float32) < 0.25
    monkeypatch.setattr(PR, "convert_model", _broken_layer(kind))
    with pytest.raises(RuntimeError, match=rf"^--precision nvfp4 \(emulated\): start-up check .*{match}"):
        PR.startup_check(plan, cpu, torch.device("cpu"), torch.float32)


# ------------------------------------------------------------------ s4.10: synchronise before the clock

class _StrictEvent:
    """A CUDA event on a scripted clock that, like CUDA, cannot give an elapsed time before the end
    event has completed (synchronize() after its last record())."""
    now = 0.0

    def __init__(self, enable_timing=True):
        self.t, self.done = None, False

    def record(self):
        _StrictEvent.now += 5.0
        self.t, self.done = _StrictEvent.now, False

    def synchronize(self):
        self.done = True

    def elapsed_time(self, other):
        if not other.done:
            raise RuntimeError("the end event has not completed: the clock was read before a synchronise")
        return other.t - self.t


def test_gemm_benchmark_reads_the_clock_only_after_the_products_finished(monkeypatch):
    """A published Spark GEMM script read the clock without synchronising and reported impossible
    TFLOP/s (s4.10); removing bench_gemm's synchronise failed no test."""
    from scripts import bench_gemm as BG

    monkeypatch.setattr(torch.cuda, "Event", _StrictEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    row = BG.time_gemm("bf16", (4096, 4096, 4096), reps=3, l2_bytes=1, device="cpu", make=lambda: (lambda: None))
    assert row["ms"] > 0 and row["tflops"] > 0
