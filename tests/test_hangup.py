"""A terminal hangup (SIGHUP: the ssh connection drops under a run in the foreground, no tmux),
for real: the run leads a new session whose controlling terminal is a pseudo-terminal, and closing
the master side makes the kernel hang it up (writes to it then fail with EIO, and the session's
leader gets SIGHUP). base_train finishes its step, saves a checkpoint, exits 129 and leaves its
last lines in <base dir>/hangup.log, and a resume continues from that checkpoint. setup.sh (slow),
the session's leader here as under `ssh -t host ./setup.sh`, passes the hangup on to its stage,
writes no done-marker and exits 129, saying so in the same log. A run that ignores SIGHUP (nohup)
and loses its terminal moves its output to the log and trains on."""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanochat import checkpoint as ck

REPO = Path(__file__).resolve().parents[1]
TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "8", "--total-batch-size", "512", "--window-pattern", "SL",
        "--sample-every", "-1", "--eval-every", "-1", "--eval-tokens", "4096", "--no-compile"]


def _clean_env(base_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE")}
    return {**env, "NANOCHAT_BASE_DIR": str(base_dir), "PYTHONPATH": str(REPO)}


def _start_on_terminal(argv: list[str], env: dict) -> tuple[int, int]:
    """argv as the leader of a new session with a fresh pty as its controlling terminal (stdin,
    stdout and stderr) -> (pid, master fd)."""
    pid, master = pty.fork()   # the child: setsid(), the slave made its controlling terminal
    if pid == 0:
        try:
            for sig in (signal.SIGHUP, signal.SIGINT, signal.SIGPIPE):   # as a login shell would leave them
                signal.signal(sig, signal.SIG_DFL)
            os.chdir(REPO)
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid, master


def _read_until(master: int, pattern: str, timeout: float) -> str:
    """What the terminal shows, read until `pattern` (a multiline regex) appears."""
    seen, deadline = b"", time.time() + timeout
    while not re.search(pattern, seen.decode(errors="replace"), re.M):
        assert time.time() < deadline, f"no {pattern!r} within {timeout} s: {seen[-3000:]!r}"
        if select.select([master], [], [], 0.2)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:   # EIO: every holder of the slave side is gone (the run ended)
                chunk = b""
            assert chunk, f"the run ended before {pattern!r}: {seen[-3000:]!r}"
            seen += chunk
    return seen.decode(errors="replace")


def _read_or_kill(pid: int, master: int, pattern: str, timeout: float) -> str:
    """_read_until, and should it fail, the run's session killed (no run left training after a failed test)."""
    try:
        return _read_until(master, pattern, timeout)
    except BaseException:
        os.close(master)
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
        raise


def _hang_up_and_wait(pid: int, master: int, timeout: float) -> int:
    """Close the master side (the kernel hangs the terminal up) -> the run's exit code (-N: killed
    by signal N)."""
    os.close(master)
    deadline = time.time() + timeout
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.1)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the run did not end within {timeout} s of the hangup")


