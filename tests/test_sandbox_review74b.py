"""Review 74b of the code sandbox (nanochat/execution.py): two regressions of review 74's layers.

* Outside a PID namespace (Docker's default profile; a user on Ubuntu 24.04, as on a DGX Spark) the
  seccomp filter denied tgkill / tkill for every target and kill() but to pid 0, so a program could
  not signal itself: `signal.raise_signal` raised PermissionError, and a C abort() died by SIGSEGV
  (glibc's last resort) instead of SIGABRT, a misleading failure detail. Its own pid is now allowed
  (baked into the filter by the child, which alone knows it); other processes stay out of reach.
* Every mount became nodev with /dev/null, zero, full, random and urandom bound back, but a bind
  that failed was never noticed: open(os.devnull) was refused while "readonly_fs" was reported.
  Now the devices are checked; a closed one gives /dev its devices back and the layer is not claimed.
"""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from nanochat import execution
from nanochat import sandbox_seccomp as sc
from tests.test_execution import _run_bpf
from tests.test_sandbox_review74 import _OTHER_PROCESSES, caller_cmd

REPO = Path(__file__).resolve().parents[1]
_EPERM, _ALLOW = sc.SECCOMP_RET_ERRNO | errno.EPERM, sc.SECCOMP_RET_ALLOW


def test_filter_allows_signals_to_the_programs_own_pid_only():
    pid, other = 4321, 1234
    for abi, a in sc.ABIS.items():
        outside = sc.build_filter(abi, allow_inet=False, allow_signals=False, own_pid=pid)
        def decide(nr, *args, prog=outside, arch=a.audit_arch):
            return _run_bpf(prog, nr, arch, args)
        kill, tkill, tgkill, sigqueue, tgsigqueue = a.signals
        # itself: kill, raise() (tgkill with its own tgid, any of its threads), sigqueue
        assert [decide(kill, pid, 10), decide(tkill, pid, 10), decide(tgkill, pid, pid + 1, 10),
                decide(sigqueue, pid, 10, 0), decide(tgsigqueue, pid, pid, 10, 0)] == [_ALLOW] * 5
        assert decide(kill, 0, 10) == _ALLOW  # its own process group
        # anyone else: another pid, its parent's group (-pid), every process (-1), another tgid
        for target in (other, -other & 0xFFFFFFFF, 0xFFFFFFFF, -pid & 0xFFFFFFFF, pid + 1):
            assert [decide(nr, target, target, 10) for nr in a.signals] == [_EPERM] * 5, (abi, target)
        # tracing stays denied whatever the first argument (ptrace's is the request, not a pid)
        assert [decide(nr, pid, pid) for nr in (*a.tracing, sc.PIDFD_SEND_SIGNAL)] == [_EPERM] * 4
        assert decide(kill, pid | 1 << 32, 10) == _ALLOW  # the kernel reads an int: the low word
        with pytest.raises(ValueError, match="own_pid"):
            sc.build_filter(abi, allow_signals=False, own_pid=0)


def test_the_child_bakes_its_pid_into_the_filter_the_parent_built():
    """The parent builds the filter before the child exists: the slot (sc.OWN_PID, no real pid)
    becomes the child's pid there, the same program as one built for that pid."""
    assert execution._OWN_PID == sc.OWN_PID
    for abi in sc.ABIS:
        unbaked = sc.build_filter(abi, allow_inet=False, allow_signals=False)
        baked = execution._with_own_pid(unbaked, 987654)
        assert baked == sc.build_filter(abi, allow_inet=False, allow_signals=False, own_pid=987654)
        assert baked != unbaked and execution._with_own_pid(sc.build_filter(abi), 987654) == sc.build_filter(abi)


# The caller runs execute_code with new namespaces refused to it (our own filter denies unshare, as
# Docker's default profile does) and reports each program's outcome.
_CALLER = """
import json, sys, warnings
warnings.simplefilter('ignore')
sys.path.insert(0, {repo!r})
from nanochat import execution, sandbox_seccomp
assert execution._install_seccomp(sandbox_seccomp.native_filter()) == ['seccomp']
out = []
for code in {programs!r}:
    r = execution.execute_code(code, timeout_s=20)
    out.append([r.status, list(r.isolation), r.stdout, r.stderr[-2000:], r.returncode, r.detail])
print(json.dumps(out))
"""

