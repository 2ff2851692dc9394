"""The chat server when a request does not end normally, over real HTTP: generation that fails
mid-way, a job that fails to start, a failure as generation closes, clients that leave (streamed,
non-streamed, while queued). Each must end the way an OpenAI client understands (a 500 JSON error,
or a `data: {"error": ...}` event then `data: [DONE]` on a stream, never a stream that looks
complete), be counted in /stats, and leave every worker free. Fixtures and helpers:
tests/test_chat_web.py."""

import json
import threading

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.engine import Engine
import test_chat_web
from test_chat_web import USER, ScriptedEngine, assert_error, wait_until

chat_model, serve = test_chat_web.chat_model, test_chat_web.serve  # its fixtures, used here too


def stream_events(url, body):
    """A streamed request's `data:` payloads in order (parsed JSON, or "[DONE]")."""
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.read().decode().split("\n")
    return [ln[6:] if ln == "data: [DONE]" else json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]


def assert_error_ending(events, message_part):
    """The stream ends with an OpenAI-shaped error event and [DONE]; no choice claims it finished."""
    assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
    err = events[-2]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert message_part in err["message"]
    chunks = events[:-2]
    assert all("error" not in e for e in chunks)
    assert not [c for e in chunks for c in e["choices"] if c["finish_reason"]], "an errored stream said it finished"
    assert not any(e.get("usage") for e in chunks)   # usage comes only with a finished answer
    return chunks


def test_generation_error_is_500_and_server_recovers(serve, chat_model):
    engine = ScriptedEngine(chat_model[1], "partial answer here", fail_at=2)
    url = serve(engine)
    err = assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}), 500)
    assert err["type"] == "server_error" and "scripted failure" in err["message"]
    events = stream_events(url, {"messages": USER, "stream_options": {"include_usage": True}})
    assert_error_ending(events, "scripted failure")
    engine.fail_at = None
    assert httpx.post(url + "/v1/chat/completions", json={"messages": USER}).status_code == 200
    assert httpx.get(url + "/health").json()["available"] == 1


def test_real_engine_failing_mid_stream_ends_with_an_error_event(serve, chat_model, monkeypatch):
    """A real Engine whose decoding fails after a few tokens (as a device error would): the tokens
    already sent stay, the stream ends with an error event (the openai client raises APIError),
    /stats counts an error, and the next request is served."""
    model, tokenizer = chat_model
    engine = Engine(model, tokenizer)
    real = engine.generate

    def failing(*args, **kwargs):
        for i, step in enumerate(real(*args, **kwargs)):
            if i == 4:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            yield step
    monkeypatch.setattr(engine, "generate", failing)
    url = serve(engine)
    body = {"messages": USER, "max_tokens": 40, "temperature": 0, "stream_options": {"include_usage": True}}
    chunks = assert_error_ending(stream_events(url, body), "illegal memory access")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["delta"].get("content", "") for e in chunks[1:] for c in e["choices"])   # what came first stays
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="illegal memory access"):
        # greedy, as the first request: a sampled reply could reach its stop token before the failing step
        for _ in client.chat.completions.create(model="m", messages=USER, max_tokens=40, stream=True, temperature=0):
            pass
    stats = httpx.get(url + "/stats").json()["requests"]
    assert stats["errors"] == 2 and stats.get("completed", 0) == 0 and stats.get("cancelled", 0) == 0
    monkeypatch.setattr(engine, "generate", real)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and httpx.get(url + "/health").json()["available"] == 1


def test_failure_as_generation_closes_is_an_error_not_a_stop(serve, chat_model, monkeypatch):
    """The reply reached its stop token, then closing the engine's generator raised (where a
    device error surfaces at the next synchronisation): the answer is not known to be good, so the
    stream must not have said finish_reason "stop" before the error event."""
    engine = ScriptedEngine(chat_model[1], "All done.")
    real = engine.generate

    def fails_on_close(*args, **kwargs):
        try:
            yield from real(*args, **kwargs)
        finally:
            raise RuntimeError("device lost while releasing the decoder")
    monkeypatch.setattr(engine, "generate", fails_on_close)
    url = serve(engine)
    chunks = assert_error_ending(stream_events(url, {"messages": USER}), "device lost")
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chunks) == "All done."
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}), 500)
    assert httpx.get(url + "/stats").json()["requests"]["errors"] == 2


