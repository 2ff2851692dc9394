"""Loss kernel backends: `--kernel current | liger | triton`.

`build_loss_fn(name, device)` returns fn(hidden (N, C), weight (Vpad, C), targets (N,), softcap,
vocab_size, reduction, *, temperature=1.0) -> loss, which GPT.set_loss_fn installs. Targets use
ignore_index=-1; only the first `vocab_size` rows of the padded head are real (padding rows get zero
gradient). `temperature` T: the cross-entropy of softmax(softcap(logits) / T), the distribution the
sampler draws from (RL trains the log-probabilities of its rollouts at their temperature); every
backend takes it in its own fused pass, so T != 1 costs no more memory than T = 1 (no (N, V) float32
logits beside the backend's own).

- current: plain PyTorch, the model's default `cross_entropy_loss` (owned here): logits
           materialised in the compute dtype, softcap + cross-entropy saving only those logits
           and the row logsumexp; compiled together with the model. `current_loss` is the
           reference chain tests compare with.
- liger:   Liger-Kernel's LigerFusedLinearCrossEntropyLoss. It runs as an eager island
           (torch.compiler.disable) by default: its forward calls .item() and under
           torch.compile it returned a wrong loss when targets hold ignore_index (Liger PR #1338,
           still open for 0.8.5). `liger_inline=True` traces it instead (needs
           capture_scalar_outputs, which platform.apply_patches sets for --kernel liger).
           Liger has no temperature: softcap_c(x) / T == softcap_{c/T}(x / T), so it gets the
           hidden states / T and softcap c / T (one extra rounding of hidden in the compute dtype).
- triton:  the project's fused linear + softcap + cross-entropy. Rows are processed in chunks
           so the (N, V) logits never exist: per chunk one matmul gives (rows, V) logits, a
           Triton kernel (nanochat/triton_kernels.py) computes loss/lse with an online
           logsumexp and overwrites the chunk with dL/dlogits, and two matmuls accumulate
           grad_hidden and grad_weight (fp32). Gradients are computed in the forward when they
           are needed and the reduction is mean/sum (3 matmuls total, like the unfused loss);
           reduction="none" recomputes the chunk logits in backward with per-row scales.
           The whole thing is a torch.library custom op, so torch.compile keeps one graph.
           On CPU the same algorithm runs with a pure-torch row kernel (`ce_rows_torch`), or
           with the Triton kernels themselves under TRITON_INTERPRET=1.

The other ops `--kernel triton` fuses in the model (residual mix + RMSNorm, QK-norm + RoPE, the
ReLU^2 MLP, the q/k/v projections: `build_mix_norm`, `build_rotary_norm`, `build_mlp`,
`build_qkv_projection`) are built by nanochat/kernel_fusions.py and importable from here too.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import os
import re
from typing import Callable

import torch
import torch.nn.functional as F

from nanochat.errors import RequestError
from nanochat.kernel_fusions import (  # noqa: F401  (re-exported: the model's fused-op builders)
    _unaligned_mlp, build_mix_norm, build_mlp, build_qkv_projection, build_rotary_norm)

IGNORE_INDEX = -1
KERNELS = ("current", "liger", "triton")
REDUCTIONS = ("mean", "sum", "none")
LossFn = Callable[..., torch.Tensor]


# --------------------------------------------------------------------------------------------
# current: plain PyTorch
# --------------------------------------------------------------------------------------------

def _check_reduction(reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: got {reduction!r}; accepted: {'|'.join(REDUCTIONS)}")


def check_temperature(temperature) -> float:
    """The loss's `temperature` as a float: a finite number > 0 (T <= 0 or inf has no softmax;
    a bool is refused, not read as 1)."""
    ok = (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
          and math.isfinite(temperature) and temperature > 0)
    if not ok:
        raise ValueError(f"loss temperature: got {temperature!r}; accepted: a finite number > 0")
    return float(temperature)


def loss_takes_temperature(fn) -> bool:
    """Whether loss fn `fn` takes the `temperature` keyword (GPT.set_loss_fn records it)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):   # no signature to read (a builtin): assume the 6-argument contract
        return False
    return any(p.name == "temperature" or p.kind is p.VAR_KEYWORD for p in params)


