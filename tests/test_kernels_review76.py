"""Review 76: the Triton kernels of `--kernel triton` and the Triton sampler fuzzed on CPU under
TRITON_INTERPRET=1 against float64 torch (values and gradients), as a demanding user hits them:
one row, rows that do not fill a block, widths 64 / 96 / 1280 / 1288, a vocabulary of 2, 37 or
past one 8192-wide block, ignore_index rows (all of them too), softcap 0 / 15, every reduction,
bf16, strided inputs, logits of 1e4 and +-inf, sampler extremes (top-k 1 / >= V, top-p 1e-9,
temperature at the greedy edge and 1e3), a seed reused.

Defects found, each test failing before its fix:
- the cross-entropy rows' online logsumexp (no softcap) took exp(-inf - -inf) = NaN when a row's
  first 8192-wide block held only -inf logits: that row's loss, lse and gradient were NaN, in the
  Triton kernel and in its CPU torch twin (`ce_rows_torch`);
- the Triton sampler computed p = exp((x - max) / T) with x = max = +inf as NaN: every
  probability NaN or 0, so it drew token 0 (or, two-stage, any candidate) where sample_next draws
  the +inf token;
- triton_qk.fusable checked the TMA row alignment of the input only: q/k outputs of 8 bytes a row
  (bf16, one kv head of D = 4) passed, and Triton's TensorDescriptor asserted at the first step.

The interpreter rounds float32 -> bf16 by truncation (Triton 3.9; a GPU rounds to nearest), so
bf16 cases here are held to a relative-norm bound, not the plain path's error.
"""

import types

import torch
import torch.nn.functional as F

from nanochat import triton_qk
from nanochat.gpt import Linear
from nanochat.kernels import ce_rows_torch

INF = float("inf")


def _rows_reference(x, targets, softcap, temperature):
    """(loss, lse, dL/dx) of softcap(x) / T per row in float64 (loss summed for the gradient)."""
    z = x.double().requires_grad_()
    zc = softcap * torch.tanh(z / softcap) if softcap else z
    zt = zc / temperature
    loss = F.cross_entropy(zt, targets, ignore_index=-1, reduction="none")
    grad, = torch.autograd.grad(loss.sum(), z)
    return loss.detach(), torch.logsumexp(zt.detach(), 1), grad


def test_torch_row_twin_survives_a_block_of_minus_inf():
    """ce_rows_torch (the CPU path of --kernel triton): a first vocab block of only -inf made the
    running max -inf and exp(-inf - -inf) NaN; now the row's loss, lse and gradient are finite."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, generator=g) * 4
    x[0, :16] = -INF          # the whole first block (block_v 16)
    x[1, 16:32] = -INF        # a later block: was already fine
    x[2, :20] = -INF          # first block and more, row ignored
    targets = torch.tensor([30, 3, -1])
    for temperature in (1.0, 0.5):
        buf = x.clone()
        loss, lse = ce_rows_torch(buf, targets, None, torch.ones(1), block_v=16, temperature=temperature)
        want_loss, want_lse, want_grad = _rows_reference(x, targets, 0.0, temperature)
        assert torch.isfinite(loss).all() and torch.isfinite(lse).all() and torch.isfinite(buf).all()
        torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(buf.double(), want_grad, rtol=1e-5, atol=1e-6)


def test_fusable_needs_aligned_output_rows():
    """The fused q/k projection writes (B*T, heads * D) through a TMA descriptor: rows of 8 bytes
    (bf16, one head of D = 4) were fusable and failed in Triton's TensorDescriptor; the plain
    chain runs them now. A CUDA bf16 input stands in as an object (no GPU here)."""
    x = types.SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, element_size=lambda: 2)
    assert triton_qk.fusable(Linear(8, 8), x, 2)        # 2 heads of 4: 16-byte rows
    assert not triton_qk.fusable(Linear(8, 4), x, 1)    # 1 head of 4: 8-byte rows
    assert not triton_qk.fusable(Linear(8, 2), x, 1)    # 1 head of 2
    assert triton_qk.fusable(Linear(8, 8), x, 4)        # 4 heads of 2: 16 bytes
    assert not triton_qk.fusable(Linear(12, 8), x, 2)   # the input's rows: 24 bytes (as before)


# --------------------------------------------------------------------------------------------
# Under TRITON_INTERPRET=1: each in its own subprocess (conftest's run_triton_interpreted)
# --------------------------------------------------------------------------------------------

CE_MINUS_INF = r"""
import torch, torch.nn.functional as F
from nanochat.triton_kernels import ce_rows_triton, ce_grad_rows_triton
inf = float("inf")
g = torch.Generator().manual_seed(0)
x = torch.randn(4, 9000, generator=g) * 3      # two blocks of 8192
x[0, :8192] = -inf                              # the first block only -inf
x[1, 8192:] = -inf
x[2, :8500] = -inf
x[3, :8192] = -inf
t = torch.tensor([8300, 5, 8999, -1])
for cap, T in ((None, 1.0), (None, 0.6), (15.0, 1.0)):
    z = x.double().requires_grad_()
    zc = cap * torch.tanh(z / cap) if cap else z
    zt = zc / T
    want = F.cross_entropy(zt, t, ignore_index=-1, reduction="none")
    want_grad, = torch.autograd.grad(want.sum(), z)
    buf = x.clone()
    loss, lse = ce_rows_triton(buf, t, cap, torch.ones(1), temperature=T)
    assert torch.isfinite(loss).all() and torch.isfinite(lse).all() and torch.isfinite(buf).all(), (cap, T, loss)
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(zt.detach(), 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buf.double(), want_grad, rtol=1e-5, atol=1e-6)
    buf = x.clone()   # the reduction='none' backward's kernel from the saved lse
    ce_grad_rows_triton(buf, t, lse, torch.ones(4), cap, temperature=T)
    torch.testing.assert_close(buf.double(), want_grad, rtol=1e-5, atol=1e-6)
