"""Seventh review of the code sandbox (nanochat/execution.py) and HumanEval's use of it: how the
CPU-time limit is reported when a program ignores SIGXCPU, and a sandbox harness that fails before
the program runs, which was scored as the model's error."""

import json
import signal

import pytest

from nanochat import execution
from nanochat.execution import execute_code

_IGNORE_XCPU = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass\n"


def test_a_program_that_ignores_sigxcpu_is_a_cpu_timeout_not_an_error():
    """RLIMIT_CPU sends SIGXCPU at the soft limit and SIGKILL one second later (the hard limit). A
    program that ignored (or handled) SIGXCPU was reported as "error: killed by signal SIGKILL":
    a time limit reported as a crash. The CPU time the run used (wait4's rusage) tells them apart."""
    res = execute_code(_IGNORE_XCPU, cpu_time_s=1, timeout_s=30)
    assert res.status == "timeout", (res.status, res.detail)
    assert res.returncode == -signal.SIGKILL
    assert res.detail.startswith("CPU-time limit 1s exceeded (SIGKILL)"), res.detail


@pytest.mark.parametrize("rc, cpu_used, status", [(-signal.SIGKILL, 2.05, "timeout"), (-signal.SIGKILL, 0.2, "error"),
                                                  (-signal.SIGXCPU, 1.0, "timeout"), (2, 5.0, "error")])
def test_only_a_kill_after_the_cpu_limit_is_a_cpu_timeout(rc, cpu_used, status):
    """A SIGKILL before the CPU limit was used up (the OOM killer, the program's own signal) stays an
    error; the returncode and the CPU time decide, not the signal alone."""
    got, detail = execution._classify(rc, False, 10.0, 1, cpu_used, "", "")
    assert got == status, detail
    assert ("CPU-time limit 1s" in detail) == (status == "timeout")


def _broken_harness(monkeypatch):
    """A child that fails before the program starts (a filter it cannot decode: ValueError)."""
    monkeypatch.setattr(execution, "_seccomp_filters", lambda: {"netns": "not hex", "no_netns": "not hex"})


def test_a_harness_that_fails_before_the_program_runs_raises(monkeypatch):
    """The program runs only after the harness has reported its layers; with no report and no
    timeout the harness itself failed (exit code 1, its own traceback). That came back as the
    program's "error" ("the program ended the interpreter itself"): every HumanEval problem scored
    0, and nothing said the sandbox, not the model, was broken."""
    _broken_harness(monkeypatch)
    with pytest.raises(RuntimeError, match=r"(?s)harness failed before the program ran.*ValueError"):
        execute_code("assert True", timeout_s=10)


def test_humaneval_does_not_score_a_broken_sandbox_as_wrong_answers(tmp_path, monkeypatch):
    from nanochat.tasks.humaneval import HumanEval

    row = {"task_id": "t/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n",
           "canonical_solution": "    return a + b\n", "test": "def check(f):\n    assert f(1, 2) == 3\n",
           "entry_point": "add"}
    (tmp_path / "humaneval.jsonl").write_text(json.dumps(row) + "\n")
    he = HumanEval(data_dir=tmp_path, timeout_s=10)
    assert he.evaluate(he[0], "    return a + b\n") and not he.evaluate(he[0], "    return a - b\n")
    _broken_harness(monkeypatch)
    with pytest.raises(RuntimeError, match="harness failed"):
        he.evaluate(he[0], "    return a + b\n")


def test_programs_that_end_badly_are_still_verdicts_not_harness_failures():
    """Only the harness's own failure raises: a program that writes over the report pipe, exits
    early or is cut by a wall clock shorter than the start-up keeps its verdict."""
    flood = ("import os\nfor fd in range(3, 40):\n    try:\n        os.write(fd, b'x' * 20000)\n"
             "    except OSError:\n        pass\nassert False\n")
    assert execute_code(flood, timeout_s=10).status in ("fail", "error")
    assert execute_code("raise SystemExit(0)", timeout_s=10).status == "error"
    assert execute_code("assert True", timeout_s=0.001).status == "timeout"
