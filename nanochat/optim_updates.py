"""MuonAdamW's per-tensor update math, free of optimizer state bookkeeping and collectives:
Polar Express orthogonalisation, Muon's momentum + update (and NorMuon's per-neuron rescale), the
decoupled (cautious) weight decay step and AdamW's update. optim.py compiles these on CUDA (one
graph per shape) and feeds them 0-dim CPU tensors for every hyperparameter, so a schedule's new
value never recompiles them.
"""

from __future__ import annotations

import torch

# Polar Express (Amsel et al. 2025, arXiv 2505.16932) 5-step coefficients, as used by
# modded-nanogpt / nanochat; input pre-scaled by 1 / (1.02 * ||G||_F).
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Band of the output singular values after 5 steps (fp32), measured for inputs whose smallest
# singular value is >= ~0.004 * ||G||_F (e.g. random rectangular matrices, or a 64x64 matrix of
# condition number 100): [0.859, 1.141]. Smaller singular values come out smaller (a 1e-3
# condition number at 64x64 gives 0.42): Muon only needs them pushed up, not exactly to 1.
# tests/test_optim.py asserts this band.
ORTHO_SV_BAND = (0.85, 1.15)


def orthogonalize(G: torch.Tensor, steps: int = 5, scale: float = 1.0) -> torch.Tensor:
    """Approximate scale * U V^T of G (..., m, n) with Polar Express; bf16 on CUDA, fp32 elsewhere.

    Each step is X <- a X + B X with B = b A + c A^2, A = X X^T. B's sum runs inside its product's
    epilogue (baddbmm: beta * A + alpha * A @ A, accumulated in float32, rounded once; the (m, m)
    Gram matrix is the small operand), and `scale` rides on the last step's update, which
    inductor fuses into one pass with a X. On an H100 (compiled, d20's stacks: 80 x 1280^2 and
    2 x 20 x 1280 x 5120) the five steps take 26.1-26.4 ms vs 27.7-27.9 ms for the plain
    expressions; baddbmm for the X update too came out between (26.8-27.0 ms): ATen copies its
    input into the output before the product, as many bytes as the pass it replaces."""
    if not 1 <= steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"ns_steps: got {steps}; accepted: 1..{len(POLAR_EXPRESS_COEFFS)}")
    work = torch.bfloat16 if G.is_cuda else torch.float32
    X = G.float()
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)).to(work)
    lead, (m, n) = X.shape[:-2], X.shape[-2:]
    X = X.reshape(-1, m, n)  # bmm / baddbmm take exactly one batch dimension
    transposed = m > n
    if transposed:  # iterate on the wide orientation: the Gram matrix X X^T is the small one
        X = X.mT
    for i, (a, b, c) in enumerate(POLAR_EXPRESS_COEFFS[:steps]):
        s = scale if i == steps - 1 else 1.0
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = (a * s) * X + s * torch.bmm(B, X)
    return (X.mT if transposed else X).reshape(*lead, m, n)


def muon_update(grad, momentum_buffer, momentum, nesterov: bool, ns_steps: int, second_moment=None, beta2=None):
    """Momentum (in place on the fp32 buffer) + orthogonalisation + shape scale, for a (K, m, n)
    stack, then NorMuon's rescale when `second_moment` is given. `momentum` and `beta2` are 0-dim
    tensors. Returns the update in the orthogonalisation dtype."""
    grad = grad.to(momentum_buffer.dtype)
    momentum_buffer.mul_(momentum).add_(grad * (1 - momentum))
    g = grad * (1 - momentum) + momentum_buffer * momentum if nesterov else momentum_buffer
    scale = max(1.0, grad.size(-2) / grad.size(-1)) ** 0.5
    update = orthogonalize(g, ns_steps, scale)
    if second_moment is None:
        return update
    return normuon_rescale(update, second_moment, beta2)


def normuon_shape(stack_shape) -> tuple[int, ...]:
    """Shape of NorMuon's factored second moment for a (K, m, n) stack: one value per row of a
    tall-or-square matrix (K, m, 1), one per column of a wide one (K, 1, n)."""
    k, m, n = stack_shape
    return (k, m, 1) if m >= n else (k, 1, n)


def normuon_rescale(update, second_moment, beta2):
    """NorMuon (Li et al. 2025, arXiv 2510.05491): after orthogonalisation, divide each neuron's
    update (a row of a tall matrix, a column of a wide one) by the root of an EMA of its mean
    square, then restore the matrix's Frobenius norm. Orthogonalised updates have uneven
    per-neuron scales; this evens them out and keeps Muon's step size. `second_moment` (fp32,
    `normuon_shape`) is updated in place; `beta2` is a 0-dim tensor. An all-zero update (a
    padding slot of the distributed stack) stays zero."""
    u = update.float()
    reduce = -1 if second_moment.size(-1) == 1 else -2
    second_moment.mul_(beta2).add_(u.square().mean(dim=reduce, keepdim=True) * (1 - beta2))
    scaled = u * second_moment.clamp_min(1e-10).rsqrt()
    before = u.norm(dim=(-2, -1), keepdim=True)
    after = scaled.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10)
    return (scaled * (before / after)).to(update.dtype)


def muon_momentum_step(grad, momentum_buffer, momentum, nesterov: bool):
    """The momentum half of muon_update (in place on the buffer); returns the direction to orthogonalise."""
    grad = grad.to(momentum_buffer.dtype)
    momentum_buffer.mul_(momentum).add_(grad * (1 - momentum))
    return grad * (1 - momentum) + momentum_buffer * momentum if nesterov else momentum_buffer.clone()


def adamw_update(p, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, wd) -> None:
    """In-place AdamW on one tensor; step/lr/betas/eps/wd are 0-dim tensors."""
    grad = grad.to(exp_avg.dtype)
    p.mul_(1 - lr * wd)
    exp_avg.mul_(beta1).add_(grad * (1 - beta1))
    exp_avg_sq.mul_(beta2).add_(grad * grad * (1 - beta2))
    bias1 = 1 - beta1 ** step
    bias2 = 1 - beta2 ** step
    p.add_(exp_avg / ((exp_avg_sq / bias2).sqrt() + eps) * (-lr / bias1))


def muon_decay_step(p, u, lr, wd, cautious: bool) -> None:
    """p -= lr * (u + wd * p [* mask]) on one tensor (compiled on CUDA: one pass instead of ~8);
    lr and wd are 0-dim tensors."""
    u = u.to(p.dtype)
    decay = p * wd
    if cautious:  # decay only coordinates the update also shrinks (sign agreement)
        decay = decay * ((u * p) >= 0)
    p.sub_((u + decay) * lr)


def state_zeros(t: torch.Tensor) -> torch.Tensor:
    """Zeros for optimizer state shaped like t: fp32 for a bf16/fp16 t, t's dtype otherwise."""
    return torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32))
