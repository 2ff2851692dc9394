"""Ninth review of the code sandbox (nanochat/execution.py, nanochat/sandbox_cgroup.py) and HumanEval's
post-processing: a leftover process still writing in the working dir made execute_code raise
(ending the evaluation) and left the dir behind; text after a stray closing fence was run as code."""

import os
import signal
import tempfile
import time
import warnings
from pathlib import Path

import pytest

from nanochat.execution import execute_code
from nanochat.tasks.humaneval import HumanEval, extract_program

# escapes the Python guard (a fresh posix module), leaves the process group and keeps filling the
# working dir; the parent has reported: the verdict is "pass"
_LEFTOVER = """import os, sys
del sys.modules['posix']
import posix
print(os.getcwd(), flush=True)
pid = posix.fork()
if pid == 0:
    posix.setsid()
    i = 0
    while True:
        try:
            posix.mkdir(f'd{i}')
            open(f'd{i}/f', 'w').close()
        except OSError:
            pass
        i += 1
print(pid, flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


@pytest.mark.skipif(os.geteuid() != 0, reason="only uid 0 may fork in the sandbox (RLIMIT_NPROC = 0 otherwise)")
def test_a_leftover_writing_in_the_working_dir_neither_raises_nor_stays():
    """Without a PID namespace and a pids cgroup (a container's root: isolate and the cgroup refused,
    here asked off), a uid-0 program that escaped the guard and left its process group kept writing
    in the working dir: TemporaryDirectory's cleanup raised OSError (Directory not empty) out of
    execute_code, ending a HumanEval run over one completion, and the dir stayed behind. The
    leftover is now found by its working dir and killed, and the dir removed."""
    res, pid = None, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = execute_code(_LEFTOVER, timeout_s=10, cpu_time_s=3, isolate=False, cgroup_root=None)
        work, pid = res.stdout.split()[0], int(res.stdout.split()[1])
        assert res.status == "pass", (res.status, res.detail)
        assert not os.path.lexists(work), "the working dir was left behind"
        deadline = time.monotonic() + 2
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _gone(pid), "the leftover still runs"
    finally:
        if pid is not None and not _gone(pid):  # the process this test started, by its pid
            os.kill(pid, signal.SIGKILL)


def test_a_working_dir_that_cannot_be_removed_is_a_warning_not_an_exception(tmp_path):
    from nanochat.sandbox_cgroup import remove_workdir

    class Stuck:  # a TemporaryDirectory whose cleanup never manages (ignore_cleanup_errors=True)
        name = str(tmp_path)

        def cleanup(self):
            pass

    with pytest.warns(RuntimeWarning, match=f"could not remove the working dir {tmp_path}"):
        remove_workdir(Stuck())
    real = tempfile.TemporaryDirectory(prefix="review9_", ignore_cleanup_errors=True)
    Path(real.name, "sub").mkdir()
    remove_workdir(real)
    assert not os.path.lexists(real.name)


_PROMPT = 'def add(a, b):\n    """Return a + b."""\n'


@pytest.mark.parametrize("completion", [
    "    return a + b\n```\n\nThis returns the sum of the two numbers.\n",   # body, stray closing fence, prose
    "def add(a, b):\n    return a + b\n```\nThis adds.",                       # function, stray fence, prose
    "    return a + b\n```",                                                   # (already handled) no prose
    "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\nDone.",        # a real block still wins
])
def test_text_after_a_stray_closing_fence_is_not_run_as_code(completion):
    """A completion that continues the prompt and ends with a closing fence and an explanation: the
    lone fence opened an (unclosed) unlabelled block, which was chosen over the code before it, so
    the explanation ran as Python (SyntaxError) and a correct answer scored 0."""
    namespace: dict = {}
    exec(compile(extract_program(completion, _PROMPT, "add"), "program.py", "exec"), namespace)
    assert namespace["add"](2, 3) == 5


def test_humaneval_scores_a_body_followed_by_fence_and_prose(shared_data):
    he = HumanEval(data_dir=shared_data)
    conv = he[0]
    body = conv["messages"][1]["content"][len(conv["prompt"]):]
    assert he.evaluate(conv, body + "```\n\nThis checks every pair of numbers.\n")
    assert not he.evaluate(conv, "    return False\n```\n\nThis checks every pair of numbers.\n")
