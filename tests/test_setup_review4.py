"""setup.sh / scripts/setup_env.sh / run_train.sh defects found by the fourth first-user review,
each test failing on the code before its fix. Stages are faked (a clone whose .venv/bin/python is a shell script; fake
nvidia-smi, df, du, uv, cargo and cc where needed; a fake interpreter for run_train.sh), so the
file runs in a few seconds.

- The closing "Chat with your model" lines named the most finished phase whose checkpoint
  *directory* existed; every training stage makes that directory as it starts (its .writer.lock),
  so a chat_sft that stopped before its first save had the user chat with `-i sft`, which fails.
- The free-disk check asked 60 GB of any GPU preset: d20's own checkpoints (base, mid and SFT keep 2
  of ~9.2 GB each, +1 while saving) and its 170 data shards need ~90 GB, so a disk that passed
  filled up days later; and a rerun after a crash counted the data and checkpoints the run had
  already written as missing room, refusing to continue a run that fits.
- A failed install in the env stage (uv's resolver, a download, the Rust build) ended setup.sh
  silently under `set -e`: no line naming the step or the command to rerun.
- nvidia-smi installed but failing (the driver lost after a reboot or kernel update) read as "no
  GPU": --preset auto went on as tiny over a GPU run's base dir (retraining its tokenizer).
- On a multi-GPU machine nothing said the stages use one GPU, and `nvidia-smi ... | head -n1` could
  end setup.sh with SIGPIPE (exit 141 under pipefail) when nvidia-smi wrote its lines separately.
- run_train.sh --stop that had to SIGKILL said "[tag] stopped" as after a save; --status said only
  "not running".
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.setup_clone import make_clone

REPO = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"

FAKE_PYTHON = """#!/usr/bin/env bash
echo "fake python $*"
exit 0
"""


@pytest.fixture
def clone(tmp_path) -> Path:
    """A repo with setup.sh, its helpers and a fake .venv whose python is FAKE_PYTHON."""
    return make_clone(tmp_path, FAKE_PYTHON, home=True)


def _tools(tmp_path, **scripts) -> Path:
    """Fake commands (name -> bash body) in tmp_path/bin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run(repo: Path, *args, bin_dir: Path | None = None, **env):
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    if bin_dir is not None:
        path = f"{bin_dir}:{path}"
    e = {"PATH": path, "HOME": str(repo.parent / "home"), **{k: str(v) for k, v in env.items()}}
    out = subprocess.run([BASH, *args], capture_output=True, text=True, timeout=60, cwd=repo, env=e)
    return out.returncode, out.stdout + out.stderr


def test_chat_is_offered_from_a_phase_that_saved_a_checkpoint(clone, tmp_path):
    """chat_sft stopped before its first save (its directory holds only .writer.lock): the closing
    lines offer the mid checkpoint, which has a latest.json, not `-i sft`."""
    base = tmp_path / "base"
    ckpts = base / "checkpoints"
    (ckpts / "sft" / "d2").mkdir(parents=True)
    (ckpts / "sft" / "d2" / ".writer.lock").write_text("pid 1 on host\n")
    (ckpts / "mid" / "d2").mkdir(parents=True)
    (ckpts / "mid" / "d2" / "latest.json").write_text('{"step": 40, "dir": "step_000040"}')
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "report", "--base-dir", base)
    assert rc == 0, out
    assert "Chat with your model (mid checkpoint, tag d2):" in out, out
    assert "chat_web -i mid --model-tag d2" in out and "-i sft" not in out, out


H100 = """case "$*" in
  *--query-gpu=name*) echo "NVIDIA H100 80GB HBM3" ;;
  *--query-gpu=compute_cap*) echo "9.0" ;;
  *--query-gpu=driver_version*) echo "580.65.06" ;;
  *--query-gpu=memory.total*) echo "81559" ;;
  "") echo "| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: 13.0 |" ;;
esac
"""
DF_80GB = """echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "disk 900000000 800000000 83886080 90% /"
"""
DU = """# du -sk PATH: $DU_DATA_KB for the data shards, nothing elsewhere
p="${@: -1}"; [[ "$p" == */base_data ]] && echo -e "${DU_DATA_KB:-0}\\t$p" || echo -e "0\\t$p"
"""


def test_free_disk_check_fits_the_model_and_counts_what_is_there(clone, tmp_path):
    """80 GB free cannot hold d20's checkpoints and data (~90 GB): refused before any stage, naming
    the need; d12 fits; --only report needs no room. A rerun whose 20 GB of shards are already in
    the base dir continues."""
    bin_dir = _tools(tmp_path, **{"nvidia-smi": H100, "df": DF_80GB, "du": DU})
    base = tmp_path / "base"
    args = ["./setup.sh", "--only", "data", "--base-dir", base]
    rc, out = _run(clone, *args, bin_dir=bin_dir)
    assert rc == 2 and "only 80 GB free at" in out and "d20 (170 data shards" in out, out
    assert "needs about 90 GB" in out and "[data]" not in out, out
    rc, out = _run(clone, *args, "--depth", "12", bin_dir=bin_dir)
    assert rc == 0 and "[data] finished" in out, out
    rc, out = _run(clone, "./setup.sh", "--only", "report", "--base-dir", base, bin_dir=bin_dir)
    assert rc == 0 and "GB free at" not in out, out   # the report writes no data or checkpoints
    (base / "base_data").mkdir(exist_ok=True)
    rc, out = _run(clone, *args, bin_dir=bin_dir, DU_DATA_KB=20 * 1048576)
    assert rc == 0 and "[data] finished" in out, out


