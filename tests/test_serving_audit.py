"""Serving audit: continuous batching (nanochat/batching.py) and the chat server over it
(nanochat/server.py) as several users exercise them, on tiny CPU models.

Correctness: requests that join and leave mid-decode, prompts at the context limit, max_tokens 1,
stop tokens, seeded sampling, n > 1, and the calculator forcing tokens into one row while others
decode, all equal their lone runs. Cancellation while queued, prefilling, decoding and at
completion frees rows at once and leaks no rows, threads or caches. Failures stay with their
request (a prefill) or the requests in flight (a step); a dead scheduler reaches its callers.
Over HTTP: a client leaving while queued inside the batcher frees its worker, 503 + Retry-After,
and /stats counts every request once. The load scripts refuse flags their server would refuse.

Synchronisation is by events and by holding the scheduler thread inside a step (`hold_scheduler`),
never by sleeping; `wait_until` polls a condition with a deadline (a hang fails, it does not
flake)."""

import json
import threading
import zlib
from types import SimpleNamespace

import pytest
import torch
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.attention import StaticKV
from nanochat.batching import BatchedEngine
from nanochat.engine import Engine
from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, replica_workers, serve_in_thread
from test_chat_web import USER, ScriptedEngine, wait_until
from test_engine import SEQ_LEN, prompt_for, random_model, specials, tiny_chat_model

TOOL = 3   # a byte token no text prompt contains: HistoryModel's rows with it in the prompt use the tool


