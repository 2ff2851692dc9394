"""Audit of report.md as a user reads it after ./setup.sh: every stage's records as the scripts
write them (tokenizer, base interrupted and resumed, base_eval, mid, SFT twice, chat_eval partial
then full, RL rewarded 0 at every step, an RL rerun that never finished), then what the summary,
time table, notes and sections say; and a report without matplotlib or with a torn metrics line."""

import math
import sys
from types import SimpleNamespace

import pytest

from nanochat import report as report_mod
from nanochat.report import get_report, log_metrics

REAL_MAKE_PLOTS = report_mod.make_plots   # before the fixture below replaces it
CHAT_TASKS = ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee")


@pytest.fixture()
def clock(tmp_path, monkeypatch):
    """A base dir, the report's clock moved by hand (clock[0]: epoch seconds), and no plots unless a
    test asks for them (matplotlib takes most of the time; the text is what is read here)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    now = [1_800_000_000.0]
    monkeypatch.setattr(report_mod, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(report_mod, "make_plots", lambda metrics, out_dir: [])
    return now


def train(clock, stage, steps, *, start=0, stop=None, dt=2.0, eval_every=10, reward=None, elapsed0=0.0):
    """Metrics rows as loop.py writes them: an eval row where due (and at the last step), a training
    row per step; RL rows carry reward / seq_len / skipped. stop: interrupted before that step."""
    for s in range(start, steps + 1):
        if stop is not None and s == stop:
            return
        clock[0] += dt
        elapsed = elapsed0 + dt * (s - start + 1)
        if s % eval_every == 0 or s == steps:
            log_metrics(stage, {"step": s, "val_bpb": 1.5 - s / 1000, "elapsed_s": elapsed})
        if s < steps:
            row = {"step": s, "loss": 3.0 - s / 100, "smooth_loss": 3.0, "lrm": 1.0, "tok_per_sec": 150000.0,
                   "mfu": 38.5, "peak_mem_gib": 38.4, "elapsed_s": elapsed}
            if reward is not None:
                row.update(loss=0.0 if reward == 0 else 0.1, reward=reward(s) if callable(reward) else reward,
                           seq_len=200.0, skipped=0.0)
            log_metrics(stage, row)


def stage_section(clock, title, stage, steps, seconds, extra=None, config=None):
    """log_stage_report's section, logged after the run's last metrics row."""
    clock[0] += 5
    get_report().log(title, {"stage": stage, **(extra or {}), "final_step": steps, "total_time_s": seconds,
                             "final_val_bpb": 1.5 - steps / 1000, "val_bpb_step": steps, "min_val_bpb": 1.4,
                             "final_loss": 2.5, "avg_tok_per_sec": 149000.0,
                             "config": config or {"num_iterations": steps}})


def chat_eval(clock, stage, score, *, max_problems=None, seconds=60.0):
    clock[0] += seconds
    full = max_problems is None
    get_report().log(f"Chat evaluation {stage}", {
        "stage": stage, "model_tag": "d12", "step": 12, "temperature": 0.0, "num_samples": 1,
        "max_problems": max_problems, **{t: score for t in CHAT_TASKS}, **{f"{t} complete": full for t in CHAT_TASKS},
        "ChatCORE metric": score / 2, "ChatCORE complete": full, "seconds": seconds})


def whole_pipeline(clock):
    rep = get_report()
    rep.reset()
    rep.log("Tokenizer training", {"vocab_size": 65536, "train_time_s": 62.3})
    train(clock, "base", 50, stop=30)                       # interrupted at step 30 ...
    train(clock, "base", 50, start=20, elapsed0=40.0)       # ... resumed from its step-20 checkpoint
    stage_section(clock, "Base model training", "base", 50, 102.0, {"peak_mem_gib": 38.4},
                  {"num_iterations": 50, "resume": 20})
    clock[0] += 25
    rep.log("Base model evaluation", {"stage": "base", "model_tag": "d12", "step": 50, "seconds": 25.0,
                                      "train_bpb": 1.45, "val_bpb": 1.46, "CORE metric": 0.12, "CORE complete": True})
    train(clock, "mid", 20, dt=3.0)
    stage_section(clock, "Midtraining", "mid", 20, 63.0, {"conversations_skipped": 0})
    train(clock, "sft", 10, dt=1.0)
    stage_section(clock, "Chat SFT", "sft", 10, 11.0, {"conversations_skipped": 12}, {"max_seq_len": 1024})
    train(clock, "sft", 12, dt=1.0)
    stage_section(clock, "Chat SFT", "sft", 12, 13.0, {"conversations_skipped": 0}, {"max_seq_len": 2048})
    chat_eval(clock, "sft", 0.2, max_problems=50)
    chat_eval(clock, "sft", 0.25, seconds=600.0)
    train(clock, "rl", 8, dt=10.0, reward=0.0, eval_every=4)
    stage_section(clock, "Chat RL", "rl", 8, 90.0)
    return rep


def table(text, head):
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(head))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        rows.append(cells)
    return {r[0]: r[1:] for r in rows}


def test_whole_pipeline_reads_right(clock):
    """What was checked and found right: latest/complete values in the summary, resumed and rerun
    stages' current runs in the time table, units named, the superseded SFT run labelled."""
    text = whole_pipeline(clock).generate(hourly_cost=3.0).read_text()
    summary = table(text, "| Metric |")
    assert summary["val bpb"] == ["1.4600", "-", "-", "-"] and summary["CORE"] == ["0.1200", "-", "-", "-"]
    assert summary["val bpb (own data)"] == ["1.4500", "1.4800", "1.4880", "1.4920"]   # SFT's second run
    assert summary["ChatCORE"][2] == "0.1250" and summary["GSM8K"][2] == "0.2500"    # the full eval, not partial
    times = table(text, "| Stage |")
    assert times["base"] == ["50", "0:01:42"] and times["sft"] == ["12", "0:00:13"] and times["rl"] == ["8", "0:01:30"]
    assert times["Chat evaluation sft"] == ["", "0:10:00"]
    assert not any("(unfinished)" in k for k in times)   # every stage's latest run logged its section
    assert "- base: 11 metrics rows of an earlier run" in text and "- sft: 12 metrics rows" in text
    assert "![peak memory (GiB)]" not in text   # plots off in this fixture; memory is GiB in its title
    assert report_mod.PLOTS[-1][3] == "peak memory (GiB)"
    body = text[text.index("## Chat SFT"):]
    assert body.index("Run 1 of 2") < body.index("- conversations_skipped: 12") < body.index("Run 2 of 2") \
        < body.index("- conversations_skipped: 0")
    assert "`max_seq_len` 1024 -> 2048" in body


