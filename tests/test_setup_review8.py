"""setup.sh / run_train.sh defects found by the eighth first-user review, each test failing on the
code before its fix. Stages are faked (a clone whose .venv/bin/python is a shell script, a fake
nvidia-smi for the dry runs, a fake interpreter for run_train.sh), so the file runs in seconds.

- `--base-dir` with its value left out (`--base-dir $UNSET --dry-run`) took the next flag as the
  directory: setup.sh began a real run in ./--dry-run, and `run_train.sh --base-dir --status`
  started a training run in ./--status instead of reporting.
- `run_train.sh --nproc N --run NAME` started torchrun with the script's `--run`, which torchrun's
  own parser (Python 3.11) reads as an ambiguous prefix of its --run-path: it exited 2 in the log
  after run_train.sh had said "started".
- `setup.sh --device-batch-size N` said "the preset's is 32" on a GPU whose fitted batch was 4 (the
  batch that had just run out of memory), and on one that fits none.
"""

from __future__ import annotations

import shlex

import pytest

from tests.test_run_train_audit import call  # noqa: F401  (a fixture: run_train.sh with a fake python)
from tests.test_setup import _dry_run
import tests.test_setup_review4 as _review4
from tests.test_setup_review3 import _run

clone = _review4.clone   # a fixture (assigned: an import would read as redefined by the tests' arguments)


# ---------------------------------------------------------------- a --base-dir without its value


def test_setup_base_dir_without_a_value_is_not_the_next_flag(clone, tmp_path):
    caller = tmp_path / "here"
    caller.mkdir()
    rc, out = _run(clone, str(clone / "setup.sh"), "--preset", "tiny", "--base-dir", "--dry-run", cwd=caller)
    assert rc == 2, out
    assert "--base-dir: got '--dry-run' (a flag, not a directory: its value left out?)" in out, out
    assert "./--dry-run for a name starting with '-'" in out
    assert not (caller / "--dry-run").exists() and "[env]" not in out and "[data]" not in out
    # the way out it names works: ./-named directories are still accepted
    rc, out = _run(clone, str(clone / "setup.sh"), "--preset", "tiny", "--base-dir", "./-nc", "--dry-run",
                   "--only", "data", cwd=caller)
    assert rc == 0 and "[data] python -m nanochat.dataset --source shakespeare" in out, out


def test_run_train_base_dir_without_a_value_does_not_start_a_run(call, tmp_path):  # noqa: F811
    r = call("--base-dir", "--status")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--base-dir: got '--status' (a flag, not a directory: its value left out?)" in r.stderr
    assert not (tmp_path / "--status").exists() and "started" not in r.stdout
    r = call("--base-dir=--stop")
    assert r.returncode == 2 and "--base-dir: got '--stop'" in r.stderr and not (tmp_path / "--stop").exists()


# ---------------------------------------------------------------- --run under torchrun


@pytest.mark.parametrize("run_flag, want", [(["--run", "myrun"], ["--run-name", "myrun"]),
                                            (["--run=myrun"], ["--run-name=myrun"])])
def test_run_train_nproc_passes_run_as_run_name(call, tmp_path, run_flag, want):  # noqa: F811
    """torchrun's parser (Python 3.11) refuses `-m scripts.base_train --run X` as an ambiguous
    --run-path, after run_train.sh has said "started"; base_train takes --run-name for it."""
    base = tmp_path / "b"
    r = call("--base-dir", str(base), "--nproc", "2", "--depth", "4", *run_flag)
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = shlex.split((base / "runs" / "d4" / "cmd").read_text())
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"], cmd
    script_args = cmd[cmd.index("scripts.base_train") + 1:]
    assert script_args == ["--depth", "4", *want], cmd
    # one process: plain python takes --run as it is (the command shown stays the user's)
    r = call("--base-dir", str(base), "--depth", "5", *run_flag)
    assert r.returncode == 0, r.stdout + r.stderr
    cmd = shlex.split((base / "runs" / "d5" / "cmd").read_text())
    assert cmd[cmd.index("scripts.base_train") + 1:] == ["--depth", "5", *run_flag], cmd


# ---------------------------------------------------------------- the device batch said


@pytest.mark.parametrize("mem_mib, said", [
    (24564, "the preset's is 4 for d20 in the NVIDIA H100 80GB HBM3's 23 GiB"),            # fitted 4, not 32
    (8000, "the preset's is 32; by the estimate, d20 fits the NVIDIA H100 80GB HBM3's 7 GiB at none"),
    (81559, "the preset's is 32)"),                                                          # fitted = preset's
])
def test_device_batch_flag_names_the_batch_fitted_to_the_gpu(tmp_path, mem_mib, said):
    rc, out = _dry_run(tmp_path, "13.0", mem_mib=mem_mib,
                       args=("--only", "base_train", "--preset", "h100", "--device-batch-size", "2"))
    assert rc == 0, out
    assert f"device batch 2 (--device-batch-size; {said}" in out, out
    assert "--device-batch-size 2 --total-batch-size 524288" in out


def test_spark_says_when_memory_in_use_is_below_the_fitted_batch(tmp_path):
    """Each stage caps PyTorch's allocator at 90% of MemAvailable at its start (platform.patch_memory_cap),
    while the batch is fitted to 3/4 of MemTotal (stable across reruns): with memory in use, setup
    says so up front instead of a stage stopping out of memory at step 0."""
    import os
    import subprocess
    from tests.test_setup import GB10_SMI, REPO, _dry_run
    rc, out = _dry_run(tmp_path, "13.0", arch="aarch64", mem_total_gib=122, mem_mib="[N/A]", gpu=GB10_SMI,
                       args=("--only", "base_train", "--preset", "spark", "--depth", "12"))
    assert rc == 0 and "GiB of the unified memory is available now" not in out, out   # 86% available: fine
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {122 * 1048576} kB\nMemAvailable: {40 * 1048576} kB\n")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "SETUP_MEMINFO": str(meminfo)}
    env.pop("TORCH_INDEX_URL", None)
    out = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--only", "base_train", "--preset", "spark",
                          "--depth", "12", "--base-dir", str(tmp_path / "base")], env=env, capture_output=True,
                         text=True, timeout=60)
    said = out.stdout + out.stderr
    assert out.returncode == 0 and "40 GiB of the unified memory is available now" in said, said
    assert "NANOCHAT_GPU_MEMORY_CAP" in said
