"""run_train.sh through bash, with real scripts.base_train runs (depth 1, CPU, the tiny corpus):
start in the background, refuse a duplicate on the same tag, --status, --stop (SIGTERM then
SIGKILL after --timeout; under torchrun, its workers), stale pid files, a run that finishes by
itself, and bad flags."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_train.sh"
TINY = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "4", "--total-batch-size", "256", "--window-pattern", "L", "--eval-every", "-1",
        "--sample-every", "-1", "--eval-tokens", "256", "--no-compile"]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_corpus):
    """A base dir with a vocab-512 tokenizer trained on the tiny corpus."""
    from nanochat.tokenizer import Tokenizer, tokenizer_dir
    d = tmp_path_factory.mktemp("run_train_base")
    texts = pq.read_table(tiny_corpus / "shard_00000.parquet", columns=["text"]).column("text").to_pylist()
    Tokenizer.train(texts, 512).save(tokenizer_dir(d))
    return d


@pytest.fixture
def run(base_dir, tiny_corpus):
    """run(*args) -> CompletedProcess of run_train.sh; every run started here is stopped at teardown:
    by --stop, then SIGKILL to whatever of it is left (its process group and torchrun's workers, which
    lead sessions of their own), so a failed test leaves no run training (or stopped) behind."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["NANOCHAT_BASE_DIR"] = str(base_dir)
    started = {}   # tag -> pid of the run's wrapper (its process group's leader)

    def call(*args, timeout=120):
        out = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=timeout)
        if "--model-tag" in args and "--status" not in args and "--stop" not in args:
            pid_file = base_dir / "runs" / args[args.index("--model-tag") + 1] / "pid"
            if out.returncode == 0 and pid_file.exists():
                started[pid_file.parent.name] = int(pid_file.read_text())
        return out
    call.data = ["--data-dir", str(tiny_corpus)]
    yield call
    for tag, pid in started.items():
        workers = _session_leaders_below(pid) if _alive(pid) else []
        if (base_dir / "runs" / tag / "pid").exists():
            call("--stop", "--model-tag", tag, "--timeout", "5")
        for p in (pid, *workers):
            if _alive(p):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p, signal.SIGKILL)


def _pid(base_dir: Path, tag: str) -> int:
    return int((base_dir / "runs" / tag / "pid").read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_start_duplicate_status_stop(run, base_dir):
    tag = "bg"
    log = base_dir / "runs" / tag / "train.log"
    r = run(*TINY, *run.data, "--num-iterations", "100000", "--model-tag", tag)
    assert r.returncode == 0, r.stderr
    assert f"[{tag}] started pid" in r.stdout
    pid = _pid(base_dir, tag)
    assert _alive(pid)
    assert "scripts.base_train" in (base_dir / "runs" / tag / "cmd").read_text()
    # real training: step lines reach the log
    _wait_for(lambda: re.search(r"^step 0*3/", log.read_text(), re.M), 180, "step 3 in the log")

    dup = run(*TINY, *run.data, "--num-iterations", "5", "--model-tag", tag)
    assert dup.returncode == 1 and "already running" in dup.stderr and str(pid) in dup.stderr
    assert _pid(base_dir, tag) == pid and _alive(pid)

    st = run("--status", "--model-tag", tag, "--lines", "3")
    assert st.returncode == 0, st.stdout + st.stderr
    assert f"[{tag}] running (pid {pid})" in st.stdout
    m = re.search(r"last step: step (\d+)/100000", st.stdout)
    assert m and int(m.group(1)) >= 3, st.stdout
    assert "last 3 log lines" in st.stdout
    # without a tag: every run is listed
    assert f"[{tag}] running" in run("--status").stdout

    stop = run("--stop", "--model-tag", tag, "--timeout", "20")
    assert stop.returncode == 0, stop.stderr
    assert "stopped" in stop.stdout
    assert not _alive(pid) and not (base_dir / "runs" / tag / "pid").exists()
    st = run("--status", "--model-tag", tag)
    assert st.returncode == 3 and "not running (stopped by --stop, exit code 143; continue with --resume latest)" \
        in st.stdout, st.stdout
    assert "stopped by run_train.sh --stop" in log.read_text()
    # SIGTERM stopped it gracefully: the step finished, a checkpoint was saved at the next step index
    text = log.read_text()
    m = re.search(r"^base_train: error: stopped by SIGTERM at step (\d+) of 100000: checkpoint (\S+) saved; "
                  r"continue with --resume latest", text, re.M)
    assert m, text[-3000:]
    assert f"received SIGTERM: saving a checkpoint at step {m.group(1)} and stopping" in text
    assert Path(m.group(2)) == base_dir / "checkpoints" / "base" / tag / f"step_{int(m.group(1)):06d}"
    assert (Path(m.group(2)) / "model.pt").is_file()


def test_stop_escalates_to_sigkill(run, base_dir):
    """A run that ignores SIGTERM is killed after --timeout."""
    tag = "stubborn"
    r = run(*TINY, *run.data, "--num-iterations", "100000", "--model-tag", tag)
    assert r.returncode == 0, r.stderr
    pid = _pid(base_dir, tag)
    log = base_dir / "runs" / tag / "train.log"
    _wait_for(lambda: re.search(r"^step 0*1/", log.read_text(), re.M), 180, "step 1 in the log")
    # make the whole process group ignore SIGTERM: stop it (SIGSTOP holds signals pending; a
    # stopped process does not act on SIGTERM until continued, so only SIGKILL ends it)
    os.killpg(pid, signal.SIGSTOP)
    t0 = time.time()
    stop = run("--stop", "--model-tag", tag, "--timeout", "1")
    assert stop.returncode == 0, stop.stderr
    assert "SIGKILL" in stop.stdout and time.time() - t0 >= 1
    assert not _alive(pid)


def _session_leaders_below(pid: int) -> list[int]:
    """Processes below pid that lead a session of their own: torchrun's workers."""
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(fields[1]), int(fields[3]))   # ppid, session id
    below, todo = [], [pid]
    while todo:
        parent = todo.pop()
        children = [p for p, (ppid, _) in stats.items() if ppid == parent]
        below += children
        todo += children
    return sorted(p for p in below if stats[p][1] == p)