@pytest.fixture(scope="module")
def chat(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


def static_engine(model, tok):
    return Engine(model, tok, decode="static", decode_bucket=16)


def collect(stream):
    return [(list(c), list(m)) for c, m in stream]


def in_thread(fn, *args):
    """Run fn(*args) in a daemon thread; returns (thread, box) with box["out"] or box["error"]."""
    box = {}

    def run():
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def hold_scheduler(engine, when=lambda: True):
    """Hold the scheduler thread inside a step (at engine._advance_rows) the first time `when()`
    is true, until `go` is set; `held` is set while it waits."""
    held, go, real = threading.Event(), threading.Event(), engine._advance_rows

    def gated(rows, sampled, stops):
        if not go.is_set() and not held.is_set() and when():
            held.set()
            assert go.wait(60), "the test never released the scheduler"
        return real(rows, sampled, stops)
    engine._advance_rows = gated
    return held, go


def on_step(engine, fn):
    """Call fn() in the scheduler thread at every row group's advance (before it)."""
    real = engine._advance_rows

    def hooked(rows, sampled, stops):
        fn(rows)
        return real(rows, sampled, stops)
    engine._advance_rows = hooked


# ------------------------------------------------------------------------------------ correctness

class HistoryModel(torch.nn.Module):
    """Stands in for GPT under batching: each row's token ids live in its KV cache (layer 0, k[..., 0]
    at each position), so rows the batcher copies or moves keep their history, and the next-token
    logits are a function of the row's whole history: pseudo-random (seeded by it) for ordinary
    rows, and for a prompt holding TOOL a scripted calculator call whose result the engine forces."""

    def __init__(self, tok, seq_len: int = 96):
        super().__init__()
        self.config = SimpleNamespace(sequence_len=seq_len, vocab_size=tok.vocab_size, n_layer=1, n_head=1,
                                      n_kv_head=1, n_embd=4)
        self.anchor = torch.nn.Parameter(torch.zeros(1))   # the engine's device and dtype
        self.s, self.start = specials(tok), tok.encode_special("<|assistant_start|>")
        self.call = [self.s.python_start, *tok.encode("12*3"), self.s.python_end]
        self.tail = [*tok.encode(" so 36"), self.s.assistant_end]

    def forward(self, idx, kv_cache=None, logits_at=None):
        B, T = idx.shape
        ids = kv_cache.k[0][:, 0, :, 0]   # (B, S): the rows' token ids by position
        if isinstance(kv_cache, StaticKV):
            pos = kv_cache.pos.expand(B).tolist()
            for b in range(B):
                ids[b, pos[b]] = idx[b, 0]
            ends = [p + 1 for p in pos]
        else:
            p0 = kv_cache.pos
            ids[:, p0:p0 + T] = idx
            kv_cache.advance(T)
            ends = [p0 + T] * B
        return torch.stack([self.next_logits(ids[b, :ends[b]].long().tolist()) for b in range(B)])[:, None]

    def next_logits(self, hist: list[int]) -> torch.Tensor:
        if self.start not in hist:   # a free row of the batch (token 0 at position 0)
            return torch.zeros(self.config.vocab_size)
        cut = max(i for i, t in enumerate(hist) if t == self.start) + 1
        prompt, gen = hist[:cut], hist[cut:]
        if TOOL not in prompt:
            seed = zlib.crc32(",".join(map(str, hist)).encode())
            return 3 * torch.randn(self.config.vocab_size, generator=torch.Generator().manual_seed(seed))
        if self.s.output_end in gen:
            i = len(gen) - gen.index(self.s.output_end) - 1
            nxt = self.tail[i] if i < len(self.tail) else 0
        else:
            nxt = self.call[len(gen)] if len(gen) < len(self.call) else 7   # 7: overridden by forced tokens
        out = torch.full((self.config.vocab_size,), -30.0)
        out[nxt] = 30.0
        return out


def admit_together(engine, batched, others: int):
    """The first prefill waits until `others` more requests are queued: all start in one step."""
    real, first = engine._prefill, [True]

    def gated(tokens, cache, compiled=False):
        if first[0]:
            first[0] = False
            assert wait_until(lambda: batched.waiting >= others, 30)
        return real(tokens, cache, compiled)
    engine._prefill = gated


def test_tool_forcing_in_one_row_while_others_decode(chat):
    tok = chat[1]
    model = HistoryModel(tok)
    start = tok.encode_special("<|assistant_start|>")
    reqs = [dict(tokens=[tok.bos_token_id, TOOL, start], temperature=0.0, max_tokens=40),
            dict(tokens=prompt_for(tok, "Hello"), temperature=1.0, seed=1, max_tokens=30, stop_tokens=()),
            dict(tokens=prompt_for(tok, "Tell me more"), temperature=0.0, max_tokens=25, stop_tokens=()),
            dict(tokens=prompt_for(tok, "Two answers"), num_samples=2, temperature=0.8, top_k=20, seed=2,
                 max_tokens=30, stop_tokens=())]
    want = [collect(static_engine(model, tok).generate(**r)) for r in reqs]
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=5)
    admit_together(engine, batched, len(reqs) - 1)
    runs = [in_thread(lambda r=r: collect(batched.generate(**r))) for r in reqs]
    for t, _ in runs:
        t.join(60)
    assert [box.get("out", box.get("error")) for _, box in runs] == want
    masks = [m[0] for _, m in want[0]]
    assert 0 in masks and masks[-1] == 1 and want[0][-1][0] == [model.s.assistant_end]   # forced, then the tail
    assert batched.rows_stepped / batched.steps > 3   # the forcing happened with the others in the step
    assert batched.live_rows == 0 and batched.waiting == 0


def test_requests_joining_and_leaving_mid_decode_equal_lone_runs(chat):
    """A long greedy request; at fixed steps of it five more join (the scheduler is held at that
    step until the joiner is queued, so "mid-decode" is certain), through 3 slots: prompts at and
    near the context limit, max_tokens 1, stop tokens, seeded sampling with top-k / top-p, n = 2."""
    model, tok = chat
    bos = tok.bos_token_id
    long = dict(tokens=prompt_for(tok, "A long story"), temperature=0.0, max_tokens=60, stop_tokens=())
    joiners = {3: dict(tokens=[bos] * (SEQ_LEN - 1), temperature=0.0, max_tokens=50, stop_tokens=()),
               6: dict(tokens=prompt_for(tok, "pick two"), num_samples=2, temperature=0.9, top_p=0.9, seed=7,
                       max_tokens=30),
               9: dict(tokens=prompt_for(tok, "one word"), temperature=1.0, seed=8, max_tokens=1),
               12: dict(tokens=prompt_for(tok, "stop soon"), temperature=1.2, top_k=20, seed=9, max_tokens=60,
                        stop_tokens=list(range(40, 200))),
               15: dict(tokens=[bos] * (SEQ_LEN - 6), temperature=0.7, seed=10, max_tokens=50, stop_tokens=())}
    lone = static_engine(model, tok)
    want = {k: collect(lone.generate(**r)) for k, r in [(0, long), *joiners.items()]}
    assert len(want[3]) == 1 and len(want[15]) == 6 and len(want[9]) == 1 and len(want[12]) < 60
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=3)
    runs = {}

    def join_at_step(rows):
        k = batched.steps
        if k in joiners and k not in runs:
            queued = batched.waiting
            runs[k] = in_thread(lambda r=joiners[k]: collect(batched.generate(**r)))
            assert wait_until(lambda: batched.waiting > queued, 30)
    on_step(engine, join_at_step)
    runs[0] = in_thread(lambda: collect(batched.generate(**long)))
    assert wait_until(lambda: len(runs) == 6 and not any(t.is_alive() for t, _ in runs.values()), 60)
    assert {k: box.get("out", box.get("error")) for k, (_, box) in runs.items()} == want
    assert batched.live_rows == 0 and batched.waiting == 0 and batched.moves >= 1


