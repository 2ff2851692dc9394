"""DataLoader: best-fit packing invariants, rank sharding, exact resume with prefetch in flight
(text and binary paths), the validation iterator and the clear errors."""

import hashlib
import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch

from nanochat.binshards import HEADER_SIZE, META_NAME, default_bin_dir, write_meta
from nanochat.dataloader import DataLoader
from nanochat.errors import DataError, MissingDataError, RequestError
from scripts.pretokenize import pretokenize


class ByteTokenizer:
    """Stand-in with the nanochat.tokenizer contract: 256 byte tokens + <|bos|> (id 256)."""

    def __init__(self, tag: str = "bytes-v1"):
        self.tag = tag
        self._enc = tiktoken.Encoding(name="test-bytes", pat_str=r"\S+|\s+",
                                      mergeable_ranks={bytes([i]): i for i in range(256)},
                                      special_tokens={"<|bos|>": 256})
        self.bos_token_id, self.vocab_size = 256, 257
        self.fingerprint = hashlib.sha256(tag.encode()).hexdigest()

    def __getstate__(self):  # picklable for pretokenize worker processes
        return {"tag": self.tag}

    def __setstate__(self, state):
        self.__init__(state["tag"])

    def encode(self, text, prepend=None, append=None, num_threads=8):
        texts = [text] if isinstance(text, str) else text
        rows = self._enc.encode_ordinary_batch(texts, num_threads=num_threads)
        rows = [([prepend] if prepend is not None else []) + r + ([append] if append is not None else [])
                for r in rows]
        return rows[0] if isinstance(text, str) else rows

    def decode(self, ids):
        return self._enc.decode(list(ids))


def make_docs(n: int, seed: int = 0, max_len: int = 120) -> list[str]:
    """Documents starting with a unique 6-char id ("00042|") so packed rows can be traced."""
    rng = random.Random(seed)
    return [f"{i:05d}|" + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, max_len)))
            for i in range(n)]


def write_shards(d, shards: list[list[str]], row_group_size: int = 16):
    d.mkdir(parents=True, exist_ok=True)
    for i, docs in enumerate(shards):
        pq.write_table(pa.table({"text": docs}), d / f"shard_{i:05d}.parquet", row_group_size=row_group_size)
    return d


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """3 train shards + 1 val shard of traceable documents."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    docs = make_docs(260)
    shards = [docs[0:80], docs[80:150], docs[150:230], docs[230:260]]
    return write_shards(tmp_path / "data", shards), shards


@pytest.fixture
def binned(corpus):
    data_dir, shards = corpus
    tok = ByteTokenizer()
    pretokenize(sorted(data_dir.glob("*.parquet")), default_bin_dir(data_dir), tok, log=lambda *a: None)
    return data_dir, shards


def loader(data_dir, source="text", **kw):
    kw.setdefault("buffer_size", 8)
    return DataLoader(kw.pop("tok", ByteTokenizer()), kw.pop("B", 4), kw.pop("T", 64),
                      kw.pop("split", "train"), data_dir=data_dir, source=source, **kw)


def segments(row: list[int], bos: int = 256) -> list[list[int]]:
    starts = [i for i, t in enumerate(row) if t == bos] + [len(row)]
    return [row[a:b] for a, b in zip(starts, starts[1:])]


def doc_ids(x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Ids of the documents (or cropped document prefixes) in a batch, checking each segment is
    an exact prefix of BOS + the document's bytes."""
    ids = []
    for xr, yr in zip(x.tolist(), y.tolist()):
        for seg in segments(xr + [t for t in yr[-1:] if t >= 0]):
            text = bytes(seg[1:]).decode()
            if len(text) >= 6:
                ids.append(text[:6])
    return ids


@pytest.mark.parametrize("source", ["text", "bin"])
def test_packing_invariants(binned, source):
    data_dir, shards = binned
    by_id = {d[:6]: d for docs in shards[:-1] for d in docs}
    dl = loader(data_dir, source, B=4, T=64, prefetch=2)
    for _ in range(12):
        x, y = next(dl)
        assert x.shape == y.shape == (4, 64) and x.dtype == y.dtype == torch.long
        assert (x[:, 0] == 256).all(), "every row starts with BOS"
        assert torch.equal(x[:, 1:], y[:, :-1]), "targets are inputs shifted by one"
        rows = torch.cat([x, y[:, -1:]], dim=1).tolist()
        for row in rows:
            for seg in segments(row):
                text = bytes(seg[1:]).decode()
                if len(text) >= 6:
                    assert by_id[text[:6]].startswith(text), "a segment is a document prefix"
                else:  # cropped before the end of its id
                    assert any(i.startswith(text) for i in by_id)
    assert 0 < dl.dropped_fraction < 0.5
    dl.close()


