"""run_train.sh defects found by the set-up / launch audit (session 52), with a fake interpreter
(no training): a relative --base-dir or NANOCHAT_BASE_DIR named another directory once the run
started in the repo (no pid file: "the run did not start", its log elsewhere); an empty --base-dir
wrote under /runs; an option of another mode (--timeout to a start, --nproc to --status, ...) was
taken and ignored; --depth 012 kept its runs under d012 while base_train saves d12."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_train.sh"

FAKE_PYTHON = """#!/bin/bash
# stands in for python: passes the flag check ("python -"), then logs where it runs and sleeps
if [[ "$1" == "-" ]]; then cat > /dev/null; exit 0; fi
echo "step 00001/00010 | base $NANOCHAT_BASE_DIR"
exec sleep 30
"""


@pytest.fixture
def call(tmp_path):
    """call(*args, cwd=tmp_path, base_env=None) -> CompletedProcess of run_train.sh with the fake python."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "NANOCHAT_BASE_DIR")}
    env["NANOCHAT_PYTHON"] = str(fake)

    def run(*args, cwd=tmp_path, base_env=None):
        e = dict(env, **({"NANOCHAT_BASE_DIR": base_env} if base_env is not None else {}))
        return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=60)
    yield run
    for pid_file in tmp_path.rglob("runs/*/pid"):   # a run left going (the fake sleeps 30 s): its group
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


@pytest.mark.parametrize("how", ["flag", "env"])
def test_a_relative_base_dir_is_the_callers(call, tmp_path, how):
    """run_train.sh --base-dir rel (or NANOCHAT_BASE_DIR=rel) from tmp_path: the pid file, the log
    and the run's NANOCHAT_BASE_DIR are tmp_path/rel's, and --status / --stop find the run."""
    args = ("--base-dir", "rel") if how == "flag" else ()
    env = None if how == "flag" else "rel"
    r = call(*args, "--depth", "3", base_env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = tmp_path / "rel" / "runs" / "d3"
    assert f"log:    {run_dir}/train.log" in r.stdout, r.stdout
    deadline = time.time() + 10
    while "step 00001" not in (run_dir / "train.log").read_text() and time.time() < deadline:
        time.sleep(0.1)
    assert f"step 00001/00010 | base {tmp_path}/rel\n" in (run_dir / "train.log").read_text()
    st = call(*args, "--status", "--model-tag", "d3", base_env=env)
    assert st.returncode == 0 and "[d3] running (pid" in st.stdout, st.stdout
    stop = call(*args, "--stop", "--timeout", "5", base_env=env)
    assert stop.returncode == 0 and "[d3] stopped" in stop.stdout, stop.stdout + stop.stderr


@pytest.mark.parametrize("args, said", [
    (["--depth", "3", "--timeout", "60"], "--timeout: got it to start a run; accepted: --timeout with --stop only"),
    (["--depth", "3", "--lines=5"], "--lines: got it to start a run; accepted: --lines with --status only"),
    (["--status", "--nproc", "2"], "--nproc: got it with --status; accepted: --nproc when starting a run"),
    (["--stop", "--lines", "3"], "--lines: got it with --stop; accepted: --lines with --status only"),
    (["--status", "--timeout", "3"], "--timeout: got it with --status"),
    (["--status", "--stop"], "--status and --stop: got both; accepted: one of the two"),
    (["--base-dir", "", "--status"], "--base-dir: got ''; accepted: a directory"),
])
def test_an_option_of_another_mode_is_refused(call, tmp_path, args, said):
    r = call(*args)
    assert r.returncode == 2 and said in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "runs").exists() and "started" not in r.stdout


def test_depth_with_a_leading_zero_is_base_trains_tag(call, tmp_path):
    r = call("--base-dir", str(tmp_path / "b"), "--depth", "012")
    assert r.returncode == 0 and "[d12] started pid" in r.stdout, r.stdout + r.stderr
    assert (tmp_path / "b" / "runs" / "d12" / "pid").exists()
    st = call("--base-dir", str(tmp_path / "b"), "--status", "--lines", "08")   # not octal
    assert st.returncode == 0 and "last 8 log lines" in st.stdout, st.stdout + st.stderr
