"""RL review 15 (nanochat/rl.py): the policy gradient differentiates the log-probability of the
distribution the rollouts were drawn from. Rollouts sample softmax(logits / --temperature); the
loss took log softmax(logits) whatever the temperature, which at a temperature other than 1 is not
the sampling policy's score function (the step was no objective's gradient). Checked by hand on
fixed logits and against a float64 reference on a tiny model; a greedy temperature is refused by
name (every sample alike, and logits / 0 in the loss)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.test_engine import tiny_chat_model
from tests.test_rl import _trainer


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's (never modified here)


class _FixedLogits(torch.nn.Module):
    """GPT.forward's interface over fixed logits (B, T, V): logits without targets, else the
    per-token cross-entropy (-1 ignored) of logits / temperature with loss_reduction="none"."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, idx, targets=None, loss_reduction="mean", temperature=1.0):
        assert idx.shape == self.logits.shape[:2]
        if targets is None:
            return self.logits
        assert loss_reduction == "none"
        return F.cross_entropy(self.logits.flatten(0, 1) / temperature, targets.flatten(), ignore_index=-1,
                               reduction="none").view_as(targets)


def test_the_loss_takes_log_p_at_the_sampling_temperature_by_hand():
    """Logits (0, ln 3): at temperature 1 p = (1/4, 3/4); at 0.5 the tempered logits are (0, 2 ln 3),
    p = (1/10, 9/10). Token 1 sampled with advantage 1 at position 0, position 1 not a target: the
    loss is -ln(9/10) over 1 token, and its gradient by the logits -(1/T)(onehot - p) = (0.2, -0.2)."""
    from nanochat.rl import policy_gradient_loss
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, -5.0]]])
    inputs, targets, adv = torch.zeros(1, 2, dtype=torch.long), torch.tensor([[1, -1]]), torch.tensor([1.0])
    model = _FixedLogits(logits.clone())
    loss, count = policy_gradient_loss(model, inputs, targets, adv, 0.5)
    assert int(count) == 1
    assert float(loss.detach()) == pytest.approx(-math.log(0.9), rel=1e-6)   # the old loss: -ln(3/4) = 0.2877
    loss.backward()
    torch.testing.assert_close(model.logits.grad, torch.tensor([[[0.2, -0.2], [0.0, 0.0]]]), rtol=0, atol=1e-6)
    # temperature 1 is the model's own (fused) loss, unchanged: -ln(3/4), gradient -(onehot - p)
    model = _FixedLogits(logits.clone())
    loss, _ = policy_gradient_loss(model, inputs, targets, adv * -2)
    assert float(loss.detach()) == pytest.approx(2 * math.log(0.75), rel=1e-6)
    loss.backward()
    torch.testing.assert_close(model.logits.grad, torch.tensor([[[-0.5, 0.5], [0.0, 0.0]]]), rtol=0, atol=1e-6)


def test_a_step_at_temperature_0_5_is_the_gradient_of_the_tempered_objective(chat_model, monkeypatch):
    """The trainer samples at 0.5 and its step's loss and gradients equal a float64 reference of
    -(1/P) sum_problems (1/tokens_p) sum_sampled_tokens advantage x log softmax(logits / 0.5), over
    the very rollouts it drew; the untempered objective's gradient differs."""
    from nanochat import rl
    trainer, opt = _trainer(chat_model, lambda text: float(len(text) % 3), temperature=0.5)
    drawn, batches = [], []
    real_generate, real_batch = trainer.engine.generate, rl.rollout_batch

    def generate(*args, **kw):
        drawn.append((kw["temperature"], kw["top_k"]))
        return real_generate(*args, **kw)

    def rollout_batch(*args, **kw):
        batches.append(real_batch(*args, **kw))
        return batches[-1]
    monkeypatch.setattr(trainer.engine, "generate", generate)
    monkeypatch.setattr(rl, "rollout_batch", rollout_batch)
    res = trainer.step(0)
    assert drawn == [(0.5, 50)] * 2 and len(batches) == 2
    model = trainer.model

    def reference(temperature: float):
        model.zero_grad(set_to_none=True)
        objective = torch.zeros((), dtype=torch.float64)
        for inputs, targets, adv in batches:
            valid = targets >= 0
            logp = torch.log_softmax(model(inputs).double() / temperature, -1)
            logp = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
            objective = objective + (adv.double()[:, None] * logp * valid).sum() / valid.sum()
        loss = -objective / len(batches)
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert any(bool((adv != 0).any()) for *_, adv in batches)
    loss, grads = reference(0.5)
    assert res.loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert set(grads) == set(opt.grads)
    for name, g in grads.items():
        torch.testing.assert_close(opt.grads[name], g.to(opt.grads[name].dtype), rtol=1e-4, atol=1e-6, msg=name)
    # what the loss computed before (log p at temperature 1) is not a rescaling of it: what remains
    # after the best-fitting scale is ~12% of the gradient here (a scale alone: Muon / Adam undo it)
    _, untempered = reference(1.0)
    flat = torch.cat([opt.grads[n].flatten() for n in grads]).double()
    other = torch.cat([untempered[n].flatten() for n in grads]).double()
    scale = float(flat @ other / (other @ other))
    assert 1.5 < scale < 3.0   # ~1 / T
    residual = float((flat - scale * other).norm() / flat.norm())
    assert residual > 0.05


@pytest.mark.parametrize("temperature", [0.0, 1e-6, float("nan"), float("inf")])
def test_a_greedy_or_non_finite_temperature_is_refused_by_name(chat_model, temperature):
    with pytest.raises(ValueError, match=r"^temperature: got .*; accepted: a finite number >= 1e-05"):
        _trainer(chat_model, lambda text: 0.0, temperature=temperature)


@pytest.mark.parametrize("name, bad", [("device_batch_size", 0), ("sample_batch_size", -1), ("num_samples", 1),
                                       ("top_k", 1), ("top_k", 0), ("examples_per_step", 0), ("max_new_tokens", 0),
                                       ("seed", -1), ("seed", 2**64), ("pos", -3), ("device_batch_size", 2.0),
                                       ("num_samples", True)])
def test_the_trainer_refuses_a_bad_count_by_name_when_built(chat_model, name, bad):
    """device_batch_size 0 failed only after the first problem's rollouts (range() arg 3 must not
    be zero); sample_batch_size -1 drew no samples (max() of an empty reward list); num_samples 1
    and top_k 1 trained nothing, silently. Now each is refused by name at construction."""
    with pytest.raises(ValueError, match=rf"^{name}: got {bad!r}; accepted: an integer >= "):
        _trainer(chat_model, lambda text: 0.0, **{name: bad})
    _trainer(chat_model, lambda text: 0.0, top_k=None, sample_batch_size=0, seed=2**64 - 1)   # the edges pass
