"""The task interface, the deterministic TaskMixture, and local-first / hub-second data loading.

A task is an indexable collection of conversations (the format in docs/INTERFACES.md) plus an
`evaluate(conversation, completion)` that scores a model's answer:

* eval_type "categorical": the answer is one of `conversation["letters"]` (e.g. "A".."D"); callers
  score it by comparing the logits of those letters after `render_for_completion`.
* eval_type "generative": the model samples a completion (through Engine) which `evaluate` checks.

Data lookup order for every loader (see `find_local_file` / `load_rows`):
  1. an explicit `data_dir` argument, else the env override (NANOCHAT_EVAL_DIR / NANOCHAT_SFT_DIR),
     else `<base_dir>/eval_data` (or `sft_data`) and then the repo's `../shared/data/<kind>`;
  2. the Hugging Face hub via `datasets` (imported lazily, only when step 1 found nothing);
  3. a `DataUnavailableError` naming every local path tried and the hub dataset + why it failed.

A local file that is there but broken (not UTF-8, a line that is not JSON, a row without the
fields its task needs, a conversation with a bad role) is a DataError naming the file and line,
raised when the task is built (not when an example is first read); an empty file is a
MissingDataError naming it.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Callable, Iterable, Sequence

from nanochat.common import get_base_dir
from nanochat.errors import DataError, MissingDataError

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

# kind -> (env override, folder under the base dir, folder under ../shared/data)
_KINDS = {
    "eval": ("NANOCHAT_EVAL_DIR", "eval_data", "eval"),
    "sft": ("NANOCHAT_SFT_DIR", "sft_data", "sft"),
    "words": ("NANOCHAT_EVAL_DIR", "eval_data", "words"),
}


class DataUnavailableError(MissingDataError):
    """Neither a local file nor the hub could provide a dataset; the message names both."""


def local_dirs(kind: str, data_dir: str | Path | None = None) -> list[Path]:
    """Directories searched (in order) for local files of `kind` ("eval" | "sft" | "words")."""
    if kind not in _KINDS:
        raise ValueError(f"kind: got {kind!r}; accepted: {'|'.join(_KINDS)}")
    env, base_sub, shared_sub = _KINDS[kind]
    if data_dir is not None or os.environ.get(env):
        root = Path(data_dir if data_dir is not None else os.environ[env])
        # the folder itself, a data root holding it, or a sibling of it (--data-dir .../eval, as the
        # help allows, must still find SpellingBee's .../words/words.txt)
        return list(dict.fromkeys([root, root / shared_sub, root.parent / shared_sub]))
    dirs = [get_base_dir() / base_sub]
    if SHARED_DATA.is_dir():
        dirs.append(SHARED_DATA / shared_sub)
    return dirs


def find_local_file(kind: str, filenames: Sequence[str], data_dir=None) -> tuple[Path | None, list[Path]]:
    """First existing `dir/filename` over local_dirs x filenames, plus every path tried."""
    tried = []
    for d in local_dirs(kind, data_dir):
        for name in filenames:
            path = d / name
            tried.append(path)
            if path.is_file():
                return path, tried
    return None, tried


def read_jsonl(path: Path) -> list[dict]:
    """The JSON value of every non-blank line; DataError naming path:line for a line that is not
    UTF-8 or not JSON."""
    with open(path, "rb") as f:
        return parse_jsonl(f, path)


def read_jsonl_numbered(path: Path) -> list[tuple[int, object]]:
    """(line number, JSON value) of every non-blank line, so that a later schema check can name
    path:line (blank lines make the record index differ from the line number)."""
    with open(path, "rb") as f:
        return parse_jsonl_numbered(f, path)


def parse_jsonl(lines: Iterable[bytes], path) -> list[dict]:
    """read_jsonl over lines already read (bytes); `path` names them in errors."""
    return [row for _, row in parse_jsonl_numbered(lines, path)]


def parse_jsonl_numbered(lines: Iterable[bytes], path) -> list[tuple[int, object]]:
    """parse_jsonl with each row's line number (as read_jsonl_numbered)."""
    rows = []
    for lineno, raw in enumerate(lines, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}:{lineno}: not UTF-8 text ({e}); fix or delete that line") from None
        if lineno == 1:   # a byte-order mark (Windows editors write one): json.loads refuses it
            line = line.removeprefix("\ufeff")
        if line.strip():
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e}); fix or delete that line") from None
    return rows


def read_local_rows(path: Path, *, numbered: bool = False) -> list:
    """read_jsonl of a dataset file that must hold rows: an empty file is a MissingDataError.
    numbered=True: (line number, row) pairs, as read_jsonl_numbered."""
    rows = read_jsonl_numbered(path)
    if not rows:
        raise MissingDataError(f"{path}: empty (no JSON lines); restore the file or delete it "
                               "(then the next data location or the hub is used)")
    return rows if numbered else [row for _, row in rows]


