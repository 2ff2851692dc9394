"""setup.sh defects found by the first-user review of the tiny preset (each test fails on the code
before its fix). Stages are faked: a copy of setup.sh in a temporary clone whose .venv/bin/python
is a shell script, so every test runs in well under a second.

- The lines that say how to continue after a stop (Ctrl-C, SIGTERM, a hangup) or a failed stage
  said "rerun ./setup.sh", dropping the flags of the run: `./setup.sh --depth 12` stopped on day 2
  and rerun as told trained a new d20 from scratch instead of resuming d12. They now print the
  command line that was run (less --force, which would redo the stages this run finished).
- bash reads a script as it runs it: a setup.sh edited in place while a stage ran (an editor that
  rewrites the file, `cat > setup.sh`) went on from the old byte offset in the new text once the
  stage ended. The whole script is now read before any of it runs.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.setup_clone import make_clone

REPO = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"
SETUP = REPO / "setup.sh"

FAKE_PYTHON = """#!/usr/bin/env bash
# a stage: says what it was asked, waits for $FAKE_SLEEP seconds, exits with $FAKE_RC for data
echo "fake python $*"
if [[ "$*" == *nanochat.dataset* ]]; then
  [[ -z "${FAKE_STARTED:-}" ]] || touch "$FAKE_STARTED"
  sleep "${FAKE_SLEEP:-0}"; exit "${FAKE_RC:-0}"
fi
exit 0
"""


@pytest.fixture
def clone(tmp_path) -> Path:
    """A repo with setup.sh, its helpers and a fake .venv whose python is FAKE_PYTHON."""
    return make_clone(tmp_path, FAKE_PYTHON)


def _env(repo: Path, **extra) -> dict[str, str]:
    """No GPU tools, a python3 >= 3.10 (this one), HOME in tmp_path; FAKE_* for the fake stages."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(repo.parent),
            **{k: str(v) for k, v in extra.items()}}


def _run(repo: Path, *args, rc: int = 0, cwd: Path | None = None):
    """bash ARGS (setup.sh and its flags) in cwd (default the clone), the fake data stage exiting rc."""
    return subprocess.run([BASH, *args], capture_output=True, text=True, timeout=60, cwd=cwd or repo,
                          env=_env(repo, FAKE_RC=rc))


@pytest.mark.parametrize("rc, said", [
    (130, "setup.sh: stopped by Ctrl-C in stage 'data' (exit 130). Rerun {cmd} to continue"),
    (143, "setup.sh: stopped by SIGTERM in stage 'data' (exit 143). Rerun {cmd} to continue"),
    (1, "setup.sh: stage 'data' failed (exit 1). Fix the problem and rerun {cmd}: finished stages"),
])
def test_how_to_continue_names_the_runs_own_flags(clone, tmp_path, rc, said):
    """A stopped or failed stage: the hint is the command that was run, flags and all (a path with a
    space quoted), as typed (./setup.sh from the repo), without --force."""
    base = tmp_path / "my base"
    args = ["--preset", "tiny", "--depth", "4", "--only", "data,base_train", "--force", "--base-dir", str(base)]
    run = _run(clone, "./setup.sh", *args, rc=rc)
    out = run.stdout + run.stderr
    assert run.returncode == (1 if rc == 1 else rc), out
    line = next(x for x in out.splitlines() if x.startswith("setup.sh: st"))
    before, hint = said.split("{cmd}")
    assert line.startswith(before) and hint in line and "[base_train]" not in out, out
    cmd = line.removeprefix(before).split(hint)[0]
    assert shlex.split(cmd) == ["./setup.sh", *(a for a in args if a != "--force")], line


def test_how_to_continue_from_another_directory(clone, tmp_path):
    """`bash /path/to/setup.sh` from elsewhere: the hint names the script as it was run."""
    run = _run(clone, str(clone / "setup.sh"), "--preset", "tiny", "--only", "data", "--base-dir", "rel",
               rc=130, cwd=tmp_path)
    assert run.returncode == 130, run.stdout + run.stderr
    assert f"Rerun {clone}/setup.sh --preset tiny --only data --base-dir rel to continue" in run.stderr, run.stderr
    run = _run(clone, "setup.sh", "--preset", "tiny", "--only", "data", rc=130)   # `bash setup.sh`
    assert "Rerun ./setup.sh --preset tiny --only data to continue" in run.stderr, run.stderr


def test_setup_sh_edited_while_a_stage_runs(clone, tmp_path):
    """The file changes under a running setup.sh (rewritten in place, lines added at the top): the
    run goes on with the text it started with and ends as it should."""
    base = tmp_path / "base"
    started = tmp_path / "started"
    env = _env(clone, FAKE_SLEEP=2, FAKE_STARTED=started)
    proc = subprocess.Popen([BASH, "./setup.sh", "--preset", "tiny", "--only", "data,report", "--base-dir",
                             str(base)], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 30
        while not started.exists():   # the data stage (FAKE_SLEEP 2 s) is running
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        text = (clone / "setup.sh").read_text()
        with open(clone / "setup.sh", "w") as f:   # in place: the same inode, as `cat > file` does
            f.write("#!/usr/bin/env bash\n" + "# an added line of comment text\n" * 40 + text.split("\n", 1)[1])
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "==> [data] finished" in out and "==> [report] finished" in out, out
    assert "Report written to" in out and "syntax error" not in out and "command not found" not in out, out


def test_a_fresh_pipeline_resets_the_report_and_a_rerun_does_not(clone, tmp_path):
    """setup.sh never ran `python -m nanochat.report reset`, so report.md said "no `python -m
    nanochat.report reset` started this run" and had no start time or total. A run in which no stage
    after env has finished starts the report; a rerun (stages done) keeps what it holds."""
    base = tmp_path / "base"
    first = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data,report", "--base-dir", str(base))
    assert first.returncode == 0, first.stdout + first.stderr
    calls = [x for x in first.stdout.splitlines() if x.startswith("fake python")]
    assert calls[0] == "fake python -m nanochat.report reset", calls
    assert any("nanochat.dataset" in c for c in calls[1:]), calls
    again = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "data,report", "--base-dir", str(base),
                 "--force")
    assert again.returncode == 0 and "nanochat.report reset" not in again.stdout, again.stdout
    later = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "report", "--base-dir", str(tmp_path / "b2"))
    assert later.returncode == 0 and "nanochat.report reset" not in later.stdout, later.stdout   # no data stage
