"""DESIGN.md s4 (pitfalls on GB10 / sm_12x) and s3's MFU rules, checked on a CPU with simulated
devices where the existing tests were weak: each test here fails if the handling it names is removed.

- s4.5: every fp8 GEMM the project issues (Fp8Linear in each --fp8-wgrad mode, the fused fp8 MLP)
  passes tensor-wise scales to a `torch._scaled_mm` that, like sm_12x, refuses row-wise ones.
- s4.6: the cuDNN window kernel (and cuDNN + FA4) are proven by a launch checked against the math,
  not by an import: a backend that imports and then fails (or computes wrongly) at its first launch
  is never picked by `auto`. The existing tests replaced `probe()` whole, so they passed with a
  `probe()` that only imported.
- s4.8: Liger's fused loss runs as an eager island under torch.compile by default (a compiled Liger
  returned a wrong loss with ignore_index targets, Liger PR #1338); only CUDA tests checked it.
- s3: MFU against the bf16 dense peak for every precision, utilisation against the active
  precision's, --peak-flops, and an unknown GPU warns and prints n/a, never 0% (GB10, H100, H200,
  B200, RTX 5090, an unknown cc 12.1 GPU), through the meter's log line.
"""

import sys
import types

import pytest
import torch
import torch.nn as nn

from nanochat import attention as A
from nanochat import cudnn_attention, fa4_attention, kernels
from nanochat import platform as P
from nanochat import precision as PR
from nanochat.device_table import DENSE_RATIO
from nanochat.platform import SimpleProps, detect_device
from nanochat.step_meter import StepMeter, describe_peaks, resolve_peak_flops
from nanochat.training import StepResult
from tests.test_kernels import _fake_liger

from tests.test_gb10_review10 import B200, GB, GB10, H100, H200, RTX5090

UNKNOWN = SimpleProps("NVIDIA Future Spark", 12, 1, 40, 96 * GB, is_integrated=True)   # cc of a GB10, not in the table
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


# ------------------------------------------------------------------ s4.5: tensor-wise fp8 scaling only

def _sm12x_scaled_mm(calls: list):
    """torch._scaled_mm as sm_12x serves it: tensor-wise (scalar float32) scales only, a row-major,
    b column-major; the product in float64. Records each call's shapes."""
    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype=None, use_fast_accum=False, **kwargs):
        if scale_a.numel() != 1 or scale_b.numel() != 1:
            raise RuntimeError(f"simulated sm_121: row-wise scaling (scales {tuple(scale_a.shape)} x "
                               f"{tuple(scale_b.shape)}) is not supported; tensor-wise only")
        assert a.dtype in FP8 and b.dtype in FP8 and scale_a.dtype == scale_b.dtype == torch.float32
        assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
        calls.append((tuple(a.shape), tuple(b.shape)))
        return ((a.double() * scale_a.double()) @ (b.double() * scale_b.double())).to(out_dtype)
    return scaled_mm


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("mode", list(PR.FP8_WGRAD_MODES))
def test_fp8_linear_gemms_are_tensor_wise_in_every_wgrad_mode(monkeypatch, mode):
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _sm12x_scaled_mm(calls))
    torch.manual_seed(0)
    layer = PR._rebuild(PR.Fp8Linear, nn.Linear(64, 32, bias=False))
    assert PR.set_fp8_wgrad_mode(layer, mode) == 1
    x = torch.randn(48, 64, requires_grad=True)
    g = torch.randn(48, 32)
    layer(x).backward(g)
    # forward, input gradient and weight gradient: all three GEMMs in fp8, none around the stand-in
    assert sorted(calls) == sorted([((48, 64), (64, 32)), ((48, 32), (32, 64)), ((32, 48), (48, 64))])
    x_ref, w_ref = x.detach().clone().requires_grad_(), layer.weight.detach().clone().requires_grad_()
    nn.functional.linear(x_ref, w_ref).backward(g)
    assert _rel(x.grad, x_ref.grad) < 0.15 and _rel(layer.weight.grad, w_ref.grad) < 0.15


