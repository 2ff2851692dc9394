"""Review 73 of MuonAdamW (nanochat/optim.py): the paths by which a value reached the optimizer
without the checks its constructor applies.

* add_param_group after construction took a group unchecked (a muon group of a 1-D tensor, lr -1,
  momentum 2) and without initial_lr / weight_decay: the next set_hparams raised KeyError.
* set_hparams took a momentum the constructor refuses: at 1 the buffer never takes a gradient, so
  every Muon matrix froze silently; a negative lr multiplier climbed the loss.
* step(max_norm=...) took a negative or nan clip: -1 scaled every averaged gradient by a negative
  factor (gradient ascent), nan clipped nothing.

Plus, against a float64 reference written from the papers rather than from this code: Keller
Jordan's Muon (momentum as a plain sum g + beta * buf, Nesterov g + beta * buf) gives the same step
as the optimizer's EMA form at a constant momentum (orthogonalisation is scale-invariant), and the
Polar Express polynomials map every singular value of a normalised input in [1e-3, 1] into the
documented band (the scalar map, no matrices)."""

from __future__ import annotations

import math

import pytest
import torch

from nanochat.optim import MuonAdamW
from nanochat.optim_updates import ORTHO_SV_BAND, POLAR_EXPRESS_COEFFS

F64 = torch.float64


def _muon(params, **kw):
    return dict(kind="muon", params=params, lr=0.05, momentum=0.9, **kw)


def _adamw(params):
    return dict(kind="adamw", params=params, lr=0.01, betas=(0.8, 0.95), eps=1e-10)


# ---------------------------------------------------------------------------------- add_param_group
@pytest.mark.parametrize("group, message", [
    (_muon([torch.nn.Parameter(torch.randn(5))]), r"params: got shapes \[\(5,\)\]"),
    (dict(_muon([torch.nn.Parameter(torch.randn(3, 4))]), lr=-1.0), "lr: got -1.0"),
    (dict(_muon([torch.nn.Parameter(torch.randn(3, 4))]), momentum=2.0), "momentum: got 2.0"),
    (dict(kind="sgd", params=[torch.nn.Parameter(torch.randn(3))], lr=0.1), "kind must be muon|adamw"),
])
def test_a_group_added_later_is_checked_as_one_given_when_built(group, message):
    opt = MuonAdamW([_adamw([torch.nn.Parameter(torch.randn(4, 3))])])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group(group)
    assert len(opt.param_groups) == 1   # the refused group is not left behind


def test_a_group_added_later_gets_the_defaults_and_steps():
    a, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(6, 4, dtype=F64))
    opt = MuonAdamW([_adamw([a])])
    opt.add_param_group(_muon([b], weight_decay=0.1))
    group = opt.param_groups[1]
    assert (group["initial_lr"], group["initial_weight_decay"]) == (0.05, 0.1)
    opt.set_hparams(lr_mult=0.5, momentum=0.8, wd_mult=0.5)   # KeyError 'initial_lr' before
    assert (group["lr"], group["weight_decay"], group["momentum"]) == (0.025, 0.05, 0.8)
    start = b.detach().clone()
    a.grad, b.grad = torch.randn(4, 3), torch.randn(6, 4, dtype=F64)
    opt.step()
    assert (b.detach() - start).abs().max() > 1e-3


# ---------------------------------------------------------------------------------- set_hparams
@pytest.mark.parametrize("kwargs, message", [
    (dict(momentum=1.0), r"momentum: got 1.0; accepted: \[0, 1\)"),
    (dict(momentum=-0.1), "momentum: got -0.1"),
    (dict(lr_mult=-1.0), "lr_mult: got -1.0; accepted: a finite number >= 0"),
    (dict(lr_mult=float("nan")), "lr_mult: got nan"),
    (dict(wd_mult=float("inf")), "wd_mult: got inf"),
])
def test_set_hparams_refuses_what_the_constructor_refuses(kwargs, message):
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = MuonAdamW([_muon([p])])
    with pytest.raises(ValueError, match=message):
        opt.set_hparams(**kwargs)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.05, 0.9)   # nothing half-set


