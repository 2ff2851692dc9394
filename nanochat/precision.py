"""Training precision: `--precision auto|bf16|fp32|fp8|nvfp4` x `--precision-backend auto|te|native|torchao|emulated`.

One mechanism: the model computes in the runtime dtype (bf16 on GPUs) and `apply_precision`
swaps its nn.Linear layers for precision-specific subclasses that keep the same `weight`
Parameter (optimizer groups, init and checkpoint keys are unchanged). Backends:

- native   fp8: `Fp8Linear`, tensor-wise dynamic scaling through torch._scaled_mm; e4m3
           activations/weights, e5m2 (default) or e4m3 gradients. Works on Ada, Hopper and
           sm_12x (row-wise scaling is not supported on sm_12x, so it is not used).
- te       fp8: Transformer Engine with Float8CurrentScaling (DelayedScaling only without
           torch.compile, where it errors); nvfp4: NVFP4BlockScaling, on sm_12x with the random
           Hadamard transform and stochastic rounding disabled (crash / all-zero FP4 data, see
           DESIGN s4.7), and a bf16 backward through the installed TE's own field
           (`backward_override="high_precision"`, TE >= 2.15). The recipe is built only from the
           dataclass's real fields and read back after construction (TE drops unknown keys);
           that half lives in precision_te.py.
- torchao  fp8: torchao.float8 tensor-wise training conversion.
- emulated nvfp4: `EmulatedNVFP4Linear` (nvfp4_emulated.py) fake-quantises activations and
           weights to e2m1 with e4m3 block scales; bf16 backward. Any device: numerics, not speed.

Layers that stay in the compute dtype (documented rule, `keep_high_precision`): the lm_head
(precision-sensitive, and the loss kernels take its weight directly), and any Linear whose
in/out features are not multiples of 16 (fp8) / 32 (nvfp4) - the GEMM/block-scale alignment.
Evaluation and sampling (grad disabled) run the plain bf16 matmul in every swapped layer, so
no recompilation for a different recipe happens mid-run. Requests the device cannot serve raise
ValueError naming --precision / --precision-backend and what this device can run instead
(`accepted_here`); what an `auto` resolved to, and why, is the plan's `chosen` (banner, checkpoint).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat import weight_cache
from nanochat.common import DTYPE_ENV
from nanochat.errors import RequestError
from nanochat.nvfp4_emulated import (E2M1_GRID, E2M1_MAX, E4M3_MAX, EmulatedNVFP4Linear,  # noqa: F401 (re-exported)
                                     fake_quant_nvfp4, quantize_nvfp4, round_to_e2m1, round_to_e4m3)
from nanochat.platform import DeviceSpec, detect_device
from nanochat.precision_te import (build_te_recipe, te_factory, te_fp8_problem, te_import_error, te_missing,
                                   te_nvfp4_problem)
from nanochat.precision_te import te_available as _te_importable


log = logging.getLogger("nanochat.precision")

PRECISIONS = ("auto", "bf16", "fp32", "fp8", "nvfp4")
BACKENDS = ("auto", "te", "native", "torchao", "emulated")
ALIGN = {"fp8": 16, "nvfp4": 32}
E5M2_MAX = 57344.0


# --------------------------------------------------------------------------------------------
# Resolution: what the request means on this device (pure; tests pass simulated specs)
# --------------------------------------------------------------------------------------------

@dataclass
class PrecisionPlan:
    precision: str                   # bf16 | fp32 | fp8 | nvfp4
    backend: str                     # none | native | te | torchao | emulated
    recipe: dict[str, Any] = field(default_factory=dict)
    kept_high_precision: list[str] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)
    chosen: str = ""                 # what an `auto` resolved to and why (the banner prints it)

    @property
    def peak_key(self) -> str:
        """Which peak_flops() entry this run's matmuls use (emulation runs bf16 matmuls)."""
        return "bf16" if self.backend == "emulated" else self.precision

    @property
    def backward_low(self) -> bool:
        """Whether the converted layers' backward GEMMs run at peak_key's rate too: TE NVFP4 with a
        backward_override (high_precision / dequantized) runs them in bf16, as emulation does."""
        if self.peak_key == "bf16":
            return False
        return self.recipe.get("backward_override", "None") in ("None", None)

    def describe(self) -> dict[str, Any]:
        desc = {"precision": self.precision, "backend": self.backend, "recipe": self.recipe,
                "converted": len(self.converted), "kept_high_precision": self.kept_high_precision}
        return {**desc, "chosen": self.chosen} if self.chosen else desc


