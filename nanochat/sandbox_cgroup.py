"""The code sandbox's per-program cgroup: caps on processes ("pids_cap") and on the memory of all
of a program's processes together ("memory_cap"), which bind root too.

Why: the kernel exempts uid 0 from RLIMIT_NPROC, so as root a fork bomb that gets past the Python
guard is otherwise bounded only by the wall clock (the PID namespace kills it at the end), and
RLIMIT_AS is per process, so N processes may hold N times `memory_mb`. A cgroup's `pids.max` and
memory limit count every task of the program, whatever its uid.

This module owns finding a cgroup the caller may use, making one per program run and removing it;
also `execute_code`'s argument checks (`validate`), its once-per-process warning about layers
the OS refused (`warn_refused`), its pipe drains (`TailReader`), the reading of its harness's
report (`parse_report`), the wait for its child (`wait_reaping`, `watch_child`), its verdict
(`classify`) and the end of a run's working dir (`kill_inside`, `remove_workdir`): parent-side code
moved here to keep execution.py short.
`nanochat.execution` makes it in the parent (`program_cgroup`), passes the `cgroup.procs` paths to
its sandbox child, which writes its own pid there first of all (before namespaces, forks and the
program: every process the program starts is born inside), and removes it after the run, also on
timeout or exception: whatever is still inside is killed first, nested cgroups go bottom-up. Each
new cgroup also sweeps away empty ones that an earlier, killed caller left behind.

Where (never moving the caller or enabling controllers anywhere): cgroup v2 for the controllers
the caller's own cgroup already delegates to its children (its cgroup.subtree_control lists `pids`
/ `memory`), the cgroup v1 `pids` / `memory` hierarchies for the rest, always under the caller's
own cgroup, so that the caller's own limits still apply on top. Only hierarchies mounted at or below
`root` (default /sys/fs/cgroup) are used; when none is writable (most containers mount it
read-only; a user without a delegated v2 subtree) the layer is simply not applied. Linux only.

What v2 can give in practice: a non-root cgroup that holds processes (ours: the caller) may enable
only threaded controllers such as `pids` in its subtree_control; `memory` is refused with EBUSY
(the kernel's no-internal-process rule, Documentation/admin-guide/cgroup-v2.rst; only the root
cgroup is exempt). So outside the root cgroup v2 yields at most `pids_cap`. Seen on a GPU box (a
container on v2, as root, its cgroup offering `memory` alone): no layer; the uid drop to nobody
(execution.py) is what makes RLIMIT_NPROC bind there.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

_PREFIX = "nanochat_exec_"
_STALE_S = 60.0  # an empty cgroup of a dead caller this old is a leftover, not a run starting up


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# execute_code's other limits (the cgroup's memory cap is memory_mb + max_workdir_bytes): accepted
# values as the error names them, and the test. NaN / inf used to crash in int(), a float memory_mb
# in `<<`, a float max_output_bytes in the child's setrlimit (every run an "error").
_LIMITS = {"timeout_s": ("a finite number > 0", lambda v: _real(v) and v > 0),
           "cpu_time_s": ("None or a finite number > 0", lambda v: v is None or _real(v) and v > 0),
           "memory_mb": ("an int >= 64", lambda v: _whole(v) and v >= 64),
           "tail_chars": ("an int >= 0", lambda v: _whole(v) and v >= 0),
           "max_output_bytes": ("an int >= 1024", lambda v: _whole(v) and v >= 1024),
           "max_workdir_bytes": (f"an int >= {1 << 20} (1 MiB)", lambda v: _whole(v) and v >= 1 << 20)}


def validate(who: str, max_processes: int, root, **limits) -> None:
    """ValueError naming the field for a bad process cap, cgroup root or one of `_LIMITS` (before
    any work)."""
    for name, value in limits.items():
        accepted, ok = _LIMITS[name]
        if not ok(value):
            raise ValueError(f"{who}: got {name}={value!r}; accepted: {accepted}")
    if isinstance(max_processes, bool) or not isinstance(max_processes, int) or max_processes < 3:
        raise ValueError(f"{who}: got max_processes={max_processes!r}; accepted: an int >= 3 (processes "
                         "and threads together, the sandbox's own included: harness, PID-namespace init, program)")
    if root is not None and not isinstance(root, (str, os.PathLike)):
        raise ValueError(f"{who}: got cgroup_root={root!r}; accepted: a path (str or os.PathLike) or None")


_warned: set = set()  # the refused-layer sets this process has already warned about
# as root without the switch to nobody, neither the read-only mounts nor the capability drop keep
# root-owned files (keys, tokens) from being read: the caller should know why, and what would help
_UID_DROP_HINT = ("; uid_drop refused: the program runs as root and can read every file root owns; "
                  "the switch to nobody needs CAP_CHOWN, CAP_SETUID and CAP_SETGID and a Python whose "
                  "interpreter and standard library every user can read (not one under /root)")


def warn_refused(isolation: list, asked: list) -> None:
    """Warn once per process (per set of refused layers) when the OS refused sandbox layers a call
    asked for (its cgroup caps, namespaces, seccomp, a root caller's uid drop: `asked`): callers such as HumanEval keep only
    the verdict, which the layers do not change, so nothing else would tell."""
    missing = tuple(x for x in asked if x not in isolation)
    # no isolation at all: the run ended before the child reported (a tiny timeout), nothing known
    if isolation and missing and missing not in _warned:
        _warned.add(missing)
        import warnings

        warnings.warn(f"nanochat sandbox: the OS refused isolation layer(s) {', '.join(missing)} (applied: "
                      f"{', '.join(isolation)}); verdicts are unaffected, programs are less confined: see "
                      "nanochat/execution.py for what each layer stops" + _UID_DROP_HINT * ("uid_drop" in missing),
                      RuntimeWarning, stacklevel=3)


class TailReader:
    """Drains one pipe in a thread and keeps only its last `keep` bytes: a program that prints
    gigabytes costs the parent bounded memory, and its writes never fail (so output volume cannot
    turn a passing program into an error)."""

    def __init__(self, fd: int, keep: int):
        self.fd, self.keep, self.buf = fd, keep, bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 16):
                self.buf += chunk
                if len(self.buf) > 2 * self.keep:  # trim in batches, not per chunk
                    del self.buf[:-self.keep]
        except OSError:
            pass
        finally:
            os.close(self.fd)

    def text(self, n_chars: int, wait_s: float) -> str:
        # a writer that escaped the kill (only possible without the PID namespace) may hold the
        # pipe open: report what arrived instead of waiting for it
        self.thread.join(wait_s)
        return bytes(self.buf[-self.keep:]).decode("utf-8", errors="replace")[-n_chars:] if n_chars else ""


def wait_reaping(proc, timeout_s: float) -> tuple[bool, float]:
    """proc.wait(timeout_s) for execute_code's child (a subprocess.Popen started in a session of its
    own), killing its group at the deadline, through wait4, whose rusage counts the CPU time of the
    child and all it reaped (init, the program): (timed out, CPU seconds)."""
    deadline, delay = time.monotonic() + timeout_s, 0.0005
    while not (done := os.wait4(proc.pid, os.WNOHANG))[0] and time.monotonic() < deadline:
        time.sleep(delay := min(2 * delay, 0.05, max(0.0, deadline - time.monotonic())))
    if timed_out := not done[0]:  # the group dies, then a blocking wait reaps it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        done = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(done[1])  # reaped: Popen must not wait for the pid again
    return timed_out, done[2].ru_utime + done[2].ru_stime


def watch_child(proc, pipes: dict[int, tuple[int, int]], timeout_s: float, drain_s: float, kill_cgroup,
                work: Path) -> tuple[bool, float, tuple[str, ...]]:
    """Wait for execute_code's child (`wait_reaping`) while threads drain its `pipes` (fd -> (bytes
    kept, characters returned)), then kill what the program left, also on an exception here
    (KeyboardInterrupt: the program must not run on unwatched): (timed out, CPU seconds, the pipes'
    tails), waiting at most `drain_s` for all of them together."""
    readers = [(TailReader(fd, keep), n_chars) for fd, (keep, n_chars) in pipes.items()]
    try:
        timed_out, cpu_used = wait_reaping(proc, timeout_s)
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the program left behind in its group
        kill_cgroup()  # and outside it (setsid) where no PID namespace did: they hold the pipes open
        with contextlib.suppress(OSError):  # and those no cgroup holds either, by their working dir
            kill_inside(work)
    deadline = time.monotonic() + drain_s  # one wait for all the pipes, not one each
    return timed_out, cpu_used, tuple(r.text(n, max(0.0, deadline - time.monotonic())) for r, n in readers)


def classify(rc: int, timed_out: bool, timeout_s: float, cpu: int, cpu_s: float, stderr: str, verdict: str,
             verdicts: dict[int, str]) -> tuple[str, str]:
    """execute_code's (status, detail) for its child's exit code, CPU seconds, stderr tail and the
    harness's verdict; `verdicts` maps the harness's exit codes to their words (pass, fail, error)."""
    if timed_out:
        return "timeout", f"wall-clock limit {timeout_s:g}s exceeded"
    # SIGKILL after the limit's CPU time: the hard limit (cpu + 1 s) of a program that ignored SIGXCPU
    if rc == -signal.SIGXCPU or rc == -signal.SIGKILL and cpu_s >= cpu:
        return "timeout", f"CPU-time limit {cpu}s exceeded ({signal.Signals(-rc).name})"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:  # real-time signals (SIGRTMIN+n) have no enum member
            name = f"{-rc}"
        return "error", f"killed by signal {name}"
    last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    # pass / fail need the harness's word, written after the program returned: an exit code alone
    # can come from the program ending the interpreter early (posix._exit(0) skips the tests)
    word = verdicts.get(rc)
    if word in ("pass", "fail") and verdict != word:
        return "error", f"exit code {rc} without the harness's verdict: the program ended the interpreter itself"
    if word == "pass":
        return "pass", ""
    if word == "fail":
        return "fail", last or "AssertionError"
    return "error", last or f"exit code {rc}"


def kill_inside(work: Path) -> None:
    """SIGKILL every process whose working dir is `work` or below it: leftovers of a program that
    escaped the Python guard and left its process group where neither a PID namespace nor a
    cgroup killed them (uid 0 without either): they held the output pipes open (the drain waited for
    them) and kept writing there. The pid is pinned with a pidfd before the check."""
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()):
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone, or a kernel without pidfds (< 5.3): nothing is signalled unpinned
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")  # EACCES for another user's process: not ours
            if cwd == str(work) or cwd.startswith(f"{work}/"):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
        finally:
            os.close(fd)


def remove_workdir(workdir) -> None:
    """Delete a run's working dir (a tempfile.TemporaryDirectory made with ignore_cleanup_errors):
    a leftover process still writing there made the deletion raise ("Directory not empty") out of
    execute_code, ending the whole evaluation, and left the dir behind. It is killed and the
    deletion retried; a dir that still cannot go is named in a warning, never raised."""
    for _ in range(3):
        workdir.cleanup()
        if not os.path.lexists(workdir.name):
            return
        with contextlib.suppress(OSError):
            kill_inside(Path(workdir.name))
        time.sleep(0.05)  # the kernel reaps what was killed
    import warnings

    warnings.warn(f"nanochat sandbox: could not remove the working dir {workdir.name} (a process the program "
                  "started still writes there)", RuntimeWarning, stacklevel=4)


def parse_report(report: str) -> tuple[list, str]:
    """(layers applied, verdict) from execute_code's harness pipe: one JSON line (the layers applied,
    written before the program runs: the working dir may be a tmpfs the parent cannot see) and,
    after the program returned, the verdict."""
    isolation = []
    with contextlib.suppress(ValueError):
        isolation = json.loads(report.partition("\n")[0])
    if not isinstance(isolation, list):
        isolation = []
    return [x for x in isolation if isinstance(x, str)], report.rpartition("\n")[2]


def _mounts(root: Path) -> list[tuple[str, Path, str, set[str]]]:
    """(fstype, mount point, mounted root in the hierarchy, super options) of each cgroup mount at
    or below `root`, from /proc/self/mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), s)  # noqa: E731
    found = []
    for line in lines:
        fields = line.split()
        sep = fields.index("-") if "-" in fields else -1
        if sep < 0 or len(fields) < sep + 4 or fields[sep + 1] not in ("cgroup", "cgroup2"):
            continue
        point = Path(unescape(fields[4]))
        if point == root or root in point.parents:
            found.append((fields[sep + 1], point, unescape(fields[3]), set(fields[sep + 3].split(","))))
    return found


