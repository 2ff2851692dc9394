"""Downloading text shards over HTTP: the mechanics behind `python -m nanochat.dataset`'s remote
sources (the source registry and the command line stay in nanochat/dataset.py, which re-exports
DownloadError, DiskFullError, download_file, download_shards and verify_text_shard).

One file (download_file): bytes go to `NAME.partial`, resumed with an HTTP Range request after a
dropped connection or an earlier run; retryable failures (network errors, 408/425/429/5xx, a
short body, bad content) are retried with exponential backoff, others (404, 403) fail at once.
The result is verified (the size and sha256 the server states, a readable parquet file with a
string `text` column, the first row group decoding), fsynced, then renamed into place: a shard
name only ever holds a complete, verified file. A per-shard lock file (`NAME.lock`, POSIX flock)
keeps two processes that fetch the same shard (torchrun ranks, two shells) off one .partial file;
the second waits and keeps the first one's result (a filesystem without locks gets a warning and
no guard). A full disk (ENOSPC) is a DiskFullError, not retried, with the partial file kept for a
resume.

Many files (download_shards): a thread pool, a tqdm bar, existing shards kept unless their footer
does not read (then fetched again), a free-space check after each finished shard, failures
returned per shard; Ctrl-C or an unexpected error stops the queued shards and the ones in flight
(their .partial files resume on the next run) instead of downloading the rest first.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from nanochat.dataset import open_text_shard, read_row_group_texts, shard_name
from nanochat.errors import DataError, DiskFullError

_RETRYABLE_STATUS = {408, 425, 429, 500, 502, 503, 504}
_NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}  # e.g. Lustre mounted without flock
_warned_no_locks: set[Path] = set()


class DownloadError(RuntimeError):
    pass


class _Retry(Exception):
    """A failed attempt that may succeed if tried again (network error, 5xx, bad content)."""


class _Stopped(Exception):
    """Raised from a worker's byte counter once download_shards is stopping (Ctrl-C, an error)."""


def _expected_from(resp) -> tuple[int | None, str | None]:
    """(total size, sha256) as the server states them. The hub reports an LFS file's sha256 as
    X-Linked-Etag on the redirect response, so look through the redirect history too."""
    total = sha = None
    for r in [*resp.history, resp]:
        etag = (r.headers.get("X-Linked-Etag") or "").strip('W/"')
        if re.fullmatch(r"[0-9a-f]{64}", etag):
            sha = etag
        if r.headers.get("X-Linked-Size", "").isdigit():
            total = int(r.headers["X-Linked-Size"])
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", resp.headers.get("Content-Range", ""))
    if m:
        total = int(m.group(3))
    elif resp.status_code == 200 and resp.headers.get("Content-Length", "").isdigit():
        total = int(resp.headers["Content-Length"])
    return total, sha


def verify_text_shard(path: Path, *, size: int | None = None, sha256: str | None = None) -> None:
    """ValueError unless `path` has the expected size/checksum and is a parquet text shard."""
    got = path.stat().st_size
    if size is not None and got != size:
        raise ValueError(f"size {got} bytes, expected {size}")
    if sha256 is not None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if h.hexdigest() != sha256:
            raise ValueError(f"sha256 {h.hexdigest()}, expected {sha256}")
    pf = open_text_shard(path)
    if pf.num_row_groups:  # decoding one row group catches corrupt pages behind a valid footer
        read_row_group_texts(pf, 0, path)