def _torchao_available() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


def accepted_values(spec: DeviceSpec, te_ok: bool = False) -> list[str]:
    """The --precision values this device runs, for the refusals: an alternative it cannot run
    either (fp8 offered to an A100 refused nvfp4, bf16 to a V100 refused fp8) only led to the
    next refusal. CPU/MPS compute bf16 (slowly); a CUDA GPU needs cc 8.0 for it (common.py)."""
    opts = ["auto"] + (["bf16"] if spec.cc is None or spec.cc >= (8, 0) else []) + ["fp32"]
    if spec.cc is not None and spec.cc >= (8, 9):
        opts.append("fp8")
    if spec.cc is not None and spec.cc >= (10, 0) and te_ok:
        opts.append("nvfp4")
    return opts


def accepted_here(spec: DeviceSpec, te_ok: bool = False) -> str:   # emulated nvfp4 computes in bf16: not below cc 8.0
    ok, emulated = accepted_values(spec, te_ok), ", or --precision nvfp4 --precision-backend emulated (numerics only)"
    return f"accepted on this device: --precision {'|'.join(ok)}" + emulated * ("bf16" in ok)


def _auto_dtype(compute_dtype: str) -> str:
    """What `--precision auto` became and why (the banner's precision row): $NANOCHAT_DTYPE, when set,
    decides auto (only auto: precision_request.runtime_dtype refuses a --precision it disagrees with)."""
    env = os.environ.get(DTYPE_ENV, "").strip()
    why = (f"from ${DTYPE_ENV}={env}" if env and env != "auto" else
           f"${DTYPE_ENV} unset: --dtype where a script has it, else bf16 on a GPU that has it, else fp32")
    return (f"{compute_dtype}: the run's compute dtype ({why}); fp8 and nvfp4 run only when asked for "
            "(--precision fp8|nvfp4)")


