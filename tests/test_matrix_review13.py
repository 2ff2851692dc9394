"""Review 13: base_train's decision over the whole matrix {--kernel current|liger|triton} x
{--precision auto|bf16|fp8|nvfp4|fp32} x {GB10 sm_121, H100 sm_90, B200 sm_100, RTX 4090 sm_89,
A100 sm_80, CPU} x {liger-kernel installed or not} x {Transformer Engine installed or not}, on
simulated device properties (no GPU).

Each cell runs the real `scripts.base_train.train` up to the first step that touches disk (the
checkpoint directory, before tokenizer, data and model): a cell either gets there, and then the
precision plan its `apply_precision` will resolve is asserted (what every `auto` chose, as the
banner prints it), or it stops earlier with a RequestError (one line, no traceback, from
script_main) that names the flag and the values this device accepts. Every value a refusal
offers must itself run on that device, and every value it leaves out must be refused.

Review 14 adds two dimensions: model widths too narrow for the fp8 / nvfp4 GEMMs (refused with
the other checks, no longer after the data and the model were built) and $NANOCHAT_DTYPE against
--precision (the flag decides the dtype, the variable only `auto`; a disagreement is refused
naming both, not as a `--dtype` base_train does not have).
"""

from __future__ import annotations

import dataclasses
import enum
import re
import sys
import types

import pytest
import torch

import nanochat.precision as PR   # bound before detect_device is patched (test_gb10_review10 says why)
from nanochat import common
from nanochat.errors import RequestError
from nanochat.platform import CPU_SPEC, SimpleProps, detect_device

GB = 10**9
DEVICES = {
    "gb10": SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True),
    "h100": SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 * GB),
    "b200": SimpleProps("NVIDIA B200", 10, 0, 148, 180 * GB),
    "rtx4090": SimpleProps("NVIDIA GeForce RTX 4090", 8, 9, 128, 24 * GB),
    "a100": SimpleProps("NVIDIA A100-SXM4-80GB", 8, 0, 108, 80 * GB),
    "cpu": None,
}
KERNELS = ("current", "liger", "triton")
PRECISIONS = ("auto", "bf16", "fp8", "nvfp4", "fp32")


class Reached(Exception):
    """The run got past every check, to the checkpoint directory (the first thing it writes)."""


# ------------------------------------------------------------------ the expected decisions

# --precision (backend auto): "precision/backend" the plan resolves to, or "!" + the start of the
# refusal. (with TE, without TE) where they differ.
NEEDS_FP8_GPU = "!--precision fp8: needs an NVIDIA GPU with compute capability >= 8.9"
NEEDS_BLACKWELL = "!--precision nvfp4: needs a Blackwell GPU"
NEEDS_TE = "!--precision nvfp4: needs Transformer Engine >= 2.8"
PRECISION_TABLE = {
    #           auto         bf16         fp8            nvfp4                      fp32
    "gb10":    ("bf16/none", "bf16/none", "fp8/native", ("nvfp4/te", NEEDS_TE), "fp32/none"),
    "b200":    ("bf16/none", "bf16/none", "fp8/native", ("nvfp4/te", NEEDS_TE), "fp32/none"),
    "h100":    ("bf16/none", "bf16/none", "fp8/native", NEEDS_BLACKWELL, "fp32/none"),
    "rtx4090": ("bf16/none", "bf16/none", "fp8/native", NEEDS_BLACKWELL, "fp32/none"),   # Ada: fp8 tensor cores
    "a100":    ("bf16/none", "bf16/none", NEEDS_FP8_GPU, NEEDS_BLACKWELL, "fp32/none"),
    "cpu":     ("fp32/none", "bf16/none", NEEDS_FP8_GPU, NEEDS_BLACKWELL, "fp32/none"),
}
# the --precision values a refusal offers on each device (with TE, without TE)
ACCEPTED = {
    "gb10": ("auto|bf16|fp32|fp8|nvfp4", "auto|bf16|fp32|fp8"),
    "b200": ("auto|bf16|fp32|fp8|nvfp4", "auto|bf16|fp32|fp8"),
    "h100": ("auto|bf16|fp32|fp8",) * 2,
    "rtx4090": ("auto|bf16|fp32|fp8",) * 2,
    "a100": ("auto|bf16|fp32",) * 2,
    "cpu": ("auto|bf16|fp32",) * 2,
}
# --kernel: None = runs; else the start of the refusal. (liger installed, not installed)
NEEDS_CUDA = "--kernel liger needs a CUDA GPU"
NEEDS_LIGER = "--kernel liger needs liger-kernel"


