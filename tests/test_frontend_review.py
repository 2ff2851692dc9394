"""Review of the chat front ends as a user meets them, one test per defect found: chat_web taking an
API key no client can send (every request a 401), tracebacks for --num-gpus over the GPUs there are
and for --step abc, a --model-tag with no checkpoints not named as the flag; chat_cli offering "None"
for -k; and on the chat page (one Chromium test, test_browser.py's fixtures) unused "New chat"s
crowding real chats out of storage, a reply cut off by the model's context said to be cut at max
tokens (the context published on /health), an API
key with a stray character reported as an unreachable server, and a saved setting over the server's
limit shown as it was, not as sent."""

import json

import pytest
import test_browser
from test_browser import chat_once, fresh_page, last_reply, load_page, q, replying, send, wait

from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread

# the same fixtures as test_browser.py (assigned, not imported: linters would read the tests'
# arguments as redefinitions)
browser, site, quick = test_browser.browser, test_browser.site, test_browser.quick


@pytest.mark.parametrize("key, said", [("s3cret-key\n", "a space or line break at its start or end"),
                                       (" s3cret-key", "a space or line break at its start or end"),
                                       ("clé-secrète", "the character 'é'"),
                                       ("s3cret\u200bkey", "the character '\\u200b'")])
def test_chat_web_refuses_an_api_key_no_client_can_send(key, said, monkeypatch):
    """HTTP trims a header's ends and curl / the openai client send ASCII only: such a key was taken, and
    then every request, with the right key, was a 401 (or, from the openai client, a UnicodeEncodeError)."""
    from scripts import chat_web

    with pytest.raises(ValueError) as e:
        chat_web.validate(chat_web.parse_args(["--api-key", key]))
    assert str(e.value) == (f"--api-key (or $NANOCHAT_API_KEY): got a key with {said}; accepted: printable ASCII "
                            "characters, not starting or ending with a space")
    assert key.strip() not in str(e.value)   # the key itself is not printed
    monkeypatch.setenv("NANOCHAT_API_KEY", key)
    with pytest.raises(ValueError, match="NANOCHAT_API_KEY"):
        chat_web.validate(chat_web.parse_args([]))
    chat_web.validate(chat_web.parse_args(["--api-key", "a key with spaces~!"]))   # inside: fine


def test_chat_web_more_gpus_than_the_machine_has_is_one_line(monkeypatch):
    """--num-gpus 8 on a one-GPU machine raised a plain ValueError after the flags were checked, which
    script_main (rightly, for a bug) shows as a traceback: a request this machine cannot meet is a
    RequestError, said in one line."""
    from types import SimpleNamespace

    import torch

    from nanochat.errors import RequestError
    from scripts import chat_web

    monkeypatch.setattr("nanochat.common.init_runtime", lambda device, dtype: SimpleNamespace(device_type="cuda",
                                                                                    device=torch.device("cuda")))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RequestError, match=r"^--num-gpus: got 8; this machine has 1 GPU\(s\)$"):
        chat_web.load_replicas(chat_web.parse_args(["--num-gpus", "8"]))


