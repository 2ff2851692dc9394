"""Downloading over HTTP: the mechanics behind `python -m nanochat.dataset`'s remote sources (the
source registry and the command line stay in nanochat/dataset.py, which re-exports DownloadError,
DiskFullError, download_file, download_shards and verify_text_shard), and the one download mechanism
other files reuse (nanochat/core_data.py fetches the CORE eval bundle with download_file).

One file (download_file): bytes go to `NAME.partial`, resumed with an HTTP Range request after a
dropped connection or an earlier run, from the same version of the file only (its ETag, else
Last-Modified, kept in `NAME.partial.version`, sent as If-Range: a file replaced on the server starts
over; spliced, its old head and new tail could pass for a shard when no sha256 is stated). Retryable
failures (network errors, 408/425/429/5xx, a short body, a stall, bad content) are retried with
exponential backoff, others (404, 403) fail at once (a 429 / 503 waits at least its Retry-After).
`retries` counts the tries in a row that got nowhere: a try whose connection dropped after it moved
the partial file on by 1 MiB or more is retried without counting (the backoff starts again), so a
250 MB shard through a link that drops every few tens of MB is not given up after 6 tries that each
got further; a restart from byte 0 moves nothing on (a server that ignores Range), except once per
call for a new file (the old one rejected, or replaced on the server): its bytes count from 0.
The result is verified (the size and sha256 the server states, then `verify`: by default a readable
parquet file with a string `text` column, the first row group decoding, every one when no sha256
was stated), fsynced, then renamed into place: a final name only ever holds a complete, verified
file. A per-file lock file (`NAME.lock`, POSIX flock: nanochat/file_lock.py) keeps two processes that
fetch the same file (torchrun ranks, two shells) off one .partial file; the second waits and keeps the
first one's result (a filesystem without locks gets a warning and no guard). A full disk (ENOSPC) is a
DiskFullError, not retried, with the partial file kept for a resume.

Stalls: requests' timeout bounds each recv, not the download, so a server that trickles a few bytes
at a time (100 B/s: 11 minutes per 64 KiB read, a day per shard) kept an attempt alive for ever.
A watcher thread per attempt abandons one that gets no full 64 KiB read within `stall_window`
seconds (default: the timeout, 60 s, i.e. under ~1 KiB/s): far below any usable link, so a slow but
working connection is never cut, while a fresh connection (another CDN node) is the likelier way
out. The watcher shuts the socket down, since the reading thread cannot notice anything while
it blocks; the attempt is retried and resumes from the .partial file.

Many files (download_shards): a thread pool, a tqdm bar of the shards on disk (failures in its
postfix), existing shards kept unless their footer does not read (then fetched again), a
free-space check after each finished shard (the bytes already in the unfinished shards' .partial
files counted as there), failures returned per shard.
Ctrl-C or an unexpected error stops the queued shards and the ones in flight at once: a shared
Cancel shuts down every connection being read (a worker blocked on a trickling server returns from
recv now, not after its next 64 KiB) and cuts short the backoff and lock waits; their .partial
files resume on the next run, and no final file is written by a stopped worker.
A worker still waiting for a server's first response is bounded by `timeout` (there is no socket
to shut yet).
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager, nullcontext
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Callable, Iterator

from nanochat.dataset import _RECREATE, open_text_shard, read_text_column, shard_name
from nanochat.errors import DataError, DiskFullError
from nanochat.file_lock import file_lock   # also re-exported: dataset_download.file_lock

_RETRYABLE_STATUS = {408, 425, 429, 500, 502, 503, 504}
_CHUNK = 1 << 16   # bytes per read: small, so a drop loses little; also the stall rule's unit
MAX_RETRY_AFTER = 300.0   # the longest Retry-After honoured: the hub's rate limits count over 5 minutes
_PROGRESS = 1 << 20   # a failed try that moved the file on by this much is not counted against retries


class DownloadError(RuntimeError):
    """A download that failed for good. `permanent`: the server refused the file itself (a 4xx
    status outside _RETRYABLE_STATUS, e.g. 404), so running the same command again cannot fetch it."""

    def __init__(self, message: str, *, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


class DownloadCancelled(Exception):
    """A download stopped because its Cancel was set (download_shards stopping on Ctrl-C or an
    error); its .partial file is kept for a resume and no final file was written."""


class _Retry(Exception):
    """A failed attempt that may succeed if tried again (network error, 5xx, a stall, bad content);
    `wait`: the seconds the server asked for before the next try (Retry-After), else 0."""

    def __init__(self, message: str, wait: float = 0.0):
        super().__init__(message)
        self.wait = wait


class Cancel:
    """A stop shared by downloads running in other threads. set() (from any thread: download_shards'
    main thread on Ctrl-C) marks it and shuts down the connection of every body being read, so a
    worker blocked in recv returns at once; downloads check it between reads, in backoff sleeps and
    while waiting for another downloader's lock, and then raise DownloadCancelled."""

    def __init__(self):
        self._event, self._lock = threading.Event(), threading.Lock()
        self._closers: set[Callable[[], None]] = set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        with self._lock:
            self._event.set()
            closers = list(self._closers)
        for close in closers:
            close()

    def check(self) -> None:
        if self._event.is_set():
            raise DownloadCancelled("download cancelled")

    def sleep(self, seconds: float) -> None:
        if self._event.wait(seconds):
            raise DownloadCancelled("download cancelled")

    @contextmanager
    def closing(self, close: Callable[[], None]) -> Iterator[None]:
        """Run close() if the cancel comes while the block runs (at once if it already came)."""
        with self._lock:
            cancelled = self._event.is_set()
            if not cancelled:
                self._closers.add(close)
        if cancelled:
            raise DownloadCancelled("download cancelled")
        try:
            yield
        finally:
            with self._lock:
                self._closers.discard(close)


