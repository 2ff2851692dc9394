"""The project's own Triton kernels (imported lazily by nanochat/kernels.py, never at startup).

Owns the per-row softcapped cross-entropy kernels used by the fused linear + cross-entropy loss
(`--kernel triton`). The chunk loop, the matmuls and the autograd/custom-op wiring live in
kernels.py; these kernels only see one (rows, V) chunk of logits at a time:

- `ce_rows_triton(logits, targets, ...)`: one program per row, two passes over the row:
  pass 1 the logsumexp of the softcapped logits / temperature, z = softcap(x) / T (a fixed shift
  by softcap / T: |z| <= softcap / T; an online running max without a softcap, or past
  FIXED_SHIFT_MAX_SOFTCAP), giving the row's loss and lse; pass 2 (when gradients are wanted)
  writes dL/dlogits in place over the logits buffer: (softmax(z) - onehot) * softcap'(x) / T *
  scale. Ignored rows (target == -1) get loss 0 and a zero gradient row.
- `ce_grad_rows_triton(...)`: pass 2 alone, from a saved lse and per-row upstream gradients
  (reduction="none" backward, where the gradient scale differs per row).

- `fp8_cast_transpose_triton(x, scale, dtype)`: x (M, N) -> fp8 (x * scale) and its (N, M)
  transpose in one pass (used by precision.py's fp8 matmul; its wgrad GEMM needs both layouts).
- `mix_norm_fwd_triton` / `mix_norm_bwd_triton`: the block input's residual mix
  s = lam * r + mu * x0 and its RMSNorm in one pass, and the backward that rebuilds s from the
  normed output (nanochat/fused_norm.py says why).
- `rotary_norm_bwd_triton`: the QK-norm + RoPE backward of q or k in one pass (fused_norm.py).
- `decode_attention_triton(q, k, v, pos, window)`: one-token attention over a KV-cache bucket
  (the CUDA-graph decode step, attention.py), split over the keys: one program per (row, head,
  chunk of keys) writes a partial (max, sum, weighted values), a second kernel merges the chunks
  (the flash-decoding scheme). Chunks outside the causal window load nothing.

Runs on CPU tensors under TRITON_INTERPRET=1 (how the tests check it without a GPU).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

IGNORE_INDEX = -1


@triton.jit
def _tanh_of(x, inv_softcap, FAST_TANH: tl.constexpr):
    """tanh(x / softcap), the division as a multiply by 1 / softcap: Triton lowers a float32 `/` to
    div.full.f32 (a reciprocal on the SFU plus fix-ups), and the row passes are SFU-bound."""
    y = x * inv_softcap
    if FAST_TANH:
        # One MUFU op instead of exp + reciprocal. Relative error ~2^-11, below the bf16 rounding
        # of the logits it is applied to.
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [y],
                                         dtype=tl.float32, is_pure=True, pack=1)
    # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at +-inf, runs in the interpreter too.
    return 1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)


@triton.jit
def _z(x, zcap, inv_softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr):
    """z = softcap(x) / T. zcap = softcap / T comes from the host (exactly softcap at T = 1), so at
    T = 1 this is the untempered kernel's instruction for instruction: a `softcap * t * (1 / T)`
    rounded the product before the fma with -lse / -m that `softcap * t - lse` compiles to."""
    if HAS_SOFTCAP:
        return zcap * _tanh_of(x, inv_softcap, FAST_TANH)
    return x * inv_temperature   # exact at 1 / T = 1


@triton.jit
def _write_grad_row(row_ptr, target, lse, scale, valid, n_cols, zcap, inv_softcap, inv_temperature,
                    HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_V: tl.constexpr):
    """Overwrite one row of logits with scale * (softmax(z) - onehot(target)) * dz/dx, where
    z = softcap(x) / T (zcap = softcap / T, inv_temperature = 1 / T: _z)."""
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            t = _tanh_of(x, inv_softcap, FAST_TANH)
            g = tl.exp(zcap * t - lse) - tl.where(cols == target, 1.0, 0.0)
            g = g * (1.0 - t * t)   # d/dx [c * tanh(x / c)] = 1 - tanh^2
        else:
            g = tl.exp(x * inv_temperature - lse) - tl.where(cols == target, 1.0, 0.0)
        g = tl.where(valid, g * (scale * inv_temperature), 0.0)   # d(z / T) = dz / T
        tl.store(row_ptr + cols, g.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ce_fwd_kernel(logits_ptr, stride_row, targets_ptr, loss_ptr, lse_ptr, scale_ptr,
                   n_cols, zcap, inv_softcap, inv_temperature, ignore_index,
                   HAS_SOFTCAP: tl.constexpr, COMPUTE_GRAD: tl.constexpr, FAST_TANH: tl.constexpr,
                   FIXED_SHIFT: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    safe_target = tl.where(valid, target, 0)

    # Pass 1: logsumexp of z = softcap(x) / T. FIXED_SHIFT (softcapped logits, |z| <= zcap =
    # softcap / T <= 40): sum exp(z - zcap) directly, which can neither overflow nor underflow to 0;
    # else an online (running max m, running sum s of exp(z - m)).
    m = zcap if FIXED_SHIFT else -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < n_cols
        x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(mask, _z(x, zcap, inv_softcap, inv_temperature, HAS_SOFTCAP, FAST_TANH), -float("inf"))
        if FIXED_SHIFT:
            s += tl.sum(tl.exp(z - m), axis=0)
        else:
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # shifted by 0 while the row's max is still -inf (a first block of -inf logits: masked
            # tokens, an fp16 overflow): -inf - -inf is NaN, and it made the row's lse and loss NaN
            shift = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.sum(tl.exp(z - shift), axis=0)
            m = m_new
    lse = m + tl.log(s)
    z_target = _z(tl.load(row_ptr + safe_target).to(tl.float32), zcap, inv_softcap, inv_temperature, HAS_SOFTCAP,
                  FAST_TANH)
    tl.store(loss_ptr + row, tl.where(valid, lse - z_target, 0.0))
    tl.store(lse_ptr + row, lse)

    if COMPUTE_GRAD:
        scale = tl.load(scale_ptr)
        _write_grad_row(row_ptr, target, lse, scale, valid, n_cols, zcap, inv_softcap, inv_temperature,
                        HAS_SOFTCAP, FAST_TANH, BLOCK_V)


@triton.jit
def _ce_grad_kernel(logits_ptr, stride_row, targets_ptr, lse_ptr, scale_ptr, scale_stride,
                    n_cols, zcap, inv_softcap, inv_temperature, ignore_index,
                    HAS_SOFTCAP: tl.constexpr, FAST_TANH: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(targets_ptr + row).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row * scale_stride).to(tl.float32)
    _write_grad_row(logits_ptr + row * stride_row, target, lse, scale, target != ignore_index,
                    n_cols, zcap, inv_softcap, inv_temperature, HAS_SOFTCAP, FAST_TANH, BLOCK_V)


# softcaps (over the temperature: the bound of |z|) up to this take the fixed-shift logsumexp:
# exp(-2 * 40) is ~1.8e-35, a normal float32, so no softcapped logit's exp underflows to 0
FIXED_SHIFT_MAX_SOFTCAP = 40.0


def _fast_tanh(t: torch.Tensor) -> bool:
    """PTX tanh.approx on real NVIDIA GPUs (sm_75+); the exact formula in the interpreter.
    NANOCHAT_EXACT_TANH=1 forces the exact one (numerics comparisons)."""
    return t.is_cuda and torch.version.hip is None and os.environ.get("NANOCHAT_EXACT_TANH") != "1"


def _launch_config(n_cols: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(n_cols), 8192)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def ce_rows_triton(logits: torch.Tensor, targets: torch.Tensor, softcap: float | None,
                   grad_scale: torch.Tensor | None, *, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and lse (float32) of softcapped logits (rows, V) / temperature. With
    `grad_scale` (a 1-element float32 tensor) the logits buffer is overwritten with
    grad_scale * dL/dlogits."""
    assert logits.ndim == 2 and logits.stride(1) == 1 and targets.shape == logits.shape[:1]
    targets = targets.contiguous()   # the kernel reads targets[row] at row; a strided view read others
    rows, n_cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return loss, lse
    block, num_warps = _launch_config(n_cols)
    scale = grad_scale if grad_scale is not None else loss  # unused pointer when no grad
    cap = float(softcap or 1.0)
    _ce_fwd_kernel[(rows,)](
        logits, logits.stride(0), targets, loss, lse, scale, n_cols,
        cap / temperature, 1.0 / cap, 1.0 / temperature, IGNORE_INDEX,
        HAS_SOFTCAP=bool(softcap), COMPUTE_GRAD=grad_scale is not None,
        FAST_TANH=_fast_tanh(logits), FIXED_SHIFT=bool(softcap) and 0 < cap / temperature <= FIXED_SHIFT_MAX_SOFTCAP,
        BLOCK_V=block, num_warps=num_warps)
    return loss, lse


