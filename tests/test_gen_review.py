"""A review of generation's documented semantics as an OpenAI-API / chat_cli user relies on them
(CPU paths; regression guards, each checked against an independent oracle rather than the code's
own formula): the nucleus is taken after top-k and after the temperature, OpenAI's "smallest set
covering top_p, at least one token"; greedy ties go to the lowest id; a request's draws do not
depend on its batch slot or its neighbours, also at the context end; n choices are independent
draws; a stop string ends the text at the first one complete, whatever the token splits; tokens
the calculator forces count toward max_tokens (a step each, mask 0), so a reply can end inside the
forced output; and the calculator answers any expression of its grammar with a result or a
refusal, fast."""

import itertools
import math
import random
import time
from types import SimpleNamespace

import torch

from nanochat.batching import BatchedEngine
from nanochat.calculator import use_calculator
from nanochat.engine import Engine
from nanochat.sampling import Sampler, sample_next
from nanochat.text_stream import TextStream
from tests.test_engine_review2 import windowed_model


def _steps(gen):
    return [(list(c), list(m)) for c, m in gen]


# ------------------------------------------------------------------------------------ sampling

def nucleus_oracle(logits: list[float], temperature: float, top_k: int | None, top_p: float) -> dict[int, float]:
    """token -> probability, by the documented recipe in plain Python: keep the top_k largest logits,
    softmax(logit / T) over them, then the smallest most-probable set whose probability reaches
    top_p (at least one token), renormalised."""
    kept = sorted(range(len(logits)), key=lambda i: -logits[i])[:top_k]
    z = {i: math.exp(logits[i] / temperature) for i in kept}
    total = sum(z.values())
    out, covered = {}, 0.0
    for i in sorted(kept, key=lambda i: -z[i]):
        out[i] = z[i] / total
        covered += out[i]
        if covered >= top_p:
            break
    norm = sum(out.values())
    return {i: p / norm for i, p in out.items()}


def test_nucleus_comes_after_top_k_and_after_the_temperature():
    """Each case is chosen so that another order gives another support: top-p over the whole
    vocabulary before top-k, or over the untempered probabilities, would keep other tokens."""
    logits = [2.0, 1.0, 0.0, -1.0]
    cases = [(0.5, None, 0.9, {0, 1}),      # T < 1 sharpens: 0.865 + 0.117 covers 0.9
             (2.0, None, 0.85, {0, 1, 2}),  # T > 1 flattens: three tokens to cover 0.85
             (2.0, 2, 0.85, {0, 1}),        # top-k first, then the nucleus of the renormalised two
             (2.0, 2, 0.6, {0}),            # 0.622 of the top two covers 0.6 (0.455 of all four does not)
             (3.0, 3, 0.6, {0, 1}),         # at T = 1 token 0 alone (0.665) would cover 0.6
             (1.0, None, 1e-12, {0})]       # a tiny top_p still keeps one token
    gen = torch.Generator().manual_seed(0)
    rows = torch.tensor([logits]).expand(4000, -1)
    for temperature, top_k, top_p, support in cases:
        want = nucleus_oracle(logits, temperature, top_k, top_p)
        assert set(want) == support, (temperature, top_k, top_p)
        draws = sample_next(rows, temperature, top_k, top_p, gen)
        freq = torch.bincount(draws, minlength=4).float() / len(draws)
        assert set(draws.tolist()) == support, (temperature, top_k, top_p, freq)
        for token, p in want.items():
            assert abs(freq[token].item() - p) < 0.035, (temperature, top_k, top_p, freq)


