"""setup.sh / scripts/setup_env.sh / run_train.sh defects found by the ninth first-user review, each test failing on
the code before its fix. A fake nvidia-smi drives the dry runs; the env stage runs in a clone with
fake uv, cargo, cc and a fake venv python, so the file runs in seconds.

- A GPU older than Turing (cc < 7.5: V100, P100, GTX 10xx) got PyPI's CUDA 13 torch (kernels for
  sm_75 and up; torch 2.15+cu132 lists sm_75..sm_120) or PyTorch's cu128 one (the same floor): torch
  imported, `torch.cuda.is_available()` said True, the env stage passed, and the first CUDA kernel
  of base_train failed ("no kernel image is available") after the data download and the tokenizer.
  Such a GPU gets the cu126 build (which keeps Maxwell, Pascal and Volta kernels), and the env
  stage's GPU check is a real launch, not is_available().
- CUDA_VISIBLE_DEVICES hiding every GPU nvidia-smi lists ('' or -1 left in the shell): --preset auto
  went on as the tiny CPU demo (its tokenizer stage overwriting a GPU run's tokenizer in that base
  dir, as a failing nvidia-smi once did), an explicit --preset h100 said "nvidia-smi found none",
  and the machine line ended in a blank "CUDA ".
- run_train.sh with a --base-dir under a file: base_train's check blamed NANOCHAT_BASE_DIR ("set
  NANOCHAT_BASE_DIR"), a variable the user never set; it is named as given now.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

import tests.test_setup_review4 as _review4
from tests.test_memory_review9 import TWO_SMI
from tests.test_run_train_audit import call  # noqa: F401  (a fixture: run_train.sh with a fake python)
from tests.setup_clone import fake_env_tools, make_clone
from tests.test_setup import REPO, _dry_run
from tests.test_setup_review3 import _run

clone = _review4.clone   # a fixture (assigned: an import would read as redefined by the tests' arguments)

V100 = ("Tesla V100-SXM2-32GB", "7.0")
CU126 = "https://download.pytorch.org/whl/cu126"


# ---------------------------------------------------------------- a GPU older than the build's kernels


@pytest.mark.parametrize("cuda, gpu, index", [
    ("13.0", V100, CU126),                                  # was PyPI (cu132: sm_75 and up)
    ("12.8", V100, CU126),                                  # was cu128 (sm_75 and up)
    ("12.9", ("Tesla P100-PCIE-16GB", "6.0"), CU126),
    ("13.0", ("Tesla T4", "7.5"), "PyPI"),                  # Turing: the CUDA 13 build runs it
    ("12.8", ("Tesla T4", "7.5"), "https://download.pytorch.org/whl/cu128"),
])
def test_a_pre_turing_gpu_gets_a_torch_build_with_its_kernels(tmp_path, cuda, gpu, index):
    rc, out = _dry_run(tmp_path, cuda, gpu=gpu, repo=make_clone(tmp_path))   # no .venv: its torch is not reused
    assert rc == 0, out
    assert f"install torch from {index}, the project" in out, out
    if index == CU126:
        assert f"the {gpu[0]} (cc {gpu[1]})" in out and "sm_75" in out, out


def _env_stage(clone, tmp_path, gpu=V100):
    """setup.sh --only env in the clone on a fake GPU: uv, cargo and cc succeed; the venv's python
    imports torch and says CUDA is available, but a kernel launch fails (a build without this GPU's
    kernels)."""
    venv_python = ("#!/usr/bin/env bash\ncase \"$*\" in\n"
                   "  *'device=\"cuda\"'*) echo 'RuntimeError: CUDA error: no kernel image is available' >&2; exit 1 ;;\n"
                   "  *get_arch_list*) echo \"2.15.0 (CUDA 13.2, kernels for sm_75 sm_80 sm_90)\" ;;\n"
                   "  *sysconfig*) echo /nonexistent ;;\nesac\nexit 0\n")
    smi = ('case "$*" in\n'
           f'  *--query-gpu=name*) echo "{gpu[0]}" ;;\n  *--query-gpu=compute_cap*) echo {gpu[1]} ;;\n'
           '  *--query-gpu=driver_version*) echo 580.1 ;;\n  *--query-gpu=memory.total*) echo 32768 ;;\n'
           '  "") echo "| NVIDIA-SMI 580.1   Driver Version: 580.1   CUDA Version: 13.0 |" ;;\nesac\n')
    bin_dir = fake_env_tools(tmp_path, venv_python, {"nvidia-smi": smi})
    shutil.rmtree(clone / ".venv")
    return _run(clone, "./setup.sh", "--preset", "h100", "--only", "env", "--base-dir", tmp_path / "base",
                bin_dir=bin_dir)


def test_env_stage_proves_the_gpu_with_a_kernel_launch(clone, tmp_path):
    rc, out = _env_stage(clone, tmp_path)
    assert rc == 2, out
    assert "cannot run a kernel on the Tesla V100-SXM2-32GB (cc 7.0)" in out, out
    assert "kernels for sm_75 sm_80 sm_90" in out and "TORCH_INDEX_URL" in out, out
    assert not (clone / ".venv" / ".setup-env.done").exists()


# ---------------------------------------------------------------- CUDA_VISIBLE_DEVICES hiding every GPU


def _hidden(tmp_path, cvd: str, *args):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text(TWO_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", CUDA_VISIBLE_DEVICES=cvd)
    out = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--only", "tokenizer", *args,
                          "--base-dir", str(tmp_path / "base")], env=env, capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("cvd", ["", "-1", "0,0"])   # "0,0": a repeated entry shows CUDA no GPU
def test_auto_preset_does_not_turn_hidden_gpus_into_the_cpu_demo(tmp_path, cvd):
    rc, out = _hidden(tmp_path, cvd)
    assert rc == 2, out
    assert f"--preset auto: CUDA_VISIBLE_DEVICES='{cvd}' hides the 2 GPUs nvidia-smi lists" in out, out
    assert "accepted: --preset tiny" in out and "tok_train" not in out, out


def test_gpu_preset_with_hidden_gpus_names_cuda_visible_devices(tmp_path):
    rc, out = _hidden(tmp_path, "", "--preset", "h100")
    assert rc == 2 and "nvidia-smi found none" not in out, out
    assert "--preset h100: CUDA_VISIBLE_DEVICES='' hides the 2 GPUs nvidia-smi lists" in out, out


def test_tiny_preset_with_hidden_gpus_runs_on_the_cpu_and_says_why(tmp_path):
    rc, out = _hidden(tmp_path, "-1", "--preset", "tiny")
    assert rc == 0 and "tok_train --vocab-size 2048" in out, out
    assert "CUDA_VISIBLE_DEVICES='-1' hides every GPU: the stages run on the CPU" in out, out
    assert "CUDA 13.0" in out and not any(line.endswith("CUDA ") for line in out.splitlines()), out


# ---------------------------------------------------------------- run_train.sh's base dir


@pytest.mark.parametrize("how", ["flag", "env"])
def test_run_train_names_the_base_dir_flag_the_user_gave(call, tmp_path, how):  # noqa: F811
    """A --base-dir under a file was refused by base_train's check as "NANOCHAT_BASE_DIR: ... (set
    NANOCHAT_BASE_DIR)", a variable the user never set (with a python that passes it: a bare mkdir error)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    if how == "flag":
        r = call("--base-dir", str(afile / "nc"), "--depth", "2")
    else:
        r = call("--depth", "2", base_env=str(afile / "nc"))
    flag = "--base-dir" if how == "flag" else "NANOCHAT_BASE_DIR"
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"run_train.sh: error: {flag}: got '{afile / 'nc'}' ('{afile}' is not a directory you can write to)" \
        in r.stderr, r.stderr
    assert "started" not in r.stdout
