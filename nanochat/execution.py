"""Sandboxed execution of generated Python (HumanEval, RL rewards): one fresh process per program.

Layers, strongest first (each applied when the OS allows it; `ExecutionResult.isolation` lists
what was actually applied):

* process: a new interpreter (`python -I`) in its own session / process group, killed as a group
  after the wall-clock limit and with its caller (parent-death signal); stdin closed; a minimal
  environment; a private temp dir. stdout / stderr are pipes the parent drains, keeping their tails
  (any amount of output costs bounded memory and never changes the verdict). A third pipe carries
  the harness's report: the layers applied, then the verdict; "pass" / "fail" need it, so a program
  that ends the interpreter itself with exit code 0 (skipping the tests) is an "error".
* "pids_cap", "memory_cap": a cgroup per run (nanochat/sandbox_cgroup.py), joined by the child
  first of all: at most `max_processes` tasks and `memory_mb` + `max_workdir_bytes` of memory for
  all its processes together (tmpfs files included), binding root too, unlike RLIMIT_NPROC.
* rlimits: RLIMIT_CPU (SIGXCPU, then SIGKILL one second later), RLIMIT_AS (memory), RLIMIT_FSIZE
  (caps every file the program writes), RLIMIT_NPROC = 0 (no fork, for non-root),
  RLIMIT_CORE = 0, RLIMIT_NOFILE.
* namespaces ("netns", "readonly_fs", "workdir_cap", "ipcns", "pidns", "procfs"): no network
  (an empty network namespace); every mount read-only and nodev (a read-only mount alone let a root
  program write a root-owned disk: only /dev/null, zero, full, random and urandom open; where one of
  them does not, /dev keeps its devices and "readonly_fs" is not claimed), the working dir a tmpfs
  of `max_workdir_bytes` (its files vanish with it, the host disk is never filled); SysV / POSIX
  IPC objects of its own; a PID namespace whose init is ours (its death kills every process the
  program started, setsid or not) with its own /proc (the host's showed every process and, to a uid
  without capabilities, other runs' working dirs and memory). Uses CLONE_NEWUSER when not root.
  Needs Linux >= 5.12 for mount_setattr.
* "no_caps": the program's process drops every capability (bounding set included) and sets
  no_new_privs, so a program running as root, or as root of the user namespace, cannot undo the
  namespaces (remount read-write, setns back out) or regain privileges through exec.
* "uid_drop": as root with CAP_CHOWN / CAP_SETUID / CAP_SETGID and a world-readable interpreter,
  the child switches to uid/gid 65534 (nobody): root-owned files stay out of reach even without
  namespaces (root makes those only with CAP_SYS_ADMIN: its user namespace maps uid 0 alone, where
  the switch cannot happen). A root caller whose program keeps uid 0 is warned.
* "seccomp" (x86_64 and aarch64): a seccomp-BPF filter, installed last, denies (EACCES / EPERM, no
  kill) socket() for every domain but AF_INET / AF_INET6 (all of them without "netns"), datagram
  socketpairs, io_uring, keyrings, SysV shmget / msgget and new namespaces (a user namespace gives
  capabilities back): Unix socket files (docker.sock, D-Bus, X11), AF_VSOCK (a VM's host) and
  keyrings cross every namespace; without "pidns" also signals but to itself and its own group,
  ptrace and process_vm_readv / writev (it could kill the caller). See nanochat/sandbox_seccomp.py.
* "landlock" (Linux >= 5.13): writes only in the working dir and to those devices, no ptrace (so no
  /proc/PID/environ or mem) of processes outside, no signals out on Linux >= 6.12; where the OS
  refuses the namespaces, the only bound on which files the program can write or delete.
* "python_guard": destructive / process / network functions are replaced by raisers (os.system,
  os.fork, os.kill, os.remove/unlink/rename, shutil.rmtree, subprocess, socket, ctypes, ...).

The Python guard alone is not a security boundary against adversarial code (it runs in the same
interpreter as the program); the other layers are the hard guarantees (one the OS refuses is
missing from `isolation`, and a RuntimeWarning says so once per process). Known gaps: the program
may read every file its uid may (read-only, not hidden); without "pids_cap" a uid-0 fork bomb
(exempt from RLIMIT_NPROC) is bounded only by the time limit, and without "pidns" too, a uid-0
process that escaped the guard, its process group and the working dir (processes there are killed)
outlives the run; without "memory_cap" memory is capped per process only, the tmpfs outside it;
without the mount namespace the working dir is on the host disk with no total size cap (each file
has one), and without "landlock" too the program may write or delete every file its uid may
(a root one its cgroup's limits) and read /proc/PID/environ (where Yama allows, /proc/PID/mem) of
its uid's processes; on other architectures (and with isolate=False) Unix sockets stay
connectable; code that deliberately writes the report pipe itself can forge a pass. The child half
of this file runs as `python -I execution.py --sandbox-child CONFIG` with only the standard library
(it gets the seccomp filter and the Landlock rules as data: it cannot import the nanochat package).
"""

