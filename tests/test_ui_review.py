"""Review of the chat page (nanochat/ui.html) against issue #7 in headless Chromium, as a demanding user
on a phone (375x667, touch) and on a desktop: one test per group of defects found, each check failing on
the page before its fix. On a phone the closed drawer's controls were still reached by Tab (and its
shadow showed down the left edge), the drawer's button did not say whether it was open and Escape did
not close it, only the open chat could be deleted (its x showed on hover alone), the settings' fields
were small enough for iOS to zoom the page on focus, and a long code-block language pushed "Copy" onto
two lines. A streaming code block was rebuilt at every token: its sideways scroll jumped back to the
start while one read a long line. The message editor ignored Enter and Escape and stayed three lines
tall for a long message; the message box showed no focus; and a browser that stores nothing (storage
off, a private window's zero quota) was told "Conversations are stored only in this browser".
Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import json
import time

import pytest
import test_browser
from test_browser import (
    chat_once,
    fake_stream,
    fresh_page,
    last_reply,
    q,
    replying,
    send,
    streaming,
    wait,
)

pytestmark = pytest.mark.browser

# the same fixtures (assigned, not imported: linters would read the tests' arguments as redefinitions)
browser, site, quick = test_browser.browser, test_browser.site, test_browser.quick

SIDEBAR_VISIBILITY = ("return [...document.querySelectorAll('#sidebar button, #sidebar summary, #sidebar input')]"
                      ".map((e) => getComputedStyle(e).visibility)")


def phone(d, on: bool) -> None:
    """A 375x667 touch screen (pointer: coarse), or back to the desktop window."""
    if on:
        d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                          {"width": 375, "height": 667, "deviceScaleFactor": 1, "mobile": True})
        d.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": True, "maxTouchPoints": 5})
    else:
        d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        d.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": False})


def active(d) -> str:
    return d.execute_script("const a = document.activeElement; return a.id || a.className || a.tagName")


def test_a_phone_drawer_settings_code_headers_and_message_box(browser, quick, tmp_path):
    _, url, _ = quick
    d = browser
    chats = [{"id": f"c{i}", "title": f"chat {i}", "updated": 1000 + i,
              "messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "Done."}]}
             for i in range(2)]
    fresh_page(d, url, {"nanochat.conversations": json.dumps(chats), "nanochat.current": "c1"})
    phone(d, True)
    try:
        d.refresh()
        wait(lambda: len(q(d, "#history .conv")) == 2, what="the saved chats")
        # closed: nothing in the drawer takes the focus (the open chat's x did, off screen), no shadow
        assert set(d.execute_script(SIDEBAR_VISIBILITY)) == {"hidden"}
        assert d.execute_script("return getComputedStyle(document.getElementById('sidebar')).boxShadow") == "none"
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        d.execute_script("document.getElementById('input').focus()")
        for _ in range(4):
            ActionChains(d).send_keys(Keys.TAB).perform()
            assert not d.execute_script("return document.getElementById('sidebar').contains(document.activeElement)")
        assert q(d, "#menu")[0].get_attribute("aria-expanded") == "false"
        q(d, "#menu")[0].click()
        assert q(d, "#menu")[0].get_attribute("aria-expanded") == "true" and active(d) == "new-chat"
        # a phone has no hover: every chat's x is there, not only the open one's
        assert d.execute_script("return [...document.querySelectorAll('#history .delete')]"
                                ".map((b) => getComputedStyle(b).visibility)") == ["visible", "visible"]
        d.execute_script("document.getElementById('settings').open = true")
        sizes = d.execute_script("return [...document.querySelectorAll('#settings input:not([type=range])')]"
                                 ".map((e) => parseFloat(getComputedStyle(e).fontSize))")
        assert len(sizes) == 3 and min(sizes) >= 16, f"iOS zooms the page into a field under 16px: {sizes}"
        time.sleep(0.3)   # the slide
        d.save_screenshot(str(tmp_path / "phone_drawer.png"))
        ActionChains(d).send_keys(Keys.ESCAPE).perform()
        assert q(d, "#menu")[0].get_attribute("aria-expanded") == "false" and active(d) == "menu"
        assert "drawer" not in q(d, "#app")[0].get_attribute("class")

        # the message box grows with its lines (Enter is a new line on a touch screen) and shrinks on send
        box = q(d, "#input")[0]
        one = box.size["height"]
        box.send_keys("one\ntwo\nthree")
        assert box.size["height"] > one * 2
        lang = "a-language-tag-a-model-made-up-that-is-longer-than-a-phone-is-wide"
        fake_stream(d, [json.dumps({"choices": [{"index": 0, "delta": {"content":
                        f"Two:\n```{lang}\nx = 1\n```\n```py\ny = 2\n```\nend"}}]}), "[DONE]"])
        q(d, "#send")[0].click()
        wait(lambda: not streaming(d) and "end" in last_reply(d), what="the reply")
        assert abs(box.size["height"] - one) < 2
        heights = d.execute_script("return [...document.querySelectorAll('.copy-code')]"
                                   ".map((b) => b.getBoundingClientRect().height)")
        assert heights[0] == heights[1], f"a long language tag broke Copy over two lines: {heights}"
        assert q(d, ".codehead span")[0].text == lang
        assert d.execute_script("return document.documentElement.scrollWidth") <= 375
        d.save_screenshot(str(tmp_path / "phone_chat.png"))
    finally:
        d.execute_script("window.__fake = null")
        phone(d, False)


INCREMENTAL = """const text = arguments[0], live = document.createElement('div'), bad = [];
  for (let n = 1; n <= text.length; n++) {
    renderContent(live, text.slice(0, n));
    const fresh = document.createElement('div'); renderContent(fresh, text.slice(0, n));
    if (live.innerHTML !== fresh.innerHTML) bad.push(n);
  }
  return bad;"""


def test_a_streaming_code_block_keeps_its_place_while_it_grows(browser, site):
    engine, url, _ = site
    d = browser
    fresh_page(d, url)
    # painted a token at a time, a reply shows what it shows painted at once (fences closing, CRLF, nesting)
    text = ("Say `x`:\n```py\r\nprint(1)\r\nprint(2)\r\n```\r\nthen\n````md\n```js\nx\n```\n````\n"
            "  ```sh\n  ls\n  ```\nend")
    assert d.execute_script(INCREMENTAL, text) == []
    d.execute_script("navigator.clipboard.writeText = async (t) => { window.__copied = t; };")
    line = "value = compute(" + ", ".join(f"argument_{i}" for i in range(20)) + ")\n"
    with replying(engine, "Here:\n```python\n" + line * 8 + "```\nDone.", delay=0.03):
        send(d, "long lines")
        pre = "document.querySelector('.msg.streaming pre')"
        wait(lambda: d.execute_script(f"const p = {pre}; return p && p.scrollWidth > p.clientWidth + 300"),
             what="a code line wider than its block")
        assert q(d, "#messages")[0].get_attribute("aria-busy") == "true"   # read out once written
        d.execute_script(f"const p = {pre}; p.scrollLeft = 150; p.__reader = true")
        shown = len(d.execute_script(f"return {pre}.textContent"))
        wait(lambda: len(d.execute_script(f"return {pre} ? {pre}.textContent : ''")) > shown + 20,
             what="more code")
        kept = d.execute_script(f"const p = {pre}; return [p.__reader === true, p.scrollLeft]")
        assert kept == [True, 150], f"the code block being written was rebuilt: {kept}"
        d.execute_script("document.querySelector('.msg.streaming .copy-code').click()")
        copied = wait(lambda: d.execute_script("return window.__copied"), what="a copy mid-stream")
        assert len(copied) > shown and (line * 8).startswith(copied)   # the code as it is now
        q(d, "#stop")[0].click()
        wait(lambda: not streaming(d), what="stopped")
    assert q(d, "#messages")[0].get_attribute("aria-busy") == "false"


QUOTA_ZERO = "Storage.prototype.setItem = function () { throw new DOMException('full', 'QuotaExceededError'); };"
BLOCKED = ("Object.defineProperty(window, 'localStorage', "
           "{get() { throw new DOMException('blocked', 'SecurityError'); }});")


def test_the_editor_keys_and_size_focus_shown_and_storage_that_keeps_nothing(browser, quick, tmp_path):
    engine, url, tokenizer = quick
    d = browser
    from selenium.webdriver.common.keys import Keys

    fresh_page(d, url)
    assert "stored only in this browser" in q(d, "#notice")[0].text
    long_message = "second\n" + "line\n" * 12 + "end"
    chat_once(d, engine, "first")
    d.execute_script("arguments[0].value = arguments[1]", q(d, "#input")[0], long_message)   # typing: Enter sends
    q(d, "#send")[0].click()
    wait(lambda: len(q(d, ".msg.assistant .meta")) == 2, what="the second reply")
    chat_once(d, engine, "third")
    q(d, ".msg.user .edit")[1].click()
    area = q(d, ".editor textarea")[0]
    assert d.execute_script("return arguments[0].scrollHeight <= arguments[0].clientHeight", area), \
        "a long message is edited in a box that scrolls"
    area.send_keys(Keys.ESCAPE)
    assert not q(d, ".editor") and q(d, ".msg.user .bubble")[1].text == long_message
    q(d, ".msg.user .edit")[1].click()
    area = q(d, ".editor textarea")[0]
    area.send_keys(Keys.CONTROL, "a")
    area.send_keys("edited")
    area.send_keys(Keys.SHIFT, Keys.ENTER)
    area.send_keys("twice")
    calls = len(engine.calls)
    d.execute_script("arguments[0].dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter', bubbles: true, "
                     "cancelable: true, isComposing: true}))", area)   # an IME's Enter picks a word
    time.sleep(0.2)
    assert len(engine.calls) == calls and area.get_attribute("value") == "edited\ntwice"
    area.send_keys(Keys.ENTER)
    wait(lambda: len(engine.calls) == calls + 1 and not streaming(d), what="Enter to save and submit")
    assert [b.text for b in q(d, ".msg.user .bubble")] == ["first", "edited\ntwice"]
    assert "edited\ntwice<|user_end|>" in tokenizer.decode(engine.calls[-1]["prompt"])
    d.save_screenshot(str(tmp_path / "desktop_edited.png"))

    # the message box shows that it has the focus; a chat row reached by keyboard shows its x
    border = "return getComputedStyle(document.getElementById('composer')).borderColor"
    d.execute_script("document.activeElement.blur()")
    idle = d.execute_script(border)
    d.execute_script("document.getElementById('input').focus()")
    assert d.execute_script(border) != idle
    q(d, "#new-chat")[0].click()
    chat_once(d, engine, "another chat")
    other = "document.querySelectorAll('#history .conv:not(.active)')[0]"
    assert d.execute_script(f"return getComputedStyle({other}.querySelector('.delete')).visibility") == "hidden"
    d.execute_script(f"{other}.querySelector('.open').focus()")
    assert d.execute_script(f"return getComputedStyle({other}.querySelector('.delete')).visibility") == "visible"
    assert d.execute_script("return [...document.querySelectorAll('button')]"
                            ".filter((b) => !(b.getAttribute('aria-label') || b.textContent.trim())).length") == 0

    # a browser that keeps nothing: the page works and says so, instead of "stored only in this browser"
    for hook_source in (QUOTA_ZERO, BLOCKED):
        hook = d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": hook_source})
        try:
            d.refresh()
            wait(lambda: q(d, "#model-name")[0].text == "tiny-test", what="the page")
            q(d, "#new-chat")[0].click()
            assert "Done." in chat_once(d, engine, "not kept")
            notice = q(d, "#notice")[0].text
            assert "not storing this chat" in notice and "stored only" not in notice, notice
        finally:
            d.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook["identifier"]})
    d.refresh()
    wait(lambda: q(d, "#model-name")[0].text == "tiny-test", what="the page")
    assert "stored only in this browser" in q(d, "#notice")[0].text