def ce_grad_rows_triton(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                        row_scale: torch.Tensor, softcap: float | None, *, temperature: float = 1.0) -> None:
    """Overwrite logits (rows, V) with row_scale[r] * dL_r/dlogits[r] given the saved lse (of
    softcap(logits) / temperature)."""
    assert logits.ndim == 2 and logits.stride(1) == 1
    assert targets.shape == lse.shape == logits.shape[:1]
    targets, lse = targets.contiguous(), lse.contiguous()   # read at [row]: strided views read others
    rows, n_cols = logits.shape
    if rows == 0:
        return
    block, num_warps = _launch_config(n_cols)
    cap = float(softcap or 1.0)
    _ce_grad_kernel[(rows,)](
        logits, logits.stride(0), targets, lse, row_scale, row_scale.stride(0) if row_scale.ndim else 0,
        n_cols, cap / temperature, 1.0 / cap, 1.0 / temperature, IGNORE_INDEX,
        HAS_SOFTCAP=bool(softcap), FAST_TANH=_fast_tanh(logits), BLOCK_V=block, num_warps=num_warps)


@triton.jit
def _cast_transpose_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, M, N, FMAX: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, N_FAST: tl.constexpr):
    # One (BLOCK_M, BLOCK_N) tile: loaded once along rows, stored once as is and once transposed;
    # tl.trans goes through shared memory, so both stores are coalesced (a transposed copy by
    # element-wise indexing writes 1-byte elements with a stride of M).
    # Block order: with N_FAST the programs resident at one time cover whole rows of x (a band of
    # row blocks), so x is read and q written in long contiguous runs and each row of qt gets one
    # run per band; M-fast order has them cover every row of x for one or two column blocks, i.e.
    # 128-byte pieces of every DRAM row of x and q at once.
    pid = tl.program_id(0)
    if N_FAST:
        n_blocks = tl.cdiv(N, BLOCK_N)
        pid_m, pid_n = pid // n_blocks, pid % n_blocks
    else:
        m_blocks = tl.cdiv(M, BLOCK_M)
        pid_m, pid_n = pid % m_blocks, pid // m_blocks
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (m[:, None] < M) & (n[None, :] < N)
    x = tl.load(x_ptr + m[:, None].to(tl.int64) * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.clamp(x * tl.load(scale_ptr), -FMAX, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + m[:, None].to(tl.int64) * N + n[None, :], q, mask=mask)
    tl.store(qt_ptr + n[:, None].to(tl.int64) * M + m[None, :], tl.trans(q), mask=tl.trans(mask))


# benchmark_kernels --mode cast on an H100 (M = 65536, 20 back-to-back calls per sample, 2026-11-24):
# N = 1280: 64 x 256 / 8 warps, row-band order 0.12 ms (2.77 TB/s); N = 5120: 128 x 128 / 4 warps,
# row-band order 0.47 ms (2.83 TB/s) vs 0.50 (2.70) in column-band order. Every tile within ~5%.
CAST_TILE_DEFAULT = {"narrow": (64, 256, 8, True), "wide": (128, 128, 4, True)}


def fp8_cast_transpose_triton(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                              fmax: float, tile: tuple | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamp(x * scale) as `dtype` (M, N), the same transposed (N, M)); x 2-D contiguous,
    scale a 1-element float32 tensor on x's device. `tile` = (BLOCK_M, BLOCK_N, warps[, n_fast]);
    None picks `CAST_TILE_DEFAULT` by width (wide: N >= 4096)."""
    assert x.ndim == 2 and x.is_contiguous() and scale.numel() == 1
    M, N = x.shape
    q = torch.empty((M, N), dtype=dtype, device=x.device)
    qt = torch.empty((N, M), dtype=dtype, device=x.device)
    if M and N:
        bm, bn, warps, *rest = tile or CAST_TILE_DEFAULT["wide" if N >= 4096 else "narrow"]
        grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
        _cast_transpose_kernel[grid](x, q, qt, scale, M, N, FMAX=fmax, BLOCK_M=bm, BLOCK_N=bn,
                                     N_FAST=bool(rest and rest[0]), num_warps=warps)
    return q, qt


# --------------------------------------------------------------------------------------------
# Residual mix + RMSNorm (fused_norm.py owns the op, its autograd and the torch twin)
# --------------------------------------------------------------------------------------------

@triton.jit
def _mix_norm_fwd_kernel(r_ptr, add_ptr, x0_ptr, lm_ptr, s_ptr, y_ptr, rstd_ptr, C, eps,
                         HAS_ADD: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    r = tl.load(r_ptr + row * C + cols, mask=mask, other=0.0)
    if HAS_ADD:   # the residual add, rounded to r's dtype as the separate add kernel stored it
        r = (r.to(tl.float32) + tl.load(add_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)).to(r.dtype)
    r = r.to(tl.float32)
    x0 = tl.load(x0_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    # an explicit fma: left to the compiler, the contraction differed with and without the add
    # above (H200: 0.2% of s one bf16 step apart), and the two must agree bit for bit
    s = tl.fma(tl.load(lm_ptr).to(tl.float32), r, tl.load(lm_ptr + 1).to(tl.float32) * x0).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + row * C + cols, s, mask=mask)
    sf = s.to(tl.float32)   # normalise the stored (rounded) s, as norm(s) on the plain path does
    rstd = tl.rsqrt(tl.sum(sf * sf, axis=0) / C + eps)
    tl.store(y_ptr + row * C + cols, (sf * rstd).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _mix_norm_bwd_kernel(gs_ptr, gy_ptr, y_ptr, rstd_ptr, x0_ptr, lm_ptr, acc_ptr, gr_ptr, gx0_ptr,
                         part_ptr, C, HAS_ACC: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    gs = tl.load(gs_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    gy = tl.load(gy_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x0_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row)
    g = gs + rstd * (gy - y * (tl.sum(gy * y, axis=0) / C))   # dL/ds: residual path + norm
    tl.store(gr_ptr + row * C + cols, (tl.load(lm_ptr).to(tl.float32) * g).to(gr_ptr.dtype.element_ty),
             mask=mask)
    gx0 = tl.load(lm_ptr + 1).to(tl.float32) * g
    if HAS_ACC:   # the later blocks' x0 gradient, summed here instead of in a separate add
        gx0 += tl.load(acc_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(gx0_ptr + row * C + cols, gx0.to(gx0_ptr.dtype.element_ty), mask=mask)
    # per-row partial sums for the two scalars' gradients: sum(g * s) with s = y / rstd rebuilt
    # from the saved output, and sum(g * x0)
    tl.store(part_ptr + 2 * row, tl.sum(g * y, axis=0) / rstd)
    tl.store(part_ptr + 2 * row + 1, tl.sum(g * x0, axis=0))


def _mix_norm_warps(block_c: int) -> int:
    return 8 if block_c >= 4096 else 4


def mix_norm_fwd_triton(r: torch.Tensor, x0: torch.Tensor, lam_mu: torch.Tensor, eps: float,
                        add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """s = lam * (r + add) + mu * x0 (r's dtype; r + add rounded to it first), y = s * rstd,
    rstd = 1/rms(s) (float32, (N, 1)); r, add and x0 (N, C) contiguous, lam_mu = (lam, mu) a
    (2,) tensor. One program per row."""
    assert r.ndim == 2 and r.is_contiguous() and x0.is_contiguous() and x0.shape == r.shape
    assert add is None or (add.is_contiguous() and add.shape == r.shape and add.dtype == r.dtype)
    n, c = r.shape
    s, y = torch.empty_like(r), torch.empty_like(r)
    rstd = torch.empty((n, 1), dtype=torch.float32, device=r.device)
    if n:
        block = triton.next_power_of_2(c)
        _mix_norm_fwd_kernel[(n,)](r, r if add is None else add, x0, lam_mu, s, y, rstd, c, eps,
                                   HAS_ADD=add is not None, BLOCK_C=block, num_warps=_mix_norm_warps(block))
    return s, y, rstd


def mix_norm_bwd_triton(gs, gy, y, rstd, x0, lam_mu, gx0_acc=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dr, dL/dx0 (+ gx0_acc, summed in float32), per-row partials (N, 2) float32:
    sum(g * s), sum(g * x0)) for the forward above, g = dL/ds = gs + the RMSNorm backward of gy.
    All (N, C) contiguous."""
    assert gx0_acc is None or (gx0_acc.is_contiguous() and gx0_acc.shape == x0.shape)
    n, c = y.shape
    gr, gx0 = torch.empty_like(gs), torch.empty_like(x0)
    part = torch.empty((n, 2), dtype=torch.float32, device=y.device)
    if n:
        block = triton.next_power_of_2(c)
        _mix_norm_bwd_kernel[(n,)](gs, gy, y, rstd, x0, lam_mu, x0 if gx0_acc is None else gx0_acc, gr, gx0,
                                   part, c, HAS_ACC=gx0_acc is not None, BLOCK_C=block,
                                   num_warps=_mix_norm_warps(block))
    return gr, gx0, part


# --------------------------------------------------------------------------------------------
# Decode attention: one query token per (row, head) over a cache bucket, split over the keys
# --------------------------------------------------------------------------------------------

@triton.jit
def _decode_merge(row, n_splits, m_ptr, l_ptr, acc_ptr, out_ptr, so_b, so_h,
                  HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    """Merge one (row, head)'s per-chunk partials (max, sum, weighted values) into its output."""
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    live = offs_s < n_splits
    # .cg (L2, not L1): in the fused kernel other programs wrote these moments ago
    m = tl.load(m_ptr + row * n_splits + offs_s, mask=live, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(l_ptr + row * n_splits + offs_s, mask=live, other=0.0, cache_modifier=".cg")
    top = tl.max(m, axis=0)                # finite: the query's own position is always visible
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
    acc = tl.load(acc_ptr + (row * n_splits + offs_s)[:, None] * D + offs_d[None, :],
                  mask=live[:, None], other=0.0, cache_modifier=".cg")
    o = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * l, axis=0)
    b, h = row // HQ, row % HQ
    tl.store(out_ptr + b * so_b + h * so_h + offs_d, o.to(out_ptr.dtype.element_ty))


@triton.jit
def _decode_partial_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, count_ptr,
                           s_pos, sq_b, sq_h, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, L, window, scale,
                           HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                           HAS_WINDOW: tl.constexpr, FUSED: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0)                 # b * HQ + h
    split = tl.program_id(1)
    n_splits = tl.num_programs(1)
    b, h = row // HQ, row % HQ
    kvh = h // GROUP
    pos = tl.load(pos_ptr + b * s_pos)     # s_pos 0: one position for every row
    offs_t = split * CHUNK + tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D)
    visible = (offs_t <= pos) & (offs_t < L)
    if HAS_WINDOW:
        visible = visible & (offs_t > pos - window)
    # all three loads first: at batch 1 the kernel is latency-bound, so K and V are in flight
    # together instead of V waiting for the softmax
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_d).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + kvh * sk_h + offs_t[:, None] * sk_t + offs_d[None, :],
                mask=visible[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + b * sv_b + kvh * sv_h + offs_t[:, None] * sv_t + offs_d[None, :],
                mask=visible[:, None], other=0.0).to(tl.float32)
    scores = tl.where(visible, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
    m = tl.max(scores, axis=0)
    p = tl.exp(scores - tl.where(m == float("-inf"), 0.0, m))   # 0 where masked
    out = row * n_splits + split
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, tl.sum(p, axis=0))
    tl.store(acc_ptr + out * D + offs_d, tl.sum(p[:, None] * v, axis=0))
    if FUSED:
        # the row's last program to finish merges (acq_rel atomic: it sees the others' partials)
        # and puts the counter back to 0 for the next call; saves the second launch
        done = tl.atomic_add(count_ptr + row, 1)
        if done == n_splits - 1:
            _decode_merge(row, n_splits, m_ptr, l_ptr, acc_ptr, out_ptr, so_b, so_h, HQ, D, SPLITS)
            tl.atomic_xchg(count_ptr + row, 0)


