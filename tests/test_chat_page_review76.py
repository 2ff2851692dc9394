"""Seventy-sixth review of the chat page (nanochat/ui.html) in headless Chromium, as a demanding user: one
test per defect found. An error worded otherwise than OpenAI's {"error": {"message"}} (a string `error`,
FastAPI's `detail`, a proxy's HTML page) showed an empty "Error: " or a bare "HTTP 502"; settings changed
in one tab were not followed by another, whose next save put its old ones back; a reply waiting in the
server's line showed only a blinking cursor, for as long as the wait lasted; and a screen reader heard the
chat as one run of text (nothing said who wrote each message or which chat was open), never heard a code
block's "Copied", and heard the retry countdown read out every second.
Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import threading

import pytest
import test_browser
from test_browser import (
    chat_once,
    fake_stream,
    fresh_page,
    last_reply,
    load_page,
    q,
    replying,
    send,
    streaming,
    type_into,
    wait,
)

pytestmark = pytest.mark.browser

# the same fixtures (assigned, not imported: linters would read the tests' arguments as redefinitions)
browser, site, quick = test_browser.browser, test_browser.site, test_browser.quick

# Until `window.__answer = null`, the page's chat requests get this [status, content type, body, headers]
ANSWER = """window.__answer = arguments[0];
  if (!window.__answerFetch) {
    window.__answerFetch = window.fetch;
    window.fetch = (u, o) => {
      if (!String(u).includes('/v1/chat') || !window.__answer) return window.__answerFetch(u, o);
      const [status, type, body, headers] = window.__answer;
      if (window.__times !== undefined && window.__times-- <= 0) return window.__answerFetch(u, o);
      return Promise.resolve(new Response(body, { status, headers: Object.assign({ 'Content-Type': type }, headers) }));
    };
  }"""


def failed_reply(d) -> str:
    wait(lambda: not streaming(d) and q(d, ".msg.assistant.error"), what="the failed reply")
    return last_reply(d)


def test_an_error_worded_otherwise_than_openais_is_said(browser, quick):
    """Only {"error": {"message"}} was read: {"error": "..."} (Ollama's, many proxies') showed "Error: " and
    nothing after it, FastAPI's {"detail": ...} and a proxy's HTML error page a bare "HTTP 404" / "HTTP 502";
    an error event mid-stream with a string `error` also an empty "Error: "."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    cases = [((500, "application/json", '{"error": "the model crashed"}', {}), ["the model crashed"]),
             ((404, "application/json", '{"detail": "Not Found"}', {}), ["Not Found"]),
             ((502, "text/html", "<html><body><h1>502 Bad Gateway</h1></body></html>", {}),
              ["HTTP 502", "Bad Gateway", "proxy"]),
             ((500, "application/json", '{"error": {"code": "x"}}', {}), ["HTTP 500 (Internal Server Error)"])]
    for answer, said in cases:
        d.execute_script(ANSWER, list(answer))
        send(d, f"status {answer[0]}")
        reply = failed_reply(d)
        assert all(s in reply for s in said) and "<" not in reply, (answer, reply)
    d.execute_script("window.__answer = null")
    fake_stream(d, ['{"choices":[{"index":0,"delta":{"content":"Half"}}]}', '{"error": "the model crashed mid-reply"}'])
    send(d, "mid-stream")
    reply = failed_reply(d)
    assert reply.startswith("Half") and reply.endswith("Error: the model crashed mid-reply"), reply
    fake_stream(d, ['{"error": {}}'])
    send(d, "an empty error")
    assert failed_reply(d).endswith("Error: the server reported an error it did not describe")
    d.execute_script("window.__fake = null")
    assert "Done." in chat_once(d, engine, "and on")


