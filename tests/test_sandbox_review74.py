"""Review 74 of the code sandbox (nanochat/execution.py), as root and as a non-root user: device nodes
and the host's /proc, two ways past the read-only mount namespace.

* A read-only mount does not stop writes to a device node (the kernel checks the mount only for
  regular files): a program running as root could open a root-owned disk (brw------- root) and
  write it raw, whatever the mounts said; any uid could open a world-writable node. Every mount is
  now also nodev, with /dev/null, zero, full, random and urandom bound back.
* The program's PID namespace still read the host's /proc: every process on the machine showed
  (command lines), and as root (or as nobody after the uid drop) a concurrent run's working dir was
  writable through /proc/PID/cwd and its memory readable through /proc/PID/mem. A procfs of the
  program's own namespace now covers it ("procfs").
* Where the OS refuses namespaces (Docker's default seccomp profile; Ubuntu 24.04's restricted user
  namespaces, as on a DGX Spark, for a user) the program could kill any process of its uid (the
  caller, a training run) and, as a user where Yama allows, ptrace one. Outside a PID namespace the
  seccomp filter now denies signals to other processes, ptrace and process_vm_readv / writev.
* There, too, the program could write and delete every file its uid may (a user's home, root's
  checkpoints) and read /proc/PID/environ (API keys) of its uid's processes: the only barrier was
  the Python guard. A Landlock ruleset ("landlock", Linux >= 5.13) now lets it write only in its
  working dir (and the safe devices) and reach no process outside its own.
"""

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nanochat import execution
from nanochat import sandbox_seccomp as sc
from nanochat.execution import execute_code

REPO = Path(__file__).resolve().parents[1]

# opens each path (write for the device copies, read for the safe ones) and reports what happened
_DEVICES = """
import json, os
out = {}
for path, mode in PATHS:
    try:
        fd = os.open(path, mode | os.O_NOCTTY)
        out[path] = len(os.read(fd, 4)) if mode == os.O_RDONLY else os.write(fd, b"x")
        os.close(fd)
    except OSError as e:
        out[path] = e.strerror
print(json.dumps(out))
"""
_SAFE = [("/dev/null", "os.O_WRONLY"), ("/dev/zero", "os.O_RDONLY"), ("/dev/urandom", "os.O_RDONLY"),
         ("/dev/full", "os.O_RDONLY"), ("/dev/random", "os.O_RDONLY")]

# what the program sees of /proc: its own pid there, how many processes, and whether the caller shows
_PROC = """
import json, os
pids = [p for p in os.listdir('/proc') if p.isdigit()]
print(json.dumps([os.readlink('/proc/self'), len(pids), os.path.exists('/proc/%d/cmdline' % CALLER)]))
"""


def _devices_program(extra: list[tuple[str, str]]) -> str:
    paths = ", ".join(f"({p!r}, {m})" for p, m in _SAFE + extra)
    return _DEVICES.replace("PATHS", f"[{paths}]")


def _isolated_or_skip(res, *layers: str) -> None:
    missing = [x for x in layers if x not in res.isolation]
    if missing:
        pytest.skip(f"the OS refused {missing} here (applied: {res.isolation})")


