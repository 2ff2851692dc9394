"""scripts/pretokenize.py and the binary shard format: round trip, dtypes, worker processes,
refusing to mix tokenizers, corrupt-shard detection, resume."""

import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from scripts import pretokenize as pt
from tests.test_dataloader import ByteTokenizer   # one stand-in tokenizer for both files


def make_docs(n: int, max_len: int) -> list[str]:
    rng = random.Random(0)
    return [f"{i:05d}|" + "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(0, max_len)))
            for i in range(n)]


def quiet(*args):
    pass


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    docs = make_docs(90, max_len=300) + ["", "unicode: h\u00e9llo \u2603 \U0001F600"]
    for i, part in enumerate((docs[:40], docs[40:85], docs[85:])):
        pq.write_table(pa.table({"text": part}), d / f"shard_{i:05d}.parquet", row_group_size=16)
    return d


def all_docs(d):
    return [t for p in sorted(d.glob("*.parquet")) for t in pq.read_table(p).column("text").to_pylist()]


def test_round_trip(text_dir, tmp_path):
    tok = ByteTokenizer()
    out = tmp_path / "bin"
    assert pt.main(["--data-dir", str(text_dir), "--out", str(out), "--workers", "1"], tokenizer=tok) == 0
    shards = [bs.BinShard(p) for p in bs.list_bin_shards(out)]
    assert [s.path.name for s in shards] == [f"shard_{i:05d}.bin" for i in range(3)]
    texts = all_docs(text_dir)
    got = [s.doc(i) for s in shards for i in range(s.num_docs)]
    assert len(got) == len(texts)
    for text, ids in zip(texts, got):
        assert ids.tolist() == tok.encode(text, prepend=tok.bos_token_id)  # binary == encode(text)
        assert tok.decode(ids[1:].tolist()) == text  # decode(binary) == text
    h = shards[0].header
    assert h.dtype == np.uint16 and h.fingerprint == tok.fingerprint and h.bos_token_id == 256
    assert bs.read_meta(out)["fingerprint"] == tok.fingerprint


def test_worker_processes_match_single_process(text_dir, tmp_path):
    tok = ByteTokenizer()
    pt.pretokenize(sorted(text_dir.glob("*.parquet")), tmp_path / "one", tok, workers=1, log=quiet)
    pt.pretokenize(sorted(text_dir.glob("*.parquet")), tmp_path / "two", tok, workers=2, threads=2, log=quiet)
    for a, b in zip(bs.list_bin_shards(tmp_path / "one"), bs.list_bin_shards(tmp_path / "two")):
        assert a.read_bytes() == b.read_bytes()


def test_refuses_to_mix_tokenizers(text_dir, tmp_path):
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        pt.pretokenize(shards, out, ByteTokenizer("another"), log=quiet)
    (out / bs.META_NAME).unlink()  # the shard headers still say which tokenizer made them
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        pt.pretokenize(shards, out, ByteTokenizer("another"), log=quiet)


def test_resume_skips_finished_and_rewrites_corrupt(text_dir, tmp_path):
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    assert len(pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)) == 3
    good = (out / "shard_00001.bin").read_bytes()
    (out / "shard_00001.bin").write_bytes(good[:-5])  # truncated
    with pytest.raises(ValueError, match="truncated or corrupt"):
        bs.BinShard(out / "shard_00001.bin")
    written = pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    assert [r["shard"] for r in written] == ["shard_00001.bin"]
    assert (out / "shard_00001.bin").read_bytes() == good


def test_uint32_for_large_vocab(tmp_path):
    assert bs.dtype_for_vocab(65536) == np.uint16 and bs.dtype_for_vocab(65537) == np.uint32
    docs = [np.array([70000, 1, 65999]), np.array([70000]), np.array([70000, 69999, 2, 3])]
    h = bs.write_shard(tmp_path / "x.bin", docs, vocab_size=70001, bos_token_id=70000, fingerprint="ab" * 32)
    sh = bs.BinShard(tmp_path / "x.bin")
    assert h.dtype == np.uint32 and sh.header == h and sh.doc_lengths().tolist() == [3, 1, 4]
    assert [sh.doc(i).tolist() for i in range(3)] == [d.tolist() for d in docs]


