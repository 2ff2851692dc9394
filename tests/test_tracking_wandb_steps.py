"""wandb's x-axis across a stop and a resume (nanochat/tracker.py). A run stopped after its last
checkpoint (step N) had logged steps up to M; its resume trains N+1..M again. Logged with wandb's own
step (`run.log(data, step=step)`), those rows vanished: wandb keeps only rows whose step is at least
the run's current one, and a resumed online run starts at the last step it logged + 1 (wandb 0.31.0
printed "Tried to log to step 6 that is less than the current step 10 ... this data will be ignored"
four times and uploaded steps 10..13 alone). The training step is now a metric of every row, the x-axis
of every chart (define_metric), and wandb numbers its rows itself. A fake wandb with wandb's step rule
shows the loss; the real wandb, offline, shows what the run files hold. Each test failed before."""

from __future__ import annotations

import importlib.machinery
import json
import struct
import sys
import types
from pathlib import Path

import pytest

from nanochat.tracker import STEP_METRIC, Tracker, WandbInitError


class SteppedWandb:
    """wandb's step rule, online: rows keyed by the run's step; log(step=s) below the current step is
    dropped with a warning, step=None takes the next one; a resumed run starts after the last row the
    server holds for its id. Records define_metric calls."""

    def __init__(self):
        self.server: dict[str, list[dict]] = {}   # run id -> its rows ({"_step": ..., **data})
        self.warnings: list[str] = []
        self.metrics: list[tuple] = []

    def module(self):
        mod = types.ModuleType("wandb")
        mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        mod.init = self.init
        return mod

    def init(self, **kw):
        fake, run_id = self, kw.get("id") or f"run-{len(self.server)}"
        rows = self.server.setdefault(run_id, [])
        assert kw.get("resume") == "allow" or not rows

        class Run:
            id, name, step = run_id, kw.get("name"), (rows[-1]["_step"] + 1) if rows else 0

            def define_metric(self, name, step_metric=None):
                fake.metrics.append((run_id, name, step_metric))

            def log(self, data, step=None):
                if step is not None and step < self.step:
                    fake.warnings.append(f"Tried to log to step {step} that is less than the current step {self.step}")
                    return
                at = self.step if step is None else step
                if rows and rows[-1]["_step"] == at:   # the same step: one row
                    rows[-1].update(data)
                else:
                    rows.append({"_step": at, **data})
                self.step = at + 1 if step is None else at

            def finish(self):
                pass
        return Run()


def _stop_and_resume(make) -> str:
    """Steps 0..9 logged (an eval at the checkpoint, step 5), a stop; the resume from the checkpoint
    logs steps 6..13. Returns the run id."""
    first = make(None)
    for step in range(10):
        first.log({"train/loss": float(step), "train/mfu": None}, step)
        if step == 5:
            first.log({"val/bpb": 5.0}, step)
            saved = {"tracker": first.state_dict()}
    first.finish()
    resumed = make(saved)
    assert resumed.describe().endswith("continuing the checkpoint's run")
    for step in range(6, 14):
        resumed.log({"train/loss": 100.0 + step}, step)
    resumed.finish()
    return saved["tracker"]["id"]


def test_a_resume_keeps_the_steps_logged_again(monkeypatch, capsys):
    """The resume's steps 6..9 were dropped (wandb's step had reached 10): only 10..13 reached the
    chart. Every row now carries its training step, the charts' x-axis, and none is dropped."""
    fake = SteppedWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake.module())
    run_id = _stop_and_resume(lambda saved: Tracker("online", run="r", resume_state=saved))
    rows = fake.server[run_id]
    assert fake.warnings == []
    assert [(r[STEP_METRIC], r["train/loss"]) for r in rows if "train/loss" in r] == \
        [(s, float(s)) for s in range(10)] + [(s, 100.0 + s) for s in range(6, 14)]
    assert [r[STEP_METRIC] for r in rows if "val/bpb" in r] == [5] and not any("train/mfu" in r for r in rows)
    assert fake.metrics == [(run_id, STEP_METRIC, None), (run_id, "*", STEP_METRIC)] * 2   # both segments
    assert "continuing the checkpoint's wandb run" in capsys.readouterr().out


def test_an_x_axis_wandb_refuses_is_an_init_error(monkeypatch):
    """define_metric refused is said at the start, naming --wandb and what failed, and the run that
    wandb.init opened is finished as failed (it was left running: an empty run online)."""
    fake = SteppedWandb()
    mod = fake.module()
    real_init = mod.init
    finished = []

    def init(**kw):
        run = real_init(**kw)
        run.define_metric = lambda *a, **k: (_ for _ in ()).throw(ValueError("bad metric"))
        run.finish = lambda exit_code=None: finished.append(exit_code)
        return run
    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    with pytest.raises(WandbInitError, match=r"--wandb offline: wandb.define_metric failed \(ValueError: bad metric\)"):
        Tracker("offline", run="r")
    assert finished == [1]


# ------------------------------------------------------------------ the real wandb, offline

def _records(path: Path):
    """The records of a .wandb file: a 7-byte header, then 32 KiB blocks of chunks (crc32 4 bytes,
    length 2, type 1: 1 whole, 2 first, 3 middle, 4 last), as wandb writes its transaction log."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:   # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:                 # zeros: the rest of the block is padding
            pos += block - pos % block
            continue
        parts, pos = (b"" if kind in (1, 2) else parts) + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _history(path: Path) -> tuple[list[dict], list[tuple]]:
    """A segment's rows ({key: value}) and its define_metric records (name or glob, step metric)."""
    rows, metrics = [], []
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind == "metric":
            metrics.append((record.metric.name or record.metric.glob_name, record.metric.step_metric))
    return rows, metrics


def test_real_wandb_offline_rows_carry_the_training_step(tmp_path, monkeypatch):
    """The real wandb, offline: each segment is its own run directory; the resumed one's rows were
    numbered by wandb's step alone (`wandb sync` renumbers them on from the run's last row, 10..17
    for training steps 6..13 here), with no training step to plot against. Now every row of both
    segments holds its training step and each segment defines it as the x-axis."""
    pytest.importorskip("wandb")
    pytest.importorskip("wandb.proto.wandb_internal_pb2")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    run_id = _stop_and_resume(lambda saved: Tracker("offline", run="steps", project="p", directory=str(tmp_path),
                                                    resume_state=saved))
    segments = sorted((tmp_path / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(segments) == 2, segments
    logged = []
    for segment in segments:
        rows, metrics = _history(segment)
        assert metrics[:2] == [(STEP_METRIC, ""), ("*", STEP_METRIC)], metrics
        assert all(STEP_METRIC in row for row in rows), rows
        logged += [(row[STEP_METRIC], row["train/loss"]) for row in rows if "train/loss" in row]
    assert sorted(logged) == sorted([(s, float(s)) for s in range(10)] + [(s, 100.0 + s) for s in range(6, 14)])