@pytest.fixture
def root_keeps_uid(monkeypatch):
    """The path of a root caller whose interpreter nobody can read (pyenv / uv under /root): the
    program runs as uid 0 with no capabilities."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setattr(execution, "_can_drop_to_nobody", lambda: False)


def test_a_root_program_cannot_write_a_device_node_on_a_read_only_mount(tmp_path, root_keeps_uid):
    """A root-owned node, mode 0600 (as a disk is): root owns it, so without nodev the program
    opened it for writing on the read-only mount. Stands in for /dev/sdX (char 1,3: the kernel's
    null device, so nothing is harmed either way)."""
    node = tmp_path / "disk"
    try:
        os.mknod(node, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    except OSError as e:
        pytest.skip(f"cannot make a device node here: {e}")
    res = execute_code(_devices_program([(str(node), "os.O_WRONLY")]), timeout_s=20)
    assert res.status == "pass", (res.status, res.stderr[-2000:])
    _isolated_or_skip(res, "readonly_fs")
    got = json.loads(res.stdout)
    assert got.pop(str(node)) == "Permission denied", res.stdout
    # the devices programs use stay: /dev/null takes writes, the others read
    assert got == {"/dev/null": 1, "/dev/zero": 4, "/dev/urandom": 4, "/dev/full": 4, "/dev/random": 4}, got


def test_the_program_sees_its_own_processes_in_proc_not_the_hosts(root_keeps_uid):
    res = execute_code(_PROC.replace("CALLER", str(os.getpid())), timeout_s=20)
    assert res.status == "pass", (res.status, res.stderr[-2000:])
    _isolated_or_skip(res, "pidns")
    me, n_pids, caller_visible = json.loads(res.stdout)
    assert "procfs" in res.isolation, res.isolation
    # pid 1 is the namespace's init, 2 the program: nothing of the host's
    assert (me, caller_visible) == ("2", False) and n_pids <= 3, res.stdout


def test_a_concurrent_run_cannot_be_reached_through_proc(root_keeps_uid):
    """Before: program A found B's process by its command line in /proc and wrote a file into B's
    working dir (/proc/B/cwd: B's tmpfs, writable) and opened B's memory: two root programs without
    capabilities may ptrace-read each other."""
    victim = ("import os, time\nfor _ in range(50):\n    if os.path.exists('planted'):\n        break\n"
              "    time.sleep(0.03)\nprint(sorted(os.listdir('.')))\n")
    attacker = ("import os, time\ntime.sleep(0.5)\nhit = []\n"
                "for p in [p for p in os.listdir('/proc') if p.isdigit()]:\n"
                "    try:\n"
                "        if b'--sandbox-child' in open(f'/proc/{p}/cmdline', 'rb').read():\n"
                "            open(f'/proc/{p}/cwd/planted', 'w').write('x')\n"
                "            hit.append(p)\n"
                "    except OSError:\n"
                "        pass\n"
                "print(hit)\n")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("victim", execute_code(victim, timeout_s=20)))
    t.start()
    try:
        got["attacker"] = execute_code(attacker, timeout_s=20)
    finally:
        t.join()
    v, a = got["victim"], got["attacker"]
    assert (v.status, a.status) == ("pass", "pass"), (v.stderr[-1000:], a.stderr[-1000:])
    _isolated_or_skip(v, "pidns", "readonly_fs")
    assert v.stdout.strip() == "['program.py']", (v.stdout, a.stdout)


# --- the same as a non-root caller (user namespaces) -------------------------------------------

# the caller, started as a process of its own: optionally with new namespaces refused to it (as
# Docker's default seccomp profile does: here our own filter, which denies unshare), and a victim
# process of the same uid (a training run, the user's shell; API_KEY in its environment) started
# first, VICTIM in the program, and a dir of the caller's with keep.txt, KEEP in the program (made in
# `keep`, else in /tmp: nobody cannot reach pytest's tmp_path; removed at the end). Reports whether
# the victim survived and [keep.txt's text, whether new.txt exists].
_CALLER = ("import json, subprocess, sys, time, warnings\nwarnings.simplefilter('ignore')\n"
           "sys.path.insert(0, {repo!r})\nfrom nanochat import execution, sandbox_seccomp\n"
           "victim = subprocess.Popen(['sleep', '60'], env={{'PATH': '/usr/bin:/bin', 'API_KEY': 'sk-x'}},\n"
           "                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
           "if {no_namespaces}:\n"
           "    assert execution._install_seccomp(sandbox_seccomp.native_filter()) == ['seccomp']\n"
           "import os, shutil, tempfile\nkeep = tempfile.mkdtemp(dir={keep!r} or None)\n"
           "open(os.path.join(keep, 'keep.txt'), 'w').write('kept')\n"
           "code = {code!r}.replace('VICTIM', str(victim.pid)).replace('KEEP', keep)\n"
           "try:\n"
           "    r = execution.execute_code(code, timeout_s=20)\n"
           "    kept = [os.path.exists(os.path.join(keep, 'keep.txt')) and open(os.path.join(keep, 'keep.txt')).read(),\n"
           "            os.path.exists(os.path.join(keep, 'new.txt'))]\n"
           "    time.sleep(0.1)\n    alive = victim.poll() is None\n"
           "finally:\n"
           "    shutil.rmtree(keep, ignore_errors=True)\n    victim.kill()\n"
           "print(json.dumps([r.status, list(r.isolation), r.stdout, r.stderr[-2000:], alive, kept]))\n")


def _user_python() -> str:
    """An interpreter uid 65534 can run (setpriv), with this checkout readable to it; else skip."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to start a non-root caller")
    from nanochat.sandbox_privileges import _world_readable

    if not _world_readable(REPO / "nanochat" / "execution.py"):
        pytest.skip("the checkout is not readable by nobody")
    for python in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if python and _world_readable(Path(python)) and subprocess.run(
                [python, "-I", "-c", "import sys; sys.exit(sys.version_info < (3, 10))"]).returncode == 0:
            return python
    pytest.skip("no Python >= 3.10 that nobody can read")


