"""Moving an earlier run (or a branch's later steps) to earlier_runs/: a rerun finishes a branch's
move cut short, a branch's move leaves a latest.json naming the step resumed from, and a disk short
of room names the checkpoints that --overwrite keeps (nanochat/checkpoint_runs.py, disk_plan)."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_runs as cr
from nanochat.checkpoint_io import write_json


def _save(d, step):
    ck.save_checkpoint(d, step, model_state={"w": torch.full((4,), float(step))}, meta={})


def _run(d, steps, latest):
    for step in steps:
        _save(d, step)
    write_json(d / "latest.json", {"step": latest, "dir": ck.step_dirname(latest)})


def _refuse_moving(monkeypatch, step):
    """os.replace refusing to move step `step`'s directory (a disk error mid-move)."""
    real = os.replace

    def replace(src, dst):
        if os.path.basename(src) == ck.step_dirname(step):
            raise OSError(errno.EIO, "Input/output error", str(src))
        return real(src, dst)
    monkeypatch.setattr(cr.os, "replace", replace)


def test_a_rerun_finishes_a_branch_move_cut_short(tmp_path, monkeypatch):
    """--resume latest (latest.json naming 2) over steps [2, 4, 6], the move failing after step 4: the
    rerun left earlier_runs/1.moving/step_4 for good and put step 6 in earlier_runs/2 (latest.json
    stays in a branch, so the leftover was never joined)."""
    d = tmp_path / "ck"
    _run(d, (2, 4, 6), latest=2)
    _refuse_moving(monkeypatch, 6)
    with pytest.raises(ck.CheckpointError, match="rerun the same command, which finishes the move$"):
        ck.branch_start(d, 2, "--resume latest").settle()
    monkeypatch.undo()
    assert ck.list_steps(d) == [2, 6] and ck.list_steps(d / "earlier_runs" / "1.moving") == [4]
    earlier = ck.branch_start(d, 2, "--resume latest")
    assert f"are moved to {d / 'earlier_runs' / '1'} at" in earlier.describe()
    assert earlier.settle() == d / "earlier_runs" / "1"
    assert sorted(p.name for p in (d / "earlier_runs").iterdir()) == ["1"]
    run = d / "earlier_runs" / "1"
    assert ck.list_steps(run) == [4, 6] and sorted(p.name for p in run.iterdir()) == ["step_000004", "step_000006"]
    assert ck.list_steps(d) == [2] and ck.read_latest(d) == 2


def test_a_rerun_finishes_a_branch_move_of_the_latest_cut_short(tmp_path, monkeypatch):
    """--resume 2 with latest.json naming 6: latest.json goes with the branch; cut short after step 4,
    the rerun of the same command joins the leftover."""
    d = tmp_path / "ck"
    _run(d, (2, 4, 6), latest=6)
    _refuse_moving(monkeypatch, 6)
    with pytest.raises(ck.CheckpointError, match="which finishes the move$"):
        ck.branch_start(d, 2, "--resume 2").settle()
    monkeypatch.undo()
    assert ck.branch_start(d, 2, "--resume 2").settle() == d / "earlier_runs" / "1"
    run = d / "earlier_runs" / "1"
    assert ck.list_steps(run) == [4, 6] and ck.read_latest(run) == 6
    assert ck.load_checkpoint(run)["model"]["w"][0].item() == 6.0


def test_a_leftover_is_not_joined_by_a_run_saved_since(tmp_path, monkeypatch):
    """A leftover branch move, then a run saved here since (its own latest.json naming a step past
    the branch point): its steps go to a new number, the leftover stays as it is."""
    d = tmp_path / "ck"
    _run(d, (2, 4, 6), latest=2)
    _refuse_moving(monkeypatch, 6)
    with pytest.raises(ck.CheckpointError):
        ck.branch_start(d, 2, "--resume latest").settle()
    monkeypatch.undo()
    _save(d, 6)   # a run resumed from 6, latest.json naming it: not the cut-short branch
    assert ck.read_latest(d) == 6
    assert ck.fresh_start(d, None, True).settle() == d / "earlier_runs" / "2"
    assert ck.list_steps(d / "earlier_runs" / "1.moving") == [4]


