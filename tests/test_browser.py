"""The chat page in a real headless Chromium (Selenium): streaming, stop, regenerate, edit, new
chat, persistence across reloads, and that model output containing HTML/<script> is shown as text
and never executed. Screenshots (desktop + mobile) are saved under the test's tmp dir. Then one test
per defect found by probing the page: corrupt or blocked localStorage, Markdown fences (mid-line,
nested, indented, CRLF) and exact copies, a reload mid-stream and scrolling up while it streams, two
tabs saving, IME Enter, a stream cut without [DONE], and settings fields that show what is sent."""

import json
import shutil
import time
import warnings
from contextlib import contextmanager

import pytest
from conftest import missing, require_module

from nanochat.server import ServerSettings, Worker, WorkerPool, create_app, serve_in_thread
from test_chat_web import ScriptedEngine
from test_engine import tiny_chat_model

pytestmark = pytest.mark.browser

REPLY = ("Sure! Here is <b>bold</b> and <script>window.__pwned = 1</script> "
         "<img src=x onerror=\"window.__pwned = 2\"> plus `inline` code:\n"
         "```python\nprint(\"<hi>\")\n```\nDone.")


def find_chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    binary, driver_path = find_chromium(), shutil.which("chromedriver")
    if binary is None or driver_path is None:
        missing("no chromium/chromedriver binary on PATH (Debian: apt-get install -y chromium chromium-driver)")
    webdriver = require_module("selenium.webdriver", "the dev extra: uv pip install -e '.[dev]'")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def site(tiny_corpus):
    tokenizer = tiny_chat_model(str(tiny_corpus))[1]
    engine = ScriptedEngine(tokenizer, REPLY, delay=0.03)
    settings = ServerSettings(model_name="tiny-test", default_temperature=0.3, default_top_k=7, max_top_k=20,
                              default_max_tokens=400, max_max_tokens=450)   # not the page's old built-ins
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w0")]), settings))
    yield engine, url, tokenizer
    server.should_exit = True
    server.thread.join(timeout=10)


