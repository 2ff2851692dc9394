"""The pretokenize run record of a binary token shard directory (format: nanochat/binshards.py):
what `meta.json` says the directory is meant to hold, and the checks readers make against it.

A run first confirms the tokenizer (`write_meta`, `check_tokenizer`), then writes `complete: false`
with the text shards it plans to tokenize (`start_run`), records each shard as it lands
(`record_shard`: the text shard name -> size a binary shard was made from, `text_shards`), and only
at the end writes `complete: true` (`record_text_shards`). Readers call `check_complete` before
anything else: an unfinished directory (an interrupted run leaves some shards, and its LAST one is
then a train shard) or one whose binary shards differ from the recorded text shards is a DataError
naming the directory and the command that finishes it; `stale_reason` then tells when the text
shards changed since (`check_fresh` does both, once per process while nothing changes). Besides each
text shard's size, a run records its mtime_ns (`text_mtime_ns`) and sha256 (`text_sha256`, hashed by
the worker as it tokenizes: ~0.1 s a 100 MB shard against its tokenizing time): a reader compares
size + mtime_ns (a stat per shard: cheap at every loader start, where hashing 100+ shards of ~100 MB
would read 10+ GB) and hashes only the shards whose mtime moved (a rewrite at the same size is stale;
a copy without its times, or `touch`, has the recorded sha256 and is not); pretokenize does the same
(`text_shard_unchanged`), keeping such a binary shard and recording the new mtime. A directory
recorded before these keys has its sizes compared only. Directories written before `complete`
existed count as complete when they carry the `text_shards` record (older ones still: when their
shards match the text shards by name).

`split_paths` is the train/val split of a finished directory (the last shard is val).

One run at a time: `run_lock` holds a record lock (lockf) on `.pretokenize.lock` in the directory while a run
writes it (a second run into the same --out is refused, naming the first: two would delete each
other's "stray" shards and lose each other's records). Each shard's sha256 is recorded as it lands
(`bin_sha256`, the file's plain sha256, so `sha256sum` agrees); `verify` reads every shard whole
and names those damaged since (a flipped bit in a token passes every cheaper check).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from nanochat.binshards import (BIN_SUFFIX, MAGIC, META_NAME, VERSION, BinShard, _text_dir_of, _write_meta_file,
                                dtype_for_vocab, list_bin_shards, read_header, read_meta)
from nanochat.errors import DataError, MissingDataError, RequestError

LOCK_NAME = ".pretokenize.lock"


def check_tokenizer(bin_dir: str | Path, fingerprint: str, what: str = "binary shards") -> None:
    """DataError if `bin_dir` was written with a different tokenizer than `fingerprint`."""
    meta = read_meta(bin_dir)
    found = [meta.get("fingerprint")] if meta is not None else []
    for p in list_bin_shards(bin_dir):  # shard headers too: meta.json may have been deleted
        try:
            found.append(read_header(p).fingerprint)
        except ValueError:  # a corrupt shard is reported by whoever reads it
            pass
    for other in found:
        if other != fingerprint:
            raise DataError(
                f"tokenizer mismatch: {what} in {bin_dir} were made with tokenizer "
                f"{str(other)[:12]}, the current tokenizer is {fingerprint[:12]}; re-run "
                "`python -m scripts.pretokenize` with --force to replace them, or move that directory "
                "aside (training then tokenizes the text shards as it reads them)")


_RUN_KEYS = ("text_shards", "text_mtime_ns", "text_sha256", "bin_sha256", "planned", "complete",
             "data_dir")  # what a run records, see the docstring


def write_meta(bin_dir: str | Path, *, fingerprint: str, vocab_size: int, bos_token_id: int,
               replace: bool = False) -> list[Path]:
    """Create or confirm meta.json; refuses (DataError) a directory made with another tokenizer,
    unless `replace` (pretokenize --force): then that tokenizer's shards and record are deleted
    first. Returns the binary shards deleted."""
    bin_dir = Path(bin_dir)
    dtype = dtype_for_vocab(vocab_size)  # a vocab no shard can hold: before anything is touched
    bin_dir.mkdir(parents=True, exist_ok=True)
    before = read_meta(bin_dir) or {}
    removed = _remove_other_tokenizer(bin_dir, fingerprint) if replace else []
    replaced = replace and before.get("fingerprint", fingerprint) != fingerprint
    check_tokenizer(bin_dir, fingerprint, "existing shards")
    meta = {"format": "nanochat-tokens", "version": VERSION, "fingerprint": fingerprint,
            "vocab_size": vocab_size, "bos_token_id": bos_token_id, "dtype": dtype.name}
    old = read_meta(bin_dir) or {}
    if old.get("fingerprint") == fingerprint:
        # kept as they are: dropping `complete: false` here would make an unfinished directory
        # look finished to a reader if this run died before start_run
        meta.update({k: old[k] for k in _RUN_KEYS if k in old})
    if removed or replaced:  # unfinished until this run's start_run records what it will write
        meta.update(complete=False, planned={})
    _write_meta_file(bin_dir, meta)
    return removed


def _remove_other_tokenizer(bin_dir: Path, fingerprint: str) -> list[Path]:
    """Delete the binary shards (and meta.json) made with another tokenizer than `fingerprint`;
    shards whose header does not read are left to the run, which rewrites them."""
    removed = []
    for p in list_bin_shards(bin_dir):
        try:
            other = read_header(p).fingerprint != fingerprint
        except ValueError:
            continue
        if other:
            p.unlink()
            removed.append(p)
    meta = read_meta(bin_dir)
    if meta is not None and meta.get("fingerprint") != fingerprint:
        (bin_dir / META_NAME).unlink()
    return removed


def text_shard_record(text_shards: Iterable[str | Path]) -> dict[str, int]:
    """{file name: size in bytes} of text shards: what a binary shard directory was made from."""
    return {Path(p).name: Path(p).stat().st_size for p in text_shards}


def file_sha256(path: str | Path) -> str:
    """sha256 hex of a file's bytes (a text shard's content, read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _record(meta: dict, key: str) -> dict:
    return meta.get(key) if isinstance(meta.get(key), dict) else {}


