"""q / k / v projections with RoPE + QK-norm in the GEMM's epilogue (`--kernel triton`, bf16).

Why: after c_q and c_k, the QK-norm + RoPE forward was a pass of its own that read q and k and
wrote them again: 5.9 ms per d20 micro-batch on an H100 (profile_training --accum 16, CHANGELOG
session 28), with nothing else to fuse it into once the projections are cuBLAS calls. Here the
projection is triton_mlp's persistent TMA GEMM, and each head is rotated and normalised on the
float32 accumulator before the one store.

What keeps that epilogue inside registers: the weight's rows are interleaved per head, rotation
pair j at columns (2j, 2j + 1) instead of (j, j + D/2), so the two halves of a pair sit in
adjacent accumulator columns, which one thread holds. The output keeps that order. Attention
only takes dot products over the head dimension (q . k), which one permutation applied to both q
and k leaves unchanged, and v is not permuted, so the attention output is the same. q and k come
out of one op, so they cannot take different paths.

Backward: the one-pass rotary kernel in its paired mode for q and k, then cuBLAS against the
interleaved weights (autograd maps their gradients back through the permutation). v's
projection (cuBLAS both ways) is in the same op so that the three input gradients are summed by
the GEMMs themselves (beta = 1), not by a separate pass over three (B, T, C) tensors (~0.22 ms
per d20 layer on an H100).

`qkv_rotary_norm(attn, x, cos, sin)` -> (q, k, v), q / k (B, T, heads, D) normed in the interleaved
order. CPU (and TRITON_INTERPRET=1 for the kernel) run the same math in torch, so tests compare the
whole model with and without it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanochat.triton_mlp import GemmGpu, launch_gpu, tile_acc, tile_offsets, tile_set
from nanochat.weight_cache import weight_as, weight_or_copy

EPS = float(torch.finfo(torch.float32).eps)   # gpt._rms's eps for float32 math
MAX_HEAD_DIM = 256   # a tile covers whole heads; the widest tile is 256 columns


def _set_blocks(nargs):
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps), tiles that hold whole heads (BLOCK_N a multiple of D;
# pruned per D below), one set per shared-memory class as triton_mlp's (tile_set). H100, 65536 x
# 1280 x 1280 with bf16 tables (ms; cuBLAS alone 0.293, cuBLAS + the compiled rotary pass 0.433):
# 128x256x64/3 0.341, 128x256x32/4 0.357, 128x128x64/4 0.386, 256x128x64/3 0.384. Small: what fits
# GB10's 101,376 bytes per block (44-92 KB: the stages, the output tile, the tables' layout
# conversion; tests/test_triton_aot.py), not measured on a GB10.
_TILES = {
    "large": ((128, 256, 64, 3, 8), (128, 256, 32, 4, 8), (128, 128, 64, 4, 8), (256, 128, 64, 3, 8),
              (64, 128, 64, 2, 4)),
    "small": ((128, 128, 64, 2, 8), (128, 128, 32, 4, 8), (128, 128, 32, 3, 8), (64, 256, 32, 3, 8),
              (64, 128, 64, 4, 4), (64, 128, 64, 3, 4), (64, 128, 64, 2, 4)),
}


def _configs(tiles: str):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_stages=st, num_warps=w, pre_hook=_set_blocks) for bm, bn, bk, st, w in _TILES[tiles]]


def _whole_heads(configs, named_args, **kwargs):
    head_dim = 2 * kwargs["HALF"]
    return [c for c in configs if c.kwargs["BLOCK_N"] % head_dim == 0]


@triton.jit
def _mm_rotary_norm_kernel(a_desc, b_desc, c_desc, cos_ptr, sin_ptr, rstd_ptr, M, N, K, T, eps,
                           NUM_PROGRAMS: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # out = norm(rotate(a @ b.T)) per head of D = 2 * HALF columns, pairs adjacent (2j, 2j + 1);
    # rows are (b, t) with t = row % T; rstd (M, N / D) float32.
    NH: tl.constexpr = BLOCK_N // (2 * HALF)   # heads per tile
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGRAMS, flatten=True):
        off_m, off_n = tile_offsets(tile, n_m, n_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tile_acc(a_desc, b_desc, off_m, off_n, K, False, BLOCK_M, BLOCK_N, BLOCK_K)
        x1, x2 = tl.split(tl.reshape(acc, (BLOCK_M, NH, HALF, 2)))
        rows = off_m + tl.arange(0, BLOCK_M)
        trig = (rows % T)[:, None] * HALF + tl.arange(0, HALF)[None, :]
        cos = tl.load(cos_ptr + trig).to(tl.float32)[:, None, :]
        sin = tl.load(sin_ptr + trig).to(tl.float32)[:, None, :]
        r1 = x1 * cos + x2 * sin
        r2 = x2 * cos - x1 * sin
        rstd = tl.rsqrt((tl.sum(r1 * r1, 2) + tl.sum(r2 * r2, 2)) / (2 * HALF) + eps)   # (BLOCK_M, NH)
        out = tl.join(r1 * rstd[:, :, None], r2 * rstd[:, :, None])
        c_desc.store([off_m, off_n], tl.reshape(out, (BLOCK_M, BLOCK_N)).to(c_desc.dtype))
        heads = off_n // (2 * HALF) + tl.arange(0, NH)
        n_heads = N // (2 * HALF)
        tl.store(rstd_ptr + rows[:, None] * n_heads + heads[None, :], rstd,
                 mask=(rows[:, None] < M) & (heads[None, :] < n_heads))


_tuned = {tiles: triton.autotune(configs=_configs(tiles), key=["M", "N", "K", "HALF"],
                                 prune_configs_by={"early_config_prune": _whole_heads})(_mm_rotary_norm_kernel)
          for tiles in _TILES}


def mm_rotary_norm(a: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_len: int,
                   gpu: GemmGpu | None = None):
    """(out, rstd): out = norm(rotate(a @ w.T)) per head in a's dtype with rotation pairs
    adjacent, rstd (M, heads) float32. a (M, K) rows (b, t) with t = row % seq_len, w (N, K)
    interleaved weight rows; cos / sin (seq_len, D/2) contiguous give D (the model passes them in
    its compute dtype, as its plain rotary norm uses them: bf16 tables also halve the shared
    memory the kernel needs to bring them into the accumulator's layout, which lets the 128 x 256
    tile fit on an H100). The Triton kernel on CUDA and under TRITON_INTERPRET=1 (float32), else
    the same math in torch. `gpu`: its SMs and shared memory (triton_mlp.GemmGpu; default a's GPU);
    nanochat/triton_aot passes a target to record the CUDA launch from CPU tensors."""
    M, K = a.shape
    N, half = w.shape[0], cos.shape[1]
    assert w.shape[1] == K and N % (2 * half) == 0 and cos.shape == sin.shape == (seq_len, half)
    assert 2 * half <= MAX_HEAD_DIM and half & (half - 1) == 0 and M % seq_len == 0
    if not (a.is_cuda or gpu is not None or _interpreting()):
        return _mm_rotary_norm_torch(a, w, cos, sin)
    assert a.is_contiguous() and w.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    rstd = torch.empty((M, N // (2 * half)), dtype=torch.float32, device=a.device)
    if M == 0:
        return out, rstd
    descs = [TensorDescriptor.from_tensor(t, [1, 1]) for t in (a, w, out)]
    if a.is_cuda or gpu is not None:
        gpu = launch_gpu(a, gpu)

        def grid(meta):
            return (min(gpu.sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
        _tuned[tile_set(gpu)][grid](*descs, cos, sin, rstd, M, N, K, seq_len, EPS, NUM_PROGRAMS=gpu.sms, HALF=half)
    else:   # the interpreter: one small config, 3 programs (each walks several tiles)
        meta = dict(BLOCK_M=16, BLOCK_N=2 * half, BLOCK_K=16, GROUP_M=2)
        _set_blocks({"a_desc": descs[0], "b_desc": descs[1], "c_desc": descs[2], **meta})
        _mm_rotary_norm_kernel[(3,)](*descs, cos, sin, rstd, M, N, K, seq_len, EPS, NUM_PROGRAMS=3,
                                     HALF=half, **meta)
    return out, rstd


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pair_view(t: torch.Tensor, half: int):
    p = t.reshape(*t.shape[:-1], half, 2)
    return p[..., 0], p[..., 1]


def _mm_rotary_norm_torch(a, w, cos, sin):
    """mm_rotary_norm's math in torch (float32, or float64 for float64 a)."""
    math = torch.promote_types(a.dtype, torch.float32)
    half, T = cos.shape[1], cos.shape[0]
    y = (a.to(math) @ w.to(math).t()).view(-1, T, w.shape[0] // (2 * half), 2 * half)
    x1, x2 = _pair_view(y, half)
    c, s = cos.to(math)[None, :, None, :], sin.to(math)[None, :, None, :]
    r1, r2 = x1 * c + x2 * s, x2 * c - x1 * s
    rstd = torch.rsqrt((r1.square().sum(-1) + r2.square().sum(-1)) / (2 * half) + torch.finfo(math).eps)
    out = torch.stack((r1 * rstd[..., None], r2 * rstd[..., None]), -1).flatten(-2)
    return out.reshape(a.shape[0], -1).to(a.dtype), rstd.reshape(a.shape[0], -1)


def rotary_norm_bwd_paired(dy, y, rstd, cos, sin):
    """dL/d(a @ w.T) for mm_rotary_norm's output y (B, T, H, D) (dy any strides with unit stride
    on D), rstd (B, T, H, 1): the paired-mode rotary kernel on CUDA, torch elsewhere."""
    if dy.is_cuda:
        from nanochat.triton_kernels import rotary_norm_bwd_triton
        return rotary_norm_bwd_triton(dy if dy.stride(-1) == 1 else dy.contiguous(), y, rstd, cos, sin,
                                      paired=True)
    from nanochat.gpt import _rms_backward
    dr = _rms_backward(dy, y, rstd)
    d1, d2 = _pair_view(dr, cos.shape[1])
    c, s = cos.to(dr.dtype)[None, :, None, :], sin.to(dr.dtype)[None, :, None, :]
    return torch.stack((d1 * c - d2 * s, d2 * c + d1 * s), -1).flatten(-2).to(dy.dtype)


@functools.cache
def _ops():
    @torch.library.custom_op("nanochat::qkv_rotary_proj", mutates_args=())
    def fwd_op(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wg: torch.Tensor | None,
               cos: torch.Tensor, sin: torch.Tensor, hq: int, hkv: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        x2 = x.reshape(B * T, C).contiguous()   # a no-op for the norm's output
        q, rq = mm_rotary_norm(x2, wq, cos, sin, T)
        k, rk = mm_rotary_norm(x2, wk, cos, sin, T)
        v = torch.mm(x2, wv.t())
        # the value-embedding gate's logits from x's first channels (empty without a gate)
        g = x.new_empty((B * T, 0)) if wg is None else torch.mm(x2[:, :wg.shape[1]], wg.t())
        return (q.view(B, T, hq, -1), rq.view(B, T, hq, 1), k.view(B, T, hkv, -1), rk.view(B, T, hkv, 1),
                v.view(B, T, -1), g.view(B, T, -1))

    @fwd_op.register_fake
    def _(x, wq, wk, wv, wg, cos, sin, hq, hkv):
        B, T, _ = x.shape
        f32 = torch.float32
        return (x.new_empty((B, T, hq, wq.shape[0] // hq)), x.new_empty((B, T, hq, 1), dtype=f32),
                x.new_empty((B, T, hkv, wk.shape[0] // hkv)), x.new_empty((B, T, hkv, 1), dtype=f32),
                x.new_empty((B, T, wv.shape[0])), x.new_empty((B, T, 0 if wg is None else wg.shape[0])))

    @torch.library.custom_op("nanochat::qkv_rotary_proj_bwd", mutates_args=())
    def bwd_op(dq_out: torch.Tensor, dk_out: torch.Tensor, dv: torch.Tensor, dg: torch.Tensor | None,
               x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, wg: torch.Tensor | None,
               q: torch.Tensor, rq: torch.Tensor, k: torch.Tensor, rk: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin = cos.float(), sin.float()
        dq = rotary_norm_bwd_paired(dq_out, q, rq, cos, sin).view(-1, wq.shape[0])
        dk = rotary_norm_bwd_paired(dk_out, k, rk, cos, sin).view(-1, wk.shape[0])
        dv = dv.reshape(-1, wv.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        # the three input gradients summed by the GEMMs (beta = 1), not by a pass over three tensors
        dx = torch.mm(dq, wq)
        dx.addmm_(dk, wk)
        dx.addmm_(dv, wv)
        dwg = x.new_empty((0,))
        if wg is not None and dg is not None:   # the gate's input gradient into its channels, in place
            dg = dg.reshape(-1, wg.shape[0])
            dx[:, :wg.shape[1]].addmm_(dg, wg)
            dwg = torch.mm(dg.t(), x2[:, :wg.shape[1]])
        return dx.view(x.shape), torch.mm(dq.t(), x2), torch.mm(dk.t(), x2), torch.mm(dv.t(), x2), dwg

    @bwd_op.register_fake
    def _(dq_out, dk_out, dv, dg, x, wq, wk, wv, wg, q, rq, k, rk, cos, sin):
        dwg = x.new_empty((0,)) if wg is None or dg is None else torch.empty_like(wg)
        return torch.empty_like(x), torch.empty_like(wq), torch.empty_like(wk), torch.empty_like(wv), dwg

    def setup_context(ctx, inputs, output):
        x, wq, wk, wv, wg, cos, sin, _hq, _hkv = inputs
        q, rq, k, rk, _v, _g = output
        ctx.mark_non_differentiable(rq, rk)
        ctx.has_gate = wg is not None
        ctx.save_for_backward(x, wq, wk, wv, wg, q, rq, k, rk, cos, sin)

    def backward(ctx, dq_out, _g_rq, dk_out, _g_rk, dv, dg):
        x, wq, wk, wv, wg, q, rq, k, rk, cos, sin = ctx.saved_tensors
        dx, dwq, dwk, dwv, dwg = torch.ops.nanochat.qkv_rotary_proj_bwd(
            dq_out, dk_out, dv, dg if ctx.has_gate else None, x, wq, wk, wv, wg, q, rq, k, rk, cos, sin)
        gate_grad = dwg if ctx.has_gate and dg is not None else None
        return dx, dwq, dwk, dwv, gate_grad, None, None, None, None

    fwd_op.register_autograd(backward, setup_context=setup_context)
    return fwd_op


def interleave(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """weight (H * D, C) with each head's rows reordered (j, j + D/2) -> (2j, 2j + 1)."""
    n, c = weight.shape
    return weight.view(n // head_dim, 2, head_dim // 2, c).transpose(1, 2).reshape(n, c)


def fusable(linear: torch.nn.Module, x: torch.Tensor, heads: int) -> bool:
    """Whether `linear(x)` (x (B, T, C)) can run as the fused projection: the model's own bias-free
    Linear (not a precision.py swap), a bf16 / fp16 CUDA input with grad enabled, whole heads of
    an even power-of-two size <= MAX_HEAD_DIM, TMA-aligned rows of the input and of the output
    (heads * D: at bf16 one kv head of D = 4 is an 8-byte row, which Triton's TensorDescriptor
    asserted on at the first step instead of the plain chain running)."""
    from nanochat.gpt import Linear
    n, c = linear.weight.shape
    d = n // heads
    return (type(linear) is Linear and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and torch.is_grad_enabled() and n % heads == 0 and 2 <= d <= MAX_HEAD_DIM and d & (d - 1) == 0
            and (c * x.element_size()) % 16 == 0 and (n * x.element_size()) % 16 == 0)


def fusable_qkv(attn: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether attention module `attn`'s q / k / v projections of x can run as qkv_rotary_norm."""
    from nanochat.gpt import Linear
    return (fusable(attn.c_q, x, attn.n_head) and fusable(attn.c_k, x, attn.n_kv_head)
            and type(attn.c_v) is Linear)


def qkv_rotary_norm(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k, v, gate logits) of attention module `attn` (GPT's CausalSelfAttention) for x (B, T, C):
    q and k norm(rotate(c(x))) per head as (B, T, heads, D) in the interleaved head order (module
    docstring), v = c_v(x) (B, T, Hkv * D), and in value-embedding layers ve_gate(x[..., :channels])
    (its input gradient then joins dx inside the GEMMs too), else None; cos / sin
    gpt.rotary_tables' (1, T, 1, D/2). The caller checks `fusable_qkv`."""
    if not torch.compiler.is_compiling():
        _ops()
    d = attn.head_dim
    wq, wk = (interleave(weight_or_copy(lin, x.dtype), d).to(x.dtype) for lin in (attn.c_q, attn.c_k))
    tables = [t.reshape(-1, t.shape[-1]).to(x.dtype).contiguous() for t in (cos, sin)]   # (T, D/2)
    from nanochat.gpt import Linear
    wg = weight_as(attn.ve_gate, x.dtype) if type(attn.ve_gate) is Linear else None
    q, _, k, _, v, g = torch.ops.nanochat.qkv_rotary_proj(x, wq, wk, weight_as(attn.c_v, x.dtype), wg, *tables,
                                                          attn.n_head, attn.n_kv_head)
    return q, k, v, (None if wg is None else g)


def register() -> None:
    """Register the custom ops before a model using them is compiled."""
    _ops()


_PROBED: dict[int, str | None] = {}


def probe(device: torch.device | str) -> str | None:
    """None when the fused projection compiles, launches and matches torch on `device` (a tiny
    real launch, once per device), else why not (the projections then stay cuBLAS + the
    compiled rotary pass)."""
    from nanochat.triton_mlp import _TritonError, available
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA GPU (device is {dev.type})"
    if not available(dev):
        return "needs compute capability >= 9 (TMA)"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        dev = torch.device("cuda", index)
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(256, 128, device=dev, generator=g).bfloat16()
        w = (torch.randn(256, 128, device=dev, generator=g) / 128**0.5).bfloat16()
        from nanochat.gpt import rotary_tables
        cos, sin = (t.reshape(64, -1).contiguous() for t in rotary_tables(64, 128, dev))
        try:
            got, got_rstd = mm_rotary_norm(a, w, cos, sin, 64)
            torch.cuda.synchronize(dev)
            want, want_rstd = _mm_rotary_norm_torch(a, w, cos, sin)
            err = max(((x.float() - y.float()).norm() / y.float().norm()).item()
                      for x, y in ((got, want), (got_rstd, want_rstd)))
            _PROBED[index] = None if err < 2e-2 else f"wrong result on this GPU (relative error {err:.3g})"
        except (RuntimeError, _TritonError) as exc:
            _PROBED[index] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return _PROBED[index]
