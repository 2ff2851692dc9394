"""The fp8 q / k projections and their QK-norm + RoPE as one autograd function (`--kernel triton`
with native fp8 layers).

Why: in the fp8 step the gradient of c_q's and c_k's outputs comes out of the QK-norm + RoPE
backward (fused_norm's one-pass Triton kernel), and the projection's fp8 backward then read it
once more only for its abs-max, the scale of its fp8 cast: 40 passes of ~73 us per d20 micro-batch
on an H100 (2.9 ms; the fp8 profile in CHANGELOG_GB10.md). Here the rotary kernel returns that
abs-max while the gradient is in registers. Same numbers as Fp8Linear ('save' mode) followed by
rotary_norm: the same casts, scales, GEMMs and float32 norm math.

`qkv_projection(attn, x, cos, sin)` is the attention's hook (GPT.set_qkv_projection): q and k through
`proj_rotary_norm(linear, x, cos, sin, heads, rotary_norm)`, fused for a native Fp8Linear in 'save'
mode while training, otherwise `rotary_norm(linear(x).view(B, T, heads, D), cos, sin)`; or, with
`bf16_gemm` for plain bf16 layers, nanochat/triton_qk.py's q/k/v op (the rotary norm in the GEMM's
epilogue).
"""

from __future__ import annotations

import torch

from nanochat import triton_qk
from nanochat.fused_norm import trig_tables
from nanochat.gpt import rotary_norm_forward
from nanochat.precision import (E4M3_MAX, Fp8Linear, _fp8_forward, _fp8_fused_backward, fp8_cast_transpose,
                                fp8_scale)


class _Fp8ProjRotaryNorm(torch.autograd.Function):
    """norm(rotate(x @ w.T viewed as heads)) with x, w in e4m3 (precision._Fp8MatmulFusedTranspose's
    forward), saving the fp8 copies the weight gradient needs, the output and 1/rms."""

    @staticmethod
    def forward(ctx, x, weight, cos, sin, shape, grad_dtype):
        # x (rows, C) contiguous, rows % 16 == 0; shape = (B, T, heads, D); cos / sin (1, T, 1, D/2)
        x_scale = fp8_scale(x, E4M3_MAX)
        x_q, x_qt = fp8_cast_transpose(x, x_scale, False)
        y, w_q, w_inv = _fp8_forward(ctx, x_q, x_scale, weight, grad_dtype, x.dtype)
        out, rstd = rotary_norm_forward(y.view(shape), cos, sin)
        ctx.save_for_backward(x_qt, x_scale, w_q, w_inv, out, rstd, cos, sin)
        return out

    @staticmethod
    def backward(ctx, dout):
        x_qt, x_scale, w_q, w_inv, out, rstd, cos, sin = ctx.saved_tensors
        dy, amax = torch.ops.nanochat.rotary_norm_bwd_amax(dout, out.contiguous(), rstd.contiguous(),
                                                            *trig_tables(cos, sin))
        rows = dy.shape[0] * dy.shape[1]
        grad_x, grad_w, _ = _fp8_fused_backward(ctx, dy.view(rows, -1), lambda: x_qt, x_scale, w_q, w_inv,
                                                grad_amax=amax)
        return grad_x, grad_w, None, None, None, None


def fusable(linear: torch.nn.Module, x: torch.Tensor) -> bool:
    """Whether `linear(x)` would run Fp8Linear's fused-transpose ('save') fp8 matmul."""
    return (isinstance(linear, Fp8Linear) and linear.wgrad_mode == "save" and linear.bias is None
            and torch.is_grad_enabled() and (x.numel() // x.shape[-1]) % 16 == 0)


def qkv_projection(attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, bf16_gemm: bool = False):
    """GPT.set_qkv_projection's hook: (q, k, v, None) of attention module `attn` for x (B, T, C), q
    and k through proj_rotary_norm ((B, T, heads, D), normed), v = c_v(x). With `bf16_gemm`
    (kernels.build_qkv_projection after triton_qk's probe passed) plain bf16 layers run
    triton_qk.qkv_rotary_norm: the same values with q's and k's head dimension in one
    interleaved order (triton_qk's docstring), and the value-embedding gate's logits."""
    if bf16_gemm and triton_qk.fusable_qkv(attn, x):
        return triton_qk.qkv_rotary_norm(attn, x, cos, sin)
    q = proj_rotary_norm(attn.c_q, x, cos, sin, attn.n_head, attn.rotary_norm)
    k = proj_rotary_norm(attn.c_k, x, cos, sin, attn.n_kv_head, attn.rotary_norm)
    return q, k, attn.c_v(x), None


def proj_rotary_norm(linear, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, rotary_norm):
    """rotary_norm(linear(x).view(B, T, heads, D), cos, sin), with the fp8 backward's gradient scale
    taken from the rotary kernel when `fusable`. x (B, T, C); returns (B, T, heads, D)."""
    B, T, C = x.shape
    if not fusable(linear, x):
        return rotary_norm(linear(x).view(B, T, heads, -1), cos, sin)
    if not torch.compiler.is_compiling():
        from nanochat.fused_norm import register
        register()   # the rotary ops (under compile they already exist)
    shape = (B, T, heads, linear.weight.shape[0] // heads)
    return _Fp8ProjRotaryNorm.apply(x.reshape(B * T, C).contiguous(), linear.weight, cos, sin, shape,
                                    linear.grad_dtype)
