"""Review 6 of the analysis scripts (compare_logs, compare_recipes, analyze_bandwidth,
profile_training): a NaN-guard stop, repeated steps and a truncated line in real base_train logs;
profile_training's --trace in a new directory and --attn-backend flex on a CPU; compare_recipes'
--tag-prefix error; the roofline table's units and its predicted column adding up.

The log lines below are copied from real depth-2 CPU runs of scripts.base_train (a 12-step run, the
same run resumed from its step-6 checkpoint, and one whose loss went NaN at step 5), whose stderr
went to the log as well: a real run takes a minute, too long for this file."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest

from nanochat.errors import RequestError
from scripts import compare_logs

_TAIL = "| lrm 1.000 | dt   1911.5ms | tok/s         268 | mfu   n/a | util(fp32)   n/a | mem   1.32GiB | eta      -"
RUN = [
    "step 00000 | val bpb 3.1749 (min 3.1749)",
    *(f"step {s:05d}/00012 | loss {v} {_TAIL}" for s, v in
      enumerate(["10.3970", "10.3967", "10.3962", "10.3945", "10.3914"])),
    "step 00005 | val bpb 3.1696 (min 3.1696)",
]
STOP = ("base_train: error: non-finite loss (nan) at step 5; last good checkpoint: /tmp/r6a/checkpoints/base/nan2/"
        "step_000003 (resume from it with --resume 3); hint: lower the learning rates (e.g. --matrix-lr)")
REST = [f"step {s:05d}/00012 | loss {v} {_TAIL}" for s, v in
        zip(range(5, 12), ["10.3890", "10.3860", "10.3818", "10.3775", "10.3727", "10.3716", "10.3689"])]
FULL = RUN + REST[:5] + ["step 00010 | val bpb 3.1620 (min 3.1620)"] + REST[5:] + \
    ["step 00012 | val bpb 3.1607 (min 3.1607)", "step 00012 | saved checkpoint /tmp/r6a/checkpoints/base/d2/step_000012"]


def _log(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


# ------------------------------------------------------------------ compare_logs

def test_runs_the_nan_guard_stopped_never_pass(tmp_path, capsys):
    """Two runs that both stopped on a NaN loss at step 5 passed ("PASS: 7 values compared"): the
    stop line was not read, so the diverged runs agreed on the steps before it."""
    nan = _log(tmp_path, "nan.log", RUN + [STOP])
    assert compare_logs.main([nan, nan]) == 1
    out = capsys.readouterr().out
    assert "stopped on non-finite loss (nan) at step 5" in out and "FAIL" in out
    assert "A and B stopped on a non-finite value" in out
    # the same stop, then a resumed run appended to the log: the stop was an earlier attempt's
    resumed = _log(tmp_path, "resumed.log", RUN + [STOP] + REST[:5] + [FULL[-5]] + REST[5:] + FULL[-2:])
    assert compare_logs.parse_log(tmp_path / "resumed.log")["stopped"] is None
    assert compare_logs.main([_log(tmp_path, "full.log", FULL), resumed]) == 0
    # stdout's buffered step lines written after stderr's stop line (no PYTHONUNBUFFERED, one log file):
    # still this run's stop, not a resumed attempt's
    late = _log(tmp_path, "late.log", RUN[:-2] + [STOP] + RUN[-2:])
    assert compare_logs.parse_log(tmp_path / "late.log")["stopped"] is not None


def test_steps_logged_twice_are_named(tmp_path, capsys):
    """A run resumed from step 6 and appended to its own log repeats steps 6..11: the last line of
    each was kept without a word, so a first attempt's different values vanished unseen."""
    first = [ln.replace("10.3818", "10.9999") for ln in FULL[:10]]    # the first attempt, to step 7
    appended = _log(tmp_path, "appended.log", first + FULL[8:])     # resumed at step 6
    full = _log(tmp_path, "full.log", FULL)
    assert compare_logs.main([full, appended]) == 0                  # the resumed values are compared
    out = capsys.readouterr().out
    assert "appended.log: 2 loss step(s) logged more than once (6, 7; a resumed run appended" in out
    assert compare_logs.parse_log(tmp_path / "appended.log")["loss"][7] == 10.3818


