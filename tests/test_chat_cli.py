"""scripts/chat_cli.py: a one-shot answer equals the engine's greedy generation, the interactive loop
keeps and clears history, bad flags raise, and on CUDA the default graph decode answers as eager. The
real script at a terminal (a pty: commands, Ctrl-C, line editing) and piped into `head`; streaming of
split UTF-8, calculator calls and control characters."""

import importlib.util
import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanochat.engine import TOOL_TEXT, Engine
from nanochat.text_stream import TextStream
from tests.test_engine import prompt_for, tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's


def test_chat_cli_one_shot_and_interactive(sft_checkpoint, chat_model, capsys, monkeypatch):
    from scripts import chat_cli

    model, tokenizer = chat_model
    assert chat_cli.main(["-p", "Hello there, how are you?", "--device", "cpu", "-t", "0", "-m", "12"]) == 0
    printed = capsys.readouterr().out
    greedy, _ = Engine(model, tokenizer).generate_batch(prompt_for(tokenizer), max_tokens=12, temperature=0.0)
    stream = TextStream(tokenizer, special_text={tokenizer.encode_special(k): v for k, v in TOOL_TEXT.items()})
    expected = "".join(stream.feed(t) for t in greedy[0][len(prompt_for(tokenizer)):]) + stream.finish()
    assert printed == expected + "\n" and len(expected) > 5
    # the fixed-shape decode path (what --decode auto captures as CUDA graphs on a GPU) answers the same
    assert chat_cli.main(["-p", "Hello there, how are you?", "--device", "cpu", "-t", "0", "-m", "12",
                          "--decode", "static"]) == 0
    assert capsys.readouterr().out == printed
    # a prompt with no room left for a reply: one line for script_main, naming the fix for -p
    from nanochat.errors import RequestError
    with pytest.raises(RequestError, match="the model's context is [0-9]+: shorten -p$"):
        chat_cli.main(["-p", "ab " * 3000, "--device", "cpu", "-m", "5"])

    lines = iter(["first question", "ab " * 3000, "second question", "/clear", "third", "/quit"])
    prompts = []
    real_render = tokenizer.render_for_completion
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    monkeypatch.setattr(type(tokenizer), "render_for_completion",
                        lambda self, conv: prompts.append(list(conv["messages"])) or real_render(conv))
    assert chat_cli.main(["--device", "cpu", "-t", "0.7", "-m", "8", "--seed", "1"]) == 0
    # history grows, /clear resets it; the too-long message is also measured alone (which hint helps)
    assert [len(p) for p in prompts] == [1, 3, 1, 3, 1]
    assert prompts[1][2]["content"] == ("ab " * 3000).strip()   # too long: refused, then dropped from the history
    assert prompts[1][0]["content"] == "first question" and prompts[4][0]["content"] == "third"
    out = capsys.readouterr().out
    assert "(new conversation)" in out and "decode=eager" in out   # auto on a CPU
    assert ": shorten the message]" in out   # too long on its own: /clear would not help (test_chat_cli_review6)


@pytest.mark.cuda
def test_chat_cli_graph_decode_answers_as_eager_cuda(sft_checkpoint, capsys):
    """On CUDA chat_cli's default decode (CUDA graphs; on an H100/H200 the persistent kernel) gives eager's
    greedy answer."""
    from scripts import chat_cli

    base = ["-p", "Hello there, how are you?", "--device", "cuda", "--dtype", "fp32", "-t", "0", "-m", "24"]
    assert chat_cli.main(base + ["--decode", "eager"]) == 0
    eager = capsys.readouterr().out
    assert chat_cli.main(base) == 0
    assert capsys.readouterr().out == eager and len(eager) > 5


def test_chat_cli_rejects_bad_flags():
    from scripts import chat_cli

    with pytest.raises(ValueError, match="--source"):
        chat_cli.parse_args(["-i", "pretrain"])
    with pytest.raises(ValueError, match="--temperature"):
        chat_cli.parse_args(["-t", "-1"])
    with pytest.raises(ValueError, match="--top-k"):
        chat_cli.parse_args(["--top-k", "-3"])
    with pytest.raises(ValueError, match="--decode.*auto\\|eager"):
        chat_cli.parse_args(["--decode", "fast"])
    with pytest.raises(ValueError, match="--graph-step.*persistent"):
        chat_cli.parse_args(["--graph-step", "cuda"])
    with pytest.raises(ValueError, match="--top-p: got 1.5"):
        chat_cli.parse_args(["--top-p", "1.5"])
    greedy = chat_cli.parse_args(["--top-p", "0", "-t", "0.9"])   # the API's meaning of top_p 0
    assert (greedy.temperature, greedy.top_p) == (0.0, None)


