"""Review 9 of mid-training / SFT: an --extra-conversations warning names the right line after
decontamination left rows out; a resume whose --total-batch-size -1 step changed with
--device-batch-size names that flag (not --total-batch-size, never passed); moving the data files
does not make a resume read as "another decontamination"; a row that is not a JSON object says so."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from nanochat.chat_data import check_replies_fit, drop_eval_questions
from nanochat.checkpoint import CheckpointError
from nanochat.errors import DataError
from nanochat.tasks import ConversationFile, TaskMixture

LOUD = "What is the loudest animal on Earth?"   # an MMLU test question (review 8's)


def _chat(user: str, reply: str = "Sure.") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reply_warning_names_the_line_after_decontaminated_rows(tiny_tokenizer, tmp_path, capsys):
    """Line 1 asks a test question (left out), line 3's prompt fills the row: the warning named
    line 2 (row index 1 of the decontaminated rows, read back in the file), a fine conversation."""
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    _write(eval_dir / "mmlu.jsonl", [{"question": LOUD, "choices": ["a", "b", "c", "d"], "answer": 0}])
    path = _write(tmp_path / "mine.jsonl", [_chat(LOUD, "The sperm whale"), _chat("hi", "hello"),
                                            _chat("tell me " * 30, "no room")])
    f = ConversationFile(path)
    assert drop_eval_questions([f], eval_dir) == {str(path): 1}
    mix = TaskMixture([f], seed=1)
    said = [s for s in check_replies_fit(mix, mix, tiny_tokenizer, 24) if "--extra-conversations" in s]
    assert len(said) == 1 and said[0].startswith(f"WARNING: --extra-conversations {path}:3: "), said


def _meta(total: int, dbs: int, world: int = 1) -> dict:
    return {"train": {"total_batch_size": total, "world_size": world, "seq_len": 32},
            "config": {"device_batch_size": dbs, "total_batch_size": -1}}


def test_auto_batch_changed_by_device_batch_names_that_flag():
    """SFT --total-batch-size -1 with --device-batch-size 4: 32 rows; a resume with 3 rounds the
    step up to 33 rows. The refusal named "--total-batch-size 1024 ... 1056", a flag never passed."""
    from nanochat.chat_train import SFT, check_auto_batch_resume
    from nanochat.training import plan_batch
    cfg = SimpleNamespace(total_batch_size=-1, device_batch_size=3)
    plan = plan_batch(SFT.auto_batch(3, 32, 1), 3, 32, 1)
    with pytest.raises(CheckpointError) as e:
        check_auto_batch_resume(_meta(1024, 4), cfg, plan, 1, SFT)
    text = str(e.value)
    assert text.startswith("--resume: ") and "--device-batch-size 3" in text and "1,056" in text
    assert "accepted: --device-batch-size 4 (the original run's) or --total-batch-size 1024" in text
    # the same step, another world size (check_resume_compatible names that), or an explicit --total-batch-size: no word
    check_auto_batch_resume(_meta(1056, 4), cfg, plan, 1, SFT)
    check_auto_batch_resume(_meta(1024, 4, world=2), cfg, plan, 1, SFT)
    check_auto_batch_resume(_meta(1024, 4), SimpleNamespace(total_batch_size=1056, device_batch_size=3), plan, 1, SFT)


def test_moved_data_files_still_resume():
    """The mixture's files are matched by content (sha256), so a run continues after its data moved;
    the decontamination counts were compared by absolute path and refused it: "a mixture
    decontaminated of 4 conversations, this run's of 4"."""
    from nanochat.chat_train import _check_same_data
    old = {"train": {"mixture": {"identity": "", "decontaminated": {"/a/sft/chat.jsonl, /a/sft/b.jsonl": 3,
                                                                   "/a/mine.jsonl": 1},
                                 "extra_conversations": [{"path": "/a/mine.jsonl", "sha256": "f" * 64}]},
                     "mixture_conversations": 10, "seq_len": 64}, "config": {"seed": 42}}
    now = {"identity": "", "decontaminated": {"/b/sft/chat.jsonl, /b/sft/b.jsonl": 3, "/b/mine.jsonl": 1},
           "extra_conversations": [{"path": "/b/mine.jsonl", "sha256": "f" * 64}]}
    _check_same_data(old, now, 10, 42, 64)
    other = {**now, "decontaminated": {"/b/sft/chat.jsonl, /b/sft/b.jsonl": 2, "/b/mine.jsonl": 2}}
    with pytest.raises(CheckpointError, match=r"chat\.jsonl, b\.jsonl: 3 -> 2, mine\.jsonl: 1 -> 2"):
        _check_same_data(old, other, 10, 42, 64)


@pytest.mark.parametrize("line, got", [("[1, 2]", "a JSON list"), ("5", "a JSON int"), ('"hi"', "a JSON str")])
def test_a_row_that_is_not_an_object_says_so(tmp_path, line, got):
    """A JSON array line (a whole file pasted as one list) was "'messages' must be a non-empty list"."""
    path = tmp_path / "rows.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError, match=rf"rows\.jsonl:1: .*; got {got}; accepted: an object "
                                        r'\{"messages": \[\.\.\.\]\}'):
        ConversationFile(path)