def test_best_fit_order_and_padding(tmp_path):
    """cap = 11 tokens: docs of 8, 6, 4, 3, 2 tokens (BOS included), all buffered.
    Row 1 = 8 + 3 (largest that fits, then largest that fits the 3 left); row 2 = 6 + 4, then
    nothing fits 1 slot: 2-token doc cropped to 1 (1 token dropped). Finite pass ends there."""
    texts = ["A" * 7, "B" * 5, "C" * 3, "D" * 2, "E" * 1]
    d = write_shards(tmp_path / "d", [texts, ["val"]])
    dl = loader(d, B=1, T=10, buffer_size=10, repeat=False, prefetch=0)
    rows = [torch.cat([x[0], y[0, -1:]]).tolist() for x, y in dl]
    assert [[bytes(s[1:]).decode() for s in segments(r)] for r in rows] == \
        [["AAAAAAA", "DD"], ["BBBBB", "CCC", ""]]
    assert dl.dropped_fraction == pytest.approx(1 / 23)


def test_document_longer_than_a_row_fills_a_row_alone(tmp_path):
    """cap 11: a 21-token document is cropped to a full row of its own (10 tokens dropped), not
    cropped to the 1 slot left after the short documents (which would drop 20)."""
    d = write_shards(tmp_path / "d", [["A" * 5, "L" * 20, "B" * 3], ["val"]])
    dl = loader(d, B=1, T=10, buffer_size=10, repeat=False, prefetch=0)
    rows = [torch.cat([x[0], y[0, -1:]]).tolist() for x, y in dl]
    assert rows[0] == [256] + [ord("L")] * 10
    assert [bytes(s[1:]).decode() for s in segments(rows[1][:10])] == ["AAAAA", "BBB"]
    assert dl.dropped_fraction == pytest.approx(10 / 31)


def test_final_batch_padding_masks_targets(tmp_path):
    """cap 9: row 0 = x (6 tokens) + y (3); row 1 = z (4) then padding; row 2 all padding."""
    d = write_shards(tmp_path / "d", [["x" * 5, "y" * 2, "z" * 3], ["v"]])
    dl = loader(d, B=3, T=8, buffer_size=4, repeat=False, prefetch=1)
    x, y = next(dl)
    z = ord("z")
    assert x[0].tolist() == [256] + [ord("x")] * 5 + [256, ord("y")] and y[0, -1] == ord("y")
    assert x[1].tolist() == [256, z, z, z] + [256] * 4
    assert y[1].tolist() == [z, z, z] + [-1] * 5
    assert (x[2] == 256).all() and (y[2] == -1).all()
    with pytest.raises(StopIteration):
        next(dl)
    with pytest.raises(StopIteration):
        next(dl)


@pytest.mark.parametrize("source,world", [("text", 2), ("text", 3), ("bin", 2)])
def test_ranks_never_share_a_document(binned, source, world):
    data_dir, shards = binned
    seen = []
    for rank in range(world):
        dl = loader(data_dir, source, rank=rank, world_size=world, B=2, T=400, repeat=False)
        seen.append([i for x, y in dl for i in doc_ids(x, y)])
    all_train = {d[:6] for docs in shards[:-1] for d in docs}
    for r in range(world):
        assert len(seen[r]) == len(set(seen[r])), "a finite pass emits each document once"
        for q in range(r + 1, world):
            assert not set(seen[r]) & set(seen[q]), f"ranks {r} and {q} share documents"
    # docs cropped to < 6 bytes cannot be identified; everything else must be there
    assert len(set().union(*map(set, seen))) >= 0.9 * len(all_train)
    assert abs(len(seen[0]) - len(seen[1])) <= 0.25 * len(seen[0]), "ranks get similar shares"


