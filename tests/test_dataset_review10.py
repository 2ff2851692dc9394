"""Review 10 of getting pretraining data (`python -m nanochat.dataset` downloading, then
scripts/pretokenize.py), against a local HTTP server on 127.0.0.1:

* a download whose validation shard failed (or a first one stopped before it came) left train
  shards only, and every reader (list_shards: training, tok_train, pretokenize) took the last
  train shard as the validation split without a word;
* retries were silent: a 429 asking for minutes per retry froze the progress bar with no reason
  given until the very end.
"""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from nanochat import dataset as ds
from nanochat import dataset_download as dl
from nanochat.errors import DataError
from scripts import pretokenize
from tests.test_dataset_download import parquet_bytes, shard_server

VAL = ds.shard_name(ds.SOURCES["climbmix"].val_index)


@pytest.fixture
def server():
    srv = shard_server()   # shards 0, 1, 2 and ClimbMix's validation shard 6542
    yield srv
    srv.close()


def _main(server, out, *flags) -> int:
    return ds.main(["--base-url", server.url, "--out", str(out), "--retries", "0", "--backoff", "0",
                    "--no-progress", *flags])


def test_a_download_without_its_validation_shard_is_not_read_as_a_set(server, tmp_path):
    out = tmp_path / "out"
    server.modes[VAL] = "500"
    assert _main(server, out, "-n", "2") == 1
    assert sorted(p.name for p in out.glob("*.parquet")) == [ds.shard_name(0), ds.shard_name(1)]
    for read in (lambda: ds.list_shards(out),
                 lambda: pretokenize.main(["--data-dir", str(out), "--out", str(tmp_path / "tok")])):
        with pytest.raises(DataError, match=rf"{ds.shard_name(1)}, not climbmix's validation shard {VAL}") as e:
            read()
        assert f"python -m nanochat.dataset --source climbmix -n 2 --out {out}" in str(e.value)
    assert not (tmp_path / "tok").exists()
    server.modes.clear()   # the rerun the message names fetches only the missing shard
    n_before = len(server.requests)
    assert _main(server, out, "-n", "2") == 0
    assert [n for n, _ in server.requests[n_before:]] == [VAL]
    assert ds.split_shards(ds.list_shards(out), "val")[0].name == VAL


def test_the_validation_shard_is_fetched_first(server, tmp_path):
    """So a download stopped part way (Ctrl-C, a full disk, a train shard failing) leaves a set."""
    assert _main(server, tmp_path, "-n", "3", "--workers", "1") == 0
    assert [n for n, _ in server.requests] == [VAL, *(ds.shard_name(i) for i in range(3))]


def test_a_start_past_the_first_shard_is_in_the_rerun_command(server, tmp_path):
    server.modes[VAL] = "500"
    assert _main(server, tmp_path, "-n", "1", "--start", "2") == 1
    with pytest.raises(DataError, match=r"-n 1 --start 2 --out"):
        ds.list_shards(tmp_path)


class _RateLimited:
    """A server that answers 429 with a Retry-After twice, then the file."""

    def __init__(self, body: bytes, retry_after: str):
        self.hits = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.hits += 1
                if owner.hits <= 2:
                    self.send_response(429)
                    self.send_header("Retry-After", retry_after)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/shard_00000.parquet"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_each_retry_is_said_with_its_cause_and_wait(tmp_path, monkeypatch, capsys):
    sleeps = []
    monkeypatch.setattr(dl, "_pause", lambda seconds, cancel: sleeps.append(seconds))
    srv = _RateLimited(parquet_bytes(["a document"]), "120")
    try:
        dl.download_file(srv.url, tmp_path / "shard_00000.parquet", retries=3, backoff=0.5)
    finally:
        srv.close()
    assert sleeps == [120.0, 120.0] and ds.list_shards(tmp_path)
    err = capsys.readouterr().err.splitlines()
    assert err == ["shard_00000.parquet: HTTP 429 (asked to wait 120 s); retry 1 of 3 in 120 s",
                   "shard_00000.parquet: HTTP 429 (asked to wait 120 s); retry 2 of 3 in 120 s"], err


def test_a_server_error_retry_names_the_shard_and_the_backoff(server, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dl, "_pause", lambda seconds, cancel: None)
    server.modes[ds.shard_name(0)] = "500"
    assert ds.main(["--base-url", server.url, "--out", str(tmp_path), "-n", "1", "--retries", "2",
                    "--backoff", "0.5", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"{ds.shard_name(0)}: HTTP 500; retry 1 of 2 in 0.5 s" in err
    assert f"{ds.shard_name(0)}: HTTP 500; retry 2 of 2 in 1 s" in err
    assert f"{server.url}/{ds.shard_name(0)}: failed after 3 attempts; last error: HTTP 500" in err
