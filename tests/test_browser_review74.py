"""Seventy-fourth review of the chat page (nanochat/ui.html) in headless Chromium, as a demanding user: one
test per defect found. A streaming reply was read, rebuilt and laid out whole at every painted frame, so a
long answer cost time quadratic in its length (40,000 characters of code in 20-character tokens: 21 s of
main-thread time, frames of 60-100 ms at the end), and a line of a few thousand backticks took seconds a
frame in the inline-code regex; each reply's start and end rebuilt the whole chat (a long chat froze the
page that long, a screen reader read the whole role=log region out again, an edit being typed above was
dropped); a keyboard user on Stop lost the focus to <body> when the reply ended; and chats the page dropped
(storage full, over its 50-chat limit) or could not read (corrupt storage) went without a word. A review of
those fixes: a line that looked like a fence opener while written kept the line break above it off, and one
unreadable saved chat set the whole saved value aside (twice the space: good chats were deleted for it).
Shares test_browser.py's fixtures: one Chromium and one scripted server for the module."""

import json
import random
import threading
from contextlib import contextmanager

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


@contextmanager
def held(engine, text):
    """The scripted model answers `text`, its first token held until the test sets the yielded gate: the
    page is mid-reply for exactly as long as the test needs, however loaded the box (a reply of a few
    dozen slow tokens was a 0.6-2 s window to act in)."""
    gate, old = threading.Event(), engine.gate
    engine.gate = gate
    try:
        with replying(engine, text, delay=0.0):
            yield gate
    finally:
        gate.set()
        engine.gate = old


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
    with held(engine, "word " * 30) as gate:
        send(d, "third")
        wait(lambda: streaming(d), what="the reply to start")
        assert seen(d) == [True] * 4 + [False, False]
        assert not q(d, ".editor .save")[0].is_enabled()   # Save waits for the reply
        gate.set()
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
    with held(engine, "word " * 20) as gate:
        send(d, "hello")
        wait(lambda: streaming(d), what="the reply to start")
        ActionChains(d).send_keys(Keys.TAB).perform()   # from the message box to Stop
        assert d.execute_script("return document.activeElement.id") == "stop"
        gate.set()
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


# Each text streamed into one bubble in the given token sizes; after every token, the bubble against a fresh
# one given the text so far at once (parts unwrapped: where a part ends is layout, not content). The first
# difference: [text so far, streamed, at once], or null.
AS_ONE = """const [cases] = arguments, thread = document.getElementById('thread'), found = [];
  const bubble = () => { const m = document.createElement('div'), b = document.createElement('div');
    m.className = 'msg assistant'; b.className = 'bubble'; m.appendChild(b); thread.appendChild(m); return b; };
  const shown = (b) => { const c = b.cloneNode(true);
    for (const p of [...c.querySelectorAll('.part')].reverse()) p.replaceWith(...p.childNodes);
    c.normalize(); c.querySelectorAll('span.text:empty').forEach((s) => s.remove());
    return c.innerHTML + ' | ' + b.textContent; };
  for (const [text, sizes] of cases) {
    const s = bubble(); let n = 0, diff = null;
    for (const k of sizes) {
      n += k; renderContent(s, text.slice(0, n));
      const f = bubble(); renderContent(f, text.slice(0, n));
      const [a, b] = [shown(s), shown(f)]; f.parentNode.remove();
      if (a !== b) { diff = [text.slice(0, n), a, b]; break; }
    }
    found.push(diff); thread.replaceChildren();
  }
  return found;"""

LINES = ["```", "```py", "  ```", "```js``` here", "``` `x` ```", "x ``` y", "````", "``", "`x` and `y`", "``a`b``",
         "`open", "- item", "  - ```", "", "text", "<b>no</b>", "end\r"]


