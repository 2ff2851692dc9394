"""One training run per checkpoint directory (nanochat/writer_lock.py): a second base_train, SFT or
run_train.sh start on a directory another run is saving into is refused up front, naming the
holder; the lock goes when its holder does."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanochat import checkpoint as ck
from nanochat import writer_lock
from nanochat.errors import RequestError

REPO = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "L", "--eval-every", "-1",
        "--sample-every", "-1", "--eval-tokens", "128", "--no-compile", "--num-iterations", "1"]


def hold(ckpt_dir: Path, who: str = "pid 4242 on otherhost: python -m scripts.base_train") -> int:
    """Another holder of the lock (flock conflicts between open file descriptions, even within a
    process, which is what a second run's open is)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(ckpt_dir / writer_lock.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, who.encode())
    return fd


def test_a_held_directory_is_refused_naming_the_holder_and_freed_with_it(tmp_path):
    d = tmp_path / "base_checkpoints" / "d1"
    fd = hold(d)
    assert writer_lock.holder(d) == "pid 4242 on otherhost: python -m scripts.base_train"
    with pytest.raises(RequestError, match=r"another training run is saving checkpoints there \(pid 4242 on "
                                           r"otherhost.*--stop --model-tag TAG.*another --model-tag"):
        writer_lock.claim_checkpoint_dir(d)
    os.close(fd)   # the holder exits
    assert writer_lock.holder(d) is None
    writer_lock.claim_checkpoint_dir(d)
    text = (d / writer_lock.LOCK_NAME).read_text()
    assert text.startswith(f"pid {os.getpid()} on ") and "4242" not in text
    writer_lock.claim_checkpoint_dir(d)   # the same process again (a resume in one test): fine
    with pytest.raises(BlockingIOError):  # and it really holds it against others
        fcntl.flock(os.open(d / writer_lock.LOCK_NAME, os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert writer_lock.holder(tmp_path / "nothing_here") is None and not (tmp_path / "nothing_here").exists()


def test_base_train_is_refused_before_it_builds_anything(env, base_dir, monkeypatch):
    from nanochat import gpt
    from scripts import base_train

    d = ck.checkpoint_dir("base", "locked", base_dir)
    fd = hold(d)
    monkeypatch.setattr(gpt, "GPT", None)   # built only after the check: must not be reached
    try:
        with pytest.raises(RequestError, match="another training run is saving checkpoints there"):
            base_train.main(TINY + env + ["--model-tag", "locked"])
    finally:
        os.close(fd)
    assert ck.list_steps(d) == []


def test_run_train_start_is_refused_while_another_run_writes_the_tag(base_dir, tiny_corpus):
    """The refusal comes from run_train.sh itself (exit 2, nothing started in the background),
    not from a log the user reads later."""
    d = ck.checkpoint_dir("base", "busy", base_dir)
    fd = hold(d, "pid 777 on thisbox, started by ./setup.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(NANOCHAT_BASE_DIR=str(base_dir), NANOCHAT_PYTHON=sys.executable)
    try:
        r = subprocess.run(["bash", str(REPO / "run_train.sh"), *TINY, "--data-dir", str(tiny_corpus),
                            "--model-tag", "busy"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        os.close(fd)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "another training run is saving checkpoints there (pid 777 on thisbox, started by ./setup.sh)" in r.stderr
    assert not (base_dir / "runs" / "busy" / "pid").exists()


def test_an_unwritable_directory_is_one_line_and_a_recreated_one_is_locked_again(tmp_path, monkeypatch):
    """A single process met a raw OSError (a traceback) where several ranks got one line; and a
    directory deleted and made again (compare_recipes between seeds) kept no lock on disk."""
    import shutil

    d = tmp_path / "base_checkpoints" / "d1"

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as m:
        m.setattr(writer_lock.os, "open", refuse)
        with pytest.raises(RequestError, match=r"cannot create \.writer\.lock there \(Permission denied\)"):
            writer_lock.claim_checkpoint_dir(d)
    writer_lock.claim_checkpoint_dir(d)
    shutil.rmtree(d)
    writer_lock.claim_checkpoint_dir(d)   # the same process, the directory made again
    assert (d / writer_lock.LOCK_NAME).is_file()
    with pytest.raises(BlockingIOError):
        fcntl.flock(os.open(d / writer_lock.LOCK_NAME, os.O_RDONLY), fcntl.LOCK_SH | fcntl.LOCK_NB)


def test_the_probe_needs_no_write_access_and_a_probe_does_not_refuse_a_run(tmp_path, monkeypatch):
    """holder() asked for an exclusive lock on a read-only fd (EBADF on NFS, where flock is a POSIX
    lock): run_train.sh died with a traceback. It probes with a shared lock now, and a run that
    starts during a probe waits it out instead of reading it as another run."""
    d = tmp_path / "ck"
    fd = hold(d)
    real = fcntl.flock

    def nfs_like(f, op):   # an exclusive lock on a fd opened read-only fails as on NFS
        if op & fcntl.LOCK_EX and (os.O_ACCMODE & _flags(f)) == os.O_RDONLY:
            raise OSError(9, "Bad file descriptor")
        return real(f, op)
    monkeypatch.setattr(fcntl, "flock", nfs_like)
    assert writer_lock.holder(d).startswith("pid 4242")
    os.close(fd)
    assert writer_lock.holder(d) is None
    probe = os.open(d / writer_lock.LOCK_NAME, os.O_RDONLY)   # a probe's shared lock, released soon
    real(probe, fcntl.LOCK_SH)
    import threading
    threading.Timer(0.1, os.close, [probe]).start()
    writer_lock.claim_checkpoint_dir(d)   # waits the probe out


def _flags(fd: int) -> int:
    import fcntl as f
    return f.fcntl(fd, f.F_GETFL)