def _own_dir(point: Path, mount_root: str, controller: str | None) -> Path | None:
    """This process's cgroup directory in a hierarchy: the v2 one (controller None) or the v1 one
    that holds `controller`. A container may mount only its own subtree (mount_root)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if (controller is None and controllers == "") or (controller in controllers.split(",")):
            if mount_root != "/" and (path + "/").startswith(mount_root.rstrip("/") + "/"):
                path = path[len(mount_root.rstrip("/")):]
            own = point / path.lstrip("/")
            return own if own.is_dir() else None
    return None


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _kill_members(cgroup: Path) -> None:
    """SIGKILL every process in `cgroup`. The pid is pinned with a pidfd and its cgroup checked
    after, so a pid reused since cgroup.procs was read is never signalled."""
    try:
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already (or a kernel without pidfds: the check below still holds)
            fd = None
        try:
            if f"/{cgroup.name}\n" in Path(f"/proc/{pid}/cgroup").read_text() + "\n":
                signal.pidfd_send_signal(fd, signal.SIGKILL) if fd is not None else os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass
        finally:
            if fd is not None:
                os.close(fd)


def _remove(cgroup: Path, timeout_s: float = 5.0) -> bool:
    """Kill what is left in `cgroup` (and any cgroup made inside it) and remove it; retries while
    the kernel is still reaping (rmdir says EBUSY). True when it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        _write(cgroup / "cgroup.kill", "1")  # v2, Linux >= 5.14: the whole subtree at once
        try:
            for d, _, _ in sorted(os.walk(cgroup), key=lambda w: -len(w[0])):  # deepest first
                _kill_members(Path(d))
                os.rmdir(d)
            return True
        except FileNotFoundError:
            if not cgroup.exists():
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _sweep(parent: Path) -> None:
    """Remove empty cgroups left by callers that died mid-run (their pid is in the name). Only
    rmdir, which the kernel refuses for a cgroup with processes: nothing running is touched."""
    try:
        entries = list(parent.glob(_PREFIX + "*"))
    except OSError:
        return
    for d in entries:
        try:
            pid = int(d.name[len(_PREFIX):].split("_")[0])
            if time.time() - d.stat().st_mtime < _STALE_S:
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        except (OSError, ValueError):
            pass


