"""The code sandbox: verdicts, limits (wall, CPU, memory, output), and escapes that must fail."""

import errno
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from nanochat import execution
from nanochat import sandbox_seccomp as sc
from nanochat.execution import execute_code, execute_many


def test_pass_fail_error_and_stdout():
    ok = execute_code("print('hello'); assert 1 + 1 == 2")
    assert ok.status == "pass" and ok.passed and ok.stdout.strip() == "hello"
    fail = execute_code("assert 1 + 1 == 3, 'math is broken'")
    assert fail.status == "fail" and "math is broken" in fail.stderr
    err = execute_code("undefined_name()")
    assert err.status == "error" and "NameError" in err.detail
    syntax = execute_code("def f(:\n  pass")
    assert syntax.status == "error" and "SyntaxError" in syntax.detail


def test_common_modules_still_import():
    code = ("import math, re, collections, itertools, functools, typing, heapq, bisect, string, hashlib, "
            "random, fractions, decimal, dataclasses, statistics, json, copy, operator\n"
            "from typing import List\nprint(math.gcd(12, 18))")
    res = execute_code(code)
    assert res.passed, res.stderr
    assert res.stdout.strip() == "6"


def test_numpy_and_environment_writes_work():
    # numpy's import calls os.putenv; blocking it made every program that imports numpy an error
    res = execute_code("import os\nos.environ['NANOCHAT_X'] = '1'\nprint(os.environ['NANOCHAT_X'])")
    assert res.passed and res.stdout.strip() == "1", res.stderr
    pytest.importorskip("numpy")
    res = execute_code("import numpy as np\nassert np.arange(10).sum() == 45\nprint(np.mean([1, 2, 3]))")
    assert res.passed and res.stdout.strip() == "2.0", res.stderr


def test_solution_that_runs_its_doctests_passes():
    """Model solutions often end with the doctest idiom; doctest imports pdb, which the guard used
    to block, making a correct solution an error. testmod() must also find the program's own
    functions in __main__."""
    code = ('def double(x):\n    """\n    >>> double(2)\n    4\n    """\n    return 2 * x\n\n'
            'if __name__ == "__main__":\n    import doctest\n    print(doctest.testmod())\n\n'
            'assert double(3) == 6\n')
    res = execute_code(code)
    assert res.passed, res.stderr
    assert "TestResults(failed=0, attempted=1)" in res.stdout


def test_infinite_loop_hits_wall_clock():
    t0 = time.monotonic()
    res = execute_code("while True:\n    pass", timeout_s=1.5)
    assert res.status == "timeout" and "wall-clock" in res.detail
    assert time.monotonic() - t0 < 6


def test_cpu_time_limit():
    res = execute_code("while True:\n    pass", timeout_s=30, cpu_time_s=1)
    assert res.status == "timeout" and "CPU" in res.detail
    assert res.duration_s < 10


def test_sleeping_process_killed_with_its_group():
    res = execute_code("import time\ntime.sleep(60)", timeout_s=1)
    assert res.status == "timeout" and res.duration_s < 5


@pytest.mark.parametrize("bomb", ["x = bytearray(16 * 1024**3)", "x = [0] * (10**10)",
                                  "s = 'a'\nwhile True:\n    s = s + s"])
def test_memory_bombs_are_contained(bomb):
    res = execute_code(bomb, timeout_s=10, memory_mb=256)
    assert res.status == "error", (res.status, res.detail)
    assert "MemoryError" in res.detail or "signal" in res.detail
    assert res.duration_s < 8


@pytest.mark.parametrize("code", [
    "import os\nos.fork()",
    "import os\nos.system('echo pwned')",
    "import subprocess\nsubprocess.run(['echo', 'pwned'])",
    "import multiprocessing\nmultiprocessing.Process(target=print).start()",
    "import os\nos.execv('/bin/echo', ['echo', 'pwned'])",
    "import ctypes",
])
def test_process_creation_is_blocked(code):
    res = execute_code(code)
    assert res.status == "error"
    assert "pwned" not in res.stdout


