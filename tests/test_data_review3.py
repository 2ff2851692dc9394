"""Regression tests from a third review of the pretraining data path (downloads, local import,
binary shards): each one failed before its fix. Downloads run against a local HTTP server on
127.0.0.1 only."""

import io
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset as ds
from nanochat import dataset_download as dl


def shard_bytes(seed: int) -> bytes:
    """A zstd text shard of several row groups (what the hub serves, in miniature)."""
    rng = random.Random(seed)
    docs = ["".join(rng.choices("abcdefgh ", k=rng.randint(100, 3000))) for _ in range(400)]
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, row_group_size=64, compression="zstd")
    return buf.getvalue()


class Server:
    """Serves `files` with Range support and no checksum header (a plain mirror, --base-url);
    `status[name]`: a list of (status, headers) answered, one per request, before the file is."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.status, self.requests = files, {}, []
        srv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                rng = self.headers.get("Range")
                srv.requests.append((name, rng, time.monotonic()))
                if srv.status.get(name):
                    code, headers = srv.status[name].pop(0)
                    self.send_response(code)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = srv.files.get(name)
                if data is None:
                    return self.send_error(404)
                start = int(rng[len("bytes="):].split("-")[0]) if rng else 0
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.end_headers()
                    return
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                self.wfile.write(data[start:])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/data"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = Server({ds.shard_name(0): shard_bytes(2)})
    yield srv
    srv.close()


# ---------------------------------------------------------------- downloads

def test_a_partial_of_a_file_since_changed_on_the_server_is_not_spliced_into_a_shard(server, tmp_path):
    """A .partial from an earlier run of a file the mirror has replaced since: the Range resume
    appends the new file's tail to the old file's head. Verification decoded only the first row
    group (it sits in the old head and decodes), so a corrupt shard took the final name and the
    dataloader stopped on it mid-training. Without a stated sha256 every row group is decoded."""
    name = ds.shard_name(0)
    old = shard_bytes(1)
    (tmp_path / (name + ".partial")).write_bytes(old[: len(old) // 2])
    dl.download_file(f"{server.url}/{name}", tmp_path / name, retries=1, backoff=0, timeout=10)
    assert (tmp_path / name).read_bytes() == server.files[name]
    assert [r for _, r, _ in server.requests] == [f"bytes={len(old) // 2}-", None]   # resumed, then from 0


def test_http_429_waits_as_long_as_the_server_asks(server, tmp_path):
    """A rate limit (429, or 503) with Retry-After: the retry came after --backoff (2 s, 4 s, ...),
    inside the server's window, so every retry was refused too and the shard failed."""
    name = ds.shard_name(0)
    server.status[name] = [(429, {"Retry-After": "1"})]
    dl.download_file(f"{server.url}/{name}", tmp_path / name, retries=1, backoff=0, timeout=10)
    assert (tmp_path / name).read_bytes() == server.files[name]
    (_, _, t0), (_, _, t1) = server.requests
    assert t1 - t0 >= 0.9, t1 - t0


def test_retry_after_is_read_as_seconds_or_a_date_and_capped():
    from email.utils import formatdate

    assert dl._retry_after({"Retry-After": "7"}) == 7
    assert 25 <= dl._retry_after({"Retry-After": formatdate(time.time() + 30, usegmt=True)}) <= 31
    assert dl._retry_after({"Retry-After": "86400"}) == dl.MAX_RETRY_AFTER
    assert dl._retry_after({"Retry-After": "soon"}) is None and dl._retry_after({}) is None
    assert dl._retry_after({"RateLimit": '"resolvers";r=0;t=42'}) == 42   # the hub's header


# ---------------------------------------------------------------- local import

def test_local_import_reads_upper_case_suffixes_skips_hidden_files_and_says_what_it_skipped(tmp_path, capsys):
    """`--data-dir` matched suffixes case-sensitively, so a Windows `NOTES.TXT` or `Data.JSONL` was
    silently left out (the run said only "wrote 2 shards"); a macOS `._name.txt` resource fork (in
    every tar made on a Mac) or a `.ipynb_checkpoints/` copy was read as a document (the first
    stopped the import as "not valid UTF-8", the second trained a duplicate). Now the suffix is
    matched in any case, hidden files and directories are skipped, and the command says how many
    files and documents it read and how many files it skipped."""
    src = tmp_path / "src"
    (src / ".ipynb_checkpoints").mkdir(parents=True)
    (src / "a.txt").write_text("alpha document")
    (src / "NOTES.TXT").write_text("notes document")
    (src / "Data.JSONL").write_text('{"text": "json document"}\n')
    (src / "._a.txt").write_bytes(b"\x00\x05\x16\x07\xff\xfe Mac OS X")
    (src / ".ipynb_checkpoints" / "a-checkpoint.txt").write_text("alpha document")
    (src / "readme.md").write_text("# not read")
    docs = ds.read_local_documents(src)
    assert sorted(docs) == ["alpha document", "json document", "notes document"]
    assert ds.main(["--data-dir", str(src), "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "read 3 documents from 3 files" in out and "skipped 1 file" in out and "readme.md" in out, out


def test_done_line_says_what_the_directory_holds_when_earlier_shards_are_there(server, tmp_path, capsys):
    """`-n 1` into a directory where an earlier `-n 3` left shards said "done: 2 shards", while
    training reads all 4 there (3 train): a user cutting -n to train on less data was misled."""
    server.files.update({ds.shard_name(i): shard_bytes(i) for i in (1, 2, 6542)})
    args = ["--base-url", server.url, "--out", str(tmp_path), "--retries", "0", "--no-progress"]
    assert ds.main([*args, "-n", "3"]) == 0
    capsys.readouterr()
    assert ds.main([*args, "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "holds 4 shards in all (3 train + shard_06542.parquet for validation)" in out, out
