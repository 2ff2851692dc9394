"""The chat server over real HTTP (uvicorn on a free 127.0.0.1 port): OpenAI schema, SSE framing,
limits, auth, queueing, client-disconnect cancellation, errors; the `openai` package as a client."""

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
    """Engine stand-in for server tests: replies with a fixed text, optionally slowly or failing.
    Records how many steps ran and whether its generator was closed (cancellation)."""

    def __init__(self, tokenizer, text: str, delay: float = 0.0, fail_at: int | None = None):
        self.tokenizer, self.device, self.max_seq_len = tokenizer, torch.device("cpu"), 256
        self.default_stop_tokens = (tokenizer.encode_special("<|assistant_end|>"), tokenizer.bos_token_id)
        self.ids = tokenizer.encode(text) + [self.default_stop_tokens[0]]
        self.delay, self.fail_at = delay, fail_at
        self.steps, self.finished, self.calls = 0, threading.Event(), []

    def generate(self, prompt, *, num_samples=1, max_tokens=256, stop_tokens=None, **kw):
        self.calls.append(dict(prompt=prompt, num_samples=num_samples, max_tokens=max_tokens, **kw))
        self.finished.clear()

        def steps():
            try:
                for i in range(max_tokens):
                    if i == self.fail_at:
                        raise RuntimeError("scripted failure")
                    time.sleep(self.delay)
                    self.steps += 1
                    token = self.ids[min(i, len(self.ids) - 1)]
                    yield [token] * num_samples, [1] * num_samples
            finally:
                self.finished.set()
        return steps()


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


@pytest.fixture
def serve():
    """serve(engine, **settings) -> base URL of a live uvicorn server; all stopped at teardown."""
    servers = []

    def start(*engines, **settings):
        workers = [Worker(e, name=f"w{i}") for i, e in enumerate(engines)]
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
    models = httpx.get(real_url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    page = httpx.get(real_url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'sha256-" in csp and "unsafe-inline" not in csp and "default-src 'none'" in csp
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text)  # nothing external
    assert "innerHTML" not in page.text


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
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = httpx.post(real_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=30).json()
    assert text == plain["choices"][0]["message"]["content"]


def test_openai_client(real_url):
    client = openai.OpenAI(base_url=real_url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
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


# ------------------------------------------------------------------------------------ limits

@pytest.mark.parametrize("body, param, code", [
    ({"messages": []}, "messages", None),
    ({"messages": "hi"}, "messages", None),
    ({"messages": [{"role": "user", "content": "x"}] * 11}, "messages", "too_many_messages"),
    ({"messages": [{"role": "user", "content": "x" * 501}]}, "messages[0].content", "message_too_long"),
    ({"messages": [{"role": "user", "content": "x" * 400}, {"role": "assistant", "content": "y" * 400},
                   {"role": "user", "content": "z" * 400}]}, "messages", "messages_too_long"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", None),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "messages[0].role", None),
    ({"messages": USER + [{"role": "assistant", "content": "x"}]}, "messages", None),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
    ({"messages": USER, "max_tokens": 10_000}, "max_tokens", "invalid_value"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"messages": USER, "temperature": 2.5}, "temperature", "invalid_value"),
    ({"messages": USER, "temperature": "hot"}, "temperature", "invalid_value"),
    ({"messages": USER, "top_p": 0}, "top_p", "invalid_value"),
    ({"messages": USER, "top_k": 5000}, "top_k", "invalid_value"),
    ({"messages": USER, "top_k": 1.5}, "top_k", "invalid_value"),
    ({"messages": USER, "n": 9}, "n", "invalid_value"),
    ({"messages": USER, "stream": "yes"}, "stream", None),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"messages": USER, "stop": [""]}, "stop", None),
    ({"messages": USER, "seed": -1}, "seed", "invalid_value"),
    ([1, 2], None, None),
])
def test_limits_are_400s(serve, chat_model, body, param, code):
    url = serve(ScriptedEngine(chat_model[1], "ok"), max_messages=10, max_message_chars=500, max_total_chars=1000)
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
    assert_error(httpx.get(url + "/nope"), 404)
    assert_error(httpx.get(url + "/v1/chat/completions"), 405)
    r = httpx.post(url + "/v1/chat/completions", json={"messages": USER})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_api_key(serve, chat_model):
    url = serve(ScriptedEngine(chat_model[1], "secret answer"), api_key="s3cret-key")
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}), 401, code="invalid_api_key")
    bad = {"Authorization": "Bearer wrong-key"}
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}, headers=bad), 401)
    assert_error(httpx.get(url + "/v1/models"), 401)
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


