"""setup.sh's choice of torch wheels for the machine's driver, shown by `--dry-run` with a fake
nvidia-smi (and uname) first on PATH: a CUDA 12 driver cannot run PyPI's CUDA 13 torch, so it gets
PyTorch's cu126 / cu128 index; a driver older than CUDA 12 stops the run before anything installs."""

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE_SMI = """#!/usr/bin/env bash
case "$*" in
  *--query-gpu=name*) echo "NVIDIA H100 80GB HBM3" ;;
  *--query-gpu=compute_cap*) echo "9.0" ;;
  *--query-gpu=driver_version*) echo "535.183.01" ;;
  "") echo "| NVIDIA-SMI 535.183.01   Driver Version: 535.183.01   {version} |" ;;
esac
"""


def _dry_run(tmp_path, cuda: str | None, arch: str = "x86_64", index_url: str | None = None):
    """setup.sh --dry-run --only env on a fake GPU whose driver reports CUDA `cuda` (None: no
    version in nvidia-smi's banner) -> (exit code, output)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(version=f"CUDA Version: {cuda}" if cuda else ""))
    uname = bin_dir / "uname"
    uname.write_text(f'#!/usr/bin/env bash\n[ "$1" = -m ] && echo {arch} || echo Linux\n')
    for f in (smi, uname):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if index_url:
        env["TORCH_INDEX_URL"] = index_url
    out = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--only", "env", "--preset", "tiny",
                          "--base-dir", str(tmp_path / "base")], env=env, capture_output=True, text=True,
                         timeout=60)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("cuda, arch, index", [
    ("12.2", "x86_64", "https://download.pytorch.org/whl/cu126"),
    ("12.4", "aarch64", "https://download.pytorch.org/whl/cu126"),
    ("12.8", "x86_64", "https://download.pytorch.org/whl/cu128"),
    ("12.9", "x86_64", "https://download.pytorch.org/whl/cu128"),
    ("13.0", "x86_64", "PyPI"),
    ("13.0", "aarch64", "https://download.pytorch.org/whl/cu130"),   # DGX Spark
    ("13.2", "x86_64", "PyPI"),
])
def test_torch_index_follows_the_drivers_cuda(tmp_path, cuda, arch, index):
    rc, out = _dry_run(tmp_path, cuda, arch)
    assert rc == 0, out
    assert f"install torch from {index}, the project" in out, out
    assert f"CUDA {cuda}" in out   # the machine line says what was read


def test_old_driver_stops_before_anything_installs(tmp_path):
    rc, out = _dry_run(tmp_path, "11.8")
    assert rc == 2
    assert "CUDA up to 11.8" in out and "TORCH_INDEX_URL" in out and "would create" not in out


def test_explicit_index_wins_and_unreadable_version_warns(tmp_path):
    rc, out = _dry_run(tmp_path, "11.8", index_url="https://example.org/whl/cu118")
    assert rc == 0 and "install torch from https://example.org/whl/cu118," in out, out
    rc, out = _dry_run(tmp_path, None)
    assert rc == 0 and "could not read the driver's CUDA version" in out and "from PyPI," in out, out


def test_no_gpu_takes_pypi(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 9\n")   # installed, no GPU
    (bin_dir / "nvidia-smi").chmod(0o755)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    out = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--only", "env", "--preset", "tiny",
                          "--force"], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "GPU: none" in out.stdout and "from PyPI," in out.stdout, out.stdout + out.stderr
