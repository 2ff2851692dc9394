"""setup.sh / run_train.sh / scripts/ensure_uv.sh defects found by the third first-user review, each
test failing on the code before its fix. Stages are faked (a clone whose .venv/bin/python is a shell
script), so the file runs in seconds.

- `--base-dir=~/nc` reaches the script with the ~ unexpanded (the shell expands it only at a word's
  start): setup.sh and run_train.sh took it as relative and wrote under a directory named '~' in
  the caller's directory.
- The "rerun ... to continue" hints dropped the settings taken from the environment: a run started
  as `NANOCHAT_BASE_DIR=/data/nc ./setup.sh`, stopped by a hangup and rerun as told from a new shell
  started over in ~/.cache/nanochat.
- The free-disk check measured the repository's filesystem, not the base dir's, where the data and
  the checkpoints go: a base dir on a full disk passed, one on a big disk beside a small root was
  refused.
- ensure_uv: a python3 with pip that refuses a --user install both ways (a python3 of another
  virtualenv) never tried uv's own installer, then said "pip and curl both failed".
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
# a stage: says what it was asked; the data stage exits with $FAKE_RC
echo "fake python $*"
if [[ "$*" == *nanochat.dataset* ]]; then exit "${FAKE_RC:-0}"; fi
exit 0
"""


@pytest.fixture
def clone(tmp_path) -> Path:
    """A repo with setup.sh, run_train.sh, their helpers and a fake .venv whose python is FAKE_PYTHON."""
    return make_clone(tmp_path, FAKE_PYTHON, names=("setup.sh", "run_train.sh"), home=True)


def _run(repo: Path, *args, cwd: Path | None = None, bin_dir: Path | None = None, **env):
    """bash ARGS in cwd (default the clone) with HOME in tmp_path, no GPU tools and a python3 >= 3.10."""
    path = f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"
    if bin_dir is not None:
        path = f"{bin_dir}:{path}"
    e = {"PATH": path, "HOME": str(repo.parent / "home"), **{k: str(v) for k, v in env.items()}}
    out = subprocess.run([BASH, *args], capture_output=True, text=True, timeout=60, cwd=cwd or repo, env=e)
    return out.returncode, out.stdout + out.stderr


def test_a_tilde_base_dir_is_the_home_directory(clone, tmp_path):
    """--base-dir=~/nc (and NANOCHAT_BASE_DIR='~/nc') is $HOME/nc, for setup.sh and run_train.sh."""
    home = tmp_path / "home"
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir=~/nc")
    assert rc == 0, out
    assert (home / "nc" / "setup_state" / "data.done").is_file(), out
    assert not (clone / "~").exists(), out
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", NANOCHAT_BASE_DIR="~/nc")
    assert rc == 0 and "[data] done already" in out, out
    rc, out = _run(clone, "./run_train.sh", "--status", "--base-dir=~/nc")
    assert rc == 3 and f"no runs in {home}/nc/runs" in out, out


@pytest.mark.parametrize("rc", [1, 130])
def test_how_to_continue_keeps_the_environments_settings(clone, tmp_path, rc):
    """A base dir, a wandb run and a torch index from the environment are in the rerun hint (the base
    dir absolute); a --base-dir flag wins over the environment's and is not repeated."""
    base = tmp_path / "my base"
    code, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", FAKE_RC=rc,
                     NANOCHAT_BASE_DIR=base, WANDB_RUN="r1", TORCH_INDEX_URL="https://example.invalid/whl")
    assert code == rc, out
    line = next(x for x in out.splitlines() if x.startswith("setup.sh: st"))
    want = (f"NANOCHAT_BASE_DIR={str(base).replace(' ', chr(92) + ' ')} WANDB_RUN=r1 "
            "TORCH_INDEX_URL=https://example.invalid/whl ./setup.sh --preset tiny --only data")
    assert f"un {want}" in line, line   # "Rerun CMD to continue" / "rerun CMD: finished stages"
    code, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir", str(base),
                     FAKE_RC=rc, NANOCHAT_BASE_DIR=tmp_path / "other")
    line = next(x for x in out.splitlines() if x.startswith("setup.sh: st"))
    assert "NANOCHAT_BASE_DIR" not in line, line


FAKE_DF = """#!/usr/bin/env bash
# df -Pk PATH: 1 GB free on the filesystem mounted at /small (any path under $SMALL), 500 GB elsewhere
p="${@: -1}"
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
if [[ "$p" == "$SMALL"* ]]; then echo "small 2000000 1000000 1048576 50% /small"
else echo "big 600000000 1000000 524288000 1% /"; fi
"""


