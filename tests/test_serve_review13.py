"""Thirteenth review of the chat server, as a user pointing OpenAI-compatible tools at it: a
conversation past the model's context is a 400 worded as OpenAI's (client libraries match those
words to tell an overflow from other 400s and trim the history), /stats answers HEAD like the
other GET routes, and the chat page declares its icon so a browser does not ask for
/favicon.ico (a 404 line in the server log on every page load). Each failed before its fix."""

import re

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from test_chat_web import USER, ScriptedEngine, assert_error, serve  # noqa: E402,F401  (serve: the fixture)


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from test_engine import tiny_chat_model

    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_chat_web's


def test_a_context_overflow_is_worded_as_openai_s(serve, chat_model):  # noqa: F811
    """The 400 said "the conversation is N tokens; the model's context is M tokens": right, but not
    the words libraries look for. LiteLLM (aider, the LiteLLM router's context-window fallbacks)
    raises ContextWindowExceededError only on "This model's maximum context length is", and CrewAI
    matches "maximum context length"; the openai client's exception text is the message alone,
    so the `code` does not reach them. Now the message opens with OpenAI's words, code and param kept."""
    url = serve(ScriptedEngine(chat_model[1], "ok"))   # the scripted engine's context: 256 tokens
    long = [{"role": "user", "content": "hello " * 400}]
    err = assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": long}), 400,
                       param="messages", code="context_length_exceeded")
    said = re.fullmatch(r"This model's maximum context length is 256 tokens; the conversation is (\d+) tokens, "
                        r"leaving no room for a reply: shorten it or start a new chat", err["message"])
    assert said and int(said.group(1)) > 256, err["message"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=long, stream=True)
    assert "This model's maximum context length is 256 tokens" in str(e.value)
    assert e.value.code == "context_length_exceeded"
    assert client.chat.completions.create(model="any", messages=USER).choices[0].message.content == "ok"


def test_stats_answers_head_behind_the_api_key(serve, chat_model):  # noqa: F811
    """/, /health and /v1/models answer HEAD (monitors probe with it); /stats said 405, read as down."""
    url = serve(ScriptedEngine(chat_model[1], "ok"), api_key="k" * 8)
    r = httpx.head(url + "/stats", headers={"Authorization": "Bearer " + "k" * 8})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json" and r.content == b""
    assert httpx.head(url + "/stats").status_code == 401   # the key is still needed
    assert httpx.get(url + "/stats", headers={"Authorization": "Bearer " + "k" * 8}).json()["model"] == "nanochat"


def test_the_page_declares_an_icon_its_csp_allows(serve, chat_model):  # noqa: F811
    """With no icon declared, every browser load of the page was followed by GET /favicon.ico: a
    404 counted in /stats (http_404) and an "error not_found" line in chat_web's request log. The
    page now names an empty data: icon, which its Content-Security-Policy's img-src allows."""
    url = serve(ScriptedEngine(chat_model[1], "ok"))
    page = httpx.get(url + "/")
    icon = re.search(r'<link rel="icon" href="([^"]+)">', page.text)
    assert icon and icon.group(1).startswith("data:"), "the page names no icon: browsers ask for /favicon.ico"
    img_src = re.search(r"img-src ([^;]+)", page.headers["content-security-policy"]).group(1).split()
    assert "data:" in img_src


def test_per_client_429_names_the_limit_and_its_flag():
    """A batch client past the per-client limit got "too many concurrent requests ... wait for one to
    finish": nothing said how many it may send or which server flag raises the limit."""
    from nanochat.chat_api import ApiError
    from nanochat.worker_pool import _ClientSlots

    slots = _ClientSlots(2)
    slots.acquire("a"), slots.acquire("a")
    try:
        slots.acquire("a")
    except ApiError as e:
        err = e
    assert err.status == 429 and "--max-concurrent-per-client" in str(err) and "at most 2 at a time" in str(err)
    slots.acquire("b")   # another client is not limited by this one
