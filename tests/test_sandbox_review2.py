"""Second review of the code sandbox: kernel objects that are not covered by the network / mount /
PID namespaces (SysV IPC, kernel keyrings), argument checks, and the warning a caller gets when the
OS refuses isolation layers. Attacks run only through `execute_code`."""

import ctypes
import errno
import math
import os
import warnings
from pathlib import Path

import pytest

from nanochat import execution
from nanochat import sandbox_cgroup
from nanochat import sandbox_seccomp as sc
from nanochat.execution import execute_code

# past the Python guard: ctypes loaded from its files (sys.modules holds None for it)
_CTYPES = ("import sys, importlib.machinery as m, importlib.util as u\n"
           "def load(name):\n"
           "    spec = m.PathFinder.find_spec(name) or m.BuiltinImporter.find_spec(name)\n"
           "    mod = u.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)\n"
           "    return mod\n"
           "load('_ctypes'); C = load('ctypes')\nlibc = C.CDLL(None, use_errno=True)\n"
           "libc.shmat.restype = C.c_void_p\n"
           "def call(name, *args):\n"
           "    r = getattr(libc, name)(*args)\n"
           "    print(name, 'ok' if r not in (-1, C.c_void_p(-1).value) else C.get_errno())\n"
           "    return r\n")
_IPC_CREAT, _IPC_RMID = 0o1000, 0


def _namespaces_or_skip() -> tuple:
    isolation = execute_code("pass").isolation
    if "netns" not in isolation:
        pytest.skip(f"namespaces unavailable here (applied: {isolation})")
    return isolation


def _host_shm_ids(key: int) -> list[int]:
    """shmids of the host's SysV segments with `key` (/proc/sysvipc/shm: key is column 1)."""
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [int(r.split()[1]) for r in rows if int(r.split()[0]) == key]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmctl.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    return libc


def test_sysv_shared_memory_stays_inside_the_run(monkeypatch):
    """SysV IPC objects live in the IPC namespace, which none of the others cover: a program's
    segment outlived the run (RAM held until reboot or ipcrm), and as root the program could attach
    the host's own segments by id. The seccomp filter is switched off here to test the namespace."""
    _namespaces_or_skip()
    monkeypatch.setattr(execution, "_seccomp_filters", lambda: {})
    libc = _libc()
    key, host_key = 0x5A000000 | os.getpid() & 0xFFFFFF, 0x5B000000 | os.getpid() & 0xFFFFFF
    host = libc.shmget(host_key, 4096, _IPC_CREAT | 0o600)  # the host's segment, root's / ours only
    assert host >= 0, ctypes.get_errno()
    spares = []
    while host == 0:   # a fresh machine's first id: the run's own first segment in its namespace is 0 too,
        spares.append(host)   # and shmat(0) there attached that one (CI, session 58), not the host's
        host_key += 1
        host = libc.shmget(host_key, 4096, _IPC_CREAT | 0o600)
        assert host >= 0, ctypes.get_errno()
    try:
        res = execute_code(_CTYPES + f"i = call('shmget', {key}, 1 << 20, {_IPC_CREAT | 0o666})\n"
                           "a = call('shmat', i, None, 0)\nC.memset(a, 65, 1 << 20)\n"
                           f"call('shmat', {host}, None, 0)\n")
        leaked = _host_shm_ids(key)
    finally:
        for shmid in (host, *spares):
            libc.shmctl(shmid, _IPC_RMID, None)
        for shmid in _host_shm_ids(key):  # never leave one behind, even when the test fails
            libc.shmctl(shmid, _IPC_RMID, None)
    assert res.passed, (res.stdout, res.stderr)
    assert res.stdout.split("\n")[:2] == ["shmget ok", "shmat ok"], res.stdout  # inside the run: usable
    assert leaked == [], "the program's segment outlived the run"
    assert res.stdout.split("\n")[2] == f"shmat {errno.EINVAL}", res.stdout  # the host's: not there
    assert "ipcns" in res.isolation, res.isolation


_KEYRING_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}  # add_key, keyctl


def _seccomp_or_skip() -> None:
    if sc.native_filter() is None:
        pytest.skip("no seccomp filter for this ABI")
    if "seccomp" not in execute_code("pass").isolation:
        pytest.skip("this OS refuses seccomp filters")


