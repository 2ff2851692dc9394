"""One pass over the training data (nanochat/data_passes.py) and base_train's banner line and
warning about it: the figure is the loader's real pass (binary shards exactly, for every rank;
text shards within the stated tolerance), the packing replay matches the packer on awkward
lengths, and the warning comes exactly when the plan needs more than one pass."""

import shutil

import numpy as np
import pytest

from nanochat import data_passes as dp
from nanochat.binshards import default_bin_dir
from nanochat.dataloader import IGNORE_INDEX, DataLoader, _Packer
from scripts.pretokenize import pretokenize
from tests.test_base_train import TINY
from tests.test_dataloader import ByteTokenizer, make_docs, write_shards


def _copy(src, dest):
    dest.mkdir(parents=True)
    for p in sorted(src.glob("*.parquet")):
        shutil.copyfile(p, dest / p.name)
    return dest


def _targets(data_dir, tok, T: int, rank: int = 0, world: int = 1, **kw) -> tuple[int, object]:
    """Training targets one finite pass of the real loader yields, and the loader's pass_size()."""
    dl = DataLoader(tok, 8, T, "train", data_dir=data_dir, rank=rank, world_size=world, repeat=False,
                    prefetch=0, **kw)
    size = dl.pass_size()
    n = sum(int((y != IGNORE_INDEX).sum()) for _, y in dl)
    dl.close()
    return n, size


@pytest.fixture(scope="module")
def tiny_bin(tiny_corpus, tiny_tokenizer, tmp_path_factory):
    data = _copy(tiny_corpus, tmp_path_factory.mktemp("passes") / "data")
    pretokenize(sorted(data.glob("*.parquet")), default_bin_dir(data), tiny_tokenizer, log=lambda *a: None)
    return data


@pytest.mark.parametrize("T,world", [(64, 1), (64, 3), (200, 2)])
def test_binary_pass_is_exact_on_every_rank(tiny_bin, tiny_tokenizer, T, world):
    got = [_targets(tiny_bin, tiny_tokenizer, T, r, world, source="bin") for r in range(world)]
    size = got[0][1]
    assert size.exact and len(size.rank_tokens) == world
    assert list(size.rank_tokens) == [n for n, _ in got]   # each rank's own pass, exactly
    assert size.tokens == sum(n for n, _ in got) > 0
    assert all(s.rank_tokens == size.rank_tokens for _, s in got)   # any rank computes all ranks'


@pytest.mark.parametrize("T", [64, 512])
def test_text_pass_estimate_is_within_its_tolerance(tiny_corpus, tiny_tokenizer, T):
    true, size = _targets(tiny_corpus, tiny_tokenizer, T, source="text")
    assert not size.exact and f"+-{dp.TEXT_TOLERANCE:.0%}" in size.basis
    assert abs(size.tokens / true - 1) <= dp.TEXT_TOLERANCE, (size.tokens, true)


def test_text_estimate_counts_the_bos_of_many_short_documents(tmp_path):
    """~70-byte documents under a byte tokenizer: the BOS is one token in 70, and documents cross
    rows (T=64): the estimate still lands within the tolerance, on 2 ranks."""
    docs = make_docs(900, seed=3)
    data = write_shards(tmp_path / "d", [docs[:400], docs[400:850], docs[850:]], row_group_size=64)
    tok = ByteTokenizer()
    true = sum(_targets(data, tok, 64, r, 2, source="text", buffer_size=32)[0] for r in range(2))
    size = DataLoader(tok, 8, 64, "train", data_dir=data, world_size=2, source="text", buffer_size=32).pass_size()
    assert abs(size.tokens / true - 1) <= dp.TEXT_TOLERANCE, (size.tokens, true)


class _Lengths:
    """A document source of given lengths (BOS + ones) for the real packer."""
    start = (0,)

    def __init__(self, lengths):
        self.lengths = lengths

    def docs(self, cursor):
        for i in range(cursor[0], len(self.lengths)):
            yield (i,), (i + 1,), self.lengths[i], np.r_[0, np.ones(self.lengths[i] - 1, dtype=np.int64)]

    def fetch(self, keys):
        assert not keys, "a fresh pass restores no buffer"
        return []

    def tokens(self, key, payload, limit=None):
        return payload if limit is None else payload[:limit]


