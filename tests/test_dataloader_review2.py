"""Review 2 of the pretraining data path: the DataLoader checked against a slow-but-obvious
reference packer written here from the documented rules (bit for bit, every row, on the tiny
Shakespeare corpus and on a synthetic corpus with empty, unicode, exact-fit and over-long
documents), token accounting (every document token emitted once or counted as dropped), rank
partitions, exact resume at every batch (prefetch in flight, shard and epoch boundaries),
binary == text, shutdown with threads in flight, and user-facing errors."""

import json
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.binshards import default_bin_dir
from nanochat.dataloader import DataLoader
from nanochat.errors import DataError, MissingDataError
from scripts.pretokenize import pretokenize
from tests.test_dataloader import ByteTokenizer, write_shards

BOS = 256


# ---------------------------------------------------------------- the reference

def shard_groups(path) -> list[list[str]]:
    """A parquet shard's texts, row group by row group."""
    pf = pq.ParquetFile(path)
    return [pf.read_row_group(g, columns=["text"]).column("text").to_pylist() for g in range(pf.num_row_groups)]


def rank_docs(shards: list[list[list[str]]], rank: int, world: int, binary: bool = False) -> list[list[int]]:
    """One pass of this rank's documents as tokens (BOS + utf-8 bytes). Text shards deal row r of
    row group g of shard s to rank (r + s + g) % world; binary shards number documents across
    the whole shard (g = 0), as documented."""
    out = []
    for s, groups in enumerate(shards):
        flat = [(g, r, t) for g, texts in enumerate(groups) for r, t in enumerate(texts)]
        for i, (g, r, text) in enumerate(flat):
            if ((i + s) if binary else (r + s + g)) % world == rank:
                out.append([BOS] + list(text.encode("utf-8")))
    return out


def reference_rows(docs: list[list[int]], T: int, buffer_size: int, repeat: bool, n_rows: int):
    """The documented best-fit packer, written plainly: returns (rows, read, dropped) where rows
    hold up to T+1 tokens (a short row only at the end of a finite pass)."""
    cap, buf, seq, rows, read, dropped = T + 1, [], 0, [], 0, 0
    stream = (d for _ in iter(int, 1) for d in docs) if repeat else iter(docs)
    exhausted = False
    while len(rows) < n_rows:
        row = []
        while len(row) < cap:
            while len(buf) < buffer_size and not exhausted:
                doc = next(stream, None)
                if doc is None:
                    exhausted = True
                    break
                read += len(doc)
                dropped += max(len(doc) - cap, 0)
                buf.append((seq, doc[:cap]))
                seq += 1
            if not buf:
                break
            room = cap - len(row)
            fits = [d for d in buf if len(d[1]) <= room]
            pick = max(fits, key=lambda d: (len(d[1]), d[0])) if fits else min(buf, key=lambda d: (len(d[1]), d[0]))
            buf.remove(pick)
            row += pick[1][:room]
            dropped += max(len(pick[1]) - room, 0)
        if not row:
            break
        rows.append(row)
    return rows, read, dropped


def reference_batches(rows: list[list[int]], B: int, T: int, finite: bool):
    """Rows -> (x, y) batches; a finite pass pads its last batch with BOS and targets -1."""
    out = []
    for i in range(0, len(rows), B):
        chunk = rows[i:i + B]
        if len(chunk) < B and not finite:
            break
        chunk = chunk + [[]] * (B - len(chunk))
        x = torch.full((B, T), BOS, dtype=torch.long)
        y = torch.full((B, T), -1, dtype=torch.long)
        for b, row in enumerate(chunk):
            full = row + [BOS] * (T + 1 - len(row))
            x[b] = torch.tensor(full[:-1])
            y[b] = torch.tensor(full[1:])
            if len(row) < T + 1:  # padding: no target from the last real token on
                y[b, max(len(row) - 1, 0):] = -1
        out.append((x, y))
    return out


