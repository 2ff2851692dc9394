"""Downloads that stall or are stopped (nanochat/dataset_download.py) against a local HTTP server
on 127.0.0.1: a trickling server is abandoned and resumed, Ctrl-C shuts the connections in flight
at once; and the CORE eval bundle download (nanochat/core_data.py), which uses the same mechanism.
The server and its modes are tests/test_dataset_download.py's."""

import io
import os
import random
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
from test_dataset_download import FixtureServer, shard_server, two_at_once

from nanochat import dataset as ds
from nanochat import dataset_download as dl


@pytest.fixture
def server():
    srv = shard_server()
    yield srv
    srv.close()


# ---------------------------------------------------------------- stalls, prompt Ctrl-C

@pytest.mark.parametrize("urllib3_shutdown", [True, False])
def test_a_trickling_server_is_abandoned_and_the_next_attempt_resumes(server, tmp_path, monkeypatch,
                                                                      urllib3_shutdown):
    """requests' timeout is per recv: 100 B/s never trips it, and one 64 KiB read took 11 minutes.
    An attempt without a full read in stall_window seconds is dropped; the retry resumes. Without
    urllib3's HTTPResponse.shutdown (before 2.3) the socket is shut directly."""
    import urllib3.response

    if not urllib3_shutdown:
        for cls in (urllib3.response.HTTPResponse, urllib3.response.BaseHTTPResponse):
            monkeypatch.delattr(cls, "shutdown", raising=False)
    name = ds.shard_name(0)
    server.modes[name] = "trickle_once"
    t0 = time.monotonic()
    dl.download_file(f"{server.url}/{name}", tmp_path / name, retries=1, backoff=0, stall_window=1.0)
    took = time.monotonic() - t0
    assert (tmp_path / name).read_bytes() == server.files[name] and took < 3, took
    assert server.requests == [(name, None), (name, "bytes=65536-")]   # the whole read kept


def test_a_server_that_keeps_trickling_fails_naming_the_url_and_the_stall(server, tmp_path):
    name = ds.shard_name(0)
    server.modes[name] = "trickle"
    url = f"{server.url}/{name}"
    t0 = time.monotonic()
    # each attempt keeps its whole reads: the second resumes at 64 KiB and stalls at 128 KiB
    with pytest.raises(ds.DownloadError, match=rf"{url}: failed after 2 attempts; last error: stalled: less than "
                                               r"64 KiB arrived in 0.5 s \(at byte 131072\)"):
        dl.download_file(url, tmp_path / name, retries=1, backoff=0, stall_window=0.5)
    assert time.monotonic() - t0 < 3
    assert server.requests == [(name, None), (name, "bytes=65536-")]
    assert not (tmp_path / name).exists() and (tmp_path / (name + ".partial")).stat().st_size == 131072


def test_a_stall_window_that_is_not_positive_is_refused(tmp_path):
    with pytest.raises(ValueError, match="stall_window: got 0; accepted: seconds > 0"):
        dl.download_file("http://127.0.0.1:9/x", tmp_path / "x", stall_window=0)


def _interrupt_main_when(ready, delay=0.3):
    """SIGINT to the main thread once ready() holds (as a terminal's Ctrl-C); the time it was sent."""
    sent = []

    def fire():
        deadline = time.monotonic() + 10
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        sent.append(time.monotonic())
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    threading.Thread(target=fire, daemon=True).start()
    return sent


def test_ctrl_c_shuts_the_connections_in_flight_at_once(server, tmp_path):
    """A worker blocked in recv on a trickling server kept Ctrl-C waiting for its next 64 KiB (past
    60 s at 100 B/s; here the server gives up after 5 s). Now the connections are shut at once; the
    .partial files stay for a resume and no shard is written."""
    for i in (0, 1, 2):
        server.modes[ds.shard_name(i)] = "trickle"
    sent = _interrupt_main_when(lambda: len(server.requests) == 3)
    with pytest.raises(KeyboardInterrupt):
        dl.download_shards([0, 1, 2], tmp_path, server.url, workers=3, retries=0, timeout=30, progress=False)
    latency = time.monotonic() - sent[0]
    assert latency < 1.0 and list(tmp_path.glob("*.parquet")) == [], latency
    assert sorted(p.name for p in tmp_path.glob("*.partial")) == [ds.shard_name(i) + ".partial" for i in (0, 1, 2)]


def test_ctrl_c_cuts_a_retry_backoff_short(server, tmp_path):
    """A worker sleeping before its next retry (up to 60 s) held Ctrl-C for the rest of the sleep."""
    server.modes[ds.shard_name(0)] = "500"
    sent = _interrupt_main_when(lambda: len(server.requests) == 1)
    with pytest.raises(KeyboardInterrupt):
        dl.download_shards([0], tmp_path, server.url, workers=1, retries=3, backoff=5, progress=False)
    latency = time.monotonic() - sent[0]
    assert latency < 1.0 and len(server.requests) == 1, (latency, server.requests)


def test_ctrl_c_on_the_command_line_during_a_stalled_download(server, tmp_path):
    """`python -m nanochat.dataset` as a user runs it: SIGINT while every worker is blocked on a
    trickling server ends it within a second, with script_main's line, by SIGINT, no shard written."""
    for i in (0, 1, 6542):
        server.modes[ds.shard_name(i)] = "trickle"
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "nanochat.dataset", "--base-url", server.url, "--out", str(out),
                             "-n", "2", "--retries", "0", "--timeout", "30", "--no-progress"],
                            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path / "base")})
    deadline = time.monotonic() + 30
    while len(server.requests) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)
    time.sleep(0.3)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    latency = time.monotonic() - sent
    assert len(server.requests) == 3 and latency < 1.5, (latency, server.requests)
    assert proc.returncode == -signal.SIGINT and err.strip().splitlines()[-1] == "dataset: interrupted", err
    assert list(out.glob("*.parquet")) == [] and len(list(out.glob("*.partial"))) == 3