def test_writer_and_reader_errors(tmp_path):
    with pytest.raises(ValueError, match="does not start with BOS"):
        bs.write_shard(tmp_path / "x.bin", [[5, 6]], vocab_size=300, bos_token_id=256, fingerprint="f")
    with pytest.raises(ValueError, match="ids outside"):
        bs.write_shard(tmp_path / "x.bin", [[256, 300]], vocab_size=300, bos_token_id=256, fingerprint="f")
    assert not list(tmp_path.iterdir()), "a failed write leaves nothing behind"
    (tmp_path / "junk.bin").write_bytes(b"\0" * 200)
    with pytest.raises(ValueError, match="bad magic"):
        bs.read_header(tmp_path / "junk.bin")
    bad = tmp_path / "bad"
    bad.mkdir()
    for i in range(2):   # train + val, so the schema is what fails
        pq.write_table(pa.table({"body": ["x"]}), bad / f"shard_0000{i}.parquet")
    with pytest.raises(ValueError, match="wrong schema"):
        pt.main(["--data-dir", str(bad), "--out", str(tmp_path / "o")], tokenizer=ByteTokenizer())
    with pytest.raises(ValueError, match="--workers"):
        pt.main(["--data-dir", str(bad), "--workers", "0"], tokenizer=ByteTokenizer())


def test_records_its_text_shards_and_redoes_changed_ones(text_dir, tmp_path):
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    assert bs.read_meta(out)["text_shards"] == {p.name: p.stat().st_size for p in shards}
    assert runs.stale_reason(out, shards) is None
    pq.write_table(pa.table({"text": ["changed since"]}), shards[1])
    assert runs.stale_reason(out, shards) == "changed: shard_00001.parquet"
    written = pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)  # no --force: the changed one only
    assert [r["shard"] for r in written] == ["shard_00001.bin"]
    assert bs.BinShard(out / "shard_00001.bin").num_docs == 1 and runs.stale_reason(out, shards) is None
    assert "binary shards without a text shard: shard_00002.bin" in runs.stale_reason(out, shards[:2])


def test_damaged_bin_files_are_data_errors(text_dir, tmp_path):
    from nanochat.errors import DataError
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    for garbage in ("{nope", "[1, 2]"):
        (out / bs.META_NAME).write_text(garbage)
        with pytest.raises(DataError, match=f"{out / bs.META_NAME}: corrupt"):
            pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    (out / bs.META_NAME).unlink()
    (out / "shard_00000.bin").write_bytes(b"")
    with pytest.raises(DataError, match="shard_00000.bin: not a nanochat binary token shard"):
        bs.BinShard(out / "shard_00000.bin")


def test_no_room_fails_before_any_shard_is_written(text_dir, tmp_path, monkeypatch):
    """The shards to write are sized from the parquet footers first; a disk without room for them
    is a DiskFullError naming both numbers, and nothing is written."""
    import shutil
    from collections import namedtuple

    from nanochat.errors import DiskFullError
    shards = sorted(text_dir.glob("*.parquet"))
    chars = sum(len(t) for t in all_docs(text_dir))
    need = pt.check_disk(tmp_path, shards, 2, free=10**12)
    assert 2 * chars // 3 <= need <= 2 * chars // 3 + 4096   # ~3 characters a token, uint16 (+ offsets)
    with pytest.raises(DiskFullError, match=r"3 binary shards need up to ~.* free; free space or pass --out"):
        pt.check_disk(tmp_path, shards, 2, free=need - 1)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, 100))
    out = tmp_path / "bin"
    with pytest.raises(DiskFullError):
        pt.main(["--data-dir", str(text_dir), "--out", str(out), "--workers", "1"], tokenizer=ByteTokenizer())
    assert not list(out.glob("*.bin"))


# ---------------------------------------------------------------- unfinished directories, bad input

def interrupted_run(shards, out, after: int):
    """A pretokenize run that dies (like kill -TERM) once `after` shards are written: the worker
    raises on the next one, leaving a temp file of a writer that is gone."""
    real = pt._tokenize_one
    done = []

    def dying(job):
        if len(done) == after:
            (out / f".{bs.bin_name_for(job[0])}.{2**22 + 7}.tmp").write_bytes(b"half")  # no such pid
            raise KeyboardInterrupt
        done.append(job)
        return real(job)

    pt._tokenize_one = dying
    try:
        with pytest.raises(KeyboardInterrupt):
            pt.pretokenize(shards, out, ByteTokenizer(), workers=1, log=quiet)
    finally:
        pt._tokenize_one = real


