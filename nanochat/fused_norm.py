"""The fused residual mix + RMSNorm at the start of every block, and the QK-norm + RoPE with a
one-pass backward (`--kernel triton`).

Each block begins with s = resid_lambdas[i] * r + x0_lambdas[i] * x0 and y = norm(s) (gpt.py,
`plain_mix_norm`). Through plain autograd the compiled graph keeps r, the previous block's
output, for one reason: resid_lambdas' gradient sum(dL/ds * r). That is one (B, T, C) tensor per
layer, 3.1 GiB at d20 with batch 32 x 2048. This op keeps only what backward needs anyway: y
(the q/k/v matmuls save it as their input), 1/rms(s) (a float32 column) and x0 (one tensor shared
by all layers), and rebuilds the rest, since s = y / rstd:

    dL/dx0_lambda = sum(g * x0),    dL/dresid_lambda = sum(g * r) = (sum(g * s) - mu * sum(g * x0)) / lam

with g = dL/ds (the residual path plus the RMSNorm backward). Every other gradient is computed
as the plain path computes it; the rebuilt s carries y's rounding (2^-9 relative per element in
bf16) into resid_lambdas' gradient only, a sum over B*T*C products in which it averages out
(tests/test_fused_norm.py bounds it against float64). With lam exactly 0, r cannot be rebuilt and
that gradient is returned as 0 (the parameters start at 1; Adam steps do not land on exact 0).

r arrives in two parts, the previous block's residual stream and its MLP output (`add`), and the
op sums them (rounded to the compute dtype, as a separate add would store it): outside a custom
op inductor fuses that add into the norm, but it cannot fuse into this one, so on its own it was
a pass per layer that wrote r and this op read it back (~4 ms per d20 micro-batch on the H100
profile, CHANGELOG_GB10.md session 30). Both parts get the same gradient tensor. Likewise x0,
which every block mixes in: plain autograd writes each block's dL/dx0 and sums them with an add
per layer, so GPT passes x0 through the op instead (`x0_chain`, `_MixNormChain`) and the backward
kernel adds its share into the sum the later blocks handed back.

On CUDA (or under TRITON_INTERPRET=1) the forward and backward are one Triton pass each
(triton_kernels.mix_norm_fwd_triton / _bwd_triton); elsewhere `mix_norm_torch` and
`mix_norm_bwd_torch` run the same math. Both are torch.library custom ops (registered on first
use), so torch.compile keeps one graph around them. The two scalars travel as one stacked (2,)
tensor: inductor requires custom-op inputs 16-byte aligned, which resid_lambdas[i] (a 0-dim view
at offset i) is not.
"""

from __future__ import annotations

import functools

import torch

from nanochat.gpt import _RotaryNorm, _rms, _rms_backward, apply_rotary   # the plain path's math, shared
from nanochat.kernels import _use_triton       # CUDA, or the Triton interpreter

OP_NAMESPACE = "nanochat"


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)   # float32, or float64 in tests


def mix_norm_torch(r, x0, lam_mu, add=None):
    """(s, y, rstd) as triton_kernels.mix_norm_fwd_triton computes them; r, x0 (and add) (N, C),
    lam_mu = (lam, mu) a (2,) tensor."""
    if add is not None:
        r = r + add   # rounded to r's dtype, as the kernel does
    m = _math_dtype(r.dtype)
    lam, mu = lam_mu.to(m).unbind()
    s = (lam * r.to(m) + mu * x0.to(m)).to(r.dtype)
    y, rstd = _rms(s)
    return s, y, rstd


def mix_norm_bwd_torch(gs, gy, y, rstd, x0, lam_mu, gx0_acc=None):
    """(dL/dr, dL/dx0 (+ gx0_acc), partials (1, 2): sum(g * s), sum(g * x0)); same math as the
    Triton kernel."""
    m = rstd.dtype
    lam, mu = lam_mu.to(m).unbind()
    g = gs.to(m) + _rms_backward(gy, y, rstd)
    part = torch.stack(((g * y.to(m) / rstd).sum(), (g * x0.to(m)).sum()))[None]
    gx0 = (mu * g).to(x0.dtype) if gx0_acc is None else (gx0_acc.to(m) + mu * g).to(x0.dtype)
    return (lam * g).to(gs.dtype), gx0, part


def scalar_grads(part: torch.Tensor, lam_mu: torch.Tensor) -> torch.Tensor:
    """(dL/dlam, dL/dmu) as a (2,) tensor from the per-row partials (rows, 2) of sum(g * s) and
    sum(g * x0)."""
    g_s, g_mu = part.sum(0).unbind()
    lam, mu = lam_mu.to(g_s.dtype).unbind()
    live = lam != 0
    g_lam = torch.where(live, (g_s - mu * g_mu) / torch.where(live, lam, 1.0), 0.0)
    return torch.stack((g_lam, g_mu)).to(lam_mu.dtype)