@pytest.mark.parametrize("broken", ["build", "start"])
def test_a_job_that_fails_to_start(serve, chat_model, monkeypatch, broken):
    """Building the job raises, or its thread cannot start (the worker is held and no thread will
    release it): non-streamed -> 500; streamed (the 200 is already sent) -> an error event and
    [DONE], which the openai client raises as APIError. Either way /stats counts an error (not a
    cancel) and the worker goes back to the pool, so the server keeps serving."""
    import nanochat.server as server

    def fail(*args, **kwargs):
        raise RuntimeError("can't start new thread")
    if broken == "build":
        monkeypatch.setattr(server, "_Job", fail)
    else:
        monkeypatch.setattr(server._Job, "start", fail)
    url = serve(ScriptedEngine(chat_model[1], "fine"), max_concurrent_per_client=10)
    err = assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=30), 500)
    assert "generation failed to start" in err["message"] and "can't start new thread" in err["message"]
    assert httpx.get(url + "/health").json()["available"] == 1
    chunks = assert_error_ending(stream_events(url, {"messages": USER}), "can't start new thread")
    assert chunks == []
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="generation failed to start"):
        list(client.chat.completions.create(model="m", messages=USER, stream=True))
    stats = httpx.get(url + "/stats").json()
    assert stats["requests"].get("cancelled", 0) == 0 and stats["requests"]["errors"] == 3, stats["requests"]
    assert httpx.get(url + "/health").json()["available"] == 1 and stats["workers"][0]["requests"] == 0
    monkeypatch.undo()
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=10)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "fine"


# ------------------------------------------------------------------------------------ clients that leave

def test_stream_disconnect_cancels_and_frees_worker(serve, chat_model):
    engine = ScriptedEngine(chat_model[1], "tick " * 200, delay=0.02)
    url = serve(engine)
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 4:
                break
    assert wait_until(engine.finished.is_set, 3), "generation kept running after the client left"
    assert engine.steps < 100
    assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 1, 3)
    stats = httpx.get(url + "/stats").json()
    assert stats["requests"]["cancelled"] == 1 and stats["active_clients"] == 0


def test_non_stream_disconnect_cancels(serve, chat_model):
    engine = ScriptedEngine(chat_model[1], "tock " * 200, delay=0.02)
    url = serve(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=0.5)
    assert wait_until(engine.finished.is_set, 3) and engine.steps < 100
    assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 1, 3)


def test_stats_count_generated_tokens_and_queued_cancels(serve, chat_model):
    """/stats: a worker's tokens are the tokens its answers generated (with n > 1 an ended choice's
    row repeats its stop token until the others end: not counted), the same sum as usage; a request
    whose client leaves while it waits for a worker counts as cancelled."""
    texts = ["Short.", "A much longer answer that keeps going for a while."]
    url = serve(ScriptedEngine(chat_model[1], texts), max_concurrent_per_client=10)
    usage = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "n": 2}, timeout=30).json()["usage"]
    stats = httpx.get(url + "/stats").json()
    assert usage["completion_tokens"] == sum(len(chat_model[1].encode(t)) + 1 for t in texts)
    assert stats["workers"][0]["tokens"] == stats["requests"]["completion_tokens"] == usage["completion_tokens"]
    streamed = stream_events(url, {"messages": USER, "n": 2, "stream_options": {"include_usage": True}})
    assert streamed[-2]["choices"] == [] and streamed[-2]["usage"] == usage   # the same count when streamed
    url = serve(ScriptedEngine(chat_model[1], "slow " * 40, delay=0.02), max_concurrent_per_client=10)
    busy = threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                            kwargs={"json": {"messages": USER}, "timeout": 30})
    busy.start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0)
    with pytest.raises(httpx.ReadTimeout):   # queued behind it, then gone
        httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=0.3)
    busy.join()
    assert wait_until(lambda: httpx.get(url + "/stats").json()["requests"].get("cancelled") == 1, 3)
    stats = httpx.get(url + "/stats").json()["requests"]
    assert stats["chat_requests"] == 2 and stats["completed"] == 1
