"""Data review 4: a text shard rewritten at the same byte size is noticed (pretokenize redoes it,
the loader refuses the stale binary shards); a local import / Shakespeare build interrupted
between shards leaves a set every reader refuses (naming the command to rerun) instead of a
partial one whose last train shard reads as validation; empty path flags are refused."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat import dataset as ds
from nanochat.errors import DataError
from scripts import pretokenize as pt
from tests.test_dataloader import ByteTokenizer


def quiet(*args):
    pass


def write_docs(path, docs):
    # uncompressed, no statistics: a same-length edit gives a file of exactly the same size
    pq.write_table(pa.table({"text": docs}), path, compression="none", write_statistics=False)


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    for i in range(3):
        write_docs(d / ds.shard_name(i), [f"shard {i} doc {j} " + "abcdefgh" * 5 for j in range(20)])
    return d


def rewrite_same_size(path, old: str, new: str):
    """Replace `old` by `new` (same length) in the shard's texts; mtime one second later (what a
    real edit after the pretokenize run gives, whatever the file system's timestamp granularity)."""
    before = path.stat()
    docs = [t.replace(old, new) for t in pq.read_table(path).column("text").to_pylist()]
    write_docs(path, docs)
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))


# ---------------------------------------------------------------- defect 1: same-size change

def test_text_shard_changed_at_the_same_size_is_stale_and_redone(text_dir, tmp_path):
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    old = (out / "shard_00001.bin").read_bytes()
    rewrite_same_size(shards[1], "abcdefgh", "ABCDEFGH")
    assert runs.stale_reason(out, shards) == "modified since at the same size: shard_00001.parquet"
    written = pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)  # no --force
    assert [r["shard"] for r in written] == ["shard_00001.bin"]
    new = bs.BinShard(out / "shard_00001.bin")
    assert (out / "shard_00001.bin").read_bytes() != old
    assert ByteTokenizer().decode(new.doc(0)[1:].tolist()).endswith("ABCDEFGH")
    assert runs.stale_reason(out, shards) is None


def test_touched_but_unchanged_text_shard_is_not_retokenized(text_dir, tmp_path):
    """mtime moved (a copy without -p, `touch`), content the same: the loader hashes that shard and
    takes it, and a plain rerun compares the recorded sha256 instead of tokenizing again."""
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    st = shards[2].stat()
    os.utime(shards[2], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert runs.stale_reason(out, shards) is None
    logged = []
    assert pt.pretokenize(shards, out, ByteTokenizer(), log=logged.append) == []
    assert any("shard_00002" in line and "sha256" in line for line in logged)
    assert runs.stale_reason(out, shards) is None
    runs.check_complete(out, shards)


def test_loader_refuses_binary_shards_of_a_text_shard_changed_at_the_same_size(text_dir):
    from nanochat.dataloader import DataLoader
    bin_dir = bs.default_bin_dir(text_dir)
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, bin_dir, ByteTokenizer(), log=quiet)
    rewrite_same_size(shards[0], "doc", "DOC")
    with pytest.raises(DataError) as e:
        DataLoader(ByteTokenizer(), 2, 16, "train", data_dir=text_dir, prefetch=0)
    msg = str(e.value)
    assert "modified since at the same size: shard_00000.parquet" in msg
    assert f"python -m scripts.pretokenize --data-dir {text_dir} --out {bin_dir}" in msg
    pt.pretokenize(shards, bin_dir, ByteTokenizer(), log=quiet)
    dl = DataLoader(ByteTokenizer(), 2, 16, "train", data_dir=text_dir, prefetch=0)
    assert dl.describe_source().startswith("binary token shards")


def test_loader_takes_text_shards_copied_without_their_times(text_dir):
    """A copy that does not keep mtimes (cp -r, scp, a second node's copy) has the same bytes: the
    loader hashes the shards whose mtime moved and reads the binary shards (read-only review)."""
    from nanochat.dataloader import DataLoader
    bin_dir = bs.default_bin_dir(text_dir)
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, bin_dir, ByteTokenizer(), log=quiet)
    for shard in shards:
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    dl = DataLoader(ByteTokenizer(), 2, 16, "train", data_dir=text_dir, prefetch=0)
    assert dl.describe_source().startswith("binary token shards")


def test_a_source_marker_that_is_not_ours_does_not_stop_reading(tmp_path):
    """list_shards reads source.json for the shard-set record: a torn marker of an older writer (or
    another tool's file) is no record, not a stop (read-only review)."""
    d = tmp_path / "data"
    d.mkdir()
    ds.write_text_shards(d, ["a", "b"], ["c"], shard_chars=1)
    want = ds.list_shards(d)
    for junk in ("", "[1, 2]", '{"source": "x"'):
        (d / ds.SOURCE_FILE).write_text(junk)
        assert ds.list_shards(d) == want


# ---------------------------------------------------------------- defect 2: interrupted import

def corpus(tmp_path, n=60):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc{i:03d} " + "x" * 90}) + "\n"
                                         for i in range(n)))
    return src


def interrupt_after(monkeypatch, n_writes: int):
    real, calls = pq.write_table, []

    def write_table(*args, **kwargs):
        if len(calls) == n_writes:
            raise KeyboardInterrupt  # Ctrl-C between two shards
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(ds.pq, "write_table", write_table)


