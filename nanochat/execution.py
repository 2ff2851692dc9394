"""Sandboxed execution of generated Python (HumanEval, RL rewards): one fresh process per program.

Layers, strongest first (each applied when the OS allows it; `ExecutionResult.isolation` lists
what was actually applied):

* process: a new interpreter (`python -I`) in its own session / process group, killed as a group
  after the wall-clock limit; stdin closed; a minimal environment; a private temp working dir.
* rlimits: RLIMIT_CPU (SIGXCPU, then SIGKILL one second later), RLIMIT_AS (memory), RLIMIT_FSIZE
  (caps files incl. the captured stdout/stderr), RLIMIT_NPROC = 0 (no fork, for non-root),
  RLIMIT_CORE = 0, RLIMIT_NOFILE.
* namespaces ("netns", "readonly_fs"): unshare a network namespace (no interfaces up, so no
  network at all) and a mount namespace in which every mount is read-only except the working dir.
  Uses CLONE_NEWUSER when not root. Needs Linux >= 5.12 for mount_setattr.
* "uid_drop": when running as root and the interpreter is world-readable, the child switches to
  uid/gid 65534 (nobody) so root-owned files stay out of reach even without namespaces.
* "python_guard": destructive / process / network functions are replaced by raisers (os.system,
  os.fork, os.kill, os.remove/unlink/rename, shutil.rmtree, subprocess, socket, ctypes, ...).

The Python guard alone is not a security boundary against adversarial code; the rlimits, the
process-group kill and the namespaces are the hard guarantees. The child half of this file runs
as `python -I execution.py --sandbox-child CONFIG` and uses only the standard library.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

STATUSES = ("pass", "fail", "timeout", "error")
_EXIT_PASS, _EXIT_FAIL, _EXIT_ERROR = 0, 1, 2
_NOBODY = 65534


@dataclass
class ExecutionResult:
    status: str                      # "pass" | "fail" (AssertionError) | "timeout" | "error"
    stdout: str = ""                 # tail of the program's stdout
    stderr: str = ""                 # tail of stderr (the traceback when it failed)
    returncode: int | None = None
    duration_s: float = 0.0
    detail: str = ""                 # why: exception type, limit hit, signal
    isolation: tuple[str, ...] = field(default_factory=tuple)

    @property
    def passed(self) -> bool:
        return self.status == "pass"


def _world_readable(path: Path) -> bool:
    """True when 'other' can traverse every ancestor of path and read path itself."""
    try:
        path = path.resolve()
        for parent in list(path.parents)[::-1]:
            if not os.stat(parent).st_mode & 0o001:
                return False
        return bool(os.stat(path).st_mode & 0o004)
    except OSError:
        return False


def _can_drop_to_nobody() -> bool:
    import sysconfig

    return (os.geteuid() == 0 and _world_readable(Path(sys.executable))
            and _world_readable(Path(sysconfig.get_paths()["stdlib"])))


def _tail(path: Path, n: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def execute_code(code: str, *, timeout_s: float = 10.0, cpu_time_s: float | None = None,
                 memory_mb: int = 1024, max_output_bytes: int = 1 << 20, tail_chars: int = 4000,
                 isolate: bool = True) -> ExecutionResult:
    """Run `code` in a sandboxed child process and classify the outcome.

    timeout_s: wall clock (the process group is killed); cpu_time_s: RLIMIT_CPU (default
    timeout_s + 1); memory_mb: RLIMIT_AS; max_output_bytes: RLIMIT_FSIZE for any file the program
    writes, including its captured stdout/stderr. isolate=False skips namespaces and the uid drop
    (rlimits and the Python guard stay).
    """
    if timeout_s <= 0 or memory_mb < 64 or max_output_bytes < 1024:
        raise ValueError(f"execute_code: got timeout_s={timeout_s} memory_mb={memory_mb} "
                         f"max_output_bytes={max_output_bytes}; accepted: > 0, >= 64, >= 1024")
    cpu = int(cpu_time_s if cpu_time_s is not None else timeout_s + 1)
    drop = isolate and _can_drop_to_nobody()
    with tempfile.TemporaryDirectory(prefix="nanochat_exec_") as tmp:
        work = Path(tmp)
        (work / "program.py").write_text(code, encoding="utf-8")
        config = {"workdir": str(work), "cpu_s": max(1, cpu), "memory_bytes": memory_mb << 20,
                  "fsize_bytes": max_output_bytes, "isolate": isolate, "drop_uid": drop}
        (work / "config.json").write_text(json.dumps(config))
        if drop:
            for p in [work, *work.iterdir()]:
                os.chown(p, _NOBODY, _NOBODY)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-I", "-B", str(Path(__file__).resolve()), "--sandbox-child", str(work / "config.json")]
        t0 = time.monotonic()
        with open(work / "stdout.txt", "wb") as out, open(work / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=tmp, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                rc = proc.wait()
            _kill_group(proc.pid)  # anything the program left behind in its group
        duration = time.monotonic() - t0
        try:
            isolation = tuple(json.loads((work / "isolation.json").read_text()))
        except (OSError, ValueError):
            isolation = ()
        stdout, stderr = _tail(work / "stdout.txt", tail_chars), _tail(work / "stderr.txt", tail_chars)
    status, detail = _classify(rc, timed_out, timeout_s, cpu, stderr)
    return ExecutionResult(status, stdout, stderr, rc, duration, detail, isolation)


def _classify(rc: int, timed_out: bool, timeout_s: float, cpu: int, stderr: str) -> tuple[str, str]:
    if timed_out:
        return "timeout", f"wall-clock limit {timeout_s:g}s exceeded"
    if rc == -signal.SIGXCPU:
        return "timeout", f"CPU-time limit {cpu}s exceeded (SIGXCPU)"
    if rc < 0:
        return "error", f"killed by signal {signal.Signals(-rc).name}"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    if rc == _EXIT_PASS:
        return "pass", ""
    if rc == _EXIT_FAIL:
        return "fail", last or "AssertionError"
    return "error", last or f"exit code {rc}"


def execute_many(programs: list[str], *, workers: int | None = None, **kw) -> list[ExecutionResult]:
    """execute_code over many programs with a thread pool (each program is its own process)."""
    workers = workers or max(1, min(len(programs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda c: execute_code(c, **kw), programs))


# ---------------------------------------------------------------------------------------------
# Child side: everything below runs inside the sandboxed interpreter.
# ---------------------------------------------------------------------------------------------

_CLONE_NEWNS, _CLONE_NEWUSER, _CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
_MS_BIND, _MS_REC, _MS_PRIVATE = 0x1000, 0x4000, 0x40000
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
_SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64 (generic syscall table)


def _unshare_namespaces(workdir: str, as_real_root: bool) -> list[str]:
    """Enter new net + mount namespaces and make every mount read-only except workdir."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    attempts = ([_CLONE_NEWNS | _CLONE_NEWNET] if as_real_root else []) + [_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET]
    for flags in attempts:
        if libc.unshare(flags) == 0:
            break
    else:
        return []
    applied = ["netns"]
    if flags & _CLONE_NEWUSER:  # map our own ids so files we create keep a real owner
        try:
            Path("/proc/self/setgroups").write_text("deny")
            Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
            Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
        except OSError:
            pass

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    def setattr_(path: str, set_: int, clr: int) -> bool:
        attr = MountAttr(set_, clr, 0, 0)
        return libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), _AT_RECURSIVE,
                            ctypes.byref(attr), ctypes.sizeof(attr)) == 0

    wd = workdir.encode()
    ok = (libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0
          and libc.mount(wd, wd, None, _MS_BIND | _MS_REC, None) == 0
          and setattr_("/", _MOUNT_ATTR_RDONLY, 0)
          and setattr_(workdir, 0, _MOUNT_ATTR_RDONLY))
    if ok:
        applied.append("readonly_fs")
    return applied


