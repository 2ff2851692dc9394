"""The report's summary and chat_eval's decoding: a score of one answer sampled at --temperature > 0
(--num-samples 1) was shown like a greedy one, with no note, and replaced the greedy score of the same
checkpoint; an entry naming no temperature was read as greedy. Sections are logged as chat_eval logs
them (its report_section), or as a hand-written entry would be."""

from types import SimpleNamespace

import pytest

from nanochat import report as report_mod
from nanochat.report import get_report


@pytest.fixture()
def rep(tmp_path, monkeypatch):
    """A fresh report in a tmp base dir, its clock moved by hand and no plots (the text is read)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    now = [1_800_000_000.0]
    monkeypatch.setattr(report_mod, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(report_mod, "make_plots", lambda metrics, out_dir: [])
    report = get_report()
    report.reset()
    report.clock = now
    return report


def chat_eval_entry(rep, *, temperature=0.0, num_samples=1, step=30, scores=None, tasks=("ARC-Easy", "GSM8K")):
    """What scripts/chat_eval.py logs for an SFT checkpoint (its report_section, fed its own config)."""
    from scripts.chat_eval import ChatEvalConfig, report_section

    kinds = {"ARC-Easy": "categorical", "MMLU": "categorical", "GSM8K": "generative", "HumanEval": "generative"}
    scores = scores or {t: 0.25 for t in tasks}
    cfg = ChatEvalConfig(source="sft", model_tag="d12", task_name="|".join(tasks), temperature=temperature,
                         num_samples=num_samples).validate()
    results = {t: {"accuracy": scores[t], "passed": 1, "total": 4, "problems": 4, "baseline": 0.0, "seconds": 1.0}
               for t in tasks}
    out = {"step": step, "results": results, "ChatCORE": sum(scores.values()) / len(tasks), "complete": False}
    rep.clock[0] += 60
    rep.log("Chat evaluation sft", report_section(cfg, "d12", out, {t: SimpleNamespace(eval_type=kinds[t])
                                                                      for t in tasks}))


def summary_rows(rep) -> dict[str, list[str]]:
    lines = rep.generate().read_text().splitlines()
    start = lines.index("## Summary") + 2
    rows = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_a_sampled_single_answer_score_is_marked(rep):
    """GSM8K at -t 0.8 -n 1 read "0.2500" like a greedy score; ARC-Easy (the answer letter's logit:
    no sampling) and ChatCORE of categorical tasks only stay unmarked."""
    chat_eval_entry(rep, temperature=0.8, scores={"ARC-Easy": 0.5, "GSM8K": 0.25})
    cells = rep.summary_cells()
    assert cells["GSM8K"]["sft"] == (0.25, ["sampled, T=0.8"])
    assert cells["ChatCORE"]["sft"] == (0.375, ["partial", "sampled, T=0.8"])
    assert cells["ARC-Easy"]["sft"] == (0.5, [])
    text = rep.generate().read_text()
    assert "| GSM8K | - | - | 0.2500 (sampled, T=0.8) | - |" in text
    assert "- (sampled, T=t): one answer per problem sampled at temperature t" in text
    chat_eval_entry(rep, temperature=0.8, step=31, tasks=("ARC-Easy", "MMLU"))
    assert rep.summary_cells()["ChatCORE"]["sft"] == (0.25, ["partial"])   # no generated answer in it


def test_the_greedy_score_of_the_same_checkpoint_is_kept_and_the_sampled_one_named(rep):
    """chat_eval -t 0.8 after a greedy chat_eval of the same checkpoint replaced its GSM8K (and
    ChatCORE): a sampled score differs run to run and is not comparable with the greedy one."""
    chat_eval_entry(rep, scores={"ARC-Easy": 0.5, "GSM8K": 0.25})
    chat_eval_entry(rep, temperature=0.8, scores={"ARC-Easy": 0.5, "GSM8K": 0.75})
    cells = rep.summary_cells()
    assert cells["GSM8K"]["sft"] == (0.25, []) and cells["ChatCORE"]["sft"] == (0.375, ["partial"])
    text = rep.generate().read_text()
    assert "| GSM8K | - | - | 0.2500 | - |" in text
    aside = [ln for ln in text.splitlines() if ln.startswith("- SFT GSM8K: ")]
    assert len(aside) == 1 and "0.7500 (sampled, T=0.8)" in aside[0] and "d12 step 30" in aside[0]
    assert "set aside: the greedy score of the same checkpoint is shown" in aside[0]
    # pass@k of the same checkpoint keeps it too
    chat_eval_entry(rep, temperature=1.0, num_samples=4, scores={"ARC-Easy": 0.5, "GSM8K": 0.9})
    assert rep.summary_cells()["GSM8K"]["sft"] == (0.25, [])
    assert "0.9000 (pass@4)" in rep.generate().read_text()
    # a greedy run after them is the latest greedy score: shown, and the set-aside notes go
    chat_eval_entry(rep, scores={"ARC-Easy": 0.5, "GSM8K": 0.5})
    assert rep.summary_cells()["GSM8K"]["sft"] == (0.5, [])
    assert "- SFT GSM8K: " not in rep.generate().read_text()


def test_another_checkpoint_or_a_stale_greedy_score_gives_way_to_the_newest(rep):
    """The rule is per checkpoint: a sampled score of a later step (or after the stage was retrained)
    is the newest model's, shown and marked; a greedy one logged after a sampled one replaces it."""
    chat_eval_entry(rep, step=30)
    chat_eval_entry(rep, temperature=0.7, step=40, scores={"ARC-Easy": 0.5, "GSM8K": 0.75})
    assert rep.summary_cells()["GSM8K"]["sft"] == (0.75, ["sampled, T=0.7"])
    chat_eval_entry(rep, step=40, scores={"ARC-Easy": 0.5, "GSM8K": 0.5})
    assert rep.summary_cells()["GSM8K"]["sft"] == (0.5, [])
    rep.clock[0] += 1
    rep.log("Chat SFT", {"stage": "sft", "final_step": 50})      # retrained: the greedy score is stale
    chat_eval_entry(rep, temperature=0.7, step=40, scores={"ARC-Easy": 0.5, "GSM8K": 0.125})
    assert rep.summary_cells()["GSM8K"]["sft"] == (0.125, ["sampled, T=0.7"])


