"""Review 3 of pretokenized data and the background launcher, as a demanding user meets them
(scripts/pretokenize.py, nanochat/binshards*.py, run_train.sh): one test per defect found."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat.errors import DataError, DiskFullError, RequestError
from scripts import pretokenize as pt
from tests.test_dataloader import ByteTokenizer, make_docs, write_shards

REPO = Path(__file__).resolve().parents[1]


def quiet(*args):
    pass


@pytest.fixture
def text_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    docs = make_docs(90)
    return write_shards(tmp_path / "data", [docs[:40], docs[40:80], docs[80:]])


def shards_of(d: Path) -> list[Path]:
    return sorted(d.glob("*.parquet"))


def temps(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob(".*.tmp"))


# ---------------------------------------------------------------- one run per directory

def test_a_second_run_into_the_same_out_is_refused_naming_the_first(text_dir, tmp_path):
    """Two runs into one --out both went ahead: each rewrote meta.json over the other's records, and
    one run's strays (another --data-dir's shards) were deleted by the other mid-run."""
    out = tmp_path / "bin"
    out.mkdir()
    holder = subprocess.Popen(   # a run holding it (another process: a process's own record locks never conflict)
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
         "os.write(fd, b'pid 4242 on elsewhere: python -m scripts.pretokenize\\n'); fcntl.lockf(fd, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(out / runs.LOCK_NAME)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RequestError, match=r"--out: .* is being written by another pretokenize run \(pid 4242 "
                                               r"on elsewhere.*pass another --out"):
            pt.main(["--data-dir", str(text_dir), "--out", str(out), "--workers", "1"], tokenizer=ByteTokenizer())
        assert not bs.list_bin_shards(out) and bs.read_meta(out) is None   # refused before anything changed
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert pt.main(["--data-dir", str(text_dir), "--out", str(out), "--workers", "1"], tokenizer=ByteTokenizer()) == 0
    assert "pid " in (out / runs.LOCK_NAME).read_text()   # who holds it, for the next refusal


def test_the_lock_dies_with_the_run_not_with_its_forked_workers(tmp_path):
    """A flock belongs to the open file, which forked pool workers share: after a kill -9 of the
    run, its orphaned workers (busy with their shards) kept the directory locked, and a rerun was
    refused naming the dead run. A record lock is the process's own."""
    out = tmp_path / "bin"
    run = subprocess.run(
        [sys.executable, "-c", "import os, sys, time; from nanochat import binshards_runs as runs\n"
         "with runs.run_lock(sys.argv[1]):\n"
         "    if os.fork() == 0:\n        time.sleep(5); os._exit(0)   # a worker, still busy\n"
         "    os._exit(0)   # the run, killed", str(out)],
        cwd=REPO, timeout=60)
    assert run.returncode == 0
    with runs.run_lock(out):   # the orphan still holds the inherited descriptor
        pass


def test_out_that_is_the_data_dir_is_refused(text_dir):
    """--out DATA_DIR wrote .bin files among the text shards, then advised moving that directory."""
    with pytest.raises(RequestError, match=r"--out: got .*data, the text shard directory \(--data-dir\) itself"):
        pt.main(["--data-dir", str(text_dir), "--out", str(text_dir), "--workers", "1"], tokenizer=ByteTokenizer())
    assert sorted(p.name for p in text_dir.iterdir()) == [p.name for p in shards_of(text_dir)]


# ---------------------------------------------------------------- a full disk, killed workers

