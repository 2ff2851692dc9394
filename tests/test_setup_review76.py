"""setup.sh defects found by review 76 (a user on a fresh machine, CPU); each test failed before its fix.

- `--identity` with its value left out (`--identity $UNSET --dry-run`) took the next flag as the model's
  name: the dry run asked for became a real run, and mid_train's argparse then stopped on
  `--identity --dry-run` ("expected one argument") after the data, tokenizer and base training. A name
  starting with '-' is refused before any stage.
- mid_train / chat_sft's data was first looked for by mid_train, after base training: without
  ../shared/data (a fresh clone) the conversations and the word list are nowhere, and the GPU presets'
  MMLU / ARC / GSM8K train splits are only on the hub, whose `datasets` package the env stage never
  installed, so every GPU run stopped at mid_train days in. The env stage now installs the hub extra
  on a GPU machine or without ../shared/data, and setup.sh runs the stages' own loaders before the
  data stage, refusing with their message when something is missing.

The stages are faked (a clone whose .venv/bin/python logs each stage and runs setup.sh's inline checks
with the real interpreter), so the file runs in seconds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from tests.setup_clone import fake_env_tools, make_clone
from tests.test_setup_review3 import _run

# setup.sh's inline checks (`python - args <<PY`) run for real; every stage command is only logged
STAGE_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == - ]]; then exec {exe} "$@"; fi
echo "$*" >> "{log}"
exit 0
"""


def _clone(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "stages.log"
    return make_clone(tmp_path, STAGE_PYTHON.format(exe=sys.executable, log=log), home=True), log


@pytest.mark.parametrize("args, value", [
    (("--identity", "--dry-run"), "--dry-run"),        # the value left out: the next flag taken as the name
    (("--identity=-Bob",), "-Bob"),                     # mid_train's argparse reads it as a flag
])
def test_an_identity_starting_with_a_dash_is_refused_before_any_stage(tmp_path, args, value):
    clone, log = _clone(tmp_path)
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", *args, "--from", "data", "--base-dir", tmp_path / "base")
    assert rc == 2, out
    assert f"setup.sh: error: --identity: got '{value}' (a flag, not a name: its value left out?)" in out, out
    assert not log.exists() and not (tmp_path / "base").exists(), out   # nothing ran, nothing made


def test_chat_data_missing_is_refused_before_the_data_stage(tmp_path):
    """NANOCHAT_EVAL_DIR / NANOCHAT_SFT_DIR at empty folders: a machine without ../shared/data."""
    clone, log = _clone(tmp_path)
    (tmp_path / "none").mkdir()
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--from", "data", "--base-dir", tmp_path / "base",
                   NANOCHAT_EVAL_DIR=tmp_path / "none", NANOCHAT_SFT_DIR=tmp_path / "none")
    assert rc == 2, out
    assert ("setup.sh: error: stage 'mid_train' would stop on its data (checked now, before the data stage and "
            "base training):") in out, out
    assert "not found" in out and str(tmp_path / "none") in out and "install the hub extra" in out, out
    assert not log.exists(), out   # no stage ran: not the data download, not base training

    # the data there (../shared/data beside this checkout): the check passes, every stage runs
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--from", "data", "--base-dir", tmp_path / "base")
    assert rc == 0 and "would stop on its data" not in out, out
    assert "scripts.mid_train" in log.read_text() and "scripts.chat_sft" in log.read_text(), out


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None,
                    reason="with `datasets` the hub's train splits are not checked offline")
