"""One writer per destination file: `file_lock(dest)` holds an exclusive POSIX flock on a sibling
`NAME.lock` while `dest` is written, so two processes (torchrun ranks, two shells) or two threads
fetching the same file never share its `.partial` file; the second one waits and then sees the
first one's result. Used by nanochat/dataset_download.py (each shard), nanochat/core_data.py
(the CORE eval bundle) and nanochat/report.py (a section's read-append-replace).

flock is released by the kernel when its holder dies, so a crash leaves no stale lock. A waiter
polls instead of blocking, so that a Ctrl-C the main thread receives can stop a worker thread that
waits. A filesystem without locks (ENOSYS, EOPNOTSUPP, ENOLCK, EINVAL: e.g. Lustre mounted without
flock, some FUSE filesystems) gets one warning per directory and no guard: writing unguarded beats
refusing to write at all. Windows has no flock: there writers are not guarded against each other.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

_NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL}  # e.g. Lustre without flock, FUSE
_warned_no_locks: set[Path] = set()


@contextmanager
def file_lock(dest: Path, on_wait=lambda: None) -> Iterator[bool]:
    """Hold an exclusive lock for writing `dest` (a file or a directory: the lock is a sibling
    `NAME.lock`); yields True when another holder (a process or thread writing the same dest) had
    it first and may have finished dest meanwhile.
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
    """Once per directory: writing unguarded beats refusing to write at all."""
    if directory not in _warned_no_locks:
        _warned_no_locks.add(directory)
        print(f"{directory}: this filesystem has no file locks ({error.strerror}); two writers "
              "of one file in it at once (downloads, report sections) are not kept apart", file=sys.stderr)