@functools.cache
def _ops():
    """Register the forward and backward custom ops once, on first use."""

    @torch.library.custom_op(f"{OP_NAMESPACE}::mix_norm", mutates_args=())
    def mix_norm_op(r: torch.Tensor, x0: torch.Tensor, lam_mu: torch.Tensor,
                    add: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if _use_triton(r):
            from nanochat.triton_kernels import mix_norm_fwd_triton
            return mix_norm_fwd_triton(r, x0, lam_mu, torch.finfo(torch.float32).eps, add)
        return mix_norm_torch(r, x0, lam_mu, add)

    @mix_norm_op.register_fake
    def _(r, x0, lam_mu, add=None):
        return (torch.empty_like(r), torch.empty_like(r),
                r.new_empty((r.shape[0], 1), dtype=_math_dtype(r.dtype)))

    @torch.library.custom_op(f"{OP_NAMESPACE}::mix_norm_bwd", mutates_args=())
    def mix_norm_bwd_op(gs: torch.Tensor, gy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor,
                        x0: torch.Tensor, lam_mu: torch.Tensor, gx0_acc: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if _use_triton(gs):
            from nanochat.triton_kernels import mix_norm_bwd_triton
            gr, gx0, part = mix_norm_bwd_triton(gs, gy, y, rstd, x0, lam_mu, gx0_acc)
        else:
            gr, gx0, part = mix_norm_bwd_torch(gs, gy, y, rstd, x0, lam_mu, gx0_acc)
        return gr, gx0, scalar_grads(part, lam_mu)

    @mix_norm_bwd_op.register_fake
    def _(gs, gy, y, rstd, x0, lam_mu, gx0_acc=None):
        return torch.empty_like(gs), torch.empty_like(x0), torch.empty_like(lam_mu)

    def setup_context(ctx, inputs, output):
        _r, x0, lam_mu, add = inputs
        _s, y, rstd = output
        ctx.mark_non_differentiable(rstd)
        ctx.has_add = add is not None
        ctx.save_for_backward(y, rstd, x0, lam_mu)

    def backward(ctx, gs, gy, _g_rstd):
        y, rstd, x0, lam_mu = ctx.saved_tensors
        gr, gx0, gscalars = torch.ops.nanochat.mix_norm_bwd(gs.contiguous(), gy.contiguous(), y, rstd, x0, lam_mu)
        # r and add enter only through their sum: one gradient serves both (no copy)
        return gr, gx0, gscalars, gr if ctx.has_add else None

    mix_norm_op.register_autograd(backward, setup_context=setup_context)
    return torch.ops.nanochat.mix_norm


def register() -> None:
    """Register the ops now (kernels.build_mix_norm calls it before anything is compiled)."""
    _ops()
    _rotary_ops()


class _MixNormChain(torch.autograd.Function):
    """The mix_norm op with x0 passed through it: the next block takes its x0 from this block's
    output, so the gradient that the later blocks gave x0 arrives here (gx0_next) and the
    backward kernel adds this block's share into it. Plain autograd instead writes every
    block's dL/dx0 and sums them with a separate add per layer (one (B, T, C) write and two
    reads more per layer)."""

    @staticmethod
    def forward(ctx, r, x0, lam_mu, add):
        s, y, rstd = torch.ops.nanochat.mix_norm(r, x0, lam_mu, add)
        ctx.save_for_backward(y, rstd, x0, lam_mu)
        ctx.has_add = add is not None
        ctx.set_materialize_grads(False)   # the last block's x0 output has no user: None, not zeros
        return s, y, x0

    @staticmethod
    def backward(ctx, gs, gy, gx0_next):
        y, rstd, x0, lam_mu = ctx.saved_tensors
        gs, gy = (torch.zeros_like(y) if g is None else g.contiguous() for g in (gs, gy))
        gx0_next = None if gx0_next is None else gx0_next.contiguous()
        gr, gx0, gscalars = torch.ops.nanochat.mix_norm_bwd(gs, gy, y, rstd, x0, lam_mu, gx0_next)
        return gr, gx0, gscalars, gr if ctx.has_add else None


def mix_norm(r: torch.Tensor, x0: torch.Tensor, lam: torch.Tensor, mu: torch.Tensor,
             add: torch.Tensor | None = None, *, x0_chain: bool = False):
    """(s, norm(s)) with s = lam * (r + add) + mu * x0: GPT.mix_norm's contract
    (gpt.plain_mix_norm); r, add and x0 (..., C) in the compute dtype, lam and mu 0-dim float32
    parameters. Taking the previous block's MLP output as `add` saves the separate residual-add
    pass (one (B, T, C) write and read per layer). x0_chain=True returns (s, norm(s), x0_next):
    the x0 the next block must take, through which the x0 gradients accumulate in the backward
    kernel (_MixNormChain)."""
    if not torch.compiler.is_compiling():
        _ops()   # registered on first eager use; under compile it already exists
    c = r.shape[-1]
    args = (r.reshape(-1, c).contiguous(), x0.reshape(-1, c).contiguous(), torch.stack((lam, mu)),
            None if add is None else add.reshape(-1, c).contiguous())
    if x0_chain:
        s, y, x0_next = _MixNormChain.apply(*args)
        return s.view(r.shape), y.view(r.shape), x0_next.view(x0.shape)
    s, y, _ = torch.ops.nanochat.mix_norm(*args)
    return s.view(r.shape), y.view(r.shape)


mix_norm.chains_x0 = True   # GPT.set_mix_norm: this fn takes x0_chain=True


# --------------------------------------------------------------------------------------------
# QK-norm + RoPE: gpt._RotaryNorm with its backward as one Triton pass
# --------------------------------------------------------------------------------------------
# Compiled, the plain backward (the RMSNorm backward, then the inverse rotation) is one inductor
# kernel per tensor at ~55% of the H100's bandwidth: 0.59 ms per layer for q and k at d20, batch
# 32 x 2048 (CHANGELOG_GB10.md). The forward stays the plain one (inductor fuses it with its
# neighbours), and so does every number: the op runs _RotaryNorm.backward's float32 math.

def rotary_norm_bwd_torch(dy, y, rstd, cos, sin):
    """_RotaryNorm.backward's math on (B, T, H, D) tensors; cos / sin (T, D/2)."""
    dr = _rms_backward(dy, y, rstd)
    c, s = cos[None, :, None, :].to(dr.dtype), sin[None, :, None, :].to(dr.dtype)
    return apply_rotary(dr, c, -s).to(dy.dtype)


@functools.cache
def _rotary_ops():
    @torch.library.custom_op(f"{OP_NAMESPACE}::rotary_norm_bwd", mutates_args=())
    def rotary_norm_bwd_op(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> torch.Tensor:
        if _use_triton(dy) and rstd.dtype == torch.float32 and y.shape[-1] & (y.shape[-1] - 1) == 0:
            from nanochat.triton_kernels import rotary_norm_bwd_triton
            return rotary_norm_bwd_triton(dy if dy.stride(-1) == 1 else dy.contiguous(), y, rstd, cos, sin)
        return rotary_norm_bwd_torch(dy, y, rstd, cos, sin)

    @rotary_norm_bwd_op.register_fake
    def _(dy, y, rstd, cos, sin):
        return torch.empty(y.shape, dtype=dy.dtype, device=y.device)

    @torch.library.custom_op(f"{OP_NAMESPACE}::rotary_norm_bwd_amax", mutates_args=())
    def rotary_norm_bwd_amax_op(dy: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, cos: torch.Tensor,
                                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, max |dx| as a 0-dim float32): the fp8 q/k projections' backward (fp8_qk.py) takes
        its gradient scale from here instead of reading dx once more."""
        if _use_triton(dy) and rstd.dtype == torch.float32 and y.shape[-1] & (y.shape[-1] - 1) == 0:
            from nanochat.triton_kernels import rotary_norm_bwd_triton
            return rotary_norm_bwd_triton(dy if dy.stride(-1) == 1 else dy.contiguous(), y, rstd, cos, sin,
                                          with_amax=True)
        dx = rotary_norm_bwd_torch(dy, y, rstd, cos, sin)
        return dx, dx.abs().amax().float()

    @rotary_norm_bwd_amax_op.register_fake
    def _(dy, y, rstd, cos, sin):
        return (torch.empty(y.shape, dtype=dy.dtype, device=y.device),
                torch.empty((), dtype=torch.float32, device=y.device))

    return torch.ops.nanochat.rotary_norm_bwd


class _RotaryNormOneBwd(_RotaryNorm):
    """_RotaryNorm (same forward, same saved tensors) whose backward is the one-pass op."""

    @staticmethod
    def backward(ctx, dy):
        y, rstd, cos, sin = ctx.saved_tensors
        dx = torch.ops.nanochat.rotary_norm_bwd(dy, y.contiguous(), rstd.contiguous(), *trig_tables(cos, sin))
        return dx, None, None


def trig_tables(cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
    """rotary_tables' (1, T, 1, D/2) cos / sin as the (T, D/2) float32 contiguous tables the
    backward ops take."""
    return [t.reshape(-1, t.shape[-1]).float().contiguous() for t in (cos, sin)]


def rotary_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """gpt.rotary_norm's contract (x (B, T, H, D), cos / sin (1, T, 1, D/2)) with the one-pass
    backward (GPT.set_rotary_norm)."""
    if not torch.compiler.is_compiling():
        _rotary_ops()
    return _RotaryNormOneBwd.apply(x, cos, sin)
