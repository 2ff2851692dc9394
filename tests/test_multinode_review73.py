"""Multi-node launch review (session 73).

* launch_multinode.sh warned "--master-addr X is a loopback address: the other node(s) cannot reach
  node 0 there" on node 0 for `--master-addr $(hostname)`, because Debian and Ubuntu map a machine's
  own name to 127.0.1.1 in /etc/hosts; the other nodes resolve that name through their own hosts
  file and DNS, and node 0's rendezvous store listens on every interface, so node 0 is fine with it.
  Now: an address that is loopback on every node (127.x, ::1, localhost) warns on every node (a node
  other than node 0 said nothing at all and waited out torchrun's 600 s); a name that is loopback
  only here gets an accurate note on node 0 and a warning on the other nodes.
* the roll call hashed every .py file under nanochat/ and scripts/, untracked ones included: a
  scratch file or an editor's lock file (emacs' ".#gpt.py", a dangling link) on one node refused a
  launch whose code was the same. Now every file Python could import, on every node.
* NANOCHAT_DIST_TIMEOUT, documented to bound the start, never reached torchrun's own wait for the
  nodes (its static rendezvous: 600 s): the launcher now passes it as --rdzv_conf timeout=N, and
  refuses a malformed value before torchrun.
* a node other than node 0 given its own address waited 600 s for a store on itself, silently.
* setup_gpus.sh counted every CUDA_VISIBLE_DEVICES entry, where CUDA stops at the first invalid one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from nanochat import roll_call

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch_multinode.sh"

# The launcher's address check runs `$PYTHON - ADDR NODE` with the check on stdin. This shim runs it
# with getaddrinfo answering for two made-up names as a node's own /etc/hosts would, so no test
# depends on this machine's hosts file: spark-0 -> 127.0.1.1 (the Debian/Ubuntu own-name line).
SHIM = """
import socket, sys
real = socket.getaddrinfo
def fake(host, *args, **kwargs):
    return real({"spark-0": "127.0.1.1"}.get(host, host), *args, **kwargs)
