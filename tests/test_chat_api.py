"""The chat API's request side (nanochat/chat_api.py, nanochat/http_guard.py): first parsing alone
(message-order normalisation, refused / ignored / nullable fields, settings validation, Host-header
parsing), then over real HTTP against a ScriptedEngine: what generation receives, 415 for non-JSON
bodies. Server behaviour (streaming, limits, queueing, guards): tests/test_chat_web.py."""

import json
from types import SimpleNamespace

import pytest
from conftest import require_module

from nanochat.chat_api import ApiError, ServerSettings, parse_chat_request
from nanochat.http_guard import host_of

SETTINGS = ServerSettings().validate()


def parse(**body):
    return parse_chat_request(body, SETTINGS)


def refused(body, settings=SETTINGS) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_chat_request(body, settings)
    assert e.value.status == 400
    return e.value


def m(role, content):
    return {"role": role, "content": content}


def test_messages_are_normalised():
    got = parse(messages=[m("assistant", "Hello! Ask me anything."), m("developer", "Be terse."), m("user", "a"),
                          m("user", [{"type": "text", "text": "b"}]), m("system", "No jokes."),
                          m("assistant", "x"), m("assistant", "y"), m("user", "z")]).messages
    assert got == [m("system", "Be terse.\n\nNo jokes."), m("user", ""), m("assistant", "Hello! Ask me anything."),
                   m("user", "a\n\nb"), m("assistant", "x\n\ny"), m("user", "z")]
    canonical = [m("system", "s"), m("user", "u"), m("assistant", "a"), m("user", "v")]
    assert parse(messages=canonical).messages == canonical   # already canonical: untouched
    assert parse(messages=[m("user", "only")]).messages == [m("user", "only")]


def test_message_errors_name_the_problem():
    e = refused({"messages": [m("user", "q"), m("assistant", "a")]})
    assert e.param == "messages" and "last message is from the assistant" in e.message
    e = refused({"messages": [m("system", "s"), m("assistant", "a")]})
    assert e.param == "messages" and "no user message" in e.message
    # the limits count what the client sent, before merging
    small = ServerSettings(max_messages=3, max_message_chars=5).validate()
    assert refused({"messages": [m("user", "x")] * 4}, small).code == "too_many_messages"
    e = refused({"messages": [m("user", "1234"), m("user", "5678"), m("user", "123456")]}, small)
    assert e.code == "message_too_long" and e.param == "messages[2].content"
    assert parse_chat_request({"messages": [m("user", "1234"), m("user", "5678")]}, small).messages == \
        [m("user", "1234\n\n5678")]   # merged text may exceed the per-message limit: each part did not


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": True}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"functions": [{"name": "f"}], "function_call": "auto"}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"), ({"function_call": "required"}, "function_call"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"response_format": "json"}, "response_format"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"), ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"), ({"web_search_options": {}}, "web_search_options"),
])
def test_unsupported_fields_are_refused(extra, param):
    e = refused({"messages": [m("user", "q")], **extra})
    assert e.param == param and e.code == "unsupported_parameter"


def test_nullable_and_mapped_fields():
    q = [m("user", "q")]
    req = parse(messages=q, stream=None, logprobs=None, top_logprobs=None, tools=[], tool_choice=None,
                response_format=None, stream_options=None, n=None, temperature=None, seed=None)
    assert req.stream is False and req.n == 1 and req.temperature == SETTINGS.default_temperature and req.seed is None
    assert parse(messages=q, max_completion_tokens=None, max_tokens=3).max_tokens == 3
    assert parse(messages=q, max_completion_tokens=4, max_tokens=3).max_tokens == 4
    assert refused({"messages": q, "max_completion_tokens": 10**6}).param == "max_completion_tokens"
    req = parse(messages=q, top_p=0, temperature=1.2)
    assert req.temperature == 0.0 and req.top_p is None          # top_p 0 = greedy
    assert parse(messages=q, seed=-3).seed == 2**64 - 3 and parse(messages=q, seed=-2**63).seed == 2**63
    assert parse(messages=q, stream=True, stream_options={"include_usage": True}).include_usage
    assert refused({"messages": q, "stream": False, "stream_options": {}}).param == "stream_options"
    for bad in ([], 0, False, "", {"include_usage": "yes"}):   # falsy or malformed: not "no options"
        assert refused({"messages": q, "stream": True, "stream_options": bad}).param == "stream_options", bad
    assert not parse(messages=q, stream=True, stream_options={}).include_usage
    for name in ("presence_penalty", "frequency_penalty"):
        assert parse(messages=q, **{name: 0}).messages == q        # 0: what the sampler does (no penalty)
        assert refused({"messages": q, name: 2}).code == "unsupported_parameter"   # not silently ignored
        e = refused({"messages": q, name: -2.01})
        assert e.param == name and e.code == "invalid_value"
        assert refused({"messages": q, name: True}).param == name


