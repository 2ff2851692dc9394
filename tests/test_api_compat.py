"""The chat API against what OpenAI clients send (nanochat/chat_api.py): message fields beyond role
and content (`name`, an assistant's `refusal`, tool-call history, non-text content parts) and the
`stop` errors; then the `openai` package over HTTP, echoing its own response objects back as
history. Parsing basics and refused top-level fields: tests/test_chat_api.py, test_api_review2.py."""

import json

import pytest
from conftest import require_module

from nanochat.chat_api import ApiError, ServerSettings, parse_chat_request

SETTINGS = ServerSettings().validate()


def user(content, **extra):
    return {"role": "user", "content": content, **extra}


def bot(content, **extra):
    return {"role": "assistant", "content": content, **extra}


def parsed(messages, **body):
    return parse_chat_request({"messages": messages, **body}, SETTINGS).messages


def refused(messages, **body) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_chat_request({"messages": messages, **body}, SETTINGS)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"
    return e.value


# ------------------------------------------------------------------------------------ message fields

def test_one_name_per_role_is_accepted_and_changes_nothing():
    """A client that names its user (a chat UI's "attach username") or its agents (two-agent
    frameworks) sends one name per role: nothing to tell apart, so the prompt is the unnamed one."""
    plain = [user("hi"), bot("hello"), user("and?")]
    named = [user("hi", name="bob"), bot("hello", name="helper"), user("and?", name="bob")]
    assert parsed(named) == parsed(plain)
    assert parsed([{"role": "developer", "content": "s", "name": "ops"}, user("q", name=None)])[0]["content"] == "s"


def test_two_speakers_of_one_role_are_refused_not_merged():
    """Messages of two named users became one user turn ("a\\n\\nb") with no names: the model read
    two people as one. OpenAI gives `name` to tell participants of one role apart; this chat format
    cannot, so it is refused by field instead of silently dropped."""
    e = refused([user("I'm for it", name="alice"), bot("ok"), user("I'm against", name="bob")])
    assert e.param == "messages[2].name" and e.code == "unsupported_value"
    assert '"bob"' in e.message and '"alice"' in e.message and "messages[0]" in e.message
    e = refused([user("hi", name=7)])
    assert e.param == "messages[0].name" and "got an integer" in e.message


def test_an_assistant_refusal_in_history_is_its_text():
    """OpenAI's shape of a refusal is an assistant message with content null and `refusal` set, or
    a {"type": "refusal"} part; sent back as history it was a 400 on `content`."""
    said = "I can't help with that."
    want = [user("q"), bot(said), user("why?")]
    assert parsed([user("q"), bot(None, refusal=said), user("why?")]) == want
    assert parsed([user("q"), bot([{"type": "refusal", "refusal": said}]), user("why?")]) == want
    e = refused([user([{"type": "refusal", "refusal": "no"}])])   # only an assistant refuses
    assert e.param == "messages[0].content[0]" and e.code == "invalid_value"
    assert refused([user("q"), bot(None), user("x")]).param == "messages[1].content"   # no text at all


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "file-1"}},
])
def test_a_part_the_server_cannot_read_is_refused_by_index_and_type(part):
    """The error named only `content`, saying text parts are accepted: a client sending a picture
    could not tell the picture was the problem, nor which part."""
    e = refused([user([{"type": "text", "text": "What is this?"}, part])])
    assert e.param == "messages[0].content[1]" and e.code == "unsupported_value"
    assert json.dumps(part["type"]) in e.message and "text" in e.message


def test_a_malformed_part_is_named_by_index():
    for part in ({"type": "text"}, {"text": "no type"}, {"type": "text", "text": 5}, "plain"):
        e = refused([user([{"type": "text", "text": "ok"}, part])])
        assert e.param == "messages[0].content[1]" and e.code == "invalid_value", part
    for kind in ([], {}):   # unhashable: the assistant's part-type lookup raised TypeError (a 500)
        e = refused([bot([{"type": kind, "text": "x"}]), user("hi")])
        assert e.param == "messages[0].content[0]" and e.code == "invalid_value", kind