@pytest.mark.parametrize("gh_cast", ["epilogue", "pass"])
def test_fused_fp8_mlp_gemms_are_tensor_wise(monkeypatch, gh_cast):
    from nanochat.triton_mlp import fp8_relu2_mlp
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", _sm12x_scaled_mm(calls))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g).bfloat16().requires_grad_()
    w_fc = (torch.randn(256, 64, generator=g) / 8).requires_grad_()
    w_proj = (torch.randn(64, 256, generator=g) / 16).requires_grad_()
    y = fp8_relu2_mlp(x, w_fc, w_proj, gh_cast=gh_cast)
    y.float().square().sum().backward()
    assert len(calls) >= 3 and all(t is not None and torch.isfinite(t).all() for t in (x.grad, w_fc.grad, w_proj.grad))
    # and the fp8 result is the MLP's: float32 reference, fp8-sized tolerance
    refs = [t.detach().float().requires_grad_() for t in (x, w_fc, w_proj)]
    y_ref = nn.functional.linear(nn.functional.relu(nn.functional.linear(refs[0], refs[1])).square(), refs[2])
    y_ref.square().sum().backward()
    assert _rel(y.float(), y_ref) < 0.15
    for got, ref in zip((x.grad, w_fc.grad, w_proj.grad), refs):
        assert _rel(got, ref.grad) < 0.15


# ------------------------------------------------------------------ s4.6: proven by a launch, not an import

@pytest.fixture
def fresh_probes(monkeypatch):
    monkeypatch.setattr(cudnn_attention, "_PROBED", {})
    monkeypatch.setattr(fa4_attention, "_PROBED", {})


def test_cudnn_that_imports_but_fails_at_launch_is_not_picked(monkeypatch, fresh_probes):
    """The frontend imports (available() is None), the first launch fails: probe() names the launch's
    failure, auto stays on flex, the verdict is cached (one launch per device), and an explicit
    --attn-backend cudnn is refused with that reason."""
    launches = []
    monkeypatch.setattr(cudnn_attention, "available", lambda: None)
    monkeypatch.setattr(cudnn_attention, "_probe_launch",
                        lambda dev: launches.append(dev) or "cuDNN window attention failed to run: no kernel image")
    dev = torch.device("cuda", 3)
    assert cudnn_attention.probe(dev) == "cuDNN window attention failed to run: no kernel image"
    assert cudnn_attention.probe(dev) is not None and launches == [dev]
    assert not cudnn_attention.proven(dev) and A.resolve_backend("auto", dev) == "sdpa_flex"
    with pytest.raises(ValueError, match="^--attn-backend cudnn: cuDNN window attention failed to run"):
        A.prepare_masks(64, [None], dev, "cudnn")
    # the launch passing is what makes auto pick it (cuda:4: a device of its own)
    monkeypatch.setattr(cudnn_attention, "_probe_launch", lambda dev: None)
    assert cudnn_attention.probe(torch.device("cuda", 4)) is None
    assert A.resolve_backend("auto", "cuda:4") == "sdpa_cudnn"


def test_fa4_that_imports_but_fails_at_launch_is_not_picked(monkeypatch, fresh_probes):
    """flash-attn-4 imports; its backward (or the cuDNN forward it runs on) fails at launch: no cudnn_fa4."""
    monkeypatch.setattr(fa4_attention, "available", lambda: None)
    monkeypatch.setattr(cudnn_attention, "available", lambda: None)
    monkeypatch.setattr(cudnn_attention, "_probe_launch", lambda dev: "cuDNN window attention failed to run: x")
    assert fa4_attention.probe(torch.device("cuda", 5)).startswith("its forward is cuDNN's, which failed")
    monkeypatch.setattr(cudnn_attention, "_probe_launch", lambda dev: None)
    monkeypatch.setattr(fa4_attention, "_probe_launch", lambda dev: "cuDNN forward + FA4 backward failed to run: sm_121")
    assert fa4_attention.probe(torch.device("cuda", 6)) == "cuDNN forward + FA4 backward failed to run: sm_121"
    assert not fa4_attention.proven("cuda:6") and A.resolve_backend("auto", "cuda:6") == "sdpa_cudnn"