@pytest.mark.parametrize("buffer_size", [1, 3, 50])
def test_replay_matches_the_packer(buffer_size):
    """Documents of 1 token (BOS alone) to 3 rows long, tiny and large buffers: the replay counts
    the targets the packer's rows hold, and the tokens it read."""
    lengths = np.random.default_rng(buffer_size).integers(1, 60, size=700)
    lengths[::17] = 1
    cap = 20
    packer = _Packer(_Lengths(lengths), batch_size=4, seq_len=cap - 1, buffer_size=buffer_size, bos=0,
                     repeat=False, pin_memory=False, config={"split": "train"}, who="test")
    state = {"epoch": 0, "cursor": [0], "buffer": [], "tokens_read": 0, "tokens_dropped": 0, "batches": 0}
    n = sum(int((b[1] != IGNORE_INDEX).sum()) for b, _ in packer.batches(state))
    assert dp.replay_packing(lengths, cap, buffer_size) == (n, int(lengths.sum()))
    assert dp.replay_packing(lengths, cap, buffer_size, limit=10)[1] == int(lengths[:10].sum())


def test_warning_exactly_when_more_than_one_pass():
    size = dp.PassSize((1000, 900), True, "exact")
    assert size.warnings(1800) == [] and size.passes(1800) == 1.0   # the smaller rank reads its pass once
    (line,) = size.warnings(1802)   # one more token a rank: the smaller rank repeats documents
    assert "repeats the training data: 1,802 tokens are 1.00 passes over its 1,900 training tokens, so each " \
        "document is trained on 1 to 2 times" in line
    assert "val bpb" not in line
    (line,) = size.warnings(18_002)   # past 10 passes: what that does to val bpb, said
    assert "are 10 passes" in line and "val bpb overstates quality if the val shard's documents also occur" in line
    assert "are ~1.00 passes over its ~12,300 training tokens" in dp.PassSize((12_345,), False, "e").warnings(12_346)[0]
    assert dp.PassSize((1000,), True, "x").describe(250) == \
        "one pass = 1,000 training tokens (x); the planned 250 tokens are 0.25 passes"


def test_base_train_banner_and_warning(env, base_dir, tiny_bin, monkeypatch, capsys):
    """The banner's figure is the binary pass's exact size; the warning appears only when the plan
    needs more than that (the loop is not run: the banner and warnings come before it)."""
    from nanochat.tokenizer import get_tokenizer
    from scripts import base_train

    class Stop(Exception):
        pass

    def no_loop(*a, **kw):
        raise Stop

    monkeypatch.setattr(base_train, "run_training_loop", no_loop)
    one_pass, _ = _targets(tiny_bin, get_tokenizer(base_dir), 64, source="bin")
    steps = one_pass // 512   # TINY: 512 tokens a step
    for n, warned in ((steps, False), (steps + 1, True), (11 * steps, True)):
        with pytest.raises(Stop):
            base_train.main(TINY + ["--data-dir", str(tiny_bin), "--num-iterations", str(n), "--eval-every", "-1",
                                    "--model-tag", f"passes{n}"])
        out = capsys.readouterr().out
        line = next(ln for ln in out.splitlines() if ln.startswith("data passes "))
        assert f"one pass = {one_pass:,} training tokens (exact:" in line
        assert f"the planned {n * 512:,} tokens are {dp._count(n * 512 / one_pass)} passes" in line
        assert ("WARNING: the plan repeats the training data" in out) == warned
        assert ("val bpb overstates" in out) == (n > 10 * steps)


def test_a_corpus_too_large_to_replay_is_estimated_from_each_ranks_first_documents(tiny_bin, tiny_tokenizer,
                                                                                  monkeypatch):
    """Past REPLAY_DOCS documents the packing of each rank's first ones is scaled to the rest:
    labelled "~", and close to the real pass."""
    got = [_targets(tiny_bin, tiny_tokenizer, 200, r, 2, source="bin", buffer_size=50) for r in range(2)]
    true = sum(n for n, _ in got)
    assert got[0][1].exact and got[0][1].tokens == true
    monkeypatch.setattr(dp, "REPLAY_DOCS", 300)
    dl = DataLoader(tiny_tokenizer, 8, 200, "train", data_dir=tiny_bin, world_size=2, source="bin", buffer_size=50)
    size = dl.pass_size()
    assert not size.exact and "first 150 documents" in size.basis
    assert abs(size.tokens / true - 1) <= 0.05, (size.tokens, true)
    assert size.describe(10**6).startswith(f"one pass = ~{round(size.tokens, -3):,} training tokens on 2 ranks")