def _attempt(session, url: str, partial: Path, timeout: float, on_bytes) -> tuple[int | None, str | None]:
    have = partial.stat().st_size if partial.exists() else 0
    # identity: requests asks for gzip by default, and a server that takes up the offer sends a
    # Content-Length and byte ranges of the compressed body while iter_content yields it
    # decompressed, so the size check fails every attempt and a Range resume would splice
    # decompressed bytes at a compressed offset
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
    with session.get(url, headers=headers, stream=True, timeout=timeout) as resp:
        if resp.status_code == 416:  # nothing left to fetch: the partial file may be complete
            m = re.fullmatch(r"bytes \*/(\d+)", resp.headers.get("Content-Range", ""))
            # the sha256 still counts: the hub states it on the redirect before the 416
            return (int(m.group(1)) if m else have), _expected_from(resp)[1]
        if resp.status_code in _RETRYABLE_STATUS:
            raise _Retry(f"HTTP {resp.status_code}")
        if resp.status_code not in (200, 206):
            raise DownloadError(f"HTTP {resp.status_code} for {url}")
        total, sha = _expected_from(resp)
        start = 0
        if resp.status_code == 206:
            m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
            start = int(m.group(1)) if m else -1
            if start != have:
                partial.unlink(missing_ok=True)
                raise _Retry(f"server resumed at byte {start}, wanted {have}")
        with open(partial, "ab" if start else "wb") as f:
            for chunk in resp.iter_content(chunk_size=1 << 16):  # small: less lost on a drop
                f.write(chunk)
                on_bytes(len(chunk))
            f.flush()
            # on disk before the rename makes it a shard: after a power cut a renamed file whose
            # data never reached the disk would be an empty or short shard under a final name
            os.fsync(f.fileno())
    got = partial.stat().st_size
    if total is not None and got < total:
        raise _Retry(f"connection closed at byte {got} of {total}")
    return total, sha


@contextmanager
def _shard_lock(dest: Path, on_wait=lambda: None) -> Iterator[bool]:
    """Hold an exclusive lock for downloading `dest`; yields True when another holder (a process
    or thread downloading the same shard) had it first and may have finished the shard meanwhile.
    flock is dropped by the kernel when its holder dies, so a crash leaves no stale lock."""
    path = dest.with_name(dest.name + ".lock")
    fd, waited = _acquire(path, on_wait)
    try:
        yield waited
    finally:
        if fd is not None:
            path.unlink(missing_ok=True)  # while still holding it: see _acquire
            os.close(fd)


def _acquire(path: Path, on_wait) -> tuple[int | None, bool]:
    """(fd holding an flock on `path`, whether we waited). A waiter can end up holding a file its
    previous holder removed, so the lock counts only while `path` is still that file. Waiting
    polls, calling on_wait() each time: a blocking flock in a worker thread could not be
    interrupted by the Ctrl-C the main thread receives. (None, False) where there are no locks."""
    try:
        import fcntl
    except ImportError:  # Windows has no flock: downloads there are not guarded against each other
        return None, False
    waited = False
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    waited = True
                    on_wait()
                    time.sleep(0.1)
            st, mine = os.stat(path), os.fstat(fd)
        except FileNotFoundError:  # removed by the holder we waited for: lock the new file
            os.close(fd)
            continue
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            _warn_no_locks(path.parent, e)
            path.unlink(missing_ok=True)
            return None, False
        except BaseException:
            os.close(fd)
            raise
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return fd, waited
        os.close(fd)


def _warn_no_locks(directory: Path, error: OSError) -> None:
    """Once per directory: downloading unguarded beats refusing to download at all."""
    if directory not in _warned_no_locks:
        _warned_no_locks.add(directory)
        print(f"{directory}: this filesystem has no file locks ({error.strerror}); two downloads "
              "into it at once are not kept apart", file=sys.stderr)


def _readable_shard(path: Path) -> bool:
    """True when `path` exists and its parquet footer reads as a text shard (no data is read)."""
    try:
        open_text_shard(path)
    except DataError:
        return False
    return True


def download_file(url: str, dest: Path, *, retries: int = 5, backoff: float = 2.0,
                  timeout: float = 60.0, on_bytes=lambda n: None) -> None:
    """Download url to dest: resume a partial file (HTTP Range), retry with exponential backoff,
    verify, then atomically rename. Raises DownloadError after the last attempt. Another process
    downloading the same dest is waited for, and its finished shard kept."""
    import requests

    partial = dest.with_name(dest.name + ".partial")
    last = "no attempt made"
    # on_bytes(0) while waiting for another downloader: download_shards' counter raises to stop
    with _shard_lock(dest, on_wait=lambda: on_bytes(0)) as waited, requests.Session() as session:
        if waited and _readable_shard(dest):  # the holder we waited for finished it
            return
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(min(backoff * 2 ** (attempt - 1), 60.0))
            try:
                total, sha = _attempt(session, url, partial, timeout, on_bytes)
                try:
                    verify_text_shard(partial, size=total, sha256=sha)
                except ValueError as e:  # corrupt content: start over from byte 0
                    partial.unlink(missing_ok=True)
                    raise _Retry(f"verification failed: {e}") from e
                os.replace(partial, dest)
                return
            except _Retry as e:
                last = str(e)
            except OSError as e:  # requests' errors are OSErrors too
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # no retry can help
                    from nanochat.common import fmt_bytes  # not at the top: nanochat.common imports torch
                    raise DiskFullError(f"{dest.parent}: the disk filled while downloading {dest.name} "
                                        f"({fmt_bytes(shutil.disk_usage(dest.parent).free)} free); free space and "
                                        "rerun: finished shards are kept and the partial one resumes") from e
                if not isinstance(e, requests.RequestException):
                    raise
                last = f"{type(e).__name__}: {e}"  # the partial file is kept and resumed
    raise DownloadError(f"{url}: failed after {retries + 1} attempts; last error: {last}")


