"""Binary token shards: the on-disk format written by `scripts/pretokenize.py` and read by the
dataloader (`DataLoader(source="bin")`: nanochat/doc_sources.py reads each document with pread;
`BinShard` here maps a whole shard, for checks and tools).

One text shard `shard_NNNNN.parquet` becomes one binary shard `shard_NNNNN.bin` (so the last one is
still the validation shard). Layout, little-endian:

    header   128 bytes: magic b"NCTOKENS", u32 version, u32 itemsize (2 = uint16, 4 = uint32),
             u64 n_tokens, u64 n_docs, u32 vocab_size, u32 bos_token_id,
             64 ASCII bytes tokenizer fingerprint (sha256 hex), zero padding
    tokens   n_tokens x uint16|uint32; every document starts with BOS
    padding  zeros up to a multiple of 8 bytes
    offsets  (n_docs + 1) x uint64: document i is tokens[offsets[i]:offsets[i+1]]

Offsets come after the tokens so a shard can be written in one streaming pass. A shard directory
also holds `meta.json` (fingerprint, vocab size, dtype) so that a writer refuses to mix tokenizers
before doing any work, and a reader can name the tokenizer the shards were made with. This module
reads and (atomically) writes that file; what a pretokenize run records in it (which text shards,
whether the run finished) and the checks on that record live in `nanochat/binshards_runs.py`.

A damaged shard or meta.json (bad magic, truncated, inconsistent offsets, another tokenizer) is a
DataError naming the file and how to re-create it (`recreate_advice`). A write that fails (a full
disk: DiskFullError; a file system refusing it: RequestError) names the file and leaves it as it
was: nothing partial under a final name, and the temp file removed.

Resume. A run records each shard's size and `shard_digest` (sha256 of the header, the offsets
table and the first and last 64 KiB of tokens; milliseconds per shard). `check_resume` compares
them with the shards on disk when a checkpoint resumes: a shard truncated, grown or rewritten since
(even at the same size, e.g. re-made from other text) is a DataError naming the file, saying what
changed and how to get the original back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from nanochat.errors import DataError, DiskFullError, RequestError

MAGIC = b"NCTOKENS"
VERSION = 1
HEADER_SIZE = 128
_HEADER = struct.Struct("<8sIIQQII64s")
assert _HEADER.size <= HEADER_SIZE
META_NAME = "meta.json"
BIN_SUFFIX = ".bin"
DIGEST_SAMPLE = 1 << 16  # token bytes hashed at each end of a shard's token area


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32. The header stores vocab_size
    as a u32, so 2**32 - 1 is the largest vocab a shard can hold."""
    if vocab_size < 1 or vocab_size > 2**32 - 1:
        raise ValueError(f"vocab_size: got {vocab_size}; accepted: 1..{2**32 - 1}")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def default_bin_dir(data_dir: str | Path) -> Path:
    """Where the binary shards of a text shard directory live: a sibling `<name>_tokens`."""
    # absolute first ("." has no name: "./_tokens"); lexically, so a symlinked dir keeps its tokens by the link
    data_dir = Path(os.path.abspath(data_dir))
    return data_dir.parent / f"{data_dir.name}_tokens"


def bin_name_for(text_shard: str | Path) -> str:
    return Path(text_shard).stem + BIN_SUFFIX


@dataclass(frozen=True)
class ShardHeader:
    version: int
    dtype: np.dtype
    n_tokens: int
    n_docs: int
    vocab_size: int
    bos_token_id: int
    fingerprint: str

    @property
    def tokens_offset(self) -> int:
        return HEADER_SIZE

    @property
    def offsets_offset(self) -> int:
        end = HEADER_SIZE + self.n_tokens * self.dtype.itemsize
        return (end + 7) // 8 * 8

    @property
    def file_size(self) -> int:
        return self.offsets_offset + 8 * (self.n_docs + 1)


def _pack_header(h: ShardHeader) -> bytes:
    fp = h.fingerprint.encode("ascii")
    if len(fp) > 64:
        raise ValueError(f"fingerprint: got {len(fp)} characters; accepted: at most 64")
    raw = _HEADER.pack(MAGIC, h.version, h.dtype.itemsize, h.n_tokens, h.n_docs,
                       h.vocab_size, h.bos_token_id, fp.ljust(64, b"\0"))
    return raw.ljust(HEADER_SIZE, b"\0")


