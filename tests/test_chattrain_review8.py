"""Review 8 of mid-training / SFT data: decontamination leaves out only conversations that ask a
test question (not a two-word MMLU topic stem), refuses an --extra-conversations file it empties
whole, and its counts reach the checkpoint's mixture record; an empty --source is refused."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from nanochat.chat_data import build_mixture, drop_eval_questions
from nanochat.errors import DataError
from nanochat.tasks import ConversationFile

LOUD = "What is the loudest animal on Earth?"   # an MMLU test question, asked word for word in sft/chatterbot.jsonl


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat(user: str, reply: str = "Sure.") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def test_two_word_topic_stems_do_not_drop_conversations(tmp_path, capsys):
    """MMLU stems such as "Neural networks" (15 folded characters: past the 12-character floor)
    carry their question in the choices; a user turn naming the topic asks no test problem."""
    eval_dir = tmp_path / "eval"
    eval_dir.mkdir()
    _write(eval_dir / "mmlu.jsonl", [{"question": q, "choices": ["a", "b", "c", "d"], "answer": 0}
                                     for q in ("Neural networks", "Milton Friedman", LOUD, "What is malware?")])
    rows = [_chat("Neural networks"), _chat("milton friedman!"), _chat(LOUD.upper(), "The sperm whale"),
            _chat("what is MALWARE"), _chat("Hello there")]
    f = ConversationFile(_write(tmp_path / "mine.jsonl", rows))
    assert drop_eval_questions([f], eval_dir) == {str(tmp_path / "mine.jsonl"): 2}
    assert [r["messages"][0]["content"] for r in f.rows] == ["Neural networks", "milton friedman!", "Hello there"]
    assert "2 conversations of" in capsys.readouterr().out


def test_extra_file_emptied_by_decontamination_is_refused_and_counts_are_recorded(shared_data, tmp_path):
    """A file all of whose rows ask test questions trained nothing of the user's data, said only
    as one start-up line among many; the counts left out go into the checkpoint's mixture record."""
    from nanochat.chat_train import mixture_record
    kw = dict(data_dir=shared_data / "sft", identity="", test_holdout=500)
    only = _write(tmp_path / "only.jsonl", [_chat(LOUD, "The sperm whale")])
    with pytest.raises(DataError, match=rf"^--extra-conversations {only}: every conversation of it \(1\) asks a "
                                        r"chat_eval test question"):
        build_mixture("sft", "train", extra=[str(only)], **kw)
    mixed = _write(tmp_path / "mixed.jsonl", [_chat(LOUD, "The sperm whale"), _chat("Hi", "Hello!")])
    mix = build_mixture("sft", "train", extra=[str(mixed)], **kw)
    record = mixture_record(SimpleNamespace(identity=""), mix)
    convs = next(src for src in record["decontaminated"] if "chatterbot" in src)
    assert record["decontaminated"] == {convs: 3, str(mixed): 1}   # sft/chatterbot.jsonl asks three
    assert record["extra_conversations"][0]["conversations"] == 1


@pytest.mark.parametrize("script, accepted", [("chat_sft", "mid|base"), ("mid_train", "base")])
def test_an_empty_source_is_refused_not_taken_for_the_default(script, accepted):
    """--source "$SRC" with SRC unset started from the stage's default phase without a word."""
    import importlib
    mod = importlib.import_module(f"scripts.{script}")
    assert mod.parse([]).source == accepted.split("|")[0]
    with pytest.raises(ValueError, match=rf"^--source: got ''; accepted: {accepted}$"):
        mod.parse(["--source", ""])
