"""The code sandbox: verdicts, limits (wall, CPU, memory, output), and escapes that must fail."""

import socket
import time

import pytest

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
    big = execute_code("print('x' * 5_000_000)", max_output_bytes=1 << 16, tail_chars=100)
    assert big.status == "error" and len(big.stdout) <= 100


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
