"""The chat server over real HTTP (uvicorn on a free 127.0.0.1 port): OpenAI schema, SSE framing,
limits, auth, queueing, per-choice stream finishes, Host and CORS guards; the `openai` package as
a client. The request side (message normalisation, refused / ignored fields, Content-Type):
tests/test_chat_api.py; requests that fail or are cancelled: tests/test_chat_failures.py."""

import json
import re
import threading
import time

import pytest
import torch
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.engine import Engine
from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread
from test_engine import tiny_chat_model

USER = [{"role": "user", "content": "Hello there"}]


class ScriptedEngine:
    """Engine stand-in for server tests: replies with a fixed text (or, given a list, sample k with
    text k mod len), optionally slowly or failing, or holding its first token until `gate` is set
    (a request that stays busy for exactly as long as a test needs, however slow the host). Records
    its calls, how many steps ran and whether its generator was closed (cancellation)."""

    def __init__(self, tokenizer, text: str | list[str], delay: float = 0.0, fail_at: int | None = None,
                 gate: threading.Event | None = None):
        self.tokenizer, self.device, self.max_seq_len = tokenizer, torch.device("cpu"), 256
        self.default_stop_tokens = (tokenizer.encode_special("<|assistant_end|>"), tokenizer.bos_token_id)
        texts = [text] if isinstance(text, str) else text
        self.rows = [tokenizer.encode(t) + [self.default_stop_tokens[0]] for t in texts]
        self.delay, self.fail_at, self.gate = delay, fail_at, gate
        self.steps, self.finished, self.calls = 0, threading.Event(), []

    def generate(self, prompt, *, num_samples=1, max_tokens=256, stop_tokens=None, **kw):
        self.calls.append(dict(prompt=prompt, num_samples=num_samples, max_tokens=max_tokens, **kw))
        self.finished.clear()

        def steps():
            try:
                if self.gate is not None:
                    assert self.gate.wait(timeout=30), "the test never opened the gate"
                for i in range(max_tokens):
                    if i == self.fail_at:
                        raise RuntimeError("scripted failure")
                    time.sleep(self.delay)
                    self.steps += 1
                    rows = [self.rows[k % len(self.rows)] for k in range(num_samples)]
                    yield [ids[min(i, len(ids) - 1)] for ids in rows], [1] * num_samples
            finally:
                self.finished.set()
        return steps()


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


@pytest.fixture
def serve():
    """serve(engine, **settings) -> base URL of a live uvicorn server; all stopped at teardown.
    An argument that is already a Worker (e.g. a batched replica's slots) is served as it is."""
    servers = []

    def start(*engines, **settings):
        workers = [e if isinstance(e, Worker) else Worker(e, name=f"w{i}") for i, e in enumerate(engines)]
        server, url = serve_in_thread(create_app(WorkerPool(workers), ServerSettings(**settings)))
        servers.append(server)
        return url
    yield start
    for server in servers:
        server.should_exit = True
    for server in servers:
        server.thread.join(timeout=10)


@pytest.fixture(scope="module")
def real_url(chat_model):
    model, tokenizer = chat_model
    app = create_app(WorkerPool([Worker(Engine(model, tokenizer), "cpu")]), ServerSettings(model_name="tiny"))
    server, url = serve_in_thread(app)
    yield url
    server.should_exit = True
    server.thread.join(timeout=10)


def sse_lines(url, body, **kw):
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30, **kw) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return r.read().decode().split("\n")


def assert_error(r, status, param="unset", code="unset"):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param != "unset":
        assert err["param"] == param
    if code != "unset":
        assert err["code"] == code
    return err


# ------------------------------------------------------------------------------------ schema

