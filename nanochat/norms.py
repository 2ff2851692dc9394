"""RMSNorm and the QK-norm + RoPE of attention: their float32 math and the autograd functions that
save only their outputs (and a float32 1/rms column), shared by gpt.py, fused_norm.py, fp8_qk.py
and triton_qk.py (gpt.py re-exports every name here).

Math dtype: float32, or float64 for float64 inputs (the tests' references); eps is F.rms_norm's
default, the math dtype's epsilon, so forward values match it exactly. RoPE rotates the two
halves of the head dimension (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin), base ROTARY_BASE.
"""

from __future__ import annotations

import torch

ROTARY_BASE = 10000.0

def _rms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) in x's dtype, 1/rms(x) in the math dtype: float32, or float64 for float64 x).
    eps is F.rms_norm's default, the math dtype's epsilon, so forward values match it exactly."""
    math_dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(math_dtype)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + torch.finfo(math_dtype).eps)
    return (xf * rstd).to(x.dtype), rstd


def _rms_backward(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """dL/dx of y = x * rstd(x), written with the output: dx = rstd * (dy - y * mean(dy * y))."""
    dyf, yf = dy.to(rstd.dtype), y.to(rstd.dtype)
    return rstd * (dyf - yf * (dyf * yf).mean(-1, keepdim=True))


class _RMSNorm(torch.autograd.Function):
    """Parameter-free RMSNorm that saves its output and 1/rms, not its input.

    Why: the output is saved anyway (it is the next matmul's input, kept for that weight's
    gradient), so backward needs nothing more than a (.., 1) float32 column. Through F.rms_norm
    the compile partitioner kept the input as well: one more (B, T, C) tensor per norm, 2 per
    layer (tests/test_gpt.py probes what it saves). With _RotaryNorm: 12.4 GiB less peak memory
    at d20, batch 32 x 2048, on an H100 (CHANGELOG_GB10.md section 7).
    """

    @staticmethod
    def forward(ctx, x):
        y, rstd = _rms(x)
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return _rms_backward(dy, y, rstd).to(dy.dtype)


def rotary_norm_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(norm(apply_rotary(x)) in x's dtype, 1/rms): rotary_norm's forward math, in float32
    (float64 for float64 x). Shared with fp8_qk's fused projection."""
    math_dtype = torch.promote_types(x.dtype, torch.float32)
    y, rstd = _rms(apply_rotary(x.to(math_dtype), cos.to(math_dtype), sin.to(math_dtype)))
    return y.to(x.dtype), rstd


class _RotaryNorm(torch.autograd.Function):
    """norm(apply_rotary(x, cos, sin)) saving only its output and 1/rms (the QK-norm of q and k).

    The rotation is orthogonal, so its backward is the inverse rotation of the norm's gradient;
    the output is what attention saves anyway. The plain chain kept the rotated, un-normed q and k
    too (2 more (B, T, C) tensors per layer)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        y, rstd = rotary_norm_forward(x, cos, sin)
        ctx.save_for_backward(y, rstd, cos, sin)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd, cos, sin = ctx.saved_tensors
        dr = _rms_backward(dy, y, rstd)
        return apply_rotary(dr, cos.to(dr.dtype), -sin.to(dr.dtype)).to(dy.dtype), None, None


def norm(x: torch.Tensor) -> torch.Tensor:
    return _RMSNorm.apply(x)


def plain_mix_norm(r: torch.Tensor, x0: torch.Tensor, lam: torch.Tensor, mu: torch.Tensor,
                   add: torch.Tensor | None = None):
    """A block's input and its norm: s = lam * r + mu * x0, (s, norm(s)), where r is the previous
    block's residual stream plus `add` (its MLP output) when given. The default GPT.mix_norm;
    --kernel triton installs nanochat/fused_norm.py's op, which needs less memory."""
    if add is not None:
        r = r + add
    # 0-dim fp32 scalars times a bf16 tensor stay bf16 (0-dim operands do not promote).
    s = lam * r + mu * x0
    return s, norm(s)


def rotary_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """norm(apply_rotary(x, cos, sin)), computed in float32 (float64 for float64 x), saving only
    its output for backward."""
    return _RotaryNorm.apply(x, cos, sin)


def rotary_tables(seq_len: int, head_dim: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin of shape (1, seq_len, 1, head_dim // 2), broadcasting over (B, T, H, D/2)."""
    inv_freq = ROTARY_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (x1, x2) halves of the head dim; x (B, T, H, D), cos/sin already in x's dtype."""
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)
