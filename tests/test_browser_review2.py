"""Second review of the chat page in headless Chromium: one test per defect found by using it as a
demanding user on desktop and on a phone. Inline code holding backticks, right-to-left text,
focus after Send/Stop/Regenerate/Edit, a long model name widening a phone's page, a 401 that did
not say where the key goes, network failures shown as the browser's bare words, a phone's Enter key
(no Shift there) that could not start a new line, and a full localStorage that lost every new chat.
Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import json
import time

import pytest
import test_browser
from test_browser import chat_once, fresh_page, last_reply, q, replying, send, streaming, wait

from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread

pytestmark = pytest.mark.browser

# the same fixtures (one Chromium and one scripted server for this module); assigned, not imported, so
# that linters do not read the tests' arguments as redefinitions
browser, site, quick = test_browser.browser, test_browser.site, test_browser.quick


def active(d) -> str:
    return d.execute_script("const a = document.activeElement; return a.id || a.className || a.tagName")


def test_inline_code_holding_backticks(browser, quick):
    """Markdown's ``a`b`` (a run of n backticks closes only with n): the page cut it at the inner one."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    with replying(engine, "Use ``a`b`` or `` `x` `` and `y`; ``open` stays."):
        chat_once(d, engine, "backticks")
    bubble = q(d, ".msg.assistant .bubble")[-1]
    codes = [c.text for c in bubble.find_elements("css selector", "code.inline")]
    assert codes == ["a`b", "`x`", "y"], codes
    assert bubble.text == "Use a`b or `x` and y; ``open` stays."


def test_right_to_left_text(browser, quick):
    """Hebrew/Arabic messages were laid out left to right (punctuation on the wrong side); a code
    block inside one must stay left to right; a title cut at 60 UTF-16 units split an emoji."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    assert q(d, "#input")[0].get_attribute("dir") == "auto"
    direction = "return getComputedStyle(arguments[0]).direction"
    with replying(engine, "שלום, מה שלומך?\n```\nx = 1\n```"):
        chat_once(d, engine, "a" * 45 + "\U0001F600" * 20)
        chat_once(d, engine, "שלום עולם?")
    assert d.execute_script(direction, q(d, ".msg.user .bubble")[0]) == "ltr"
    assert d.execute_script(direction, q(d, ".msg.user .bubble")[-1]) == "rtl"
    assert d.execute_script(direction, q(d, ".msg.assistant .bubble")[-1]) == "rtl"
    assert d.execute_script(direction, q(d, ".msg.assistant .codeblock")[-1]) == "ltr"
    title = json.loads(d.execute_script("return localStorage.getItem('nanochat.conversations')"))[0]["title"]
    assert title == "a" * 45 + "\U0001F600" * 15, title   # whole characters, no lone surrogate


def test_focus_returns_to_the_message_box(browser, quick):
    """Send, Stop, Regenerate and an edit's Save hid or rebuilt the focused button: focus fell to
    <body>, so the next keystrokes went nowhere and a keyboard user started over from the top."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "first")
    q(d, "#input")[0].send_keys("second")
    q(d, "#send")[0].click()
    wait(lambda: len(q(d, ".msg.assistant .meta")) == 2 and not streaming(d), what="the second reply")
    assert active(d) == "input"
    calls = len(engine.calls)
    q(d, ".msg.assistant .regenerate")[-1].click()
    wait(lambda: len(engine.calls) == calls + 1 and not streaming(d), what="the regenerated reply")
    assert active(d) == "input"
    q(d, ".msg.user .edit")[0].click()
    assert d.execute_script("return document.activeElement.matches('.editor textarea')")
    q(d, ".editor .cancel")[0].click()
    assert active(d) == "input"
    q(d, ".msg.user .edit")[0].click()
    q(d, ".editor .save")[0].click()
    wait(lambda: len(engine.calls) == calls + 2 and not streaming(d), what="the edited resubmission")
    assert active(d) == "input"
    with replying(engine, "word " * 60, delay=0.05):
        send(d, "slowly")
        wait(lambda: streaming(d) and len(last_reply(d)) > 10, what="streaming")
        q(d, "#stop")[0].click()
        wait(lambda: not streaming(d), what="stopped")
    assert active(d) == "input"


