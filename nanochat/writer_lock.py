"""One training run per checkpoint directory: the writer lock.

Two runs saving into one directory (`./setup.sh`'s pretrain stage and a `./run_train.sh` of the
same model tag, or two terminals) interleave their steps, and --keep-last's pruning of one deletes
the other's checkpoints. Each training script claims its directory at start-up, before the
model is built: rank 0 takes a POSIX flock on `<dir>/.writer.lock` for the life of the process
(the kernel drops it when the process dies, so a crash leaves nothing stale) and writes who holds
it there; a second run is refused with that description. `holder()` asks without taking it
(run_train.sh checks before it starts anything in the background).

Filesystems without flock (Lustre mounted without it) go on unlocked with a warning, as the
downloads do (nanochat/dataset_download.py)."""
from __future__ import annotations

import errno
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

LOCK_NAME = ".writer.lock"
_HELD: dict[str, int] = {}   # resolved directory -> fd holding its lock (for the process's life)


def _describe_self() -> str:
    cmd = " ".join([Path(sys.executable).name, *sys.argv])[:300]
    return f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: {cmd}"


def _try_lock(fd: int, mode: int | None = None) -> bool | None:
    """True: locked; False: another holds it; None: this filesystem has no flock."""
    import fcntl

    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if mode is None else mode) | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return None   # ENOSYS / ENOLCK / EOPNOTSUPP and the like: no usable flock on this filesystem


def _read_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "a process that has not written its description yet"
    except OSError:
        return "another process"


def holder(ckpt_dir) -> str | None:
    """Who holds `ckpt_dir`'s writer lock right now (their description), or None: nobody, no such
    directory yet, or no flock here. Takes nothing (the probe's own lock is released at once)."""
    path = Path(ckpt_dir) / LOCK_NAME
    if os.name != "posix" or not path.is_file() or _held(Path(ckpt_dir)):
        return None
    import fcntl

    try:   # a shared probe: it conflicts with the holder's exclusive lock and needs no write access
        fd = os.open(path, os.O_RDONLY)   # (NFS runs flock as a POSIX lock: exclusive needs a writable fd)
    except OSError:
        return None
    try:
        got = _try_lock(fd, fcntl.LOCK_SH)
        if got:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return _read_holder(path) if got is False else None
    except OSError:   # cannot tell here: the run's own claim decides
        return None
    finally:
        os.close(fd)


def _held(ckpt_dir: Path) -> bool:
    """Whether this process holds ckpt_dir's lock still: its fd is the file at that path (a directory
    deleted and made again, as compare_recipes does between seeds, needs a new lock)."""
    key = str(ckpt_dir.resolve()) if ckpt_dir.exists() else str(ckpt_dir.absolute())
    fd = _HELD.get(key)
    if fd is None:
        return False
    try:
        held, now = os.fstat(fd), os.stat(ckpt_dir / LOCK_NAME)
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            return True
    except OSError:
        pass
    os.close(_HELD.pop(key))
    return False


def refusal(ckpt_dir, who: str) -> str:
    return (f"{ckpt_dir}: another training run is saving checkpoints there ({who}); two runs in one "
            "directory would overwrite and prune each other's steps. Let it finish, stop it (`./run_train.sh "
            "--stop --model-tag TAG` for runs it started; kill -TERM PID otherwise: the run saves first), "
            "or train under another --model-tag")


def _claim_local(ckpt_dir: Path) -> str:
    """Take the lock in this process; '' when taken (or not possible here), else the refusal."""
    if os.name != "posix" or _held(ckpt_dir):
        return ""
    from nanochat.checkpoint_io import make_dirs   # the directory first made here, for the run's saves: durable
    make_dirs(ckpt_dir)
    path = ckpt_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    got = _try_lock(fd)
    for _ in range(10):   # a holder() probe (run_train.sh) holds a shared lock for a moment: not a run
        if got is not False:
            break
        time.sleep(0.05)
        got = _try_lock(fd)
    if got is False:
        os.close(fd)
        return refusal(ckpt_dir, _read_holder(path))
    if got is None:
        os.close(fd)
        print(f"WARNING: {ckpt_dir}: this filesystem has no flock; going on without the one-run-per-"
              "checkpoint-directory check", file=sys.stderr)
        return ""
    os.ftruncate(fd, 0)
    os.pwrite(fd, (_describe_self() + "\n").encode(), 0)
    _HELD[str(ckpt_dir.resolve())] = fd
    return ""


def claim_checkpoint_dir(ckpt_dir, *, timeout_s: float = 600.0) -> None:
    """Hold `ckpt_dir`'s writer lock for this process's life (rank 0 under torch.distributed,
    collective: every rank raises the same RequestError when another run holds it). Call it at
    start-up, after the directory is known and before anything expensive."""
    import torch.distributed as dist

    from nanochat.errors import RequestError

    ckpt_dir = Path(ckpt_dir)
    distributed = dist.is_available() and dist.is_initialized()
    if not distributed or dist.get_rank() == 0:
        try:
            why = _claim_local(ckpt_dir)
        except OSError as e:   # a read-only or foreign directory: one line, and the other ranks are told
            why = f"{ckpt_dir}: cannot create {LOCK_NAME} there ({e.strerror or e})"
    if distributed:
        from nanochat.distributed import _default_store

        store, key = _default_store(), f"nanochat/writer_lock/{ckpt_dir.absolute()}"
        if dist.get_rank() == 0:
            store.set(key, why)
        else:
            store.wait([key], timedelta(seconds=timeout_s))
            why = store.get(key).decode()
    if why:
        raise RequestError(why)


def release_all() -> None:
    """Drop every lock this process holds (tests; a process's exit does it by itself)."""
    for fd in _HELD.values():
        os.close(fd)
    _HELD.clear()
