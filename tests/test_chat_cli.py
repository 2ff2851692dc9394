"""scripts/chat_cli.py: a one-shot answer equals the engine's greedy generation, the interactive loop
keeps and clears history, bad flags raise, and on CUDA the default graph decode answers as eager."""

import pytest

from nanochat.engine import TOOL_TEXT, Engine, TextStream
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
    assert [len(p) for p in prompts] == [1, 3, 3, 1]  # history grows, /clear resets it
    assert prompts[1][2]["content"] == ("ab " * 3000).strip()   # too long: refused, then dropped from the history
    assert prompts[1][0]["content"] == "first question" and prompts[3][0]["content"] == "third"
    out = capsys.readouterr().out
    assert "(new conversation)" in out and "decode=eager" in out   # auto on a CPU
    assert ": type /clear to start over]" in out


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
