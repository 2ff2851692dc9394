"""The "never lose data" promise under crashes, bit rot and flaky networks, probed end to end:
a checkpoint save SIGKILLed at every file operation (and a --keep-last removal after it) leaves a
checkpoint that loads and that --resume auto takes; a download resumed after the file changed on
the server never splices two versions (If-Range, nanochat/dataset_download.py); a bit flipped in a
text shard this project wrote is a DataError naming it, never slightly different text (page CRCs,
nanochat/dataset.py), and the shard is on disk before it is renamed into place."""

from __future__ import annotations

import io
import os
import random
import shutil
import signal
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_runs as cr
from nanochat import dataset as ds
from nanochat import dataset_download as dl
from nanochat.errors import DataError


# ---------------------------------------------------------------- checkpoints: SIGKILL anywhere

def _save(d: Path, step: int) -> Path:
    g = torch.Generator().manual_seed(step)
    return ck.save_checkpoint(d, step, model_state={"w": torch.randn(32, 32, generator=g)},
                              optimizer_state={"state": {0: {"m": torch.full((2,), float(step))}}, "param_groups": []},
                              loader_state={"row": step}, loop_state={"step": step}, meta={"model_config": {}})


def _die_at(k: int) -> None:
    """In a forked child: SIGKILL itself at the k-th file operation of what follows (before and after
    each rename, fsync, unlink, mkdir, rmtree; halfway through each torch.save's bytes)."""
    count = [0]

    def tick():
        count[0] += 1
        if count[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(mod, name):
        orig = getattr(mod, name)

        def op(*a, **kw):
            tick()
            out = orig(*a, **kw)
            tick()
            return out
        setattr(mod, name, op)

    for name in ("replace", "rename", "fsync", "unlink", "mkdir", "rmdir"):
        wrap(os, name)
    wrap(shutil, "rmtree")
    save = torch.save

    def half_then_rest(obj, f, *a, **kw):
        buf = io.BytesIO()
        save(obj, buf, *a, **kw)
        data = buf.getvalue()
        tick()
        f.write(data[:len(data) // 2])
        tick()
        f.write(data[len(data) // 2:])
    torch.save = half_then_rest


def test_a_save_and_prune_killed_at_any_file_operation_leaves_a_loadable_checkpoint(tmp_path):
    """Step 10 saved; then step 20 saved and step 10 pruned (--keep-last 1), SIGKILLed at the k-th
    file operation for every k until one run finishes: each time --resume auto resumes, the step it
    takes loads with its optimizer, and it is 10 or 20 (20 once latest.json names it)."""
    taken, k = set(), 0
    while True:
        k += 1
        d = tmp_path / f"k{k}"
        _save(d, 10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # fork() of a multi-threaded process
            pid = os.fork()
        if pid == 0:
            try:
                _die_at(k)
                _save(d, 20)
                cr.remove_old_step(d / ck.step_dirname(10), d / ck.step_dirname(20), 1, say=lambda s: None)
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert cr.resolve_resume("auto", d, log=lambda s: None) == "latest", (k, sorted(os.listdir(d)))
        out = ck.load_checkpoint(d, "latest", load_optimizer=True)
        assert out["step"] in (10, 20) and out["loop"]["step"] == out["step"], (k, out["step"])
        taken.add(out["step"])
        shutil.rmtree(d)
        if not os.WIFSIGNALED(status):
            break
        assert k < 400, "the kill points never ran out"
    assert taken == {10, 20} and k > 20, (taken, k)   # the sweep reached both sides of the pointer update


# ---------------------------------------------------------------- downloads: one version per file

def _shard(seed: int) -> bytes:
    """Two shards of the same layout (uncompressed, equal-length documents): a splice of one's head
    to the other's tail reads as a valid parquet file whose texts are neither's."""
    rng = random.Random(seed)
    buf = io.BytesIO()
    pq.write_table(pa.table({"text": ["".join(rng.choices("abcdefgh ", k=4000)) for _ in range(60)]}), buf,
                   compression="none")
    return buf.getvalue()


class _VersionedServer:
    """One file, replaceable, with an ETag; Range supported; `honour_if_range`: send the whole new
    version (200) to an If-Range naming an old one, as RFC 9110 says; else ignore If-Range (206).
    `cut_first`: close the first response halfway (a dropped connection)."""

    def __init__(self, body: bytes, etag: str, *, honour_if_range: bool):
        self.body, self.etag, self.honour, self.cut_first, self.requests = body, etag, honour_if_range, True, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                rng, if_range = self.headers.get("Range"), self.headers.get("If-Range")
                server.requests.append((rng, if_range))
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
                if if_range is not None and if_range != server.etag and server.honour:
                    start = 0
                body = server.body[start:]
                self.send_response(206 if start else 200)
                self.send_header("ETag", server.etag)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(server.body) - 1}/{len(server.body)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if server.cut_first:
                    server.cut_first = False
                    self.wfile.write(body[:len(body) // 2])
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/{ds.shard_name(0)}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("honour_if_range", [True, False], ids=["if-range", "ignores-if-range"])
def test_a_resume_after_the_file_changed_on_the_server_never_splices_the_two(tmp_path, honour_if_range):
    """A first run drops halfway through version A (its .partial kept); the server then holds B (a
    mirror re-synced) and states no sha256. The rerun resumed with a Range request and kept A's head
    on B's tail, a parquet file of texts that are neither's, which passed verification as a shard."""
    old, new = _shard(1), _shard(2)
    assert len(old) == len(new)
    srv = _VersionedServer(old, '"version-a"', honour_if_range=honour_if_range)
    dest = tmp_path / ds.shard_name(0)
    try:
        with pytest.raises(dl.DownloadError):
            dl.download_file(srv.url, dest, retries=0)
        partial = dest.with_name(dest.name + ".partial")
        assert 0 < partial.stat().st_size < len(old) and not dest.exists()
        srv.body, srv.etag = new, '"version-b"'
        dl.download_file(srv.url, dest, retries=1, backoff=0)
    finally:
        srv.close()
    assert dest.read_bytes() == new
    assert srv.requests[1][1] == '"version-a"'   # the resume named the version its bytes are of
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name]   # no .partial, no .version left


def test_a_resume_of_the_same_version_still_resumes(tmp_path):
    body = _shard(3)
    srv = _VersionedServer(body, '"v1"', honour_if_range=True)
    dest = tmp_path / ds.shard_name(0)
    try:
        with pytest.raises(dl.DownloadError):
            dl.download_file(srv.url, dest, retries=0)
        have = dest.with_name(dest.name + ".partial").stat().st_size
        dl.download_file(srv.url, dest, retries=0)
    finally:
        srv.close()
    assert dest.read_bytes() == body
    assert srv.requests[1] == (f"bytes={have}-", '"v1"')
    assert sorted(p.name for p in tmp_path.iterdir()) == [dest.name]


# ---------------------------------------------------------------- text shards: bit rot, power cuts

def test_a_bit_flipped_in_a_written_text_shard_is_named_never_read_as_other_text(tmp_path):
    """Without page checksums most flipped bits in a zstd shard still decoded, as other text (41 of 60
    random flips); now each is a DataError naming the shard, or changes nothing that is read."""
    rng = random.Random(0)
    docs = ["".join(rng.choices("abcdefghij klm\n", k=2000)) for _ in range(400)]
    path = ds.write_text_shards(tmp_path, docs, docs[:5])[0]
    good = path.read_bytes()
    pf = pq.ParquetFile(path)
    data_end = min(pf.metadata.row_group(0).column(0).data_page_offset + pf.metadata.row_group(0).column(0)
                   .total_compressed_size, len(good) - 8)
    detected = 0
    for i in range(40):
        damaged = bytearray(good)
        damaged[rng.randrange(4, data_end)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(damaged))
        try:
            pf = ds.open_text_shard(path)
            texts = [t for rg in range(pf.num_row_groups) for t in ds.read_row_group_texts(pf, rg, path)]
        except DataError as e:
            assert str(path) in str(e)
            detected += 1
            continue
        assert texts == docs, f"flip {i}: the shard read as other text, without an error"
    assert detected >= 30, detected


def test_a_written_text_shard_is_on_disk_before_its_rename(tmp_path, monkeypatch):
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.stat(a).st_ino)), replace(a, b))[1])
    path = tmp_path / ds.shard_name(0)
    ds._write_shard_file(path, pa.table({"text": ["hello", "world"]}))
    inode = path.stat().st_ino
    assert ("fsync", inode) in events[:events.index(("replace", inode))], events
    assert ds.read_row_group_texts(ds.open_text_shard(path), 0, path) == ["hello", "world"]


def test_shards_without_page_checksums_still_read(tmp_path):
    """Downloaded shards and the user's own parquet files carry no CRCs: verification skips them."""
    path = tmp_path / "theirs.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), path)
    assert ds.read_row_group_texts(ds.open_text_shard(path), 0, path) == ["a", "b"]



def test_the_shakespeare_copy_is_on_disk_before_its_rename(tmp_path, tiny_corpus, monkeypatch):
    """The tiny corpus copied from ../shared/data (every tiny run's data) was renamed into place
    without an fsync: after a power cut, an empty shard under a final name."""
    from nanochat import shakespeare
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.stat(a).st_ino)), replace(a, b))[1])
    paths = shakespeare.get_shakespeare(tmp_path / "out", shared_dir=tiny_corpus)
    for path in paths:   # its last rename (a marker file renamed earlier may have had its inode)
        inode = path.stat().st_ino
        last = max(i for i, e in enumerate(events) if e == ("replace", inode))
        assert events[last - 1] == ("fsync", inode), (path, events)


def test_a_full_disk_copying_the_offline_shakespeare_is_named_and_leaves_no_temp(tmp_path, tiny_corpus, monkeypatch):
    """The copy from ../shared/data was a bare shutil.copyfile: a full disk ended in a raw OSError
    traceback and left the partial temp copy on the full disk (session 75 left this). Now it is the
    DiskFullError every other shard write gives, and the temp file is gone."""
    import errno

    from nanochat import shakespeare
    from nanochat.errors import DiskFullError

    def copy_until_full(src, dst):
        Path(dst).write_bytes(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shakespeare.shutil, "copyfile", copy_until_full)
    out = tmp_path / "out"
    with pytest.raises(DiskFullError, match=r"the disk filled while writing shard_00000\.parquet; free space"):
        shakespeare.get_shakespeare(out, shared_dir=tiny_corpus)
    assert not list(out.glob(".*.tmp"))
    with pytest.raises(DataError, match="incomplete"):   # readers refuse the half-made set
        ds.list_shards(out)
