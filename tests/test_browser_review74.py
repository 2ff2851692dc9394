"""Seventy-fourth review of the chat page (nanochat/ui.html) in headless Chromium, as a demanding user: one
test per defect found. A streaming reply was read, rebuilt and laid out whole at every painted frame, so a
long answer cost time quadratic in its length (40,000 characters of code in 20-character tokens: 21 s of
main-thread time, frames of 60-100 ms at the end), and a line of a few thousand backticks took seconds a
frame in the inline-code regex; each reply's start and end rebuilt the whole chat (a long chat froze the
page that long, a screen reader read the whole role=log region out again, an edit being typed above was
dropped); a keyboard user on Stop lost the focus to <body> when the reply ended; and chats the page dropped
(storage full, over its 50-chat limit) or could not read (corrupt storage) went without a word.
Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import json

import pytest
import test_browser
from test_browser import (
    chat_once,
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

# A reply streamed into a bubble of the page's own (with its CSS) in STEP-character tokens, laid out after
# each as the browser does for a painted frame; the time of each step, in ms. Stops past BUDGET ms in all.
STREAM = """const [text, step, budget] = arguments, times = [];
  const msg = document.createElement('div'), bubble = document.createElement('div');
  msg.className = 'msg assistant'; bubble.className = 'bubble'; msg.appendChild(bubble);
  document.getElementById('thread').appendChild(msg);
  const start = performance.now();
  for (let n = step; n < text.length + step && performance.now() - start < budget; n += step) {
    const t = performance.now();
    renderContent(bubble, text.slice(0, n)); bubble.getBoundingClientRect();
    times.push(performance.now() - t);
  }
  const fresh = document.createElement('div'); renderContent(fresh, text);
  const same = fresh.innerHTML === bubble.innerHTML && !bubble.querySelector('img, script, a, b');
  msg.remove();
  return [times, same && window.__pwned === undefined];"""


def long_answer(chars: int) -> str:
    """Prose, a closed code block, then a long one still being written (as the end of a streamed answer)."""
    prose = "The quick brown <b>fox</b> jumps over the `lazy <img src=x onerror=window.__pwned=1>` dog.\n\n"
    code = "def double(x):\n    return 2 * x   # twice as much\n"
    return (prose * (chars // 4 // len(prose)) + "```py\n" + code * 20 + "```\n" + prose * 4
            + "```python\n" + code * (chars * 3 // 4 // len(code)))


def median(xs):
    return sorted(xs)[len(xs) // 2]


def test_a_long_answer_streams_in_time_linear_in_its_length(browser, quick):
    """Each frame read, rebuilt and laid out the whole reply: this answer took 5.0 s to paint in 25-character
    tokens, its last frames 7x as long as its first (40,000 characters of code alone in 20-character tokens:
    21 s, frames of 60-100 ms at the end). The last frames now cost what the first ones do (0.6 s in all)."""
    _, url, _ = quick
    d = browser
    fresh_page(d, url)
    d.set_script_timeout(60)
    text = long_answer(50_000)
    times, same = d.execute_script(STREAM, text, 25, 12_000)
    steps = -(-len(text) // 25)
    first, last = median(times[:200]), median(times[-200:])
    print(json.dumps({"chars": len(text), "steps": len(times), "total_ms": round(sum(times)),
                      "first_200_median_ms": round(first, 2), "last_200_median_ms": round(last, 2)}))
    assert len(times) == steps, f"streaming {len(text)} characters took over 12 s ({len(times)} of {steps} tokens)"
    assert same, "painted a token at a time, the reply differs from the same text painted at once (or holds HTML)"
    assert last < 3 * first + 1.0, f"frames grew with the answer: first {first:.2f} ms, last {last:.2f} ms"


PARTS = """const [text, whole, inner] = arguments, thread = document.getElementById('thread'), bubbles = [];
  for (const k of [0, 1]) {
    const m = document.createElement('div'), b = document.createElement('div');
    m.className = 'msg assistant'; b.className = 'bubble'; m.appendChild(b); thread.appendChild(m); bubbles.push(b);
  }
  renderContent(bubbles[0], text); bubbles[1].innerHTML = whole;
  (whole.includes('<code>') ? bubbles[1].querySelector('code') : bubbles[1].firstChild).textContent = inner;
  const r = [bubbles[0].getBoundingClientRect().height, bubbles[1].getBoundingClientRect().height,
             bubbles[0].querySelectorAll('.part').length, bubbles[0].textContent === bubbles[1].textContent];
  thread.replaceChildren();
  return r;"""


def test_parts_of_a_long_reply_look_as_one_text(browser, quick):
    """A long reply is laid out in parts (a block each, so that a token lays out one part): a part's
    edge must not show - no line added or lost, blank lines included."""
    _, url, _ = quick
    d = browser
    fresh_page(d, url)
    prose = "".join(f"line {i}\n" + ("\n" if i % 7 == 0 else "") for i in range(90)) + "\n\nend"
    code = "".join(f"x{i} = {i}\n" + ("\n" if i % 5 == 0 else "") for i in range(90))
    block = ('<div class="codeblock"><div class="codehead"><span>code</span><button>Copy</button></div>'
             '<pre><code></code></pre></div>')
    for text, whole, inner in ((prose, '<span class="text"></span>', prose), ("```\n" + code + "```", block, code[:-1])):
        parts_high, one_high, parts, same_text = d.execute_script(PARTS, text, whole, inner)
        assert parts >= 3 and same_text, (parts, same_text)
        assert parts_high == one_high, f"{parts} parts: {parts_high} px high; in one piece: {one_high} px"


def test_a_line_of_backticks_does_not_hang_the_page(browser, quick):
    """The inline-code regex tried every backtick as an opener and scanned the line for its closer: a
    line of 16,000 backticks took 0.5 s to draw - at every token while it streamed."""
    _, url, _ = quick
    d = browser
    fresh_page(d, url)
    ms = d.execute_script("""const b = document.createElement('div'), t = performance.now();
      renderContent(b, 'x' + '`'.repeat(50000) + ' y ``z');
      return [performance.now() - t, b.textContent.length];""")
    print(json.dumps({"backticks": 50_000, "render_ms": round(ms[0], 1)}))
    assert ms[1] == 50_007 and ms[0] < 300, ms
    spans = d.execute_script("""const b = document.createElement('div');
      renderContent(b, 'a ``x`y`` b `c`` d ``e` ` f ` g`');
      return [...b.querySelectorAll('code.inline')].map((c) => c.textContent);""")
    assert spans == ["x`y", "c`` d ``e", "f"], spans   # as Markdown reads them


def seen(d) -> list:
    """Whether each message element on screen is the one marked by mark() (not rebuilt since)."""
    return d.execute_script("return [...document.querySelectorAll('#thread .msg')].map((m) => !!m.__seen)")


def mark(d) -> None:
    d.execute_script("document.querySelectorAll('#thread .msg').forEach((m) => { m.__seen = true; })")


def test_a_reply_leaves_the_messages_above_it_as_they_are(browser, quick):
    """Each reply's start and end rebuilt the whole chat: a long chat froze the page for as long as it
    took to draw (twice a reply), a screen reader read the whole log out again, and an edit being
    typed in an earlier message was dropped when a new message was sent."""
    engine, url, tokenizer = quick
    d = browser
    fresh_page(d, url)
    chat_once(d, engine, "first")
    chat_once(d, engine, "second")
    q(d, ".msg.user .edit")[0].click()
    q(d, ".editor textarea")[0].send_keys(" (a draft)")
    mark(d)
    with replying(engine, "word " * 30, delay=0.02):
        send(d, "third")
        wait(lambda: streaming(d), what="the reply to start")
        assert seen(d) == [True] * 4 + [False, False]
        assert not q(d, ".editor .save")[0].is_enabled()   # Save waits for the reply
        wait(lambda: not streaming(d) and "tokens" in q(d, ".msg.assistant .meta")[-1].text, what="the reply")
    assert seen(d) == [True] * 4 + [False, False]
    assert [a.get_attribute("value") for a in q(d, ".editor textarea")] == ["first (a draft)"]
    assert q(d, ".editor .save")[0].is_enabled()
    assert last_reply(d).startswith("word word") and "third" in tokenizer.decode(engine.calls[-1]["prompt"])
    # a regenerated answer: drawn again from it on, the messages above it stay
    q(d, ".editor .cancel")[0].click()
    mark(d)
    q(d, ".msg.assistant .regenerate")[1].click()   # the second answer: the third turn goes with it
    wait(lambda: len(q(d, ".msg")) == 4 and not streaming(d) and q(d, ".msg.assistant .meta")[-1].text,
         what="the regenerated answer")
    assert seen(d) == [True, True, True, False]
    assert q(d, ".msg.assistant .version span")[-1].text == "2/2"


def test_a_reply_ending_under_a_focused_stop_leaves_the_focus_in_place(browser, quick):
    """A keyboard user who tabbed to Stop (ready to stop the reply) lost the focus to <body> when the reply
    ended by itself: Stop was hidden under it. It goes to Send, in Stop's place."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    with replying(engine, "word " * 20, delay=0.05):
        send(d, "hello")
        wait(lambda: streaming(d), what="the reply to start")
        ActionChains(d).send_keys(Keys.TAB).perform()   # from the message box to Stop
        assert d.execute_script("return document.activeElement.id") == "stop"
        wait(lambda: not streaming(d), what="the reply to end")
    assert d.execute_script("return document.activeElement.id") == "send"