@pytest.mark.parametrize("source", ["text", "bin"])
def test_exact_resume_with_prefetch(binned, source):
    data_dir, _ = binned
    ref = loader(data_dir, source, B=4, T=127, prefetch=3, buffer_size=6)
    batches, states = [], []
    for _ in range(40):  # ~1.3 epochs: the resumes cross an epoch boundary
        batches.append(next(ref))
        states.append(json.loads(json.dumps(ref.state_dict())))  # plain python types
    ref.close()
    assert states[-1]["epoch"] >= 1
    for k in (0, 7, 23):
        dl = loader(data_dir, source, B=4, T=127, prefetch=3, buffer_size=6)
        dl.load_state_dict(states[k])
        for j in range(k + 1, 40):
            x, y = next(dl)
            assert torch.equal(x, batches[j][0]) and torch.equal(y, batches[j][1]), (k, j)
        assert dl.state_dict() == states[-1]
        dl.close()


def test_exact_resume_with_equal_lengths(tmp_path):
    """Many documents of equal length: the restored buffer must break ties exactly as before."""
    rng = random.Random(1)
    docs = [f"{i:05d}|" + "x" * rng.choice([0, 4, 12]) for i in range(120)]
    d = write_shards(tmp_path / "d", [docs[:100], docs[100:]])
    ref = loader(d, B=2, T=30, buffer_size=10, prefetch=2)
    batches = [next(ref)[0] for _ in range(12)]
    state = ref.state_dict()
    batches += [next(ref)[0] for _ in range(12)]
    ref.close()
    dl = loader(d, B=2, T=30, buffer_size=10, prefetch=2)
    dl.load_state_dict(state)
    assert all(torch.equal(next(dl)[0], b) for b in batches[12:])
    dl.close()


def test_state_refers_to_last_batch_handed_out(corpus):
    data_dir, _ = corpus
    a = loader(data_dir, prefetch=4)
    next(a)
    s1 = a.state_dict()
    import time
    time.sleep(0.3)  # let the prefetch thread run ahead
    assert a.state_dict() == s1 and s1["batches"] == 1
    b = loader(data_dir, prefetch=0)
    next(b)
    assert b.state_dict() == s1
    # load_state_dict on a running loader drops the prefetched batches
    a2 = next(a)
    a.load_state_dict(s1)
    assert torch.equal(next(a)[0], a2[0])
    a.close()


def test_dropped_loader_stops_its_thread(corpus):
    import gc
    import threading
    import time

    def alive():
        return sum(t.name == "nanochat-dataloader" for t in threading.enumerate())

    before = alive()
    dl = loader(corpus[0], prefetch=2)
    next(dl)
    assert alive() == before + 1
    del dl  # no close(): garbage collection must stop the prefetch thread
    gc.collect()
    deadline = time.time() + 5
    while alive() > before and time.time() < deadline:
        time.sleep(0.05)
    assert alive() == before


def test_text_and_binary_paths_agree(binned):
    data_dir, _ = binned
    t, b = loader(data_dir, "text"), loader(data_dir, "bin")
    for _ in range(15):
        (xt, yt), (xb, yb) = next(t), next(b)
        assert torch.equal(xt, xb) and torch.equal(yt, yb)
    assert t.dropped_fraction == b.dropped_fraction
    t.close(), b.close()


def test_auto_source_prefers_binary_shards(binned):
    data_dir, _ = binned
    assert loader(data_dir, "auto").state_dict()["source"] == "bin"
    for p in default_bin_dir(data_dir).iterdir():
        p.unlink()
    assert loader(data_dir, "auto").state_dict()["source"] == "text"


def test_validation_iterator(corpus):
    data_dir, shards = corpus
    val_ids = {d[:6] for d in shards[-1]}
    finite = loader(data_dir, split="val", repeat=False, B=2, T=200)
    got = [i for x, y in finite for i in doc_ids(x, y)]
    assert set(got) <= val_ids and len(got) == len(set(got)) >= 0.9 * len(val_ids)
    rep1 = loader(data_dir, split="val", B=2, T=200)
    rep2 = loader(data_dir, split="val", B=2, T=200)
    for _ in range(30):  # more batches than one pass holds: it cycles, identically each time
        assert torch.equal(next(rep1)[0], next(rep2)[0])
    assert rep1.epoch >= 1