@pytest.mark.parametrize("code", [
    "import os\nos.remove({p!r})",
    "import os\nos.unlink({p!r})",
    "import pathlib\npathlib.Path({p!r}).unlink()",
    "import shutil, os\nshutil.rmtree(os.path.dirname({p!r}))",
    "import posix\nposix.unlink({p!r})",
    "import os\nos.rename({p!r}, {p!r} + '.moved')",
    "open({p!r}, 'w').write('overwritten')",
    "import importlib, os\nimportlib.reload(os)\nos.remove({p!r})",
])
def test_files_outside_the_sandbox_survive(tmp_path, code):
    victim = tmp_path / "keep" / "precious.txt"
    victim.parent.mkdir()
    victim.write_text("precious")
    res = execute_code(code.format(p=str(victim)))
    assert res.status == "error", (res.status, res.stdout, res.stderr)
    assert victim.is_file() and victim.read_text() == "precious"


def test_program_may_write_inside_its_working_dir():
    res = execute_code("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())")
    assert res.passed and res.stdout.strip() == "ok"


def test_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)  # the kernel completes handshakes into the backlog without accept()
    port = server.getsockname()[1]
    try:
        res = execute_code(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                           "s.sendall(b'leak')\nprint('connected')")
        res2 = execute_code(f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}', timeout=2)")
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()  # nothing connected
    finally:
        server.close()
    assert res.status == "error" and "connected" not in res.stdout
    assert res2.status == "error"


def test_network_namespace_blocks_raw_sockets_when_available():
    """Where the kernel allows namespaces, even the socket module's C core sees no network."""
    probe = execute_code("pass")
    if "netns" not in probe.isolation:
        pytest.skip(f"namespaces unavailable here (applied: {probe.isolation})")
    # the Python guard blocks `socket`; check the namespace underneath by reading the interfaces
    res = execute_code("print(open('/proc/net/dev').read())")
    lines = [ln.split(":")[0].strip() for ln in res.stdout.splitlines() if ":" in ln]
    assert lines == ["lo"], res.stdout


def test_exit_and_large_output():
    assert execute_code("exit(0)").status == "error"  # must not skip the tests by exiting early
    # files the program writes are capped by max_output_bytes ...
    big_file = execute_code("open('big.bin', 'wb').write(b'x' * 5_000_000)", max_output_bytes=1 << 16)
    assert big_file.status == "error" and "File too large" in big_file.detail
    # ... but stdout / stderr are drained and only their tails kept: output never changes the verdict
    chatty = execute_code("import sys\nfor i in range(200_000):\n    print('debug', i)\n"
                          "    print('warn', i, file=sys.stderr)\nassert sum(range(10)) == 45",
                          max_output_bytes=1 << 16, tail_chars=100)
    assert chatty.status == "pass", (chatty.status, chatty.detail)
    assert len(chatty.stdout) <= 100 and chatty.stdout.endswith("debug 199999\n")
    assert len(chatty.stderr) <= 100 and chatty.stderr.endswith("warn 199999\n")


def test_exiting_the_interpreter_is_never_a_pass():
    """pass needs the harness's verdict after the program returned, not just exit code 0: the
    guard's os._exit is one attribute away (os.stat.__self__ is the posix module)."""
    res = execute_code("import os\nos.stat.__self__._exit(0)\nassert False, 'tests never ran'")
    assert res.status == "error" and res.returncode == 0, (res.status, res.detail)
    assert "verdict" in res.detail


def test_realtime_signal_is_an_error_not_a_crash():
    # signal.Signals has no member for SIGRTMIN+n: classifying it used to raise ValueError
    res = execute_code("import signal\nsignal.raise_signal(signal.SIGRTMIN + 6)")
    assert res.status == "error" and "signal" in res.detail, (res.status, res.detail)


def test_lone_surrogate_in_the_source_is_an_error_not_a_crash():
    res = execute_code("x = '\ud800'\nprint('ran')")
    assert res.status == "error" and "ran" not in res.stdout


def test_program_is_its_own_main_module():
    """pickle (and typing.get_type_hints) look classes up in sys.modules['__main__']."""
    code = ("import pickle, typing\nclass Point:\n    x: 'int' = 0\n"
            "p = pickle.loads(pickle.dumps(Point()))\nassert typing.get_type_hints(Point) == {'x': int}\n"
            "import sys\nassert sys.argv == ['program.py'] and not hasattr(sys.modules['__main__'], 'subprocess')")
    res = execute_code(code)
    assert res.passed, res.stderr


# Escapes below use the harness frame's globals to reach the real subprocess module: the Python
# guard is not a boundary, so what must hold is the kernel's side (namespaces, capabilities).
_UNGUARDED = "import sys\nsub = sys._getframe(1).f_globals['subprocess']\n"


