"""chat_web as an operator runs it: a wrong -i/-s/--decode named before the model loads (as chat_cli
does, through nanochat/model_choice.py), --help that says every default, a start-up banner that says
the dtype `auto` chose and a URL that can be opened for a wildcard bind, no "reachable from the
network" warning for a bind that fails, one log line per request as it ends (status, duration,
first token, finish, tokens; nanochat/serve_lifecycle.py's RequestLog) and a terminal hang-up
(SIGHUP) that shuts the server down in order and exits 0 instead of killing it mid-answer.
Ctrl-C / SIGTERM: tests/test_serve_shutdown.py; flag checks: tests/test_chat_web_recipe.py."""

import logging
import re
import signal
import socket
import time

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.errors import RequestError  # noqa: E402
from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread  # noqa: E402
from test_chat_web import USER, ScriptedEngine, free_port, wait_until  # noqa: E402
from test_engine import tiny_chat_model  # noqa: E402
from test_serve_shutdown import launch_slowed  # noqa: E402  (chat_web, its model slowed once loaded)


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):   # sft_checkpoint's model (conftest); cached: test_chat_web's
    return tiny_chat_model(str(tiny_corpus))


def _no_load(*a, **kw):
    raise AssertionError("the model was loaded before the flags were checked")


def test_a_missing_step_source_or_decode_is_named_before_the_model_loads(sft_checkpoint, monkeypatch):
    """chat_web said "no checkpoint for step 99 in ..." and "no rl checkpoints under ...", naming no
    flag and no other phase, and --decode graphs on a CPU was a traceback after the model loaded."""
    from scripts import chat_web

    monkeypatch.setattr("nanochat.checkpoint.load_model", _no_load)
    monkeypatch.setattr("uvicorn.run", _no_load)
    cases = [(["-s", "99"], r"^-s/--step: got 99; accepted: latest or a step on disk: 7 \(in "),
             (["-i", "rl"], r"^no rl checkpoints under .*, or pick another -i/--source: sft$"),
             (["--decode", "graphs"], r"^--decode: 'graphs' needs a CUDA device, this run is on cpu; accepted"),
             (["--decode", "static", "--graph-step", "persistent"], r"^--graph-step: 'persistent' needs a CUDA")]
    for argv, said in cases:
        with pytest.raises(RequestError, match=said):
            chat_web.main(["--device", "cpu", "--port", str(free_port()), *argv])


def test_help_says_every_default_and_never_the_key(monkeypatch, capsys):
    """-t/-k/-m said "default temperature" (which?), --port, -g, -s and every limit nothing at all;
    the key from $NANOCHAT_API_KEY must not show up in --help."""
    from scripts import chat_web

    monkeypatch.setenv("NANOCHAT_API_KEY", "secret-key-from-env")
    with pytest.raises(SystemExit):
        chat_web.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())   # argparse wraps lines
    d = ServerSettings()
    for flag, default in [("--temperature", d.default_temperature), ("--top-k", d.default_top_k),
                          ("--max-tokens", d.default_max_tokens), ("--port", 8000), ("--step", "latest"),
                          ("--max-queue", d.max_queue), ("--max-n", d.max_n), ("--batch-slots", 8)]:
        assert re.search(rf"{flag} [A-Z_]+ (?:(?! --[a-z-]+ [A-Z_]+ ).)*\(default: {re.escape(str(default))}\)", text), (flag, text)
    assert "secret-key-from-env" not in text
    assert chat_web.parse_args([]).api_key == "secret-key-from-env"   # still the default


def test_banner_says_the_dtype_and_a_url_to_open(sft_checkpoint, monkeypatch, capsys):
    """The banner named the device but not the dtype `--dtype auto` chose, and for --host 0.0.0.0
    printed http://0.0.0.0:PORT: no address to open from another machine, refused by some clients.
    A warm-up that compiles (minutes on a GPU's first start) ran without a word (on CUDA it
    is said now; a CPU's static decode compiles nothing and is not announced)."""
    from nanochat.serve_lifecycle import browse_urls
    from scripts import chat_web

    monkeypatch.setattr("uvicorn.run", lambda app, **kw: None)
    port = free_port("0.0.0.0")
    assert chat_web.main(["--device", "cpu", "--host", "0.0.0.0", "--port", str(port)]) == 0
    out = capsys.readouterr().out
    # a GPU's warm-up is announced (minutes of compiling on a first start); a CPU's takes a second
    # and was announced as one that "can take minutes" (review 13)
    assert "warming up" not in out and re.search(r"^loaded sft/d2 step 7 on cpu \(fp32, decode=static", out, re.M), out
    assert f"serving nanochat-sft-d2 on http://127.0.0.1:{port} (" in out, out
    remote = re.search(rf"^  from other machines: http://(\S+):{port}$", out, re.M)
    assert remote and remote.group(1) not in ("0.0.0.0", "127.0.0.1"), out
    assert browse_urls("::", 80)[0] == "http://[::1]:80" and browse_urls("::1", 80) == ["http://[::1]:80"]
    assert browse_urls("chat.example.com", 80) == ["http://chat.example.com:80"]