def caller_cmd(script: str, *, as_user: bool, why_root: str = "needs root") -> list[str]:
    """The command that runs `script` as the sandbox's caller: root keeping its uid (this venv's
    Python), or uid 65534 through setpriv (as_user); skips where that caller cannot be made."""
    if as_user:
        return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", _user_python(), "-I", "-c", script]
    if os.geteuid() != 0:
        pytest.skip(why_root)
    return [sys.executable, "-I", "-c", script]


def _run_caller(code: str, *, as_user: bool, no_namespaces: bool = False, keep: str = "") -> tuple:
    """execute_code(code) in a caller process of its own: root keeping its uid (this venv's Python,
    under /root here: no uid drop) or uid 65534 (as_user)."""
    script = _CALLER.format(repo=str(REPO), code=code, no_namespaces=no_namespaces, keep=keep)
    if no_namespaces and sc.native_filter() is None:
        pytest.skip("no seccomp filter for this ABI: namespaces cannot be refused the way Docker does")
    cmd = caller_cmd(script, as_user=as_user)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return tuple(json.loads(out.stdout))


def _run_as_nobody(code: str) -> tuple:
    return _run_caller(code, as_user=True)[:4]


def test_as_a_user_other_device_nodes_are_closed_and_the_safe_ones_work():
    """/dev/ptmx is world-writable on every Linux (a node like a disk a user's group may write):
    before, the program opened it; the safe devices still work."""
    if not os.path.exists("/dev/ptmx"):
        pytest.skip("no /dev/ptmx")
    status, isolation, stdout, stderr = _run_as_nobody(_devices_program([("/dev/ptmx", "os.O_RDWR")]))
    assert status == "pass", (isolation, stderr)
    if "readonly_fs" not in isolation:
        pytest.skip(f"no mount namespace for a user here (applied: {isolation})")
    got = json.loads(stdout)
    assert got.pop("/dev/ptmx") == "Permission denied", stdout
    assert got == {"/dev/null": 1, "/dev/zero": 4, "/dev/urandom": 4, "/dev/full": 4, "/dev/random": 4}, got


def test_as_a_user_the_program_sees_only_its_own_processes():
    status, isolation, stdout, stderr = _run_as_nobody(_PROC.replace("CALLER", "1"))
    assert status == "pass", (isolation, stderr)
    if "pidns" not in isolation:
        pytest.skip(f"no PID namespace for a user here (applied: {isolation})")
    me, n_pids, _ = json.loads(stdout)
    assert "procfs" in isolation and me == "2" and n_pids <= 3, (isolation, stdout)