def test_stop_must_be_a_string_or_a_list():
    q = [m("user", "q")]
    assert parse(messages=q, stop=None).stop == () and parse(messages=q, stop=[]).stop == ()
    assert parse(messages=q, stop="x").stop == ("x",) and parse(messages=q, function_call="auto").stop == ()
    for bad in ({}, 0, False, {"a": 1}, 5):      # not "no stop sequences": a client bug, said so
        assert refused({"messages": q, "stop": bad}).param == "stop", bad


@pytest.mark.parametrize("fields, flag", [
    ({"default_max_tokens": 0}, "--max-tokens"), ({"max_temperature": -1.0}, "--max-temperature"),
    ({"max_temperature": float("nan")}, "--max-temperature"), ({"max_temperature": float("inf")}, "--max-temperature"),
    ({"max_temperature": 0.5}, "--max-temperature"),
    ({"max_top_k": 10}, "--max-top-k"), ({"max_max_tokens": 100}, "--max-max-tokens"),
])
def test_settings_errors_name_the_flag_that_was_given(fields, flag):
    """chat_web's flags: -m/--max-tokens sets default_max_tokens (there is no --default-max-tokens),
    and a limit below the default it bounds names the limit's flag too."""
    with pytest.raises(ValueError, match=flag):
        ServerSettings(**fields).validate()


def test_settings_validation():
    assert ServerSettings().max_concurrent_per_client is None    # resolved by create_app from the pool
    with pytest.raises(ValueError, match="--max-concurrent-per-client"):
        ServerSettings(max_concurrent_per_client=0).validate()
    ok = ServerSettings(allowed_hosts=("localhost", "::1", "[::1]", "chat.example.com", "10.0.0.2"),
                        cors_origins=("http://localhost:3000", "https://app.example.com", "http://[::1]:8080"))
    assert ok.validate() is ok
    for bad in ("a b", "", "http://x", "x/y"):
        with pytest.raises(ValueError, match="--allowed-host"):
            ServerSettings(allowed_hosts=(bad,)).validate()
    for bad in ("*", "localhost:3000", "http://x.example/", "ftp://x.example", "http://x.example/path"):
        with pytest.raises(ValueError, match="--cors-origin"):
            ServerSettings(cors_origins=(bad,)).validate()


def test_api_error_types_follow_openai():
    assert ApiError(401, "k").body()["error"]["type"] == "invalid_request_error"
    assert ApiError(404, "m").body()["error"]["type"] == "invalid_request_error"
    assert ApiError(429, "r").body()["error"]["type"] == "rate_limit_error"
    assert ApiError(503, "b").body()["error"]["type"] == "server_error"


@pytest.mark.parametrize("header, host", [
    ("localhost:8000", "localhost"), ("LOCALHOST", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("::1", "::1"), ("127.0.0.1:80", "127.0.0.1"), ("localhost.", "localhost"), ("evil.example:8000", "evil.example"),
    ("", ""), ("[::1", "[::1"),
    ("127.0.0.1:18438@evil.com", "127.0.0.1:18438@evil.com"), ("[::1]x", "[::1]x"), ("localhost:", "localhost:"),
])
def test_host_of(header, host):
    assert host_of(header) == host


# ------------------------------------------------------------------------------------ over HTTP

@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from test_engine import tiny_chat_model

    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_chat_web's


@pytest.fixture(scope="module")
def srv(chat_model):
    """One live server for this section: srv.post(**httpx_kwargs) posts a chat completion;
    srv.engine.calls (a ScriptedEngine's) show what generation received."""
    httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread
    from test_chat_web import ScriptedEngine

    engine = ScriptedEngine(chat_model[1], "ok")
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings()))
    yield SimpleNamespace(engine=engine, url=url, post=lambda **kw: httpx.post(url + "/v1/chat/completions", **kw))
    server.should_exit = True
    server.thread.join(timeout=10)