def test_generation_error_is_500_and_server_recovers(serve, chat_model):
    engine = ScriptedEngine(chat_model[1], "partial answer here", fail_at=2)
    url = serve(engine)
    err = assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}), 500)
    assert err["type"] == "server_error" and "scripted failure" in err["message"]
    lines = sse_lines(url, {"messages": USER, "stream": True})
    assert any('"error"' in ln for ln in lines) and "data: [DONE]" in lines
    engine.fail_at = None
    assert httpx.post(url + "/v1/chat/completions", json={"messages": USER}).status_code == 200
    assert httpx.get(url + "/health").json()["available"] == 1


# ------------------------------------------------------------------------------------ concurrency

def wait_until(cond, timeout=5.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


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


def test_queue_per_client_limit_and_busy(serve, chat_model):
    tok = chat_model[1]
    engine = ScriptedEngine(tok, "slow " * 30, delay=0.02)
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
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}), 429,
                 code="too_many_concurrent_requests")
    first.join()
    second.join()
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["choices"][0]["message"]["content"] == "slow " * 30 for r in results)


def test_queue_full_is_503(serve, chat_model):
    engine = ScriptedEngine(chat_model[1], "wait " * 30, delay=0.02)
    url = serve(engine, max_queue=1, max_concurrent_per_client=10)
    threads = [threading.Thread(target=httpx.post, args=(url + "/v1/chat/completions",),
                                kwargs={"json": {"messages": USER}, "timeout": 30}) for _ in range(2)]
    threads[0].start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0)
    threads[1].start()
    assert wait_until(lambda: httpx.get(url + "/health").json()["waiting"] == 1)
    assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER}), 503, code="server_busy")
    for t in threads:
        t.join()


def test_two_replicas_serve_in_parallel(serve, chat_model):
    engines = [ScriptedEngine(chat_model[1], "par " * 20, delay=0.02) for _ in range(2)]
    url = serve(*engines, max_concurrent_per_client=10)
    results = []
    threads = [threading.Thread(target=lambda: results.append(httpx.post(
        url + "/v1/chat/completions", json={"messages": USER}, timeout=30))) for _ in range(4)]
    for t in threads:
        t.start()
    both_busy = wait_until(lambda: httpx.get(url + "/health").json()["available"] == 0)
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


# ------------------------------------------------------------------------------------ the recipe

def test_chat_web_recipe(sft_checkpoint, monkeypatch, capsys):
    from scripts import chat_web

    served = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: served.update(app=app, **kw))
    assert chat_web.main(["--device", "cpu", "--port", "8123", "--max-n", "2"]) == 0
    assert served["host"] == "127.0.0.1" and served["port"] == 8123
    assert "WARNING" not in capsys.readouterr().err
    server, url = serve_in_thread(served["app"])
    try:
        out = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 5}, timeout=30).json()
        assert out["model"] == "nanochat-sft-d2" and out["usage"]["completion_tokens"] >= 1
        assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER, "n": 3}), 400, "n")
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
    assert chat_web.main(["--device", "cpu", "--host", "0.0.0.0"]) == 0
    assert "WARNING: binding 0.0.0.0" in capsys.readouterr().err and served["host"] == "0.0.0.0"
    for argv, flag in [(["--port", "0"], "--port"), (["--max-queue", "0"], "--max-queue"),
                       (["--api-key", "short"], "--api-key"), (["-i", "nope"], "--source"),
                       (["--temperature", "9"], "--temperature"), (["--graph-step", "mega"], "--graph-step"),
                       (["--batch-slots", "2", "--max-n", "3"], "--batch-slots"),
                       (["--batch-slots", "0"], "--batch-slots")]:
        with pytest.raises(ValueError, match=flag):
            chat_web.main(["--device", "cpu", *argv])


@pytest.mark.slow
def test_load_test_script():
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "scripts.load_test", "--requests", "30", "--concurrency", "30",
                           "--max-tokens", "8"], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.splitlines()[0])
    assert result["ok"] == 30 and result["errors"] == 0 and result["health_failures"] == 0
    assert result["health_checks"] >= 1 and result["latency_p95_s"] is not None
