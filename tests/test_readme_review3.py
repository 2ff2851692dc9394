"""More of README.md's statements about the code, read out of the README text (so an edit on either
side is caught): the extras pyproject.toml defines, the fields of the training step line, and the
free disk setup.sh asks for per preset. tests/test_docs_commands.py and
tests/test_readme_walkthrough.py check the README's commands, paths and preset figures.
"""
from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = " ".join((REPO / "README.md").read_text().split())   # sentences run over line breaks


def quoted(pattern: str) -> re.Match:
    m = re.search(pattern, README)
    assert m, f"README.md no longer says {pattern!r}: update this test with the README"
    return m


def test_the_readmes_extras_are_pyprojects():
    listed = quoted(r"pyproject\.toml dependencies and extras \(([^)]+)\)").group(1)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(x.strip() for x in listed.split(",")) == sorted(extras)


def test_the_step_line_has_the_readmes_fields_in_order():
    from nanochat.step_meter import StepMeter
    from nanochat.training import StepResult

    fields = quoted(r"The training log line: `([^`]+)`").group(1)
    documented = [re.sub(r"\s+\(.*\)$", "", f.strip()) for f in fields.split("|")]   # "lrm (LR multiplier)"
    meter = StepMeter(1e6, 1, peak_bf16=1e12, peak_active=2e12, precision="fp8", warmup_steps=0)
    m = meter.update(StepResult(step=3, loss=2.5, lrm=0.5, dt=0.25, tokens=4096, grad_norm=None))
    line = meter.log_line(m, 10)
    names = [part.split()[0] for part in line.split(" | ")]
    assert [n.replace("(fp8)", "(precision)") for n in names] == documented, (names, documented)
    assert re.search(r"\| eta +\S+$", line)   # every step line ends with an ETA


FAKE_DF = """#!/usr/bin/env bash
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "fake 999999999 1 {free_kb} 1% /"
"""
FAKE_SMI = """#!/usr/bin/env bash
case "$*" in
  *query-gpu=name*) echo "NVIDIA H100 80GB HBM3" ;;
  *compute_cap*) echo "9.0" ;;
  *driver_version*) echo "580.65.06" ;;
  *memory.total*) echo "81559" ;;
  "") echo "| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: 13.0 |" ;;
esac
"""


def _dry_run_warns_about_disk(tmp_path: Path, preset: str, free_gb: int) -> bool:
    bin_dir = tmp_path / f"bin_{preset}_{free_gb}"
    bin_dir.mkdir()
    (bin_dir / "df").write_text(FAKE_DF.format(free_kb=free_gb * 1048576))
    (bin_dir / "nvidia-smi").write_text(FAKE_SMI)
    for name in ("df", "nvidia-smi"):
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "WANDB_RUN")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    proc = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--preset", preset, "--only", "data",
                           "--base-dir", str(tmp_path / "base")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return "GB free at" in proc.stdout + proc.stderr


def test_the_free_disk_check_asks_what_the_readme_says(tmp_path):
    tiny = int(quoted(r"(\d+) GB for tiny").group(1))
    d20 = int(quoted(r"d20 about (\d+) GB in all").group(1))   # "about": within 10%
    assert _dry_run_warns_about_disk(tmp_path, "tiny", tiny - 1)
    assert not _dry_run_warns_about_disk(tmp_path, "tiny", tiny)
    assert _dry_run_warns_about_disk(tmp_path, "h100", int(0.9 * d20))   # the h100 preset trains d20
    assert not _dry_run_warns_about_disk(tmp_path, "h100", int(1.1 * d20) + 1)