def test_health_models_page(real_url):
    h = httpx.get(real_url + "/health").json()
    assert h["status"] == "ok" and h["workers"] == 1 and h["available"] == 1
    assert h["sampling"] == {"defaults": {"temperature": 0.8, "top_k": 50, "max_tokens": 512},
                             "limits": {"temperature": 2.0, "top_k": 1000, "max_tokens": 4096}}
    models = httpx.get(real_url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    page = httpx.get(real_url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'sha256-" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text)  # nothing external
    assert "innerHTML" not in page.text
    # relative requests: behind a reverse proxy at a sub-path (/chat/ -> /) they stay under it
    assert sorted(re.findall(r'fetch\("([^"]+)"', page.text)) == ["./health", "./v1/chat/completions"]


def test_completion_schema(real_url):
    body = {"model": "whatever", "messages": USER, "max_tokens": 12, "seed": 3, "temperature": 0.9}
    r = httpx.post(real_url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    out = r.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == "tiny"
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
    u = out["usage"]
    assert u["prompt_tokens"] > 3 and 1 <= u["completion_tokens"] <= 12
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    again = httpx.post(real_url + "/v1/chat/completions", json=body, timeout=30).json()
    assert again["choices"][0]["message"] == choice["message"]  # same seed, same answer


def test_sse_framing_matches_non_streaming(real_url):
    body = {"messages": USER, "max_tokens": 16, "seed": 11, "stream": True, "stream_options": {"include_usage": True}}
    lines = sse_lines(real_url, body)
    events = [ln for ln in lines if ln]
    assert all(ln.startswith("data: ") for ln in events)
    assert events[-1] == "data: [DONE]" and lines[-2:] == ["", ""]  # every event ends with a blank line
    chunks = [json.loads(ln[6:]) for ln in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI: null but on the last
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = {k: v for k, v in body.items() if k != "stream_options"}  # only allowed with stream: true
    plain = httpx.post(real_url + "/v1/chat/completions", json={**plain, "stream": None}, timeout=30).json()
    assert text == plain["choices"][0]["message"]["content"]


def test_openai_client(real_url):
    client = openai.OpenAI(base_url=real_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert e.value.body["type"] == "invalid_request_error"
    out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, seed=5, n=2)
    assert len(out.choices) == 2 and out.usage.completion_tokens >= 2
    stream = client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, seed=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    single = client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, seed=5)
    assert text == single.choices[0].message.content
    assert chunks[-1].usage.total_tokens == single.usage.total_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, logprobs=True, top_logprobs=2)
    assert e.value.body["code"] == "unsupported_parameter" and e.value.body["param"] == "logprobs"
    # a negative seed (any int64 is valid for OpenAI) is accepted and is as reproducible as any other
    neg = [client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, seed=-7, temperature=1.0)
           .choices[0].message.content for _ in range(2)]
    assert neg[0] == neg[1]


# ------------------------------------------------------------------------------------ limits

@pytest.fixture(scope="module")
def limits_url(chat_model):
    """One server with small limits for the many 400 rows (a server per row costs ~0.25 s)."""
    app = create_app(WorkerPool([Worker(ScriptedEngine(chat_model[1], "ok"), "w0")]),
                     ServerSettings(max_messages=10, max_message_chars=500, max_total_chars=1000))
    server, url = serve_in_thread(app)
    yield url
    server.should_exit = True
    server.thread.join(timeout=10)


@pytest.mark.parametrize("body, param, code", [
    ({"messages": []}, "messages", "empty_array"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": [{"role": "user", "content": "x"}] * 11}, "messages", "too_many_messages"),
    ({"messages": [{"role": "user", "content": "x" * 501}]}, "messages[0].content", "message_too_long"),
    ({"messages": [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": "y" * 400},
                   {"role": "user", "content": "z" * 400}]}, "messages", "messages_too_long"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    # any order is normalised, but the reply must answer a user message
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages", "missing_required_parameter"),
    ({"messages": USER + [{"role": "assistant", "content": "x"}]}, "messages", "invalid_value"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"messages": USER, "max_tokens": 10_000}, "max_tokens", "invalid_value"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": USER, "temperature": 2.5}, "temperature", "invalid_value"),
    ({"messages": USER, "temperature": "hot"}, "temperature", "invalid_type"),
    ({"messages": USER, "top_p": 1.5}, "top_p", "invalid_value"),
    ({"messages": USER, "max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens", "invalid_value"),
    ({"messages": USER, "max_completion_tokens": None, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"messages": USER, "frequency_penalty": "high"}, "frequency_penalty", "invalid_type"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"messages": USER, "stream": None, "stream_options": {}}, "stream_options", "invalid_value"),
    ({"messages": USER, "top_k": 5000}, "top_k", "invalid_value"),
    ({"messages": USER, "top_k": 1.5}, "top_k", "invalid_type"),
    ({"messages": USER, "n": 9}, "n", "invalid_value"),
    ({"messages": USER, "stream": "yes"}, "stream", "invalid_type"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"messages": USER, "stop": [""]}, "stop[0]", "invalid_value"),   # the item, as messages[i]
    ({"messages": USER, "seed": 2**63}, "seed", "invalid_value"),
    ({"messages": USER, "seed": -2**63 - 1}, "seed", "invalid_value"),
    ([1, 2], None, "invalid_type"),
])
def test_limits_are_400s(limits_url, body, param, code):
    url = limits_url
    err = assert_error(httpx.post(url + "/v1/chat/completions", json=body), 400, param, code)
    assert err["type"] == "invalid_request_error"
    assert httpx.get(url + "/health").json()["available"] == 1  # still serving


def test_body_json_and_context_errors(serve, chat_model):
    url = serve(ScriptedEngine(chat_model[1], "ok"), max_body_bytes=4000)
    assert_error(httpx.post(url + "/v1/chat/completions", content=b"{not json"), 400, code="invalid_json")
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 5000}]}).encode()
    assert_error(httpx.post(url + "/v1/chat/completions", content=big), 413, code="body_too_large")
    chunked = httpx.post(url + "/v1/chat/completions", content=iter([big[:3000], big[3000:]]))  # no Content-Length
    assert_error(chunked, 413, code="body_too_large")
    long_chat = [{"role": "user", "content": "word " * 700}]
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": long_chat}), 400, "messages",
                 "context_length_exceeded")
    assert assert_error(httpx.get(url + "/nope"), 404, code="not_found")["type"] == "invalid_request_error"
    r = httpx.get(url + "/v1/chat/completions")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"  # HTTPException headers pass through
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_api_key(serve, chat_model):
    url = serve(ScriptedEngine(chat_model[1], "secret answer"), api_key="s3cret-key", model_name="m")
    err = assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}), 401, code="invalid_api_key")
    assert err["type"] == "invalid_request_error"   # as OpenAI
    bad = {"Authorization": "Bearer wrong-key"}
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}, headers=bad), 401)
    assert_error(httpx.get(url + "/v1/models"), 401)
    assert_error(httpx.get(url + "/v1/models/m"), 401)
    good = {"Authorization": "Bearer s3cret-key"}
    assert httpx.get(url + "/v1/models/m", headers=good).json()["id"] == "m"
    assert_error(httpx.get(url + "/stats"), 401)
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).chat.completions.create(
            model="m", messages=USER)
    client = openai.OpenAI(base_url=url + "/v1", api_key="s3cret-key", max_retries=0)
    assert client.chat.completions.create(model="m", messages=USER).choices[0].message.content == "secret answer"


