"""Eighth review of generation (engine, batching, sampling): numpy numbers (a sweep's seeds,
temperatures, sample counts) are taken as the numbers they are, not refused with a message that
contradicts itself; and (regression guards) a table-driven stand-in model that samples tool calls
at random, run through eager, static and continuously batched decoding with staggered admission,
gives every request exactly its lone run, forced calculator output and masks included."""

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nanochat.batching import BatchedEngine
from nanochat.engine import Engine, validate_sampling
from tests.test_engine import chat_model, specials, tok  # noqa: F401  (fixtures)
from tests.test_engine_review2 import greedy_without_cache, windowed_model


def _steps(gen):
    return [(list(c), list(m)) for c, m in gen]


def test_numpy_numbers_are_accepted_as_the_numbers_they_are():
    """np.int64(2) samples were refused with "num_samples: got np.int64(2); accepted: an integer >= 1"
    (and likewise max_tokens, seed, top_k, slots; np.float32 temperatures and top_p): the message
    contradicts itself, while numpy token ids and stop ids were accepted."""
    engine = Engine(windowed_model(), None)
    plain = dict(num_samples=2, max_tokens=5, temperature=0.7, top_k=20, top_p=0.9, seed=3, stop_tokens=())
    numpy = dict(num_samples=np.int64(2), max_tokens=np.int32(5), temperature=np.float32(0.7),
                 top_k=np.int64(20), top_p=np.float32(0.9), seed=np.uint64(3), stop_tokens=())
    want = _steps(engine.generate([1, 2, 3], **plain))
    # np.float32(0.7) != 0.7: the draws are those of float(np.float32(...)), not of 0.7
    want32 = _steps(engine.generate([1, 2, 3], **{**plain, "temperature": float(np.float32(0.7)),
                                                  "top_p": float(np.float32(0.9))}))
    assert len(want) == 5 and len(want[0][0]) == 2
    assert _steps(engine.generate([1, 2, 3], **numpy)) == want32
    assert engine.generate_batch([1, 2, 3], **numpy)[0] == engine.generate_batch([1, 2, 3], **{
        **plain, "temperature": float(np.float32(0.7)), "top_p": float(np.float32(0.9))})[0]
    t, k, p = validate_sampling(np.float64(0.5), np.int64(7), np.float64(0.25))
    assert (t, k, p) == (0.5, 7, 0.25) and type(k) is int and type(t) is float
    batched = BatchedEngine(Engine(windowed_model(), None, decode="static", decode_bucket=8), slots=np.int64(2))
    assert batched.slots == 2 and type(batched.slots) is int
    assert _steps(batched.generate([1, 2, 3], **numpy)) == want32
    batched.close()
    # what is not an integer is still refused, naming the argument
    for bad in (2.0, "2", True, np.float64(2.0)):
        with pytest.raises(ValueError, match=r"^num_samples: got .*; accepted: an integer >= 1"):
            engine.generate([1, 2, 3], num_samples=bad)
    with pytest.raises(ValueError, match=r"^temperature: got"):
        engine.generate([1, 2, 3], temperature=np.float32("nan"))
    with pytest.raises(ValueError, match=r"^seed: got"):
        engine.generate([1, 2, 3], seed=np.int64(-1))


class MarkovModel(torch.nn.Module):
    """Stands in for GPT with a next-token table: the logits after token t are table[t], so the KV
    cache plays no part and any cache layout (eager, static, per-row batched) must give the same
    tokens. The table makes <|python_start|> likely anywhere, digits and operators after it and
    <|python_end|> after digits: sampled replies call the calculator now and then, at random."""

    def __init__(self, tokenizer, seq_len=96):
        super().__init__()
        V, s = tokenizer.vocab_size, specials(tokenizer)
        self.config = SimpleNamespace(sequence_len=seq_len, vocab_size=V, n_layer=1, n_head=1, n_kv_head=1,
                                      n_embd=8)
        table = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 2
        digits = [tokenizer.encode(str(d))[0] for d in range(10)]
        ops = [tokenizer.encode(o)[0] for o in "+*"]
        table[:, s.python_start] += 4.5
        for d in digits:
            table[s.python_start, d] += 12
            table[d, digits + ops] += 5
            table[d, s.python_end] += 7
        for o in ops:
            table[o, digits] += 9
        table[:, s.bos] -= 30   # bos is a default stop: replies end at assistant_end or max_tokens
        self.table = torch.nn.Parameter(table)

    def forward(self, idx, kv_cache=None, logits_at=None):
        if kv_cache is not None:
            kv_cache.advance(idx.size(1))   # StaticKV: a no-op
        logits = self.table[idx]
        return logits if logits_at is None else logits[:, logits_at]


def test_random_tool_calls_through_every_decode_path_and_staggered_batching(tok):  # noqa: F811
    s = specials(tok)
    model = MarkovModel(tok)
    reqs = [dict(tokens=[tok.bos_token_id] + [5 + i] * (3 + 7 * i), num_samples=1 + (i % 3 == 0),
                 max_tokens=20 + 13 * i, temperature=(1.0, 0.7, 0.0)[i % 3], top_k=(None, 30)[i % 2], seed=i)
            for i in range(7)]
    want = [_steps(Engine(model, tok).generate(**r)) for r in reqs]
    tokens = [t for w in want for c, _ in w for t in c]
    forced = sum(m.count(0) for w in want for _, m in w)
    assert tokens.count(s.python_end) >= 5 and tokens.count(s.output_end) >= 3 and forced >= 20
    # some requests run to their max_tokens (capped by the context): cut off mid-reply or mid-call
    assert any(len(w) == min(r["max_tokens"], 96 - len(r["tokens"])) for w, r in zip(want, reqs))
    static = Engine(model, tok, decode="static", decode_bucket=8)
    assert [_steps(static.generate(**r)) for r in reqs] == want
    batched = BatchedEngine(Engine(model, tok, decode="static", decode_bucket=8), slots=3)
    got = [None] * len(reqs)

    def run(i):
        time.sleep(0.01 * i)   # joins while others are mid-reply; 9 rows through 3 slots
        got[i] = _steps(batched.generate(**reqs[i]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    batched.close()
    assert got == want
    assert batched.rows_stepped > batched.steps   # rows really shared steps


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_greedy_to_the_context_end_equals_recomputation(decode):
    """Prompts from 1 token to one short of the context, max_tokens far past it: every reply runs
    exactly to the context end and equals greedy decoding without a cache."""
    model = windowed_model(seq_len=30, pattern="SSL")
    engine = Engine(model, None, decode=decode, decode_bucket=7)
    for n in (1, 9, 27, 29):
        prompt = [(5 * i + n) % 97 for i in range(n)]
        out = [c[0] for c, _ in engine.generate(prompt, max_tokens=10**6, temperature=0.0)]
        assert out == greedy_without_cache(model, prompt, 30 - n)