def test_keyrings_and_ipc_that_rlimit_as_misses_are_denied():
    """Kernel keyrings are not namespaced: the program reached the caller's session and user
    keyrings (read their keys, link new ones). SysV shared memory / message queues hold memory
    that RLIMIT_AS does not count once detached: without the memory cgroup (a non-root user on
    cgroup v2) a shmget / shmat / shmdt loop filled host RAM."""
    _seccomp_or_skip()
    libc, key = _libc(), 0x5C000000 | os.getpid() & 0xFFFFFF
    add_key, keyctl = _KEYRING_CALLS[sc.native_abi()]
    try:
        res = execute_code(_CTYPES + "libc.syscall.restype = C.c_long\n"
                           f"call('shmget', {key}, 1 << 20, 0o1600)\ncall('msgget', {key}, 0o1600)\n"
                           f"call('syscall', {add_key}, b'user', b'nanochat', b'x', 1, -3)\n"  # session keyring
                           f"call('syscall', {keyctl}, 0, -3, 0)\n"  # KEYCTL_GET_KEYRING_ID
                           f"call('semget', {key}, 1, 0o1600)\n")  # a few bytes: left alone
    finally:  # before the fix (or in a run that escaped) these were the host's: remove them
        for shmid in _host_shm_ids(key):
            libc.shmctl(shmid, _IPC_RMID, None)
        for kind, ctl in (("msg", libc.msgctl), ("sem", libc.semctl)):
            for row in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]:
                if int(row.split()[0]) == key:
                    ctl(int(row.split()[1]), _IPC_RMID, None)
    got = [line.split()[-1] for line in res.stdout.splitlines()]
    eperm = str(errno.EPERM)
    assert got == [eperm, eperm, eperm, eperm, "ok"], (res.stdout, res.stderr)


def test_filter_decisions_for_keyrings_and_ipc_per_abi():
    from tests.test_execution import _decide

    EPERM, ALLOW = sc.SECCOMP_RET_ERRNO | errno.EPERM, sc.SECCOMP_RET_ALLOW
    numbers = {"x86_64": dict(add_key=248, request_key=249, keyctl=250, shmget=29, msgget=68, shmat=30, semget=64),
               "aarch64": dict(add_key=217, request_key=218, keyctl=219, shmget=194, msgget=186, shmat=196,
                               semget=190)}
    for abi, nr in numbers.items():
        for name in ("add_key", "request_key", "keyctl", "shmget", "msgget"):
            assert _decide(abi, nr[name]) == EPERM, (abi, name)
            assert _decide(abi, nr[name], allow_inet=False) == EPERM, (abi, name)
        for name in ("shmat", "semget"):
            assert _decide(abi, nr[name]) == ALLOW, (abi, name)
        for neighbour in (nr["add_key"] - 1, nr["keyctl"] + 1):
            assert _decide(abi, neighbour) == ALLOW, (abi, neighbour)


@pytest.mark.parametrize("kw, field", [
    (dict(timeout_s=math.nan), "timeout_s"), (dict(timeout_s=math.inf), "timeout_s"),
    (dict(timeout_s="5"), "timeout_s"), (dict(cpu_time_s=math.nan), "cpu_time_s"),
    (dict(cpu_time_s=-3), "cpu_time_s"), (dict(cpu_time_s=0), "cpu_time_s"),
    (dict(memory_mb=128.5), "memory_mb"), (dict(memory_mb=True), "memory_mb"),
    (dict(tail_chars=-5), "tail_chars"), (dict(max_output_bytes=4096.0), "max_output_bytes"),
])
def test_bad_numbers_are_rejected_naming_the_field(kw, field):
    """Before: NaN / inf crashed with 'cannot convert float NaN to integer', a float memory_mb with
    a TypeError about <<, and a negative cpu_time_s or tail_chars was silently accepted."""
    with pytest.raises(ValueError, match=rf"{field}=.*accepted"):
        execute_code("pass", **kw)