USER = [m("user", "Hello there")]


def assert_error(r, status, param="unset", code="unset"):
    from test_chat_web import assert_error as check

    return check(r, status, param, code)


@pytest.mark.parametrize("messages, canonical", [
    ([m("user", "first"), m("system", "Be brief."), m("user", "second")],
     [m("system", "Be brief."), m("user", "first\n\nsecond")]),
    ([m("developer", "Be kind."), m("assistant", "Hi! How can I help?"), m("user", "Tell me a joke")],
     [m("system", "Be kind."), m("user", ""), m("assistant", "Hi! How can I help?"), m("user", "Tell me a joke")]),
    ([m("system", "one"), m("user", "a"), m("user", "b"), m("assistant", "c"), m("assistant", "d"), m("system", "two"),
      m("user", "e")], [m("system", "one\n\ntwo"), m("user", "a\n\nb"), m("assistant", "c\n\nd"), m("user", "e")]),
    ([m("assistant", "Welcome!"), m("user", "thanks"), m("user", "so?")],
     [m("user", ""), m("assistant", "Welcome!"), m("user", "thanks\n\nso?")]),
])
def test_message_order_is_normalised(srv, chat_model, messages, canonical):
    """Any order OpenAI accepts is answered; the model sees the prompt of the equivalent canonical
    conversation (one leading system message, then user/assistant alternating from the user)."""
    engine = srv.engine
    r = srv.post(json={"messages": messages})
    assert r.status_code == 200, r.text
    assert engine.calls[-1]["prompt"] == chat_model[1].render_for_completion({"messages": canonical})
    assert srv.post(json={"messages": canonical}).status_code == 200
    assert engine.calls[-1]["prompt"] == engine.calls[-2]["prompt"]


def test_streamed_tool_calls_in_history_render_as_the_model_wrote_them(srv, chat_model):
    """A reply with a calculator call streams as "<<12*3=36>>"; sent back as history it must render
    as the tokens the model generated (python / python_output parts, as SFT trained), not as the
    literal text. A refused or cut-off call, or text that only looks like one, stays text."""
    from nanochat.chat_api import tool_call_parts
    from nanochat.engine import TOOL_TEXT
    from nanochat.text_stream import TextStream
    from nanochat.tokenizer import assistant_parts

    tok = chat_model[1]
    sp = tok.encode_special
    generated = (tok.encode("12 boxes of 3 is ") + [sp("<|python_start|>")] + tok.encode("12*3")
                 + [sp("<|python_end|>"), sp("<|output_start|>")] + tok.encode("36") + [sp("<|output_end|>")]
                 + tok.encode(" apples, and <<a=b>> 1<<2 >> 3."))
    stream = TextStream(tok, (), {sp(k): v for k, v in TOOL_TEXT.items()})
    shown = "".join(stream.feed(t) for t in generated) + stream.finish()   # what the server streams
    assert shown == "12 boxes of 3 is <<12*3=36>> apples, and <<a=b>> 1<<2 >> 3."
    history = [m("user", "How many?"), m("assistant", shown), m("user", "Sure?")]
    assert srv.post(json={"messages": history}).status_code == 200
    want = tok.render_for_completion({"messages": [history[0], m("assistant", assistant_parts(tok, generated)),
                                                   history[2]]})
    assert srv.engine.calls[-1]["prompt"] == want
    for text in ("no calls here", "<<2+2=5>> wrong result", "<<12*3=", "<<=4>>", "<<x=1>>"):
        assert tool_call_parts(text) == text
    assert tool_call_parts('<<"a=b".count("=")=1>>!') == [{"type": "python", "text": '"a=b".count("=")'},
                                                         {"type": "python_output", "text": "1"},
                                                         {"type": "text", "text": "!"}]


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ({"tools": [TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [TOOL["function"]]}, "functions"),
    ({"functions": [TOOL["function"]], "function_call": {"name": "get_weather"}}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"logit_bias": {"3": -100}}, "logit_bias"),
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"web_search_options": {"search_context_size": "low"}}, "web_search_options"),
])
def test_unsupported_parameters_are_refused(srv, extra, param):
    engine = srv.engine
    before = len(engine.calls)
    r = srv.post(json={"messages": USER, **extra})
    err = assert_error(r, 400, param, "unsupported_parameter")
    assert param in err["message"] and len(engine.calls) == before