def test_a_val_line_cut_inside_its_number_is_not_a_value(tmp_path, capsys):
    """A log truncated mid-line ("val bpb 3.1") read the cut number as the run's bpb: here a diff of
    0.06 reported against a value the run never printed."""
    cut = _log(tmp_path, "cut.log", FULL[:-2] + ["step 00012 | val bpb 3.1"])
    assert 12 not in compare_logs.parse_log(tmp_path / "cut.log")["val_bpb"]
    assert compare_logs.main([_log(tmp_path, "full.log", FULL), cut]) == 1
    assert "val_bpb: 1 step(s) only in A: 12" in capsys.readouterr().out


def test_missing_and_empty_logs(tmp_path, capsys):
    full = _log(tmp_path, "full.log", FULL)
    with pytest.raises(RequestError, match="log: got .*nope.log'; accepted: an existing log file"):
        compare_logs.parse_args([full, str(tmp_path / "nope.log")])
    assert compare_logs.main([full, _log(tmp_path, "empty.log", [""])]) == 1
    assert "empty.log: no step lines" in capsys.readouterr().out


# ------------------------------------------------------------------ compare_recipes

def test_tag_prefix_errors_name_tag_prefix():
    """A bad --tag-prefix was reported as '--model-tag: got ../x_0', a flag compare_recipes refuses."""
    from scripts import compare_recipes

    with pytest.raises(RequestError, match=r"--tag-prefix: got '\.\./x'"):
        compare_recipes.parse_args(["--tag-prefix", "../x"])


# ------------------------------------------------------------------ profile_training

SMOKE = ["--device", "cpu", "--depth", "1", "--device-batch-size", "1", "--seq", "16", "--vocab", "64",
         "--no-compile", "--steps", "1", "--warmup", "0", "--profile-steps", "1", "--top", "2"]


def test_trace_in_a_new_directory_is_written(tmp_path, monkeypatch, capsys):
    """parse_args accepts a --trace whose directories do not exist yet, but nothing created them: the
    profiler logged an error, and the run ended with exit 0 and no trace."""
    from scripts import profile_training

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    trace = tmp_path / "new" / "dir" / "trace.json"
    assert profile_training.main(SMOKE + ["--trace", str(trace)]) == 0
    assert json.loads(trace.read_text())["traceEvents"]


def test_flex_attention_on_a_cpu_is_refused_by_flag(tmp_path, monkeypatch):
    """flex has no backward on a CPU: base_train refuses it by flag, profile_training built the model
    and died at the first step with a RuntimeError traceback."""
    from scripts import profile_training

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(RequestError, match="--attn-backend flex has no backward on CPU; accepted for CPU"):
        profile_training.main(SMOKE + ["--attn-backend", "flex"])


# ------------------------------------------------------------------ analyze_bandwidth

def test_roofline_table_units_and_predicted_column_add_up(monkeypatch, capsys):
    """The table's predicted column left the residual glue blank although the predicted step counts it
    (scaled by the bandwidth ratio): the column did not add up to the step it predicted. The
    intensity column said "AI" with no unit, and the step time did not say it was measured."""
    import nanochat.common
    from nanochat.platform import DEVICE_TABLE
    from scripts import analyze_bandwidth as A

    h100 = DEVICE_TABLE["h100-sxm"]
    monkeypatch.setattr(nanochat.common, "init_runtime", lambda *a: NS(device=NS(type="cuda")))
    monkeypatch.setattr(A, "detect_device", lambda device: h100)
    monkeypatch.setattr(A, "measure_ops", lambda *a: {"attn_proj_gemms": 2.0, "mlp_gemms": 3.0,
                                                     "attention": 1.5, "lm_head_loss": 4.0})
    monkeypatch.setattr(A, "measure_step", lambda *a: (20.0, 5.0))
    A.main(["--depth", "2", "--seq", "16", "--device-batch-size", "2", "--vocab", "64", "--predict", "gb10"])
    out = capsys.readouterr().out
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    residual, summary = rows[-2], rows[-1]
    assert residual["predicted_bandwidth_scaled_ms"] == round(4.5 * 3350 / 273, 3)   # GB10's 273 GB/s
    assert residual["label"].startswith("PREDICTION, not a measurement")
    table = out.split("\n\n", 1)[1].splitlines()
    assert "FLOP/B" in table[0] and "pred ms" in table[0]
    preds = [float(ln.split()[-1]) for ln in table[1:7]]
    assert sum(preds) == pytest.approx(summary["predicted_step_ms"], abs=0.05)
    assert "measured step 20.0 ms" in out
    assert "predicted step on gb10: " in out and "PREDICTION, not a measurement" in out.splitlines()[-1]
