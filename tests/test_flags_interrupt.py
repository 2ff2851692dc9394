"""Ctrl-C in a script run through nanochat.flags.script_main: one line (`<name>: interrupted`), no
traceback, and the process ends the way Python ends an uncaught Ctrl-C (by SIGINT after a normal
shutdown: a shell reports exit code 130 and a shell script stops there). Real processes get real
SIGINTs; the training loop's graceful stop (nanochat/loop.py) keeps its lines when a second Ctrl-C
cuts it short."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# A script that prints a result (left in stdout's buffer: a pipe), says it is ready on stderr and
# blocks until interrupted; an atexit handler shows that Python's shutdown still runs.
BLOCKED = """
import atexit, os, sys, time
from nanochat.flags import script_main
atexit.register(lambda: print("atexit ran", file=sys.stderr, flush=True))

def run():
    print("a result line")
    print(f"ready {os.getpid()}", file=sys.stderr, flush=True)
    time.sleep(30)

script_main("demo", lambda: None, run)
"""


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)   # a child of a shell's background job inherits SIG_IGN


def _start(argv, **kw) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO)), preexec_fn=_default_sigint, **kw)


def _ready_pid(proc: subprocess.Popen) -> int:
    """The pid the child says it has once it is blocked (its first stderr line)."""
    line = proc.stderr.readline()
    assert line.startswith("ready "), (line, proc.stderr.read())
    return int(line.split()[1])


def test_ctrl_c_is_one_line_and_a_sigint_exit_without_a_traceback():
    t0 = time.perf_counter()
    proc = _start([sys.executable, "-c", BLOCKED])
    os.kill(_ready_pid(proc), signal.SIGINT)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)   # the shell's 130
    assert err.splitlines() == ["demo: interrupted", "atexit ran"], err   # no traceback
    assert out == "a result line\n"   # buffered output is not lost
    assert time.perf_counter() - t0 < 3


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_shell_sees_130_and_a_script_stops_after_the_interrupted_command():
    """`$?` is 130; and Ctrl-C (to the whole foreground group, as a terminal sends it) ends a bash
    script there: bash goes on after a child that exited (sys.exit(130) would run `echo after`),
    but not after one that died of SIGINT."""
    shell = _start(["bash", "-c", '"$0" -c "$1"; echo "rc=$?"', sys.executable, BLOCKED])
    os.kill(_ready_pid(shell), signal.SIGINT)   # the python child alone
    out, err = shell.communicate(timeout=10)
    assert shell.returncode == 0 and out.splitlines() == ["a result line", "rc=130"], (out, err)

    script = _start(["bash", "-c", '"$0" -c "$1"; echo after', sys.executable, BLOCKED], start_new_session=True)
    _ready_pid(script)
    os.killpg(script.pid, signal.SIGINT)   # bash and python, as Ctrl-C in a terminal
    out, err = script.communicate(timeout=10)
    assert "after" not in out and script.returncode == -signal.SIGINT, (script.returncode, out, err)
    assert "demo: interrupted" in err and "Traceback" not in err, err


def test_an_interrupted_stop_is_still_said_once(capsys, monkeypatch):
    """A second Ctrl-C that cuts a training run's stop short (its StopRequested in flight, not yet
    printed) still says where the checkpoint is; a stop already said is not repeated; other ranks
    say nothing. The interrupt goes on (Python's exit by SIGINT) with a hook that prints nothing
    for it but still prints other exceptions."""
    from nanochat.errors import RequestError
    from nanochat.flags import script_main

    class Stop(RequestError):
        exit_code = 130

    def interrupted_stop():
        try:
            raise Stop("stopped by SIGINT at step 4 of 10: checkpoint /x/step_000004 saved")
        finally:
            raise KeyboardInterrupt   # the second Ctrl-C, e.g. while loop.py restores its handlers

    def run_it(run):
        with pytest.raises(KeyboardInterrupt) as info:
            script_main("base_train", lambda: None, run)
        return info.value, capsys.readouterr()

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)   # put back what script_main replaces
    monkeypatch.setenv("RANK", "0")
    interrupt, said = run_it(interrupted_stop)
    assert said.err.splitlines() == ["base_train: error: stopped by SIGINT at step 4 of 10: checkpoint "
                                     "/x/step_000004 saved", "base_train: interrupted"]
    sys.excepthook(KeyboardInterrupt, interrupt, interrupt.__traceback__)
    assert capsys.readouterr().err == ""
    sys.excepthook(ValueError, ValueError("other"), None)
    assert "ValueError: other" in capsys.readouterr().err

    real_print, calls = print, []

    def interrupted_print(*args, **kw):   # the second Ctrl-C right after the stop's line was printed
        real_print(*args, **kw)
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt

    def said_stop():
        raise Stop("stopped by SIGTERM ...")

    monkeypatch.setattr("builtins.print", interrupted_print)
    with pytest.raises(KeyboardInterrupt):
        script_main("base_train", lambda: None, said_stop)
    monkeypatch.setattr("builtins.print", real_print)
    assert capsys.readouterr().err.splitlines() == ["base_train: error: stopped by SIGTERM ...",
                                                    "base_train: interrupted"]

    monkeypatch.setenv("RANK", "1")
    assert run_it(interrupted_stop)[1].err == ""


def test_ctrl_c_while_checking_the_flags_is_one_line(capsys, monkeypatch):
    """check() is covered too (a slow import there, e.g. torch)."""
    from nanochat.flags import script_main

    def check():
        raise KeyboardInterrupt

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    with pytest.raises(KeyboardInterrupt):
        script_main("chat_eval", check, lambda: pytest.fail("run() after an interrupted check"))
    assert capsys.readouterr().err == "chat_eval: interrupted\n"


# The training loop (real signals, real run_training_loop): the first Ctrl-C comes in step 1; the
# second either during the checkpoint save (it interrupts at once) or after it, while the stop is
# on its way to script_main. torch is imported once: each case is a forked child with its own
# stdout/stderr files, and the parent prints their exit codes.
LOOP = """
import json, os, signal, sys, types
from pathlib import Path
from nanochat.flags import script_main
from nanochat.loop import LoopSpec, run_training_loop

out = Path(sys.argv[1])

class Trainer:
    def step(self, step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return types.SimpleNamespace(loss=1.0, extra=None, lrm=1.0)
    def loop_state(self, step, meter, **kw):
        return {"step": step}
    def note_checkpoint(self, path):
        pass

def case(when):
    def save(step, state):
        if when == "during-save":
            os.kill(os.getpid(), signal.SIGINT)
        return out / f"step_{step:06d}"

    def run():
        meter = types.SimpleNamespace(update=lambda result: {}, log_line=lambda metrics, n: "step")
        try:
            run_training_loop(Trainer(), meter, LoopSpec("base", 5, report=False, save=save))
        finally:
            if when == "after-save":
                os.kill(os.getpid(), signal.SIGINT)

    script_main("base_train", lambda: None, run)

codes = {}
for when in ("during-save", "after-save"):
    pid = os.fork()
    if pid == 0:
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(out / f"{when}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        case(when)   # ends the child
    codes[when] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(json.dumps(codes))
"""


def test_a_second_ctrl_c_in_training_keeps_the_stop_lines(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "NANOCHAT_SETUP_STAGE")}
    env.update(PYTHONPATH=str(REPO), NANOCHAT_BASE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", LOOP, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env, preexec_fn=_default_sigint)
    assert proc.returncode == 0, proc.stderr
    codes = json.loads(proc.stdout)
    out = {when: (tmp_path / f"{when}.stdout").read_text().splitlines() for when in codes}
    err = {when: (tmp_path / f"{when}.stderr").read_text().splitlines() for when in codes}
    first = "received SIGINT: the step in flight finishes, then a checkpoint is saved (Ctrl-C again to interrupt at once)"
    for when in ("during-save", "after-save"):
        assert codes[when] == -signal.SIGINT, (when, codes, err[when])
        assert err[when][0] == first and not any("Traceback" in line for line in err[when]), err[when]
        assert out[when][:3] == ["step", "step", "received SIGINT: saving a checkpoint at step 2 and stopping "
                                 "(Ctrl-C again interrupts at once)"], out[when]
    assert err["during-save"][1:] == ["base_train: interrupted"]   # cut short in the save: nothing saved
    assert out["during-save"][3:] == []
    checkpoint = tmp_path / "step_000002"
    assert out["after-save"][3:] == [f"step 00002 | saved checkpoint {checkpoint}"]
    assert err["after-save"][1:] == [f"base_train: error: stopped by SIGINT at step 2 of 5: checkpoint {checkpoint} "
                                     "saved; continue with --resume latest", "base_train: interrupted"]