def test_stop_strings_and_tool_text(serve, chat_model):
    tok = chat_model[1]
    url = serve(ScriptedEngine(tok, "Hello world. Bye now"))
    out = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "stop": ["world"]}).json()
    assert out["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hello "},
                                 "logprobs": None, "finish_reason": "stop"}
    lines = sse_lines(url, {"messages": USER, "stop": "Bye", "stream": True})
    text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content", "")
                   for ln in lines if ln.startswith("data: {"))
    assert text == "Hello world. "
    out = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------------------------ compatibility

def test_stream_n_finishes_each_choice_when_it_ends(serve, chat_model):
    """n > 1: a choice's finish chunk comes when that choice ends, while the others still stream;
    the non-streaming answer is unchanged."""
    texts = ["Short.", "A much longer answer that keeps going for a while."]
    url = serve(ScriptedEngine(chat_model[1], texts))
    for max_tokens, reasons in ((64, ["stop", "stop"]), (10, ["stop", "length"])):
        body = {"messages": USER, "n": 2, "max_tokens": max_tokens}
        plain = httpx.post(url + "/v1/chat/completions", json=body).json()["choices"]
        assert [c["finish_reason"] for c in plain] == reasons and plain[0]["message"]["content"] == texts[0]
        lines = sse_lines(url, {**body, "stream": True})
        choices = [c for ln in lines if ln.startswith("data: {") for c in json.loads(ln[6:])["choices"]]
        order = [(c["index"], "end" if c["finish_reason"] else "text") for c in choices
                 if c["finish_reason"] or c["delta"].get("content")]
        ends = [(c["index"], c["finish_reason"]) for c in choices if c["finish_reason"]]
        assert ends == [(0, reasons[0]), (1, reasons[1])]          # each exactly once, 0 first
        assert (1, "text") in order[order.index((0, "end")) + 1:]   # 1 was still streaming when 0 ended
        for i in (0, 1):
            streamed = "".join(c["delta"].get("content", "") for c in choices if c["index"] == i)
            assert streamed == plain[i]["message"]["content"]


