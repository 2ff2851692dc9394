"""Review 10 of base_train as a user who interrupts runs: a second Ctrl-C in the middle of a save
(nothing half-written is picked up, the resume equals the uninterrupted run step for step), a resume
that leaves --grad-clip off is named, a --resume of a mistyped --model-tag names the tags that hold
checkpoints, and a disk that fills mid-run (the metrics row first, then the save) ends at the save,
naming the checkpoint kept."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch

from nanochat import checkpoint as ck

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "4", "--total-batch-size", "512", "--window-pattern", "SL",   # 2 micro-batches
        "--sample-every", "-1", "--eval-every", "-1", "--eval-tokens", "256", "--no-compile"]


def _train(args):
    from scripts import base_train
    return base_train.main(args)


def test_second_ctrl_c_in_a_save_then_resume_without_grad_clip_is_named(env, base_dir, monkeypatch, capsys):
    """Ctrl-C twice while step 4's checkpoint is written: the half-written step_000004.partial is never
    resumed from (latest.json still names step 2); the resume continues bit for bit when it repeats
    --grad-clip, and says so when it leaves it off (clipping was turned off without a word)."""
    from nanochat import checkpoint
    from nanochat.loop import run_training_loop

    args = TINY + env + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "ctrlc", "--grad-clip", "0.5"]
    full = _train(args)
    d = ck.checkpoint_dir("base", "ctrlc", base_dir)
    done = ck.load_checkpoint(d, 4, load_optimizer=True)

    real, files = checkpoint.save_hashed, []

    def save_hashed(path, obj):
        files.append(path)
        if len(files) == 4:   # step 2's three files went through; step 4's first one is being written
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real(path, obj)
    monkeypatch.setattr(checkpoint, "save_hashed", save_hashed)
    with pytest.raises(KeyboardInterrupt):
        _train(args + ["--overwrite"])
    monkeypatch.setattr(checkpoint, "save_hashed", real)
    assert ck.list_steps(d) == [2] and ck.read_latest(d) == 2
    assert (d / "step_000004.partial").is_dir()   # left by the interrupt: ignored, swept at the next save

    from scripts import base_train

    def stop_before_training(*a, **k):   # the resume without --grad-clip would replace step 4
        raise RuntimeError("stop before training")
    capsys.readouterr()
    monkeypatch.setattr(base_train, "run_training_loop", stop_before_training)
    with pytest.raises(RuntimeError, match="stop before training"):
        _train(args[:-2] + ["--resume", "latest"])   # --grad-clip 0.5 left off
    assert ("--resume: gradient clipping follows this run's flags, not the checkpoint's: --grad-clip 0.5 -> 0 "
            "(off); pass --grad-clip 0.5 to continue as before") in capsys.readouterr().out
    monkeypatch.setattr(base_train, "run_training_loop", run_training_loop)

    resumed = _train(args + ["--resume", "latest"])
    assert "gradient clipping follows" not in capsys.readouterr().out
    assert sorted(resumed["losses"]) == [2, 3]
    assert all(resumed["losses"][s] == full["losses"][s] for s in (2, 3))   # exact, not approx
    again = ck.load_checkpoint(d, 4, load_optimizer=True)
    assert all(torch.equal(v, again["model"][k]) for k, v in done["model"].items())
    assert again["loader"] == done["loader"] and not (d / "step_000004.partial").exists()


def test_resume_of_a_mistyped_model_tag_names_the_tags_with_checkpoints(env, base_dir):
    """base_train claims the tag's directory (.writer.lock) before it reads the --resume target, so a
    mistyped tag existed by then and the error said only "latest.json missing"."""
    ck.save_checkpoint(ck.checkpoint_dir("base", "mine", base_dir), 3, model_state={"w": torch.zeros(1)}, meta={})
    with pytest.raises(ck.CheckpointError, match=r"base/mnie \(latest.json missing\); model tag 'mnie' holds no "
                                                 r"checkpoint: the base model tags that do are .*\bmine\b.* "
                                                 r"\(--model-tag\)"):
        _train(TINY + env + ["--num-iterations", "4", "--model-tag", "mnie", "--resume", "latest"])
    with pytest.raises(ck.CheckpointError, match=r"no checkpoint for step 3 in .*base/mnie2; steps on disk: none; "
                                                 r"model tag 'mnie2' holds no checkpoint: .*\bmine\b"):
        _train(TINY + env + ["--num-iterations", "4", "--model-tag", "mnie2", "--resume", "3"])
    # the right tag without that step: no tag hint (the tag is right)
    with pytest.raises(ck.CheckpointError, match=r"steps on disk: \[3\]$"):
        ck.read_meta(ck.checkpoint_dir("base", "mine", base_dir), 5)


def test_a_disk_filling_mid_run_stops_at_the_save_naming_the_checkpoint_kept(env, base_dir, monkeypatch, capsys):
    """The disk fills after step 2's save: the metrics row of step 2 fails first. It ended rank 0
    alone with a bare OSError traceback (under torchrun the other ranks hang at the next collective);
    now it warns once, training goes on, and the save of step 4 stops the run, step 2 intact."""
    from nanochat import report

    real_log, real_save = report.log_metrics, torch.save

    def log_metrics(stage, row, **kw):
        if row["step"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_log(stage, row, **kw)

    def save(obj, f, *a, **kw):
        if "step_000004" in str(getattr(f, "name", "")):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **kw)
    monkeypatch.setattr(report, "log_metrics", log_metrics)
    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(ck.CheckpointError, match=r"checkpoint of step 4 not written to .*base/full: no room on its "
                                                 r"disk \(No space left on device; .* free now\); the checkpoint of "
                                                 r"step 2 is intact, free space and resume with --resume"):
        _train(TINY + env + ["--num-iterations", "6", "--save-every", "2", "--model-tag", "full"])
    out = capsys.readouterr().out
    assert out.count("the report's metrics rows stop (No space left on device") == 1
    assert "step 00003/00006" in out   # it trained on after the failed row
    d = ck.checkpoint_dir("base", "full", base_dir)
    assert ck.list_steps(d) == [2] and ck.read_latest(d) == 2 and not list(d.glob("step_*.partial"))
    ck.load_checkpoint(d, "latest", load_optimizer=True)   # whole and verified