def expected_kernel(kernel: str, device: str, liger: bool) -> str | None:
    if kernel != "liger":
        return None   # current everywhere; triton on CUDA (triton is installed) and CPU (its torch path)
    if device == "cpu":
        return NEEDS_CUDA
    return None if liger else NEEDS_LIGER


def expected(kernel: str, precision: str, device: str, liger: bool, te: bool) -> str:
    """The cell's outcome: the precision refusal first (base_train checks --precision before --kernel)."""
    want = PRECISION_TABLE[device][PRECISIONS.index(precision)]
    if isinstance(want, tuple):
        want = want[0 if te else 1]
    if want.startswith("!"):
        return want
    refusal = expected_kernel(kernel, device, liger)
    return "!" + refusal if refusal else want


# ------------------------------------------------------------------ simulated installs and devices

class Format(enum.Enum):
    E4M3 = 0
    HYBRID = 1
    E2M1 = 2


def fake_te_recipe_module() -> types.ModuleType:
    """transformer_engine.common.recipe with the fields of a current TE (2.15+)."""
    def dc(name, fields):
        return dataclasses.make_dataclass(name, [(k, object, dataclasses.field(default=v)) for k, v in fields.items()])
    mod = types.ModuleType("transformer_engine.common.recipe")
    mod.Format = Format
    mod.Float8CurrentScaling = dc("Float8CurrentScaling", {"fp8_format": Format.HYBRID})
    mod.DelayedScaling = dc("DelayedScaling", {"fp8_format": Format.HYBRID})
    mod.NVFP4BlockScaling = dc("NVFP4BlockScaling", {"disable_rht": False, "disable_stochastic_rounding": False,
                                                    "backward_override": None, "fp4_format": Format.E2M1})
    return mod


def install(monkeypatch, *, liger: bool, te: bool) -> None:
    """liger-kernel and Transformer Engine installed (stand-ins) or not importable."""
    for root in ("liger_kernel", "transformer_engine"):
        for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
            monkeypatch.delitem(sys.modules, name)
    if liger:
        from tests.test_precision_review2 import fake_liger
        fake_liger(monkeypatch)
    else:
        monkeypatch.setitem(sys.modules, "liger_kernel", None)
    if te:
        pkg, common_mod = types.ModuleType("transformer_engine"), types.ModuleType("transformer_engine.common")
        recipe = fake_te_recipe_module()
        pkg.common, common_mod.recipe = common_mod, recipe
        for mod in (pkg, common_mod, recipe):
            monkeypatch.setitem(sys.modules, mod.__name__, mod)
    else:
        monkeypatch.setitem(sys.modules, "transformer_engine", None)
    monkeypatch.setattr(PR, "_te_importable", lambda: te)


