"""Regression tests for serving bugs found by using a live server as a demanding API client (each
failed before its fix): a request body that never finishes arriving, a client leaving mid-body,
and n larger than a batched replica's slots."""

import socket
import time

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.server import Worker  # noqa: E402
from test_chat_web import USER, ScriptedEngine, serve  # noqa: E402,F401  (serve: the fixture)

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from test_engine import tiny_chat_model

    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_chat_web's


def raw_request(url: str, data: bytes, wait: float, close_after: float | None = None) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(wait)
        s.sendall(data)
        if close_after is not None:
            time.sleep(close_after)
            return b""
        out = b""
        try:
            while chunk := s.recv(65536):   # the server closes the connection after its answer
                out += chunk
        except socket.timeout:
            out += b"<no more>"
        return out or b"<no answer>"


def test_a_stalled_body_is_a_408_not_a_connection_held_forever(serve, chat_model, monkeypatch):  # noqa: F811
    """A client that declares a body and sends only part of it (slowloris) held its connection and
    handler for as long as it kept the socket open: no answer ever came. Now it gets a 408 once
    BODY_TIMEOUT_S has passed; a body sent whole is unaffected."""
    from nanochat import http_guard

    monkeypatch.setattr(http_guard, "BODY_TIMEOUT_S", 0.5)
    url = serve(Worker(ScriptedEngine(chat_model[1], "ok"), "w0"), model_name="m")
    t0 = time.perf_counter()
    answer = raw_request(url, HEAD + b"Content-Length: 100\r\n\r\n{\"messages\"", wait=5)
    assert answer.startswith(b"HTTP/1.1 408 ") and b'"code":"request_timeout"' in answer, answer
    assert time.perf_counter() - t0 < 4
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3}, timeout=10)
    assert r.status_code == 200
    assert httpx.get(url + "/stats").json()["requests"]["http_408"] == 1


def test_a_client_leaving_mid_body_is_not_counted_a_server_error(serve, chat_model):  # noqa: F811
    """A client closing its connection before its whole body arrived was an unexpected exception:
    /stats counted an http_500 (an internal error) for it. It is a client that left (499)."""
    url = serve(Worker(ScriptedEngine(chat_model[1], "ok"), "w0"), model_name="m")
    raw_request(url, HEAD + b"Content-Length: 100\r\n\r\n{\"messages\"", wait=5, close_after=0.1)
    deadline = time.time() + 5
    while "http_499" not in (counts := httpx.get(url + "/stats").json()["requests"]) and time.time() < deadline:
        time.sleep(0.05)
    assert counts.get("http_499") == 1 and "http_500" not in counts, counts


def test_n_over_the_batch_slots_is_a_400_before_queueing(serve, chat_model):  # noqa: F811
    """A replica with 2 batch slots and the default max_n (4) took n = 3, queued it, and failed it
    in the generation thread: a 500 "generation failed: ValueError" (an error event mid-stream).
    Now n is bounded by the slots, refused as any n over the limit, and /stats says the real limit."""
    from nanochat.engine import Engine
    from nanochat.server import replica_workers

    model, tok = chat_model
    url = serve(*replica_workers(Engine(model, tok), "cpu", 2), model_name="m")
    body = {"messages": USER, "max_tokens": 3, "seed": 1}
    r = httpx.post(url + "/v1/chat/completions", json={**body, "n": 3}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "accepted: an integer in [1, 2]" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/chat/completions", json={**body, "n": 2}, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    stats = httpx.get(url + "/stats").json()
    assert stats["limits"]["max_n"] == 2 and stats["requests"].get("http_500", 0) == 0