def test_an_entry_naming_no_temperature_is_not_taken_for_greedy(rep):
    """A hand-written entry (chat_eval has always logged "temperature") was read as greedy: it is
    marked, and it does not replace a greedy score of the same checkpoint; one that says pass@k
    (num_samples > 1) states it was sampled, and is not marked unknown."""
    rep.log("Chat evaluation sft", {"stage": "sft", "model_tag": "d12", "step": 30, "GSM8K": 0.1, "ARC-Easy": 0.3,
                                    "ChatCORE metric": 0.2})
    cells = rep.summary_cells()
    assert cells["GSM8K"]["sft"] == (0.1, ["temperature unknown"]) and cells["ARC-Easy"]["sft"] == (0.3, [])
    assert cells["ChatCORE"]["sft"] == (0.2, ["temperature unknown"])
    assert "- (temperature unknown): the entry names no temperature" in rep.generate().read_text()
    chat_eval_entry(rep, scores={"ARC-Easy": 0.5, "GSM8K": 0.25})
    rep.clock[0] += 60
    rep.log("Chat evaluation sft", {"stage": "sft", "model_tag": "d12", "step": 30, "GSM8K": 0.6})
    assert rep.summary_cells()["GSM8K"]["sft"] == (0.25, [])
    rep.log("Chat evaluation rl", {"stage": "rl", "num_samples": 4, "GSM8K": 0.4})
    assert rep.summary_cells()["GSM8K"]["rl"] == (0.4, ["pass@4"])
    rep.log("Chat evaluation rl", {"stage": "rl", "temperature": "0.8", "GSM8K": 0.4})   # not a number
    assert rep.summary_cells()["GSM8K"]["rl"] == (0.4, ["temperature unknown"])


def test_sampled_mark_formats_the_temperature_as_chat_eval_prints_it():
    """chat_eval's console says "(sampled, T=1)" (`:g`); the report said "(sampled, T=1.0)"."""
    from nanochat.report_md import _decoding_note

    assert _decoding_note("GSM8K", {"temperature": 1.0}) == ["sampled, T=1"]
    assert _decoding_note("GSM8K", {"temperature": 0.75}) == ["sampled, T=0.75"]
