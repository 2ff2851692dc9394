"""Memory sizing inside a container and on a multi-GPU box (review 9): the unified-memory budget and
the allocator cap are bounded by a cgroup memory limit (v2 and v1, read from fake files: /proc/meminfo
shows the host's memory inside `docker run --memory`), and setup.sh sizes its batch by that limit and
for the GPU CUDA_VISIBLE_DEVICES names, not nvidia-smi's first (a fake nvidia-smi)."""

import os
import subprocess

import pytest
from test_platform import GB10, fake_ctx

from nanochat import memory_limits as M
from nanochat import platform as P
from tests.test_setup import GB10_SMI, REPO, _dry_run

GB = 10**9
MEMINFO = f"MemTotal: {125_000_000} kB\nMemAvailable: {120_000_000} kB\n"   # a Spark's host: ~123 GB free


def _v2(tmp_path, max_="34359738368", current=4 * GB, inactive=1 * GB, own="/"):
    """A cgroup v2 mount as a container sees it (its own cgroup at the root) -> (root, /proc/self/cgroup)."""
    root = tmp_path / "cg"
    d = root / own.strip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "memory.max").write_text(f"{max_}\n")
    (d / "memory.current").write_text(f"{current}\n")
    (d / "memory.stat").write_text(f"anon 123\ninactive_file {inactive}\nactive_file 5\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text(f"0::{own}\n")
    return str(root), str(proc)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    monkeypatch.setattr(P, "_MEMORY_CAP", [])
    monkeypatch.setattr(P, "_LOGGED", set())


def test_a_v2_container_limit_bounds_the_budget_and_is_named(tmp_path):
    root, proc = _v2(tmp_path)   # 32 GiB limit, 4 GB used of which 1 GB reclaimable file cache
    gb10 = P.detect_device(props=GB10)
    budget, source = P.unified_memory_budget(meminfo=MEMINFO, cgroup_root=root, self_cgroup=proc)
    assert budget == int((34359738368 - 3 * GB) * 0.9)
    assert "cgroup memory limit" in source and str(tmp_path / "cg" / "memory.max") in source
    assert P.memory_budget_bytes(gb10, meminfo=MEMINFO, cgroup_root=root, self_cgroup=proc) == budget
    # no cgroup read (None), or "max": MemAvailable, as before
    assert P.memory_budget_bytes(gb10, meminfo=MEMINFO, cgroup_root=None) == int(120_000_000 * 1024 * 0.9)
    root, proc = _v2(tmp_path, max_="max")
    assert P.unified_memory_budget(meminfo=MEMINFO, cgroup_root=root, self_cgroup=proc) == (
        int(120_000_000 * 1024 * 0.9), "MemAvailable")


def test_the_allocator_cap_follows_the_container_limit_and_says_so(tmp_path, caplog):
    root, proc = _v2(tmp_path, current=0, inactive=0)
    ctx, calls = fake_ctx(), []
    ctx.set_memory_fraction, ctx.total_memory, ctx.meminfo = calls.append, (lambda: 128 * GB), MEMINFO
    ctx.cgroup_root, ctx.self_cgroup = root, proc
    with caplog.at_level("WARNING"):
        assert P.patch_memory_cap(P.detect_device(props=GB10), ctx) == "memory_cap"
    assert P.memory_cap_bytes() == int(34359738368 * 0.9)   # 30.9 GB, not 110 GB of the host's
    assert "capped at 30.9 GB" in caplog.text and "cgroup memory limit" in caplog.text, caplog.text
    assert P.PatchContext(env={}).cgroup_root is None   # tests' contexts read no cgroup ...
    assert P.PatchContext.real(P.CPU_SPEC).cgroup_root == M.CGROUP_ROOT   # ... real runs do


def test_v1_the_tightest_ancestor_binds_and_a_foreign_path_reads_the_mount(tmp_path):
    mem = tmp_path / "cg" / "memory"
    own = mem / "docker" / "abc"
    own.mkdir(parents=True)
    no_limit = "9223372036854771712"   # what v1 writes for "no limit"
    for d, limit, usage in ((mem, no_limit, 50 * GB), (mem / "docker", 16 * GB, 10 * GB), (own, no_limit, 2 * GB)):
        (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
        (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
        (d / "memory.stat").write_text(f"inactive_file 7\ntotal_inactive_file {GB}\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text("12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    found = M.cgroup_memory(str(tmp_path / "cg"), str(proc))
    assert (found.limit, found.usage, found.free) == (16 * GB, 9 * GB, 7 * GB)
    assert found.path == str(mem / "docker" / "memory.limit_in_bytes")
    # a v1 container: /proc/self/cgroup names the host's path, the mount is the container's cgroup
    (mem / "memory.limit_in_bytes").write_text(f"{8 * GB}\n")
    (mem / "memory.usage_in_bytes").write_text(f"{3 * GB}\n")
    proc.write_text("4:memory:/kubepods/pod1/xyz\n")
    found = M.cgroup_memory(str(tmp_path / "cg"), str(proc))
    assert found.free == 6 * GB and found.path == str(mem / "memory.limit_in_bytes")
    assert M.cgroup_memory(str(tmp_path / "nowhere"), str(tmp_path / "none")) is None


def test_setup_sizes_a_gb10_container_by_its_cgroup_limit(tmp_path, monkeypatch):
    root, proc = _v2(tmp_path, current=0, inactive=0)   # docker run --memory=32g on a 122 GiB Spark
    monkeypatch.setenv("SETUP_CGROUP_ROOT", root)
    monkeypatch.setenv("SETUP_PROC_CGROUP", proc)
    rc, out = _dry_run(tmp_path, "13.0", arch="aarch64", mem_total_gib=122, mem_mib="[N/A]", gpu=GB10_SMI,
                       args=("--only", "base_train", "--preset", "spark", "--depth", "20"))
    assert rc == 0 and "--device-batch-size 4 " in out, out   # 3/4 of 32 GiB; the host's 122 fitted 16
    assert "3/4 of the 32 GiB of unified memory (the cgroup memory limit in" in out and "memory.max" in out, out
    assert "available memory 32 GB" in out, out



def test_setup_reads_the_smallest_limit_and_the_least_free_of_any_level(tmp_path, capsys):
    """A parent cgroup of 64 GiB with 60 GiB in use and our own of 32 GiB with 1 GiB: the level
    with the least free memory is the parent, and its 64 GiB was printed as the limit, so setup.sh
    fitted a batch to 48 GiB under a 32 GiB hard limit. The total is the smallest limit, the free
    part the least any level leaves."""
    GiB = 2**30
    root = tmp_path / "cg"
    own = root / "parent" / "me"
    own.mkdir(parents=True)
    for d, limit, used in ((root / "parent", 64 * GiB, 60 * GiB), (own, 32 * GiB, 1 * GiB)):
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{used}\n")
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/parent/me\n")
    assert M.main([str(root), str(proc)]) == 0
    limit, free, path = capsys.readouterr().out.split()
    assert (int(limit), int(free), path) == (32 * GiB, 4 * GiB, str(own / "memory.max"))


def test_a_simulated_setup_machine_ignores_the_test_machine_s_cgroup(tmp_path, monkeypatch):
    """SETUP_MEMINFO simulates the machine: the real cgroup of whatever runs the tests (a CI container
    with a memory limit) must not size the simulated Spark; only SETUP_CGROUP_ROOT gives it one."""
    root, proc = _v2(tmp_path, max_=str(8 * 2**30), current=0, inactive=0)
    monkeypatch.delenv("SETUP_CGROUP_ROOT", raising=False)
    monkeypatch.setenv("SETUP_PROC_CGROUP", proc)
    text = (REPO / "setup.sh").read_text()
    assert 'if [[ -z "${SETUP_MEMINFO:-}" || -n "${SETUP_CGROUP_ROOT:-}" ]]; then' in text
    rc, out = _dry_run(tmp_path, "13.0", arch="aarch64", mem_total_gib=122, mem_mib="[N/A]", gpu=GB10_SMI,
                       args=("--only", "base_train", "--preset", "spark", "--depth", "20"))
    assert rc == 0 and "--device-batch-size 16 " in out and "cgroup" not in out, out

# two GPUs: nvidia-smi's first is an 80 GB H100, the second a 24 GB RTX 4090
TWO_SMI = """#!/usr/bin/env bash
case "$*" in
  *--query-gpu=name*) printf 'NVIDIA H100 80GB HBM3\\nNVIDIA GeForce RTX 4090\\n' ;;
  *--query-gpu=compute_cap*) printf '9.0\\n8.9\\n' ;;
  *--query-gpu=uuid*) printf 'GPU-aaaa1111-0000\\nGPU-bbbb2222-0000\\n' ;;
  *--query-gpu=driver_version*) printf '580.1\\n580.1\\n' ;;
  *--query-gpu=memory.total*) printf '81559\\n24564\\n' ;;
  "") echo "| NVIDIA-SMI 580.1   Driver Version: 580.1   CUDA Version: 13.0 |" ;;
esac
"""


def _two_gpus(tmp_path, cvd):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(TWO_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "CUDA_VISIBLE_DEVICES")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if cvd is not None:
        env["CUDA_VISIBLE_DEVICES"] = cvd
    out = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--only", "base_train", "--preset", "h100",
                          "--depth", "20", "--base-dir", str(tmp_path / "base")], env=env, capture_output=True,
                         text=True, timeout=60)
    return out.returncode, out.stdout + out.stderr


H100, RTX = "NVIDIA H100 80GB HBM3 (cc 9.0)", "NVIDIA GeForce RTX 4090 (cc 8.9)"


@pytest.mark.parametrize("cvd, dbs, gpu", [(None, 32, H100), ("1", 4, RTX), ("1,0", 4, RTX),
                                           ("GPU-bbbb", 4, RTX), ("0", 32, H100)])
def test_setup_sizes_for_the_gpu_cuda_visible_devices_names(tmp_path, cvd, dbs, gpu):
    rc, out = _two_gpus(tmp_path, cvd)
    assert rc == 0 and f"--device-batch-size {dbs} " in out and f"GPU: {gpu}" in out, out


def test_setup_stops_on_a_cuda_visible_devices_naming_no_gpu(tmp_path):
    rc, out = _two_gpus(tmp_path, "7")
    assert rc == 2 and "CUDA_VISIBLE_DEVICES='7'" in out and "accepted: an index 0..1 or a GPU UUID" in out, out