def test_a_failed_install_in_the_env_stage_names_the_step_and_the_rerun(clone, tmp_path):
    """uv cannot install torch (no wheel for this index): setup.sh says which step failed and the
    command to rerun, instead of ending with uv's exit code alone."""
    shutil.rmtree(clone / ".venv")
    venv_py = '#!/usr/bin/env bash\nexit 1\n'   # a venv without torch
    bin_dir = _tools(tmp_path, cargo="exit 0\n", cc="exit 0\n", uv=f"""case "$*" in
  venv*) mkdir -p .venv/bin && printf '{venv_py}' > .venv/bin/python && chmod +x .venv/bin/python ;;
  "pip install"*) echo "error: no matching distribution for torch" >&2; exit 2 ;;
esac
""")
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "env", "--base-dir", tmp_path / "base",
                   bin_dir=bin_dir)
    assert rc == 1, out
    line = next((x for x in out.splitlines() if x.startswith("setup.sh: stage 'env' failed")), "")
    assert "(exit 2) running: uv pip install" in line and "torch\\>=2.9" in line, out
    assert "rerun ./setup.sh --preset tiny --only env" in line, out


def test_a_failing_nvidia_smi_is_not_a_cpu_machine(clone, tmp_path):
    """After a reboot whose kernel lost the NVIDIA driver, nvidia-smi fails: --preset auto stopped
    being the GPU run's preset and went on as tiny (retraining the run's tokenizer at vocab 2048).
    Now it stops, quoting nvidia-smi; an explicit --preset tiny still runs."""
    bin_dir = _tools(tmp_path, **{"nvidia-smi": 'echo "NVIDIA-SMI has failed because it couldn\'t communicate'
                                                ' with the NVIDIA driver."; exit 9\n'})
    base = tmp_path / "base"
    rc, out = _run(clone, "./setup.sh", "--only", "data", "--base-dir", base, bin_dir=bin_dir)
    assert rc == 2 and "--preset auto: nvidia-smi failed ('exit 9: NVIDIA-SMI has failed" in out, out
    assert "--preset tiny" in out and "[data]" not in out and "No NVIDIA GPU found" not in out, out
    rc, out = _run(clone, "./setup.sh", "--preset", "h100", "--only", "data", "--base-dir", base, bin_dir=bin_dir)
    assert rc == 2 and "(it failed: 'exit 9: NVIDIA-SMI" in out, out
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir", base, bin_dir=bin_dir)
    assert rc == 0 and "[data] finished" in out, out


def test_a_multi_gpu_machine_is_told_the_stages_use_one(clone, tmp_path):
    """8 GPUs: the start says the stages train on one and how base training uses them all. Each query
    prints a line per GPU: `| head -n1` could close the pipe while nvidia-smi still wrote, and its
    SIGPIPE ended setup.sh (exit 141, pipefail); here the lines after the first come late."""
    eight = H100.replace('*--query-gpu=name*) echo "NVIDIA H100 80GB HBM3"',
                         '*--query-gpu=name*) echo "NVIDIA H100 80GB HBM3"; sleep 0.2\n'
                         '    for i in 2 3 4 5 6 7 8; do echo "NVIDIA H100 80GB HBM3"; done')
    rc, out = _run(clone, "./setup.sh", "--dry-run", "--only", "data", "--base-dir", tmp_path / "base",
                   bin_dir=_tools(tmp_path, **{"nvidia-smi": eight}))
    assert rc == 0, out
    assert "==> 8 GPUs: the stages below train on one of them" in out and "./run_train.sh --nproc 8" in out, out
    assert "GPU: NVIDIA H100 80GB HBM3 (cc 9.0)" in out and "preset h100" in out, out


STUBBORN_PYTHON = """#!/bin/bash
# passes run_train.sh's flag check ("python -"), then logs steps, ignoring SIGTERM
if [[ "$1" == "-" ]]; then cat > /dev/null; exit 0; fi
trap '' TERM
for i in $(seq 1 300); do echo "step $(printf %05d $i)/00300 | loss 1"; sleep 0.1; done
"""


def test_run_train_stop_that_had_to_kill_does_not_say_stopped(tmp_path):
    """--stop escalating to SIGKILL said "[tag] stopped", as after a save, and --status showed a bare
    "not running": now both say it was killed, maybe before its save."""
    fake = tmp_path / "python"
    fake.write_text(STUBBORN_PYTHON)
    fake.chmod(0o755)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), "NANOCHAT_PYTHON": str(fake),
           "NANOCHAT_BASE_DIR": str(tmp_path / "base")}

    def run(*args):
        out = subprocess.run([BASH, str(REPO / "run_train.sh"), *args], env=env, capture_output=True, text=True,
                             timeout=30)
        return out.returncode, out.stdout + out.stderr
    rc, out = run("--depth", "3")
    assert rc == 0, out
    log = tmp_path / "base" / "runs" / "d3" / "train.log"
    for _ in range(100):
        if "step 00001/" in log.read_text():
            break
        time.sleep(0.05)
    rc, out = run("--stop", "--timeout", "1")
    assert rc == 0 and "SIGKILL" in out, out
    assert "[d3] killed (last step logged: step 0" in out and "[d3] stopped" not in out, out
    rc, out = run("--status", "--model-tag", "d3")
    assert rc == 3 and "[d3] not running (killed by --stop after its --timeout" in out, out
