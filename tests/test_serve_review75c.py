"""Review 75c of the server's own 4xx errors (nanochat/server.py, nanochat/http_guard.py): after
chat_api's 400s got OpenAI's codes (test_serve_review75b.py), the server still answered `code: null`
for the tokenizer refusing `messages`, a request-validation error, a 405 and a bad Content-Length.
Each is triggered here over HTTP (the real app through ASGI, a stand-in engine: none of these
reaches the model) and must answer its status, OpenAI's type and a non-null code. The Host and CORS
refusals already had codes; they are checked too, so the set stays whole.

A Content-Length of "²" (the latin-1 byte 0xB2, which str.isdigit() accepts and int() does not)
was a 500 internal error; it is the same 400 as any other bad Content-Length."""

import ast
import inspect
from types import SimpleNamespace

import pytest
from conftest import require_module

from nanochat import chat_api

USER = {"messages": [{"role": "user", "content": "Hello there"}]}


def refusing_tokenizer():
    def render_for_completion(conversation):
        raise ValueError("messages[0].content: got text this tokenizer cannot render")
    return SimpleNamespace(render_for_completion=render_for_completion)


@pytest.fixture(scope="module")
def client():
    """The real app with a Host allow-list and one CORS origin, plus a probe route with typed query
    parameters: no route of the app has a parameter FastAPI validates, so the probe is how a
    RequestValidationError reaches the app's handler."""
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
    from fastapi import Query
    from fastapi.testclient import TestClient

    from nanochat.server import Worker, WorkerPool, create_app

    engine = SimpleNamespace(tokenizer=refusing_tokenizer(), max_seq_len=256)
    settings = chat_api.ServerSettings(allowed_hosts=("testserver",), cors_origins=("http://good.example",))
    app = create_app(WorkerPool([Worker(engine, "w0")]), settings)

    @app.get("/probe")
    async def probe(n: int = Query(gt=0)):
        return {"n": n}

    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def check(r, status: int, code: str, param="unset") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    if param != "unset":
        assert err["param"] == param, err
    return err


def test_the_tokenizer_refusing_messages_is_invalid_value(client):
    err = check(client.post("/v1/chat/completions", json=USER), 400, "invalid_value", param="messages")
    assert err["message"].startswith("'messages': messages[0].content"), err["message"]   # unchanged


@pytest.mark.parametrize("query, code", [("", "missing_required_parameter"), ("?n=abc", "invalid_type"),
                                         ("?n=0", "invalid_value")])
def test_a_request_validation_error_has_a_code(client, query, code):
    err = check(client.get("/probe" + query), 400, code)
    assert err["message"].startswith("invalid request: "), err["message"]
    assert client.get("/probe?n=3").json() == {"n": 3}


def test_a_method_not_allowed_has_a_code(client):
    r = client.get("/v1/chat/completions")
    check(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "POST"


@pytest.mark.parametrize("length", [b"abc", b"-1", b"\xb2"])   # \xb2: "²" in latin-1, a digit to isdigit()
def test_a_bad_content_length_has_a_code(client, length):
    r = client.post("/v1/chat/completions", content=b"{}",
                    headers={"Content-Type": "application/json", "Content-Length": length})
    err = check(r, 400, "invalid_content_length")
    assert err["message"] == "invalid Content-Length header"


def test_host_and_cors_refusals_have_codes(client):
    check(client.get("/health", headers={"Host": "rebind.example"}), 400, "invalid_host")
    check(client.post("/v1/chat/completions", json=USER, headers={"Origin": "http://evil.example"}),
          403, "invalid_origin")
    r = client.options("/v1/chat/completions",
                       headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    check(r, 400, "cors_preflight_refused")


def test_no_4xx_in_server_or_http_guard_is_raised_without_a_code():
    """A guard for the next one added: every ApiError with a literal 4xx status passes a `code`."""
    from nanochat import http_guard, server

    for module in (server, http_guard):
        calls = [n for n in ast.walk(ast.parse(inspect.getsource(module)))
                 if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "ApiError" and n.args
                 and isinstance(n.args[0], ast.Constant) and 400 <= n.args[0].value < 500]
        assert calls, module.__name__
        uncoded = [n.lineno for n in calls if not any(k.arg == "code" for k in n.keywords)]
        assert not uncoded, f"ApiError(4xx) without a code in {module.__name__} at lines {uncoded}"
