"""Chat training mixtures leave out conversations that ask a chat_eval test question verbatim."""

import json

import pytest

from nanochat.chat_data import build_mixture, drop_eval_questions
from nanochat.tasks import ConversationFile
from nanochat.tasks.common import SHARED_DATA


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_extra_file_rows_asking_eval_questions_are_dropped(tmp_path, capsys):
    mmlu = json.loads((SHARED_DATA / "eval" / "mmlu.jsonl").open().readline())
    gsm = json.loads((SHARED_DATA / "eval" / "gsm8k.jsonl").open().readline())
    rows = [{"messages": [{"role": "user", "content": "  " + mmlu["question"].upper() + "!! "},
                          {"role": "assistant", "content": "x"}]},
            {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"},
                          {"role": "user", "content": gsm["question"]}, {"role": "assistant", "content": "42"}]},
            {"messages": [{"role": "user", "content": "What is a question?"}, {"role": "assistant", "content": "y"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": mmlu["question"]}]}]
    f = ConversationFile(_write(tmp_path / "mine.jsonl", rows))
    dropped = drop_eval_questions([f], SHARED_DATA / "eval")
    assert dropped == {str(tmp_path / "mine.jsonl"): 2}
    assert [r["messages"][0]["content"] for r in f.rows] == ["What is a question?", "hi"]  # an assistant turn is not asked
    assert "2 conversations of" in capsys.readouterr().out


def test_local_sft_mixture_no_longer_trains_on_mmlu_questions(capsys):
    """sft/chatterbot.jsonl asks three MMLU test questions word for word."""
    mix = build_mixture("sft", "train", data_dir=SHARED_DATA / "sft", identity="", test_holdout=500)
    convs = mix.tasks[0]
    asked = {m["content"].strip() for r in convs.rows for m in r["messages"] if m["role"] == "user"}
    assert "What is the only metal that is a liquid at normal atmospheric pressure and temperature?" not in asked
    out = capsys.readouterr().out
    assert "decontamination: 3 conversations of" in out


def test_missing_eval_files_are_named(tmp_path, capsys):
    sft = tmp_path / "sft"
    sft.mkdir()
    f = ConversationFile(_write(sft / "a.jsonl", [{"messages": [{"role": "user", "content": "q"},
                                                                {"role": "assistant", "content": "a"}]}]))
    assert drop_eval_questions([f], sft) == {}
    assert "no local test file of MMLU, ARC-Easy, ARC-Challenge, GSM8K" in capsys.readouterr().out


def test_generic_stems_and_rows_past_a_slice_are_not_checked(tmp_path):
    """A stem several MMLU problems share with other choices ("Which of the following is true?")
    is no one test problem: a chat turn equal to it stays. A task sliced to its first N rows (SFT's
    10K of SmolTalk) is checked only until N are kept: the rows past it are never trained."""
    import collections

    from nanochat.decontaminate import _eval_questions, _question_text
    mmlu = [json.loads(line) for line in (SHARED_DATA / "eval" / "mmlu.jsonl").open()]
    folded = collections.Counter(_question_text(r["question"]) for r in mmlu)
    stem = next(q for q, n in folded.items() if n > 3 and len(q.split()) >= 3
                and len({json.dumps(r["choices"]) for r in mmlu if _question_text(r["question"]) == q}) > 1)
    questions, _ = _eval_questions(SHARED_DATA / "eval")
    assert stem not in questions and _question_text(mmlu[0]["question"]) in questions
    ask = {"messages": [{"role": "user", "content": mmlu[0]["question"]}, {"role": "assistant", "content": "x"}]}
    chat = {"messages": [{"role": "user", "content": stem}, {"role": "assistant", "content": "y"}]}
    f = ConversationFile(_write(tmp_path / "c.jsonl", [chat, ask, chat, ask, ask]))
    f.stop = 2   # as get_conversations(stop=N) slices
    assert drop_eval_questions([f], SHARED_DATA / "eval") == {str(tmp_path / "c.jsonl"): 1}
    assert [r["messages"][0]["content"] for r in f.rows[:2]] == [stem, stem]   # the 2 a slice reads
    assert len(f.rows) == 4 and len(f) == 2   # the unread tail kept as it was


def test_a_run_from_before_decontamination_is_named_on_resume():
    """A mid/SFT checkpoint saved before this check trained on every row: resuming it under the
    check shifted or removed rows, and the refusal blamed --test-holdout and --data-dir."""
    from nanochat.chat_train import _check_same_data
    from nanochat.checkpoint import CheckpointError
    old = {"train": {"mixture": {"identity": "nanochat-spark", "extra_conversations": []},
                     "mixture_conversations": 1877}, "config": {"seed": 42}}
    now = {"identity": "nanochat-spark", "extra_conversations": [], "decontaminated": {"chatterbot.jsonl": 3}}
    with pytest.raises(CheckpointError, match="from before decontamination.*leaves out 3 conversations.*"
                                              "--no-decontaminate"):
        _check_same_data(old, now, 1874, 42, 64)
    _check_same_data(old, {**now, "decontaminated": {}}, 1877, 42, 64)   # --no-decontaminate: as it was
    new = {"train": {"mixture": now, "mixture_conversations": 1874}, "config": {"seed": 42}}
    _check_same_data(new, now, 1874, 42, 64)
    with pytest.raises(CheckpointError, match="decontaminated of 3 conversations, this run's of 0"):
        _check_same_data(new, {**now, "decontaminated": {}}, 1874, 42, 64)


def test_no_decontaminate_keeps_every_row():
    mix = build_mixture("sft", "train", data_dir=SHARED_DATA / "sft", identity="", test_holdout=500,
                        decontaminate=False)
    asked = {m["content"].strip() for r in mix.tasks[0].rows for m in r["messages"] if m["role"] == "user"}
    assert "What is the only metal that is a liquid at normal atmospheric pressure and temperature?" in asked
    assert mix.decontaminated == {}
