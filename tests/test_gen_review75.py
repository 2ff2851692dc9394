"""Review 75 of generation (engine, batching, sampling, chat_cli), as a demanding user meets it: a
chat_cli reply cut off inside a calculator call (--max-tokens, Ctrl-C, the context end) keeps that
call in the conversation as the text it showed, not as a tool call whose output the next turn reads
as the calculator's answer (the chat API keeps a cut-off call as text too:
chat_api.tool_call_parts)."""

import io
from types import SimpleNamespace

import pytest

from nanochat.calculator import use_calculator
from tests.test_engine import prompt_for, scripted_engine, specials, tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's


def _args(max_tokens):
    return SimpleNamespace(max_tokens=max_tokens, temperature=0.0, top_k=None, top_p=None)


def _call_plan(tok, before, expr, after):
    """A scripted reply: `before` text, a calculator call of `expr` (the engine forces its output), then
    `after` and <|assistant_end|>. The reply is read after the last <|assistant_start|> (a scripted
    engine built for a one-token prompt sees a conversation's prompt as generated)."""
    s = specials(tok)
    call = tok.encode(before) + [s.python_start, *tok.encode(expr), s.python_end]
    tail = tok.encode(after) + [s.assistant_end]
    start = tok.encode_special("<|assistant_start|>")

    def plan(b, gen):
        if start in gen:
            gen = gen[len(gen) - gen[::-1].index(start):]
        if s.output_end in gen:
            return tail[len(gen) - gen.index(s.output_end) - 1]
        return call[len(gen)] if len(gen) < len(call) else 7   # 7: replaced by the forced output
    return plan, len(call)


def _tool_outputs(tok, ids):
    """The text of every <|output_start|> ... <|output_end|> block in `ids` (a rendered prompt)."""
    s = specials(tok)
    out, i = [], 0
    while s.output_start in ids[i:]:
        j = ids.index(s.output_start, i)
        k = ids.index(s.output_end, j)
        out.append(tok.decode(ids[j + 1:k]))
        i = k + 1
    return out


def test_a_reply_cut_off_inside_the_calculator_output_keeps_it_as_text(chat_model):
    """-m cut the reply inside the forced output of 2**200 (61 digits): the conversation kept a
    python_output part holding the first digits, and the next turn's prompt showed the model
    `<|output_start|>16069<|output_end|>`, a calculator answer nobody computed."""
    from scripts.chat_cli import answer

    tok = chat_model[1]
    result = use_calculator("2**200")
    plan, call_len = _call_plan(tok, "Sure: ", "2**200", " done")
    prompt = prompt_for(tok)
    cut = call_len + 4   # <|output_start|> and three tokens of the result
    out = io.StringIO()
    message = answer(scripted_engine(tok, plan, prompt), tok, prompt, _args(cut), seed=0, out=out)
    shown = out.getvalue().rstrip("\n")
    assert shown.startswith("Sure: <<2**200=") and result.startswith(shown[len("Sure: <<2**200="):])
    assert len(shown) < len("Sure: <<2**200=") + len(result)   # really cut inside the output
    # as the chat API keeps it (tool_call_parts): the text as shown, not a tool call
    assert message["content"] == [{"type": "text", "text": shown}]
    history = [{"role": "user", "content": "2**200?"}, message, {"role": "user", "content": "and?"}]
    assert _tool_outputs(tok, tok.render_for_completion({"messages": history})) == []

    # the whole reply fits: the call stays a call, its output the calculator's
    full = answer(scripted_engine(tok, plan, prompt), tok, prompt, _args(200), seed=0, out=io.StringIO())
    assert full["content"] == [{"type": "text", "text": "Sure: "}, {"type": "python", "text": "2**200"},
                               {"type": "python_output", "text": result}, {"type": "text", "text": " done"}]


def test_ctrl_c_inside_a_calculator_call_keeps_the_partial_call_as_text(chat_model):
    """Ctrl-C while the call's expression was being written: the kept partial answer held a python part,
    which the next turn rendered as a closed call that never got an output block."""
    from scripts.chat_cli import answer

    tok = chat_model[1]
    s = specials(tok)
    script = tok.encode("Let me see ") + [s.python_start, *tok.encode("12*3")]

    def plan(b, gen):
        if len(gen) == len(script):
            raise KeyboardInterrupt
        return script[len(gen)]
    prompt = prompt_for(tok)
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt) as stop:
        answer(scripted_engine(tok, plan, prompt), tok, prompt, _args(40), seed=0, out=out)
    assert out.getvalue() == "Let me see <<12*3\n"
    assert stop.value.message == {"role": "assistant", "content": [{"type": "text", "text": "Let me see <<12*3"}]}
    history = [{"role": "user", "content": "12*3?"}, stop.value.message, {"role": "user", "content": "go on"}]
    assert s.python_start not in tok.render_for_completion({"messages": history})


def test_the_interactive_chat_does_not_show_the_next_turn_a_truncated_result(chat_model, monkeypatch):
    """End to end through the loop: a reply cut at -m inside the output of 2**200, then a second
    message; the second prompt holds no tool output other than complete calculator results."""
    from scripts.chat_cli import converse

    tok = chat_model[1]
    plan, call_len = _call_plan(tok, "", "2**200", " ok")
    engine = scripted_engine(tok, plan, [0])
    typed = iter(["what is 2**200?", "and then?"])

    def read(prompt=""):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None
    prompts = []
    real_render = type(tok).render_for_completion
    monkeypatch.setattr("builtins.input", read)
    monkeypatch.setattr(type(tok), "render_for_completion",
                        lambda self, conv: prompts.append(real_render(self, conv)) or prompts[-1])
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert converse(engine, tok, _args(call_len + 3), lambda: 0) == 0
    assert len(prompts) == 2
    assert all(o == use_calculator("2**200") for o in _tool_outputs(tok, prompts[1]))
    assert "<<2**200=" in tok.decode(prompts[1])   # what the user saw is still in the conversation
