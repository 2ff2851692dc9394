"""ARC-Easy and ARC-Challenge (AI2 Reasoning Challenge) as categorical multiple-choice tasks.

Local file: `arc_easy.jsonl` / `arc_challenge.jsonl` (the test split; `arc_easy_<split>.jsonl` for
another split), rows {"id", "question", "choices": [...], "answer": index}. Hub: allenai/ai2_arc.
"""

from __future__ import annotations

import functools

import re

from nanochat.tasks.common import LETTERS, Task, check_rows, load_rows, render_mc

_SUBSETS = {"easy": ("arc_easy", "ARC-Easy"), "challenge": ("arc_challenge", "ARC-Challenge")}
_SPLITS = ("train", "validation", "test")


def _from_hub(row: dict) -> dict:
    labels = list(row["choices"]["label"])
    return {"id": row["id"], "question": row["question"], "choices": list(row["choices"]["text"]),
            "answer": labels.index(row["answerKey"])}


def mc_conversation(question: str, choices: list[str], answer: int, **extra) -> dict:
    """The shared categorical conversation: lettered prompt, the letter as the assistant answer."""
    if not 0 <= answer < len(choices) <= len(LETTERS):
        raise ValueError(f"answer: got {answer} for {len(choices)} choices")
    letters = LETTERS[: len(choices)]
    # "choices": what evaluate_letter reads when a file lists the gold's text twice
    return {"messages": [{"role": "user", "content": render_mc(question, choices, letters)},
                         {"role": "assistant", "content": letters[answer]}],
            "letters": list(letters), "choices": list(choices), **extra}


def check_mc_row(row: dict, scored: bool = True) -> str | None:
    """What is wrong with a multiple-choice row {"question", "choices", "answer"}, or None. The
    texts are checked too: a null question or choice passed here and stopped the evaluation with
    an AttributeError after the model had loaded (or was shown as "None" in the prompt). One choice
    is no question: its only letter always won, scoring 100% of such rows (a damaged export); refused
    where rows are `scored` (a training split's odd row, e.g. in the hub's ~100k MMLU auxiliary_train, only
    teaches the letter, and must not stop a mid-training days in)."""
    choices, answer = row["choices"], row["answer"]
    if not isinstance(row["question"], str):
        return f"'question' must be a string, got {type(row['question']).__name__}"
    if not isinstance(choices, list) or not 1 <= len(choices) <= len(LETTERS) \
            or not all(isinstance(c, str) for c in choices):
        return f"'choices' must be a list of 1..{len(LETTERS)} strings"
    if len(choices) < 2 and scored:
        return f"'choices' holds a single choice, {choices[0][:40]!r}: a question needs 2..{len(LETTERS)}"
    ok = not isinstance(answer, bool) and (isinstance(answer, int) or (isinstance(answer, str) and answer.isdigit()))
    if not ok or not 0 <= int(answer) < len(choices):
        return f"'answer' must be an index 0..{len(choices) - 1} into 'choices', got {answer!r}"
    return None


MC_KEYS = ("question", "choices", "answer")


# "B", "b", "B.", "(B)", "B) blue", "**B**": a letter standing alone (a lower-case one only before
# punctuation or the end: "a bird" is an article, not choice A). Markdown emphasis counts as
# punctuation: chat models write "**B**" and "**Answer:** C". A letter in quotes, backticks or
# brackets ('The answer is "B"', "`C`", "[D]") is one too, either case: the closing quote failed the
# lookahead that keeps "A's" from being choice A, so they named no answer.
_LETTER = (r"[*_]*(?:[\"'`\u2018\u201c\[][*_]*([A-Za-z])[*_]*[\"'`\u2019\u201d\]]"
           r"|\(?[*_]*(?:([A-Z])(?![A-Za-z0-9'])|([a-z])(?=$|[.):,*_])))")
_LEADING_LETTER = re.compile(_LETTER)
# "The answer is C", "Answer: (D)", "The answer is: **C**", "my answer is c.": a letter named as the
# answer further on ("is" and ":" in either order or both, any case). "option B", "Option (B)", "The
# correct choice is C": the same after "option" / "choice", which chat models write as often; read
# only when no "answer" names a letter ("The answer is C. Option A is wrong." is C).
_CUE = r"(?<![A-Za-z0-9])(?i:{})(?![A-Za-z0-9])[*_]*\s*(?i:is\b)?[*_]*\s*:?[\s*_]*"
_NAMED_LETTER = re.compile(_CUE.format("answer") + _LETTER)
_OPTION_LETTER = re.compile(_CUE.format("option|choice") + _LETTER)
# "A or B", "A, B", "A/B", "(A) and (B)", "option B or option C": a second letter right after the
# first, a hedge naming two
_ANOTHER_LETTER = re.compile(r"[*_)]*\s*(?:,|/|&|\bor\b|\band\b)\s*(?:(?i:option|choice)(?![A-Za-z0-9])\s*)?" + _LETTER)
# "A lot of ...", "A is correct": a leading "A" followed by a lower-case word may be the article or
# the answer. It gives way to a letter named later ("A lot of people pick option B" is B) and is the
# answer otherwise ("A is correct.", "A because ...")
_WORD_LETTER = re.compile(r"[AI][ \t]+[a-z]")


