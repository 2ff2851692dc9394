"""Ninth review of the chat server, as an operator loading a batched replica (chat_web's default
continuous batching) on CPU: many concurrent streamed and non-streamed requests with different
n, stop strings, seeds, temperatures and max_tokens, and clients that leave mid-stream or while
queued. No defect was found in this round; these pin what was checked: a request's answer (text,
finish reasons, usage) does not depend on what it was batched with, and after clients leave every
row, worker and per-client slot is free again and the /stats counters add up. One fix: the cleanup
of a stream that never started (run by the garbage collector, on whatever thread it runs) touched
asyncio futures off the event loop's thread."""

import json
import threading

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from test_chat_web import wait_until  # noqa: E402

SLOTS = 4


@pytest.fixture(scope="module")
def batched_url(tiny_corpus):
    from nanochat.engine import Engine
    from nanochat.server import ServerSettings, WorkerPool, create_app, replica_workers, serve_in_thread
    from test_engine import tiny_chat_model

    model, tokenizer = tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_chat_web's
    workers = replica_workers(Engine(model, tokenizer, decode="static", decode_bucket=32), "cpu", SLOTS)
    server, url = serve_in_thread(create_app(WorkerPool(workers), ServerSettings(
        model_name="tiny", max_concurrent_per_client=32)))
    yield url
    server.should_exit = True
    server.thread.join(timeout=10)


def body(i: int, **kw) -> dict:
    return {"messages": [{"role": "user", "content": f"Tell me about thing {i}"}], "seed": 100 + i,
            "max_tokens": 6 + 5 * i, "n": 1 + i % 3, "temperature": (0.0, 0.8, 1.5)[i % 3],
            "stop": ([], ["e"], ["th", "o "])[i % 3], **kw}


def answer(url: str, b: dict, stream: bool):
    """(texts, finish reasons, usage) of one request, streamed or not."""
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=b, timeout=60)
        assert r.status_code == 200, r.text
        j = r.json()
        return [c["message"]["content"] for c in j["choices"]], [c["finish_reason"] for c in j["choices"]], j["usage"]
    texts, finish, usage = [""] * b["n"], [None] * b["n"], None
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={**b, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                for c in event["choices"]:
                    texts[c["index"]] += c["delta"].get("content") or ""
                    finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
                usage = event.get("usage") or usage
    return texts, finish, usage


def all_at_once(targets) -> list:
    got = [None] * len(targets)
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, targets[i]())) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return got


def counters(url: str) -> dict:
    return httpx.get(url + "/stats", timeout=10).json()


def test_answers_do_not_depend_on_what_they_were_batched_with(batched_url):
    bodies = [body(i) for i in range(6)]
    before = counters(batched_url)["requests"]
    alone = [answer(batched_url, b, stream=False) for b in bodies]
    # each body twice at once, streamed and not: 12 requests (up to 3 rows each) through 4 rows
    together = all_at_once([lambda b=b, s=s: answer(batched_url, b, s) for b in bodies for s in (False, True)])
    assert together == [a for a in alone for _ in range(2)]
    stats = counters(batched_url)
    added = {k: v - before.get(k, 0) for k, v in stats["requests"].items()}
    assert added == {"chat_requests": 18, "completed": 18,
                     "completion_tokens": 3 * sum(a[2]["completion_tokens"] for a in alone)}
    assert stats["batching"][0]["live_rows"] == 0 and stats["batching"][0]["mean_batch"] > 1


def test_clients_that_leave_free_their_rows_and_the_counts_add_up(batched_url):
    before = counters(batched_url)["requests"]

    def leave_stream(b, after):   # reads `after` SSE events (0: only the headers), then hangs up
        with httpx.stream("POST", batched_url + "/v1/chat/completions", json={**b, "stream": True}, timeout=60) as r:
            for k, _ in enumerate(r.iter_lines()):
                if k >= after:
                    break

    def leave_post(b):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(batched_url + "/v1/chat/completions", json=b, timeout=0.001)

    long = dict(max_tokens=200, stop=[])
    all_at_once([lambda i=i: leave_stream(body(i, **long), i % 4) for i in range(8)] +
                [lambda i=i: leave_post(body(i, **long)) for i in range(4)])
    # every request ends (a hung-up stream is noticed at its next write, a queued one at once)
    assert wait_until(lambda: sum(v for k, v in counters(batched_url)["requests"].items()
                                  if k in ("completed", "cancelled", "errors")) - sum(
        before.get(k, 0) for k in ("completed", "cancelled", "errors")) == 12, timeout=20)
    stats, health = counters(batched_url), httpx.get(batched_url + "/health").json()
    assert stats["requests"]["chat_requests"] - before.get("chat_requests", 0) == 12
    assert stats["requests"].get("errors", 0) == before.get("errors", 0)
    assert wait_until(lambda: httpx.get(batched_url + "/health").json()["available"] == SLOTS)
    assert stats["batching"][0]["waiting"] == 0 and stats["active_clients"] == 0 and health["waiting"] == 0
    assert wait_until(lambda: counters(batched_url)["batching"][0]["live_rows"] == 0)
    # and the replica still answers as before: a seeded request equals its lone answer
    b = body(4)
    assert answer(batched_url, b, stream=True) == answer(batched_url, b, stream=False)


def test_an_unstarted_stream_s_cleanup_runs_on_the_event_loop_thread():
    """weakref.finalize ran _unstarted_cleanup on the collector's thread (a generation thread
    allocating): it released the worker into the next waiter's future, and asyncio futures are not
    thread-safe. It now hands the cleanup to the loop (call_soon_threadsafe)."""
    import asyncio
    from types import SimpleNamespace

    from nanochat.server import _unstarted_cleanup
    from nanochat.worker_pool import WorkerPool

    async def scenario():
        loop_thread = threading.get_ident()
        pool = WorkerPool([SimpleNamespace(busy=False, name="w")])
        mine, next_in_line = pool.claim(), pool.claim()   # the first holds the worker, the second waits
        stats, released = {"cancelled": 0, "errors": 0}, []
        finalizer = threading.Thread(target=_unstarted_cleanup, args=(
            pool, mine, stats, lambda: released.append(threading.get_ident()), []))
        finalizer.start()
        finalizer.join()
        worker = await asyncio.wait_for(next_in_line, 5)   # handed on, on the loop
        return loop_thread, released, worker, stats
    loop_thread, released, worker, stats = asyncio.run(scenario())
    assert released == [loop_thread] and worker.name == "w" and stats["cancelled"] == 1