# (layer, counters file, counter, note): v1 and v2 name the pids counter alike, not the OOM kills
_EVENTS = (("pids_cap", "pids.events", "max", "process cap {} reached"),
           ("memory_cap", "memory.events", "oom_kill", "memory cap {} MiB hit (OOM kill)"),
           ("memory_cap", "memory.oom_control", "oom_kill", "memory cap {} MiB hit (OOM kill)"))


class ProgramCgroup:
    """One program run's cgroup directories, keyed by the layer each gives."""

    def __init__(self, dirs: dict[str, Path], limits: dict[str, int]):
        self.dirs, self.limits = dirs, limits

    def join_paths(self) -> dict[str, list[str]]:
        """cgroup.procs path -> layers, for the sandbox child (v2: one path, both layers)."""
        out: dict[str, list[str]] = {}
        for layer, d in self.dirs.items():
            out.setdefault(str(d / "cgroup.procs"), []).append(layer)
        return out

    def limits_hit(self) -> list[str]:
        """The caps the program ran into (the kernel's event counters), for the verdict's detail."""
        hit, shown = [], {"pids_cap": self.limits.get("pids_cap"),
                          "memory_cap": f"{self.limits.get('memory_cap', 0) / (1 << 20):g}"}
        for layer, file, key, what in _EVENTS:
            try:
                counters = dict(ln.split()[:2] for ln in (self.dirs[layer] / file).read_text().splitlines())
                if int(counters.get(key, "0")) > 0 and what.format(shown[layer]) not in hit:
                    hit.append(what.format(shown[layer]))
            except (KeyError, OSError, ValueError):
                pass
        return hit

    def kill(self) -> None:
        """SIGKILL whatever is still inside: processes that left the program's process group
        (setsid) outside a PID namespace, which would otherwise outlive the run."""
        for d in dict.fromkeys(self.dirs.values()):
            _write(d / "cgroup.kill", "1")
            _kill_members(d)

    def remove(self) -> list[str]:
        """Remove every directory; returns those that could not be removed (should stay empty)."""
        return [str(d) for d in dict.fromkeys(self.dirs.values()) if not _remove(d)]