def test_chat_cli_without_a_model_says_so_in_one_line(tmp_path):
    """A fresh machine (no sft checkpoint yet): one line naming where it looked, exit 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "scripts.chat_cli", "-p", "hi", "--device", "cpu"],
                       cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("chat_cli: error: no sft checkpoints under ") and str(tmp_path) in r.stderr


def test_answer_ends_where_the_model_starts_a_user_turn(chat_model):
    """A reply ends at <|user_start|> as the server's does: the model's invented next user turn is
    neither printed nor kept in the history."""
    import io
    from types import SimpleNamespace

    from scripts.chat_cli import answer
    from tests.test_engine import scripted_engine, specials

    tok = chat_model[1]
    s = specials(tok)
    prompt = prompt_for(tok)
    script = tok.encode("Fine, thanks.") + [s.user_start] + tok.encode("And you?") + [s.assistant_end]
    engine = scripted_engine(tok, lambda b, gen: script[len(gen)], prompt)
    args = SimpleNamespace(max_tokens=40, temperature=0.0, top_k=None, top_p=None)
    out = io.StringIO()
    message = answer(engine, tok, prompt, args, seed=0, out=out)
    assert out.getvalue() == "Fine, thanks.\n"
    assert message == {"role": "assistant", "content": [{"type": "text", "text": "Fine, thanks."}]}


# ------------------------------------------------------------------------------ the real script, as a user runs it

# Runs scripts/chat_cli.py as `python -m` does, with its first answer slowed to 5 tokens/s: room to cut it
# off mid-way. On a terminal (a pty) it becomes the controlling one, so that a typed Ctrl-C sends SIGINT.
SLOW_FIRST_ANSWER = """
import itertools, os, runpy, sys, time
if os.isatty(0):
    import fcntl, termios
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
from nanochat import engine
calls, generate = itertools.count(), engine.Engine.generate
def slowed(self, *args, **kwargs):
    slow = next(calls) == 0
    for step in generate(self, *args, **kwargs):
        yield step
        if slow:
            time.sleep(0.2)