def test_a_reply_streamed_a_token_at_a_time_shows_what_it_shows_at_once(browser, quick):
    """A line that looked like a fence opener while it was written ("```js" of "```js``` here") took the line
    break off the prose line above it, and kept it off once the line turned out to be prose: "Usejs here" on
    screen until the reply ended. Every token of these replies must show what the text so far shows at once."""
    _, url, _ = quick
    d = browser
    fresh_page(d, url)
    rng = random.Random(74)
    tokens = [["a\n", "```js", "``` b\n", "c"], ["Use\n", "```", "js``` here\nok"], ["x\r\n```py", "\r\ny\r\n```", "\r\nz"]]
    cases = [["".join(t), [len(p) for p in t]] for t in tokens] + [[t, [1] * len(t)] for t in ("a\n```js``` b\nc", "a\n```\nb")]
    for _ in range(60):
        text = rng.choice(["\n", "\r\n"]).join(rng.choice(LINES) for _ in range(rng.randint(2, 12)))
        sizes = [rng.choice([1, 2, 3, 5, 8, 13]) for _ in text]
        cases.append([text, sizes])
    found = d.execute_script(AS_ONE, cases)
    bad = [f for f in found if f]
    assert not bad, f"{len(bad)} of {len(cases)} replies differ while streaming; the first: {bad[0]}"


# localStorage as full as a small quota: a write that would take the keys and values past LIMIT characters fails
QUOTA = """const realSet = Storage.prototype.setItem, LIMIT = %d;
  Storage.prototype.setItem = function (key, value) {
    let used = key.length + String(value).length;
    for (let i = 0; i < this.length; i++) if (this.key(i) !== key) used += this.key(i).length + this.getItem(this.key(i)).length;
    if (used > LIMIT) throw new DOMException('full', 'QuotaExceededError');
    return realSet.call(this, key, value);
  };"""
ADD_CHAT = """state.convs.unshift({ id: arguments[0], title: arguments[0], updated: Date.now(),
                                  messages: [{ role: 'user', content: 'x'.repeat(arguments[1]) }] });
  save(); renderHistory();
  return [localStorage.getItem('nanochat.conversations.unreadable'), JSON.parse(localStorage.getItem('nanochat.conversations')).length];"""


def test_one_unreadable_chat_sets_aside_only_itself_and_goes_before_good_chats(browser, quick):
    """One saved entry the page could not read copied the WHOLE saved value to ...unreadable: the chats took
    twice their space, and later saves deleted good chats to make room. Only the unreadable entries are set
    aside now, said while they are there, and deleted (and said) before any good chat is."""
    _, url, _ = quick
    d = browser
    good = [{"id": f"c{i}", "title": f"chat {i}", "updated": 1000 + i, "messages": [{"role": "user", "content": "x" * 1000}]}
            for i in range(4)]
    bad = {"id": 7, "note": "y" * 2000}   # an id that is no string
    fresh_page(d, url, {"nanochat.conversations": json.dumps(good + [bad])})
    hook = d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": QUOTA % 20_000})
    try:
        d.refresh()   # a second visit finds the same entry set aside: added once
        wait(lambda: len(q(d, "#history .conv")) == 4, what="the saved chats")
        said, red = notice(d)
        assert "nanochat.conversations.unreadable" in said and red, said
        aside, count = d.execute_script(ADD_CHAT, "new", 10_000)   # the whole value kept aside: 21,000 characters
        assert json.loads(aside) == [bad] and count == 5, (len(aside or ""), count)
        said, red = notice(d)
        assert "Deleted to make room" not in said and "nanochat.conversations.unreadable" in said, said
        d.refresh()   # nothing unreadable left in the chats: the entry set aside is still said while it is there
        wait(lambda: len(q(d, "#history .conv")) == 5, what="the saved chats")
        assert "nanochat.conversations.unreadable" in notice(d)[0]
        # full again: the unreadable entry goes, not a chat
        aside, count = d.execute_script(ADD_CHAT, "newer", 4_000)
        assert aside is None and count == 6, (aside, count)
        said, red = notice(d)
        assert "set aside as nanochat.conversations.unreadable, were deleted to make room" in said and red, said
        assert "Deleted to make room" not in said and "stored only in this browser" in said, said
    finally:
        d.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": hook["identifier"]})