def test_an_interrupted_run_is_marked_unfinished_and_a_rerun_finishes_it(text_dir, tmp_path):
    from nanochat.errors import DataError
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    interrupted_run(shards, out, after=2)
    from nanochat.dataloader import DataLoader
    for split in ("train", "val"):  # was: train on shard 0, validate on shard 1 (a train shard)
        with pytest.raises(DataError, match=f"{out} is incomplete"):
            DataLoader(ByteTokenizer(), 2, 16, split, data_dir=text_dir, bin_dir=out)
    meta = bs.read_meta(out)
    assert meta["complete"] is False and sorted(meta["planned"]) == [p.name for p in shards]
    assert [p.name for p in bs.list_bin_shards(out)] == ["shard_00000.bin", "shard_00001.bin"]
    with pytest.raises(DataError) as e:
        runs.check_complete(out)
    msg = str(e.value)
    assert f"{out} is incomplete" in msg and "2 of 3 binary shards written; missing: shard_00002.bin" in msg
    assert f"python -m scripts.pretokenize --data-dir {text_dir.resolve()} --out {out}" in msg
    written = pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)  # resumes: the missing one only
    assert [r["shard"] for r in written] == ["shard_00002.bin"]
    assert not list(out.glob(".*.tmp"))  # the dead writer's temp file is cleaned up
    meta = bs.read_meta(out)
    assert meta["complete"] is True and "planned" not in meta
    assert meta["text_shards"] == {p.name: p.stat().st_size for p in shards}
    runs.check_complete(out, shards)


def test_a_rerun_drops_binary_shards_whose_text_shard_is_gone(text_dir, tmp_path):
    from nanochat.errors import DataError
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    (out / "shard_00001.bin").unlink()  # a complete directory that lost a shard
    with pytest.raises(DataError, match=r"holds 2 binary shards, not one for each of the 3 text shards "
                                        r"recorded in its meta.json \(missing: shard_00001.bin\)"):
        runs.check_complete(out)
    shards[2].unlink()  # the text shard set shrank: its binary shard would be read as validation
    logged = []
    pt.pretokenize(shards[:2], out, ByteTokenizer(), log=logged.append)
    assert [p.name for p in bs.list_bin_shards(out)] == ["shard_00000.bin", "shard_00001.bin"]
    assert any("removed shard_00002.bin" in line for line in logged)
    runs.check_complete(out, shards[:2])