def test_a_long_request_does_not_starve_short_ones(chat):
    """FIFO admission into free slots (the documented policy): six short requests queued behind a
    long one in a 2-slot engine run one after another in the free slot while the long request
    decodes at every step; none waits for the long one to end."""
    model, tok = chat
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=2)
    log, shorts = [], []

    def record(rows):
        log.append((batched.steps, id(rows)))
        if batched.steps == 2 and not shorts:   # all six queued at once, at step 2
            shorts.extend(in_thread(lambda i=i: collect(batched.generate(
                prompt_for(tok, f"short {i}"), temperature=0.0, max_tokens=4, stop_tokens=()))) for i in range(6))
            assert wait_until(lambda: batched.waiting == 6, 30)
    on_step(engine, record)
    long = collect(batched.generate(prompt_for(tok, "long"), temperature=0.0, max_tokens=60, stop_tokens=()))
    for t, _ in shorts:
        t.join(30)
    assert len(long) == 60 and all(len(box["out"]) == 4 for _, box in shorts)
    long_id = log[0][1]
    assert [s for s, r in log if r == long_id] == list(range(60))   # a token every step
    last_short = max(s for s, r in log if r != long_id)
    assert last_short <= 2 + 6 * 4 + 2   # one free slot, 4 steps each: done by step ~28 of 60


# ------------------------------------------------------------------------------------ cancellation

def test_cancel_while_queued_prefilling_and_at_completion(chat):
    model, tok = chat
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=1)
    prompt = prompt_for(tok, "hello")
    # queued: the one slot is held by a request whose step the scheduler is inside
    held, go = hold_scheduler(engine)
    first = batched.generate(prompt, temperature=0.0, max_tokens=6, stop_tokens=())
    t_first, first_box = in_thread(collect, first)
    assert held.wait(30)
    queued = batched.generate(prompt, temperature=0.0, max_tokens=6)
    t, box = in_thread(collect, queued)
    assert wait_until(lambda: batched.waiting == 1, 30)
    queued.cancel()            # from this thread, while its consumer is blocked waiting
    t.join(10)
    assert not t.is_alive() and box["out"] == [] and batched.waiting == 0
    go.set()
    t_first.join(30)
    assert first_box["out"] == collect(static_engine(model, tok).generate(prompt, temperature=0.0, max_tokens=6,
                                                                          stop_tokens=()))
    # prefilling: the consumer returns while the prefill still runs; the request gets no step
    entered, release, real = threading.Event(), threading.Event(), engine._prefill

    def slow_prefill(tokens, cache, compiled=False):
        entered.set()
        assert release.wait(30)
        return real(tokens, cache, compiled)
    engine._prefill = slow_prefill
    steps, advances = batched.steps, []
    on_step(engine, advances.append)
    prefilling = batched.generate(prompt, temperature=0.0, max_tokens=6)
    t, box = in_thread(collect, prefilling)
    assert entered.wait(30)
    prefilling.cancel()
    t.join(10)
    assert not t.is_alive() and box["out"] == []
    release.set()
    engine._prefill = real
    # at completion (every step read, the end not yet) and before the first read: nothing breaks
    done = batched.generate(prompt, temperature=0.0, max_tokens=3, stop_tokens=())
    assert len([next(done) for _ in range(3)]) == 3
    done.cancel()
    assert list(done) == []
    never = batched.generate(prompt, max_tokens=3)
    never.cancel()
    assert list(never) == [] and batched.waiting == 0 and batched.live_rows == 0
    assert len(advances) == 3 and batched.steps == steps + 2   # `done`'s steps only