@pytest.fixture
def cell(monkeypatch, tmp_path):
    """cell(kernel, precision, device, liger, te, *extra_flags) -> ("runs", plan) or ("refused", message),
    from scripts.base_train.train on the simulated device."""
    import nanochat.attention
    import nanochat.checkpoint
    import nanochat.platform
    from scripts import base_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # no ptxas probe of the real box
    monkeypatch.setattr(nanochat.attention, "check_training_backend", lambda *a, **k: "sdpa")   # not this review's

    def reached(*args, **kwargs):
        raise Reached
    monkeypatch.setattr(nanochat.checkpoint, "checkpoint_dir", reached)

    def run(kernel, precision, device, liger, te, *extra):
        install(monkeypatch, liger=liger, te=te)
        spec = CPU_SPEC if DEVICES[device] is None else detect_device(props=DEVICES[device])
        monkeypatch.setattr(nanochat.platform, "detect_device", lambda *a, **k: spec)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: spec.cc is not None and spec.cc >= (8, 0))
        device_type = "cpu" if spec.cc is None else "cuda"
        try:
            cfg = base_train.parse_config(["--kernel", kernel, "--precision", precision, "--device", device_type,
                                           *extra])
            dtype = common._resolve_dtype(base_train.runtime_dtype(cfg.precision), device_type)   # as init_runtime
            rt = common.Runtime(device=torch.device(device_type), device_type=device_type, dtype=dtype, rank=0,
                                local_rank=0, world_size=1, ddp=False, is_master=True)
            base_train.train(cfg, rt)
        except Reached:
            # what setup_precision_and_kernel's apply_precision resolves (the banner's "precision" row)
            return "runs", PR.resolve(cfg.precision, cfg.precision_backend, spec, compute_dtype=rt.dtype_name)
        except RequestError as e:   # script_main prints it as one line
            return "refused", str(e)
        raise AssertionError("train() returned before its checkpoint directory")
    return run


# ------------------------------------------------------------------ the matrix

def accepted_precisions(message: str) -> list[str]:
    m = re.search(r"accepted on this device: --precision ([a-z0-9|]+)", message)
    assert m, f"no accepted --precision values in: {message}"
    return m.group(1).split("|")


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("kernel", KERNELS)
def test_matrix_cell_runs_or_refuses_as_the_table_says(cell, kernel, device):
    wrong = []
    for precision in PRECISIONS:
        for liger in (True, False):
            for te in (True, False):
                want = expected(kernel, precision, device, liger, te)
                how, got = cell(kernel, precision, device, liger, te)
                where = f"{kernel}/{precision}/{device}/liger={liger}/te={te}"
                if want.startswith("!"):
                    if how != "refused" or not got.startswith(want[1:]):
                        wrong.append(f"{where}: want refusal {want[1:]!r}, got {how} {got}")
                    elif got.startswith("--precision"):
                        if "|".join(accepted_precisions(got)) != ACCEPTED[device][0 if te else 1]:
                            wrong.append(f"{where}: accepted values {accepted_precisions(got)}")
                    elif "--kernel" not in got or not re.search(r"use --kernel (triton|current)", got):
                        wrong.append(f"{where}: refusal names no accepted --kernel: {got}")
                    continue
                if how != "runs":
                    wrong.append(f"{where}: want {want}, refused: {got}")
                    continue
                if f"{got.precision}/{got.backend}" != want:
                    wrong.append(f"{where}: want {want}, got {got.precision}/{got.backend}")
                if precision == "auto" and not got.chosen.startswith(f"--precision auto -> {got.precision}: "):
                    wrong.append(f"{where}: the banner does not say what auto chose: {got.chosen!r}")
                if precision in ("fp8", "nvfp4") and not got.chosen.startswith(
                        f"--precision-backend auto -> {got.backend}: "):
                    wrong.append(f"{where}: the banner does not say what backend auto chose: {got.chosen!r}")
    assert not wrong, "\n".join(wrong)


# ------------------------------------------------------------------ what a refusal offers must run

OFFER = re.compile(r"accepted on this device: --precision ([a-z0-9|]+), or --precision nvfp4 --precision-backend emulated")