class _FullDisk:
    """A file whose writes fail with `code` once `room` bytes are written (a disk filling up)."""

    def __init__(self, f, room: int, code: int):
        self.f, self.room, self.code = f, room, code

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(self.code, os.strerror(self.code))
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("code, said, kind", [
    (errno.ENOSPC, "the disk is full", DiskFullError),
    (errno.EFBIG, "the file system caps a file's size", RequestError),
])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_write_names_the_shard_and_leaves_no_partial_file(text_dir, tmp_path, monkeypatch, code, said,
                                                                   kind, workers):
    """Python's OSError ("[Errno 27] File too large") named no file and came back as a traceback (two,
    from a worker); the shard's temp file is gone, no final-named partial shard is left, the run
    stays unfinished, and a rerun with room finishes it."""
    out = tmp_path / "bin"
    monkeypatch.setattr(bs, "open", lambda path, mode="r": _FullDisk(open(path, mode), 300, code), raising=False)
    with pytest.raises(kind, match=rf"{out}/shard_0000\d\.bin: writing it failed \({os.strerror(code)}\).*{said}.*"
                                   "left as it was \\(no partial file\\), and the binary shards already written are kept: re-run the same command"):
        pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), workers=workers, log=quiet)
    assert not bs.list_bin_shards(out) and not temps(out)
    with pytest.raises(DataError, match="is incomplete"):
        runs.check_complete(out)
    monkeypatch.undo()
    assert len(pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), workers=workers, log=quiet)) == 3


def test_a_failed_meta_write_names_it_and_keeps_the_old_one(text_dir, tmp_path, monkeypatch):
    out = tmp_path / "bin"
    pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), log=quiet)
    before = (out / bs.META_NAME).read_text()
    real = Path.write_text

    def full(self, text, *args, **kwargs):
        if self.name.startswith(f".{bs.META_NAME}."):
            real(self, text[:10])   # a partial temp file, then no room
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, text, *args, **kwargs)
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(DiskFullError, match=rf"{out / bs.META_NAME}: writing it failed .*the disk is full"):
        pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), force=True, log=quiet)
    assert (out / bs.META_NAME).read_text() == before and not temps(out)


class _StopsMidShard(ByteTokenizer):
    """Shard 0's worker writes slowly; shard 1's fails once shard 0's temp file is there, so the pool
    is terminated with a worker mid-shard (Pool.terminate: SIGTERM, no cleanup in the worker)."""

    def encode(self, text, prepend=None, append=None, num_threads=8):
        texts = [text] if isinstance(text, str) else text
        if texts and texts[0].startswith("00000|"):
            time.sleep(30)
        if texts and texts[0].startswith("00040|"):
            deadline = time.time() + 10
            while not list(Path(self.tag).glob(".shard_00000.bin.*.tmp")) and time.time() < deadline:
                time.sleep(0.02)
            raise ValueError("a worker failed")
        return super().encode(text, prepend, append, num_threads)


def test_workers_killed_mid_shard_leave_no_temp_files(text_dir, tmp_path):
    """A worker's error terminated the pool: the other worker's partial shard stayed as a temp file
    (up to a shard's size, on what may be a full disk) until a rerun."""
    out = tmp_path / "bin"
    t0 = time.time()
    with pytest.raises(ValueError, match="a worker failed"):
        pt.pretokenize(shards_of(text_dir), out, _StopsMidShard(str(out)), workers=2, log=quiet)
    # shard 2 may have landed whole meanwhile (the failed worker's next job): the killed one did not
    assert time.time() - t0 < 20 and not temps(out) and not (out / "shard_00000.bin").exists()


DRIVER = """
import sys, time
from nanochat.flags import script_main
from scripts import pretokenize as pt
from tests.test_dataloader import ByteTokenizer

class Slow(ByteTokenizer):
    def encode(self, *args, **kwargs):
        time.sleep(1.0)
        return super().encode(*args, **kwargs)

argv = sys.argv[1:]
script_main("pretokenize", lambda: pt.parse(argv), lambda: pt.main(argv, tokenizer=Slow()))
"""


def test_ctrl_c_with_workers_is_one_line_and_a_rerun_resumes_saying_so(text_dir, tmp_path):
    """Ctrl-C reaches every process of the terminal's group: each worker printed its own
    KeyboardInterrupt traceback under the main process's one line. The rerun says it resumes."""
    out = tmp_path / "bin"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = ["--data-dir", str(text_dir), "--out", str(out), "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *args], cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 30
        while len(temps(out)) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert len(temps(out)) == 2, "both workers writing"
        os.killpg(proc.pid, signal.SIGINT)   # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == -signal.SIGINT and err.strip() == "pretokenize: interrupted", err
    assert not temps(out) and bs.read_meta(out)["complete"] is False
    logged = []
    pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), log=logged.append)
    assert f"resuming the unfinished run in {out}: 0 of 3 binary shards kept, 3 to write" in logged
    runs.check_complete(out, shards_of(text_dir))


