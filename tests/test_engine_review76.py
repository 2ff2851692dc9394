"""Engine + chat_cli as a demanding user meets them (review 76): an odd calculator call ("2if 1 else 3")
wrote Python's SyntaxWarning to stderr in the middle of the streamed answer; `-p -` read the prompt
from stdin before checking the other flags (and waited on a terminal without a word); a missing,
corrupt or stale latest.json named no flag (or training's --resume); a base model's reply cut off by
the context spoke of a "conversation" it does not have; an explicit --graph-step the run could not take
was dropped without a word, and the engine's persistent-probe fallback line went to stdout (before
`-p`'s answer)."""

import io
import json
import re
import warnings
from types import SimpleNamespace

import pytest

from nanochat.calculator import use_calculator
from nanochat.errors import RequestError
from tests.test_engine import scripted_engine, specials, tiny_chat_model

ARGS = SimpleNamespace(max_tokens=40, temperature=0.0, top_k=None, top_p=None)


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's


# ------------------------------------------------------------------------------ the calculator's parse

ODD_CALLS = {"2if 1 else 3": None, "5and 3": None, "1or 2": None, "0x1for": None,
             '"a\\d".count("d")': "1"}   # the escape: a DeprecationWarning on 3.11, a SyntaxWarning from 3.12


def test_odd_tool_calls_write_no_python_warning():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = {expr: use_calculator(expr) for expr in ODD_CALLS}
    assert got == ODD_CALLS
    assert [str(w.message) for w in seen] == []
    # the warning filters are the caller's again afterwards
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.warn("still heard", SyntaxWarning)
    assert [str(w.message) for w in seen] == ["still heard"]


def test_an_odd_tool_call_in_a_streamed_answer_is_shown_without_a_warning(chat_model):
    from scripts.chat_cli import answer

    tok = chat_model[1]
    s = specials(tok)
    reply = [s.python_start, *tok.encode("2if 1 else 3"), s.python_end]
    tail = [*tok.encode(" ok"), s.assistant_end]

    def plan(b, gen):   # the call, then (after the forced output block) " ok" and the end of the turn
        if s.output_end in gen:
            return tail[len(gen) - gen.index(s.output_end) - 1]
        return reply[len(gen)] if len(gen) < len(reply) else 7
    engine = scripted_engine(tok, plan, [0] * 5)
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        answer(engine, tok, [tok.bos_token_id] * 5, ARGS, seed=0, out=out)
    assert out.getvalue() == "<<2if 1 else 3=error>> ok\n"
    assert [str(w.message) for w in seen] == []


# ------------------------------------------------------------------------------ -p - and the other flags

class FakeStdin(io.StringIO):
    """A terminal's stdin holding `text`, which records whether it was read."""

    def __init__(self, text: str):
        super().__init__(text)
        self.reads = 0

    def isatty(self) -> bool:
        return True

    def read(self, *a):
        self.reads += 1
        return super().read(*a)


def test_p_dash_checks_the_other_flags_before_reading_the_prompt(monkeypatch, capsys):
    from scripts import chat_cli

    stdin = FakeStdin("Why is the sky blue?\n")
    monkeypatch.setattr("sys.stdin", stdin)
    for flags, said in [(["-t", "-1"], "^--temperature: got -1.0"), (["--decode", "fast"], "^--decode: got 'fast'"),
                        (["-s", "x"], "^-s/--step: got 'x'"), (["--top-p", "2"], "^--top-p: got 2.0")]:
        with pytest.raises(ValueError, match=said):
            chat_cli.parse_args(["-p", "-", *flags])
    assert stdin.reads == 0   # the prompt is not typed (and lost) before a bad flag is said
    args = chat_cli.parse_args(["-p", "-", "--top-p", "0", "-t", "0.8"])
    assert (args.prompt, args.temperature, args.top_p) == ("Why is the sky blue?", 0.0, None)
    # on a terminal it says what it waits for, on stderr (stdout keeps the answer alone)
    assert capsys.readouterr().err == \
        "(reading the prompt from the terminal: end it with Ctrl-D on a line of its own)\n"


# ------------------------------------------------------------------------------ -s latest that is not there

