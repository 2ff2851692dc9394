"""The int8 weight-only matmul of decode steps, y = (x @ q.T) * scale, as one Triton kernel (CUDA).

A batch-1 (or small-batch) decode step is bound by the bytes of weights it streams, so reading
1-byte weights instead of 2-byte ones is up to 2x on the matrices (on a DGX Spark's ~273 GB/s the
whole step is that stream). One input row runs `_int8_gemv_row_kernel` (float32 products in
registers, 1-8 output rows per program, so even a 1280-row matrix spreads over hundreds of
programs); 2..GEMV_MAX_ROWS rows run `_int8_gemv_kernel`, which reads each int8 weight tile once
per block of rows, widens it to the input's dtype (every int8 value is exact in bf16 and fp16)
and multiplies on the tensor cores. Both apply the per-output-row scale once at the end; no
dequantised copy of the weight is ever written. H200 at d20's matrices, one row: 1.15-1.74x
faster than cuBLAS on the bf16 weights (bench_int8; CHANGELOG_GB10.md, session 44). Larger inputs (prompt
prefill) go through `quantize.int8_linear`'s dequantise-then-GEMM path instead, where the GEMM's
FLOPs dominate.

`int8_gemv` is a torch custom op (`nanochat::int8_gemv`) so that torch.compile and CUDA-graph
capture see one opaque launch. Tiles are chosen by `gemv_config` from the shape, not autotuned:
autotuning inside a graph capture would time kernels while capturing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nanochat.quantize import GEMV_MAX_ROWS


@triton.jit
def widen(w):
    """w as float32, exactly. int8 by bit arithmetic instead of a conversion: the byte u (as
    unsigned) XOR 0x4B000080 is the float 2^23 + 128 + q, so subtracting 2^23 + 128 leaves q
    (every q in -128..127). That is a LOP3 and an FADD per value where `w.to(tl.float32)` is an
    I2F, which sm_90 issues at 16 per clock per SM (CUDA programming guide, arithmetic
    instruction throughput): 4.2e12 values/s on an H100/H200's 132 SMs at 1.98 GHz, under the
    H200's 4.8 TB/s of int8. Measured on the H200 it changed nothing that shows (the row kernel
    and the persistent step reach 1-2.5 TB/s, under that ceiling; CHANGELOG_GB10.md, session
    45); it removes the ceiling. Other dtypes: a plain cast."""
    if w.dtype == tl.int8:
        u = w.to(tl.uint8, bitcast=True).to(tl.int32)
        return (u ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
    else:
        return w.to(tl.float32)


@triton.jit
def _int8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_m = rm < M
    in_n = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        in_k = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=in_n[:, None] & in_k[None, :], other=0)
        w = w.to(x.dtype)   # exact in bf16 / fp16 (|q| <= 128); widen() then a cast measured 5% slower here
        if IEEE:   # float32 inputs: no TF32 rounding of the activations
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    scale = tl.load(s_ptr + rn, mask=in_n, other=0.0)
    y = acc * scale[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y.to(y_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _int8_gemv_row_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_wn,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One input row (batch-1 decode): no tensor cores, so a program can own as few as one output
    row and the grid spreads a 1280-row matrix over hundreds of programs, each streaming long
    runs of int8; the products are summed in float32 registers and reduced once at the end."""
    pid_n = tl.program_id(0)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_n = rn < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        in_k = kk < K
        x = tl.load(x_ptr + kk, mask=in_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=in_n[:, None] & in_k[None, :], other=0)
        acc += widen(w) * x[None, :]
    scale = tl.load(s_ptr + rn, mask=in_n, other=0.0)
    y = tl.sum(acc, axis=1) * scale
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=in_n)


def gemv_config(M: int, N: int, K: int) -> dict:
    """Tile sizes for an (M rows) x (N x K int8) product. One row: the row kernel (ROW), BLOCK_N
    output rows per program. More: BLOCK_M covers the rows (one weight pass for M <= 64; tl.dot
    needs >= 16), BLOCK_N small enough that a d20 layer's narrowest matrix (N = 1280) still
    spreads over ~80 programs, BLOCK_K a 128-byte run of int8 per weight row."""
    if M == 1:   # the fastest tiles of bench_int8 --sweep at d20's matrices (H200, CHANGELOG_GB10.md)
        block_n, block_k, warps = (1, 512, 4) if N <= 2048 else (2, 512, 2) if N <= 8192 else (8, 256, 4)
        return {"ROW": True, "BLOCK_N": block_n, "BLOCK_K": min(block_k, max(16, triton.next_power_of_2(K))),
                "num_warps": warps, "num_stages": 3}
    block_m = max(16, min(GEMV_MAX_ROWS, triton.next_power_of_2(M)))
    block_n = 16 if N <= 8192 else 32
    block_k = 128 if K >= 128 else max(16, triton.next_power_of_2(K))
    warps = 4 if block_m <= 32 else 8
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": 4}


def launch(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """y (M, N) in x2's dtype = (x2 @ q.T) * scale; x2 (M, K) with a unit last stride, q (N, K)
    int8 contiguous, scale (N,) float32. `config` overrides gemv_config's tiles (bench_int8 --sweep)."""
    M, K = x2.shape
    N = q.shape[0]
    y = torch.empty((M, N), device=x2.device, dtype=x2.dtype)
    cfg = dict(config or gemv_config(M, N, K))
    if cfg.pop("ROW", False):
        assert M == 1
        _int8_gemv_row_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](x2, q, scale, y, N, K, q.stride(0), **cfg)
        return y
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _int8_gemv_kernel[grid](x2, q, scale, y, M, N, K, x2.stride(0), q.stride(0), y.stride(0),
                            IEEE=x2.dtype == torch.float32, **cfg)
    return y


@functools.cache
def register() -> None:
    """Registers `nanochat::int8_gemv` (once; quantize._kernel_for calls it when a model is
    quantised, so a compiled step only ever sees torch.ops.nanochat.int8_gemv: registering inside
    a trace would break the graph)."""
    @torch.library.custom_op("nanochat::int8_gemv", mutates_args=())
    def int8_gemv_op(x2: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return launch(x2, q, scale)

    @int8_gemv_op.register_fake
    def _(x2, q, scale):
        return x2.new_empty((x2.shape[0], q.shape[0]))


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., K) x (N, K) int8 -> (..., N) in x's dtype, through the kernel (the caller checks that
    x has at most GEMV_MAX_ROWS rows and lives where Triton runs, and has called register())."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return torch.ops.nanochat.int8_gemv(x2, q, scale).view(*x.shape[:-1], q.shape[0])