def test_many_cancel_cycles_leak_no_rows_threads_or_caches(chat):
    """Three client threads through two slots, 20 cycles each: cancelled before the first read,
    after one token, mid-stream, from another thread while blocked, or read to the end. Then no
    live row, no queued request, no extra thread, the same cache, and answers equal lone runs."""
    model, tok = chat
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=2)
    prompts = [prompt_for(tok, t) for t in ("one", "a second prompt", "three")]
    kw = dict(temperature=0.9, max_tokens=12, stop_tokens=())
    assert len(collect(batched.generate(prompts[0], seed=0, **kw))) == 12   # the scheduler thread exists now
    threads_before, cache = threading.active_count(), batched._cache

    def client(c):
        for i in range(20):
            stream = batched.generate(prompts[c], seed=i, **kw)
            kind = (i + c) % 5
            if kind == 0:
                stream.cancel()
                assert list(stream) == []
            elif kind == 1:
                next(stream)
                stream.close()
            elif kind == 2:
                got = [next(stream) for _ in range(5)]
                stream.cancel()
                assert len(got + list(stream)) <= 12
            elif kind == 3:
                threading.Timer(0.001 * (i % 3), stream.cancel).start()
                assert len(collect(stream)) <= 12
            else:
                assert len(collect(stream)) == 12
    runs = [in_thread(client, c) for c in range(3)]
    for t, box in runs:
        t.join(120)
        assert "error" not in box, box.get("error")
    assert wait_until(lambda: batched.live_rows == 0 and batched.waiting == 0, 10) and batched._live == []
    assert wait_until(lambda: threading.active_count() == threads_before, 10), threading.enumerate()
    assert batched._cache is cache and len(batched._indices) <= 8
    lone = static_engine(model, tok)
    for c, p in enumerate(prompts):
        assert collect(batched.generate(p, seed=99 + c, **kw)) == collect(lone.generate(p, seed=99 + c, **kw))
    batched.close()
    assert threading.active_count() == threads_before - 1 and batched._cache is None
    assert collect(batched.generate(prompts[0], seed=5, **kw)) == collect(lone.generate(prompts[0], seed=5, **kw))


# ------------------------------------------------------------------------------------ failures

def test_a_failing_prefill_fails_only_its_request(chat):
    model, tok = chat
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=2)
    real, calls = engine._prefill, []

    def prefill(tokens, cache, compiled=False):
        calls.append(len(tokens))
        if len(calls) == 1:   # the first waits until the second is queued: both join one admission
            assert wait_until(lambda: batched.waiting == 1, 30)
        elif len(calls) == 2:
            raise RuntimeError("out of memory (simulated) for this prompt")
        return real(tokens, cache, compiled)
    engine._prefill = prefill
    kw = dict(temperature=0.0, max_tokens=20, stop_tokens=())
    ok = in_thread(collect, batched.generate(prompt_for(tok, "fine"), **kw))
    assert wait_until(lambda: len(calls) == 1, 30)   # "fine" is in its prefill: "too long" comes second
    bad = in_thread(collect, batched.generate(prompt_for(tok, "too long"), **kw))
    for t, _ in (ok, bad):
        t.join(30)
    assert "out of memory" in str(bad[1].get("error"))
    assert ok[1].get("out") == collect(static_engine(model, tok).generate(prompt_for(tok, "fine"), **kw)), ok[1]
    assert batched.live_rows == 0 and len(collect(batched.generate(prompt_for(tok, "again"), **kw))) == 20