@pytest.mark.parametrize("device", list(DEVICES))
def test_every_precision_a_refusal_offers_runs_and_every_other_is_refused(cell, device):
    """A refusal's "accepted on this device" list, for every request this device refuses (each
    --precision x --precision-backend), must be exactly the --precision values that run there (and
    its nvfp4-emulated offer must run). A B200 / GB10 with Transformer Engine refused `--precision
    bf16 --precision-backend te` offering auto|bf16|fp32|fp8: nvfp4, which runs there, was left out."""
    wrong = []
    for te in (True, False):
        runs = {p for p in PRECISIONS if cell("current", p, device, False, te)[0] == "runs"}
        how, _ = cell("current", "nvfp4", device, False, te, "--precision-backend", "emulated")
        assert how == "runs", (device, te)
        for precision in PRECISIONS:
            for backend in PR.BACKENDS:
                how, got = cell("current", precision, device, False, te, "--precision-backend", backend)
                if how == "runs" or (m := OFFER.search(got)) is None:
                    continue
                offered = set(m.group(1).split("|"))
                if offered != runs:
                    wrong.append(f"{device} te={te} --precision {precision} --precision-backend {backend}: "
                                 f"offers {sorted(offered)}, runs {sorted(runs)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "cpu"])
def test_every_kernel_a_refusal_offers_runs(cell, device):
    """--kernel liger without liger-kernel offers triton|current; on a CPU (liger needs CUDA) the
    same two: each runs there with the same precision."""
    for dev in (device, "cpu"):
        how, got = cell("liger", "auto", dev, False, False)
        assert how == "refused" and got.startswith("--kernel liger"), got
        offered = re.search(r"use --kernel (\w+)(?:\|| .*?or --kernel )(\w+)", got)
        assert offered and {offered.group(1), offered.group(2)} == {"triton", "current"}, got
        for kernel in offered.groups():
            assert cell(kernel, "auto", dev, False, False)[0] == "runs", (dev, kernel)


# ------------------------------------------------------------------ GB10 whose Triton cannot target sm_121

@pytest.fixture
def old_triton(monkeypatch):
    """A visible CUDA GPU whose Triton (3.5.1) bundles a CUDA 12.8 ptxas (no sm_121); `candidates`:
    the system ptxas binaries found (DESIGN s4.1)."""
    from nanochat import platform as P
    for name in P.PTXAS_ENV + (P.PATCHED_ENV,):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(P, "triton_version", lambda: "3.5.1")
    monkeypatch.setattr(P, "bundled_ptxas_version", lambda cc: (12, 8))

    def use(candidates=()):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(P, "find_system_ptxas", lambda: list(candidates))
        monkeypatch.setattr(P, "ptxas_version", lambda path: dict(candidates).get(path))
    return use


def test_native_fp8_without_a_ptxas_for_the_gpu_is_refused_before_the_checkpoint_dir(cell, old_triton):
    """Native fp8 casts with a Triton kernel (fp8_cast_transpose) whatever --kernel / --compile say. On
    a GB10 with Triton 3.5 and no CUDA 13 ptxas, `--kernel current --no-compile --precision fp8` (the
    escape check_kernel's refusal names) passed every early check and died in ptxas at the
    precision start-up check, after the checkpoint directory, the data and the model."""
    old_triton()
    how, got = cell("current", "fp8", "gb10", False, False, "--no-compile")
    assert how == "refused", got
    assert got.startswith("--precision fp8 (backend native): its fp8 casts are Triton kernels"), got
    assert "cannot target sm_121" in got and "accepted on this device: --precision auto|bf16|fp32" in got
    # what it offers runs: bf16 with --kernel current --no-compile, and TE's fp8 when installed
    assert cell("current", "bf16", "gb10", False, False, "--no-compile")[0] == "runs"
    assert cell("current", "fp8", "gb10", False, True, "--no-compile", "--precision-backend", "te")[0] == "runs"
    # and a compiled run is refused at the same point (before, check_kernel refused it)
    assert cell("triton", "fp8", "gb10", False, False)[1].startswith("--precision fp8 (backend native)")
    # a CUDA 13 ptxas on the box: fp8 runs (the patch points Triton at it)
    old_triton([("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    assert cell("current", "fp8", "gb10", False, False, "--no-compile")[0] == "runs"
    assert cell("triton", "fp8", "gb10", False, False)[0] == "runs"


def test_native_fp8_ptxas_check_needs_a_visible_gpu(old_triton, monkeypatch):
    """The check proves nothing about a simulated spec on a box without CUDA (other tests resolve
    GB10 plans there) and an H100 (sm_90) is served by any Triton's ptxas."""
    gb10 = detect_device(props=DEVICES["gb10"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert PR.resolve("fp8", "auto", gb10, te_available=False).backend == "native"
    old_triton()
    assert PR.resolve("fp8", "auto", detect_device(props=DEVICES["h100"]), te_available=False).backend == "native"
    with pytest.raises(RequestError, match="^--precision fp8 .*Triton 3.5.1's bundled ptxas"):
        PR.resolve("fp8", "auto", gb10, te_available=False)


@pytest.mark.parametrize("device,sm12x", [("gb10", True), ("b200", False)])
def test_nvfp4_recipe_differs_between_sm_100_and_sm_121(device, sm12x):
    """The nvfp4 cells that run build TE's recipe per device: on sm_12x without the random Hadamard
    transform (crashes) and stochastic rounding (wrote zeros), on sm_100 with TE's defaults; both
    with the bf16 backward (DESIGN s4.7). What the banner's precision row shows as `recipe`."""
    from nanochat.precision_te import build_te_recipe
    _, desc = build_te_recipe("nvfp4", detect_device(props=DEVICES[device]), fake_te_recipe_module())
    assert desc["recipe"] == "NVFP4BlockScaling" and desc["backward_override"] == "high_precision"
    assert desc["disable_rht"] == desc["disable_stochastic_rounding"] == str(sm12x)


# ------------------------------------------------------------------ the CPU column, really run

@pytest.mark.parametrize("kernel", ["current", "triton"])
@pytest.mark.parametrize("precision,backend,dtype,want", [
    ("auto", "auto", torch.float32, "fp32/none"),
    ("bf16", "auto", torch.bfloat16, "bf16/none"),
    ("fp32", "auto", torch.float32, "fp32/none"),
    ("nvfp4", "emulated", torch.bfloat16, "nvfp4/emulated"),   # what the CPU's nvfp4 refusal offers
])
def test_cpu_cells_that_run_train_a_step(kernel, precision, backend, dtype, want):
    """What the table says runs on a CPU runs: setup_precision_and_kernel on a depth-1 model, one
    forward + backward with finite gradients, and the banner's precision / kernel rows."""
    info = cpu_step(kernel, precision, backend, dtype)
    assert f"{info['precision']}/{info['backend']}" == want and info["kernel"] == kernel
    assert info["peak_key"] == ("bf16" if backend == "emulated" else info["precision"])
    assert (info["kernel_fusions"] == "none") == (kernel == "current"), info["kernel_fusions"]
    assert (precision == "auto") == info.get("chosen", "").startswith("--precision auto -> fp32: ")


def cpu_step(kernel: str, precision: str, backend: str = "auto", dtype: torch.dtype = torch.float32) -> dict:
    """setup_precision_and_kernel on a depth-1 CPU model and one forward + backward (finite
    gradients asserted); returns what the banner prints."""
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth
    from nanochat.training import setup_precision_and_kernel
    rt = common.Runtime(device=torch.device("cpu"), device_type="cpu", dtype=dtype, rank=0, local_rank=0,
                        world_size=1, ddp=False, is_master=True)
    model = build_model(config_for_depth(1, 64, 32, aspect_ratio=32, head_dim=16, window_pattern="L"), "cpu",
                        compute_dtype=dtype)
    info = setup_precision_and_kernel(model, precision, kernel, rt, compile=False, precision_backend=backend)
    x = torch.randint(0, 64, (2, 32))
    model(x, x).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    return info


def test_triton_kernel_on_a_cpu_torch_without_triton_runs(cell, monkeypatch):
    """--kernel triton on a CPU runs its torch path, so check_kernel lets it through where no triton
    package exists (macOS, torch's CPU wheel index); but build_qkv_projection imported fp8_qk, which
    imports Triton, and the run stopped with ModuleNotFoundError after the data and the model."""
    import nanochat
    for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)
    for mod in ("fp8_qk", "triton_qk", "triton_mlp", "triton_kernels"):   # imported by earlier tests
        monkeypatch.delitem(sys.modules, f"nanochat.{mod}", raising=False)
        monkeypatch.delattr(nanochat, mod, raising=False)
    assert cell("triton", "auto", "cpu", False, False)[0] == "runs"
    info = cpu_step("triton", "auto")
    assert info["kernel_fusions"] == "linear_ce,mix_norm,mix_add,x0_grad_acc,rotary_norm"   # as with Triton


# ------------------------------------------------------------------ review 14: widths the GEMMs cannot take

ALIGN = {"fp8": 16, "nvfp4": 32}
NARROW = {   # base_train flags -> the model width (n_embd) they give
    8: ("--depth", "1", "--aspect-ratio", "8", "--head-dim", "8"),
    24: ("--depth", "3", "--aspect-ratio", "8", "--head-dim", "24"),
    48: ("--depth", "1", "--aspect-ratio", "48", "--head-dim", "48"),   # fp8's GEMMs take it, nvfp4's do not
}
LOW = [("fp8", "auto"), ("fp8", "te"), ("nvfp4", "auto"), ("nvfp4", "emulated")]


def with_flag(flags: tuple, name: str, value: str) -> tuple:
    i = flags.index(name)
    return flags[:i + 1] + (value,) + flags[i + 2:]


@pytest.mark.parametrize("device", list(DEVICES))
def test_a_model_too_narrow_for_the_gemms_is_refused_before_the_data_and_the_model(cell, device):
    """--precision fp8|nvfp4 with widths the GEMMs cannot take (not multiples of 16 / 32: tiny
    --depth / --aspect-ratio / --head-dim) was refused by apply_precision, after the tokenizer, the
    data loaders and the model: now with the device checks, before the checkpoint directory. The
    device's own refusal comes first (fp8 on an A100 says so, whatever the width); a width refusal
    names --precision and the width, offers exactly the --precision values that run at this width
    here, and flag values of a wider model (--aspect-ratio, --head-dim) that each run."""
    wrong = []
    for te in (True, False):
        for width, flags in NARROW.items():
            runs_here = {p for p in PRECISIONS if cell("current", p, device, False, te, *flags)[0] == "runs"}
            for precision, backend in LOW:
                extra = ("--precision-backend", backend)
                wide_how, wide_got = cell("current", precision, device, False, te, *extra)
                how, got = cell("current", precision, device, False, te, *extra, *flags)
                where = f"{device} te={te} width {width} --precision {precision} --precision-backend {backend}"
                if wide_how == "refused":   # the device (or install) first, as at the default width
                    if (how, got) != (wide_how, wide_got):
                        wrong.append(f"{where}: want the default width's refusal {wide_got!r}, got {how} {got}")
                    continue
                if width % ALIGN[precision] == 0:
                    if how != "runs":
                        wrong.append(f"{where}: aligned, refused: {got}")
                    continue
                if how != "refused" or not got.startswith(
                        f"--precision {precision}: the model's width {width} (n_embd) is not a multiple of "
                        f"{ALIGN[precision]}, which its GEMMs need"):
                    wrong.append(f"{where}: want the width refusal, got {how} {got}")
                    continue
                offered = re.search(r"accepted on this device: --precision ([a-z0-9|]+) at this width", got)
                if not offered or set(offered.group(1).split("|")) != runs_here:
                    wrong.append(f"{where}: offers {offered and offered.group(1)}, runs {sorted(runs_here)}: {got}")
                fixes = re.search(r"--aspect-ratio (\d+) \(width (\d+)\) or --head-dim (\d+)$", got)
                if not fixes or int(fixes.group(2)) % ALIGN[precision] or int(fixes.group(2)) < width:
                    wrong.append(f"{where}: no wider flags offered: {got}")
                    continue
                for fix in (with_flag(flags, "--aspect-ratio", fixes.group(1)),
                            with_flag(flags, "--head-dim", fixes.group(3))):
                    if (fixed := cell("current", precision, device, False, te, *extra, *fix))[0] != "runs":
                        wrong.append(f"{where}: the offered {fix} does not run: {fixed}")
    assert not wrong, "\n".join(wrong)


def test_the_width_refusal_is_one_check_for_the_flags_and_for_a_built_model():
    """check_request (base_train, from the flags' meta-device model) and apply_precision (any caller,
    on the model it converts) refuse a narrow model with the same words: one function, check_widths."""
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth
    from nanochat.precision_request import check_request
    rt = common.Runtime(device=torch.device("cpu"), device_type="cpu", dtype=torch.bfloat16, rank=0, local_rank=0,
                        world_size=1, ddp=False, is_master=True)
    config = config_for_depth(2, 96, 32, aspect_ratio=4, head_dim=8)
    with pytest.raises(RequestError) as early:
        check_request("nvfp4", "emulated", rt, config, compile=False)
    model = build_model(config, "cpu", compute_dtype=torch.bfloat16)
    with pytest.raises(RequestError) as late:
        PR.apply_precision(model, "nvfp4", rt, "emulated", compile=False)
    assert str(early.value).startswith(str(late.value))   # + base_train's flags (profile_training has none)
    assert str(late.value).startswith("--precision nvfp4: the model's width 8 (n_embd) is not a multiple of 32"), late.value
    assert "--aspect-ratio" not in str(late.value)
    assert "--aspect-ratio 13 (width 32) or --head-dim 32" in str(early.value)   # depth 2: 2 x 13 -> 32


def test_a_precision_that_fails_its_start_up_launch_stops_before_the_data_and_the_model(cell, monkeypatch):
    """precision.startup_check (one tiny layer: finite, non-zero gradients; TE's sm_12x stochastic
    rounding wrote zeros) ran inside apply_precision, after the data and the model: now with the
    other checks, where the device is real (here the CPU's emulated nvfp4, made to give zeros)."""
    from nanochat.nvfp4_emulated import EmulatedNVFP4Linear
    assert cell("current", "nvfp4", "cpu", False, False, "--precision-backend", "emulated")[0] == "runs"
    zeros = lambda self, x: torch.nn.functional.linear(x, self.weight.to(x.dtype)) * 0   # noqa: E731
    monkeypatch.setattr(EmulatedNVFP4Linear, "forward", zeros)
    with pytest.raises(RuntimeError, match="start-up check got zero or non-finite gradients"):
        cell("current", "nvfp4", "cpu", False, False, "--precision-backend", "emulated")


# ------------------------------------------------------------------ review 14: $NANOCHAT_DTYPE x --precision

ENV_DTYPE = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "fp32", "float32": "fp32"}


@pytest.mark.parametrize("device", ["h100", "cpu"])
@pytest.mark.parametrize("env", ["bf16", "fp32", "float32", "auto", "fp16"])
def test_nanochat_dtype_decides_auto_and_a_flag_it_disagrees_with_is_refused_naming_both(cell, monkeypatch, device,
                                                                                         env):
    """NANOCHAT_DTYPE=fp32 with --precision bf16|fp8|nvfp4 stopped in init_runtime with "--dtype bf16
    conflicts with NANOCHAT_DTYPE=fp32", naming a flag base_train does not have. Now: the variable
    decides `--precision auto` (the banner's precision row names it), a --precision whose dtype
    agrees runs as without it, one that disagrees is refused at parse time naming the flag and the
    variable, and each way out it names runs (or meets the device's own refusal, as unset)."""
    monkeypatch.setenv("NANOCHAT_DTYPE", env)
    wrong = []
    for precision in PRECISIONS:
        how, got = cell("current", precision, device, False, False)
        where = f"{device} NANOCHAT_DTYPE={env} --precision {precision}"
        if env == "fp16":
            if not (how == "refused" and got.startswith("NANOCHAT_DTYPE: got 'fp16'; accepted: auto|bf16|fp32")):
                wrong.append(f"{where}: {how} {got}")
            continue
        monkeypatch.delenv("NANOCHAT_DTYPE")
        unset = cell("current", precision, device, False, False)
        monkeypatch.setenv("NANOCHAT_DTYPE", env)
        flag_dtype = {"auto": None, "fp8": "bf16", "nvfp4": "bf16"}.get(precision, precision)
        if precision == "auto":
            want = ENV_DTYPE.get(env) or unset[1].precision
            if how != "runs" or got.precision != want:
                wrong.append(f"{where}: want {want}, got {how} {got}")
            elif (f"from $NANOCHAT_DTYPE={env})" in got.chosen) != (env != "auto"):
                wrong.append(f"{where}: the banner does not say what decided auto: {got.chosen}")
        elif env == "auto" or ENV_DTYPE[env] == flag_dtype:   # agrees: as without it
            if (how, str(got)) != (unset[0], str(unset[1])):
                wrong.append(f"{where}: want {unset}, got {how} {got}")
        else:
            other = ENV_DTYPE[env]
            named = (f"but NANOCHAT_DTYPE={env} asks for {other}: drop one of them: unset NANOCHAT_DTYPE (or set "
                     f"it to {flag_dtype}), or pass --precision {other}|auto")
            if how != "refused" or not got.startswith(f"--precision {precision} computes in {flag_dtype}") \
                    or named not in got:
                wrong.append(f"{where}: want the conflict named, got {how} {got}")
                continue
            for p in (other, "auto"):   # the flags it offers run with the variable kept
                if cell("current", p, device, False, False)[0] != "runs":
                    wrong.append(f"{where}: the offered --precision {p} does not run")
            monkeypatch.setenv("NANOCHAT_DTYPE", flag_dtype)   # "or set it to <the flag's dtype>": as unset
            if (again := cell("current", precision, device, False, False))[0] != unset[0]:
                wrong.append(f"{where}: NANOCHAT_DTYPE={flag_dtype}: want {unset}, got {again}")
            monkeypatch.setenv("NANOCHAT_DTYPE", env)
    assert not wrong, "\n".join(wrong)


def test_bf16_refusal_names_the_env_var_when_it_asked(monkeypatch):
    """NANOCHAT_DTYPE=bf16 on a GPU without native bf16: the refusal named a `--dtype bf16` nobody passed."""
    from nanochat import common
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    monkeypatch.setenv("NANOCHAT_DTYPE", "bf16")
    with pytest.raises(common.RequestError, match=r"^NANOCHAT_DTYPE=bf16: Tesla V100 .* or unset NANOCHAT_DTYPE"):
        common._resolve_dtype("auto", "cuda")
    with pytest.raises(common.RequestError, match=r"^--dtype bf16: Tesla V100") as e:
        common._resolve_dtype("bf16", "cuda")
    assert "unset" not in str(e.value)


def test_base_trains_bf16_refusal_names_its_precision_flag(monkeypatch):
    """base_train --precision fp8 on a GPU without native bf16 was refused as '--dtype bf16', a flag
    base_train does not have."""
    from nanochat import common
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    monkeypatch.delenv("NANOCHAT_DTYPE", raising=False)
    with pytest.raises(common.RequestError, match=r"^--precision fp8: Tesla V100 has no native bf16 support; "
                                                  r"use --precision fp32$"):
        common._resolve_dtype("bf16", "cuda", "--precision fp8")
