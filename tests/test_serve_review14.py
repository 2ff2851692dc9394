"""chat_web's server as a demanding client uses it, over real sockets against uvicorn serving the
tiny CPU model: a request head (request line + headers) past http_guard.MAX_HEADER_BYTES is a JSON
431 whatever way it arrives, and the server keeps serving; a big Cookie header, a big body and a
body left unread by an early answer are not mistaken for one; a request the parser cannot read is
a JSON 400, not uvicorn's plain text."""

import socket

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.engine import Engine  # noqa: E402
from nanochat.http_guard import MAX_HEADER_BYTES, guarded_protocol  # noqa: E402
from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread  # noqa: E402
from test_chat_web import USER, assert_error  # noqa: E402
from test_engine import tiny_chat_model  # noqa: E402
from test_security_review13 import read_until_closed, status_of  # noqa: E402

KEY = "secretkey123"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"messages": USER, "max_tokens": 3}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


@pytest.fixture(scope="module")
def url(chat_model):
    model, tokenizer = chat_model
    app = create_app(WorkerPool([Worker(Engine(model, tokenizer), "cpu")]),
                     ServerSettings(model_name="tiny", api_key=KEY))
    server, base = serve_in_thread(app)
    yield base
    server.should_exit = True
    server.thread.join(timeout=10)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def json_of(response: bytes) -> dict:
    import json

    head, _, body = response.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return json.loads(body)


