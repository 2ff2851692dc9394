"""Review 6 of getting pretraining data (nanochat/dataset.py, dataset_download.py, local_data.py):
what a server sends instead of a shard is named, retries stay bounded however many are asked for,
two writers of one data directory do not tear its source marker, a full disk during a local import
is one error with no temp file left, and a --val-fraction that leaves no train document names
that flag. Downloads run against a local HTTP server on 127.0.0.1."""

import errno
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset as ds
from nanochat import dataset_download as dl
from nanochat.errors import DiskFullError

HTML = b"<!DOCTYPE html><html><body>Please sign in to continue</body></html>"


def parquet_bytes(n_docs: int = 20) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": [f"document {i} " * 50 for i in range(n_docs)]}), buf)
    return buf.getvalue()


@pytest.fixture
def server():
    """Serves a good shard as shard_00000 and, with status 200, an HTML page for every other name
    (what a captive portal or a proxy's login page does); records the requested names."""
    good, requests = parquet_bytes(), []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            name = self.path.rsplit("/", 1)[-1]
            requests.append(name)
            body = good if name == ds.shard_name(0) else HTML
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream" if body is good else "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}/data", good, requests
    httpd.shutdown()
    httpd.server_close()


def test_an_html_page_sent_with_200_is_named_not_called_a_damaged_shard(server, tmp_path, capsys):
    """The error said 'not a readable parquet file ...; a shard this project made: delete it and
    re-create the shards with `python -m nanochat.dataset -n 8`': about a .partial already deleted,
    advising the command that failed, and never saying that the server sent a web page."""
    url, good, requests = server
    rc = ds.main(["--base-url", url, "--out", str(tmp_path), "-n", "1", "--retries", "1", "--backoff", "0",
                  "--timeout", "5", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "1 of 2 shards FAILED" in err, err
    assert "shard_06542.parquet" in err and "b'<!DOCTYPE html><html><body>Please sign in" in err, err
    assert "delete it and re-create" not in err, err
    assert requests.count(ds.shard_name(6542)) == 2   # a bad body is retried, from byte 0, then given up
    assert (tmp_path / ds.shard_name(0)).read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == [ds.shard_name(0), ds.SOURCE_FILE]  # no .partial/.lock


def test_many_retries_stay_bounded_instead_of_crashing(tmp_path, monkeypatch):
    """`--retries 100000` (retry all night on a flaky link): attempt 1026's backoff computed
    2 ** 1024 as a float and died with OverflowError, a traceback that stopped every shard."""
    pauses = []
    monkeypatch.setattr(dl, "_attempt", lambda *a, **k: (_ for _ in ()).throw(dl._Retry("HTTP 503")))
    monkeypatch.setattr(dl, "_pause", lambda seconds, cancel: pauses.append(seconds))
    with pytest.raises(dl.DownloadError, match="failed after 1101 attempts; last error: HTTP 503"):
        dl.download_file("http://127.0.0.1:9/shard_00000.parquet", tmp_path / "x.parquet", retries=1100)
    assert len(pauses) == 1100 and max(pauses) == 60.0 and pauses[:3] == [2.0, 4.0, 8.0]


def test_two_writers_of_a_source_marker_do_not_tear_it(tmp_path):
    """Two downloads into one directory at once (torchrun ranks, two shells) both write source.json
    through one temp name: one renamed the other's half-written file into place (a reader then
    got 'source.json: corrupt') or failed with FileNotFoundError on a temp file already renamed."""
    errors, start = [], threading.Barrier(3)

    def claim():
        start.wait()
        for _ in range(150):
            try:
                ds.claim_data_dir(tmp_path, "climbmix")
                assert ds.read_source_marker(tmp_path / ds.SOURCE_FILE) == "climbmix"
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(repr(e))

    threads = [threading.Thread(target=claim) for _ in range(2)]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(30)
    assert errors == [], errors[:3]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ds.SOURCE_FILE]   # no temp file left


def test_a_full_disk_during_a_local_import_is_one_error_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """pyarrow's ENOSPC OSError was a traceback, and the hidden `.shard_NNNNN.parquet.tmp` (up to a
    shard's size) stayed on the full disk; now a DiskFullError naming the directory, nothing left,
    and the set marked unfinished so no reader takes the shards written so far for a whole set."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i in range(4):
        (src / f"doc{i}.txt").write_text(f"document {i}\n")
    real_write = pq.write_table

    def write_then_fill(table, where, **kw):
        if str(where).endswith(".tmp") and ds.shard_name(1) in str(where):
            with open(where, "wb") as f:
                f.write(b"PAR1" + b"\0" * 1000)   # what the writer got out before the disk filled
            raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")
        return real_write(table, where, **kw)

    monkeypatch.setattr(ds.pq, "write_table", write_then_fill)
    with pytest.raises(DiskFullError, match=f"{out}: the disk filled while writing {ds.shard_name(1)}"):
        ds.main(["--data-dir", str(src), "--out", str(out), "--val-fraction", "0.25"])
    assert sorted(p.name for p in out.iterdir()) == [ds.shard_name(0), ds.SOURCE_FILE]
    with pytest.raises(ds.DataError, match="is incomplete"):
        ds.list_shards(out)
    monkeypatch.setattr(ds.pq, "write_table", real_write)
    assert ds.main(["--data-dir", str(src), "--out", str(out), "--val-fraction", "0.25"]) == 0
    assert [p.name for p in ds.list_shards(out)] == [ds.shard_name(0), ds.shard_name(1)]


def test_a_val_fraction_that_leaves_no_train_document_names_the_flag(tmp_path):
    """10 documents and --val-fraction 0.95 said '--data-dir: ... holds 10 document(s); need at
    least 2': the documents were there, the flag to change went unnamed."""
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for i in range(10):
        (src / f"doc{i}.txt").write_text(f"document {i}\n")
    with pytest.raises(ValueError, match=r"--val-fraction: got 0.95, which holds out all 10 documents .* "
                                         r"accepted: 0 < x < 0.95 for this many documents"):
        ds.main(["--data-dir", str(src), "--out", str(out), "--val-fraction", "0.95"])
    assert not list(out.glob("*.parquet"))
    assert ds.main(["--data-dir", str(src), "--out", str(out), "--val-fraction", "0.9"]) == 0
    assert len(ds.list_shards(out)) == 2
    (src2 := tmp_path / "one").mkdir()
    (src2 / "a.txt").write_text("only one document\n")
    with pytest.raises(ValueError, match="--data-dir: .* holds 1 document"):   # too few: still the dir
        ds.main(["--data-dir", str(src2), "--out", str(tmp_path / "out2")])


def test_another_files_check_keeps_its_own_words(server, tmp_path):
    """download_file's verify for other files (the eval bundle's zip check): its rejection said
    '(the server sent N bytes starting ..., not a parquet file)', wrong for a zip."""
    url, _, _ = server

    def zip_check(path, size=None, sha256=None):
        raise ValueError("not a readable zip archive")

    with pytest.raises(dl.DownloadError) as e:
        dl.download_file(f"{url}/bundle.zip", tmp_path / "bundle.zip", retries=0, backoff=0, verify=zip_check)
    assert "not a readable zip archive" in str(e.value) and "parquet" not in str(e.value)