def test_resume_rejects_other_settings(corpus):
    data_dir, _ = corpus
    state = loader(data_dir).state_dict()
    # a RequestError naming the flag (base_train prints it as one line), not a traceback
    with pytest.raises(RequestError, match=r"--resume: the checkpoint's data loader had --device-batch-size 4, "
                                           r"this run's has 5; resume with the original run's data and flags"):
        loader(data_dir, B=5).load_state_dict(state)
    with pytest.raises(RequestError, match="world size 1, this run's has 2"):
        loader(data_dir, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(RequestError, match="had the tokenizer"):
        loader(data_dir, tok=ByteTokenizer("other")).load_state_dict(state)
    pq.write_table(pa.table({"text": ["changed"]}), data_dir / "shard_00001.parquet")
    with pytest.raises(RequestError, match="had the shard sizes of --data-dir"):  # the data changed under it
        loader(data_dir).load_state_dict(state)


def test_clear_errors(tmp_path, corpus, binned):
    data_dir, _ = binned
    with pytest.raises(ValueError, match="batch_size"):
        loader(data_dir, B=0)
    with pytest.raises(ValueError, match="seq_len"):
        loader(data_dir, T=-3)
    with pytest.raises(ValueError, match="split"):
        loader(data_dir, split="test")
    with pytest.raises(ValueError, match="rank"):
        loader(data_dir, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError, match="no text shards"):
        loader(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"content": ["x"]}), bad / f"shard_{i:05d}.parquet")
    with pytest.raises(ValueError, match="expected a string column 'text'"):
        loader(bad)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        loader(data_dir, "bin", tok=ByteTokenizer("other"))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        loader(data_dir, "auto", tok=ByteTokenizer("other"))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        write_meta(default_bin_dir(data_dir), fingerprint="f" * 64, vocab_size=257, bos_token_id=256)
    with pytest.raises(FileNotFoundError, match="pretokenize"):
        loader(data_dir, "bin", bin_dir=tmp_path / "nothing")
    one = write_shards(tmp_path / "one", [["a", "b"]])
    with pytest.raises(ValueError, match="at least 2 shards"):
        loader(one)
    tiny = write_shards(tmp_path / "tiny", [["a"], ["b"]])
    with pytest.raises(MissingDataError, match=r"rank 1 of 2\) has no documents"):  # at construction
        loader(tiny, rank=1, world_size=2, prefetch=1)


def test_background_errors_reach_the_consumer(corpus):
    data_dir, _ = corpus
    tok = ByteTokenizer()
    tok.encode = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("encode exploded"))
    dl = loader(data_dir, tok=tok, prefetch=2)
    with pytest.raises(RuntimeError, match="encode exploded"):
        next(dl)


def test_real_tokenizer_contract(corpus):
    """The loader runs with nanochat.tokenizer.Tokenizer (byte-level, no merges needed)."""
    tokmod = pytest.importorskip("nanochat.tokenizer")
    tok = tokmod.Tokenizer(tokmod.SPLIT_PATTERN, {bytes([i]): i for i in range(256)})
    data_dir, _ = corpus
    x, y = next(loader(data_dir, tok=tok, prefetch=0))
    assert (x[:, 0] == tok.bos_token_id).all() and torch.equal(x[:, 1:], y[:, :-1])


def test_shakespeare_tiny_corpus(tiny_corpus, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    docs = pq.read_table(tiny_corpus / "shard_00000.parquet").column("text").to_pylist()
    dl = DataLoader(ByteTokenizer(), 8, 256, "train", data_dir=tiny_corpus, source="text")
    x, y = next(dl)
    for row in torch.cat([x, y[:, -1:]], dim=1).tolist():
        assert row[0] == 256
        for seg in segments(row):
            prefix = bytes(seg[1:])
            assert any(d.encode().startswith(prefix) for d in docs)
    dl.close()


@pytest.mark.cuda
def test_cuda_pinned_non_blocking(binned):
    data_dir, _ = binned
    dl = loader(data_dir, "bin", device="cuda", prefetch=2)
    assert dl.pin_memory
    x, y = next(dl)
    assert x.is_cuda and y.is_cuda and x.dtype == torch.long and (x[:, 0] == 256).all()
    cpu = loader(data_dir, "bin", prefetch=0)
    assert torch.equal(x.cpu(), next(cpu)[0])
    dl.close()


# ------------------------------------------------------------------ damaged / mismatched data

def corrupt_row_group(path, rg: int) -> None:
    """Zero the start of one row group's first page: the footer stays valid, the group does not
    decode (as with a disk error mid-file)."""
    meta = pq.ParquetFile(path).metadata.row_group(rg).column(0)
    start = meta.dictionary_page_offset or meta.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start:start + 32] = bytes(32)
    path.write_bytes(bytes(raw))