@pytest.mark.parametrize("field, value", [
    ("tool_calls", [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
    ("function_call", {"name": "f", "arguments": "{}"}),
    ("audio", {"id": "audio_1"}),
])
def test_tool_call_history_is_refused_by_field(field, value):
    """An assistant turn that called a tool, with text beside the call, was rendered as the text
    alone: a turn other than the one that happened. This server calls no tools: refused by field.
    As OpenAI returns them (null, or []), the fields are accepted."""
    e = refused([user("q"), bot("Let me check.", **{field: value}), user("and?")])
    assert e.param == f"messages[1].{field}" and e.code == "unsupported_parameter"
    assert parsed([user("q"), bot("a", **{field: None}), user("b")]) == [user("q"), bot("a"), user("b")]


def test_tool_messages_say_why():
    e = refused([user("q"), {"role": "tool", "content": "42", "tool_call_id": "c1"}])
    assert e.param == "messages[1].role" and "tools" in e.message


# ------------------------------------------------------------------------------------ stop

@pytest.mark.parametrize("stop, said, param", [
    (["a", "b", "c", "d", "e"], "got 5 strings, more than 4", "stop"),
    ("", "got an empty string", "stop"),
    (["ok", ""], "'stop[1]': got an empty string", "stop[1]"),
    (["x" * 101], "'stop[0]': got a string of 101 characters", "stop[0]"),
    (["ok", None], "'stop[1]': got null", "stop[1]"),
    (["ok", 7], "'stop[1]': got an integer", "stop[1]"),
    (["ok", "a\ud800"], "lone UTF-16 surrogate", "stop[1]"),
    ("a\ud800", "lone UTF-16 surrogate", "stop"),
    ({"a": 1}, "got an object", "stop"),
    (0, "got an integer", "stop"),
])
def test_a_refused_stop_says_which_rule_it_broke(stop, said, param):
    """One message for every way `stop` can be wrong left the client to guess (too many? an empty
    one? too long?); OpenAI's says the count it got, too. A bad item is the param `stop[i]`, as a
    bad message is `messages[i]` (it was "stop" for every item: session 75 left it)."""
    e = refused([user("q")], stop=stop)
    assert e.param == param and said in e.message, (e.param, e.message)
    assert "up to 4 non-empty strings" in e.message or "valid Unicode text" in e.message


# ------------------------------------------------------------------------------------ the openai package

@pytest.fixture(scope="module")
def client(tiny_corpus):
    openai = require_module("openai", "the dev extra: uv pip install -e '.[dev]'")
    require_module("fastapi", "the web extra: uv pip install -e '.[web]'")
    from test_chat_web import ScriptedEngine
    from test_engine import tiny_chat_model

    from nanochat.server import Worker, WorkerPool, create_app, serve_in_thread

    tokenizer = tiny_chat_model(str(tiny_corpus))[1]   # cached: the same model as test_chat_web's
    engine = ScriptedEngine(tokenizer, ["Fine.", "Sure thing."])
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w0")]), ServerSettings(model_name="m")))
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), engine, url
    server.should_exit = True
    server.thread.join(timeout=10)


def test_openai_response_objects_go_back_as_history(client):
    """A client appends `response.choices[0].message` (or its full dump, nulls and all, as many
    frameworks store it) and asks again: the prompt is the same as with plain dicts."""
    c, engine, _ = client
    first = c.chat.completions.create(model="m", messages=[user("hi", name="bob")])
    message = first.choices[0].message
    for echoed in (message, message.model_dump()):
        c.chat.completions.create(model="m", messages=[user("hi", name="bob"), echoed, user("and?", name="bob")])
        got = engine.calls[-1]["prompt"]
        c.chat.completions.create(model="m", messages=[user("hi"), bot("Fine."), user("and?")])
        assert got == engine.calls[-1]["prompt"]


def test_the_openai_client_sees_message_errors_by_field(client):
    import openai

    c, engine, _ = client
    before = len(engine.calls)
    cases = [([user([{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}])],
              "messages[0].content[1]"),
             ([user("yes", name="alice"), user("no", name="bob")], "messages[1].name")]
    for messages, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=messages)
        assert e.value.body["param"] == param and e.value.body["code"] == "unsupported_value"
        with pytest.raises(openai.BadRequestError):   # a stream is refused before it starts, as JSON
            c.chat.completions.create(model="m", messages=messages, stream=True)
    assert len(engine.calls) == before   # no generation ran


def test_a_stream_without_include_usage_has_no_usage_field(client):
    """OpenAI: the usage chunk (empty choices) and `usage: null` on the other chunks come only with
    stream_options.include_usage; n = 2 streams each choice's role, text and one finish by index."""
    import httpx

    _, _, url = client
    body = {"messages": [user("hi")], "stream": True, "n": 2}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all("usage" not in ch and len(ch["choices"]) == 1 for ch in chunks)
    finishes = [(ch["choices"][0]["index"], ch["choices"][0]["finish_reason"]) for ch in chunks
                if ch["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [(0, "stop"), (1, "stop")]
    texts = ["".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"][0]["index"] == i)
             for i in (0, 1)]
    assert texts == ["Fine.", "Sure thing."]


def test_at_the_context_limit_the_answer_is_cut_with_length(client, tiny_corpus):
    """A max_tokens beyond what the context has room for is not a 400: the answer gets the room
    left (the engine is asked for exactly that) and ends with finish_reason "length", as OpenAI
    reports an answer cut by the context; no room at all is a 400 context_length_exceeded."""
    import openai
    from test_engine import tiny_chat_model

    c, engine, _ = client
    tok = tiny_chat_model(str(tiny_corpus))[1]
    def room_left(k: int) -> int:   # of a prompt of k "a "s
        return engine.max_seq_len - len(tok.render_for_completion({"messages": [user("a " * k)]}))
    k = max(k for k in range(engine.max_seq_len) if room_left(k) >= 1)
    room = room_left(k)
    assert 1 <= room < len(tok.encode("Fine.")), room   # less room than the reply needs
    out = c.chat.completions.create(model="m", messages=[user("a " * k)], max_completion_tokens=1000)
    assert engine.calls[-1]["max_tokens"] == room
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == room
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=[user("a " * (k + 40))])
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "messages"
