"""run_train.sh refuses a start that base_train would end within seconds, before anything starts
(first-user review, session 71): the start said "started pid N" and exited 0, and the run failed in
the log a moment later: no tokenizer, no data shards, --resume latest|STEP without that checkpoint,
or the same command again after a --stop or a finished run (a fresh start into a tag that holds
checkpoints, which base_train refuses without --resume or --overwrite). A NANOCHAT_PYTHON that is
no program, or a Python without torch, ended in env's "No such file or directory" (exit 127) or a
traceback (exit 1). A relative --data-dir was read from the repo (where the run starts), not from
the caller's directory: "--data-dir: got 'shards'; accepted: an existing directory" for a directory
that was there. Real interpreter, no training: each call is the flag check alone (seconds)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_train.sh"
FLAGS = ["--device", "cpu", "--depth", "1", "--max-seq-len", "64", "--device-batch-size", "4",
         "--total-batch-size", "256", "--no-compile", "--model-tag", "t"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_tokenizer):
    """A base dir with a tokenizer and, for tag t, one checkpoint step recorded as the latest."""
    from nanochat.tokenizer import tokenizer_dir
    d = tmp_path_factory.mktemp("run_train_inputs")
    tiny_tokenizer.save(tokenizer_dir(d))
    ckpt = d / "checkpoints" / "base" / "t"
    (ckpt / "step_000003").mkdir(parents=True)
    (ckpt / "latest.json").write_text(json.dumps({"step": 3}))
    return d


def _call(base_dir: Path, *args: str, python: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_PYTHON")}
    env["NANOCHAT_BASE_DIR"] = str(base_dir)
    if python is not None:
        env["NANOCHAT_PYTHON"] = python
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def _refused(out: subprocess.CompletedProcess, base_dir: Path, *said: str) -> None:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "started pid" not in out.stdout and "Traceback" not in out.stderr, out.stdout + out.stderr
    for text in said:
        assert text in out.stderr, out.stderr
    assert not (base_dir / "runs").exists()   # nothing started: no run dir, pid or log


def test_the_same_command_again_into_a_tag_with_checkpoints_is_refused(base_dir, tiny_corpus):
    out = _call(base_dir, *FLAGS, "--data-dir", str(tiny_corpus))
    _refused(out, base_dir, "run_train.sh: error: ", "holds checkpoints of an earlier run (steps [3])",
             "--resume latest", "--overwrite")


@pytest.mark.parametrize("resume, said", [("7", "no checkpoint for step 7"), ("latest", "latest.json missing")])
def test_resume_of_a_checkpoint_that_is_not_there_is_refused(base_dir, tiny_corpus, resume, said):
    tag = "t" if resume == "7" else "other"
    flags = [a if a != "t" else tag for a in FLAGS]
    _refused(_call(base_dir, *flags, "--data-dir", str(tiny_corpus), "--resume", resume), base_dir, said)


def test_missing_data_and_missing_tokenizer_are_refused(base_dir, tmp_path):
    empty = tmp_path / "no_shards"
    empty.mkdir()
    _refused(_call(base_dir, *FLAGS, "--data-dir", str(empty)), base_dir, "no text shards (*.parquet) in")
    bare = tmp_path / "bare"
    _refused(_call(bare, *FLAGS), bare, "tokenizer at ", "file not found", "scripts.tok_train")


def test_a_bad_nanochat_python_is_named(tmp_path):
    no_torch = tmp_path / "python"   # a Python that lacks the project's packages
    no_torch.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    no_torch.chmod(0o755)
    for python, said in ((str(tmp_path / "nope"), " (no such program)"), (str(no_torch), ", which cannot import torch")):
        out = _call(tmp_path, *FLAGS, python=python)
        _refused(out, tmp_path, f"run_train.sh: error: NANOCHAT_PYTHON: got '{python}'{said}; accepted: a Python "
                 "with this project installed")


def test_a_relative_data_dir_is_the_callers(base_dir, tiny_corpus, tmp_path):
    (tmp_path / "shards").symlink_to(tiny_corpus)
    flags = [a if a != "t" else "fresh" for a in FLAGS]
    for spelling in (["--data-dir", "shards"], ["--data_dir=shards"]):
        # past the data check: refused at the next one (no checkpoint to resume in a new tag)
        out = _call(base_dir, *flags, *spelling, "--resume", "latest", cwd=tmp_path)
        _refused(out, base_dir, "checkpoints/base/fresh (latest.json missing)")