def test_damaged_text_shards_are_data_errors_at_construction(tmp_path, corpus):
    data_dir, _ = corpus
    truncated = data_dir / "shard_00001.parquet"
    truncated.write_bytes(truncated.read_bytes()[:300])
    with pytest.raises(DataError, match="shard_00001.parquet: not a readable parquet file"):
        loader(data_dir)
    nulls = write_shards(tmp_path / "nulls", [["a", None, "b"], ["c"]])
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 0 has null 'text'"):
        loader(nulls)


def test_null_texts_without_statistics_fail_when_read(tmp_path):
    d = tmp_path / "nostats"
    d.mkdir()
    pq.write_table(pa.table({"text": ["ab", None]}), d / "shard_00000.parquet", write_statistics=False)
    pq.write_table(pa.table({"text": ["cd"]}), d / "shard_00001.parquet")
    dl = loader(d, prefetch=1)
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 0 has null 'text'"):
        next(dl)


def test_row_group_that_does_not_decode_names_shard_and_group(tmp_path):
    docs = [hashlib.sha256(str(i).encode()).hexdigest() * 8 for i in range(64)]
    d = tmp_path / "mid"
    d.mkdir()
    pq.write_table(pa.table({"text": docs}), d / "shard_00000.parquet", row_group_size=16, compression="zstd")
    pq.write_table(pa.table({"text": docs[:4]}), d / "shard_00001.parquet")
    corrupt_row_group(d / "shard_00000.parquet", 2)
    dl = loader(d, B=1, prefetch=0, buffer_size=1)
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 2 is unreadable .*re-create") as e:
        for _ in range(200):
            next(dl)
    assert "\n" not in str(e.value)  # printed as one line


def test_split_of_empty_documents_is_an_error(tmp_path):
    empty = write_shards(tmp_path / "empty", [["", ""], ["x"]])
    with pytest.raises(MissingDataError, match=r"split 'train' .* has no non-empty documents"):
        loader(empty)  # proven by the parquet statistics: before any batch
    assert next(loader(empty, split="val"))[0].shape == (4, 64)  # the val split is fine
    d = tmp_path / "nostats"  # without statistics only reading shows it: the first batch fails
    d.mkdir()
    pq.write_table(pa.table({"text": ["", "", ""]}), d / "shard_00000.parquet", write_statistics=False)
    pq.write_table(pa.table({"text": ["x"]}), d / "shard_00001.parquet")
    with pytest.raises(MissingDataError, match="no non-empty documents"):
        next(loader(d, prefetch=1))


def test_damaged_binary_shards_are_data_errors(binned):
    data_dir, _ = binned
    bin_dir = default_bin_dir(data_dir)
    shard = bin_dir / "shard_00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(b"garbage!" + good[8:])
    with pytest.raises(DataError, match="shard_00000.bin: not a nanochat binary token shard"):
        loader(data_dir, "bin")
    shard.write_bytes(good[:-100])
    with pytest.raises(DataError, match="shard_00000.bin: truncated or corrupt"):
        loader(data_dir, "bin")
    raw = bytearray(good)
    raw[-16:-8] = (10**6).to_bytes(8, "little")  # an offset past the end
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="shard_00000.bin: corrupt document offsets"):
        loader(data_dir, "bin")
    raw = bytearray(good)
    raw[HEADER_SIZE + 2:HEADER_SIZE + 4] = (300).to_bytes(2, "little")  # doc 0, token 1: >= vocab 257
    shard.write_bytes(bytes(raw))
    dl = loader(data_dir, "bin", prefetch=1)  # ids are checked as documents are read
    with pytest.raises(DataError, match="shard_00000.bin: document 0 has token id 300 >= the vocab size 257"):
        for _ in range(100):
            next(dl)
    shard.write_bytes(good)
    other_vocab = ByteTokenizer()
    other_vocab.vocab_size = 300
    with pytest.raises(DataError, match="made for vocab size 257, the tokenizer has 300"):
        loader(data_dir, "bin", tok=other_vocab)
    with pytest.raises(DataError, match="tokenizer mismatch"):
        loader(data_dir, "bin", tok=ByteTokenizer("other"))


