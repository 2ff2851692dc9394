"""tests/conftest.py kills what a failed test left running: its scan must find an orphan started
in that test's body by this pytest session, and nothing else (not another test's, not another
session's, not a process still below pytest, e.g. a fixture's browser or torch's compile workers)."""

import os
import subprocess
import sys
import time

import pytest

from tests.conftest import SESSION_VAR, leftover_processes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc (Linux)")
SLEEP = f"{sys.executable} -c 'import time; time.sleep(30)'"


def _orphan(env) -> int:
    """Start a sleeper through a shell that exits at once: the sleeper is orphaned, as run_train.sh's
    nohup'd runs are. -> its pid."""
    out = subprocess.run(["bash", "-c", f"{SLEEP} >/dev/null 2>&1 & echo $!"], env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout)


def test_the_scan_finds_the_tests_own_orphans_only():
    env = dict(os.environ, PYTEST_CURRENT_TEST="tests/test_x.py::test_a[1] (call)", **{SESSION_VAR: "s1"})
    mine = _orphan(env)
    other_test = _orphan(dict(env, PYTEST_CURRENT_TEST="tests/test_x.py::test_a[10] (call)"))
    setup_phase = _orphan(dict(env, PYTEST_CURRENT_TEST="tests/test_x.py::test_a[1] (setup)"))
    other_session = _orphan(dict(env, **{SESSION_VAR: "s2"}))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        time.sleep(0.2)   # the shells have exited: the sleepers are orphans
        assert leftover_processes("tests/test_x.py::test_a[1]", session="s1") == [mine]
        assert leftover_processes("tests/test_x.py::test_a[10]", session="s1") == [other_test]
        assert leftover_processes("tests/test_x.py::test_a", session="s1") == []    # a prefix is another test
        assert leftover_processes("tests/test_x.py::test_a[1]", session="s2") == [other_session]
    finally:
        for pid in (mine, other_test, setup_phase, other_session):
            os.kill(pid, 9)
        child.kill()
        child.wait()