def resolve(precision: str, backend: str = "auto", spec: DeviceSpec | None = None, *,
            compute_dtype: str = "bf16", te_available: bool | None = None,
            torchao_available: bool | None = None, te_recipe: Any = None) -> PrecisionPlan:
    """Validate `precision` x `backend` against the device; raise ValueError saying what to do.
    `te_available` / `torchao_available` / `te_recipe` (TE's recipe module) simulate installs;
    with `te_available` given and no `te_recipe`, TE's fp8 and nvfp4 recipes are taken to be complete."""
    if precision not in PRECISIONS:
        raise RequestError(f"--precision: got {precision!r}; accepted: {'|'.join(PRECISIONS)}")
    if backend not in BACKENDS:
        raise RequestError(f"--precision-backend: got {backend!r}; accepted: {'|'.join(BACKENDS)}")
    spec = spec or detect_device()
    requested = precision
    if precision == "auto":
        precision = compute_dtype
    elif precision in ("bf16", "fp32") and precision != compute_dtype:
        # the plan would name a dtype the model does not run in (and MFU its peak): refuse it
        raise RequestError(f"--precision {precision}: this run computes in {compute_dtype} (its runtime "
                           f"dtype); accepted here: auto|{compute_dtype}, or start the run in {precision}")
    if precision in ("bf16", "fp32"):
        if backend not in ("auto",):   # named per backend: "emulated applies to fp8|nvfp4" led to a refusal of fp8
            applies = {"emulated": "nvfp4", "native": "fp8", "torchao": "fp8"}.get(backend, "fp8|nvfp4")
            te_ok = _nvfp4_te_runs(spec, te_available, te_recipe)
            raise RequestError(f"--precision-backend {backend}: only applies to --precision {applies}; with "
                               f"--precision {requested} leave it at auto ({accepted_here(spec, te_ok)})")
        return PrecisionPlan(precision, "none",
                             chosen=f"--precision auto -> {_auto_dtype(precision)}" if requested == "auto" else "")
    # Probed only where the request can use them: importing TE (with ~1 GB of cuDNN libraries) for
    # a native fp8 run cost start-up time, and a broken TE install stopped a run that never used it
    # (or, on a GPU too old for the precision, hid the message that says so behind TE's OSError)
    eligible = spec.cc is not None and spec.cc >= ((10, 0) if precision == "nvfp4" else (8, 9))
    needs_te = eligible and (backend == "te" or (backend == "auto" and precision == "nvfp4"))
    te_ok = needs_te and (_te_importable() if te_available is None else te_available)
    # a refusal says why TE is missing: not installed, or installed and failing to import (quoted)
    te_why = (te_import_error() if needs_te and not te_ok and te_available is None else None) or "not installed"
    ao_ok = backend == "torchao" and (_torchao_available() if torchao_available is None else torchao_available)
    if precision == "nvfp4":
        plan = _resolve_nvfp4(spec, backend, te_ok, te_why)
        if plan.backend == "te" and (te_recipe is not None or te_available is None):
            if (problem := te_nvfp4_problem(spec, te_recipe)) is not None:   # before any model is built
                raise RequestError(problem)
    else:
        plan = _resolve_fp8(spec, backend, te_ok, ao_ok, te_why)
        if plan.backend == "te" and (te_recipe is not None or te_available is None):
            if (problem := te_fp8_problem(te_recipe)) is not None:   # before any model is built
                raise RequestError(problem)
        if plan.backend == "native":
            _check_native_fp8_ptxas(spec)
    if backend == "auto":
        plan.chosen = f"--precision-backend auto -> {plan.backend}: " + (
            "tensor-wise scaled torch._scaled_mm (row-wise scaling fails on sm_12x), no extra package, one "
            "compiled graph; te|torchao on request" if plan.precision == "fp8" else
            "Transformer Engine is the only nvfp4 training path (emulated: numerics only, on request)")
    return plan


def _nvfp4_te_runs(spec: DeviceSpec, te_available: bool | None, te_recipe: Any) -> bool:
    """Whether --precision nvfp4 (backend auto) resolves on `spec`: for the accepted list of a refusal
    that had no reason to probe TE. Without it a Blackwell with TE installed was offered
    auto|bf16|fp32|fp8 only. TE is imported here only on a refusal, on a GPU of cc >= 10.0."""
    if spec.cc is None or spec.cc < (10, 0):
        return False
    if not (_te_importable() if te_available is None else te_available):
        return False
    if te_recipe is None and te_available is not None:   # a simulated install: complete (resolve's rule)
        return True
    return te_nvfp4_problem(spec, te_recipe) is None


def _check_native_fp8_ptxas(spec: DeviceSpec) -> None:
    """Native fp8's casts (fp8_cast_transpose, also in the start-up check whatever --fp8-wgrad says)
    are Triton kernels on CUDA, launched whatever --kernel and --compile say: on a GPU Triton's
    ptxas cannot target (GB10 with Triton <= 3.5 and no CUDA 13 ptxas, DESIGN s4.1) a run with
    `--kernel current --no-compile` (what kernels.check_kernel's refusal advises) passed every
    early check and died in ptxas at the start-up check, after the data and the model (without
    Triton installed: at the import). Checked only where a GPU is visible: a simulated spec on a
    CPU box launches nothing."""
    if not spec.is_cuda or not torch.cuda.is_available():
        return
    from nanochat.platform import PtxasMissing, ptxas_problem
    if (problem := ptxas_problem(spec)) is not None:
        raise PtxasMissing(
            f"--precision fp8 (backend native): its fp8 casts are Triton kernels, launched whatever --kernel "
            f"and --compile say: {problem} Until Triton can target this GPU, accepted on this device: --precision "
            "auto|bf16|fp32 (with --kernel current --no-compile), or --precision fp8 --precision-backend te "
            "(Transformer Engine's own kernels, when installed)")