print("OK")
"""


def test_triton_ce_rows_survive_a_block_of_minus_inf(run_triton_interpreted):
    """ce_rows_triton without a softcap: a row whose first 8192 logits are -inf had a NaN loss,
    lse and gradient (its online max started at -inf - -inf)."""
    run_triton_interpreted(CE_MINUS_INF)


SAMPLE_PLUS_INF = r"""
import torch
from nanochat.sampling import sample_next
from nanochat.triton_sample import sample_triton
inf = float("inf")
g = torch.Generator().manual_seed(0)
rows = torch.randn(3, 100, generator=g) * 2
rows[0, 37] = inf
rows[1, 99] = inf                    # the last token: no luck from argmax's first index
rows[2, 5] = inf; rows[2, 80] = inf  # two: the draw is one of them
plus = rows == inf
for T, k, p, chunk in ((1.0, None, None, 0), (0.7, 5, None, 0), (0.7, 5, None, 32), (1.0, None, 0.9, 0),
                       (1.0, 300, None, 0), (1e3, 2, 0.5, 32)):
    seen = set()
    for seed in range(3):
        keep = torch.zeros(3, 100, dtype=torch.int8)
        got = sample_triton(rows, T, k, p, seed, 4, keep_out=keep, chunk=chunk)
        assert torch.equal(keep.bool(), plus), (T, k, p, chunk, keep.sum(1))
        assert plus.gather(1, got[:, None]).all(), (T, k, p, chunk, got)
        seen.add(int(got[2]))
    if p is None:   # sample_next (its top-p path has no answer for +inf: softmax gives NaN)
        want = sample_next(rows[:2], T, k, p, torch.Generator().manual_seed(0))
        assert want.tolist() == [37, 99] and got[:2].tolist() == [37, 99], (want, got)
print("OK")
"""


def test_triton_sampler_draws_a_plus_inf_logit(run_triton_interpreted):
    """A +inf logit (no softcap, an overflow) is the draw, as in sample_next: the Triton sampler
    made every probability NaN or 0 and drew token 0 (two-stage: another candidate)."""
    run_triton_interpreted(SAMPLE_PLUS_INF)


# --------------------------------------------------------------------------------------------
# The fuzz grids, small enough for the interpreter (regressions: they passed before the fixes)
# --------------------------------------------------------------------------------------------

CE_FUZZ = r"""
import itertools, math, torch, torch.nn.functional as F
from nanochat.kernels import triton_loss
def reference(h, w, t, cap, V, red, temperature):   # float64 throughout (current_loss upcasts to float32)
    z = h @ w[:V].t()
    z = cap * torch.tanh(z / cap) if cap else z
    return F.cross_entropy(z / temperature, t, ignore_index=-1, reduction=red)