def test_no_network_warning_for_a_bind_that_fails(tmp_path, monkeypatch, capsys):
    """`--host 0.0.0.0` on a taken port printed "WARNING: binding 0.0.0.0:PORT makes the server
    reachable from the network" and then the error that it cannot bind at all."""
    from scripts import chat_web

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with socket.create_server(("0.0.0.0", 0)) as busy:
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RequestError, match=f"cannot listen on 0.0.0.0:{port} "):
            chat_web.main(["--device", "cpu", "--host", "0.0.0.0", "--port", str(port)])
    assert "WARNING" not in capsys.readouterr().err


def test_one_log_line_per_request_as_it_ends(chat_model, caplog):
    """uvicorn's access log said `"POST /v1/chat/completions HTTP/1.1" 200 OK` as a response started:
    a stream's 200 before its first word, no duration, no tokens, and a stream that then failed or
    whose client left read the same as one that finished. RequestLog logs as the response ends."""
    from nanochat.serve_lifecycle import RequestLog

    _, tokenizer = chat_model
    engine = ScriptedEngine(tokenizer, "hello there friend " * 20, delay=0.01)
    log = logging.getLogger("test_chat_web_ops.requests")
    server, url = serve_in_thread(RequestLog(create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings()), log))
    caplog.set_level(logging.DEBUG, logger=log.name)
    try:
        post = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 4}, timeout=30).json()
        httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 0}, timeout=30)
        body = {"messages": USER, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            r.read()
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "max_tokens": 200}, timeout=30) as r:
            next(r.iter_lines())   # then leaves
        httpx.get(url + "/health")
        plain = {"messages": USER, "max_tokens": 2, "stream": True}   # no include_usage: counted all the same
        with httpx.stream("POST", url + "/v1/chat/completions", json=plain, timeout=30) as r:
            r.read()
        assert wait_until(lambda: len(caplog.records) == 6)
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    usage = post["usage"]
    time_ = r"in \d+\.\d{3} s"
    expected = [(logging.INFO, rf'"POST /v1/chat/completions" 200 {time_}: length; '
                               rf'{usage["prompt_tokens"]}\+{usage["completion_tokens"]} tokens$'),
                (logging.INFO, rf'"POST /v1/chat/completions" 400 {time_}: error invalid_value$'),
                (logging.INFO, rf'"POST /v1/chat/completions" 200 {time_} \(stream, first token \d+\.\d{{3}} s\): '
                               r'length; \d+\+3 tokens$'),
                (logging.INFO, rf'"POST /v1/chat/completions" 200 {time_} \(stream[^)]*\): client left$'),
                (logging.DEBUG, rf'"GET /health" 200 {time_}$'),   # a load balancer's polling: not at INFO
                (logging.INFO, rf'"POST /v1/chat/completions" 200 {time_} \(stream, first token \d+\.\d{{3}} s\): '
                               r'length; \d+\+2 tokens$')]
    assert len(lines) == len(expected), lines
    for (level, line), (want_level, pattern) in zip(lines, expected):
        assert level == want_level and re.search(r'^127\.0\.0\.1:\d+ - ' + pattern, line), (line, pattern)


def test_sighup_shuts_down_in_order_and_exits_0(sft_checkpoint):
    """SIGHUP (the terminal or ssh session closed) killed chat_web at once (exit -1), cutting the
    stream in progress. Now it stops as SIGTERM does (the stream ends with the server_shutting_down
    event and [DONE], exit 0), its output moved to <base dir>/hangup.log as a training run's is.
    The request log (chat_web's default --log-level info) has one line per request."""
    proc, url = launch_slowed(sft_checkpoint, "--max-n", "1")
    events = []
    try:
        # greedy: a sampled reply may end with <|assistant_end|> at token 2 ("stop", not "length")
        greedy = {"messages": USER, "max_tokens": 2, "temperature": 0}
        assert httpx.post(url + "/v1/chat/completions", json=greedy).status_code == 200
        body = {"messages": USER, "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                events.append(line)
                if len(events) == 6:   # the answer has begun
                    t0 = time.monotonic()
                    proc.send_signal(signal.SIGHUP)
        rc = proc.wait(timeout=15)
        exited = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    hangup = (sft_checkpoint / "hangup.log").read_text()
    assert rc == 0 and exited < 6, (rc, exited, out[-2000:], hangup[-2000:])   # grace 3 s + a loaded CI machine
    data = [e for e in events if e.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and '"code":"server_shutting_down"' in data[-2], data[-3:]
    assert "the terminal hung up (SIGHUP)" in hangup and "Traceback" not in out + hangup, hangup
    assert re.search(r'"POST /v1/chat/completions" 200 in \d+\.\d+ s: length; \d+\+2 tokens', out), out
    assert re.search(r'"POST /v1/chat/completions" 200 in \d+\.\d+ s \(stream, first token [^)]*\): '
                     r'error server_shutting_down', hangup), hangup
    assert "HTTP/1.1" not in out + hangup   # uvicorn's own access line: not a second line per request
