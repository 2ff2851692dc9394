"""Attention backward through FlashAttention-4's CuTe DSL kernels (the `cudnn_fa4` backend).

Owns: `available()`, `probe(device)`, `proven(device)`, `FA4_AUTO_CAPABILITIES` (where `auto` may
pick the backend) and `backward(...)`, the one call into the `flash-attn-4` package.
nanochat/cudnn_attention.py calls `backward` from its backward custom op when the backend is
`cudnn_fa4`; the forward stays cuDNN's.

Why this split: at d20 shapes on the H100 (B=32, 10 heads, T=2048, D=128, bf16, torch 2.11,
flash-attn-4 4.0.0b36, median of 20), FA4's Hopper backward is faster than cuDNN's and its
forward is slower:
    full causal  forward cuDNN 0.672 / FA4 0.848 ms, backward cuDNN 2.318 / FA4 1.830 ms
    window 512   forward cuDNN 0.523 / FA4 0.619 ms, backward cuDNN 1.774 / FA4 1.311 ms
Both compute the same softmax statistics (the log-sum-exp of the scaled scores, natural log, one
float32 per query and head), so cuDNN's forward output and statistics feed FA4's backward
directly: cuDNN forward + FA4 backward is 2.50 instead of 2.99 ms per full layer and 1.83 instead
of 2.30 ms per window layer.

The entry point used is `flash_attn.cute.interface._flash_attn_bwd`, which the package's own
autograd function calls; it is private, so the version is pinned in pyproject.toml (`fa4` extra)
and every process proves it with a tiny real launch against plain math before `auto` may pick it
(`probe`). Importing this module imports nothing from the package.

Install: `pip install 'flash-attn-4==4.0.0b36' 'nvidia-cutlass-dsl[cu13]'` (pure Python; the
kernels are JIT-compiled by the CuTe DSL on first use, ~6 s per shape and window, cached per
process).
"""

from __future__ import annotations

import threading
import warnings

import torch

from nanochat.cudnn_attention import _index  # device -> index, as cuDNN's probe cache keys it

PINNED = "4.0.0b36"
# Where auto may pick cudnn_fa4 (nanochat/attention.py imports it): the compute capabilities where it
# was measured faster than cuDNN's own backward (H100). Elsewhere (e.g. GB10, sm_121, whose FA4
# backward is a different, SM80-style kernel) it is an explicit choice until measured there.
FA4_AUTO_CAPABILITIES = ((9, 0),)
_PROBED: dict = {}  # device index -> None (works) or the reason it does not
_LOCK = threading.Lock()
_QUIET: list = []  # non-empty once flash-attn-4's JIT warnings are filtered


def _bwd_fn():
    from flash_attn.cute.interface import _flash_attn_bwd

    if not _QUIET:  # once: each kernel's JIT warns about an argument type and deprecated names
        warnings.filterwarnings("ignore", message="Argument aux_data", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"flash_attn\.cute")
        _QUIET.append(True)
    return _flash_attn_bwd


def available() -> str | None:
    """None if flash-attn-4's backward entry point imports, else why not (with the fix)."""
    try:
        _bwd_fn()
    except (ImportError, OSError) as exc:  # OSError: a shared library of the CuTe DSL failed to load
        return (f"flash-attn-4 is not installed or does not import ({exc}); "
                f"pip install 'flash-attn-4=={PINNED}' 'nvidia-cutlass-dsl[cu13]'")
    return None


def backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             lse: torch.Tensor, window: int, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Write the gradients of causal attention (window > 0: a query sees its last `window` keys)
    into dq, dk, dv. Every tensor is (B, H, T, D) with unit stride on D and laid out (B, T, H, D)
    in memory (what cudnn_attention allocates); lse is cuDNN's (B, H, T, 1) float32 statistics."""
    B, H, T, _ = q.shape
    bthd = [t.transpose(1, 2) for t in (q, k, v, o, do, dq, dk, dv)]
    assert all(t.stride(-1) == 1 for t in bthd), "fa4 backward: every tensor needs unit stride on D"
    fq, fk, fv, fo, fdo, fdq, fdk, fdv = bthd
    left = window - 1 if window > 0 else None  # FA's window counts the keys before the query
    _bwd_fn()(fq, fk, fv, fo, fdo, lse.view(B, H, T), None, True, 0.0,
              window_size_left=left, window_size_right=0 if window > 0 else None,
              dq=fdq, dk=fdk, dv=fdv)


def proven(device) -> bool:
    """True once probe() passed on this device (a dict lookup: safe inside a compiled forward)."""
    device = torch.device(device)
    return device.type == "cuda" and _PROBED.get(_index(device), "not probed") is None


def probe(device) -> str | None:
    """One tiny real cuDNN forward + FA4 backward per window kind (full causal, window) against
    float32 plain math, cached per device: None if they run and agree, else the reason."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    index = _index(device)
    with _LOCK:
        if index not in _PROBED:
            reason = available()
            if reason is None:
                from nanochat import cudnn_attention

                reason = cudnn_attention.probe(device)
                if reason is not None:
                    reason = f"its forward is cuDNN's, which failed: {reason}"
            if reason is None:
                reason = _probe_launch(torch.device("cuda", index))
            _PROBED[index] = reason
    return _PROBED[index]


def _probe_launch(device: torch.device) -> str | None:
    """cuDNN forward + FA4 backward on cudnn_attention's probe inputs (model layout), full causal and
    at its probe window, within its tolerance (whose inputs tell a one-key window error apart, e.g.
    window_size_left = window instead of window - 1: cudnn_attention's notes above PROBE_SHAPE)."""
    from nanochat import cudnn_attention as C

    for seed, window in enumerate((0, C.PROBE_WINDOW)):
        q, k, v = C.probe_inputs(device, bthd=True, seed=seed)
        try:
            out = C.window_attention(q, k, v, window, bwd="fa4")
            out.float().square().sum().backward()
        except (RuntimeError, ValueError, TypeError, AssertionError) as exc:
            return f"cuDNN forward + FA4 backward failed to run: {type(exc).__name__}: {exc}"
        err = C.probe_error(out.detach(), (q, k, v), window)
        if not err < C.PROBE_TOLERANCE:
            return (f"FA4 backward disagrees with the reference (window {window}, max error {err:.3g}, "
                    f"accepted < {C.PROBE_TOLERANCE:g})")
    return None
