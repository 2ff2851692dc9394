"""Review of the chat API as an OpenAI client uses it: a request whose messages are system (or
developer) messages alone is answered, as OpenAI answers it, with the system text as the user turn
the model was trained on (it was a 400 "no user message"); empty system messages no longer leave
blank lines before the real instructions. Through the real FastAPI app: a ScriptedEngine shows the
prompt generation received, the tiny model answers through the `openai` package."""

import json

import pytest
from conftest import require_module

httpx = require_module("httpx", "the dev extra: uv pip install -e '.[dev]'")
openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
require_module("fastapi", "the web extra: uv pip install -e '.[web]'")

from nanochat.chat_api import ServerSettings, parse_chat_request  # noqa: E402
from nanochat.chat_format import check_conversation  # noqa: E402
from nanochat.engine import Engine  # noqa: E402
from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread  # noqa: E402
from test_chat_web import ScriptedEngine, assert_error  # noqa: E402
from test_engine import tiny_chat_model  # noqa: E402


def m(role, content):
    return {"role": role, "content": content}


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


@pytest.fixture(scope="module")
def scripted(chat_model):
    """A live server over a ScriptedEngine: (url, engine); engine.calls show each prompt."""
    engine = ScriptedEngine(chat_model[1], "Hi there.")
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings()))
    yield url, engine
    server.should_exit = True
    server.thread.join(timeout=10)


@pytest.fixture(scope="module")
def real(chat_model):
    model, tokenizer = chat_model
    server, url = serve_in_thread(create_app(WorkerPool([Worker(Engine(model, tokenizer), "cpu")]),
                                             ServerSettings(model_name="tiny")))
    yield url
    server.should_exit = True
    server.thread.join(timeout=10)


def prompt_of(tokenizer, messages):
    return tokenizer.render_for_completion({"messages": messages})


@pytest.mark.parametrize("messages, asked", [
    ([m("system", "Say hello in French.")], "Say hello in French."),
    ([m("developer", "Say hello.")], "Say hello."),
    ([m("system", "Be brief."), m("developer", "Name a colour.")], "Be brief.\n\nName a colour."),
    ([m("system", ""), m("system", [{"type": "text", "text": "Count to 3."}])], "Count to 3."),
    ([m("system", "")], ""),
])
def test_system_messages_alone_are_answered_as_the_user_turn(scripted, chat_model, messages, asked):
    """OpenAI answers a request of system / developer messages alone (an instruction-only prompt);
    this server refused it with a 400 "no user message". Now the instructions are the user turn:
    the same prompt as that system text over an empty user message, which is how the tokenizer
    folds a system message into the first user turn (SFT's format)."""
    url, engine = scripted
    tokenizer = chat_model[1]
    for stream in (False, True):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": messages, "stream": stream, "max_tokens": 8},
                       timeout=30)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(x[6:]) for x in r.text.split("\n") if x.startswith("data: {")]
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        else:
            text = r.json()["choices"][0]["message"]["content"]
        assert text == "Hi there."
        assert engine.calls[-1]["prompt"] == prompt_of(tokenizer, [m("user", asked)]) == \
            prompt_of(tokenizer, [m("system", asked), m("user", "")])


def test_what_still_needs_a_user_message_is_still_refused(scripted):
    """Only a conversation of system messages alone changed: one whose reply would answer the
    assistant (system + assistant greeting, or history ending with the assistant) is still a 400
    naming `messages`, and training data keeps its rule (a system message alone trains nothing)."""
    url, _ = scripted
    for messages, said in (([m("system", "s"), m("assistant", "Hello!")], "no user message"),
                           ([m("user", "q"), m("assistant", "a")], "last message is from the assistant")):
        err = assert_error(httpx.post(url + "/v1/chat/completions", json={"messages": messages}, timeout=30),
                           400, param="messages")
        assert said in err["message"]
    with pytest.raises(ValueError, match="only a system message"):
        check_conversation({"messages": [m("system", "s")]})


def test_empty_messages_leave_no_blank_lines():
    """An empty system message (what some clients send for "no system prompt") was joined with the
    real one as "\\n\\nBe terse.": the instructions the model read began with two blank lines; an
    empty user message merged into the next one did the same to the question."""
    settings = ServerSettings().validate()
    got = parse_chat_request({"messages": [m("system", ""), m("user", "hi"), m("developer", "Be terse.")]},
                             settings).messages
    assert got == [m("system", "Be terse."), m("user", "hi")]
    got = parse_chat_request({"messages": [m("system", ""), m("user", "hi")]}, settings).messages
    assert got == [m("user", "hi")]
    # an empty turn merged into its neighbour of the same role: "\n\nhi" before
    got = parse_chat_request({"messages": [m("user", ""), m("user", "hi"), m("user", "")]}, settings).messages
    assert got == [m("user", "hi")]


def test_the_openai_client_gets_an_answer_to_a_system_prompt_alone(real, chat_model):
    """End to end with the tiny model and the `openai` package: streamed and not, the same answer
    for the same seed, and usage counts the prompt the instructions became."""
    client = openai.OpenAI(base_url=real + "/v1", api_key="unused", max_retries=0)
    messages = [m("system", "You are a poet. Write one line about the sea.")]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=3)
    (choice,) = out.choices
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert out.usage.prompt_tokens == len(prompt_of(chat_model[1], [m("user", messages[0]["content"])]))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, seed=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
