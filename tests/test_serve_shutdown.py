"""The chat server shutting down (Ctrl-C / SIGTERM) while it answers: every client gets a proper end
in OpenAI's shape, never a cut connection. Before, uvicorn served on for its grace period and then
cancelled what still ran: streams ended with "incomplete chunked message body", a queued
non-streamed request got a bare 500, and a SIGTERM'd chat_web exited killed by the signal (-15).
Now new and queued requests get a 503 `server_shutting_down` at once (a stream: that error event
and [DONE]), running ones the same shortly before the grace period ends, with their generation
stopped and their slot freed, and chat_web exits 0. Fixtures and helpers: tests/test_chat_web.py."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

import test_chat_web
from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread
from test_chat_web import USER, ScriptedEngine, assert_error, free_port, wait_until

chat_model = test_chat_web.chat_model   # its fixture, used here too
SHUTTING_DOWN = "server_shutting_down"


class _LoopOf:
    """ASGI pass-through that records the server's event loop (drain must be called on it)."""

    def __init__(self, app):
        self.app, self.state, self.loop = app, app.state, None

    async def __call__(self, scope, receive, send):
        self.loop = asyncio.get_running_loop()
        await self.app(scope, receive, send)


def _stream(url, body, out, name):
    """A streamed request (thread): out[name] = (time it ended, its data payloads or the exception)."""
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            lines = r.read().decode().split("\n")
        out[name] = time.monotonic(), [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:])
                                  for ln in lines if ln.startswith("data: ")]
    except Exception as e:  # noqa: BLE001 - reported by the assertions
        out[name] = time.monotonic(), e


def _post(url, body, out, name):
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        out[name] = time.monotonic(), r
    except Exception as e:  # noqa: BLE001
        out[name] = time.monotonic(), e


def _start(target, *args):
    t = threading.Thread(target=target, args=args, daemon=True)
    t.start()
    return t


def assert_shutdown_event(events, stopped: bool):
    """The stream ends with the server_shutting_down error event and [DONE], no finish reason."""
    assert isinstance(events, list), events
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    err = events[-2]["error"]
    assert err["code"] == SHUTTING_DOWN and err["type"] == "server_error", err
    assert ("stopped before it finished" in err["message"]) == stopped, err["message"]
    assert not [c for e in events[:-2] for c in e["choices"] if c["finish_reason"]]
    return events[:-2]


def test_drain_answers_queued_and_new_at_once_and_stops_running_ones(chat_model):
    """drain(stop_after): queued requests (streamed and not) and new ones are answered 503 at once;
    the running stream goes on until stop_after, then its generation is stopped (the engine's
    generator closed, as for a gone client), the worker is free and the stream ends properly."""
    _, tokenizer = chat_model
    engine = ScriptedEngine(tokenizer, "word " * 200, delay=0.02)
    app = _LoopOf(create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings(max_concurrent_per_client=8)))
    server, url = serve_in_thread(app)
    out = {}
    try:
        body = {"messages": USER, "max_tokens": 200}
        threads = [_start(_stream, url, body, out, "running")]
        assert wait_until(lambda: engine.steps > 3)
        threads += [_start(_stream, url, body, out, "queued_stream"), _start(_post, url, body, out, "queued")]
        assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 2)
        t0 = time.monotonic()
        app.loop.call_soon_threadsafe(app.state.drain, 0.6)
        for t in threads[1:]:
            t.join(timeout=5)
        assert out["queued_stream"][0] - t0 < 0.4 and out["queued"][0] - t0 < 0.4   # at once
        assert_shutdown_event(out["queued_stream"][1], stopped=False)
        r = out["queued"][1]
        assert_error(r, 503, code=SHUTTING_DOWN)
        assert r.headers["retry-after"] == "1"
        for stream in (False, True):   # a new request, as the server keeps its listener open a moment
            assert_error(httpx.post(url + "/v1/chat/completions", json={**body, "stream": stream}), 503,
                         code=SHUTTING_DOWN)
        assert not engine.finished.is_set()   # still generating until stop_after
        threads[0].join(timeout=5)
        done_at, events = out["running"]
        assert 0.5 < done_at - t0 < 2.0
        chunks = assert_shutdown_event(events, stopped=True)
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks).startswith("word word")
        assert engine.finished.wait(2)   # the generator was closed: generation stopped
        steps = engine.steps
        time.sleep(0.1)
        assert engine.steps == steps < 200
        assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 1)
        counts = httpx.get(url + "/stats").json()["requests"]
        assert counts["cancelled"] == 1 and counts["errors"] == 2 and not counts.get("completed")
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)


