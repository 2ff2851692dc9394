"""Ninth review of inference as a demanding CLI user meets it (regression guards, and one fix:
graph_step "persistent" where no static step runs it): streamed text equals the one-shot decode of the same tokens whatever the byte
splits, special tokens and stop strings, and a reply cut off by Ctrl-C mid-stream hands the static
decoder back, so the next answer is the one a fresh engine gives."""

import io
import random
from types import SimpleNamespace

import pytest

from nanochat.engine import Engine
from nanochat.text_stream import TextStream
from tests.test_engine import ScriptedModel, chat_model, specials  # noqa: F401  (fixture)


class ByteTokenizer:
    """Tokens 0..255 are single bytes (so any character can be split anywhere), 256.. special."""

    special_tokens = ["<|python_start|>", "<|python_end|>", "<|assistant_start|>"]

    def encode_special(self, name):
        return 256 + self.special_tokens.index(name)

    def decode_bytes(self, ids):
        return bytes(ids)


def reference(ids, shown, stops):
    """What a stream must add up to: each run of bytes between specials decoded at once (bad or cut
    UTF-8 as U+FFFD), specials as `shown`, cut at the first stop string."""
    text, run = "", []
    for t in ids:
        if t >= 256:
            text += bytes(run).decode("utf-8", "replace") + shown.get(t, "")
            run = []
        else:
            run.append(t)
    text += bytes(run).decode("utf-8", "replace")
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(hits)] if hits else text


def test_streamed_text_equals_the_one_shot_decode():
    """Multi-byte characters (2-4 bytes) cut at random byte boundaries, stray continuation bytes,
    specials shown as text or as nothing, stop strings that overlap characters and specials'
    text: the deltas add up to the reference, none is emitted past a stop string."""
    tokenizer = ByteTokenizer()
    shown = {256: "<<", 257: "="}
    pieces = [b"a", b"b", b" ", "é".encode(), "中".encode(), "😀".encode(), b"\x80", b"\xff", b"=", b"<"]
    stop_sets = [(), ("ab",), ("中a",), ("<<", "b "), ("=",), ("\ufffd",), ("😀😀",)]
    rng = random.Random(0)
    for _ in range(1500):
        data = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        ids, i = [], 0
        while i < len(data):   # one token per byte, specials dropped in between at random
            ids.extend(data[i:i + 1])
            i += 1
            if rng.random() < 0.15:
                ids.append(rng.choice([256, 257, 258]))
        stops = rng.choice(stop_sets)
        stream = TextStream(tokenizer, stop_strings=stops, special_text=shown)
        deltas = [stream.feed(t) for t in ids] + [stream.finish()]
        assert "".join(deltas) == reference(ids, shown, stops), (ids, stops)


def test_ctrl_c_mid_reply_hands_the_static_decoder_back(chat_model):  # noqa: F811  (the fixture)
    """chat_cli's answer() interrupted by Ctrl-C while streaming: the static decoder is free again
    (a busy one would send every later answer down the slower private-cache path) and the next
    answer is token for token the one a fresh engine gives."""
    from scripts.chat_cli import answer

    tok = chat_model[1]
    s = specials(tok)
    reply = tok.encode("a long enough reply to interrupt") + [s.assistant_end]
    prompt = [tok.bos_token_id, 5, 6]

    def engine():
        plan = (lambda b, gen: reply[len(gen)] if len(gen) < len(reply) else s.assistant_end)
        return Engine(ScriptedModel(tok.vocab_size, len(prompt), plan), tok, decode="static", decode_bucket=16)

    class CtrlC(io.StringIO):
        def write(self, text):
            if self.tell() > 3:
                raise KeyboardInterrupt
            return super().write(text)

    args = SimpleNamespace(max_tokens=60, temperature=0.0, top_k=None, top_p=None)
    fresh = io.StringIO()
    answer(engine(), tok, prompt, args, 0, out=fresh)
    used = engine()
    try:
        answer(used, tok, prompt, args, 0, out=CtrlC())
        raise AssertionError("the interrupt did not reach the caller")
    except KeyboardInterrupt:
        pass
    assert [d.busy for d in used.decoders.values()] == [False]
    again = io.StringIO()
    assert answer(used, tok, prompt, args, 0, out=again) == answer(engine(), tok, prompt, args, 0, out=io.StringIO())
    assert again.getvalue() == fresh.getvalue() == "a long enough reply to interrupt\n"


@pytest.mark.parametrize("decode", ["eager", "compile"])
def test_persistent_graph_step_in_a_mode_without_static_steps_says_what_runs(decode):
    """graph_step="persistent" under decode eager/compile (no static step runs it) was kept as the
    attribute, so chat_cli's banner and bench rows said "persistent" for a plain decode."""
    from tests.test_engine import random_model

    engine = Engine(random_model("cpu"), None, decode=decode, graph_step="persistent")
    assert engine.graph_step == "eager" and engine.step_at(1) is None
    assert "persistent" in engine.graph_step_note and f"decode={decode}" in engine.graph_step_note


def test_bench_prefill_warms_up_past_the_gpu_s_idle_clock(monkeypatch):
    """One warm-up call left bench_inference's first timed prefills at an idle GPU clock (31.7 ms on
    an H200 where TTFT, which includes the prefill, was 23 ms): it now warms up for >= 3 calls and
    0.3 s before timing."""
    import contextlib

    from scripts import bench_inference as BI

    calls, clock = [], [0.0]

    def prefill(prompt):
        calls.append(clock[0])
        clock[0] += 0.05   # 50 ms a call on the fake clock
    engine = SimpleNamespace(prefill=prefill, inference_weights=contextlib.nullcontext)
    rt = SimpleNamespace(synchronize=lambda: None)
    monkeypatch.setattr(BI, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(BI, "timed", lambda rt, fn: (fn(), 0.05)[1])
    row = BI.bench_prefill(engine, rt, [1, 2, 3, 4], repeats=2)
    assert len(calls) == 6 + 2 and row["tok_per_s"] == pytest.approx(4 / 0.05)   # 0.3 s of warm-up, then 2