def _pause(seconds: float, cancel: Cancel | None) -> None:
    """The backoff before a retry (up to 60 s): cut short by a cancel."""
    if cancel is None:
        time.sleep(seconds)
    else:
        cancel.sleep(seconds)


def _body_closer(resp) -> Callable[[], None]:
    """A function that makes a read blocked on resp's body, in another thread, return at once."""
    raw = resp.raw
    # the socket under http.client's reader, found now (the connection may have let go of it)
    sock = getattr(getattr(getattr(getattr(raw, "_fp", None), "fp", None), "raw", None), "_sock", None)

    def close():
        try:
            raw.shutdown()   # urllib3 >= 2.3: a shutdown of the socket for reading
            return
        except Exception:   # noqa: BLE001 - older urllib3, or a response that cannot: the socket
            pass            # itself (a closer runs in Cancel.set(), under a Ctrl-C: it never raises)
        if sock is not None:
            try:   # socket.socket's own shutdown: ssl's also drops the TLS state under the reader
                socket.socket.shutdown(sock, socket.SHUT_RD)
            except OSError:   # already closed
                pass
    return close


class _BodyWatch:
    """The stall rule for one response body (module docstring): a thread that wakes `window` s after
    the last full read and, if no read came since, marks the attempt stalled and shuts its socket."""

    def __init__(self, close: Callable[[], None], window: float):
        self.close, self.window = close, window
        self.last, self.stalled = time.monotonic(), False
        self.done = threading.Event()

    def tick(self) -> None:
        self.last = time.monotonic()

    def run(self) -> None:
        while not self.done.wait(max(0.0, self.last + self.window - time.monotonic())):
            if time.monotonic() - self.last >= self.window:
                self.stalled = True
                self.close()
                return


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


def check_size_sha(path: Path, *, size: int | None = None, sha256: str | None = None) -> None:
    """ValueError unless `path` has the expected size and sha256 (None: not checked)."""
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


def verify_text_shard(path: Path, *, size: int | None = None, sha256: str | None = None) -> None:
    """ValueError unless `path` has the expected size/checksum and is a parquet text shard. With a
    sha256 the first row group is decoded (corrupt pages behind a valid footer); without one (a
    mirror that states none) every row group is: a Range resume of a file the server replaced
    since is the old file's head spliced to the new one's tail, whose first row group may decode."""
    check_size_sha(path, size=size, sha256=sha256)
    pf = open_text_shard(path)
    for rg in range(min(pf.num_row_groups, 1 if sha256 else pf.num_row_groups)):
        read_text_column(pf, rg, path)   # decodes and checks UTF-8 in C++: no Python strings made