def read_header(path: str | Path, fd: int | None = None) -> ShardHeader:
    """Parse and sanity-check a shard header; DataError naming the file when it is not one.
    `fd`: a descriptor open on it (the header and size are then those of that open file, which
    the caller goes on reading: a file replaced at `path` since cannot slip in between)."""
    path = Path(path)
    try:
        if fd is None:
            with open(path, "rb") as f:
                raw, size = f.read(HEADER_SIZE), os.fstat(f.fileno()).st_size
        else:
            os.lseek(fd, 0, os.SEEK_SET)   # the caller reads at explicit offsets: no position to keep
            raw, size = os.read(fd, HEADER_SIZE), os.fstat(fd).st_size
    except OSError as e:
        raise DataError(f"{path}: unreadable ({e}); {recreate_advice(path)}") from e
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise DataError(f"{path}: not a nanochat binary token shard (bad magic); {recreate_advice(path)}")
    magic, version, itemsize, n_tokens, n_docs, vocab, bos, fp = _HEADER.unpack(raw[:_HEADER.size])
    if version != VERSION:
        raise DataError(f"{path}: format version {version}; this code reads version {VERSION}; "
                        f"{recreate_advice(path)}")
    if itemsize not in (2, 4):
        raise DataError(f"{path}: corrupt header (itemsize {itemsize}); {recreate_advice(path)}")
    try:
        fingerprint = fp.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise DataError(f"{path}: corrupt header (tokenizer fingerprint is not ASCII); "
                        f"{recreate_advice(path)}") from None
    h = ShardHeader(version, np.dtype(np.uint16 if itemsize == 2 else np.uint32), n_tokens, n_docs,
                    vocab, bos, fingerprint)
    if size != h.file_size:
        raise DataError(f"{path}: truncated or corrupt ({size} bytes, header says {h.file_size}); "
                        f"{recreate_advice(path)}")
    return h