def test_a_missing_corrupt_or_stale_latest_record_names_the_step_flag(sft_checkpoint, monkeypatch):
    from nanochat import checkpoint
    from nanochat.model_choice import check_checkpoint
    from scripts import chat_cli

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(checkpoint, "load_model", no_loading)
    latest = sft_checkpoint / "checkpoints" / "sft" / "d2" / "latest.json"
    check_checkpoint("sft", None, "latest")   # as saved: fine
    record = json.loads(latest.read_text())
    cases = [(None, "missing"), ("garbage", "corrupt"), ('{"step": 1.5}', "corrupt")]
    for text, state in cases:
        latest.unlink(missing_ok=True)
        if text is not None:
            latest.write_text(text)
        said = f"^-s/--step: got latest, but {re.escape(str(latest))} \\(the latest step's record\\) is {state}; " \
               "accepted: a step on disk: 7$"
        with pytest.raises(RequestError, match=said):
            check_checkpoint("sft", None, "latest")
        with pytest.raises(RequestError, match=said):   # chat_cli says it before a runtime or the model
            chat_cli.main(["-p", "hi", "--device", "cpu"])
    latest.write_text(json.dumps({**record, "step": 9, "dir": "step_000009"}))   # names a step that is gone
    with pytest.raises(RequestError, match=r"^-s/--step: got latest \(step 9, which latest.json names\); "
                                           r"accepted: a step on disk: 7 \(in "):
        check_checkpoint("sft", "d2", "latest")
    check_checkpoint("sft", "d2", "7")   # an explicit step on disk is still fine


# ------------------------------------------------------------------------------ -i base at the context's end

def test_a_base_model_cut_off_by_the_context_speaks_of_its_text(chat_model, capsys):
    from scripts.chat_cli import answer

    tok = chat_model[1]
    word = tok.encode(" and")[0]
    engine = scripted_engine(tok, lambda b, gen: word, [0] * 125)   # context 128: room for 3 tokens
    answer(engine, tok, [tok.bos_token_id] * 125, ARGS, seed=0, out=io.StringIO(), plain=True)
    assert capsys.readouterr().err == "[cut off: the text filled the model's context of 128 tokens]\n"


# ------------------------------------------------------------------------------ what the graph step is, and why

def test_an_explicit_graph_step_this_run_cannot_take_is_said(sft_checkpoint, monkeypatch, capsys):
    """--graph-step persistent (or compiled) with an eager / static decode on a CPU ran the plain model and
    nothing said so; chat_web's banner says the engine's note. -p: on stderr, the answer alone on stdout."""
    from scripts import chat_cli

    flags = ["--device", "cpu", "-m", "2", "-t", "0"]
    assert chat_cli.main(["-p", "hi", "--graph-step", "persistent", *flags]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("[graph_step persistent: decode=eager has no static decode step") and "graph" not in out
    assert chat_cli.main(["-p", "hi", "--graph-step", "compiled", "--decode", "static", *flags]) == 0
    assert capsys.readouterr().err.startswith("[graph_step compiled: decode=static runs its static steps on the plain")
    assert chat_cli.main(["-p", "hi", *flags]) == 0   # auto: nothing to say
    assert "graph_step" not in capsys.readouterr().err

    def typed(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", typed)
    assert chat_cli.main(["--graph-step", "persistent", *flags]) == 0
    banner = capsys.readouterr().out.splitlines()
    assert banner[1].startswith("  graph_step persistent: decode=eager has no static decode step")


def test_a_failed_persistent_probe_is_said_on_stderr(chat_model, monkeypatch, capsys):
    """graph_step auto's probe of the persistent kernel (CUDA) printed its fallback on stdout, the line before
    `chat_cli -p`'s answer, which stdout holds alone. Simulated on the CPU: the probe's kernel fails."""
    import nanochat.triton_decode as triton_decode
    from nanochat.engine import Engine
    from tests.test_engine import prompt_for

    def broken(*a, **k):
        raise RuntimeError("out of resources: shared memory")
    monkeypatch.setattr(triton_decode, "PersistentDecodeStep", broken)
    model, tok = chat_model
    engine = Engine(model, tok, decode="static", decode_bucket=16)
    engine.graph_step, engine.graph_step_auto = "persistent", True   # what auto picks on an H100
    got, _ = engine.generate_batch(prompt_for(tok), max_tokens=4, temperature=0.0)
    want, _ = Engine(model, tok).generate_batch(prompt_for(tok), max_tokens=4, temperature=0.0)
    assert got == want and engine.graph_step == "eager"
    out, err = capsys.readouterr()
    assert out == ""
    assert err == "engine: graph_step auto: eager (the persistent step failed its probe: out of resources: " \
                  "shared memory)\n"