# ---------------------------------------------------------------- the CORE eval bundle (core_data.py)

def bundle_zip() -> bytes:
    """A small eval bundle: core.yaml, eval_meta_data.csv, one task file, and ~300 kB of stored
    random bytes, so the download takes several 64 KiB reads."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("eval_bundle/core.yaml", "icl_tasks: []\n")
        zf.writestr("eval_bundle/eval_meta_data.csv", "Eval Task,Random baseline\n")
        zf.writestr("eval_bundle/eval_data/x/lm.jsonl", '{"context": "a", "continuation": "b"}\n')
        zf.writestr("eval_bundle/eval_data/pad.bin", random.Random(0).randbytes(300_000))
    return buf.getvalue()


@pytest.fixture
def bundle_server():
    srv = FixtureServer({"eval_bundle.zip": bundle_zip()})
    srv.zip_url = f"{srv.url}/eval_bundle.zip"
    yield srv
    srv.close()


def fetch_bundle(srv, dest, **kw):
    from nanochat.core_data import download_eval_bundle   # not at the top: nanochat.common imports torch
    return download_eval_bundle(srv.zip_url, dest, progress=False, **kw)


def _left_in(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("damaged", [False, True])
def test_eval_bundle_resumes_after_a_cut_off(bundle_server, tmp_path, damaged):
    """The bundle was fetched with bare urllib into a temporary dir: a cut-off started over (and an
    IncompleteRead escaped as no RuntimeError). Now the .partial zip stays and the rerun resumes
    it; a .partial whose bytes are not this zip's (damaged) fails the CRC check once complete and
    is fetched again from byte 0, never unpacked."""
    bundle_server.modes["eval_bundle.zip"] = "truncate_once"
    dest, url = tmp_path / "bundle", bundle_server.zip_url
    with pytest.raises(RuntimeError, match=rf"could not download the eval bundle: {url}: failed "
                                           r"after 1 attempts; last error: ChunkedEncodingError"):
        fetch_bundle(bundle_server, dest, retries=1)
    partial, = tmp_path.glob(".bundle-*.zip.partial")
    kept = partial.stat().st_size
    assert not dest.exists() and 0 < kept <= len(bundle_server.files["eval_bundle.zip"]) // 2
    if damaged:
        partial.write_bytes(b"\0" * kept)   # e.g. a disk error, or bytes of another file
    assert fetch_bundle(bundle_server, dest, retries=2, backoff=0) == dest
    assert [r for _, r in bundle_server.requests] == [None, f"bytes={kept}-"] + [None] * damaged
    assert (dest / "core.yaml").is_file()
    assert (dest / "eval_data" / "pad.bin").read_bytes() == random.Random(0).randbytes(300_000)
    assert _left_in(tmp_path) == ["bundle"]   # no zip, .partial, .lock or temporary dir left


def test_a_zip_cut_short_without_a_length_is_fetched_again_then_refused(bundle_server, tmp_path):
    """No Content-Length and a close mid-body looks complete to HTTP; the zip check catches it (a
    truncated zip has no central directory) before the file is renamed; each attempt starts over,
    and the last one's error is a ValueError."""
    bundle_server.modes["eval_bundle.zip"] = "close_no_length"
    with pytest.raises(ValueError, match=rf"eval bundle from {bundle_server.zip_url} is not a zip file"):
        fetch_bundle(bundle_server, tmp_path / "bundle", retries=2, backoff=0)
    assert [r for _, r in bundle_server.requests] == [None, None]
    assert _left_in(tmp_path) == []


def test_a_stalled_eval_bundle_download_fails_naming_the_stall(bundle_server, tmp_path):
    bundle_server.modes["eval_bundle.zip"] = "trickle"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"could not download the eval bundle: {bundle_server.zip_url}: failed "
                                           r"after 2 attempts; last error: stalled: less than 64 KiB arrived in 0.5 s"):
        fetch_bundle(bundle_server, tmp_path / "bundle", retries=2, backoff=0, stall_window=0.5)
    assert time.monotonic() - t0 < 3
    assert not (tmp_path / "bundle").exists() and len(list(tmp_path.glob(".bundle-*.zip.partial"))) == 1


def test_two_ranks_fetching_the_eval_bundle_download_it_once(bundle_server, tmp_path):
    """Every rank of a torchrun calling download_eval_bundle downloaded its own copy into the same
    place (and one's rmtree of a 'partial' dest could remove the other's bundle); now the second
    waits for the first and keeps its bundle."""
    bundle_server.modes["eval_bundle.zip"] = "hold"
    dest = tmp_path / "bundle"
    results = two_at_once(bundle_server, lambda: fetch_bundle(bundle_server, dest, retries=1))
    assert results == {"first": dest, "second": dest}
    assert bundle_server.requests == [("eval_bundle.zip", None)] and _left_in(tmp_path) == ["bundle"]


def test_a_verified_zip_left_by_an_interrupted_unpack_is_reused(bundle_server, tmp_path, monkeypatch):
    from nanochat import core_data

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(core_data, "_unpack_bundle", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_bundle(bundle_server, tmp_path / "bundle", retries=1)
    monkeypatch.undo()
    assert len(list(tmp_path.glob(".bundle-*.zip"))) == 1   # downloaded, verified, not unpacked
    assert (fetch_bundle(bundle_server, tmp_path / "bundle") / "core.yaml").is_file()
    assert len(bundle_server.requests) == 1 and _left_in(tmp_path) == ["bundle"]