def test_harmless_parameters_are_ignored(srv):
    """Fields that do not change what the answer means are accepted (and have no effect); penalties
    only at 0, unknown fields only as null (tests/test_api_review2.py: otherwise refused)."""
    engine = srv.engine
    ignored = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True,
               "service_tier": "auto", "logprobs": False, "top_logprobs": None, "tools": [TOOL], "tool_choice": "none",
               "functions": [TOOL["function"]], "function_call": "none", "response_format": {"type": "text"},
               "presence_penalty": 0, "frequency_penalty": 0.0, "an_unknown_field": None, "logit_bias": {},
               "modalities": ["text"], "audio": None, "web_search_options": None, "reasoning_effort": "low",
               "prediction": {"type": "content", "content": "ok"}}
    plain = srv.post(json={"messages": USER, "seed": 4})
    r = srv.post(json={"messages": USER, "seed": 4, **ignored})
    assert r.status_code == 200, r.text
    assert r.json()["choices"] == plain.json()["choices"]
    assert engine.calls[-1] == engine.calls[-2]


def test_sampling_fields_reach_the_engine(srv):
    engine = srv.engine

    def sent(**extra):
        r = srv.post(json={"messages": USER, **extra})
        assert r.status_code == 200, r.text
        return engine.calls[-1]
    assert sent(max_completion_tokens=None, max_tokens=3)["max_tokens"] == 3     # null defers to max_tokens
    assert sent(max_completion_tokens=2, max_tokens=3)["max_tokens"] == 2
    greedy = sent(top_p=0, temperature=0.9)                                      # OpenAI's range is [0, 1]
    assert greedy["temperature"] == 0 and greedy["top_p"] is None
    assert sent(top_p=0.5)["top_p"] == 0.5
    assert sent(seed=-1)["seed"] == 2**64 - 1 and sent(seed=-2**63)["seed"] == 2**63  # any int64, one-to-one
    assert sent(seed=2**63 - 1)["seed"] == 2**63 - 1 and sent(seed=7)["seed"] == 7
    r = srv.post(json={"messages": USER, "stream": None})  # nullable: false
    assert r.headers["content-type"].startswith("application/json") and r.json()["object"] == "chat.completion"


@pytest.mark.parametrize("ctype", ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                   "multipart/form-data; boundary=x"])
def test_non_json_content_type_is_415(srv, ctype):
    """The types a cross-site page can POST without a CORS preflight are refused before any work."""
    body, before = json.dumps({"messages": USER}).encode(), len(srv.engine.calls)
    r = srv.post(content=body, headers={"Content-Type": ctype})
    err = assert_error(r, 415, code="unsupported_media_type")
    assert "Content-Type: application/json" in err["message"] and len(srv.engine.calls) == before


def test_head_probes_of_health_and_page(srv):
    """Uptime monitors and `curl -I` probe with HEAD: 200 with the GET's headers, no body."""
    httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
    for path in ("/health", "/"):
        r, get = httpx.head(srv.url + path), httpx.get(srv.url + path)
        assert r.status_code == 200 and r.content == b"" and r.headers["content-type"] == get.headers["content-type"]


def test_json_content_type_variants_accepted(srv):
    body = json.dumps({"messages": USER}).encode()
    for headers in ({"Content-Type": "application/json; charset=utf-8"}, {"Content-Type": "Application/JSON"}, {}):
        r = srv.post(content=body, headers=headers)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", headers
    assert "content-type" not in r.request.headers   # the last one really sent none (minimal clients)


# ------------------------------------------------------------------------------------ stream framing

def stream_lines(tokenizer, text, **body) -> list[str]:
    """The non-empty lines of a streamed answer whose model replies `text` (str or list, as
    ScriptedEngine), read as line-based clients do (httpx's iter_lines)."""
    httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread
    from test_chat_web import ScriptedEngine

    server, url = serve_in_thread(create_app(WorkerPool([Worker(ScriptedEngine(tokenizer, text), "w0")])))
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True, **body}) as r:
            return [ln for ln in r.iter_lines() if ln]
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)