def grads(fn, h, w, t, cap, V, red, T, math_dtype=None, **kw):
    h = h.detach().to(math_dtype or h.dtype).requires_grad_(); w = w.detach().to(math_dtype or w.dtype).requires_grad_()
    loss = fn(h, w, t, cap, V, red, T, **kw) if fn is reference else fn(h, w, t, cap, V, red, temperature=T, **kw)
    up = torch.linspace(-1.5, 2.0, loss.numel(), dtype=loss.dtype).view(loss.shape)
    return (loss.detach(), *torch.autograd.grad((loss * up).sum(), (h, w)))
def rel(a, b):
    a, b = a.double().nan_to_num(0), b.double().nan_to_num(0)
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
n = 0
for (N, C, V, Vpad), cap, red, ign in itertools.product(((1, 16, 2, 2), (17, 64, 37, 48), (5, 96, 1000, 1024)),
                                                     (0.0, 15.0), ("mean", "sum", "none"), ("some", "all")):
    g = torch.Generator().manual_seed(n)
    n += 1
    h, w = torch.randn(N, C, generator=g), torch.randn(Vpad, C, generator=g) / math.sqrt(C) * 3
    t = torch.randint(0, V, (N,), generator=g)
    t[::2 if ign == "some" else 1] = -1
    T = 0.7 if n % 3 == 0 else 1.0
    want = grads(reference, h, w, t, cap, V, red, T, torch.float64)
    got = grads(triton_loss, h, w, t, cap, V, red, T, chunk_rows=4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert not got[2][V:].any()   # the padded head's rows get no gradient
    if N > 1 and n % 4 == 0:      # a transposed hidden view, bf16
        hv = torch.randn(C, N, generator=g).t()
        got = grads(triton_loss, hv.bfloat16(), w.bfloat16(), t, cap, V, red, T, chunk_rows=4)
        want = grads(reference, hv.bfloat16(), w.bfloat16(), t, cap, V, red, T, torch.float64)
        assert torch.equal(got[0].isnan(), want[0].isnan())
        assert all(rel(a, b) < 2e-2 for a, b in zip(got, want)), [rel(a, b) for a, b in zip(got, want)]
# logits of 1e4, with and without a softcap
h, w = torch.randn(6, 16) * 100, torch.randn(37, 16) * 10
t = torch.tensor([0, 5, -1, 36, 2, 2])
for cap in (0.0, 15.0):
    for red in ("mean", "none"):
        got, want = grads(triton_loss, h, w, t, cap, 37, red, 1.0), grads(reference, h, w, t, cap, 37, red, 1.0, torch.float64)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-3)
print("OK")
"""


def test_fused_loss_fuzz(run_triton_interpreted):
    """triton_loss (the Triton row kernels) against a float64 reference: one row, a vocabulary of
    2, 37 (a padded head) and 1000, softcap 0 / 15, every reduction, some / all rows ignored,
    temperature 0.7, bf16 from a transposed view, logits of 1e4."""
    run_triton_interpreted(CE_FUZZ)


NORM_FUZZ = r"""
import itertools, torch
from nanochat import fused_norm
from nanochat.norms import plain_mix_norm, rotary_norm, rotary_tables
g = torch.Generator().manual_seed(0)
for C, rows, add, chain in itertools.product((64, 96, 1280, 1288), (1, 7), (False, True), (False, True)):
    r, x0, a = (torch.randn(rows, C, generator=g) for _ in range(3))
    ups = [torch.randn(rows, C, generator=g, dtype=torch.float64) for _ in range(3)]
    out = []
    for fn, dt in ((fused_norm.mix_norm, torch.float32), (plain_mix_norm, torch.float64)):
        leaves = [t.to(dt).requires_grad_() for t in (r, x0, a, torch.tensor(0.9), torch.tensor(-0.4))]
        res = fn(leaves[0], leaves[1], leaves[3], leaves[4], leaves[2] if add else None,
                 **({"x0_chain": True} if chain and fn is not plain_mix_norm else {}))
        s, y = res[0], res[1]
        x0n = res[2] if len(res) == 3 else leaves[1] if chain else None
        L = (s.double() * ups[0]).sum() + (y.double() * ups[1]).sum() + (0 if x0n is None else (x0n.double() * ups[2]).sum())
        out.append([s, y, *torch.autograd.grad(L, leaves, allow_unused=True)])
    for name, a_, b_ in zip(("s", "y", "gr", "gx0", "gadd", "glam", "gmu"), *out):
        if b_ is None:
            continue
        torch.testing.assert_close(a_.double(), b_.double(), rtol=2e-5, atol=2e-5, msg=lambda m: f"{C} {rows} {name}: {m}")
