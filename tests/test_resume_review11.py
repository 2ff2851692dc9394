"""Review 11 of base_train as a user who must never lose a run: a stop names the whole command that
resumes (the user's own command may hold --overwrite, which a resume refuses), and so does an
out-of-memory stop (at the lower --device-batch-size); --overwrite moves the earlier run to
earlier_runs/<N>/ and keeps it (deleted, a Ctrl-C of the new run, whose stop saves, cost it); a
resume names each flag that differs from the checkpoint's run (a new --eval-tokens was taken without
a word); a change of the model's shape is refused from meta.json, naming the flag, before the
weights load."""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat.loop import CPU_OUT_OF_MEMORY, StopRequested

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "4", "--total-batch-size", "512", "--window-pattern", "SL",   # 2 micro-batches
        "--sample-every", "-1", "--eval-every", "-1", "--eval-tokens", "256", "--no-compile"]


def _train(args):
    from scripts import base_train
    return base_train.main(args)


def _files(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _trainer_that(monkeypatch, at_step: int, act):
    """base_train's Trainer, calling act() when it starts step `at_step`."""
    from scripts import base_train

    class Trainer(base_train.Trainer):
        def step(self, step):
            if step == at_step:
                act()
            return super().step(step)
    monkeypatch.setattr(base_train, "Trainer", Trainer)


def test_ctrl_c_of_an_overwrite_run_names_the_resume_command_and_keeps_the_earlier_run(
        env, base_dir, monkeypatch, capsys):
    """The run being replaced survives the new run's Ctrl-C (its stop saves: a save deleted the earlier
    run), and the stop prints the command that resumes: the user's flags, no --overwrite, the model tag
    resolved (d2, the tag these flags give: on the resume, no flag reads as changed)."""
    args = TINY + env + ["--num-iterations", "2"]
    _train(args)
    d = ck.checkpoint_dir("base", "d2", base_dir)
    earlier = _files(d / "step_000002")
    capsys.readouterr()

    _trainer_that(monkeypatch, 1, lambda: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(StopRequested) as stop:
        _train(args[:-2] + ["--num-iterations", "4", "--save-every", "3", "--overwrite"])
    out = capsys.readouterr().out
    assert (f"--overwrite: the earlier run's checkpoints (steps [2], " in out and
            f") in {d} are moved to {d / 'earlier_runs' / '1'} at this run's first save and kept there" in out), out
    assert f"--overwrite: moved the earlier run's checkpoints (steps [2]) to {d / 'earlier_runs' / '1'}" in out
    assert _files(d / "earlier_runs" / "1" / "step_000002") == earlier   # whole, and still resumable there
    assert ck.read_latest(d / "earlier_runs" / "1") == 2 and ck.list_steps(d) == [2]

    message = str(stop.value)
    head, command = message.split("continue with --resume latest: ")
    assert head == f"stopped by SIGINT at step 2 of 4: checkpoint {d / 'step_000002'} saved; "
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "scripts.base_train"] and "--overwrite" not in argv
    assert argv[3:5] == ["--model-tag", "d2"] and argv[-2:] == ["--resume", "latest"]
    assert "--no-compile" in argv and argv[argv.index("--save-every") + 1] == "3"
    monkeypatch.undo()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    resumed = _train(argv[3:])                          # as printed: it continues, nothing changed
    assert sorted(resumed["losses"]) == [2, 3] and ck.read_latest(d) == 4
    assert "these flags differ" not in capsys.readouterr().out


def test_out_of_memory_names_the_resume_command_at_the_lower_device_batch(env, base_dir, monkeypatch):
    """--device-batch-size 4 runs out of memory in step 2, after step 2's save: the hint names the
    command that resumes from that step at device batch 2 (the user's own command plus a lower batch
    starts afresh under --overwrite, and is refused without --resume); that command continues it."""
    args = TINY + env + ["--num-iterations", "3", "--save-every", "2", "--model-tag", "oom", "--overwrite"]

    def oom():
        raise RuntimeError(f"{CPU_OUT_OF_MEMORY} 123 bytes")
    _trainer_that(monkeypatch, 2, oom)
    with pytest.raises(ValueError, match="out of CPU memory in step 2") as err:
        _train(args)
    command = str(err.value).split("; resume with: ")[1]
    argv = shlex.split(command)
    assert "--overwrite" not in argv and argv[argv.index("--device-batch-size") + 1] == "2", command
    assert argv[-2:] == ["--resume", "2"]   # the step it saved (latest.json may name another branch's)
    monkeypatch.undo()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    assert sorted(_train(argv[3:])["losses"]) == [2]


def test_a_resume_names_the_flags_that_differ_and_refuses_a_new_shape_before_loading(
        env, base_dir, monkeypatch, capsys):
    from scripts import base_train

    args = TINY + env + ["--num-iterations", "2", "--model-tag", "cfg", "--save-every", "2"]
    _train(args)
    capsys.readouterr()

    def stop_before_training(*a, **k):
        raise RuntimeError("stop before training")
    monkeypatch.setattr(base_train, "run_training_loop", stop_before_training)
    with pytest.raises(RuntimeError, match="stop before training"):
        _train(args[:-4] + ["--model-tag", "cfg", "--eval-tokens", "512", "--keep-last", "1", "--num-iterations", "2",
                            "--resume", "latest"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "these flags differ" in ln)
    assert line == ("--resume: these flags differ from the checkpoint's run, and this run's apply: --eval-tokens "
                    "256 -> 512, --save-every 2 -> -1, --keep-last 0 -> 1")

    def no_load(*a, **k):
        raise AssertionError("the checkpoint's weights were loaded before the refusal")
    monkeypatch.setattr(ck, "load_checkpoint", no_load)
    for flag, value, named in (("--depth", "3", "n_layer (set by base_train --depth) 2"),
                               ("--max-seq-len", "32", "sequence_len (set by base_train --max-seq-len) 64"),
                               ("--head-dim", "16", "n_head (set by base_train --head-dim) 2")):
        i = args.index(flag)
        with pytest.raises(ck.CheckpointError, match="^--resume: the checkpoint has " + re.escape(named)):
            _train(args[:i + 1] + [value] + args[i + 2:] + ["--resume", "latest"])


def test_disk_short_of_room_names_the_earlier_runs_kept(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    ck.save_checkpoint(d, 1, model_state={"w": torch.zeros(1000)}, meta={})
    ck.fresh_start(d, None, True).settle()
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    with pytest.raises(ck.CheckpointError, match=rf"free space, e.g. by deleting what you no longer need of "
                                                 rf"{d / 'earlier_runs'} \(\d+ KB of earlier runs' checkpoints\), or"):
        ck.disk_plan(d, 10, 1)


def test_a_resume_of_an_older_step_moves_the_later_ones_aside(env, base_dir, capsys):
    """--resume 2 of a run saved at 2 and 4 (a retry from before a loss spike): its saves replaced the
    first run's step 4 (that branch gone, and with other --save-every values the two runs' steps
    mixed in one directory). The later steps, with latest.json, move to earlier_runs/<N>/ and stay."""
    args = TINY + env + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "branch"]
    _train(args)
    d = ck.checkpoint_dir("base", "branch", base_dir)
    first = _files(d / "step_000004")
    capsys.readouterr()
    _train(args + ["--resume", "2", "--matrix-lr", "0.01"])
    out = capsys.readouterr().out
    aside = d / "earlier_runs" / "1"
    assert (f"--resume 2: the checkpoints after step 2 in {d} (steps [4], " in out and ": the run this one branches "
            f"from) are moved to {aside} at this run's first save and kept there" in out), out
    assert f"--resume 2: moved the checkpoints after step 2 (steps [4]: the run this one branches from) to {aside}" \
        in out
    assert _files(aside / "step_000004") == first and ck.read_latest(aside) == 4
    assert ck.list_steps(d) == [2, 4] and ck.read_latest(d) == 4 and _files(d / "step_000004") != first


def test_a_move_aside_that_the_disk_refuses_is_one_line(tmp_path, monkeypatch):
    """Moving the earlier run aside needs a directory: a disk that refuses it (full, read-only) ended
    the first save with a bare OSError traceback; now a CheckpointError saying where the files are
    and that a rerun finishes the move."""
    d = tmp_path / "ck"
    ck.save_checkpoint(d, 1, model_state={"w": torch.zeros(4)}, meta={})
    real = type(d).mkdir

    def full(self, *a, **k):
        if self.name.endswith(".moving"):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **k)
    monkeypatch.setattr(type(d), "mkdir", full)
    with pytest.raises(ck.CheckpointError, match=rf"^--overwrite: could not move the earlier run's checkpoints "
                                                 rf"\(steps \[1\]\) to {d / 'earlier_runs' / '1'} \(OSError: .*No "
                                                 r"space left on device.*\), so this run's checkpoint was not written; .* "
                                                 r"rerun the same command, which finishes the move$"):
        ck.fresh_start(d, None, True).settle()
    assert ck.list_steps(d) == [1] and ck.read_latest(d) == 1


def test_a_first_save_without_room_says_rerun_not_resume(tmp_path, monkeypatch):
    """A fresh run's first save refused for room (its --overwrite moved the earlier run aside just
    before) said "free space and resume with --resume": there is nothing of it to resume."""
    d = tmp_path / "ck"
    ck.save_checkpoint(d, 1, model_state={"w": torch.zeros(4)}, meta={})
    ck.fresh_start(d, None, True).settle()
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    with pytest.raises(ck.CheckpointError, match=r"^checkpoint of step 2 not written to .*: no room on its disk "
                                                 r"\(.*\); there is no checkpoint there to resume: free space and "
                                                 r"rerun$"):
        ck.save_checkpoint(d, 2, model_state={"w": torch.zeros(4000)}, meta={})
