"""Review 6 of the optimizer math against hand-written float64 references: Polar Express (tall,
wide, zero, rank-1), Nesterov momentum, NorMuon, cautious weight decay, AdamW's bias correction,
the schedules at their boundaries, the recipe's LRs in the param groups (and a resume's), an exact
state round trip through torch.save, and the distributed step on a one-rank gloo group.
Plus the defects found: schedules past the end with no warmdown / no ramp, and MuonAdamW groups
that crashed inside the first step (KeyError, shape errors) instead of being refused when built."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist

from nanochat.optim import MuonAdamW, build_optimizer, lr_multiplier, muon_momentum, muon_momentum_peaked
from nanochat.optim_updates import POLAR_EXPRESS_COEFFS, muon_decay_step, muon_update, orthogonalize
from nanochat.recipe import RECIPE_FLAGS, resolve_recipe
from tests.test_optim import fake_grads, set_grads, tiny_model

F64 = torch.float64


def ref_orthogonalize(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Polar Express in float64, written out: normalise by 1.02 ||G||_F, iterate on the wide side."""
    x = G.double()
    x = x / (x.norm() * 1.02 + 1e-6)
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def ref_muon(start, grads_per_step, *, lr, momentum, wd, nesterov, beta2):
    """Per-matrix Muon (+ NorMuon when beta2 > 0, + cautious decay) in float64."""
    params = [p.double().clone() for p in start]
    bufs = [torch.zeros_like(p) for p in params]
    second = [None] * len(params)
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            x = (1 - momentum) * g + momentum * bufs[i] if nesterov else bufs[i]
            m, n = p.shape
            s = max(1.0, m / n) ** 0.5
            u = ref_orthogonalize(x) * s
            if beta2:
                ms = u.square().mean(dim=-1 if m >= n else -2, keepdim=True)   # per row (tall) / column (wide)
                second[i] = (1 - beta2) * ms if second[i] is None else beta2 * second[i] + (1 - beta2) * ms
                scaled = u / second[i].sqrt()
                u = scaled * (u.norm() / scaled.norm())
            mask = ((u * p) >= 0).double()
            params[i] = p - lr * (u + s * wd * p * mask)
    return params


# ---------------------------------------------------------------------------------- Polar Express
@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (6, 6), (1, 7), (7, 1)])
def test_orthogonalize_matches_the_float64_reference(shape):
    G = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    for steps in (1, 3, 5):
        assert (orthogonalize(G, steps).double() - ref_orthogonalize(G, steps)).abs().max() < 5e-5
    torch.testing.assert_close(orthogonalize(G, 5, 2.5).double(), 2.5 * ref_orthogonalize(G), rtol=0, atol=1e-4)


def test_orthogonalize_zero_and_rank_one():
    assert torch.equal(orthogonalize(torch.zeros(2, 6, 4)), torch.zeros(2, 6, 4))   # no nan from 0 / 0
    g = torch.Generator().manual_seed(1)
    u, v = torch.randn(9, 1, dtype=F64, generator=g), torch.randn(1, 4, dtype=F64, generator=g)
    out = orthogonalize(u @ v).double()
    sv = torch.linalg.svdvals(out)
    # one direction, u v^T / (|u| |v|), pushed from 1 / 1.02 towards 1; nothing invented elsewhere
    assert 0.85 < sv[0] < 1.15 and sv[1:].max() < 1e-4
    torch.testing.assert_close(out, sv[0] * (u @ v) / (u.norm() * v.norm()), rtol=0, atol=1e-4)


