"""tokenizer.pkl's file handling, for nanochat/tokenizer.py: an unpickler that refuses every global
(the file holds only plain data) and checks its opcodes' lengths and memo indices before the C
unpickler trusts them, and atomic writes of several files at once (all staged, then replaced, then
their directory synced)."""

from __future__ import annotations

import os
import pickle
import secrets
from pathlib import Path


class _SafeUnpickler(pickle.Unpickler):
    """tokenizer.pkl holds only dict/list/str/bytes/int, so any global lookup means tampering."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in tokenizer file")


def _check_pickle_bounds(data: bytes) -> None:
    """ValueError unless every opcode in `data` is whole and every memo index is below the number of
    opcodes before it. The C unpickler trusts both fields: one flipped byte in a length or memo index
    made it allocate what the field says before noticing the file is short (MemoryError, or a
    zero-filled memo table of up to 32 GB that got the process OOM-killed). pickletools reads each
    length against the bytes it has, so checking costs time in the file's size and no memory."""
    import pickletools  # only loads need it (it builds its opcode tables at import)

    for n, (op, arg, pos) in enumerate(pickletools.genops(data)):  # ValueError on a cut-off opcode
        if op.name in ("PUT", "BINPUT", "LONG_BINPUT") and not 0 <= arg <= n:
            raise ValueError(f"memo index {arg} at byte {pos} is beyond the {n} opcodes before it")


def _stage(path: Path, write) -> str:
    """Write a temp file beside `path` (flushed and fsynced) and return its name; os.replace puts it
    in place. The temp file is created with mode 0o666 less the umask, like a plain open(): mkstemp's
    0o600 would make the tokenizer unreadable to other users of a shared base dir."""
    tmp = str(path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _atomic_write_all(files: list[tuple[Path, object]]) -> None:
    """Write every (path, write) pair through temp files and os.replace, then fsync their
    directories. All temp files are written before the first replace: a failure while writing
    (disk full, Ctrl-C) leaves the previous files as they were, never a new tokenizer.pkl beside
    the old token_bytes.pt."""
    staged: list[tuple[str, Path]] = []
    try:
        for path, write in files:
            staged.append((_stage(path, write), path))
        while staged:
            tmp, path = staged[0]
            os.replace(tmp, path)
            staged.pop(0)
    finally:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
    # a file's own fsync makes its bytes durable, not the rename that named it: without the
    # directory's, a power cut after a save could bring back the old tokenizer.pkl (or one new file
    # of the pair beside an old one). (torch is loaded already: the pair's token_bytes.pt is torch.save's)
    from nanochat.checkpoint_io import fsync_dir
    for directory in dict.fromkeys(path.parent for path, _ in files):
        fsync_dir(directory)
