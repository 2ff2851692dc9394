"""The whole matrix of how a training run computes: simulated device x --precision x
--precision-backend x installed packages (Transformer Engine, torchao) -> the path chosen or the
error, checked against an oracle written from the rules (DESIGN s4-5, README "Stages and their main
flags") rather than from the code: an explicit request the device cannot serve raises a ValueError
that starts with the flag and names only alternatives this device can run; `auto` says what it chose
and why; TE recipes report their effective fields; MFU peaks per device and precision; the loss
kernels x device type x liger installed."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import re
import sys
import types

import pytest
import torch
import torch.nn as nn

from nanochat import precision as PR
from nanochat.device_table import DENSE_RATIO, peaks
from nanochat.platform import SimpleProps, detect_device
from nanochat.precision_te import build_te_recipe


def _gpu(name, major, minor, sms, gb):
    return detect_device(props=SimpleProps(name, major, minor, sms, gb * 10**9))


DEVICES = {
    "cpu": detect_device("cpu"),
    "v100": _gpu("Tesla V100-SXM2-16GB", 7, 0, 80, 16),            # no bf16, no fp8
    "a100": _gpu("NVIDIA A100-SXM4-80GB", 8, 0, 108, 80),          # bf16, no fp8
    "h100": _gpu("NVIDIA H100 80GB HBM3", 9, 0, 132, 80),
    "h200": _gpu("NVIDIA H200", 9, 0, 132, 141),
    "b200": _gpu("NVIDIA B200", 10, 0, 148, 180),
    "rtx5090": _gpu("NVIDIA GeForce RTX 5090", 12, 0, 170, 32),
    "gb10": _gpu("NVIDIA GB10", 12, 1, 48, 128),
    "unknown-10.3": _gpu("NVIDIA B300 SXM6 AC", 10, 3, 148, 288),
    "unknown-8.9": _gpu("NVIDIA Some Ada Card", 8, 9, 60, 24),
}


# ------------------------------------------------------------------------------------ the oracle

def can_bf16(spec) -> bool:      # CPU/MPS compute bf16 (slowly); a CUDA GPU needs Ampere
    return spec.cc is None or spec.cc >= (8, 0)


def can_fp8(spec) -> bool:
    return spec.cc is not None and spec.cc >= (8, 9)


def can_fp4(spec) -> bool:
    return spec.cc is not None and spec.cc >= (10, 0)


def compute_dtype(spec, precision: str) -> str:
    """What base_train starts the run in (runtime_dtype + common._resolve_dtype, no $NANOCHAT_DTYPE)."""
    if precision == "fp32" or (precision == "auto" and not (spec.cc is not None and can_bf16(spec))):
        return "fp32"
    return "bf16"


def expected(spec, precision, backend, te, ao) -> tuple[str, str]:
    """("ok", "precision/backend") or ("error", the flag the message must start with)."""
    if precision in ("auto", "bf16", "fp32"):
        if backend != "auto":
            return "error", f"--precision-backend {backend}"
        return "ok", f"{compute_dtype(spec, precision)}/none"
    if precision == "fp8":
        if not can_fp8(spec):
            return "error", "--precision fp8"      # the device first, whatever the backend
        if backend == "emulated":
            return "error", "--precision-backend emulated"
        chosen = "native" if backend == "auto" else backend
        installed = {"native": True, "te": te, "torchao": ao}[chosen]
        return ("ok", f"fp8/{chosen}") if installed else ("error", f"--precision-backend {chosen}")
    if backend == "emulated":
        return "ok", "nvfp4/emulated"
    if not can_fp4(spec):
        return "error", "--precision nvfp4"
    if backend in ("native", "torchao"):
        return "error", f"--precision-backend {backend}"
    return ("ok", "nvfp4/te") if te else ("error", "--precision nvfp4")


MATRIX = list(itertools.product(DEVICES, PR.PRECISIONS, PR.BACKENDS, (True, False), (True, False)))


def _offered(text: str, what: str) -> bool:
    """Whether an error's advice (the text after its leading 'flag: ') offers `what`."""
    return re.search(rf"(?<![\w-]){re.escape(what)}(?![\w-])", text) is not None


