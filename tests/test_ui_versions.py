"""Versions of a turn on the chat page (nanochat/ui.html), in headless Chromium: Regenerate and an edit's
Save add a version of that turn instead of deleting every later one; the "< n/m >" control switches
between versions, each with the conversation that followed it; the request's history is the path shown;
chats saved before versions load as they were; versions survive a reload; a version saved broken is
dropped, not the chat. Shares test_browser.py's fixtures: one Chromium and one scripted server."""

import json

import pytest
import test_browser
from test_browser import (RECORD_BODIES, chat_once, fake_stream, fresh_page, last_reply, q, replying, send,
                          streaming, wait)

pytestmark = pytest.mark.browser
browser, site, quick = test_browser.browser, test_browser.site, test_browser.quick   # fixtures, as test_ui_review8

PATH = ("return [...document.querySelectorAll('#thread .msg')].map((m) => ({role: m.classList.contains('user') ? "
        "'user' : 'assistant', content: m.querySelector('.bubble').textContent}))")


def path(d):
    """The conversation shown, as the API's messages."""
    return d.execute_script(PATH)


def counters(d):
    return [c.text for c in q(d, ".version > span")]


def step(d, index, label):
    """Press a version arrow of message `index` (its aria-label names it: "Previous version", ...)."""
    q(d, f'#thread .msg[data-index="{index}"] .version button[aria-label="{label}"]')[0].click()


def answer(d, engine, click, text):
    """Click something that asks the model again (Regenerate, an edit's Save); wait for `text` shown."""
    calls = len(engine.calls)
    with replying(engine, text, delay=0.0):
        click()
        wait(lambda: len(engine.calls) > calls and not streaming(d) and last_reply(d) == text, what=text)


def saved(d):
    return json.loads(d.execute_script("return localStorage.getItem('nanochat.conversations')"))


def test_regenerate_keeps_the_old_answer_and_history_is_the_path_shown(browser, quick):
    engine, url, tokenizer = quick
    d = browser
    fresh_page(d, url)
    d.execute_script(RECORD_BODIES)
    with replying(engine, "first answer", delay=0.0):
        chat_once(d, engine, "question")
    assert not q(d, ".version")   # one version: no control
    with replying(engine, "second answer", delay=0.1):   # slow: the arrows are off while it streams
        q(d, ".msg.assistant .regenerate")[0].click()
        wait(lambda: streaming(d) and counters(d) == ["2/2"], what="the new version streaming")
        assert all(b.get_attribute("disabled") for b in q(d, ".version button"))
        wait(lambda: not streaming(d), what="the new version")
    assert last_reply(d) == "second answer" and counters(d) == ["2/2"]
    assert q(d, ".version")[0].get_attribute("aria-label") == "Version 2 of 2"
    step(d, 1, "Previous version")
    assert last_reply(d) == "first answer" and counters(d) == ["1/2"]
    # at the first version its arrow is off, and the focus is on the other: Enter steps back by keyboard
    active = d.switch_to.active_element
    assert active.get_attribute("aria-label") == "Next version"
    assert q(d, '.version button[aria-label="Previous version"]')[0].get_attribute("disabled")
    from selenium.webdriver.common.keys import Keys

    active.send_keys(Keys.ENTER)
    assert last_reply(d) == "second answer" and counters(d) == ["2/2"]
    step(d, 1, "Previous version")
    # a new turn continues the version shown, and is sent exactly the path shown before it
    with replying(engine, "follow-up answer", delay=0.0):
        chat_once(d, engine, "and then?")
    sent = d.execute_script("return window.__bodies.pop().messages")
    assert sent == path(d)[:-1] == [{"role": "user", "content": "question"},
                                    {"role": "assistant", "content": "first answer"},
                                    {"role": "user", "content": "and then?"}]
    assert "second answer" not in tokenizer.decode(engine.calls[-1]["prompt"])
    step(d, 1, "Next version")   # the other version has no follow-up
    assert [m["content"] for m in path(d)] == ["question", "second answer"]
    # a failed reply regenerated is replaced, not kept as a version
    fake_stream(d, ['{"choices":[{"index":0,"delta":{"content":"Half"}}]}'])
    send(d, "fail")
    wait(lambda: q(d, ".msg.assistant.error"), what="the failed reply")
    d.execute_script("window.__fake = null")
    answer(d, engine, lambda: q(d, ".msg.assistant .regenerate")[-1].click(), "fixed")
    assert counters(d) == ["2/2"] and not q(d, ".msg.error")