engine.Engine.generate = slowed
runpy.run_module("scripts.chat_cli", run_name="__main__", alter_sys=True)
"""


def chat_cli_command(*flags, device="cpu"):
    return [sys.executable, "-c", SLOW_FIRST_ANSWER, "--device", device, *flags]


class Terminal:
    """The master side of a pty the child runs in: send keys, wait for text."""

    def __init__(self, fd):
        self.fd, self.seen, self.pos = fd, b"", 0

    def read(self, timeout: float) -> bool:
        if not select.select([self.fd], [], [], timeout)[0]:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:   # EIO: the child has gone
            return False
        self.seen += data
        return bool(data)

    def expect(self, text: str, timeout: float = 60) -> bytes:
        """Everything after the previous expect up to and including the next `text`."""
        end = time.monotonic() + timeout
        while (at := self.seen.find(text.encode(), self.pos)) < 0:
            assert time.monotonic() < end and self.read(0.05), f"no {text!r} in {self.seen[self.pos:]!r}"
        start, self.pos = self.pos, at + len(text)
        return self.seen[start:self.pos]

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_chat_cli_at_a_terminal(sft_checkpoint, device):
    """A session at a real terminal (a pty): a mistyped /command and an empty line send nothing; Ctrl-C in an
    answer stops it and returns to the prompt, the partial answer kept (said); /clear forgets the conversation;
    arrow keys edit the line; Ctrl-C at the prompt exits 0; no traceback anywhere. On CUDA the answers come
    from the CUDA-graph decode (the persistent kernel on an H100/H200), cut off mid-replay the same way."""

    master, slave = pty.openpty()
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(sft_checkpoint), "TERM": "dumb"}
    child = subprocess.Popen(chat_cli_command("-t", "0", "-m", "12", device=device), stdin=slave, stdout=slave, stderr=slave,
                             cwd=Path(__file__).resolve().parents[1], env=env, start_new_session=True)
    os.close(slave)
    term = Terminal(master)
    try:
        term.expect("User: ")
        term.send("/fo bar\r")
        assert "unknown command /fo; commands: /clear" in term.expect("User: ").decode()
        term.send("\r")
        assert b"Assistant" not in term.expect("User: ")
        term.send("hello there\r")   # the slowed answer: cut off after its first token
        term.expect("Assistant: ")
        term.read(10)
        term.send("\x03")
        assert b"(stopped: the partial answer stays in the conversation" in term.expect("User: ")
        answers = []
        keys = "hello thre\x1b[D\x1b[De\r" if importlib.util.find_spec("readline") else "hello there\r"
        term.send("/clear\r")
        term.expect("User: ")
        for line in ("hello there\r", "hello there\r", "/clear\r", keys):
            term.send(line)
            answers.append(term.expect("\r\n\r\nUser: ").decode(errors="replace"))
        first, _, _, edited = (re.search("Assistant: (.*)\r\n\r\nUser: ", a, re.S) for a in answers)
        assert "(new conversation)" in answers[2]
        assert len(first[1]) > 3 and edited[1] == first[1]   # as the first turn of a conversation: no history
        time.sleep(0.3)
        for _ in range(3):   # a Ctrl-C the instant the prompt is written can land before input() reads (CPython)
            term.send("\x03")
            try:
                child.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        assert child.wait(timeout=5) == 0
        while term.read(0.1):
            pass
        assert b"Traceback" not in term.seen, term.seen.decode(errors="replace")
    finally:
        child.kill()
        child.wait()
        os.close(master)


def test_chat_cli_piped_into_head_ends_quietly(sft_checkpoint):
    """`chat_cli -p ... | head -c 1` (stdin not a terminal either): the reader goes away mid-answer and the
    script ends as other Unix tools do there: exit 141, nothing on stderr (it was a BrokenPipeError
    traceback)."""

    env = {**os.environ, "NANOCHAT_BASE_DIR": str(sft_checkpoint)}
    child = subprocess.Popen(chat_cli_command("-p", "hello there", "-t", "0", "-m", "50"), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[1],
                             env=env)
    assert_quiet_after_head(child)


def assert_quiet_after_head(child: subprocess.Popen) -> None:
    """Read one byte of `child`'s stdout and close it, as `head -c 1` does: the child must end with exit
    141 and nothing on stderr."""
    try:
        assert child.stdout.read(1)
        child.stdout.close()
        assert child.wait(timeout=60) == 141
        assert child.stderr.read() == b""
    finally:
        child.kill()
        child.wait()
        child.stderr.close()


def test_chat_cli_commands_are_not_messages(sft_checkpoint, chat_model, capsys, monkeypatch):
    """An unknown /command prints the command list instead of going to the model; /help lists them; //text
    sends /text; end of input (Ctrl-D, or a piped stdin running out) exits 0."""
    from scripts import chat_cli

    tokenizer = chat_model[1]
    lines = iter(["/reset", "/help", "//etc/hosts is what?"])

    def typed(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    sent = []
    real_render = tokenizer.render_for_completion
    monkeypatch.setattr("builtins.input", typed)
    monkeypatch.setattr(type(tokenizer), "render_for_completion",
                        lambda self, conv: sent.append(list(conv["messages"])) or real_render(conv))
    assert chat_cli.main(["--device", "cpu", "-t", "0", "-m", "4"]) == 0
    assert sent == [[{"role": "user", "content": "/etc/hosts is what?"}]]
    out = capsys.readouterr().out
    assert f"unknown command /reset; {chat_cli.HELP}" in out and out.count(chat_cli.HELP) == 2


def test_chat_cli_checks_step_prompt_and_model_tag_before_loading(sft_checkpoint, monkeypatch):
    """--step abc was a ValueError traceback from the loader; -p "" an answer to nothing; a --model-tag with no
    checkpoints a message naming neither the flag nor the tags there are. Each is one line, before loading."""
    from scripts import chat_cli

    with pytest.raises(ValueError, match="^-s/--step: got 'abc'; accepted: latest or an integer >= 0$"):
        chat_cli.parse_args(["--step", "abc"])
    with pytest.raises(ValueError, match="^-p/--prompt: got an empty prompt"):
        chat_cli.parse_args(["-p", "  "])
    assert chat_cli.parse_args(["--step", "7"]).step == "7"

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded")
    monkeypatch.setattr("nanochat.checkpoint.load_model", no_loading)
    from nanochat.errors import RequestError
    with pytest.raises(RequestError, match=r"^-g/--model-tag: got 'd20'; accepted: d2 \(the sft models under "):
        chat_cli.main(["-p", "hi", "--device", "cpu", "--model-tag", "d20"])
    with pytest.raises(RequestError, match="^no rl checkpoints under .*; train one first") as e:
        chat_cli.main(["-p", "hi", "--device", "cpu", "-i", "rl", "--model-tag", "d2"])
    assert "python -m scripts.chat_rl" in str(e.value) and "setup.sh" not in str(e.value)   # setup.sh trains no RL


class FakeTerminal:
    """A StringIO that says it is a terminal and records each write."""

    def __init__(self, tty=True):
        self.buffer, self.tty, self.writes = io.StringIO(), tty, []

    def write(self, text):
        self.writes.append(text)
        return self.buffer.write(text)

    def flush(self):
        pass

    def isatty(self):
        return self.tty


def byte_tokens(tok, data: bytes) -> list[int]:
    """One token per byte (the byte-level BPE's first 256 ids)."""
    by_byte = {tok.decode_bytes([i]): i for i in range(256)}
    return [by_byte[bytes([b])] for b in data]


def test_answer_streams_utf8_tools_and_no_terminal_escapes(chat_model):
    """Characters split across byte tokens print whole, as they complete; a calculator call shows as
    <<expr=result>>; on a terminal, control characters the model writes show as U+FFFD (an ESC sequence
    once cleared the screen), while a pipe gets the text as generated."""
    from scripts.chat_cli import answer
    from tests.test_engine import scripted_engine, specials

    tok = chat_model[1]
    s = specials(tok)
    prompt = prompt_for(tok)
    call = byte_tokens(tok, "é ✓ 😀\x1b[2J".encode()) + [s.python_start, *tok.encode("2+3"), s.python_end]
    tail = tok.encode(" ok") + [s.assistant_end]

    def plan(b, gen):
        if s.output_end in gen:
            return tail[len(gen) - gen.index(s.output_end) - 1]
        return call[len(gen)] if len(gen) < len(call) else 7   # then the calculator's forced tokens
    args = SimpleNamespace(max_tokens=40, temperature=0.0, top_k=None, top_p=None)
    shown = {}
    for tty in (True, False):
        out = FakeTerminal(tty)
        message = answer(scripted_engine(tok, plan, prompt), tok, prompt, args, seed=0, out=out)
        shown[tty] = out.buffer.getvalue()
        assert [w for w in out.writes if w][:5] == ["é", " ", "✓", " ", "😀"]   # each once it is complete
    assert shown[True] == "é ✓ 😀\ufffd[2J<<2+3=5>> ok\n"
    assert shown[False] == "é ✓ 😀\x1b[2J<<2+3=5>> ok\n"
    assert message["content"][0] == {"type": "text", "text": "é ✓ 😀\x1b[2J"}   # the history keeps the text


def test_answer_cut_off_by_ctrl_c_ends_its_line(chat_model):
    """Ctrl-C in an answer (-p or interactive) ends the cut-off line before the interrupt goes on, so the
    next output (the prompt, `chat_cli: interrupted`) does not run on after the partial answer."""
    from scripts.chat_cli import answer
    from tests.test_engine import scripted_engine

    tok = chat_model[1]
    prompt = prompt_for(tok)
    words = tok.encode("Fine, thanks and you")

    def plan(b, gen):
        if len(gen) == 3:
            raise KeyboardInterrupt
        return words[len(gen)]
    out = FakeTerminal()
    with pytest.raises(KeyboardInterrupt) as stop:
        answer(scripted_engine(tok, plan, prompt), tok, prompt,
               SimpleNamespace(max_tokens=40, temperature=0.0, top_k=None, top_p=None), seed=0, out=out)
    assert out.buffer.getvalue() == tok.decode(words[:3]) + "\n"
    assert type(stop.value) is KeyboardInterrupt   # uncaught, a subclass exits 1: -p must exit 130 as documented
    # the partial answer, which the interactive loop keeps in the conversation (as the chat page does)
    assert stop.value.message == {"role": "assistant", "content": [{"type": "text", "text": tok.decode(words[:3])}]}

    def at_once(b, gen):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt) as stop:   # nothing written: no partial answer to keep
        answer(scripted_engine(tok, at_once, prompt), tok, prompt,
               SimpleNamespace(max_tokens=40, temperature=0.0, top_k=None, top_p=None), seed=0, out=FakeTerminal())
    assert stop.value.message is None


