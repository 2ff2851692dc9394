"""Defects found by the multi-GPU / multi-node review (CPU, gloo):

* `check_shared_dir`: two nodes whose checkpoint directories are not one shared directory trained
  until the first save (by default the last) and then died with a bare FileNotFoundError on the
  other node's rank; the check names the ranks that do not see rank 0's directory, on every rank;
* run_train.sh validated the flags but not the device for --nproc processes: `--nproc 8 --device
  cuda` on a box with fewer GPUs (or none), or --device mps, started torchrun in the background
  and left N copies of the same error in the log;
* scripts/launch_multinode.sh read a leading zero as octal in its checks ("--master-port 08" gave
  a bash arithmetic error, "--nnodes 010" was checked as 8 while torchrun runs 10); an exported
  NCCL_IB_HCA / NCCL_SOCKET_IFNAME was replaced by the detected values, or passed on unchecked
  while the dry run said "HCAs none"; a started node waited silently for a missing one."""

from __future__ import annotations

import json
import os
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from nanochat.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch_multinode.sh"
RUN_TRAIN = REPO / "run_train.sh"


# ------------------------------------------------------------------------------------ shared dir

def _shared_dir_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from nanochat.distributed import check_shared_dir
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    result = {}
    try:
        check_shared_dir(Path(out, "shared"))            # one directory: passes
        result["shared"] = "ok"
        try:                                              # a directory of each rank's own ("node")
            check_shared_dir(Path(out, f"node{rank}", "ckpt"), timeout_s=30)
            result["own"] = "ok"
        except ValueError as e:
            result["own"] = str(e)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_check_shared_dir_names_the_ranks_that_do_not_see_it(tmp_path):
    mp.spawn(_shared_dir_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["shared"] == r1["shared"] == "ok"
    assert list((tmp_path / "shared").iterdir()) == []    # the marker is gone
    for rank, r in enumerate((r0, r1)):   # every rank raises (none is left waiting at the next collective)
        assert "rank(s) [1] of 2" in r["own"] and str(tmp_path / f"node{rank}" / "ckpt") in r["own"], r
        assert "shared by all of them" in r["own"]


def test_check_shared_dir_without_a_group_is_a_no_op(tmp_path):
    from nanochat.distributed import check_shared_dir
    check_shared_dir(tmp_path / "x")
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------------------------ run_train.sh

def _fake_gpus(tmp_path: Path, count: int) -> dict:
    """An environment whose Python sees `count` CUDA devices (sitecustomize patches torch.cuda)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import torch\n"
        f"torch.cuda.is_available = lambda: {count > 0}\n"
        f"torch.cuda.device_count = lambda: {count}\n")
    return {"PYTHONPATH": str(site)}


@pytest.mark.parametrize("gpus, args, said", [
    (2, ["--nproc", "4", "--device", "cuda"], "--nproc: got 4 with 2 GPU(s) visible; accepted: 1..2"),
    (2, ["--nproc", "3"], "--nproc: got 3 with 2 GPU(s) visible"),            # --device auto -> cuda
    (0, ["--nproc", "2", "--device", "cuda"], "--device cuda: no CUDA device is visible"),
    (0, ["--nproc", "2", "--device", "mps"], "--device mps"),
])
def test_run_train_checks_the_device_for_nproc_before_starting(tmp_path, gpus, args, said):
    base = tmp_path / "base"
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base), **_fake_gpus(tmp_path, gpus)}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    r = subprocess.run(["bash", str(RUN_TRAIN), *args, "--depth", "2", "--model-tag", "rv"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and said in r.stderr, r.stdout + r.stderr
    assert not (base / "runs").exists()      # nothing started


# ------------------------------------------------------------------------------------ launch_multinode.sh

def _sysfs(root: Path) -> Path:
    for iface in ("eth7", "enp1s0f1np1"):
        net = root / "sys" / "class" / "net" / iface
        net.mkdir(parents=True)
        (net / "mtu").write_text("9000\n")
        (net / "operstate").write_text("up\n")
    ib = root / "sys" / "class" / "infiniband" / "rocep1s0f1" / "device" / "net" / "enp1s0f1np1"
    ib.mkdir(parents=True)
    return root


def _launch(tmp_path, *args, env_extra=None, dry_run=True):
    env = {**os.environ, "NANOCHAT_SYSFS_ROOT": str(_sysfs(tmp_path / "fs")), "IBDEV2NETDEV": "/nonexistent",
           "PYTHON": "python3", **(env_extra or {})}
    for var in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"):
        if var not in (env_extra or {}):
            env.pop(var, None)
    return subprocess.run(["bash", str(LAUNCH), *args, *(["--dry-run"] if dry_run else [])], capture_output=True,
                          text=True, env=env, timeout=30)


def test_launch_multinode_reads_leading_zeros_as_decimal(tmp_path):
    r = _launch(tmp_path, "--node-rank", "09", "--nnodes", "010", "--nproc", "02", "--master-port", "08",
                "--master-addr", "10.0.0.1", "--iface", "eth7")
    assert r.returncode == 0 and "arithmetic" not in r.stderr and "value too great" not in r.stderr, r.stderr
    cmd = r.stdout.splitlines()[-1].split()
    assert {"--nnodes=10", "--node_rank=9", "--nproc_per_node=2", "--master_port=8"} <= set(cmd), cmd
    r = _launch(tmp_path / "b", "--node-rank", "9", "--nnodes", "09", "--master-addr", "h", "--iface", "eth7")
    assert r.returncode == 2 and "--node-rank: got '9'; accepted: 0..8" in r.stderr, r.stderr


def test_launch_multinode_takes_exported_nccl_variables(tmp_path):
    # an exported HCA list is checked like --hca (here: no such HCA), not passed on behind the dry run's back
    r = _launch(tmp_path, "--node-rank", "0", "--master-addr", "h", "--iface", "eth7",
                env_extra={"NCCL_IB_HCA": "mlx5_7"})
    assert r.returncode == 2 and "NCCL_IB_HCA (from the environment" in r.stderr and "'mlx5_7'" in r.stderr, r.stderr
    # a valid exported pair is what the launch uses (not the detected interface / HCAs)
    r = _launch(tmp_path / "b", "--node-rank", "0", "--master-addr", "h",
                env_extra={"NCCL_IB_HCA": "=rocep1s0f1:1", "NCCL_SOCKET_IFNAME": "eth7"})
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "export NCCL_IB_HCA==rocep1s0f1:1" in lines, r.stdout + r.stderr
    assert "export NCCL_SOCKET_IFNAME=eth7" in lines
    # the flags win over the environment
    r = _launch(tmp_path / "c", "--node-rank", "0", "--master-addr", "h", "--iface", "enp1s0f1np1",
                env_extra={"NCCL_SOCKET_IFNAME": "eth7"})
    assert r.returncode == 0 and "export NCCL_SOCKET_IFNAME=enp1s0f1np1" in r.stdout.splitlines(), r.stderr
    r = _launch(tmp_path / "d", "--node-rank", "0", "--master-addr", "h", env_extra={"NCCL_SOCKET_IFNAME": "^lo"})
    assert r.returncode == 2 and "NCCL_SOCKET_IFNAME (from the environment" in r.stderr, r.stderr


def test_launch_multinode_says_what_a_node_waits_for(tmp_path):
    r = _launch(tmp_path, "--node-rank", "1", "--master-addr", "10.0.0.1", "--iface", "eth7",
                env_extra={"PYTHON": "true"}, dry_run=False)   # `true` stands in for torchrun
    assert r.returncode == 0, r.stderr
    assert "node 1 of 2: waiting for all 2 nodes at 10.0.0.1:29500" in r.stderr, r.stderr