def drain(dl, limit=None):
    got = []
    for x, y in dl:
        got.append((x.clone(), y.clone()))
        if limit is not None and len(got) >= limit:
            break
    return got


def assert_same(got, want):
    assert len(got) == len(want), (len(got), len(want))
    for i, ((x, y), (wx, wy)) in enumerate(zip(got, want)):
        assert torch.equal(x, wx), f"batch {i}: inputs differ"
        assert torch.equal(y, wy), f"batch {i}: targets differ"


@pytest.fixture(scope="module")
def tiny(tiny_corpus):
    return [shard_groups(p) for p in sorted(tiny_corpus.glob("*.parquet"))]


@pytest.fixture
def base_env(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))


@pytest.mark.parametrize("T,B,world,buffer_size", [(64, 1, 1, 8), (700, 3, 2, 16), (3000, 5, 3, 64),
                                                   (4000, 2, 1, 1000)])
def test_tiny_corpus_full_pass_matches_the_reference_packer(tiny_corpus, tiny, base_env, T, B, world, buffer_size):
    """One finite pass per rank: every row bit for bit, the padded final batch, and the token
    accounting (read = emitted + dropped; read = every token of this rank's documents)."""
    for rank in range(world):
        docs = rank_docs(tiny[:-1], rank, world)
        rows, read, dropped = reference_rows(docs, T, buffer_size, repeat=False, n_rows=10**9)
        assert read == sum(map(len, docs)) == sum(map(len, rows)) + dropped
        dl = DataLoader(ByteTokenizer(), B, T, "train", data_dir=tiny_corpus, source="text", rank=rank,
                        world_size=world, buffer_size=buffer_size, repeat=False, prefetch=2)
        assert_same(drain(dl), reference_batches(rows, B, T, finite=True))
        s = dl.state_dict()
        assert (s["tokens_read"], s["tokens_dropped"]) == (read, dropped)
        assert dl.dropped_fraction == pytest.approx(dropped / read)


def synthetic_docs(n: int, seed: int = 0) -> list[str]:
    """Empty documents, unicode, documents of exactly one row and far longer than one."""
    import random
    rng = random.Random(seed)
    pool = ["", "a", "h\u00e9llo \u2603", "\U0001F600" * 3, "x" * 16, "y" * 17, "z" * 15, "w" * 90]
    return [rng.choice(pool) if rng.random() < 0.4 else
            "".join(rng.choice("abc d\u00e9") for _ in range(rng.randint(0, 40))) for _ in range(n)]


@pytest.fixture
def synth(tmp_path, base_env):
    shards = [synthetic_docs(37, 1), synthetic_docs(1, 2), [], synthetic_docs(50, 3), synthetic_docs(23, 4)]
    d = write_shards(tmp_path / "synth", shards, row_group_size=7)
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "shard_00002.parquet")  # 0 rows
    return d, [shard_groups(p) for p in sorted(d.glob("*.parquet"))]


@pytest.mark.parametrize("T,B,buffer_size,world", [(16, 1, 1, 1), (16, 4, 3, 1), (7, 3, 5, 2), (33, 2, 200, 3),
                                                   (1, 2, 4, 1)])
def test_synthetic_repeating_stream_matches_the_reference(synth, T, B, buffer_size, world):
    """Several epochs (buffer_size 200 > a pass: a document is buffered twice across epochs)."""
    d, shards = synth
    for rank in range(world):
        docs = rank_docs(shards[:-1], rank, world)
        n = 3 * len(docs) // B + 5
        rows, _, _ = reference_rows(docs, T, buffer_size, repeat=True, n_rows=n * B)
        for source in ("text", "bin"):
            if source == "bin" and world > 1:
                continue  # binary shards deal documents across a whole shard: tested below
            if source == "bin" and not default_bin_dir(d).exists():
                pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), ByteTokenizer(), log=lambda *a: None)
            dl = DataLoader(ByteTokenizer(), B, T, "train", data_dir=d, source=source, rank=rank, world_size=world,
                            buffer_size=buffer_size, prefetch=1)
            assert_same(drain(dl, n), reference_batches(rows, B, T, finite=False))
            assert dl.epoch >= 2
            dl.close()


