"""Tasks / chat data review 7: defects found by training and evaluating as a user would.

* --test-holdout N left trained twins of scored problems: MMLU's test file holds 105 problems twice
  (same question and choices), so chat_eval scored problems whose copy past the first N was trained
  on (2 of the first 100, 21 of the first 1000). Twins of a held-out problem, in any task the stage
  trains, are now left out of training.
* a bad row of an eval file was named "row N", the N-th JSON row: with blank lines in the file that
  is another line than the one an editor shows. The line is now named too.
* a hub failure said nothing of what to do offline: now it names the file to put where.
* an SFT / RL checkpoint with no source recorded (older, or converted) was taken as trained from
  nothing: chat_eval scored every problem and said nothing. Now its lineage is unknown, said on the
  console and in the results; and a chat stage starting from such a checkpoint records what is known
  (its own holdout) with the map marked incomplete, instead of recording nothing at all.
"""

from __future__ import annotations

import json

import pytest

from nanochat.errors import DataError


def write_jsonl(path, rows, blank_after: int | None = None):
    lines = [json.dumps(r) for r in rows]
    if blank_after is not None:
        lines.insert(blank_after, "")
    path.write_text("\n".join(lines) + "\n")
    return path


def gsm(q: str, n: int = 1) -> dict:
    return {"question": q, "answer": f"It is {n}.\n#### {n}"}


def mc(q: str, choices=("a", "b")) -> dict:
    return {"question": q, "choices": list(choices), "answer": 0}


# ------------------------------------------------------------------ held-out twins

def test_a_trained_twin_of_a_held_out_gsm8k_problem_is_left_out(tmp_path, capsys):
    from nanochat.chat_data import build_mixture

    write_jsonl(tmp_path / "gsm8k.jsonl", [gsm("What is 1+1?", 2), gsm("What is 2+2?", 4),
                                           gsm("What is  1+1? ", 2), gsm("What is 3+3?", 6)])
    task = build_mixture("rl", "train", data_dir=tmp_path, test_holdout=2)
    questions = [task[i]["messages"][0]["content"] for i in range(len(task))]
    assert questions == ["What is 3+3?"], questions        # the whitespace twin of problem 0 was trained on
    assert "1 GSM8K test problems past the first 2 repeat a held-out one" in capsys.readouterr().out


def test_a_held_out_arc_easy_problem_is_not_trained_through_arc_challenge(tmp_path):
    from nanochat.chat_data import _train_split_tasks

    write_jsonl(tmp_path / "arc_easy.jsonl", [mc("Which is red?"), mc("Which is blue?")])
    write_jsonl(tmp_path / "arc_challenge.jsonl", [mc("Which is green?"), mc("which is RED?"), mc("Which is gray?")])
    easy, challenge = _train_split_tasks(("arc",), tmp_path, 1)
    first_lines = lambda t: [t[i]["messages"][0]["content"].split("\n")[0] for i in range(len(t))]   # noqa: E731
    assert first_lines(easy) == ["Which is blue?"] and first_lines(challenge) == ["Which is gray?"]


def test_a_holdout_leaving_only_twins_is_refused_naming_the_flag(tmp_path):
    from nanochat.chat_data import build_mixture
    from nanochat.errors import RequestError

    write_jsonl(tmp_path / "gsm8k.jsonl", [gsm("What is 1+1?", 2), gsm("What is 1+1?", 2)])
    with pytest.raises(RequestError, match="--test-holdout: got 1; accepted: -1 or a smaller N .*gsm8k.jsonl past"):
        build_mixture("rl", "train", data_dir=tmp_path, test_holdout=1)


def test_no_scored_mmlu_problem_of_the_real_file_is_trained(shared_data, tmp_path, monkeypatch):
    from nanochat.chat_data import _train_split_tasks
    from nanochat.tasks import MMLU

    def problem_key(row):   # the problem as the model reads it
        return json.dumps([" ".join(row["question"].split()), row["choices"]])

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    data = shared_data / "eval"
    scored = {problem_key(r) for r in MMLU("test", data_dir=data, stop=100).rows[:100]}
    (trained,) = _train_split_tasks(("mmlu",), data, 100)
    assert len(trained) == 14042 - 100 - 2                 # the 2 twins of scored problems are left out
    assert not any(problem_key(r) in scored for r in trained.rows[100:])


