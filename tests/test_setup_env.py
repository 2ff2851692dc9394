"""Environment scripts, in what they do without installing anything: setup.sh's env stage compiles
the venv's packages to bytecode (scripts/setup_env.sh), so that processes started under
PYTHONDONTWRITEBYTECODE=1 do not compile torch again on every import; the GPU box's
scripts/gpu_check.sh and te_install.sh answer --help and bad arguments before any install."""

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


def test_gpu_check_help_and_unknown_sections_do_nothing_else(tmp_path):
    """scripts/gpu_check.sh --help printed nothing useful: it installed the carried wheels and failed;
    a misspelt section ran nothing and printed an empty summary. Both now answer before any work."""
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out")}
    run = lambda *a: subprocess.run([BASH, str(REPO / "scripts" / "gpu_check.sh"), *a], cwd=tmp_path, env=env,  # noqa: E731
                                    capture_output=True, text=True, timeout=30)
    out = run("--help")
    assert out.returncode == 0 and out.stdout.startswith("GPU-box check:") and "  tests      pytest -m cuda" in out.stdout
    out = run("tests,infr")
    assert out.returncode == 2 and "unknown section 'infr'; accepted: " in out.stderr, out.stderr
    assert " infer " in out.stderr and " tests " in out.stderr and not (tmp_path / "out").exists()
    te = [BASH, str(REPO / "scripts" / "te_install.sh")]
    out = subprocess.run([*te, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.startswith("Install Transformer Engine"), out.stderr
    out = subprocess.run(te, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and ".te/core.whl.name not found" in out.stderr and not list(tmp_path.iterdir())