@pytest.mark.parametrize("world", [2, 3])
def test_binary_shards_at_several_ranks_match_the_reference(synth, world):
    d, shards = synth
    pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), ByteTokenizer(), log=lambda *a: None)
    union = []
    for rank in range(world):
        docs = rank_docs(shards[:-1], rank, world, binary=True)
        union += docs
        rows, _, _ = reference_rows(docs, 16, 4, repeat=False, n_rows=10**9)
        dl = DataLoader(ByteTokenizer(), 3, 16, "train", data_dir=d, source="bin", rank=rank, world_size=world,
                        buffer_size=4, repeat=False, prefetch=1)
        assert_same(drain(dl), reference_batches(rows, 3, 16, finite=True))
    assert sorted(union) == sorted(rank_docs(shards[:-1], 0, 1))


def test_rank_partitions_are_disjoint_and_cover_the_split(synth):
    """The reference's rank rule itself: each document of a pass on exactly one rank (text)."""
    _, shards = synth
    keys = [(s, g, r) for s, groups in enumerate(shards[:-1]) for g, texts in enumerate(groups)
            for r in range(len(texts))]
    for world in (1, 2, 3):
        owners = [[k for k in keys if (k[0] + k[1] + k[2]) % world == rank] for rank in range(world)]
        assert sorted(sum(owners, [])) == sorted(keys)
        assert max(map(len, owners)) - min(map(len, owners)) <= len(keys) // world // 2 + 2


# ---------------------------------------------------------------- exact resume

@pytest.mark.parametrize("source,rank,world", [("text", 0, 1), ("bin", 0, 1), ("text", 2, 3), ("bin", 1, 2)])
@pytest.mark.parametrize("repeat", [False, True])
def test_resume_after_every_batch_reproduces_the_rest(synth, source, rank, world, repeat):
    """States taken after every batch (prefetch 3 running ahead), through shard boundaries, epoch
    ends and, finite, the last batch: each resumed loader yields exactly the remaining stream.
    Repeating, the stream is taken into its third epoch (two epoch ends, each pass's shard
    boundaries, a buffer carried across an epoch end), not to 100 batches: rank 2 of 3 went
    through 12 epochs there, 79 resumes of the same boundaries over again."""
    d, _ = synth
    if source == "bin":
        pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), ByteTokenizer(), log=lambda *a: None)
    make = lambda: DataLoader(ByteTokenizer(), 3, 12 if world == 1 else 6, "train", data_dir=d, source=source,
                              buffer_size=5, prefetch=3, repeat=repeat, rank=rank, world_size=world)
    ref, batches, states = make(), [], []
    for x, y in ref:
        batches.append((x.clone(), y.clone()))
        states.append(json.loads(json.dumps(ref.state_dict())))
        if len(batches) == 100 or (repeat and states[-1]["epoch"] >= 3):
            break
    ref.close()
    assert {s["cursor"][0] for s in states} >= {0, 3} and (repeat or len(batches) < 100)
    assert not repeat or states[-1]["epoch"] >= 2
    edges = {k for k in range(1, len(states)) if states[k]["epoch"] != states[k - 1]["epoch"]
             or states[k]["cursor"][0] != states[k - 1]["cursor"][0]}
    assert len(edges) >= (2 if repeat else 1)
    for k, state in enumerate(states):
        if repeat and not ({k - 1, k, k + 1} & edges or k % 9 == 0 or k == len(states) - 1):
            continue  # every state of the finite pass; around every boundary when repeating
        dl = make()
        dl.load_state_dict(state)
        assert_same(drain(dl, len(batches) - k - 1) if k + 1 < len(batches) or not repeat else [], batches[k + 1:])
        if repeat:
            assert dl.state_dict() == states[-1] if k + 1 < len(states) else True
        if not repeat:
            with pytest.raises(StopIteration):
                next(dl)
        dl.close()