def _check_room(out_dir: Path, sizes: list[int], left: int) -> None:
    """DiskFullError when the shards still to come (at the mean size of those finished) would not
    fit: better to stop with the finished ones kept than to fill the disk to the last byte."""
    each = sum(sizes) / len(sizes)
    free = shutil.disk_usage(out_dir).free
    if free < each * left:
        from nanochat.common import fmt_bytes  # not at the top: nanochat.common imports torch
        raise DiskFullError(f"{out_dir}: {left} more shards need ~{fmt_bytes(each * left)} (~{fmt_bytes(each)} each), "
                            f"{fmt_bytes(free)} free; free space (or ask for fewer with -n) and rerun: the "
                            f"{len(sizes)} finished this time are kept")


def _to_fetch(indices: list[int], out_dir: Path) -> list[int]:
    """The shards not yet in out_dir, plus those there whose footer does not read (a truncated or
    overwritten file would otherwise count as done on every rerun, found only by the dataloader)."""
    todo = []
    for i in indices:
        path = out_dir / shard_name(i)
        if not path.exists():
            todo.append(i)
        elif not _readable_shard(path):
            print(f"{path}: not a readable text shard; downloading it again", file=sys.stderr)
            todo.append(i)
    return todo


def download_shards(indices: list[int], out_dir: Path, base_url: str, *, workers: int = 4,
                    retries: int = 5, backoff: float = 2.0, timeout: float = 60.0,
                    progress: bool = True) -> list[tuple[int, str]]:
    """Download shard indices into out_dir in parallel; returns [(index, error)] for failures."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    todo = _to_fetch(indices, out_dir)
    lock, done_bytes = threading.Lock(), [0]
    # stop: start no more shards (the disk is full, or we are stopping); abort: also drop the ones
    # in flight at their next chunk (Ctrl-C), their .partial files kept for a resume
    stop, abort = threading.Event(), threading.Event()

    def count(n):
        if abort.is_set():
            raise _Stopped()
        with lock:
            done_bytes[0] += n

    failures, sizes = [], []

    def fetch(i: int) -> None:
        if stop.is_set():   # a worker that picks this shard up leaves it alone
            return
        try:
            download_file(f"{base_url.rstrip('/')}/{shard_name(i)}", out_dir / shard_name(i), retries=retries,
                          backoff=backoff, timeout=timeout, on_bytes=count)
        except DiskFullError:
            stop.set()
            raise

    bar = tqdm(total=len(indices), initial=len(indices) - len(todo), unit="shard",
               disable=not progress, dynamic_ncols=True)
    with bar, ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(fetch, i): i for i in todo}
        try:
            for fut in as_completed(futures):
                try:
                    fut.result()
                    sizes.append((out_dir / shard_name(futures[fut])).stat().st_size)
                except DownloadError as e:
                    failures.append((futures[fut], str(e)))
                bar.update(1)
                bar.set_postfix(MB=f"{done_bytes[0] / 1e6:.0f}", failed=len(failures))
                left = sum(not f.done() for f in futures)
                if sizes and left:
                    _check_room(out_dir, sizes, left)
        except BaseException as e:
            # without this the pool's exit ran every queued shard to the end before the error (or
            # Ctrl-C) surfaced; a full disk lets the shards in flight finish, anything else stops them
            stop.set()
            if not isinstance(e, DiskFullError):
                abort.set()
            for f in futures:
                f.cancel()
            raise
    return sorted(failures)