def _processes_with(marker: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if marker in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


@pytest.mark.parametrize("then", ["print('left it behind')", "import time\ntime.sleep(30)"])
def test_processes_that_leave_the_group_die_with_the_sandbox(then):
    if "netns" not in execute_code("pass").isolation:
        pytest.skip("namespaces unavailable here")
    marker = f"{os.getpid()}{len(then)}.25"  # a unique `sleep` duration to find it by
    res = execute_code(_UNGUARDED + f"sub.Popen(['sleep', '{marker}'], start_new_session=True)\n" + then,
                       timeout_s=2)
    leftovers = _processes_with(f"sleep {marker}")
    for line in leftovers:  # never leave them running, even when the test fails
        os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert leftovers == [] and "pidns" in res.isolation, (leftovers, res.isolation)


def test_program_holds_no_capabilities(tmp_path):
    """As root (or root of its user namespace) a program could otherwise remount the filesystem
    read-write or setns back into the host's namespaces."""
    probe = execute_code("pass")
    if os.geteuid() != 0 and "netns" not in probe.isolation:
        pytest.skip("not root and no user namespace: the program never had capabilities")
    victim = tmp_path / "written_from_the_sandbox"
    res = execute_code(_UNGUARDED + "print(open('/proc/self/status').read())\n"
                       f"sub.run(['sh', '-c', 'mount -o remount,rw / ; touch {victim}'], capture_output=True)")
    status = dict(line.split(":\t", 1) for line in res.stdout.splitlines() if ":\t" in line)
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0, status
    assert status["NoNewPrivs"].strip() == "1"
    assert not victim.exists()


def test_execute_many_keeps_order():
    programs = [f"print({i})" for i in range(6)] + ["assert False"]
    results = execute_many(programs, workers=2)
    assert [r.stdout.strip() for r in results[:6]] == [str(i) for i in range(6)]
    assert results[-1].status == "fail"


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="timeout_s"):
        execute_code("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        execute_code("pass", memory_mb=1)
    with pytest.raises(ValueError, match="max_workdir_bytes"):
        execute_code("pass", max_workdir_bytes=4096)
    for bad in (2, "64", 64.0, True):
        with pytest.raises(ValueError, match=r"max_processes=.*accepted: an int >= 3"):
            execute_code("pass", max_processes=bad)
    with pytest.raises(ValueError, match="cgroup_root=5; accepted: a path"):
        execute_code("pass", cgroup_root=5)


# --- seccomp: sockets that cross namespaces ---------------------------------------------------
# A program past the Python guard loads the C modules straight from their files (sys.modules holds
# None for them): what must stop it is the kernel's filter.
_LOAD = ("import sys, importlib.machinery as m, importlib.util as u\n"
         "def load(name):\n"
         "    spec = m.PathFinder.find_spec(name) or m.BuiltinImporter.find_spec(name)\n"
         "    mod = u.module_from_spec(spec); sys.modules[name] = mod; spec.loader.exec_module(mod)\n"
         "    return mod\n"
         "S = load('_socket')\n")


# an allow-all filter installed by a throwaway interpreter, independently of the code under test
_PROBE = ("import ctypes, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "class P(ctypes.Structure):\n    _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]\n"
          "ret = ctypes.create_string_buffer(bytes.fromhex('060000000000ff7f'))\n"  # BPF_RET_K ALLOW
          "libc.prctl(38, 1, 0, 0, 0)\n"  # PR_SET_NO_NEW_PRIVS, then PR_SET_SECCOMP FILTER
          "sys.exit(libc.prctl(22, 2, ctypes.byref(P(1, ctypes.cast(ret, ctypes.c_void_p))), 0, 0) != 0)")


def _seccomp_expected() -> None:
    """Skip only where the filter cannot exist: an ABI it does not know, or an OS that refuses
    any seccomp filter (a kernel without it, or an outer sandbox that forbids stacking)."""
    if sc.native_filter() is None:
        pytest.skip(f"no seccomp filter for this ABI ({os.uname().machine}, 64-bit: {sys.maxsize > 2**32})")
    if subprocess.run([sys.executable, "-I", "-c", _PROBE], check=False).returncode != 0:
        pytest.skip("this OS refuses seccomp filters (prctl(PR_SET_SECCOMP) failed)")


