"""scripts/ensure_uv.sh, which setup.sh sources to get uv onto a fresh machine: pip --user, a PEP 668
Python retried with --break-system-packages, no pip at all (uv's own installer, told to leave the
shell files alone), a way out named when nothing works, and a uv already on PATH kept. Each test
runs the function with HOME in tmp_path and only fake tools on PATH, in well under a second.
setup.sh's other install steps: tests/test_setup.py."""

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ensure_uv(tmp_path, python: str, curl: str | None = None, uv_on_path: bool = False):
    """Run ensure_uv with HOME in tmp_path and only fake tools on PATH -> (rc, output, uv installed)."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    tools = {"python3": python, "curl": curl, "uv": "#!/bin/sh\nexit 0\n" if uv_on_path else None}
    for name, text in tools.items():
        if text is not None:
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    for name in ("env", "sh", "mkdir", "chmod", "cat"):   # what the fake installers use
        (bin_dir / name).symlink_to(shutil.which(name))
    script = f'source {REPO / "scripts" / "ensure_uv.sh"}; ensure_uv {bin_dir / "python3"}; rc=$?; ' \
             'command -v uv; exit $rc'
    out = subprocess.run(["/bin/bash", "-c", script], env={"HOME": str(home), "PATH": str(bin_dir)},
                         capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout + out.stderr, (home / ".local" / "bin" / "uv").exists()


_MAKE_UV = 'mkdir -p "$HOME/.local/bin"; printf "#!/bin/sh\\n" > "$HOME/.local/bin/uv"; chmod +x "$HOME/.local/bin/uv"'


def test_ensure_uv_retries_a_pep668_python_with_break_system_packages(tmp_path):
    python = f"""#!/bin/sh
case "$*" in
  "-m pip --version") exit 0 ;;
  *--break-system-packages*) {_MAKE_UV} ;;
  *"pip install"*) echo "error: externally-managed-environment" >&2; exit 1 ;;
esac
"""
    rc, out, installed = _ensure_uv(tmp_path, python)
    assert rc == 0 and installed, out
    assert "retrying with --break-system-packages" in out and out.strip().endswith("/.local/bin/uv")


def test_ensure_uv_without_pip_uses_uvs_installer_and_leaves_shell_files(tmp_path):
    python = "#!/bin/sh\nexit 1\n"   # no pip module
    curl = f"""#!/bin/sh
cat <<'INSTALLER'
[ "$UV_NO_MODIFY_PATH" = 1 ] || {{ echo "would edit shell files" >&2; exit 1; }}
{_MAKE_UV}
INSTALLER
"""
    rc, out, installed = _ensure_uv(tmp_path, python, curl)
    assert rc == 0 and installed, out


def test_ensure_uv_names_the_way_out_when_it_cannot(tmp_path):
    rc, out, installed = _ensure_uv(tmp_path, "#!/bin/sh\nexit 1\n")   # no pip, no curl
    assert rc == 2 and not installed
    assert "could not install uv" in out and "docs.astral.sh/uv" in out


def test_ensure_uv_keeps_a_uv_already_there(tmp_path):
    python = "#!/bin/sh\necho called >&2\nexit 1\n"
    rc, out, installed = _ensure_uv(tmp_path, python, uv_on_path=True)
    assert rc == 0 and not installed and "called" not in out and "installing" not in out, out