# --- outside a PID namespace: no signals to, or ptrace of, other processes --------------------

# past the Python guard (ctypes loaded from its files, the posix module behind os): kill the victim,
# ptrace-attach it, then the calls that must keep working (its own group, the kernel's SIGALRM)
_OTHER_PROCESSES = """
import sys, importlib.machinery as m, importlib.util as u
def load(name):
    spec = m.PathFinder.find_spec(name) or m.BuiltinImporter.find_spec(name)
    mod = u.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)
    return mod
load('_ctypes'); C = load('ctypes')
import os, signal, time
posix = os.stat.__self__
libc = C.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [C.c_long, C.c_long, C.c_void_p, C.c_void_p]
def try_(name, call):
    try:
        r = call()
        print(name, C.get_errno() if r == -1 else 'ok')
    except OSError as e:
        print(name, e.errno)
try_('kill', lambda: posix.kill(VICTIM, signal.SIGKILL))
try_('killpg', lambda: posix.killpg(VICTIM, signal.SIGKILL))
if libc.ptrace(16, VICTIM, None, None) == 0:  # PTRACE_ATTACH
    print('ptrace ok'); libc.ptrace(17, VICTIM, None, None)
else:
    print('ptrace', C.get_errno())
try_('own_group', lambda: posix.kill(0, 0))
signal.signal(signal.SIGALRM, lambda *a: print('alarm ok'))
signal.setitimer(signal.ITIMER_REAL, 0.01)
time.sleep(0.2)
"""


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_outside_namespaces_the_program_cannot_kill_or_trace_other_processes(as_user):
    status, isolation, stdout, stderr, alive, _ = _run_caller(_OTHER_PROCESSES, as_user=as_user, no_namespaces=True)
    assert status == "pass", (isolation, stderr)
    assert "pidns" not in isolation and "seccomp" in isolation, isolation
    got = dict(line.split() for line in stdout.splitlines())
    eperm = str(errno.EPERM)
    assert alive and got == {"kill": eperm, "killpg": eperm, "ptrace": eperm, "own_group": "ok",
                             "alarm": "ok"}, (stdout, alive)


def test_inside_a_pid_namespace_the_program_still_signals_its_own_processes():
    """With the namespaces the filter leaves signals alone: the victim is out of reach anyway (ESRCH:
    no such pid in the program's namespace), and the program's own processes take signals."""
    code = _OTHER_PROCESSES + ("try_('self', lambda: posix.kill(os.getpid(), 0))\n"
                               "import threading\ntry_('thread', lambda: signal.pthread_kill(threading.get_ident(), 0))\n")
    status, isolation, stdout, stderr, alive, _ = _run_caller(code, as_user=False)
    if "pidns" not in isolation:
        pytest.skip(f"no PID namespace here (applied: {isolation})")
    got = dict(line.split() for line in stdout.splitlines())
    assert status == "pass" and alive, (stdout, stderr)
    assert got["kill"] == got["killpg"] == str(errno.ESRCH) and got["self"] == got["thread"] == "ok", stdout


def test_filter_decisions_for_other_processes_per_abi():
    from tests.test_execution import _run_bpf

    EPERM, ALLOW = sc.SECCOMP_RET_ERRNO | errno.EPERM, sc.SECCOMP_RET_ALLOW
    for abi, a in sc.ABIS.items():
        inside, outside = sc.build_filter(abi), sc.build_filter(abi, allow_inet=False, allow_signals=False)
        calls = (*a.signals, *a.tracing, sc.PIDFD_SEND_SIGNAL, sc.PIDFD_GETFD)
        decide = lambda prog, nr, *args: _run_bpf(prog, nr, a.audit_arch, args)  # noqa: E731
        assert [decide(outside, nr, 1234) for nr in calls] == [EPERM] * len(calls)
        assert [decide(inside, nr, 1234) for nr in calls] == [ALLOW] * len(calls)
        kill = a.signals[0]
        assert decide(outside, kill, 1234, 9) == EPERM and decide(outside, kill, 0xFFFFFFFF, 9) == EPERM  # -1
        assert decide(outside, kill, 0, 9) == ALLOW and decide(inside, kill, 1234, 9) == ALLOW
        assert decide(outside, kill, 1 << 32, 9) == ALLOW  # the kernel reads an int: pid 0
    # the numbers, from the kernel's tables: kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo,
    # then ptrace, process_vm_readv / writev, on each ABI
    assert (sc.ABIS["x86_64"].signals, sc.ABIS["x86_64"].tracing) == ((62, 200, 234, 129, 297), (101, 310, 311))
    assert (sc.ABIS["aarch64"].signals, sc.ABIS["aarch64"].tracing) == ((129, 130, 131, 138, 240), (117, 270, 271))