# ---------------------------------------------------------------- memory and shutdown

def test_buffered_long_documents_hold_one_row_not_the_whole_document(tmp_path, base_env):
    """A document longer than a row is cropped to T+1 tokens as it enters the buffer, and so must
    its tokens be: the buffer held every long document whole (1000 buffered books of 300K tokens
    = GBs per rank; here 1M-token documents, buffered ~10 times over the cycling passes)."""
    import tracemalloc
    d = write_shards(tmp_path / "big", [["x" * 1_000_000, "small doc", "one more small doc"], ["v"]])
    dl = DataLoader(ByteTokenizer(), 2, 16, "train", data_dir=d, source="text", prefetch=0, buffer_size=20)
    tracemalloc.start()
    try:
        x, _ = next(dl)  # the packer (prefetch 0: this thread) keeps its buffer between batches
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert x[0].tolist() == [BOS] + [ord("x")] * 15
    # expected: the encode chunk being read (one 4 MB int32 document); before: ~10 of them
    assert held < 12_000_000, f"{held:,} bytes held after one batch"


class SlowAfter(ByteTokenizer):
    """Encodes instantly for the first `fast` calls, then takes `delay` seconds a call."""

    def __init__(self, fast: int, delay: float):
        super().__init__()
        self.fast, self.delay, self.calls = fast, delay, 0

    def encode(self, *a, **k):
        import time
        self.calls += 1
        if self.calls > self.fast:
            time.sleep(self.delay)
        return super().encode(*a, **k)


def test_close_with_the_producer_mid_batch_returns_promptly(tmp_path, base_env):
    """close() stops the prefetch thread between documents, not only once the batch it is
    packing is done: with a slow tokenizer (or a huge document, a slow file system) one batch of
    32 rows takes 32 encode calls, and close() (base_train's exit, each evaluation's val loader)
    waited for all of them."""
    import time
    d = write_shards(tmp_path / "d", [["y" * 40] * 200, ["v"]])
    tok = SlowAfter(fast=32, delay=0.1)
    dl = DataLoader(tok, 32, 16, "train", data_dir=d, source="text", prefetch=1, buffer_size=1, encode_batch=1)
    next(dl)  # 32 fast encode calls; the thread is now packing batch 2 at 0.1 s a document
    time.sleep(0.3)
    t0 = time.perf_counter()
    closer = threading.Thread(target=dl.close, daemon=True)
    closer.start()
    closer.join(timeout=30)
    took = time.perf_counter() - t0
    assert not closer.is_alive(), "close() hung"
    assert took < 1.0, f"close() took {took:.2f} s with a batch in flight"
    tok.fast = 10**9
    x, _ = next(dl)  # a closed loader restarts from the last batch handed out
    assert x.shape == (32, 16)
    dl.close()


def test_tiny_corpus_binary_shards_give_the_text_rows_and_val_never_leaks(tiny_corpus, tiny, tmp_path, base_env):
    """Pretokenized shards give bit-for-bit the rows of on-the-fly tokenizing (train and val, one
    rank); the val split is exactly the last shard's documents and no train row holds one."""
    bin_dir = tmp_path / "tiny_tokens"
    pretokenize(sorted(tiny_corpus.glob("*.parquet")), bin_dir, ByteTokenizer(), log=lambda *a: None)
    for split, shards in (("train", tiny[:-1]), ("val", tiny[-1:])):
        rows, _, _ = reference_rows(rank_docs(shards, 0, 1), 1500, 32, repeat=False, n_rows=10**9)
        want = reference_batches(rows, 4, 1500, finite=True)
        for source in ("text", "bin"):
            dl = DataLoader(ByteTokenizer(), 4, 1500, split, data_dir=tiny_corpus, bin_dir=bin_dir, source=source,
                            buffer_size=32, repeat=False, prefetch=2)
            assert_same(drain(dl), want)
    val = {t for groups in tiny[-1:] for texts in groups for t in texts}
    train = {t for groups in tiny[:-1] for texts in groups for t in texts}
    assert not val & train  # the corpus itself: the split is by shard, so this is what can leak


