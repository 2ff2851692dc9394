"""Engine edge cases (tests/test_engine.py is full): sampling knobs at their limits through the
whole generation (a top_p below float32's range, top-k 1 over tied logits, seeds past the
generator's range) and generate_batch's stop tokens given as an iterator."""

from types import SimpleNamespace

import pytest
import torch

from nanochat.engine import Engine
from tests.test_engine import SEQ_LEN, prompt_for, scripted_engine, specials, tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_top_p_below_float32_range_is_greedy_not_token_0(chat_model, decode):
    """top_p 1e-300 is a valid nucleus (0, 1]; in float32 it reads as 0, which dropped every token,
    the likeliest included, so each draw was the argmax of all zeros: token 0, every step."""
    model, tok = chat_model
    engine = Engine(model, tok, decode=decode, decode_bucket=16)
    prompt = prompt_for(tok)
    kw = dict(max_tokens=12, stop_tokens=(), num_samples=2)
    greedy, _ = engine.generate_batch(prompt, temperature=0.0, **kw)
    assert set(greedy[0][len(prompt):]) != {0}
    for top_p in (1e-30, 1e-50, 1e-300):
        got, _ = engine.generate_batch(prompt, temperature=1.3, top_p=top_p, seed=4, **kw)
        assert got == greedy, top_p


def test_top_k_1_over_tied_logits_is_greedy(tok_plan):
    """top_k 1 is greedy decoding: with the two best logits equal (common in bf16 logits on a GPU)
    it drew either of them at random, so the answer depended on the seed."""
    tok, s, prompt = tok_plan
    tied = TiedModel(tok.vocab_size)
    engine = Engine(tied, tok)
    greedy = [c for c, _ in engine.generate(prompt, max_tokens=6, temperature=0.0, stop_tokens=())]
    assert greedy == [[TiedModel.FIRST]] * 6
    for seed in range(8):
        got = [c for c, _ in engine.generate(prompt, max_tokens=6, temperature=1.0, top_k=1, seed=seed,
                                             stop_tokens=())]
        assert got == greedy, seed


class TiedModel(torch.nn.Module):
    """Every position: tokens FIRST and SECOND share the top logit, the rest far below."""
    FIRST, SECOND = 11, 12

    def __init__(self, vocab_size):
        super().__init__()
        self.config = SimpleNamespace(sequence_len=64, vocab_size=vocab_size, n_layer=1, n_head=1, n_kv_head=1,
                                      n_embd=8)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, idx, kv_cache=None, logits_at=None):
        B, T = idx.shape
        kv_cache.advance(T)
        logits = torch.full((B, T if logits_at is None else len(logits_at), self.config.vocab_size), -10.0)
        logits[..., [self.FIRST, self.SECOND]] = 5.0
        return logits


@pytest.fixture
def tok_plan(chat_model):
    tok = chat_model[1]
    return tok, specials(tok), [tok.bos_token_id, 1, 2]


def test_seed_outside_the_generators_range_is_refused_at_the_call(chat_model):
    """A seed of 2**64 passed the check (an integer >= 0) and failed at the first token, inside the
    generator, as 'Overflow when unpacking long long' (chat_cli printed that for every message)."""
    model, tok = chat_model
    engine = Engine(model, tok)
    prompt = prompt_for(tok)
    for seed in (2**64, 10**30):
        with pytest.raises(ValueError, match=r"seed: got .*; accepted: an integer in 0\.\.18446744073709551615"):
            engine.generate(prompt, seed=seed)
    top = list(engine.generate(prompt, max_tokens=2, seed=2**64 - 1, stop_tokens=()))
    assert len(top) == 2
    from nanochat.batching import BatchedEngine

    with pytest.raises(ValueError, match="seed: got"):
        BatchedEngine(Engine(model, tok, decode="static"), slots=1).generate(prompt, seed=2**64)


def test_bad_stop_tokens_name_the_argument(chat_model):
    model, tok = chat_model
    engine = Engine(model, tok)
    for stops in (["<|assistant_end|>"], [None], 5):
        with pytest.raises(ValueError, match="stop_tokens"):
            engine.generate([1, 2, 3], stop_tokens=stops)


def test_generate_batch_stops_on_an_iterator_of_stop_tokens(tok_plan):
    """generate_batch read the iterator for its own bookkeeping, so generate got it empty and
    decoded to max_tokens past the stop token (same rows, 100x the steps)."""
    tok, s, prompt = tok_plan
    script = [*tok.encode("hi there"), s.assistant_end]
    engine = scripted_engine(tok, lambda b, gen: script[len(gen)] if len(gen) < len(script) else 7, prompt)
    calls = []
    hook = engine.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        rows, masks = engine.generate_batch(prompt, max_tokens=100, temperature=0.0,
                                            stop_tokens=(t for t in [s.assistant_end]))
    finally:
        hook.remove()
    assert rows == [prompt + script[:-1]] and masks == [[0] * len(prompt) + [1] * (len(script) - 1)]
    assert len(calls) == len(script)   # the prefill, then one step per token before the stop


def test_context_end_with_several_samples(chat_model):
    """A prompt one token short of the context: one step for every sample, in both decode paths."""
    model, tok = chat_model
    prompt = [tok.bos_token_id] * (SEQ_LEN - 1)
    for decode in ("eager", "static"):
        steps = list(Engine(model, tok, decode=decode).generate(prompt, num_samples=3, max_tokens=9,
                                                                temperature=1.0, seed=1, stop_tokens=()))
        assert len(steps) == 1 and len(steps[0][0]) == 3
