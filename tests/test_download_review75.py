"""Review of the downloads (nanochat/dataset_download.py, nanochat/core_data.py's eval bundle)
against a local HTTP server on 127.0.0.1: a link that drops every connection but moves the file on
each time is not given up on after --retries tries; the free-space check does not count the bytes
already in the unfinished shards' .partial files as still needed; the unpacked eval bundle is on
disk before it takes its name (and before its zip, the one durable copy, is deleted); the shards'
progress bar counts the shards on disk, not the failed ones."""

import io
import os
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_download_stall import bundle_server, fetch_bundle  # noqa: F401 - bundle_server: a fixture

from nanochat import dataset as ds
from nanochat import dataset_download as dl


# ---------------------------------------------------------------- a link that drops, moving on each time

def _big_shard() -> bytes:
    """~3 MiB of uncompressed parquet: several 1 MiB steps of progress."""
    rng = random.Random(75)
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["".join(rng.choices("abcdefgh ", k=30_000)) for _ in range(100)]}), buf,
                   compression="none")
    return buf.getvalue()


class _DroppingServer:
    """One file with a constant ETag and Range support; every response states the whole rest
    (Content-Length) but the connection is closed after `per_connection` bytes of it: a proxy or a
    CDN node that cuts long transfers."""

    def __init__(self, body: bytes, per_connection: int):
        self.body, self.per_connection, self.requests = body, per_connection, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                rng = self.headers.get("Range")
                server.requests.append(rng)
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
                self.send_response(206 if start else 200)
                self.send_header("ETag", '"v1"')
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(server.body) - 1}/{len(server.body)}")
                self.send_header("Content-Length", str(len(server.body) - start))
                self.end_headers()
                self.wfile.write(server.body[start:start + server.per_connection])
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/{ds.shard_name(0)}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_link_that_drops_but_moves_the_file_on_each_time_is_not_given_up(tmp_path, capsys):
    """Every try counted against --retries, also one that fetched megabytes before its connection
    dropped: a 250 MB shard through a link that drops every few tens of MB failed (exit 1) after 6
    tries although each one resumed further, and each rerun failed the same way. Now a try that moved
    the file on by 1 MiB or more is not a failed one: the count (and the backoff) starts again."""
    body = _big_shard()
    srv = _DroppingServer(body, per_connection=5 << 18)   # 1.25 MiB per connection: 3 tries for ~3 MiB
    dest = tmp_path / ds.shard_name(0)
    try:
        dl.download_file(srv.url, dest, retries=1, backoff=0)
    finally:
        srv.close()
    assert dest.read_bytes() == body
    n = len(srv.requests)
    assert n >= 3 and srv.requests[0] is None and all(r.startswith("bytes=") for r in srv.requests[1:]), srv.requests
    err = capsys.readouterr().err
    assert err.count("so retrying (not counted as a retry) in 0 s") == n - 1 and "retry 1 of 1" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name]


def test_a_link_that_drops_without_real_progress_still_gives_up_naming_the_url(tmp_path):
    """The other side of it: tries that move the file on by less than 1 MiB (200 kB here) still
    count, so a download through a link that barely moves ends after --retries, naming the URL."""
    srv = _DroppingServer(_big_shard(), per_connection=200_000)
    dest = tmp_path / ds.shard_name(0)
    try:
        with pytest.raises(dl.DownloadError, match=rf"{srv.url}: failed after 3 attempts; last error: "
                                                   r"ChunkedEncodingError"):
            dl.download_file(srv.url, dest, retries=2, backoff=0)
    finally:
        srv.close()
    assert len(srv.requests) == 3 and not dest.exists()
    assert (tmp_path / (dest.name + ".partial")).stat().st_size == 3 * 196_608   # 3 whole 64 KiB reads each


# ---------------------------------------------------------------- the free-space check

