"""DataLoader: best-fit packing invariants, rank sharding, exact resume with prefetch in flight
(text and binary paths), the validation iterator and the clear errors."""

import hashlib
import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiktoken
import torch

from nanochat.binshards import default_bin_dir
from nanochat.binshards_runs import write_meta
from nanochat.dataloader import DataLoader
from nanochat.errors import MissingDataError, RequestError
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
    with pytest.raises(RequestError, match=r"--resume: the checkpoint's data loader had world size 1, "
                                           r"this run's has 2; resume with the original run's data and flags"):
        loader(data_dir, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(RequestError, match="had the tokenizer"):
        loader(data_dir, tok=ByteTokenizer("other")).load_state_dict(state)
    pq.write_table(pa.table({"text": ["changed"]}), data_dir / "shard_00001.parquet")
    with pytest.raises(RequestError, match="had the shard sizes of --data-dir"):  # the data changed under it
        loader(data_dir).load_state_dict(state)


def test_resume_at_another_batch_size_reads_the_same_rows(corpus):
    """Rows are packed one by one whatever the batch size, so a state taken at batch size 4 resumes
    at 2 or 6 with the same rows, in order (base_train's rerun at a lower --device-batch-size after
    an out-of-memory stop); the state then records the new batch size."""
    data_dir, _ = corpus
    first = loader(data_dir, B=4)
    next(iter(first))
    state = first.state_dict()
    want = torch.cat([b[0] for _, b in zip(range(3), first)])   # the next 12 rows, at batch size 4
    for B in (2, 6):
        other = loader(data_dir, B=B)
        other.load_state_dict(state)
        assert other.state_dict()["batch_size"] == B
        rows = torch.cat([b[0] for _, b in zip(range(12 // B), other)])
        assert torch.equal(rows, want), B


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