def write_shard(path: str | Path, docs: Iterable[Sequence[int] | np.ndarray], *, vocab_size: int,
                bos_token_id: int, fingerprint: str) -> ShardHeader:
    """Stream `docs` (token id sequences, each starting with BOS) into `path`, atomically
    (temp file + os.replace): a reader never sees a half-written shard."""
    path = Path(path)
    dtype = dtype_for_vocab(vocab_size)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    offsets = [0]
    try:
        with _failed_write_named(path), open(tmp, "wb") as f:
            f.write(b"\0" * HEADER_SIZE)  # placeholder, rewritten once the counts are known
            for doc in docs:
                arr = np.asarray(doc)
                if arr.ndim != 1 or arr.size == 0 or int(arr[0]) != bos_token_id:
                    raise ValueError(f"{path}: document {len(offsets) - 1} does not start with BOS")
                if int(arr.max()) >= vocab_size or int(arr.min()) < 0:
                    raise ValueError(f"{path}: document {len(offsets) - 1} has ids outside 0..{vocab_size - 1}")
                f.write(arr.astype(dtype, copy=False).tobytes())
                offsets.append(offsets[-1] + arr.size)
            h = ShardHeader(VERSION, dtype, offsets[-1], len(offsets) - 1, vocab_size, bos_token_id,
                            fingerprint)
            f.write(b"\0" * (h.offsets_offset - f.tell()))
            f.write(np.asarray(offsets, dtype=np.uint64).tobytes())
            f.seek(0)
            f.write(_pack_header(h))
            f.flush()
            os.fsync(f.fileno())
        with _failed_write_named(path):
            os.replace(tmp, path)
    finally:
        _remove_quietly(tmp)
    return h


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_REFUSED = (errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


@contextlib.contextmanager
def _failed_write_named(path: Path) -> Iterator[None]:
    """Turn a failed write of `path` into one line naming it: no room (ENOSPC, EDQUOT) is a
    DiskFullError, a file system that refuses it (EFBIG: a FAT32 disk's 4 GiB file cap or a `ulimit
    -f`; read-only, permissions, I/O errors) a RequestError; both say that the file is left as it
    was and that a rerun keeps the shards already written. Python's own OSError names no file for
    a write, and in a pretokenize worker it came back as two tracebacks."""
    try:
        yield
    except OSError as e:
        if e.errno not in _NO_ROOM + _REFUSED:
            raise
        what = f"{path}: writing it failed ({e.strerror or e})"
        after = (f"; {path.name} is left as it was (no partial file), and the binary shards already written "
                 "are kept: re-run the same command")
        if e.errno in _NO_ROOM:
            raise DiskFullError(f"{what}: the disk is full{after} once there is room (or pass --out on a "
                                "disk with room)") from e
        hint = (" (the file system caps a file's size: FAT32 at 4 GiB, or a `ulimit -f`)"
                if e.errno == errno.EFBIG else "")
        raise RequestError(f"{what}{hint}{after} once it can be written (or pass --out elsewhere)") from e


def _remove_quietly(path: Path) -> None:
    """Delete a temp file if it is there; a disk that refuses even that keeps the error it had."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


class BinShard:
    """A memory-mapped binary shard: `doc(i)` is a zero-copy view of document i's tokens.
    `check_bos` reads every document's first token, which touches (nearly) every page of tokens:
    the dataloader passes False and checks each document as it reads it (doc_sources.BinSource)."""

    def __init__(self, path: str | Path, *, check_bos: bool = True):
        self.path = Path(path)
        self.header = h = read_header(self.path)
        self.tokens = np.memmap(self.path, dtype=h.dtype, mode="r", offset=HEADER_SIZE,
                                shape=(h.n_tokens,)) if h.n_tokens else np.zeros(0, h.dtype)
        self.offsets = np.asarray(np.memmap(self.path, dtype=np.uint64, mode="r",
                                            offset=h.offsets_offset, shape=(h.n_docs + 1,)),
                                  dtype=np.int64)
        if self.offsets[0] != 0 or self.offsets[-1] != h.n_tokens or np.any(np.diff(self.offsets) <= 0):
            raise DataError(f"{self.path}: corrupt document offsets; {recreate_advice(self.path)}")
        if check_bos and h.n_docs and np.any(self.tokens[self.offsets[:-1]] != h.bos_token_id):
            raise DataError(f"{self.path}: corrupt shard (a document does not start with BOS); "
                            f"{recreate_advice(self.path)}")

    @property
    def num_docs(self) -> int:
        return self.header.n_docs

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


def shard_digest(path: str | Path) -> str:
    """A content check cheap enough for every loader start: sha256 (first 32 hex digits) over the
    header, the offsets table (every document's length) and the first and last DIGEST_SAMPLE bytes
    of tokens. A shard re-made from other text or with another tokenizer changes it even at the
    same size; a flipped byte deep inside the tokens does not (hashing it all would read GBs)."""
    path = Path(path)
    h = read_header(path)  # DataError naming the file if it is no shard (or truncated)
    n = h.n_tokens * h.dtype.itemsize
    head = min(DIGEST_SAMPLE, n)
    spans = [(0, HEADER_SIZE + head), (HEADER_SIZE + max(head, n - DIGEST_SAMPLE), HEADER_SIZE + n),
             (h.offsets_offset, h.file_size)]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for start, end in spans:
            f.seek(start)
            while start < end:
                chunk = f.read(min(end - start, 1 << 20))
                if not chunk:  # shrunk while being read
                    raise DataError(f"{path}: truncated while being read; {recreate_advice(path)}")
                digest.update(chunk)
                start += len(chunk)
    return digest.hexdigest()[:32]


def check_resume(paths: Sequence[Path], state: dict, digests_now: Sequence[str] | None = None) -> None:
    """DataError naming the first of `paths` that is not what `state` (a data loader state with
    `shards`, `shard_bytes`, `shard_digests`) recorded when the run read it: gone, truncated,
    grown, or rewritten at the same size. Nothing to check (returns) for a state from before
    digests were recorded, or for other shard names (the loader's own comparison names those).
    `digests_now`: the shards' digests as the caller already computed them (else read here)."""
    names, sizes, digests = state.get("shards"), state.get("shard_bytes"), state.get("shard_digests")
    if not (isinstance(digests, list) and isinstance(sizes, list) and names == [p.name for p in paths]
            and len(sizes) == len(digests) == len(paths)):
        return
    for i, (path, size, digest) in enumerate(zip(paths, sizes, digests)):
        now = path.stat().st_size if path.is_file() else None
        if now is None:
            what = "is gone"
        elif now != size:
            what = f"was {'truncated' if now < size else 'grown'} from {size} to {now} bytes"
        elif (digests_now[i] if digests_now is not None else shard_digest(path)) != digest:
            what = "was rewritten (same size, other content: header, document lengths or tokens differ)"
        else:
            continue
        raise DataError(f"{path} {what} since the checkpoint's run read it; a resumed run must read the shards "
                        "it started on: put the original back (`python -m scripts.pretokenize` with the run's "
                        "tokenizer and text shards writes it again byte for byte), or start a new --model-tag "
                        "to train on the shards as they are now")


# ---------------------------------------------------------------- directory-level helpers

def list_bin_shards(bin_dir: str | Path) -> list[Path]:
    bin_dir = Path(bin_dir)
    if not bin_dir.is_dir():
        return []
    # their text shards' order, so both paths validate on the same shard ("a.c.parquet" < "a.parquet")
    return sorted((p for p in bin_dir.iterdir() if p.suffix == BIN_SUFFIX and not p.name.startswith(".")),
                  key=lambda p: p.stem + ".parquet")


def read_meta(bin_dir: str | Path) -> dict | None:
    path = Path(bin_dir) / META_NAME
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        meta = e
    if not isinstance(meta, dict):
        why = meta if isinstance(meta, Exception) else f"a JSON {type(meta).__name__}, not an object"
        raise DataError(f"{path}: corrupt ({why}); delete the directory and re-run "
                        "`python -m scripts.pretokenize`")
    return meta


def _write_meta_file(bin_dir: Path, meta: dict) -> None:
    """Replace meta.json atomically; a failed write (a full disk) names it and leaves the old one.
    Fsynced before the rename, as the shards are: after a power cut a renamed file whose data never
    reached the disk is an empty meta.json, refused as corrupt (advice: delete every shard)."""
    tmp = bin_dir / f".{META_NAME}.{os.getpid()}.tmp"
    try:
        with _failed_write_named(bin_dir / META_NAME):
            tmp.write_text(json.dumps(meta, indent=1) + "\n")
            fd = os.open(tmp, os.O_RDONLY)   # fsync flushes the file, whatever the descriptor's mode
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, bin_dir / META_NAME)
    finally:
        _remove_quietly(tmp)


def _text_dir_of(bin_dir: Path, meta: dict) -> str | Path:
    """The text shard directory bin_dir was made from: recorded, else by default_bin_dir's naming."""
    data_dir = meta.get("data_dir")
    if data_dir is None and bin_dir.name.endswith("_tokens"):
        data_dir = bin_dir.parent / bin_dir.name[:-len("_tokens")]
    return data_dir or "TEXT_SHARD_DIR"


def recreate_advice(path: str | Path) -> str:
    """How to re-create the damaged binary shard at `path`: the command for ITS directory (a bare
    `pretokenize` writes $NANOCHAT_BASE_DIR/base_data_tokens, not a --data-dir's shards), without
    --force, which would re-tokenize every shard: a rerun makes only the missing one."""
    bin_dir = Path(path).parent
    try:
        meta = read_meta(bin_dir) or {}
    except DataError:  # a corrupt meta.json: the naming rule alone
        meta = {}
    return (f"delete it, then re-create it with `python -m scripts.pretokenize --data-dir "
            f"{_text_dir_of(bin_dir, meta)} --out {bin_dir}` (it makes only the missing shard)")


def tokenize_text_shard(text_shard: str | Path, out_path: str | Path, tokenizer, *,
                        threads: int = 1, batch_docs: int = 256) -> ShardHeader:
    """Tokenize every document of a parquet text shard (BOS prepended) into one binary shard."""
    from nanochat.dataset import read_row_group_texts, open_text_shard

    pf = open_text_shard(text_shard)
    bos = tokenizer.bos_token_id

    def docs():
        for rg in range(pf.num_row_groups):
            texts = read_row_group_texts(pf, rg, text_shard)
            for i in range(0, len(texts), batch_docs):
                yield from tokenizer.encode(texts[i:i + batch_docs], prepend=bos, num_threads=threads)

    return write_shard(out_path, docs(), vocab_size=tokenizer.vocab_size, bos_token_id=bos,
                       fingerprint=tokenizer.fingerprint)