# ------------------------------------------------------------------ loader messages

def test_a_bad_row_after_a_blank_line_names_its_line(tmp_path):
    from nanochat.tasks import ARC

    write_jsonl(tmp_path / "arc_easy.jsonl", [mc("A?"), mc("B?"), {**mc("C?"), "answer": 5}], blank_after=1)
    with pytest.raises(DataError, match=r"arc_easy.jsonl: row 3: 'answer' must be .*\(line 4 of the file\)"):
        ARC("easy", "test", data_dir=tmp_path)


def test_a_bad_smoltalk_row_names_its_line(tmp_path):
    from nanochat.tasks import SmolTalk

    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "assistant", "content": "hi"}]}
    path = write_jsonl(tmp_path / "smoltalk_train.jsonl", [good, bad], blank_after=0)
    with pytest.raises(DataError, match=f"{path}: row 2: messages\\[0\\].role .*\\(line 3 of the file\\)"):
        SmolTalk("train", data_dir=tmp_path)


def test_a_hub_failure_says_what_to_do_offline(tmp_path, monkeypatch):
    from nanochat.tasks import GSM8K, common
    from nanochat.tasks.common import DataUnavailableError

    def offline(*a):
        raise ConnectionError("Couldn't reach huggingface.co")

    monkeypatch.setattr(common, "load_hub_rows", offline)
    with pytest.raises(DataUnavailableError, match="Offline: put gsm8k_test.jsonl or gsm8k.jsonl .* in one of the "
                                                   "folders tried above") as e:
        GSM8K("test", data_dir=tmp_path)
    assert "ConnectionError: Couldn't reach" in str(e.value)


# ------------------------------------------------------------------ lineage

def test_an_sft_or_rl_checkpoint_without_a_source_is_an_unknown_lineage():
    from nanochat.chat_data import test_holdouts

    def unreadable(src):
        raise AssertionError("no source to read")

    held, complete = test_holdouts({"phase": "sft", "config": {"test_holdout": 3}}, unreadable)
    assert held == {"ARC-Easy": (3, "sft"), "ARC-Challenge": (3, "sft"), "GSM8K": (3, "sft")} and not complete
    assert test_holdouts({"phase": "rl", "config": {}, "source": None}, unreadable)[1] is False
    assert test_holdouts({"phase": "mid", "config": {"test_holdout": 3}}, unreadable)[1] is True   # from base
    recorded = {"phase": "mid", "step": 1, "test_holdouts": {"GSM8K": [4, "mid"]}, "test_holdouts_complete": False}
    assert test_holdouts({"phase": "rl", "source": recorded}, unreadable) == ({"GSM8K": (4, "mid")}, False)


def test_chat_eval_says_an_unknown_lineage_in_its_results(base, tiny_tokenizer, tmp_path, capsys):
    """An RL model started from an SFT checkpoint that names no source: SFT's own holdout (2) is
    recorded and still cuts the score, and the rest of the chain is unknown, said where the scores go."""
    from types import SimpleNamespace
    import shutil
    from nanochat.chat_start import start_point
    from nanochat.checkpoint import checkpoint_dir
    from scripts import chat_eval
    from tests.test_eval_review2 import save

    write_jsonl(tmp_path / "arc_easy.jsonl", [mc(f"Q{i}?") for i in range(5)])
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": 2})
    _, _, source, _ = start_point("rl", SimpleNamespace(source="sft", model_tag="d1", step="latest", resume=None), base)
    assert source["test_holdouts"]["ARC-Easy"] == [2, "sft"] and source["test_holdouts_complete"] is False
    save(base, tiny_tokenizer, "rl", 4, config={"test_holdout": -1}, source={**source, "phase": "sft", "step": 3})
    shutil.rmtree(checkpoint_dir("sft", "d1", base))
    out = chat_eval.main(["-i", "rl", "--device", "cpu", "--data-dir", str(tmp_path), "-a", "ARC-Easy",
                          "--out", str(tmp_path / "r.json")])
    assert out["results"]["ARC-Easy"]["total"] == 2 and out["training_problems_known"] is False
    assert json.loads((tmp_path / "r.json").read_text())["training_problems_known"] is False
    assert "are not known" in capsys.readouterr().out
