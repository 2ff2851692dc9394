"""Review 75 of checkpoints and resume: a re-save of a step killed between its two renames leaves the
step only as its old copy (step_N.old-PID), which a load renames back. setup.sh's resume check
(nanochat.resume_point) and model_digest judged the absent step_N instead: the latest step "gone",
so the stage resumed an earlier step or started afresh (--overwrite), and the old copy, a whole
checkpoint of the latest step, was deleted at a later save. Crashes are simulated by raising a
BaseException (no cleanup runs, as under SIGKILL) at the second rename of the re-save. And a re-save
deleted its old copy before the swap's directory fsync, which may fail (EIO) with the renames not on disk."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat.checkpoint_io import model_digest
from nanochat.resume_point import ResumePoint, resume_point


class Killed(BaseException):
    """A SIGKILL stand-in: neither the save's error handling nor its cleanup runs."""


def _save(ckpt: Path, step: int, weight: float = 0.0, source: dict | None = None) -> Path:
    return ck.save_checkpoint(ckpt, step, model_state={"w": torch.full((4,), weight + step)},
                              optimizer_state={"state": {}, "param_groups": [{"lr": 0.1}]},
                              loader_state={"pos": step}, loop_state={"step": step}, meta={"source": source})


def _resave_killed_between_renames(ckpt: Path, step: int, monkeypatch) -> Path:
    """Save `step` again, killed after the old copy moved aside and before the new one moved in.
    Returns the old copy left behind."""
    real = os.replace

    def replace(src, dst):
        src, dst = Path(src), Path(dst)
        if src.name == f"step_{step:06d}.partial" and dst.name == f"step_{step:06d}" and \
                any(ckpt.glob(f"step_{step:06d}.old-*")):
            raise Killed(f"killed between {src.name} and {dst.name}")
        return real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", replace)
        with pytest.raises(Killed):
            _save(ckpt, step, weight=100.0)
    assert not (ckpt / f"step_{step:06d}").exists()
    (old,) = ckpt.glob(f"step_{step:06d}.old-*")
    return old


@pytest.fixture
def base(tmp_path) -> Path:
    ckpt = ck.checkpoint_dir("base", "d2", tmp_path)
    for step in (20, 40):
        _save(ckpt, step)
    return ckpt


def test_a_resave_killed_between_its_renames_keeps_the_latest_step(base, monkeypatch):
    """The stage's --resume auto restores step 40 and continues it; the check said "resume 20"."""
    _resave_killed_between_renames(base, 40, monkeypatch)
    assert resume_point(base) == ResumePoint("keep")
    out = ck.load_checkpoint(base, "latest", load_optimizer=True)   # what --resume auto then reads
    assert out["step"] == 40 and out["model"]["w"].tolist() == [40.0] * 4


def test_the_only_step_left_as_its_old_copy_is_kept_not_started_afresh(tmp_path, monkeypatch):
    """--keep-last 1 (or a first run's only save): the check said "fresh", setup.sh passed --overwrite,
    and the run's only checkpoint was retrained from step 0 (its old copy never moved aside)."""
    ckpt = ck.checkpoint_dir("base", "d2", tmp_path)
    _save(ckpt, 40)
    _resave_killed_between_renames(ckpt, 40, monkeypatch)
    assert resume_point(ckpt) == ResumePoint("keep")


def test_a_damaged_old_copy_is_judged_as_the_step(base, monkeypatch):
    old = _resave_killed_between_renames(base, 40, monkeypatch)
    (old / "model.pt").unlink()
    assert resume_point(base) == ResumePoint("resume", 20, "step 40", "model.pt is gone")


def test_model_digest_reads_the_old_copy_a_load_restores(base, tmp_path, monkeypatch):
    """A mid run started from base step 40; base's re-save of 40 was killed between its renames. The
    mid check compared its recorded sha256 with None (no step_000040) and started mid afresh, though
    base's load restores the very weights mid started from."""
    recorded = model_digest(base, 40)
    mid = ck.checkpoint_dir("mid", "d2", tmp_path)
    source = {"phase": "base", "model_tag": "d2", "step": 40, "model_sha256": recorded}
    _save(mid, 10, source=source)
    _save(mid, 20, source=source)
    (mid / "step_000020" / "model.pt").unlink()
    _resave_killed_between_renames(base, 40, monkeypatch)
    assert model_digest(base, 40) == recorded
    assert resume_point(mid, base) == ResumePoint("resume", 10, "step 20", "model.pt is gone")


def test_a_resave_deletes_the_old_copy_only_once_the_swap_is_on_disk(base, monkeypatch):
    """A directory fsync failing with EIO means the renames may not be on disk (checkpoint_io.fsync_dir
    raises it): the re-save's old copy was already deleted by then, while the error said the step
    was intact. The old copy now stays until the swap is synced (the next save sweeps it)."""
    real = ck.fsync_dir
    staging = base / "step_000040.partial"

    def fsync_dir(path):
        if Path(path) == base and not staging.exists():   # after the swap
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real(path)

    monkeypatch.setattr(ck, "fsync_dir", fsync_dir)
    with pytest.raises(ck.CheckpointError, match="step 40.*refused the write"):
        _save(base, 40, weight=100.0)
    monkeypatch.undo()
    (old,) = base.glob("step_000040.old-*")
    assert torch.load(old / "model.pt", weights_only=True)["w"].tolist() == [40.0] * 4
    _save(base, 60)   # the next save sweeps the superseded copy
    assert not list(base.glob("step_000040.old-*"))
    assert ck.load_checkpoint(base, 40)["model"]["w"].tolist() == [140.0] * 4
