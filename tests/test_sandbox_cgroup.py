"""The code sandbox's per-run cgroup: a process cap and a total-memory cap that bind root too (a
fork bomb as uid 0 ignores RLIMIT_NPROC), reported as layers, never left behind."""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from nanochat import execution
from nanochat.execution import execute_code

# Past the Python guard (the posix module is one attribute away): what must hold is the kernel's cap.
_POSIX = "import os\npx = os.stat.__self__\n"


def _own_cgroup_dirs(controller: str) -> list[Path]:
    """This process's own cgroup directories (under /sys/fs/cgroup) where a child cgroup would get
    `controller`'s limits and that are writable: v1 hierarchies holding the controller, v2 ones
    that delegate it. Read-only probing, independent of the code under test."""
    try:
        own = dict(line.split(":", 2)[1:] for line in Path("/proc/self/cgroup").read_text().splitlines())
        mounts = [line.split()[1:4] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except (OSError, ValueError):
        return []
    found = []
    for point, fstype, options in mounts:
        if not point.startswith("/sys/fs/cgroup"):
            continue
        if fstype == "cgroup":
            key = next((k for k in own if controller in k.split(",")), None)
            if key is None or controller not in options.split(","):
                continue
        elif fstype == "cgroup2" and "" in own:
            key = ""
        else:
            continue
        d = Path(point, own[key].strip().lstrip("/"))
        try:
            delegated = fstype == "cgroup" or controller in (d / "cgroup.subtree_control").read_text().split()
        except OSError:
            continue
        if delegated and d.is_dir() and os.access(d, os.W_OK):
            found.append(d)
    return found


def _require(controller: str) -> list[Path]:
    dirs = _own_cgroup_dirs(controller)
    if not dirs:
        pytest.skip(f"no writable cgroup with the {controller} controller here (/sys/fs/cgroup absent or "
                    "read-only, no permission, or no delegated v2 subtree)")
    return dirs


def _leftovers() -> list[Path]:
    """Cgroups this test process's runs made that still exist."""
    return [p for c in ("pids", "memory") for d in _own_cgroup_dirs(c)
            for p in d.glob(f"nanochat_exec_{os.getpid()}_*")]


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def _recording_workdirs(monkeypatch) -> list[str]:
    """The host-side working dirs of the runs that follow (each process's command line names it)."""
    workdirs, real = [], execution.tempfile.TemporaryDirectory

    def recording(*args, **kwargs):
        d = real(*args, **kwargs)
        workdirs.append(d.name)
        return d

    monkeypatch.setattr(execution.tempfile, "TemporaryDirectory", recording)
    return workdirs


def test_fork_bomb_is_capped_ends_on_time_and_leaves_no_cgroup(monkeypatch):
    """As root RLIMIT_NPROC does not apply: before the cgroup, this bomb multiplied until the wall
    clock (thousands of processes on a 2-core box)."""
    _require("pids")
    probe = execute_code("pass")
    assert "pids_cap" in probe.isolation, probe.isolation  # never run the bomb uncapped
    workdirs = _recording_workdirs(monkeypatch)
    bomb = _POSIX + "while True:\n    try:\n        px.fork()\n    except OSError:\n        pass\n"
    box, cap, timeout_s = [], 12, 1.5
    runner = threading.Thread(target=lambda: box.append(execute_code(bomb, timeout_s=timeout_s, max_processes=cap)))
    t0 = time.monotonic()
    runner.start()
    most = 0
    while runner.is_alive():
        if workdirs:
            most = max(most, len(_processes_with(workdirs[0])))
        time.sleep(0.01)
    runner.join()
    elapsed, res = time.monotonic() - t0, box[0]
    left = _processes_with(workdirs[0])
    for pid in left:  # never leave them running, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert res.status == "timeout" and f"process cap {cap} reached" in res.detail, (res.status, res.detail)
    assert "pids_cap" in res.isolation
    assert 3 < most <= cap and left == [], (most, left)
    assert elapsed < timeout_s + 2, elapsed
    assert _leftovers() == []


def test_forks_stop_at_max_processes_and_the_program_is_not_a_pass():
    """The sandbox's own processes count (harness, the PID namespace's init, the program)."""
    _require("pids")
    code = _POSIX + ("n = 0\ntry:\n    for i in range(100):\n        if px.fork() == 0:\n"
                     "            import time\n            time.sleep(5)\n            px._exit(0)\n"
                     "        n += 1\nfinally:\n    print('forked', n)\n")
    res = execute_code(code, timeout_s=10, max_processes=16)
    own = 3 if "pidns" in res.isolation else 1
    assert res.stdout.split() == ["forked", str(16 - own)], (res.stdout, res.isolation)
    assert res.status == "error" and "BlockingIOError" in res.detail and "process cap 16 reached" in res.detail
    assert res.duration_s < 5 and _leftovers() == []


def test_memory_cap_counts_all_processes_together():
    """RLIMIT_AS is per process: four children of 100 MiB each fit in memory_mb=256 one by one,
    not together under the cgroup's memory_mb + max_workdir_bytes = 264 MiB."""
    _require("memory")
    code = _POSIX + ("kids = []\nfor i in range(4):\n    pid = px.fork()\n    if pid == 0:\n"
                     "        try:\n            held = b'1' * (100 << 20)\n            import time\n"
                     "            time.sleep(0.5)\n        finally:\n            px._exit(0)\n"
                     "    kids.append(pid)\nstatus = [px.waitpid(k, 0)[1] for k in kids]\n"
                     "assert status == [0, 0, 0, 0], status\n")
    res = execute_code(code, timeout_s=10, memory_mb=256, max_workdir_bytes=8 << 20)
    assert res.status in ("fail", "error") and "memory cap 264 MiB hit" in res.detail, (res.status, res.detail)
    assert "memory_cap" in res.isolation and _leftovers() == []


def test_layers_listed_only_where_a_writable_cgroup_exists(tmp_path):
    for root in (tmp_path / "missing", tmp_path, None):  # nonexistent, not a cgroup, off
        res = execute_code("print('ran')", cgroup_root=root)
        assert res.passed and res.stdout == "ran\n", (root, res.status, res.stderr)
        assert not {"pids_cap", "memory_cap"} & set(res.isolation), (root, res.isolation)
    res = execute_code("print('ran')")
    assert res.passed
    for controller, layer in (("pids", "pids_cap"), ("memory", "memory_cap")):
        assert (layer in res.isolation) == bool(_own_cgroup_dirs(controller)), res.isolation
    assert _leftovers() == []


def test_processes_that_leave_the_group_are_killed_without_a_pid_namespace():
    """isolate=False (no PID namespace): a child that calls setsid escaped the group kill, lived on
    and held the output pipes open (the parent waited 2 s per pipe). The cgroup kill gets it."""
    _require("pids")
    marker = f"{os.getpid()}.125"
    code = _POSIX + (f"if px.fork() == 0:\n    px.setsid()\n    px.execv('/bin/sleep', ['sleep', '{marker}'])\n"
                     "print('parent done')\n")
    res = execute_code(code, timeout_s=5, isolate=False)
    left = _processes_with(f"sleep\0{marker}")
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert res.passed and "pids_cap" in res.isolation, (res.status, res.detail, res.isolation)
    assert left == [] and res.duration_s < 2, (left, res.duration_s)
    assert _leftovers() == []


def test_cgroup_and_program_removed_when_the_caller_fails_mid_run(monkeypatch):
    """An exception in the parent while the program runs (here: right after the start) must not
    leave the program running or its cgroup behind."""
    _require("pids")
    started, real = [], subprocess.Popen

    def popen_then_fail(*args, **kwargs):
        proc = real(*args, **kwargs)
        started.append(proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(  # until the child has joined its cgroup
                (d / "cgroup.procs").read_text().strip() for d in _leftovers()):
            time.sleep(0.01)
        raise RuntimeError("the caller failed")

    monkeypatch.setattr(subprocess, "Popen", popen_then_fail)
    with pytest.raises(RuntimeError, match="caller failed"):
        execute_code("import time\ntime.sleep(30)", timeout_s=20)
    try:
        rc = started[0].wait(timeout=5)
    finally:  # never leave it running, even when the test fails (the group holds the PID namespace's init)
        if started[0].poll() is None:
            os.killpg(started[0].pid, signal.SIGKILL)
            started[0].wait()
    assert rc == -signal.SIGKILL and _leftovers() == []


def test_empty_cgroup_of_a_dead_caller_is_swept():
    parent = _require("pids")[0]
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names no live process
    stale = parent / f"nanochat_exec_{dead.pid}_0123456789ab"
    try:
        stale.mkdir()
        old = time.time() - 3600
        os.utime(stale, (old, old))
    except OSError as e:
        pytest.skip(f"cannot make an aged cgroup here: {e}")
    try:
        res = execute_code("pass")
        assert res.passed and not stale.exists()
    finally:
        if stale.exists():
            stale.rmdir()