def _launch_with(monkeypatch, kernel):
    """cudnn_attention._probe_launch on the CPU with `kernel` standing in for cuDNN's window kernel."""
    monkeypatch.setattr(cudnn_attention, "window_attention", kernel)
    monkeypatch.setattr(cudnn_attention, "_cudnn",
                        lambda: types.SimpleNamespace(cudnnGraphNotSupportedError=type("NotSupported", (Exception,), {})))
    return cudnn_attention._probe_launch(torch.device("cpu"))


def test_probe_launch_runs_the_kernel_and_checks_it_against_the_math(monkeypatch):
    """The probe's launch, with the kernel replaced: one that raises at launch, one that runs but
    ignores the window, and a right one (the plain math)."""
    def dies(q, k, v, window, **kw):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    def no_window(q, k, v, window, **kw):
        return A.reference_attention(q, k, v, window=None)

    def right(q, k, v, window, **kw):
        return A.reference_attention(q, k, v, window=window)

    assert str(_launch_with(monkeypatch, dies)).startswith("cuDNN window attention failed to run: RuntimeError")
    assert str(_launch_with(monkeypatch, no_window)).startswith("cuDNN window attention disagrees with the reference")
    assert _launch_with(monkeypatch, right) is None


# ------------------------------------------------------------------ s4.8: Liger as an eager island

_MISCOMPILED_LIGER = (
    "import torch\n"
    "SEEN = []\n"
    "class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):\n"
    "    def __init__(self, ignore_index=-100, reduction='mean', softcap=None, accum_dtype=None):\n"
    "        super().__init__()\n"
    "        self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap\n"
    "    def forward(self, lin_weight, _input, target, bias=None):\n"
    "        traced = torch.compiler.is_compiling()\n"
    "        SEEN.append(traced)\n"
    "        z = _input @ lin_weight.t()\n"
    "        z = self.softcap * torch.tanh(z / self.softcap) if self.softcap else z\n"
    "        rows = torch.nn.functional.cross_entropy(z.float(), target, ignore_index=self.ignore_index,\n"
    "                                                 reduction='none')\n"
    "        kept = (target != self.ignore_index).sum().item()   # Liger's .item() in forward\n"
    "        # traced, the mean's count goes wrong when targets hold ignore_index (as Liger PR #1338)\n"
    "        return rows.sum() / (target.numel() if traced else max(kept, 1))\n")


@pytest.mark.parametrize("inline", [False, True])
def test_liger_runs_eagerly_inside_a_compiled_step(tmp_path, monkeypatch, inline):
    """--kernel liger's default loss is an eager island: under torch.compile Liger's forward is not
    traced, so its traced-only wrong loss never happens; liger_inline=True (traced) shows the
    stand-in's failure mode is real."""
    _fake_liger(tmp_path, monkeypatch)
    (tmp_path / "liger_kernel" / "transformers" / "fused_linear_cross_entropy.py").write_text(_MISCOMPILED_LIGER)
    try:
        _check_liger_island(inline)
    finally:   # the stand-in leaves sys.modules with tmp_path (a later test must not import it)
        for name in [m for m in sys.modules if m.split(".")[0] == "liger_kernel"]:
            del sys.modules[name]
        torch._dynamo.reset()


def _check_liger_island(inline):
    from liger_kernel.transformers import fused_linear_cross_entropy as stand_in
    torch._dynamo.reset()
    fn = kernels.make_liger_loss(inline=inline)
    step = torch.compile(lambda h, w, t: fn(h, w, t, 3.0, 11, "mean"), backend="eager")
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(12, 8, generator=g), torch.randn(16, 8, generator=g)   # 11 real rows of 16
    targets = torch.randint(0, 11, (12,), generator=g)
    targets[::3] = kernels.IGNORE_INDEX
    loss = step(hidden, weight, targets)
    want = kernels.current_loss(hidden, weight, targets, 3.0, 11)
    assert stand_in.SEEN == [inline]
    if inline:
        assert not torch.allclose(loss, want)
    else:
        torch.testing.assert_close(loss, want)


