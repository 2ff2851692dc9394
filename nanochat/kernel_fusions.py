"""Which of the model's ops `--kernel name` replaces with fused ones (the banner's `kernel_fusions`),
next to the loss that nanochat/kernels.py builds. Each builder returns the function a GPT hook
installs, or None for the model's plain version; only `--kernel triton` fuses anything:

- `build_mix_norm`: every block's residual mix + RMSNorm as one op (nanochat/fused_norm.py), one
  (B, T, C) tensor per layer less kept for backward (GPT.set_mix_norm);
- `build_rotary_norm`: q/k's QK-norm + RoPE with a one-pass Triton backward (GPT.set_rotary_norm);
- `build_mlp`: the ReLU^2 MLP whose GEMMs apply relu^2 and its gradient in their epilogues
  (nanochat/triton_mlp.py: bf16, and native fp8 in the save wgrad mode; TMA, compute capability
  >= 9, proved by a probe launch) (GPT.set_mlp_fn);
- `build_qkv_projection`: the q/k/v projections with QK-norm + RoPE in the GEMM's epilogue
  (nanochat/triton_qk.py, bf16) and fp8 layers' gradient abs-max in the rotary backward
  (nanochat/fp8_qk.py) (GPT.set_qkv_projection).

A fusion that cannot run here is left off (a failed probe or a shape TMA cannot take is said in
one line); a bad --kernel name or a device the kernel cannot run on raises a RequestError, as
build_loss_fn's checks do. nanochat/kernels.py re-exports these builders, and
this module imports it only inside the builders (it imports this one at its top).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from nanochat.errors import RequestError


def _check_name(name: str) -> None:
    from nanochat.kernels import KERNELS
    if name not in KERNELS:
        raise RequestError(f"--kernel: got {name!r}; accepted: {'|'.join(KERNELS)}")


def build_mlp(name: str, device: torch.device | str, precision: str, *, layer: torch.nn.Module | None = None):
    """Every block's MLP for `--kernel name` (GPT.set_mlp_fn), or None for the Linear path. For
    triton on a GPU where nanochat/triton_mlp.py's probe launch passes (TMA: cc >= 9): at bf16
    its GEMMs with fused relu^2 epilogues; at fp8, when the MLP's `layer` (its c_fc) is
    precision.py's native Fp8Linear in the save wgrad mode, the same in fp8 GEMMs that also give
    the next cast's abs-max (with that layer's gradient format). Otherwise None: other kernels,
    TE / torchao layers, layers kept high-precision, the other fp8 wgrad modes, nvfp4, CPU, older
    GPUs, a failed probe (printed)."""
    _check_name(name)
    fp8 = precision == "fp8" and _is_fp8_save_layer(layer)
    if name != "triton" or not (precision == "bf16" or fp8) or torch.device(device).type != "cuda":
        return None
    try:   # tensor descriptors: Triton >= 3.4; without them the Linear path stays (the banner's
        from nanochat import triton_mlp   # kernel_fusions then lacks relu2_mlp)
    except ImportError:
        return None
    reason = _unaligned_mlp(layer, 1 if fp8 else 2) or triton_mlp.probe(device, fp8=fp8)
    if reason is not None:
        from nanochat.common import print0
        print0(f"[kernels] --kernel triton: the fused relu^2 {precision} MLP is off ({reason}); the MLP "
               "runs cuBLAS + a compiled relu^2 (kernel_fusions in the banner)")
        return None
    triton_mlp.register()
    if not fp8:
        return triton_mlp.relu2_mlp
    from nanochat.precision import Fp8Linear
    fn = functools.partial(triton_mlp.fp8_relu2_mlp, grad_dtype=layer.grad_dtype)
    fn.replaces = (Fp8Linear,)   # GPT.set_mlp_fn: the layer class this fused MLP stands in for
    return fn


def _unaligned_mlp(layer, elem_bytes: int) -> str | None:
    """Why the fused MLP's TMA descriptors cannot take `layer`'s (c_fc's) shapes, or None: every
    row of x, h and both weights must be a multiple of 16 bytes, else Triton's TensorDescriptor
    asserted at the first training step (e.g. a width of 12 at bf16)."""
    if layer is None or getattr(layer, "weight", None) is None:
        return None
    hidden, n_embd = layer.weight.shape
    if (n_embd * elem_bytes) % 16 or (hidden * elem_bytes) % 16:
        return (f"width {n_embd} / hidden {hidden} at {elem_bytes} byte(s) per element: TMA needs rows of a "
                "multiple of 16 bytes")
    return None


def _is_fp8_save_layer(layer) -> bool:
    """Is `layer` a native Fp8Linear whose recipe fp8_relu2_mlp reproduces (wgrad mode save)?"""
    if layer is None:
        return False
    from nanochat.precision import Fp8Linear
    return isinstance(layer, Fp8Linear) and layer.wgrad_mode == "save"


def build_mix_norm(name: str, device: torch.device | str = "cpu"):
    """Each block's residual mix + input norm for `--kernel name` (GPT.set_mix_norm): None (the
    model's plain autograd version) for current and liger; for triton the fused op of
    nanochat/fused_norm.py, which keeps one (B, T, C) tensor less per layer for backward."""
    _check_name(name)
    if name != "triton":
        return None
    from nanochat.kernels import build_loss_fn
    build_loss_fn(name, device)   # the same device and Triton checks, raised the same way
    from nanochat import fused_norm
    fused_norm.register()
    return fused_norm.mix_norm


def build_rotary_norm(name: str, device: torch.device | str = "cpu"):
    """q/k's QK-norm + RoPE for `--kernel name` (GPT.set_rotary_norm): None (the plain version)
    for current and liger; for triton fused_norm.rotary_norm, whose backward is one Triton pass."""
    if build_mix_norm(name, device) is None:   # same checks; registers fused_norm's ops
        return None
    from nanochat import fused_norm
    return fused_norm.rotary_norm


def build_qkv_projection(name: str, device: torch.device | str = "cpu", *, gemm: bool = True):
    """q/k/v's projections + q/k's QK-norm + RoPE for `--kernel name` (GPT.set_qkv_projection): for
    triton fp8_qk.qkv_projection, which fuses native fp8 layers' gradient abs-max into the rotary
    backward and, with `gemm` on a GPU where nanochat/triton_qk.py's probe launch passes, runs
    plain bf16 layers as one op with the rotary norm in the GEMMs' epilogue (`bf16_gemm`, the
    function's keyword); other layers run the plain chain. None for current and liger."""
    if build_rotary_norm(name, device) is None:
        return None
    if torch.device(device).type != "cuda" and importlib.util.find_spec("triton") is None:
        # off CUDA the hook is the model's own plain chain, and fp8_qk imports Triton: a CPU torch without
        # it (macOS, the CPU index) passed check_kernel, then hit ModuleNotFoundError after data + model
        return None
    from nanochat import fp8_qk
    bf16_gemm = False
    if gemm and torch.device(device).type == "cuda":
        from nanochat import triton_qk
        reason = triton_qk.probe(device)
        if reason is not None:
            from nanochat.common import print0
            print0(f"[kernels] --kernel triton: the q/k GEMM with the rotary norm in its epilogue is off "
                   f"({reason}); q/k run cuBLAS + the compiled rotary norm")
        else:
            triton_qk.register()
            bf16_gemm = True
    return functools.partial(fp8_qk.qkv_projection, bf16_gemm=bf16_gemm)