def _version_file(partial: Path) -> Path:
    return partial.with_name(partial.name + ".version")


def _server_version(resp) -> str | None:
    """This version of the file: a strong ETag (If-Range takes no weak one), else Last-Modified."""
    etag = (resp.headers.get("ETag") or "").strip()
    return etag if etag and not etag.startswith("W/") else (resp.headers.get("Last-Modified") or None)


def _known_version(partial: Path) -> str | None:
    """The version the partial bytes are of (None: not noted: the server stated none, or older code)."""
    try:
        known = _version_file(partial).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return known if known.isascii() and known.isprintable() else None   # sent as a header value


def _note_version(partial: Path, version: str | None) -> None:
    if version:
        _version_file(partial).write_text(version)
    else:
        _version_file(partial).unlink(missing_ok=True)


def _drop_partial(partial: Path) -> None:
    partial.unlink(missing_ok=True)
    _note_version(partial, None)


def _attempt(session, url: str, partial: Path, timeout: float, on_bytes, stall_window: float,
             cancel: Cancel | None) -> tuple[int | None, str | None]:
    have = partial.stat().st_size if partial.exists() else 0
    known = _known_version(partial) if have else None
    # identity: requests asks for gzip by default, and a server that takes up the offer sends a
    # Content-Length and byte ranges of the compressed body while iter_content yields it
    # decompressed, so the size check fails every attempt and a Range resume would splice
    # decompressed bytes at a compressed offset. If-Range: another version comes whole (a 200)
    headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {}),
               **({"If-Range": known} if known else {})}
    with session.get(url, headers=headers, stream=True, timeout=timeout) as resp:
        if resp.status_code == 416:  # nothing left to fetch: the partial file may be complete
            m = re.fullmatch(r"bytes \*/(\d+)", resp.headers.get("Content-Range", ""))
            # the sha256 still counts: the hub states it on the redirect before the 416
            return (int(m.group(1)) if m else have), _expected_from(resp)[1]
        if resp.status_code in _RETRYABLE_STATUS:
            wait = _retry_after(resp.headers) or 0.0
            raise _Retry(f"HTTP {resp.status_code}" + (f" (asked to wait {wait:g} s)" if wait else ""), wait)
        if resp.status_code not in (200, 206):
            raise DownloadError(f"HTTP {resp.status_code} for {url}", permanent=400 <= resp.status_code < 500)
        total, sha = _expected_from(resp)
        start, now = 0, _server_version(resp)
        if resp.status_code == 206:
            m = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
            start = int(m.group(1)) if m else -1
            if start != have:
                _drop_partial(partial)
                raise _Retry(f"server resumed at byte {start}, wanted {have}")
            if known and now and now != known:   # a server that ignores If-Range
                _drop_partial(partial)
                raise _Retry(f"the file changed on the server (version {now}, the partial file is of {known}); "
                             "starting over")
        with open(partial, "ab" if start else "wb") as f:
            if not start:   # noted once the partial is empty: it never names another version's bytes
                _note_version(partial, now)
            _read_body(resp, f, on_bytes, stall_window, cancel)
            f.flush()
            # on disk before the rename makes it a shard: after a power cut a renamed file whose
            # data never reached the disk would be an empty or short shard under a final name
            os.fsync(f.fileno())
    got = partial.stat().st_size
    if total is not None and got < total:
        raise _Retry(f"connection closed at byte {got} of {total}")
    return total, sha