def test_refused_layers_are_reported_once(monkeypatch):
    """Callers such as HumanEval keep only `passed`: when the OS refuses a layer (here the kernel
    rejects the seccomp filter) the run must still score the same, and say so, once per process."""
    if sc.native_filter() is None or "seccomp" not in execute_code("pass").isolation:
        pytest.skip("seccomp is not applied here anyway")
    monkeypatch.setattr(execution, "_seccomp_filters", lambda: {"netns": "00" * 8, "no_netns": "00" * 8})
    monkeypatch.setattr(sandbox_cgroup, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = execute_code("print('é ✓')\nassert 1 + 1 == 2")
        bad = execute_code("assert 1 + 1 == 3, 'nope'")
    assert ok.passed and ok.stdout == "é ✓\n" and bad.status == "fail" and "nope" in bad.detail
    assert "seccomp" not in ok.isolation
    msgs = [str(w.message) for w in caught if "nanochat sandbox" in str(w.message)]
    assert len(msgs) == 1 and "seccomp" in msgs[0], msgs
    with warnings.catch_warnings(record=True) as quiet:  # what the caller opted out of: no warning
        warnings.simplefilter("always")
        assert execute_code("pass", isolate=False, cgroup_root=None).passed
    assert not [w for w in quiet if "nanochat sandbox" in str(w.message)]


@pytest.mark.parametrize("kw", [dict(), dict(isolate=False, cgroup_root=None)])
def test_verdicts_are_the_same_with_and_without_the_os_layers(kw):
    cases = {"print('héllo ✓ 😀')\nassert sorted([3, 1]) == [1, 3]": ("pass", ""),
             "assert [1] == [2], 'wrong answer'": ("fail", "AssertionError: wrong answer"),
             "raise KeyError('k')": ("error", "KeyError: 'k'"),
             "import time\ntime.sleep(30)": ("timeout", "wall-clock limit 1s exceeded")}
    got = {code: execute_code(code, timeout_s=1, **kw) for code in cases}
    assert {c: (r.status, r.detail) for c, r in got.items()} == cases
    assert got[next(iter(cases))].stdout == "héllo ✓ 😀\n"


_NS_CALLS = {"x86_64": dict(clone=56, unshare=272), "aarch64": dict(clone=220, unshare=97)}
_CLONE_NEWUSER, _CLONE_NEWNET, _SIGCHLD = 0x10000000, 0x40000000, 17


def test_no_new_namespaces_no_capabilities_regained():
    """unshare(CLONE_NEWUSER) used to succeed: the program's process held every capability again
    (CapEff all ones) in a user namespace of its own, bounding set or not, with the kernel's
    namespace-only surface (netfilter, its own mounts). Threads and plain forks must still work."""
    _seccomp_or_skip()
    nr = _NS_CALLS[sc.native_abi()]
    res = execute_code(_CTYPES + "libc.syscall.restype = C.c_long\n"
                       f"call('syscall', {nr['unshare']}, {_CLONE_NEWUSER})\n"
                       f"r = call('syscall', {nr['clone']}, {_CLONE_NEWUSER | _CLONE_NEWNET | _SIGCHLD}, 0, 0, 0, 0)\n"
                       "if r == 0:\n    C.CDLL(None)._exit(0)\n"  # the escaped child must not run on
                       "call('syscall', 435, C.create_string_buffer(88), 88)\n"  # clone3: glibc falls back
                       "import threading\nbox = []\nt = threading.Thread(target=box.append, args=(1,))\n"
                       "try:\n    t.start(); t.join(); print('thread', box)\n"  # non-root: RLIMIT_NPROC = 0
                       "except RuntimeError as e:\n    print('thread', e)\n"
                       "px = __import__('os').stat.__self__\ntry:\n    pid = px.fork()\n"
                       "except OSError as e:\n    print('fork', e)\nelse:\n"
                       "    if pid == 0:\n        px._exit(7)\n"
                       "    print('fork', px.waitstatus_to_exitcode(px.waitpid(pid, 0)[1]))\n"
                       "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n")
    eperm, enosys = str(errno.EPERM), str(errno.ENOSYS)
    assert res.stdout.split("\n")[:3] == [f"syscall {eperm}", f"syscall {eperm}", f"syscall {enosys}"], \
        (res.stdout, res.stderr)
    if os.geteuid() == 0:  # RLIMIT_NPROC = 0 stops a non-root fork before the filter is asked
        assert res.stdout.split("\n")[3:6] == ["thread [1]", "fork 7", "0000000000000000"], res.stdout
    assert res.passed, (res.stdout, res.stderr)


def test_filter_decisions_for_namespace_calls_per_abi():
    from tests.test_execution import _decide

    EPERM, ENOSYS, ALLOW = (sc.SECCOMP_RET_ERRNO | errno.EPERM, sc.SECCOMP_RET_ERRNO | errno.ENOSYS,
                            sc.SECCOMP_RET_ALLOW)
    fork_flags, thread_flags = 0x01200011, 0x003D0F00  # glibc's fork() and pthread_create clone flags
    for abi, nr in _NS_CALLS.items():
        for allow_inet in (True, False):
            assert _decide(abi, nr["unshare"], 0, allow_inet=allow_inet) == EPERM
            assert _decide(abi, 435, allow_inet=allow_inet) == ENOSYS
            for flag in (0x00020000, 0x02000000, 0x04000000, 0x08000000, _CLONE_NEWUSER, 0x20000000, _CLONE_NEWNET):
                assert _decide(abi, nr["clone"], flag | _SIGCHLD, allow_inet=allow_inet) == EPERM, (abi, hex(flag))
            assert _decide(abi, nr["clone"], fork_flags, allow_inet=allow_inet) == ALLOW
            assert _decide(abi, nr["clone"], thread_flags, allow_inet=allow_inet) == ALLOW