def _resolve_fp8(spec, backend, te_ok, ao_ok, te_why="not installed") -> PrecisionPlan:
    # the device first: "fp8 runs natively (native|te|torchao)" to a CPU named nothing it can run
    if spec.cc is None or spec.cc < (8, 9):
        where = f"{spec.name} (cc {spec.cc[0]}.{spec.cc[1]})" if spec.cc else spec.name
        raise RequestError(f"--precision fp8: needs an NVIDIA GPU with compute capability >= 8.9 "
                         f"(Ada, Hopper, Blackwell); this is {where}; {accepted_here(spec)}")
    if backend == "emulated":   # TE / torchao are not probed for this refusal: their condition is named
        raise RequestError("--precision-backend emulated: only for --precision nvfp4; accepted for fp8: "
                         "auto|native, or te|torchao when Transformer Engine / torchao are installed")
    if backend == "auto":
        backend = "native"   # no extra dependency, compiles into one graph
    if backend == "te" and not te_ok:
        raise RequestError(f"--precision-backend te: Transformer Engine {te_missing(te_why)}; or use "
                           "--precision-backend native")
    if backend == "torchao" and not ao_ok:
        raise RequestError("--precision-backend torchao: torchao is not installed (pip install torchao); "
                         "or use --precision-backend native")
    recipe = {"scaling": "tensorwise", "fwd": "e4m3", "grad": "e5m2"}
    if backend == "te":
        recipe = {"recipe": "Float8CurrentScaling", "fp8_format": "HYBRID"}
    return PrecisionPlan("fp8", backend, recipe)


def _resolve_nvfp4(spec, backend, te_ok, te_why="not installed") -> PrecisionPlan:
    if backend == "emulated":
        return PrecisionPlan("nvfp4", "emulated", {"elem": "e2m1", "block": 16,
                                                   "block_scale": "e4m3", "tensor_scale": "fp32",
                                                   "backward": "bf16 (straight-through)"})
    if spec.cc is None or spec.cc[0] < 10:
        where = f"{spec.name} (cc {spec.cc[0]}.{spec.cc[1]})" if spec.cc else spec.name
        raise RequestError(f"--precision nvfp4: needs a Blackwell GPU (compute capability >= 10.0); "
                         f"this is {where}; {accepted_here(spec)}")
    if backend in ("native", "torchao"):   # TE is not probed here, so its condition is named
        raise RequestError(f"--precision-backend {backend}: nvfp4 training is only wired through "
                         "Transformer Engine here; accepted for nvfp4: auto|te (with Transformer Engine "
                         ">= 2.8 installed) or emulated (numerics only)")
    if not te_ok:
        raise RequestError(f"--precision nvfp4: needs Transformer Engine >= 2.8, which {te_missing(te_why)}; "
                           f"{accepted_here(spec)}")
    return PrecisionPlan("nvfp4", "te", {"recipe": "NVFP4BlockScaling"})


# --------------------------------------------------------------------------------------------
# Native fp8: tensor-wise dynamic scaling through torch._scaled_mm
# --------------------------------------------------------------------------------------------

def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic scaling: (x * s) in `dtype` and 1/s (float32 scalar for _scaled_mm)."""
    fmax = E4M3_MAX if dtype == torch.float8_e4m3fn else E5M2_MAX
    scale = fp8_scale(x, fmax)
    return _fp8_cast(x, scale, fmax, dtype), scale.reciprocal()


def _fp8_cast(x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the format's range, rounded to `dtype` (nearest even)."""
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def fp8_scale(x: torch.Tensor, fmax: float) -> torch.Tensor:
    """fmax / amax(x): the tensor-wise scale that maps x's largest magnitude onto the format's."""
    return fmax / x.detach().abs().amax().float().clamp(min=1e-12)