# ---------------------------------------------------------------- what a user can hand it

def test_data_dir_shapes_a_user_can_hand_it(tmp_path, base_env):
    """No parquet files; a 0-row shard (train: skipped, val: refused naming it); a `text` column
    of bytes or ints (refused naming the file and the column types); one document far longer than
    a row (one row of it, the rest counted as dropped)."""
    empty = tmp_path / "none"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a shard")
    with pytest.raises(MissingDataError, match=rf"no text shards \(\*\.parquet\) in {empty}"):
        DataLoader(ByteTokenizer(), 2, 8, "train", data_dir=empty)
    d = write_shards(tmp_path / "d", [["ab", "cd"], ["x"], ["v"]])
    none = pa.table({"text": pa.array([], pa.string())})
    pq.write_table(none, d / "shard_00001.parquet")
    rows = [x[0].tolist() for x, _ in DataLoader(ByteTokenizer(), 1, 2, "train", data_dir=d, repeat=False)]
    assert rows == [[BOS, ord("c")], [BOS, ord("a")]]  # equal lengths: the newest first
    pq.write_table(none, d / "shard_00002.parquet")
    with pytest.raises(MissingDataError, match=r"split 'val' .* has no documents \(shards: shard_00002.parquet\)"):
        DataLoader(ByteTokenizer(), 1, 2, "val", data_dir=d)
    for bad in (pa.array([b"ab"], pa.binary()), pa.array([1], pa.int64())):
        pq.write_table(pa.table({"text": bad}), d / "shard_00000.parquet")
        with pytest.raises(DataError, match=rf"shard_00000.parquet: wrong schema: expected a string column 'text', "
                                            rf"found columns \['text: {bad.type}'\]"):
            DataLoader(ByteTokenizer(), 1, 2, "train", data_dir=d)
    huge = write_shards(tmp_path / "huge", [["h" * 3_000_000, "ok"], ["v"]])
    dl = DataLoader(ByteTokenizer(), 2, 16, "train", data_dir=huge, repeat=False, buffer_size=4)
    (x, y), = list(dl)
    assert x[0].tolist() == [BOS] + [ord("h")] * 15 and y[0].tolist() == [ord("h")] * 16
    assert x[1].tolist() == [BOS, ord("o"), ord("k")] + [BOS] * 13 and y[1].tolist() == [ord("o"), ord("k")] + [-1] * 14
    assert dl.state_dict()["tokens_dropped"] == 3_000_001 - 17


def test_a_synchronous_loader_does_not_end_silently_after_an_error(synth):
    """prefetch=0: an exception inside the packer (a bad row group, Ctrl-C while tokenizing) used
    to leave a dead generator, so the next call raised StopIteration: an endless train stream
    looking finished. Now the next call retries from the last batch handed out (a persistent error
    raises again; a passing one gives exactly the batch an undisturbed loader gives)."""
    d, _ = synth
    want = [x for x, _ in drain(DataLoader(ByteTokenizer(), 2, 8, "train", data_dir=d, prefetch=0), 60)]
    tok, fail = ByteTokenizer(), {"n": 0}
    encode = tok.encode

    def flaky(*a, **k):
        if fail["n"]:
            fail["n"] -= 1
            raise KeyboardInterrupt
        return encode(*a, **k)
    tok.encode = flaky
    dl = DataLoader(tok, 2, 8, "train", data_dir=d, prefetch=0)
    assert torch.equal(next(dl)[0], want[0])
    fail["n"] = 10**9
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            for _ in range(50):
                next(dl)
    fail["n"] = 0
    k = dl.state_dict()["batches"]
    assert k < 50 and torch.equal(next(dl)[0], want[k]), "continues after the last batch handed out"
