"""Review 75b of checkpoints: a re-save of step N killed between its two renames leaves step N only
as its old copy (step_N.old-PID), which a read of N renames back. branch_start (an explicit --resume M,
M < N) and fresh_start (--overwrite, --resume auto starting afresh, or a fresh run refused) looked
only at complete step_N directories: that copy was no step of the abandoned run, so it was not moved
to earlier_runs/<N>/ with it (or was moved under its .old- name, left out of the banner's steps and
size), a fresh run without --overwrite was not refused, and the new run's own save of step N, then
the next save's sweep of superseded copies, deleted it without a word. Crashes are simulated by
raising a BaseException (no cleanup runs, as under SIGKILL) at the re-save's second rename."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nanochat import checkpoint as ck
from nanochat.checkpoint_runs import EARLIER_RUNS, finish_cut_short_moves, resolve_resume, steps_bytes
from test_ckpt_review75 import Killed, _resave_killed_between_renames, _save


def _weights(ckpt_dir: Path, step) -> list[float]:
    return ck.load_checkpoint(ckpt_dir, step)["model"]["w"].tolist()


def _run(tmp_path, steps, swapped: int, monkeypatch) -> Path:
    ckpt = ck.checkpoint_dir("base", "d2", tmp_path)
    for step in steps:
        _save(ckpt, step)
    _resave_killed_between_renames(ckpt, swapped, monkeypatch)
    return ckpt


def test_a_resume_of_an_older_step_moves_the_swapped_out_later_step(tmp_path, monkeypatch):
    """--resume 20 with step 40 only as its old copy: nothing was moved, and the new run's saves of 40
    and 60 deleted the earlier run's step 40."""
    ckpt = _run(tmp_path, (20, 40), 40, monkeypatch)
    earlier = ck.branch_start(ckpt, 20, "--resume 20")
    assert earlier is not None and earlier.steps == [40]
    assert "(steps [40], " in earlier.describe() and "(steps [40], 0 B" not in earlier.describe()
    moved = earlier.settle()
    assert moved == ckpt / EARLIER_RUNS / "1" and (moved / "step_000040").is_dir()
    assert not list(ckpt.glob("step_*.old-*")) and not list(moved.glob("step_*.old-*"))
    assert ck.read_latest(ckpt) == 20   # the tag resumes where this run started
    _save(ckpt, 40, weight=200.0)   # the new run's saves: a fresh step 40, then the sweep of the next one
    _save(ckpt, 60, weight=200.0)
    assert _weights(moved, "latest") == [40.0] * 4   # the earlier run's step 40, kept
    assert _weights(ckpt, 40) == [240.0] * 4


def test_a_swapped_out_step_is_in_the_banners_steps_and_size(tmp_path, monkeypatch):
    """With another later step (60) the old copy went along as step_000040.old-PID, but the banner
    said steps [60] and counted only its bytes; now it moves as step_000040, restorable there."""
    ckpt = _run(tmp_path, (20, 40, 60), 40, monkeypatch)
    earlier = ck.branch_start(ckpt, 20, "--resume 20")
    assert earlier is not None and earlier.steps == [40, 60]
    assert steps_bytes(ckpt, [40]) > 0   # the copy a read of step 40 takes
    moved = earlier.settle()
    assert sorted(p.name for p in moved.iterdir() if p.name.startswith("step_")) == ["step_000040", "step_000060"]
    assert _weights(moved, 40) == [40.0] * 4


@pytest.mark.parametrize("steps", [(40,), (20, 40)])
def test_a_fresh_run_is_refused_over_a_swapped_out_step(tmp_path, monkeypatch, steps):
    """Without --overwrite a fresh run into the tag is refused naming every step (the only step as its
    old copy, e.g. --keep-last 1: it started, and its own save of step 40 deleted the earlier run's)."""
    ckpt = _run(tmp_path, steps, 40, monkeypatch)
    with pytest.raises(ck.CheckpointError, match=rf"steps \[{', '.join(map(str, steps))}\]"):
        ck.fresh_start(ckpt, None, False)


def test_overwrite_moves_a_swapped_out_step_with_the_earlier_run(tmp_path, monkeypatch):
    ckpt = _run(tmp_path, (20, 40), 40, monkeypatch)
    earlier = ck.fresh_start(ckpt, None, True)
    assert earlier is not None and earlier.steps == [20, 40]
    moved = earlier.settle()
    assert ck.list_steps(ckpt) == [] and not list(ckpt.glob("step_*.old-*")) and not (ckpt / "latest.json").exists()
    for step in (20, 40, 60):
        _save(ckpt, step, weight=300.0)
    assert _weights(moved, "latest") == [40.0] * 4 and _weights(moved, 20) == [20.0] * 4


def test_resume_auto_names_a_swapped_out_step(tmp_path, monkeypatch):
    """No latest.json (an --overwrite cut short): --resume auto starts fresh, naming every step it moves."""
    ckpt = _run(tmp_path, (20, 40), 40, monkeypatch)
    (ckpt / "latest.json").unlink()
    said: list[str] = []
    assert resolve_resume("auto", ckpt, log=said.append) is None
    assert "steps [20, 40]" in said[0]
    assert ck.fresh_start(ckpt, "auto", False).steps == [20, 40]


def test_a_move_cut_short_after_the_swapped_out_step_went_in_is_finished(tmp_path, monkeypatch):
    """Killed before earlier_runs/1.moving became 1: the old copy is in it as step_000040, so the
    record's steps are complete and the next start names the folder."""
    ckpt = _run(tmp_path, (20, 40), 40, monkeypatch)
    earlier = ck.branch_start(ckpt, 20, "--resume 20")
    real = os.replace

    def replace(src, dst):
        if Path(src).name == "1.moving":
            raise Killed("killed before the move's final rename")
        return real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        with pytest.raises(Killed):
            earlier.settle()
    assert finish_cut_short_moves(ckpt) == [ckpt / EARLIER_RUNS / "1"]
    assert _weights(ckpt / EARLIER_RUNS / "1", 40) == [40.0] * 4


def test_a_branch_from_a_swapped_out_step_leaves_latest_naming_it(tmp_path, monkeypatch):
    """The step resumed from held only as its old copy when the later steps move (no read restored it
    yet): latest.json went with them and the tag had none (--resume auto: a fresh start); it now names
    the step, which a read restores."""
    ckpt = _run(tmp_path, (20, 40, 60), 20, monkeypatch)
    ck.branch_start(ckpt, 20, "--resume 20").settle()
    assert ck.read_latest(ckpt) == 20 and _weights(ckpt, "latest") == [20.0] * 4
