"""Engine: KV-cache decoding matches full recomputation, batches match singles, sampling knobs,
stop tokens, the calculator tool state machine (with a scripted stand-in model), TextStream."""

import functools
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from nanochat.calculator import REFUSED_OUTPUT
from nanochat.engine import Engine, assistant_parts
from nanochat.text_stream import TextStream

SEQ_LEN = 256


@functools.lru_cache(maxsize=None)
def tiny_chat_model(corpus_dir: str):
    """A small BPE tokenizer trained on a slice of the Shakespeare shard and a depth-2 GPT with
    random weights (scaled up so greedy choices are decisive, not ties). Built once per session;
    tests/test_chat_web.py and tests/test_browser.py reuse it."""
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import Tokenizer

    shard = sorted(p for p in __import__("pathlib").Path(corpus_dir).glob("*.parquet"))[0]
    texts = pq.read_table(shard, columns=["text"]).column("text").to_pylist()[:150]
    tokenizer = Tokenizer.train(texts, vocab_size=512)
    config = GPTConfig(sequence_len=SEQ_LEN, vocab_size=tokenizer.vocab_size, n_layer=2, n_head=2,
                       n_kv_head=1, n_embd=64, window_pattern="SL")
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # init_weights zeroes some projections; random ones give varied logits
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


@pytest.fixture(scope="session")
def engine(chat_model):
    model, tokenizer = chat_model
    return Engine(model, tokenizer)


def prompt_for(tokenizer, text="Hello there, how are you?"):
    return tokenizer.render_for_completion({"messages": [{"role": "user", "content": text}]})


# ------------------------------------------------------------------------------------ real model

