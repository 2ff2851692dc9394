"""Review 3 of the report and log tools, as a user hits them: a retrained upstream stage leaves the
later stages' runs in the time table and plots as if current; a non-finite "seconds" kills
`generate`; compare_logs passes a run that stopped early; a wandb failure ends training;
compare_recipes' A/B runs become the pipeline's base stage in report.md."""

import importlib.machinery
import math
import sys
import types

import pytest

from nanochat import report as report_mod
from nanochat.errors import RequestError
from nanochat.report import get_report, log_metrics
from scripts import compare_logs
from test_report_audit import clock, stage_section, table, train, whole_pipeline  # noqa: F401  (fixtures)


def test_a_retrained_upstream_stage_marks_later_runs_stale(clock, monkeypatch):  # noqa: F811
    """base retrained after the whole pipeline (a config change), nothing after it yet: the summary
    said "(stale)" but the time table listed mid/SFT/RL and the evaluations as current runs, summed
    them with the new base run, and the plots drew their curves as the stages'."""
    rep = whole_pipeline(clock)
    clock[0] += 100
    train(clock, "base", 30)
    stage_section(clock, "Base model training", "base", 30, 60.0, config={"num_iterations": 30})
    drawn = {}
    monkeypatch.setattr(report_mod, "make_plots", lambda metrics, out_dir: drawn.update(metrics) or [])
    text = rep.generate().read_text()
    times = table(text, "| Stage |")
    # total: the new base run and the tokenizer's training (62.3 s; in the table since review 9)
    assert times["base"] == ["30", "0:01:02"] and times["total"] == ["", "0:02:04"]
    for label in ("mid (stale)", "sft (stale)", "rl (stale)", "Base model evaluation (stale)",
                  "Chat evaluation sft (stale)"):
        assert label in times
    assert "- not in the total: Base model evaluation (stale), mid (stale)" in text
    assert sorted(drawn) == ["base", "mid (stale)", "rl (stale)", "sft (stale)"]
    # the pipeline run again after it: nothing stale any more
    train(clock, "mid", 20, dt=3.0)
    stage_section(clock, "Midtraining", "mid", 20, 63.0)
    times = table(rep.generate().read_text(), "| Stage |")
    assert "mid" in times and "sft (stale)" in times and "Base model evaluation (stale)" in times


def test_a_non_finite_evaluation_time_is_not_logged_not_a_crash(clock):  # noqa: F811
    """_hms(nan) raised "cannot convert float NaN to integer": no report.md at all."""
    rep = whole_pipeline(clock)
    clock[0] += 1
    rep.log("Chat evaluation rl", {"stage": "rl", "GSM8K": 0.1, "seconds": math.nan})
    clock[0] += 1
    rep.log("Evaluation mid", {"stage": "mid", "val_bpb": 1.0, "seconds": math.inf})
    times = table(rep.generate().read_text(), "| Stage |")
    assert times["Chat evaluation rl"] == ["", "not logged"]


LOG = "".join(f"step {s:05d}/00020 | loss {9 - s / 10:.4f} | lrm 1.000 | mem   1.00GiB\n" for s in range(20)) + \
    "step 00010 | val bpb 2.5000 (min 2.5000)\nstep 00020 | val bpb 2.0000 (min 2.0000)\n"


def test_compare_logs_fails_on_steps_in_one_log_only(tmp_path, capsys):
    """A resumed run that died at step 14 passed the resume check: only the steps both logs have were
    compared ("PASS: 4 values compared")."""
    full, cut, empty = tmp_path / "full.log", tmp_path / "cut.log", tmp_path / "empty.log"
    full.write_text(LOG)
    cut.write_text("".join(ln + "\n" for ln in LOG.splitlines() if ln.startswith("step 0001") and "/" in ln
                           and int(ln[5:10]) < 15))
    empty.write_text("Traceback (most recent call last):\n")
    assert compare_logs.main([str(full), str(full), "--from-step", "11"]) == 0
    capsys.readouterr()
    assert compare_logs.main([str(full), str(cut), "--from-step", "11"]) == 1
    out = capsys.readouterr().out
    assert "loss: 5 step(s) only in A: 15, 16, 17, 18, 19" in out and "val_bpb: 1 step(s) only in A: 20" in out
    assert "FAIL: 4 values compared, 4 identical" in out and "stopped early?" in out
    assert compare_logs.main([str(full), str(empty)]) == 1
    assert f"{empty}: no step lines" in capsys.readouterr().out
    with pytest.raises(RequestError, match="--from-step: got -1"):
        compare_logs.parse_args([str(full), str(full), "--from-step", "-1"])