def check_rows(rows: list, source: str, required: Sequence[str], check: Callable[[dict], str | None] | None = None,
               ) -> list:
    """Every row is an object with the `required` keys (and passes `check`, which returns what is
    wrong or None); DataError naming the source and row otherwise. Run when a task is built."""
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            problem = f"a JSON {type(row).__name__}, expected an object"
        else:
            missing = [k for k in required if k not in row]
            problem = f"missing {', '.join(map(repr, missing))}" if missing else (check(row) if check else None)
        if problem:
            line = line_of_row(source, i)
            raise DataError(f"{source}: row {i + 1}: {problem} (needs {', '.join(required)}); fix or delete "
                            + ("that row" if line is None else f"that row (line {line} of the file)"))
    return rows


def line_of_row(source: str, index: int) -> int | None:
    """The line number of the index-th (0-based) row of a local file, counting blank lines as an
    editor does (a file with blank lines has "row 6" on another line); None for rows from the hub."""
    path = Path(source)
    if source.startswith("hub:") or not path.is_file():
        return None
    with open(path, "rb") as f:   # the rows parse_jsonl_numbered read, with their line numbers
        numbered = parse_jsonl_numbered(f, path)
    return numbered[index][0] if index < len(numbered) else None


def _import_datasets():
    """Lazy import so that `datasets` stays an optional dependency (pip install '.[hub]')."""
    import datasets  # noqa: PLC0415

    return datasets


def load_hub_rows(hub_id: str, config: str | None, split: str) -> list[dict]:
    datasets = _import_datasets()
    ds = datasets.load_dataset(hub_id, config, split=split)
    return [dict(r) for r in ds]


def load_rows(kind: str, filenames: Sequence[str], *, data_dir=None,
              hub: tuple[str, str | None, str] | None = None,
              convert_hub: Callable[[dict], dict] | None = None) -> tuple[list[dict], str]:
    """Rows of a dataset from a local JSONL file, else the hub; returns (rows, source description).

    hub = (dataset id, config, split) or None when the dataset has no hub fallback.
    """
    path, tried = find_local_file(kind, filenames, data_dir)
    if path is not None:
        return read_local_rows(path), str(path)
    hub_reason, hub_error = "no hub fallback for this dataset", None
    if hub is not None:
        try:
            rows = load_hub_rows(*hub)
        except ImportError as e:
            hub_reason, hub_error = f"`datasets` is not installed ({e}); pip install 'nanochat-spark[hub]'", e
        except Exception as e:  # noqa: BLE001 - any hub failure (offline, 404, auth) is re-raised below
            hub_reason, hub_error = f"{type(e).__name__}: {e}", e
        else:
            source = f"hub:{hub[0]}/{hub[1] or ''}:{hub[2]}"
            local = f"put {filenames[0]} (one JSON object per line) in {tried[0].parent}" if tried else "use a local file"
            return (_convert_hub_rows(rows, convert_hub, source, local) if convert_hub else rows), source
    where = "\n  ".join(str(p) for p in tried)
    hub_name = f"hub dataset {hub[0]!r} (config {hub[1]!r}, split {hub[2]!r})" if hub else "the hub"
    env = _KINDS[kind][0]
    raise DataUnavailableError(
        f"dataset {filenames[0]!r} not found.\nLocal files tried (set {env} or pass --data-dir):\n  {where}\n"
        f"Hub: {hub_name} failed: {hub_reason}\n"
        # offline (this project's usual case) the hub cannot help: say what can
        f"Offline: put {' or '.join(filenames)} (one JSON object per line) in one of the folders tried above"
    ) from hub_error


def _convert_hub_rows(rows: list[dict], convert: Callable[[dict], dict], source: str, local: str) -> list[dict]:
    """convert() over the hub's rows; a row it cannot convert (the hub's schema changed, a null
    field) is a DataError naming the hub dataset and row, not a bare KeyError from the task."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(convert(row))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise DataError(f"{source}: row {i + 1} does not have the fields this task reads "
                            f"({type(e).__name__}: {e}); {local} instead") from e
    return out


# The seed of the one fixed shuffle an eval task's rows get (MMLU, HumanEval; upstream's
# shuffle(seed=42)): chat_eval's --max-problems N scores the first N, so they must be a spread of the
# whole set, the same every run; and --test-holdout N's training split (start=N) is this order's rest.
EVAL_ORDER_SEED = 42


def fixed_order(n: int, seed: int = EVAL_ORDER_SEED) -> list[int]:
    """The file positions of n rows in their fixed shuffled order: rows = [rows[i] for i in
    fixed_order(len(rows))] is random.Random(seed).shuffle(rows) (shuffle's swaps depend only on the
    length), so MMLU's order stays the one it had."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order


