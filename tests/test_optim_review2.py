"""Second review of MuonAdamW and its schedules (nanochat/optim.py, optim_schedules.py): Muon's
weight decay against upstream nanochat's float64 formula, low-precision parameters (fp32 state that
survives a state-dict round trip), hyperparameters refused with the field's name, AdamW's bias
correction at step 1, and the schedules' edge cases."""

import copy
import math

import pytest
import torch

from nanochat.optim import (MuonAdamW, build_optimizer, lr_multiplier, muon_momentum_peaked,
                            weight_decay_cosine, weight_decay_multiplier)
from tests.test_optim import _reference_muon, fake_grads, set_grads, tiny_model  # upstream's formula


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])   # tall: s = sqrt(3); wide: s = 1
def test_muon_weight_decay_rides_on_the_shape_scaled_lr(shape):
    """Upstream scales Muon's LR by sqrt(max(1, m/n)) and decays by lr * wd, so a tall matrix
    (the MLP's c_fc) decays sqrt(m/n) faster than lr * wd. The step here applied the factor to
    the update only: recipe v2's weight decay (0.28, tuned upstream) decayed c_fc at half
    upstream's rate at aspect 4."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape)) for _ in range(3)]
    opt = MuonAdamW([dict(kind="muon", params=params, lr=0.05, momentum=0.9, nesterov=True, ns_steps=5,
                          weight_decay=0.5, cautious_wd=True)])
    start = [p.detach().clone() for p in params]
    steps = [[torch.randn(*shape) for _ in params] for _ in range(2)]
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    ref, ambiguous = _reference_muon(start, steps, lr=0.05, momentum=0.9, wd=0.5)
    for p, r, skip in zip(params, ref, ambiguous):
        assert skip.float().mean() < 0.01
        assert (p.double() - r).abs()[~skip].max() < 1e-5


def _bf16_model():
    model = tiny_model()
    return model.to(torch.bfloat16)


def test_low_precision_params_keep_fp32_state_through_a_resume():
    """bf16 parameters: momentum, NorMuon's moment and Adam's moments in fp32 (the module says
    so; an EMA in bf16 loses the small gradients). torch's load_state_dict casts state to the
    parameter's dtype: NorMuon's fp32 moment came back bf16, and a resumed run stepped
    differently from the uninterrupted one."""
    model = _bf16_model()
    opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=0.95)
    for s in range(2):
        set_grads(model, [g.bfloat16() for g in fake_grads(model, s)])
        opt.step()
    dtypes = {k: v.dtype for st in opt.state.values() for k, v in st.items() if k != "step"}
    assert set(dtypes) == {"momentum_buffer", "second_moment", "exp_avg", "exp_avg_sq"}
    assert set(dtypes.values()) == {torch.float32}, dtypes
    twin = copy.deepcopy(model)
    opt_twin = build_optimizer(twin, weight_decay=0.1, normuon_beta2=0.95)
    opt_twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), twin.parameters()):
        for key, value in opt.state[p].items():
            assert opt_twin.state[q][key].dtype == value.dtype and torch.equal(opt_twin.state[q][key], value), key
    grads = [g.bfloat16() for g in fake_grads(model, 7)]
    set_grads(model, grads)
    set_grads(twin, grads)
    opt.step()
    opt_twin.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)


def test_a_bf16_state_saved_earlier_loads_as_fp32():
    """A state saved in bf16 (before state_zeros) loaded into fp32 parameters: torch upcast it, and
    the dtype restore put bf16 back, so the steps ran in bf16 from then on."""
    model = tiny_model()
    opt = build_optimizer(model, weight_decay=0.1)
    set_grads(model, fake_grads(model, 0))
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for st in saved["state"].values():
        for k, v in st.items():
            if k != "step":
                st[k] = v.bfloat16()
    opt2 = build_optimizer(copy.deepcopy(model), weight_decay=0.1)
    opt2.load_state_dict(saved)
    dtypes = {v.dtype for st in opt2.state.values() for k, v in st.items() if k != "step"}
    assert dtypes == {torch.float32}, dtypes


def test_bf16_adamw_moments_match_the_fp32_reference():
    """Adam's moments of a bf16 parameter in fp32: they equal torch's AdamW moments for an fp32
    copy fed the same gradients (moments depend on the gradients alone). In bf16 (8-bit mantissa)
    they were ~0.4% off, and the EMA lost gradients below 1/256 of its value."""
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(64, 32))
    ours = torch.nn.Parameter(ref.detach().bfloat16())
    opt = MuonAdamW([dict(kind="adamw", params=[ours], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)])
    ref_opt = torch.optim.AdamW([ref], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0)
    for _ in range(20):
        g = (torch.randn(64, 32) * torch.logspace(-3, 0, 32)).bfloat16()   # columns with small gradients
        ours.grad, ref.grad = g, g.float()
        opt.step()
        ref_opt.step()
    for key in ("exp_avg", "exp_avg_sq"):
        got, want = opt.state[ours][key], ref_opt.state[ref][key]
        assert got.dtype == torch.float32, key
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)   # bf16: ~4e-3
    assert ours.dtype == torch.bfloat16


def test_adamw_first_step_is_bias_corrected():
    """Step 1: m / (1 - b1) = g and v / (1 - b2) = g^2, so each coordinate moves by lr * sign(g)
    (eps 1e-10), after the decoupled decay p * (1 - lr * wd)."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.5]))
    opt = MuonAdamW([dict(kind="adamw", params=[p], lr=0.1, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.5)])
    p.grad = torch.tensor([1e-3, -4.0, 0.2, -7.0])
    opt.step()
    want = torch.tensor([1.0, -2.0, 3.0, 0.5]) * (1 - 0.1 * 0.5) - 0.1 * torch.sign(p.grad)
    torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("field, group, message", [
    ("lr", dict(kind="adamw", lr=-0.1), "lr: got -0.1"),
    ("lr", dict(kind="muon", lr=float("nan")), "lr: got nan"),
    ("weight_decay", dict(kind="muon", weight_decay=-1.0), "weight_decay: got -1.0"),
    ("betas", dict(kind="adamw", betas=(0.9, 1.0)), "betas: got (0.9, 1.0)"),
    ("betas", dict(kind="adamw", betas=(float("nan"), 0.9)), "betas: got (nan, 0.9)"),
    ("eps", dict(kind="adamw", eps=0.0), "eps: got 0.0"),
    ("momentum", dict(kind="muon", momentum=1.0), "momentum: got 1.0"),
    ("beta2", dict(kind="muon", beta2=-0.5), "beta2: got -0.5"),
])
def test_bad_group_hyperparameters_are_refused_with_the_field(field, group, message):
    """MuonAdamW built directly (not through build_optimizer's flags) accepted a negative or nan
    LR, betas outside [0, 1) and eps 0 silently (torch's optimizers refuse them)."""
    base = dict(params=[torch.nn.Parameter(torch.randn(8, 4))], lr=0.01, weight_decay=0.0)
    base.update(dict(betas=(0.8, 0.95), eps=1e-10) if group["kind"] == "adamw" else dict(momentum=0.95, beta2=0.0))
    base.update(group)
    with pytest.raises(ValueError, match=f"{field}") as err:
        MuonAdamW([base])
    assert message in str(err.value) and "accepted" in str(err.value)


