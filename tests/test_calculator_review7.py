"""The calculator tool end to end (review 7): a refused call gets an empty forced output block, so a
model that learned output blocks cannot pass off a made-up result as the calculator's; the stream
shows every call closed; a streamed answer sent back as history renders to the tokens generated;
several calls per answer, rows that do not call, calls cut off at max_tokens; GSM8K's annotations
read the way the calculator writes them."""

import json
import re
import time

import pytest

from nanochat.batching import BatchedEngine
from nanochat.calculator import REFUSED_OUTPUT, evaluate, use_calculator
from nanochat.chat_api import tool_call_parts
from nanochat.engine import TOOL_TEXT, assistant_parts
from nanochat.text_stream import TextStream
from tests.test_engine import run, scripted_engine, specials, tiny_chat_model


@pytest.fixture(scope="module")
def tok(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))[1]   # cached: the same tokenizer as test_engine's


def shown(tok, ids) -> str:
    """What chat_cli and the server stream for generated ids."""
    stream = TextStream(tok, (), {tok.encode_special(k): v for k, v in TOOL_TEXT.items()})
    return "".join(stream.feed(t) for t in ids) + stream.finish()


def next_prompt(tok, assistant_content):
    return tok.render_for_completion({"messages": [{"role": "user", "content": "q"},
                                                   {"role": "assistant", "content": assistant_content},
                                                   {"role": "user", "content": "and?"}]})


def generated_rows(cols, n, stop):
    """Each row's ids up to (not including) its stop token."""
    rows = [[c[b] for c in cols] for b in range(n)]
    return [ids[:ids.index(stop)] for ids in rows]


@pytest.mark.parametrize("decode", ["eager", "static", "batched"])
def test_a_refused_call_gets_an_empty_output_not_a_made_up_one(tok, decode):
    """Midtraining trains on tool outputs (mask all), so after <|python_end|> a model writes
    <|output_start|> and a number itself. For a call the calculator refuses nothing was forced:
    the model's own "7" streamed as "<<50%*20=7>>", a calculator result to the reader, and RL
    trained on it (mask 1). Now a block is forced (mask 0) and the model's guess never runs; it holds
    calculator.REFUSED_OUTPUT (review 13: empty, it streamed as "<<50%*20=>>", a result gone missing)."""
    s, prompt = specials(tok), [tok.bos_token_id, 5]
    call = [s.python_start, *tok.encode("50%*20"), s.python_end]
    made_up = [s.output_start, *tok.encode("7"), s.output_end]
    tail = [*tok.encode(" so 10"), s.assistant_end]

    def plan(b, gen):
        if s.output_end in gen:
            return tail[len(gen) - gen.index(s.output_end) - 1]
        return (call + made_up)[len(gen)]

    engine = scripted_engine(tok, plan, prompt, "eager" if decode == "eager" else "static")
    source = BatchedEngine(engine, slots=2) if decode == "batched" else engine
    try:
        steps = list(source.generate(prompt, temperature=0.0, max_tokens=60))
    finally:
        if decode == "batched":
            source.close()
    tokens, masks = [c[0] for c, _ in steps], [m[0] for _, m in steps]
    refused = [s.output_start, *tok.encode(REFUSED_OUTPUT), s.output_end]
    assert tokens == call + refused + tail
    assert masks == [1] * len(call) + [0] * len(refused) + [1] * len(tail)
    assert shown(tok, tokens[:-1]) == "<<50%*20=error>> so 10"


def test_a_refused_call_streams_closed_and_comes_back_as_the_same_tokens(tok):
    """The stream showed "<<50%*20=" and never closed it; sent back as history that text rendered as
    ordinary tokens, not the python block the model wrote. Now "<<50%*20=>>" round-trips, through
    the server (tool_call_parts) and the CLI (assistant_parts) alike."""
    s = specials(tok)
    ids = [*tok.encode("Half is "), s.python_start, *tok.encode("50%*20"), s.python_end, s.output_start,
           s.output_end, *tok.encode(" 10.")]
    text = shown(tok, ids)
    assert text == "Half is <<50%*20=>> 10."
    prompt = next_prompt(tok, "")[:-6]   # bos, the user turn, <|assistant_start|>
    want = prompt + ids + [tok.encode_special("<|assistant_end|>")]
    assert next_prompt(tok, tool_call_parts(text))[:len(want)] == want
    assert next_prompt(tok, assistant_parts(tok, ids))[:len(want)] == want


def test_empty_tool_blocks_are_kept_as_parts(tok):
    """assistant_parts dropped a block with nothing in it, so its start / end tokens vanished from
    the next turn's prompt (the CLI keeps history this way)."""
    s = specials(tok)
    ids = [s.python_start, s.python_end, s.output_start, s.output_end]
    assert assistant_parts(tok, ids) == [{"type": "python", "text": ""}, {"type": "python_output", "text": ""}]
    assert tool_call_parts(shown(tok, ids)) == assistant_parts(tok, ids)
    assert next_prompt(tok, assistant_parts(tok, ids))[-len(ids) - 6:-6] == ids