def _make(parent: Path, name: str, settings: list[tuple[str, str, bool]]) -> Path | None:
    """mkdir parent/name and write its settings (file, value, required); None, with nothing left
    behind, when the directory or a required setting cannot be made."""
    _sweep(parent)
    d = parent / name
    try:
        d.mkdir()
    except OSError:
        return None
    for file, value, required in settings:
        if not _write(d / file, value) and required:
            _remove(d)
            return None
    return d


def _v2_dir(mounts: list, name: str, max_processes: int, memory_bytes: int) -> dict[str, Path]:
    """A cgroup v2 directory for the layers our own cgroup delegates (cgroup.subtree_control)."""
    for fstype, point, mount_root, _ in mounts:
        own = _own_dir(point, mount_root, None) if fstype == "cgroup2" else None
        try:
            delegated = set((own / "cgroup.subtree_control").read_text().split()) if own else set()
        except OSError:
            continue
        wanted = [(layer, f, v) for c, layer, f, v in (("pids", "pids_cap", "pids.max", str(max_processes)),
                                                       ("memory", "memory_cap", "memory.max", str(memory_bytes)))
                  if c in delegated]
        optional = [("memory.swap.max", "0", False), ("memory.oom.group", "1", False)]  # OOM: all at once
        if wanted and (d := _make(own, name, [(f, v, True) for _, f, v in wanted] + optional)):
            return {layer: d for layer, _, _ in wanted}
    return {}