def test_host_guard(serve, chat_model):
    """DNS rebinding: with allowed_hosts set, a Host header naming anything else is refused on every
    route; the port is ignored and [::1] is understood. Unset (None): any Host is served."""
    engine = ScriptedEngine(chat_model[1], "ok")
    url = serve(engine, allowed_hosts=("localhost", "127.0.0.1", "::1"))
    port = url.rsplit(":", 1)[1]
    with httpx.Client() as client:   # one connection: ~20 requests
        for host in (f"127.0.0.1:{port}", "localhost", "LocalHost:80", "[::1]:8000", "localhost."):
            assert client.get(url + "/health", headers={"Host": host}).status_code == 200, host
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.example", "localhost.evil.example"):
            h = {"Host": host}
            for r in (client.get(url + "/health", headers=h), client.get(url + "/", headers=h),
                      client.post(url + "/v1/chat/completions", json={"messages": USER}, headers=h)):
                err = assert_error(r, 400, code="invalid_host")
                assert "Host header" in err["message"] and host in err["message"]
    assert not engine.calls
    anyhost = serve(engine)
    assert httpx.get(anyhost + "/health", headers={"Host": "evil.example"}).status_code == 200


def test_origin_guard(serve, chat_model):
    """With a Host allow-list, a POST from a page of another origin is refused before any work (a
    Blob-bodied cross-site fetch sends no Content-Type, so require_json alone cannot stop it); pages
    on the allowed hosts, --cors-origin pages and clients that send no Origin (curl, openai) pass."""
    engine = ScriptedEngine(chat_model[1], "ok")
    app_origin = "http://app.example:3000"
    url = serve(engine, allowed_hosts=("localhost", "127.0.0.1", "::1"), cors_origins=(app_origin,))
    port = url.rsplit(":", 1)[1]
    body = json.dumps({"messages": USER}).encode()
    with httpx.Client() as client:
        for origin in ("http://evil.example", "null", f"http://evil.example:{port}", "https://localhost.evil.example",
                       "not a url"):
            r = client.post(url + "/v1/chat/completions", content=body, headers={"Origin": origin})
            err = assert_error(r, 403, code="invalid_origin")
            assert origin in err["message"] and "--cors-origin" in err["message"]
        assert not engine.calls
        assert client.get(url + "/health", headers={"Origin": "http://evil.example"}).status_code == 200
        for headers in ({"Origin": f"http://127.0.0.1:{port}"}, {"Origin": "http://localhost:5173"},
                        {"Origin": "http://[::1]:8000"}, {"Origin": app_origin}, {}):
            r = client.post(url + "/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", headers
    anyhost = serve(engine)   # no allow-list (a network bind): the Origin is not checked either
    r = httpx.post(anyhost + "/v1/chat/completions", json={"messages": USER}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 200


def test_cors_is_opt_in(serve, chat_model):
    origin = "http://app.example:3000"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    engine = ScriptedEngine(chat_model[1], "ok")
    off = serve(engine)
    assert "access-control-allow-origin" not in httpx.options(off + "/v1/chat/completions", headers=preflight).headers
    r = httpx.post(off + "/v1/chat/completions", json={"messages": USER}, headers={"Origin": origin})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    on = serve(engine, cors_origins=(origin,))
    r = httpx.options(on + "/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= set(r.headers["access-control-allow-headers"].lower().split(", "))
    # the openai JS SDK in a browser adds x-stainless-* headers; a public page calling a local server
    # gets a Private Network Access preflight; a 429/503's Retry-After must be readable by the page
    sdk = {**preflight, "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,"
           "x-stainless-retry-count,x-stainless-timeout", "Access-Control-Request-Private-Network": "true"}
    r = httpx.options(on + "/v1/chat/completions", headers=sdk)
    assert r.status_code == 200 and "x-stainless-timeout" in r.headers["access-control-allow-headers"], r.text
    assert r.headers["access-control-allow-private-network"] == "true"
    r = httpx.post(on + "/v1/chat/completions", json={"messages": USER}, headers={"Origin": origin})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    assert "retry-after" in r.headers["access-control-expose-headers"].lower()
    r = httpx.options(on + "/v1/chat/completions", headers={**sdk, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_per_client_limit_defaults_to_the_slots(serve, chat_model):
    engines = [ScriptedEngine(chat_model[1], "ok") for _ in range(6)]
    assert httpx.get(serve(*engines) + "/stats").json()["limits"]["max_concurrent_per_client"] == 6
    assert httpx.get(serve(engines[0]) + "/stats").json()["limits"]["max_concurrent_per_client"] == 4
    explicit = serve(*engines, max_concurrent_per_client=2)
    assert httpx.get(explicit + "/stats").json()["limits"]["max_concurrent_per_client"] == 2


# ------------------------------------------------------------------------------------ concurrency

def wait_until(cond, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_queue_per_client_limit_and_busy(serve, chat_model):
    tok = chat_model[1]
    gate = threading.Event()   # the first request holds the only worker until the 429 is seen
    engine = ScriptedEngine(tok, "slow " * 5, gate=gate)
    url = serve(engine, max_concurrent_per_client=2, max_queue=1)
    results = []

    def call():
        results.append(httpx.post(url + "/v1/chat/completions", json={"messages": USER}, timeout=30))

    first = threading.Thread(target=call)
    first.start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0)
    second = threading.Thread(target=call)
    second.start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1)
    # a third request from the same client exceeds the per-client limit
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER})
    assert_error(r, 429, code="too_many_concurrent_requests")
    assert r.headers["retry-after"] == "1"
    gate.set()
    first.join()
    second.join()
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["choices"][0]["message"]["content"] == "slow " * 5 for r in results)


def test_queue_full_is_503(serve, chat_model):
    gate = threading.Event()   # the first request holds the only worker until the 503 is seen
    engine = ScriptedEngine(chat_model[1], "wait " * 5, gate=gate)
    url = serve(engine, max_queue=1, max_concurrent_per_client=10)
    threads = [threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                                kwargs={"json": {"messages": USER}, "timeout": 30}) for _ in range(2)]
    threads[0].start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0)
    threads[1].start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER})
    assert_error(r, 503, code="server_busy")
    assert r.headers["retry-after"] == "1"
    gate.set()
    for t in threads:
        t.join()


