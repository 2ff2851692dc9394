"""Eighth review of the chat page (nanochat/ui.html) in headless Chromium, as a demanding user: one
test per defect found, plus guards for what was probed and held. A reply stopped before its first
token went back to the model as an empty assistant turn; deleting another chat while a reply
streamed froze that reply on screen; an edited message kept its Edit button under the editor; Copy
said "Copied" when nothing was copied (and the fallback dropped the focus to <body>). Guards: an
error mid-stream, and a phone-wide page with unbroken words and HTML in a code block.
Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import json
import time

import pytest
import test_browser
from test_browser import (
    RECORD_BODIES,
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


def test_a_reply_stopped_before_its_first_token_is_not_sent_back(browser, quick):
    """Stop before any token (a slow prefill, a queue): the empty reply went back as history, so the
    model saw a chat where it had answered nothing - <|assistant_start|><|assistant_end|>."""
    engine, url, tokenizer = quick
    d = browser
    fresh_page(d, url)
    d.execute_script(RECORD_BODIES)
    with replying(engine, "slow", delay=0.6):   # Stop comes well before 0.6 s
        send(d, "first")
        wait(lambda: streaming(d), what="the reply to start")
        q(d, "#stop")[0].click()
        wait(lambda: not streaming(d), what="stopped")
        wait(engine.finished.is_set, what="the server's generation cancelled")
    assert last_reply(d) == "" and q(d, ".msg.assistant .meta")[-1].text == "stopped"   # still shown
    assert "Done." in chat_once(d, engine, "second")
    sent = d.execute_script("return window.__bodies.pop().messages")
    assert sent == [{"role": "user", "content": "first\n\nsecond"}], sent
    assert "<|assistant_start|><|assistant_end|>" not in tokenizer.decode(engine.calls[-1]["prompt"])


def test_an_error_mid_stream_is_shown_and_send_works_again(browser, quick):
    engine, url, tokenizer = quick
    d = browser
    fresh_page(d, url)
    with replying(engine, "one two three four five", delay=0.02):
        engine.fail_at = 3
        try:
            send(d, "first")
            wait(lambda: q(d, ".msg.assistant.error") and not streaming(d), what="the error shown")
        finally:
            engine.fail_at = None
    assert "Error: generation failed: RuntimeError: scripted failure" in last_reply(d)
    assert q(d, "#send")[0].is_displayed() and not q(d, "#stop")[0].is_displayed()
    assert "Done." in chat_once(d, engine, "second")
    assert "one" not in tokenizer.decode(engine.calls[-1]["prompt"])   # the failed reply is not history


def test_deleting_another_chat_while_a_reply_streams_keeps_it_live(browser, quick):
    """Deleting an old chat re-rendered the thread: the page went on painting the replaced node, so
    the streaming reply froze (and lost its cursor) until it ended."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "old chat")
    q(d, "#new-chat")[0].click()
    with replying(engine, "word " * 80, delay=0.03):
        send(d, "new chat")
        wait(lambda: len(last_reply(d)) > 10, what="the first tokens")
        d.execute_script("[...document.querySelectorAll('#history .conv')].find((c) => "
                         "c.textContent.includes('old chat')).querySelector('.delete').click()")
        assert streaming(d), "the streaming reply lost its streaming look"
        shown = len(last_reply(d))
        wait(lambda: len(last_reply(d)) > shown + 20, what="the reply to go on showing tokens")
        q(d, "#stop")[0].click()
        wait(lambda: not streaming(d), what="the reply to stop")
        wait(engine.finished.is_set, what="the server's generation cancelled")
    assert [c.text for c in q(d, "#history .conv .open")] == ["new chat"]