def test_force_on_a_nearly_full_disk_counts_the_shards_it_replaces(text_dir, tmp_path, monkeypatch):
    """--force (or re-making changed text shards) replaces each binary shard in place, yet the space
    check asked for the whole set again on top of it: refused on a disk with room for the rewrite."""
    import shutil
    from collections import namedtuple

    out = tmp_path / "bin"
    shards = shards_of(text_dir)
    pt.pretokenize(shards, out, ByteTokenizer(), log=quiet)
    old = {s: (out / bs.bin_name_for(s)).stat().st_size for s in shards}
    monkeypatch.setattr(pt, "planned_bytes", lambda shard, itemsize: old[shard] + 100)   # a close estimate
    free = 3 * 100 + max(old.values()) + 10   # the growth, and one old shard still there while its new one lands
    assert free < sum(old.values()) + 300      # what the check asked for
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9, free))
    assert len(pt.pretokenize(shards, out, ByteTokenizer(), force=True, log=quiet)) == 3
    with pytest.raises(DiskFullError, match=r"3 binary shards need up to"):   # two workers: two old shards in flight
        pt.check_disk(out, shards, 2, workers=2)
    assert pt.check_disk(tmp_path / "fresh", shards, 2, free=10**12) == sum(old.values()) + 300


# ---------------------------------------------------------------- reruns, damage on disk

def test_a_rerun_with_nothing_to_do_keeps_the_directory_finished(text_dir, tmp_path, monkeypatch):
    """Every rerun marked a finished directory unfinished until its end: a training run opening its
    val loader at an evaluation meanwhile was refused ("incomplete") and died."""
    out = tmp_path / "bin"
    pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), log=quiet)
    written, real = [], runs._write_meta_file
    monkeypatch.setattr(runs, "_write_meta_file", lambda d, meta: (written.append(meta.get("complete")), real(d, meta)))
    logged = []
    assert pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), log=logged.append) == []
    assert False not in written and bs.read_meta(out)["complete"] is True
    assert f"{out} is up to date: all 3 binary shards kept" in logged
    runs.check_complete(out, shards_of(text_dir))


def test_verify_names_a_shard_with_a_flipped_token_bit(text_dir, tmp_path, capsys):
    """A bit flipped inside a token (the id still within the vocab) passed every check: header,
    size, offsets, BOS starts, the loader's token range and its resume digest (first and last
    64 KiB only). --verify reads every shard against the sha256 recorded when it was written."""
    out = bs.default_bin_dir(text_dir)
    assert pt.main(["--data-dir", str(text_dir), "--workers", "1"], tokenizer=ByteTokenizer()) == 0
    assert set(bs.read_meta(out)["bin_sha256"]) == {"shard_00000.bin", "shard_00001.bin", "shard_00002.bin"}

    def unwritable(d):   # shards on a read-only mount: --verify writes nothing, so it must not ask for writing
        raise RequestError(f"--out: {d} is not writable")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pt, "check_out_dir", unwritable)
        assert pt.main(["--data-dir", str(text_dir), "--verify"]) == 0
    victim = out / "shard_00001.bin"
    raw = bytearray(victim.read_bytes())
    sh = bs.BinShard(victim)
    at = bs.HEADER_SIZE + 2 * (int(sh.offsets[3]) + 2)   # a letter inside document 3, not its BOS
    del sh
    raw[at] ^= 0x01
    victim.write_bytes(bytes(raw))
    bs.BinShard(victim)   # every structural check passes
    capsys.readouterr()
    with pytest.raises(DataError, match=rf"{out}: 1 of 3 binary shards damaged \(shard_00001.bin: its bytes differ "
                                        rf"from the sha256 recorded .*rm {victim}\) and re-run `python -m "
                                        rf"scripts.pretokenize --data-dir {text_dir} --out {out}`"):
        pt.main(["--data-dir", str(text_dir), "--verify"])
    said = capsys.readouterr().out
    assert "shard_00000.bin: ok" in said and "shard_00001.bin: DAMAGED" in said
    victim.unlink()
    assert [r["shard"] for r in pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), log=quiet)] == \
        ["shard_00001.bin"]
    assert pt.main(["--data-dir", str(text_dir), "--verify"]) == 0
    assert "all 3 binary shards verified" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--verify: got it with --force"):
        pt.parse(["--verify", "--force"])


