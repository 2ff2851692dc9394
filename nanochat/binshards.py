"""Binary token shards: the on-disk format written by `scripts/pretokenize.py` and read,
memory-mapped, by the dataloader (`DataLoader(source="bin")`).

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
before doing any work, and a reader can name the tokenizer the shards were made with; after a
complete run it also records the text shards (names and sizes) the binary shards were made from,
so that a reader can tell when the text shards changed since (`stale_reason`).

A damaged shard or meta.json (bad magic, truncated, inconsistent offsets, another tokenizer) is a
DataError naming the file and how to re-create it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from nanochat.errors import DataError

MAGIC = b"NCTOKENS"
VERSION = 1
HEADER_SIZE = 128
_HEADER = struct.Struct("<8sIIQQII64s")
assert _HEADER.size <= HEADER_SIZE
META_NAME = "meta.json"
BIN_SUFFIX = ".bin"
_RECREATE = "delete it and re-create it with `python -m scripts.pretokenize --force`"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size: got {vocab_size}; accepted: 1..{2**32}")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def default_bin_dir(data_dir: str | Path) -> Path:
    """Where the binary shards of a text shard directory live: a sibling `<name>_tokens`."""
    data_dir = Path(data_dir)
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


def read_header(path: str | Path) -> ShardHeader:
    """Parse and sanity-check a shard header; DataError naming the file when it is not one."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise DataError(f"{path}: unreadable ({e}); {_RECREATE}") from e
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise DataError(f"{path}: not a nanochat binary token shard (bad magic); {_RECREATE}")
    magic, version, itemsize, n_tokens, n_docs, vocab, bos, fp = _HEADER.unpack(raw[:_HEADER.size])
    if version != VERSION:
        raise DataError(f"{path}: format version {version}; this code reads version {VERSION}; {_RECREATE}")
    if itemsize not in (2, 4):
        raise DataError(f"{path}: corrupt header (itemsize {itemsize}); {_RECREATE}")
    try:
        fingerprint = fp.rstrip(b"\0").decode("ascii")
    except UnicodeDecodeError:
        raise DataError(f"{path}: corrupt header (tokenizer fingerprint is not ASCII); {_RECREATE}") from None
    h = ShardHeader(version, np.dtype(np.uint16 if itemsize == 2 else np.uint32), n_tokens, n_docs,
                    vocab, bos, fingerprint)
    size = path.stat().st_size
    if size != h.file_size:
        raise DataError(f"{path}: truncated or corrupt ({size} bytes, header says {h.file_size}); {_RECREATE}")
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
        with open(tmp, "wb") as f:
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
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return h


class BinShard:
    """A memory-mapped binary shard: `doc(i)` is a zero-copy view of document i's tokens."""

    def __init__(self, path: str | Path, *, check_bos: bool = True):
        self.path = Path(path)
        self.header = h = read_header(self.path)
        self.tokens = np.memmap(self.path, dtype=h.dtype, mode="r", offset=HEADER_SIZE,
                                shape=(h.n_tokens,)) if h.n_tokens else np.zeros(0, h.dtype)
        self.offsets = np.asarray(np.memmap(self.path, dtype=np.uint64, mode="r",
                                            offset=h.offsets_offset, shape=(h.n_docs + 1,)),
                                  dtype=np.int64)
        if self.offsets[0] != 0 or self.offsets[-1] != h.n_tokens or np.any(np.diff(self.offsets) <= 0):
            raise DataError(f"{self.path}: corrupt document offsets; {_RECREATE}")
        if check_bos and h.n_docs and np.any(self.tokens[self.offsets[:-1]] != h.bos_token_id):
            raise DataError(f"{self.path}: corrupt shard (a document does not start with BOS); {_RECREATE}")

    @property
    def num_docs(self) -> int:
        return self.header.n_docs

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


# ---------------------------------------------------------------- directory-level helpers

def list_bin_shards(bin_dir: str | Path) -> list[Path]:
    bin_dir = Path(bin_dir)
    if not bin_dir.is_dir():
        return []
    return sorted(p for p in bin_dir.iterdir() if p.suffix == BIN_SUFFIX and not p.name.startswith("."))


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
                f"{str(other)[:12]}, the current tokenizer is {fingerprint[:12]}; delete that "
                "directory and re-run `python -m scripts.pretokenize`, or read the text shards "
                "instead (source='text')")


def write_meta(bin_dir: str | Path, *, fingerprint: str, vocab_size: int, bos_token_id: int) -> None:
    """Create or confirm meta.json; refuses (ValueError) a directory made with another tokenizer."""
    bin_dir = Path(bin_dir)
    bin_dir.mkdir(parents=True, exist_ok=True)
    check_tokenizer(bin_dir, fingerprint, "existing shards")
    meta = {"format": "nanochat-tokens", "version": VERSION, "fingerprint": fingerprint,
            "vocab_size": vocab_size, "bos_token_id": bos_token_id,
            "dtype": dtype_for_vocab(vocab_size).name}
    old = read_meta(bin_dir) or {}
    if old.get("fingerprint") == fingerprint and "text_shards" in old:
        meta["text_shards"] = old["text_shards"]  # kept until record_text_shards replaces it
    _write_meta_file(bin_dir, meta)


def _write_meta_file(bin_dir: Path, meta: dict) -> None:
    tmp = bin_dir / f".{META_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, bin_dir / META_NAME)


def text_shard_record(text_shards: Iterable[str | Path]) -> dict[str, int]:
    """{file name: size in bytes} of text shards: what a binary shard directory was made from."""
    return {Path(p).name: Path(p).stat().st_size for p in text_shards}


def record_text_shards(bin_dir: str | Path, text_shards: Iterable[str | Path]) -> None:
    """Record in meta.json the text shards (names + sizes) the binary shards were made from."""
    meta = read_meta(bin_dir)
    if meta is None:
        raise DataError(f"{Path(bin_dir) / META_NAME}: missing; re-run `python -m scripts.pretokenize`")
    _write_meta_file(Path(bin_dir), {**meta, "text_shards": text_shard_record(text_shards)})


def stale_reason(bin_dir: str | Path, text_shards: list[Path]) -> str | None:
    """Why the binary shards of bin_dir do not match `text_shards` (their names and sizes now), or
    None when they match, or when there is nothing to compare (an older directory without a
    record, or no text shards at all: reading the binary shards alone is fine)."""
    meta = read_meta(bin_dir)
    recorded = meta.get("text_shards") if meta is not None else None
    if not isinstance(recorded, dict) or not text_shards:
        return None
    now = text_shard_record(text_shards)
    strays = sorted(p.name for p in list_bin_shards(bin_dir) if p.stem not in {Path(n).stem for n in now})
    if now == recorded and not strays:
        return None
    changed = sorted(n for n in now.keys() & recorded.keys() if now[n] != recorded[n])
    parts = [f"{what}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
             for what, names in (("changed", changed), ("new", sorted(now.keys() - recorded.keys())),
                                 ("gone", sorted(recorded.keys() - now.keys())),
                                 ("binary shards without a text shard", strays)) if names]
    return "; ".join(parts)


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