def test_text_that_only_looks_like_a_call_stays_text():
    for text in ("<<2+2=5>>", "<<2+2=>>", "<<12*3=", "<<=4>>", "a <<x=1>> b", "<<1<2=>>"):
        assert tool_call_parts(text) == text
    assert tool_call_parts("<<x=>>") == [{"type": "python", "text": "x"}, {"type": "python_output", "text": ""}]


@pytest.mark.parametrize("decode", ["eager", "static"])
def test_two_calls_in_one_row_and_a_row_without_calls(tok, decode):
    """Row 0 makes an accepted and a refused call, row 1 none: each row gets only its own forced
    tokens, and each row's streamed text renders back to exactly what it generated."""
    s, prompt = specials(tok), [tok.bos_token_id, 9]
    pieces = [[10, s.python_start, *tok.encode("12*3"), s.python_end],
              [*tok.encode(" and "), s.python_start, *tok.encode("x+1"), s.python_end],
              [*tok.encode(" done"), s.assistant_end]]
    plain = [10, *tok.encode(" no tools here"), s.assistant_end]

    def plan(b, gen):
        if b == 1:
            return plain[len(gen)] if len(gen) < len(plain) else 3
        closed = [i for i, t in enumerate(gen) if t == s.output_end]
        start = closed[-1] + 1 if closed else 0
        piece = pieces[len(closed)]
        return piece[len(gen) - start] if len(gen) - start < len(piece) else 3   # 3: overridden by forcing

    cols, masks = run(scripted_engine(tok, plan, prompt, decode), prompt, num_samples=2, max_tokens=80)
    row0, row1 = generated_rows(cols, 2, s.assistant_end)
    out36 = [s.output_start, *tok.encode("36"), s.output_end]
    refused = [s.output_start, *tok.encode(REFUSED_OUTPUT), s.output_end]
    assert row0 == pieces[0] + out36 + pieces[1] + refused + pieces[2][:-1]
    assert row1 == plain[:-1] and all(m[1] == 1 for m in masks[:len(plain)])
    assert sum(m[0] == 0 for m in masks[:len(row0)]) == len(out36) + len(refused)
    text = shown(tok, row0)
    assert text == shown(tok, [10]) + "<<12*3=36>> and <<x+1=error>> done"
    want = next_prompt(tok, "")[:-6] + row0
    assert next_prompt(tok, tool_call_parts(text))[:len(want)] == want
    assert tool_call_parts(shown(tok, row1)) == shown(tok, row1)


def test_a_call_cut_off_at_max_tokens_forces_nothing(tok):
    s, prompt = specials(tok), [tok.bos_token_id, 4]
    digits = tok.encode("1")
    engine = scripted_engine(tok, lambda b, gen: s.python_start if not gen else digits[0], prompt)
    cols, masks = run(engine, prompt, max_tokens=6)
    assert [c[0] for c in cols] == [s.python_start] + digits[:1] * 5
    assert all(m[0] == 1 for m in masks)
    assert shown(tok, [c[0] for c in cols]) == "<<11111"


def test_gsm8k_annotations_read_as_the_calculator_writes_them(shared_data):
    """Every calculator annotation of the GSM8K test split is accepted and equals the annotated
    result (annotations write "16.00" or ".5" where the calculator writes "16" and "0.5", which
    solution_to_parts uses); whole numbers never come with ".0"."""
    calls = re.compile(r"<<([^<>]*)>>")
    n = 0
    with open(shared_data / "eval" / "gsm8k.jsonl") as f:
        for line in f:
            for m in calls.finditer(json.loads(line)["answer"]):
                expr, _, result = m.group(1).rpartition("=")
                out = use_calculator(expr)
                assert out is not None, m.group(0)
                assert not out.endswith(".0") and "e" not in out, (m.group(0), out)
                if "/" not in result:   # one annotation writes "3/4" for 0.75
                    assert float(out) == float(result.replace(",", "")), (m.group(0), out)
                n += 1
    assert n > 4000


@pytest.mark.parametrize("expr", ["1e308 // 1e-308", "(2**1023*2-1) % 1.5", "'a' * 10**9", "(-2)**1024",
                                  "9" * 299 + "**2", "b'a'.count(b'a')", "f'{1}'.count('1')", "1 + \x00",
                                  "[" * 150 + "]" * 150, "'x'.count('x')" + "*9" * 95])
def test_more_hostile_inputs_are_refused_fast(expr):
    t0 = time.perf_counter()
    assert use_calculator(expr) is None
    assert time.perf_counter() - t0 < 0.5


def test_results_stay_exact_and_readable():
    assert use_calculator("(-2)**1023") == str((-2) ** 1023)
    assert use_calculator("2**-1080") == "0"                  # underflow is zero, not an error
    assert use_calculator("100 * 1.1") == "110" and use_calculator("4 * 1.1") == "4.4"
    assert evaluate("1_000 * 2") == 2000 and use_calculator("'abc'.count('')") == "4"
