"""Review 15 of the model on CPU: gradients of the whole model (its custom autograd functions, with
and without weight_cache's sinks) against float64 autograd through a plain reference written here
from gpt.py's docstring; per-row static decode and logits_at against it; the documented init and
dtype policy; loss reductions with ignored targets; and two refusals (config_for_depth's
non-integer sizes, a StaticKV cache longer than the rotary table)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nanochat import weight_cache
from nanochat.gpt import GPT, GPTConfig, config_for_depth
from nanochat.kv_cache import KVCache, StaticKV
from tests.test_model_review2 import _naive_logits

V = 37   # padded to 64 inside


def _reference_logits(model: GPT, P: dict, idx: torch.Tensor, pos0: int = 0) -> torch.Tensor:
    """The plain float64 forward of the documented architecture (tests/test_model_review2.py's),
    over parameters P (autograd-able) from position pos0."""
    return _naive_logits(model, idx, P=P, pos0=pos0)


def _model(pattern="SL", n_layer=3, n_head=3, n_kv_head=1, n_embd=18, T=16, seed=0) -> GPT:
    """float64 parameters away from init (zero projections and gates would hide terms)."""
    cfg = GPTConfig(sequence_len=T, vocab_size=V, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                    n_embd=n_embd, window_pattern=pattern)
    model = GPT(cfg, attn_backend="sdpa", compute_dtype=torch.float64).to(torch.float64)
    model.init_weights()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


def _detached(model: GPT) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


# ---- the fixes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,flag", [(dict(depth="4"), "--depth"), (dict(depth=2.5), "--depth"),
                                         (dict(depth=True), "--depth"), (dict(aspect_ratio=64.0), "--aspect-ratio"),
                                         (dict(head_dim=128.0), "--head-dim")])
def test_config_for_depth_refuses_non_integer_sizes_by_flag(kwargs, flag):
    """depth "4" raised a TypeError; 2.5, True and the float sizes were refused as GPTConfig.n_layer
    or GPTConfig.n_head: got 1.0, fields the caller never passed."""
    args = dict(depth=2, vocab_size=100, sequence_len=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{flag}: got .*accepted: an integer"):
        config_for_depth(**args)
    assert config_for_depth(2, 100, 64, aspect_ratio=64, head_dim=128).n_embd == 128   # ints still pass


def test_static_kv_cache_longer_than_the_rotary_table_is_refused():
    """The table covers 10 x sequence_len positions (40 here); a StaticKV step over a longer cache
    gathered past it once the position got there ("INDICES element is out of DATA bounds" on
    CPU, a device-side assert on CUDA). Now the step names the table and the cache length."""
    model = _model(T=4, n_layer=2)
    idx = torch.randint(0, V, (1, 1))
    long_cache = KVCache(1, 1, 48, 6, 2, "cpu", torch.float64)
    with torch.no_grad(), pytest.raises(ValueError, match=r"StaticKV cache of 48 positions exceeds the rotary table \(40\)"):
        model(idx, kv_cache=StaticKV(long_cache, torch.tensor([44]), torch.arange(48)))
    fits = KVCache(1, 1, 40, 6, 2, "cpu", torch.float64)   # as long as the table: runs
    with torch.no_grad():
        assert model(idx, kv_cache=StaticKV(fits, torch.tensor([39]), torch.arange(40))).shape == (1, 1, V)


# ---- guards for what was probed and found right ---------------------------------------------------

@pytest.mark.parametrize("sinks", [None, False, True])
def test_whole_model_gradients_match_float64_autograd_reference(sinks):
    """Every parameter's gradient of a summed loss with ignored targets (GQA 3:1, head dim 6,
    window 4 < T = 9, value embeddings on layers 0 and 2) through the model's own backward
    functions (RMSNorm, rotary norm, ReLU^2, value-embedding mix, softcap cross-entropy) equals
    autograd through the plain reference; sinks: inside weight_cache.step_weights."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, V, (2, 9), generator=g), torch.randint(0, V, (2, 9), generator=g)
    targets[1, 3:] = -1
    P = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    ref = F.cross_entropy(_reference_logits(model, P, idx).reshape(-1, V), targets.reshape(-1),
                          ignore_index=-1, reduction="sum")
    ref.backward()
    if sinks is None:
        loss = model(idx, targets, loss_reduction="sum")
        loss.backward()
    else:
        with weight_cache.step_weights(model, torch.float64, sinks=sinks):
            loss = model(idx, targets, loss_reduction="sum")
            loss.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, P[name].grad, rtol=1e-9, atol=1e-11, msg=name)


def test_per_row_static_decode_t1_and_logits_at_match_the_reference():
    """Rows at different positions in one StaticKV step (stale slots past a row's position
    masked), a T=1 forward at position 0, and logits_at, against the reference (logits are
    float32 by contract, hence the tolerance)."""
    model = _model(pattern="SSL", n_layer=4, n_head=4, n_kv_head=2, n_embd=24)
    idx = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(2))
    ref = _reference_logits(model, _detached(model), idx)
    with torch.no_grad():
        cache = KVCache(2, 2, 16, 6, 4, "cpu", torch.float64)
        model(idx[:, :9], kv_cache=cache)
        pos = torch.tensor([5, 8])   # row 0 rewinds: slots 6..8 are stale for it
        step = model(idx[[0, 1], pos][:, None], kv_cache=StaticKV(cache, pos, torch.arange(12)))
        torch.testing.assert_close(step[:, 0], torch.stack([ref[0, 5], ref[1, 8]]).float(), rtol=0, atol=2e-5)
        torch.testing.assert_close(model(idx[:, :1]), ref[:, :1].float(), rtol=0, atol=2e-5)
        at = torch.tensor([10, 0, 4])
        torch.testing.assert_close(model(idx, logits_at=at), ref[:, at].float(), rtol=0, atol=2e-5)