def test_chat_cli_refuses_a_seed_the_sampler_cannot_take():
    """--seed 2**64 passed the flag check and failed at every answer with 'Overflow when unpacking long
    long' (interactively: printed for each message) after the model had loaded."""
    from scripts import chat_cli

    with pytest.raises(ValueError, match=r"^--seed: got 18446744073709551616; accepted: an integer in 0\.\."):
        chat_cli.parse_args(["--seed", str(2**64)])
    assert chat_cli.parse_args(["--seed", str(2**64 - 1)]).seed == 2**64 - 1


def test_answer_cut_off_by_the_context_says_so(chat_model, capsys):
    """A reply that fills the model's context ends mid-sentence: a note on stderr says why (stdout keeps the
    answer alone for -p), with what to do about it in the interactive loop; one cut at -m says that (it
    said nothing, where the web page shows "length"); a reply that ends at its stop token gets no note."""
    from scripts.chat_cli import answer
    from tests.test_engine import scripted_engine, specials

    tok = chat_model[1]
    s = specials(tok)
    words = tok.encode(" and so on and so forth")
    engine = scripted_engine(tok, lambda b, gen: words[len(gen) % len(words)], [0] * 125)   # context 128
    args = SimpleNamespace(max_tokens=40, temperature=0.0, top_k=None, top_p=None)
    out = io.StringIO()
    answer(engine, tok, [tok.bos_token_id] * 125, args, seed=0, out=out, full_hint="; /clear starts over")
    assert out.getvalue() == tok.decode(words[:3]) + "\n"
    assert capsys.readouterr().err == "[cut off: the conversation filled the model's context of 128 tokens; " \
                                      "/clear starts over]\n"
    args.max_tokens = 2
    answer(engine, tok, [tok.bos_token_id] * 125, args, seed=0, out=io.StringIO())
    assert capsys.readouterr().err == "[cut off at --max-tokens 2]\n"
    ends = scripted_engine(tok, lambda b, gen: [words[0], words[1], s.assistant_end][len(gen)], [0] * 125)
    args.max_tokens = 40
    answer(ends, tok, [tok.bos_token_id] * 125, args, seed=0, out=io.StringIO())
    assert capsys.readouterr().err == ""