def _fp8_grad_input(g_q, g_inv, w_q, w_inv, out_dtype):
    """dL/dx = g @ w for y = x @ w.T, in fp8: (M, N) @ (N, K), b = w column-major."""
    return torch._scaled_mm(g_q, w_q.t().contiguous().t(), scale_a=g_inv, scale_b=w_inv, out_dtype=out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """y = x @ w.T with x, w in e4m3; backward grads quantised to `grad_dtype`."""

    @staticmethod
    def forward(ctx, x, weight, grad_dtype):
        x_q, x_inv = to_fp8(x, torch.float8_e4m3fn)
        w_q, w_inv = to_fp8(weight, torch.float8_e4m3fn)
        # _scaled_mm: a row-major, b column-major (w_q.t() of a row-major (out, in) is).
        y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_inv, scale_b=w_inv, out_dtype=x.dtype,
                             use_fast_accum=True)
        ctx.save_for_backward(x_q, x_inv, w_q, w_inv)   # fp8 copies: a quarter of bf16 x's memory
        ctx.grad_dtype, ctx.w_dtype = grad_dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        x_q, x_inv, w_q, w_inv = ctx.saved_tensors
        g_q, g_inv = to_fp8(grad, ctx.grad_dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _fp8_grad_input(g_q, g_inv, w_q, w_inv, grad.dtype)
        if ctx.needs_input_grad[1]:   # (N, M) @ (M, K)
            grad_w = torch._scaled_mm(g_q.t().contiguous(), x_q.t().contiguous().t(), scale_a=g_inv,
                                      scale_b=x_inv, out_dtype=torch.float32).to(ctx.w_dtype)
        return grad_x, grad_w, None


@torch.library.custom_op("nanochat::fp8_cast_transpose", mutates_args=())
def fp8_cast_transpose(x: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * scale) in e4m3 (or e5m2), (M, N), and the same values transposed, (N, M), contiguous:
    the two layouts a tensor-wise fp8 GEMM pair needs (row-major for one, column-major for the
    other). One Triton pass on CUDA; torch ops elsewhere. x 2-D contiguous, scale a float32 scalar."""
    dtype, fmax = (torch.float8_e5m2, E5M2_MAX) if e5m2 else (torch.float8_e4m3fn, E4M3_MAX)
    if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        from nanochat.triton_kernels import fp8_cast_transpose_triton
        return fp8_cast_transpose_triton(x, scale.reshape(1).float(), dtype, fmax)
    q = _fp8_cast(x, scale, fmax, dtype)
    return q, q.t().contiguous()


@fp8_cast_transpose.register_fake
def _fp8_cast_transpose_fake(x, scale, e5m2):
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((x.shape[1], x.shape[0]), dtype=dtype)


class _Fp8MatmulFusedTranspose(torch.autograd.Function):
    """_Fp8Matmul with the transposed fp8 copies made by `fp8_cast_transpose` (one tiled pass
    that writes both layouts) instead of `.t().contiguous()` after the cast. Why: in the H100 d20
    fp8 profile the compiled cast + transposed copy of c_fc's gradient ran at ~1.3 TB/s (1.52 ms
    per layer; its bf16 counterpart, the relu^2 backward alone, 0.65 ms). Same numbers as
    _Fp8Matmul (same scales and rounding).

    The forward writes x's two fp8 layouts in one pass and saves the transposed one for the
    weight gradient. The compile partitioner cannot drop that copy (a custom op's output is not
    recomputed), so it costs memory: d20 dbs 32 on the H100, 56.7 GiB peak vs 46.6, for 179.4k
    tok/s vs 172.7k (2026-11-23). `_Fp8MatmulFusedTransposeLean` is the memory-lean variant."""

    @staticmethod
    def forward(ctx, x, weight, grad_dtype):
        x_scale = fp8_scale(x, E4M3_MAX)
        x_q, x_qt = fp8_cast_transpose(x.contiguous(), x_scale, False)
        y, w_q, w_inv = _fp8_forward(ctx, x_q, x_scale, weight, grad_dtype, x.dtype)
        ctx.save_for_backward(x_qt, x_scale, w_q, w_inv)
        return y

    @staticmethod
    def backward(ctx, grad):
        x_qt, x_scale, w_q, w_inv = ctx.saved_tensors
        return _fp8_fused_backward(ctx, grad, lambda: x_qt, x_scale, w_q, w_inv)


class _Fp8MatmulFusedTransposeLean(torch.autograd.Function):
    """`_Fp8MatmulFusedTranspose` that saves the bf16 input and its scale instead of an fp8 copy:
    the input is saved anyway (norm outputs, the attention output) or recomputable from what is
    (relu^2 of c_fc's output), so the partitioner keeps no extra tensor; the backward makes the
    transposed copy with the same scale (same numbers). d20 dbs 32, H100: 46.4 GiB, 172.3k tok/s."""

    @staticmethod
    def forward(ctx, x, weight, grad_dtype):
        x_scale = fp8_scale(x, E4M3_MAX)
        x_q = _fp8_cast(x, x_scale, E4M3_MAX, torch.float8_e4m3fn)
        y, w_q, w_inv = _fp8_forward(ctx, x_q, x_scale, weight, grad_dtype, x.dtype)
        ctx.save_for_backward(x, x_scale, w_q, w_inv)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, x_scale, w_q, w_inv = ctx.saved_tensors
        x_qt = lambda: fp8_cast_transpose(x.contiguous(), x_scale, False)[1]  # noqa: E731
        return _fp8_fused_backward(ctx, grad, x_qt, x_scale, w_q, w_inv)


def _fp8_forward(ctx, x_q, x_scale, weight, grad_dtype, out_dtype):
    """(y = x @ w.T from x's e4m3 copy, w's e4m3 copy, its inverse scale); dtypes go on ctx."""
    w_q, w_inv = to_fp8(weight, torch.float8_e4m3fn)
    ctx.grad_dtype, ctx.w_dtype = grad_dtype, weight.dtype
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale.reciprocal(), scale_b=w_inv,
                         out_dtype=out_dtype, use_fast_accum=True)
    return y, w_q, w_inv


def _fp8_fused_backward(ctx, grad, x_qt, x_scale, w_q, w_inv, grad_amax=None):
    """Gradients of the fused-transpose matmuls; `x_qt()` gives x's transposed fp8 copy;
    `grad_amax` max |grad| when the producer of grad already found it (fp8_qk.py)."""
    e5m2 = ctx.grad_dtype == torch.float8_e5m2
    fmax = E5M2_MAX if e5m2 else E4M3_MAX
    g_scale = fp8_scale(grad, fmax) if grad_amax is None else fmax / grad_amax.float().clamp(min=1e-12)
    g_q, g_qt = fp8_cast_transpose(grad.contiguous(), g_scale, e5m2)
    g_inv = g_scale.reciprocal()
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = _fp8_grad_input(g_q, g_inv, w_q, w_inv, grad.dtype)
    if ctx.needs_input_grad[1]:   # (N, M) @ (M, K): a = g^T row-major, b = x column-major
        grad_w = torch._scaled_mm(g_qt, x_qt().t(), scale_a=g_inv, scale_b=x_scale.reciprocal(),
                                  out_dtype=torch.float32).to(ctx.w_dtype)
    return grad_x, grad_w, None


FP8_WGRAD_MODES = {"save": _Fp8MatmulFusedTranspose, "recompute": _Fp8MatmulFusedTransposeLean,
                   "plain": _Fp8Matmul}


def set_fp8_wgrad_mode(model: nn.Module, mode: str) -> int:
    """How each Fp8Linear in `model` gets x's transposed fp8 copy for the weight gradient
    (`--fp8-wgrad`): 'save' (default; fused cast + transpose in the forward, the copy saved:
    fastest), 'recompute' (made in the backward from the saved bf16 input: ~10 GiB less at d20
    dbs 32), 'plain' (`_Fp8Matmul`: compiled casts and transposed copies). Measured on one H100,
    d20 dbs 32, kernel triton (2026-11-23): save 179.4k tok/s / 56.7 GiB vs plain 172.7k /
    46.6 GiB; on another machine recompute 172.3k / 46.4 GiB vs plain 172.4k / 46.6 GiB; on a
    third save 181.1k / 56.7 GiB, recompute 176.3k / 46.4 GiB, bf16 157.2k / 46.6 GiB.
    `scripts/bench_train.py --precision fp8,fp8lean,fp8plain` compares them. Returns how many
    layers were set."""
    if mode not in FP8_WGRAD_MODES:
        raise RequestError(f"--fp8-wgrad: got {mode!r}; accepted: {'|'.join(FP8_WGRAD_MODES)}")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.wgrad_mode = mode
    return len(layers)


class Fp8Linear(nn.Linear):
    """nn.Linear (no bias) whose training matmuls run in fp8; grad-disabled calls run bf16."""

    grad_dtype: torch.dtype = torch.float8_e5m2
    wgrad_mode: str = "save"   # per layer: set_fp8_wgrad_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        rows = x.numel() // x.shape[-1]
        if not torch.is_grad_enabled() or rows % 16 != 0 or self.bias is not None:
            return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        matmul = FP8_WGRAD_MODES[self.wgrad_mode]
        y = matmul.apply(x.reshape(rows, x.shape[-1]), w, self.grad_dtype)
        return y.reshape(*x.shape[:-1], w.shape[0])


# --------------------------------------------------------------------------------------------
# Module swapping
# --------------------------------------------------------------------------------------------

def keep_high_precision(name: str, module: nn.Linear, precision: str) -> str | None:
    """Why this Linear stays in the compute dtype (None = convert it)."""
    if name.split(".")[-1] == "lm_head" or "lm_head" in name:
        return "lm_head"
    align = ALIGN[precision]
    if module.in_features % align or module.out_features % align:
        return f"dims {module.in_features}x{module.out_features} not multiples of {align}"
    return None


def swap_linears(model: nn.Module, precision: str, factory) -> tuple[list[str], list[str]]:
    """Replace eligible nn.Linear modules with factory(old) (sharing the weight Parameter)."""
    converted, kept = [], []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            reason = keep_high_precision(full, child, precision)
            if reason:
                kept.append(f"{full} ({reason})")
                continue
            setattr(parent, child_name, factory(child))
            converted.append(full)
    return converted, kept


def _rebuild(cls: type, old: nn.Linear) -> nn.Linear:
    """Same weight Parameter, new class (no re-initialisation, no copy). gpt.Linear's weight_cache
    slot and sink are dropped: these layers cast their own master weight, and with the slot every
    accumulating step also cast a copy of it nobody read (and the fused fp8 MLP quantised that
    bf16-rounded copy instead of the master)."""
    new = cls.__new__(cls)
    new.__dict__.update(old.__dict__)   # parameters, buffers, hooks, in/out features
    new._buffers = {k: v for k, v in old._buffers.items() if k not in (weight_cache.SLOT, weight_cache.SINK)}
    return new


def convert_model(model: nn.Module, plan: PrecisionPlan, spec: DeviceSpec, *, compile: bool = True,
                  grad_dtype: torch.dtype = torch.float8_e5m2) -> PrecisionPlan:
    """Swap the model's linears according to `plan` (in place); fills plan.converted/kept."""
    if plan.backend == "none":
        return plan
    if plan.backend == "native":
        cls = type("Fp8LinearG", (Fp8Linear,), {"grad_dtype": grad_dtype})
        factory = lambda old: _rebuild(cls, old)   # noqa: E731
    elif plan.backend == "emulated":
        factory = lambda old: _rebuild(EmulatedNVFP4Linear, old)   # noqa: E731
    elif plan.backend == "te":
        _te_importable()   # torch's cuDNN loaded first, then TE
        import transformer_engine.common.recipe as te_recipe
        import transformer_engine.pytorch as te
        recipe, desc = build_te_recipe(plan.precision, spec, te_recipe, compile=compile)
        plan.recipe = desc
        factory = te_factory(te, recipe)
    elif plan.backend == "torchao":
        return _convert_torchao(model, plan)
    else:
        raise AssertionError(plan.backend)
    plan.converted, plan.kept_high_precision = swap_linears(model, plan.precision, factory)
    return plan


def _convert_torchao(model: nn.Module, plan: PrecisionPlan) -> PrecisionPlan:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    kept: list[str] = []

    def module_filter(module, fqn):
        reason = keep_high_precision(fqn, module, "fp8") if isinstance(module, nn.Linear) else "not Linear"
        if reason and isinstance(module, nn.Linear):
            kept.append(f"{fqn} ({reason})")
        return reason is None

    convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=module_filter)
    plan.converted = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    plan.kept_high_precision = kept
    return plan