def test_muon_update_scales_tall_matrices_only():
    for (m, n), s in (((12, 3), 2.0), ((3, 12), 1.0), ((5, 5), 1.0)):
        g = torch.randn(1, m, n, generator=torch.Generator().manual_seed(2))
        buf = torch.zeros(1, m, n)
        out = muon_update(g, buf, torch.tensor(0.0), False, 5)   # momentum 0: the gradient itself
        torch.testing.assert_close(out, s * orthogonalize(g), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(buf, g)


# ---------------------------------------------------------------------------------- Muon step
@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (6, 6)])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("beta2", [0.0, 0.9])
def test_muon_step_matches_the_float64_reference(shape, nesterov, beta2):
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(shape, dtype=F64, generator=g)) for _ in range(3)]
    start = [p.detach().clone() for p in params]
    opt = MuonAdamW([dict(kind="muon", params=params, lr=0.03, momentum=0.9, nesterov=nesterov, ns_steps=5,
                          weight_decay=0.2, cautious_wd=True, beta2=beta2)])
    steps = [[torch.randn(shape, dtype=F64, generator=g) for _ in params] for _ in range(3)]
    for grads in steps:
        for p, grad in zip(params, grads):
            p.grad = grad
        opt.step()
    ref = ref_muon(start, steps, lr=0.03, momentum=0.9, wd=0.2, nesterov=nesterov, beta2=beta2)
    for p, r in zip(params, ref):
        assert (p.detach() - r).abs().max() < 1e-5


def test_cautious_decay_only_where_update_and_weight_agree_in_sign():
    p = torch.tensor([[1.0, -1.0, 2.0, -2.0, 3.0]])
    u = torch.tensor([[0.5, 0.5, -0.5, -0.5, 0.0]])
    lr, wd = torch.tensor(0.1), torch.tensor(0.2)
    cautious, plain = p.clone(), p.clone()
    muon_decay_step(cautious, u, lr, wd, True)
    muon_decay_step(plain, u, lr, wd, False)
    agree = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]])   # signs agree (or u == 0): the update shrinks |p|
    torch.testing.assert_close(cautious, p - 0.1 * (u + 0.2 * p * agree))
    torch.testing.assert_close(plain, p - 0.1 * (u + 0.2 * p))


# ---------------------------------------------------------------------------------- AdamW
def test_adamw_bias_correction_and_decoupled_decay_float64():
    g = torch.Generator().manual_seed(4)
    p = torch.nn.Parameter(torch.randn(4, 3, dtype=F64, generator=g))
    q, m, v = p.detach().clone(), torch.zeros(4, 3, dtype=F64), torch.zeros(4, 3, dtype=F64)
    lr, b1, b2, eps, wd = 0.01, 0.8, 0.95, 1e-10, 0.1
    opt = MuonAdamW([dict(kind="adamw", params=[p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)])
    for t in range(1, 5):
        p.grad = torch.randn(4, 3, dtype=F64, generator=g)
        opt.step()
        q = q * (1 - lr * wd)   # decoupled: on the weight, not through the moments
        m, v = b1 * m + (1 - b1) * p.grad, b2 * v + (1 - b2) * p.grad ** 2
        q = q - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)
        # hyperparameters travel as fp32 0-dim tensors: 1 - lr * wd = 0.999 rounds to 0.99900001, which
        # moves |p| ~ 2 by ~3e-8 a step (without decay the steps agree to 2e-9): far below a step of lr
        assert (p.detach() - q).abs().max() < 4e-8 * t, t


