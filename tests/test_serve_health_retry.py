"""/health counts free generation rows, and the chat page waits out a busy server.

/health's `available` counted idle workers: a batched replica's workers share its `slots` rows and a
request of n samples holds n of them, so with an n = 2 request decoding on a 4-slot replica it said 3
(two requests that would wait told a load balancer there was room). It now counts rows, and the
pool hands a request to the replica with the most free rows. Checked on a live server over a real
BatchedEngine whose scheduler is held inside a step (test_serving_audit's `hold_scheduler`).

The chat page showed a 429 (per-client limit) or a 503 (queue full, shutting down) as an error at
once. It now sends the request again after the server's Retry-After (clamped) or a doubling wait, a
bounded number of times, with a countdown that Stop ends; other refusals (a 400) are shown at once.
Checked in headless Chromium (test_browser.py's fixture) against a live server whose refusals are
real: requests held in flight (ScriptedEngine's gate) from other loopback addresses fill the limits.
"""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import test_browser
import test_serving_audit
from conftest import require_module
from test_browser import last_reply, load_page, q, send, streaming, wait
from test_chat_web import USER, ScriptedEngine, wait_until
from test_serving_audit import hold_scheduler, in_thread

from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")

# the same fixtures (assigned, not imported: linters would read the tests' arguments as redefinitions)
browser, chat = test_browser.browser, test_serving_audit.chat


@pytest.fixture
def batched4(chat):
    """(url, engine, batched): a live server over one replica of 4 batch slots (the tiny model)."""
    yield from test_serving_audit.serve_batched(chat, 4)


def test_health_counts_free_generation_rows_not_idle_workers(batched4):
    url, engine, batched = batched4
    health = lambda: httpx.get(url + "/health").json()  # noqa: E731
    h = health()
    assert (h["workers"], h["slots"], h["available"], h["waiting"]) == (4, 4, 4, 0)
    post = lambda n: httpx.post(url + "/v1/chat/completions", timeout=60, json={  # noqa: E731
        "messages": USER, "n": n, "max_tokens": 6, "temperature": 0})
    held, go = hold_scheduler(engine)
    a = in_thread(post, 2)
    try:
        assert held.wait(30)   # A's 2 rows decode; the scheduler waits inside that step
        assert health()["available"] == 2      # was 3: one worker busy
        b = in_thread(post, 1)
        assert wait_until(lambda: batched.waiting == 1, 10)   # B holds a worker, waits in the replica for a row
        assert health()["available"] == 1      # was 2
        c = in_thread(post, 2)
        assert wait_until(lambda: batched.waiting == 2, 10)   # C's 2 rows do not fit beside A's and B's
        h = health()
        assert h["available"] == 0 and h["waiting"] == 0 and h["slots"] == 4   # was available 1
        rows = sorted(w["rows"] for w in httpx.get(url + "/stats").json()["workers"])
        assert rows == [0, 1, 2, 2]
    finally:
        go.set()
    answers = []
    for t, box in (a, b, c):
        t.join(60)
        answers.append(box["out"])
    assert [r.status_code for r in answers] == [200] * 3
    assert [len(r.json()["choices"]) for r in answers] == [2, 1, 2]
    assert wait_until(lambda: health()["available"] == 4, 10)
    assert not any(w["rows"] for w in httpx.get(url + "/stats").json()["workers"])


def test_a_request_goes_to_the_replica_with_free_rows():
    """Two batched replicas of 2 rows: with replica 0's rows all held by an n = 2 request, the next
    request took replica 0's idle worker (first in line) and waited while replica 1 was idle."""
    replicas = [SimpleNamespace(slots=2, tokenizer=None) for _ in range(2)]
    plain = SimpleNamespace(tokenizer=None)   # an unbatched replica: one row, whatever its request's n

    async def scenario():
        pool = WorkerPool([Worker(e, f"r{i}/{j}") for i, e in enumerate(replicas) for j in range(2)]
                          + [Worker(plain, "plain")])
        assert (pool.slots, pool.available) == (5, 5)
        first = pool.claim(2).result()
        assert first.engine is replicas[0] and pool.available == 3
        second = pool.claim(1).result()
        assert second.engine is replicas[1] and pool.available == 2   # was replica 0's idle worker
        third = pool.claim(1).result()   # replica 1 and the plain one have a row each: the first in line
        assert third.engine is replicas[1] and pool.available == 1
        fourth = pool.claim(3).result()   # n = 3 holds the unbatched replica's one row
        assert fourth.engine is plain and fourth.rows == 3 and pool.available == 0
        fifth = pool.claim(1).result()   # the last idle worker: it waits inside replica 0 for a row
        assert fifth.engine is replicas[0] and pool.available == 0
        waiter = pool.claim(1)
        assert not waiter.done() and pool.waiting == 1
        pool.release(first)   # handed on to the waiter: replica 0 then holds its row and fifth's
        assert waiter.result() is first and first.rows == 1 and pool.available == 0
        for w in (second, fourth):
            pool.release(w)
        assert pool.available == 2 and pool.waiting == 0
        for w in (first, third, fifth):
            pool.release(w)
        assert pool.available == 5 and not any(w.rows or w.busy for w in pool.workers)
    asyncio.run(scenario())


