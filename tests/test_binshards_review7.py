"""Review 7 of the binary token shard path (scripts/pretokenize.py, nanochat/binshards.py, the
dataloader's binary source): what a demanding user ran into, one test per defect."""

import os

import pytest

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat.dataloader import DataLoader
from scripts import pretokenize as pt
from tests.test_dataloader import ByteTokenizer, make_docs, write_shards


def quiet(*args):
    pass


@pytest.fixture
def text_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    docs = make_docs(60)
    return write_shards(tmp_path / "data", [docs[:40], docs[40:]])


def test_data_dir_given_as_dot_pretokenizes_where_the_loader_looks(text_dir, monkeypatch):
    # `--data-dir .` from inside the data dir used to write "./_tokens" (a dir inside the data dir
    # the loader never reads) and print no note, since the note compared against the same path
    monkeypatch.chdir(text_dir)
    assert bs.default_bin_dir(".") == text_dir.parent / "data_tokens"
    assert bs.default_bin_dir(text_dir / "sub" / "..") == text_dir.parent / "data_tokens"
    assert pt.main(["--data-dir", ".", "--workers", "1"], tokenizer=ByteTokenizer()) == 0
    assert not (text_dir / "_tokens").exists()
    dl = DataLoader(ByteTokenizer(), 2, 16, "train", data_dir=text_dir, buffer_size=4, prefetch=0)
    assert dl.source_kind == "bin" and dl.source_dir == text_dir.parent / "data_tokens"


def test_out_holding_other_bin_files_is_refused_not_emptied(text_dir, tmp_path):
    # pretokenize deleted every .bin without a text shard of its name as a "stray": with --out
    # pointing at a directory that also held someone's files, pytorch_model.bin was deleted
    out = tmp_path / "models"
    out.mkdir()
    precious = out / "pytorch_model.bin"
    precious.write_bytes(b"weights, not tokens")
    with pytest.raises(ValueError, match=r"--out: .*pytorch_model\.bin.*not binary token shards; accepted"):
        pt.main(["--data-dir", str(text_dir), "--out", str(out), "--workers", "1"], tokenizer=ByteTokenizer())
    assert precious.read_bytes() == b"weights, not tokens"
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]  # refused before any work: no meta.json
    # the library call below pretokenize refuses too, before it records or deletes anything
    runs.write_meta(out, fingerprint=ByteTokenizer().fingerprint, vocab_size=257, bos_token_id=256)
    with pytest.raises(ValueError, match="pytorch_model.bin, not binary token shards"):
        runs.start_run(out, sorted(text_dir.glob("*.parquet")))
    assert precious.exists()


def test_our_own_stray_shards_are_still_removed(text_dir, tmp_path):
    # the stray rule itself still holds for shards pretokenize wrote (their text shard is gone)
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    (out / "shard_00000.bin").rename(out / "shard_00007.bin")
    assert runs.foreign_bin_files(out, shards) == []
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    assert [p.name for p in bs.list_bin_shards(out)] == ["shard_00000.bin", "shard_00001.bin"]


def test_val_is_the_same_shard_for_text_and_binary_when_names_hold_dots(tmp_path, monkeypatch):
    # text order sorts "a.c.parquet" before "a.parquet"; sorting the .bin names put "a.bin" first,
    # so the binary val shard was made from a text TRAIN shard (and the text val shard trained on)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    docs = make_docs(40)
    d = write_shards(tmp_path / "data", [docs[:20], docs[20:]])
    (d / "shard_00000.parquet").rename(d / "a.c.parquet")
    (d / "shard_00001.parquet").rename(d / "a.parquet")
    pt.pretokenize(sorted(d.glob("*.parquet")), bs.default_bin_dir(d), ByteTokenizer(), log=quiet)
    assert [p.name for p in runs.split_paths(bs.default_bin_dir(d), "val")] == ["a.bin"]
    rows = {}
    for source in ("text", "bin"):
        dl = DataLoader(ByteTokenizer(), 4, 32, "val", data_dir=d, source=source, repeat=False, buffer_size=4)
        rows[source] = [x.tolist() for x, _ in dl]
    assert rows["text"] == rows["bin"]


def test_pretokenize_refuses_a_single_text_shard_before_work(tmp_path):
    """One text shard: the loader refuses its binary shards (no train + val split), so pretokenize
    does too, up front (it wrote the shard and exited 0)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanochat.errors import MissingDataError
    from scripts import pretokenize as pt
    from tests.test_dataloader import ByteTokenizer

    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"text": ["one document", "another"]}), data / "shard_00000.parquet")
    with pytest.raises(MissingDataError, match="need at least 2 shards"):
        pt.main(["--data-dir", str(data), "--workers", "1"], tokenizer=ByteTokenizer())
    assert not (tmp_path / "data_tokens").exists()


def test_a_tokenizer_mismatch_names_a_remedy_the_command_line_has(tmp_path):
    """The hint said "read the text shards (source='text')": no flag of any script sets that (the
    loader's source is auto); moving the directory aside is what makes training read the text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from scripts import pretokenize as pt
    from tests.test_dataloader import ByteTokenizer

    data = tmp_path / "data"
    data.mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": [f"document {i} " * 20] * 4}), data / f"shard_0000{i}.parquet")
    assert pt.main(["--data-dir", str(data), "--workers", "1"], tokenizer=ByteTokenizer()) == 0
    from nanochat.dataloader import DataLoader
    with pytest.raises(ValueError, match="tokenizer mismatch") as err:
        DataLoader(ByteTokenizer("other"), 2, 32, "train", data_dir=data)
    assert "source=" not in str(err.value) and "aside" in str(err.value)