def test_chat_cli_refuses_decode_paths_the_device_lacks_before_loading(monkeypatch):
    """--decode graphs or --graph-step persistent on a CPU: said before the model loads, naming the flag
    (it was the Engine's 'decode: ...' traceback after loading, and for persistent a message at every answer)."""
    from nanochat.errors import RequestError
    from scripts import chat_cli

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded")
    monkeypatch.setattr("nanochat.checkpoint.load_model", no_loading)
    with pytest.raises(RequestError, match=r"^--decode: 'graphs' needs a CUDA device, this run is on cpu; accepted"):
        chat_cli.main(["-p", "hi", "--device", "cpu", "--decode", "graphs"])
    with pytest.raises(RequestError, match=r"^--graph-step: 'persistent' needs a CUDA device, this run is on cpu"):
        chat_cli.main(["-p", "hi", "--device", "cpu", "--decode", "static", "--graph-step", "persistent"])
    with pytest.raises(AssertionError, match="the model loaded"):   # persistent is unused by eager decoding
        chat_cli.main(["-p", "hi", "--device", "cpu", "--graph-step", "persistent"])


def test_a_piped_line_that_is_not_utf8_is_said_and_the_chat_goes_on(sft_checkpoint):
    """`chat_cli < latin1.txt`: input() raised UnicodeDecodeError, a traceback that ended the chat."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(sft_checkpoint)}
    res = subprocess.run([sys.executable, "-m", "scripts.chat_cli", "--device", "cpu", "-t", "0", "-m", "3"],
                         input="caf\xe9 au lait\nhello\n/quit\n".encode("latin-1"), capture_output=True,
                         cwd=Path(__file__).resolve().parents[1], env=env, timeout=120)
    out = res.stdout.decode("utf-8", "replace")
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr[-800:]
    assert out.count("(that line is not UTF-8 text; send it as UTF-8)") == 1
    assert out.count("Assistant: ") == 1   # "hello" is answered