# ---------------------------------------------------------------------------------- schedules
def test_lr_schedule_at_its_boundaries():
    n, kw = 20, dict(warmup_steps=4, warmdown_ratio=0.5, final_lr_frac=0.1)
    assert [lr_multiplier(s, n, **kw) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_multiplier(10, n, **kw) == 1.0                              # the warmdown's first step is 11
    assert lr_multiplier(11, n, **kw) == pytest.approx(0.9 + 0.1 * 0.1)
    assert lr_multiplier(n, n, **kw) == pytest.approx(0.1) and lr_multiplier(n + 5, n, **kw) == pytest.approx(0.1)
    assert lr_multiplier(1, n, warmup_ratio=0.1, warmdown_ratio=0.0) == 1.0   # 2 warmup steps
    assert muon_momentum(0) == 0.85 and muon_momentum(150) == pytest.approx(0.90) and muon_momentum(10 ** 6) == 0.95
    assert muon_momentum_peaked(20, 100, 0.8, ramp_steps=40) == pytest.approx(0.85 + 0.12 * 0.5)   # warmdown start
    assert muon_momentum_peaked(100, 100, 0.8, ramp_steps=40) == pytest.approx(0.90)


def test_schedules_past_the_end_without_warmdown_and_without_ramp():
    """lr_multiplier clamps a step past num_iterations to the final fraction, but with
    warmdown_ratio 0 it divided by the zero-length warmdown (ZeroDivisionError); muon_momentum
    with ramp_steps=0 (no ramp) divided by zero too."""
    assert lr_multiplier(11, 10, warmdown_ratio=0.0) == 1.0
    assert lr_multiplier(12, 10, warmdown_ratio=0.0, warmup_steps=3) == 1.0
    assert muon_momentum(0, ramp_steps=0) == 0.95 and muon_momentum(7, ramp_steps=0) == 0.95
    assert muon_momentum_peaked(0, 10, 0.5, ramp_steps=0) == 0.97
    with pytest.raises(ValueError, match="ramp_steps: got -1; accepted: an integer >= 0"):
        muon_momentum(3, ramp_steps=-1)


# ---------------------------------------------------------------------------------- recipe -> groups
def test_recipe_lrs_reach_the_groups_and_a_resume_keeps_its_own_flags():
    none = {k: None for k in RECIPE_FLAGS}
    batch = 2 ** 17   # v2: every LR x sqrt(2^17 / 2^19) = 0.5
    r = resolve_recipe("v2", none, total_batch_size=batch, target_tokens=2e8, ref_tokens=1e8)
    model = tiny_model()
    opt = build_optimizer(model, **r.optimizer_kwargs())
    d = (64 / 768) ** -0.5
    want = {"lm_head": 0.008 * 0.5 * d, "embedding": 0.3 * 0.5 * d, "value_embeds": 0.3 * 0.5 * d,
            "resid_lambdas": 0.5 * 0.5 * 0.01, "scalars": 0.5 * 0.5}
    for group in opt.param_groups:
        lr = want.get(group["name"], 0.02 * 0.5)
        assert group["initial_lr"] == pytest.approx(lr) and group["lr"] == pytest.approx(lr), group["name"]
        wd = 0.28 * 0.5 * 0.5 if group["kind"] == "muon" else 0.0   # x lr scale x D_ref / D
        assert group["initial_weight_decay"] == pytest.approx(wd)
        assert group.get("beta2", 0.95) == 0.95
    set_grads(model, fake_grads(model, 0))
    opt.step()
    # resume with --matrix-lr 0.04: the new LR (scaled the same way) wins over the checkpoint's
    r2 = resolve_recipe("v2", {**none, "matrix_lr": 0.04}, total_batch_size=batch, target_tokens=2e8, ref_tokens=1e8)
    opt2 = build_optimizer(tiny_model(), **r2.optimizer_kwargs())
    opt2.load_state_dict(opt.state_dict())
    sched = r2.schedule(100)
    sched.apply(opt2, 90)
    lrm = lr_multiplier(90, 100, warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05)
    for group in opt2.param_groups:
        base = 0.04 * 0.5 if group["kind"] == "muon" else want[group["name"]]
        assert group["initial_lr"] == pytest.approx(base) and group["lr"] == pytest.approx(base * lrm)


# ---------------------------------------------------------------------------------- state round trip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_after_save_and_load_equals_a_step_without(dtype):
    def grads(m, s, skip=False):
        for (name, p), g in zip(m.named_parameters(), fake_grads(m, s)):
            p.grad = None if skip and ("value_embeds" in name or "blocks.1." in name) else g.to(dtype)

    model = tiny_model().to(dtype)
    opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=0.95)
    for s in range(2):   # some parameters never stepped yet: no state for them in the save
        grads(model, s, skip=True)
        opt.step()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    model2 = tiny_model().to(dtype)
    model2.load_state_dict(saved["model"])
    opt2 = build_optimizer(model2, weight_decay=0.1, normuon_beta2=0.95)
    opt2.load_state_dict(saved["opt"])
    for s in range(2, 4):
        for m, o in ((model, opt), (model2, opt2)):
            grads(m, s)
            o.set_hparams(lr_mult=0.5, momentum=0.93, wd_mult=0.4)
            o.step()
    for (name, p), q in zip(model.named_parameters(), model2.parameters()):
        assert torch.equal(p, q), name


