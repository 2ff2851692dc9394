"""scripts/launch_multinode.sh defects found by the set-up / launch audit (session 52), on a fake
sysfs (NANOCHAT_SYSFS_ROOT) and a fake ibdev2netdev: --hca on a node without
/sys/class/infiniband, or an ibdev2netdev that fails, ended the script under set -e / pipefail with
no message at all; the dry run's `export` lines did not quote a value with a space (a repo path in
PYTHONPATH), so pasting them into a shell failed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch_multinode.sh"


def _sysfs(root: Path, iface: str = "eth7") -> Path:
    """A sysfs with one network interface (MTU 9000, up) and no InfiniBand class at all."""
    net = root / "sys" / "class" / "net" / iface
    net.mkdir(parents=True, exist_ok=True)
    (net / "mtu").write_text("9000\n")
    (net / "operstate").write_text("up\n")
    return root


def _launch(tmp_path, *args, ibdev2netdev="none", extra_env=None):
    env = dict(os.environ, NANOCHAT_SYSFS_ROOT=str(_sysfs(tmp_path / "fs")), IBDEV2NETDEV=ibdev2netdev,
               PYTHON="python3", **(extra_env or {}))
    for var in ("NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"):   # an exported one stands for --hca / --iface
        if var not in (extra_env or {}):
            env.pop(var, None)
    return subprocess.run(["bash", str(LAUNCH), "--node-rank", "0", "--master-addr", "10.0.0.1", "--iface", "eth7",
                           *args, "--dry-run"], capture_output=True, text=True, env=env, timeout=30)


def test_hca_on_a_node_without_infiniband_says_so(tmp_path):
    r = _launch(tmp_path, "--hca", "rocep1s0f1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--hca: 'rocep1s0f1' names no HCA on this node; available: none" in r.stderr, r.stderr
    r = _launch(tmp_path, "--hca", "^mlx5_9")   # an exclusion names nothing that must exist
    assert r.returncode == 0 and "export NCCL_IB_HCA=^mlx5_9" in r.stdout.splitlines(), r.stdout + r.stderr


def test_a_failing_ibdev2netdev_falls_back_to_sysfs(tmp_path):
    tool = tmp_path / "ibdev2netdev"
    tool.write_text("#!/bin/sh\necho 'ibdev2netdev: no devices' >&2\nexit 1\n")
    tool.chmod(0o755)
    r = _launch(tmp_path, ibdev2netdev=str(tool))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "export NCCL_SOCKET_IFNAME=eth7" in r.stdout and "no RDMA HCA found for eth7" in r.stderr


def test_dry_run_exports_read_back_in_a_shell(tmp_path):
    """The printed exports, run by bash, give the values the launch would set."""
    r = _launch(tmp_path, extra_env={"PYTHONPATH": "/opt/my libs"})
    assert r.returncode == 0, r.stderr
    exports = "\n".join(x for x in r.stdout.splitlines() if x.startswith("export "))
    got = subprocess.run(["bash", "-c", exports + '\nprintf "%s\\n" "$PYTHONPATH" "$NCCL_SOCKET_IFNAME"'],
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0 and got.stdout.splitlines() == [f"{REPO}:/opt/my libs", "eth7"], (exports, got)