FULL = """const realSet = Storage.prototype.setItem;
  Storage.prototype.setItem = function (k, v) {
    if (k === 'nanochat.conversations' && String(v).length > 4400) throw new DOMException('full', 'QuotaExceededError');
    return realSet.call(this, k, v);
  };"""


def notice(d) -> tuple[str, bool]:
    box = q(d, "#notice")[0]
    return box.text, "unsaved" in box.get_attribute("class")


def test_chats_the_page_drops_or_cannot_read_are_said(browser, quick):
    """Chats went without a word: the oldest were deleted when storage was full or past the 50-chat limit,
    and saved chats the page could not read (a half-written value, a hand edit) were overwritten by the
    next save. It now says so under the message box, and keeps an unreadable value aside."""
    engine, url, _ = quick
    d = browser
    # unreadable: set aside under another key, said; the page still works
    for stored in ('[{"id": "a", "title": "lost", "messages": [{"role": "user", "co', '{"a": 1}'):
        fresh_page(d, url, {"nanochat.conversations": stored})
        said, red = notice(d)
        assert "could not read" in said and "nanochat.conversations.unreadable" in said and red, said
        assert "Done." in chat_once(d, engine, "hello")
        assert d.execute_script("return localStorage.getItem('nanochat.conversations.unreadable')") == stored
        assert "could not read" in notice(d)[0]   # said for as long as the page is open
    fresh_page(d, url, {"nanochat.conversations": '[{"id": "ok", "title": "kept", "messages": []}, 5]'})
    assert "could not read" in notice(d)[0]       # one chat of two unreadable
    # over the 50-chat limit: the oldest goes, by name
    old = [{"id": f"c{i}", "title": f"chat {i}", "updated": 1000 + i, "messages": [{"role": "user", "content": "x"}]}
           for i in range(50)]
    fresh_page(d, url, {"nanochat.conversations": json.dumps(old)})
    assert notice(d) == ("Small models make things up. Conversations are stored only in this browser.", False)
    chat_once(d, engine, "the 51st")
    said, red = notice(d)
    assert 'Deleted to make room (50 chats at most, as this browser\'s storage allows): "chat 0".' in said and red, said
    # storage full: the oldest go to make room, by name
    old = [{"id": f"old{i}", "title": f"old {i}", "updated": 1000 + i,
            "messages": [{"role": "user", "content": "x" * 2000}]} for i in range(2)]
    fresh_page(d, url, {"nanochat.conversations": json.dumps(old)})
    hook = d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": FULL})
    try:
        d.refresh()
        wait(lambda: len(q(d, "#history .conv")) == 2, what="the old chats")
        chat_once(d, engine, "new " + "hello world " * 20)
        said, red = notice(d)
        assert '"old 0"' in said and "stored only in this browser" in said and red, said
        assert [c.get_attribute("title") for c in q(d, "#history .conv .open")][1:] == ["old 1"]
    finally:
        d.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook["identifier"]})