# chat_web itself, as `python -m scripts.chat_web` runs it: its model slowed to ~30 tokens/s once
# loaded (an answer still running when the signal comes) and a 3 s grace period (generation stopped after 2 s)
LAUNCH = """
import sys, time
import nanochat.gpt as gpt
from scripts import chat_web
from nanochat.flags import script_main

forward, load = gpt.GPT.forward, chat_web.load_replicas
def slow(self, *a, **kw):
    time.sleep(0.03)
    return forward(self, *a, **kw)
def load_then_slow(args):
    loaded = load(args)
    gpt.GPT.forward = slow
    return loaded
chat_web.load_replicas, chat_web.GRACE_S = load_then_slow, 3
script_main("chat_web", lambda: None, lambda: chat_web.main(sys.argv[1:]))
"""


def launch_slowed(base_dir, *flags) -> tuple[subprocess.Popen, str]:
    """chat_web (LAUNCH: its model slowed once loaded, GRACE_S 3) on the CPU over `base_dir`, started
    and answering /health; returns the process (stdout and stderr merged, text) and its URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "--device", "cpu", "--port", str(port), *flags],
                            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=dict(os.environ, NANOCHAT_BASE_DIR=str(base_dir)))
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return httpx.get(url + "/health").status_code == 200
        except httpx.TransportError:
            return False
    if not wait_until(up, timeout=60):
        proc.kill()
        raise AssertionError(f"chat_web did not start: {proc.communicate()[0][-2000:]}")
    return proc, url


def test_chat_web_sigterm_ends_every_answer_properly_and_exits_0(sft_checkpoint):
    """2 batch slots: two answers running (a stream, a non-streamed one), two queued (idem). On
    SIGTERM the queued ones get their 503 at once, the running ones stream on, then end with the
    error STOP_EARLY_S before the grace period ends; the process exits 0 soon after."""
    proc, url = launch_slowed(sft_checkpoint, "--batch-slots", "2", "--max-n", "1", "--log-level", "warning")
    out = {}
    try:
        body = {"messages": USER, "max_tokens": 200, "temperature": 0}
        threads = [_start(_stream, url, body, out, "running_stream"), _start(_post, url, body, out, "running")]
        assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def openai_stream():
            try:
                for _ in client.chat.completions.create(model="m", messages=USER, stream=True, max_tokens=200):
                    pass
                out["queued_stream"] = time.monotonic(), "completed"
            except Exception as e:  # noqa: BLE001
                out["queued_stream"] = time.monotonic(), e
        threads += [_start(openai_stream), _start(_post, url, body, out, "queued")]
        assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 2)
        time.sleep(0.3)   # the running stream has sent some of its answer
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=10)
        rc = proc.wait(timeout=10)
        exited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        log = proc.communicate()[0]
    ended = {name: round(at - t0, 2) for name, (at, _) in out.items()}   # seconds after the signal
    assert rc == 0 and exited < 4.5, (rc, exited, ended, log[-2000:])
    assert "Traceback" not in log and "Cancel" not in log, log[-2000:]   # nothing left for uvicorn to cancel
    assert ended["queued_stream"] < 1.2 and ended["queued"] < 1.2, ended   # at once
    assert 1.8 < ended["running_stream"] < 2.9 and 1.8 < ended["running"] < 2.9, ended   # STOP_EARLY_S before 3 s
    err = out["queued_stream"][1]   # the openai client reads the error event as an APIError
    assert isinstance(err, openai.APIError) and err.code == SHUTTING_DOWN, err
    assert_error(out["queued"][1], 503, code=SHUTTING_DOWN)
    assert "stopped before it finished" in assert_error(out["running"][1], 503, code=SHUTTING_DOWN)["message"]
    assert len(assert_shutdown_event(out["running_stream"][1], stopped=True)) > 2   # role chunk + some answer


def test_finish_waits_for_the_generation_threads_drain_stopped(chat_model):
    """chat_web once exited -6 ("terminate called without an active exception") instead of 0: the
    process ended while a generation thread (a daemon) was still inside a model step. run_server
    now calls app.state.finish() after uvicorn returns: it joins every generation thread."""
    _, tokenizer = chat_model
    engine = ScriptedEngine(tokenizer, "word " * 200, delay=0.05)
    app = _LoopOf(create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings(max_concurrent_per_client=8)))
    server, url = serve_in_thread(app)
    out = {}
    try:
        t = _start(_stream, url, {"messages": USER, "max_tokens": 200}, out, "running")
        assert wait_until(lambda: engine.steps > 2)
        gen = [th for th in threading.enumerate() if th.name.startswith("gen-w0")]
        assert len(gen) == 1 and gen[0].is_alive()
        app.loop.call_soon_threadsafe(app.state.drain, 0.0)
        t.join(timeout=5)
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
    app.state.finish(5.0)
    assert not gen[0].is_alive()
    assert_shutdown_event(out["running"][1], stopped=True)
