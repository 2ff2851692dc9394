"""Tenth review of the chat page (nanochat/ui.html) in headless Chromium, as a demanding user: one
test per defect found. A double-clicked Send stopped its own reply at once (Stop takes Send's place, the
second click landed on it), and a double-clicked Stop sent the draft; a streaming reply was rebuilt
at every token, so a finished code block's Copy pressed mid-stream did nothing and a selection in it
was dropped; a reply of the model's over the server's message limit was blamed on the user's new
message (said "send a shorter one" and left it out); a pasted block of code lost its first line's
indentation. Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import json
import time

import pytest
import test_browser
from test_browser import RECORD_BODIES, chat_once, fresh_page, last_reply, q, replying, send, streaming, wait

from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread

pytestmark = pytest.mark.browser

# the same fixtures (assigned, not imported: linters would read the tests' arguments as redefinitions)
browser, site, quick = test_browser.browser, test_browser.site, test_browser.quick


def double_click(d, css):
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(d).double_click(q(d, css)[0]).perform()


def test_a_double_click_on_send_or_stop_is_one_click(browser, quick):
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    with replying(engine, "one two three four", delay=0.05):
        q(d, "#input")[0].send_keys("double")
        double_click(d, "#send")   # its second click lands on Stop, shown in Send's place
        wait(lambda: not streaming(d) and q(d, ".msg.assistant .meta"), what="the reply")
    assert q(d, ".msg.assistant .meta")[-1].text != "stopped" and "four" in last_reply(d)
    with replying(engine, "slow " * 20, delay=0.1):
        send(d, "talk")
        wait(lambda: streaming(d) and last_reply(d), what="the reply streaming")
        q(d, "#input")[0].send_keys("my next question")
        calls = len(engine.calls)
        double_click(d, "#stop")   # its second click lands on Send: the draft went out
        wait(lambda: not streaming(d), what="stopped")
        time.sleep(0.3)
    assert q(d, ".msg.assistant .meta")[-1].text == "stopped"
    assert len(engine.calls) == calls and q(d, "#input")[0].get_attribute("value") == "my next question"


def test_a_streaming_reply_keeps_what_is_written(browser, site):
    """Copy on a finished code block, pressed as a person does (press, release a moment later) while
    the reply goes on, copies it; a selection in the written part stays as tokens arrive."""
    engine, url, _ = site
    d = browser
    fresh_page(d, url)
    d.execute_script("navigator.clipboard.writeText = async (t) => { window.__copied = t; };")
    with replying(engine, "Here:\n```py\nprint(1)\n```\n" + "more words " * 40, delay=0.04):
        send(d, "code")
        wait(lambda: "more words" in last_reply(d), what="the code block written")
        x, y = d.execute_script("const r = document.querySelector('.copy-code').getBoundingClientRect();"
                                "return [r.x + r.width / 2, r.y + r.height / 2]")
        for kind in ("mousePressed", "mouseReleased"):
            d.execute_cdp_cmd("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left",
                                                           "clickCount": 1})
            time.sleep(0.25)   # tokens arrive meanwhile
        d.execute_script("const r = document.createRange();"
                         "r.selectNodeContents(document.querySelector('.msg.streaming .bubble .text'));"
                         "getSelection().removeAllRanges(); getSelection().addRange(r);")
        text = last_reply(d)
        wait(lambda: len(last_reply(d)) > len(text) + 10, what="more tokens")
        assert streaming(d), "the reply ended: this test needs it streaming"
        assert d.execute_script("return getSelection().toString()") == "Here:"
        assert d.execute_script("return window.__copied") == "print(1)"
        q(d, "#stop")[0].click()
        wait(lambda: not streaming(d), what="stopped")


def test_a_model_reply_over_the_message_limit_is_not_blamed_on_the_new_message(browser, quick):
    engine, _, _ = quick
    d = browser
    settings = ServerSettings(model_name="tiny-test", max_message_chars=40)
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w10")]), settings))
    try:
        fresh_page(d, url)
        with replying(engine, "abcdefghij" * 6, delay=0.0):   # 60 characters: over the limit, sent back
            chat_once(d, engine, "hi")
        send(d, "short")
        wait(lambda: q(d, ".msg.assistant.error"), what="the refusal")
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
    said = last_reply(d)
    assert "'messages[1].content'" in said and "the model's replies" in said and "new chat" in said, said
    assert "send a shorter one" not in said, said
    saved = json.loads(d.execute_script("return localStorage.getItem('nanochat.conversations')"))[0]["messages"]
    assert not saved[-1].get("refused"), "the user's message was left out of the chat for the model's reply"


def test_pasted_code_keeps_its_first_line_indentation(browser, quick):
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    d.execute_script(RECORD_BODIES)
    code = "    x = 1\n    y = 2"
    d.execute_script("arguments[0].value = arguments[1]", q(d, "#input")[0], "\n  \n" + code + "\n\n")
    calls = len(engine.calls)
    q(d, "#send")[0].click()
    wait(lambda: len(engine.calls) > calls and not streaming(d), what="the reply")
    assert d.execute_script("return window.__bodies.pop().messages")[-1]["content"] == code
    q(d, ".msg.user .edit")[0].click()   # an edit is sent the same way
    d.execute_script("arguments[0].value = arguments[1]", q(d, ".editor textarea")[0], code.replace("1", "3") + "\n")
    q(d, ".editor .save")[0].click()
    wait(lambda: len(engine.calls) > calls + 1 and not streaming(d), what="the edited reply")
    assert d.execute_script("return window.__bodies.pop().messages")[-1]["content"] == code.replace("1", "3")
    chat_once(d, engine, "  hello  ")   # one line: trimmed as before
    assert d.execute_script("return window.__bodies.pop().messages")[-1]["content"] == "hello"