def test_a_failing_step_fails_the_requests_in_flight_and_slots_are_reused(chat):
    model, tok = chat
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=2)
    real, seen = engine._advance_rows, []

    def advance(rows, sampled, stops):
        seen.append(id(rows))
        if len(set(seen)) == 2 and len(seen) == 4:   # both live, in the second shared step
            raise RuntimeError("simulated device failure")
        return real(rows, sampled, stops)
    engine._advance_rows = advance
    admit_together(engine, batched, 1)
    kw = dict(temperature=0.0, max_tokens=30, stop_tokens=())
    runs = [in_thread(collect, batched.generate(prompt_for(tok, t), **kw)) for t in ("a", "b")]
    for t, _ in runs:
        t.join(30)
    assert all("simulated device failure" in str(box.get("error")) for _, box in runs), runs
    engine._advance_rows = real
    lone = static_engine(model, tok)
    again = [in_thread(collect, batched.generate(prompt_for(tok, t), **kw)) for t in ("c", "d")]
    for t, _ in again:
        t.join(30)
    assert [box.get("out") for _, box in again] == [collect(lone.generate(prompt_for(tok, t), **kw)) for t in "cd"]
    assert batched.live_rows == 0


def test_a_dead_scheduler_reaches_its_callers_and_restarts(chat):
    """Entering inference_weights() fails in the scheduler thread (out of memory for the fused q/k/v
    copy): the thread died with the request waiting forever for it, and so did every later one."""
    model, tok = chat
    engine = static_engine(model, tok)
    batched = BatchedEngine(engine, slots=2)
    real = engine.inference_weights
    engine.inference_weights = lambda: (_ for _ in ()).throw(RuntimeError("out of memory (simulated)"))
    t, box = in_thread(collect, batched.generate(prompt_for(tok, "hi"), max_tokens=3))
    t.join(20)
    assert not t.is_alive(), "the request waits forever for a dead scheduler"
    assert "out of memory" in str(box.get("error"))
    engine.inference_weights = real
    assert len(collect(batched.generate(prompt_for(tok, "hi"), max_tokens=3, stop_tokens=()))) == 3


# ------------------------------------------------------------------------------------ over HTTP

def serve_batched(chat, slots: int, **settings):
    """Yields (url, engine, batched): a live server over one replica of `slots` batch slots of the
    tiny model (ServerSettings: model "tiny", 10 requests per client, then `settings`)."""
    model, tok = chat
    engine = static_engine(model, tok)
    workers = replica_workers(engine, "cpu", slots)
    server, url = serve_in_thread(create_app(WorkerPool(workers), ServerSettings(
        model_name="tiny", max_concurrent_per_client=10, **settings)))
    yield url, engine, workers[0].engine
    server.should_exit = True
    server.thread.join(timeout=10)


@pytest.fixture
def batched_server(chat):
    """(url, engine, batched): a server over one replica of 2 batch slots (max_queue 1)."""
    yield from serve_batched(chat, 2, max_queue=1)


def test_leaving_while_queued_in_the_batcher_frees_the_worker_and_stats_add_up(batched_server):
    """A holds both rows (n = 2, the scheduler held inside its step); B got the second worker but
    waits inside the BatchedEngine for rows; C waits for a worker; D is refused (503, Retry-After).
    B's client leaves: its worker must go to C at once (it was held until A ended, B's first token
    generated for nobody). Then /stats and /health add up."""
    url, engine, batched = batched_server
    held, go = hold_scheduler(engine)
    post = lambda body: httpx.post(url + "/v1/chat/completions", json=body, timeout=60)  # noqa: E731
    a = in_thread(post, {"messages": USER, "n": 2, "max_tokens": 12, "temperature": 0})
    try:
        assert held.wait(30)
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=30,
                          json={"messages": USER, "stream": True, "max_tokens": 12}) as r:
            lines = r.iter_lines()   # kept: an abandoned iter_lines() closes the connection
            next(line for line in lines if line.startswith("data: "))   # B's job started
            assert wait_until(lambda: batched.waiting == 1, 10)
            c = in_thread(post, {"messages": USER, "max_tokens": 5, "temperature": 0})
            assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1, 10)
            d = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=10)
            assert d.status_code == 503 and d.headers["retry-after"] == "1"
            stats = httpx.get(url + "/stats").json()
            assert stats["batching"][0]["live_rows"] == 2 and stats["batching"][0]["waiting"] == 1
        # B gone: C takes its worker (queued in the batcher in turn) while A is still held
        assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 0, 10), "B's worker stayed taken"
        assert wait_until(lambda: batched.waiting == 1, 10) and held.is_set() and not go.is_set()
    finally:
        go.set()
    for t, _ in (a, c):
        t.join(60)
    answers = [a[1]["out"].json(), c[1]["out"].json()]
    assert [len(x["choices"]) for x in answers] == [2, 1]
    assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 2, 10)
    stats = httpx.get(url + "/stats").json()
    req = stats["requests"]
    assert req["chat_requests"] == 3 and req["completed"] == 2 and req["cancelled"] == 1 and "errors" not in req
    assert req["http_503"] == 1
    assert req["completion_tokens"] == sum(x["usage"]["completion_tokens"] for x in answers)
    assert sum(w["tokens"] for w in stats["workers"]) == req["completion_tokens"]   # B generated nothing
    assert stats["batching"][0]["live_rows"] == 0 and stats["batching"][0]["waiting"] == 0