def startup_check(plan: PrecisionPlan, spec: DeviceSpec, device: torch.device, dtype: torch.dtype,
                  compile: bool = True) -> float:
    """Tiny fwd/bwd through one converted layer: gradients must be finite and non-zero (TE's
    sm_12x stochastic-rounding bug produced all-zero gradients) and the output close to the
    unquantised one. Returns the output's relative error."""
    layer = nn.Sequential(nn.Linear(256, 256, bias=False)).to(device=device)
    nn.init.normal_(layer[0].weight, std=0.05)
    ref_w = layer[0].weight.detach().clone()
    convert_model(layer, dataclasses.replace(plan), spec, compile=compile)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(64, 256, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    y = layer(x)
    y.float().square().mean().backward()
    grad = layer[0].weight.grad
    if grad is None or not torch.isfinite(grad).all() or grad.abs().max() == 0:
        raise RuntimeError(f"--precision {plan.precision} ({plan.backend}): start-up check got "
                           "zero or non-finite gradients; try --precision bf16 and report the versions")
    ref = F.linear(x.detach().float(), ref_w.float())
    rel = ((y.detach().float() - ref).norm() / ref.norm()).item()
    limit = 0.25 if plan.precision == "nvfp4" else 0.1
    if not rel < limit:
        raise RuntimeError(f"--precision {plan.precision} ({plan.backend}): start-up check output "
                           f"relative error {rel:.3f} > {limit}")
    return rel


def apply_precision(model: nn.Module, precision: str, rt: Any, backend: str = "auto", *,
                    compile: bool = True, fp8_wgrad: str = "save") -> dict[str, Any]:
    """Entry point for training: resolve, check, convert. Returns the resolved description
    (keys: precision, backend, recipe, converted, kept_high_precision, startup_rel_err, and
    fp8_wgrad for native fp8). `fp8_wgrad` other than 'save' needs native fp8 (raises otherwise)."""
    spec = detect_device(rt.device)
    plan = resolve(precision, backend, spec, compute_dtype=getattr(rt, "dtype_name", "bf16"))
    native_fp8 = plan.precision == "fp8" and plan.backend == "native"
    if fp8_wgrad != "save" and not native_fp8:
        raise RequestError(f"--fp8-wgrad {fp8_wgrad} (base_train; bench_train's fp8lean|fp8plain): applies to "
                           f"native fp8 only (--precision fp8 --precision-backend native); this run resolved to "
                           f"{plan.precision} via {plan.backend}")
    info: dict[str, Any] = {}
    if plan.backend != "none":
        from nanochat.precision_request import check_widths   # (it imports this module)
        check_widths(model, plan.precision, spec)   # base_train's check_request did, on its flags' model
        info["startup_rel_err"] = round(startup_check(plan, spec, rt.device, rt.dtype, compile), 4)
        convert_model(model, plan, spec, compile=compile)
        assert plan.converted, "check_widths passed a model with no Linear to convert"
        if native_fp8:
            set_fp8_wgrad_mode(model, fp8_wgrad)
            info["fp8_wgrad"] = fp8_wgrad
        log.warning("[precision] %s via %s: %d linears converted, kept: %s", plan.precision,
                    plan.backend, len(plan.converted), plan.kept_high_precision)
        info["low_precision_flops"] = low_precision_flops(model, plan)
    return {**plan.describe(), **info, "peak_key": plan.peak_key}


def low_precision_flops(model: nn.Module, plan: PrecisionPlan) -> int:
    """Training FLOPs per token that run at the active precision's peak: the converted Linears'
    forward (2 per weight) and, when `plan.backward_low`, their backward (4 per weight). The rest of
    gpt.estimate_flops (lm_head and other kept layers, attention) runs at bf16, so the meter's
    util() divides by a peak blended from the two (step_meter.blended_peak): against the nvfp4 peak
    for every FLOP, an nvfp4 run with TE's bf16 backward topped out near 30% on a GB10."""
    if plan.peak_key == "bf16":
        return 0
    names = set(plan.converted)
    weights = sum(m.weight.numel() for name, m in model.named_modules() if name in names)
    return (6 if plan.backward_low else 2) * weights


@contextlib.contextmanager
def eval_precision():
    """Evaluation/sampling: grad disabled, which every swapped layer reads as 'run bf16'."""
    with torch.no_grad():
        yield