def test_two_replicas_serve_in_parallel(serve, chat_model):
    gate = threading.Event()   # each replica's first request holds it until both are seen busy
    engines = [ScriptedEngine(chat_model[1], "par " * 20, gate=gate) for _ in range(2)]
    url = serve(*engines, max_concurrent_per_client=10)
    results = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(
        url + "/v1/chat/completions", json={"messages": USER}, timeout=30))) for _ in range(4)]
    for t in threads:
        t.start()
    both_busy = wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0)
    gate.set()
    for t in threads:
        t.join()
    assert both_busy and [r.status_code for r in results] == [200] * 4
    assert sum(len(e.calls) for e in engines) == 4 and all(e.calls for e in engines)
    workers = httpx.get(url + "/stats").json()["workers"]
    assert [w["requests"] for w in workers] == [len(e.calls) for e in engines] and not any(w["busy"] for w in workers)


def test_batched_replica_serves_concurrent_streams(chat_model):
    """Continuous batching behind the API (chat_web's default): six streaming greedy requests at
    once through one replica's 4 slots; each answer equals the plain Engine's, and /stats shows
    the steps were shared."""
    from nanochat.server import replica_workers

    model, tokenizer = chat_model
    workers = replica_workers(Engine(model, tokenizer, decode="static", decode_bucket=32), "cpu", 4)
    assert len(workers) == 4 and len({id(w.engine) for w in workers}) == 1
    server, url = serve_in_thread(create_app(WorkerPool(workers), ServerSettings(
        model_name="tiny", max_concurrent_per_client=10)))
    try:
        bodies = [{"messages": [{"role": "user", "content": f"Tell me about {w}"}], "temperature": 0,
                   "max_tokens": 12 + 3 * i} for i, w in enumerate(["kings", "fools", "ghosts", "love", "war", "sea"])]
        got = [None] * len(bodies)

        def call(i):
            lines = sse_lines(url, {**bodies[i], "stream": True})
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            got[i] = "".join(c["delta"].get("content", "") for e in events for c in e.get("choices", []))
        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        plain, plain_url = serve_in_thread(create_app(WorkerPool([Worker(Engine(model, tokenizer), "cpu")]),
                                                      ServerSettings(model_name="tiny")))
        try:
            want = [httpx.post(plain_url + "/v1/chat/completions", json=b, timeout=30).json()
                    ["choices"][0]["message"]["content"] for b in bodies]
        finally:
            plain.should_exit = True
            plain.thread.join(timeout=10)
        assert got == want and all(want)
        stats = httpx.get(url + "/stats").json()
        assert len(stats["workers"]) == 4 and stats["batching"][0]["slots"] == 4
        assert stats["batching"][0]["mean_batch"] > 1.0
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)


