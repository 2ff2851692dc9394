"""Second review of the OpenAI-compatible API (nanochat/chat_api.py, nanochat/server.py) as an
`openai` client sees it: fields whose effect the server cannot produce are refused by name, never
silently ignored (non-zero penalties, misspelt or foreign fields), and an unknown path or method
says what was asked and what the server serves."""

import pytest
from conftest import require_module

from nanochat.chat_api import ApiError, ServerSettings, parse_chat_request

USER = [{"role": "user", "content": "Hello there"}]
SETTINGS = ServerSettings().validate()


def refused(body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_chat_request(body, SETTINGS)
    assert e.value.status == 400
    return e.value


# ------------------------------------------------------------------------------------ parsing

@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_a_penalty_the_sampler_cannot_apply_is_refused(name):
    """The sampler has no repetition penalties: 0 (OpenAI's default) is what it does, so 0 / null
    are accepted; any other value would be silently ignored, so it is refused by name."""
    for ok in (None, 0, 0.0):
        assert parse_chat_request({"messages": USER, name: ok}, SETTINGS).messages == USER
    for value in (0.5, -1, 2):
        e = refused({"messages": USER, name: value})
        assert e.param == name and e.code == "unsupported_parameter" and name in e.message and "0" in e.message
    assert refused({"messages": USER, name: 2.5}).code == "invalid_value"   # out of OpenAI's range: still that


@pytest.mark.parametrize("field", ["max_token", "temprature", "repetition_penalty", "min_p", "best_of"])
def test_an_unknown_field_is_refused_by_name(field):
    """A misspelt field (max_token) or another server's extension (repetition_penalty) would be
    ignored, giving an answer the client did not ask for; OpenAI refuses unrecognized arguments too."""
    e = refused({"messages": USER, field: 5})
    assert e.param == field and e.code == "unknown_parameter"
    assert repr(field) in e.message and "max_tokens" in e.message   # names it and what is accepted


def test_known_fields_without_effect_and_null_unknowns_are_accepted():
    harmless = {"user": "u", "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True,
                "service_tier": "auto", "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
                "verbosity": "medium", "safety_identifier": "s", "prompt_cache_key": "k",
                "prompt_cache_retention": "in-memory", "an_unset_extension": None}
    assert parse_chat_request({"messages": USER, **harmless}, SETTINGS).messages == USER


# ------------------------------------------------------------------------------------ over HTTP

@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from test_engine import tiny_chat_model

    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_chat_web's


@pytest.fixture(scope="module")
def url(chat_model):
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread
    from test_chat_web import ScriptedEngine

    server, base = serve_in_thread(create_app(WorkerPool([Worker(ScriptedEngine(chat_model[1], "ok"), "w0")]),
                                              ServerSettings(model_name="m")))
    yield base
    server.should_exit = True
    server.thread.join(timeout=10)


def test_the_openai_client_sees_refused_penalties_and_unknown_fields(url):
    openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, frequency_penalty=0.7)
    assert e.value.body["param"] == "frequency_penalty" and e.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER, extra_body={"repetition_penalty": 1.2})
    assert e.value.body["param"] == "repetition_penalty" and e.value.body["code"] == "unknown_parameter"
    out = client.chat.completions.create(model="m", messages=USER, presence_penalty=0, frequency_penalty=0,
                                         extra_body={"top_k": 5})   # this server's own extension
    assert out.choices[0].message.content == "ok"


def test_unknown_paths_and_methods_say_what_was_asked_and_what_is_served(url):
    import httpx
    openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")

    r = httpx.post(url + "/v1/completions", json={"prompt": "x"})
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == "not_found" and err["type"] == "invalid_request_error"
    assert "POST /v1/completions" in err["message"] and "POST /v1/chat/completions" in err["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:   # e.g. the legacy completions API
        client.completions.create(model="m", prompt="x")
    assert "/v1/chat/completions" in e.value.body["message"]
    r = httpx.get(url + "/v1/chat/completions")
    err = r.json()["error"]
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert "GET" in err["message"] and "/v1/chat/completions" in err["message"] and "POST" in err["message"]


def test_stream_options_keys_are_checked_too():
    """A misspelt stream_options key ("include_usag") gave a stream without the usage chunk the client
    asked for; include_obfuscation (OpenAI's padding of deltas; this server adds none) is accepted."""
    q = {"messages": USER, "stream": True}
    e = refused({**q, "stream_options": {"include_usag": True}})
    assert e.param == "stream_options" and "include_usag" in e.message and "include_usage" in e.message
    req = parse_chat_request({**q, "stream_options": {"include_usage": True, "include_obfuscation": False}}, SETTINGS)
    assert req.include_usage
    assert refused({**q, "stream_options": {"include_obfuscation": "no"}}).param == "stream_options"