# --- outside the namespaces: writes only in the working dir, no other process's /proc ---------

_WRITES = """
import os, json
posix = os.stat.__self__
out = {}
def try_(name, call):
    try:
        call(); out[name] = 'ok'
    except OSError as e:
        out[name] = e.errno
try_('overwrite', lambda: open('KEEP/keep.txt', 'w').write('gone'))
try_('delete', lambda: posix.unlink('KEEP/keep.txt'))
try_('create', lambda: open('KEEP/new.txt', 'w').write('x'))
try_('environ', lambda: open('/proc/VICTIM/environ', 'rb').read())
try_('own_dir', lambda: open('scratch.txt', 'w').write('x') and posix.unlink('scratch.txt'))
try_('devnull', lambda: open('/dev/null', 'w').write('x'))
try_('rename_in_own_dir', lambda: open('a.txt', 'w').write('x') and posix.rename('a.txt', 'b.txt'))
print(json.dumps(out))
"""


def _landlock_abi() -> int:
    """The kernel's Landlock ABI version (landlock_create_ruleset's version query), < 1 without it."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1)
    except (OSError, AttributeError):
        return -1


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_outside_namespaces_the_program_writes_only_in_its_working_dir(as_user, tmp_path):
    """A dir of the caller's (a user's home, root's checkpoints) with a file: before, the program
    overwrote and deleted it and created files there, and read the victim's API_KEY from
    /proc/PID/environ (as a user; root's processes hold capabilities, which keep it out)."""
    if _landlock_abi() < 1:
        pytest.skip("Landlock is not enabled in this kernel")
    status, isolation, stdout, stderr, alive, kept = _run_caller(
        _WRITES, as_user=as_user, no_namespaces=True, keep="" if as_user else str(tmp_path))
    assert status == "pass", (isolation, stderr)
    assert "landlock" in isolation and "netns" not in isolation, isolation
    got = json.loads(stdout)
    denied = {k: v for k, v in got.items() if v != "ok"}
    assert set(denied) == {"overwrite", "delete", "create", "environ"}, got
    assert set(denied.values()) <= {errno.EACCES, errno.EPERM} and alive, got
    assert kept == ["kept", False], kept  # keep.txt as it was, no new.txt


def test_landlock_rules_follow_the_kernels_abi():
    """Rights a kernel does not know make landlock_create_ruleset fail (EINVAL): each ABI gets its own."""
    import struct

    assert sc.landlock_rules("/w", ("/dev/null",), abi=0) == []
    for abi, fs, scopes in [(1, 0x1FF2, 0), (2, 0x3FF2, 0), (3, 0x7FF2, 0), (6, 0x7FF2, 3), (7, 0x7FF2, 3)]:
        attr, work, dev = sc.landlock_rules("/w", ("/dev/null",), abi=abi)
        assert struct.unpack("<QQQ", bytes.fromhex(attr)) == (fs, 0, scopes), abi
        assert work == ["/w", fs] and dev == ["/dev/null", 2 | (1 << 14) * (abi >= 3)], abi
    if _landlock_abi() >= 1:
        assert sc.landlock_abi() == _landlock_abi()
