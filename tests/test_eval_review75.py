"""Review 75 of the evaluation numbers: a HumanEval file whose own solutions can never pass is refused
when the task is built (it scored every answer 0, silently), and report.md's time table counts every
evaluation run whose scores the summary shows (chat_eval a task at a time lost the earlier runs' time)."""

import json
import re

import pytest

from nanochat.errors import DataError

ADD = {"task_id": "t/0", "prompt": 'def add(a, b):\n    """a + b"""\n', "canonical_solution": "    return a + b\n",
       "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n", "entry_point": "add"}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("change, problem", [
    # an MBPP-style export: bare asserts, no check(); every program ended in NameError: check
    ({"test": "assert add(1, 2) == 3\n"}, "'test' defines no top-level check"),
    # an export that lost the solution's indentation: SyntaxError ('return' outside function)
    ({"canonical_solution": "return a + b\n"}, "do not compile"),
    ({"test": "def check(candidate):\nassert candidate(1, 2) == 3\n"}, "'test' is not valid Python"),
    # a misspelt entry point: check(ad) is a NameError whatever the model writes
    ({"entry_point": "ad"}, "define no function 'ad'"),
])
def test_humaneval_rows_that_can_never_pass_are_refused_naming_file_and_line(tmp_path, change, problem):
    from nanochat.tasks import HumanEval

    _write(tmp_path / "humaneval.jsonl", [ADD, {**ADD, "task_id": "t/1", **change}])
    with pytest.raises(DataError, match=rf"humaneval.jsonl: row 2: .*{re.escape(problem)}.*line 2 of the file"):
        HumanEval(data_dir=tmp_path)


def test_humaneval_well_formed_rows_still_load(tmp_path, shared_data):
    from nanochat.tasks import HumanEval

    helper = {**ADD, "task_id": "t/1", "entry_point": "twice",   # a helper first, as HumanEval/10
              "prompt": "import math\n\ndef add(a, b):\n    return a + b\n\n\ndef twice(x):\n    \"\"\"2x\"\"\"\n",
              "canonical_solution": "    return add(x, x)\n",
              "test": "\n\nMETADATA = {}\n\n\ndef check(candidate):\n    assert candidate(2) == 4\n"}
    _write(tmp_path / "humaneval.jsonl", [ADD, helper])
    assert len(HumanEval(data_dir=tmp_path)) == 2
    assert len(HumanEval(data_dir=shared_data / "eval")) == 164   # the released file passes every check


def _time_table(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    start = lines.index("| Stage | steps | wall clock |")
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def _chat_entry(t: float, **scores) -> dict:
    data = {"stage": "sft", "model_tag": "d4", "step": 20, "temperature": 0.0, **scores}
    return {"time": f"2026-12-02T10:00:{int(t):02d}", "t": 1.8e9 + t, "data": data}


def _write_section(base, title, entries):
    path = base / "report" / "sections" / f"{title.lower().replace(' ', '-')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"section": title, "entries": entries}))


@pytest.fixture()
def report_base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOCHAT_REPORT_DIR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


def test_time_table_counts_each_chat_eval_run_the_summary_shows(report_base):
    from nanochat.report import Report, report_dir

    # chat_eval one task at a time: both runs' scores are in the summary, so both runs' time is the pipeline's
    _write_section(report_base, "Chat evaluation sft", [
        _chat_entry(1, **{"ARC-Easy": 0.31, "ARC-Easy complete": True, "seconds": 100.0}),
        _chat_entry(2, **{"GSM8K": 0.05, "GSM8K complete": True, "max_new_tokens": 512, "seconds": 50.0})])
    text = Report(report_dir()).generate(hourly_cost=36.0).read_text()
    rows = _time_table(text)
    assert rows["Chat evaluation sft (2 runs)"] == ["", "0:02:30"], rows   # was "Chat evaluation sft": 0:00:50
    assert rows["total"] == ["", "0:02:30"]
    assert "$1.50 for the table's total" in text   # 150 s at $36/h (was $0.50)


def test_time_table_does_not_count_an_evaluation_a_rerun_replaced(report_base):
    from nanochat.report import Report, report_dir

    # the GSM8K run was rerun: its first run's score is not shown, nor is its time counted
    _write_section(report_base, "Chat evaluation sft", [
        {**_chat_entry(0, **{"MMLU": 0.3, "MMLU complete": True, "seconds": 1000.0}), "t": 1.8e9 + 0.2},
        _chat_entry(1, **{"ARC-Easy": 0.31, "ARC-Easy complete": True, "seconds": 100.0}),
        _chat_entry(2, **{"GSM8K": 0.05, "GSM8K complete": True, "seconds": 50.0}),
        _chat_entry(3, **{"GSM8K": 0.06, "GSM8K complete": True, "seconds": 40.0})])
    # the MMLU entry is stale (before the latest SFT run, below): no part of the current model's time either
    _write_section(report_base, "SFT", [{"time": "2026-12-02T09:59:59", "t": 1.8e9 + 0.5, "data": {
        "stage": "sft", "model_tag": "d4", "final_step": 20, "total_time_s": 10.0}}])
    _write_section(report_base, "Base model evaluation", [
        {"time": "2026-12-02T10:00:05", "t": 1.8e9 + 5, "data": {"stage": "base", "step": 9, "val_bpb": 1.1, "seconds": 7.0}}])
    rows = _time_table(Report(report_dir()).generate().read_text())
    assert rows["Chat evaluation sft (2 runs)"] == ["", "0:02:20"], rows   # 100 + 40
    assert rows["Base model evaluation"] == ["", "0:00:07"]                # one entry: as before