def text_shard_unchanged(path: str | Path, meta: dict) -> tuple[bool, str | None]:
    """(whether the text shard at `path` is the one `meta` recorded, its sha256 when this call had
    to hash it). Another size: no. Same size and mtime_ns: yes, unread. Same size, the mtime moved
    (rewritten, or copied without its times: cp -r, scp, a second node's copy): yes when its
    sha256 is the recorded one. No mtime recorded (a directory from before the record): the size
    decides. Not recorded in a directory that records its shards: no (a run that died between
    writing the binary shard and recording it leaves one that nothing ties to this text, which may
    have changed since). The one freshness rule of pretokenize (what to redo) and the loader
    (stale_reason)."""
    path = Path(path)
    st, name = path.stat(), path.name
    sizes, mtimes = _record(meta, "text_shards"), _record(meta, "text_mtime_ns")
    if name not in sizes:  # no record at all: a directory from before records, taken as it is
        return not isinstance(meta.get("text_shards"), dict), None
    if sizes[name] != st.st_size:
        return False, None
    if name not in mtimes or mtimes[name] == st.st_mtime_ns:
        return True, None
    sha = file_sha256(path)
    return sha == _record(meta, "text_sha256").get(name), sha


def _meta_for_update(bin_dir: Path) -> dict:
    meta = read_meta(bin_dir)
    if meta is None:
        raise DataError(f"{bin_dir / META_NAME}: missing; re-run `python -m scripts.pretokenize`")
    return meta


def _stems(names: Iterable[str]) -> set[str]:
    return {Path(n).stem for n in names}


def start_run(bin_dir: str | Path, text_shards: Sequence[str | Path], data_dir: str | Path | None = None) -> list[Path]:
    """Mark bin_dir unfinished (`complete: false`) and record the text shards it is meant to hold,
    BEFORE any shard is written, so that a reader never takes a half-made directory for a whole
    one. Binary shards without a text shard in the plan are deleted (their text shard is gone: left
    there they would shift the train/val split), as are temp files of writers no longer running;
    other `.bin` files (foreign_bin_files) are a ValueError, before anything changes. Returns the
    binary shards deleted. write_meta must have run (tokenizer check, directory)."""
    bin_dir = Path(bin_dir)
    meta = _meta_for_update(bin_dir)
    plan = text_shard_record(text_shards)
    foreign = foreign_bin_files(bin_dir, text_shards)
    if foreign:  # pretokenize refuses these before any work; deleting them would lose someone's data
        raise ValueError(f"{bin_dir} holds {_names(p.stem for p in foreign)}, not binary token shards; "
                         "accepted: a directory of binary token shards only")
    meta.update(complete=False, planned=plan)
    for key in ("text_shards", "text_mtime_ns", "text_sha256"):  # kept for the shards still planned
        meta[key] = {n: v for n, v in _record(meta, key).items() if n in plan}
    meta["bin_sha256"] = {n: v for n, v in _record(meta, "bin_sha256").items() if Path(n).stem in _stems(plan)}
    if data_dir is not None:
        meta["data_dir"] = str(Path(data_dir).resolve())
    _write_meta_file(bin_dir, meta)
    strays = [p for p in list_bin_shards(bin_dir) if p.stem not in _stems(plan)]
    for p in strays:
        p.unlink()
    _remove_dead_temps(bin_dir)
    return strays


