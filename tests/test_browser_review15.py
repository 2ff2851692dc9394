"""Fifteenth review of the chat page (nanochat/ui.html) in headless Chromium, as a demanding user: one
test per defect found. A reply streaming in a background tab was stored empty until it ended (its saves
ran in animation frames, which a hidden tab does not run), so a phone that discarded the tab lost it;
a keyboard user's focus fell to <body> whenever the conversation list was rebuilt (a chat opened or
deleted from it, the phone's drawer closing) and the message editor's box had no name; and with one
chat open in two tabs, the reply one tab was writing read "interrupted" in the other, a message sent
there raced its saves, and the other tab's saves threw away an edit being typed.
Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import json

import pytest
import test_browser
from test_browser import (
    chat_once,
    fresh_page,
    load_page,
    q,
    replying,
    send,
    streaming,
    wait,
)

pytestmark = pytest.mark.browser

# the same fixtures (assigned, not imported: linters would read the tests' arguments as redefinitions)
browser, site, quick = test_browser.browser, test_browser.site, test_browser.quick

SLOW = "word " * 40   # ~80 tokens: at 0.05 s a token, ~4 s of streaming
STORED = "JSON.parse(localStorage.getItem('nanochat.conversations'))[0].messages.at(-1)"


def press(d, *keys):
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(d).send_keys(*keys).perform()


def stored_mid_stream(d):
    """The last stored message if it is a reply stored while streaming, with text; else None."""
    m = json.loads(d.execute_script(f"return JSON.stringify({STORED})"))
    return m if m.get("streaming") and m["content"] else None


def hidden_then_stored(d):
    """In one go in the page: None while every token is stored already; else hide the page and say
    whether the stored reply then equals the one in memory (in a list, so that False is truthy)."""
    result = d.execute_script(
        f"const s = {STORED}; if (!state.busyReply || s.content === state.busyReply.content) return null;"
        f"document.dispatchEvent(new Event('visibilitychange')); return {STORED}.content === state.busyReply.content")
    return None if result is None else [result]


def meta(d) -> list[str]:
    return [m.text for m in q(d, ".msg.assistant .meta")]


def focused(d) -> str:
    return d.execute_script("const a = document.activeElement; return a.id ? '#' + a.id : "
                            "a.matches('#history .open') ? 'open:' + a.textContent : a.className || a.tagName")


def test_a_reply_streaming_in_a_background_tab_is_saved_as_it_comes(browser, quick):
    """Saves ran in requestAnimationFrame: in a hidden tab the stored reply stayed empty until it ended.
    Hiding the page now saves too (a phone may discard a hidden tab without a pagehide)."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    first = d.current_window_handle
    with replying(engine, SLOW, delay=0.05):
        send(d, "answer while I look elsewhere")
        wait(lambda: streaming(d) and q(d, ".msg.assistant .bubble")[-1].text, what="the first tokens")
        d.switch_to.new_window("tab")   # the chat's tab is hidden now: no animation frames there
        try:
            d.get(url + "/health")      # same origin: its localStorage
            saved = wait(lambda: stored_mid_stream(d), timeout=3, what="the reply stored while it streams in a hidden tab")
            assert saved["content"].startswith("word")
        finally:
            d.close()
            d.switch_to.window(first)
        wait(lambda: not streaming(d), timeout=10, what="the reply to end")
    # hiding the page saves what has come since the last (throttled) save
    with replying(engine, SLOW, delay=0.3):
        send(d, "and now slowly")
        d.execute_script("Object.defineProperty(document, 'visibilityState', {value: 'hidden', configurable: true})")
        try:
            result = wait(lambda: hidden_then_stored(d), timeout=8, what="tokens not stored yet, then the page hidden")
            assert result == [True], "hiding the page did not store the reply as it stands"
        finally:
            d.execute_script("delete document.visibilityState")
            q(d, "#stop")[0].click()
            wait(lambda: not streaming(d), what="stopped")