def test_editing_an_earlier_message_keeps_the_later_turns(browser, quick):
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    d.execute_script(RECORD_BODIES)
    for text in ("one", "two"):
        with replying(engine, "answer " + text, delay=0.0):
            chat_once(d, engine, text)
    old = path(d)

    def edit(text):
        q(d, ".msg.user .edit")[0].click()
        area = q(d, ".editor textarea")[0]
        area.clear()
        area.send_keys(text)
        q(d, ".editor .save")[0].click()

    answer(d, engine, lambda: edit("uno"), "answer uno")
    assert [m["content"] for m in path(d)] == ["uno", "answer uno"] and counters(d) == ["2/2"]
    assert d.execute_script("return window.__bodies.pop().messages") == path(d)[:1]
    step(d, 0, "Previous version")
    assert path(d) == old and counters(d) == ["1/2"]   # the later turns are back
    # a version inside a version: regenerating the old chat's last answer; the edit keeps it
    answer(d, engine, lambda: q(d, ".msg.assistant .regenerate")[-1].click(), "answer two again")
    assert counters(d) == ["1/2", "2/2"]
    assert d.execute_script("return window.__bodies.pop().messages") == path(d)[:-1] == old[:-1]
    step(d, 0, "Next version")
    assert [m["content"] for m in path(d)] == ["uno", "answer uno"]
    step(d, 0, "Previous version")
    assert [m["content"] for m in path(d)] == ["one", "answer one", "two", "answer two again"]
    assert counters(d) == ["1/2", "2/2"]
    # a phone: the control sits with the answer's actions, and nothing scrolls sideways
    d.set_window_size(375, 740)
    try:
        d.execute_script("document.querySelectorAll('.meta').forEach((m) => m.textContent = "
                         "'123 tokens \u00b7 45.6 tok/s \u00b7 cut off at the max tokens limit')")
        widths = d.execute_script("const e = document.documentElement, m = document.getElementById('messages');"
                                  "return [e.scrollWidth - e.clientWidth, m.scrollWidth - m.clientWidth]")
        assert widths == [0, 0], f"the page scrolls sideways on a phone: {widths}"
        assert all(b.is_displayed() for b in q(d, ".version button"))
    finally:
        d.set_window_size(1280, 860)


OLD_CHAT = {"id": "old1", "title": "old question", "updated": 1,
            "messages": [{"role": "user", "content": "old question"},
                         {"role": "assistant", "content": "old answer", "meta": "2 tokens"}]}
BROKEN = {"id": "bad1", "title": "broken versions", "updated": 0,   # each: dropped, the message kept
          "messages": [{"role": "user", "content": "a", "versions": "x"},
                       {"role": "assistant", "content": "b", "versions": [[{"role": "user", "content": "c"}], None]},
                       {"role": "user", "content": "d", "versions": [None, None]},
                       {"role": "assistant", "content": "e", "versions": [[{"role": "assistant", "content": 5}], None]}]}


def test_a_chat_saved_before_versions_loads_and_versions_survive_a_reload(browser, quick):
    engine, url, _ = quick
    d = browser
    fresh_page(d, url, {"nanochat.conversations": json.dumps([OLD_CHAT, BROKEN]), "nanochat.current": "old1"})
    assert path(d) == [{"role": "user", "content": "old question"}, {"role": "assistant", "content": "old answer"}]
    assert not q(d, ".version") and q(d, ".msg.assistant .meta")[0].text == "2 tokens"
    answer(d, engine, lambda: q(d, ".msg.assistant .regenerate")[0].click(), "new answer")
    assert counters(d) == ["2/2"]
    # stored in the chat format as before: `messages` is the path shown, the old version hangs off its place
    chat = next(c for c in saved(d) if c["id"] == "old1")
    assert [m["content"] for m in chat["messages"]] == ["old question", "new answer"]
    assert chat["messages"][1]["versions"] == [[OLD_CHAT["messages"][1]], None]
    d.refresh()
    wait(lambda: counters(d) == ["2/2"], what="the versions after a reload")
    step(d, 1, "Previous version")
    assert last_reply(d) == "old answer" and q(d, ".msg.assistant .meta")[0].text == "2 tokens"
    d.refresh()   # the version shown is saved too
    wait(lambda: counters(d) == ["1/2"] and last_reply(d) == "old answer", what="the version shown after a reload")
    # broken versions (a hand edit, another app) are dropped; the chat and its messages stay
    q(d, "#history .conv .open")[1].click()
    assert [m["content"] for m in path(d)] == ["a", "b", "d", "e"] and not q(d, ".version")
    assert "Done." in chat_once(d, engine, "still works")
