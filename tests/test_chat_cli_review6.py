"""scripts/chat_cli.py as a demanding user meets it: a known command with words after it, the hint for a
message too long on its own, `-p -` reading the prompt from stdin, and special tokens the model writes
outside a tool call (shown as nothing, kept as nothing: nanochat/chat_format.assistant_parts)."""

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_engine import prompt_for, scripted_engine, specials, tiny_chat_model

ARGS = SimpleNamespace(max_tokens=8, temperature=0.0, top_k=None, top_p=None)


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's


def chat(monkeypatch, tok, lines: list[str], plan=None) -> int:
    """Run the interactive loop on `lines` (then end of input) against a scripted model whose context
    is 128 tokens; by default each reply is empty (the model ends it at once)."""
    from scripts.chat_cli import converse

    s = specials(tok)
    typed = iter(lines)

    def read(prompt=""):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", read)
    engine = scripted_engine(tok, plan or (lambda b, gen: s.assistant_end), [0])
    return converse(engine, tok, ARGS, lambda: 0)


def words(tok, at_least: int) -> str:
    """A message whose prompt, alone in a conversation, is at least `at_least` tokens."""
    n = 1
    while len(prompt_for(tok, "apple " * n)) < at_least:
        n += 1
    return ("apple " * n).strip()


def test_a_known_command_with_words_after_it_is_not_called_unknown(chat_model, monkeypatch, capsys):
    """"/clear all" said "unknown command /clear; commands: /clear = new conversation, ..."."""
    from scripts.chat_cli import HELP

    assert chat(monkeypatch, chat_model[1], ["/clear all", "/quit now", "/nope"]) == 0
    out = capsys.readouterr().out
    assert "unknown command /clear" not in out and "unknown command /quit" not in out
    assert f"/clear takes nothing after it: type /clear alone; {HELP}" in out
    assert "/quit takes nothing after it" in out and f"unknown command /nope; {HELP}" in out   # still chatting


def test_a_message_too_long_on_its_own_is_told_to_shorten_not_to_clear(chat_model, monkeypatch, capsys):
    """With history, a message that alone fills the context was told "type /clear to start over"; after
    /clear the same message was then told to shorten it. The hint is /clear only when it would help."""
    tok = chat_model[1]
    too_long, half = words(tok, 200), words(tok, 70)
    assert chat(monkeypatch, tok, ["hi", too_long]) == 0
    out = capsys.readouterr().out
    assert "the model's context is 128: shorten the message]" in out and "/clear to start over" not in out
    assert chat(monkeypatch, tok, [half, half, "/clear", half]) == 0   # the history is what does not fit
    out = capsys.readouterr().out
    assert out.count("the model's context is 128: type /clear to start over]") == 1
    assert out.count("Assistant: ") == 3 and "shorten the message" not in out


def test_p_dash_reads_the_prompt_from_stdin(monkeypatch):
    """`-p -` answered the one-character prompt "-"; it reads stdin (as `cat -`), checked as -p is."""
    from scripts import chat_cli

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n  Why is the sky blue? 😀\n\n".encode())))
    assert chat_cli.parse_args(["-p", "-"]).prompt == "Why is the sky blue? 😀"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b" \n\n")))
    with pytest.raises(ValueError, match="^-p/--prompt: got an empty prompt"):
        chat_cli.parse_args(["-p", "-"])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("caf\xe9".encode("latin-1"))))
    with pytest.raises(ValueError, match="^-p/--prompt: got 'caf\\\\udce9'; accepted: UTF-8 text"):
        chat_cli.parse_args(["-p", "-"])


def test_p_dash_as_a_user_runs_it(sft_checkpoint, capsys):
    """The script reads its flags once (stdin can be read once): piped, the answer is -p's for the text."""
    from scripts import chat_cli

    flags = ["--device", "cpu", "-t", "0", "-m", "12"]
    assert chat_cli.main(["-p", "Hello there, how are you?", *flags]) == 0
    expected = capsys.readouterr().out
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(sft_checkpoint)}
    res = subprocess.run([sys.executable, "-m", "scripts.chat_cli", "-p", "-", *flags],
                         input=b"Hello there, how are you?\n", capture_output=True, env=env, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr.decode()[-800:]
    assert res.stdout.decode() == expected and len(expected) > 5


def test_special_tokens_outside_a_tool_call_are_kept_as_shown(chat_model):
    """A stray <|user_end|> or <|assistant_start|> in a reply shows as nothing, but the history kept it as
    its name in text, which the next turn rendered as a dozen ordinary tokens the user never saw."""
    from nanochat.chat_format import assistant_parts
    from scripts.chat_cli import answer

    tok = chat_model[1]
    s = specials(tok)
    stray = [tok.encode_special("<|user_end|>"), tok.encode_special("<|assistant_start|>")]
    script = tok.encode("Fine") + stray + tok.encode(", thanks.") + [s.assistant_end]
    prompt = prompt_for(tok)
    out = io.StringIO()
    message = answer(scripted_engine(tok, lambda b, gen: script[len(gen)], prompt), tok, prompt,
                     SimpleNamespace(**{**vars(ARGS), "max_tokens": 40}), 0, out=out)
    assert out.getvalue() == "Fine, thanks.\n"
    assert message["content"] == [{"type": "text", "text": "Fine, thanks."}]
    call = [s.python_start, *tok.encode("1+1"), s.python_end, s.output_start, *tok.encode("2"), s.output_end]
    assert assistant_parts(tok, stray + call) == [{"type": "python", "text": "1+1"},
                                                  {"type": "python_output", "text": "2"}]