class FakeRun:
    def __init__(self, fail_log=False, fail_finish=False):
        self.logged, self.fail_log, self.fail_finish = [], fail_log, fail_finish

    def define_metric(self, name, **kw):   # the tracker plots every metric against the row's "step"
        pass

    def log(self, data, step=None):
        if self.fail_log:
            raise RuntimeError("wandb internal error")
        self.logged.append((data["step"], data))

    def finish(self):
        if self.fail_finish:
            raise OSError("disk full")


@pytest.fixture()
def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def test_a_wandb_failure_never_stops_training(fake_wandb, capsys):
    """A log / finish that raised hours in ended the training run; now a warning, and tracking off for
    the rest of it. wandb.init refused (online without an API key) is an error naming --wandb, at the start."""
    from nanochat.tracker import Tracker

    def refuse(**kw):
        raise OSError("api_key not configured (no-tty)")
    fake_wandb.init = refuse
    with pytest.raises(RuntimeError, match=r"--wandb online: wandb.init failed \(OSError: api_key not configured.*"
                                           r"--wandb off"):
        Tracker("online", run="r1")

    runs = [FakeRun(fail_log=True), FakeRun(fail_finish=True)]
    fake_wandb.init = lambda **kw: runs.pop(0)
    tracker = Tracker("offline", run="r2")
    tracker.log({"loss": 1.0}, 5)
    tracker.log({"loss": 1.0}, 6)   # off after the first failure: one warning
    err = capsys.readouterr().err
    assert err.count("WARNING") == 1 and "wandb log at step 5 failed" in err and not tracker.enabled
    tracker = Tracker("offline", run="r3")
    tracker.log({"loss": 2.0, "mfu": None}, 1)
    tracker.finish()
    assert "wandb finish failed: OSError: disk full" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--wandb: got 'Online'; accepted: off|offline|online"):
        Tracker("Online")


def test_compare_recipes_keeps_the_pipeline_report(tmp_path, monkeypatch):
    """Each A/B run of base_train logged its metrics and "Base model training" section into the
    pipeline's report: report.md then showed the last comparison run as the base stage."""
    from scripts import base_train, compare_recipes

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOCHAT_REPORT_DIR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(report_mod, "system_info", lambda: {"device": "cpu"})

    def fake_main(argv):   # what base_train writes to the report, without the training
        log_metrics("base", {"step": 0, "loss": 3.0, "elapsed_s": 1.0})
        get_report().log("Base model training", {"stage": "base", "final_step": 1, "final_val_bpb": 2.0})
        return {"final_val_bpb": 2.0 + len(argv) / 1000, "num_iterations": 1, "avg_tok_per_sec": 1.0}
    monkeypatch.setattr(base_train, "main", fake_main)
    flags = ["--device", "cpu", "--depth", "2", "--max-seq-len", "64", "--device-batch-size", "8",
             "--total-batch-size", "512", "--no-compile", "--num-iterations", "2"]
    compare_recipes.main(["--runs", "v1", "v2", "--", *flags])
    assert not (tmp_path / "report" / "metrics_base.jsonl").exists()
    assert not (tmp_path / "report" / "sections").exists()
    ab = tmp_path / "compare_recipes" / "report"
    assert len((ab / "metrics_base.jsonl").read_text().splitlines()) == 2   # cleared at the start, no header
    assert "NANOCHAT_REPORT_DIR" not in __import__("os").environ
    for argv, message in ((["--runs", "v1", "v1"], "--runs: got"), (["--seeds", "1", "1"], "--seeds: got")):
        with pytest.raises(RequestError, match=message):
            compare_recipes.parse_args(argv)
