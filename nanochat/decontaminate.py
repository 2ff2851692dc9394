"""Decontamination: what chat_eval scores is kept out of what mid-training / SFT / RL train on.

Owns two checks, both on test problems compared as the model reads them (folded text, not ids):

* `drop_eval_questions`: general-chat conversations (the chat sets, --extra-conversations files)
  a user turn of which IS a chat_eval test question (MMLU, ARC, GSM8K) are left out of training.
  The set of such questions (`_eval_questions`) is read from the local test files only
  (`EVAL_QUESTION_FILES`) and cached per process on their stat(), so the many mixture builds of
  one process read MMLU once.
* `_drop_held_out_twins`: under --test-holdout N training takes test[N:]; a problem there that
  repeats one of the first N (scored) ones under another id or subject (`problem_key`) is left out.

nanochat/chat_data.py's build_mixture calls both (the twins through _train_split_tasks) and re-exports
these names, so imports of them from chat_data still work.
This module imports nothing of chat_data (no cycle) and nothing heavy at import time.
"""

from __future__ import annotations

import functools
import json
import re
import time
from pathlib import Path

# chat_eval's multiple-choice and math test files (local names), for the decontamination below
EVAL_QUESTION_FILES = {"MMLU": ("mmlu_test.jsonl", "mmlu.jsonl"), "ARC-Easy": ("arc_easy_test.jsonl", "arc_easy.jsonl"),
                       "ARC-Challenge": ("arc_challenge_test.jsonl", "arc_challenge.jsonl"),
                       "GSM8K": ("gsm8k_test.jsonl", "gsm8k.jsonl")}


_WORD = re.compile(r"[^\W_]+")


def _question_text(text) -> str:
    """Case, punctuation and spacing folded: "What is X?" and "what is x" are one question."""
    return " ".join(_WORD.findall(str(text).casefold()))


def _asks_something(question: str) -> bool:
    """A folded test question that a chat turn equal to it would really ask: 12+ characters and
    3+ words. MMLU has 30-odd stems of two words ("Neural networks", "Milton Friedman", "Business
    cycles") whose question lives in the choices; a user turn naming such a topic (a reply to
    "what shall we talk about?") asks no test problem, and its conversation was left out."""
    return len(question) >= 12 and len(question.split()) >= 3


