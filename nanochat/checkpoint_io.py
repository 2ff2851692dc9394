"""The files of a checkpoint: step directory names, atomic writes (temp file + fsync +
os.replace), size + sha256 sums hashed alongside the IO, and torch.load(weights_only=True) that
returns only what matches its sums. checkpoint.py builds saves, loads and resumes on these.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import pickle
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from nanochat.errors import RequestError

_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointError(RequestError):
    """A checkpoint is missing, incomplete or incompatible; the message names the path: a
    RequestError, so the scripts print it as one line."""


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def list_steps(ckpt_dir: str | Path) -> list[int]:
    """Complete checkpoint steps in ckpt_dir, ascending (partial directories are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    steps = [int(m.group(1)) for p in ckpt_dir.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(steps)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some filesystems do not allow opening directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None], *, written: Callable[[Path], Any] | None = None) -> None:
    """Write `path` via a same-directory temp file, fsync, os.replace; the temp is removed on error.
    `written(tmp)` is called once the bytes are in the file, before the fsync (e.g. to hash them)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if written is not None:
                written(tmp)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, obj: dict) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True, default=str).encode()))


# The sums are hashed on helper threads next to the IO that dominates a checkpoint: a save hashes
# each file (from the page cache, through a read-only mmap: one hashlib call, which releases the
# GIL for all of it) while fsync flushes it and the next file is written; a load hashes while
# torch.load reads. Hashing after the IO, as before, added ~45% to a d20 save (9.2 GB) and ~130%
# to its load on an H200 box (scripts/bench_checkpoint.py).


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """The helper threads, made on first use; a forked child makes its own (its copy of the
    parent's executor has no threads, and would queue work that never runs)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-sha256"))
    return _POOL[1]


def _file_sum(f) -> dict:
    """{"bytes", "sha256"} of an open binary file (closed after); the path may have moved since."""
    with f:
        size = os.fstat(f.fileno()).st_size
        sha = hashlib.sha256()
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                sha.update(view)
        return {"bytes": size, "sha256": sha.hexdigest()}


def sha256_file(path: Path) -> str:
    return _file_sum(open(path, "rb"))["sha256"]


def save_hashed(path: Path, obj) -> Future:
    """Write `obj` atomically; returns a future of its {"bytes", "sha256"}, hashed during the fsync."""
    hashing = []
    atomic_write(path, lambda f: torch.save(obj, f),
                 written=lambda tmp: hashing.append(_hash_pool().submit(_file_sum, open(tmp, "rb"))))
    return hashing[0]


def saved_sum(path: Path, rank: int) -> dict | None:
    """What sums_rank<R>.json recorded for `path` (None: a checkpoint from before the sums)."""
    sums_path = path.parent / f"sums_rank{rank}.json"
    if not sums_path.is_file() or not path.is_file():
        return None
    try:
        want = json.loads(sums_path.read_text())[path.name]
        if not isinstance(want, dict):
            raise TypeError(f"{path.name}: {want!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{sums_path}: corrupt or without {path.name} ({e})") from e
    return want


def _damaged(path: Path, want: dict) -> CheckpointError:
    others = [s for s in list_steps(path.parent.parent) if step_dirname(s) != path.parent.name]
    return CheckpointError(f"{path}: the file differs from the one saved ({path.stat().st_size:,} bytes, "
                           f"{want.get('bytes'):,} when saved, or another sha256): damaged on disk; "
                           f"use another step ({others or 'none on disk'})")


def start_check(path: Path, rank: int) -> tuple[dict, Future] | None:
    """Refuse a file whose size differs from its sums and start hashing it on a helper thread
    (None: a checkpoint from before the sums, or a missing file, which torch.load reports)."""
    want = saved_sum(path, rank)
    if want is None:
        return None
    if path.stat().st_size != want.get("bytes"):
        raise _damaged(path, want)
    return want, _hash_pool().submit(_file_sum, open(path, "rb"))


def load_verified(path: Path, device, rank: int = 0, check: tuple[dict, Future] | None = None) -> Any:
    """torch.load(weights_only=True) of a file that must match its saved size and sha256. The hash
    runs on a helper thread while torch.load reads the same file (`check`: one started earlier,
    by start_check); what was loaded is returned only if the hash matches."""
    check = check or start_check(path, rank)
    if check is None:
        return _load(path, device)
    want, hashing = check
    try:
        obj = _load(path, device)
    except CheckpointError:
        if hashing.result()["sha256"] != want.get("sha256"):
            raise _damaged(path, want) from None   # the cause, not torch's view of its symptom
        raise
    if hashing.result()["sha256"] != want.get("sha256"):
        del obj
        raise _damaged(path, want)
    return obj


def _load(path: Path, device) -> Any:
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing from the checkpoint") from None
    except pickle.UnpicklingError as e:  # weights_only refused a pickled global (or a corrupt file)
        first = str(e).strip().splitlines()[-1][:200] if str(e).strip() else ""
        raise CheckpointError(f"{path}: cannot read with weights_only=True ({first})") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read ({type(e).__name__}: {e})") from e
