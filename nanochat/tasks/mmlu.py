"""MMLU (57 subjects) as a categorical multiple-choice task.

Local file: `mmlu.jsonl` (test split; `mmlu_<split>.jsonl` otherwise), rows {"id", "question",
"choices", "answer", "subject"}. Hub: cais/mmlu ("all" for test/validation/dev,
"auxiliary_train" for the train split used in midtraining). Rows are shuffled once with a fixed
seed (see MMLU.__init__), so a prefix (--max-problems) spans the subjects.
"""

from __future__ import annotations

import functools

from nanochat.tasks.arc import MC_KEYS, check_mc_row, evaluate_letter, mc_conversation
from nanochat.tasks.common import Task, check_rows, fixed_order, load_rows

_SPLITS = ("auxiliary_train", "dev", "validation", "test")


def _from_hub(row: dict) -> dict:
    if isinstance(row.get("train"), dict):  # auxiliary_train nests each row under "train"
        row = row["train"]
    return {"question": row["question"], "choices": list(row["choices"]),
            "answer": int(row["answer"]), "subject": row.get("subject", "")}


class MMLU(Task):
    eval_type = "categorical"
    name = "MMLU"

    def __init__(self, split: str = "test", *, subject: str | None = None, data_dir=None, **kw):
        super().__init__(**kw)
        if split not in _SPLITS:
            raise ValueError(f"MMLU split: got {split!r}; accepted: {'|'.join(_SPLITS)}")
        names = [f"mmlu_{split}.jsonl"] + (["mmlu.jsonl"] if split == "test" else [])
        hub = ("cais/mmlu", "auxiliary_train", "train") if split == "auxiliary_train" else ("cais/mmlu", "all", split)
        rows, self.source = load_rows("eval", names, data_dir=data_dir, hub=hub, convert_hub=_from_hub)
        check_rows(rows, self.source, MC_KEYS, functools.partial(check_mc_row, scored=split != "auxiliary_train"))
        # The file (and the hub's "all") is sorted by subject, so the first N problems that
        # --max-problems N scores would be the first subjects alone (N = 100: abstract algebra).
        # One fixed shuffle (as upstream's shuffle(seed=42)) makes every prefix a spread of
        # subjects, the same each run; start/stop slices (the --test-holdout training split)
        # partition this same order.
        order = fixed_order(len(rows))   # = random.Random(42).shuffle(rows), as before
        rows = [rows[i] for i in order]
        if subject is not None:
            rows = [r for r in rows if r.get("subject") == subject]
            if not rows:
                raise ValueError(f"MMLU subject: got {subject!r}; no rows with that subject")
        else:
            self.order = order   # each row's position in the file (Task.seed_index)
        self.rows = rows

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        r = self.rows[index]
        question = r["question"]
        if r.get("subject"):
            question = f"({r['subject'].replace('_', ' ')}) {question}"
        return mc_conversation(question, list(r["choices"]), int(r["answer"]), subject=r.get("subject", ""))

    def evaluate(self, conversation: dict, completion: str) -> bool:
        return evaluate_letter(conversation, completion)