@pytest.mark.parametrize("name", list(DEVICES))
def test_precision_matrix_matches_the_rules(name):
    spec = DEVICES[name]
    for dev, precision, backend, te, ao in (row for row in MATRIX if row[0] == name):
        want_kind, want = expected(spec, precision, backend, te, ao)
        dtype = compute_dtype(spec, precision)
        case = (dev, precision, backend, f"te={te}", f"torchao={ao}")
        try:
            plan = PR.resolve(precision, backend, spec, compute_dtype=dtype, te_available=te,
                              torchao_available=ao)
        except ValueError as exc:
            msg = str(exc)
            assert want_kind == "error", (case, msg)
            assert msg.startswith(want + ":"), (case, want, msg)
            said = re.search(r"accepted|[Uu]se |leave it", msg)   # says what to do instead
            assert said, (case, msg)
            advice = msg[said.start():]
            # never an alternative this device cannot run (it only leads to the next refusal)
            if not can_fp8(spec):
                assert not _offered(advice, "fp8"), (case, msg)
            if not can_bf16(spec):
                assert not _offered(advice, "bf16"), (case, msg)
            if not te and _offered(advice, "te"):
                assert "Transformer Engine" in advice, (case, msg)   # offered only with what it needs
            if not ao and _offered(advice, "torchao"):
                assert "torchao is not installed" in advice or "when" in advice, (case, msg)
            continue
        assert want_kind == "ok", (case, plan)
        assert f"{plan.precision}/{plan.backend}" == want, case


def test_nvfp4_refusal_names_what_this_device_runs():
    """An A100 asked for nvfp4 was told 'use --precision fp8 or bf16' (fp8 needs cc 8.9: the next
    run stopped again); a CPU too; a V100 was told bf16 for fp8 (it has no bf16 either)."""
    for name in ("a100", "cpu"):
        with pytest.raises(ValueError) as exc:
            PR.resolve("nvfp4", "auto", DEVICES[name], compute_dtype="bf16", te_available=True)
        assert "fp8" not in str(exc.value).split(":", 1)[1] and "emulated" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        PR.resolve("fp8", "auto", DEVICES["v100"], compute_dtype="bf16")
    assert "fp32" in str(exc.value) and "bf16" not in str(exc.value)
    with pytest.raises(ValueError, match=r"^--precision nvfp4: .*accepted on this device: --precision auto\|bf16\|fp32\|fp8"):
        PR.resolve("nvfp4", "auto", DEVICES["h100"], compute_dtype="bf16", te_available=True)


def test_fp8_emulated_on_a_cpu_names_the_device_first():
    """`--precision fp8 --precision-backend emulated` on a CPU said 'fp8 runs natively (native|te|
    torchao)': none of which runs on a CPU."""
    with pytest.raises(ValueError, match=r"^--precision fp8: needs an NVIDIA GPU"):
        PR.resolve("fp8", "emulated", DEVICES["cpu"], compute_dtype="fp32")


def test_nvfp4_other_backend_without_te_does_not_offer_te_as_ready():
    with pytest.raises(ValueError) as exc:
        PR.resolve("nvfp4", "native", DEVICES["b200"], te_available=False)
    msg = str(exc.value)
    assert msg.startswith("--precision-backend native:") and "emulated" in msg
    assert "Transformer Engine" in msg and "auto|te|emulated" not in msg


# ------------------------------------------------------------------------------------ auto: what and why

@pytest.mark.parametrize("name", ["cpu", "h100", "gb10"])
def test_auto_says_what_it_chose_and_why(name):
    spec = DEVICES[name]
    dtype = compute_dtype(spec, "auto")
    desc = PR.resolve("auto", "auto", spec, compute_dtype=dtype).describe()
    assert desc["precision"] == dtype
    assert re.search(rf"--precision auto -> {dtype}: .*compute dtype", desc["chosen"]), desc
    assert "fp8" in desc["chosen"]   # why not fp8 on a GPU that has it: only when asked for
    if can_fp8(spec):
        fp8 = PR.resolve("fp8", "auto", spec, te_available=True).describe()
        assert fp8["chosen"].startswith("--precision-backend auto -> native: "), fp8
    if can_fp4(spec):
        fp4 = PR.resolve("nvfp4", "auto", spec, te_available=True).describe()
        assert fp4["chosen"].startswith("--precision-backend auto -> te: "), fp4
    # explicit requests choose nothing: no reason to give
    assert "chosen" not in PR.resolve(dtype, "auto", spec, compute_dtype=dtype).describe()