def test_settings_changed_in_another_tab_are_followed(browser, quick):
    """Tab B's top-k was not followed by tab A: A went on sending its own, and A's next change of any setting
    saved its old top-k back over B's."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    first = d.current_window_handle
    d.switch_to.new_window("tab")
    try:
        load_page(d, url + "/")
        d.execute_script("document.getElementById('settings').open = true")
        type_into(q(d, "#top-k")[0], "3")
        q(d, "#max-tokens")[0].click()   # the field's change
    finally:
        d.close()
        d.switch_to.window(first)
    d.execute_script("document.getElementById('settings').open = true")
    wait(lambda: q(d, "#top-k")[0].get_attribute("value") == "3", timeout=3, what="the other tab's top-k shown")
    type_into(q(d, "#max-tokens")[0], "100")
    q(d, "#top-k")[0].click()
    chat_once(d, engine, "hello")
    assert (engine.calls[-1]["top_k"], engine.calls[-1]["max_tokens"]) == (3, 100)
    assert d.execute_script("return JSON.parse(localStorage.getItem('nanochat.settings.v2'))") == {
        "top_k": "3", "max_tokens": "100"}


def test_a_reply_waiting_in_the_servers_line_says_so(browser, quick, monkeypatch):
    """Every replica busy: the page showed an empty reply with a blinking cursor, nothing more, for as long as
    the wait lasted. The server's keep-alives now put a line above the message box, gone with the first token."""
    import httpx

    import nanochat.server

    engine, url, _ = quick
    d = browser
    monkeypatch.setattr(nanochat.server, "KEEPALIVE_S", 0.2)   # the server's 2 s, shortened
    fresh_page(d, url)
    gate, old = threading.Event(), engine.gate
    engine.gate = gate

    def other_client():   # holds the server's one worker until the gate opens
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            for _ in r.iter_lines():
                pass
    calls = len(engine.calls)
    other = threading.Thread(target=other_client)
    other.start()
    try:
        wait(lambda: len(engine.calls) > calls, what="the other client's request running")
        send(d, "am I in line?")
        box = wait(lambda: [b for b in q(d, "#retry") if b.is_displayed()], timeout=5, what="the wait said")[0]
        assert "Waiting for the model" in box.text and box.get_attribute("role") == "status"
        assert streaming(d) and last_reply(d) == ""
    finally:
        gate.set()
        engine.gate = old
        other.join(timeout=10)
    wait(lambda: not streaming(d) and "Done." in last_reply(d), what="the reply")
    assert not q(d, "#retry")[0].is_displayed()


def headings(d) -> list:
    """The headings the accessibility tree gives the chat, as a screen reader gets them."""
    tree = d.execute_cdp_cmd("Accessibility.getFullAXTree", {})["nodes"]
    return [n["name"]["value"] for n in tree if n.get("role", {}).get("value") == "heading"
            and not n.get("ignored") and n.get("name")]


def test_a_screen_reader_hears_who_wrote_each_message_and_which_chat_is_open(browser, quick):
    """The log read as one run of text: nothing said which message was the user's and which the model's (told
    apart on screen by side and colour alone); the open chat was marked by its colour alone, and each chat's
    x was "Delete conversation", the same for every one."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "first chat")
    q(d, "#new-chat")[0].click()
    chat_once(d, engine, "hello")
    chat_once(d, engine, "again")
    assert [h for h in headings(d) if h.endswith("said:")] == ["You said:", "nanochat said:"] * 2
    size = d.execute_script("const r = document.querySelector('.msg h2').getBoundingClientRect(); return [r.width, r.height]")
    assert size == [1, 1] and q(d, ".msg.user .bubble")[0].text == "hello", size   # not on screen
    current = d.execute_script("return [...document.querySelectorAll('#history .open')]"
                               ".map((b) => [b.textContent, b.getAttribute('aria-current')])")
    assert current == [["hello", "page"], ["first chat", None]], current
    labels = [b.get_attribute("aria-label") for b in q(d, "#history .delete")]
    assert labels == ["Delete conversation: hello", "Delete conversation: first chat"], labels
    q(d, ".msg.user .edit")[0].click()   # the editor in the bubble's place: the heading stays
    assert [h for h in headings(d) if h.endswith("said:")][:1] == ["You said:"]


LIVE = """window.__said = [];
  new MutationObserver(() => {
    for (const r of document.querySelectorAll('[role=status], [role=alert], [aria-live]'))
      if (!r.closest('[aria-hidden=true]') && !r.hidden && r.textContent && r.textContent !== r.__last) {
        r.__last = r.textContent; if (!r.closest('#messages')) window.__said.push(r.textContent);
      }
  }).observe(document.body, { subtree: true, childList: true, characterData: true, attributes: true });"""


def test_a_screen_reader_hears_copied_once_and_a_retry_once(browser, quick):
    """A code block's Copy is named by its aria-label ("Copy code"): its "Copied" was never said; and the retry
    countdown, a live region, was read out each second (up to 30 s of it)."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    with replying(engine, "Here:\n```py\nx = 1\n```\n", delay=0.0):
        chat_once(d, engine, "code")
    d.execute_script("navigator.clipboard.writeText = async (t) => { window.__copied = t; };" + LIVE)
    q(d, ".copy-code")[0].click()
    wait(lambda: "Copied" in d.execute_script("return window.__said"), timeout=3, what="'Copied' said")
    assert d.execute_script("return window.__copied") == "x = 1"
    d.execute_script("window.__said = []; window.__times = 1")   # one 429, then the server
    d.execute_script(ANSWER, [429, "application/json", '{"error": {"message": "busy"}}', {"Retry-After": "2"}])
    send(d, "busy?")
    wait(lambda: not streaming(d) and "Done." in last_reply(d), timeout=8, what="the retried reply")
    said = [s for s in d.execute_script("return window.__said") if "retry" in s]
    assert said == ["Server busy, retrying in 2 s (retry 1 of 5)"], said
    d.execute_script("window.__answer = null")


