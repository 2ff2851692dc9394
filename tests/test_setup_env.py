"""setup.sh's env stage helpers (scripts/setup_env.sh) that run without installing anything: the
venv's packages compiled to bytecode, so that processes started under PYTHONDONTWRITEBYTECODE=1 do
not compile torch again on every import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"

# a venv python that reports `site` as its purelib and is the real interpreter otherwise
WRAPPER = """#!/usr/bin/env bash
if [[ "$1" == "-c" ]]; then echo "{site}"; exit 0; fi
exec "{python}" "$@"
"""


def test_compile_bytecode_writes_pycs_and_counts_files_for_a_newer_python(tmp_path):
    repo, site = tmp_path / "repo", tmp_path / "site"
    (repo / ".venv" / "bin").mkdir(parents=True)
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("X = 1\n")
    (site / "pkg" / "newer.py").write_text("def f[T](a): ...\nclass C:\n  def g(self) -> int: return 1\n"
                                           if sys.version_info < (3, 12) else "match = (\n")
    py = repo / ".venv" / "bin" / "python"
    py.write_text(WRAPPER.format(site=site, python=sys.executable))
    py.chmod(0o755)
    script = f'say() {{ echo "==> $*"; }}; REPO={repo}; cd {repo}; source {REPO}/scripts/setup_env.sh; compile_bytecode'
    out = subprocess.run([BASH, "-c", script], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert list((site / "pkg" / "__pycache__").glob("__init__.*.pyc")), out.stdout
    assert "==> bytecode: the venv's packages compiled in" in out.stdout
    assert "(1 file(s) skipped, see " in out.stdout, out.stdout
    assert "newer.py" in (repo / ".venv" / ".compileall.log").read_text()
