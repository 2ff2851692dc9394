"""General chat conversations for SFT / midtraining: local JSONL files first, SmolTalk second.

* `LocalConversations`: every `*.jsonl` file (or the named ones) in the SFT data dir
  (data_dir arg, NANOCHAT_SFT_DIR, `<base_dir>/sft_data`, then `../shared/data/sft`); rows
  {"messages": [...]}. These files have no splits: every 20th conversation of each file is
  "test", the rest "train".
* `SmolTalk`: HuggingFaceTB/smol-smoltalk from the hub (or a local `smoltalk_<split>.jsonl`).
* `get_conversations(split, source="auto")`: local files when any exist, else SmolTalk; the choice
  is printed, never silent.
* `ConversationFile`: one JSONL file of the user's own conversations (mid_train / chat_sft
  `--extra-conversations`, e.g. an identity of their own, as upstream nanochat's CustomJSON task),
  all of it for training; every row must hold at least one assistant reply.

Every row is checked when the task is built, so a bad one is a DataError naming file and line (the
line in the file: blank lines count) before any model loads: the conversation format, what
`tokenizer.render_conversation` accepts (else the loader would stop on it mid-training), and, in
local files, text that trains what it says (no empty assistant reply, no lone surrogate escape).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from nanochat.common import print0
from nanochat.errors import DataError
from nanochat.tasks.common import (_KINDS, DataUnavailableError, Task, check_rows, load_rows, local_dirs,
                                   parse_jsonl_numbered, read_local_rows, line_of_row,
                                   validate_conversation)
from nanochat.tokenizer import check_conversation

_SPLITS = ("train", "test")
TEST_EVERY = 20


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"conversations split: got {split!r}; accepted: {'|'.join(_SPLITS)}")


def _check_row(row, where: str, *, text: bool = True) -> None:
    """ValueError starting with `where` unless `row` is a conversation render_conversation accepts
    (checked here because the loader renders rows lazily: a refused one would stop training when
    first reached, naming no file). text=True (local files) also refuses text that would silently
    train the wrong thing: an assistant reply with no text (teaches the model to answer nothing)
    and a lone UTF-16 surrogate escape such as \\ud800 (tokenized as U+FFFD)."""
    validate_conversation(row, where)
    try:
        check_conversation(row)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for i, m in enumerate(row["messages"] if text else ()):
        texts = [m["content"]] if isinstance(m["content"], str) else [p["text"] for p in m["content"]]
        for t in texts:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{where}: messages[{i}].content holds a lone surrogate "
                                 f"{t[e.start]!r} (not text; it would train as U+FFFD)") from None
        written = texts if isinstance(m["content"], str) else \
            [p["text"] for p in m["content"] if p["type"] != "python_output"]   # the tool's output is not the reply
        if m["role"] == "assistant" and not any(t.strip() for t in written):
            raise ValueError(f"{where}: messages[{i}] is an empty assistant reply (it would teach the "
                             "model to answer nothing)")


def find_local_conversation_files(names=None, data_dir=None) -> list[Path]:
    """The *.jsonl files of the first SFT dir that has any (or the named stems, all required). An
    eval or words folder (`--data-dir .../eval`, which local_dirs allows so that its sibling sft/ is
    found) is never read as conversations: its ARC/MMLU rows are not."""
    others = {sub for kind, (_, base_sub, shared_sub) in _KINDS.items() if kind != "sft" for sub in (base_sub, shared_sub)}
    for d in local_dirs("sft", data_dir):
        if names is None and d.name in others:
            continue
        if names is None:
            files = sorted(p for p in d.glob("*.jsonl") if not p.name.startswith("smoltalk"))
        else:
            files = [d / f"{n}.jsonl" for n in names]
            files = files if all(p.is_file() for p in files) else []
        if files:
            return files
    return []


class _ConversationList(Task):
    eval_type = "generative"

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        return {"messages": self.rows[index]["messages"]}


class LocalConversations(_ConversationList):
    def __init__(self, split: str = "train", *, names: list[str] | None = None, data_dir=None, **kw):
        super().__init__(**kw)
        _check_split(split)
        files = find_local_conversation_files(names, data_dir)
        if not files:
            where = "\n  ".join(str(d) for d in local_dirs("sft", data_dir))
            wanted = "*.jsonl" if names is None else ", ".join(f"{n}.jsonl" for n in names)
            raise DataUnavailableError(f"no local conversation files ({wanted}) in:\n  {where}\n"
                                       "Hub: use SmolTalk (source='smoltalk') for the hub dataset")
        self.rows, self.files = [], files
        for path in files:
            # line numbers, not row indices, in errors: blank lines are skipped
            for i, (line, row) in enumerate(read_local_rows(path, numbered=True)):
                try:  # every row, not only this split's: a broken file fails train and test alike
                    _check_row(row, f"{path}:{line}")
                except ValueError as e:
                    raise DataError(f"{e}; fix or delete that row") from None
                if (i % TEST_EVERY == 0) == (split == "test"):
                    self.rows.append(row)
        self.source = ", ".join(str(p) for p in files)


class ConversationFile(_ConversationList):
    """Every conversation of one JSONL file, for training (no test split). A row that is not a
    conversation, or one without an assistant reply (it would train nothing under SFT's
    assistant-only loss), is a DataError naming `flag`, the file and the line."""

    def __init__(self, path: str | Path, *, flag: str = "--extra-conversations", **kw):
        super().__init__(**kw)
        self.path = Path(path)
        try:
            data = self.path.read_bytes()
            numbered = parse_jsonl_numbered(io.BytesIO(data), path)   # the lines a file read would give
            # each row's line in the file, kept alongside the rows (decontamination leaves rows out:
            # reading the file back by row index then named another conversation's line)
            self.lines, self.rows = [n for n, _ in numbered], [row for _, row in numbered]
        except OSError as e:
            raise DataError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
        except DataError as e:
            raise DataError(f"{flag} {e}") from None
        if not self.rows:
            raise DataError(f"{flag} {path}: holds no conversations (accepted: one JSON object "
                            '{"messages": [...]} per line)')
        for i, row in enumerate(self.rows):
            try:
                _check_row(row, f"{flag} {path}:{self.lines[i]}")
                if not any(m.get("role") == "assistant" for m in row["messages"]):
                    raise ValueError(f"{flag} {path}:{self.lines[i]}: no assistant message (nothing to learn from)")
            except ValueError as e:
                raise DataError(f"{e}; fix or delete that row") from None
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.source = str(path)


class SmolTalk(_ConversationList):
    def __init__(self, split: str = "train", *, data_dir=None, **kw):
        super().__init__(**kw)
        _check_split(split)
        self.rows, self.source = load_rows("sft", [f"smoltalk_{split}.jsonl"], data_dir=data_dir,
                                           hub=("HuggingFaceTB/smol-smoltalk", None, split))
        check_rows(self.rows, self.source, ("messages",))
        for i, row in enumerate(self.rows):   # hub rows too: one the renderer refuses would stop training
            try:
                _check_row(row, f"{self.source}: row {i + 1}", text=False)
            except ValueError as e:
                line = line_of_row(self.source, i)   # blank lines make it another line than row i + 1
                raise DataError(f"{e}; fix or delete that row" + (f" (line {line} of the file)" if line else "")) from None


def get_conversations(split: str = "train", *, source: str = "auto", data_dir=None, **kw) -> Task:
    """source: "auto" (local files if any, else SmolTalk) | "local" | "smoltalk"."""
    if source not in ("auto", "local", "smoltalk"):
        raise ValueError(f"get_conversations source: got {source!r}; accepted: auto|local|smoltalk")
    if source == "local" or (source == "auto" and find_local_conversation_files(None, data_dir)):
        task = LocalConversations(split, data_dir=data_dir, **kw)
    else:
        try:
            task = SmolTalk(split, data_dir=data_dir, **kw)
        except DataUnavailableError as e:
            raise DataUnavailableError(f"{e}\n(and no local conversation files in "
                                       f"{[str(d) for d in local_dirs('sft', data_dir)]})") from e
    print0(f"conversations ({split}): {len(task)} from {task.source}")
    return task