def test_a_deleted_chat_can_be_brought_back(browser, quick):
    """A chat's x deleted it at once, for good: on a phone every row's x is shown, a finger's width from the
    title that opens the chat. The last chat deleted can be brought back (opened again if it was open)."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "keep me")
    q(d, "#new-chat")[0].click()
    chat_once(d, engine, "other")
    d.execute_script("arguments[0].click()", q(d, "#history .delete")[1])   # "keep me", not open
    wait(lambda: [c.text for c in q(d, "#history .open")] == ["other"], what="the chat deleted")
    undo = q(d, "#undo")[0]
    assert undo.is_displayed() and "keep me" in undo.text
    q(d, "#undo .undo")[0].click()
    assert [c.text for c in q(d, "#history .open")] == ["other", "keep me"] and not q(d, "#undo")[0].is_displayed()
    assert q(d, ".msg.user .bubble")[0].text == "other"
    assert d.execute_script("return document.activeElement.textContent") == "keep me"
    # the open one: back, and open again; stored as before
    d.execute_script("arguments[0].click()", q(d, "#history .delete")[0])
    wait(lambda: q(d, ".msg.user .bubble")[0].text == "keep me", what="the other chat opened")
    q(d, "#undo .undo")[0].click()
    assert q(d, ".msg.user .bubble")[0].text == "other" and len(q(d, ".msg")) == 2
    d.refresh()
    wait(lambda: len(q(d, "#history .conv")) == 2, what="both chats after a reload")
    assert q(d, ".msg.user .bubble")[0].text == "other"


def test_a_touch_screen_gets_buttons_a_finger_can_hit(browser, quick):
    """On a touch screen Copy, Regenerate, Edit and the version arrows were 20-22 px high (the arrows 22 px
    wide), a few px apart: a finger meant for Copy regenerated the answer."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    with replying(engine, "Code:\n```py\nx = 1\n```\n", delay=0.0):
        chat_once(d, engine, "code")
        q(d, ".regenerate")[0].click()
        wait(lambda: not streaming(d) and q(d, ".msg.assistant .meta"), what="the second version")
    sizes = ("return [...document.querySelectorAll('#thread button')].filter((b) => b.offsetParent)"
             ".map((b) => [b.className, b.getBoundingClientRect().width, b.getBoundingClientRect().height])")
    d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 1,
                                                              "mobile": True})
    d.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": True, "maxTouchPoints": 5})
    try:
        wait(lambda: d.execute_script("return matchMedia('(pointer: coarse)').matches"), what="a touch screen")
        buttons = d.execute_script(sizes)
        assert {b[0].split()[0] for b in buttons} >= {"edit", "copy", "copy-code", "regenerate", "prev", "next"}
        small = [b for b in buttons if min(b[1], b[2]) < 36]
        assert not small, small
    finally:
        d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
        d.execute_cdp_cmd("Emulation.setTouchEmulationEnabled", {"enabled": False})
    assert max(b[2] for b in d.execute_script(sizes)) < 30   # a mouse: the compact row as it was
