"""Sixth review of the chat server, used over real HTTP as a hostile or unusual client would:
lone UTF-16 surrogates in field names, messages and stop strings, max_tokens beside
max_completion_tokens, a refused CORS preflight (each failed before its fix); plus a guard that
stop strings spanning split characters never leak, and that a run of malformed requests on one
keep-alive connection gets OpenAI-shaped errors and leaves the server serving."""

import json

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.chat_api import ApiError, ServerSettings, parse_chat_request  # noqa: E402
from test_chat_web import USER, ScriptedEngine, assert_error, serve  # noqa: E402,F401  (serve: the fixture)

JSON = {"Content-Type": "application/json"}
ANSWER = "A\U0001F600B ab \u05e9\u05dc\u05d5\u05dd \U0001F469\u200d\U0001F467 end"   # emoji, RTL, ZWJ


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from test_engine import tiny_chat_model

    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_chat_web's


@pytest.fixture
def url(serve, chat_model):   # noqa: F811
    return serve(ScriptedEngine(chat_model[1], ANSWER))


def post_raw(url: str, body: bytes, **kw) -> httpx.Response:
    """A body as bytes: JSON escapes such as a lone "\\ud800" that json.dumps would not write."""
    return httpx.post(url + "/v1/chat/completions", content=body, headers=JSON, timeout=30, **kw)


# ------------------------------------------------------------------ lone surrogates

def test_an_unknown_field_named_with_a_lone_surrogate_is_a_400_not_a_500(url):
    """The unknown_parameter error carries the field's name as `param`; JSON "\\udc00" parses to a
    lone surrogate, which the JSON response could not encode: a 500 UnicodeEncodeError."""
    r = post_raw(url, b'{"messages": [{"role": "user", "content": "hi"}], "\\udc00x": 1}')
    err = assert_error(r, 400, code="unknown_parameter")
    assert err["param"] == "\\udc00x"   # the escape, readable
    assert httpx.post(url + "/v1/chat/completions", json={"messages": USER}).status_code == 200


@pytest.mark.parametrize("body, param", [
    (b'{"messages": [{"role": "user", "content": "hi \\ud83d there"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", '
     b'"text": "x\\ude00"}]}]}', "messages[1].content"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\ud83d"]}', "stop[1]"),
])
def test_a_lone_surrogate_in_text_is_refused_by_field(url, body, param):
    """A lone surrogate is no character: the prompt was silently tokenized with U+FFFD in its place
    (the tokenizer leaves refusing it to the boundaries that take user text), and a stop string
    holding one can never match UTF-8 model text, so the reply ran on unstopped."""
    err = assert_error(post_raw(url, body), 400, param=param, code="invalid_value")
    assert "surrogate" in err["message"] and "accepted" in err["message"]


def test_a_surrogate_pair_escape_is_one_character_and_stops_the_stream(url):
    """The same escapes as a whole pair are the emoji: accepted, and as a stop string they cut the
    streamed and the plain answer alike, before the emoji's first byte."""
    body = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "stop": "\\ud83d\\ude00B"}'
    plain = post_raw(url, body).json()["choices"][0]
    assert plain == {"index": 0, "message": {"role": "assistant", "content": "A"}, "logprobs": None,
                     "finish_reason": "stop"}
    streamed = post_raw(url, body[:-1] + b', "stream": true}').text
    assert "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content", "")
                   for ln in streamed.split("\n") if ln.startswith("data: {")) == "A"


# ------------------------------------------------------------------ max_tokens

@pytest.mark.parametrize("legacy", [0, "lots", 10**6, 2.5])
def test_max_tokens_is_checked_beside_max_completion_tokens(url, legacy):
    """max_completion_tokens wins, but a bad max_tokens next to it was accepted unread: the client's
    bug went unreported (the same value alone is a 400)."""
    s = ServerSettings()
    with pytest.raises(ApiError) as e:
        parse_chat_request({"messages": USER, "max_completion_tokens": 5, "max_tokens": legacy}, s)
    code = "invalid_type" if legacy in ("lots", 2.5) else "invalid_value"   # a wrong JSON type, or out of range
    assert e.value.param == "max_tokens" and e.value.code == code
    assert parse_chat_request({"messages": USER, "max_completion_tokens": 5, "max_tokens": 9}, s).max_tokens == 5
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_completion_tokens": 5,
                                                        "max_tokens": legacy})
    assert_error(r, 400, param="max_tokens", code=code)