from __future__ import annotations

import contextlib
import json
import math
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
_VERDICTS = {_EXIT_PASS: "pass", _EXIT_FAIL: "fail", _EXIT_ERROR: "error"}
_NOBODY = 65534
_REPORT_BYTES = 4096  # the harness pipe: the isolation line, then the verdict
_DRAIN_WAIT_S = 2.0  # how long the pipes may stay open after the run (held by a process that escaped)


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


def _can_drop_to_nobody() -> bool:
    """Whether the child may switch to nobody (nanochat/sandbox_privileges.py; imported here, not at
    the top: the child runs this file without the nanochat package)."""
    from nanochat.sandbox_privileges import can_drop_to_nobody

    return can_drop_to_nobody()


def execute_code(code: str, *, timeout_s: float = 10.0, cpu_time_s: float | None = None,
                 memory_mb: int = 1024, max_output_bytes: int = 1 << 20, tail_chars: int = 4000,
                 max_workdir_bytes: int = 64 << 20, max_processes: int = 64,
                 cgroup_root: str | os.PathLike | None = "/sys/fs/cgroup", isolate: bool = True) -> ExecutionResult:
    """Run `code` in a sandboxed child process and classify the outcome.

    timeout_s: wall clock (the process group, and the PID namespace with it, is killed);
    cpu_time_s: RLIMIT_CPU (default timeout_s + 1); memory_mb: RLIMIT_AS, and with
    max_workdir_bytes added the cgroup's cap on all the program's processes together;
    max_output_bytes: RLIMIT_FSIZE for any file the program writes; tail_chars: how much of the
    end of stdout and stderr is kept (the rest is read and dropped); max_workdir_bytes: size of the
    tmpfs that holds the working dir (all files together; RAM, freed when the program ends);
    max_processes: the cgroup's pids.max (tasks: processes and threads, the sandbox's own up to 3
    included); cgroup_root: where cgroup hierarchies are looked for (None: no cgroup).
    isolate=False skips the namespaces, the capability drop, the uid drop and the seccomp filter
    (rlimits, the cgroup and the Python guard stay). A harness failing before the program ran raises RuntimeError.
    """
    from nanochat.sandbox_cgroup import (parse_report, program_cgroup, remove_workdir, validate,  # not in the child
                                         warn_refused)
    from nanochat.sandbox_seccomp import landlock_rules

    validate("execute_code", max_processes, cgroup_root, timeout_s=timeout_s, cpu_time_s=cpu_time_s,
             memory_mb=memory_mb, tail_chars=tail_chars, max_output_bytes=max_output_bytes,
             max_workdir_bytes=max_workdir_bytes)
    # RLIMIT_CPU is whole seconds: rounded up (never less than the caller allowed), and this figure
    # is the one the timeout message names; setrlimit takes a C long
    cpu = max(1, min(math.ceil(cpu_time_s if cpu_time_s is not None else timeout_s + 1), 1 << 31))
    drop = isolate and _can_drop_to_nobody()
    # the cgroup is left (its leftovers killed) before the working dir is deleted; a failed deletion
    # (a leftover still writing there) must not raise: one program would end the whole evaluation
    workdir = tempfile.TemporaryDirectory(prefix="nanochat_exec_", ignore_cleanup_errors=True)
    with contextlib.ExitStack() as stack:
        stack.callback(remove_workdir, workdir)
        cgroup = stack.enter_context(program_cgroup(cgroup_root, max_processes, (memory_mb << 20) + max_workdir_bytes))
        work = Path(workdir.name)
        # surrogatepass: lone surrogates reach compile(), which rejects them as Python itself does
        (work / "program.py").write_bytes(code.encode("utf-8", errors="surrogatepass"))
        config = {"workdir": str(work), "cpu_s": cpu, "memory_bytes": memory_mb << 20,
                  "fsize_bytes": max_output_bytes, "workdir_bytes": max_workdir_bytes, "isolate": isolate,
                  "drop_uid": drop, "seccomp": _seccomp_filters() if isolate else {},
                  "landlock": landlock_rules(str(work), _SAFE_DEVICES) if isolate else [],
                  "cgroups": cgroup.join_paths(), "parent_pid": os.getpid()}
        t0 = time.monotonic()
        rc, timed_out, cpu_used, (stdout, stderr, report) = _run_child(work, config, timeout_s, tail_chars, cgroup.kill)
        duration = time.monotonic() - t0
        caps_hit = cgroup.limits_hit()
    if not (report or timed_out):  # its first write precedes the program: a sandbox fault, not the model's
        raise RuntimeError(f"nanochat sandbox: the harness failed before the program ran (exit code {rc}): "
                           f"{stderr.strip()[-2000:] or 'no output'}")
    isolation, verdict = parse_report(report)
    warn_refused(isolation, ["pids_cap", "memory_cap"] * (cgroup_root is not None) + ["netns", "readonly_fs",
                 "workdir_cap", "ipcns", "pidns", "no_caps"] * isolate + ["seccomp"] * bool(config["seccomp"])
                 + ["uid_drop"] * (isolate and os.geteuid() == 0))
    status, detail = _classify(rc, timed_out, timeout_s, cpu, cpu_used, stderr, verdict)
    if caps_hit and status != "pass":
        detail = "; ".join([detail, *caps_hit])
    return ExecutionResult(status, stdout, stderr, rc, duration, detail, tuple(isolation))