class Task:
    """Base class: subclasses set eval_type and implement num_examples / get_example / evaluate.

    start/stop/step slice the underlying examples (like range()), e.g. Task(stop=100) for a quick run.
    A task whose rows are in a fixed shuffled order sets `order` (fixed_order: each row's position in
    its file), which seed_index reads.
    """

    eval_type: str = "generative"
    order: list[int] | None = None

    def __init__(self, start: int = 0, stop: int | None = None, step: int = 1):
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise ValueError(f"task slice: got start={start} stop={stop} step={step}; "
                             "accepted: 0 <= start <= stop, step >= 1")
        self.start, self.stop, self.step = start, stop, step

    # -- subclass API
    def num_examples(self) -> int:
        raise NotImplementedError

    def get_example(self, index: int) -> dict:
        raise NotImplementedError

    def evaluate(self, conversation: dict, completion: str):
        raise NotImplementedError(f"{type(self).__name__} is a training-only task")

    # -- sliced view
    def __len__(self) -> int:
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, (stop - self.start + self.step - 1) // self.step)

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__} index {i} out of range (len {n})")
        return self.get_example(self.start + (i % n) * self.step)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def seed_index(self, i: int) -> int:
        """The number a problem's sampling seed is drawn from (run_generative: seed + this): its index
        i, or in a shuffled task its position in the file, so that the shuffle left every problem's
        samples (and a full run's sampled score) as they were."""
        if self.order is None:
            return i
        return self.order[self.start + (i % len(self)) * self.step]

    def file_example(self, j: int) -> dict:
        """The example of the file's j-th row, wherever a shuffle put it (what names a problem by its
        place in the released file, HumanEval/10 say, reads); the unsliced task's index j otherwise."""
        if self.order is None:
            return self.get_example(j)
        if not 0 <= j < len(self.order):
            raise IndexError(f"{type(self).__name__} file row {j} out of range ({len(self.order)} rows)")
        return self.get_example(self.order.index(j))


class TaskMixture(Task):
    """Deterministic shuffled union of tasks (list a task twice to oversample it).

    epochs > 1 repeats the mixture with a fresh shuffle per epoch (seed + epoch), so a training loop
    can simply walk indices 0..len-1. Mid / SFT build one epoch (epochs=1): their loader
    (chat_data.ChatLoader) reads epoch 0 in this order and each later epoch in a permutation of it
    drawn from the run's --seed and the epoch, without holding every epoch's index in memory.
    """

    def __init__(self, tasks: Sequence[Task], *, seed: int = 42, epochs: int = 1, **kw):
        super().__init__(**kw)
        if not tasks:
            raise ValueError("TaskMixture: got no tasks; accepted: a non-empty list of Task")
        if epochs < 1:
            raise ValueError(f"TaskMixture epochs: got {epochs}; accepted: >= 1")
        self.tasks = list(tasks)
        base = [(t, j) for t, task in enumerate(self.tasks) for j in range(len(task))]
        self.index: list[tuple[int, int]] = []
        for epoch in range(epochs):
            order = list(base)
            random.Random(seed + epoch).shuffle(order)
            self.index.extend(order)

    def num_examples(self) -> int:
        return len(self.index)

    def get_example(self, index: int) -> dict:
        t, j = self.index[index]
        return self.tasks[t][j]

    def task_of(self, index: int) -> Task:
        return self.tasks[self.index[index][0]]


class TaskSequence(Task):
    """Tasks one after another (curricula); no shuffling."""

    def __init__(self, tasks: Sequence[Task], **kw):
        super().__init__(**kw)
        self.tasks = list(tasks)
        self.offsets = []
        total = 0
        for task in self.tasks:
            self.offsets.append(total)
            total += len(task)
        self.total = total

    def num_examples(self) -> int:
        return self.total

    def get_example(self, index: int) -> dict:
        for task, off in zip(reversed(self.tasks), reversed(self.offsets)):
            if index >= off:
                return task[index - off]
        raise IndexError(index)


LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def render_mc(question: str, choices: Iterable[str], letters: str = LETTERS) -> str:
    """A multiple-choice user prompt: the question, lettered choices, and the answer instruction.

    The instruction asks for the letter alone, so the categorical eval reads a single token.
    """
    lines = [question.strip(), ""]
    lines += [f"{letter}. {choice}" for letter, choice in zip(letters, choices)]
    lines += ["", "Answer with the letter of the correct choice only."]
    return "\n".join(lines)


def validate_conversation(conv: dict, where: str = "conversation") -> dict:
    """Check the INTERFACES.md conversation format; raises ValueError naming the bad field."""
    if not isinstance(conv, dict):   # e.g. a whole file pasted as one JSON list: say what the line is
        raise ValueError(f"{where}: 'messages' must be a non-empty list, in a JSON object per line; got a JSON "
                         f"{type(conv).__name__}; accepted: an object " '{"messages": [...]}')
    msgs = conv.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    if not all(isinstance(m, dict) for m in msgs):
        raise ValueError(f"{where}: every message must be an object with 'role' and 'content'")
    first = 1 if msgs[0].get("role") == "system" else 0   # a system message may lead
    if first == len(msgs):
        raise ValueError(f"{where}: a system message alone; a user message must follow it")
    for i, m in enumerate(msgs[first:], start=first):   # i: the index in the file's own list
        want = "user" if (i - first) % 2 == 0 else "assistant"
        if m.get("role") != want:
            raise ValueError(f"{where}: messages[{i}].role is {m.get('role')!r}; expected {want!r}")
        content = m.get("content")
        if not isinstance(content, (str, list)):
            raise ValueError(f"{where}: messages[{i}].content must be a string or a list of parts")
    return conv