# ---------------------------------------------------------------------------------- distributed path
def test_the_distributed_step_on_one_gloo_rank_matches_the_local_step(tmp_path):
    """_step_distributed (reduce-scatter, flags, clip, all-gather) on a one-rank gloo group, called
    directly (step() takes the local path at world size 1): the local step after clip_grad_norm_."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        local, spread = tiny_model(), tiny_model()
        opt_l = build_optimizer(local, weight_decay=0.1, normuon_beta2=0.95)
        opt_d = build_optimizer(spread, weight_decay=0.1, normuon_beta2=0.95)
        for s in range(3):
            for m in (local, spread):
                set_grads(m, fake_grads(m, s))
                if s == 1:   # a Muon slot and an AdamW tensor without gradient: skipped on both paths
                    for name, p in m.named_parameters():
                        p.grad = None if "blocks.1.attn" in name or "lm_head" in name else p.grad
            torch.nn.utils.clip_grad_norm_(local.parameters(), 1.0)
            opt_l.step()
            with torch.no_grad():
                opt_d._step_distributed(max_norm=1.0)
            assert opt_d.grad_norm > 1.0   # the clip did act
        for (name, p), q in zip(local.named_parameters(), spread.parameters()):
            assert (p - q).abs().max() < 1e-5, name
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------- bad groups
@pytest.mark.parametrize("group, message", [
    (dict(kind="muon", params=[torch.nn.Parameter(torch.randn(5))], lr=0.1, momentum=0.9),
     r"params: got shapes \[\(5,\)\]; accepted: 2-D matrices of one shape"),
    (dict(kind="muon", params=[torch.nn.Parameter(torch.randn(3, 4, 5))], lr=0.1, momentum=0.9),
     r"params: got shapes \[\(3, 4, 5\)\]"),
    (dict(kind="muon", params=[torch.nn.Parameter(torch.randn(3, 4))], lr=0.1),
     "missing momentum; accepted: muon groups that set lr, momentum"),
    (dict(kind="adamw", params=[torch.nn.Parameter(torch.randn(3))], lr=0.1),
     "missing betas, eps; accepted: adamw groups that set lr, betas, eps"),
    (dict(kind="muon", params=[torch.nn.Parameter(torch.randn(3, 4))], lr=0.1, momentum=0.9, ns_steps=7),
     r"ns_steps: got 7; accepted: an integer in 1\.\.5"),
])
def test_bad_groups_are_refused_when_built_not_inside_step(group, message):
    """These passed construction and failed inside the first step(): KeyError('momentum'), a 3-D
    weight orthogonalised slice by slice then 'too many values to unpack', ns_steps=7 after the
    momentum buffer had already advanced."""
    with pytest.raises(ValueError, match=message):
        MuonAdamW([group])


def test_weight_decay_is_optional_as_documented():
    """initial_weight_decay defaulted to 0 for a group without weight_decay, but step() then
    raised KeyError('weight_decay')."""
    a = torch.nn.Parameter(torch.ones(4, 4))
    b = torch.nn.Parameter(torch.ones(3))
    opt = MuonAdamW([dict(kind="muon", params=[a], lr=0.1, momentum=0.9),
                     dict(kind="adamw", params=[b], lr=0.1, betas=(0.8, 0.95), eps=1e-10)])
    a.grad, b.grad = torch.eye(4), torch.ones(3)
    opt.step()
    assert all(g["weight_decay"] == 0.0 and g["initial_weight_decay"] == 0.0 for g in opt.param_groups)
    assert not math.isclose(float(a.detach()[0, 0]), 1.0) and float(b.detach()[0]) == pytest.approx(0.9)