def test_build_optimizer_refuses_nan_and_inf_flags():
    model = tiny_model()
    for flag, kwargs in (("--matrix-lr", dict(matrix_lr=float("nan"))), ("--scalar-lr", dict(scalar_lr=math.inf)),
                         ("--weight-decay", dict(weight_decay=-0.1)),
                         ("--normuon-beta2", dict(normuon_beta2=float("nan"))),
                         ("adam_betas", dict(adam_betas=(float("nan"), 0.9)))):
        with pytest.raises(ValueError, match=flag):
            build_optimizer(model, **kwargs)


def test_schedule_edge_cases():
    """Warmup >= the run, warmdown 0 and 1, a one-step run, the final fraction at step N, and no
    jump where warmup meets warmdown (pure functions of the step: a resume gets the same values)."""
    n = 10
    # warmup over the whole run: (step + 1) / warmup, peak at the last trained step
    assert [lr_multiplier(s, n, warmup_ratio=1.0, warmdown_ratio=0.0) for s in (0, 9)] == [0.1, 1.0]
    # warmup_steps past the run: capped where the warmdown starts, the warmdown still happens
    assert lr_multiplier(0, n, warmup_steps=100, warmdown_ratio=0.5) == pytest.approx(0.2)
    assert lr_multiplier(4, n, warmup_steps=100, warmdown_ratio=0.5) == 1.0
    assert lr_multiplier(9, n, warmup_steps=100, warmdown_ratio=0.5) == pytest.approx(0.2)
    # warmdown 1: decays from step 0; the final fraction exactly at step n
    assert lr_multiplier(0, n, warmdown_ratio=1.0, final_lr_frac=0.05) == 1.0
    assert lr_multiplier(n, n, warmdown_ratio=1.0, final_lr_frac=0.05) == pytest.approx(0.05)
    assert lr_multiplier(n, n, warmdown_ratio=0.65, final_lr_frac=0.05, warmup_steps=40) == pytest.approx(0.05)
    assert all(lr_multiplier(s, n, warmdown_ratio=0.0) == 1.0 for s in range(n + 1))
    # one step: a full-LR step (v1 and v2 alike), momentum and weight decay at their start values
    assert lr_multiplier(0, 1) == 1.0 and lr_multiplier(0, 1, warmdown_ratio=0.65, warmup_steps=40) == 1.0
    assert muon_momentum_peaked(0, 1, 0.65) == pytest.approx(0.85)
    assert weight_decay_cosine(0, 1) == 1.0 and weight_decay_multiplier(0, 1) == 1.0
    # warmdown ratio 1 for the momentum: ramp value at 0 down to `end` at step n
    assert muon_momentum_peaked(n, n, 1.0) == pytest.approx(0.90)
    # rounded warmup and warmdown that overlap: values stay in [0, 1] and the peak is reached
    for kw in (dict(warmup_ratio=0.5, warmdown_ratio=0.5), dict(warmup_steps=40, warmdown_ratio=0.65)):
        for total in (1, 2, 3, 7, 77):
            vals = [lr_multiplier(s, total, **kw) for s in range(total + 1)]
            assert all(0 <= v <= 1 for v in vals) and max(vals) == 1.0, (kw, total, vals)
    for bad in (dict(warmup_ratio=float("nan")), dict(final_lr_frac=1.5), dict(warmup_steps=-1),
                dict(warmdown_ratio=-0.1)):
        with pytest.raises(ValueError, match="--"):
            lr_multiplier(0, n, **bad)