def test_a_gpu_presets_train_splits_without_the_hub_are_refused_before_the_data_stage(tmp_path):
    clone, log = _clone(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(
        '#!/usr/bin/env bash\ncase "$*" in\n  *--query-gpu=name*) echo "NVIDIA H100 80GB HBM3" ;;\n'
        '  *--query-gpu=compute_cap*) echo 9.0 ;;\n  *--query-gpu=driver_version*) echo 580.1 ;;\n'
        '  *--query-gpu=memory.total*) echo 81559 ;;\n'
        '  "") echo "| NVIDIA-SMI 580.1   Driver Version: 580.1   CUDA Version: 13.0 |" ;;\nesac\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    rc, out = _run(clone, "./setup.sh", "--preset", "h100", "--depth", "2", "--from", "data",   # (d2: the disk check passes)
                   "--base-dir", tmp_path / "base", bin_dir=bin_dir)
    assert rc == 2, out
    assert "stage 'mid_train' would stop on its data" in out and "mmlu_auxiliary_train.jsonl" in out, out
    assert not log.exists(), out


# the env stage with fake uv / cargo / cc: uv logs what it installs; the venv python passes every check
VENV_PYTHON = "#!/usr/bin/env bash\n[[ \"$1\" == - ]] && cat > /dev/null\nexit 0\n"
UV = """echo "uv $*" >> "{log}"
case "$*" in venv*) mkdir -p .venv/bin && cp {venv_python} .venv/bin/python ;; esac
exit 0
"""
H100_SMI = ('case "$*" in\n  *--query-gpu=name*) echo "NVIDIA H100 80GB HBM3" ;;\n'
            '  *--query-gpu=compute_cap*) echo 9.0 ;;\n  *--query-gpu=driver_version*) echo 580.1 ;;\n'
            '  *--query-gpu=memory.total*) echo 81559 ;;\n'
            '  "") echo "| NVIDIA-SMI 580.1   Driver Version: 580.1   CUDA Version: 12.9 |" ;;\nesac\n')


@pytest.mark.parametrize("gpu, preset, shared, extras", [
    (True, "h100", True, "web,dev,gpu,hub"),   # a GPU preset: MMLU / ARC / GSM8K train splits only the hub has
    (False, "tiny", False, "web,dev,hub"),     # a fresh clone without ../shared/data: every chat stage reads the hub
    (False, "tiny", True, "web,dev"),          # the offline data beside the checkout: as before (no venv churn)
    (True, "tiny", True, "web,dev,gpu"),       # tiny on a GPU box reads the offline data: no hub (it was by GPU)
])
def test_env_stage_installs_the_hub_extra_where_the_chat_stages_need_it(tmp_path, gpu, preset, shared, extras):
    clone = make_clone(tmp_path, home=True)
    if shared:   # ../shared/data beside the clone
        for sub in ("eval", "sft"):
            (tmp_path / "shared" / "data" / sub).mkdir(parents=True)
    log = tmp_path / "uv.log"
    tools = {"uv": UV.format(log=log, venv_python=tmp_path / "venv_python")}
    if gpu:
        tools["nvidia-smi"] = H100_SMI
    bin_dir = fake_env_tools(tmp_path, VENV_PYTHON, tools)
    rc, out = _run(clone, "./setup.sh", "--preset", preset, "--only", "env",
                   "--base-dir", tmp_path / "base", bin_dir=bin_dir)
    assert rc == 0, out
    assert f"==> installing nanochat-spark[{extras}]\n" in out, out
    assert f"-e .[{extras}]" in log.read_text(), log.read_text()


def test_with_the_hub_there_a_missing_word_list_is_not_sent_to_the_hub_extra(tmp_path):
    """With `datasets` importable the check looks only for the word list, which has no hub copy: the
    refusal told the user to install the hub extra, already there (review of session 76)."""
    clone, log = _clone(tmp_path)
    (tmp_path / "none").mkdir()
    fake = tmp_path / "pkgs" / "datasets"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")   # found by importlib.util.find_spec, as an installed `datasets`
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--from", "data", "--base-dir", tmp_path / "base",
                   NANOCHAT_EVAL_DIR=tmp_path / "none", NANOCHAT_SFT_DIR=tmp_path / "none",
                   PYTHONPATH=f"{tmp_path / 'pkgs'}:{Path(__file__).resolve().parents[1]}")
    assert rc == 2 and "would stop on its data" in out, out
    assert "install the hub extra" not in out and "Put the files named above in place" in out, out
    assert not log.exists(), out


@pytest.mark.parametrize("preset, marker, extras", [
    ("tiny", "extras=web,dev,gpu,hub", "web,dev,gpu,hub"),   # installed by an earlier h100 run: it stays
    ("tiny", "extras=web,dev,gpu", "web,dev,gpu"),           # never installed: tiny does not add it
    ("tiny", None, "web,dev,gpu"),
    ("h100", None, "web,dev,gpu,hub"),
])
def test_switching_to_tiny_after_a_gpu_preset_keeps_the_hub_and_the_venv(tmp_path, preset, marker, extras):
    """The hub extra by preset made `--preset tiny` after `--preset h100` on one GPU box another
    extras list than the env marker's: the env stage reinstalled the venv (uv, rustbpe) at every switch
    of preset (review of 76). env_extras, sourced as setup.sh sources it."""
    repo = tmp_path / "repo"
    (repo / ".venv").mkdir(parents=True)
    for sub in ("eval", "sft"):
        (tmp_path / "shared" / "data" / sub).mkdir(parents=True)
    if marker is not None:
        (repo / ".venv" / ".setup-env.done").write_text(f"python=x\n{marker}\nbytecode=compiled\n")
    script = Path(__file__).resolve().parents[1] / "scripts" / "setup_env.sh"
    out = subprocess.run(["bash", "-c", f'REPO="$1"; PRESET="$2"; GPU_NAME="NVIDIA H100"; GPU_CC=9.0; '
                          f'CUDA_DRIVER_VERSION=12.9; source "$3"; env_extras', "_", str(repo), preset, str(script)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == extras, (out.stdout, out.stderr)
