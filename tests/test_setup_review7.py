"""setup.sh / scripts/setup_stages.sh / scripts/setup_env.sh / run_train.sh defects found by the
seventh first-user review, each test failing on the code before its fix. Stages are faked (a clone
whose .venv/bin/python is a shell script; fake uv, cargo and cc; a fake interpreter for
run_train.sh), so the file runs in a few seconds.

- run_train.sh printed `./run_train.sh --status --model-tag T` (and --stop) after a start with
  --base-dir: typed as shown they looked in ~/.cache/nanochat, --status said "not running" and
  --stop "[T] is not running" (exit 0) while the run went on.
- A refused `--from` pointed at `./setup.sh --from STAGE`, dropping the run's own flags (--base-dir,
  --preset, ...): that command looked in another base dir. And the rerun hints dropped a flag's
  value that reads like --force (`--conversations --force`), leaving a broken command.
- `--device-batch-size=-` (the old "not given" mark) was silently the preset's batch.
- `--conversations=~/c.jsonl` was said not to exist (its ~ unexpanded, unlike --base-dir's), and
  `./c.jsonl` vs `c.jsonl` made different mid / SFT commands, so a rerun retrained the chat stages.
- The env stage's closing import check (torch + rustbpe) ended setup.sh under `set -e` with a bare
  traceback: no line naming the stage or the command to rerun.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.setup_clone import fake_env_tools, make_clone
from tests.test_setup_review3 import _run

REPO = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"

FAKE_PYTHON = """#!/usr/bin/env bash
echo "fake python $*"
[[ -z "${FAKE_FAIL:-}" || "$*" != *"$FAKE_FAIL"* ]] || exit 3
exit 0
"""


@pytest.fixture
def clone(tmp_path) -> Path:
    return make_clone(tmp_path, FAKE_PYTHON, home=True)


def _commands(out: str) -> dict[str, list[str]]:
    """The dry run's '==> [stage] CMD' lines -> {stage: argv}."""
    cmds = {}
    for line in out.splitlines():
        if line.startswith("==> [") and "] python" in line:
            stage, cmd = line[5:].split("] ", 1)
            cmds[stage] = shlex.split(cmd)
    return cmds


# ---------------------------------------------------------------- run_train.sh's printed commands
RT_FAKE_PYTHON = """#!/bin/bash
# stands in for python: passes the flag check ("python -"), then sleeps like a training run
if [[ "$1" == "-" ]]; then cat > /dev/null; exit 0; fi
echo "step 00001/00010"
exec sleep 30
"""