def test_requests_waiting_inside_full_replicas_are_spread_over_them():
    """Two full replicas of 4 rows: free rows floored at 0 tied them, so every n = 1 request that
    followed went to replica 0's idle workers and waited behind its request while replica 1's
    request might end first (a request never moves). Ranked by unheld rows, they alternate."""
    replicas = [SimpleNamespace(slots=4, tokenizer=None) for _ in range(2)]

    async def scenario():
        pool = WorkerPool([Worker(e, f"r{i}/{j}") for i, e in enumerate(replicas) for j in range(4)])
        got = [pool.claim(n).result().engine for n in (4, 4, 1, 1, 1)]
        assert got == [replicas[0], replicas[1], replicas[0], replicas[1], replicas[0]]
        assert pool.available == 0
    asyncio.run(scenario())


# ------------------------------------------------------------------------------------ the chat page

COUNT_FETCHES = ("window.__fetches = 0; const realFetch = window.fetch;"
                 "window.fetch = (u, o) => { if (String(u).includes('completions')) window.__fetches++;"
                 " return realFetch(u, o); };")
WATCH_NOTICE = ("window.__noticeShown = 0; const box = document.getElementById('retry');"
                "new MutationObserver(() => { if (!box.hidden) window.__noticeShown++; })"
                ".observe(box, { attributes: true, childList: true });")
# the page's retry policy (retryDelay: seconds, or null = no more tries) for made-up answers
POLICY = """
const r = (status, after) => ({ status, headers: new Headers(after === undefined ? {} : { "Retry-After": after }) });
const date = new Date(Date.now() + 6000).toUTCString();
return [[0, 1, 2, 3, 4].map((k) => retryDelay(r(503), k)), retryDelay(r(429), 5), retryDelay(r(429, "1"), 0),
        retryDelay(r(503, "120"), 0), retryDelay(r(503, "0"), 0), retryDelay(r(429, "2.5"), 3),
        retryDelay(r(503, date), 0), retryDelay(r(503, "soon"), 1),
        [400, 401, 404, 413, 500].map((s) => retryDelay(r(s, "1"), 0))];"""


@pytest.mark.browser
def test_chat_page_retries_429_and_503_and_stop_ends_the_wait(browser, chat):
    """One page over a server that takes one request per client and one in line (max_queue 1):
    a 429 is waited out with a countdown and answered; a 503's wait is ended by Stop (no request
    after it); a 400 is shown at once, never retried."""
    engine = ScriptedEngine(chat[1], "Retried fine.")
    app = create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings(
        model_name="tiny-test", max_concurrent_per_client=1, max_queue=1, max_message_chars=100))
    server, url = serve_in_thread(app)
    clients = {}

    def post_from(address):   # a request held in flight (the gate) from a loopback address of its own
        client = clients.setdefault(address, httpx.Client(transport=httpx.HTTPTransport(local_address=address)))
        return client.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=60)

    def notice():
        box = q(d, "#retry")[0]
        return box.text if box.is_displayed() else ""
    stats = lambda: httpx.get(url + "/stats").json()["requests"]  # noqa: E731
    d, gates = browser, []
    try:
        load_page(d, url + "/")
        wait(lambda: q(d, "#model-name")[0].text == "tiny-test", what="model name from /health")
        policy = d.execute_script(POLICY)
        assert policy[:6] == [[1, 2, 4, 8, 16], None, 1, 30, 1, 2.5] and 4 <= policy[6] <= 6, policy
        assert policy[7:] == [2, [None] * 5], policy
        d.execute_script(COUNT_FETCHES)

        # 429: this address's one request is taken; the page waits, tries again and gets its answer
        gates.append(threading.Event())
        engine.gate = gates[-1]
        held = in_thread(post_from, "127.0.0.1")
        assert wait_until(lambda: len(engine.calls) == 1, 10)
        send(d, "hello")
        text = wait(notice, what="the retry notice")
        gates[-1].set()   # the held request ends: the page's next try (in 1 s) goes through
        assert text == "Server busy, retrying in 1 s (retry 1 of 5)", text
        held[0].join(30)
        assert held[1]["out"].status_code == 200 and stats()["http_429"] == 1
        wait(lambda: not streaming(d), what="the retried reply")
        assert last_reply(d) == "Retried fine." and not notice()
        assert d.execute_script("return window.__fetches") == 2 and stats()["completed"] == 2

        # 503: another client's request runs and a third's fills the line; Stop ends the page's wait
        gates.append(threading.Event())
        engine.gate = gates[-1]
        running = in_thread(post_from, "127.0.0.2")
        assert wait_until(lambda: len(engine.calls) == 3, 10)
        queued = in_thread(post_from, "127.0.0.3")
        assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1, 10)
        send(d, "again")
        assert wait(notice, what="the retry notice").startswith("Server busy, retrying in 1 s")
        assert stats()["http_503"] == 1
        q(d, "#stop")[0].click()
        wait(lambda: not streaming(d), what="stopped")
        assert not notice() and q(d, ".msg.assistant .meta")[-1].text == "stopped"
        time.sleep(1.5)   # past the 1 s wait: a try Stop did not cancel would have been sent by now
        assert d.execute_script("return window.__fetches") == 3 and stats()["http_503"] == 1
        gates[-1].set()
        for t, box in (running, queued):
            t.join(30)
            assert box["out"].status_code == 200

        # 400 (a message over the server's limit): shown at once, no notice, one request
        d.execute_script(WATCH_NOTICE)
        send(d, "x" * 150)
        wait(lambda: q(d, ".msg.error"), what="the error")
        assert "100" in last_reply(d) and not streaming(d)
        assert d.execute_script("return [window.__fetches, window.__noticeShown]") == [4, 0]
        assert stats()["http_400"] == 1
    finally:
        for gate in gates:
            gate.set()
        for client in clients.values():
            client.close()
        server.should_exit = True
        server.thread.join(timeout=10)
