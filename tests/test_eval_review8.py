"""Review 8 of the pipeline's end (chat_eval, the tasks' scoring, chat_cli, the report), as a demanding
user meets it. Each test failed before its fix:

* chat_cli: a model that ends its turn at once (or writes only whitespace) printed a blank line and
  nothing else (`-p` exit 0 with an empty answer), as if it had hung or failed silently; now a note on
  stderr says the reply was empty (stdout still holds the answer alone).
* ARC / MMLU letters (tasks/arc.py extract_letter): a letter in quotes, backticks or brackets
  ('The answer is "B"', "`C`", "[D]") named no answer: scored wrong.
* chat_eval's report entry did not record --max-new-tokens (nor --top-k / --seed of a sampled run): two
  entries of one stage, one cut at 8 new tokens, differed in nothing the report showed but their scores.
* chat_eval said "scoring its first N problems only: the model trained on the rest" for a task whose
  file (--data-dir) holds N problems or fewer: there was no rest.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest

from tests.test_engine import prompt_for, scripted_engine, specials, tiny_chat_model

ARGS = SimpleNamespace(max_tokens=8, temperature=0.0, top_k=None, top_p=None)


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's


# ------------------------------------------------------------------ chat_cli: an empty reply

@pytest.mark.parametrize("reply", ["", " \n  "])
def test_an_empty_reply_is_said_on_stderr(chat_model, capsys, reply):
    from scripts.chat_cli import answer

    tok = chat_model[1]
    s = specials(tok)
    script = [*tok.encode(reply), s.assistant_end]
    prompt = prompt_for(tok, "hi")
    engine = scripted_engine(tok, lambda b, gen: script[len(gen)], prompt)
    out = io.StringIO()
    msg = answer(engine, tok, prompt, ARGS, 0, out=out)
    assert out.getvalue() == reply + "\n"            # stdout: the answer alone, as for any reply
    assert capsys.readouterr().err == "[empty reply: the model ended its turn without writing any text]\n"
    assert msg["role"] == "assistant"


def test_a_reply_with_text_gets_no_empty_note(chat_model, capsys):
    from scripts.chat_cli import answer

    tok = chat_model[1]
    s = specials(tok)
    script = [*tok.encode(" yes"), s.assistant_end]
    prompt = prompt_for(tok, "hi")
    engine = scripted_engine(tok, lambda b, gen: script[len(gen)], prompt)
    answer(engine, tok, prompt, ARGS, 0, out=io.StringIO())
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------ multiple-choice letters

def mc(gold: str) -> dict:
    from nanochat.tasks.arc import mc_conversation

    return mc_conversation("Sky colour?", ["green", "blue", "red", "black"], "ABCD".index(gold))


@pytest.mark.parametrize("completion, gold", [
    ('The answer is "B"', "B"), ("The answer is 'B'.", "B"), ("`C`", "C"), ("[D]", "D"),
    ("Answer: `c`", "C"), ("The answer is \u201cA\u201d.", "A"), ('The answer is **"B"**', "B"),
])
def test_a_quoted_or_bracketed_letter_is_read(completion, gold):
    from nanochat.tasks.arc import evaluate_letter

    assert evaluate_letter(mc(gold), completion)
    assert not evaluate_letter(mc("A" if gold != "A" else "B"), completion)


@pytest.mark.parametrize("completion", ['"A" or "B"', "'A' and 'B'", "It's A's turn", '"Because"'])
def test_quotes_do_not_make_a_hedge_or_a_word_an_answer(completion):
    from nanochat.tasks.arc import evaluate_letter

    assert not any(evaluate_letter(mc(g), completion) for g in "ABCD")


# ------------------------------------------------------------------ chat_eval's report entry and limits

def chat_cfg(*argv):
    from scripts.chat_eval import ChatEvalConfig

    return ChatEvalConfig(source="sft", **dict(argv)).validate()


def section_for(cfg, tasks):
    from scripts.chat_eval import report_section

    results = {n: {"accuracy": 0.5, "total": 4, "problems": 4, "seconds": 1.0} for n in tasks}
    out = {"step": 3, "results": results, "ChatCORE": 0.1, "complete": False, "training_problems_known": True}
    return report_section(cfg, "d1", out, {n: SimpleNamespace(eval_type=t) for n, t in tasks.items()})


def test_the_report_entry_records_how_answers_were_generated():
    greedy = section_for(chat_cfg(("task_name", "GSM8K"), ("max_new_tokens", 8)), {"GSM8K": "generative"})
    assert greedy["max_new_tokens"] == 8 and "top_k" not in greedy   # greedy: top-k and seed change nothing
    sampled = section_for(chat_cfg(("task_name", "GSM8K"), ("temperature", 0.8), ("top_k", 20), ("seed", 7)),
                          {"GSM8K": "generative"})
    assert (sampled["max_new_tokens"], sampled["top_k"], sampled["seed"]) == (512, 20, 7)
    letters = section_for(chat_cfg(("task_name", "ARC-Easy")), {"ARC-Easy": "categorical"})
    assert "max_new_tokens" not in letters   # no answer was generated


def test_a_task_no_larger_than_its_holdout_is_not_said_to_be_cut(capsys):
    from scripts.chat_eval import problem_limits

    cfg = chat_cfg(("task_name", "ARC-Easy|MMLU"))
    held = {"ARC-Easy": (10, "sft"), "MMLU": (10, "sft")}
    assert problem_limits(cfg, held, {"ARC-Easy": 4, "MMLU": 50}) == {"MMLU": 10}
    out = capsys.readouterr().out
    assert "ARC-Easy" not in out and "MMLU: scoring its first 10 problems only" in out