# ---------------------------------------------------------------------------------- step(max_norm)
@pytest.mark.parametrize("max_norm", [-1.0, 0.0, float("nan"), float("inf")])
def test_step_refuses_a_clip_that_is_not_a_positive_number(monkeypatch, max_norm):
    """Where the clip happens inside step() (several ranks, no FSDP): reduces_gradients forced on
    here so one process reaches the check (step() then takes the local path and ignored the clip)."""
    monkeypatch.setattr(MuonAdamW, "reduces_gradients", property(lambda self: True))
    p = torch.nn.Parameter(torch.randn(6, 4))
    start = p.detach().clone()
    opt = MuonAdamW([_muon([p])])
    p.grad = torch.randn(6, 4)
    with pytest.raises(ValueError, match=f"max_norm \\(--grad-clip\\): got {max_norm}; accepted: a finite number > 0"):
        opt.step(max_norm=max_norm)
    assert torch.equal(p.detach(), start) and not opt.state   # refused before any update


# ---------------------------------------------------------------------------------- paper references
def _polar_f64(x: torch.Tensor) -> torch.Tensor:
    """Polar Express (arXiv 2505.16932) on a float64 matrix: X / (1.02 ||X||_F), then per step
    X <- a X + b (X X^T) X + c (X X^T)^2 X, on the wide orientation."""
    tall = x.size(0) > x.size(1)
    x = (x.T if tall else x) / (x.norm() * 1.02)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        gram = x @ x.T
        x = a * x + b * gram @ x + c * gram @ gram @ x
    return x.T if tall else x


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_matches_kellers_sum_form_in_float64(nesterov):
    """Muon as the post writes it (kellerjordan.github.io/posts/muon): buf <- beta buf + g,
    direction g + beta buf (Nesterov) or buf, orthogonalise, scale by sqrt(max(1, m/n)), step
    W <- W - lr (O + wd W) (plain decay here: cautious_wd off). The optimizer keeps an EMA
    (1 - beta) x that sum: the same orthogonalised step at a constant beta."""
    g = torch.Generator().manual_seed(73)
    shapes = [(12, 4), (4, 12), (7, 7)]
    params = [torch.nn.Parameter(torch.randn(s, dtype=F64, generator=g)) for s in shapes]
    ref = [p.detach().clone() for p in params]
    bufs = [torch.zeros_like(r) for r in ref]
    opt = MuonAdamW([_muon([p], nesterov=nesterov, weight_decay=0.1, cautious_wd=False) for p in params])
    beta, lr, wd = 0.9, 0.05, 0.1
    for _ in range(4):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, dtype=F64, generator=g)
            bufs[i] = beta * bufs[i] + p.grad
            direction = p.grad + beta * bufs[i] if nesterov else bufs[i]
            m, n = p.shape
            s = max(1.0, m / n) ** 0.5
            ref[i] = ref[i] - lr * (s * _polar_f64(direction) + s * wd * ref[i])
        opt.step()
    for p, r in zip(params, ref):
        assert (p.detach() - r).abs().max() < 2e-5   # fp32 orthogonalisation on CPU, float64 here


def test_polar_express_maps_the_normalised_range_into_the_band():
    """The five polynomials as a scalar map: every singular value in [1e-3, 1 / 1.02] (what the
    1.02 ||X||_F normalisation leaves, down to 1e-3) ends in ORTHO_SV_BAND ([0.859, 1.141] here).
    Four steps leave it (0.42 .. 1.58), and so do two steps swapped (0.36 .. 122) or the first
    step's b and c exchanged (inf)."""
    x = torch.logspace(-3, math.log10(1 / 1.02), 4001, dtype=F64)
    y = x.clone()
    for a, b, c in POLAR_EXPRESS_COEFFS:
        y = a * y + b * y ** 3 + c * y ** 5
    lo, hi = ORTHO_SV_BAND
    assert lo <= y.min() and y.max() <= hi, (y.min(), y.max())
