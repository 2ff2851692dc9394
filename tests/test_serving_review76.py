"""Review 76 of serving on CPU (nanochat/batching.py under nanochat/server.py), as a demanding API
user of chat_web's default batched replica over the tiny random model.

Probed and found right (these runs are not all pinned here: tests/test_serving_audit.py and
tests/test_serve_review9.py pin most): n > 1 with a seed (choices differ, a repeat is identical, a
batched replica answers as an unbatched one), temperature 0 (the Engine's own greedy tokens), stop
strings across token boundaries, U+FFFD and an emoji split into byte tokens, a stop string that is
a prefix of another, max_tokens 1, the context limit (finish "length" where the context ends, usage
exact), 30 concurrent streams of mixed n / length / sampling equal to their lone runs, clients
leaving mid-stream, before the response starts and while queued (rows, workers and per-client
slots free again, /stats' counters add up).

One defect: /stats' batching counters (steps, rows_stepped, mean_batch) included BatchedEngine's
warm-up requests, so a freshly started chat_web, before any request, reported ~30 decode steps at a
mean batch of ~1.75, and every later mean_batch was skewed by them. They now count served requests
only."""

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.batching import BatchedEngine  # noqa: E402
from nanochat.engine import Engine  # noqa: E402
from nanochat.server import ServerSettings, WorkerPool, create_app, replica_workers, serve_in_thread  # noqa: E402
from test_engine import SEQ_LEN, prompt_for, tiny_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def chat(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


@pytest.fixture(scope="module")
def warmed_server(chat):
    """chat_web's start on a CPU: a 4-slot batched replica, warmed up, then served."""
    model, tok = chat
    workers = replica_workers(Engine(model, tok), "cpu", 4)
    workers[0].engine.warmup()
    server, url = serve_in_thread(create_app(WorkerPool(workers), ServerSettings(model_name="tiny")))
    yield url, workers[0].engine
    server.should_exit = True
    server.thread.join(timeout=10)
    workers[0].engine.close()


def test_warmup_leaves_the_batching_counters_at_zero(chat):
    """warmup() runs short requests through the scheduler (steps 32, rows_stepped 56 on this model
    before the fix); the counters then count served requests only: a lone request of 5 tokens is
    4 decode steps of one row."""
    model, tok = chat
    batched = BatchedEngine(Engine(model, tok), slots=4)
    try:
        assert batched.warmup() > 0
        assert (batched.steps, batched.rows_stepped, batched.moves) == (0, 0, 0)
        steps = list(batched.generate(prompt_for(tok), max_tokens=5, temperature=0.0, stop_tokens=()))
        assert len(steps) == 5 and (batched.steps, batched.rows_stepped) == (4, 4)
    finally:
        batched.close()


def test_a_fresh_servers_stats_report_no_decode_steps(warmed_server):
    url, _ = warmed_server
    batching = httpx.get(url + "/stats", timeout=10).json()["batching"]
    assert batching == [{"slots": 4, "live_rows": 0, "waiting": 0, "steps": 0, "rows_stepped": 0, "mean_batch": 0.0}]


def test_context_limit_usage_and_greedy_answer_are_exact(warmed_server, chat):
    """A pin of what was probed: at and near the context limit the answer stops where the context
    ends (finish "length"), usage counts the rendered conversation and every generated token, and
    temperature 0 answers the Engine's own greedy tokens."""
    model, tok = chat
    url, batched = warmed_server
    stops = set(batched.default_stop_tokens) | {tok.encode_special("<|user_start|>")}
    engine = Engine(model, tok)
    for words in (63, 61):   # rendered: 255 and 247 tokens of the 256-token context
        messages = [{"role": "user", "content": " ".join(["Hello"] * words)}]
        prompt = tok.render_for_completion({"messages": messages})
        room = SEQ_LEN - len(prompt)
        assert room in (1, 9)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 50, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        want = [c[0] for c, _ in engine.generate(prompt, max_tokens=room, temperature=0.0, stop_tokens=stops)]
        assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(want),
                                "total_tokens": len(prompt) + len(want)}
        (choice,) = out["choices"]
        assert choice["finish_reason"] == ("stop" if want[-1] in stops else "length")
        assert choice["message"]["content"] == tok.decode([t for t in want if t not in stops])