def test_unix_socket_files_are_unreachable(tmp_path, monkeypatch):
    """A socket file the program can see (docker.sock, D-Bus, X11) must not be connectable, even
    by code past the Python guard: no namespace covers it, the seccomp filter does."""
    _seccomp_expected()
    # uid 0 in the sandbox (its capabilities are gone, the owner's bits still apply) so that the
    # path under tmp_path stays reachable: the test is of the filter, not of the uid drop
    monkeypatch.setattr(execution, "_can_drop_to_nobody", lambda: False)
    path = str(tmp_path / "host.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.settimeout(0.5)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as outside:  # the socket is real
            outside.connect(path)
            server.accept()[0].close()
        res = execute_code(_LOAD + f"import os, stat\nprint('visible', stat.S_ISSOCK(os.stat({path!r}).st_mode))\n"
                           "try:\n    s = S.socket(S.AF_UNIX, S.SOCK_STREAM)\n"
                           "except OSError as e:\n    print('socket denied', e.errno)\n"
                           f"else:\n    s.connect({path!r})\n    s.sendall(b'escaped')\n    print('connected')\n")
        with pytest.raises(socket.timeout):
            server.accept()  # nothing connected from the sandbox
    finally:
        server.close()
    assert res.passed and "visible True" in res.stdout, (res.status, res.stdout, res.stderr)
    assert f"socket denied {errno.EACCES}" in res.stdout and "connected" not in res.stdout, res.stdout
    assert "seccomp" in res.isolation, res.isolation


def test_seccomp_leaves_inet_and_stream_pairs_and_denies_the_rest():
    _seccomp_expected()
    code = _LOAD + (
        "def try_(name, make):\n"
        "    try:\n        make().close(); print(name, 'ok')\n"
        "    except OSError as e:\n        print(name, e.errno)\n"
        "for fam, typ in [('INET', 'STREAM'), ('INET6', 'DGRAM'), ('NETLINK', 'RAW'), ('VSOCK', 'STREAM'), ('PACKET', 'RAW')]:\n"
        "    try_(fam, lambda: S.socket(getattr(S, 'AF_' + fam), getattr(S, 'SOCK_' + typ)))\n"
        "for typ in ('STREAM', 'SEQPACKET', 'DGRAM'):\n"
        "    try_('pair_' + typ, lambda: S.socketpair(S.AF_UNIX, getattr(S, 'SOCK_' + typ))[0])\n"
        "load('_ctypes'); C = load('ctypes')\n"
        "libc = C.CDLL(None, use_errno=True)\n"
        "fd = libc.syscall(425, 1, C.create_string_buffer(120))\n"  # io_uring_setup, same on both ABIs
        "print('io_uring', 'ok' if fd >= 0 else C.get_errno())\n")
    if sc.native_abi() == "x86_64":  # getpid through the x32 ABI's numbering
        code += "print('x32_getpid', 'ok' if libc.syscall(0x40000000 | 39) >= 0 else C.get_errno())\n"
    res = execute_code(code)
    got = dict(line.split() for line in res.stdout.splitlines())
    assert res.passed, (res.stdout, res.stderr)
    eacces, eperm = str(errno.EACCES), str(errno.EPERM)
    inet = "ok" if "netns" in res.isolation else eacces  # no network namespace: no INET sockets either
    want = {"INET": inet, "INET6": inet, "NETLINK": eacces, "VSOCK": eacces, "PACKET": eacces,
            "pair_STREAM": "ok", "pair_SEQPACKET": "ok", "pair_DGRAM": eacces, "io_uring": eperm}
    if sc.native_abi() == "x86_64":
        want["x32_getpid"] = eperm  # not ENOSYS: the filter answers before the kernel looks
    assert got == want, got


def _run_bpf(program: bytes, nr: int, arch: int, args=()) -> int:
    """A classic-BPF interpreter for the opcodes a seccomp filter may use here, on a struct
    seccomp_data; returns the action. Checks the kernel's rules: forward jumps inside the program."""
    insns = list(struct.iter_unpack("<HBBI", program))
    data = struct.pack("<IIQ6Q", nr & 0xFFFFFFFF, arch, 0, *(list(args) + [0] * (6 - len(args))))
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == sc.BPF_LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == sc.BPF_AND_K:
            acc &= k
        elif code == sc.BPF_RET_K:
            return k
        elif code in (sc.BPF_JEQ_K, sc.BPF_JGE_K, sc.BPF_JGT_K):
            taken = {sc.BPF_JEQ_K: acc == k, sc.BPF_JGE_K: acc >= k, sc.BPF_JGT_K: acc > k}[code]
            pc += jt if taken else jf
            assert pc < len(insns)
        else:
            raise AssertionError(f"opcode {code:#x} at {pc - 1}")


def _decide(abi: str, nr: int, *args: int, arch: str | None = None, allow_inet: bool = True) -> int:
    """The action of `abi`'s filter for one call, made on `arch`'s ABI (default: the same)."""
    prog = sc.build_filter(abi, allow_inet=allow_inet)
    return _run_bpf(prog, nr, sc.ABIS[arch or abi].audit_arch, args)


def test_seccomp_filter_decisions_per_abi():
    EACCES, EPERM = sc.SECCOMP_RET_ERRNO | errno.EACCES, sc.SECCOMP_RET_ERRNO | errno.EPERM
    ALLOW, KILL = sc.SECCOMP_RET_ALLOW, sc.SECCOMP_RET_KILL_PROCESS
    for abi, a in sc.ABIS.items():
        assert _decide(abi, a.socket, sc.AF_UNIX, 1) == EACCES
        assert _decide(abi, a.socket, sc.AF_UNIX | 1 << 32, 1) == EACCES  # the kernel reads an int: low word
        assert _decide(abi, a.socket, 40, 1) == EACCES and _decide(abi, a.socket, 16, 3) == EACCES  # vsock, netlink
        assert _decide(abi, a.socket, sc.AF_INET, 1) == ALLOW and _decide(abi, a.socket, sc.AF_INET6, 2) == ALLOW
        assert _decide(abi, a.socketpair, sc.AF_UNIX, 1 | 0o2000000) == ALLOW  # SOCK_STREAM | SOCK_CLOEXEC
        assert _decide(abi, a.socketpair, sc.AF_UNIX, 5) == ALLOW  # SOCK_SEQPACKET
        assert _decide(abi, a.socketpair, sc.AF_UNIX, 2) == EACCES  # SOCK_DGRAM: sendto() any path
        assert _decide(abi, a.socketpair, sc.AF_INET, 1) == EACCES
        assert [_decide(abi, nr) for nr in range(424, 429)] == [ALLOW, EPERM, EPERM, EPERM, ALLOW]
        assert _decide(abi, 0) == ALLOW and _decide(abi, 63) == ALLOW  # read on one ABI or the other
        # a foreign ABI (here i386's int 0x80) is killed: its numbers mean other calls
        assert _run_bpf(sc.build_filter(abi), a.socket, 0x40000003, (sc.AF_INET,)) == KILL
        assert _decide(abi, a.socket, sc.AF_INET, allow_inet=False) == EACCES
        assert _decide(abi, a.socketpair, sc.AF_UNIX, 1, allow_inet=False) == ALLOW
    # x32 calls arrive with AUDIT_ARCH_X86_64 and bit 30 set: denied whatever they are
    assert _decide("x86_64", sc.X32_SYSCALL_BIT | 41, sc.AF_UNIX) == EPERM
    assert _decide("x86_64", 198, sc.AF_UNIX) == ALLOW and _decide("aarch64", 41, sc.AF_UNIX) == ALLOW
    assert _decide("aarch64", 198, sc.AF_UNIX, arch="x86_64") == KILL
    with pytest.raises(ValueError, match="abi"):
        sc.build_filter("riscv64")


# --- the working dir: a size-capped tmpfs, not the host disk ----------------------------------

def _tree_bytes(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def test_working_dir_is_capped_and_off_the_host_disk(monkeypatch):
    if "netns" not in execute_code("pass").isolation:
        pytest.skip("namespaces unavailable here: the working dir stays on the host disk")
    workdirs, real = [], tempfile.TemporaryDirectory

    def recording(*args, **kwargs):  # learn the host-side working dir to watch it
        d = real(*args, **kwargs)
        workdirs.append(d.name)
        return d

    monkeypatch.setattr(execution.tempfile, "TemporaryDirectory", recording)
    code = ("import errno, os, time\nst = os.statvfs('.')\nprint('fs', st.f_blocks * st.f_frsize)\n"
            "chunk, written = b'x' * (512 << 10), 0\n"
            "try:\n    for i in range(200):\n        with open(f'f{i}.bin', 'wb') as f:\n"
            "            f.write(chunk)\n        written += len(chunk)\n"
            "except OSError as e:\n    print('stopped', errno.errorcode[e.errno], written)\n"
            "time.sleep(0.8)\n")  # full: the test watches the host side meanwhile
    box = []
    runner = threading.Thread(target=lambda: box.append(execute_code(code, timeout_s=20)))
    runner.start()
    host_max = 0
    while runner.is_alive():
        if workdirs:
            host_max = max(host_max, _tree_bytes(workdirs[0]))
        time.sleep(0.02)
    runner.join()
    res, cap = box[0], 64 << 20
    assert res.passed, (res.status, res.stderr)
    fs, stopped = res.stdout.split("\n")[:2]
    assert fs == f"fs {cap}" and stopped.startswith("stopped ENOSPC "), res.stdout
    assert cap // 2 < int(stopped.split()[-1]) <= cap
    assert host_max < 1 << 20, f"{host_max} bytes reached the host disk"
    assert "workdir_cap" in res.isolation


def test_capped_working_dir_keeps_normal_programs_working():
    res = execute_code("open('scratch.txt', 'w').write('ok')\nimport os\nst = os.statvfs('.')\n"
                       "print(open('scratch.txt').read(), st.f_blocks * st.f_frsize, sorted(os.listdir('.')))\n"
                       "assert 1 == 2, 'shown with its source line'", max_workdir_bytes=4 << 20)
    assert res.status == "fail", (res.status, res.stderr)
    if "workdir_cap" not in res.isolation:
        assert "netns" not in res.isolation, res.isolation  # only where the OS refuses namespaces
        pytest.skip("namespaces unavailable here")
    assert res.stdout.split() == ["ok", str(4 << 20), "['program.py',", "'scratch.txt']"], res.stdout
    # program.py is put back in the tmpfs: tracebacks (and inspect.getsource) still read it
    assert "assert 1 == 2, 'shown with its source line'" in res.stderr


# --- root with some capabilities missing (containers): programs still run -------------------
REPO = Path(__file__).resolve().parents[1]
_ROOT_RUN = ("import json\nfrom nanochat import execution\n"
             "if {probe}:\n    print(json.dumps(execution._can_drop_to_nobody()))\n    raise SystemExit\n"
             "r = execution.execute_code('import os\\nprint(os.getuid())\\nassert 1 + 1 == 2')\n"
             "print(json.dumps([r.status, list(r.isolation), r.stdout, r.stderr[-2000:]]))\n")


def _root_python() -> list[str]:
    """An interpreter the uid drop applies to (root, every capability, world-readable files), run
    with PYTHONPATH at this checkout; skips where there is none or setpriv is missing."""
    import shutil

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux)")
    for python in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if python and subprocess.run([python, "-I", "-c", "import sys; sys.exit(sys.version_info < (3, 10))"],
                                     capture_output=True).returncode == 0:
            out = subprocess.run([python, "-c", _ROOT_RUN.format(probe=True)], capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
            if out.stdout.strip() == "true":
                return [python, "-c", _ROOT_RUN.format(probe=False)]
    pytest.skip("no world-readable Python >= 3.10 to switch to nobody with")


@pytest.mark.parametrize("dropped, becomes_nobody", [("-sys_admin", True), ("-setuid,-setgid", False),
                                                     ("-chown", False)])
def test_root_without_some_capabilities_still_runs_programs(dropped, becomes_nobody):
    """Root in a container often lacks CAP_SYS_ADMIN (and some run with --cap-drop). Before: without
    CAP_SYS_ADMIN the child entered a user namespace mapping uid 0 alone, where the switch to
    nobody failed (setgroups: EPERM) and nobody's working dir was closed to it; without
    CAP_SETUID / CAP_SETGID the switch failed the same way: every program was an "error" (and
    without CAP_CHOWN execute_code itself raised). Now the program runs, as nobody outside
    namespaces where root cannot make them without a user namespace, else as root (no uid_drop)."""
    cmd = _root_python()
    out = subprocess.run(["setpriv", "--bounding-set", dropped, "--inh-caps", dropped, "--", *cmd],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    status, isolation, stdout, stderr = json.loads(out.stdout)
    assert status == "pass", (isolation, stderr)
    assert ("uid_drop" in isolation) == becomes_nobody and stdout.split() == ["65534" if becomes_nobody else "0"]
    assert "no_caps" in isolation and "python_guard" in isolation, isolation