def test_a_client_leaving_right_at_completion_is_counted(chat):
    """The answer's last text was streamed, then the client left while the engine's generator was
    still closing (its "done" not yet read): counted as nothing before (chat_requests 1, completed
    0, cancelled 0, errors 0); now cancelled, so chat_requests = completed + cancelled + errors."""
    engine = ScriptedEngine(chat[1], "All done.")
    closing, hold, real = threading.Event(), threading.Event(), engine.generate

    def slow_close(*args, **kwargs):
        try:
            yield from real(*args, **kwargs)
        finally:
            closing.set()
            hold.wait(30)
    engine.generate = slow_close
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings()))
    try:
        text = ""
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True},
                          timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += "".join(c["delta"].get("content", "") for c in json.loads(line[6:])["choices"])
                if text == "All done.":
                    break
            assert closing.wait(10)   # the job is closing the engine's generator: leave now
        assert wait_until(lambda: httpx.get(url + "/stats").json()["active_clients"] == 0, 10)
        hold.set()
        assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 1, 10)
        req = httpx.get(url + "/stats").json()["requests"]
        assert req["chat_requests"] == 1 and req.get("cancelled") == 1, req
        assert req.get("completed", 0) + req.get("errors", 0) == 0
    finally:
        hold.set()
        server.should_exit = True
        server.thread.join(timeout=10)


# ------------------------------------------------------------------------------------ load scripts

def test_load_scripts_refuse_what_their_server_or_device_would_refuse():
    from scripts import bench_serving, load_test

    with pytest.raises(ValueError, match="--api-key"):    # the started server died on it (ServerSettings)
        load_test.parse_args(["--api-key", "short"])
    with pytest.raises(ValueError, match="--max-tokens"):   # every request was a 400
        load_test.parse_args(["--max-tokens", "5000"])
    assert load_test.parse_args(["--url", "http://127.0.0.1:1", "--api-key", "short", "--max-tokens", "5000"])
    with pytest.raises(ValueError, match="--decode"):   # refused by the Engine after the model was built
        bench_serving.parse_args(["--device", "cpu", "--decode", "graphs"])


@pytest.mark.parametrize("slots", [1, 2])
def test_bench_serving_fails_when_a_request_fails(slots):
    """A client thread whose request raised died quietly: the figures were printed over fewer
    requests and the script exited 0."""
    from scripts.bench_serving import run_mode

    engine = Engine(random_model("cpu"), None, decode="static", decode_bucket=16)
    real = engine._prefill

    def prefill(tokens, cache, compiled=False):
        if len(tokens) == 11:
            raise RuntimeError("simulated failure")
        return real(tokens, cache, compiled)
    engine._prefill = prefill
    prompts = [list(range(1, n)) for n in (6, 12, 9, 7)]   # the second has 11 tokens
    with pytest.raises(RuntimeError, match="a request failed.*simulated failure"):
        run_mode(engine, slots, prompts, SimpleNamespace(clients=2, max_tokens=4))