for D, (B, T, H) in itertools.product((2, 64), ((1, 1, 1), (2, 7, 3))):
    cos, sin = rotary_tables(T, D)
    x = torch.randn(B, T, H, D, generator=g)
    dy = torch.randn(B, H, T, D, generator=g).transpose(1, 2)   # attention's strided gradient
    got = []
    for fn, dt in ((fused_norm.rotary_norm, torch.float32), (rotary_norm, torch.float64)):
        xx = x.to(dt).requires_grad_()
        y = fn(xx, cos.to(dt), sin.to(dt))
        got.append((y, *torch.autograd.grad(y, xx, dy.to(dt))))
    for a_, b_ in zip(*got):
        torch.testing.assert_close(a_.double(), b_.double(), rtol=1e-5, atol=1e-5)
print("OK")
"""


def test_mix_norm_and_rotary_backward_fuzz(run_triton_interpreted):
    """fused_norm's Triton mix + RMSNorm (widths 64 / 96 / 1280 / 1288, one row, with the residual
    add and the x0 chain) and the one-pass QK-norm + RoPE backward (a strided gradient, a single
    head row) against float64 plain autograd."""
    run_triton_interpreted(NORM_FUZZ)


SAMPLER_FUZZ = r"""
import itertools, torch
from nanochat.sampling import kth_largest, nucleus
from nanochat.triton_sample import sample_triton
inf = float("inf")
g = torch.Generator().manual_seed(0)
V = 40
rows = torch.randn(3, V, generator=g) * 3
rows[1, ::3] = -inf
rows[2, : V // 2] = rows[2, 0]   # a tie group of half the row
cases = [(k, None, T) for k in (None, 1, V - 1, V, V + 5) for T in (1e-5, 0.7, 1e3)]
cases += [(None, 1e-9, 0.7), (None, 0.5, 1e-5), (None, 0.5, 1e3), (1, 0.5, 0.7), (V - 1, 0.5, 0.7), (V + 5, 1e-9, 1e3)]
for k, p, T in cases:
    keep = torch.zeros(3, V, dtype=torch.int8)
    got = sample_triton(rows, T, k, p, 7, 3, keep_out=keep, chunk=0)
    x = rows if k is None or k >= V else rows.masked_fill(rows < kth_largest(rows, k), -inf)
    probs = torch.softmax(x / T, -1)
    want = (probs if p is None else nucleus(probs, p)) > 0
    assert torch.equal(keep.bool(), want), (k, p, T, (keep.bool() != want).nonzero()[:4])
    assert want.gather(1, got[:, None]).all(), (k, p, T, got)
    if p is None:   # the seed reused (top-p calls are the slow ones here)
        assert torch.equal(sample_triton(rows, T, k, p, 7, 3, chunk=0), got)
print("OK")
"""


def test_sampler_extremes_fuzz(run_triton_interpreted):
    """The one-program Triton sampler's drawable set against sample_next's rule (top-k on the raw
    logits, softmax at T, the value-cut nucleus) at top-k 1 / V - 1 / V / > V, top-p 1e-9 and 0.5,
    T at the greedy edge (1e-5) and 1e3, -inf and tied logits; a seed reused draws the same."""
    run_triton_interpreted(SAMPLER_FUZZ)