@triton.jit
def _decode_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, so_b, so_h, n_splits,
                           HQ: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr):
    _decode_merge(tl.program_id(0), n_splits, m_ptr, l_ptr, acc_ptr, out_ptr, so_b, so_h, HQ, D, SPLITS)


_DECODE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _decode_counters(device: torch.device, rows: int) -> torch.Tensor | None:
    """A zeroed int32 counter per (row, head) that outlives the call (the fused kernel leaves it
    at 0 again). Created or grown only outside CUDA-graph capture (an allocation inside a
    capture belongs to the graph's pool); None there, and the caller launches the merge
    separately."""
    buf = _DECODE_COUNTERS.get(device)
    if buf is None or buf.numel() < rows:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _DECODE_COUNTERS[device] = torch.zeros(max(rows, 1024), dtype=torch.int32, device=device)
    return buf


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                            window: int | None, chunk: int = 64, num_warps: int | None = None,
                            fused: bool = False) -> torch.Tensor:
    """Softmax(q k^T / sqrt(D)) v for one query token per (row, head): q (B, Hq, 1, D); k, v
    (B, Hkv, L, D) (a cache bucket: any strides with a unit last one); pos a (1,) long tensor,
    the query's position, or (B,) with each row's own: keys 0..pos are visible, and only the last `window` of them when
    window is set. GQA: query head h reads kv head h // (Hq // Hkv). Returns (B, Hq, 1, D) in
    q's dtype. D must be a power of two (tl.arange); the caller checks.

    Tiles: 64 keys per program; 4 warps while there are at most 512 programs, 2 beyond. Swept
    on an H100 at d20 decode shapes (10 heads, D = 128; 16/32/64/128 keys x 2/4 warps, one layer
    in a CUDA graph of 20 calls, so L2-warm): batch 1, bucket 768: 5.9 us (cuDNN SDPA with the
    position mask 9.9); bucket 2048: 8.3 (11.1); batch 8: 11.0 (13.9); batch 32: 50.2 (51.3).
    In the whole decode step (L2-cold) see attention._static_decode_attention.

    fused=True: the last program of each (row, head) merges the chunks (a per-row atomic
    counter, acq_rel) instead of a second launch, which costs ~2 us per layer at batch 1 (the
    merge kernel in the d20 profile). The default since it passed tests/test_attention.py's CUDA
    test on an H100 (50 repeated calls equal the first and the two-kernel merge) and measured
    0.976 vs 0.993 ms per d20 batch-1 step (`bench_inference --decode-kernel`)."""
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    assert T == 1 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and Hq % Hkv == 0
    assert D & (D - 1) == 0 and pos.numel() in (1, B) and chunk & (chunk - 1) == 0
    n_splits = triton.cdiv(L, chunk)
    num_warps = num_warps or (4 if B * Hq * n_splits <= 512 else 2)
    m = torch.empty(B * Hq * n_splits, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((B * Hq * n_splits, D), dtype=torch.float32, device=q.device)
    out = torch.empty((B, Hq, 1, D), dtype=q.dtype, device=q.device)
    counters = _decode_counters(q.device, B * Hq) if fused else None
    splits_p2 = triton.next_power_of_2(n_splits)
    _decode_partial_kernel[(B * Hq, n_splits)](
        q, k, v, pos, m, l, acc, out, m if counters is None else counters,  # m: unread unless FUSED
        0 if pos.numel() == 1 else pos.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), L, window or 0, D ** -0.5,
        HQ=Hq, GROUP=Hq // Hkv, D=D, CHUNK=chunk, HAS_WINDOW=window is not None,
        FUSED=counters is not None, SPLITS=splits_p2, num_warps=num_warps)
    if counters is None:
        _decode_combine_kernel[(B * Hq,)](m, l, acc, out, out.stride(0), out.stride(1), n_splits,
                                          HQ=Hq, D=D, SPLITS=splits_p2, num_warps=4)
    return out


