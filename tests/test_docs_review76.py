"""Review 76: README.md, docs/INTERFACES.md and rustbpe/README.md against the code, where the other
doc tests do not look.

test_docs_review6 checks INTERFACES.md's signatures (names, positional order, literal defaults) and
its module-level names; test_readme_walkthrough the tiny preset's figures. This file adds:
- an indented `name: type` line of an INTERFACES.md block is an attribute of the class it sits
  under (a line that drifted under a function, or a class without that attribute, is caught);
- what the README says chat_eval scores of the tiny model without `--max-problems` is what
  chat_eval's problem_limits and the offline task files give (held-out tasks: their first N;
  the others: every problem);
- rustbpe/README.md's benchmark paragraph quotes bench_tokenizer's defaults and points at no
  figures outside the repository.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from test_docs_review6 import _find, code_lines

REPO = Path(__file__).resolve().parents[1]
README = " ".join((REPO / "README.md").read_text().split())   # sentences run over line breaks


def quoted(pattern: str, text: str = README) -> re.Match:
    m = re.search(pattern, text)
    assert m, f"the doc no longer says {pattern!r}: update this test with it"
    return m


# ------------------------------------------------------------------------------ INTERFACES attributes

def attribute_problems(text: str) -> tuple[list[str], int]:
    """(problems, attributes checked) of the indented `name: type` lines (`a: int; b: int` too) of
    the python blocks: each must sit under a `class C` line (not a `def`, nor at top level), and C
    must have it (a dataclass field, a class attribute or property, or a `self.name` in its source).
    Lines that continue a parameter list, comments and `def` lines are not attributes."""
    problems, checked, owner, depth = [], 0, None, 0
    for no, line, mods in code_lines(text):
        code = line.split("#", 1)[0]
        continued = depth > 0
        depth = max(0, depth + sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}"))
        if continued:
            continue
        m = re.match(r"(class|def) (\w+)", line)
        if m:
            owner = (m[1], m[2], mods)
            continue
        if line[:1].strip() and not line.startswith("@"):   # any other top-level line ends the owner
            owner = None
            continue
        if line.lstrip().startswith(("def ", "#", "@")):
            continue
        names = re.findall(r"(?:^|;)\s*(\w+)\s*:", code)
        if not names:
            continue
        if owner is None or owner[0] != "class":
            problems.append(f"line {no}: {names} indented under {owner[0] + ' ' + owner[1] if owner else 'nothing'}, "
                            "not a class")
            continue
        cls = _find(owner[2], None, owner[1])
        try:
            source = inspect.getsource(cls) if cls is not None else ""
        except (OSError, TypeError):   # a compiled class (rustbpe)
            source = ""
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
        for name in names:
            checked += 1
            if not (name in fields or hasattr(cls, name) or re.search(rf"self\.{name}\b", source)):
                problems.append(f"line {no}: {owner[1]}.{name}: no such attribute in {owner[2]}")
    return problems, checked


def test_interfaces_attribute_lines_are_their_classes():
    problems, checked = attribute_problems((REPO / "docs" / "INTERFACES.md").read_text())
    assert checked >= 15, checked
    assert not problems, "docs/INTERFACES.md attribute lines that are not their class's:\n" + "\n".join(problems)


def test_a_misplaced_or_stale_attribute_line_is_caught():
    doc = ("## Data: `nanochat/chat_data.py`\n\n```python\n"
           "class ChatLoader:      # iterator\n"
           "    def __init__(self, task, tokenizer, batch_size, seq_len, *, device=\"cpu\",\n"
           "                 mask=\"assistant\", seed: int = 42)\n"
           "    skipped: int   # counted\n"
           "    no_such_count: int\n"
           "def epoch_order(n, seed, epoch) -> list[int]\n"
           "    skipped: int   # drifted under a function\n```\n")
    problems, checked = attribute_problems(doc)
    assert checked == 2, (checked, problems)   # the continued parameter line is no attribute
    assert len(problems) == 2, problems
    assert "ChatLoader.no_such_count" in problems[0]
    assert "under def epoch_order" in problems[1]


# ------------------------------------------------------------------------------ the tiny run's chat_eval

def test_the_tiny_chat_eval_without_max_problems_scores_what_the_readme_says(shared_data):
    """The tiny preset's mid and SFT train with --test-holdout N, so chat_eval scores ARC, MMLU and
    GSM8K on their first N test problems only; HumanEval and SpellingBee were never trained on and
    are scored whole. The README's timing line must not say "N of each task"."""
    from nanochat.chat_data import TEST_TRAINED
    from nanochat.tasks import EVAL_TASKS, get_task
    from scripts.chat_eval import ChatEvalConfig, problem_limits

    block = (REPO / "README.md").read_text().split("## Step by step on a CPU", 1)[1].split("```")[1]
    holdouts = {int(n) for n in re.findall(r"scripts\.(?:mid_train|chat_sft) .*--test-holdout (\d+)", block)}
    assert len(holdouts) == 1, holdouts
    n = holdouts.pop()
    said = quoted(r"chat_eval \d+ s \(\d+ s without `--max-problems`: (.*?)\), report")[1]

    held = {name: (n, stage) for stage in ("mid", "sft") for name in TEST_TRAINED[stage]}
    sizes = {name: len(get_task(name, data_dir=shared_data / "eval")) for name in EVAL_TASKS}
    limits = problem_limits(ChatEvalConfig(source="sft"), held, sizes)
    assert set(limits) == set(held) and set(held) < set(EVAL_TASKS)   # some tasks are scored whole
    assert f"{n} held-out" in said, said
    for name in EVAL_TASKS:
        if name in limits:
            assert limits[name] == n and re.search(rf"\b{re.escape(name)}\b", said), (name, said)
        else:
            assert f"{name}'s {sizes[name]}" in said, f"README: {said!r}; chat_eval scores {name}'s {sizes[name]}"


# ------------------------------------------------------------------------------ rustbpe/README.md

def test_rustbpe_readmes_benchmark_paragraph_is_the_scripts():
    from scripts.bench_tokenizer import parse_args

    text = " ".join((REPO / "rustbpe" / "README.md").read_text().split("## Benchmark", 1)[1].split())
    args = parse_args([])
    assert f"trains a {args.vocab_size} vocabulary" in text, text
    assert f"on {args.chars // 1_000_000} M characters of `../shared/data/pretrain/docs`" in text, text
    assert args.data_dir.parts[-2:] == ("pretrain", "docs")
    assert f"with {args.threads} threads" in text, text
    # its figures are where a reader of this repository can find them (not "the issue")
    assert not re.search(r"\bissue\b", text), text