def _seccomp_filters() -> dict[str, str]:
    from nanochat.sandbox_seccomp import child_filters  # built here: the child cannot import nanochat

    return child_filters()


def _run_child(work: Path, config: dict, timeout_s: float, tail_chars: int, kill_cgroup) -> tuple:
    """Start the sandbox child in `work`, wait (killing its group at the deadline, then what is left in
    its cgroup): (exit code, timed out, CPU seconds used, (stdout tail, stderr tail, harness report))."""
    (out_r, out_w), (err_r, err_w), (ver_r, ver_w) = os.pipe(), os.pipe(), os.pipe()
    try:
        config["verdict_fd"] = ver_w  # pass_fds keeps the number in the child
        (work / "config.json").write_text(json.dumps(config))
        if config["drop_uid"]:
            for p in [work, *work.iterdir()]:
                os.chown(p, _NOBODY, _NOBODY)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
               "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-I", "-B", str(Path(__file__).resolve()), "--sandbox-child", str(work / "config.json")]
        proc = subprocess.Popen(cmd, cwd=work, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w, env=env,
                                start_new_session=True, close_fds=True, pass_fds=(ver_w,))
    except BaseException:
        for fd in (out_r, err_r, ver_r):
            os.close(fd)
        raise
    finally:
        for fd in (out_w, err_w, ver_w):
            os.close(fd)
    from nanochat.sandbox_cgroup import watch_child

    keep = 4 * tail_chars + 4  # UTF-8: at most 4 bytes per character
    pipes = {out_r: (keep, tail_chars), err_r: (keep, tail_chars), ver_r: (_REPORT_BYTES, _REPORT_BYTES)}
    timed_out, cpu_used, tails = watch_child(proc, pipes, timeout_s, _DRAIN_WAIT_S, kill_cgroup, work)
    return proc.returncode, timed_out, cpu_used, tails


def _classify(rc: int, timed_out: bool, timeout_s: float, cpu: int, cpu_s: float, stderr: str, verdict: str):
    from nanochat.sandbox_cgroup import classify  # the parent's side: the child cannot import it

    return classify(rc, timed_out, timeout_s, cpu, cpu_s, stderr, verdict, _VERDICTS)


def execute_many(programs: list[str], *, workers: int | None = None, **kw) -> list[ExecutionResult]:
    """execute_code over many programs with a thread pool (each program is its own process)."""
    workers = workers or max(1, min(len(programs), os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda c: execute_code(c, **kw), programs))


# ---------------------------------------------------------------------------------------------
# Child side: everything below runs inside the sandboxed interpreter.
# ---------------------------------------------------------------------------------------------

_CLONE_NEWNS, _CLONE_NEWIPC, _CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 8, 0x1000, 0x4000, 0x40000
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NODEV = -100, 0x8000, 0x1, 0x4
# the only device nodes a program may open (every mount is nodev: see "readonly_fs" above)
_SAFE_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_SYS_MOUNT_SETATTR = 442  # same number on x86_64 and aarch64 (generic syscall table)


