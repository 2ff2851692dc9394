"""The record a shard directory keeps of its set: source.json.

A data directory's source.json says which source filled it ({"source": "climbmix" | "shakespeare" |
"local:<dir>", and "options": the flags that shaped the set, e.g. a download's -n/--start or a local
import's --val-fraction}), so that sets of two sources never mix (claim_data_dir refuses). A writer
of a whole set (nanochat/dataset.py's write_text_shards: the local import; the Shakespeare copy)
also records that its set is unfinished before its first shard ("complete": false) and, after the
last one, that it is finished and which shards it holds ("complete": true, "shards": [names]):
check_written_set refuses a set whose writer was interrupted or that no longer matches that list.

nanochat/dataset.py owns the rest (listing, reading, the source registry, the rerun commands) and
re-exports these names; this module imports nothing of it, so dataset.py imports it at the top.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from nanochat.errors import DataError

SOURCE_FILE = "source.json"  # records which source filled a data directory, so sets never mix


def claim_data_dir(out_dir: Path, source: str, options: dict | None = None) -> None:
    """Refuse to mix shard sets: a directory holding shards from another source is an error.
    `options`: the flags that shaped the set, recorded so a refusal can name the exact rerun."""
    out_dir.mkdir(parents=True, exist_ok=True)
    marker = out_dir / SOURCE_FILE
    existing = sorted(out_dir.glob("*.parquet"))
    recorded = read_source_marker(marker)
    if existing and recorded != source:
        # a local import's source is "local:<dir>", which the flags spell --data-dir <dir>; and .parquet
        # files no run of ours recorded may be the user's own data: never advise deleting those
        filled_by = _source_flag(source) if source.startswith("local:") else f"--source {source}"
        had = (f"shards from {_source_flag(recorded)} (delete it or pass another --out)" if recorded else
               ".parquet files no nanochat run recorded (yours? they are left alone: pass another --out)")
        raise ValueError(f"--out: {out_dir} already holds {len(existing)} {had}; accepted: an empty "
                         f"directory or one filled by {filled_by}")
    # a fresh record: a writer that finishes its set records that (mark_shard_set_complete)
    write_marker(out_dir, {"source": source, **({"options": options} if options else {})})


def _source_flag(source: str) -> str:
    """A recorded source as the flag that fills it: "local:<dir>" is --data-dir <dir>."""
    return f"--data-dir {source[6:]}" if source.startswith("local:") else source


def mark_shard_set_incomplete(out_dir: Path) -> None:
    """Record in the source marker that out_dir's shard set is being written: list_shards refuses
    it until mark_shard_set_complete. A writer calls this before its first shard."""
    recorded = {k: v for k, v in (read_marker(out_dir / SOURCE_FILE) or {}).items() if k != "shards"}
    write_marker(out_dir, {**recorded, "complete": False})


def mark_shard_set_complete(out_dir: Path, paths: list[Path]) -> None:
    """Record in the source marker that out_dir holds exactly `paths`, all written (list_shards
    checks it). A writer calls this last, after every shard is in place."""
    recorded = read_marker(out_dir / SOURCE_FILE) or {}
    write_marker(out_dir, {**recorded, "complete": True, "shards": [Path(p).name for p in paths]})


def check_written_set(data_dir: Path, recorded: dict, shards: list[Path], rerun: str) -> None:
    """DataError (naming the directory and `rerun`, how to re-create it) for a shard set that its
    writer (mark_shard_set_incomplete / _complete) did not finish, or that is not the set it
    finished (a shard deleted or added since): read as it is, its last shard (a train shard, or a
    stray) would be the validation split. Sets without that record (older ones, downloads) pass."""
    if recorded.get("complete") is False:
        raise DataError(f"{data_dir} is incomplete: the run writing its shards did not finish "
                        f"({len(shards)} shards on disk); {rerun}")
    want = recorded.get("shards")
    if recorded.get("complete") is True and isinstance(want, list):
        have = [p.name for p in shards]
        missing = [n for n in want if n not in have]
        extra = [n for n in have if n not in want]
        if missing or extra:
            diff = "; ".join(f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                             for what, names in (("missing", missing), ("not written by it", extra)) if names)
            raise DataError(f"{data_dir} does not hold the {len(want)} shards the run that wrote it left "
                            f"({diff}); {rerun}")


def write_marker(out_dir: Path, record: dict) -> None:
    # atomic: a torn marker reads as corrupt. One temp name per process and thread: two downloads
    # into one directory (torchrun ranks, two shells) sharing one truncated each other's temp file,
    # renamed a torn one into place or failed on one the other had renamed (FileNotFoundError)
    tmp = out_dir / f".{SOURCE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, out_dir / SOURCE_FILE)
    finally:
        tmp.unlink(missing_ok=True)


def read_source_marker(marker: Path) -> str | None:
    """The source recorded in a data directory's source.json (None when there is none); a file
    that is not the JSON object we write is a DataError naming it."""
    recorded = read_marker(marker)
    return None if recorded is None else recorded.get("source")


def read_marker(marker: Path) -> dict | None:
    """source.json as a dict: {"source": ..., and from write_text_shards "complete": bool,
    "shards": [names]} (None when there is none)."""
    if not marker.is_file():
        return None
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise DataError(f"{marker}: corrupt ({e}); delete it (and the shards next to it if you do "
                        "not know where they came from) and run the download again") from e
    if not isinstance(recorded, dict):
        raise DataError(f"{marker}: corrupt (a JSON {type(recorded).__name__}, expected an object "
                        '{"source": ...}); delete it and run the download again')
    return recorded