def _retry_after(headers) -> float | None:
    """The seconds a 429 / 503 asks us to wait (Retry-After: seconds or an HTTP date; else the
    hub's `RateLimit: "...";r=0;t=SECONDS`), at most MAX_RETRY_AFTER; None when it says nothing.
    Retrying sooner, inside the server's window, is refused again and spends the retries."""
    value, wait = (headers.get("Retry-After") or "").strip(), None
    if value.isdigit():
        wait = float(value)
    elif value:
        try:
            wait = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):   # neither form: ignored, as the RFC allows
            wait = None
    if wait is None:
        m = re.search(r";\s*t=(\d+)", headers.get("RateLimit") or "")
        wait = float(m.group(1)) if m else None
    return None if wait is None else min(max(wait, 0.0), MAX_RETRY_AFTER)


def _read_body(resp, f, on_bytes, stall_window: float, cancel: Cancel | None) -> None:
    """Append resp's body to f under the stall rule; a cancel shuts the connection down at once.
    A shut socket ends the read with an error (or, without a Content-Length, as a normal end of
    the body), so what stopped it is checked after the loop either way: never taken as complete."""
    close = _body_closer(resp)
    watch = _BodyWatch(close, stall_window)
    watcher = threading.Thread(target=watch.run, name="download-stall-watch", daemon=True)
    with cancel.closing(close) if cancel is not None else nullcontext():
        watcher.start()
        try:
            for chunk in resp.iter_content(chunk_size=_CHUNK):
                f.write(chunk)
                watch.tick()
                on_bytes(len(chunk))
        except Exception as e:   # noqa: BLE001 - re-raised unless a stall or cancel caused it
            _raise_if_stopped(watch, cancel, f, e)
            raise
        finally:
            watch.done.set()
            watcher.join()
        _raise_if_stopped(watch, cancel, f, None)


def _raise_if_stopped(watch: _BodyWatch, cancel: Cancel | None, f, cause: Exception | None) -> None:
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return   # a full disk says more than a stall at the same moment: download_file reports it
    if cancel is not None and cancel.is_set():
        raise DownloadCancelled(f"download cancelled at byte {f.tell()}") from cause
    if watch.stalled:
        raise _Retry(f"stalled: less than {_CHUNK // 1024} KiB arrived in {watch.window:g} s "
                     f"(at byte {f.tell()}); the partial file is kept") from cause


def _readable_shard(path: Path) -> bool:
    """True when `path` exists and its parquet footer reads as a text shard (no data is read)."""
    try:
        open_text_shard(path)
    except DataError:
        return False
    return True


def _finished(dest: Path, verify) -> bool:
    """True when dest is there and passes `verify` (what another downloader left)."""
    if not dest.exists():
        return False
    try:
        verify(dest)
    except ValueError:
        return False
    return True


