"""Scale review 15: failures on one rank or one node of a torchrun launch (CPU, gloo, 2 ranks at most).

* a rank that failed alone after the group formed (a shard of its own unreadable, its own OOM) tore
  the group down in its script's `finally: destroy_runtime(rt)`; the other rank's next collective
  failed at once ("Connection closed by peer"), torchrun ended the job on that traceback and killed
  the failed rank during its SPEAKER_GRACE_S wait: the real error was never printed;
* a rank that stopped before joining (a --device, dtype or GPU count refused on its node) left the
  others inside init_process_group without a word for gloo's 30 minutes (NCCL: its bootstrap's wait);
  nodes running different code, torch, backend or flags started together and failed (or trained on)
  later. Now a roll call on the rendezvous store (nanochat/roll_call.py) raises on every rank: the
  failed rank's own error at once, what differs, or the ranks missing after NANOCHAT_DIST_TIMEOUT;
* no timeout was set or documented: NANOCHAT_DIST_TIMEOUT (default 600 s) now bounds the start, the
  group's collectives and the timed barriers;
* launch_multinode.sh on node 0 with an address that is not node 0's retried the store connection
  with a C++ trace every second for 15 minutes; a name that does not resolve was retried until the
  rendezvous timeout. Both stop before torchrun now (a dry run warns).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from nanochat import roll_call
from nanochat.common import destroy_runtime, init_runtime
from nanochat.distributed import BarrierTimeout, free_port
from nanochat.errors import RequestError

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch_multinode.sh"
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NANOCHAT_DTYPE",
                 "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT",
                 roll_call.TIMEOUT_ENV, roll_call.ALLOW_FLAGS_ENV)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def _one_rank_env(monkeypatch) -> None:
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)


def _torchrun(tmp_path: Path, script: str, env_extra: dict) -> tuple[subprocess.CompletedProcess, float]:
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env_extra}
    for var in set(TORCHRUN_VARS) - set(env_extra):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--monitor-interval=0.1",
           "--master_port", str(free_port()), str(path)]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    return r, time.monotonic() - t0


# ------------------------------------------------------------------ a rank failing alone is heard

def test_destroy_runtime_keeps_the_group_while_an_error_propagates(monkeypatch):
    _one_rank_env(monkeypatch)
    rt = init_runtime("cpu", "fp32", seed=0)
    try:
        with pytest.raises(RuntimeError, match="its own OOM"):
            try:
                raise RuntimeError("its own OOM")
            finally:
                destroy_runtime(rt)   # as base_train / chat_train / chat_rl call it
        assert dist.is_initialized()   # left for the process exit, after the rank said why
    finally:
        destroy_runtime(rt)
    assert not dist.is_initialized()
    rt = init_runtime("cpu", "fp32", seed=0)   # a stop (every rank at the same step) leaves it as an end does
    stop = RuntimeError("stopped by SIGTERM")
    stop.exit_code = 143
    with pytest.raises(RuntimeError, match="SIGTERM"):
        try:
            raise stop
        finally:
            destroy_runtime(rt)
    assert not dist.is_initialized()


FAILS_ALONE = """import sys
import torch, torch.distributed as dist
from nanochat.common import destroy_runtime, init_runtime
from nanochat.errors import RequestError
from nanochat.flags import script_main

def run():
    rt = init_runtime("cpu", "fp32", seed=0)
    try:
        if rt.rank == 1:   # LOCAL_RANK 1: not its node's speaker, so it says its line after SPEAKER_GRACE_S
            raise RequestError("shard_00007.parquet: not a readable parquet file (rank 1's own shard)")
        dist.all_reduce(torch.ones(1))   # rank 0 waits for rank 1 here
    finally:
        destroy_runtime(rt)

script_main("worker", lambda: None, run)
"""


def test_a_rank_that_fails_alone_is_heard_under_torchrun(tmp_path):
    r, _ = _torchrun(tmp_path, FAILS_ALONE, {roll_call.TIMEOUT_ENV: "60"})
    out = r.stdout + r.stderr
    assert r.returncode != 0
    assert "worker: error: shard_00007.parquet: not a readable parquet file" in out, out[-3000:]
    root_cause = out[out.index("Root Cause"):]
    assert "rank      : 1 (local_rank: 1)" in root_cause and "exitcode  : 2" in root_cause, root_cause


# ------------------------------------------------------------------ the roll call at the start

STOPS_BEFORE_JOINING = """import os
from nanochat.common import init_runtime
from nanochat.flags import script_main

