"""The pretraining dataloader's document sources (nanochat/dataloader.py packs what they yield): a
rank's documents of one split, from parquet text shards tokenized in batches as they are read
(`TextSource`) or from binary token shards made by scripts/pretokenize.py, read with pread
(`BinSource`). Both deal documents rank-strided (dataset.rank_rows: inside each row group for
text, inside each shard for binary), name each document by a small key and a cursor after it
(what a loader state records), re-read buffered documents by key on resume (`fetch`) and check
what they can up front: every shard is opened at construction (schema, footer, header, offsets,
tokenizer), but only a binary shard's header and offsets are read then, not its tokens (on a real
corpus that is the whole data set, on every rank, at every start): token ids and each document's
BOS are checked as a document is read (`BinSource.tokens`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from nanochat import binshards as bs
from nanochat import dataset as ds
from nanochat.errors import DataError


def describe_shards(source) -> str:
    """A source's shards for a message: `(shards: NAMES) in DIR`, the first few names only."""
    names = source.names
    listed = ", ".join(names[:3]) + (f", ... ({len(names)} shards)" if len(names) > 3 else "")
    return f"(shards: {listed}) in {source.paths[0].parent}"


def _text_column_bytes(meta, rg: int) -> int:
    """The uncompressed size of row group rg's `text` column, from a parquet footer."""
    group = meta.row_group(rg)
    return sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
               if group.column(c).path_in_schema == "text")


