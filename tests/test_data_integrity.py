"""Binary token shards that change after a run read them: truncated, grown, gone, or rewritten at the
same size. `binshards.shard_digest` / `check_resume` detect each and name the file with what to do;
the data loader records `shard_digests` in its state and checks them on resume."""

from __future__ import annotations

import shutil

import pytest

import tests.test_dataloader as base
from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat.errors import DataError
from tests.test_dataloader import ByteTokenizer, loader

corpus, binned = base.corpus, base.binned   # the shared fixtures: 3 train + 1 val shard, pretokenized

FP = ByteTokenizer().fingerprint


def shard(path, docs):
    return bs.write_shard(path, [[256, *d] for d in docs], vocab_size=257, bos_token_id=256, fingerprint=FP)


def flip_token(path, index: int) -> None:
    """Change token `index` (a letter, not BOS) in place: same size, same header and offsets."""
    raw = bytearray(path.read_bytes())
    at = bs.HEADER_SIZE + 2 * index
    raw[at] ^= 1
    path.write_bytes(bytes(raw))


def state_of(paths) -> dict:
    return {"shards": [p.name for p in paths], "shard_bytes": [p.stat().st_size for p in paths],
            "shard_digests": [bs.shard_digest(p) for p in paths]}


def test_digest_follows_content_not_location(tmp_path):
    a = tmp_path / "a.bin"
    shard(a, [[97, 98, 99], [100, 101]])
    digest = bs.shard_digest(a)
    assert len(digest) == 32 and bs.shard_digest(shutil.copy(a, tmp_path / "copy.bin")) == digest
    # same size, same token count and document count, other document lengths (re-made from other text)
    shard(a, [[97, 98], [99, 100, 101]])
    assert bs.shard_digest(a) != digest
    shard(a, [[97, 98, 99], [100, 101]])
    assert bs.shard_digest(a) == digest       # deterministic: re-writing the same docs restores it
    flip_token(a, 1)
    assert bs.shard_digest(a) != digest
    # another tokenizer (fingerprint in the header), same tokens
    bs.write_shard(a, [[256, 97, 98, 99], [256, 100, 101]], vocab_size=257, bos_token_id=256, fingerprint="x" * 64)
    assert bs.shard_digest(a) != digest


def test_digest_samples_both_ends_of_a_large_shard(tmp_path):
    """Tokens within DIGEST_SAMPLE bytes of either end are hashed; the middle of a large shard is not
    (documented trade-off: hashing every token would read the whole file at every start)."""
    big = tmp_path / "big.bin"
    n = bs.DIGEST_SAMPLE  # tokens of 2 bytes: the token area is twice the sample
    shard(big, [[97] * (n // 2), [98] * (n // 2), [99] * (n // 2)])
    digest = bs.shard_digest(big)
    for index, changes in ((2, True), (3 * (n // 2) + 1, True), (n // 2 + n // 4, False)):
        raw = big.read_bytes()
        flip_token(big, index)
        assert (bs.shard_digest(big) != digest) is changes, index
        big.write_bytes(raw)


def test_check_resume_names_each_kind_of_change(tmp_path):
    paths = [tmp_path / "shard_00000.bin", tmp_path / "shard_00001.bin"]
    shard(paths[0], [[97, 98, 99], [100, 101]])
    shard(paths[1], [[102] * 10])
    state = state_of(paths)
    bs.check_resume(paths, state)                          # unchanged: fine
    good = paths[0].read_bytes()

    flip_token(paths[0], 2)
    with pytest.raises(DataError) as e:
        bs.check_resume(paths, state)
    msg = str(e.value)
    assert f"{paths[0]} was rewritten (same size" in msg
    assert "python -m scripts.pretokenize" in msg and "--model-tag" in msg   # what to do

    paths[0].write_bytes(good[:-8])
    with pytest.raises(DataError, match=rf"shard_00000\.bin was truncated from {len(good)} to {len(good) - 8} bytes"):
        bs.check_resume(paths, state)
    paths[0].write_bytes(good + bytes(8))
    with pytest.raises(DataError, match=r"shard_00000\.bin was grown from"):
        bs.check_resume(paths, state)
    paths[0].unlink()
    with pytest.raises(DataError, match=r"shard_00000\.bin is gone since"):
        bs.check_resume(paths, state)
    paths[0].write_bytes(good)
    bs.check_resume(paths, state)                          # the original back: fine again

    # nothing to compare: a state from before digests, or one over other shards (the loader names those)
    flip_token(paths[1], 3)
    bs.check_resume(paths, {k: v for k, v in state.items() if k != "shard_digests"})
    bs.check_resume(paths[:1], state)
    with pytest.raises(DataError, match=r"shard_00001\.bin was rewritten"):
        bs.check_resume(paths, state)


def test_split_paths_is_the_last_shard_for_val(binned):
    data_dir, _ = binned
    bin_dir = bs.default_bin_dir(data_dir)
    names = [p.name for p in bs.list_bin_shards(bin_dir)]
    assert [p.name for p in runs.split_paths(bin_dir, "val")] == names[-1:]
    assert [p.name for p in runs.split_paths(bin_dir, "train")] == names[:-1]


def _state_after_one_batch(data_dir) -> dict:
    dl = loader(data_dir, "bin", prefetch=0)
    next(dl)
    state = dl.state_dict()
    dl.close()
    return state


def test_truncated_shard_on_resume_is_named_at_construction(binned):
    """A shard cut short no longer matches its header's size: refused when the loader opens it."""
    data_dir, _ = binned
    state = _state_after_one_batch(data_dir)
    path = bs.default_bin_dir(data_dir) / "shard_00001.bin"
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(DataError, match=r"shard_00001\.bin: truncated or corrupt .*delete it, then re-create it with "
                                        r"`python -m scripts\.pretokenize --data-dir "):
        loader(data_dir, "bin", prefetch=0).load_state_dict(state)


def test_shard_rewritten_at_the_same_size_is_refused_on_resume(binned):
    data_dir, _ = binned
    state = _state_after_one_batch(data_dir)
    path = bs.default_bin_dir(data_dir) / "shard_00001.bin"   # a train shard the run has not reached yet
    flip_token(path, 3)
    resumed = loader(data_dir, "bin", prefetch=0)
    assert len(state["shard_digests"]) == len(state["shards"])
    with pytest.raises(DataError, match=r"shard_00001\.bin was rewritten \(same size"):
        resumed.load_state_dict(state)
