"""Review 8 of RL rewards and code execution: a sandboxed program dies with a caller killed
mid-run (it ran on with no wall clock at all), and a HumanEval body followed by a lone fence line
is the code run (the empty "block" the fence opened was chosen instead, leaving the prompt's stub)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nanochat.tasks.humaneval import extract_program

_ROOT = Path(__file__).resolve().parents[1]


def _descendants(root: int) -> set[int]:
    """Live (not zombie) processes below `root`, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rpartition(")")[2].split()[:2]
        if state != "Z":
            parents[int(entry.name)] = int(ppid)
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
@pytest.mark.parametrize("isolate", [True, False])
def test_a_sandboxed_program_dies_with_its_caller(isolate, tmp_path):
    """A caller SIGKILLed mid-run (the OOM killer, a killed rank) left its sandbox (harness, PID
    namespace init, program) running: a sleeping program for as long as it liked."""
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from nanochat.execution import execute_code
        execute_code("import time\\ntime.sleep(60)", timeout_s=60, isolate={isolate})
        """)], cwd=_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(tmp_path)})   # a killed caller leaves its temp dir behind
    sandbox: set[int] = set()
    try:
        deadline = time.monotonic() + 20
        while not sandbox and time.monotonic() < deadline:
            time.sleep(0.1)
            sandbox = _descendants(caller.pid)
        time.sleep(1.0)   # the harness forks its namespace's init and program
        sandbox |= _descendants(caller.pid)
        assert sandbox, "the sandbox never started"
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 5
        while any(map(_alive, sandbox)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in sandbox if _alive(pid)]
    finally:
        for pid in sandbox:   # never leave them running, even when the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        caller.kill()
        caller.wait()
    assert left == [], f"sandbox processes outlived their caller: {left}"


_PROMPT = 'def add(a, b):\n    """Return a + b."""\n'


@pytest.mark.parametrize("completion", [
    "    return a + b\n```\n",                         # a body, then a lone closing fence
    "    return a + b\n```",                           # the same, cut off without its newline
    "```python\n```\n    return a + b\n",              # an empty block, then the body
    "```text\nadd(1, 2) -> 3\n```\n    return a + b\n",  # an example in another language, then the body
])
def test_humaneval_runs_the_body_not_an_empty_fence(completion):
    program = extract_program(completion, _PROMPT, "add")
    namespace: dict = {}
    exec(compile(program, "program.py", "exec"), namespace)
    assert namespace["add"](2, 3) == 5, program


def test_humaneval_still_prefers_a_block_with_code():
    program = extract_program("Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n```\n```\n", _PROMPT, "add")
    namespace: dict = {}
    exec(compile(program, "program.py", "exec"), namespace)
    assert namespace["add"](2, 3) == 5 and "Sure" not in program