def test_run_train_prints_status_and_stop_commands_that_find_the_run(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(RT_FAKE_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NANOCHAT_BASE_DIR")}
    env.update(NANOCHAT_PYTHON=str(fake), HOME=str(tmp_path / "home"))
    base = tmp_path / "runs here" / "b"

    def sh(cmd: str):
        return subprocess.run([BASH, "-c", cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)

    start = sh(f"{shlex.quote(str(REPO / 'run_train.sh'))} --base-dir {shlex.quote(str(base))} --depth 3")
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        said = dict(line.split(": ", 1)[1].strip().split(":", 1) for line in start.stdout.splitlines()
                    if line.startswith("run_train.sh:   status:") or line.startswith("run_train.sh:   stop:"))
        status = sh(said["status"].strip())   # typed as printed, from where the user is
        assert status.returncode == 0 and "[d3] running (pid" in status.stdout, (said, status.stdout + status.stderr)
        stop = sh(said["stop"].strip() + " --timeout 5")
        assert stop.returncode == 0 and "[d3] stopped" in stop.stdout, (said, stop.stdout + stop.stderr)
    finally:
        pid_file = base / "runs" / "d3" / "pid"
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    # a --stop in the wrong base dir says where it looked, not a bare "not running"
    wrong = sh(f"{shlex.quote(str(REPO / 'run_train.sh'))} --stop --model-tag d3")
    assert f"is not running in {tmp_path / 'home' / '.cache' / 'nanochat' / 'runs'}" in wrong.stdout, wrong.stdout


# ---------------------------------------------------------------- setup.sh's hints
def test_a_refused_from_names_the_users_own_command(clone, tmp_path):
    # a file named '--force' (an --identity name may not start with '-': setup.sh refuses it)
    (clone / "--force").write_text('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]\n')
    base = tmp_path / "my base"
    args = ["--preset", "tiny", "--base-dir", str(base), "--conversations", "--force", "--from", "base_train"]
    rc, out = _run(clone, "./setup.sh", *args)
    assert rc == 2 and "--from: got 'base_train'" in out, out
    hint = out.split("so rerun with --from data (", 1)[1].split(") or without --from", 1)[0]
    want = ["./setup.sh", "--preset", "tiny", "--base-dir", str(base), "--conversations", "--force", "--from", "data"]
    assert shlex.split(hint) == want, hint
    rc, out = _run(clone, "./setup.sh", *args[:-2], "--from=tokenizer")   # the = spelling is replaced too
    hint = out.split("so rerun with --from data (", 1)[1].split(") or without --from", 1)[0]
    assert rc == 2 and shlex.split(hint) == want, out


def test_a_failed_stage_keeps_a_flag_value_that_reads_like_force(clone, tmp_path):
    """`--conversations --force` (a file named so): the rerun hint dropped the value '--force', leaving
    `--conversations --only` (the test used `--identity --force`, a name setup.sh now refuses)."""
    (clone / "--force").write_text('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]\n')
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--conversations", "--force", "--only", "data",
                   "--base-dir", tmp_path / "base", FAKE_FAIL="nanochat.dataset")
    assert rc == 1, out
    line = next(x for x in out.splitlines() if x.startswith("setup.sh: stage 'data' failed"))
    hint = line.split("rerun ", 1)[1].split(": finished", 1)[0]
    assert shlex.split(hint)[1:] == ["--preset", "tiny", "--conversations", "--force", "--only", "data",
                                     "--base-dir", str(tmp_path / "base")], line


# ---------------------------------------------------------------- flag values
def test_device_batch_size_dash_is_not_the_presets(clone, tmp_path):
    for spelling in (["--device-batch-size=-"], ["--device-batch-size", "-"]):
        rc, out = _run(clone, "./setup.sh", "--dry-run", "--preset", "tiny", *spelling, "--base-dir", tmp_path / "b")
        assert rc == 2 and "--device-batch-size: got '-'; accepted: an integer 1-1024" in out, out
        assert "==> [" not in out, out


def test_conversations_tilde_and_spellings_name_one_file(clone, tmp_path):
    home = tmp_path / "home"
    (home / "c.jsonl").write_text('{"messages": []}\n')
    want = str(home / "c.jsonl")
    seen = []
    for spelling, cwd in (("--conversations=~/c.jsonl", clone), ("--conversations=./c.jsonl", home),
                          ("--conversations=c.jsonl", home), ("--conversations=../home/c.jsonl", home)):
        rc, out = _run(clone, str(clone / "setup.sh"), "--dry-run", "--preset", "tiny", "--only", "chat_sft",
                       spelling, "--base-dir", tmp_path / "b", cwd=cwd)
        assert rc == 0, (spelling, out)
        cmd = _commands(out)["chat_sft"]
        seen.append(cmd[cmd.index("--extra-conversations") + 1])
    assert seen == [want] * 4, seen


# ---------------------------------------------------------------- the env stage
def test_env_stage_whose_venv_cannot_import_names_the_stage(clone, tmp_path):
    """The installs pass, but the venv cannot import rustbpe: one line naming the env stage and the
    rerun, exit 1 (was: set -e ended setup.sh on the traceback alone)."""
    shutil.rmtree(clone / ".venv")
    # what `uv venv` makes: a python whose closing import check fails
    bin_dir = fake_env_tools(tmp_path, "#!/usr/bin/env bash\n"
                             "case \"$*\" in *'import rustbpe, torch; print'*) echo 'No module named rustbpe' >&2; exit 1 ;;\n"
                             "  *sysconfig*) echo /nonexistent ;; esac\nexit 0\n")
    t0 = time.time()
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "env", "--base-dir", tmp_path / "base",
                   bin_dir=bin_dir)
    assert rc == 1, out
    line = next((x for x in out.splitlines() if x.startswith("setup.sh: stage 'env' failed")), "")
    assert "running: .venv/bin/python -c" in line and "rerun ./setup.sh --preset tiny --only env" in line, out
    assert not (clone / ".venv" / ".setup-env.done").exists() and time.time() - t0 < 30
