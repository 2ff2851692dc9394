"""A throwaway copy of setup.sh (and run_train.sh) with the helper scripts they source, and
optionally a fake .venv python: what the setup tests run instead of the real pipeline. One place
names the sourced helpers, so a new one (setup_stages.sh) is one edit, not one per test file."""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCED = ("ensure_uv.sh", "setup_env.sh", "setup_stages.sh", "setup_gpus.sh", "setup_batch.sh")   # what setup.sh sources from scripts/


def make_clone(tmp_path: Path, fake_python: str | None = None, *, names=("setup.sh",), home: bool = False) -> Path:
    """tmp_path/clone with `names` from the repo root and scripts/SOURCED; `fake_python`: the text of
    an executable .venv/bin/python; `home`: make tmp_path/home too."""
    repo = tmp_path / "clone"
    (repo / "scripts").mkdir(parents=True)
    for name in names:
        shutil.copy(REPO / name, repo / name)
    for helper in SOURCED:
        shutil.copy(REPO / "scripts" / helper, repo / "scripts" / helper)
    if fake_python is not None:
        py = repo / ".venv" / "bin" / "python"
        py.parent.mkdir(parents=True)
        py.write_text(fake_python)
        py.chmod(0o755)
    if home:
        (tmp_path / "home").mkdir()
    return repo


def fake_env_tools(tmp_path: Path, venv_python: str, extra: dict[str, str] | None = None) -> Path:
    """tmp_path/bin holding the env stage's tools as fakes: cargo and cc succeed, `uv venv` makes a
    .venv whose python is the script `venv_python`; `extra`: {name: bash body} (e.g. nvidia-smi)."""
    venv_py = tmp_path / "venv_python"
    venv_py.write_text(venv_python)
    venv_py.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {"cargo": "exit 0\n", "cc": "exit 0\n",
             "uv": f'case "$*" in venv*) mkdir -p .venv/bin && cp {venv_py} .venv/bin/python ;; esac\nexit 0\n',
             **(extra or {})}
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/usr/bin/env bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return bin_dir