def download_file(url: str, dest: Path, *, retries: int = 5, backoff: float = 2.0,
                  timeout: float = 60.0, on_bytes=lambda n: None, stall_window: float | None = None,
                  cancel: Cancel | None = None, verify=verify_text_shard) -> None:
    """Download url to dest: resume a partial file (HTTP Range), retry with exponential backoff
    (`retries`: tries in a row that got nowhere; module docstring), verify, then atomically rename.
    Raises DownloadError (naming url, chained to the last attempt's error) after the last attempt.
    Another process downloading the same dest is waited for, and its finished file kept; so is a
    dest already there that passes `verify`.

    stall_window: seconds an attempt may go without a full 64 KiB read before it is abandoned and
    retried (default: timeout; module docstring). cancel: a Cancel that stops this download from
    another thread (DownloadCancelled). verify(path, size=, sha256=): raises ValueError for a file
    that must not be kept (it is deleted and fetched again from byte 0); default: a text shard."""
    import requests

    window = timeout if stall_window is None else stall_window
    if not (isinstance(window, (int, float)) and window > 0):
        raise ValueError(f"stall_window: got {stall_window!r}; accepted: seconds > 0 (or None: the timeout)")
    partial = dest.with_name(dest.name + ".partial")
    last, cause = "no attempt made", None

    def on_wait():   # while another downloader holds the lock: download_shards' counter raises to stop
        on_bytes(0)
        if cancel is not None:
            cancel.check()

    with file_lock(dest, on_wait=on_wait), requests.Session() as session:
        # not only after a wait: another process can finish dest between the caller's look
        # (download_shards' listing) and this lock; fetching it again cost a whole shard per rank
        if _finished(dest, verify):
            return
        # failed: tries in a row that got nowhere. A try that moved the partial file on past its
        # furthest byte by _PROGRESS is not one (module docstring): `attempts` can pass retries + 1
        failed, attempts, furthest = 0, 0, _size(partial)
        fresh_starts = 1   # a new file (rejected, or replaced on the server): its bytes count from 0, once
        while True:
            attempts += 1
            before = _known_version(partial) if _size(partial) else None
            rejected = False
            try:
                total, sha = _attempt(session, url, partial, timeout, on_bytes, window, cancel)
                try:
                    verify(partial, size=total, sha256=sha)
                except ValueError as e:  # corrupt content: start over from byte 0
                    why = _what_came(partial, e) if verify is verify_text_shard else str(e)
                    _drop_partial(partial)
                    rejected = True
                    raise _Retry(f"verification failed: {why}") from e
                os.replace(partial, dest)
                _note_version(partial, None)
                return
            except _Retry as e:
                last, cause, wait = str(e), e.__cause__ or e, e.wait
            except OSError as e:  # requests' errors are OSErrors too
                if e.errno in (errno.ENOSPC, errno.EDQUOT):  # no retry can help
                    raise _disk_full(dest) from e
                if not isinstance(e, requests.RequestException):
                    raise
                last, cause, wait = f"{type(e).__name__}: {e}", e, 0.0  # the partial file is kept and resumed
            got = _size(partial)   # measured after a rejected file was dropped: a restart is no progress
            after = _known_version(partial) if got else None
            replaced = before is not None and after != before   # a 200 of another version, or a 206 of one dropped
            if fresh_starts and (rejected or replaced):
                # the old bytes are gone for good: the new file's progress counts from byte 0. Once
                # only: two CDN nodes stating different versions, or a file that is always rejected,
                # would otherwise restart (and make "progress") for ever
                fresh_starts, furthest = 0, 0
            failed, furthest = (0 if got >= furthest + _PROGRESS else failed + 1), max(furthest, got)
            if retries == 0 or failed > retries:
                break
            _before_retry(dest, last, failed, retries, backoff, wait, got, cancel)
    tail = f" (the last {failed} without progress)" if 0 < failed < attempts else ""
    raise DownloadError(f"{url}: failed after {attempts} attempts{tail}; last error: {last}") from cause


def _before_retry(dest: Path, last: str, failed: int, retries: int, backoff: float, wait: float, got: int,
                  cancel: Cancel | None) -> None:
    """Say the retry, with its cause, then wait: `backoff` doubling per try that got nowhere (the
    exponent capped: 2 ** 1024 overflows a float), at least what the server asked for."""
    delay = max(min(backoff * 2 ** min(max(failed - 1, 0), 16), 60.0), wait)
    # said, not only waited: a 429's Retry-After (up to 5 min) per retry was minutes of a frozen
    # progress bar that looked like a hang, and the cause came only at the end
    which = (f"retry {failed} of {retries}" if failed else
             f"it moved the file on to byte {got}, so retrying (not counted as a retry)")
    print(f"{dest.name}: {last}; {which} in {delay:g} s", file=sys.stderr)
    _pause(delay, cancel)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _what_came(partial: Path, error: ValueError) -> str:
    """Why a text shard's download was rejected (verify_text_shard's; other files, e.g. the eval
    bundle's zip, keep their own check's words), for the message: the check's own text, without the advice for
    a shard already on disk (delete it, re-create it: this file is deleted and fetched again), and,
    when the body is not parquet at all (an HTML error page or a proxy's login page sent with 200),
    how it starts: what the user needs to see what the server sent."""
    why = str(error).removesuffix(f"; {_RECREATE}")
    try:
        with open(partial, "rb") as f:
            head = f.read(64)
    except OSError:
        return why
    if head[:4] != b"PAR1":
        why += f" (the server sent {partial.stat().st_size} bytes starting {head!r}, not a parquet file)"
    return why