def test_an_oversized_request_head_is_a_json_431_and_the_server_keeps_serving(url):
    """uvicorn left h11's buffer limit at 256 KiB: a connection could hold a quarter megabyte of
    headers, and past it the client got a reset (httpx: ReadError) where a plain-text 400 was
    meant. Now a head past MAX_HEADER_BYTES is a JSON 431 the client reads, and the next request
    is served."""
    cookie = {"Cookie": "session=" + "x" * 20_000}   # every localhost app's cookies reach every port
    assert httpx.get(url + "/health", headers=cookie).status_code == 200
    r = httpx.get(url + "/health", headers={"X-Big": "a" * 300_000}, timeout=10)
    err = assert_error(r, 431, param=None, code="request_headers_too_large")
    assert str(MAX_HEADER_BYTES) in err["message"] and "cookies" in err["message"]
    assert r.headers["connection"] == "close"
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:   # as the openai package reports it
        client.chat.completions.create(model="m", messages=USER, max_tokens=2,
                                       extra_headers={"X-Trace": "t" * (MAX_HEADER_BYTES + 1)})
    assert caught.value.status_code == 431 and caught.value.code == "request_headers_too_large"
    # a head that never ends is refused as soon as the limit passes, not when the header timeout ends
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES + 100))
        out, closed = read_until_closed(s, 5)
    assert closed and status_of(out) == 431 and json_of(out)["error"]["code"] == "request_headers_too_large"
    # still serving: the real model answers, streamed and not
    r = httpx.post(url + "/v1/chat/completions", json=BODY, headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    with client.chat.completions.create(model="m", messages=USER, max_tokens=2, stream=True) as stream:
        assert [c for c in stream]


def test_a_big_head_pipelined_behind_a_request_is_a_431_too(url):
    """A head that arrives while the previous request is answered is the parser's to bound (h11's
    limit, set to MAX_HEADER_BYTES): before, 100 KB of it waited for the header timeout's 408."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    if AutoHTTPProtocol.__name__ != "H11Protocol":   # uvicorn[standard]: httptools, whose limit is fixed
        pytest.skip("uvicorn parses with httptools here, which has no buffer limit to set")
    first = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    second = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as s:
        s.sendall(first + second)
        out, closed = read_until_closed(s, 5)
    assert closed and out.startswith(b"HTTP/1.1 200 ")
    refusal = out[out.index(b"HTTP/1.1 431 "):]
    assert json_of(refusal)["error"]["code"] == "request_headers_too_large"


def test_a_big_head_sent_during_a_stream_is_refused_after_it(chat_model):
    """A head that grows past the limit while the previous answer streams is refused once that
    answer ends: answers go in the order of their requests, so a 431 written first would read as
    the stream's answer."""
    import json
    import threading
    import time

    from test_chat_web import ScriptedEngine

    gate = threading.Event()
    app = create_app(WorkerPool([Worker(ScriptedEngine(chat_model[1], "held answer", gate=gate), "w")]))
    server, base = serve_in_thread(app)
    try:
        body = json.dumps({**BODY, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", port_of(base)), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.2)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            for _ in range(2 * MAX_HEADER_BYTES // 1000):
                s.sendall(b"a" * 1000)
            threading.Timer(0.5, gate.set).start()
            out, closed = read_until_closed(s, 5)
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
    assert closed and out.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in out
    refusal = out[out.index(b"HTTP/1.1 431 "):]
    assert out.index(b"data: [DONE]") < out.index(b"HTTP/1.1 431 ")
    assert json_of(refusal)["error"]["code"] == "request_headers_too_large"


def test_bodies_are_not_counted_as_headers(url):
    """Only the head counts: a 600 KB body (here JSON whitespace) is served, and so is the next
    request on a connection whose big body arrived after an early 401 had already answered it."""
    raw = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2' + b" " * 600_000 + b"}"
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(2):
            r = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
            assert_error(r, 401, code="invalid_api_key")
            r = client.get("/health", headers={"Cookie": "session=" + "x" * 20_000})
            assert r.status_code == 200 and r.json()["status"] == "ok"


def test_a_request_the_parser_cannot_read_is_a_json_400(url):
    """uvicorn answered a malformed request line or header in text/plain; every error of this
    server is OpenAI-shaped."""
    for bad in (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nNo colon here\r\n\r\n",
                b"GET /he alth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as s:
            s.sendall(bad)
            out, closed = read_until_closed(s, 5)
        assert closed and status_of(out) == 400
        err = json_of(out)["error"]
        assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error"
    assert httpx.get(url + "/health").status_code == 200


def test_both_servers_run_with_the_head_limit(chat_model, monkeypatch):
    """run_server (chat_web's) and serve_in_thread take uvicorn's options from one place: the
    guarded protocol counting heads, and h11's own buffer limit as its backstop."""
    import uvicorn

    from nanochat import serve_lifecycle

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.update(kw))
    model, tokenizer = chat_model
    app = create_app(WorkerPool([Worker(Engine(model, tokenizer), "cpu")]), ServerSettings())
    serve_lifecycle.run_server(app, "127.0.0.1", 1)
    assert seen["h11_max_incomplete_event_size"] == MAX_HEADER_BYTES == seen["http"].max_header_bytes
    assert seen["ws"] == "none" and seen["http"].max_connections_per_client == 256
    from scripts import chat_web

    assert f"at most {MAX_HEADER_BYTES // 1024} KiB" in chat_web.__doc__   # the operator's docs say the code's value
    for bad in (0, 100, True, 2.5e4):
        with pytest.raises(ValueError, match="max_header_bytes"):
            guarded_protocol(max_header_bytes=bad)


# ------------------------------------------------------------------------------------ OpenAI's features

def test_what_an_openai_client_sends_works_as_openai_specifies(url):
    """The current Chat Completions features, through the openai package against the real model:
    the final usage chunk, seeds, max_completion_tokens, n > 1 streamed, stop as a string or a
    list, content as text parts, developer and system messages, and the hints without effect."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)

    def ask(**kw):
        return client.chat.completions.create(model="m", **{"messages": USER, "max_tokens": 6, **kw})
    chunks = list(ask(n=2, stream=True, stream_options={"include_usage": True}, seed=5))
    *deltas, last = chunks
    assert last.choices == [] and all(c.usage is None for c in deltas)   # usage: only on the extra last chunk
    assert 2 <= last.usage.completion_tokens <= 12   # both choices' tokens (n=2, 6 at most each)
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in deltas if c.choices[0].finish_reason}
    assert set(finishes) == {0, 1}
    streamed = ["".join(c.choices[0].delta.content or "" for c in deltas if c.choices[0].index == i) for i in (0, 1)]
    plain = ask(n=2, seed=5)
    assert [c.message.content for c in plain.choices] == streamed   # the seed: the same samples, streamed or not
    assert plain.usage.completion_tokens == last.usage.completion_tokens
    short = ask(max_tokens=openai.NOT_GIVEN, max_completion_tokens=2, temperature=0)
    assert short.usage.completion_tokens <= 2
    greedy = ask(temperature=0, max_tokens=12).choices[0].message.content
    cut = next(i for i in range(1, len(greedy)) if greedy[i].strip())   # a visible character after the first
    for stop in (greedy[cut], [greedy[cut], "\u2603"]):
        (choice,) = ask(temperature=0, max_tokens=12, stop=stop).choices
        assert choice.finish_reason == "stop" and greedy.startswith(choice.message.content)
        assert greedy[cut] not in choice.message.content
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    assert ask(messages=parts, temperature=0, max_tokens=12).choices[0].message.content == greedy
    system = ask(messages=[{"role": "system", "content": "Be brief."}, *USER], temperature=0)
    developer = ask(messages=[{"role": "developer", "content": "Be brief."}, *USER], temperature=0)
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens > short.usage.prompt_tokens
    assert developer.choices[0].message.content == system.choices[0].message.content
    hinted = ask(temperature=0, max_tokens=12, user="u-1", metadata={"trace": "x"}, logprobs=False,
                 response_format={"type": "text"}, presence_penalty=0, frequency_penalty=0.0, tools=TOOLS,
                 tool_choice="none")
    assert hinted.choices[0].message.content == greedy   # asking for nothing this server lacks: no effect


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": True}, "logprobs"), ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"tools": TOOLS}, "tools"), ({"tools": TOOLS, "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"), ({"logit_bias": {"5": -100}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_what_the_server_cannot_do_is_refused_naming_what_is_accepted(url, extra, param):
    """Refusals named the field but not always what it accepts ("leave 'tools' out"): a client
    that sends tools by default could not tell that tool_choice "none" passes."""
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="m", messages=USER, max_tokens=2, **extra)
    e = caught.value
    assert e.param == param and f"'{param}'" in e.body["message"] and "accepted: " in e.body["message"]


class _Transport:
    def __init__(self):
        self.written, self.closed, self.eof = b"", False, False

    def write(self, data):
        self.written += data

    def write_eof(self):
        self.eof = True

    def can_write_eof(self):
        return True

    def close(self):
        self.closed = True

    def is_closing(self):
        return self.closed


class _Cycle:
    def __init__(self, started=False, complete=False):
        self.response_started, self.response_complete, self.disconnected = started, complete, False
        self.more_body = False


def _bare_protocol(monkeypatch, cycle):
    """A guarded protocol object without a server: only the state _refuse / on_response_complete use."""
    cls = guarded_protocol()
    proto = object.__new__(cls)
    proto.cycle, proto.transport = cycle, _Transport()
    proto.flow = type("Flow", (), {"resume_reading": lambda self: None, "pause_reading": lambda self: None})()
    proto.loop = type("Loop", (), {"call_later": lambda self, *a: None})()
    monkeypatch.setattr(cls, "_unset_keepalive_if_required", lambda self: None, raising=False)
    return cls, proto


def test_a_refusal_during_an_answer_never_writes_into_it(monkeypatch):
    """An error while a request's answer is half sent (a parser error of its body) wrote the JSON error
    into the middle of that answer, and the app's next write hit 'write() after write_eof()'. Now the
    request is marked disconnected (its writes are dropped) and the connection just closes."""
    _, proto = _bare_protocol(monkeypatch, _Cycle(started=True))
    proto._refuse(400, "Bad Request", "x", "invalid_http_request")
    assert proto.cycle.disconnected and proto.transport.closed and proto.transport.written == b""
    _, proto = _bare_protocol(monkeypatch, _Cycle(started=False))   # nothing sent yet: the error, then the end
    proto._refuse(400, "Bad Request", "x", "invalid_http_request")
    assert proto.cycle.disconnected and proto.transport.eof and b" 400 " in proto.transport.written


def test_a_deferred_431_waits_for_a_pipelined_request_the_parser_started(monkeypatch):
    """httptools starts the next pipelined request inside on_response_complete: the deferred 431 went
    out ahead of that request's answer. It now waits until no answer is in progress."""
    cls, proto = _bare_protocol(monkeypatch, _Cycle(started=True, complete=True))
    nxt = _Cycle()
    monkeypatch.setattr(cls.__mro__[1], "on_response_complete", lambda self: setattr(self, "cycle", nxt))
    proto._refuse_after = (431, "Request Header Fields Too Large", "too big", "request_headers_too_large")
    proto.on_response_complete()   # the parser started the pipelined request: not yet
    assert proto.transport.written == b"" and not proto._refused
    nxt.response_started = nxt.response_complete = True
    proto.on_response_complete()
    assert b" 431 " in proto.transport.written and proto._refused


def test_a_bad_request_queued_behind_an_answer_is_refused_after_it(monkeypatch):
    """httptools points self.cycle at a queued request B while request A's answer streams (B waits
    in self.pipeline): a parser error after B wrote its 400 into the middle of A's answer. It now
    waits for on_response_complete, as the deferred 431 does."""
    _, proto = _bare_protocol(monkeypatch, _Cycle())   # B: queued, not started
    proto.pipeline = [("B", None)]
    proto.send_400_response("Invalid HTTP request received.")
    assert proto.transport.written == b"" and not proto._refused and proto._refuse_after[0] == 400
    assert proto.pipeline == []   # never started: waiting for a body that will not come, it held the connection


def test_a_bad_request_after_one_being_answered_waits_for_that_answer(monkeypatch):
    """Garbage after request A while A's answer streams (A's body all read) closed the connection in the
    middle of A's answer; now A is answered, then the 400. A parser error in A's own body is A's: now."""
    a = _Cycle(started=True)
    a.more_body = False
    _, proto = _bare_protocol(monkeypatch, a)
    proto.send_400_response("Invalid HTTP request received.")
    assert not proto.transport.closed and not a.disconnected and proto._refuse_after[0] == 400
    own = _Cycle()
    own.more_body = True   # its body is being read: the error is this request's
    _, proto = _bare_protocol(monkeypatch, own)
    proto.send_400_response("Invalid HTTP request received.")
    assert own.disconnected and b" 400 " in proto.transport.written
