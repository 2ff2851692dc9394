"""GSM8K grade-school math: solutions become calculator tool calls, answers are read after '####'.

A solution line like `9 * 2 = $<<9*2=18>>18` turns into the assistant parts
  text "9 * 2 = $", python "9*2", python_output "18", text "18 ..."
so the model learns to call the calculator (the Engine runs the python part and forces the
output tokens; the tokenizer masks python_output out of the loss). The python_output text is the
calculator's own (`use_calculator`, what the Engine forces), not the annotation's spelling of it
("<<4*4=16.00>>" gives "16"), so training sees the tokens inference will; an expression the
calculator refuses keeps the annotation's text.

Local file: `gsm8k.jsonl` (test split; `gsm8k_<split>.jsonl` otherwise), rows {"question", "answer"}.
Hub: openai/gsm8k, config "main". Rows stay in the file's order, unlike MMLU's and HumanEval's
fixed shuffle: the released test split is in no order of topic or difficulty (calculator calls and
question length are flat across it), so its first N (chat_eval --max-problems N, chat_rl's
--eval-examples) are already a spread of the set, and every --test-holdout run so far split it there.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from nanochat.calculator import use_calculator
from nanochat.tasks.common import Task, check_rows, load_rows

_CALL = re.compile(r"<<([^<>]*)>>")
# after '####': an optional sign before the dollar ("-$5") or after it ("$-5"), then the number, whole:
# not the head of a fraction or exponent ("12/5" was read as 12, "1e3" as 1). In a completion a comma
# only between groups of three digits ("1,250"): stripped anywhere, a decimal comma "2,5" read as 25
# and a list "1,2" as 12, both scored right against a gold 25 / 12 (they are now no answer). A gold
# answer (the dataset's own text, trusted) drops its commas wherever they stand: no row is refused for that.
_ANSWER_FORM = (r"####\s*(?:(-)\s*\$|\$)?\s*(-?{digits}(?:\.[0-9]+)?|-?\.[0-9]+)"
                r"(?![.,]?[0-9]|\s*/\s*[0-9]|[eE][+-]?[0-9])")
_ANSWER = re.compile(_ANSWER_FORM.replace("{digits}", r"(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)"))
_GOLD_ANSWER = re.compile(_ANSWER_FORM.replace("{digits}", r"[0-9][0-9,]*"))
_SPLITS = ("train", "test")


def solution_to_parts(solution: str) -> list[dict]:
    """Split a GSM8K solution into text / python / python_output parts (adjacent text merged)."""
    parts: list[dict] = []

    def add_text(text: str) -> None:
        if not text:
            return
        if parts and parts[-1]["type"] == "text":
            parts[-1]["text"] += text
        else:
            parts.append({"type": "text", "text": text})

    pos = 0
    for m in _CALL.finditer(solution):
        add_text(solution[pos:m.start()])
        expr, eq, result = m.group(1).rpartition("=")
        if eq and expr.strip():
            forced = use_calculator(expr.strip())  # what the Engine forces after this call (refused: the
            # annotation's result stays, where the Engine forces "error"; no GSM8K test call is refused)
            parts.append({"type": "python", "text": expr.strip()})
            parts.append({"type": "python_output", "text": result.strip() if forced is None else forced})
        else:  # a malformed annotation without '=': keep it as plain text
            add_text(m.group(0))
        pos = m.end()
    add_text(solution[pos:])
    return parts


def extract_answer(text: str, *, gold: bool = False) -> str | None:
    """The number after the first '####' (thousands commas removed), or None when there is none. The
    first, as OpenAI's grade-school-math grader and upstream nanochat read it: a completion that runs
    on past its answer (e.g. into another "#### N") is scored on the answer it gave first. `gold`:
    the dataset's answer, whose commas are all dropped wherever they stand."""
    m = (_GOLD_ANSWER if gold else _ANSWER).search(text)
    return (m.group(1) or "") + m.group(2).replace(",", "").rstrip(".") if m else None


def answers_match(pred: str | None, gold: str | None) -> bool:
    """Numeric equality of two answers ("18" == "18.0"), exact: both are decimal text, and a float
    tolerance would accept 123456789012345679 for 123456789012345678 or 0.1000001 for 0.1."""
    if pred is None or gold is None:
        return False
    try:
        return Decimal(pred.strip()) == Decimal(gold.strip())
    except InvalidOperation:
        return pred.strip() == gold.strip()


def assistant_text(conversation: dict) -> str:
    """All text of the last assistant message (string content or the text of every part)."""
    content = conversation["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content)


def check_row(row: dict) -> str | None:
    """What is wrong with a GSM8K row, or None. An answer without its final '#### N' has no gold
    number: every completion would score as wrong (and SFT would train on a solution that never
    states its answer), silently."""
    if not (isinstance(row["answer"], str) and isinstance(row["question"], str)):
        return "'question' and 'answer' must be strings"
    if extract_answer(row["answer"], gold=True) is None:
        return f"'answer' must end in '#### N' (the final number), got ...{row['answer'][-40:]!r}"
    return None


class GSM8K(Task):
    eval_type = "generative"
    name = "GSM8K"

    def __init__(self, split: str = "test", *, data_dir=None, **kw):
        super().__init__(**kw)
        if split not in _SPLITS:
            raise ValueError(f"GSM8K split: got {split!r}; accepted: {'|'.join(_SPLITS)}")
        names = [f"gsm8k_{split}.jsonl"] + (["gsm8k.jsonl"] if split == "test" else [])
        self.rows, self.source = load_rows("eval", names, data_dir=data_dir, hub=("openai/gsm8k", "main", split))
        check_rows(self.rows, self.source, ("question", "answer"), check_row)

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        r = self.rows[index]
        return {"messages": [{"role": "user", "content": r["question"]},
                             {"role": "assistant", "content": solution_to_parts(r["answer"])}],
                "answer": extract_answer(r["answer"], gold=True)}

    def evaluate(self, conversation: dict, completion: str) -> bool:
        gold = conversation.get("answer") or extract_answer(assistant_text(conversation), gold=True)
        return answers_match(extract_answer(completion), gold)

    def reward(self, conversation: dict, completion: str) -> float:
        return float(self.evaluate(conversation, completion))