def test_a_branch_move_leaves_latest_naming_the_step_resumed_from(tmp_path):
    """--resume 2 with latest.json naming 4: the move took latest.json, and a first save that then
    failed (no room) left the tag with no latest.json: --resume latest failed, --resume auto started
    afresh. It now names step 2, which is there."""
    d = tmp_path / "ck"
    _run(d, (2, 4), latest=4)
    ck.branch_start(d, 2, "--resume 2").settle()
    assert ck.read_latest(d) == 2 and ck.list_steps(d) == [2]
    assert ck.resolve_resume("auto", d, log=lambda s: None) == "latest"
    assert ck.read_latest(d / "earlier_runs" / "1") == 4
    assert not list(d.glob(".latest.json.tmp-*"))


def test_a_branch_latest_that_cannot_be_written_puts_the_old_one_back(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    _run(d, (2, 4), latest=4)

    def full(path, obj):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(cr, "write_json", full)
    with pytest.raises(ck.CheckpointError, match="No space left on device.*which finishes the move$"):
        ck.branch_start(d, 2, "--resume 2").settle()
    monkeypatch.undo()
    assert ck.read_latest(d) == 4 and ck.list_steps(d) == [2, 4]   # as before: nothing moved
    assert ck.branch_start(d, 2, "--resume 2").settle() == d / "earlier_runs" / "1"
    assert ck.read_latest(d) == 2 and ck.read_latest(d / "earlier_runs" / "1") == 4


def test_a_full_disk_names_the_checkpoints_an_overwrite_keeps(tmp_path, monkeypatch):
    """The first --overwrite on a full disk: earlier_runs/ does not exist yet, so the message named
    nothing to delete, though the earlier run's steps stay on the disk (moved and kept)."""
    d = tmp_path / "ck"
    _run(d, (1, 2), latest=2)
    earlier = ck.fresh_start(d, None, True)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    aside = re.escape(str(d / "earlier_runs" / "1"))
    with pytest.raises(ck.CheckpointError, match=rf"or set NANOCHAT_BASE_DIR to a disk with room; --overwrite frees "
                                                 rf"none of it: the earlier run's checkpoints \(steps \[1, 2\], \d+ "
                                                 rf"\w+\) in {re.escape(str(d))} stay on this disk, moved to {aside} "
                                                 r"and kept \(delete the ones you no longer need\)$"):
        ck.disk_plan(d, 10, 1, earlier=earlier)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 3 * ck._needed(10) // 2)   # room for 1 of 3
    assert re.search(rf"room for 1: .*; --overwrite frees none of it: .* moved to {aside}",
                     ck.disk_plan(d, 10, 3, earlier=earlier))
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    branch = ck.branch_start(d, 1, "--resume 1")
    with pytest.raises(ck.CheckpointError, match=r"--resume 1 frees none of it: the checkpoints after step 1 in "):
        ck.disk_plan(d, 10, 1, earlier=branch)
    earlier.settle()
    with pytest.raises(ck.CheckpointError) as e:   # moved: earlier_runs/ is named instead
        ck.disk_plan(d, 10, 1, earlier=earlier)
    assert "frees none" not in str(e.value) and "of earlier runs' checkpoints" in str(e.value)


def test_base_train_passes_the_earlier_run_to_the_disk_plan(env, base_dir, monkeypatch):
    """The recipe's call site: --overwrite over a run, on a disk short of room, names its steps."""
    from scripts import base_train
    d = ck.checkpoint_dir("base", "full", base_dir)
    _run(d, (1,), latest=1)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    args = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
            "--device-batch-size", "4", "--total-batch-size", "512", "--sample-every", "-1", "--eval-every", "-1",
            "--no-compile", "--num-iterations", "2", "--model-tag", "full", "--overwrite"]
    with pytest.raises(ck.CheckpointError, match=r"--overwrite frees none of it: the earlier run's checkpoints "
                                                 r"\(steps \[1\]"):
        base_train.main(args + env)


