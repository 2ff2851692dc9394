"""The project's own Triton kernels (imported lazily by nanochat/kernels.py, never at startup).

Owns the per-row softcapped cross-entropy kernels used by the fused linear + cross-entropy loss
(`--kernel triton`). The chunk loop, the matmuls and the autograd/custom-op wiring live in
kernels.py; these kernels only see one (rows, V) chunk of logits at a time:

- `ce_rows_triton(logits, targets, ...)`: one program per row, two passes over the row:
  pass 1 an online (running max, running sum) logsumexp of the softcapped logits, giving the
  row's loss and lse; pass 2 (when gradients are wanted) writes dL/dlogits in place over the
  logits buffer: (softmax - onehot) * softcap'(x) * scale. Ignored rows (target == -1) get loss 0
  and a zero gradient row.
- `ce_grad_rows_triton(...)`: pass 2 alone, from a saved lse and per-row upstream gradients
  (reduction="none" backward, where the gradient scale differs per row).

- `fp8_cast_transpose_triton(x, scale, dtype)`: x (M, N) -> fp8 (x * scale) and its (N, M)
  transpose in one pass (used by precision.py's fp8 matmul; its wgrad GEMM needs both layouts).

Runs on CPU tensors under TRITON_INTERPRET=1 (how the tests check it without a GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

IGNORE_INDEX = -1


@triton.jit
def _softcap(x, softcap, HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    if HAS_SOFTCAP:
        y = x / softcap
        if FAST_TANH:
            # One MUFU op instead of exp + reciprocal: the row passes are SFU-bound at large V.
            # Relative error ~2^-11, below the bf16 rounding of the logits it is applied to.
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [y],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at +-inf, runs in the interpreter too.
            t = 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)
        x = softcap * t
    return x


@triton.jit
def _write_grad_row(row_ptr, target, lse, scale, valid, n_cols, softcap,
                    HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_V: tl.constexpr):
    """Overwrite one row of logits with scale * (softmax(z) - onehot(target)) * dz/dx."""
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = _softcap(x, softcap, HAS_SOFTCAP, FAST_TANH)
        g = tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)
        if HAS_SOFTCAP:
            t = z / softcap
            g = g * (1.0 - t * t)   # d/dx [c * tanh(x / c)] = 1 - tanh^2
        g = tl.where(valid, g * scale, 0.0)
        tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_fwd_kernel(logits_ptr, stride_row, targets_ptr, loss_ptr, lse_ptr, scale_ptr,
                   n_cols, softcap, ignore_index,
                   HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, FAST_TANH: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)

    # Pass 1: online logsumexp (running max m, running sum s of exp(z - m)).
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, _softcap(x, softcap, HAS_SOFTCAP, FAST_TANH), -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(s)
    z_target = _softcap(tl.load(row_ptr + safe_target).to(tl.float32), softcap, HAS_SOFTCAP, FAST_TANH)
    tl.store(loss_ptr + row, tl.where(valid, lse - z_target, 0.0))
    tl.store(lse_ptr + row, lse)

    if COMPUTE_GRAD:
        scale = tl.load(scale_ptr)
        _write_grad_row(row_ptr, target, lse, scale, valid, n_cols, softcap, HAS_SOFTCAP, FAST_TANH,
                        BLOCK_V)


@triton.jit
def _ce_grad_kernel(logits_ptr, stride_row, targets_ptr, lse_ptr, scale_ptr, scale_stride,
                    n_cols, softcap, ignore_index,
                    HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
    _write_grad_row(logits_ptr + row * stride_row, target, lse, scale, target != ignore_index,
                    n_cols, softcap, HAS_SOFTCAP, FAST_TANH, BLOCK_V)


def _fast_tanh(t: torch.Tensor) -> bool:
    """PTX tanh.approx on real NVIDIA GPUs (sm_75+); the exact formula in the interpreter.
    NANOCHAT_EXACT_TANH=1 forces the exact one (numerics comparisons)."""
    return t.is_cuda and torch.version.hip is None and os.environ.get("NANOCHAT_EXACT_TANH") != "1"


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(n_cols), 8192)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def ce_rows_triton(logits: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                   grad_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and lse (float32) of softcapped logits (rows, V). With `grad_scale` (a
    1-element float32 tensor) the logits buffer is overwritten with grad_scale * dL/dlogits."""
    assert logits.ndim == 2 and logits.stride(1) == 1 and targets.shape == logits.shape[:1]
    rows, n_cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss, lse
    block, num_warps = _launch_config(n_cols)
    scale = grad_scale if grad_scale is not None else loss  # unused pointer when no grad
    _ce_fwd_kernel[(rows,)](
        logits, logits.stride(0), targets, loss, lse, scale, n_cols,
        float(softcap or 1.0), IGNORE_INDEX,
        HAS_SOFTCAP=bool(softcap), COMPUTE_GRAD=grad_scale is not None,
        FAST_TANH=_fast_tanh(logits), BLOCK_V=block,
        num_warps=num_warps)
    return loss, lse


def ce_grad_rows_triton(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                        row_scale: torch.Tensor, softcap: float | None) -> None:
    """Overwrite logits (rows, V) with row_scale[r] * dL_r/dlogits[r] given the saved lse."""
    assert logits.ndim == 2 and logits.stride(1) == 1
    rows, n_cols = logits.shape
    if rows == 0:
        return
    block, num_warps = _launch_config(n_cols)
    _ce_grad_kernel[(rows,)](
        logits, logits.stride(0), targets, lse, row_scale, row_scale.stride(0) if row_scale.ndim else 0,
        n_cols, float(softcap or 1.0), IGNORE_INDEX,
        HAS_SOFTCAP=bool(softcap), FAST_TANH=_fast_tanh(logits), BLOCK_V=block, num_warps=num_warps)


@triton.jit
def _cast_transpose_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, M, N, FMAX: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One (BLOCK_M, BLOCK_N) tile: loaded once along rows, stored once as is and once transposed;
    # tl.trans goes through shared memory, so both stores are coalesced (a transposed copy by
    # element-wise indexing writes 1-byte elements with a stride of M).
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (m[:, None] < M) & (n[None, :] < N)
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(x * tl.load(scale_ptr), -FMAX, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + m[:, None].to(tl.int64) * N + n[None, :], q, mask=mask)
    tl.store(qt_ptr + n[:, None].to(tl.int64) * M + m[None, :], tl.trans(q), mask=tl.trans(mask))


def fp8_cast_transpose_triton(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                              fmax: float, tile: tuple[int, int, int] | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamp(x * scale) as `dtype` (M, N), the same transposed (N, M)); x 2-D contiguous,
    scale a 1-element float32 tensor on x's device. `tile` = (BLOCK_M, BLOCK_N, warps); None
    picks by width: `benchmark_kernels --mode cast` on an H100 (M = 65536) measured 64 x 64 /
    4 warps best at N = 1280 (0.16 ms, 2.1 TB/s; every other tile tried 0.18-0.22 ms) and 128 x 128
    / 4 warps at N = 5120 (0.54 vs 0.60 ms, 2.5 TB/s)."""
    assert x.ndim == 2 and x.is_contiguous() and scale.numel() == 1
    M, N = x.shape
    q = torch.empty((M, N), dtype=dtype, device=x.device)
    qt = torch.empty((N, M), dtype=dtype, device=x.device)
    if M and N:
        bm, bn, warps = tile or ((128, 128, 4) if N >= 4096 else (64, 64, 4))
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _cast_transpose_kernel[grid](x, q, qt, scale, M, N, FMAX=fmax, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
    return q, qt