def _disk_full(dest: Path) -> DiskFullError:
    from nanochat.common import fmt_bytes  # not at the top: nanochat.common imports torch
    return DiskFullError(f"{dest.parent}: the disk filled while downloading {dest.name} "
                         f"({fmt_bytes(shutil.disk_usage(dest.parent).free)} free); free space and "
                         "rerun: finished files are kept and the partial one resumes")


def _check_room(out_dir: Path, sizes: list[int], left: list[int]) -> None:
    """DiskFullError when the shards `left` (at the mean size of those finished) would not fit:
    better to stop with the finished ones kept than to fill the disk to the last byte. What their
    .partial files hold (the shards in flight, or resumed from an earlier run) is on the disk
    already, and counted: near the end, the last shards in flight, nearly done, each counted whole
    stopped a download whose every shard then finished on disk, with exit 2."""
    each = sum(sizes) / len(sizes)
    held = [_size(out_dir / (shard_name(i) + ".partial")) for i in left]
    need, have = sum(max(each - h, 0) for h in held), sum(min(h, each) for h in held)
    free = shutil.disk_usage(out_dir).free
    if free < need:
        from nanochat.common import fmt_bytes  # not at the top: nanochat.common imports torch
        raise DiskFullError(f"{out_dir}: {len(left)} more shards need ~{fmt_bytes(need)} (~{fmt_bytes(each)} each), "
                            f"{fmt_bytes(free)} free; free space (or ask for fewer with -n) and rerun: the "
                            f"{len(sizes)} finished this time are kept"
                            + (f"; the {fmt_bytes(have)} already in their .partial files are counted" if have else ""))


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
                    progress: bool = True, stall_window: float | None = None) -> list[tuple[int, str]]:
    """Download shard indices into out_dir in parallel; returns [(index, DownloadError)] for failures.
    stall_window: as download_file's (default: timeout)."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    todo = _to_fetch(indices, out_dir)
    lock, done_bytes = threading.Lock(), [0]
    # stop: start no more shards (the disk is full, or we are stopping); cancel: also stop the ones
    # in flight now (Ctrl-C: their connections are shut), their .partial files kept for a resume
    stop, cancel = threading.Event(), Cancel()

    def count(n):
        cancel.check()
        with lock:
            done_bytes[0] += n

    failures, sizes = [], []

    def fetch(i: int) -> bool:
        """True when the shard is now in out_dir; False when a stop came before it started."""
        if stop.is_set():   # a worker that picks this shard up leaves it alone
            return False
        try:
            download_file(f"{base_url.rstrip('/')}/{shard_name(i)}", out_dir / shard_name(i), retries=retries,
                          backoff=backoff, timeout=timeout, on_bytes=count, stall_window=stall_window,
                          cancel=cancel)
        except DiskFullError:
            stop.set()
            raise
        return True

    bar = tqdm(total=len(indices), initial=len(indices) - len(todo), unit="shard",
               disable=not progress, dynamic_ncols=True)
    with bar, ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(fetch, i): i for i in todo}
        try:
            for fut in as_completed(futures):
                try:
                    # a shard skipped after a full disk elsewhere has no file: its future can come
                    # before the DiskFullError's (stat() then raised FileNotFoundError instead)
                    if fut.result():
                        sizes.append((out_dir / shard_name(futures[fut])).stat().st_size)
                        bar.update(1)   # shards on disk only: a failed one ended the bar on "4/4" too
                except DownloadError as e:
                    failures.append((futures[fut], e))
                bar.set_postfix(MB=f"{done_bytes[0] / 1e6:.0f}", failed=len(failures))
                left = [i for f, i in futures.items() if not f.done()]
                if sizes and left:
                    _check_room(out_dir, sizes, left)
        except BaseException as e:
            # without this the pool's exit ran every queued shard to the end before the error (or
            # Ctrl-C) surfaced; a full disk lets the shards in flight finish, anything else stops them
            stop.set()
            if not isinstance(e, DiskFullError):
                cancel.set()   # from this thread: workers blocked in recv return now, not at their next chunk
            for f in futures:
                f.cancel()
            raise
    return sorted(failures)

