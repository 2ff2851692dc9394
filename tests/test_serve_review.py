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