def test_greedy_ties_go_to_the_lowest_id():
    """Temperature 0, a temperature below GREEDY_BELOW and top-k 1 are the argmax, and of tied
    maxima the lowest id, also across a vocabulary wider than the chunked top-k's."""
    for V in (5, 6000):
        logits = torch.zeros(2, V)
        tied = [V - 1, V // 2, 3]
        logits[:, tied] = 4.0
        for temperature, top_k in ((0.0, None), (1e-7, 50), (0.9, 1)):
            for seed in range(3):
                assert Sampler(torch.device("cpu"), temperature, top_k, 0.9, seed)(logits, 0).tolist() == [min(tied)] * 2


# ------------------------------------------------------------------------------------ reproducibility

def test_a_request_draws_the_same_in_any_slot_beside_any_neighbours():
    """A sampled request that fills the context exactly (prompt + max_tokens == sequence_len) gives
    the same tokens alone in slot 0 of the batcher, in slot 3 beside a sampled n=2 request with the
    same seed and a greedy one, and from a lone Engine; max_tokens one past the context is cut to
    it. The neighbours equal their own lone runs."""
    model = windowed_model(seq_len=32)
    lone = Engine(model, None, decode="static", decode_bucket=8)
    prompt = [3, 1, 4, 1, 5] * 5 + [9, 2]   # 27 tokens: 5 more fill the context
    req = dict(max_tokens=5, temperature=0.9, top_k=20, top_p=0.9, seed=11, stop_tokens=())
    want = _steps(lone.generate(prompt, **req))
    assert len(want) == 5
    neighbours = [dict(tokens=[8, 9, 10], num_samples=2, max_tokens=25, temperature=1.3, seed=11, stop_tokens=()),
                  dict(tokens=[7] * 20, max_tokens=12, temperature=0.0, stop_tokens=())]
    batched = BatchedEngine(Engine(model, None, decode="static", decode_bucket=8), slots=4)
    try:
        alone = batched.generate(prompt, **{**req, "max_tokens": 6})
        assert _steps(alone) == want
        others = [batched.generate(**n) for n in neighbours]
        firsts = [next(o) for o in others]   # admitted and stepping: slots 0-1 and 2
        stream = batched.generate(prompt, **req)
        got = [next(stream)]
        assert stream._req.slots == [3]   # the request really sits beside them
        got += _steps(stream)
        assert got == want
        for n, o, first in zip(neighbours, others, firsts):
            assert [first] + _steps(o) == _steps(lone.generate(**n))
    finally:
        batched.close()


class FlatModel(torch.nn.Module):
    """Every token equally likely after anything: the draws show the sampler's randomness alone."""

    def __init__(self, vocab: int = 16, seq_len: int = 160):
        super().__init__()
        self.config = SimpleNamespace(sequence_len=seq_len, vocab_size=vocab, n_layer=1, n_head=1, n_kv_head=1,
                                      n_embd=8)
        self.anchor = torch.nn.Parameter(torch.zeros(1))   # the engine's device and dtype

    def forward(self, idx, kv_cache=None, logits_at=None):
        if kv_cache is not None:
            kv_cache.advance(idx.size(1))   # StaticKV: a no-op
        T = idx.size(1) if logits_at is None else len(logits_at)
        return torch.zeros(idx.size(0), T, self.config.vocab_size)


def test_n_choices_are_independent_draws():
    """n=4 rows over 16 equally likely tokens for 150 steps: two rows agree at a step about 1 time
    in 16 (rows drawn from one noise vector would always agree), every row covers the vocabulary,
    a call is reproducible from its seed, another seed gives other rows, and the batcher gives the
    same rows."""
    model = FlatModel()
    kw = dict(num_samples=4, max_tokens=150, temperature=1.0, seed=5, stop_tokens=())
    steps = _steps(Engine(model, None).generate([1, 2], **kw))
    rows = list(zip(*(c for c, _ in steps)))
    for a in range(4):
        assert len(set(rows[a])) == 16
        for b in range(a + 1, 4):
            agree = sum(x == y for x, y in zip(rows[a], rows[b])) / len(steps)
            assert agree < 0.16, (a, b, agree)
    assert _steps(Engine(model, None).generate([1, 2], **kw)) == steps
    assert _steps(Engine(model, None).generate([1, 2], **{**kw, "seed": 6})) != steps
    batched = BatchedEngine(Engine(model, None, decode="static", decode_bucket=32), slots=4)
    try:
        assert _steps(batched.generate([1, 2], **kw)) == steps
    finally:
        batched.close()


# ------------------------------------------------------------------------------------ stop strings

class PieceTokenizer:
    """Token i is the i-th piece of text given."""

    def __init__(self, pieces):
        self.table = [p.encode() for p in pieces]

    def decode_bytes(self, ids):
        return b"".join(self.table[i] for i in ids)


def first_stop_oracle(pieces: list[str], stops: list[str]) -> str:
    """What generation with stop strings returns: after each token, if a stop string occurs in the
    text so far, the text up to the earliest such occurrence, and nothing more is generated."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return text[:min(hits)]
    return text


def test_a_stop_string_ends_the_text_at_the_first_one_complete():
    """Overlapping stop strings (one a prefix, a suffix or the middle of another) over every kind of
    token split: the streamed deltas add up to the oracle's text. A shorter stop string that
    completes inside a longer one's partial match ends the text there, as generation would."""
    tok = PieceTokenizer(["a", "b", "c", "d", "abcd"])
    stream = TextStream(tok, stop_strings=["abcd", "bc"])
    assert [stream.feed(t) for t in range(4)] + [stream.finish()] == ["", "", "a", "", ""]
    stream = TextStream(tok, stop_strings=["abcd", "bc"])
    assert stream.feed(4) + stream.finish() == ""   # both in one token: the earlier start
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])] if text else []
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        stream = TextStream(PieceTokenizer(pieces), stop_strings=stops)
        deltas = [stream.feed(i) for i in range(len(pieces))] + [stream.finish()]
        assert "".join(deltas) == first_stop_oracle(pieces, stops), (pieces, stops, deltas)


# ------------------------------------------------------------------------------------ tool and max_tokens