# ------------------------------------------------------------------ s3: MFU rules per device

DEVICES = {   # props, dense peaks in TFLOP/s (device_table.py; DESIGN.md s3); {} = not in the table
    "gb10": (GB10, {"bf16": 125.0, "fp8": 250.0, "nvfp4": 500.0}),
    "h100": (H100, {"bf16": 989.4, "fp8": 1978.9}),
    "h200": (H200, {"bf16": 989.4, "fp8": 1978.9}),
    "b200": (B200, {"bf16": 2250.0, "fp8": 4500.0, "nvfp4": 9000.0}),
    "rtx5090": (RTX5090, {"bf16": 209.5, "fp8": 419.0, "nvfp4": 1676.0}),
    "unknown": (UNKNOWN, {}),
}
FLOPS_PER_TOKEN, TOKENS = 1e9, 25_000   # one step of 1 s: 2.5e13 FLOP/s


def _step(rt, precision, override, warned):
    bf16, act, name = resolve_peak_flops(rt, precision, override, warn=warned.append)
    meter = StepMeter(FLOPS_PER_TOKEN, 1, peak_bf16=bf16, peak_active=act, precision=precision, warmup_steps=0)
    m = meter.update(StepResult(0, 1.0, 1.0, 1.0, TOKENS))
    return bf16, act, name, m, meter.log_line(m, 10)


@pytest.mark.parametrize("device", list(DEVICES))
def test_mfu_against_bf16_util_against_the_precision_and_peak_flops(monkeypatch, device):
    props, table = DEVICES[device]
    spec = detect_device(props=props)
    monkeypatch.setattr(P, "detect_device", lambda *a, **k: spec)
    rt = types.SimpleNamespace(device=torch.device("cuda", 0), device_type="cuda", world_size=1)
    flops = FLOPS_PER_TOKEN * TOKENS
    precisions = [p for p in ("bf16", "fp8", "nvfp4") if p in PR.accepted_values(spec, te_ok=True)]
    assert precisions == ["bf16", "fp8"] + (["nvfp4"] if spec.cc >= (10, 0) else [])
    for precision in precisions:
        warned = []
        bf16, act, name, m, line = _step(rt, precision, None, warned)
        assert name == props.name
        if not table:   # never a silent 0%: n/a in the line and a warning asking for --peak-flops
            assert (bf16, act, m["mfu"], m["util"]) == (None, None, None, None)
            assert len(warned) == 1 and repr(props.name) in warned[0] and "--peak-flops" in warned[0]
            assert "mfu   n/a" in line and f"util({precision})   n/a" in line and "0.00%" not in line
            assert describe_peaks(rt, precision, bf16, act, None) == "n/a (MFU not computed; --peak-flops)"
        else:           # MFU: the same bf16 peak whatever the precision; util: the precision's own
            assert not warned
            assert m["mfu"] == pytest.approx(100 * flops / (table["bf16"] * 1e12))
            assert m["util"] == pytest.approx(100 * flops / (table[precision] * 1e12))
            assert f"mfu {m['mfu']:5.2f}% | util({precision}) {m['util']:5.2f}%" in line
        # --peak-flops (the dense bf16 peak of one device) replaces the table's, on a known GPU too;
        # util follows by this GPU's own ratio (DENSE_RATIO for one the table lacks)
        override = 400e12
        bf16, act, _, m, line = _step(rt, precision, override, [])
        ratio = table[precision] / table["bf16"] if table else DENSE_RATIO[precision]
        assert bf16 == override and act == pytest.approx(override * ratio)
        assert m["mfu"] == pytest.approx(100 * flops / override)
        assert m["util"] == pytest.approx(100 * flops / (override * ratio)) and "n/a" not in line