def test_stream_lines_survive_line_based_clients(chat_model):
    """U+2028/U+2029/U+0085 in a reply: str.splitlines (httpx's iter_lines, requests' decode_unicode)
    breaks lines there, so a raw one in a `data:` line cut its JSON in two; escaped, every line parses."""
    text = "a\u2028b\x85c\u2029d"
    lines = stream_lines(chat_model[1], text)
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: {") for ln in lines[:-1]), lines
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text


def test_stream_n_sends_one_choice_per_chunk(chat_model):
    """As OpenAI streams n > 1: each chunk carries one choice, so a client reading
    `chunk.choices[0]` (and its index) gets every choice's text and finish."""
    texts = ["Short.", "A longer answer."]
    lines = stream_lines(chat_model[1], texts, n=2, stream_options={"include_usage": True})
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert all(len(e["choices"]) == 1 for e in events[:-1]) and events[-1]["choices"] == []
    got, finish = ["", ""], [None, None]
    for e in events[:-1]:
        c = e["choices"][0]
        got[c["index"]] += c["delta"].get("content") or ""
        finish[c["index"]] = c["finish_reason"] or finish[c["index"]]
    assert got == texts and finish == ["stop", "stop"]
    assert [e["choices"][0]["delta"].get("role") for e in events[:2]] == ["assistant", "assistant"]


def test_server_url_brackets_an_ipv6_bind_host():
    from nanochat.http_guard import server_url
    assert server_url("127.0.0.1", 8000) == "http://127.0.0.1:8000"
    assert server_url("::1", 8000) == "http://[::1]:8000" and server_url("::", 80) == "http://[::]:80"
    assert server_url("localhost", 9) == "http://localhost:9"


def test_an_unexpected_error_is_a_json_500_that_a_cors_page_can_read(chat_model):
    """Starlette answers an Exception handler's 500 outside the CORS middleware: a listed page got it
    without Access-Control-Allow-Origin (a network error in the browser, not the error JSON)."""
    from fastapi.testclient import TestClient
    from test_chat_web import ScriptedEngine

    from nanochat.server import Worker, WorkerPool, create_app

    class BrokenPool(WorkerPool):
        @property
        def available(self):
            raise RuntimeError("boom")

    origin = "http://app.example:3000"
    app = create_app(BrokenPool([Worker(ScriptedEngine(chat_model[1], "ok"), "w0")]),
                     ServerSettings(cors_origins=(origin,)))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/health", headers={"Origin": origin})
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal error: RuntimeError"
        assert r.headers["access-control-allow-origin"] == origin
        assert client.get("/stats").json()["requests"]["http_500"] == 1


def test_a_burst_of_streams_cannot_overrun_the_queue(chat_model):
    """max_queue: a streaming request took its place in line only once its response had started, so
    a burst of them all passed the `waiting < max_queue` check. Now the place is taken at admission,
    and one left before its response started gives it back (the worker is not lost)."""
    import asyncio
    import threading
    import time

    import httpx
    from test_chat_web import ScriptedEngine

    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread

    engine = ScriptedEngine(chat_model[1], "slow " * 20, delay=0.03)
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w0")]),
                                             ServerSettings(max_queue=1, max_concurrent_per_client=10)))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        busy = threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                                kwargs={"json": body, "timeout": 30})
        busy.start()
        deadline = time.time() + 10
        while httpx.get(url + "/health").json()["available"] != 0 and time.time() < deadline:
            time.sleep(0.01)

        async def burst():
            async with httpx.AsyncClient(timeout=30) as client:
                async def one():
                    async with client.stream("POST", url + "/v1/chat/completions",
                                             json={**body, "stream": True}) as r:
                        text = "".join([chunk async for chunk in r.aiter_text()])
                        return r.status_code, text
                return await asyncio.gather(*[one() for _ in range(5)])
        results = asyncio.run(burst())
        busy.join()
        codes = sorted(code for code, _ in results)
        assert codes == [200, 503, 503, 503, 503], codes
        assert next(text for code, text in results if code == 200).rstrip().endswith("data: [DONE]")
        health = httpx.get(url + "/health").json()
        assert health["available"] == 1 and health["waiting"] == 0   # every place and worker given back
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
