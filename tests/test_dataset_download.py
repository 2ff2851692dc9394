"""Shard downloads (nanochat/dataset_download.py, and `python -m nanochat.dataset` driving it)
against a local HTTP server on 127.0.0.1: resume, retries, verification, corrupt and damaged
files, server faults, a full disk, two downloaders of one shard, Ctrl-C; stalls and the CORE eval
bundle are in tests/test_download_stall.py."""

import errno
import gzip
import io
import os
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanochat import dataset as ds
from nanochat import dataset_download as dl


def parquet_bytes(docs, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": docs}), buf, **kw)
    return buf.getvalue()


# ---------------------------------------------------------------- local server

class FixtureServer:
    """Serves `files` over HTTP with Range support; `modes[name]` injects faults:
    truncate_once (close mid-body on the first request), corrupt, 500, badsha, gzip (compress
    the body when the client accepts gzip), short_body (a Content-Length and body 1000 bytes
    short), close_no_length (no Content-Length, close mid-body), hold (the first request sends
    half, sets `half_sent` and waits for `release_first`; Range requests wait for `release_ranged`),
    trickle (the full Content-Length, 100 kB at once, then 100 B/s until the client goes or
    `trickle_for` seconds pass), trickle_once (trickle the first request only)."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.modes, self.requests = files, {}, []
        self._truncated, self._trickled = set(), set()
        self.trickle_for, self.closing = 5.0, threading.Event()
        self.half_sent, self.release_first, self.release_ranged = (threading.Event() for _ in range(3))
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
                if mode == "hold" and rng:
                    server.release_ranged.wait(10)
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    if mode == "badsha":  # the hub states it on the redirect before any response
                        self.send_header("X-Linked-Etag", '"' + "0" * 64 + '"')
                    self.end_headers()
                    return
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                if mode == "badsha":
                    self.send_header("X-Linked-Etag", '"' + "0" * 64 + '"')
                if mode == "gzip" and data is not server.files[name]:
                    self.send_header("Content-Encoding", "gzip")
                body = data[start:-1000] if mode == "short_body" else data[start:]
                if mode != "close_no_length":
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if mode == "close_no_length" or (mode == "hold" and not rng and not server.half_sent.is_set()):
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    if mode == "close_no_length":
                        self.close_connection = True
                        return
                    server.half_sent.set()
                    server.release_first.wait(10)
                    body = body[len(body) // 2:]
                if mode == "trickle" or (mode == "trickle_once" and name not in server._trickled):
                    server._trickled.add(name)
                    return self._trickle(body)
                if mode == "truncate_once" and name not in server._truncated:
                    server._truncated.add(name)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def _trickle(self, body: bytes):
                """What a stalled mirror does: a good start, then 10 bytes every 0.1 s."""
                self.close_connection = True
                self.wfile.write(body[:100_000])
                self.wfile.flush()
                pos, until = 100_000, time.monotonic() + server.trickle_for
                try:
                    while pos < len(body) and time.monotonic() < until and not server.closing.wait(0.1):
                        self.wfile.write(body[pos:pos + 10])
                        self.wfile.flush()
                        pos += 10
                except OSError:   # the client shut the connection: what these tests want
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/data"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def shard_server() -> FixtureServer:
    rng = random.Random(0)  # ~300 kB per shard, uncompressed: several 64 kB download chunks
    files = {ds.shard_name(i): parquet_bytes(["".join(rng.choices("abcdefgh ", k=5000)) for _ in range(60)],
                                             compression="none") for i in (0, 1, 2, 6542)}
    return FixtureServer(files)


@pytest.fixture
def server():
    srv = shard_server()
    yield srv
    srv.close()


def cli(srv, out, *extra):
    return ds.main(["--base-url", srv.url, "--out", str(out), "--retries", "2", "--backoff", "0",
                    "--timeout", "10", "--no-progress", *extra])


# ---------------------------------------------------------------- downloads

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
    assert [i for i, _ in failures] == [0] and "not a readable parquet" in str(failures[0][1])
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
    monkeypatch.setattr(dl, "_pause", lambda seconds, cancel: sleeps.append(seconds))
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


def test_sources_never_mix(tmp_path, server):
    ds.claim_data_dir(tmp_path, "shakespeare")
    (tmp_path / ds.shard_name(0)).write_bytes(parquet_bytes(["x"]))
    with pytest.raises(ValueError, match="already holds 1 shards from shakespeare"):
        cli(server, tmp_path, "-n", "1")


# ---------------------------------------------------------------- a full disk

def test_download_stops_when_the_remaining_shards_cannot_fit(server, tmp_path, monkeypatch, capsys):
    """After each finished shard the ones left (at the mean size so far) must fit the free space;
    otherwise the download stops with one line naming the numbers, the finished shards kept."""
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: usage(10**12, 0, 1000))
    # 3 more, or 2 when the pool's worker finished shard 1 before shard 0's check ran (a race seen in CI)
    with pytest.raises(ds.DiskFullError, match=r"[23] more shards need ~\d+ KB \(~\d+ KB each\), 1 KB free; free "
                                               r"space \(or ask for fewer with -n\) and rerun: the 1 finished"):
        ds.download_shards([0, 1, 2, 6542], tmp_path, server.url, workers=1, retries=0, progress=False)
    # shard 1 may have started before the check (the pool's worker takes the next one at once)
    assert [p.name for p in ds.list_shards(tmp_path)][:1] == [ds.shard_name(0)]
    assert not list(tmp_path.glob("*.partial"))
    assert {n for n, _ in server.requests} <= {ds.shard_name(0), ds.shard_name(1)}   # the others never started
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    assert ds.download_shards([0, 1, 2, 6542], tmp_path, server.url, workers=1, retries=0, progress=False) == []
    assert len(ds.list_shards(tmp_path)) == 4


def test_a_full_disk_mid_download_is_one_line_not_retried(server, tmp_path, monkeypatch, capsys):
    calls = []

    def disk_full(*args, **kwargs):
        calls.append(args[1])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dl, "_attempt", disk_full)
    from nanochat.flags import run_cli

    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: ds.main(["--base-url", server.url, "--out", str(tmp_path), "-n", "2", "--workers", "1",
                                    "--retries", "3", "--no-progress"]))
    rc = exit_.value.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "the disk filled while downloading" in err[0] and "finished files are kept" in err[0], err
    assert len(calls) == 1     # no retry, no other shard started


def test_a_full_disk_mid_file_keeps_only_a_partial_that_resumes(server, tmp_path):
    """ENOSPC after the first chunk: no file under the shard's name (nothing counts as a shard),
    the .partial is kept, and the next run resumes it to the exact bytes."""
    dest = tmp_path / ds.shard_name(0)
    url = f"{server.url}/{dest.name}"

    def fill_disk(n):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ds.DiskFullError, match=f"the disk filled while downloading {dest.name}"):
        dl.download_file(url, dest, retries=3, backoff=0, on_bytes=fill_disk)
    partial = tmp_path / (dest.name + ".partial")
    kept = partial.stat().st_size
    assert not dest.exists() and 0 < kept < len(server.files[dest.name]) and len(server.requests) == 1
    with pytest.raises(FileNotFoundError, match="no text shards"):
        ds.list_shards(tmp_path)
    dl.download_file(url, dest, retries=0)
    assert dest.read_bytes() == server.files[dest.name] and not partial.exists()
    assert server.requests[-1] == (dest.name, f"bytes={kept}-")


# ---------------------------------------------------------------- server faults, verification

@pytest.mark.parametrize("mode", ["short_body", "close_no_length"])
def test_a_short_body_the_server_calls_complete_is_not_a_shard(server, tmp_path, mode):
    """A Content-Length that is short, or none and a close mid-body: the bytes look complete to
    HTTP; verification rejects them, every attempt starts over, and nothing is left behind."""
    name = ds.shard_name(0)
    server.modes[name] = mode
    with pytest.raises(ds.DownloadError, match=r"failed after 2 attempts; last error: verification failed: .*"
                                               r"not a readable parquet file"):
        dl.download_file(f"{server.url}/{name}", tmp_path / name, retries=1, backoff=0)
    assert [r for n, r in server.requests] == [None, None]   # no resume from a rejected file
    assert list(tmp_path.iterdir()) == []


def test_a_complete_partial_is_checked_against_the_stated_sha256(server, tmp_path):
    """A .partial left complete by an earlier run gets a 416 on resume; the sha256 the server states
    must still be checked (it was dropped on that path, so the file became a shard unchecked)."""
    name = ds.shard_name(2)
    server.modes[name] = "badsha"
    (tmp_path / (name + ".partial")).write_bytes(server.files[name])
    with pytest.raises(ds.DownloadError, match="verification failed: sha256 [0-9a-f]{64}, expected 0{64}"):
        dl.download_file(f"{server.url}/{name}", tmp_path / name, retries=0)
    assert not (tmp_path / name).exists() and not (tmp_path / (name + ".partial")).exists()


def test_the_file_is_on_disk_before_it_is_renamed_into_place(server, tmp_path, monkeypatch):
    """fsync before os.replace: after a power cut a renamed file whose data never reached the disk
    is an empty or short file under a shard's name."""
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.stat(a).st_ino)), replace(a, b))[1])
    name = ds.shard_name(0)
    dl.download_file(f"{server.url}/{name}", tmp_path / name, retries=0)
    inode = (tmp_path / name).stat().st_ino
    assert ("replace", inode) in events and ("fsync", inode) in events[:events.index(("replace", inode))], events