def test_kv_cache_matches_full_recompute(engine, chat_model):
    model, tokenizer = chat_model
    prompt = prompt_for(tokenizer)
    steps = list(engine.generate(prompt, max_tokens=40, temperature=0.0, stop_tokens=[]))
    cached = [col[0] for col, _ in steps]
    assert len(cached) == 40
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(40):
            logits = model(torch.tensor([ids]))[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4, "tie in greedy choice: the test model is not decisive"
            ids.append(int(logits.argmax()))
    assert cached == ids[len(prompt):]
    assert len(set(cached)) > 3  # not a degenerate model repeating one token


def test_cached_logits_match_full_forward(engine, chat_model):
    model, tokenizer = chat_model
    seq = prompt_for(tokenizer, "To be or not to be")
    with torch.no_grad():
        full = model(torch.tensor([seq]))[0]
        cache = engine.new_cache(1, len(seq))
        split = len(seq) - 5
        got = [model(torch.tensor([seq[:split]]), kv_cache=cache)[0]]
        for t in seq[split:]:
            got.append(model(torch.tensor([[t]]), kv_cache=cache)[0])
    torch.testing.assert_close(torch.cat(got), full, atol=1e-4, rtol=1e-4)


def test_batch_equals_singles_greedy(engine, chat_model):
    _, tokenizer = chat_model
    prompt = prompt_for(tokenizer, "What is the weather")
    single, _ = engine.generate_batch(prompt, num_samples=1, max_tokens=30, temperature=0.0, stop_tokens=[])
    batch, masks = engine.generate_batch(prompt, num_samples=4, max_tokens=30, temperature=0.0, stop_tokens=[])
    assert all(row == single[0] for row in batch)
    assert all(m == [0] * len(prompt) + [1] * 30 for m in masks)


def test_prefill_once_then_batched_decode(engine, chat_model):
    model, tokenizer = chat_model
    shapes = []
    hook = model.register_forward_hook(lambda mod, args, kwargs, out: shapes.append(tuple(args[0].shape)),
                                       with_kwargs=True)
    try:
        prompt = prompt_for(tokenizer)
        list(engine.generate(prompt, num_samples=3, max_tokens=5, temperature=1.0, stop_tokens=[]))
    finally:
        hook.remove()
    assert shapes == [(1, len(prompt))] + [(3, 1)] * 4


def test_sampling_is_seeded(engine, chat_model):
    _, tokenizer = chat_model
    prompt = prompt_for(tokenizer)
    kw = dict(num_samples=3, max_tokens=20, temperature=1.0, top_k=50, stop_tokens=[])
    a, _ = engine.generate_batch(prompt, seed=1, **kw)
    b, _ = engine.generate_batch(prompt, seed=1, **kw)
    c, _ = engine.generate_batch(prompt, seed=2, **kw)
    assert a == b and a != c
    assert len({tuple(r) for r in a}) > 1  # samples in a batch differ from each other


def test_top_k_1_and_tiny_top_p_are_greedy(engine, chat_model):
    _, tokenizer = chat_model
    prompt = prompt_for(tokenizer)
    kw = dict(max_tokens=15, stop_tokens=[])
    greedy, _ = engine.generate_batch(prompt, temperature=0.0, **kw)
    assert engine.generate_batch(prompt, temperature=1.5, top_k=1, seed=3, **kw)[0] == greedy
    assert engine.generate_batch(prompt, temperature=1.5, top_p=1e-6, seed=3, **kw)[0] == greedy


def test_context_limit_and_validation(engine, chat_model):
    _, tokenizer = chat_model
    steps = list(engine.generate([tokenizer.bos_token_id] * (SEQ_LEN - 3), max_tokens=50, stop_tokens=[]))
    assert len(steps) == 3
    with pytest.raises(ValueError, match="tokens"):
        engine.generate([tokenizer.bos_token_id] * SEQ_LEN)
    with pytest.raises(ValueError, match="tokens"):
        engine.generate([])
    for kw, name in [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
                     ({"top_p": 1.5}, "top_p"), ({"num_samples": 0}, "num_samples"), ({"max_tokens": 0}, "max_tokens"),
                     ({"temperature": float("nan")}, "temperature")]:
        with pytest.raises(ValueError, match=name):
            engine.generate([1, 2, 3], **kw)


# ------------------------------------------------------------------------------------ scripted model

class ScriptedModel(torch.nn.Module):
    """Stands in for GPT: the next token of row b is plan(b, tokens generated so far in row b),
    with all probability on it. Records what it was fed so tests can see forced tokens."""

    def __init__(self, vocab_size: int, prompt_len: int, plan):
        super().__init__()
        self.config = SimpleNamespace(sequence_len=128, vocab_size=vocab_size, n_layer=1, n_head=1,
                                      n_kv_head=1, n_embd=8)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the engine a device and dtype
        self.prompt_len, self.plan, self.history = prompt_len, plan, []

    def forward(self, idx, kv_cache=None, logits_at=None):
        B, T = idx.shape
        if T > 1:
            self.history = [idx[0].tolist()]
        else:
            # the token lands at the cache position: a step re-run at the same position (static
            # decoding redoes a step whose speculative input a forced token replaced) overwrites it
            pos = int(kv_cache.pos)
            if len(self.history) != B:
                self.history = [list(self.history[0]) for _ in range(B)]
            for b in range(B):
                self.history[b][pos:] = [int(idx[b, 0])]
        kv_cache.advance(T)
        logits = torch.full((B, T if logits_at is None else len(logits_at), self.config.vocab_size), -30.0)
        for b in range(B):
            try:
                nxt = self.plan(b, self.history[b][self.prompt_len:])
            except IndexError:  # past the script's end: static decoding's lookahead step after a stop
                nxt = 0
            logits[b, -1, nxt] = 30.0
        return logits


@pytest.fixture(scope="session")
def tok(chat_model):
    return chat_model[1]


def specials(tok):
    return SimpleNamespace(**{name: tok.encode_special(f"<|{name}|>") for name in (
        "python_start", "python_end", "output_start", "output_end", "assistant_end", "bos", "user_start")})


def scripted_engine(tok, plan, prompt, decode="eager"):
    return Engine(ScriptedModel(tok.vocab_size, len(prompt), plan), tok, decode=decode, decode_bucket=16)


def run(engine, prompt, **kw):
    steps = list(engine.generate(prompt, temperature=0.0, **kw))
    return [list(c) for c, _ in steps], [list(m) for _, m in steps]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_calculator_output_is_forced(tok, decode):
    s, prompt = specials(tok), [tok.bos_token_id, 1, 2]
    call = [s.python_start, *tok.encode("12*3"), s.python_end]
    tail = [*tok.encode(" so 36"), s.assistant_end]

    def plan(b, gen):
        if s.output_end in gen:
            return tail[len(gen) - gen.index(s.output_end) - 1]
        return call[len(gen)] if len(gen) < len(call) else 7  # 7 is overridden by forced tokens

    engine = scripted_engine(tok, plan, prompt, decode)
    cols, masks = run(engine, prompt, max_tokens=60)
    forced = [s.output_start, *tok.encode("36"), s.output_end]
    assert [c[0] for c in cols] == call + forced + tail
    assert [m[0] for m in masks] == [1] * len(call) + [0] * len(forced) + [1] * len(tail)
    # the forced tokens were fed back into the model (static decoding also feeds the stop token:
    # its one-step lookahead is queued before the host sees that the row finished)
    fed, want = engine.model.history[0][len(prompt):], call + forced + tail[:-1]
    assert fed[:len(want)] == want and len(fed) - len(want) == (decode == "static")
    results, bmasks = engine.generate_batch(prompt, max_tokens=60, temperature=0.0)
    assert results[0] == prompt + call + forced + tail[:-1]  # stop token excluded
    parts = assistant_parts(tok, results[0][len(prompt):])
    assert parts == [{"type": "python", "text": "12*3"}, {"type": "python_output", "text": "36"},
                     {"type": "text", "text": " so 36"}]


@pytest.mark.parametrize("expr", ["__import__('os').system('echo pwned')", "().__class__", "10**10**10"])
def test_refused_calculator_forces_an_empty_output(tok, expr):
    """Nothing is evaluated; the call gets a closed output block holding calculator.REFUSED_OUTPUT
    (tests/test_calculator_review7.py says why)."""
    s, prompt = specials(tok), [tok.bos_token_id, 5]
    call = [s.python_start, *tok.encode(expr), s.python_end]
    refused = [s.output_start, *tok.encode(REFUSED_OUTPUT), s.output_end]
    script = call + [7] * len(refused) + tok.encode(" hmm") + [s.assistant_end]   # the 7s: overridden by the forcing
    engine = scripted_engine(tok, lambda b, gen: script[len(gen)], prompt)
    cols, masks = run(engine, prompt, max_tokens=200)
    assert [c[0] for c in cols] == call + refused + script[len(call) + len(refused):]
    assert [m[0] for m in masks] == [1] * len(call) + [0] * len(refused) + [1] * (len(script) - len(call) - len(refused))


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_tool_forcing_is_per_row(tok, decode):
    s, prompt = specials(tok), [tok.bos_token_id, 9]
    # the first token comes from the shared batch-1 prefill, so both rows start with 10
    with_call = [10, s.python_start, *tok.encode("2+2"), s.python_end]
    plain = [10, *tok.encode("four"), s.assistant_end]

    def plan(b, gen):
        if b == 1:
            return plain[len(gen)] if len(gen) < len(plain) else 3
        if s.output_end in gen:
            return s.assistant_end
        return with_call[len(gen)] if len(gen) < len(with_call) else 3

    engine = scripted_engine(tok, plan, prompt, decode)
    cols, masks = run(engine, prompt, num_samples=2, max_tokens=40)
    row0 = [c[0] for c in cols]
    forced = [s.output_start, *tok.encode("4"), s.output_end]
    assert row0 == with_call + forced + [s.assistant_end]
    row1 = [c[1] for c in cols]
    assert row1[:len(plain)] == plain and set(row1[len(plain):]) == {s.assistant_end}
    assert all(m[1] == 0 for m in masks[len(plain):])  # finished row: repeated stop token, mask 0
    # what row 0 was fed: the call, then the forced tokens (not the model's 3s), one per position
    assert engine.model.history[0][len(prompt):len(prompt) + len(with_call + forced)] == with_call + forced


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_stop_tokens(tok, decode):
    s, prompt = specials(tok), [tok.bos_token_id, 4]
    rows = {0: [10, s.assistant_end], 1: [10, 11, 12, s.bos]}

    def plan(b, gen):
        return rows[b][len(gen)] if len(gen) < len(rows[b]) else 13

    cols, masks = run(scripted_engine(tok, plan, prompt, decode), prompt, num_samples=2, max_tokens=50)
    assert cols == [[10, 10], [s.assistant_end, 11], [s.assistant_end, 12], [s.assistant_end, s.bos]]
    assert masks == [[1, 1], [1, 1], [0, 1], [0, 1]]
    # custom stop tokens replace the defaults: <|assistant_end|> no longer stops row 0
    cols, _ = run(scripted_engine(tok, plan, prompt, decode), prompt, num_samples=2, max_tokens=50,
                  stop_tokens=[12, 13])
    assert cols == [[10, 10], [s.assistant_end, 11], [13, 12]]
    # no stop at all: exactly max_tokens steps
    cols, _ = run(scripted_engine(tok, lambda b, g: 10, prompt, decode), prompt, max_tokens=7)
    assert len(cols) == 7


def test_engine_without_tokenizer_has_no_tool_and_no_default_stops(tok):
    s, prompt = specials(tok), [1, 2, 3]
    script = [s.python_start, *tok.encode("1+1"), s.python_end, s.assistant_end, 10]
    engine = Engine(ScriptedModel(tok.vocab_size, len(prompt), lambda b, g: script[min(len(g), len(script) - 1)]), None)
    cols = [c[0] for c, _ in engine.generate(prompt, max_tokens=len(script), temperature=0.0)]
    assert cols == script


# ------------------------------------------------------------------------------------ TextStream

def test_text_stream_utf8_and_specials(tok):
    text = "héllo wörld ✓ — naïve ünïcödé"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    stream = TextStream(tok)
    pieces = [stream.feed(t) for t in ids] + [stream.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    s = specials(tok)
    stream = TextStream(tok, special_text={s.python_start: "<<", s.python_end: "="})
    out = "".join(stream.feed(t) for t in [s.python_start, *tok.encode("1+1"), s.python_end, s.user_start])
    assert out + stream.finish() == "<<1+1="


class SplitBytesTokenizer:
    """Tokens whose bytes cut characters anywhere, as large byte-level BPE vocabularies' do."""
    TABLE = {0: b"\xe4", 1: b"\xb8", 2: b"\xad\xe6", 3: b"\x96", 4: b"\x87", 5: b"ok", 6: b"\xff", 7: b"\xf0\x9f"}

    def decode_bytes(self, ids):
        return b"".join(self.TABLE[i] for i in ids)


def test_text_stream_characters_split_across_tokens():
    """'中文' as 5 tokens that cut both characters: each appears once complete, no U+FFFD; bytes that
    can never be UTF-8 show as U+FFFD at once; an incomplete character at the end, at finish."""
    stream = TextStream(SplitBytesTokenizer())
    assert [stream.feed(t) for t in [0, 1, 2, 3, 4]] + [stream.finish()] == ["", "", "中", "", "文", ""]
    stream = TextStream(SplitBytesTokenizer())
    assert [stream.feed(t) for t in [5, 6, 5, 7]] + [stream.finish()] == ["ok", "\ufffd", "ok", "", "\ufffd"]


def test_text_stream_stop_strings(tok):
    stream = TextStream(tok, stop_strings=["STOP", "xyz"])
    ids = tok.encode("abc ST then STOP and more")
    pieces = [stream.feed(t) for t in ids]
    assert "".join(pieces) + stream.finish() == "abc ST then "
    assert stream.stopped
    # a held-back partial match is released when it does not complete
    stream = TextStream(tok, stop_strings=["STOP"])
    pieces = [stream.feed(t) for t in tok.encode("one ST")]
    assert "".join(pieces) == "one "  # "ST" is held back: it may start "STOP"
    assert "".join(pieces) + stream.finish() == "one ST" and not stream.stopped


def random_model(device, **overrides):
    """A small GPT with random (non-zero) weights for numerics tests; no tokenizer needed."""
    from nanochat.gpt import GPT, GPTConfig

    cfg = dict(sequence_len=128, vocab_size=300, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, window_pattern="SL")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**cfg, **overrides}), compute_dtype=torch.float32).to(device)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model.eval()


def decode_modes_agree(device):
    model = random_model(device)
    prompt = list(range(1, 20))
    kw = dict(num_samples=3, max_tokens=30, temperature=0.0, stop_tokens=())
    eager = Engine(model, None, decode="eager").generate_batch(prompt, **kw)
    compiled_engine = Engine(model, None, decode="compile")
    assert compiled_engine.generate_batch(prompt, **kw) == eager
    kw["num_samples"] = 5  # another batch size and prompt length: no recompile needed, same answers
    assert compiled_engine.generate_batch(prompt[:7], **kw) == Engine(model, None, decode="eager").generate_batch(
        prompt[:7], **kw)


@pytest.mark.slow
def test_compiled_decode_matches_eager_cpu():
    decode_modes_agree("cpu")


@pytest.mark.cuda
def test_compiled_decode_matches_eager_cuda():
    decode_modes_agree("cuda")
    engine = Engine(random_model("cuda"), None, decode="auto")
    assert engine.decode_mode == "graphs" and engine.cache_dtype == torch.float32
    assert Engine(random_model("cpu"), None, decode="auto").decode_mode == "eager"
