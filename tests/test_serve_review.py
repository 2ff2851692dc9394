"""Regression tests for serving bugs a user hit (a review of the serving stack as a user): each
test failed before its fix. chat_web's command line (a bad --log-level, a port in use) and the
other findings noted on each test."""

import socket

import pytest
from conftest import require_module

require_module("fastapi", "the web extra: uv pip install -e '.[web]'")


def test_chat_web_bad_log_level_is_a_flag_error():
    """--log-level was passed to uvicorn unchecked: a typo was a KeyError traceback, and only once
    the model had loaded and warmed up."""
    from scripts import chat_web

    with pytest.raises(ValueError, match="--log-level: got 'verbose'; accepted: critical|error"):
        chat_web.validate(chat_web.parse_args(["--log-level", "verbose"]))
    chat_web.validate(chat_web.parse_args(["--log-level", "WARNING"]))   # uvicorn lowercases it


def test_chat_web_port_in_use_is_said_before_the_model_loads(tmp_path, monkeypatch):
    """A port another server holds was found by uvicorn after the model loaded and warmed up
    (minutes for a large model on a GPU); now main says so first, naming --port. The base dir here
    has no checkpoint: reaching the model load would raise a different error."""
    from nanochat.errors import RequestError
    from scripts import chat_web

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with socket.create_server(("127.0.0.1", 0)) as busy:
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RequestError, match=f"--host/--port: cannot listen on 127.0.0.1:{port} "):
            chat_web.main(["--device", "cpu", "--port", str(port)])
    chat_web.check_port_free("127.0.0.1", port)   # free again: no error
    if socket.has_dualstack_ipv6():   # "::" binds dual-stack like uvicorn: an IPv4 listener collides
        with socket.create_server(("0.0.0.0", 0)) as busy:
            busy.listen()
            port = busy.getsockname()[1]
            with pytest.raises(RequestError, match=f"cannot listen on :::{port} "):
                chat_web.check_port_free("::", port)


def test_chat_cli_too_long_first_message_says_shorten_it(monkeypatch, capsys):
    """A first message too long for the context was answered "type /clear to start over", which
    cannot help (the conversation is that message alone); it now says to shorten the message."""
    from types import SimpleNamespace

    from scripts import chat_cli

    tokenizer = SimpleNamespace(render_for_completion=lambda conv: [0] * sum(len(m["content"])
                                                                             for m in conv["messages"]))
    engine = SimpleNamespace(max_seq_len=50)
    lines = iter(["x" * 100, "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert chat_cli.converse(engine, tokenizer, SimpleNamespace(), lambda: 0) == 0
    out = capsys.readouterr().out
    assert "[the conversation is 100 tokens, the model's context is 50: shorten the message]" in out
    assert "/clear to start over" not in out


def test_a_silent_stream_sends_keepalive_comments(monkeypatch):
    """A started stream waiting for its first token (a batched request waiting for free rows, a long
    prefill) sent no bytes after the role chunk until the token came: a client or proxy read timeout
    could end it. Now an SSE comment goes out every KEEPALIVE_S of silence, and the stream closed
    while it waits leaves no pending read on the job's queue."""
    import asyncio
    from types import SimpleNamespace

    from nanochat import chat_sse

    monkeypatch.setattr(chat_sse, "KEEPALIVE_S", 0.02)

    async def run(close_early: bool):
        job = SimpleNamespace(req=SimpleNamespace(n=1, include_usage=False), events=asyncio.Queue(), stats={
            "completed": 0, "completion_tokens": 0, "errors": 0})
        gen = chat_sse._sse_events(job, {"id": "x", "created": 0, "model": "m"})
        out = [await gen.__anext__()]   # the role chunk
        loop = asyncio.get_running_loop()
        loop.call_later(0.15, job.events.put_nowait, ("delta", [(0, "hi")], []))
        loop.call_later(0.16, job.events.put_nowait, ("done", ["stop"], {"completion_tokens": 1}))
        if close_early:
            out.append(await gen.__anext__())
            await gen.aclose()
            await asyncio.sleep(0.2)   # the put lands in the queue: nobody took it
            return out, job.events.qsize()
        return out + [e async for e in gen], job.events.qsize()

    out, left = asyncio.run(run(close_early=False))
    waits = [e for e in out if e == ": waiting for the model\n\n"]
    assert len(waits) >= 3, out   # ~0.15 s of silence at 0.02 s
    assert '"content":"hi"' in "".join(out) and out[-1] == "data: [DONE]\n\n" and left == 0
    assert out.index(waits[0]) > 0 and all(e.startswith((":", "data: ")) for e in out)
    out, left = asyncio.run(run(close_early=True))
    assert out[1] == ": waiting for the model\n\n" and left == 2   # both events stayed queued
