"""Tenth review of the OpenAI-compatible API (nanochat/chat_api.py, nanochat/server.py) from a
client's side: a settings error names a flag chat_web really has (or the field, where there is no
flag) and accepted values that exclude what it refused, and /v1/models answers HEAD probes as the
chat page and /health do."""

import pytest
from conftest import require_module

from nanochat.chat_api import ServerSettings

INT_FIELDS = ["max_messages", "max_message_chars", "max_total_chars", "default_max_tokens", "max_max_tokens",
              "max_top_k", "max_n", "max_stop", "max_body_bytes", "max_concurrent_per_client", "max_queue"]


@pytest.mark.parametrize("field", INT_FIELDS)
def test_a_bad_integer_setting_names_a_real_flag_or_the_field(field):
    """ServerSettings.validate built every error as "--<field>": max_stop, which chat_web has no flag
    for, was refused as "--max-stop", a flag that `python -m scripts.chat_web` does not accept."""
    with pytest.raises(ValueError) as e:
        ServerSettings(**{field: 0}).validate()
    named = str(e.value).split(":")[0]
    if named.startswith("--"):
        from scripts import chat_web

        chat_web.parse_args([named, "5"])   # a flag chat_web lacks: argparse's SystemExit
    else:
        assert named == f"ServerSettings.{field}"
    assert "accepted: an integer >= 1" in str(e.value)


def test_an_infinite_max_temperature_is_refused_as_not_finite():
    """inf was refused with "accepted: a number >= 0", which inf is: the message must say what is wrong."""
    with pytest.raises(ValueError, match=r"--max-temperature: got inf; accepted: a finite number >= 0"):
        ServerSettings(max_temperature=float("inf")).validate()
    assert ServerSettings(max_temperature=1e30, default_temperature=1.0).validate().max_temperature == 1e30


# ------------------------------------------------------------------------------------ over HTTP

@pytest.fixture(scope="module")
def url(tiny_corpus):
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread
    from test_chat_web import ScriptedEngine
    from test_engine import tiny_chat_model

    tokenizer = tiny_chat_model(str(tiny_corpus))[1]   # cached: the same model as test_chat_web's
    server, base = serve_in_thread(create_app(WorkerPool([Worker(ScriptedEngine(tokenizer, "ok"), "w0")]),
                                              ServerSettings(model_name="org/m", api_key="k" * 8)))
    yield base
    server.should_exit = True
    server.thread.join(timeout=10)


def test_models_answer_head_probes_behind_the_api_key(url):
    """A gateway's readiness probe `HEAD /v1/models` got a 405 (Allow: GET), read as "server down",
    while / and /health answer HEAD. Now: the GET's status and headers, no body, the key still needed."""
    import httpx

    key = {"Authorization": "Bearer " + "k" * 8}
    for path in ("/v1/models", "/v1/models/org/m"):
        got, head = httpx.get(url + path, headers=key), httpx.head(url + path, headers=key)
        assert got.status_code == head.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == got.headers["content-type"] == "application/json"
        assert httpx.head(url + path).status_code == 401   # no key: refused, as the GET is
    assert httpx.head(url + "/v1/models/other", headers=key).status_code == 404
    assert httpx.get(url + "/v1/models", headers=key).json()["data"][0]["id"] == "org/m"
    r = httpx.post(url + "/v1/models", headers=key)   # other methods still say what is allowed
    assert r.status_code == 405 and sorted(r.headers["allow"].split(", ")) == ["GET", "HEAD"]