def test_phone_enter_key_starts_a_new_line(browser, quick):
    """A phone's keyboard has no Shift+Enter: Enter sent, so a multi-line message was impossible.
    On a touch screen Enter is a new line and the Send button sends."""
    from selenium.webdriver.common.keys import Keys

    engine, url, tokenizer = quick
    d = browser
    d.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": True, "maxTouchPoints": 5})
    try:
        fresh_page(d, url)
        assert "Enter to send" not in q(d, "#empty")[0].text
        box, calls = q(d, "#input")[0], len(engine.calls)
        box.send_keys("line one", Keys.ENTER, "line two")
        time.sleep(0.2)
        assert len(engine.calls) == calls and box.get_attribute("value") == "line one\nline two"
        q(d, "#send")[0].click()
        wait(lambda: len(engine.calls) == calls + 1 and not streaming(d), what="Send to send")
        assert "line one\nline two<|user_end|>" in tokenizer.decode(engine.calls[-1]["prompt"])
    finally:
        d.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": False})


def test_api_key_error_says_where_the_key_goes_and_a_long_name_fits_a_phone(browser, quick):
    """401: "send 'Authorization: Bearer <key>'" means nothing to a web user: the page now opens
    Settings and says so; Regenerate after entering the key answers. And a long --model-name
    widened a phone's page (a sideways scroll bar under the header)."""
    engine, _, _ = quick
    d = browser
    name = "nanochat-sft-" + "d20_fp8_experiment_" * 4
    settings = ServerSettings(model_name=name, api_key="secret-key-123")
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w-auth")]), settings))
    try:
        d.get(url + "/")
        d.execute_script("localStorage.clear()")
        d.get(url + "/")
        wait(lambda: q(d, "#model-name")[0].text == name, what="the model name")
        send(d, "hello")
        wait(lambda: q(d, ".msg.assistant.error"), what="the 401 shown")
        assert "API key" in last_reply(d) and "Settings" in last_reply(d)
        assert d.execute_script("return document.getElementById('settings').open")
        q(d, "#api-key")[0].send_keys("secret-key-123")
        q(d, ".msg.assistant .regenerate")[-1].click()
        wait(lambda: not streaming(d) and "Done." in last_reply(d), what="the answer with the key")
        assert not q(d, ".msg.assistant.error")
        d.set_window_size(390, 844)
        time.sleep(0.3)
        widths = d.execute_script("const e = document.documentElement; return [e.scrollWidth, e.clientWidth]")
        assert widths[0] <= widths[1], f"the page scrolls sideways on a phone: {widths}"
    finally:
        d.set_window_size(1280, 860)
        server.should_exit = True
        server.thread.join(timeout=10)


BROKEN_FETCH = """window.__realFetch2 = window.__realFetch2 || window.fetch;
  window.fetch = (u, o) => {
    if (!String(u).includes('/v1/chat')) return window.__realFetch2(u, o);
    if (MODE === 'down') return Promise.reject(new TypeError('Failed to fetch'));
    const body = new ReadableStream({ start(c) {
      c.enqueue(new TextEncoder().encode('data: {"choices":[{"index":0,"delta":{"content":"Half"}}]}\\n\\n'));
      setTimeout(() => c.error(new TypeError('network error')), 50); } });
    return Promise.resolve(new Response(body, { status: 200, headers: { "Content-Type": "text/event-stream" } }));
  };"""


