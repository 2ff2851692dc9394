"""Review 76 (base_train start-up and resume, CPU). A --resume that cannot go on (no such checkpoint,
another model shape, recipe or horizon) and a fresh start into a tag holding checkpoints were refused
only after both data loaders had opened and checked every shard: now base_train.plan_run decides them
from the flags, the tokenizer and meta.json before any data is read. run_train.sh checked only that
the checkpoint was there: a resume these flags could not continue (and any --resume auto) said
"started pid N", exited 0 and failed in the log; it now runs the same plan_run before the start."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.test_base_train import TINY

REPO = Path(__file__).resolve().parents[1]
TAG = "r76"


@pytest.fixture(scope="module")
def trained(base_dir, tiny_corpus):
    """base_dir holding tag r76's 2-step run (a checkpoint at step 2, recorded as the latest)."""
    from nanochat import writer_lock
    from scripts import base_train
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base_dir))
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE"):
            mp.delenv(var, raising=False)
        base_train.main(TINY + ["--data-dir", str(tiny_corpus), "--num-iterations", "2", "--eval-every", "-1",
                                "--model-tag", TAG])
        writer_lock.release_all()
    return base_dir


REFUSALS = [
    (["--model-tag", "none76", "--resume", "latest"], "latest.json missing"),
    (["--model-tag", TAG, "--resume", "7"], "no checkpoint for step 7"),
    (["--model-tag", TAG, "--resume", "latest", "--depth", "3"], "n_layer (set by base_train --depth) 2 but this run has 3"),
    (["--model-tag", TAG, "--resume", "auto", "--recipe", "v1"], "--recipe: got 'v1' but the checkpoint was trained with"),
    (["--model-tag", TAG, "--resume", "latest", "--num-iterations", "1"], "at step 2, past --num-iterations 1"),
    (["--model-tag", TAG, "--num-iterations", "4"], "holds checkpoints of an earlier run (steps [2])"),
    (["--model-tag", "new76", "--num-iterations", "2000000000"], "--num-iterations: makes 2e+09 steps"),
]


@pytest.mark.parametrize("argv, said", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_resume_and_horizon_refusals_come_before_the_data_is_read(trained, env, monkeypatch, argv, said):
    from nanochat import dataloader
    from scripts import base_train

    def no_data(*args, **kwargs):
        raise AssertionError("the data loaders were built before the refusal")
    monkeypatch.setattr(dataloader, "DataLoader", no_data)
    monkeypatch.setattr(base_train, "eval_loader", no_data)
    with pytest.raises(ValueError) as e:
        base_train.main(TINY + env + ["--eval-every", "-1"] + argv)
    assert said in str(e.value)


def test_plan_run_lets_a_resume_these_flags_continue(trained, env):
    """The check run_train.sh makes passes a resume that can go on (and says nothing on stdout)."""
    from nanochat.checkpoint import checkpoint_dir
    from nanochat.tokenizer import get_tokenizer
    from scripts.base_train import parse_config, plan_run
    cfg = parse_config(TINY + env + ["--model-tag", TAG, "--resume", "auto", "--num-iterations", "4"])
    said = []
    plan = plan_run(cfg, get_tokenizer(trained), 1, checkpoint_dir("base", TAG, trained), log=said.append)
    assert (plan.resume_step, plan.num_iterations, plan.total_batch_size, cfg.recipe) == (2, 4, 512, "v2")
    assert said == [f"--resume auto: resuming the latest checkpoint in {checkpoint_dir('base', TAG, trained)}"]


@pytest.mark.parametrize("argv, said", [
    (["--resume", "latest", "--depth", "3"], "n_layer (set by base_train --depth) 2 but this run has 3"),
    (["--resume", "auto", "--max-seq-len", "128", "--total-batch-size", "1024"],
     "sequence_len (set by base_train --max-seq-len) 64 but this run has 128"),
])
def test_run_train_refuses_a_resume_these_flags_cannot_continue(trained, tiny_corpus, argv, said):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_PYTHON")}
    env["NANOCHAT_BASE_DIR"] = str(trained)
    out = subprocess.run(["bash", str(REPO / "run_train.sh"), *TINY, "--data-dir", str(tiny_corpus),
                          "--num-iterations", "4", "--model-tag", TAG, *argv], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "started pid" not in out.stdout and f"run_train.sh: error: --resume: the checkpoint has {said}" in out.stderr
    assert not (trained / "runs").exists()   # nothing started: no run dir, pid or log