def test_invalid_utf8_text_names_the_shard(tmp_path, capsys):
    from nanochat.errors import DataError
    from nanochat.flags import run_cli
    d = tmp_path / "data"
    d.mkdir()
    bad = pa.array([b"ok", b"\xff bad"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": bad}), d / "shard_00000.parquet")
    pq.write_table(pa.table({"text": ["fine"]}), d / "shard_00001.parquet")
    for workers in ("1", "2"):
        with pytest.raises(DataError, match=r"shard_00000.parquet: row group 0 holds text that is not valid "
                                            r"UTF-8 \(row 1, byte 0"):
            pt.main(["--data-dir", str(d), "--out", str(tmp_path / "o"), "--workers", workers],
                    tokenizer=ByteTokenizer())
    with pytest.raises(SystemExit) as e:  # the command line: one line naming the file
        run_cli(lambda: pt.main(["--data-dir", str(d), "--out", str(tmp_path / "o")], tokenizer=ByteTokenizer()))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "shard_00000.parquet: row group 0" in err[0]


def test_out_that_is_a_file_is_refused_up_front(text_dir, tmp_path):
    from nanochat.errors import RequestError
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(RequestError, match=r"--out: got '.*afile', which is a file; accepted: a directory"):
        pt.main(["--data-dir", str(text_dir), "--out", str(afile)], tokenizer=ByteTokenizer())
    with pytest.raises(RequestError, match=r"--out: got '.*afile/sub', which cannot be created: .*afile is a file"):
        pt.main(["--data-dir", str(text_dir), "--out", str(afile / "sub")], tokenizer=ByteTokenizer())
    assert afile.read_text() == "not a directory"


@pytest.mark.parametrize("statistics", [True, False])
def test_all_empty_text_shards_are_refused(tmp_path, statistics):
    """Footer statistics show it before any work; without them the tokens do (BOS only), and the
    directory is left unfinished so that no reader takes it."""
    from nanochat.errors import DataError, MissingDataError
    d = tmp_path / "data"
    d.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"text": ["", ""]}), d / f"shard_{i:05d}.parquet", write_statistics=statistics)
    out = tmp_path / "bin"
    with pytest.raises(MissingDataError, match=r"no text to tokenize: every document of the train split "
                                               r"\(shard_00000.parquet, shard_00001.parquet\) .* is empty"):
        pt.main(["--data-dir", str(d), "--out", str(out), "--workers", "1"], tokenizer=ByteTokenizer())
    if statistics:
        assert not bs.list_bin_shards(out)
    else:
        with pytest.raises(DataError, match="is incomplete"):
            runs.check_complete(out)
    pq.write_table(pa.table({"text": ["some text", ""]}), d / "shard_00000.parquet", write_statistics=statistics)
    with pytest.raises(MissingDataError, match=r"the val split \(shard_00002.parquet\)"):
        pt.main(["--data-dir", str(d), "--out", str(out), "--workers", "1"], tokenizer=ByteTokenizer())


def test_disk_plan_sizes_the_text_column_not_the_first_one(tmp_path):
    """The estimate read column 0: with an id column first it came out ~100x too small, so a disk
    without room passed the check and filled up mid-run."""
    from scripts.pretokenize import planned_bytes
    texts = [f"{i} " + "word " * 600 for i in range(100)]
    pq.write_table(pa.table({"id": list(range(100)), "text": texts}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": texts}), tmp_path / "b.parquet")
    assert planned_bytes(tmp_path / "a.parquet", 2) == planned_bytes(tmp_path / "b.parquet", 2)
    assert planned_bytes(tmp_path / "a.parquet", 2) > 2 * sum(map(len, texts)) // 3


def test_force_replaces_the_shards_of_another_tokenizer(text_dir, tmp_path):
    """The loader's advice for binary shards of another tokenizer is `pretokenize --force`; it
    failed with 'tokenizer mismatch ... delete that directory'. Without --force it still refuses."""
    from nanochat.dataloader import DataLoader
    from nanochat.errors import DataError
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    new = ByteTokenizer("retrained")
    with pytest.raises(DataError, match="re-run `python -m scripts.pretokenize --force`"):
        DataLoader(new, 2, 16, "train", data_dir=text_dir, bin_dir=out, source="bin")
    with pytest.raises(DataError, match="tokenizer mismatch"):
        pt.pretokenize(shards, out, new, log=quiet)
    logged = []
    assert len(pt.pretokenize(shards, out, new, force=True, log=logged.append)) == 3
    assert any("another tokenizer" in line for line in logged)
    assert {bs.read_header(p).fingerprint for p in bs.list_bin_shards(out)} == {new.fingerprint}
    meta = bs.read_meta(out)
    assert meta["fingerprint"] == new.fingerprint and meta["complete"] is True
    x, _ = next(DataLoader(new, 2, 16, "train", data_dir=text_dir, bin_dir=out, source="bin", prefetch=0))
    assert (x[:, 0] == 256).all()


def test_rerun_rewrites_a_shard_damaged_behind_a_valid_header(text_dir, tmp_path):
    """A shard of the right size whose offsets are damaged was skipped as done (only its header
    was read) and the directory marked complete, though every reader refuses it."""
    out = tmp_path / "bin"
    shards = sorted(text_dir.glob("*.parquet"))
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    path = out / "shard_00001.bin"
    good = path.read_bytes()
    raw = bytearray(good)
    raw[-16:-8] = (10**6).to_bytes(8, "little")  # an offset past the end, size unchanged
    path.write_bytes(bytes(raw))
    written = pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    assert [r["shard"] for r in written] == ["shard_00001.bin"] and path.read_bytes() == good