# a device this rank's machine does not have (on Linux: mps; on a node, e.g., cuda with its driver
# gone), refused there before the group forms
device = "mps" if os.environ["RANK"] == "1" else "cpu"
script_main("worker", lambda: None, lambda: init_runtime(device, "fp32", seed=0) and None)
"""


def _two_nodes(tmp_path: Path, script: str, env_extra: dict, timeout: float = 60) -> tuple[list[str], float]:
    """`script` under two torchrun launches of one process each, as two nodes (--nnodes 2) on 127.0.0.1;
    returns each node's output and the seconds until both ended (a node left waiting is killed)."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env_extra}
    for var in set(TORCHRUN_VARS) - set(env_extra):
        env.pop(var, None)
    port, t0 = free_port(), time.monotonic()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={n}",
                               "--nproc_per_node=1", "--monitor-interval=0.1", "--master_addr=127.0.0.1",
                               f"--master_port={port}", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=tmp_path, env=env) for n in (0, 1)]
    outs = []
    for node in nodes:
        try:
            outs.append(node.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))[0])
        except subprocess.TimeoutExpired:
            node.kill()
            outs.append(node.communicate()[0] + "\n(killed: still waiting)")
    return outs, time.monotonic() - t0


def test_a_node_whose_rank_stops_before_joining_is_heard_on_the_other_node(tmp_path):
    """Node 1's rank refuses its start. Node 0's agent does not learn of it: its rank waited inside
    init_process_group for gloo's 30 minutes (the test kills it after 60 s). Now it raises rank 1's
    own error at once."""
    (out0, out1), took = _two_nodes(tmp_path, STOPS_BEFORE_JOINING, {roll_call.TIMEOUT_ENV: "120"})
    assert "worker: error: --device mps: the MPS backend is not available" in out1, out1[-2000:]
    assert (f"worker: error: rank 1 (host {socket.gethostname()}) stopped before the process group formed: "
            "--device mps: the MPS backend is not available on this machine") in out0, out0[-3000:]
    assert took < 30, (took, out0[-2000:])


def _facts(**changes) -> dict:
    facts = roll_call.rank_facts("gloo", "float32", env={})
    facts.update(changes)
    return facts


def _both(store_port: int, facts: list[dict], timeout_s: float = 20) -> list:
    """roll_call on ranks 0 and 1 in two threads against one TCPStore; returns each one's exception."""
    got: list = [None, None]

    def rank(r):
        store = dist.TCPStore("127.0.0.1", store_port, 2, False, timedelta(seconds=20))
        try:
            roll_call.roll_call(store, r, 2, facts[r], timeout_s, poll_s=0.01)
        except RequestError as e:
            got[r] = e
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


@pytest.fixture
def store_port():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=20), wait_for_workers=False)
    yield port
    del server


def test_roll_call_names_what_differs_between_the_ranks(store_port):
    same = _facts()
    assert _both(store_port, [same, same]) == [None, None]
    files = dict(same["files"], **{"nanochat/gpt.py": "0" * 16})
    other = _facts(host="spark-1", git="abc1234+dirty", files=files, torch="2.11.0", backend="nccl",
                   argv=same["argv"] + ["--depth", "12"])
    errors = _both(store_port, [same, other])
    assert errors[0] is not None and str(errors[0]) == str(errors[1])   # the same line on every rank
    said = str(errors[0])
    assert "nanochat/gpt.py differ between rank(s) 0" in said and "rank(s) 1 (host spark-1), git abc1234+dirty" in said
    assert "the torch version" in said and "'2.11.0' on rank(s) 1" in said
    assert "process-group backend" in said and "'nccl' on rank(s) 1" in said
    assert "'... --depth 12' on rank(s) 1 (host spark-1)" in said and "'... (nothing)' on rank(s) 0" in said
    # rank 0 allowing different command lines: only the flags may differ
    allowed = _facts(allow_different_flags=True)
    assert _both(store_port, [allowed, dict(allowed, argv=allowed["argv"] + ["--data-dir", "/local1"])]) == [None, None]


def test_roll_call_names_the_ranks_that_never_came(store_port):
    store = dist.TCPStore("127.0.0.1", store_port, 2, False, timedelta(seconds=20))
    t0 = time.monotonic()
    with pytest.raises(RequestError, match=r"rank\(s\) 1 of 2 did not reach the start within 0.5 s "
                                           r"\(NANOCHAT_DIST_TIMEOUT; seen from rank 0") as e:
        roll_call.roll_call(store, 0, 2, _facts(), 0.5, poll_s=0.01)
    assert time.monotonic() - t0 < 5 and "--data-dir missing on that node" in str(e.value)


