"""Chat training mixtures leave out conversations that ask a chat_eval test question verbatim."""

import json

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