# past the Python guard (ctypes, the posix module): the program signals itself every way, from a
# thread too, then tries its parent (the caller) with signal 0 (harmless if it got through)
_OWN_SIGNALS = _OTHER_PROCESSES.split("try_('kill'")[0] + """
import json, threading
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
try_('raise', lambda: signal.raise_signal(signal.SIGUSR1))
try_('kill_self', lambda: posix.kill(os.getpid(), signal.SIGUSR1))
t = threading.Thread(target=try_, args=('thread', lambda: signal.pthread_kill(threading.main_thread().ident,
                                                                                 signal.SIGUSR1)))
try:  # RLIMIT_NPROC = 0 (a user's program) leaves no threads
    t.start(); t.join()
except RuntimeError:
    print('thread none')
try_('sigqueue', lambda: libc.sigqueue(os.getpid(), signal.SIGUSR1, C.c_void_p(0)))
try_('parent', lambda: posix.kill(os.getppid(), 0))
try_('tgkill_parent', lambda: libc.syscall(TGKILL, os.getppid(), os.getppid(), 0))
time.sleep(0.05)
print('handled', len(got))
"""
_ABORT = _OTHER_PROCESSES.split("try_('kill'")[0] + "libc.abort()\n"


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_outside_namespaces_the_program_signals_itself_but_not_its_parent(as_user):
    abi = sc.native_abi()
    if abi is None:
        pytest.skip("no seccomp filter for this ABI")
    own = _OWN_SIGNALS.replace("TGKILL", str(sc.ABIS[abi].signals[2]))
    script = _CALLER.format(repo=str(REPO), programs=[own, _ABORT])
    cmd = caller_cmd(script, as_user=as_user)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/", check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (status, isolation, stdout, stderr, _, _), aborted = json.loads(out.stdout)
    assert status == "pass", (isolation, stderr)
    assert "pidns" not in isolation and "seccomp" in isolation, isolation
    got = dict(line.split() for line in stdout.splitlines())
    eperm = str(errno.EPERM)
    threads = got["thread"] == "ok"
    assert as_user or threads, stdout  # root's program has threads
    assert got == {"raise": "ok", "kill_self": "ok", "thread": got["thread"], "sigqueue": "ok", "parent": eperm,
                   "tgkill_parent": eperm, "handled": str(3 + threads)}, stdout
    # abort(): SIGABRT, as anywhere else (it was SIGSEGV: raise() refused, glibc's last resort)
    assert aborted[0] == "error" and aborted[4] == -6 and aborted[5] == "killed by signal SIGABRT", aborted


# _unshare_namespaces in a process of its own, its libc refusing every bind of a device node (as a
# failed bind would): does /dev/null still open, what is claimed, are the mounts still read-only?
_NO_DEVICE_BINDS = """
import ctypes, json, os, sys, tempfile
sys.path.insert(0, {repo!r})
from nanochat import execution
real = ctypes.CDLL
class NoDeviceBinds:
    def __init__(self, *a, **kw):
        self.libc = real(*a, **kw)
    def __getattr__(self, name):
        return getattr(self.libc, name)
    def mount(self, src, dst, fstype, flags, data):
        if flags == execution._MS_BIND and src.startswith(b'/dev/'):
            return -1
        return self.libc.mount(src, dst, fstype, flags, data)
work, other = (tempfile.mkdtemp(prefix='nanochat_review74b_') for _ in range(2))
print(work, other, flush=True)
ctypes.CDLL = NoDeviceBinds
applied = execution._unshare_namespaces(work, os.geteuid() == 0, 1 << 20, None)
def try_(call):
    try:
        call()
        return 'ok'
    except OSError as e:
        return e.errno
print(json.dumps([applied, try_(lambda: os.close(os.open('/dev/null', os.O_WRONLY))),
                  try_(lambda: open(os.path.join(other, 'x'), 'w'))]))
"""


@pytest.mark.parametrize("as_user", [False, True], ids=["root", "user"])
def test_a_device_not_bound_back_is_noticed_and_dev_null_still_opens(as_user):
    script = _NO_DEVICE_BINDS.format(repo=str(REPO))
    cmd = caller_cmd(script, as_user=as_user, why_root="needs root to make a mount namespace without a user namespace")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd="/", check=False)
    dirs, *rest = out.stdout.splitlines() or [""]
    for d in dirs.split():  # made by the script before its namespace: on the host
        if d.startswith(("/tmp", os.environ.get("TMPDIR", "/tmp"))):
            shutil.rmtree(d, ignore_errors=True)
    assert out.returncode == 0 and rest, out.stderr[-3000:]
    applied, dev_null, outside_write = json.loads(rest[0])
    if "netns" not in applied or outside_write == "ok":
        pytest.skip(f"no read-only mount namespace here (applied: {applied})")
    # before: "readonly_fs" claimed while /dev/null was refused (EACCES: nodev)
    assert dev_null == "ok", (applied, dev_null)
    assert "readonly_fs" not in applied and outside_write == errno.EROFS, (applied, outside_write)