def test_an_unfinished_latest_run_is_named(clock):
    """An RL rerun interrupted after 3 steps: the time table showed "rl | 3 | 0:00:30" as the stage's
    run while the section and summary described the earlier run that finished, with nothing saying
    the latest one never did; a stage that crashed before any section looked finished too."""
    rep = whole_pipeline(clock)
    train(clock, "rl", 8, dt=10.0, reward=0.0, eval_every=4, stop=3)
    train(clock, "mid", 20, dt=3.0, stop=5)   # mid retrained, crashed at step 5
    text = rep.generate().read_text()
    times = table(text, "| Stage |")
    assert times["rl (unfinished)"] == ["3", "0:00:30"] and times["mid (unfinished)"] == ["5", "0:00:15"]
    assert times["base"] == ["50", "0:01:42"] and "sft" in times   # finished ones unmarked
    assert "- rl (unfinished): its latest run logged no training section after its metrics: it was interrupted" \
        in text
    clock[0] += 10
    log_metrics("custom", {"step": 1, "loss": 1.0})   # not a pipeline stage: no section expected
    train(clock, "sft", 3, dt=1.0, stop=2)
    get_report().log("Chat evaluation mid", {"stage": "mid", "ARC-Easy": 0.3, "seconds": 5.0})  # not training
    times = table(get_report().generate().read_text(), "| Stage |")
    assert "custom" in times and "sft (unfinished)" in times and "mid (unfinished)" in times


def test_a_stage_that_never_logged_a_section_is_named(clock):
    get_report().reset()
    train(clock, "base", 20, stop=7)
    text = get_report().generate().read_text()
    assert table(text, "| Stage |")["base (unfinished)"] == ["7", "0:00:14"]
    assert "(no run of the stage logged one)" in text


def test_rl_rewards_are_summarised_and_all_zero_named(clock):
    """A run whose reward was 0 at every step (advantages all 0: nothing learned) read like any other."""
    text = whole_pipeline(clock).generate().read_text()
    assert "- rl: the mean reward was 0 at every one of its 8 logged steps" in text
    train(clock, "rl", 4, dt=10.0, reward=lambda s: [0.0, 0.25, 0.5, 0.5][s])
    stage_section(clock, "Chat RL", "rl", 4, 40.0)
    text = get_report().generate().read_text()
    assert "- rl: mean reward per step: first 0.0, last 0.5, mean 0.3125 over 4 logged steps" in text
    assert "was 0 at every" not in text


def test_torn_metrics_lines_are_named(clock):
    """A torn or foreign metrics line was skipped silently: its rows were missing from the plots and
    time table with nothing in report.md to say so."""
    rep = whole_pipeline(clock)
    path = rep.dir / "metrics_sft.jsonl"
    with open(path, "a") as f:
        f.write('{"step": 13, "loss"\n[1, 2]\n\n')
    text = rep.generate().read_text()
    assert "- metrics_sft.jsonl: 2 line(s) that are not JSON objects (a torn write) skipped" in text
    assert "metrics_base.jsonl" not in text


def test_no_matplotlib_still_writes_the_report(clock, monkeypatch):
    """Without matplotlib `generate` died with ModuleNotFoundError after the whole pipeline: no
    report.md at all; now the report is written and says why it has no plots."""
    monkeypatch.setattr(report_mod, "make_plots", REAL_MAKE_PLOTS)
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    rep = whole_pipeline(clock)
    text = rep.generate().read_text()
    assert "## Summary" in text and "## Chat RL" in text and "](plots/" not in text
    assert "_No plots: matplotlib could not be imported" in text and "uv pip install matplotlib" in text


def test_report_md_is_replaced_atomically(clock, monkeypatch):
    """report.md goes through a temp file + os.replace: a crash mid-write keeps the previous one."""
    import os

    rep = whole_pipeline(clock)
    old = rep.generate().read_text()
    clock[0] += 1
    get_report().log("Chat evaluation sft", {"stage": "sft", "MMLU": 0.9})

    def crash(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        rep.generate()
    assert (rep.dir / "report.md").read_text() == old
    assert not [p for p in rep.dir.iterdir() if p.name.startswith(".report.md.tmp")]
    assert math.isclose(rep.summary()["MMLU"]["sft"], 0.9)