def test_a_damaged_shard_already_there_is_fetched_again(server, tmp_path, capsys):
    """A shard cut short (a crash, a full disk, a bad copy) used to count as done on every rerun,
    exit 0, until the dataloader stopped on it; now its footer is read and it is fetched again."""
    ds.claim_data_dir(tmp_path, "climbmix")
    name, val = ds.shard_name(0), ds.shard_name(6542)
    (tmp_path / name).write_bytes(server.files[name][:-100])
    (tmp_path / val).write_bytes(server.files[val])
    assert cli(server, tmp_path, "-n", "1") == 0
    assert (tmp_path / name).read_bytes() == server.files[name]
    assert [n for n, _ in server.requests] == [name]   # the good one is kept
    assert f"{tmp_path / name}: not a readable text shard; downloading it again" in capsys.readouterr().err


def test_base_url_that_is_not_an_http_url_is_a_flag_error(tmp_path):
    """requests refused such a URL on every shard, each after all its retries and backoff, then
    exit 1 with a line per shard; it is a flag error, before any work."""
    from nanochat.errors import RequestError
    for url in ("127.0.0.1:8000/data", "ftp://example.org/data", "http:///data"):
        with pytest.raises(RequestError, match=rf"--base-url: got '{url}'; accepted: an http:// or https:// URL"):
            ds.main(["--base-url", url, "-n", "1", "--retries", "0", "--no-progress", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- concurrency, stopping

def test_two_downloaders_of_one_shard_do_not_corrupt_it(server, tmp_path):
    """torchrun ranks (or two shells) fetching the same shard shared one .partial file: the second
    resumed the first's partial, and once the first renamed it into place the second wrote its
    range into a new .partial at byte 0 and failed ('connection closed'), leaving bytes a later run
    resumed (or, mid-write, appended to the renamed shard; or the first died on a .partial the
    second renamed away). Now the second waits for the first and keeps its result."""
    name = ds.shard_name(0)
    server.modes[name] = "hold"
    dest = tmp_path / name
    results = two_at_once(server, lambda: dl.download_file(f"{server.url}/{name}", dest, retries=0, timeout=10))
    assert results == {"first": None, "second": None} and dest.read_bytes() == server.files[name]
    assert server.requests == [(name, None)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]   # no .partial, no .lock left


def two_at_once(server, fetch) -> dict:
    """fetch() in two threads: the second starts while the server holds the first's response
    half sent ('hold' mode). {'first'|'second': fetch()'s result, or repr of its error}."""
    results = {}

    def run(who):
        try:
            results[who] = fetch()
        except Exception as e:  # noqa: BLE001 - reported by the caller's assertion
            results[who] = repr(e)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    assert server.half_sent.wait(10)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    time.sleep(0.3)               # the second is now waiting: for the lock, or (before) for the server
    server.release_first.set()
    first.join(10)
    server.release_ranged.set()
    second.join(10)
    return results


def test_ctrl_c_stops_the_queued_and_running_shards(tmp_path, monkeypatch):
    """Ctrl-C (or any unexpected error) during download_shards used to wait for the thread pool to
    download every queued shard before it surfaced; now none starts and the one in flight stops."""
    started, finished = [], []

    def fake_download(url, dest, *, on_bytes, **kw):
        started.append(dest.name)
        if dest.name == ds.shard_name(0):
            raise KeyboardInterrupt
        for _ in range(50):   # 0.5 s of 'download' unless stopped
            on_bytes(1)
            time.sleep(0.01)
        finished.append(dest.name)

    monkeypatch.setattr(dl, "download_file", fake_download)
    with pytest.raises(KeyboardInterrupt):
        dl.download_shards([0, 1, 2, 3], tmp_path, "http://127.0.0.1:9", workers=1, progress=False)
    assert finished == [] and set(started) <= {ds.shard_name(0), ds.shard_name(1)}, (started, finished)



def test_a_downloader_waiting_for_another_can_be_stopped(server, tmp_path):
    """The wait for another process's lock reports through on_bytes(0), so download_shards can stop
    a worker stuck there on Ctrl-C (a blocking flock ignored it until the other one finished)."""
    dest = tmp_path / ds.shard_name(0)

    def stop(n):
        raise RuntimeError("stopping")

    with dl.file_lock(dest):   # another downloader holds the shard
        with pytest.raises(RuntimeError, match="stopping"):
            dl.download_file(f"{server.url}/{dest.name}", dest, retries=0, on_bytes=stop)
    assert server.requests == [] and list(tmp_path.iterdir()) == []


def test_a_filesystem_without_locks_still_downloads(server, tmp_path, monkeypatch, capsys):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    for i in (0, 1):
        dl.download_file(f"{server.url}/{ds.shard_name(i)}", tmp_path / ds.shard_name(i), retries=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ds.shard_name(0), ds.shard_name(1)]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "this filesystem has no file locks (Function not implemented)" in err[0], err
