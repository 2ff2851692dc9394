"""Review 3 of the pretraining dataloader: the figures it reports (dropped_fraction) checked against
what the emitted batches and the resume state say independently, early in the stream while the
packing buffer is still full of documents read but not yet packed; the cost of the binary shards'
freshness check when a loader is made again and again (base_train's val loader per evaluation)."""

import os
from pathlib import Path

import pytest

from nanochat import binshards_runs as runs
from nanochat.binshards import default_bin_dir
from nanochat.dataloader import DataLoader
from nanochat.errors import DataError
from scripts.pretokenize import pretokenize
from tests.test_dataloader import ByteTokenizer, make_docs, write_shards


@pytest.fixture
def one_shard(tmp_path, monkeypatch):
    """One train shard (row groups of 16) + a val shard, documents of 7..127 tokens."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    docs = make_docs(400, seed=3)
    return write_shards(tmp_path / "data", [docs[:360], docs[360:]]), docs[:360]


def consumed_and_dropped(state: dict, docs: list[str], emitted: int) -> tuple[int, int]:
    """Tokens of the documents that have LEFT the packing buffer (read before the cursor, not in
    the buffer) and how many of them were cropped away (those tokens minus the emitted ones)."""
    si, rg, row = state["cursor"]
    assert si == 0 and state["epoch"] == 0
    read = rg * 16 + row
    buffered = {g * 16 + r for _, g, r in state["buffer"]}
    consumed = sum(len(d.encode()) + 1 for i, d in enumerate(docs[:read]) if i not in buffered)
    return consumed, consumed - emitted


@pytest.mark.parametrize("T", [64, 512])  # crops at row ends only (512) and also on entry (64)
def test_dropped_fraction_counts_only_documents_that_were_packed(one_shard, T):
    """dropped_fraction is the share of the packed documents' tokens that packing cut away. It
    used to divide by every token READ, including the whole packing buffer (documents not yet
    packed): early in a run (what profile_dataloader measures) that reported 0.1% for 3%."""
    d, docs = one_shard
    B = 2
    dl = DataLoader(ByteTokenizer(), B, T, "train", data_dir=d, source="text", buffer_size=64, prefetch=2)
    for k in range(1, 6):
        next(dl)
        consumed, dropped = consumed_and_dropped(dl.state_dict(), docs, k * B * (T + 1))
        assert dropped > 0 and dl.dropped_fraction == pytest.approx(dropped / consumed, rel=1e-12), k
    state = dl.state_dict()
    dl.close()
    resumed = DataLoader(ByteTokenizer(), B, T, "train", data_dir=d, source="text", buffer_size=64, prefetch=0)
    resumed.load_state_dict(state)  # the figure survives a resume, and keeps counting after it
    assert resumed.dropped_fraction == pytest.approx(dl.dropped_fraction, rel=1e-12)
    next(resumed)
    consumed, dropped = consumed_and_dropped(resumed.state_dict(), docs, 6 * B * (T + 1))
    assert resumed.dropped_fraction == pytest.approx(dropped / consumed, rel=1e-12)


def test_text_shards_copied_without_their_times_are_hashed_once_not_per_loader(tmp_path, monkeypatch):
    """Binary shards next to text shards whose mtimes moved (`cp -r`, scp: a second node's copy)
    make the freshness check hash every text shard. base_train builds a train loader, a val loader
    and then a val loader at every evaluation: each used to hash the whole data dir again (minutes
    per evaluation at full size). Once per process for unchanged files; a real change still fails."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    docs = make_docs(120, seed=5)
    d = write_shards(tmp_path / "data", [docs[:50], docs[50:100], docs[100:]])
    pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), ByteTokenizer(), log=lambda *a: None)
    for p in d.glob("*.parquet"):  # the same bytes, new mtimes
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    hashed = []
    real = runs.file_sha256
    monkeypatch.setattr(runs, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    for split in ("train", "val", "val", "val"):
        dl = DataLoader(ByteTokenizer(), 2, 32, split, data_dir=d, buffer_size=8)
        assert dl.describe_source().startswith("binary token shards")
        dl.close()
    assert sorted(hashed) == sorted(p.name for p in d.glob("*.parquet"))
    victim = d / "shard_00001.parquet"  # rewritten at the same size: other content, new mtime
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DataError, match="modified since"):
        DataLoader(ByteTokenizer(), 2, 32, "val", data_dir=d, buffer_size=8)


def test_base_train_evaluates_on_the_kind_of_shards_it_trains_on(env, base_dir, monkeypatch):
    """A pretokenize started while a text-based run trains: each evaluation's val loader took
    `source="auto"`, so it picked the unfinished binary directory (DataError "incomplete": the run
    died) or, once finished, switched val's source mid-run. It now reads what the train loader reads."""
    from nanochat import dataloader as dl
    from scripts import base_train

    made = []

    class Recording(dl.DataLoader):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append((args[3], kw.get("source", "auto"), self.source_kind))

    rewound, rewind = [], dl.DataLoader.rewind   # the first evaluation reads base_train's one val loader (EvalSet)
    monkeypatch.setattr(dl.DataLoader, "rewind", lambda self: (rewound.append(self.source_kind), rewind(self))[1])
    monkeypatch.setattr(dl, "DataLoader", Recording)
    base_train.main(["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32",
                     "--max-seq-len", "64", "--device-batch-size", "2", "--total-batch-size", "128",
                     "--window-pattern", "L", "--eval-every", "1", "--sample-every", "-1", "--eval-tokens", "128",
                     "--no-compile", "--num-iterations", "2", "--model-tag", "valkind", *env])
    vals = [m for m in made if m[0] == "val"]
    assert vals and all(m == ("val", "text", "text") for m in vals), made
    assert rewound == ["text"], rewound   # read once, by the first of the 3 evaluations; the others replay it
