"""Sixth review of inference (engine, batching, sampling): a cancelled batched stream ends at once
even where the scheduler already queued its later steps, a temperature past float32's range keeps
the top-k / top-p filters of the torch sampler, warm-up on a context too short for its usual
prompts, and (regression guards) KV-cache reuse across requests of different lengths and tool
output that runs into the context end."""

import time

import pytest
import torch

from nanochat.batching import BatchedEngine
from nanochat.engine import Engine
from nanochat.sampling import Sampler, sample_next
from tests.test_engine import scripted_engine, specials, tok  # noqa: F401  (fixtures)
from tests.test_engine import chat_model  # noqa: F401  (the session fixture tok needs)
from tests.test_engine import random_model
from tests.test_engine_review2 import greedy_without_cache, windowed_model


def _wait_until(cond, timeout=20.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_cancel_ends_a_stream_whose_steps_are_already_queued():
    """A consumer slower than the scheduler: every step of the request is already in its queue when
    cancel() comes. The stream kept handing out those 29 queued steps after the cancel."""
    batched = BatchedEngine(Engine(windowed_model(), None, decode="static", decode_bucket=8), slots=1)
    stream = batched.generate([1, 2, 3], max_tokens=30, temperature=0.0, stop_tokens=())
    first = next(stream)
    assert _wait_until(lambda: batched.live_rows == 0)   # the scheduler has produced all 30 steps
    assert stream._req.out.qsize() > 1
    stream.cancel()
    assert list(stream) == [] and len(first[0]) == 1
    # cancelled before the first read: never submitted, nothing runs
    steps = batched.steps
    never = batched.generate([1, 2, 3], max_tokens=5)
    never.cancel()
    assert list(never) == [] and batched.waiting == 0 and batched.steps == steps
    batched.close()


@pytest.mark.parametrize("temperature", [1e39, 1e300])
@pytest.mark.parametrize("top_p", [None, 0.9])
def test_temperature_past_float32_range_keeps_top_k(temperature, top_p):
    """T became inf in float32: every tempered logit 0 (masked ones nan) and the draw went to any of
    the 100 tokens. Such a T is uniform over the 5 tokens top-k keeps (top-p 0.9 of five equal
    probabilities keeps all five), nothing more."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 100, generator=gen) * 3
    allowed = [set(row.topk(5).indices.tolist()) for row in logits]
    draws = [sample_next(logits, temperature, 5, top_p, gen).tolist() for _ in range(200)]
    for r in range(2):
        assert {d[r] for d in draws} == allowed[r]
    sampler = Sampler("cpu", temperature, 5, top_p, seed=1, backend="torch")
    for _ in range(20):
        first, second = sampler(logits, 0).tolist()
        assert first in allowed[0] and second in allowed[1]


def test_moderate_temperatures_draw_as_before():
    """Top-k now masks the raw logits, before the division by T: the same draws at ordinary T."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=gen) * 2
    for temperature, top_k, top_p in [(0.7, 20, None), (1.3, 50, 0.8), (1.0, None, 0.5)]:
        a, b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        got = sample_next(logits, temperature, top_k, top_p, a)
        ref_logits = logits / temperature
        if top_k is not None:
            ref_logits = ref_logits.masked_fill(ref_logits < ref_logits.topk(top_k).values[:, -1:], float("-inf"))
        noise = torch.empty_like(ref_logits).exponential_(generator=b).clamp_min_(torch.finfo(torch.float32).tiny)
        if top_p is None:
            want = (ref_logits - noise.log()).argmax(dim=-1)
        else:
            probs = torch.softmax(ref_logits, dim=-1)
            sp, order = torch.sort(probs, dim=-1, descending=True)
            drop = (sp.cumsum(-1) - sp) >= top_p
            drop[..., 0] = False
            want = (torch.zeros_like(probs).scatter_(-1, order, sp.masked_fill(drop, 0.0)) / noise).argmax(-1)
        assert torch.equal(got, want)


def test_warmup_on_a_context_too_short_for_its_usual_prompts():
    """Engine.warmup's 4-token prompt (and BatchedEngine.warmup's context - 2) did not fit a context of
    4 (or 2): start-up raised 'prompt has 4 tokens; the model's context is 4'."""
    engine = Engine(windowed_model(seq_len=4, pattern="L", n_layer=1), None)
    assert engine.warmup() >= 0
    tiny = Engine(windowed_model(seq_len=2, pattern="L", n_layer=1), None, decode="static")
    assert tiny.warmup(batch_sizes=(1,)) >= 0
    batched = BatchedEngine(tiny, slots=1)
    assert batched.warmup() >= 0
    batched.close()


def test_kv_cache_reuse_across_requests_of_different_lengths():
    """One persistent cache serves a long request, then shorter and longer ones: the stale k/v a
    longer earlier request left past a later one's position never leaks into its answer."""
    model = windowed_model(seq_len=48)
    static = Engine(model, None, decode="static", decode_bucket=8)
    batched = BatchedEngine(Engine(model, None, decode="static", decode_bucket=8), slots=2)
    for length in (40, 3, 20, 1):
        prompt = [(i * 5 + 1) % 97 for i in range(length)]
        want = greedy_without_cache(model, prompt, 48 - length)
        assert [c[0] for c, _ in static.generate(prompt, max_tokens=100, temperature=0.0)] == want
        assert [c[0] for c, _ in batched.generate(prompt, max_tokens=100, temperature=0.0)] == want
    batched.close()


@pytest.mark.parametrize("decode", ["eager", "static", "batched"])
def test_tool_output_running_into_the_context_end(tok, decode):  # noqa: F811  (the imported fixture)
    """A ~300-digit calculator result forced at the context end: generation stops at the context
    (every step yielded once, forced ones with mask 0), no error, nothing past the end."""
    s, prompt = specials(tok), [tok.bos_token_id, 1, 2]
    call = [s.python_start, *tok.encode("123456789**35"), s.python_end]
    engine = scripted_engine(tok, lambda b, gen: call[len(gen)] if len(gen) < len(call) else 7, prompt,
                             "eager" if decode == "eager" else "static")
    room = engine.max_seq_len - len(prompt)
    source = BatchedEngine(engine, slots=2) if decode == "batched" else engine
    steps = list(source.generate(prompt, temperature=0.0, max_tokens=10_000))
    tokens, masks = [c[0] for c, _ in steps], [m[0] for _, m in steps]
    assert len(tokens) == room and tokens[:len(call)] == call
    assert tokens[len(call)] == s.output_start and s.output_end not in tokens
    assert masks == [1] * len(call) + [0] * (room - len(call))
    if decode == "batched":
        source.close()


def test_explicit_persistent_step_that_cannot_run_is_refused_when_the_engine_is_built(monkeypatch):
    """graph_step='persistent' on a model/device the persistent kernel cannot serve failed only at
    the first answer, with a message that did not name graph_step; it is refused up front now,
    naming the reason and the accepted values. Eager decoding, which never runs the step, still
    takes the request as before."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = random_model("cpu")
    from nanochat.errors import RequestError
    with pytest.raises(RequestError, match=r"graph_step \(--graph-step\): 'persistent' cannot run here: needs a CUDA GPU.*"
                                         r"accepted here: auto\|compiled\|eager"):
        Engine(model, None, decode="static", graph_step="persistent")
    assert Engine(model, None, decode="eager", graph_step="persistent").decode_mode == "eager"
