"""Review 10 of the pretraining dataloader: resuming a run that read text shards once only binary
token shards are left (the text shards deleted after pretokenizing)."""

import pytest

from nanochat.binshards import default_bin_dir
from nanochat.dataloader import DataLoader
from nanochat.errors import MissingDataError
from scripts.pretokenize import pretokenize
from tests.test_dataloader import ByteTokenizer, corpus  # noqa: F401  (corpus: the fixture)


def test_resume_of_a_text_run_whose_text_shards_are_gone_says_why_it_needs_them(corpus):  # noqa: F811
    data_dir, _ = corpus
    first = DataLoader(ByteTokenizer(), 2, 32, "train", data_dir=data_dir, buffer_size=4)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    first.close()
    assert state["source"] == "text"
    pretokenize(sorted(data_dir.glob("*.parquet")), default_bin_dir(data_dir), ByteTokenizer(), log=lambda *a: None)
    for p in data_dir.glob("*.parquet"):  # the text shards are big: deleted once pretokenized
        p.unlink()
    resumed = DataLoader(ByteTokenizer(), 2, 32, "train", data_dir=data_dir, buffer_size=4)
    assert resumed.source_kind == "bin"   # a fresh run would train on the binary shards
    with pytest.raises(MissingDataError) as err:
        resumed.load_state_dict(state)
    msg = str(err.value)
    # the resume's problem, named as one, with remedies that work; not a bare "no text shards" whose
    # advice (download data) gives shards the resume refuses too
    assert msg.startswith("--resume:") and "--model-tag" in msg and str(data_dir) in msg
    assert "nanochat.dataset" not in msg
    # the loader is untouched: it still reads the binary shards from the start
    assert resumed.source_kind == "bin" and resumed.state_dict()["batches"] == 0
    x, y = next(resumed)
    assert x.shape == (2, 32) and (x[:, 0] == 256).all()
    resumed.close()