def test_network_failures_are_explained(browser, quick):
    """The server stopped (or restarting): the reply said only "Error: Failed to fetch" or "Error:
    network error", the browser's words; now it says what happened in a user's words."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    for case in ("down", "mid-stream"):
        d.execute_script(BROKEN_FETCH.replace("MODE", json.dumps(case)))
        send(d, "hello " + case)
        errors = 1 if case == "down" else 2
        wait(lambda: len(q(d, ".msg.assistant.error")) == errors, what=f"the {case} error")  # noqa: B023
        said = "could not reach the server" if case == "down" else "connection to the server broke"
        assert said in last_reply(d), last_reply(d)
        assert ("Half" in last_reply(d)) == (case == "mid-stream")
    d.execute_script("window.fetch = window.__realFetch2")
    assert "Done." in chat_once(d, engine, "again")


FULL_STORAGE = """const realSet = Storage.prototype.setItem;
  Storage.prototype.setItem = function (k, v) {
    if (k === 'nanochat.conversations' && String(v).length > 4400)
      throw new DOMException('full', 'QuotaExceededError');
    return realSet.call(this, k, v);
  };"""


def test_full_storage_makes_room_for_new_chats(browser, quick):
    """localStorage full (a few MB a site): every later save failed silently, so each new chat was
    gone after a reload. The oldest chats now make room, never the open one."""
    engine, url, _ = quick
    d = browser
    old = [{"id": f"old{i}", "title": f"old {i}", "updated": 1000 + i,
            "messages": [{"role": "user", "content": "x" * 2000}]} for i in range(2)]
    fresh_page(d, url, {"nanochat.conversations": json.dumps(old)})
    hook = d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FULL_STORAGE})
    try:
        d.refresh()
        wait(lambda: len(q(d, "#history .conv")) == 2, what="the old chats")
        q(d, "#new-chat")[0].click()
        chat_once(d, engine, "new " + "hello world " * 20)
        d.refresh()
        titles = wait(lambda: [c.get_attribute("title") for c in q(d, "#history .conv .open")], what="saved chats")
        assert titles[0].startswith("new hello") and titles[1:] == ["old 1"], titles
    finally:
        d.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook["identifier"]})


NO_ROOM_FOR_BIG = """const realSet = Storage.prototype.setItem;
  Storage.prototype.setItem = function (k, v) {
    if (k === 'nanochat.conversations' && String(v).includes('BIGCHAT'))
      throw new DOMException('full', 'QuotaExceededError');
    return realSet.call(this, k, v);
  };"""


def test_an_open_chat_too_big_to_store_alone_keeps_the_others(browser, quick):
    """The room-making loop dropped every other chat when the open one alone exceeded the quota:
    they vanished from the sidebar, and the next save that fitted made the loss permanent."""
    engine, url, _ = quick
    d = browser
    old = [{"id": f"old{i}", "title": f"old {i}", "updated": 1000 + i,
            "messages": [{"role": "user", "content": "x" * 100}]} for i in range(2)]
    fresh_page(d, url, {"nanochat.conversations": json.dumps(old)})
    hook = d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": NO_ROOM_FOR_BIG})
    try:
        d.refresh()
        wait(lambda: len(q(d, "#history .conv")) == 2, what="the old chats")
        q(d, "#new-chat")[0].click()
        chat_once(d, engine, "BIGCHAT: this one never fits, whatever else is dropped")
        assert len(q(d, "#history .conv")) == 3   # the old ones stay listed
        stored = json.loads(d.execute_script("return localStorage.getItem('nanochat.conversations')"))
        assert {"old0", "old1"} <= {c["id"] for c in stored}   # and stored, as they were
    finally:
        d.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook["identifier"]})


def test_a_chat_too_long_for_the_server_leaves_the_message_out_and_says_what_next(browser, quick):
    """A refusal of the whole chat's size (context_length_exceeded, ...): the new message is left
    out too (merged into the next it failed that one), and the page says a new chat is the way on
    if the next message is refused as well."""
    engine, url, tokenizer = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "first")
    d.execute_script("arguments[0].value = 'y'.repeat(600); arguments[0].dispatchEvent(new Event('input'))",
                     q(d, "#input")[0])   # 600 tokens: over the tiny model's 256-token context
    q(d, "#send")[0].click()
    wait(lambda: q(d, ".msg.assistant.error"), what="the refusal shown")
    assert "start a new chat" in last_reply(d) and "left out" in last_reply(d)
    assert "Done." in chat_once(d, engine, "second")
    assert "yyyyyyyy" not in tokenizer.decode(engine.calls[-1]["prompt"])


def test_a_message_refused_for_its_size_does_not_lock_up_the_chat(browser, quick):
    """A message over the server's size limit failed, and stayed in the history: merged into the next
    user message, it made every later one fail too until the user edited it or started a new chat.
    It is now left out of what the page sends, and its error says so."""
    engine, url, tokenizer = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "first")
    calls = len(engine.calls)
    box = q(d, "#input")[0]
    d.execute_script("arguments[0].value = 'x'.repeat(16001); arguments[0].dispatchEvent(new Event('input'))", box)
    q(d, "#send")[0].click()
    wait(lambda: q(d, ".msg.assistant.error"), what="the refusal shown")
    assert "left out of this chat" in last_reply(d) and len(engine.calls) == calls   # never reached the model
    assert "Done." in chat_once(d, engine, "second")
    prompt = tokenizer.decode(engine.calls[-1]["prompt"])
    assert "second" in prompt and "first" in prompt and "xxxxxxxx" not in prompt