def test_the_room_check_counts_what_the_partial_files_already_hold(tmp_path, monkeypatch):
    """After each finished shard, the shards still to come had to fit the free space at their full
    size, although the ones in flight (or resumed from an earlier run) already had most of their
    bytes on disk: near the end of a download onto a nearly full disk it stopped with "1 more
    shards need ~N MB" (exit 2) while that shard, left to finish, was then complete on disk."""
    import collections

    size = 100_000
    partial_written, checked = threading.Event(), threading.Event()
    usage = collections.namedtuple("usage", "total used free")

    def disk_usage(path):
        checked.set()
        return usage(10**12, 0, 1000)   # room for the last 1000 bytes of shard 1, not for a whole shard

    def fake_download(url, dest, **kw):
        partial = dest.with_name(dest.name + ".partial")
        if dest.name == ds.shard_name(1):   # in flight: all but 1000 bytes on disk
            partial.write_bytes(b"x" * (size - 1000))
            partial_written.set()
            assert checked.wait(10)          # still running while the main thread checks the room
        else:
            assert partial_written.wait(10)
        partial.write_bytes(b"x" * size)
        os.replace(partial, dest)

    monkeypatch.setattr(dl.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(dl, "download_file", fake_download)
    assert dl.download_shards([0, 1], tmp_path, "http://127.0.0.1:9", workers=2, progress=False) == []
    assert checked.is_set()
    assert sorted(p.name for p in tmp_path.iterdir()) == [ds.shard_name(0), ds.shard_name(1)]


def test_the_room_check_still_stops_what_cannot_fit(tmp_path, monkeypatch):
    """The same check, with partial files holding too little: the error names the bytes still needed."""
    import collections

    usage = collections.namedtuple("usage", "total used free")
    (tmp_path / (ds.shard_name(2) + ".partial")).write_bytes(b"x" * 40_000)   # from an earlier run

    checked = threading.Event()

    def disk_usage(path):
        checked.set()
        return usage(10**12, 0, 1000)

    def fake_download(url, dest, **kw):
        if dest.name != ds.shard_name(0):   # shard 1 in flight, shard 2 queued, while the room is checked
            assert checked.wait(10)
        dest.write_bytes(b"x" * 100_000)

    monkeypatch.setattr(dl.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(dl, "download_file", fake_download)
    with pytest.raises(ds.DiskFullError, match=r"2 more shards need ~160 KB \(~100 KB each\), 1 KB free; .* "
                                               r"the 1 finished this time are kept; the 40 KB already in their "
                                               r"\.partial files are counted"):
        dl.download_shards([0, 1, 2], tmp_path, "http://127.0.0.1:9", workers=1, progress=False)


# ---------------------------------------------------------------- the eval bundle on disk before its name

def test_the_unpacked_eval_bundle_is_on_disk_before_it_takes_its_name(bundle_server, tmp_path, monkeypatch):  # noqa: F811
    """The zip was fsynced before its rename, but the bundle unpacked from it was moved into place
    and the zip deleted with none of its files synced: after a power cut, core.yaml could stand in
    dest (so download_eval_bundle returned at once) over empty or cut task files, and the zip was
    gone. Now every unpacked file and folder is synced before the move, and the move before the
    zip goes."""
    events, fsync, replace, unlink = [], os.fsync, os.replace, os.unlink
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.stat(a).st_ino)), replace(a, b))[1])
    monkeypatch.setattr(os, "unlink", lambda p, **kw: (events.append(("unlink", str(p))), unlink(p, **kw))[1])
    dest = tmp_path / "bundle"
    assert fetch_bundle(bundle_server, dest, retries=1) == dest
    moved = events.index(("replace", dest.stat().st_ino))
    synced = {ino for what, ino in events[:moved] if what == "fsync"}
    tree = [dest, *dest.rglob("*")]
    assert len(tree) == 7 and {p.stat().st_ino for p in tree} <= synced, (tree, events)
    zip_gone = next(i for i, (what, p) in enumerate(events) if what == "unlink" and p.endswith(".zip"))
    assert ("fsync", tmp_path.stat().st_ino) in events[moved:zip_gone], events
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]


# ---------------------------------------------------------------- the progress bar

def test_the_bar_counts_the_shards_on_disk_not_the_failed_ones(tmp_path, capsys):
    """The bar advanced for a shard that failed too: a run that left a shard out ended on
    "100% 4/4 shards" (its shard/s rate counting the failure), the failure only in the postfix."""
    from test_dataset_download import shard_server

    srv = shard_server()
    srv.modes[ds.shard_name(1)] = "500"
    try:
        failures = dl.download_shards([6542, 0, 1, 2], tmp_path, srv.url, workers=1, retries=0, progress=True)
    finally:
        srv.close()
    assert [i for i, _ in failures] == [1]
    frames = [f.strip() for f in capsys.readouterr().err.replace("\n", "\r").split("\r") if "shard" in f]
    assert frames and not any("4/4" in f for f in frames), frames
    assert "3/4" in frames[-1] and "failed=1" in frames[-1], frames


class _ReplacedServer(_DroppingServer):
    """The file was replaced on the server (ETag "v1") after an earlier run left a long .partial of
    the old one ("v0"): If-Range with v0 gets the whole new file (a 200), cut every connection."""

    def __init__(self, body: bytes, per_connection: int, honours_if_range: bool):
        super().__init__(body, per_connection)
        self.honours_if_range = honours_if_range
        outer = self
        handler = self.httpd.RequestHandlerClass
        plain_get = handler.do_GET

        def do_GET(self):
            if outer.honours_if_range and self.headers.get("If-Range") not in (None, '"v1"'):
                del self.headers["Range"]   # RFC 9110: another version comes whole
            plain_get(self)
        handler.do_GET = do_GET


@pytest.mark.parametrize("honours_if_range", [True, False])
def test_after_the_file_changed_on_the_server_the_new_files_progress_counts(tmp_path, honours_if_range):
    """Progress was measured against the furthest byte the .partial file ever had, so after a
    restart from byte 0 (the old version's 2.9 MB .partial dropped) every try that moved the new file
    on by 1.25 MiB counted against --retries until it passed 2.9 MB: it failed after 3 attempts."""
    body = _big_shard()
    srv = _ReplacedServer(body, per_connection=5 << 18, honours_if_range=honours_if_range)
    dest = tmp_path / ds.shard_name(0)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(b"\0" * (len(body) - 1000))
    dl._note_version(partial, '"v0"')
    try:
        dl.download_file(srv.url, dest, retries=1, backoff=0)
    finally:
        srv.close()
    assert dest.read_bytes() == body
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name]


def test_a_file_that_is_always_rejected_still_gives_up(tmp_path):
    """The fresh start after a rejected file is allowed once: a server whose file never verifies,
    through a link that drops every 1.25 MiB, is given up on, naming the URL, not fetched for ever."""
    body = _big_shard()
    bad = body[:-100] + b"\0" * 100   # the parquet footer broken
    srv = _DroppingServer(bad, per_connection=5 << 18)
    dest = tmp_path / ds.shard_name(0)
    try:
        with pytest.raises(dl.DownloadError, match=rf"{srv.url}: failed after \d+ attempts"):
            dl.download_file(srv.url, dest, retries=1, backoff=0)
    finally:
        srv.close()
    assert not dest.exists() and len(srv.requests) < 20, srv.requests
