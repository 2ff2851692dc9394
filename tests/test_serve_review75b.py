"""Review 75b of the chat API's errors (nanochat/chat_api.py): every 400 raised while parsing a
request carries one of OpenAI's error codes and the field it is about as `param`. A wrong JSON
type of `stream`, `model`, `messages`, a message's role / content / name, `stop` or
`stream_options` answered `code: null`, where OpenAI sends "invalid_type"; a bad value
"invalid_value"; a required field left out (or null) "missing_required_parameter". Clients that
branch on `code` (retry, trim, report) could not tell these apart."""

import ast
import inspect
from types import SimpleNamespace

import pytest
from conftest import require_module

from nanochat import chat_api

U = {"role": "user", "content": "Hello there"}
A = {"role": "assistant", "content": "Hi"}

# (body, param, code): each sent alone; param None only where the body has no field to name
BAD = [
    ([1, 2], None, "invalid_type"),
    ("just text", None, "invalid_type"),
    ({}, "messages", "missing_required_parameter"),
    ({"messages": None}, "messages", "missing_required_parameter"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": {"role": "user"}}, "messages", "invalid_type"),
    ({"messages": []}, "messages", "empty_array"),
    ({"messages": [U, "hi"]}, "messages[1]", "invalid_type"),
    ({"messages": [U, {"content": "x"}]}, "messages[1].role", "missing_required_parameter"),
    ({"messages": [{"role": 5, "content": "x"}]}, "messages[0].role", "invalid_type"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [U, {"role": "tool", "content": "4"}]}, "messages[1].role", "unsupported_value"),
    ({"messages": [U, A, {"role": "user"}]}, "messages[2].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content", "invalid_type"),
    ({"messages": [{**U, "name": 7}]}, "messages[0].name", "invalid_type"),
    ({"messages": [A]}, "messages", "missing_required_parameter"),          # no user message
    ({"messages": [U, A]}, "messages", "invalid_value"),                    # the last is not the user's
    ({"messages": [U], "model": 5}, "model", "invalid_type"),
    ({"messages": [U], "stream": "yes"}, "stream", "invalid_type"),
    ({"messages": [U], "stream": 1}, "stream", "invalid_type"),
    ({"messages": [U], "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"messages": [U], "stream": True, "stream_options": []}, "stream_options", "invalid_type"),
    ({"messages": [U], "stream": True, "stream_options": {"include_usag": True}}, "stream_options",
     "unknown_parameter"),
    ({"messages": [U], "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
     "invalid_type"),
    ({"messages": [U], "stop": {}}, "stop", "invalid_type"),
    ({"messages": [U], "stop": 0}, "stop", "invalid_type"),
    ({"messages": [U], "stop": ["ok", None]}, "stop[1]", "invalid_type"),
    ({"messages": [U], "stop": ""}, "stop", "invalid_value"),
    ({"messages": [U], "stop": ["ok", ""]}, "stop[1]", "invalid_value"),
    ({"messages": [U], "stop": ["x" * 101]}, "stop[0]", "invalid_value"),
    ({"messages": [U], "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"messages": [U], "temperature": "hot"}, "temperature", "invalid_type"),
    ({"messages": [U], "max_token": 5}, "max_token", "unknown_parameter"),
]


@pytest.fixture(scope="module")
def client():
    """The real app over ASGI: parsing runs before any model work, so a stand-in engine with no
    model serves (a request that got past parsing would fail loudly, not pass)."""
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
    from fastapi.testclient import TestClient

    from nanochat.server import Worker, WorkerPool, create_app

    engine = SimpleNamespace(tokenizer=SimpleNamespace(), max_seq_len=256)
    with TestClient(create_app(WorkerPool([Worker(engine, "w0")]), chat_api.ServerSettings()),
                    raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("body, param, code", BAD, ids=[f"{i}-{p}-{c}" for i, (_, p, c) in enumerate(BAD)])
def test_every_parse_error_has_openais_code_and_the_param(client, body, param, code):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] is not None, err
    assert (err["param"], err["code"]) == (param, code), err
    # the message names the same field (messages unchanged: the field first, in quotes)
    assert err["message"].startswith(f"'{param}'" if param else "request body"), err["message"]


def test_no_400_in_chat_api_is_raised_without_a_code():
    """A guard for the next check added: every ApiError(400, ...) written in chat_api passes a
    `code` (the `refuse` helper of unsupported fields included)."""
    tree = ast.parse(inspect.getsource(chat_api))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "ApiError"
             and n.args and getattr(n.args[0], "value", None) == 400]
    assert len(calls) > 20
    uncoded = [n.lineno for n in calls if not any(k.arg == "code" for k in n.keywords)]
    assert not uncoded, f"ApiError(400) without a code at chat_api.py lines {uncoded}"
