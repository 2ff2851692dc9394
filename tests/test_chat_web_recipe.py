"""scripts/chat_web as a command: `main` serving the newest SFT checkpoint (uvicorn.run stubbed, the
app then served on a free 127.0.0.1 port): the bind, the DNS-rebinding guard's hosts for a loopback
or a network bind, CORS, the per-client limit, and every bad flag refused naming it; a bad server
setting from the command line is one line and exit 2; and scripts/load_test.py against the
server. The server's behaviour over HTTP: tests/test_chat_web.py, whose helpers these import."""

import json

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.server import serve_in_thread  # noqa: E402
from test_chat_web import USER, assert_error, free_port  # noqa: E402
from test_engine import tiny_chat_model  # noqa: E402


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):   # sft_checkpoint's model (conftest); cached: test_chat_web's
    return tiny_chat_model(str(tiny_corpus))


def test_chat_web_recipe(sft_checkpoint, monkeypatch, capsys):
    from scripts import chat_web

    served = {}
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: served.update(app=app, **kw))
    port = free_port()   # main checks that it can listen there before loading the model
    assert chat_web.main(["--device", "cpu", "--port", str(port), "--max-n", "2", "--allowed-host", "chat.example.com",
                          "--cors-origin", "http://localhost:3000"]) == 0
    assert served["host"] == "127.0.0.1" and served["port"] == port
    printed = capsys.readouterr()
    assert "WARNING" not in printed.err and "up to 8 concurrent request(s) per client" in printed.out
    server, url = serve_in_thread(served["app"])
    try:
        out = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 5}, timeout=30).json()
        assert out["model"] == "nanochat-sft-d2" and out["usage"]["completion_tokens"] >= 1
        assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": USER, "n": 3}), 400, "n")
        # loopback bind: the DNS-rebinding guard answers loopback names and --allowed-host only
        assert_error(httpx.get(url + "/health", headers={"Host": f"rebind.example:{port}"}), 400, code="invalid_host")
        for host in (f"localhost:{port}", "chat.example.com"):
            assert httpx.get(url + "/health", headers={"Host": host}).status_code == 200
        limits = httpx.get(url + "/stats").json()["limits"]
        assert limits["max_concurrent_per_client"] == 8  # default: the 8 batch slots x 1 replica
        assert limits["cors_origins"] == ["http://localhost:3000"]
        r = httpx.options(url + "/v1/chat/completions", headers={"Origin": "http://localhost:3000",
                                                                 "Access-Control-Request-Method": "POST"})
        assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
    assert chat_web.main(["--device", "cpu", "--host", "0.0.0.0", "--port", str(free_port("0.0.0.0"))]) == 0
    assert "WARNING: binding 0.0.0.0" in capsys.readouterr().err and served["host"] == "0.0.0.0"
    args = chat_web.parse_args(["--host", "0.0.0.0"])
    assert chat_web.settings_from_args(args, "m").allowed_hosts is None   # network bind: any Host...
    args = chat_web.parse_args(["--host", "0.0.0.0", "--allowed-host", "a.example", "--allowed_host", "b.example"])
    assert chat_web.settings_from_args(args, "m").allowed_hosts == ("a.example", "b.example")  # ...unless listed
    args = chat_web.parse_args(["--host", "127.0.0.2", "--max-concurrent-per-client", "3"])
    settings = chat_web.settings_from_args(args, "m")
    assert settings.allowed_hosts == ("localhost", "127.0.0.1", "::1", "127.0.0.2")
    assert settings.max_concurrent_per_client == 3
    for argv, flag in [(["--port", "0"], "--port"), (["--max-queue", "0"], "--max-queue"),
                       (["--api-key", "short"], "--api-key"), (["-i", "nope"], "--source"),
                       (["--temperature", "9"], "--temperature"), (["--graph-step", "mega"], "--graph-step"),
                       (["--batch-slots", "2", "--max-n", "3"], "--batch-slots"),
                       (["--batch-slots", "0"], "--batch-slots"),
                       (["--cors-origin", "localhost:3000"], "--cors-origin"),
                       (["--cors-origin", "http://a.example/app"], "--cors-origin"),
                       (["--allowed-host", "a b"], "--allowed-host"),
                       (["--max-concurrent-per-client", "0"], "--max-concurrent-per-client")]:
        with pytest.raises(ValueError, match=flag):
            chat_web.main(["--device", "cpu", *argv])


def test_a_bad_server_setting_is_refused_by_the_command_line_check(tmp_path):
    """The limits (ServerSettings) are checked with the other flags, before any model loads: from
    the command line a bad one is one line `chat_web: error: ...` and exit 2, not a traceback;
    a short key from $NANOCHAT_API_KEY names the variable too."""
    import os
    import subprocess
    import sys

    from scripts import chat_web
    for argv, flag in [(["-t", "9"], "--temperature"), (["--max-messages", "0"], "--max-messages"),
                       (["--cors-origin", "notaurl"], "--cors-origin"), (["-m", "999999"], "--max-tokens")]:
        with pytest.raises(ValueError, match=flag):
            chat_web.validate(chat_web.parse_args(argv))
    proc = subprocess.run([sys.executable, "-m", "scripts.chat_web"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, NANOCHAT_API_KEY="short", NANOCHAT_BASE_DIR=str(tmp_path)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, (proc.returncode, proc.stderr)
    assert proc.stderr.splitlines() == ["chat_web: error: --api-key (or $NANOCHAT_API_KEY): got a key shorter than 8 "
                                        "characters; accepted: >= 8 characters"]


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