def test_a_posted_failure_needs_torchruns_store(monkeypatch):
    """Outside torchrun rank 0 hosts the store (and may be the rank that stops): nothing is posted."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert roll_call.post_start_failure("x") is False


# ------------------------------------------------------------------ NANOCHAT_DIST_TIMEOUT

def test_the_dist_timeout_reaches_the_process_group_and_the_barriers(monkeypatch):
    seen = {}
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    _one_rank_env(monkeypatch)
    init_runtime("cpu", "fp32", seed=0)
    assert seen["timeout"] == timedelta(seconds=600)   # gloo's own default was 30 minutes
    _one_rank_env(monkeypatch)
    monkeypatch.setenv("NANOCHAT_DIST_TIMEOUT", "42.5")
    init_runtime("cpu", "fp32", seed=0)
    assert seen["timeout"] == timedelta(seconds=42.5)
    for bad in ("0", "-1", "inf", "10m"):
        monkeypatch.setenv("NANOCHAT_DIST_TIMEOUT", bad)
        with pytest.raises(RequestError, match=f"NANOCHAT_DIST_TIMEOUT: got '{bad}'; accepted: seconds > 0"):
            init_runtime("cpu", "fp32", seed=0)
    # a barrier with no timeout of its own waits NANOCHAT_DIST_TIMEOUT (it was 600 s whatever that said)
    import nanochat.distributed as distributed
    monkeypatch.setenv("NANOCHAT_DIST_TIMEOUT", "0.5")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed, "_default_store", lambda: dist.HashStore())
    box = []
    waiter = threading.Thread(target=lambda: box.append(pytest.raises(BarrierTimeout, distributed.timed_barrier)),
                              daemon=True)
    waiter.start()
    waiter.join(10)
    assert box and "rank(s) [1] of 2 did not arrive" in str(box[0].value), "timed_barrier ignored NANOCHAT_DIST_TIMEOUT"


# ------------------------------------------------------------------ launch_multinode.sh --master-addr

def _launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    net = tmp_path / "fs" / "sys" / "class" / "net" / "eth7"
    net.mkdir(parents=True, exist_ok=True)
    (net / "mtu").write_text("9000\n")
    (net / "operstate").write_text("up\n")
    fake = tmp_path / "python"   # a real python for the script's checks; records a torchrun start instead of one
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-" ]; then exec {sys.executable} "$@"; fi\necho "STARTED $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "NANOCHAT_SYSFS_ROOT": str(tmp_path / "fs"), "IBDEV2NETDEV": "/nonexistent", "PYTHON": str(fake)}
    for var in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)
    return subprocess.run(["bash", str(LAUNCH), "--iface", "eth7", *args], capture_output=True, text=True, env=env,
                          timeout=30)


def test_launch_multinode_checks_the_master_addr_before_starting(tmp_path):
    # 192.0.2.0/24 is TEST-NET-1 (never assigned); .invalid never resolves (RFC 6761)
    r = _launch(tmp_path, "--node-rank", "0", "--master-addr", "192.0.2.123")
    assert r.returncode == 2 and "STARTED" not in r.stdout, r.stdout + r.stderr
    assert "--master-addr: got '192.0.2.123', which is not an address of this node" in r.stderr
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", "spark-0.invalid")
    assert r.returncode == 2 and "STARTED" not in r.stdout, r.stdout + r.stderr
    assert "--master-addr: got 'spark-0.invalid', which does not resolve here" in r.stderr
    # a dry run (maybe prepared on another machine) only warns
    r = _launch(tmp_path, "--node-rank", "0", "--master-addr", "192.0.2.123", "--dry-run")
    assert r.returncode == 0 and "a real launch stops here" in r.stderr and "--master_addr=192.0.2.123" in r.stdout
    # node 0's own address starts torchrun; a loopback one warns that no other node reaches it
    r = _launch(tmp_path, "--node-rank", "0", "--master-addr", "127.0.0.1")
    assert r.returncode == 0 and "STARTED -m torch.distributed.run" in r.stdout, r.stderr
    assert "127.0.0.1 is a loopback address: the other 1 node(s) cannot reach node 0" in r.stderr
    r = _launch(tmp_path, "--node-rank", "0", "--nnodes", "1", "--master-addr", "127.0.0.1")
    assert r.returncode == 0 and "loopback" not in r.stderr, r.stderr


def test_a_refusal_before_the_group_is_left_for_the_other_nodes(monkeypatch, capsys):
    """script_main's error exit under torchrun, before the process group forms (a --data-dir
    missing on this node only), posts its line to the launch's store: the other nodes' roll call
    raised it only after NANOCHAT_DIST_TIMEOUT. Once: not again for init_runtime's own post, nor
    for a stop (exit_code), nor outside torchrun."""
    from nanochat import flags, roll_call
    from nanochat.errors import RequestError

    posted = []
    monkeypatch.setattr(roll_call, "post_start_failure", lambda message, env=None: posted.append(message) or True)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")   # this node's speaker: says it at once
    with pytest.raises(SystemExit):
        flags._exit_with_error("base_train", RequestError("--data-dir: /nope does not exist"))
    assert posted == ["base_train: error: --data-dir: /nope does not exist"]
    again = RequestError("--device cuda: no GPU")
    again.start_failure_posted = True
    stop = RequestError("stopped")
    stop.exit_code = 143
    for error in (again, stop):
        with pytest.raises(SystemExit):
            flags._exit_with_error("base_train", error)
    monkeypatch.delenv("RANK")
    with pytest.raises(SystemExit):
        flags._exit_with_error("base_train", RequestError("bad"))
    assert len(posted) == 1
    capsys.readouterr()


def _plain_facts(argv):
    return {"host": "h", "pid": 1, "files": {"a.py": "x"}, "git": "g", "torch": "t", "backend": "gloo",
            "dtype": "bf16", "argv": argv, "allow_different_flags": False}


def test_a_failed_start_does_not_fail_torchrun_s_restart(monkeypatch):
    """torchrun's store outlives a worker restart (--max-restarts): the failure rank 1 posted in
    attempt 0 (and rank 0's refusal) sat in the slots attempt 1's roll calls took, which failed at
    once with the stale message. Each attempt now has its own keys."""
    import torch.distributed as dist

    from nanochat import roll_call as RC
    from nanochat.errors import RequestError

    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    slot = f"{RC._prefix()}/{store.add(f'{RC._prefix()}/calls/rank1', 0) + 1}"   # as post_start_failure does
    store.set(f"{slot}/failure/rank1", json.dumps({"host": "h1", "message": "transient"}))
    store.add(f"{slot}/failed", 1)
    with pytest.raises(RequestError, match="transient") as e:
        RC.roll_call(store, 0, 2, _plain_facts(["x"]), 5)
    assert e.value.start_failure_posted   # flags._exit_with_error leaves it there: not posted again
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    errors = []

    def rank(r):
        try:
            RC.roll_call(store, r, 2, _plain_facts(["x"]), 5)
        except Exception as exc:   # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert errors == []


def test_rank_0_stays_until_the_others_read_the_verdict(monkeypatch):
    """Outside torchrun rank 0 hosts the store: raising the roll call's refusal at once and exiting
    left rank 1 reading a closed store ("connection closed", a rendezvous error) instead of the
    difference. Rank 0 now waits until every rank that arrived has read (bounded by LINGER_S)."""
    import time

    import torch.distributed as dist

    from nanochat import roll_call as RC
    from nanochat.errors import RequestError

    monkeypatch.setattr(RC, "LINGER_S", 0.6)
    store = dist.HashStore()
    key = f"{RC._prefix()}/1"
    store.set(f"{key}/files1", json.dumps({"a.py": "x"}, sort_keys=True))   # rank 1 arrived, has not read yet
    code = __import__("hashlib").sha256(json.dumps({"a.py": "x"}, sort_keys=True).encode()).hexdigest()
    store.set(f"{key}/rank1", json.dumps({**{k: v for k, v in _plain_facts(["--depth", "12"]).items() if k != "files"},
                                           "code": code}))
    store.add(f"{key}/count", 1)
    t0 = time.monotonic()
    with pytest.raises(RequestError, match="command line"):
        RC.roll_call(store, 0, 2, _plain_facts(["--depth", "20"]), 5)
    assert time.monotonic() - t0 >= 0.5          # waited for rank 1's read
    store.add(f"{key}/read", 1)                  # rank 1 reads and leaves
    assert store.add(f"{key}/read", 0) == 2
