"""Review 75 of the OpenAI-compatible server from an `openai` client's side (nanochat/chat_api.py):
every parameter the installed `openai` package can send is one the server knows (answered, refused
as unsupported, or accepted without effect), never an "unknown_parameter" 400: `prompt_cache_options`
(a caching hint) was refused as unknown and `moderation` (which asks for moderation the server
cannot run) as a misspelling."""

import pytest
from conftest import require_module

from nanochat.chat_api import ApiError, ServerSettings, parse_chat_request

SETTINGS = ServerSettings().validate()
USER = [{"role": "user", "content": "Hello there"}]


def refused(body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_chat_request(body, SETTINGS)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


# ------------------------------------------------------------------------------------ known parameters

# CompletionCreateParamsBase's fields in openai 3.57 (2026-12): fixed here, so that a new SDK release
# (CI installs the newest) cannot fail CI; the newest SDK's extra fields are listed by the test below
SDK_3_57_PARAMS = (
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs", "max_completion_tokens",
    "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls", "prediction",
    "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "reasoning_effort",
    "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream_options",
    "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options")


def _unknown(names) -> list[str]:
    unknown = []
    for name in names:
        try:
            parse_chat_request({"messages": USER, name: {}}, SETTINGS)   # {}: of some type; the name is the test
        except ApiError as e:
            if e.code == "unknown_parameter":
                unknown.append(name)
    return unknown


def test_every_parameter_the_openai_package_sends_is_known():
    """The SDK's create() parameters, each sent non-null: none may come back "unknown_parameter"
    (whose message tells the client it misspelt a field it took from OpenAI's own client)."""
    assert not _unknown(SDK_3_57_PARAMS), "classify these in nanochat/chat_api.py (used, refused or without effect)"
    assert _unknown(["temprature"]) == ["temprature"]   # the check can fail


def test_the_installed_openai_packages_new_parameters_are_reported():
    """A newer SDK's fields beyond 3.57's: skipped (not failed) with their names, to classify later."""
    require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase

    new = _unknown(sorted(set(CompletionCreateParamsBase.__annotations__) - {"messages", "model", *SDK_3_57_PARAMS}))
    if new:
        pytest.skip(f"the installed openai package sends fields nanochat/chat_api.py does not know yet: {new}")


def test_prompt_cache_options_is_accepted_without_effect_and_type_checked():
    for value in ({"mode": "implicit", "ttl": "30m"}, {"mode": "explicit"}, {}, None):
        assert parse_chat_request({"messages": USER, "prompt_cache_options": value}, SETTINGS).messages == USER
    e = refused({"messages": USER, "prompt_cache_options": "30m"})
    assert e.param == "prompt_cache_options" and e.code == "invalid_type" and "got a string" in e.message


@pytest.mark.parametrize("value", [{"model": "omni-moderation-latest"},
                                   {"model": "omni-moderation-latest", "policy": {"output": {"mode": "block"}}}])
def test_moderation_is_refused_as_unsupported_not_as_a_typo(value):
    """"block" would withhold a flagged answer, "score" add scores to it: neither can happen here,
    so it is refused by name as unsupported (null asks for nothing and passes)."""
    e = refused({"messages": USER, "moderation": value})
    assert e.param == "moderation" and e.code == "unsupported_parameter"
    assert "moderat" in e.message and "null" in e.message and "misspelt" not in e.message
    assert parse_chat_request({"messages": USER, "moderation": None}, SETTINGS).messages == USER


def test_the_openai_client_sends_the_new_fields(tiny_corpus):
    """Over HTTP, as the `openai` package reports them (extra_body: older packages lack the kwargs)."""
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
    from test_chat_web import ScriptedEngine
    from test_engine import tiny_chat_model

    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread

    tokenizer = tiny_chat_model(str(tiny_corpus))[1]
    server, url = serve_in_thread(create_app(WorkerPool([Worker(ScriptedEngine(tokenizer, "Hi there."), "w0")]),
                                             ServerSettings()))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ok = client.chat.completions.create(model="m", messages=USER,
                                            extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}})
        assert ok.choices[0].message.content == "Hi there."
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="m", messages=USER,
                                           extra_body={"moderation": {"model": "omni-moderation-latest"}})
        assert (e.value.code, e.value.param) == ("unsupported_parameter", "moderation")
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)


# ------------------------------------------------------------------------------------ --cors-origin

@pytest.mark.parametrize("given, sent", [
    ("https://app.example.com:443", "https://app.example.com"),   # a default port: browsers leave it out
    ("http://app.example:80", "http://app.example"),
    ("http://LocalHost:3000", "http://localhost:3000"),           # hosts are lowercased
    ("http://[0:0::1]:8080", "http://[::1]:8080"),                # IPv6 compressed
    ("http://app.example:03000", "http://app.example:3000"),
    ("http://bücher.example", "http://xn--bcher-kva.example"),    # punycode
])
def test_a_cors_origin_no_browser_sends_is_refused_naming_the_form_it_sends(given, sent):
    """CORS (and HostGuard's Origin check) compare the Origin header exactly, and a browser writes
    it lowercase without a default port: `--cors-origin https://app.example.com:443` was accepted
    and then matched no request, the web app's every preflight refused."""
    with pytest.raises(ValueError, match="--cors-origin") as e:
        ServerSettings(cors_origins=(given,)).validate()
    assert repr(given) in str(e.value) and str(e.value).endswith(f"accepted: {sent}")
    assert ServerSettings(cors_origins=(sent,)).validate().cors_origins == (sent,)


def test_a_host_whose_punycode_depends_on_the_idna_version_gets_no_wrong_suggestion():
    """Python's IDNA 2003 codec turns straße into strasse; a browser sends xn--strae-oqa: the refusal
    suggested another domain. Now it asks for the punycode form, which is then accepted."""
    with pytest.raises(ValueError, match=r"--cors-origin: got 'http://straße.de' \(a host name with ß") as e:
        ServerSettings(cors_origins=("http://straße.de",)).validate()
    assert "strasse" not in str(e.value)
    assert ServerSettings(cors_origins=("http://xn--strae-oqa.de",)).validate().cors_origins == ("http://xn--strae-oqa.de",)


def test_a_cors_origin_port_past_65535_is_refused():
    with pytest.raises(ValueError, match=r"--cors-origin: got 'http://app.example:99999' \(Port out of range"):
        ServerSettings(cors_origins=("http://app.example:99999",)).validate()


def test_chat_web_refuses_it_before_the_model_loads():
    from scripts.chat_web import parse_args, validate

    with pytest.raises(ValueError, match="accepted: https://app.example.com$"):
        validate(parse_args(["--cors-origin", "https://app.example.com:443"]))
