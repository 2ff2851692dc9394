"""Review 9 of the pretraining data pipeline as a user who brings their own folder meets it
(`python -m nanochat.dataset --data-dir SRC`): a JSONL record with a lone surrogate escape is a
DataError naming its line, not an encode error naming no file; a byte-identical copy of a file is
read once, not double-counted (nor split across train and validation); a user's own parquet file
in --out (= SRC) is read, not skipped as if it were one of our shards."""

import json
import re
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

import pytest

from nanochat import dataset as ds
from nanochat.errors import DataError
from nanochat.local_data import read_local_documents


def quiet(*_):
    pass


def texts(path):
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def test_a_lone_surrogate_escape_in_jsonl_names_the_file_and_line(tmp_path):
    """json.loads accepts "\\ud800"; the str it makes has no UTF-8, so writing the shard failed with
    `'utf-8' codec can't encode character` naming neither the file nor the line (and left --out
    marked unfinished)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text('{"text": "fine"}\n{"text": "bad \\ud800 here"}\n{"text": "also fine"}\n')
    with pytest.raises(DataError, match=r"a\.jsonl:2: 'text' holds a lone surrogate"):
        ds.import_local_dir(src, tmp_path / "out", log=quiet)
    # a pair of escapes (an emoji) is one valid character: still read
    (src / "a.jsonl").write_text('{"text": "smile \\ud83d\\ude00"}\n{"text": "two"}\n{"text": "three"}\n')
    assert read_local_documents(src)[0] == "smile \U0001F600"


def test_a_byte_identical_copy_of_a_file_is_read_once(tmp_path):
    """`corpus.jsonl` next to `corpus (1).jsonl` (a second download): every document was read twice,
    and the copy's documents, last in the order, became the validation split of training data."""
    src = tmp_path / "src"
    src.mkdir()
    docs = [f"document number {i} " + "word " * i for i in range(40)]
    (src / "corpus.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    shutil.copy(src / "corpus.jsonl", src / "corpus (1).jsonl")
    (src / "other.txt").write_text("a different document")
    lines = []
    paths = ds.import_local_dir(src, tmp_path / "out", val_fraction=0.1, log=lines.append)
    train = [t for p in paths[:-1] for t in texts(p)]
    val = texts(paths[-1])
    assert sorted(train + val) == sorted(docs + ["a different document"])   # each exactly once
    assert not set(train) & set(val)
    assert "skipped 1 exact copy of another file: corpus.jsonl (= corpus (1).jsonl)" in lines[0]
    assert lines[0].startswith("read 41 documents from 2 files")


def test_empty_files_are_not_taken_for_copies_of_each_other(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("")
    (src / "b.txt").write_text("")
    (src / "c.txt").write_text("one")
    (src / "d.txt").write_text("two")
    lines = []
    ds.import_local_dir(src, tmp_path / "out", val_fraction=0.5, log=lines.append)
    assert "cop" not in lines[0] and "from 4 files" in lines[0]


def test_a_users_own_parquet_in_out_is_read_not_skipped_as_our_shard(tmp_path):
    """--out inside (or equal to) SRC skips our earlier shards there; it skipped every *.parquet
    directly in --out, so `--data-dir X --out X` over the user's mydata.parquet said there were no
    .parquet files under X."""
    src = tmp_path / "mine"
    src.mkdir()
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(20)]}), src / "mydata.parquet")
    assert len(read_local_documents(src, exclude=src)) == 20
    # the import itself then refuses the directory by its flag: it holds files that are not ours
    with pytest.raises(ValueError, match=r"--out: .* already holds 1 \.parquet files no nanochat run recorded "
                                         r"\(yours\? they are left alone: pass another --out\); accepted: an empty "
                                         r"directory or one filled by --data-dir .*mine$") as e:
        ds.import_local_dir(src, src, log=quiet)
    assert "delete" not in str(e.value) and "--source local:" not in str(e.value)
    assert (src / "mydata.parquet").exists()
    # our own shards in --out are still skipped on a rerun
    (src / "mydata.parquet").rename(tmp_path / "mydata.parquet")
    (src / "notes.jsonl").write_text("".join(json.dumps({"text": f"note {i}"}) + "\n" for i in range(20)))
    ds.import_local_dir(src, src, val_fraction=0.1, log=quiet)
    assert len(read_local_documents(src, exclude=src)) == 20


def test_a_local_import_refused_over_another_source_names_the_flags(tmp_path):
    """The refusal of a directory filled by a local import wrote "--source local:/path", not a
    value --source takes: it names --data-dir now, on both sides."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "x.txt").write_text(f"one document of {d.name}\n")
        (d / "y.txt").write_text(f"another document of {d.name}\n")
    out = tmp_path / "out"
    ds.import_local_dir(a, out, val_fraction=0.3, log=quiet)
    with pytest.raises(ValueError, match=rf"shards from --data-dir {re.escape(str(a.resolve()))} \(delete it or "
                                         rf"pass another --out\); accepted: an empty directory or one filled by "
                                         rf"--data-dir {re.escape(str(b.resolve()))}$"):
        ds.import_local_dir(b, out, log=quiet)


def test_a_refused_default_out_tells_a_setup_sh_user_what_to_change(tmp_path, monkeypatch):
    """setup.sh's data stage runs `nanochat.dataset` with no --out: over files of its own in the base
    dir's base_data/, the refusal said "pass another --out", a flag setup.sh does not have."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    (tmp_path / "base_data").mkdir()
    pq.write_table(pa.table({"text": ["mine"]}), tmp_path / "base_data" / "shard_00000.parquet")
    with pytest.raises(ValueError, match=r"^--out: .*no nanochat run recorded.* under \./setup\.sh, move those "
                                         r"files away or pass another --base-dir\)$"):
        ds.main(["--source", "shakespeare"])
    with pytest.raises(ValueError, match=r"pass another --out\); accepted: [^(]*$"):   # --out given: no such hint
        ds.main(["--source", "shakespeare", "--out", str(tmp_path / "base_data")])
    assert (tmp_path / "base_data" / "shard_00000.parquet").exists()