TORCHRUN = ["--nproc", "2", *TINY, "--total-batch-size", "512", "--eval-tokens", "512"]   # 2 ranks x 4 x 64 tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_stop_under_torchrun(run, base_dir, device):
    """--nproc 2: --stop sends SIGTERM to torchrun's workers themselves (not to torchrun, which
    would SIGKILL them 30 s later by default); both ranks save at the same step and exit, and
    torchrun ends by itself. The loop's first lines say how long torchrun would wait. On CUDA
    (2 GPUs, NCCL) the ranks agree on the stop step through an NCCL all-reduce."""
    if device == "cuda" and __import__("torch").cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    tag = f"tr_{device}"
    log = base_dir / "runs" / tag / "train.log"
    args = [a if a != "cpu" else device for a in TORCHRUN]
    r = run(*args, *run.data, "--num-iterations", "100000", "--model-tag", tag)
    assert r.returncode == 0, r.stderr
    pid = _pid(base_dir, tag)
    _wait_for(lambda: re.search(r"^step 0*3/", log.read_text(), re.M), 240, "step 3 in the log")
    workers = _session_leaders_below(pid)
    assert len(workers) == 2, workers
    stop = run("--stop", "--model-tag", tag, "--timeout", "120")
    assert stop.returncode == 0, stop.stderr
    assert f"sending SIGTERM to the 2 torchrun workers ({' '.join(map(str, workers))})" in stop.stdout
    assert not _alive(pid) and not any(_alive(w) for w in workers)
    text = log.read_text()
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig
    if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:   # torch with pytorch#172596
        said = ("stop signals: torchrun SIGKILLs the workers 3600 s after passing one on "
                "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT)")
    else:   # e.g. torch 2.11: torchrun's 30 s are fixed, so --stop signalling the workers is what helps
        said = "stop signals: torchrun SIGKILLs the workers 30 s after passing one on (fixed in torch"
    assert said in text
    m = re.search(r"base_train: error: stopped by SIGTERM at step (\d+) of 100000: checkpoint (\S+) saved", text)
    assert m, text[-3000:]
    assert text.count("base_train: error: stopped by SIGTERM") == 1   # said once, by rank 0
    assert "death signal" not in text           # torchrun itself was never signalled
    # torchrun's own exit code after its workers stopped on SIGTERM is 1: --status says stopped
    assert "not running (stopped by --stop, exit code " in run("--status", "--model-tag", tag).stdout
    names = {f.name for f in Path(m.group(2)).iterdir()}
    assert {"model.pt", "optim_rank0.pt", "optim_rank1.pt", "state_rank0.pt", "state_rank1.pt"} <= names


def test_sigkill_reaches_torchrun_workers(run, base_dir):
    """A torchrun run whose workers do not stop is SIGKILLed after --timeout, workers included:
    they lead sessions of their own, outside the run's process group, and would otherwise be
    orphans holding their GPUs."""
    tag = "tr_stuck"
    r = run(*TORCHRUN, *run.data, "--num-iterations", "100000", "--model-tag", tag)
    assert r.returncode == 0, r.stderr
    pid = _pid(base_dir, tag)
    workers = []

    def started():
        workers[:] = _session_leaders_below(pid)
        return len(workers) == 2
    _wait_for(started, 120, "torchrun's 2 workers")
    for w in workers:
        os.kill(w, signal.SIGSTOP)              # signals stay pending: only SIGKILL ends them
    stop = run("--stop", "--model-tag", tag, "--timeout", "1")
    assert stop.returncode == 0, stop.stderr
    assert "SIGKILL" in stop.stdout
    _wait_for(lambda: not any(_alive(w) for w in workers) and not _alive(pid), 10, "every process to end")