def wait(predicate, timeout=10.0, what="condition"):
    """Poll until `predicate` is truthy. An element the page re-rendered between being found and
    being read (StaleElementReferenceException) is "not yet": the next poll finds the new one."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            value = predicate()
        except StaleElementReferenceException:
            value = None
        if value:
            return value
        time.sleep(0.03)
    raise AssertionError(f"timed out waiting for {what}")


def q(driver, css):
    return driver.find_elements("css selector", css)


def send(driver, text):
    box = q(driver, "#input")[0]
    box.clear()
    box.send_keys(text)
    q(driver, "#send")[0].click()


def type_into(box, text):
    """Replace a field's text as a user does (select all, type): Selenium's clear() fires `change`."""
    from selenium.webdriver.common.keys import Keys

    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(text)


def streaming(driver):
    return bool(q(driver, ".msg.assistant.streaming"))


def last_reply(driver):
    return q(driver, ".msg.assistant .bubble")[-1].text


def load_page(driver, url):
    """Open the chat page; one retry when the browser shows something else (a loaded 2-core CI box
    once had a first load come back without the page), with what it showed as a warning."""
    for attempt in range(2):
        driver.get(url)
        if q(driver, "#model-name"):
            return
        if attempt == 0:
            warnings.warn(f"the chat page did not load at first; the browser showed: {driver.page_source[:300]!r}")
            time.sleep(1.0)
    raise AssertionError(f"the chat page did not load: {driver.page_source[:500]!r}")


def test_chat_page(browser, site, tmp_path):
    engine, url, tokenizer = site
    d = browser
    load_page(d, url + "/")
    d.execute_script("localStorage.clear()")
    load_page(d, url + "/")
    wait(lambda: q(d, "#model-name") and q(d, "#model-name")[0].text == "tiny-test", what="model name from /health")
    assert q(d, "#empty")
    d.execute_script("document.getElementById('settings').open = true")
    # the settings show the server's defaults and limits (/health), and requests leave them to the server
    wait(lambda: q(d, "#max-tokens")[0].get_attribute("value") == "400", what="server defaults in the settings")
    assert [q(d, "#" + i)[0].get_attribute("value") for i in ("temperature", "top-k")] == ["0.3", "7"]
    assert [q(d, "#" + i)[0].get_attribute("max") for i in ("top-k", "max-tokens")] == ["20", "450"]
    d.save_screenshot(str(tmp_path / "chat_empty.png"))

    # send: tokens arrive while the reply is streaming, then it completes
    send(d, "Show me some code")
    wait(lambda: streaming(d), what="streaming to start")
    first = wait(lambda: len(last_reply(d)) > 5 and last_reply(d), what="first tokens")
    wait(lambda: len(last_reply(d)) > len(first) + 5, what="more tokens")
    assert streaming(d), "the whole reply arrived at once: not streamed"
    engine.delay = 0.0   # streaming is shown: the rest of this reply and the next two come at once
    wait(lambda: not streaming(d), what="the reply to finish")
    reply = last_reply(d)
    sampling = lambda call: (call["temperature"], call["top_k"])  # noqa: E731
    assert sampling(engine.calls[-1]) == (0.3, 7)
    assert "<script>window.__pwned = 1</script>" in reply and "<b>bold</b>" in reply
    assert d.execute_script("return window.__pwned === undefined")
    assert not q(d, "#thread script") and not q(d, "#thread img") and not q(d, "#thread b")
    assert q(d, ".codeblock pre code")[-1].text == 'print("<hi>")'
    assert q(d, ".bubble code.inline")[-1].text == "inline"
    assert "tokens" in q(d, ".msg.assistant .meta")[-1].text
    d.save_screenshot(str(tmp_path / "chat_desktop.png"))

    # regenerate the answer: a second request with the same conversation; a changed setting is sent,
    # clamped to the server's limit, and "Server defaults" drops it again
    type_into(q(d, "#top-k")[0], "5000")
    calls = len(engine.calls)
    q(d, ".msg.assistant .regenerate")[-1].click()
    wait(lambda: len(engine.calls) == calls + 1 and not streaming(d), what="regeneration")
    assert sampling(engine.calls[-1]) == (0.3, 20)
    q(d, "#reset-settings")[0].click()
    assert q(d, "#top-k")[0].get_attribute("value") == "7"
    assert len(q(d, ".msg")) == 2 and "Done." in last_reply(d)

    # edit the user message and resubmit: the prompt now holds the new text
    q(d, ".msg.user .edit")[0].click()
    area = q(d, ".editor textarea")[0]
    area.clear()
    area.send_keys("Edited question")
    q(d, ".editor .save")[0].click()
    wait(lambda: len(engine.calls) == calls + 2 and not streaming(d), what="edited resubmission")
    assert sampling(engine.calls[-1]) == (0.3, 7)
    assert q(d, ".msg.user .bubble")[0].text == "Edited question"
    assert "Edited question" in tokenizer.decode(engine.calls[-1]["prompt"])

    # stop: the reply ends early, is marked stopped, and the server cancels the generation
    engine.delay = 0.1
    send(d, "Talk slowly")
    wait(lambda: streaming(d) and len(last_reply(d)) > 3, what="slow streaming")
    q(d, "#stop")[0].click()
    wait(lambda: not streaming(d), what="stop")
    assert q(d, ".msg.assistant .meta")[-1].text == "stopped"
    assert "Done." not in last_reply(d)
    wait(engine.finished.is_set, what="server-side cancellation")
    engine.delay = 0.03

    # new chat: empty thread, two conversations in the sidebar; both survive a reload
    q(d, "#new-chat")[0].click()
    assert q(d, "#empty") and not q(d, ".msg")
    d.refresh()
    wait(lambda: len(q(d, "#history .conv")) == 2, what="saved conversations after reload")
    q(d, "#history .conv .open")[1].click()
    assert q(d, ".msg.user .bubble")[0].text == "Edited question"

    # mobile layout: the sidebar becomes a drawer behind the menu button
    d.set_window_size(390, 844)
    time.sleep(0.3)
    assert q(d, "#menu")[0].is_displayed()
    assert d.execute_script("return document.getElementById('sidebar').getBoundingClientRect().right") <= 1
    d.save_screenshot(str(tmp_path / "chat_mobile.png"))
    q(d, "#menu")[0].click()
    time.sleep(0.4)
    assert d.execute_script("return document.getElementById('sidebar').getBoundingClientRect().left") >= -1
    d.save_screenshot(str(tmp_path / "chat_mobile_drawer.png"))
    d.set_window_size(1280, 860)
    logs = [e for e in d.get_log("browser") if e["level"] == "SEVERE"] if hasattr(d, "get_log") else []
    assert not [e for e in logs if "Content Security Policy" in e["message"]], logs
    print(f"screenshots: {tmp_path}")


# ------------------------------------------------------------------------------------ defects found by probing

RECORD_BODIES = ("window.__bodies = []; const realFetch = window.fetch; window.fetch = (u, o) => {"
                 " if (o && o.body) window.__bodies.push(JSON.parse(o.body)); return realFetch(u, o); };")


@contextmanager
def replying(engine, text, delay=None):
    """The scripted model answers `text` (at `delay` s a token) inside the block."""
    rows, old_delay = engine.rows, engine.delay
    engine.rows = [engine.tokenizer.encode(text) + [engine.default_stop_tokens[0]]]
    engine.delay = old_delay if delay is None else delay
    try:
        yield
    finally:
        engine.rows, engine.delay = rows, old_delay


def fresh_page(d, url, storage=None):
    """The page over a cleared localStorage (then `storage`'s keys set), loaded and talking to /health."""
    load_page(d, url + "/")
    d.execute_script("localStorage.clear()")
    for key, value in (storage or {}).items():
        d.execute_script("localStorage.setItem(arguments[0], arguments[1])", key, value)
    load_page(d, url + "/")
    wait(lambda: q(d, "#model-name")[0].text == "tiny-test", what="model name from /health")


def chat_once(d, engine, text):
    calls = len(engine.calls)
    send(d, text)
    wait(lambda: len(engine.calls) > calls and not streaming(d) and q(d, ".msg.assistant .meta"), what="a reply")
    return last_reply(d)


@pytest.fixture
def quick(site):
    """The scripted model answers "Done." at once (the module's reply streams for seconds)."""
    with replying(site[0], "Done.", delay=0.0):
        yield site


def test_bad_or_blocked_storage_leaves_the_page_working(browser, quick):
    engine, url, _ = quick
    d = browser
    # values an older page, a hand edit or another app could leave: the page used to die on each
    for convs, settings in (('{"a": 1}', '{}'), ('[null, {"id": "x"}, {"id": "y", "messages": [{"role": "user", '
                                                  '"content": 5}, {"role": "user", "content": "kept"}]}]', '5')):
        fresh_page(d, url, {"nanochat.conversations": convs, "nanochat.current": "y", "nanochat.settings.v2": settings})
        assert "Done." in chat_once(d, engine, "hello")
        assert q(d, "#top-k")[0].get_attribute("value") == "7"
    assert q(d, ".msg.user .bubble")[0].text == "kept"
    # storage blocked by the browser's settings: every access throws
    block = ("Object.defineProperty(window, 'localStorage', "
             "{get() { throw new DOMException('blocked', 'SecurityError'); }});")
    blocker = d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": block})
    try:
        load_page(d, url + "/")
        wait(lambda: q(d, "#model-name")[0].text == "tiny-test", what="model name with storage blocked")
        assert "Done." in chat_once(d, engine, "hello")
    finally:
        d.execute_cdp_cmd("Page.removeScriptToEvaluateOnNewDocument", {"identifier": blocker["identifier"]})


def test_code_fences_and_copy(browser, site):
    engine, url, _ = site
    d = browser
    text = ("Wrap code in ``` fences.\n"                       # mid-sentence: text, not a fence
            "````markdown\n```py\nx = 1\n```\n````\n"          # a longer fence holds a shorter one
            "  ```sh\r\n  ls -la\r\n  echo hi\r\n  ```\r\n"     # indented (a list item), CRLF lines
            "The end.")
    fresh_page(d, url)
    d.execute_script("navigator.clipboard.writeText = async (t) => { window.__copied = t; };")
    with replying(engine, text, delay=0.0):
        chat_once(d, engine, "fences")
    bubble = q(d, ".msg.assistant .bubble")[-1]
    assert "Wrap code in ``` fences." in bubble.text and "The end." in bubble.text
    codes = d.execute_script("return [...document.querySelectorAll('.codeblock')].map((b) => "
                             "[b.querySelector('.codehead span').textContent, b.querySelector('code').textContent])")
    assert codes == [["markdown", "```py\nx = 1\n```"], ["sh", "ls -la\r\necho hi"]]
    for i, (_, code) in enumerate(codes):
        button = q(d, ".copy-code")[i]
        button.click()
        wait(lambda: d.execute_script("return window.__copied") == code, what=f"code block {i} copied exactly")
    button.click()   # a second click while it says "Copied" must not leave it saying so
    wait(lambda: button.text == "Copy", timeout=3, what="the copy button's label back")


def test_reload_mid_stream_keeps_the_partial_reply_and_scrolling_is_left_to_the_reader(browser, site):
    engine, url, tokenizer = site
    d = browser
    fresh_page(d, url)
    # ~30 lines (3 tokens each) overflow the box: at 0.01 s a token they come in ~1 s, and the 120 lines
    # after them leave ~3.6 s for the switch to slow below (at 0.03 s, 90 lines took 2.6 s to fill)
    with replying(engine, "line\n" * 150, delay=0.01):
        send(d, "count lines")
        box = "document.getElementById('messages')"
        wait(lambda: d.execute_script(f"return {box}.scrollHeight > {box}.clientHeight + 300"), what="a long reply")
        engine.delay = 0.1   # the rest comes slowly: a loaded CI box still reloads well before the end
        d.execute_script(f"{box}.scrollTop = 0")
        text = last_reply(d)
        wait(lambda: len(last_reply(d)) > len(text) + 10, what="more tokens")
        assert streaming(d) and d.execute_script(f"return {box}.scrollTop") == 0, "streaming pulled the reader down"
        d.refresh()
    wait(lambda: q(d, ".msg.assistant .meta"), what="the reloaded conversation")
    saved = json.loads(d.execute_script("return localStorage.getItem('nanochat.conversations')"))[0]["messages"][-1]
    assert saved["content"].startswith("line\nline\n") and saved["content"] != "line\n" * 150
    assert q(d, ".msg.assistant .meta")[-1].text == "interrupted" and not q(d, ".msg.error")
    with replying(engine, "Done.", delay=0.0):
        chat_once(d, engine, "go on")   # the cut-off reply is history, as streamed
    prompt = tokenizer.decode(engine.calls[-1]["prompt"])
    assert "<|assistant_start|>" + saved["content"] + "<|assistant_end|><|user_start|>go on" in prompt


def test_two_tabs_keep_each_others_chats(browser, quick):
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    first = d.current_window_handle
    d.switch_to.new_window("tab")
    try:
        load_page(d, url + "/")
        chat_once(d, engine, "from the second tab")
    finally:
        d.close()
        d.switch_to.window(first)
    chat_once(d, engine, "from the first tab")   # this save used to drop the other tab's chat
    load_page(d, url + "/")
    titles = wait(lambda: [c.text for c in q(d, "#history .conv .open")], what="saved chats")
    assert sorted(titles) == ["from the first tab", "from the second tab"]


def test_keyboard_and_ime(browser, quick):
    engine, url, tokenizer = quick
    d = browser
    fresh_page(d, url)
    box = q(d, "#input")[0]
    box.send_keys("konnichiwa")
    calls = len(engine.calls)
    for init in ("{isComposing: true}", "{keyCode: 229}"):   # Chrome's, then Safari's Enter ending a composition
        d.execute_script("arguments[0].dispatchEvent(new KeyboardEvent('keydown', Object.assign("
                         "{key: 'Enter', bubbles: true, cancelable: true}, " + init + ")))", box)
    time.sleep(0.3)
    assert len(engine.calls) == calls and box.get_attribute("value") == "konnichiwa"
    from selenium.webdriver.common.keys import Keys

    box.send_keys(Keys.SHIFT, Keys.ENTER)
    box.send_keys("line two")
    assert len(engine.calls) == calls and box.get_attribute("value") == "konnichiwa\nline two"
    box.send_keys(Keys.ENTER)
    wait(lambda: len(engine.calls) == calls + 1 and not streaming(d), what="Enter to send")
    assert "konnichiwa\nline two<|user_end|>" in tokenizer.decode(engine.calls[-1]["prompt"])


def fake_stream(driver, data: list[str]) -> None:
    """Until `window.__fake = null`, the page's chat requests get a 200 event stream of these `data:`
    lines (a proxy's or a restarted server's answer, say), then the end of the response."""
    driver.execute_script("""window.__fake = arguments[0];
      if (!window.__realFetch) {
        window.__realFetch = window.fetch;
        window.fetch = (u, o) => {
          if (!String(u).includes('/v1/chat') || !window.__fake) return window.__realFetch(u, o);
          const lines = window.__fake;
          const body = new ReadableStream({ start(c) {
            for (const l of lines) c.enqueue(new TextEncoder().encode('data: ' + l + '\\n\\n'));
            c.close(); } });
          return Promise.resolve(new Response(body, { status: 200, headers: { "Content-Type": "text/event-stream" } }));
        };
      }""", data)


def test_stream_cut_without_done_is_an_error(browser, quick):
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    # a proxy or a restarted server can end the response cleanly but early: no [DONE]
    fake_stream(d, ['{"choices":[{"index":0,"delta":{"content":"Half an"}}]}'])
    send(d, "hello")
    wait(lambda: q(d, ".msg.assistant.error"), what="the cut reply shown as failed")
    assert "Half an" in last_reply(d) and "closed before the reply was complete" in last_reply(d)
    d.execute_script("window.__fake = null")
    assert "Done." in chat_once(d, engine, "again")   # and the page goes on


def test_an_answer_cut_at_max_tokens_says_so(browser, quick):
    """finish_reason "length": the reply stops mid-sentence and looked finished; its line now says so."""
    engine, url, _ = quick
    d = browser
    fresh_page(d, url)
    fake_stream(d, ['{"choices":[{"index":0,"delta":{"content":"The sky is blue bec"}}]}',
                    '{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}',
                    '{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":4,"total_tokens":9}}', "[DONE]"])
    send(d, "why blue?")
    meta = wait(lambda: [m.text for m in q(d, ".msg.assistant .meta") if "tokens" in m.text], what="the reply's line")
    assert meta[-1].startswith("4 tokens") and meta[-1].endswith("cut off at the max tokens limit"), meta
    d.execute_script("window.__fake = null")
    assert "Done." in chat_once(d, engine, "again")
    assert not any("cut off" in m.text for m in q(d, ".msg.assistant .meta")[-1:])   # a finished one does not


def test_settings_show_what_is_sent(browser, quick):
    engine, _, _ = quick
    d = browser
    # a server default off the slider's 0.05 steps (chat_web -t 0.33): the page must say 0.33, not 0.35
    settings = ServerSettings(model_name="tiny-test", default_temperature=0.33, default_top_k=7, max_top_k=20)
    server, url = serve_in_thread(create_app(WorkerPool([Worker(engine, "w1")]), settings))
    try:
        fresh_page(d, url)
        d.execute_script(RECORD_BODIES + "document.getElementById('settings').open = true")
        wait(lambda: q(d, "#temperature-value")[0].text == "0.33", what="the server's temperature shown")
        for typed, shown in (("2.6", "3"), ("-4", "0"), ("5000", "20")):
            type_into(q(d, "#top-k")[0], typed)
            chat_once(d, engine, "k " + typed)   # clicking Send commits the field
            assert q(d, "#top-k")[0].get_attribute("value") == shown
            assert d.execute_script("return window.__bodies.pop().top_k") == int(shown)
            assert engine.calls[-1]["top_k"] == (int(shown) or None)   # 0 = off
    finally:
        server.should_exit = True
        server.thread.join(timeout=10)
