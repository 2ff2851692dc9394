"""Evaluation review 14: scores checked against scripted answerers, and defects they and a reading of
the scoring found.

* HumanEval: code written without a fence and followed (or preceded) by prose ("def f(...): ...
  \\n\\nThis returns ...") ran whole as Python: a SyntaxError, so a correct answer scored 0; and an
  unfenced function next to a fenced usage example (```print(f(1))```) ran the example against the
  prompt's docstring-only stub. The code among the prose is now what runs.
* CORE (offline COPA): each choice's first letter was lowered to continue the premise, the pronoun I
  too ("i took deep breaths."): a word no text writes, which made that choice alone less likely in
  the 4 items where one choice starts with "I" and the other does not.
* every chat_eval task, through its real data and scoring code, gives a gold answerer every problem
  and a wrong one none (categorical: a scripted model's letter logits; generative: a scripted
  Engine replaying the rendered gold answer, calculator calls and outputs included).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from nanochat.tasks.humaneval import extract_program

_PROMPT = 'from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    """Return a + b."""\n'


def _add(program: str):
    namespace: dict = {}
    exec(compile(program, "program.py", "exec"), namespace)
    return namespace["add"]


@pytest.mark.parametrize("completion", [
    "    return a + b\n\nThis returns the sum of the two numbers.\n",                 # a body, then prose
    "def add(a: int, b: int) -> int:\n    return a + b\n\nThis adds them.\n",         # a function, then prose
    "Here is the function:\ndef add(a, b):\n    return a + b\nIt adds a and b.",      # prose around it
    "Sure, using a helper:\n\nimport operator\n\ndef plus(a, b):\n    return operator.add(a, b)\n\n"
    "def add(a, b):\n    return plus(a, b)\n\nThat is all.\n",                         # its helper and import kept
    "def add(a, b):\n    return a + b\n\nUsage:\n```python\nprint(add(1, 2))\n```\n",  # not the usage block
    "    return a + b\n",                                                              # (as before) a raw body
    # the signature and docstring repeated as text, the body in a block (review: ran the empty stub)
    'def add(a: int, b: int) -> int:\n    """Return a + b."""\n```python\n    return a + b\n```\n',
    'Here it is:\ndef add(a, b):\n    """Return a + b."""\n```python\n    return a + b\n```\nDone.\n',
    # the whole function as text, one line of it explained in a block: the function runs, not the excerpt
    "def add(a, b):\n    total = a\n    total += b\n    return total\n\nThe key line:\n```python\n"
    "    total += b\n```\n",
])
def test_humaneval_runs_the_code_among_prose(completion):
    assert _add(extract_program(completion, _PROMPT, "add"))(2, 3) == 5


def test_humaneval_code_among_prose_is_still_scored_on_what_it_does():
    wrong = extract_program("    return a - b\n\nThis returns the sum.\n", _PROMPT, "add")
    assert _add(wrong)(2, 3) == -1
    # a program that compiles whole is never cut (its prose-like last line is the model's code)
    assert extract_program("    return a + b\nprint(add(1, 2))\n", _PROMPT, "add") == \
        _PROMPT + "    return a + b\nprint(add(1, 2))\n"
    # nothing but prose: the prompt's stub with the prose, which fails to compile, as before
    assert extract_program("I cannot solve this.", _PROMPT, "add") == _PROMPT + "I cannot solve this."


def test_humaneval_scores_a_correct_function_followed_by_prose(shared_data):
    from nanochat.tasks import HumanEval

    he = HumanEval(data_dir=shared_data / "eval")
    conv = he.file_example(0)
    solution = conv["messages"][1]["content"]   # the prompt + the canonical body: the whole function
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the sandbox's note on isolation layers this machine refuses
        assert he.evaluate(conv, solution + "\nThis compares every pair of numbers.\n")
        assert not he.evaluate(conv, conv["prompt"] + "    return False\n\nThis compares every pair.\n")


def test_core_copa_keeps_the_pronoun_i_upper_case(shared_data):
    from nanochat.core_data import load_core_data

    (task, items), = load_core_data(tasks=["copa"], data_dir=shared_data / "eval").tasks
    choices = [c for item in items for c in item["choices"]]
    assert "I took deep breaths." in choices and "my heart pounded." in choices
    assert not [c for c in choices if c.startswith(("i ", "i'"))]
    assert all(c[:1].islower() or c.startswith(("I ", "I'")) for c in choices if c[:1].isalpha())


# ------------------------------------------------------------------ scripted answerers

class LetterModel(torch.nn.Module):
    """Logits for each row's prompt (identified by its tokens): `first` highest, the other letters after."""

    def __init__(self, table: dict[tuple, list[int]], vocab: int):
        super().__init__()
        self.table, self.vocab = table, vocab

    def forward(self, x):
        out = torch.zeros(*x.shape, self.vocab)
        for r, row in enumerate(x.tolist()):
            prompt = max((p for p in self.table if tuple(row[:len(p)]) == p), key=len)
            first, *rest = self.table[prompt]
            out[r, len(prompt) - 1, rest] = 1.0
            out[r, len(prompt) - 1, first] = 5.0
        return out


class ReplayEngine:
    """An Engine whose answer to each prompt is scripted (the prompt's ids -> the completion's)."""

    max_seq_len = 1 << 20

    def __init__(self, table: dict[tuple, list[int]]):
        self.table = table

    def generate_batch(self, prompt, num_samples=1, **kw):
        return [list(prompt) + self.table[tuple(prompt)] for _ in range(num_samples)], None


@pytest.mark.parametrize("gold", [True, False])
def test_every_chat_eval_task_scores_a_gold_answerer_right_and_a_wrong_one_wrong(tiny_tokenizer, shared_data, gold):
    from nanochat.tasks import EVAL_TASKS, get_task
    from nanochat.tasks.evaluate import run_categorical, run_generative

    tok = tiny_tokenizer
    for name in EVAL_TASKS:
        task = get_task(name, data_dir=shared_data / "eval")
        n = 8 if name == "HumanEval" else 40   # HumanEval runs each program in the sandbox (~0.2 s)
        table = {}
        for i in range(n):
            conv = task[i]
            prompt = tuple(tok.render_for_completion(conv))
            if task.eval_type == "categorical":
                letters, answer = conv["letters"], conv["messages"][-1]["content"]
                first = answer if gold else next(x for x in letters if x != answer)
                table[prompt] = [tok.encode(first)[0]] + [tok.encode(x)[0] for x in letters if x != first]
            elif gold:   # the rendered gold answer, tool calls and their outputs as the Engine forces them
                ids, _ = tok.render_conversation(conv, max_tokens=1 << 20)
                table[prompt] = ids[len(prompt):-1]   # without <|assistant_end|>
            else:
                table[prompt] = tok.encode("    return None\n\n#### 123456789")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if task.eval_type == "categorical":
                res = run_categorical(LetterModel(table, tok.vocab_size), tok, task, "cpu", batch_size=7,
                                      max_problems=n)
            else:
                res = run_generative(ReplayEngine(table), tok, task, "cpu", max_problems=n)
        assert (res.passed, res.total) == ((n if gold else 0), n), name