def _set_rlimits(cfg: dict) -> None:
    import resource

    def limit(which, soft, hard=None):
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass

    limit(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)
    limit(resource.RLIMIT_AS, cfg["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, 64)
    if os.getuid() != 0:  # root ignores RLIMIT_NPROC; the Python guard covers fork there
        limit(resource.RLIMIT_NPROC, 0)


_OS_DISABLED = (
    "system", "popen", "fork", "forkpty", "vfork", "kill", "killpg", "abort", "_exit",
    "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
    "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir", "removedirs", "rename", "renames",
    "replace", "truncate", "ftruncate", "link", "symlink", "mkfifo", "mknod", "chmod", "fchmod",
    "lchmod", "chown", "fchown", "lchown", "chroot", "chdir", "fchdir", "setuid", "setgid",
    "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "putenv", "unsetenv", "plock", "register_at_fork", "pidfd_open",
)
_BLOCKED_MODULES = (
    "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "ctypes", "_ctypes",
    "socket", "_socket", "ssl", "_ssl", "pty", "posix", "nt", "pdb", "webbrowser", "urllib.request",
    "http.client", "ftplib", "smtplib", "telnetlib", "asyncio",
)


def _disabled(name: str):
    def raiser(*args, **kwargs):
        raise PermissionError(f"{name} is disabled in the nanochat sandbox")
    return raiser


def _python_guard() -> None:
    """Replace destructive / escaping functions with raisers and block dangerous modules."""
    import builtins
    import importlib
    import shutil

    for name in _OS_DISABLED:
        if hasattr(os, name):
            setattr(os, name, _disabled(f"os.{name}"))
    for name in ("rmtree", "move", "chown", "disk_usage"):
        setattr(shutil, name, _disabled(f"shutil.{name}"))
    importlib.reload = _disabled("importlib.reload")
    builtins.help = _disabled("help")
    for mod in _BLOCKED_MODULES:
        sys.modules[mod] = None  # `import mod` now raises ImportError


def _child_main(config_path: str) -> None:
    import traceback

    cfg = json.loads(Path(config_path).read_text())
    workdir = cfg["workdir"]
    source = Path(workdir, "program.py").read_text(encoding="utf-8")
    applied: list[str] = []
    if cfg["isolate"]:
        try:
            applied += _unshare_namespaces(workdir, as_real_root=os.geteuid() == 0)
        except OSError:
            pass
        if cfg["drop_uid"] and os.geteuid() == 0:
            os.setgroups([])
            os.setgid(_NOBODY)
            os.setuid(_NOBODY)
            applied.append("uid_drop")
    _set_rlimits(cfg)
    applied.append("rlimits")
    os.chdir(workdir)
    applied.append("python_guard")
    Path(workdir, "isolation.json").write_text(json.dumps(applied))
    exit_now, flush = os._exit, (sys.stdout.flush, sys.stderr.flush)
    _python_guard()
    code = _EXIT_PASS
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except AssertionError:
        traceback.print_exc()
        code = _EXIT_FAIL
    except SystemExit as e:  # generated code must not end the run early (it would skip the tests)
        print(f"SystemExit({e.code!r}) called by the program", file=sys.stderr)
        code = _EXIT_ERROR
    except BaseException:  # noqa: BLE001 - any other failure of the program is an "error"
        traceback.print_exc()
        code = _EXIT_ERROR
    for f in flush:
        try:
            f()
        except Exception:  # noqa: BLE001 - a broken stdout must not change the verdict
            pass
    exit_now(code)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sandbox-child":
    _child_main(sys.argv[2])