def extract_letter(completion: str, letters) -> str | None:
    """The answer letter (upper case) of a free-text completion, or None when it names none of
    `letters`: a letter standing alone at the start (a leading "A <word>" only when no letter is named
    later), else the last one named after "answer (is|:)", else the one after "option" / "choice"
    (None when those name several: "Option C is right ... option D is wrong"). A hedge between two
    choices ("A or B", "The answer is A, B", "option B or option C") names none: it was scored as its
    first letter (or, named twice, its last). (Only the first character used to count, which read
    "Answer: B" as A, "Because..." as B.)"""
    text = completion.strip()
    leading = [_LEADING_LETTER.match(text)]
    named, options = list(_NAMED_LETTER.finditer(text)), list(_OPTION_LETTER.finditer(text))
    if len({_letter_of(m, letters) for m in options} - {None}) > 1:
        options = []   # a walk through the options: which one it settles on is not for a regex to say
    groups = [named, options, leading] if _WORD_LETTER.match(text) else [leading, named, options]
    # the last "answer is X" counts: "To answer: a, b and c are animals. The answer is B" is B
    for found in groups:
        for i in reversed(range(len(found))):
            letter = _letter_of(found[i], letters)
            if letter is None:
                continue
            # a hedge: another letter right after this one, or this one right after the previous one
            after = _letter_of(_ANOTHER_LETTER.match(text, found[i].end()), letters)
            prior = _ANOTHER_LETTER.match(text, found[i - 1].end()) if i > 0 else None
            before = _letter_of(found[i - 1], letters) if prior and prior.end() >= found[i].end() else None
            if any(other not in (None, letter) for other in (after, before)):
                return None
            return letter
    return None


def _letter_of(m, letters) -> str | None:
    """The upper-case letter a match of _LETTER (or a pattern ending in it) read, if one of `letters`."""
    letter = next((g for g in m.groups() if g), None) if m else None
    return letter.upper() if letter and letter.upper() in letters else None


def evaluate_letter(conversation: dict, completion: str) -> bool:
    """True when the completion's answer letter (extract_letter) is the gold letter, or names a
    choice whose text is the gold's: 4 MMLU test questions list their answer twice (e.g. "687" as A
    and B), and the copy that is not the gold's letter scored wrong (CORE's rule too)."""
    gold = conversation["messages"][-1]["content"]
    letters = conversation.get("letters", LETTERS)
    said = extract_letter(completion, letters)
    if said is None or said == gold:
        return said == gold
    choices = conversation.get("choices")
    if not choices or gold not in letters:
        return False
    return choices[list(letters).index(said)].strip() == choices[list(letters).index(gold)].strip()


class ARC(Task):
    eval_type = "categorical"

    def __init__(self, subset: str = "easy", split: str = "test", *, data_dir=None, **kw):
        super().__init__(**kw)
        if subset not in _SUBSETS:
            raise ValueError(f"ARC subset: got {subset!r}; accepted: easy|challenge")
        if split not in _SPLITS:
            raise ValueError(f"ARC split: got {split!r}; accepted: {'|'.join(_SPLITS)}")
        stem, hub_config = _SUBSETS[subset]
        names = [f"{stem}_{split}.jsonl"] + ([f"{stem}.jsonl"] if split == "test" else [])
        self.rows, self.source = load_rows("eval", names, data_dir=data_dir,
                                           hub=("allenai/ai2_arc", hub_config, split), convert_hub=_from_hub)
        check_rows(self.rows, self.source, MC_KEYS, functools.partial(check_mc_row, scored=split != "train"))
        self.name = "ARC-Easy" if subset == "easy" else "ARC-Challenge"

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        r = self.rows[index]
        return mc_conversation(r["question"], list(r["choices"]), int(r["answer"]))

    def evaluate(self, conversation: dict, completion: str) -> bool:
        return evaluate_letter(conversation, completion)