def foreign_bin_files(bin_dir: str | Path, text_shards: Iterable[str | Path]) -> list[Path]:
    """`.bin` files of bin_dir that a run would delete as strays (no text shard of that name) but
    that lack MAGIC: someone else's files (an --out that held e.g. pytorch_model.bin)."""
    def ours(path: Path) -> bool:
        try:
            with open(path, "rb") as f:
                return f.read(len(MAGIC)) == MAGIC
        except OSError:  # unreadable, or a directory named *.bin: not ours to delete
            return False
    stems = _stems(Path(p).name for p in text_shards)
    return [p for p in list_bin_shards(bin_dir) if p.stem not in stems and not ours(p)]


def _remove_dead_temps(bin_dir: Path) -> None:
    """Delete `.NAME.PID.tmp` files (write_shard, _write_meta_file) whose writer is gone: a run
    killed by a signal does not reach write_shard's cleanup."""
    for tmp in bin_dir.glob(".*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (another pretokenize on this directory): leave it alone
        except ProcessLookupError:
            pass
        except PermissionError:  # alive, another user's
            continue
        tmp.unlink(missing_ok=True)


def record_shard(bin_dir: str | Path, text_name: str, size: int, mtime_ns: int | None = None,
                 sha256: str | None = None, *, bin_sha256: str | None = None) -> None:
    """Record that the binary shard of text shard `text_name` (`size` bytes, modified at
    `mtime_ns`, content `sha256`, as stat-ed and hashed before it was read) is written, its own
    bytes hashing to `bin_sha256` (None: the record of that is left as it is)."""
    meta = _meta_for_update(Path(bin_dir))
    for key, value in (("text_shards", size), ("text_mtime_ns", mtime_ns), ("text_sha256", sha256)):
        made = {n: v for n, v in _record(meta, key).items() if n != text_name}
        meta[key] = {**made, text_name: value} if value is not None else made
    if bin_sha256 is not None:
        meta["bin_sha256"] = {**_record(meta, "bin_sha256"), Path(text_name).stem + BIN_SUFFIX: bin_sha256}
    _write_meta_file(Path(bin_dir), meta)


def record_text_shards(bin_dir: str | Path, text_shards: Iterable[str | Path]) -> None:
    """Mark bin_dir complete: every binary shard is written, made from `text_shards` (names +
    sizes, recorded). DataError if one of them is missing."""
    bin_dir = Path(bin_dir)
    meta = _meta_for_update(bin_dir)
    record = text_shard_record(text_shards)
    missing = sorted(_stems(record) - {p.stem for p in list_bin_shards(bin_dir)})
    if missing:
        raise DataError(f"{bin_dir}: binary shards {', '.join(missing[:3])} missing at the end of the run; "
                        f"{_rerun(bin_dir, meta)}")
    meta = {k: v for k, v in meta.items() if k != "planned"}
    _write_meta_file(bin_dir, {**meta, "text_shards": record, "complete": True})


def _rerun(bin_dir: Path, meta: dict, data_dir: str | Path | None = None) -> str:
    """The command that finishes or redoes bin_dir (finished shards are kept and skipped)."""
    return (f"re-run `python -m scripts.pretokenize --data-dir {data_dir or _text_dir_of(bin_dir, meta)} --out "
            f"{bin_dir}` (shards already written are kept), or delete {bin_dir} to read the text shards instead")


def _names(stems: Iterable[str]) -> str:
    names = sorted(s + BIN_SUFFIX for s in stems)
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")


def check_complete(bin_dir: str | Path, text_shards: Sequence[Path] | None = None) -> None:
    """DataError (naming bin_dir and the command to rerun) unless bin_dir holds every binary shard
    it is meant to: not when its run did not finish (`complete: false`), nor when its binary shards
    are not exactly those of the text shards recorded in meta.json, or, for a directory from before
    that record, of `text_shards` (those now in the data directory; nothing to compare without).
    An empty or missing directory passes: the caller reports that there are no shards."""
    bin_dir = Path(bin_dir)
    meta = read_meta(bin_dir)
    have = {p.stem for p in list_bin_shards(bin_dir)}
    if meta is None:
        if have:
            raise DataError(f"{bin_dir}: binary shards without {META_NAME}, so nothing says they are all "
                            f"there; {_rerun(bin_dir, {})}")
        return
    data_dir = text_shards[0].parent if text_shards else None
    if meta.get("complete") is False:
        planned = _stems(meta.get("planned") or {})
        missing = planned - have
        raise DataError(f"{bin_dir} is incomplete: the pretokenize run writing it did not finish "
                        f"({len(planned & have)} of {len(planned)} binary shards written"
                        f"{'; missing: ' + _names(missing) if missing else ''}); {_rerun(bin_dir, meta, data_dir)}")
    record = meta.get("text_shards")
    if isinstance(record, dict):
        want, where = _stems(record), f"the {len(record)} text shards recorded in its {META_NAME}"
    elif text_shards:
        want, where = _stems(p.name for p in text_shards), f"the {len(text_shards)} text shards in {data_dir}"
    else:
        return
    if want != have:
        diff = "; ".join(f"{what}: {_names(names)}" for what, names in
                         (("missing", want - have), ("extra", have - want)) if names)
        raise DataError(f"{bin_dir} holds {len(have)} binary shards, not one for each of {where} ({diff}); "
                        f"{_rerun(bin_dir, meta, data_dir)}")


def stale_reason(bin_dir: str | Path, text_shards: list[Path]) -> str | None:
    """Why the binary shards of bin_dir do not match `text_shards` (their names, sizes and, when
    recorded, mtime_ns now, then sha256 where the mtime moved: a shard rewritten at the same size
    is "modified since", a copy of the same bytes is not), or
    None when they match, or when there is nothing to compare (an older directory without a
    record, or no text shards at all: reading the binary shards alone is fine). Meaningful for a
    finished directory only: call check_complete first."""
    meta = read_meta(bin_dir)
    recorded = meta.get("text_shards") if meta is not None else None
    if not isinstance(recorded, dict) or not text_shards:
        return None
    now = text_shard_record(text_shards)
    strays = sorted(p.name for p in list_bin_shards(bin_dir) if p.stem not in {Path(n).stem for n in now})
    changed = sorted(n for n in now.keys() & recorded.keys() if now[n] != recorded[n])
    paths = {Path(p).name: Path(p) for p in text_shards}
    # same size, yet not the recorded content (only shards whose mtime moved are hashed)
    touched = sorted(n for n in now.keys() & recorded.keys()
                     if now[n] == recorded[n] and not text_shard_unchanged(paths[n], meta)[0])
    if now == recorded and not strays and not touched:
        return None
    parts = [f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
             for what, names in (("changed", changed), ("modified since at the same size", touched),
                                 ("new", sorted(now.keys() - recorded.keys())),
                                 ("gone", sorted(recorded.keys() - now.keys())),
                                 ("binary shards without a text shard", strays)) if names]
    return "; ".join(parts)


_FRESH: set[tuple] = set()  # binary shard directories found fresh, with the stats of every file checked


def _stat_key(path: Path) -> tuple:
    st = path.stat() if path.exists() else None
    return (st.st_size, st.st_mtime_ns, st.st_ino) if st else (None,)


def check_fresh(bin_dir: Path, text_shards: list[Path], data_dir: Path) -> None:
    """DataError unless bin_dir is a finished pretokenize run (an interrupted one would train on some
    shards and validate on a train shard) made from `text_shards` (those of data_dir, when pretokenize
    recorded them and there are any): stale_reason's rule. Text shards whose mtime moved (a copy
    without its times) are hashed whole: once per process while nothing changes, not for every
    loader (base_train makes one per evaluation; a full data dir takes minutes)."""
    files = [bin_dir / META_NAME, *list_bin_shards(bin_dir), *text_shards]
    seen = (str(bin_dir.resolve()), tuple((str(p), *_stat_key(p)) for p in files))
    if seen in _FRESH:
        return
    check_complete(bin_dir, text_shards)
    why = stale_reason(bin_dir, text_shards)
    if why is not None:
        raise DataError(f"{bin_dir} was made from other text shards than {data_dir} ({why}); re-run "
                        f"`python -m scripts.pretokenize --data-dir {data_dir} --out {bin_dir}` (it redoes "
                        "only the text shards that changed; --force redoes all), or delete "
                        f"{bin_dir} to read the text shards")
    _FRESH.add(seen)


def split_paths(bin_dir: Path, split: str) -> list[Path]:
    """The binary shards of `split` in a finished directory: the last one is val, the others train."""
    check_complete(bin_dir)  # asked for explicitly too: an unfinished run's last shard is not val
    paths = list_bin_shards(bin_dir)
    if len(paths) < 2:
        raise MissingDataError(f"need at least 2 binary token shards (train + val) in {bin_dir}, "
                               f"found {len(paths)}; create them with `python -m scripts.pretokenize`, or move {bin_dir} "
                               "aside (training then tokenizes the text shards as it reads them)")
    return paths[:-1] if split == "train" else paths[-1:]


# ---------------------------------------------------------------- one run at a time, verification

def _lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "a run that has not written its description yet"
    except OSError:
        return "another process"


@contextlib.contextmanager
def run_lock(bin_dir: str | Path) -> Iterator[None]:
    """Hold bin_dir's pretokenize lock (a POSIX record lock on LOCK_NAME, which the kernel drops when
    the process dies: nothing stale after a kill) for the block, with who holds it written into the
    file. A record lock, not flock: a flock belongs to the open file, which forked pool workers share,
    so after a kill -9 of the run the lock lived on in its orphaned workers. A directory another run
    holds is a RequestError naming that run. A file system without locks goes on unlocked, with a
    warning. (This process must not open and close LOCK_NAME meanwhile: that drops a record lock.)"""
    import fcntl

    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                print(f"WARNING: {bin_dir}: this file system has no file locks; going on without the "
                      "one-pretokenize-run-per-directory check", file=sys.stderr)
            else:
                raise RequestError(
                    f"--out: {bin_dir} is being written by another pretokenize run ({_lock_holder(path)}); two "
                    "runs into one directory delete and overwrite each other's shards: let it finish (a rerun "
                    "then has nothing left to do), stop it (its rerun resumes), or pass another --out") from None
        else:
            os.ftruncate(fd, 0)
            who = " ".join([Path(sys.executable).name, *sys.argv])[:300]
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                          f"{who}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


def shard_problem(path: Path, meta: dict) -> str | None:
    """What is wrong with the binary shard at `path`, read whole, or None: its header, size,
    offsets and BOS starts (BinShard), its tokenizer against meta.json's, token ids within the
    vocab, and its sha256 against the one recorded when it was written (when recorded)."""
    try:
        sh = BinShard(path)
    except DataError as e:
        return str(e).split("; delete it")[0].removeprefix(f"{path}: ")
    try:
        h = sh.header
        if meta.get("fingerprint") not in (None, h.fingerprint):
            return (f"made with tokenizer {h.fingerprint[:12]}, {META_NAME} says "
                    f"{str(meta.get('fingerprint'))[:12]}")
        top = int(sh.tokens.max()) if h.n_tokens else 0
        if top >= h.vocab_size:
            return f"token id {top} >= its vocab size {h.vocab_size}"
    finally:
        del sh
    want = _record(meta, "bin_sha256").get(path.name)
    if want is not None and file_sha256(path) != want:
        return ("its bytes differ from the sha256 recorded when it was written (a flipped bit on the disk, "
                "or a copy or edit since)")
    return None


def verify(bin_dir: str | Path, data_dir: str | Path | None = None, log=print) -> int:
    """Read every binary shard of bin_dir whole (shard_problem) and check the directory is a
    finished run (check_complete). DataError naming every damaged shard and how to re-make just
    those; returns the number of shards checked."""
    bin_dir = Path(bin_dir)
    paths = list_bin_shards(bin_dir)
    meta = read_meta(bin_dir)
    if meta is None or not paths:
        raise MissingDataError(f"{bin_dir}: no binary token shards{'' if meta is None else ' (only ' + META_NAME + ')'} "
                               "to verify; make them with `python -m scripts.pretokenize`")
    check_complete(bin_dir)
    bad, unhashed = [], 0
    for p in paths:
        why = shard_problem(p, meta)
        unhashed += p.name not in _record(meta, "bin_sha256")
        log(f"{p.name}: {'DAMAGED: ' + why if why else 'ok'}")
        if why:
            bad.append((p, why))
    if unhashed:
        log(f"{unhashed} of {len(paths)} shards have no recorded sha256 (written before pretokenize recorded "
            "one): their structure and token ids were checked, not every byte")
    if bad:
        listed = "; ".join(f"{p.name}: {why}" for p, why in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise DataError(f"{bin_dir}: {len(bad)} of {len(paths)} binary shards damaged ({listed}); delete "
                        f"{'it' if len(bad) == 1 else 'them'} (rm {' '.join(str(p) for p, _ in bad)}) and re-run "
                        f"`python -m scripts.pretokenize --data-dir {data_dir or _text_dir_of(bin_dir, meta)} --out "
                        f"{bin_dir}`: it re-makes only the missing ones")
    return len(paths)
