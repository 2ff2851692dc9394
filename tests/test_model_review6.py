"""Review 6 of the model on CPU: bad input to the model's setters, FLOPs/mask helpers and KV caches
is refused by name (it used to fail later inside torch or give a silently wrong figure), plus
guards for what was probed and found right: FLOPs and parameter counts of odd shapes, parameter
groups, KV-cache decode for every window pattern, seeded init and state_dict round trips."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanochat import fused_norm
from nanochat.gpt import GPT, GPTConfig, plain_mix_norm
from nanochat.kv_cache import KVCache, StaticKV

V = 70


def _model(pattern="SL", n_layer=2, n_head=4, n_kv_head=1, n_embd=32, T=16, dtype=torch.float32, backend="sdpa"):
    cfg = GPTConfig(sequence_len=T, vocab_size=V, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                    n_embd=n_embd, window_pattern=pattern)
    torch.manual_seed(0)
    model = GPT(cfg, attn_backend=backend, compute_dtype=dtype).to(dtype)
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():   # off the zero-init projections, which would hide the attention path
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


# ---- defects fixed in this review ---------------------------------------------------------------

def test_set_rotary_norm_refuses_a_non_callable():
    """Its siblings (set_loss_fn, set_mix_norm, ...) refuse one; this one stored it and the first
    forward died with "'str' object is not callable" inside attention."""
    model = _model()
    with pytest.raises(ValueError, match="set_rotary_norm: expected a callable or None, got str"):
        model.set_rotary_norm("triton")
    model.set_rotary_norm(None)
    model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("fn", [None, plain_mix_norm])
def test_set_mix_norm_refuses_chain_x0_without_a_chaining_fn(fn):
    """chain_x0=True calls fn(..., x0_chain=True): with the plain mix the first training step
    failed with a TypeError; now the setter says so. The fused op takes it."""
    model = _model()
    with pytest.raises(ValueError, match="chain_x0=True needs a fn that takes x0_chain"):
        model.set_mix_norm(fn, chain_x0=True)
    model.set_mix_norm(fused_norm.mix_norm, chain_x0=True)
    idx = torch.randint(0, V, (1, 8))
    model(idx, idx).backward()


@pytest.mark.parametrize("bad", [0, -8, 2.5, True])
def test_flops_and_masks_refuse_a_non_positive_seq_len(bad):
    """estimate_flops(0) silently meant the config's length, and -8 charged every query -8 keys
    (a smaller FLOPs figure: a wrong MFU); prepare_attention(0) built the default masks."""
    model = _model()
    for call in (model.estimate_flops, model.prepare_attention):
        with pytest.raises(ValueError, match=r"seq_len: got .*; accepted: None or an integer >= 1"):
            call(bad)
    assert model.estimate_flops(None) == model.estimate_flops(16) > model.estimate_flops(8)


@pytest.mark.parametrize("field,value", [("seq_len", 2.5), ("num_kv_heads", True), ("head_dim", "8")])
def test_kv_cache_refuses_non_integer_sizes(field, value):
    """int(value) >= 1 let 2.5 and "8" through to a TypeError inside torch.zeros, and True as 1."""
    sizes = dict(batch_size=1, num_kv_heads=1, seq_len=8, head_dim=8, num_layers=2)
    sizes[field] = value
    with pytest.raises(ValueError, match=f"KVCache {field}: got {value!r}; accepted: an integer >= 1"):
        KVCache(**sizes, device="cpu", dtype=torch.float32)


def test_copy_row_refuses_a_negative_length_and_other_heads():
    """A negative length sliced from the end (all but the last slots copied); a cache of other
    kv heads broadcast one head's row into all of them. Both without an error."""
    src = KVCache(2, 1, 8, 8, 2, "cpu", torch.float32)
    dst = KVCache(2, 4, 8, 8, 2, "cpu", torch.float32)
    with pytest.raises(ValueError, match="copy_row: -2 slots"):
        src.copy_row(0, src, 1, -2)
    with pytest.raises(ValueError, match="copy_row: 1 kv heads x head dim 8 given, the cache holds 4 x 8"):
        dst.copy_row(0, src, 0, 5)
    src.k[0][1, :, :5] = 1.0
    src.copy_row(0, src, 1, 5)
    assert torch.equal(src.k[0][0, :, :5], torch.ones(1, 5, 8))


