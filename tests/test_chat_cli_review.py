"""scripts/chat_cli.py as a demanding user meets it (issue #7 review): --help shows the interactive
commands; a missing --step or a source with no model names its flag and what there is, before the
model loads; a closed stdin is a one-line error, not a traceback after loading; lines piped in are
echoed into the transcript; a carriage return the model writes cannot overwrite a terminal line."""

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_chat_cli import FakeTerminal
from tests.test_engine import prompt_for, scripted_engine, specials, tiny_chat_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def checkpoints(tiny_corpus, tmp_path_factory):
    """One base dir for the module: the tiny model saved as sft/d2 and base/d2, step 7 each."""
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tokenizer import tokenizer_dir

    model, tokenizer = tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's
    base = tmp_path_factory.mktemp("chat_cli_review")
    tokenizer.save(tokenizer_dir(base))
    for phase in ("sft", "base"):
        save_checkpoint(checkpoint_dir(phase, "d2", base), 7, model_state=model.state_dict(),
                        meta={"model_config": asdict(model.config), "tokenizer_fingerprint": tokenizer.fingerprint})
    return base


@pytest.fixture
def base_dir(checkpoints, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(checkpoints))
    return checkpoints


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model loaded")
    monkeypatch.setattr("nanochat.checkpoint.load_model", refuse)


def test_help_shows_the_commands_and_keys(capsys):
    """--help printed the docstring's first line only: no /clear, /quit, Ctrl-C or `-p -` example."""
    from scripts import chat_cli

    with pytest.raises(SystemExit) as done:
        chat_cli.parse_args(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for needed in ("/clear", "/quit", "/help", "Ctrl-D", "Ctrl-C", "-p -", "-i base", "status 0"):
        assert needed in text, needed


def test_missing_step_or_source_names_the_flag_before_loading(base_dir, no_loading):
    """--step 99 said "no checkpoint for step 99 in ..." and -i rl "no rl checkpoints under ...": neither
    named the flag nor, for -i, the sources that do have a model."""
    from nanochat.errors import RequestError
    from scripts import chat_cli

    flags = ["-p", "hi", "--device", "cpu"]
    with pytest.raises(RequestError, match=r"^-s/--step: got 99; accepted: latest or a step on disk: 7 \(in "):
        chat_cli.main([*flags, "--step", "99"])
    with pytest.raises(RequestError, match=r"^-s/--step: got 3; accepted: latest or a step on disk: 7 \(in .*base"):
        chat_cli.main([*flags, "-i", "base", "-g", "d2", "-s", "3"])
    with pytest.raises(RequestError, match=r"^no rl checkpoints under .*, or pick another -i/--source: sft\|base$"):
        chat_cli.main([*flags, "-i", "rl"])
    with pytest.raises(RequestError, match=r"^no mid checkpoints under .*-i/--source: sft\|base$"):
        chat_cli.main([*flags, "-i", "mid", "-g", "d2", "-s", "7"])
    with pytest.raises(AssertionError, match="the model loaded"):   # a step that is there passes
        chat_cli.main([*flags, "--step", "7"])


def test_interactive_chat_with_a_closed_stdin_is_a_flag_error(monkeypatch):
    """`chat_cli <&-` loaded the model, then died in input() with a "lost sys.stdin" traceback (exit 1)."""
    from scripts import chat_cli

    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(ValueError, match=r"^-p/--prompt: not given, and there is no stdin to chat on"):
        chat_cli.parse_args(["--device", "cpu"])
    assert chat_cli.parse_args(["-p", "hi"]).prompt == "hi"   # -p needs no stdin


def test_piped_chat_transcript_shows_the_lines(base_dir):
    """`printf 'hi\\n...' | chat_cli`: the transcript read "User: " and then the answer, the line itself
    nowhere (a pipe does not echo). Empty lines and commands send nothing, a last line without a newline
    is answered, end of input exits 0, and nothing writes an ANSI escape into the pipe."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "TERM": "xterm-256color"}
    res = subprocess.run([sys.executable, "-m", "scripts.chat_cli", "--device", "cpu", "-t", "0", "-m", "3"],
                         input=b"hello there\n\n/help\n/nope\nlast one", capture_output=True, cwd=ROOT, env=env,
                         timeout=120)
    out = res.stdout.decode()
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr.decode()[-800:]
    assert "\nUser: hello there\n\nAssistant: " in out and "\nUser: last one\n\nAssistant: " in out
    assert "\nUser: /help\ncommands: /clear" in out and "\nUser: /nope\nunknown command /nope;" in out
    assert out.count("Assistant: ") == 2 and "\x1b" not in out
    assert out.endswith("\nUser: \n")   # end of input: the prompt's line ended, exit 0


def test_a_carriage_return_cannot_overwrite_a_terminal_line(tiny_corpus):
    """On a terminal, "\\r" moved the cursor back and the text after it overwrote what the model had said
    (the comment's own reason for hiding control characters); a pipe still gets the text as generated."""
    from scripts.chat_cli import answer

    tok = tiny_chat_model(str(tiny_corpus))[1]
    prompt = prompt_for(tok)
    script = tok.encode("Yes, do it.\rNo") + tok.encode(" ok\r\nbye") + [specials(tok).assistant_end]
    args = SimpleNamespace(max_tokens=60, temperature=0.0, top_k=None, top_p=None)
    shown = {}
    for tty in (True, False):
        out = FakeTerminal(tty)
        message = answer(scripted_engine(tok, lambda b, gen: script[len(gen)], prompt), tok, prompt, args, 0, out=out)
        shown[tty] = out.buffer.getvalue()
    assert shown[True] == "Yes, do it.No ok\nbye\n"
    assert shown[False] == "Yes, do it.\rNo ok\r\nbye\n"
    assert message["content"] == [{"type": "text", "text": "Yes, do it.\rNo ok\r\nbye"}]   # the history: as written