class ByteChatTokenizer:
    """Bytes 0..255 as tokens, the chat specials after them: a tokenizer the Engine's tool can use
    without training one."""

    NAMES = ("<|bos|>", "<|assistant_end|>", "<|python_start|>", "<|python_end|>", "<|output_start|>",
             "<|output_end|>")
    special_tokens = NAMES
    bos_token_id = 256
    vocab_size = 256 + len(NAMES)

    def encode_special(self, name):
        return 256 + self.NAMES.index(name)

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", "replace")

    def decode_bytes(self, ids):
        return bytes(ids)


class NextTokenModel(torch.nn.Module):
    """The next token is a fixed function of the last one fed (all probability on it)."""

    def __init__(self, vocab, table: dict[int, int], default: int, seq_len=64):
        super().__init__()
        self.config = SimpleNamespace(sequence_len=seq_len, vocab_size=vocab, n_layer=1, n_head=1, n_kv_head=1,
                                      n_embd=8)
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.next = torch.full((vocab,), default, dtype=torch.long)
        for a, b in table.items():
            self.next[a] = b

    def forward(self, idx, kv_cache=None, logits_at=None):
        if kv_cache is not None:
            kv_cache.advance(idx.size(1))
        last = idx if logits_at is None else idx[:, logits_at]
        return torch.nn.functional.one_hot(self.next[last], self.config.vocab_size).float() * 30


def test_forced_tool_tokens_count_toward_max_tokens():
    """The model writes <|python_start|>12*3<|python_end|>; the engine forces <|output_start|>36
    <|output_end|>, a step each with mask 0, and max_tokens counts those steps (the server's usage
    counts them as completion tokens alike): a max_tokens two past the call ends the reply inside
    the forced output, after exactly max_tokens steps, in every decode path."""
    tok = ByteChatTokenizer()
    sp = tok.encode_special
    call = [sp("<|python_start|>"), *tok.encode("12*3"), sp("<|python_end|>")]
    forced = [sp("<|output_start|>"), *tok.encode("36"), sp("<|output_end|>")]
    table = dict(itertools.pairwise(call)) | {5: call[0], sp("<|output_end|>"): sp("<|assistant_end|>")}
    model = NextTokenModel(tok.vocab_size, table, default=ord("?"))
    engines = [Engine(model, tok), Engine(model, tok, decode="static", decode_bucket=8)]
    batched = BatchedEngine(Engine(model, tok, decode="static", decode_bucket=8), slots=2)
    try:
        for engine in engines + [batched]:
            whole = _steps(engine.generate([1, 5], max_tokens=40, temperature=0.0))
            assert [c[0] for c, _ in whole] == call + forced + [sp("<|assistant_end|>")]
            assert [m[0] for _, m in whole] == [1] * len(call) + [0] * len(forced) + [1]
            cut = _steps(engine.generate([1, 5], max_tokens=len(call) + 2, temperature=0.0))
            assert [c[0] for c, _ in cut] == call + forced[:2]
            assert [m[0] for _, m in cut] == [1] * len(call) + [0, 0]
        results, masks = engines[0].generate_batch([1, 5], max_tokens=len(call) + 2, temperature=0.0)
        assert results[0][2:] == call + forced[:2] and masks[0][2:] == [1] * len(call) + [0, 0]
    finally:
        batched.close()


# ------------------------------------------------------------------------------------ calculator

def test_any_expression_of_the_grammar_gets_a_result_or_a_refusal_fast():
    """Random expressions over extreme operands (1e308, 5e-324, 2**1023, 60-digit numbers, inf
    literals, thousands separators, .count), every operator, unary minus and parentheses: each
    returns text or None (never raises) within 50 ms; a few boundaries by hand."""
    atoms = ["0", "1", "-1", "2", "3", "7", "10", "0.5", "1e308", "1e-308", "5e-324", "9" * 60, "2**1023", "1.5",
             "0.0", "-0.0", "1,000", "1_0", "0x7f", "3.", ".5", "1e400", "'ab'.count('a')", "(2**1024-1)"]
    ops = ["+", "-", "*", "/", "//", "%", "**"]
    rng = random.Random(0)

    def expr(depth):
        if depth == 0 or rng.random() < 0.3:
            return rng.choice(atoms)
        r = rng.random()
        if r < 0.15:
            return "-" + expr(depth - 1)
        if r < 0.3:
            return "(" + expr(depth - 1) + ")"
        return expr(depth - 1) + rng.choice(ops) + expr(depth - 1)

    for _ in range(3000):
        e = expr(rng.randint(1, 6))
        t0 = time.perf_counter()
        out = use_calculator(e)
        assert out is None or isinstance(out, str), e
        assert time.perf_counter() - t0 < 1.0, e   # ~0.02 ms typical: only a runaway (a huge power) fails,
        # not a scheduler stall on a loaded 2-core machine
    assert use_calculator("(" * 99 + "6*7" + ")" * 99) == "42"   # nesting within the limits is fine
    for refused in ("2.0**1024", "(2**1023)*2.0", "0**-1", "(-8)**(1/3)", "1e308*10", "-" * 150 + "1",
                    "7**366", "10**309", "9" * 301, "1%0", "1.0//0.0"):
        assert use_calculator(refused) is None, refused