def test_a_hangup_stops_base_train_with_a_checkpoint_and_its_log(base_dir, tiny_corpus, monkeypatch):
    """Before: SIGHUP killed the run at once (exit -1), losing every step since the last save."""
    log = base_dir / "hangup.log"
    log.unlink(missing_ok=True)
    args = TINY + ["--data-dir", str(tiny_corpus), "--model-tag", "hup"]
    pid, master = _start_on_terminal([sys.executable, "-m", "scripts.base_train", *args, "--num-iterations", "200"],
                                     _clean_env(base_dir))
    shown = _read_or_kill(pid, master, r"^step 0000[1-9]/00200 ", timeout=120)
    assert "saved checkpoint" not in shown   # nothing saved yet: --save-every is off
    rc = _hang_up_and_wait(pid, master, timeout=120)
    text = log.read_text() if log.exists() else "(no hangup.log)"
    assert rc == 128 + signal.SIGHUP, text[-3000:]
    assert re.search(r"^==> .* pid \d+: the terminal hung up \(SIGHUP\); its output continues here$", text, re.M), text
    m = re.search(r"^base_train: error: stopped by SIGHUP at step (\d+) of 200: checkpoint (\S+) saved; continue "
                  r"with --resume latest: python -m scripts\.base_train --model-tag hup .* --resume latest$", text, re.M)
    assert m, text[-3000:]
    step, ckpt_dir = int(m.group(1)), base_dir / "checkpoints" / "base" / "hup"
    assert 2 <= step < 200 and Path(m.group(2)) == ckpt_dir / f"step_{step:06d}", text[-3000:]
    assert f"received SIGHUP: saving a checkpoint at step {step} and stopping\n" in text
    assert f"step {step:05d} | saved checkpoint {m.group(2)}\n" in text
    assert ck.list_steps(ckpt_dir) == [step] and ck.read_latest(ckpt_dir) == step
    assert (ckpt_dir / f"step_{step:06d}" / "model.pt").is_file()

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))   # resume it: the next two steps, from there
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    from scripts import base_train
    summary = base_train.main(args + ["--resume", "latest", "--num-iterations", str(step + 2)])
    assert sorted(summary["losses"]) == [step, step + 1]
    assert ck.read_latest(ckpt_dir) == step + 2


def _loop_program(setup: str, suffix: str, sleep_s: float, finish: str) -> str:
    """A 30-step run_training_loop with a stand-in trainer (each step logs `step N` + suffix,
    sleeping `sleep_s`), started by `setup` and ended by the statement `finish`."""
    return f"""
import signal, sys, time, types
from nanochat.loop import LoopSpec, run_training_loop
{setup}

class Trainer:
    meter = types.SimpleNamespace(update=lambda result: {{}}, log_line=lambda metrics, n: f"step {{len(T.steps)}}{suffix}")
    steps = []
    def step(self, step):
        self.steps.append(step)
        time.sleep({sleep_s})
        return types.SimpleNamespace(loss=1.0, extra=None, lrm=1.0)
    def loop_state(self, step, meter, **kw):
        return {{}}
    def note_checkpoint(self, path):
        pass

T = Trainer()
spec = LoopSpec("base", num_iterations=30, report=False, save=lambda step, state: f"saved-{{step}}")
res = run_training_loop(T, meter=T.meter, spec=spec)
{finish}
"""


LOST_TERMINAL_RUN = _loop_program(
    "signal.signal(signal.SIGHUP, signal.SIG_IGN)   # as under nohup: the run outlives its terminal", "", 0.05,
    'print(f"finished at step {res.step} after {len(T.steps)} steps", flush=True)')


@pytest.mark.parametrize("unbuffered", [False, True])
def test_a_terminal_lost_without_sighup_moves_the_output_and_the_run_goes_on(tmp_path, unbuffered):
    """SIGHUP ignored (nohup) but stdout still the terminal: its writes fail with EIO once it hangs
    up. Before: the first step line after it ended the run with a traceback (exit 1); now the output
    moves to the hangup log and the run finishes, exit 0, with no line lost or written twice (a
    buffered stdout keeps the text of a failed write, an unbuffered one drops it)."""
    env = {k: v for k, v in _clean_env(tmp_path).items() if k != "PYTHONUNBUFFERED"}
    pid, master = _start_on_terminal([sys.executable, "-c", LOST_TERMINAL_RUN],
                                     {**env, "PYTHONUNBUFFERED": "1"} if unbuffered else env)
    _read_or_kill(pid, master, r"^step 3\r\n", timeout=60)   # the whole line (python -u writes its end apart)
    rc = _hang_up_and_wait(pid, master, timeout=60)
    log = tmp_path / "hangup.log"
    text = log.read_text() if log.exists() else "(no hangup.log)"
    assert rc == 0, text
    assert re.search(r"^==> .* pid \d+: writing to the terminal failed \(EIO\); its output continues here$",
                     text, re.M), text
    lines = text.splitlines()
    assert lines[-3:] == ["step 30", "step 00030 | saved checkpoint saved-30", "finished at step 30 after 30 steps"]
    first = int(lines[1].split()[1])   # the line whose write failed is written here, not lost
    assert lines[1:-2] == [f"step {n}" for n in range(first, 31)] and first >= 4, text