def test_a_cache_of_other_heads_is_refused_by_name():
    """KVCache(B, n_head, ...) for a GQA model: prefill broadcast the one kv head (silently), the
    static decode step then failed with index_copy_'s slice-shape message."""
    model = _model(n_kv_head=1)
    cfg = model.config
    idx = torch.randint(0, V, (2, 6))
    with torch.no_grad():
        cache = KVCache(2, cfg.n_head, 16, cfg.head_dim, cfg.n_layer, "cpu", torch.float32)
        with pytest.raises(ValueError, match="1 kv heads x head dim 8 given, the cache holds 4 x 8"):
            model(idx, kv_cache=cache)
        for pos in (torch.tensor([3]), torch.tensor([3, 4])):
            with pytest.raises(ValueError, match="1 kv heads x head dim 8 given, the cache holds 4 x 8"):
                model(idx[:, :1], kv_cache=StaticKV(cache, pos, torch.arange(16)))


# ---- guards for what was probed and found right -------------------------------------------------

@pytest.mark.parametrize("shape", [dict(n_embd=24, n_head=4, n_kv_head=1), dict(n_embd=6, n_head=3, n_kv_head=3),
                                   dict(n_embd=40, n_head=2, n_kv_head=1)])
def test_counts_groups_and_flops_of_odd_shapes(shape):
    """Head dims 6, 2 and 20, widths under the 32 gate channels: param_counts equals the built
    parameters, the groups cover each once, and the matmul FLOPs equal torch's counter."""
    model = _model(n_layer=3, **shape)
    assert sum(model.param_counts().values()) == sum(p.numel() for p in model.parameters())
    ids = [id(p) for ps in model.param_groups().values() for p in ps]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in model.parameters()}
    idx = torch.randint(0, V, (2, 12))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    mm = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}["aten.mm"]
    cfg = model.config
    attn = sum(12 * cfg.n_head * cfg.head_dim * (12 if w is None else min(w, 12)) for w in model.windows)
    assert model.windows == [4, None, None]
    assert model.estimate_flops(12) - attn == mm / idx.numel()


@pytest.mark.parametrize("pattern,n_layer", [("L", 1), ("S", 2), ("LS", 3), ("SSSL", 5)])
def test_kv_cache_decode_equals_the_full_forward_past_sequence_len(pattern, n_layer):
    """Uneven chunks, then single tokens, out to 20 positions (past sequence_len 8, windows of 2)."""
    model = _model(pattern, n_layer=n_layer, n_kv_head=2, T=8, dtype=torch.float64)
    idx = torch.randint(0, V, (2, 20))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2, 2, 20, 8, n_layer, "cpu", torch.float64)
        bounds = (0, 5, 6, 9, 16, 17, 18, 19, 20)
        out = torch.cat([model(idx[:, a:b], kv_cache=cache) for a, b in zip(bounds, bounds[1:])], 1)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-9)


def test_seeded_init_and_state_dict_round_trip():
    """The same seed gives the same weights; a state_dict loads into a fresh model (the rotary
    tables, not saved, rebuilt) with bit-identical logits."""
    cfg = GPTConfig(sequence_len=16, vocab_size=V, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    states = []
    for _ in range(2):
        torch.manual_seed(3)
        model = GPT(cfg)
        model.init_weights()
        states.append(model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    assert not any(k in states[0] for k in ("cos", "sin"))
    fresh = GPT(cfg)
    fresh.load_state_dict(states[0])
    idx = torch.randint(0, V, (1, 16))
    with torch.no_grad():
        assert torch.equal(fresh(idx), model(idx))