def test_interrupted_local_import_is_visibly_incomplete(tmp_path, monkeypatch):
    src, out = corpus(tmp_path), tmp_path / "out"
    interrupt_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        ds.import_local_dir(src, out, val_fraction=0.1, shard_chars=1000, log=quiet)
    assert len(list(out.glob("*.parquet"))) == 2  # a partial set is on disk ...
    monkeypatch.undo()
    with pytest.raises(DataError) as e:  # ... and every reader refuses it
        ds.list_shards(out)
    msg = str(e.value)
    assert f"{out} is incomplete" in msg
    # the rerun named in full: the set's --val-fraction 0.1 too (it moved the validation split)
    assert f"python -m nanochat.dataset --data-dir {src.resolve()} --val-fraction 0.1 --out {out}" in msg
    paths = ds.import_local_dir(src, out, val_fraction=0.1, shard_chars=1000, log=quiet)  # the rerun
    assert ds.list_shards(out) == paths and len(paths) == 7
    # the default fraction is not spelled out; a path with a space is quoted for the shell
    spaced = tmp_path / "my out"
    interrupt_after(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        ds.import_local_dir(src, spaced, shard_chars=1000, log=quiet)
    monkeypatch.undo()
    with pytest.raises(DataError, match=f"--data-dir {src.resolve()} --out '{spaced}'`"):
        ds.list_shards(spaced)


def test_interrupted_reimport_does_not_mix_with_the_earlier_set(tmp_path, monkeypatch):
    """A re-import over an earlier, larger set dies after one shard: the old shards past it (old
    validation shard last) must not read as the new set."""
    src, out = corpus(tmp_path), tmp_path / "out"
    assert len(ds.import_local_dir(src, out, val_fraction=0.1, shard_chars=1000, log=quiet)) == 7
    interrupt_after(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        ds.import_local_dir(src, out, val_fraction=0.5, shard_chars=1000, log=quiet)
    monkeypatch.undo()
    with pytest.raises(DataError, match="is incomplete"):
        ds.split_shards(ds.list_shards(out), "val")


def test_shard_set_checked_against_its_manifest(tmp_path):
    src, out = corpus(tmp_path), tmp_path / "out"
    paths = ds.import_local_dir(src, out, val_fraction=0.1, shard_chars=1000, log=quiet)
    marker = json.loads((out / ds.SOURCE_FILE).read_text())
    assert marker["complete"] is True and marker["shards"] == [p.name for p in paths]
    paths[-1].unlink()  # the validation shard deleted: shard 5 (train) would be read as val
    with pytest.raises(DataError, match=r"missing: shard_00006.parquet.*python -m nanochat.dataset --data-dir"):
        ds.list_shards(out)
    write_docs(paths[-1], ["x"])
    write_docs(out / "shard_00007.parquet", ["y"])  # a stray one would become the val shard
    with pytest.raises(DataError, match="not written by it: shard_00007.parquet"):
        ds.list_shards(out)


def test_marker_of_older_runs_and_downloads_still_read(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for i in range(2):
        write_docs(out / ds.shard_name(i), ["a"])
    (out / ds.SOURCE_FILE).write_text(json.dumps({"source": "climbmix"}))  # no `complete`: as before
    assert len(ds.list_shards(out)) == 2


def test_interrupted_shakespeare_build_is_incomplete(tmp_path, monkeypatch):
    out = tmp_path / "out"
    ds.claim_data_dir(out, "shakespeare")
    interrupt_after(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        ds.write_text_shards(out, ["a", "b"], ["c"], shard_chars=1)
    monkeypatch.undo()
    with pytest.raises(DataError, match=r"python -m nanochat.dataset --source shakespeare --out"):
        ds.list_shards(out)


def test_shakespeare_copy_from_shared_data_is_all_or_visibly_incomplete(tmp_path, monkeypatch, tiny_corpus):
    """The copy of ../shared/data's tiny shards (setup.sh's data stage) used to write the final
    names directly: a copy cut short left one train shard that readers took as a whole set, its
    only shard read as validation. Now it is unfinished until every shard is in place."""
    import shutil

    from nanochat import shakespeare

    out, copy = tmp_path / "out", shutil.copyfile
    calls = []

    def copy_then_die(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return copy(src, dst)
    monkeypatch.setattr(shakespeare.shutil, "copyfile", copy_then_die)
    with pytest.raises(KeyboardInterrupt):
        shakespeare.get_shakespeare(out, shared_dir=tiny_corpus)
    monkeypatch.undo()
    with pytest.raises(DataError, match="incomplete"):
        ds.list_shards(out)
    paths = shakespeare.get_shakespeare(out, shared_dir=tiny_corpus)   # the rerun finishes it
    assert ds.list_shards(out) == paths and [p.name for p in paths] == ["shard_00000.parquet", "shard_00001.parquet"]
    assert not list(out.glob(".*.tmp"))


# ---------------------------------------------------------------- user review: flags

@pytest.mark.parametrize("flag", ["--data-dir", "--out"])
def test_empty_path_flag_is_refused_not_read_as_the_current_directory(flag, tmp_path, monkeypatch):
    """`--data-dir "$DATA"` with DATA unset imported every .txt/.jsonl under the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not meant as training data\n\nat all")
    argv = ["--data-dir", str(tmp_path), "--out", ""] if flag == "--out" else ["--data-dir", ""]
    with pytest.raises(ValueError, match=f"{flag}: .*empty"):
        ds.parse_args(argv)
    assert not list(tmp_path.glob("*.parquet"))


def test_pretokenize_refuses_empty_path_flags(tmp_path):
    for flag in ("--data-dir", "--out", "--tokenizer-dir"):
        with pytest.raises(ValueError, match=f"{flag}: .*empty"):
            pt.parse([flag, ""])