# ------------------------------------------------------------------ CORS preflight

@pytest.mark.parametrize("origin, method, refused", [("http://evil.example", "POST", "origin"),
                                                     ("http://localhost:3000", "DELETE", "method")])
def test_a_refused_cors_preflight_is_openai_json(serve, chat_model, origin, method, refused):  # noqa: F811
    """Starlette answered a refused preflight with text/plain "Disallowed CORS origin": the one 4xx
    of this server that was not OpenAI's JSON error shape. An allowed one is unchanged."""
    url = serve(ScriptedEngine(chat_model[1], "ok"), cors_origins=("http://localhost:3000",))
    r = httpx.options(url + "/v1/chat/completions",
                      headers={"Origin": origin, "Access-Control-Request-Method": method})
    err = assert_error(r, 400, code="cors_preflight_refused")
    assert r.headers["content-type"] == "application/json"
    # only a listed origin's page may read the refusal (a refused method: it learns which are allowed)
    assert r.headers.get("access-control-allow-origin") == (None if refused == "origin" else origin)
    assert f"({refused})" in err["message"] and "http://localhost:3000" in err["message"]
    ok = httpx.options(url + "/v1/chat/completions",
                       headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"


# ------------------------------------------------------------------ guards that held

@pytest.mark.parametrize("stop", ["\U0001F600", "\U0001F600B", "B a", "\u200d\U0001F467", "\u05dc\u05d5", "end"])
def test_stop_strings_across_split_characters_never_leak(url, stop):
    """Each emoji / Hebrew letter is several byte tokens of the tiny vocabulary: no delta may hold
    part of the stop text, and the stream equals the plain answer."""
    expected = ANSWER[:ANSWER.index(stop)]
    with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stop": stop, "stream": True},
                      timeout=30) as r:
        deltas = [json.loads(ln[6:])["choices"] for ln in r.iter_lines() if ln.startswith("data: {")]
    text = [c[0]["delta"].get("content", "") for c in deltas]
    assert "".join(text) == expected and [c[0]["finish_reason"] for c in deltas][-1] == "stop"
    assert "\ufffd" not in "".join(text)
    plain = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "stop": [stop]}).json()
    assert plain["choices"][0]["message"]["content"] == expected


def test_hostile_requests_on_one_connection_then_it_still_serves(serve, chat_model):  # noqa: F811
    """Malformed, wrongly typed, oversized and unknown requests on one keep-alive connection: each
    an OpenAI-shaped 4xx, and the connection and server answer the next request normally."""
    url = serve(ScriptedEngine(chat_model[1], ANSWER), max_body_bytes=4000)
    hostile = [
        (dict(content=b"{bad", headers=JSON), 400, "invalid_json"),
        (dict(content=b"[" * 500 + b"]" * 500, headers=JSON), 400, "invalid_type"),
        (dict(content=b'{"messages": []}', headers={"Content-Type": "text/plain"}), 415, "unsupported_media_type"),
        (dict(content=b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', headers=JSON),
         400, "invalid_value"),
        (dict(json={"messages": USER, "max_token": 5}), 400, "unknown_parameter"),
        (dict(json={"messages": USER, "n": 2, "top_k": -1}), 400, "invalid_value"),
        (dict(content=iter([b'{"messages": "', b"x" * 4000, b'"}']), headers=JSON), 413, "body_too_large"),
    ]
    with httpx.Client(base_url=url, timeout=30) as client:
        for kwargs, status, code in hostile:
            assert_error(client.post("/v1/chat/completions", **kwargs), status, code=code)
            r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "n": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert httpx.get(url + "/health").json()["available"] == 1


def test_a_trailing_slash_is_a_json_404_naming_the_endpoints_not_a_redirect(chat_model):
    """POST /v1/chat/completions/ got a 307 whose Location was an absolute URL built from the Host
    header, wrong behind a reverse proxy; now the JSON 404 that names the served endpoints."""
    from fastapi.testclient import TestClient

    from nanochat.server import Worker, WorkerPool, create_app

    app = create_app(WorkerPool([Worker(ScriptedEngine(chat_model[1], "ok"), "w0")]), ServerSettings())
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions/", json={"messages": USER}, follow_redirects=False)
        assert r.status_code == 404, r.headers
        assert "POST /v1/chat/completions" in r.json()["error"]["message"] and "location" not in r.headers
        assert client.post("/v1/chat/completions", json={"messages": USER}).status_code == 200