class _Killed(BaseException):
    """A kill at that instant: nothing after it runs, no `except OSError` sees it."""


def test_a_branch_kill_between_moving_and_rewriting_latest_leaves_a_latest(tmp_path, monkeypatch):
    """latest.json (naming 4) was moved into the move first and a new one naming the resumed step 2
    written after: a kill between the two left the tag with none, so --resume latest was refused and
    --resume auto (a setup.sh rerun) started the stage afresh. The rerun of the same command joins."""
    d = tmp_path / "ck"
    _run(d, (2, 4), latest=4)

    def killed(path, obj):
        raise _Killed
    monkeypatch.setattr(cr, "write_json", killed)
    with pytest.raises(_Killed):
        ck.branch_start(d, 2, "--resume 2").settle()
    monkeypatch.undo()
    assert ck.read_latest(d) == 4 and ck.list_steps(d) == [2, 4]   # untouched: a latest.json at every instant
    assert cr.resolve_resume("auto", d, log=lambda _: None) == "latest"
    assert ck.branch_start(d, 2, "--resume 2").settle() == d / "earlier_runs" / "1"
    assert sorted(p.name for p in (d / "earlier_runs").iterdir()) == ["1"]
    assert ck.list_steps(d / "earlier_runs" / "1") == [4] and ck.read_latest(d / "earlier_runs" / "1") == 4
    assert ck.list_steps(d) == [2] and ck.read_latest(d) == 2


def test_a_move_killed_before_its_final_rename_gets_its_name_at_the_next_start(tmp_path, monkeypatch):
    """Every step went into earlier_runs/1.moving, then a kill before it was renamed to 1: a rerun has
    no later step (branch) or no earlier run (fresh start) to move, so nothing ever renamed it and the
    folder the banner named never appeared."""
    real = os.replace

    def killed_at_the_end(src, dst):
        if str(src).endswith(".moving"):
            raise _Killed
        return real(src, dst)
    for start in ("branch", "fresh"):
        d = tmp_path / start
        _run(d, (2, 4, 6), latest=6)
        monkeypatch.setattr(cr.os, "replace", killed_at_the_end)
        with pytest.raises(_Killed):
            (ck.branch_start(d, 2, "--resume 2") if start == "branch" else
             ck.fresh_start(d, None, overwrite=True)).settle()
        monkeypatch.undo()
        moving, final = d / "earlier_runs" / "1.moving", d / "earlier_runs" / "1"
        assert ck.list_steps(moving) == ([4, 6] if start == "branch" else [2, 4, 6]) and not final.exists()
        again = ck.branch_start(d, 2, "--resume 2") if start == "branch" else ck.fresh_start(d, None, overwrite=True)
        assert again is None
        assert not moving.exists() and ck.list_steps(final) == ([4, 6] if start == "branch" else [2, 4, 6])
        assert not (final / cr.MOVE_RECORD).exists()


def test_chat_rl_names_a_changed_data_dir_on_resume():
    """chat_rl's refusal compares only the training file --data-dir gives: a new --data-dir that
    changes only the test file scored was accepted without a word (it was among the fields said)."""
    from nanochat.resume_checks import say_config_changes
    from scripts.chat_rl import SAID_ON_RESUME

    lines = say_config_changes({"data_dir": "/data/a", "seed": 1}, {"data_dir": "/data/b", "seed": 1},
                               said=SAID_ON_RESUME)
    assert any("--data-dir /data/a -> /data/b" in line for line in lines), lines