def test_init_follows_the_documented_scheme():
    """gpt.py's docstring: wte N(0, 1); c_q/c_k/c_v/c_fc and value embeddings U(-s, s), s =
    sqrt(3 / n_embd); both projections and the gates 0; lm_head N(0, 0.001); lambdas 1 and 0.1."""
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=16, vocab_size=300, n_layer=3, n_head=2, n_kv_head=1, n_embd=48)
    model = GPT(cfg)
    model.init_weights()
    s = math.sqrt(3 / 48)
    assert abs(model.wte.weight.std().item() - 1) < 0.05 and abs(model.lm_head.weight.std().item() - 1e-3) < 1e-4
    uniform = [m.weight for b in model.blocks for m in (b.attn.c_q, b.attn.c_k, b.attn.c_v, b.mlp.c_fc)]
    uniform += [e.weight for e in model.value_embeds.values()]
    for w in uniform:
        assert w.abs().max() <= s and w.abs().max() > 0.95 * s and abs(w.std().item() - s / math.sqrt(3)) < 0.02
    zero = [m.weight for b in model.blocks for m in (b.attn.c_proj, b.mlp.c_proj, b.attn.ve_gate) if m is not None]
    assert len(zero) == 2 * 3 + 2 and all(torch.count_nonzero(w) == 0 for w in zero)
    assert sorted(model.value_embeds) == ["0", "2"]
    assert torch.equal(model.resid_lambdas, torch.ones(3)) and torch.equal(model.x0_lambdas, torch.full((3,), 0.1))
    idx = torch.randint(0, 300, (4, 16))
    assert abs(model(idx, idx).item() - math.log(300)) < 0.05   # initial loss ~ ln(vocab)


def test_dtype_policy_and_loss_reductions_with_ignored_targets():
    """Logits float32 whatever the compute dtype, the loss float64 in a float64 model; "none"
    gives (B, T) with 0 at ignored targets, "sum" their sum, "mean" the sum over the kept count;
    an all-ignored batch: sum 0, none zeros, mean NaN (F.cross_entropy's convention, documented
    in kernels.py) with zero, finite gradients."""
    model = _model()
    idx = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    targets = idx.roll(-1, 1)
    targets[0, 2:] = -1
    assert model(idx).dtype == torch.float32
    none, total = model(idx, targets, loss_reduction="none"), model(idx, targets, loss_reduction="sum")
    assert none.dtype == torch.float64 and none.shape == (2, 7) and torch.all(none[0, 2:] == 0)
    torch.testing.assert_close(total, none.sum(), rtol=1e-13, atol=0)
    torch.testing.assert_close(model(idx, targets), total / 9, rtol=1e-13, atol=0)
    ignored = torch.full_like(targets, -1)
    assert model(idx, ignored, loss_reduction="sum").item() == 0
    assert torch.count_nonzero(model(idx, ignored, loss_reduction="none")) == 0
    mean = model(idx, ignored)
    assert torch.isnan(mean)
    mean.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)


def test_a_forward_past_the_rotary_table_names_the_positions_it_needed():
    """Positions run 0..size-1; a forward over [T0, T0 + T) needs up to T0 + T - 1. The error said
    "position T0 + T exceeds the table", one past the last position the forward used."""
    model = _model(T=4, n_layer=2)   # table of 40 positions
    with torch.no_grad(), pytest.raises(ValueError, match=r"positions 0\.\.40 reach past the rotary table's "
                                                           r"40 positions \(0\.\.39\)"):
        model(torch.randint(0, V, (1, 41)))
    with torch.no_grad():
        assert model(torch.randint(0, V, (1, 40))).shape[:2] == (1, 40)   # the whole table: runs


@pytest.mark.parametrize("resolved", ["sdpa_cudnn", "sdpa_flex"])
def test_a_cuda_resolved_backend_on_a_cpu_is_refused_by_its_own_name(resolved):
    """GPT takes the resolved names too (RESOLVED_BACKENDS). On a CPU, sdpa_cudnn ran the window
    layers through flex and failed with "attention backend 'flex' has no backward on CPU", naming a
    backend nobody asked for; now the name given is refused with what a CPU takes."""
    from nanochat.errors import RequestError
    model = GPT(GPTConfig(sequence_len=16, vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=64),
                attn_backend=resolved)
    model.init_weights()
    with pytest.raises(RequestError, match=rf"^--attn-backend: {resolved} \(resolved for a CUDA device\) needs a "
                                           r"CUDA device, got cpu; accepted here: auto\|sdpa\|flex\|reference"):
        model(torch.randint(0, V, (1, 8)))
