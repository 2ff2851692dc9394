"""Review 15 of the pretraining data path, on the tiny Shakespeare corpus: a binary loader no
longer reads every token of its split at construction (its per-document BOS check moved to the
read), a repeating train split with less than one batch for a rank is refused naming the flags and
the directory (it was cycled hundreds of times inside each batch), and exact resume at shard,
row-group and epoch boundaries for 1, 2 and 3 ranks on text and binary shards."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.binshards import HEADER_SIZE, BinShard, default_bin_dir
from nanochat.dataloader import DataLoader
from nanochat.errors import DataError, MissingDataError
from scripts.pretokenize import pretokenize


@pytest.fixture(scope="module")
def texts(tiny_corpus):
    train = pq.read_table(tiny_corpus / "shard_00000.parquet", columns=["text"]).column("text").to_pylist()
    val = pq.read_table(tiny_corpus / "shard_00001.parquet", columns=["text"]).column("text").to_pylist()
    return train, val


def write(d, shards, row_group_size=16):
    d.mkdir(parents=True, exist_ok=True)
    for i, docs in enumerate(shards):
        pq.write_table(pa.table({"text": pa.array(docs, pa.string())}), d / f"shard_{i:05d}.parquet",
                       row_group_size=row_group_size)
    return d


def binned(d, tok):
    pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), tok, log=lambda *a: None)
    return d


@pytest.fixture
def corpus(tmp_path, texts, tiny_tokenizer, monkeypatch):
    """Tiny-corpus scenes in 3 train shards (row groups of 16; the middle one has zero rows; the
    last adds an empty document and one longer than a row), the val works as the last shard, and
    their binary shards."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    train, val = texts
    shards = [train[:40], [], train[40:70] + ["", "\n\n".join(train[70:74])], val[:8]]
    return binned(write(tmp_path / "data", shards), tiny_tokenizer)


def test_binary_loader_construction_does_not_scan_every_document(corpus, tiny_tokenizer):
    """Constructing a binary loader checked every document's BOS, which reads (nearly) every page
    of tokens: on the offline docs corpus 65.7 of its 65.7 MB of train shards, cold, per rank and
    per start (a real corpus: the whole data set). The check now happens as a document is read,
    with the same DataError naming the shard and the document."""
    shard = default_bin_dir(corpus) / "shard_00002.bin"
    sh = BinShard(shard)
    doc, start, itemsize = 17, int(sh.offsets[17]), sh.header.dtype.itemsize
    del sh
    raw = bytearray(shard.read_bytes())
    raw[HEADER_SIZE + start * itemsize:HEADER_SIZE + (start + 1) * itemsize] = (5).to_bytes(itemsize, "little")
    shard.write_bytes(bytes(raw))
    dl = DataLoader(tiny_tokenizer, 2, 256, "train", data_dir=corpus, source="bin", prefetch=1)  # no scan
    with pytest.raises(DataError, match=rf"shard_00002.bin: document {doc} does not start with BOS .*pretokenize"):
        for _ in range(200):
            next(dl)
    dl.close()


def test_a_train_split_smaller_than_one_batch_is_refused_naming_flags_and_dir(tmp_path, texts, tiny_tokenizer,
                                                                                monkeypatch):
    """3 scenes of Shakespeare at --device-batch-size 8 x --max-seq-len 2048: every batch held them
    over and over (the loader's epoch counter read 500+ after the first batch) without a word."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    train, val = texts
    d = write(tmp_path / "small", [train[:3], val[:2]])
    dl = DataLoader(tiny_tokenizer, 8, 2048, "train", data_dir=d, source="text", prefetch=1)
    with pytest.raises(MissingDataError) as e:   # text: known once the first pass is read
        next(dl)
    msg = str(e.value)
    assert "--device-batch-size 8" in msg and "--max-seq-len 2048" in msg and str(d) in msg, msg
    assert "less than one batch" in msg and "shard_00000.parquet" in msg and "fewer ranks" not in msg
    binned(d, tiny_tokenizer)
    with pytest.raises(MissingDataError, match=r"rank 1 of 2\) holds .* tokens in one pass .*less than one batch"
                                               r".*, or use fewer ranks$"):
        DataLoader(tiny_tokenizer, 2, 2048, "train", data_dir=d, source="bin", rank=1, world_size=2)  # at once
    # what is fine: enough for a batch; the finite val pass (its last batch padded)
    x, _ = next(DataLoader(tiny_tokenizer, 2, 512, "train", data_dir=d, source="bin", prefetch=0))
    assert x.shape == (2, 512)
    assert len(list(DataLoader(tiny_tokenizer, 8, 2048, "val", data_dir=d, repeat=False))) == 1


@pytest.mark.parametrize("source", ["text", "bin"])
def test_exact_resume_at_boundaries_for_one_two_and_three_ranks(corpus, tiny_tokenizer, source):
    """States after every batch through two epoch ends (cursors mid-row-group, across the zero-row
    shard and the shard ends): a loader resumed from the state at each boundary, and from a few
    states between, yields exactly the rest of the uninterrupted stream. The state is small,
    JSON- and torch.load(weights_only=True)-able, and never names the val shard."""
    for world in (1, 2, 3):
        for rank in range(world):
            make = lambda: DataLoader(tiny_tokenizer, 2, 512, "train", data_dir=corpus, source=source, rank=rank,
                                      world_size=world, buffer_size=8, prefetch=2)
            ref, batches, states = make(), [], []
            for x, y in ref:
                batches.append(torch.stack([x, y]).clone())
                states.append(ref.state_dict())
                if states[-1]["epoch"] >= 2:
                    break
            ref.close()
            # a new epoch, shard or (text) row group: the cursor without its row / document
            edges = {k for k in range(1, len(states)) if states[k]["epoch"] != states[k - 1]["epoch"]
                     or states[k]["cursor"][:-1] != states[k - 1]["cursor"][:-1]}
            assert len({s["epoch"] for s in states}) == 3 and edges
            picks = sorted({k - 1 for k in edges} | set(range(0, len(states) - 1, 11)))
            for k in picks:
                state = json.loads(json.dumps(states[k]))
                buf = io.BytesIO()
                torch.save(state, buf)
                assert torch.load(io.BytesIO(buf.getvalue()), weights_only=True) == state
                assert len(json.dumps(state)) < 1500 and "shard_00003" not in json.dumps(state["shards"])
                dl = make()
                dl.load_state_dict(state)
                rest = [torch.stack(next(dl)) for _ in range(len(batches) - k - 1)]
                dl.close()
                assert all(torch.equal(a, b) for a, b in zip(rest, batches[k + 1:])), (source, world, rank, k)
