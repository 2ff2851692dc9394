"""tests/conftest.py kills what a failed test left running: its scan must find a child started
during that test (even one in its own session, as nohup'd runs are) and nothing else."""

import os
import subprocess
import sys

import pytest

from tests.conftest import leftover_processes

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc (Linux)")


def test_the_scan_finds_the_tests_own_children_only():
    env = dict(os.environ, PYTEST_CURRENT_TEST="tests/test_x.py::test_a[1] (call)")
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env=dict(env, PYTEST_CURRENT_TEST="tests/test_x.py::test_a[10] (call)"))
    try:
        assert leftover_processes("tests/test_x.py::test_a[1]") == [mine.pid]
        assert leftover_processes("tests/test_x.py::test_a[10]") == [other.pid]
        assert leftover_processes("tests/test_x.py::test_a") == []   # a prefix is another test
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()
    assert leftover_processes("tests/test_x.py::test_a[1]") == []   # reaped: gone from /proc