def _setup_on_terminal(base: Path, *args: str) -> tuple[int, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE")}
    return _start_on_terminal(["bash", str(REPO / "setup.sh"), "--preset", "tiny", "--base-dir", str(base), *args], env)


@pytest.mark.slow
def test_a_hangup_stops_setup_after_the_stages_save(tmp_path, tmp_path_factory):
    """setup.sh leads the session (as under `ssh -t host ./setup.sh`): the kernel signals only it,
    so it passes the hangup on, waits for base_train's save, writes no done-marker, runs no later
    stage and exits 129; its lines and the stage's are in <base dir>/hangup.log. Before: setup.sh
    died at once (exit -1) and its stage, signalled as it did, died unsaved."""
    from test_setup import prepared_base   # setup.sh's data and tokenizer stages, run once per session

    base = prepared_base(tmp_path_factory, tmp_path / "base")
    pid, master = _setup_on_terminal(base, "--only", "base_train,base_eval", "--depth", "1")   # d1: the smallest
    _read_or_kill(pid, master, r"^step 00000/00250 ", timeout=150)   # training: the hangup lands in a later step
    rc = _hang_up_and_wait(pid, master, timeout=120)
    log = base / "hangup.log"
    text = log.read_text() if log.exists() else "(no hangup.log)"
    assert rc == 129, text[-3000:]
    assert re.search(r"^==> .* setup\.sh \(pid \d+\): the terminal hung up \(SIGHUP\); its output continues here$",
                     text, re.M), text
    m = re.search(r"^base_train: error: stopped by SIGHUP at step (\d+) of 250: checkpoint (\S+) saved; "
                  r"continue with --resume latest \(or rerun \./setup\.sh\)$", text, re.M)
    assert m and (Path(m.group(2)) / "model.pt").is_file(), text[-3000:]
    assert text.rstrip().endswith("setup.sh: stopped by SIGHUP (the terminal hung up) in stage 'base_train' (exit "
                                  f"129). Rerun {REPO}/setup.sh --preset tiny --base-dir {base} --only "
                                  "base_train,base_eval --depth 1 to continue: finished stages are skipped and training "
                                  "resumes from its last checkpoint."), text[-3000:]
    assert "[base_eval]" not in text and "stage 'base_train' failed" not in text, text[-3000:]
    assert not (base / "setup_state" / "base_train.done").exists()


PIPED_RUN = _loop_program("", ' " + "x" * 5000 + "', 0.0,
                          'print(f"finished at step {res.step}", file=sys.stderr, flush=True)')


def test_a_pipe_whose_reader_quit_moves_stdout_alone(tmp_path):
    """`base_train ... | head` on a terminal: stdout's reader quits (EPIPE), stderr is still the live
    terminal. The step lines move to the hangup log and the run goes on, but stderr (warnings, the
    stop or error line) stays on the terminal. Before: it moved to the log too, and the terminal
    showed nothing more of the run."""
    master, slave = pty.openpty()
    out_r, out_w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", PIPED_RUN], stdin=subprocess.DEVNULL, stdout=out_w, stderr=slave,
                            env=_clean_env(tmp_path))
    os.close(out_w)
    os.close(slave)
    try:
        assert os.read(out_r, 100).startswith(b"step 1 ")   # `head -c 100`, then it quits
        os.close(out_r)
        assert proc.wait(timeout=60) == 0
        shown = _read_until(master, r"^finished at step 30\r?$", timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    log = (tmp_path / "hangup.log").read_text()
    assert re.search(r"^==> .* pid \d+: writing to the terminal failed \(EPIPE\); its output continues here$",
                     log, re.M), log[:500]
    assert "step 00030 | saved checkpoint saved-30" in log and "finished" not in log, log[-500:]
    assert "==>" not in shown