# --------------------------------------------------------------------------------------------
# QK-norm + RoPE backward (fused_norm.py owns the op and its autograd)
# --------------------------------------------------------------------------------------------

@triton.jit
def _pairs(x, ROWS: tl.constexpr, HALF: tl.constexpr):
    """(x[:, 0::2], x[:, 1::2]) in float32 of a (ROWS, 2 * HALF) tile: adjacent columns split in
    registers."""
    return tl.split(tl.reshape(x.to(tl.float32), (ROWS, HALF, 2)))


@triton.jit
def _rotary_norm_bwd_kernel(dy_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, dx_ptr, amax_ptr, n_rows, T, H,
                            s_b, s_t, s_h, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
                            AMAX_SLOTS: tl.constexpr, PAIRED: tl.constexpr):
    # Rows are (b, t, h) heads of D = 2 * HALF; dy may be strided (attention's gradient layout),
    # y / dx / rstd are contiguous (B, T, H, D) / (B, T, H, 1), cos / sin (T, HALF) float32.
    # A rotation pair (x1_j, x2_j) is (j, j + HALF), or with PAIRED (2j, 2j + 1) (triton_qk's
    # interleaved heads: loaded as whole rows and split in registers).
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < n_rows
    h, t, b = r % H, (r // H) % T, r // (H * T)
    c = tl.arange(0, HALF)
    m = live[:, None]
    dy_base = (b.to(tl.int64) * s_b + t.to(tl.int64) * s_t + h.to(tl.int64) * s_h)[:, None]
    if PAIRED:
        d = tl.arange(0, 2 * HALF)[None, :]
        row = r.to(tl.int64)[:, None] * (2 * HALF) + d
        dy1, dy2 = _pairs(tl.load(dy_ptr + dy_base + d, mask=m, other=0.0), BLOCK_R, HALF)
        y1, y2 = _pairs(tl.load(y_ptr + row, mask=m, other=0.0), BLOCK_R, HALF)
    else:
        row = r.to(tl.int64)[:, None] * (2 * HALF) + c[None, :]
        dy1 = tl.load(dy_ptr + dy_base + c[None, :], mask=m, other=0.0).to(tl.float32)
        dy2 = tl.load(dy_ptr + dy_base + c[None, :] + HALF, mask=m, other=0.0).to(tl.float32)
        y1 = tl.load(y_ptr + row, mask=m, other=0.0).to(tl.float32)
        y2 = tl.load(y_ptr + row + HALF, mask=m, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + r, mask=live, other=0.0)[:, None]
    dot = (tl.sum(dy1 * y1, 1) + tl.sum(dy2 * y2, 1))[:, None] / (2 * HALF)
    dr1, dr2 = rstd * (dy1 - y1 * dot), rstd * (dy2 - y2 * dot)   # the RMSNorm backward
    trig = t[:, None] * HALF + c[None, :]
    cos = tl.load(cos_ptr + trig, mask=m, other=0.0)
    sin = tl.load(sin_ptr + trig, mask=m, other=0.0)
    out = dx_ptr.dtype.element_ty
    dx1, dx2 = (dr1 * cos - dr2 * sin).to(out), (dr2 * cos + dr1 * sin).to(out)   # the inverse rotation
    if PAIRED:
        tl.store(dx_ptr + row, tl.reshape(tl.join(dx1, dx2), (BLOCK_R, 2 * HALF)), mask=m)
    else:
        tl.store(dx_ptr + row, dx1, mask=m)
        tl.store(dx_ptr + row + HALF, dx2, mask=m)
    if AMAX_SLOTS > 0:   # max |dx| of the stored values (masked rows are 0), spread over slots
        big = tl.maximum(tl.max(tl.abs(dx1.to(tl.float32))), tl.max(tl.abs(dx2.to(tl.float32))))
        tl.atomic_max(amax_ptr + tl.program_id(0) % AMAX_SLOTS, big)


AMAX_SLOTS = 64   # one atomic per program into slot pid % 64: ~40k programs at d20, not one address


def rotary_norm_bwd_triton(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor, block_rows: int = 16, with_amax: bool = False,
                           paired: bool = False):
    """dL/dx of y = norm(rotate(x)) (gpt._RotaryNorm): dy, y (B, T, H, D) (dy any strides with
    unit stride on D; y contiguous), rstd (B, T, H, 1) float32, cos / sin (T, D/2) float32
    contiguous; D a power of two. One pass; returns dx (B, T, H, D) contiguous in dy's dtype, and
    with `with_amax` also max |dx| (a 0-dim float32 tensor: the scale of dx's fp8 cast, found while
    dx is in registers instead of by another read of it). `paired`: rotation pairs are adjacent
    (2j, 2j + 1) in every head, triton_qk's interleaved layout, instead of (j, j + D/2)."""
    B, T, H, D = y.shape
    assert y.is_contiguous() and rstd.is_contiguous() and dy.stride(-1) == 1 and dy.shape == y.shape
    assert D >= 2 and D & (D - 1) == 0 and cos.shape == sin.shape == (T, D // 2)
    dx = torch.empty(y.shape, dtype=dy.dtype, device=y.device)
    slots = torch.zeros(AMAX_SLOTS if with_amax else 1, dtype=torch.float32, device=y.device)
    n = B * T * H
    if n:
        _rotary_norm_bwd_kernel[(triton.cdiv(n, block_rows),)](
            dy, y, rstd, cos, sin, dx, slots, n, T, H, dy.stride(0), dy.stride(1), dy.stride(2),
            HALF=D // 2, BLOCK_R=block_rows, AMAX_SLOTS=AMAX_SLOTS if with_amax else 0, PAIRED=paired,
            num_warps=4)
    return (dx, slots.amax()) if with_amax else dx