def test_apply_precision_result_carries_the_choice_to_the_banner():
    """base_train prints apply_precision's dict in its banner (and keeps it in the checkpoint)."""
    rt = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32, dtype_name="fp32")
    info = PR.apply_precision(nn.Sequential(nn.Linear(64, 64, bias=False)), "auto", rt)
    assert info["precision"] == "fp32" and info["chosen"].startswith("--precision auto -> fp32")


# ------------------------------------------------------------------------------------ TE recipes

class Format(enum.Enum):
    E2M1 = 0
    E4M3 = 1
    HYBRID = 2


def real_field_te(env: dict[str, str] | None = None):
    """A fake TE recipe module with the installed TE's field names, whose defaults come from the
    environment as TE's do (NVTE_BACKWARD_OVERRIDE, NVTE_NVFP4_DISABLE_RHT, ...)."""
    env = env or {}

    def dc(name, fields):
        return dataclasses.make_dataclass(name, [(k, object, dataclasses.field(default=v)) for k, v in fields.items()])
    bwd = env.get("NVTE_BACKWARD_OVERRIDE")
    fp8 = dc("Float8CurrentScaling", {"fp8_format": Format.HYBRID, "fp8_dpa": False, "backward_override": bwd})
    nvfp4 = dc("NVFP4BlockScaling", {
        "disable_rht": env.get("NVTE_NVFP4_DISABLE_RHT", "0") == "1",
        "disable_stochastic_rounding": env.get("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "0") == "1",
        "disable_2d_quantization": env.get("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "0") == "1",
        "fp4_format": Format.E2M1, "backward_override": bwd})
    return types.SimpleNamespace(Format=Format, Float8CurrentScaling=fp8, DelayedScaling=fp8, NVFP4BlockScaling=nvfp4)


@pytest.mark.parametrize("name", ["gb10", "rtx5090", "b200", "unknown-10.3", "h100"])
def test_te_recipe_per_device_asserted_and_reported(name):
    """sm_12x gets RHT and stochastic rounding off (DESIGN s4.7), every nvfp4 recipe a bf16
    backward; the description the banner prints is the recipe as built, env-driven defaults too."""
    spec = DEVICES[name]
    recipe, desc = build_te_recipe("fp8", spec, real_field_te())
    assert recipe.fp8_format is Format.HYBRID and desc["recipe"] == "Float8CurrentScaling"
    if not can_fp4(spec):
        return
    recipe, desc = build_te_recipe("nvfp4", spec, real_field_te())
    sm12x = spec.cc[0] == 12
    assert recipe.disable_rht is sm12x and recipe.disable_stochastic_rounding is sm12x
    assert recipe.backward_override == "high_precision"
    assert desc["disable_rht"] == str(sm12x) and desc["disable_stochastic_rounding"] == str(sm12x)


def test_te_recipe_description_shows_env_driven_fields():
    """TE takes NVTE_BACKWARD_OVERRIDE / NVTE_NVFP4_DISABLE_RHT as field defaults: an fp8 run with
    NVTE_BACKWARD_OVERRIDE=dequantized in the shell ran its backward in bf16 while the banner said
    only 'Float8CurrentScaling, HYBRID'; a B200 nvfp4 run with RHT turned off by the env likewise."""
    te = real_field_te({"NVTE_BACKWARD_OVERRIDE": "dequantized", "NVTE_NVFP4_DISABLE_RHT": "1"})
    _, desc = build_te_recipe("fp8", DEVICES["h100"], te)
    assert desc["backward_override"] == "dequantized"
    _, desc = build_te_recipe("nvfp4", DEVICES["b200"], te)
    assert desc["disable_rht"] == "True" and desc["backward_override"] == "high_precision"
    _, desc = build_te_recipe("fp8", DEVICES["h100"], real_field_te())
    assert desc["backward_override"] == "None"


# ------------------------------------------------------------------------------------ MFU peaks

# dense peak of the active precision / bf16 peak, by device (None: that device has no such path)
RATIOS = {"h100": {"fp8": 2.0}, "h200": {"fp8": 2.0}, "b200": {"fp8": 2.0, "nvfp4": 4.0},
          "rtx5090": {"fp8": 2.0, "nvfp4": 8.0}, "gb10": {"fp8": 2.0, "nvfp4": 4.0}}


@pytest.mark.parametrize("name", list(DEVICES))
def test_mfu_peak_for_every_plan_the_device_accepts(name):
    spec = DEVICES[name]
    for precision, backend in itertools.product(("auto", "fp8", "nvfp4"), ("auto", "emulated")):
        try:
            plan = PR.resolve(precision, backend, spec, compute_dtype=compute_dtype(spec, precision),
                              te_available=True)
        except ValueError:
            continue
        bf16, act = peaks(spec, plan.peak_key)
        if not spec.known:      # CPU / a GPU the table lacks: None (MFU n/a), never 0
            assert bf16 is None and act is None, (name, plan)
            bf16o, acto = peaks(spec, plan.peak_key, override=100e12)
            assert bf16o == 100e12 and acto == pytest.approx(100e12 * DENSE_RATIO[plan.peak_key])
            continue
        ratio = 1.0 if plan.peak_key == "bf16" else RATIOS[name].get(plan.peak_key, 0.5)
        assert bf16 > 0 and act == pytest.approx(bf16 * ratio, rel=1e-3), (name, plan.peak_key)
        if plan.backend == "emulated":   # bf16 matmuls: the bf16 peak, never the fp4 one
            assert act == bf16


def test_unknown_gpu_warns_instead_of_printing_zero(monkeypatch):
    from nanochat import platform
    from nanochat.step_meter import resolve_peak_flops
    monkeypatch.setattr(platform, "detect_device", lambda device=None, props=None: DEVICES["unknown-10.3"])
    rt = types.SimpleNamespace(device=torch.device("cuda"), device_type="cuda")
    warned = []
    bf16, act, _ = resolve_peak_flops(rt, "nvfp4", None, warn=warned.append)
    assert (bf16, act) == (None, None) and "--peak-flops" in warned[0]
    bf16, act, _ = resolve_peak_flops(rt, "nvfp4", 1e15, warn=warned.append)
    assert (bf16, act) == (1e15, 4e15)


# ------------------------------------------------------------------------------------ loss kernels

def fake_liger(monkeypatch) -> None:
    """A stand-in liger-kernel whose fused linear cross-entropy takes the arguments we pass."""
    class Loss:
        def __init__(self, ignore_index=-100, softcap=None, reduction="mean", accum_dtype=None):
            pass
    mod = types.ModuleType("liger_kernel.transformers.fused_linear_cross_entropy")
    mod.LigerFusedLinearCrossEntropyLoss = Loss
    for name in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)


@pytest.mark.parametrize("kernel,device,liger,want", [
    ("current", "cpu", False, None), ("current", "cuda", False, None),
    ("triton", "cpu", False, None), ("triton", "cuda", False, None),
    ("liger", "cpu", True, "--kernel liger needs a CUDA GPU"),
    ("liger", "cuda", False, "--kernel liger needs liger-kernel"),
    ("liger", "cuda", True, None),
    ("magic", "cpu", False, "--kernel: got 'magic'; accepted: current|liger|triton"),
])
def test_kernel_matrix(monkeypatch, kernel, device, liger, want):
    """check_kernel (run with the other checks before a model exists) on a CUDA device type (no GPU
    needed for the check) with liger-kernel present (a stand-in module) or missing."""
    from nanochat.kernels import check_kernel
    if liger:
        fake_liger(monkeypatch)
    else:   # import fails as if not installed, also where another test imported the real one (CI)
        for name in [n for n in sys.modules if n.startswith("liger_kernel.")] + ["liger_kernel"]:
            monkeypatch.setitem(sys.modules, name, None)
    if want is None:
        check_kernel(kernel, device)
    else:
        with pytest.raises(ValueError, match=re.escape(want)):
            check_kernel(kernel, device)