class TextSource:
    """This rank's documents from parquet text shards, tokenized in batches (BOS prepended).
    A document's key is (shard, row group, row); cursors point just after a document.
    Only the shard being read is open: a split may hold more shards than the open-file limit."""

    kind = "text"

    def __init__(self, shards: list[Path], tokenizer, rank: int, world_size: int, threads: int,
                 encode_batch: int):
        self.paths = list(shards)
        self.metas, self.empty = [], []
        for p in self.paths:  # schema errors surface here
            pf = ds.open_text_shard(p)
            self.metas.append(pf.metadata)
            self.empty.append(ds.all_texts_empty(pf))
            pf.close()
        self.names = [p.name for p in shards]
        self.sizes = [p.stat().st_size for p in shards]
        self.tok, self.rank, self.world = tokenizer, rank, world_size
        self.threads, self.encode_batch = threads, encode_batch
        self.start = (0, 0, 0)
        self._open: tuple[int, object] | None = None  # (shard index, ParquetFile) being read

    def _column(self, si: int, rg: int):
        if self._open is None or self._open[0] != si:
            if self._open is not None:
                self._open[1].close()
            self._open = None
            pf = ds.open_text_shard(self.paths[si])
            if not pf.metadata.equals(self.metas[si]):  # row groups must be those the cursor counts
                pf.close()
                raise DataError(f"{self.paths[si]}: changed since the data loader opened it; re-run "
                                "with the shards left as they are")
            self._open = (si, pf)
        return ds.read_text_column(self._open[1], rg, self.paths[si])

    def _groups(self, si: int) -> int:
        return self.metas[si].num_row_groups

    def _rows(self, si: int, rg: int) -> int:
        return self.metas[si].row_group(rg).num_rows

    def rank_doc_count(self) -> int:
        """This rank's documents in one pass, from the parquet footers (no data read)."""
        return sum(len(ds.rank_rows(self._rows(si, rg), si, rg, self.rank, self.world))
                   for si in range(len(self.paths)) for rg in range(self._groups(si)))

    def all_empty(self) -> bool:
        """True when the footer statistics prove every text of the split is empty."""
        return all(self.empty)

    def doc_count(self) -> int:
        """Documents of the split on all ranks together, from the footers."""
        return sum(m.num_rows for m in self.metas)

    def sample_docs(self, n: int, groups: int = 4) -> tuple[int, list[int], list[int]]:
        """For data_passes' estimate: (the split's text bytes, UTF-8 bytes and tokens of about `n`
        documents spread over at most `groups` evenly spaced row groups; every rank's rows). The
        bytes come from the footers' column sizes, scaled by the true bytes of the row groups read
        (a footer's size counts encoding overhead). Opens its own files: the loader's prefetch
        thread may be reading this source."""
        import pyarrow.compute as pc

        where = [(si, rg) for si in range(len(self.paths)) for rg in range(self._groups(si)) if self._rows(si, rg)]
        if not where:
            return 0, [], []
        k = min(groups, len(where))
        picks = sorted({where[round(i * (len(where) - 1) / max(k - 1, 1))] for i in range(k)})
        per, texts, read_meta, read_true = -(-n // len(picks)), [], 0, 0
        for si, rg in picks:
            pf = ds.open_text_shard(self.paths[si])
            try:
                col = ds.read_text_column(pf, rg, self.paths[si])
            finally:
                pf.close()
            read_meta += _text_column_bytes(self.metas[si], rg)
            read_true += pc.sum(pc.binary_length(col)).as_py() or 0
            texts += col.take(list(range(0, len(col), max(len(col) // per, 1))[:per])).to_pylist()
        meta = sum(_text_column_bytes(m, rg) for m in self.metas for rg in range(m.num_row_groups))
        total = round(meta * read_true / read_meta) if read_meta else 0
        return total, [len(t.encode("utf-8")) for t in texts], [len(t) for t in self._encode(texts)]

    def _encode(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tok.encode(texts, prepend=self.tok.bos_token_id, num_threads=self.threads)
        return [np.asarray(t, dtype=np.int32) for t in ids]

    def docs(self, cursor):
        """Yield (key, next_cursor, length, tokens) from cursor to the end of one pass."""
        s0, g0, r0 = cursor
        for si in range(s0, len(self.paths)):
            for rg in range(g0 if si == s0 else 0, self._groups(si)):
                rows = ds.rank_rows(self._rows(si, rg), si, rg, self.rank, self.world,
                                    r0 if (si, rg) == (s0, g0) else 0)
                col = self._column(si, rg) if len(rows) else None
                for i in range(0, len(rows), self.encode_batch):
                    chunk = rows[i:i + self.encode_batch]
                    texts = col.take(list(chunk)).to_pylist()  # only this rank's rows become str
                    for row, toks in zip(chunk, self._encode(texts)):
                        yield (si, rg, row), (si, rg, row + 1), len(toks), toks

    def fetch(self, keys: list[tuple]) -> list[tuple[int, np.ndarray]]:
        """(length, tokens) for documents named by key (restoring a packing buffer)."""
        groups: dict[tuple[int, int], list[int]] = {}
        for si, rg, row in keys:
            groups.setdefault((si, rg), []).append(row)
        found = {}
        for (si, rg), rows in sorted(groups.items()):  # shard by shard: each is opened once
            rows = sorted(set(rows))
            for row, toks in zip(rows, self._encode(self._column(si, rg).take(rows).to_pylist())):
                found[(si, rg, row)] = toks
        return [(len(found[k]), found[k]) for k in keys]

    def tokens(self, key, payload, limit: int | None = None) -> np.ndarray:
        return payload if limit is None else payload[:limit]


_OPEN_BIN_SHARDS = 8  # shards kept open: those the packing buffer's documents come from


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    """n bytes of fd from offset, fewer only at the end of the file."""
    parts, got = [], 0
    while got < n:
        if hasattr(os, "pread"):
            part = os.pread(fd, n - got, offset + got)
        else:   # Windows: a source is read by one thread, so seek + read is as good
            os.lseek(fd, offset + got, os.SEEK_SET)
            part = os.read(fd, n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


class _OpenBin:
    """A binary shard being read: a descriptor open on it and its document offsets, checked
    against what the loader recorded at construction. Tokens are read with pread, not through a
    memory map: a shard truncated in place while a run reads it (a `cp` over the directory) is then
    a short read, a DataError naming the file, where an access to a map past the file's new end
    was SIGBUS: "Fatal Python error: Bus error", the process killed naming no file and saving no
    checkpoint. A shard replaced by a rename keeps being read from the file this one opened."""

    def __init__(self, path: Path, header: bs.ShardHeader, lengths: np.ndarray):
        self.path, self.dtype, self.fd = path, header.dtype, -1
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))   # Windows: no newline translation
        except OSError as e:
            raise DataError(f"{path}: unreadable ({e}); {bs.recreate_advice(path)}") from e
        try:
            offsets = None
            if bs.read_header(path, self.fd) == header:
                raw = _pread_exact(self.fd, 8 * (header.n_docs + 1), header.offsets_offset)
                offsets = np.frombuffer(raw, dtype=np.uint64).astype(np.int64)
            if offsets is None or len(offsets) != header.n_docs + 1 or offsets[0] != 0 \
                    or not np.array_equal(np.diff(offsets), lengths):
                raise DataError(f"{path}: changed since the data loader opened it; re-run with the "
                                "shards left as they are")
            self.offsets = offsets
        except BaseException:
            self.close()
            raise

    def read(self, d: int, limit: int | None = None) -> np.ndarray:
        """Document d's tokens (its first `limit`); never empty: offsets strictly increase."""
        start = int(self.offsets[d])
        n = int(self.offsets[d + 1]) - start if limit is None else min(int(self.offsets[d + 1]) - start, limit)
        size = n * self.dtype.itemsize
        try:
            raw = _pread_exact(self.fd, size, bs.HEADER_SIZE + start * self.dtype.itemsize)
        except OSError as e:
            raise DataError(f"{self.path}: unreadable ({e}); {bs.recreate_advice(self.path)}") from e
        if len(raw) < size:
            raise DataError(f"{self.path}: truncated since the data loader opened it (document {d} lies past "
                            f"its end now, {os.fstat(self.fd).st_size} bytes); put the shard back as it was "
                            f"(a resume reads the same shards), or {bs.recreate_advice(self.path)}")
        return np.frombuffer(raw, dtype=self.dtype)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


class BinSource:
    """This rank's documents from binary shards; key = (shard, document). Every shard's header,
    size, offsets and tokenizer are checked at construction, its tokens as they are read
    (`tokens`, with pread: _OpenBin); only the few being read stay open (a split may hold more
    shards than the open-file limit)."""

    kind = "bin"

    def __init__(self, paths: list[Path], tokenizer, rank: int, world_size: int):
        self.paths = list(paths)
        self.headers, self.lengths = [], []
        for p in self.paths:
            sh = bs.BinShard(p, check_bos=False)  # the BOS scan reads every page of tokens: see tokens()
            if sh.header.fingerprint != tokenizer.fingerprint:
                raise DataError(f"tokenizer mismatch: {sh.path} was made with tokenizer "
                                f"{sh.header.fingerprint[:12]}, the current tokenizer is "
                                f"{tokenizer.fingerprint[:12]}; re-run `python -m scripts.pretokenize "
                                f"--force` (or move {sh.path.parent} aside: training then tokenizes the text shards)")
            if sh.header.vocab_size != tokenizer.vocab_size:
                raise DataError(f"{sh.path}: made for vocab size {sh.header.vocab_size}, the tokenizer has "
                                f"{tokenizer.vocab_size}; re-run `python -m scripts.pretokenize --force`")
            self.headers.append(sh.header)
            self.lengths.append(sh.doc_lengths())
            del sh  # its maps: nothing of this shard stays open until it is read
        self.vocab_size, self.bos = tokenizer.vocab_size, tokenizer.bos_token_id
        self.names = [p.name for p in paths]
        self.sizes = [p.stat().st_size for p in paths]
        self.digests = [bs.shard_digest(p) for p in self.paths]  # a resume checks them (bs.check_resume)
        self.rank, self.world = rank, world_size
        self.start = (0, 0)
        self._open: OrderedDict[int, _OpenBin] = OrderedDict()  # least recently used first

    def _shard(self, si: int) -> _OpenBin:
        sh = self._open.pop(si, None)
        if sh is None:
            sh = _OpenBin(self.paths[si], self.headers[si], self.lengths[si])
        self._open[si] = sh
        if len(self._open) > _OPEN_BIN_SHARDS:
            self._open.popitem(last=False)[1].close()
        return sh

    def docs(self, cursor):
        s0, d0 = cursor
        for si in range(s0, len(self.paths)):
            lengths = self.lengths[si]
            for d in ds.rank_rows(len(lengths), si, 0, self.rank, self.world, d0 if si == s0 else 0):
                yield (si, d), (si, d + 1), int(lengths[d]), None

    def fetch(self, keys):
        return [(int(self.lengths[si][d]), None) for si, d in keys]

    def tokens(self, key, payload, limit: int | None = None) -> np.ndarray:
        """The document's tokens (its first `limit`: those packed), checked as they are read."""
        t = self._shard(key[0]).read(key[1], limit)
        top = int(t.max())  # cheap, as the BOS: an id past the vocab fails the embedding cryptically
        if top >= self.vocab_size or t[0] != self.bos:
            what = f"has token id {top} >= the vocab size {self.vocab_size}" if top >= self.vocab_size else \
                f"does not start with BOS ({self.bos})"
            raise DataError(f"{self.paths[key[0]]}: document {key[1]} {what} (corrupt shard); "
                            f"{bs.recreate_advice(self.paths[key[0]])}")
        return t

    def rank_doc_count(self) -> int:
        return sum(len(ds.rank_rows(len(n), si, 0, self.rank, self.world)) for si, n in enumerate(self.lengths))

    def rank_lengths(self, rank: int, limit: int | None = None) -> np.ndarray:
        """Document lengths of `rank`'s pass in reading order, its first `limit` only if given
        (data_passes replays their packing)."""
        parts, held = [], 0
        for si, n in enumerate(self.lengths):
            if limit is not None and held >= limit:
                break
            parts.append(n[ds.rank_rows(len(n), si, 0, rank, self.world).start::self.world])
            held += len(parts[-1])
        return (np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))[:limit]

    def rank_tokens(self, cap: int, rank: int | None = None) -> int:
        """Tokens of a rank's documents in one pass (default this one's), each cropped to a row of `cap`."""
        total, rank = 0, self.rank if rank is None else rank
        for si, n in enumerate(self.lengths):
            mine = ds.rank_rows(len(n), si, 0, rank, self.world)
            total += int(np.minimum(n[mine.start::self.world], cap).sum())
        return total

    def all_empty(self) -> bool:
        return all(bool(np.all(n <= 1)) for n in self.lengths)