def test_stale_binary_shards_are_refused_when_picked_automatically(binned):
    data_dir, shards = binned
    bin_dir = default_bin_dir(data_dir)
    assert loader(data_dir, "auto").describe_source() == f"binary token shards {bin_dir}"
    write_shards(data_dir, [shards[0], shards[1][:-3]] + shards[2:])  # shard 1 changed since
    with pytest.raises(DataError) as e:
        loader(data_dir, "auto")
    msg = str(e.value)
    assert f"{bin_dir} was made from other text shards than {data_dir}" in msg
    assert "changed: shard_00001.parquet" in msg and "pretokenize" in msg and "--force" in msg
    loader(data_dir, "bin")  # asked for explicitly: read as they are
    meta = json.loads((bin_dir / META_NAME).read_text())
    del meta["text_shards"]  # a directory made before the record existed: accepted
    (bin_dir / META_NAME).write_text(json.dumps(meta))
    loader(data_dir, "auto")
    pretokenize(sorted(data_dir.glob("*.parquet")), bin_dir, ByteTokenizer(), log=lambda *a: None)
    assert loader(data_dir, "auto").describe_source().startswith("binary token shards")
    (data_dir / "shard_00004.parquet").write_bytes((data_dir / "shard_00003.parquet").read_bytes())
    with pytest.raises(DataError, match="new: shard_00004.parquet"):
        loader(data_dir, "auto")
    assert loader(data_dir, "text").describe_source() == f"text shards {data_dir}"


def test_unfinished_binary_shard_directories_are_refused(binned):
    """An interrupted pretokenize leaves some shards: read as a whole, its last one (a train shard)
    would be the validation split. Refused, picked automatically or asked for, until a rerun."""
    from nanochat import binshards as bs
    data_dir, _ = binned
    bin_dir = default_bin_dir(data_dir)
    text = sorted(data_dir.glob("*.parquet"))
    bs.start_run(bin_dir, text, data_dir)  # what a run records before its first shard
    (bin_dir / "shard_00003.bin").unlink()
    for source in ("auto", "bin"):
        with pytest.raises(DataError) as e:
            loader(data_dir, source)
        msg = str(e.value)
        assert f"{bin_dir} is incomplete" in msg and "3 of 4 binary shards written; missing: shard_00003.bin" in msg
        assert f"python -m scripts.pretokenize --data-dir {data_dir}" in msg
    with pytest.raises(DataError, match="is incomplete"):
        loader(data_dir, "auto", split="val")
    pretokenize(text, bin_dir, ByteTokenizer(), log=lambda *a: None)  # the rerun finishes it
    assert loader(data_dir, "auto").describe_source() == f"binary token shards {bin_dir}"
    meta = json.loads((bin_dir / META_NAME).read_text())
    del meta["complete"]  # a finished directory from before `complete` existed: still read
    (bin_dir / META_NAME).write_text(json.dumps(meta))
    assert loader(data_dir, "auto").describe_source() == f"binary token shards {bin_dir}"
    loader(data_dir, "bin", split="val")
    # ... and one of those left by an interrupted run: no record at all
    del meta["text_shards"]
    (bin_dir / META_NAME).write_text(json.dumps(meta))
    (bin_dir / "shard_00003.bin").unlink()
    with pytest.raises(DataError, match=r"holds 3 binary shards, not one for each of the 4 text shards in .*"
                                        r"\(missing: shard_00003.bin\); re-run `python -m scripts.pretokenize"):
        loader(data_dir, "auto")


