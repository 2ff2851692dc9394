"""Review 7 of base_train's loop and exact resume: a stop in the last step saves before the final
evaluation (and the resume finishes bit for bit), a resume at another --max-seq-len or --depth is
refused naming that flag."""

from __future__ import annotations

import os
import signal
from dataclasses import asdict

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat.loop import LoopSpec, StopRequested, run_training_loop
from nanochat.resume_checks import check_resume_compatible
from tests.test_loop import _SignalTrainer

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "4", "--total-batch-size", "512", "--window-pattern", "SL",   # 2 micro-batches
        "--sample-every", "-1", "--eval-tokens", "256", "--no-compile", "--warmdown-ratio", "0.5"]


def _Trainer(at: int):
    """A trainer whose step `at` sends the process SIGTERM mid-step (test_loop's)."""
    return _SignalTrainer(at, signal.SIGTERM)


def test_a_stop_in_the_last_step_saves_before_the_final_evaluation(tmp_path, monkeypatch):
    """SIGTERM during the last step: the loop evaluated and sampled at num_iterations before its
    only save (minutes at d20, past torchrun's 30 s grace: the SIGKILL took a --save-every -1
    run's one checkpoint). Now it saves first and stops; the resume evaluates there."""
    monkeypatch.delenv("NANOCHAT_SETUP_STAGE", raising=False)
    evals, saves, states = [], [], []

    def save(step, state):
        saves.append(step)
        states.append(state)
        return tmp_path / f"step_{step:06d}"

    def spec():
        return LoopSpec("base", num_iterations=4, report=False, eval_every=2, sample_every=-1, save=save,
                        evaluate=lambda s: evals.append(s) or {"val_bpb": 1.0})
    trainer = _Trainer(at=3)
    with pytest.raises(StopRequested, match="stopped by SIGTERM at step 4 of 4"):
        run_training_loop(trainer, trainer.meter, spec())
    assert trainer.steps == [0, 1, 2, 3] and evals == [0, 2] and saves == [4]
    resumed = run_training_loop(_Trainer(at=-1), trainer.meter, spec(), start_step=4, resume_state=states[-1])
    assert evals == [0, 2, 4] and saves == [4, 4] and resumed.val_bpb_step == 4
    # a stage that saves nothing has nothing to stop for at its end: it finishes
    trainer = _Trainer(at=3)
    done = run_training_loop(trainer, trainer.meter, LoopSpec("rl", num_iterations=4, report=False))
    assert done.step == 4 and trainer.steps == [0, 1, 2, 3]


def test_stop_in_the_last_step_resumes_bit_for_bit(env, base_dir, monkeypatch):
    """The real base_train: gradient accumulation, warmdown crossing the cut, evals on both sides,
    SIGTERM mid-step in the last step; the resumed final checkpoint equals the uninterrupted one's."""
    from nanochat import training
    from scripts import base_train

    args = TINY + env + ["--num-iterations", "3", "--eval-every", "2", "--model-tag", "stoplast"]
    full = base_train.main(args)
    d = ck.checkpoint_dir("base", "stoplast", base_dir)
    a = ck.load_checkpoint(d, 3, load_optimizer=True)
    real = training.Trainer.step

    def step(self, s):
        if s == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(self, s)
    monkeypatch.setattr(training.Trainer, "step", step)
    with pytest.raises(StopRequested, match="at step 3 of 3"):
        base_train.main(args + ["--overwrite"])
    stopped = ck.load_checkpoint(d, 3, load_optimizer=True)
    assert stopped["loop"]["evaluated_at"] == 2   # saved before the final evaluation
    monkeypatch.setattr(training.Trainer, "step", real)
    resumed = base_train.main(args + ["--resume", "latest"])
    assert resumed["losses"] == {} and resumed["final_val_bpb"] == full["final_val_bpb"]
    b = ck.load_checkpoint(d, 3, load_optimizer=True)
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    assert a["loader"] == b["loader"] and a["loop"]["meter"] == b["loop"]["meter"]
    assert (b["loop"]["evaluated_at"], b["loop"]["val_bpb_step"]) == (3, 3)


def _fake_checkpoint(d, model_config: dict, total: int) -> None:
    ck.save_checkpoint(d, 2, model_state={"w": torch.zeros(1)}, optimizer_state={}, loader_state=None,
                       loop_state={"step": 2}, meta={"model_config": model_config,
                                                     "train": {"total_batch_size": total, "world_size": 1}})


def test_another_max_seq_len_on_resume_is_named_not_the_device_batch(env, base_dir, tmp_path):
    """--total-batch-size auto on a resume keeps the checkpoint's total; a new --max-seq-len that
    divides it but not the micro-batch was refused as a --device-batch-size the user never changed."""
    from nanochat.gpt import config_for_depth
    from nanochat.tokenizer import get_tokenizer
    from scripts import base_train

    cfg = config_for_depth(2, get_tokenizer(base_dir).vocab_size, 64, aspect_ratio=32, head_dim=32,
                           window_pattern="SL")
    _fake_checkpoint(ck.checkpoint_dir("base", "seqlen", base_dir), asdict(cfg), 256)   # 4 x 64 x 1 micro-batch
    argv = [a for a in TINY if a not in ("--total-batch-size", "512")]
    argv[argv.index("--max-seq-len") + 1] = "128"
    argv[argv.index("--eval-tokens") + 1] = "512"
    with pytest.raises(ValueError, match=r"sequence_len \(set by base_train --max-seq-len\) 64 but this run has 128"):
        base_train.main(argv + env + ["--num-iterations", "4", "--model-tag", "seqlen", "--resume", "latest"])


def test_another_depth_on_resume_is_named_as_the_depth():
    """A new --depth changes n_layer and n_embd; sorted by name, n_embd came first and the error
    read "n_embd (set by --depth / --aspect-ratio) 64 but this run has 96"."""
    from nanochat.gpt import config_for_depth
    from nanochat.training import BatchPlan

    saved = asdict(config_for_depth(2, 1024, 64, aspect_ratio=32, head_dim=32, window_pattern="SL"))
    now = asdict(config_for_depth(3, 1024, 64, aspect_ratio=32, head_dim=32, window_pattern="SL"))
    meta = {"model_config": saved, "train": {"total_batch_size": 512, "world_size": 1}}
    with pytest.raises(ValueError, match=r"n_layer \(set by base_train --depth\) 2 but this run has 3"):
        check_resume_compatible(meta, now, BatchPlan(512, 4, 64, 1, 2), 1, "fp")