# ---------------------------------------------------------------- run_train.sh

FAKE_PYTHON = """#!/bin/bash
# stands in for python: passes the flag check ("python -"), then logs a step and sleeps
if [[ "$1" == "-" ]]; then cat > /dev/null; exit 0; fi
echo "step 00001/00010 | loss 9.0"
exec sleep 30
"""


def test_status_of_a_run_that_died_says_so_every_time(tmp_path):
    """A run killed together with its wrapper (kill -9 of its group, a reboot) left no exit code:
    --status said "pid N is gone; removed its stale pid file" once, then only "not running"."""
    fake = tmp_path / "py thon"   # a path with a space
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    base = tmp_path / "base dir"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NANOCHAT_BASE_DIR")}
    env["NANOCHAT_PYTHON"] = str(fake)

    def call(*args):
        return subprocess.run(["bash", str(REPO / "run_train.sh"), "--base-dir", str(base), *args], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=60)
    assert call("--model-tag", "t").returncode == 0
    pid = int((base / "runs" / "t" / "pid").read_text())
    try:
        deadline = time.time() + 10
        while "step 00001" not in (base / "runs" / "t" / "train.log").read_text() and time.time() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(pid, signal.SIGKILL)
    deadline = time.time() + 10
    while Path(f"/proc/{pid}").exists() and time.time() < deadline:
        time.sleep(0.05)
    for _ in range(2):
        st = call("--status", "--model-tag", "t", "--lines", "0")
        assert st.returncode == 3 and "[t] not running (died without an exit code" in st.stdout, st.stdout
        assert "continue with --resume latest" in st.stdout and "last step: step 00001/00010" in st.stdout
    stop = call("--stop", "--model-tag", "t")
    assert stop.returncode == 0 and "is not running" in stop.stdout


def test_help_says_the_exit_codes_and_where_the_log_goes():
    r = subprocess.run(["bash", str(REPO / "run_train.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    assert "Exit codes: 0 started" in r.stdout and "1 a run of that tag is already running" in r.stdout
    assert "3 (--status) not running" in r.stdout and "appended to across starts" in r.stdout


def test_a_rewound_val_loader_reads_the_same_shard_while_pretokenize_tops_up(text_dir, tmp_path):
    """base_train opened a fresh val loader at each evaluation: a pretokenize run adding a shard
    meanwhile first failed it (the directory unfinished), then moved val to the new last shard.
    Its one val loader, rewound per evaluation, reads the shard it listed at start-up."""
    import torch

    from nanochat.dataloader import DataLoader

    out = tmp_path / "bin"
    pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), log=quiet)
    val = DataLoader(ByteTokenizer(), 2, 32, "val", data_dir=text_dir, bin_dir=out, source="bin",
                     repeat=False, prefetch=0)
    first = [x.clone() for x, _ in val]
    assert first and val.source_dir == out
    write_shards(text_dir, [make_docs(90)[:40], make_docs(90)[40:80], make_docs(90)[80:], make_docs(30, seed=7)])
    meta = bs.read_meta(out)
    runs._write_meta_file(out, {**meta, "complete": False})   # a top-up run in progress
    with pytest.raises(DataError):   # what a fresh val loader met
        DataLoader(ByteTokenizer(), 2, 32, "val", data_dir=text_dir, bin_dir=out, source="bin", repeat=False)
    pt.pretokenize(shards_of(text_dir), out, ByteTokenizer(), log=quiet)   # finished: 4 shards, val the 4th
    moved = [x for x, _ in DataLoader(ByteTokenizer(), 2, 32, "val", data_dir=text_dir, bin_dir=out,
                                      source="bin", repeat=False, prefetch=0)]
    assert len(moved) != len(first) or not all(torch.equal(a, b) for a, b in zip(first, moved))
    for _ in range(2):
        val.rewind()
        again = [x for x, _ in val]
        assert len(again) == len(first) and all(torch.equal(a, b) for a, b in zip(first, again))
    val.close()