def test_stale_pid_and_finished_run(run, base_dir):
    tag = "stale"
    d = base_dir / "runs" / tag
    d.mkdir(parents=True)
    p = subprocess.Popen(["true"])
    p.wait()
    (d / "pid").write_text(f"{p.pid}\n")   # a process that is gone
    st = run("--status", "--model-tag", tag)
    assert st.returncode == 3 and "stale pid file" in st.stdout and not (d / "pid").exists()

    (d / "pid").write_text(f"{p.pid}\n")
    r = run(*TINY, *run.data, "--num-iterations", "3", "--model-tag", tag)
    assert r.returncode == 0, r.stderr
    assert "removing the stale pid file" in r.stdout
    pid = _pid(base_dir, tag)
    _wait_for(lambda: (d / "exit_code").exists(), 180, "the short run to finish")
    assert (d / "exit_code").read_text().strip() == "0"
    # the wrapper writes exit_code, then logs one line and exits: allow it that moment
    _wait_for(lambda: not _alive(pid), 10, "the wrapper to exit after writing exit_code")
    st = run("--status", "--model-tag", tag)
    assert st.returncode == 3
    assert "finished, exit code 0" in st.stdout and "last step: step 00002/00003" in st.stdout
    stop = run("--stop", "--model-tag", tag)
    assert stop.returncode == 0 and "not running" in stop.stdout


@pytest.mark.parametrize("args, flag", [
    (["--kernel", "cudnn"], "--kernel"),                 # base_train's own validation, before nohup
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "2", *TINY, "--eval-tokens", "100"], "--eval-tokens"),   # less than one micro-batch, 4 x 64
    (["--nproc", "2", *TINY, "--eval-tokens", "512"], "--total-batch-size"),   # the same for the batch
    (["--fsdp"], "--fsdp"),                              # needs torchrun: --nproc 2
    (["--stop", "--timeout", "soon"], "--timeout"),
    (["--status", "--lines", "-1"], "--lines"),
    (["--status", "--depth", "4"], "--status"),
    (["--model-tag", "a/b"], "--model-tag"),
])
def test_bad_flags_fail_before_starting(run, base_dir, args, flag):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert flag in r.stderr and "Traceback" not in r.stderr
    for tag in ("d0", "d20", "a"):   # nothing was started (no run dir, no pid file)
        assert not (base_dir / "runs" / tag / "pid").exists()


def test_help():
    r = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "--status" in r.stdout and "--stop" in r.stdout and "nohup" in r.stdout


FAKE_PYTHON = """#!/bin/bash
# stands in for python: passes the flag check ("python -"), then logs a step and {what}
if [[ "$1" == "-" ]]; then cat > /dev/null; exit 0; fi
echo "step 00001/00010 | loss 9.0"
{action}
"""


def test_status_says_a_crash_failed_and_shows_only_the_latest_starts_steps(tmp_path):
    """A run that ends with a non-zero code is "failed" (not "finished"), 137 hints at memory; after
    a restart, "last step" is the new run's (none yet), not the crashed one's from the same log."""
    fake = tmp_path / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["NANOCHAT_PYTHON"] = str(fake)

    def call(*args):
        return subprocess.run(["bash", str(SCRIPT), "--base-dir", str(tmp_path / "base"), *args], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=60)
    d = tmp_path / "base" / "runs" / "t"
    for n, (code, said) in enumerate(((1, "failed, exit code 1: see the log"), (137, "killed by SIGKILL, exit code 137: out of memory?"),
                       (0, "finished, exit code 0"))):
        fake.write_text(FAKE_PYTHON.format(what="exits", action=f"exit {code}"))
        fake.chmod(0o755)
        assert call("--model-tag", "t").returncode == 0
        _wait_for(lambda: (d / "train.log").read_text().count("==> exited with code") == n + 1, 20, "the run to end")
        st = call("--status", "--model-tag", "t")
        assert st.returncode == 3 and f"[t] not running ({said}" in st.stdout, st.stdout
        assert "last step: step 00001/00010" in st.stdout
    fake.write_text(FAKE_PYTHON.format(what="hangs", action="echo loading; exec sleep 60").replace(
        'echo "step 00001/00010 | loss 9.0"\n', ""))
    assert call("--model-tag", "t").returncode == 0
    try:
        _wait_for(lambda: "loading" in (d / "train.log").read_text(), 20, "the new run's first line")
        st = call("--status", "--model-tag", "t")
        assert st.returncode == 0 and "[t] running (pid" in st.stdout and "last step: none yet" in st.stdout, st.stdout
    finally:
        call("--stop", "--model-tag", "t", "--timeout", "5")