def current_loss(hidden, weight, targets, softcap, vocab_size, reduction="mean", *, temperature=1.0):
    """Reference: logits in the compute dtype, upcast to fp32, softcap, / temperature, cross-entropy."""
    _check_reduction(reduction)
    temperature = check_temperature(temperature)
    logits = F.linear(hidden, weight[:vocab_size].to(hidden.dtype)).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:
        logits = logits / temperature
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction=reduction)


# --------------------------------------------------------------------------------------------
# the model's default loss (gpt.GPT.loss_fn until set_loss_fn replaces it)
# --------------------------------------------------------------------------------------------

def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 in tests


def _tempered(z: torch.Tensor, source: torch.Tensor, temperature: float) -> torch.Tensor:
    """z / temperature, in place unless z is `source` (the saved logits, which backward reads)."""
    if temperature == 1.0:
        return z
    return z / temperature if z is source else z.div_(temperature)


class _SoftcapCrossEntropy(torch.autograd.Function):
    """cross_entropy(softcap * tanh(logits.float() / softcap) / temperature, targets, ignore_index=-1).

    Same math as the plain F.cross_entropy chain, but it saves only the compute-dtype logits and
    the per-row logsumexp: the plain chain keeps two float32 (N, V) tensors for backward (tanh
    output and log_softmax; 17 GB at d20, batch 32 x 2048). Forward and backward are single fused
    passes under torch.compile. Eager (RL's policy gradient runs uncompiled) each float32 (N, V)
    tensor is built in place: backward holds two (tanh and the gradient) beside the saved logits,
    where the out-of-place chain held up to ~6 at once (peak of a CPU forward + backward at
    N = 256, V = 8192: 25.4 MiB, was 49.5). Every value is still the same operation on the same
    operands, so the results are bitwise those of the out-of-place chain.
    """

    @staticmethod
    def forward(ctx, logits, targets, softcap: float, reduction: str, temperature: float = 1.0):
        x = logits.to(_loss_dtype(logits))
        z = torch.div(x, softcap).tanh_().mul_(softcap) if softcap else x   # softcap 0: none, as current_loss
        del x
        z = _tempered(z, logits, temperature)
        lse = torch.logsumexp(z, dim=-1)
        valid = targets != -1
        # where, not clamp(min=0): a target below -1 (-100, another library's ignore_index) was
        # read as token 0, a finite wrong loss; gather refuses it (and ids >= vocab_size) instead
        target_z = z.gather(1, torch.where(valid, targets, 0)[:, None]).squeeze(1)
        del z
        losses = torch.where(valid, lse - target_z, 0.0)
        count = valid.sum()
        ctx.save_for_backward(logits, targets, lse, count)
        ctx.softcap, ctx.reduction, ctx.temperature = softcap, reduction, temperature
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / count if reduction == "mean" else total  # mean over kept tokens (NaN if none)

    @staticmethod
    def backward(ctx, grad):
        logits, targets, lse, count = ctx.saved_tensors
        x = logits.to(_loss_dtype(logits))
        dtype, softcap = x.dtype, ctx.softcap
        if softcap:
            t = torch.div(x, softcap).tanh_()
            g = t * softcap
        else:   # a buffer of its own: g is written in place below
            g = x.clone() if x is logits else x
        del x
        g = _tempered(g, logits, ctx.temperature)
        g.sub_(lse[:, None]).exp_()   # softmax(z)
        valid = targets != -1
        if torch.compiler.is_compiling():
            # - onehot(target) as a select: inductor fuses it into the one pointwise pass over (N, V),
            # where a scatter into g would make it store g, scatter, and read it back (3x the traffic)
            cols = torch.arange(g.size(1), device=g.device)
            g = torch.where(cols[None, :] == targets[:, None], g - 1.0, g)
        else:   # eager: p + (-1) at each kept row's target (ignored rows: + (-0) at column 0), in place
            g.scatter_add_(1, torch.where(valid, targets, 0)[:, None], -valid.to(dtype)[:, None])
        row_scale = valid.to(dtype) * grad  # grad: (N,) for "none", a scalar otherwise
        if ctx.reduction == "mean":   # all ignored: zero gradient like F.cross_entropy, not 0/0
            row_scale = row_scale / count.clamp(min=1)
        if ctx.temperature != 1.0:   # d(z / T) = dz / T
            row_scale = row_scale / ctx.temperature
        if softcap:
            g.mul_(t.mul_(t).neg_().add_(1.0))   # d/dx [c tanh(x / c)] = 1 - tanh^2
            del t
        return g.mul_(row_scale[:, None]).to(logits.dtype), None, None, None, None


