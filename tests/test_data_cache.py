"""Start-up data reads done once: decontaminate's eval-question set (cached per process on the files'
path / mtime / size / inode), the held-out-twin check's problem keys (only for rows asking a held-out
question), and CORE's offline hellaswag file (converted once for hellaswag and hellaswag_zeroshot)."""

import json
import os
from types import SimpleNamespace

import pytest

from nanochat import core_data, decontaminate
from nanochat.tasks import common as task_common


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _mc(question):
    return {"question": question, "choices": ["a", "b", "c", "d"], "answer": 0}


def count_reads(monkeypatch, module, name: str) -> list[str]:
    """The names of the files module.name (a reader taking a path) is called on, from now on."""
    opened, real = [], getattr(module, name)

    def counting(path):
        opened.append(path.name)
        return real(path)
    monkeypatch.setattr(module, name, counting)
    return opened


@pytest.fixture
def eval_reads(monkeypatch):
    """Paths read_jsonl (the eval-question reader) opened, from an empty _eval_questions cache."""
    decontaminate._read_eval_questions.cache_clear()
    yield count_reads(monkeypatch, task_common, "read_jsonl")
    decontaminate._read_eval_questions.cache_clear()


def test_eval_questions_cached_until_a_file_is_edited_added_or_removed(tmp_path, eval_reads):
    d = tmp_path / "eval"
    d.mkdir()
    mmlu = _jsonl(d / "mmlu.jsonl", [_mc("Which planet is the largest of all?")])
    questions, missing = decontaminate._eval_questions(d)
    assert questions == {"which planet is the largest of all"} and eval_reads == ["mmlu.jsonl"]
    assert missing == ("ARC-Easy", "ARC-Challenge", "GSM8K")
    assert isinstance(questions, frozenset) and isinstance(missing, tuple)   # the cache's: callers cannot change it

    again = decontaminate._eval_questions(d)   # a cache hit: the same answer, no file read
    assert again == (questions, missing) and eval_reads == ["mmlu.jsonl"]

    # edited in place: same size, same inode, a later mtime
    before = mmlu.stat()
    _jsonl(mmlu, [_mc("Which planet is the hottest of all?")])
    os.utime(mmlu, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))
    assert mmlu.stat().st_size == before.st_size and mmlu.stat().st_ino == before.st_ino
    assert decontaminate._eval_questions(d)[0] == {"which planet is the hottest of all"}
    assert eval_reads == ["mmlu.jsonl"] * 2

    # a test file for a task that had none is read at the next call
    gsm = _jsonl(d / "gsm8k.jsonl", [{"question": "How many eggs does the hen lay?", "answer": "#### 3"}])
    questions, missing = decontaminate._eval_questions(d)
    assert questions == {"which planet is the hottest of all", "how many eggs does the hen lay"}
    assert missing == ("ARC-Easy", "ARC-Challenge")
    gsm.unlink()   # and one removed is no longer counted
    assert decontaminate._eval_questions(d) == (frozenset({"which planet is the hottest of all"}),
                                                ("ARC-Easy", "ARC-Challenge", "GSM8K"))


def test_eval_questions_leave_out_stems_shared_by_other_problems(tmp_path, eval_reads):
    """The set as before the cache: a question asked by two different problems (other choices) is
    not a test question by itself; the same problem twice (another subject) still is."""
    d = tmp_path / "eval"
    d.mkdir()
    stem, twice = "Which of the following is true?", "What is the boiling point of water?"
    _jsonl(d / "mmlu.jsonl", [_mc(stem), {**_mc(stem), "choices": ["e", "f", "g", "h"]},
                              {**_mc(twice), "subject": "physics"}, {**_mc(twice), "subject": "chemistry"},
                              _mc("Neural networks")])   # too short to ask anything
    questions, _ = decontaminate._eval_questions(d)
    assert questions == {"what is the boiling point of water"}


def test_held_out_twins_key_only_rows_asking_a_held_out_question(monkeypatch):
    """_drop_held_out_twins built a problem key (json of question and choices) for every trained
    row (MMLU's 14K: ~0.3 s at each mid start-up); now only for rows whose question a held-out
    problem asks, with the same rows left out."""
    keyed = []

    def counting(row):
        keyed.append(row["question"])
        return real(row)
    real = decontaminate.problem_key
    monkeypatch.setattr(decontaminate, "problem_key", counting)
    held = _mc("What is 2 + 2?")
    rows = [held, *(_mc(f"Question number {i}?") for i in range(50)),
            _mc("what is  2 + 2?"),                                 # the held-out problem again: left out
            {**_mc("What is 2 + 2?"), "choices": ["1", "2", "3", "4"]}]   # other choices: another problem
    task = SimpleNamespace(rows=rows, start=1, name="T")
    decontaminate._drop_held_out_twins([task], 1)
    assert [r["question"] for r in task.rows] == ["What is 2 + 2?", *(f"Question number {i}?" for i in range(50)),
                                                   "What is 2 + 2?"]
    assert task.rows[-1]["choices"] == ["1", "2", "3", "4"]
    assert sorted(keyed) == sorted(["What is 2 + 2?", "what is  2 + 2?", "What is 2 + 2?"])


def _hellaswag(i):
    return {"activity_label": "Cooking", "ctx": f"[header] How to cook {i} [title] Heat it.",
            "endings": [f"Stir {i}.", "[step] Wait.", "Eat.", "Sleep."], "label": i % 4}


def test_core_hellaswag_file_converted_once_for_both_tasks(tmp_path, monkeypatch):
    _jsonl(tmp_path / "hellaswag.jsonl", [_hellaswag(i) for i in range(12)])
    alone = core_data.load_core_data(tasks=["hellaswag"], data_dir=tmp_path).tasks[0][1]
    reads = count_reads(monkeypatch, core_data, "read_jsonl_numbered")
    data = core_data.load_core_data(tasks=["hellaswag_zeroshot", "hellaswag"], data_dir=tmp_path)
    assert reads == ["hellaswag.jsonl"]
    (zs, zero_shot), (ten, ten_shot) = data.tasks
    assert (zs.label, zs.num_fewshot, ten.label, ten.num_fewshot) == ("hellaswag_zeroshot", 0, "hellaswag", 10)
    assert zero_shot == ten_shot == alone and zero_shot is not ten_shot   # each task its own list
    assert alone[0] == {"query": "Cooking: How to cook 0. Heat it.", "choices": ["Stir 0.", "Wait.", "Eat.", "Sleep."],
                        "gold": 0}


def test_core_hellaswag_text_without_tags_only_respaced():
    assert core_data._hellaswag_text("  A man  walks\tin. ") == "A man walks in."
    assert core_data._hellaswag_text("How to cook [title] Prepare it. [step] Mix") == "How to cook. Prepare it. Mix"