def test_chat_web_checks_step_and_model_tag_as_chat_cli_does(tmp_path, monkeypatch):
    """--step abc was a ValueError traceback from the loader once the runtime was up, and a --model-tag
    with no checkpoints "no checkpoint recorded in .../d20 (latest.json missing)", naming neither the
    flag nor the tags there are; chat_cli said both in one line before loading."""
    from nanochat.errors import RequestError
    from scripts import chat_web

    for step in ("abc", "-1"):
        with pytest.raises(ValueError, match=f"^-s/--step: got '{step}'; accepted: latest or an integer >= 0$"):
            chat_web.validate(chat_web.parse_args(["--step", step]))
    (tmp_path / "checkpoints" / "sft" / "d2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "sft" / "d2" / "latest.json").write_text("{}")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setattr(chat_web, "load_replicas", lambda args: pytest.fail("the model loaded"))
    with pytest.raises(RequestError, match=r"^-g/--model-tag: got 'd20'; accepted: d2 \(the sft models under "):
        chat_web.main(["--model-tag", "d20", "--device", "cpu"])


def test_chat_cli_top_k_error_offers_only_what_a_flag_can_take():
    """-k -1 said "accepted: None or an integer >= 0": the engine's API words; no flag value is None."""
    from scripts import chat_cli

    with pytest.raises(ValueError) as e:
        chat_cli.parse_args(["-k", "-1"])
    assert str(e.value) == "--top-k: got -1; accepted: an integer >= 0 (0 = off)"


def saved_convs(d) -> list[dict]:
    return json.loads(d.execute_script("return localStorage.getItem('nanochat.conversations')"))


@pytest.mark.browser
def test_chat_page_storage_context_cut_off_key_and_settings(browser, quick):
    engine, url, tokenizer = quick
    d = browser
    # 1. "New chat" then back to a chat, again and again: each left an empty, unlisted chat saved at the
    # top of the list; a few dozen of them pushed real chats past the 50 kept, without a word (and with
    # 50 saved, opening a new chat dropped the oldest at once)
    convs = [{"id": f"c{i}", "title": f"chat {i}", "updated": 1000 + i,
              "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
             for i in range(50)]
    fresh_page(d, url, {"nanochat.conversations": json.dumps(convs), "nanochat.current": "c49"})
    for _ in range(3):
        q(d, "#new-chat")[0].click()
        next(b for b in q(d, "#history .conv button.open") if b.text == "chat 49").click()
    assert sorted(c["id"] for c in saved_convs(d)) == sorted(c["id"] for c in convs)
    q(d, "#new-chat")[0].click()
    assert len(saved_convs(d)) == 51   # and the open new chat (a reload shows it)
    # another tab's save leaves this tab's unused new chat out (not its open one): it stays open here
    d.execute_script("window.__events = 0; addEventListener('storage', () => window.__events++)")
    first = d.current_window_handle
    d.switch_to.new_window("tab")
    try:
        load_page(d, url + "/")
        next(b for b in q(d, "#history .conv button.open") if b.text == "chat 48").click()
        chat_once(d, engine, "from the second tab")
    finally:
        d.close()
        d.switch_to.window(first)
    wait(lambda: d.execute_script("return window.__events"), what="the other tab's save seen")
    assert [c.text for c in q(d, "#history .conv.active .open")] == ["New chat"]

    # 2. a reply the model's context (the scripted engine's 256 tokens) cut off said "cut off at the max
    # tokens limit" (400 here): raising that cannot help it, a new chat can
    app = create_app(WorkerPool([Worker(engine, "w-context")]), ServerSettings(model_name="tiny-test",
                                                                               default_max_tokens=400))
    server, context_url = serve_in_thread(app)   # /health publishes the context (context_len)
    try:
        fresh_page(d, context_url)
        with replying(engine, "word " * 300):
            send(d, "tell me a long story")
            meta = wait(lambda: [m.text for m in q(d, ".msg.assistant .meta") if "tokens" in m.text], what="its line")
        assert meta[-1].endswith("cut off: this chat filled the model's context (256 tokens); start a new chat to "
                                 "go on"), meta
        q(d, "#new-chat")[0].click()   # (this chat is full: the next message would be refused)
        assert "Done." in chat_once(d, engine, "short")
        assert "cut off" not in q(d, ".msg.assistant .meta")[-1].text
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)

    # 3. an API key pasted with a curly quote: fetch refuses the header, and the page said "could not reach
    # the server: is it running?"
    fresh_page(d, url)
    d.execute_script("document.getElementById('settings').open = true")
    q(d, "#api-key")[0].send_keys("s3cret\u2019key")
    send(d, "hello")
    wait(lambda: q(d, ".msg.assistant.error"), what="the refused key said")
    assert "API key under Settings holds a character no API key has" in last_reply(d), last_reply(d)
    assert "could not reach" not in last_reply(d)

    # 4. a max tokens saved for a server with a higher limit (4096) showed 4096 while 450 was sent
    fresh_page(d, url, {"nanochat.settings.v2": json.dumps({"max_tokens": "4096"})})
    wait(lambda: q(d, "#max-tokens")[0].get_attribute("max") == "450", what="the server's limits")
    assert q(d, "#max-tokens")[0].get_property("value") == "450"
    assert "Done." in chat_once(d, engine, "hi") and engine.calls[-1]["max_tokens"] <= 450