socket.getaddrinfo = fake
exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
"""


def _launch(tmp_path: Path, *args: str, script: Path = LAUNCH, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    net = tmp_path / "fs" / "sys" / "class" / "net" / "eth7"
    net.mkdir(parents=True, exist_ok=True)
    (net / "mtu").write_text("9000\n")
    (net / "operstate").write_text("up\n")
    shim = tmp_path / "shim.py"
    shim.write_text(SHIM)
    fake = tmp_path / "python"   # the address check runs for real; torchrun's start is only recorded
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-" ]; then shift; exec {sys.executable} {shim} "$@"; fi\n'
                    'echo "STARTED $*"\n')
    fake.chmod(0o755)
    env = {**os.environ, "NANOCHAT_SYSFS_ROOT": str(tmp_path / "fs"), "IBDEV2NETDEV": "/nonexistent",
           "PYTHON": str(fake), **(extra_env or {})}
    for var in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NANOCHAT_DIST_TIMEOUT"):
        if var not in (extra_env or {}):
            env.pop(var, None)
    return subprocess.run(["bash", str(script), "--iface", "eth7", *args], capture_output=True, text=True,
                          env=env, timeout=30)


def test_own_hostname_on_node_0_is_a_note_not_a_loopback_warning(tmp_path):
    r = _launch(tmp_path, "--node-rank", "0", "--master-addr", "spark-0")
    assert r.returncode == 0 and "STARTED -m torch.distributed.run" in r.stdout, r.stderr
    assert "WARNING: --master-addr" not in r.stderr, r.stderr
    assert "note: --master-addr spark-0 resolves to 127.0.1.1 (loopback) on this node" in r.stderr
    assert "each other node resolves 'spark-0' itself" in r.stderr
    # one node: nobody else needs to reach it
    r = _launch(tmp_path, "--node-rank", "0", "--nnodes", "1", "--master-addr", "spark-0")
    assert r.returncode == 0 and "loopback" not in r.stderr, r.stderr


def test_a_node_that_would_look_for_node_0_on_itself_is_warned(tmp_path):
    # a name this node resolves to loopback: torchrun would wait 600 s for a store on itself
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", "spark-0")
    assert r.returncode == 0 and "STARTED" in r.stdout, r.stderr
    assert "WARNING: --master-addr spark-0 resolves to 127.0.1.1, a loopback address, on this node" in r.stderr
    assert "node 1 looks for node 0 on itself" in r.stderr
    # loopback on every node: node 0 warns as before, the other nodes now too
    for addr in ("127.0.0.1", "localhost"):
        r = _launch(tmp_path, "--node-rank", "1", "--master-addr", addr)
        assert f"WARNING: --master-addr {addr} is a loopback address: node 1 looks for node 0 on itself" in r.stderr
        r = _launch(tmp_path, "--node-rank", "0", "--master-addr", addr)
        assert f"{addr} is a loopback address: the other 1 node(s) cannot reach node 0 there" in r.stderr, r.stderr
    # a name that resolves to a real address elsewhere says nothing about loopback
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", "192.0.2.123")
    assert r.returncode == 0 and "loopback" not in r.stderr, r.stderr


# ------------------------------------------------------------------ roll call: the files hashed

def _git(repo: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, env=env, timeout=30)


def _checkout(root: Path) -> Path:
    for rel, text in {"nanochat/gpt.py": "x = 1\n", "nanochat/tasks/arc.py": "y = 2\n",
                      "scripts/base_train.py": "z = 3\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_roll_call_hashes_the_same_files_in_a_checkout_and_a_copy_without_git(tmp_path, monkeypatch):
    """One rule on every node: a git checkout with an untracked module and its rsync'd copy without
    .git give the same files (hashing git's tracked files on one node and all on the other refused
    identical trees, and let an untracked imported module differ unseen)."""
    repo = _checkout(tmp_path / "repo")
    _git(repo, "init", "-q")
    _git(repo, "add", "nanochat", "scripts")
    (repo / "nanochat" / "new_mod.py").write_text("v = 1\n")   # untracked, imported by the code
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    monkeypatch.setattr(roll_call, "_REPO", repo)
    in_repo = roll_call._source_hashes()
    monkeypatch.setattr(roll_call, "_REPO", copy)
    assert roll_call._source_hashes() == in_repo
    assert "nanochat/new_mod.py" in in_repo
    (copy / "nanochat" / "new_mod.py").write_text("v = 2\n")   # another version of it on that node: seen
    assert roll_call._source_hashes()["nanochat/new_mod.py"] != in_repo["nanochat/new_mod.py"]


def test_roll_call_hashes_every_importable_file(tmp_path, monkeypatch):
    repo = _checkout(tmp_path / "copy")   # e.g. rsync'd without .git
    (repo / "nanochat" / "extra.py").write_text("w = 4\n")
    os.symlink("user@spark-1.4242:1700000000", repo / "nanochat" / ".#gpt.py")   # emacs' lock: dangling
    (repo / "nanochat" / "gpt.orig.py").write_text("x = 0\n")
    monkeypatch.setattr(roll_call, "_REPO", repo)
    assert sorted(roll_call._source_hashes()) == ["nanochat/extra.py", "nanochat/gpt.py", "nanochat/tasks/arc.py",
                                                  "scripts/base_train.py"]


def _roll_call_of(tmp_path, monkeypatch, extra: dict[str, str]) -> None:
    """The roll call of two nodes with the same checkout, node 1 with `extra` files besides."""
    from concurrent.futures import ThreadPoolExecutor

    from nanochat.distributed import free_port
    facts = []
    for node in ("node0", "node1"):
        repo = _checkout(tmp_path / node)
        for rel, text in (extra if node == "node1" else {}).items():
            (repo / rel).write_text(text)
        monkeypatch.setattr(roll_call, "_REPO", repo)
        facts.append({"host": node, "pid": 1, "files": roll_call._source_hashes(), "git": None, "torch": "2.9",
                      "backend": "gloo", "dtype": "n/a", "argv": ["base_train.py"], "allow_different_flags": False})
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=20), wait_for_workers=False)

    def rank(r):
        store = server if r == 0 else dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=20))
        roll_call.roll_call(store, r, 2, facts[r], 10.0, poll_s=0.01)

    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(rank, r) for r in (0, 1)]:
            done.result(timeout=30)


def test_an_editor_backup_on_one_node_does_not_fail_the_roll_call(tmp_path, monkeypatch):
    _roll_call_of(tmp_path, monkeypatch, {"scripts/base_train.py~": "z = 0\n", "nanochat/gpt.orig.py": "x = 0\n"})


def test_a_module_on_one_node_only_fails_the_roll_call_naming_it(tmp_path, monkeypatch):
    with pytest.raises(roll_call.RequestError, match="scripts/scratch.py"):
        _roll_call_of(tmp_path, monkeypatch, {"scripts/scratch.py": "import torch\n"})


# ------------------------------------------------------------------ NANOCHAT_DIST_TIMEOUT and torchrun's wait

def test_dist_timeout_bounds_torchruns_wait_for_the_nodes(tmp_path):
    """torchrun's static rendezvous waited its own 600 s for a node that never came, whatever
    NANOCHAT_DIST_TIMEOUT said: node 0 now gives up after that many seconds (here 1)."""
    from nanochat.distributed import free_port
    worker = tmp_path / "worker.py"
    worker.write_text("print('never runs: node 1 never comes')\n")
    net = tmp_path / "fs" / "sys" / "class" / "net" / "eth7"
    net.mkdir(parents=True)
    (net / "mtu").write_text("9000\n")
    (net / "operstate").write_text("up\n")
    env = {**os.environ, "NANOCHAT_SYSFS_ROOT": str(tmp_path / "fs"), "IBDEV2NETDEV": "/nonexistent",
           "PYTHON": sys.executable, "NANOCHAT_DIST_TIMEOUT": "1"}
    for var in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)
    try:
        r = subprocess.run(["bash", str(LAUNCH), "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                            str(free_port()), "--iface", "eth7", "--", str(worker)], capture_output=True, text=True,
                           env=env, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("node 0 still waited for node 1 after 60 s with NANOCHAT_DIST_TIMEOUT=1")
    assert r.returncode != 0 and "never runs" not in r.stdout, r.stdout + r.stderr
    assert "waiting for clients. 1/2 clients joined" in r.stderr, r.stderr[-2000:]
    assert "torchrun gives up after 1 s, NANOCHAT_DIST_TIMEOUT" in r.stderr


def test_dist_timeout_is_read_before_torchrun(tmp_path):
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", "10.0.0.1", "--dry-run",
                extra_env={"NANOCHAT_DIST_TIMEOUT": "1800.5"})
    assert r.returncode == 0 and "--rdzv_conf=timeout=1801" in r.stdout.split(), r.stdout + r.stderr
    assert "export NANOCHAT_DIST_TIMEOUT=1800.5" in r.stdout.splitlines()
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", "10.0.0.1", extra_env={"NANOCHAT_DIST_TIMEOUT": "10m"})
    assert r.returncode == 2 and "STARTED" not in r.stdout, r.stdout + r.stderr
    assert "launch_multinode: error: NANOCHAT_DIST_TIMEOUT: got '10m'; accepted: seconds > 0" in r.stderr, r.stderr
    # unset: torchrun's own default (600 s), as the usage says
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", "10.0.0.1", "--dry-run")
    assert r.returncode == 0 and "rdzv" not in r.stdout, r.stdout


def _own_address() -> str | None:
    """A non-loopback IPv4 address of this machine (the source of its default route), or None."""
    import socket
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))   # UDP: picks the route's source address, sends nothing
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_a_node_given_its_own_address_is_warned(tmp_path):
    """Node 1 given its own address (each node's own IP pasted in) waited 600 s for a store on itself."""
    addr = _own_address()
    if addr is None:
        pytest.skip("no non-loopback address on this machine")
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", addr)
    assert r.returncode == 0 and "STARTED" in r.stdout, r.stderr
    assert (f"WARNING: --master-addr {addr} is an address of this node ({addr}), but --node-rank 1 is not node 0"
            in r.stderr), r.stderr
    r = _launch(tmp_path, "--node-rank", "0", "--master-addr", addr)   # node 0's own address: as it should be
    assert r.returncode == 0 and "WARNING: --master-addr" not in r.stderr and "note:" not in r.stderr, r.stderr


# ------------------------------------------------------------------ setup_gpus.sh: the GPUs CUDA shows

@pytest.mark.parametrize("visible, count", [("0,1", 2), (" 1 , 0 ", 2), ("0,1,", 2), ("0,1,2,3", 2),
                                            ("0,-1,1", 1), ("0,5,1", 1), ("1,,0", 1), ("GPU-ab,GPU-cd", 2),
                                            ("0,0", 0), ("1,0,1", 0), ("0,00", 0), ("GPU-ab,GPU-ab", 0),
                                            ("0,5,0", 0), ("0,5,1,1", 0), ("1,-1,1", 1)])
def test_visible_gpu_count_stops_where_cuda_stops(visible, count):
    """CUDA (and torch's parser) read CUDA_VISIBLE_DEVICES up to the first invalid entry; "0,-1,1"
    counted 2, and setup.sh advised --nproc 2 on a machine where CUDA showed one GPU."""
    script = REPO / "scripts" / "setup_gpus.sh"
    r = subprocess.run(["bash", "-c", f'set -euo pipefail; GPU_COUNT=2; warn() {{ :; }}; die() {{ :; }}; '
                                      f'source "{script}"; visible_gpu_count'],
                       capture_output=True, text=True, timeout=30, env={**os.environ, "CUDA_VISIBLE_DEVICES": visible})
    assert r.returncode == 0 and r.stdout.strip() == str(count), (visible, r.stdout, r.stderr)
