"""A user's third review of base pretraining on CPU (nanochat/training.py, loop.py, base_train):
guards for what the earlier tests left uncovered. The exact-resume test of test_base_train runs one
micro-batch a step; here a SIGTERM stop lands between steps that accumulate two micro-batches (the
Trainer holds the prefetched batch) of a bf16 run with the once-per-step weight casts."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from nanochat import checkpoint as ck

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "2", "--total-batch-size", "256", "--window-pattern", "SL", "--recipe", "v1",
        "--sample-every", "-1", "--eval-tokens", "1024", "--no-compile", "--num-iterations", "4",
        "--eval-every", "-1", "--grad-clip", "1.0"]


def _train(args):
    from scripts import base_train
    return base_train.main(args)


def test_a_sigterm_stop_between_accumulated_steps_resumes_bit_for_bit(env, base_dir, monkeypatch):
    """bf16 on CPU: fp32 masters, weights cast once a step (weight_cache), gradient sinks."""
    from nanochat import training
    from nanochat.loop import StopRequested

    args = TINY + env + ["--precision", "bf16", "--model-tag", "acc"]
    full = _train(args)
    final_full = ck.load_checkpoint(ck.checkpoint_dir("base", "acc", base_dir), 4)["model"]
    real_step = training.Trainer.step

    def step(self, s):
        out = real_step(self, s)
        if s == 1:   # a stop arriving during step 1: saved at step 2, before it
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    monkeypatch.setattr(training.Trainer, "step", step)
    with pytest.raises(StopRequested, match="stopped by SIGTERM at step 2 of 4"):
        _train(args + ["--overwrite"])
    monkeypatch.setattr(training.Trainer, "step", real_step)
    d = ck.checkpoint_dir("base", "acc", base_dir)
    meta = ck.read_meta(d, 2)["train"]
    assert ck.read_latest(d) == 2 and meta["grad_accum_steps"] == 2 and meta["cast_once"]

    resumed = _train(args + ["--resume", "latest"])
    assert sorted(resumed["losses"]) == [2, 3]
    assert all(resumed["losses"][s] == full["losses"][s] for s in (2, 3)), (resumed["losses"], full["losses"])
    final = ck.load_checkpoint(d, 4)["model"]
    assert all(torch.equal(v, final_full[k]) for k, v in final.items())