def test_an_edited_message_hides_its_actions(browser, quick):
    """`.actions { display: flex }` beat the hidden attribute: Edit stayed under its own editor, and
    clicking it threw (its bubble was gone)."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "one")
    chat_once(d, engine, "two")
    q(d, ".msg.user .edit")[0].click()
    assert not q(d, ".msg.user .actions")[0].is_displayed()
    area = q(d, ".editor textarea")[0]
    area.clear()
    area.send_keys("uno")
    q(d, ".editor .save")[0].click()   # an earlier turn: the turns after it go, the edited one is asked
    wait(lambda: not streaming(d) and q(d, ".msg.assistant .meta"), what="the edited turn answered")
    assert [b.text for b in q(d, ".msg .bubble")] == ["uno", "Done."]


COPY_FAILS = """navigator.clipboard.writeText = () => Promise.reject(new DOMException('denied', 'NotAllowedError'));
  document.execCommand = () => false;"""


def test_copy_that_fails_says_so_and_keeps_the_focus(browser, quick):
    """Clipboard refused and the old way failed too: the button said "Copied", and the user pasted
    whatever the clipboard held before. The fallback's textarea also left the focus on <body>."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    with replying(engine, "```\nls\n```"):
        chat_once(d, engine, "code")
    d.execute_script("navigator.clipboard.writeText = () => Promise.reject(new DOMException('x', 'NotAllowedError'))")
    button = q(d, ".copy-code")[0]
    button.click()
    wait(lambda: button.text == "Copied", what="the old way's copy")
    assert d.execute_script("return document.activeElement.className") == "copy-code"
    d.execute_script(COPY_FAILS)
    q(d, ".msg.assistant .copy")[0].click()
    wait(lambda: q(d, ".msg.assistant .copy")[0].text == "Copy failed", what="the failure said")


def test_a_phone_shows_unbroken_words_and_html_in_code_in_place(browser, quick):
    """375 px wide: a long unbroken word, URL, inline code or code line must not widen the page, and
    HTML in a code block (or its language) is text."""
    _, url, _ = quick
    d = browser
    d.set_window_size(375, 740)
    try:
        fresh_page(d, url)
        word = "x" * 600
        reply = (f"{word} https://example.com/{word} `{word}`\n```<img src=x onerror=\"window.__p=1\">\n"
                 f"<script>window.__p=2</script><img src=y onerror=\"window.__p=3\">{word}\n```\nend")
        fake_stream(d, [json.dumps({"choices": [{"index": 0, "delta": {"content": reply}}]}), "[DONE]"])
        d.execute_script("arguments[0].value = 'y'.repeat(500)", q(d, "#input")[0])   # typing it: seconds
        q(d, "#send")[0].click()
        wait(lambda: not streaming(d) and "end" in last_reply(d), what="the reply")
        time.sleep(0.1)
        widths = d.execute_script("const e = document.documentElement, m = document.getElementById('messages');"
                                  "return [e.scrollWidth - e.clientWidth, m.scrollWidth - m.clientWidth]")
        assert widths == [0, 0], f"the page scrolls sideways on a phone: {widths}"
        assert d.execute_script("return window.__p === undefined && !document.querySelector('#thread img, "
                                "#thread script')")
        assert q(d, ".codehead span")[0].text == '<img src=x onerror="window.__p=1">'
    finally:
        d.execute_script("window.__fake = null")
        d.set_window_size(1280, 860)


def _fake_raw(driver, chunks: list[str], content_type: str) -> None:
    """Until `window.__raw = null`, chat requests get a 200 of exactly these body chunks."""
    driver.execute_script("""window.__raw = [arguments[0], arguments[1]];
      const real = window.fetch;
      window.fetch = (u, o) => {
        if (!String(u).includes('/v1/chat') || !window.__raw) return real(u, o);
        const [chunks, type] = window.__raw;
        const body = new ReadableStream({ start(c) {
          for (const x of chunks) c.enqueue(new TextEncoder().encode(x));
          c.close(); } });
        return Promise.resolve(new Response(body, { status: 200, headers: { "Content-Type": type } }));
      };""", chunks, content_type)


def test_crlf_event_streams_are_read_and_a_page_that_is_no_stream_is_named(browser, quick):
    """SSE allows \\r\\n and \\r line ends (a proxy may rewrite them): the page split events on
    \\n\\n only and called every such reply "closed before the reply was complete". A 200 that is
    no event stream (a proxy's login page) got that same message."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    event = lambda text: json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})  # noqa: E731
    # the \r\n of one line end split across two chunks, and a bare-\r event
    _fake_raw(d, [f"data: {event('Hello')}\r", f"\n\r\ndata: {event(' there')}\r\r", "data: [DONE]\r\n\r\n"],
              "text/event-stream; charset=utf-8")
    send(d, "hi")
    wait(lambda: not streaming(d) and last_reply(d), what="the reply")
    assert last_reply(d) == "Hello there" and not q(d, ".msg.assistant.error")
    _fake_raw(d, ["<html><body>Please log in</body></html>"], "text/html; charset=utf-8")
    send(d, "again")
    wait(lambda: q(d, ".msg.assistant.error"), what="the refusal shown")
    assert "answered with text/html, not a reply stream" in last_reply(d)
    d.execute_script("window.__raw = null")
    assert "Done." in chat_once(d, engine, "and on")
