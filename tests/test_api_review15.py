"""Fifteenth review of the OpenAI-compatible API (nanochat/chat_api.py) from a client's side: the
fields accepted without effect (`user`, `metadata`, `store`, ...) are still type-checked as OpenAI
checks them (a wrong type was accepted unread), in the parser and over HTTP through the `openai`
package."""

import pytest
from conftest import require_module

from nanochat.chat_api import ApiError, ServerSettings, parse_chat_request

SETTINGS = ServerSettings().validate()
USER = [{"role": "user", "content": "Hello there"}]


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_chat_request(body, SETTINGS)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


# ------------------------------------------------------------------------------------ field types

@pytest.mark.parametrize("field, value, said", [
    ("user", 5, "got an integer; accepted: a string"),
    ("user", True, "got a boolean; accepted: a string"),
    ("store", "false", "got a string; accepted: true|false"),   # a truthy string: the opposite of what it says
    ("parallel_tool_calls", 1, "got an integer; accepted: true|false"),
    ("metadata", ["trace"], "got a list; accepted: an object of string values"),
    ("metadata", {"run": 7}, 'got {"run": 7}; accepted: an object of string values'),
    ("prediction", "x", "got a string; accepted: an object"),
    ("reasoning_effort", 3, "got an integer; accepted: a string"),
    ("service_tier", {}, "got {}; accepted: a string"),
])
def test_a_field_without_effect_of_the_wrong_type_is_a_400_naming_it(field, value, said):
    """These fields change nothing here, so they were accepted unread whatever they held: a client
    sending `"user": 5` or `"store": "false"` never learnt of its bug, which OpenAI reports."""
    e = refused({"messages": USER, field: value})
    assert e.param == field and e.code == "invalid_type"
    assert e.message.startswith(f"'{field}': {said}") and "no effect" in e.message


def test_fields_without_effect_of_the_right_type_or_null_pass():
    ok = {"user": "u", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True, "service_tier": "auto",
          "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "medium",
          "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h"}
    assert parse_chat_request({"messages": USER, **ok}, SETTINGS).messages == USER
    assert parse_chat_request({"messages": USER, **dict.fromkeys(ok)}, SETTINGS).messages == USER


def test_the_openai_client_sees_the_wrong_type_named(tiny_corpus):
    """Over HTTP, as the `openai` package reports it: a 400 BadRequestError whose body names the
    field, in OpenAI's error shape."""
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
    from test_chat_web import ScriptedEngine
    from test_engine import tiny_chat_model

    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread

    tokenizer = tiny_chat_model(str(tiny_corpus))[1]
    server, url = serve_in_thread(create_app(WorkerPool([Worker(ScriptedEngine(tokenizer, "ok"), "w0")]), SETTINGS))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=USER, user=42)
        assert e.value.body == {"message": e.value.body["message"], "type": "invalid_request_error", "param": "user",
                                "code": "invalid_type"}
        ok = client.chat.completions.create(model="m", messages=USER, user="u-1", store=False, metadata={"k": "v"})
        assert ok.choices[0].message.content == "ok"
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