def test_the_focus_stays_in_the_conversation_list(browser, quick, tmp_path):
    """Opening or deleting a chat from the list (keyboard: Enter) rebuilt the list and dropped the focus
    to <body>; on a phone, opening one closed the drawer around the focused button. The editor's box
    had no accessible name."""
    from selenium.webdriver.common.keys import Keys

    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    for title in ("chat one", "chat two", "chat three"):
        q(d, "#new-chat")[0].click()
        chat_once(d, engine, title)
    d.execute_script("arguments[0].focus()", q(d, "#history .conv .open")[1])   # "chat two"
    press(d, Keys.ENTER)
    wait(lambda: q(d, ".msg.user .bubble")[0].text == "chat two", what="chat two opened")
    assert focused(d) == "open:chat two"
    press(d, Keys.TAB)
    assert focused(d) == "delete"
    press(d, Keys.ENTER)   # deletes "chat two": the focus goes to the row now in its place
    wait(lambda: len(q(d, "#history .conv")) == 2, what="chat two deleted")
    assert focused(d) == "open:chat one"
    q(d, ".msg.user .edit")[0].click()
    assert d.execute_script("return document.activeElement.getAttribute('aria-label')") == "Edit message"
    q(d, ".editor .cancel")[0].click()
    d.set_window_size(390, 844)   # a phone: the list is a drawer
    try:
        q(d, "#menu")[0].click()
        wait(lambda: focused(d) == "#new-chat", what="the drawer open")
        d.execute_script("arguments[0].focus()", q(d, "#history .conv .open")[1])
        press(d, Keys.ENTER)   # the other chat
        wait(lambda: d.execute_script("return getComputedStyle(document.getElementById('sidebar')).visibility")
             == "hidden", what="the drawer closed")
        d.save_screenshot(str(tmp_path / "phone_after_opening_a_chat.png"))
        assert focused(d) == "#menu"
    finally:
        d.set_window_size(1280, 860)


def test_one_chat_in_two_tabs(browser, quick, tmp_path):
    """The reply one tab writes read "interrupted" in another tab showing the chat, whose messages sent
    meanwhile raced the writer's saves; and each save there threw away an edit being typed."""
    from selenium.webdriver.common.keys import Keys

    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "shared chat")
    first = d.current_window_handle
    d.switch_to.new_window("tab")
    second = d.current_window_handle
    try:
        load_page(d, url + "/")
        wait(lambda: q(d, ".msg.user .edit"), what="the chat in the second tab")
        q(d, ".msg.user .edit")[0].click()
        q(d, ".editor textarea")[0].send_keys(" (my draft)")
        d.switch_to.window(first)
        with replying(engine, SLOW, delay=0.05):
            send(d, "from the first tab")
            wait(lambda: streaming(d) and q(d, ".msg.assistant .bubble")[-1].text, what="the first tab's reply")
            d.switch_to.window(second)
            wait(lambda: meta(d)[-1:] == ["being written in another tab"], what="the reply said to be written elsewhere")
            d.save_screenshot(str(tmp_path / "second_tab_while_the_first_writes.png"))
            assert [a.get_attribute("value") for a in q(d, ".editor textarea")] == ["shared chat (my draft)"]
            assert d.execute_script("return document.activeElement.matches('.editor textarea')")   # still typing there
            assert not q(d, ".editor .save")[0].is_enabled() and not q(d, "#send")[0].is_enabled()
            calls = len(engine.calls)
            q(d, "#input")[0].send_keys("wait for it", Keys.ENTER)   # not sent; the text stays
            assert len(engine.calls) == calls and q(d, "#input")[0].get_attribute("value") == "wait for it"
            d.switch_to.window(first)
            wait(lambda: not streaming(d), timeout=10, what="the first tab's reply to end")
        d.switch_to.window(second)
        wait(lambda: "tokens" in meta(d)[-1], what="the finished reply in the second tab")
        assert [a.get_attribute("value") for a in q(d, ".editor textarea")] == ["shared chat (my draft)"]
        assert q(d, ".editor .save")[0].is_enabled() and q(d, "#send")[0].is_enabled()
    finally:
        d.switch_to.window(second)
        d.close()
        d.switch_to.window(first)
