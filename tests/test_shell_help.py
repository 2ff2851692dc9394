"""Every shell script a user runs (scripts/*.sh that is not a library setup.sh sources, plus setup.sh
and run_train.sh) answers --help with its usage on stdout and exit 0, as the README says every
script does (alt_triton.sh and fa4_install.sh printed their usage as an error, exit 2)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _runnable() -> list[Path]:
    scripts = [REPO / "setup.sh", REPO / "run_train.sh"]
    for path in sorted((REPO / "scripts").glob("*.sh")):
        head = "\n".join(path.read_text().splitlines()[:3]).lower()
        if "sourced by" not in head and "sourced," not in head:   # libraries setup.sh sources
            scripts.append(path)
    return scripts


@pytest.mark.parametrize("script", _runnable(), ids=lambda p: p.name)
def test_help_is_usage_and_exit_0(script):
    proc = subprocess.run(["bash", str(script), "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-1000:])
    assert len(proc.stdout.strip().splitlines()) >= 2 and not proc.stderr, (proc.stdout[:500], proc.stderr[-500:])


def test_the_libraries_left_out_are_only_sourced_ones():
    names = {p.name for p in _runnable()}
    assert {"alt_triton.sh", "fa4_install.sh", "gpu_check.sh", "te_install.sh", "launch_multinode.sh"} <= names
    assert not names & {"setup_env.sh", "setup_gpus.sh", "setup_stages.sh", "ensure_uv.sh"}
