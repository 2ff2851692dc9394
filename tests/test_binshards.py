"""nanochat/binshards.py: the binary token shard format's dtypes and their limits."""

import numpy as np
import pytest

from nanochat import binshards as bs
from scripts.pretokenize import pretokenize
from tests.test_dataloader import ByteTokenizer, loader, make_docs, write_shards


def test_vocab_must_fit_the_header_and_the_dtype(tmp_path):
    """The header stores vocab_size as a u32: 2**32 passed dtype_for_vocab, then the writer
    failed with a struct.error after streaming every token of the shard."""
    assert bs.dtype_for_vocab(2**16) == np.uint16 and bs.dtype_for_vocab(2**16 + 1) == np.uint32
    assert bs.dtype_for_vocab(2**32 - 1) == np.uint32
    for bad in (0, 2**32, -5):
        with pytest.raises(ValueError, match=r"vocab_size: got .*; accepted: 1\.\.4294967295"):
            bs.dtype_for_vocab(bad)
    with pytest.raises(ValueError, match="vocab_size"):
        bs.write_shard(tmp_path / "x.bin", [[0, 1]], vocab_size=2**32, bos_token_id=0, fingerprint="f")
    assert not list(tmp_path.iterdir())


def test_uint32_tokens_roundtrip(tmp_path):
    """Vocab > 65536 writes uint32 shards; the loader reads the same ids back."""
    big = ByteTokenizer("big")
    big.bos_token_id, big.vocab_size = 70000, 70001
    d = write_shards(tmp_path / "d", [make_docs(30), make_docs(5, seed=1)])
    pretokenize(sorted(d.glob("*.parquet")), bs.default_bin_dir(d), big, log=lambda *a: None)
    assert np.fromfile(bs.default_bin_dir(d) / "shard_00000.bin", dtype=np.uint8)[12] == 4  # itemsize
    x, _ = next(loader(d, "bin", tok=big, prefetch=0))
    assert (x[:, 0] == 70000).all()