def _eval_question_files(data_dir) -> tuple[tuple[tuple[str, str, int, int, int], ...], tuple[str, ...]]:
    """(task, resolved path, st_mtime_ns, st_size, st_ino) of each local test file _eval_questions
    reads, and the tasks with none: a few stat() calls, the key of _read_eval_questions' cache."""
    from nanochat.tasks.common import find_local_file
    found, missing = [], []
    for name, filenames in EVAL_QUESTION_FILES.items():
        path, _ = find_local_file("eval", filenames, data_dir)
        if path is None:
            missing.append(name)
            continue
        st = path.stat()
        found.append((name, str(path.resolve()), st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(found), tuple(missing)


@functools.lru_cache(maxsize=8)
def _read_eval_questions(files: tuple[tuple[str, str, int, int, int], ...]) -> frozenset[str]:
    """_eval_questions' set from `files`, cached per process on what was read (an edited, replaced,
    added or removed file is another key): each mid / SFT mixture build (the tests build dozens)
    read MMLU's 14K problems again, ~0.5 s."""
    from nanochat.tasks.common import read_jsonl
    first: dict[str, dict] = {}     # question -> the first problem asking it
    keys: dict[str, set] = {}       # ... -> its problem keys, once a second problem asks it
    for _, path, *_ in files:
        for row in read_jsonl(Path(path)):
            if not _asks_something(q := _question_text(row.get("question", ""))):
                continue
            if q not in first:      # problem_key (json of question + choices): only for the ~2% asked twice
                first[q] = row
            else:
                keys.setdefault(q, {problem_key(first[q])}).add(problem_key(row))   # a repeated problem is one
    return frozenset(q for q in first if len(keys.get(q, ())) <= 1)


def _eval_questions(data_dir) -> tuple[frozenset[str], tuple[str, ...]]:
    """The folded questions of the local MMLU / ARC / GSM8K test files that a chat turn equal to one
    would really ask (_asks_something), but not a stem several problems share with other choices
    ("which of the following is true": 8 MMLU problems; their question is in the choices); and the
    tasks with no local file. Both immutable: the set is shared by every caller (cached)."""
    files, missing = _eval_question_files(data_dir)
    return _read_eval_questions(files), missing


def drop_eval_questions(tasks, data_dir=None) -> dict[str, int]:
    """Leave out of each general-chat task in `tasks` (rows of {"messages"}) every conversation a
    user turn of which IS a chat_eval test question (MMLU, ARC, GSM8K; compared after folding case,
    punctuation and spacing; _eval_questions says which). The local sft/chatterbot.jsonl asks three
    MMLU test questions word for word ("What is the only metal that is a liquid at normal
    atmospheric pressure and temperature?"), answered: trained on, they are read back as MMLU
    accuracy. Only local eval files are read (no download at training time); a missing one is
    named. A task sliced to its first `stop` rows (SFT's 10K of SmolTalk's 460K) is checked only
    until that many are kept. Returns {source: conversations left out}."""
    from nanochat.common import print0
    questions, missing = _eval_questions(data_dir)
    if missing:
        print0(f"decontamination: no local test file of {', '.join(missing)}; conversations not checked against it")
    # a user turn far longer than every question (a pasted document) cannot fold down to one: not folded
    longest = 2 * max(map(len, questions), default=0) + 100

    def asks(m) -> bool:
        text = m.get("content")
        return (m.get("role") == "user" and isinstance(text, str) and len(text) <= longest
                and _question_text(text) in questions)
    dropped, began, checked = {}, time.perf_counter(), 0
    for task in tasks:
        kept, limit = [], getattr(task, "stop", None)   # indices of the rows kept
        for i, row in enumerate(task.rows):
            if limit is not None and len(kept) >= limit:   # the rest is never read: kept unchecked
                kept += range(i, len(task.rows))
                break
            checked += 1
            if not any(map(asks, row["messages"])):
                kept.append(i)
        if n := len(task.rows) - len(kept):
            dropped[task.source] = n
            print0(f"decontamination: {n} conversation{'s' if n != 1 else ''} of {task.source} "
                   f"ask{'s' if n == 1 else ''} a chat_eval test question word for word; left out of training")
            task.rows = [task.rows[i] for i in kept]
            if getattr(task, "lines", None) is not None:   # a ConversationFile's line of each row, kept in step
                task.lines = [task.lines[i] for i in kept]
    if (took := time.perf_counter() - began) > 2:   # the hub's 460K conversations (mid): ~10-20 s at start-up
        print0(f"decontamination: {checked:,} conversations checked against {len(questions):,} test questions "
               f"in {took:.0f} s")
    return dropped


def _fold_spacing(text) -> str:
    return " ".join(str(text).split()).casefold()


def problem_key(row: dict) -> str:
    """A test problem as the model reads it (question and choices, whitespace-normalised), whatever
    its id, subject or file: the same problem under two ids or two tasks is one problem."""
    return json.dumps([_fold_spacing(row.get("question", "")), [_fold_spacing(c) for c in row.get("choices") or ()]])


def _drop_held_out_twins(tasks: list, holdout: int) -> None:
    """Leave out of test[holdout:] (trained) every problem that repeats one of any task's first
    `holdout` (scored by chat_eval): MMLU's test file holds 105 problems twice (same question and
    choices, often under another subject), so with --test-holdout 1000 the 1000 scored problems had
    21 twins among the trained ones (2% of the score was read off training data)."""
    from nanochat.common import print0
    held = [r for t in tasks for r in t.rows[:holdout]]
    scored = {problem_key(r) for r in held}
    # a twin asks a held-out question: the whole key (~0.3 s over MMLU's 14K) only for rows that do
    asked = {_fold_spacing(r.get("question", "")) for r in held}
    for t in tasks:
        assert t.start == holdout, "the training task must start where the held-out problems end"
        tail = [r for r in t.rows[holdout:]
                if _fold_spacing(r.get("question", "")) not in asked or problem_key(r) not in scored]
        dropped = len(t.rows[holdout:]) - len(tail)
        t.rows = t.rows[:holdout] + tail   # get_example reads self.rows: test[holdout:] is now the tail
        if dropped:
            print0(f"--test-holdout {holdout}: {dropped} {getattr(t, 'name', type(t).__name__)} test problems past "
                   f"the first {holdout} repeat a held-out one; left out of training (chat_eval scores those)")