def free_port(host: str = "127.0.0.1") -> int:   # chat_web's recipe tests and others import it
    import socket

    with socket.create_server((host, 0)) as sock:
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------------ int8 weights

def test_int8_replica_answers_and_says_so(chat_model, serve):
    """A replica serving int8 weights (chat_web --quantize int8): the API answers through its
    batched engine and /stats names the weights' format per worker."""
    from nanochat.checkpoint import build_model
    from nanochat.quantize import quantize_model
    from nanochat.server import replica_workers

    model, tokenizer = chat_model
    twin = build_model(model.config, "cpu", for_training=False)   # the shared fixture stays unquantised
    twin.load_state_dict(model.state_dict())
    quantised = quantize_model(twin.eval(), "int8")
    workers = replica_workers(Engine(quantised, tokenizer, decode="static", decode_bucket=32), "cpu", 2)
    server, url = serve_in_thread(create_app(WorkerPool(workers), ServerSettings(model_name="tiny")))
    plain = serve(Engine(model, tokenizer))
    try:
        body = {"messages": USER, "temperature": 0, "max_tokens": 8}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert {w["weights"] for w in httpx.get(url + "/stats").json()["workers"]} == {"int8"}
        assert httpx.get(plain + "/stats").json()["workers"][0]["weights"] == "none"
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