def cross_entropy_loss(hidden, weight, targets, softcap: float, vocab_size: int, reduction: str, *,
                       temperature: float = 1.0):
    """Default loss: float32 softcap(hidden @ weight^T) / temperature over the real vocab, then
    cross-entropy.

    hidden (N, C) and weight (Vpad, C) arrive in the compute dtype; targets (N,) with -1 = ignore.
    The matmul runs in the compute dtype; the padding columns are dropped before the softcap.
    softcap 0 or None: no softcap (the same contract as current_loss and triton_loss).
    """
    _check_reduction(reduction)   # else any unknown name ("avg") silently returned the sum
    temperature = check_temperature(temperature)
    logits = F.linear(hidden, weight)[:, :vocab_size]
    return _SoftcapCrossEntropy.apply(logits, targets, float(softcap or 0.0), reduction, temperature)


# --------------------------------------------------------------------------------------------
# Row kernels: the pure-torch twin of nanochat/triton_kernels.py (same algorithm, CPU path)
# --------------------------------------------------------------------------------------------

def _capped(x: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return softcap * torch.tanh(x / softcap) if softcap else x


def ce_rows_torch(logits, targets, softcap, grad_scale, block_v: int = 8192, *, temperature: float = 1.0):
    """Same contract as triton_kernels.ce_rows_triton: online logsumexp over vocab blocks of
    softcap(logits) / temperature, optional in-place gradient."""
    rows, n_cols = logits.shape
    m = torch.full((rows,), -float("inf"), device=logits.device)
    s = torch.zeros(rows, device=logits.device)
    for start in range(0, n_cols, block_v):
        z = _capped(logits[:, start:start + block_v].float(), softcap) / temperature
        m_new = torch.maximum(m, z.amax(dim=1))
        shift = torch.where(m_new == -float("inf"), 0.0, m_new)   # the kernel's: no -inf - -inf = NaN
        s = s * torch.exp(m - shift) + torch.exp(z - shift[:, None]).sum(dim=1)
        m = m_new
    lse = m + torch.log(s)
    valid = targets != IGNORE_INDEX
    safe = torch.where(valid, targets, 0)
    z_t = _capped(logits.gather(1, safe[:, None]).squeeze(1).float(), softcap) / temperature
    loss = torch.where(valid, lse - z_t, 0.0)
    if grad_scale is not None:
        ce_grad_rows_torch(logits, targets, lse, grad_scale.expand(rows), softcap, block_v, temperature=temperature)
    return loss, lse


def ce_grad_rows_torch(logits, targets, lse, row_scale, softcap, block_v: int = 8192, *, temperature: float = 1.0):
    rows, n_cols = logits.shape
    valid = targets != IGNORE_INDEX
    # d(z / T) = dz / T: the temperature's factor goes into the row scale
    scale = torch.where(valid, row_scale.float().expand(rows) / temperature, 0.0)
    for start in range(0, n_cols, block_v):
        block = logits[:, start:start + block_v]
        z = _capped(block.float(), softcap)
        g = torch.exp(z / temperature - lse[:, None])
        cols = torch.arange(start, start + block.shape[1], device=logits.device)
        g = g - (cols[None, :] == targets[:, None]).float()
        if softcap:
            g = g * (1.0 - (z / softcap) ** 2)
        block.copy_(g * scale[:, None])


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _row_kernels(t: torch.Tensor):
    if _use_triton(t):
        from nanochat import triton_kernels as tk
        return tk.ce_rows_triton, tk.ce_grad_rows_triton
    return ce_rows_torch, ce_grad_rows_torch


# --------------------------------------------------------------------------------------------
# triton: chunked fused linear + cross-entropy
# --------------------------------------------------------------------------------------------

def default_chunk_rows(n_rows: int, vocab: int, budget_bytes: int = 512 * 2**20) -> int:
    """Rows per chunk so one bf16 (rows, V) logits chunk stays under `budget_bytes`."""
    rows = max(256, budget_bytes // (2 * vocab))
    rows = 1 << (rows.bit_length() - 1)   # a power of two keeps GEMM tiles full
    return max(1, min(n_rows, rows))


def _accumulate_wgrad(acc: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """acc (V, C) fp32 += g.T @ h without a (V, C) temporary where the platform allows."""
    if g.dtype == acc.dtype:
        acc.addmm_(g.t(), h)
    elif acc.is_cuda:   # addmm out_dtype (torch >= 2.8) accumulates bf16 products into fp32
        torch.addmm(acc, g.t(), h, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(torch.mm(g.t(), h).float())


def _check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    """The Triton row kernels read logits[row, target] unchecked: a target below -1 or >= vocab_size
    read other memory and gave a finite, wrong loss. CPU: a ValueError; CUDA: an asynchronous
    device assert (no host sync per step). Runs in the custom op's eager body, also under compile."""
    bad = ((targets < IGNORE_INDEX) | (targets >= vocab_size)).any()
    msg = f"loss targets: accepted -1 (ignored) or a token id in 0..{vocab_size - 1}"
    if not targets.is_cuda:
        if bad:
            raise ValueError(f"{msg}; got {targets[(targets < IGNORE_INDEX) | (targets >= vocab_size)][:4].tolist()}")
        return
    torch._assert_async(~bad, msg)


def _fused_forward(hidden, weight, targets, softcap, vocab_size, reduction, compute_grad, chunk_rows,
                   temperature=1.0):
    n, c = hidden.shape
    _check_targets(targets, vocab_size)
    w = weight[:vocab_size].to(hidden.dtype)
    rows_fn, _ = _row_kernels(hidden)
    loss_rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
    n_valid = (targets != IGNORE_INDEX).sum().float()
    if reduction == "mean":
        scale = (1.0 / n_valid).reshape(1)   # all-ignored -> inf -> nan loss, like F.cross_entropy
    else:
        scale = torch.ones(1, dtype=torch.float32, device=hidden.device)
    grad_h = torch.empty_like(hidden) if compute_grad else hidden.new_empty(0)
    grad_w = (torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device)
              if compute_grad else weight.new_empty(0, dtype=torch.float32))
    step = chunk_rows or default_chunk_rows(n, vocab_size)
    buf = torch.empty(min(step, n), vocab_size, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n, step):
        end = min(start + step, n)
        h = hidden[start:end]
        logits = buf[: end - start]
        torch.mm(h, w.t(), out=logits)
        loss_rows[start:end], lse[start:end] = rows_fn(
            logits, targets[start:end], softcap, scale if compute_grad else None, temperature=temperature)
        if compute_grad:   # logits now holds dL/dlogits for these rows
            torch.mm(logits, w, out=grad_h[start:end])
            _accumulate_wgrad(grad_w[:vocab_size], logits, h)
    if reduction == "none":
        loss = loss_rows
    else:
        loss = loss_rows.sum() * (scale[0] if reduction == "mean" else 1.0)
    return loss, lse, grad_h, grad_w


def _fused_backward_rows(hidden, weight, targets, lse, grad_rows, softcap, vocab_size, chunk_rows,
                         temperature=1.0):
    """reduction='none' backward: recompute each chunk's logits, scale rows by grad_rows."""
    n, c = hidden.shape
    w = weight[:vocab_size].to(hidden.dtype)
    _, grad_fn = _row_kernels(hidden)
    grad_h = torch.empty_like(hidden)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device)
    step = chunk_rows or default_chunk_rows(n, vocab_size)
    buf = torch.empty(min(step, n), vocab_size, dtype=hidden.dtype, device=hidden.device)
    grad_rows = grad_rows.float().contiguous()
    for start in range(0, n, step):
        end = min(start + step, n)
        h = hidden[start:end]
        logits = buf[: end - start]
        torch.mm(h, w.t(), out=logits)
        grad_fn(logits, targets[start:end], lse[start:end], grad_rows[start:end], softcap, temperature=temperature)
        torch.mm(logits, w, out=grad_h[start:end])
        _accumulate_wgrad(grad_w[:vocab_size], logits, h)
    return grad_h, grad_w


@functools.cache
def _custom_ops():
    """Register the custom ops once, on first use (no import-time registration)."""
    lib = "nanochat"

    @torch.library.custom_op(f"{lib}::fused_linear_ce", mutates_args=())
    def fused_linear_ce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                        softcap: float, vocab_size: int, reduction: str, compute_grad: bool,
                        chunk_rows: int, temperature: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _fused_forward(hidden, weight, targets, softcap or None, vocab_size, reduction,
                              compute_grad, chunk_rows, temperature)

    @fused_linear_ce.register_fake
    def _(hidden, weight, targets, softcap, vocab_size, reduction, compute_grad, chunk_rows, temperature):
        n = hidden.shape[0]
        loss = hidden.new_empty((n,) if reduction == "none" else (), dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        grad_h = torch.empty_like(hidden) if compute_grad else hidden.new_empty(0)
        grad_w = weight.new_empty(weight.shape if compute_grad else (0,), dtype=torch.float32)
        return loss, lse, grad_h, grad_w

    @torch.library.custom_op(f"{lib}::fused_linear_ce_bwd", mutates_args=())
    def fused_linear_ce_bwd(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                            lse: torch.Tensor, grad_rows: torch.Tensor, softcap: float,
                            vocab_size: int, chunk_rows: int, temperature: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return _fused_backward_rows(hidden, weight, targets, lse, grad_rows, softcap or None,
                                    vocab_size, chunk_rows, temperature)

    @fused_linear_ce_bwd.register_fake
    def _(hidden, weight, targets, lse, grad_rows, softcap, vocab_size, chunk_rows, temperature):
        return torch.empty_like(hidden), weight.new_empty(weight.shape, dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        hidden, weight, targets, softcap, vocab_size, reduction, compute_grad, chunk_rows, temperature = inputs
        _loss, lse, grad_h, grad_w = output
        ctx.args = (softcap, vocab_size, reduction, compute_grad, chunk_rows, temperature)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(hidden, weight, targets, lse, grad_h, grad_w)

    def backward(ctx, g_loss, _g_lse, _g_gh, _g_gw):
        hidden, weight, targets, lse, grad_h, grad_w = ctx.saved_tensors
        softcap, vocab_size, reduction, compute_grad, chunk_rows, temperature = ctx.args
        if reduction == "none" or not compute_grad:
            rows = g_loss if reduction == "none" else g_loss.expand(hidden.shape[0]) * (
                1.0 / (targets != IGNORE_INDEX).sum().float() if reduction == "mean" else 1.0)
            grad_h, grad_w = torch.ops.nanochat.fused_linear_ce_bwd(
                hidden, weight, targets, lse, rows, softcap, vocab_size, chunk_rows, temperature)
            return grad_h, grad_w.to(ctx.weight_dtype), None, None, None, None, None, None, None
        g = g_loss.float()
        # scale in float32, round once: g.to(bf16) would scale every hidden gradient by the
        # rounding of g (e.g. 1/3 -> 0.33398, +0.2%) while the head's gradient got the exact g
        gh = (grad_h.float() * g).to(grad_h.dtype) if ctx.needs_input_grad[0] else None
        gw = (grad_w * g).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None, None

    fused_linear_ce.register_autograd(backward, setup_context=setup_context)
    return torch.ops.nanochat.fused_linear_ce


def _check_chunk_rows(chunk_rows: int) -> None:
    if chunk_rows < 0:
        raise ValueError(f"chunk_rows: got {chunk_rows}; accepted: 0 (automatic) or a positive row count")


def _check_loss_shapes(hidden, weight, targets, vocab_size: int) -> None:
    """The chunk loop and the Triton kernels index by these shapes unchecked: targets longer than
    hidden's rows gave a finite loss whose mean also counted the extra targets; a vocab_size above
    the head's rows let target ids past the logits through _check_targets (a read out of bounds)."""
    if hidden.ndim != 2 or weight.ndim != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"loss shapes: accepted hidden (N, C), weight (V, C), targets (N,); got hidden "
                         f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets {tuple(targets.shape)}")
    if not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"vocab_size: got {vocab_size}; accepted: 1..{weight.shape[0]} (the head's rows)")


def triton_loss(hidden, weight, targets, softcap, vocab_size, reduction="mean", chunk_rows: int = 0, *,
                temperature: float = 1.0):
    """The fused loss; same signature as current_loss."""
    _check_reduction(reduction)
    temperature = check_temperature(temperature)
    _check_chunk_rows(chunk_rows)
    _check_loss_shapes(hidden, weight, targets, vocab_size)
    if not torch.compiler.is_compiling():
        _custom_ops()   # registered on first eager use; under compile it already exists
    op = torch.ops.nanochat.fused_linear_ce
    compute_grad = (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
                    and reduction != "none")
    loss, _lse, _gh, _gw = op(hidden.contiguous(), weight, targets.contiguous(),
                              float(softcap or 0.0), int(vocab_size), reduction, compute_grad,
                              int(chunk_rows), temperature)
    return loss


# --------------------------------------------------------------------------------------------
# liger
# --------------------------------------------------------------------------------------------

def _liger_module(softcap, reduction):
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError as exc:
        raise RequestError(
            "--kernel liger needs liger-kernel: pip install 'liger-kernel>=0.6.2' (or the `gpu` "
            f"extra: pip install -e '.[gpu]'); or use --kernel triton|current ({exc})") from exc
    if "accum_dtype" not in inspect.signature(LigerFusedLinearCrossEntropyLoss).parameters:
        # 0.6.0/0.6.1: no fp32 weight-gradient accumulation (and a TypeError for the keyword)
        raise RequestError("--kernel liger needs liger-kernel >= 0.6.2 (accum_dtype, the fp32 weight-"
                           "gradient accumulation): pip install -U liger-kernel; or use --kernel triton|current")
    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, softcap=softcap or None,
                                            reduction=reduction, accum_dtype=torch.float32)


def liger_per_token_support() -> tuple[bool, bool]:
    """(reduction='none' returns per-token losses, its backward applies per-token upstream
    gradients) for the installed Liger. Up to 0.6.2 'none' returned the summed loss; up to 0.8.1
    the backward multiplied every row by the first token's upstream gradient only (its
    element_mul_kernel loads one scalar); 0.8.2 recomputes the chunks with them
    (`token_grad_output`)."""
    from liger_kernel.ops import fused_linear_cross_entropy as flce
    fwd = flce.fused_linear_cross_entropy_forward
    backward_ok = "token_grad_output" in inspect.signature(fwd).parameters
    try:
        src = inspect.getsource(fwd)
    except OSError:   # no source shipped: claim only what the signature shows
        return backward_ok, backward_ok
    # up to 0.6.2 the per-token branch is only a comment ("# if reduction == 'none':")
    forward_ok = backward_ok or re.search(r'^\s*if reduction == "none":', src, re.MULTILINE) is not None
    return forward_ok, backward_ok


def _check_liger_reduction(reduction: str, needs_grad: bool, support: tuple[bool, bool]) -> None:
    """Raise where the installed Liger (`support`: liger_per_token_support()) would return a
    wrong per-token loss or gradient."""
    if reduction != "none":
        return
    forward_ok, backward_ok = support
    if not forward_ok or (needs_grad and not backward_ok):
        what = "per-token losses" if not forward_ok else "per-token gradients (backward)"
        raise RequestError(f"--kernel liger: the installed liger-kernel gets reduction='none' {what} "
                           "wrong (fixed in liger-kernel 0.8.2): pip install -U 'liger-kernel>=0.8.2'; "
                           "or use --kernel triton|current")


def make_liger_loss(inline: bool = False) -> LossFn:
    modules: dict[tuple, torch.nn.Module] = {}
    support = liger_per_token_support()   # read once here, never inside a traced call

    def liger_loss(hidden, weight, targets, softcap, vocab_size, reduction="mean", *, temperature=1.0):
        needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        _check_reduction(reduction)
        temperature = check_temperature(temperature)
        if temperature != 1.0:
            # no temperature in Liger: softcap_c(x) / T == softcap_{c/T}(x / T) and x / T = (h / T) W^T,
            # so one (N, C) copy of the hidden states stands in for (N, V) tempered logits
            hidden = hidden / temperature
            softcap = softcap / temperature if softcap else softcap
        key = (float(softcap or 0.0), reduction)
        _check_liger_reduction(reduction, needs_grad, support)
        # Liger's kernel reads logits[row, target] unchecked, like ours: the same target check
        _check_targets(targets, vocab_size)
        if key not in modules:
            modules[key] = _liger_module(softcap, reduction)
        # Only the real vocab rows, in the activations' dtype (Liger matmuls in that dtype).
        loss = modules[key](weight[:vocab_size].to(hidden.dtype), hidden, targets)
        if reduction == "mean":
            # Liger sums rows it pre-divided by the kept count, so an all-ignored batch gave 0.0
            # (0.8.5) where current/triton give NaN (F.cross_entropy's mean over no tokens): the
            # same NaN for every --kernel (the trainer's non-finite guard); gradients stay zero
            loss = torch.where((targets != IGNORE_INDEX).any(), loss, float("nan"))
        return loss

    if inline:
        return liger_loss
    island = torch.compiler.disable(liger_loss)

    def liger_loss_island(*args, **kwargs):
        # A plain wrapper: torch.compile(disable(f)) would unwrap to f and trace Liger anyway
        # (seen on torch 2.11: its addmm(out_dtype=...) then fails inside dynamo's fake tensors).
        return island(*args, **kwargs)

    return liger_loss_island


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------

def check_kernel(name: str, device: torch.device | str, compile: bool = False) -> None:
    """Can `--kernel name` run on `device` (`compile`: under torch.compile, whose inductor kernels are
    Triton's whatever the kernel)? A RequestError saying what to do instead: the recipes call it
    with their other checks, before a model is built."""
    if name not in KERNELS:
        raise RequestError(f"--kernel: got {name!r}; accepted: {'|'.join(KERNELS)}")
    dev = torch.device(device)
    if name == "liger":
        if dev.type != "cuda":   # triton offered only where it runs: its CPU path, not MPS (refused below)
            raise RequestError(f"--kernel liger needs a CUDA GPU (device is {dev.type}); use "
                               + ("--kernel triton (runs its CPU path) or --kernel current" if dev.type == "cpu"
                                  else "--kernel current"))
        _liger_module(None, "mean")   # installed?
    if name == "triton":
        if dev.type not in ("cuda", "cpu"):
            raise RequestError(f"--kernel triton runs on cuda and cpu, not {dev.type}; use --kernel current")
        if dev.type == "cuda" and importlib.util.find_spec("triton") is None:   # found, not imported
            raise RequestError("--kernel triton needs the triton package on CUDA: pip install triton, "
                               "or use --kernel current")
    if (compile or name in ("liger", "triton")) and dev.type == "cuda" and torch.cuda.is_available():
        # liger and triton launch Triton kernels whatever --compile says, and a compiled model's are
        # inductor's: a ptxas that cannot target this GPU (GB10 with Triton <= 3.5, no CUDA 13 toolkit)
        # stopped training's apply_patches only after the checkpoint directory, data and model existed
        from nanochat.platform import PtxasMissing, detect_device, ptxas_problem
        if (problem := ptxas_problem(detect_device(device))) is not None:
            what = f"--kernel {name}" if name != "current" else "the compiled model (--no-compile avoids it)"
            raise PtxasMissing(f"{what}: {problem}")


def build_loss_fn(name: str, device: torch.device | str = "cpu", *, liger_inline: bool = False,
                  chunk_rows: int = 0) -> LossFn:
    """The loss function for `--kernel name` on `device`; a RequestError (check_kernel) when it
    cannot run there."""
    check_kernel(name, device)
    _check_chunk_rows(chunk_rows)
    dev = torch.device(device)
    if name == "current":
        return current_loss
    if name == "liger":
        return make_liger_loss(inline=liger_inline)
    if dev.type == "cuda":
        import nanochat.triton_kernels  # noqa: F401  (triton is there: check_kernel)
    _custom_ops()
    return functools.partial(triton_loss, chunk_rows=chunk_rows)