def _unshare_namespaces(workdir: str, as_real_root: bool, cap_bytes: int, owner: int | None) -> list[str]:
    """Enter new net + mount namespaces, mount a tmpfs of cap_bytes (owned by `owner` when the
    program will run as that uid) over workdir and make every other mount read-only; then unshare
    a PID namespace (it applies to the next fork: see _fork_pid_namespace)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    attempts = [_CLONE_NEWNS | _CLONE_NEWNET] if as_real_root else []
    # not for a root about to become `owner` (nobody): a user namespace made by root maps uid 0
    # alone, so the switch would fail in it and the working dir (owner's, 0700) be closed to it;
    # where the plain namespaces are refused (no CAP_SYS_ADMIN: most containers), the program runs
    # as nobody outside namespaces instead
    if owner is None:
        attempts.append(_CLONE_NEWUSER | _CLONE_NEWNS | _CLONE_NEWNET)
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
    # private first: a mount made in a shared tree would propagate to the host's namespace
    ok = libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) == 0
    # the tmpfs caps all the program's files together (RLIMIT_FSIZE caps each one) and keeps them
    # off the host disk; nr_inodes bounds empty files too (their inodes are kernel memory)
    opts = f"size={cap_bytes},nr_inodes={max(256, cap_bytes >> 12)},mode=0700"
    opts += f",uid={owner},gid={owner}" if owner is not None else ""
    capped = ok and libc.mount(b"tmpfs", wd, b"tmpfs", _MS_NOSUID | _MS_NODEV, opts.encode()) == 0
    ok = ok and (capped or libc.mount(wd, wd, None, _MS_BIND | _MS_REC, None) == 0)
    if ok and setattr_("/", _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NODEV, 0) and setattr_(workdir, 0, _MOUNT_ATTR_RDONLY):
        for dev in _SAFE_DEVICES:  # each bound over itself, and that one mount made dev again
            if libc.mount(dev.encode(), dev.encode(), None, _MS_BIND, None) == 0:
                setattr_(dev, 0, _MOUNT_ATTR_NODEV)
        try:  # one not bound back stays closed (/dev/null: every library's): check them all
            for dev in filter(os.path.exists, _SAFE_DEVICES):
                os.close(os.open(dev, os.O_WRONLY if dev == "/dev/null" else os.O_RDONLY))
            applied.append("readonly_fs")
        except OSError:  # /dev gets its devices back, the layer is not claimed (mounts stay read-only)
            setattr_("/dev", 0, _MOUNT_ATTR_NODEV)
    if capped:
        applied.append("workdir_cap")
    if libc.unshare(_CLONE_NEWIPC) == 0:  # SysV / POSIX IPC objects: the program's die with the run
        applied.append("ipcns")
    if libc.unshare(_CLONE_NEWPID) == 0:
        applied.append("pidns")
    return applied


_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 38, 47, 4
_CAP_VERSION_3 = 0x20080522


def _drop_capabilities(drop_uid: bool) -> list[str]:
    """Lose every capability for good (bounding set, ambient, effective / permitted / inheritable)
    and set no_new_privs, switching to nobody first when asked. Capabilities are what would let a
    root program (or the root of our user namespace) remount the filesystem read-write, setns back
    into the host's namespaces or raise its own limits."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    cap = 0
    while libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # EINVAL past the kernel's last cap
        cap += 1
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    applied = []
    if drop_uid and os.geteuid() == 0:  # needs CAP_SETUID, so before the capset below
        os.setgroups([])
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)
        applied.append("uid_drop")
    capset = getattr(libc, "capset", None)  # glibc and musl export it
    header = (ctypes.c_uint32 * 2)(_CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    if capset is not None and capset(header, data) == 0 and cap > 0:
        applied.append("no_caps")
    return applied


_SYS_LANDLOCK = 444  # landlock_create_ruleset; + 1 add_rule, + 2 restrict_self (both ABIs)


def _landlock(rules: list) -> list[str]:
    """Enter for good the Landlock domain of `rules` (nanochat/sandbox_seccomp.py's landlock_rules)."""
    import ctypes
    import struct

    libc = ctypes.CDLL(None, use_errno=True)
    ruleset = libc.syscall(_SYS_LANDLOCK, bytes.fromhex(rules[0]), len(rules[0]) // 2, 0) if rules else -1
    if ruleset < 0:
        return []
    try:
        for i, (path, rights) in enumerate(rules[1:]):
            added = False
            with contextlib.suppress(OSError):  # a missing device: simply not writable
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
                added = libc.syscall(_SYS_LANDLOCK + 1, ruleset, 1, struct.pack("<Qi", rights, fd), 0) == 0
                os.close(fd)
            if i == 0 and not added:  # the working dir (the first rule) must stay writable: no domain
                return []
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        return ["landlock"] if libc.syscall(_SYS_LANDLOCK + 2, ruleset, 0) == 0 else []
    finally:
        os.close(ruleset)


_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, _OWN_PID = 22, 2, 0x7FFFFFFF  # sandbox_seccomp.OWN_PID: see below


def _with_own_pid(program: bytes, pid: int) -> bytes:
    """`program` with `pid` for each instruction's constant _OWN_PID: the program's pid, which the
    parent could not know (outside a PID namespace it may signal itself, not other processes)."""
    slot, own, k = _OWN_PID.to_bytes(4, "little"), pid.to_bytes(4, "little"), range(4, len(program), 8)
    return b"".join(program[i - 4:i] + (own if program[i:i + 4] == slot else program[i:i + 4]) for i in k)


def _install_seccomp(program: bytes) -> list[str]:
    """Install the parent's seccomp-BPF filter (nanochat/sandbox_seccomp.py: no sockets but
    AF_INET / AF_INET6, no io_uring) on this process and everything it starts; it stays for good."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(_with_own_pid(program, os.getpid()), len(program))
    fprog = SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    # a filter needs no_new_privs (or CAP_SYS_ADMIN): set here too, not only by the capability drop
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return []
    installed = libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0
    return ["seccomp"] if installed else []


def _exit_like_init(status: int) -> None:
    """End this process the way the program ended, from the wait status of init, which reports
    a program killed by signal N as exit code 128 + N (or was killed itself)."""
    import resource

    code = os.waitstatus_to_exitcode(status)
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    if not sig:
        os._exit(code)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, ValueError):
        signal.signal(sig, signal.SIG_DFL)  # Python ignores SIGPIPE / SIGXFSZ by default
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal that did not end us (should not happen)


def _die_with_parent(*, pid: int | None = None, pipe: int | None = None) -> None:
    """SIGKILL this process when its parent dies: a caller killed mid-run (OOM killer, a SIGKILLed
    rank) left the program running with no wall clock at all. Fork and a uid change clear it, so
    each process sets its own. A parent already gone is no race: `pid` is the one it must still
    have, or `pipe` a pipe whose write end only the parent holds (EOF: gone; a PID namespace's init
    sees no parent pid)."""
    import ctypes
    import select

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if (pid is not None and os.getppid() != pid) or (pipe is not None and select.select([pipe], [], [], 0)[0]):
        os._exit(_EXIT_ERROR)


def _fork_pid_namespace(own_proc: bool) -> list[str]:
    """Returns in the program's process, pid 2 of the new PID namespace, with "procfs" if it mounted
    its namespace's /proc (only `own_proc`: where the mounts are private, none reaching the host).

    This process waits and mirrors the outcome. Its child is the namespace's init (pid 1): it
    reaps orphans and leaves with the program's status (as 128 + signal when killed: signals that
    an init sends itself are ignored). When init exits, or the parent kills our process group
    (init stays in it; the program may leave with setsid), the kernel kills the whole namespace."""
    alive_r, alive_w = os.pipe()  # the harness's end closes only when it dies: init's check for a parent
    init = os.fork()
    if init:
        os.close(alive_r)
        _exit_like_init(os.waitpid(init, 0)[1])
    os.close(alive_w)
    _die_with_parent(pipe=alive_r)
    os.close(alive_r)
    program = os.fork()
    if program == 0:  # over the host's /proc, which showed every process (see "procfs" above)
        import ctypes

        flags = _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
        return ["procfs"] if own_proc and ctypes.CDLL(None).mount(b"proc", b"/proc", b"proc", flags, None) == 0 else []
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # no KeyboardInterrupt in init
    try:
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == program:
                break
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    except BaseException:  # noqa: BLE001 - init must never outlive its program
        os._exit(_EXIT_ERROR)


def _set_rlimits(cfg: dict) -> None:
    import resource

    def limit(which, soft, hard=None):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(which, (soft, soft if hard is None else hard))

    limit(resource.RLIMIT_CPU, cfg["cpu_s"], cfg["cpu_s"] + 1)
    limit(resource.RLIMIT_AS, cfg["memory_bytes"])
    limit(resource.RLIMIT_FSIZE, cfg["fsize_bytes"])
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, 64)
    if os.getuid() != 0:  # uid 0 ignores RLIMIT_NPROC: there the guard and the PID namespace remain
        limit(resource.RLIMIT_NPROC, 0)


_OS_DISABLED = (
    "system", "popen", "fork", "forkpty", "vfork", "kill", "killpg", "abort", "_exit", "execl", "execle",
    "execlp", "execlpe", "execv", "execve", "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
    "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir",
    "removedirs", "rename", "renames", "replace", "truncate", "ftruncate", "link", "symlink", "mkfifo", "mknod",
    "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "chroot", "chdir", "fchdir", "setuid", "setgid",
    "seteuid", "setegid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "plock",
    "register_at_fork", "pidfd_open",
)  # putenv stays: it only touches this process's environment, and numpy's import calls it
_BLOCKED_MODULES = (
    "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "ctypes", "_ctypes",
    "socket", "_socket", "ssl", "_ssl", "pty", "posix", "nt", "webbrowser", "urllib.request",
    "http.client", "ftplib", "smtplib", "telnetlib", "asyncio",
)  # not pdb: doctest imports it, and solutions often end with `doctest.testmod()` (stdin is closed)


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


def _join_cgroups(paths: dict[str, list[str]]) -> list[str]:
    """Enter the run's cgroup(s) (cgroup.procs path -> its layers) first of all: every process the
    program starts is then born under their caps. A refused one is simply not claimed."""
    applied = []
    for procs, layers in paths.items():
        with contextlib.suppress(OSError):
            Path(procs).write_text(str(os.getpid()))
            applied += layers
    return applied


def _child_main(config_path: str) -> None:
    cfg = json.loads(Path(config_path).read_text())
    _die_with_parent(pid=cfg["parent_pid"])  # the caller's wall clock is the program's only one
    applied = _join_cgroups(cfg["cgroups"])
    workdir = cfg["workdir"]
    raw = Path(workdir, "program.py").read_bytes()  # before the tmpfs hides the host's copy
    if cfg["isolate"]:
        try:
            applied += _unshare_namespaces(workdir, os.geteuid() == 0, cfg["workdir_bytes"],
                                           _NOBODY if cfg["drop_uid"] else None)
        except OSError:
            pass
        if "workdir_cap" in applied:  # tracebacks and inspect.getsource read program.py from cwd
            try:
                Path(workdir, "program.py").write_bytes(raw)
            except OSError:  # larger than the cap: the program still runs, without source lines
                pass
        if "pidns" in applied:
            # from here on: the program's process, pid 2 in the namespace (its /proc: private mounts)
            applied += _fork_pid_namespace(own_proc=bool({"readonly_fs", "workdir_cap"} & set(applied)))
        applied += _drop_capabilities(cfg["drop_uid"])
        if "pidns" not in applied:  # the uid drop cleared it (in the namespace, init's death kills all)
            _die_with_parent(pid=cfg["parent_pid"])
        applied += _landlock(cfg["landlock"])
    _set_rlimits(cfg)
    applied.append("rlimits")
    os.chdir(workdir)
    # last before the program: nothing the harness does from here on needs a socket (its pipes are
    # inherited fds). Outside the namespaces it denies AF_INET / AF_INET6, signals and ptrace too.
    filter_hex = cfg["seccomp"].get("netns" if "pidns" in applied else "no_netns")
    if filter_hex:
        try:
            applied += _install_seccomp(bytes.fromhex(filter_hex))
        except OSError:  # no libc to call: the layer is simply not claimed
            pass
    applied.append("python_guard")
    os.write(cfg["verdict_fd"], (json.dumps(applied) + "\n").encode())
    _run_program(raw.decode("utf-8", errors="surrogatepass"), cfg["verdict_fd"])


def _run_program(source: str, verdict_fd: int) -> None:
    """Run the program as `__main__` (its own module, so pickle and typing find its classes) and
    leave with the verdict's exit code."""
    import traceback
    import types

    exit_now, write, flush = os._exit, os.write, (sys.stdout.flush, sys.stderr.flush)
    _python_guard()
    main = types.ModuleType("__main__")
    main.__file__ = "program.py"
    harness, sys.modules["__main__"], sys.argv = sys.modules["__main__"], main, ["program.py"]
    code = _EXIT_PASS
    try:
        exec(compile(source, "program.py", "exec"), main.__dict__)
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
    del harness
    try:
        write(verdict_fd, _VERDICTS[code].encode())
    except OSError:  # the program closed it: no verdict, so the parent reports an error
        pass
    exit_now(code)


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--sandbox-child":
    _child_main(sys.argv[2])