@pytest.mark.parametrize("small", ["base", "repo"])
def test_free_disk_is_measured_where_the_artefacts_go(clone, tmp_path, small):
    """A full disk under the base dir stops the run naming the base dir; a base dir on a big disk
    beside a small repo disk runs (the repo's disk holds only the .venv, which is there already)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "df").write_text(FAKE_DF)
    (bin_dir / "df").chmod(0o755)
    base = tmp_path / "base"
    base.mkdir()   # e.g. a mounted disk
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir", str(base),
                   bin_dir=bin_dir, SMALL=base if small == "base" else clone)
    if small == "base":
        assert rc == 2 and f"only 1 GB free at {base}" in out and "[data]" not in out, out
    else:
        assert rc == 0 and "free disk 500 GB" in out and "[data] finished" in out, out


def test_ensure_uv_tries_uvs_installer_when_pip_refuses(tmp_path):
    """pip is there but refuses --user both ways (a python3 of another virtualenv): uv's installer."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    make_uv = 'mkdir -p "$HOME/.local/bin"; printf "#!/bin/sh\\n" > "$HOME/.local/bin/uv"; chmod +x "$HOME/.local/bin/uv"'
    tools = {
        "python3": '#!/bin/sh\ncase "$*" in "-m pip --version") exit 0 ;; esac\n'
                   'echo "ERROR: Can not perform a \'--user\' install." >&2; exit 1\n',
        "curl": f"#!/bin/sh\ncat <<'INSTALLER'\n{make_uv}\nINSTALLER\n",
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for name in ("env", "sh", "mkdir", "chmod", "cat"):
        (bin_dir / name).symlink_to(shutil.which(name))
    script = f'source {REPO / "scripts" / "ensure_uv.sh"}; ensure_uv {bin_dir / "python3"}; rc=$?; command -v uv; exit $rc'
    out = subprocess.run(["/bin/bash", "-c", script], env={"HOME": str(home), "PATH": str(bin_dir)},
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("/.local/bin/uv") and (home / ".local" / "bin" / "uv").exists()


def test_a_second_setup_on_the_same_base_dir_is_refused(clone, tmp_path):
    """Two setup.sh runs on one base dir ran the same stages at once (two base_trains saving into one
    checkpoint directory): the second now stops before any stage, naming the first's pid; another
    base dir, or a dry run, is not held up; once the first ends the base dir is free again."""
    base, started = tmp_path / "base", tmp_path / "started"
    args = ["./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir", str(base)]
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path / "home"),
           "FAKE_SLEEP": "30", "FAKE_STARTED": str(started)}
    fake = clone / ".venv" / "bin" / "python"   # this test's stage: sleeps until told
    fake.write_text('#!/usr/bin/env bash\necho "fake python $*"\n[[ "$*" != *nanochat.dataset* || -z "${FAKE_SLEEP:-}" ]]'
                    ' || { touch "$FAKE_STARTED"; exec sleep "$FAKE_SLEEP"; }\n')
    first = subprocess.Popen([BASH, *args], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        for _ in range(200):
            if started.exists():
                break
            time.sleep(0.05)
        assert started.exists(), "the first run's data stage did not start"
        rc, out = _run(clone, *args)
        assert rc == 2 and f"another ./setup.sh (pid {first.pid}) is running on {base}" in out, out
        assert "[data]" not in out, out
        rc, out = _run(clone, *args, "--dry-run")
        assert rc == 0 and "[data] python -m nanochat.dataset" in out, out
        rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir", str(tmp_path / "b2"))
        assert rc == 0 and "[data] finished" in out, out
    finally:
        first.terminate()   # SIGTERM: setup.sh passes it on to the stage and stops
        first.communicate(timeout=30)
    rc, out = _run(clone, *args, "--force")
    assert rc == 0 and "[data] finished" in out, out


@pytest.mark.parametrize("tag", [".", ".."])
def test_run_train_refuses_a_dot_model_tag(clone, tag):
    """--model-tag .. named the base dir itself (--status reported it as a run)."""
    rc, out = _run(clone, "./run_train.sh", "--status", "--model-tag", tag, NANOCHAT_BASE_DIR=clone.parent / "b")
    assert rc == 2 and f"--model-tag: got '{tag}'" in out, out


def test_a_lock_left_to_an_orphan_or_unsupported_is_said_so(clone, tmp_path):
    """The setup.sh that took the lock is gone (kill -9) while a process it started holds it: the
    message no longer sends the user to kill a dead (maybe reused) pid. A filesystem without locks
    (flock's other exit codes) warns and goes on, instead of reading as "another setup.sh"."""
    base = tmp_path / "base"
    lock = base / "setup_state" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("999999999\n")   # no such pid
    holder = subprocess.Popen(["flock", str(lock), "sleep", "30"])
    try:
        for _ in range(100):   # until the holder has it
            if subprocess.run(["flock", "-n", str(lock), "true"]).returncode != 0:
                break
            time.sleep(0.05)
        rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir", str(base))
        assert rc == 2 and "a process an earlier ./setup.sh started still holds" in out and "fuser -v" in out, out
    finally:
        holder.kill()
        holder.wait()
    fake = tmp_path / "nolock"
    fake.mkdir()
    (fake / "flock").write_text("#!/bin/sh\nexit 71\n")   # util-linux: a lock the filesystem refuses
    (fake / "flock").chmod(0o755)
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data", "--base-dir", str(base), bin_dir=fake)
    assert rc == 0 and "cannot lock" in out and "[data] finished" in out, out
