"""Review 3 of the model on CPU: attention against a float64 masked-softmax reference written here,
chunked-prefill / static KV-cache decode against the full forward (windows, positions past the
window, per-row positions), the FLOPs/token figure at d20 by hand, config and state_dict refusals,
int8 round-trip bounds, and loads with assign=True (meta-built models, quantised row views)."""

from __future__ import annotations

import math

import pytest
import torch

from nanochat.attention import attention
from nanochat.gpt import GPT, GPTConfig, config_for_depth
from nanochat.kv_cache import KVCache, StaticKV
from nanochat.quantize import quantize_model, quantize_rows

V = 70


def _model(pattern="SSL", dtype=torch.float64, T=16, n_kv_head=2):
    cfg = GPTConfig(sequence_len=T, vocab_size=V, n_layer=4, n_head=4, n_kv_head=n_kv_head, n_embd=32,
                    window_pattern=pattern)
    model = GPT(cfg, attn_backend="sdpa", compute_dtype=dtype).to(dtype)
    model.init_weights()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # away from init (zero projections / gates would hide terms)
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if "lambdas" in name else 0.0))
    return model


def _masked_softmax(q, k, v, window):
    B, H, T, D = q.shape
    rep = H // k.size(1)
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    ok = (j <= i) & ((i - j < window) if window else True)
    return ((q @ k.transpose(-1, -2)) / math.sqrt(D)).masked_fill(~ok, -math.inf).softmax(-1) @ v


@pytest.mark.parametrize("backend", ["sdpa", "flex", "reference"])
def test_attention_equals_masked_softmax_reference(backend):
    torch.manual_seed(0)
    for T, window in ((1, 1), (5, 1), (5, 3), (130, 64), (130, 129), (130, 500), (130, None)):
        q = torch.randn(2, 4, T, 16, dtype=torch.float64)
        k, v = torch.randn(2, 2, T, 16, dtype=torch.float64), torch.randn(2, 2, T, 16, dtype=torch.float64)
        out = attention(q, k, v, window=window, backend=backend)
        torch.testing.assert_close(out, _masked_softmax(q, k, v, window), rtol=0, atol=1e-10)


@pytest.mark.parametrize("pattern", ["SSL", "S"])
def test_chunked_prefill_and_static_decode_equal_the_full_forward(pattern):
    """Windows of 4 keys over 16 positions: chunks that start inside and past the window, then
    StaticKV steps with each row at its own position (row 1 two tokens behind row 0)."""
    model = _model(pattern)
    idx = torch.randint(0, V, (2, 16))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2, 2, 16, 8, 4, "cpu", torch.float64)
        chunks = [model(idx[:, a:b], kv_cache=cache) for a, b in ((0, 3), (3, 9), (9, 10), (10, 16))]
        torch.testing.assert_close(torch.cat(chunks, 1), full, rtol=0, atol=1e-6)
        cache = KVCache(2, 2, 16, 8, 4, "cpu", torch.float64)
        model(idx[:, :6], kv_cache=cache)
        for s in range(8):
            pos = torch.tensor([6 + s, 4 + s])
            out = model(torch.stack([idx[0, 6 + s], idx[1, 4 + s]])[:, None],
                        kv_cache=StaticKV(cache, pos, torch.arange(16)))
            torch.testing.assert_close(out[:, 0], torch.stack([full[0, 6 + s], full[1, 4 + s]]), rtol=0, atol=1e-6)


def test_flops_per_token_at_d20_by_hand():
    """6 N (N = transformer matrices incl. value-embedding gates + padded lm_head: the matmul part,
    DESIGN.md's ~2.6e9) + 12 * n_head * head_dim * keys per layer (causal not halved): SSSL at
    T = 2048 gives 15 window layers of 512 keys and 5 full layers (the last one forced full)."""
    with torch.device("meta"):
        model = GPT(config_for_depth(20, 32768, 2048))
    C, L = 1280, 20
    matrices = L * 12 * C * C + 10 * 32 * 10 + 32768 * C   # q,k,v,proj (4C^2) + MLP (8C^2); 10 gates; head
    assert model.num_scaling_params() == matrices
    attn = 12 * 10 * 128 * (15 * 512 + 5 * 2048)
    assert model.estimate_flops() == 6 * matrices + attn
    assert round(6 * matrices / 1e9, 1) == 2.6 and round(model.estimate_flops() / 1e9, 2) == 2.89


@pytest.mark.parametrize("field,value", [("n_kv_head", 3), ("n_head", 0), ("n_embd", 30), ("softcap", -1.0),
                                         ("vocab_size", 0), ("sequence_len", 2.0)])
def test_config_refusals_name_the_field(field, value):
    cfg = GPTConfig(sequence_len=64, vocab_size=V, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPT(cfg)


def test_state_dict_of_another_config_names_the_mismatch():
    other = GPT(GPTConfig(sequence_len=16, vocab_size=V, n_layer=4, n_head=4, n_kv_head=4, n_embd=32))
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks\.0\.attn\.c_k\.weight"):
        other.load_state_dict(_model(dtype=torch.float32).state_dict())


def test_int8_round_trip_error_is_at_most_half_a_step():
    w = torch.randn(5, 300) * torch.tensor([1e-8, 1.0, 100.0, 0.0, 3.0])[:, None]
    q, scale = quantize_rows(w)
    err = (w - q.float() * scale[:, None]).abs().amax(1)
    assert (err <= scale / 2 * (1 + 1e-5)).all() and q.abs().max() == 127 and scale[3] == 1


def test_meta_built_model_loads_with_assign_and_runs():
    """The torch idiom for a fast load (build on meta, load_state_dict(assign=True)) left the rotary
    tables, which are not saved, on meta: the first forward failed."""
    src = _model(dtype=torch.float32)
    idx = torch.randint(0, V, (2, 8))
    with torch.device("meta"):
        model = GPT(src.config, attn_backend="sdpa", compute_dtype=torch.float32)
    model.load_state_dict(src.state_dict(), assign=True)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), src(idx), rtol=0, atol=0)


def test_quantised_assign_load_keeps_row_views_current():
    """assign=True replaced the fused q/k/v rows; c_q/c_k/c_v stayed views of the old ones, so
    grad-enabled forwards (a loss) used the weights the model had before the load."""
    src = quantize_model(_model(dtype=torch.float32), "int8")
    dst = _model(dtype=torch.float32)
    with torch.no_grad():
        for p in dst.parameters():
            p.mul_(-1)
    quantize_model(dst, "int8")
    dst.load_state_dict(src.state_dict(), assign=True)
    attn = dst.blocks[0].attn
    assert torch.equal(attn.c_k.qweight, attn.qkv_quant.qweight[32:48])
    idx = torch.randint(0, V, (2, 8))
    torch.testing.assert_close(dst(idx, idx), src(idx, idx), rtol=0, atol=0)


def test_targets_of_another_shape_are_refused():
    """(T, B) targets with B * T elements lined up with the wrong tokens and gave a finite loss."""
    model = _model(dtype=torch.float32)
    idx = torch.randint(0, V, (2, 8))
    for bad in (idx.t(), idx[:, :7]):
        with pytest.raises(ValueError, match=r"GPT.forward targets: expected the shape of idx \(2, 8\)"):
            model(idx, bad)