def create(root: str | os.PathLike, max_processes: int, memory_bytes: int) -> ProgramCgroup:
    """A fresh cgroup for one program run with pids.max = max_processes and a memory limit of
    memory_bytes (no swap); no layer where no usable hierarchy is found. v2 first (one directory
    for both caps), then v1 for what v2 does not give."""
    name = f"{_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
    mounts = _mounts(Path(os.path.abspath(root)))
    cgroup = ProgramCgroup({}, {"pids_cap": max_processes, "memory_cap": memory_bytes})
    try:
        cgroup.dirs.update(_v2_dir(mounts, name, max_processes, memory_bytes))
        for controller, layer, settings in (
                ("pids", "pids_cap", [("pids.max", str(max_processes), True)]),
                ("memory", "memory_cap", [("memory.limit_in_bytes", str(memory_bytes), True),
                                          ("memory.memsw.limit_in_bytes", str(memory_bytes), False)])):
            for fstype, point, mount_root, options in mounts:
                if layer in cgroup.dirs or fstype != "cgroup" or controller not in options:
                    continue
                own = _own_dir(point, mount_root, controller)
                if own and (d := _make(own, name, settings)):
                    cgroup.dirs[layer] = d
    except BaseException:  # interrupted half-way: nothing made may stay
        cgroup.remove()
        raise
    return cgroup


@contextlib.contextmanager
def program_cgroup(root: str | os.PathLike | None, max_processes: int, memory_bytes: int) -> Iterator[ProgramCgroup]:
    """`create` (nothing when root is None), yielded, and removed on the way out whatever happened."""
    cgroup = create(root, max_processes, memory_bytes) if root is not None else ProgramCgroup({}, {})
    try:
        yield cgroup
    finally:
        left = cgroup.remove()
        if left:  # only a process stuck in the kernel (D state) can keep one busy for 5 s
            import warnings

            warnings.warn(f"nanochat sandbox: could not remove cgroup(s) {left}; the next run sweeps "
                          "them once empty", RuntimeWarning, stacklevel=3)