def test_invalid_utf8_text_fails_the_first_batch_naming_the_shard(tmp_path):
    d = write_shards(tmp_path / "d", [make_docs(20), make_docs(5, seed=1)])
    texts = pa.array([t.encode() for t in make_docs(20)[:19]] + [b"bad \xff"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": texts}), d / "shard_00000.parquet", row_group_size=16)
    dl = loader(d, prefetch=1)  # construction reads footers only (their max is not UTF-8 either)
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 1 holds text that is not valid UTF-8 "
                                        r"\(row 3, byte 4: invalid start byte\)"):
        for _ in range(20):
            next(dl)


# ------------------------------------------------------------------ audit regressions

def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
@pytest.mark.parametrize("source", ["text", "bin"])
def test_many_shards_do_not_hold_a_file_each(tmp_path, source):
    """Every shard was kept open (a parquet reader or a memmap each): a split of more shards than
    the open-file limit (1024 by default) failed, text shards with 'not a readable parquet file
    ... Too many open files; delete it and re-create'."""
    d = write_shards(tmp_path / "d", [make_docs(3, seed=i) for i in range(60)])
    if source == "bin":
        pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), ByteTokenizer(), log=lambda *a: None)
    import gc
    gc.collect()  # earlier tests' loaders: closed now, not while counting
    before = open_fds()
    dl = loader(d, source, B=2, T=400, prefetch=0, buffer_size=40)
    assert open_fds() - before <= 3
    for _ in range(6):  # ~2 passes over all 59 train shards
        next(dl)
    assert open_fds() - before <= 12  # the shard being read (binary: a few, for the buffer)
    dl.close()


@pytest.mark.parametrize("source", ["text", "bin"])
def test_shard_replaced_after_construction_is_a_data_error(binned, source):
    """Shards are reopened as they are read: one that changed since is named, not misread."""
    from nanochat.binshards import write_shard
    data_dir, shards = binned
    dl = loader(data_dir, source, prefetch=0)
    if source == "text":
        write_shards(data_dir, [shards[0][:-5]])
    else:
        write_shard(default_bin_dir(data_dir) / "shard_00000.bin", [[256, 97]], vocab_size=257,
                    bos_token_id=256, fingerprint=ByteTokenizer().fingerprint)
    with pytest.raises(DataError, match=r"shard_00000\.(parquet|bin): changed since the data loader opened it"):
        next(dl)


def test_resume_of_a_text_run_after_pretokenizing(corpus):
    """A run started on text shards, then pretokenized: the resumed loader (source auto) picked
    the binary shards and refused the checkpoint's state; there is no flag to pick the source."""
    data_dir, _ = corpus
    ref = loader(data_dir, "auto", prefetch=2)
    batches, states = [], []
    for _ in range(10):
        batches.append(next(ref))
        states.append(ref.state_dict())
    ref.close()
    state3, state = states[2], states[-1]
    pretokenize(sorted(data_dir.glob("*.parquet")), default_bin_dir(data_dir), ByteTokenizer(), log=lambda *a: None)
    dl = loader(data_dir, "auto", prefetch=2)
    assert dl.describe_source().startswith("binary token shards")
    dl.load_state_dict(state3)  # continues exactly, on the text shards the checkpoint read
    assert dl.describe_source() == f"text shards {data_dir}"
    for j in range(3, 10):
        x, y = next(dl)
        assert torch.equal(x, batches[j][0]) and torch.equal(y, batches[j][1])
    assert dl.state_dict() == state
    dl.close()
    with pytest.raises(RequestError, match="--device-batch-size"):  # other settings: still refused
        loader(data_dir, "auto", B=5).load_state_dict(state)
    bin_state = loader(data_dir, "bin").state_dict()
    for p in default_bin_dir(data_dir).iterdir():
        p.unlink()
    with pytest.raises(RequestError, match=r"read binary token shards, .*python -m scripts.pretokenize"):
        loader(data_dir, "auto").load_state_dict(bin_state)


def test_local_txt_with_windows_line_endings_is_split_at_blank_lines(tmp_path):
    """A long CRLF .txt file (Project Gutenberg's format) was never split (the blank-line pattern
    wanted \\n\\n), so it became one document, cropped by the loader to a single row."""
    from nanochat.local_data import read_local_documents
    src = tmp_path / "src"
    src.mkdir()
    paras = [f"paragraph {i:03d} " + " ".join(["word"] * 60) for i in range(300)]  # ~93k characters
    (src / "book.txt").write_bytes("\r\n\r\n".join(p.replace(" word", "\r\nword", 1) for p in paras).encode())
    docs = read_local_documents(src, max_doc_chars=20_000)
    assert len(docs) >= 4 and max(map(len, docs)) <= 21_000
    assert "\r" not in "".join(docs)  # read like Python's text mode: \r\n -> \n
    assert "\n\n".join(docs) == "\n\n".join(p.replace(" word", "\nword", 1) for p in paras)
