"""The code sandbox's seccomp-BPF filter (which sockets a sandboxed program may create, which calls
it may make) and its Landlock ruleset (where it may write: `landlock_rules`, at the end).

`nanochat.execution` builds the filter here, in the parent (pure Python, no kernel calls; Landlock's
version query is the one), and its sandbox child installs the bytes with prctl(PR_SET_SECCOMP)
just before the program runs; the child cannot import this module (it runs as `python -I
execution.py`), so it receives bytes.

Why: the network namespace leaves no network, but it does not cover the filesystem. A Unix
socket file the program can see (/var/run/docker.sock, a D-Bus or X11 socket, nscd) is connectable
from any namespace, and a read-only mount does not stop connect(). So socket() is allowed only for
AF_INET / AF_INET6 (which the empty network namespace already cuts off; without that namespace
they are denied too), and every other domain (AF_UNIX, AF_NETLINK, AF_VSOCK, AF_PACKET, ...)
fails with EACCES, as a kernel that forbids it would answer: no kill, so libraries that try a
socket and fall back (glibc's nscd client) keep working. socketpair() is allowed only for AF_UNIX
stream / seqpacket pairs: they are born connected to each other and cannot be re-connected, while
a datagram socket can sendto() any socket path. io_uring_setup / _enter / _register fail with
EPERM: IORING_OP_SOCKET (Linux 5.19+) creates sockets without the socket() system call.
add_key / request_key / keyctl fail with EPERM (as in Docker's default profile): kernel keyrings
are not namespaced, so the program would reach the caller's session and user keyrings (read keys,
link new ones). shmget / msgget fail with EPERM: a SysV segment or message queue holds memory that
RLIMIT_AS stops counting once it is detached, so without the memory cgroup a shmget / shmat /
shmdt loop could fill host RAM (the IPC namespace, execution.py's "ipcns", frees them after the
run; semaphores, a few bytes each, stay allowed). unshare() and a clone() with a namespace flag
fail with EPERM, clone3 with ENOSYS (its flags are in memory a filter cannot read; glibc then falls
back to clone for threads and fork): a new user namespace hands back a full capability set (the
dropped bounding set included) in it, and with it the kernel's namespace-only attack surface
(nf_tables, mounts of its own), as in Docker's default profile.

Outside a PID namespace (where the OS refuses namespaces: Docker's default profile, Ubuntu 24.04's
restricted user namespaces for a user) the program could reach every process of its uid: kill the
caller, a training run, the user's shell (kill(-1) all at once), and where Yama allows, ptrace one
and write its memory. That filter (allow_signals=False) also denies (EPERM) kill / tkill / tgkill /
rt_sigqueueinfo / rt_tgsigqueueinfo but to its own pid (as tgkill's thread group: any of its
threads) or process group (pid 0), pidfd_send_signal, ptrace, process_vm_readv / writev and pidfd_getfd; the
kernel's own signals (SIGXCPU, SIGKILL, SIGSEGV, ...) still arrive. The program's pid is known only
in the child, which installs the filter: the parent builds it with OWN_PID in its place (no pid is
that large: a filter nobody baked lets no signal through to any process) and the child writes its
own pid there (a process it forks, as root, may not signal itself: its pid is another).
/proc/PID/mem and /proc/PID/environ are files, out of a filter's reach: the Landlock domain (below)
keeps the program from them, and from writing outside its dir.

The filter checks the audit architecture first (as the kernel's seccomp docs require: the same
number means another call on another ABI) and kills the process on a foreign one (a 32-bit
int 0x80 or compat call). On x86_64 it also denies the x32 ABI (numbers with bit 0x40000000),
whose socket() would otherwise pass a check on the number 41. Only x86_64 and aarch64 (the DGX
Spark) are known here; elsewhere `native_filter` returns None and the layer is not claimed.
"""

from __future__ import annotations

import errno
import functools
import platform
import struct
import sys
from dataclasses import dataclass

AUDIT_ARCH_X86_64 = 0xC000003E   # EM_X86_64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
AUDIT_ARCH_AARCH64 = 0xC00000B7  # EM_AARCH64 | __AUDIT_ARCH_64BIT | __AUDIT_ARCH_LE
X32_SYSCALL_BIT = 0x40000000
IO_URING_SETUP, IO_URING_REGISTER = 425, 427  # setup, enter, register: same numbers on both ABIs
PIDFD_SEND_SIGNAL, PIDFD_GETFD = 424, 438  # same numbers on both ABIs
OWN_PID = 0x7FFFFFFF  # stands for the program's pid in a filter until its child writes it: above pid_max (2**22)
CLONE3 = 435  # same number on both ABIs
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (NEWTIME: only unshare / clone3)
CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x7E000000

SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10
SOCK_STREAM, SOCK_SEQPACKET, SOCK_TYPE_MASK = 1, 5, 0xF  # the type argument also carries NONBLOCK / CLOEXEC

# classic BPF opcodes used below (linux/filter.h, linux/bpf_common.h)
BPF_LD_W_ABS, BPF_JEQ_K, BPF_JGE_K, BPF_JGT_K, BPF_AND_K, BPF_RET_K = 0x20, 0x15, 0x35, 0x25, 0x54, 0x06
# struct seccomp_data offsets (little-endian: an int argument is the low word of its u64 slot)
OFF_NR, OFF_ARCH, OFF_ARG0, OFF_ARG1 = 0, 4, 16, 24


@dataclass(frozen=True)
class Abi:
    audit_arch: int
    socket: int
    socketpair: int
    x32_trap: bool  # x86_64: also the x32 ABI's numbers reach a filter with AUDIT_ARCH_X86_64
    add_key: int  # add_key, request_key, keyctl: consecutive on both ABIs
    ipc_gets: tuple[int, int]  # shmget, msgget
    clone: int
    unshare: int
    signals: tuple[int, ...]  # kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo: a target pid first
    tracing: tuple[int, ...]  # ptrace, process_vm_readv, process_vm_writev


ABIS = {
    "x86_64": Abi(AUDIT_ARCH_X86_64, socket=41, socketpair=53, x32_trap=True, add_key=248, ipc_gets=(29, 68),
                  clone=56, unshare=272, signals=(62, 200, 234, 129, 297), tracing=(101, 310, 311)),
    "aarch64": Abi(AUDIT_ARCH_AARCH64, socket=198, socketpair=199, x32_trap=False, add_key=217,
                   ipc_gets=(194, 186), clone=220, unshare=97, signals=(129, 130, 131, 138, 240),
                   tracing=(117, 270, 271)),
}


def _assemble(program: list) -> bytes:
    """Encode [label str | (code, k, jump_true, jump_false)] as struct sock_filter[]; jumps name a
    later label (or None: the next instruction) and become the relative offsets BPF wants."""
    labels, index = {}, 0
    for item in program:
        if isinstance(item, str):
            labels[item] = index
        else:
            index += 1
    out, index = [], 0
    for item in program:
        if isinstance(item, str):
            continue
        code, k, jt, jf = item
        offsets = [0 if j is None else labels[j] - index - 1 for j in (jt, jf)]
        assert all(0 <= off < 256 for off in offsets), (item, offsets)  # BPF jumps only forward
        out.append(struct.pack("<HBBI", code, *offsets, k))
        index += 1
    return b"".join(out)


def build_filter(abi: str, *, allow_inet: bool = True, allow_signals: bool = True, own_pid: int = OWN_PID) -> bytes:
    """The filter for one ABI ("x86_64" | "aarch64"). allow_inet=False also denies AF_INET and
    AF_INET6 sockets: for a child whose network namespace could not be created. allow_signals=False
    denies signals (but to `own_pid` and its own group), ptrace and the like: for one outside a PID
    namespace."""
    if abi not in ABIS:
        raise ValueError(f"build_filter: abi={abi!r}; accepted: {sorted(ABIS)}")
    if not 0 < own_pid <= OWN_PID:
        raise ValueError(f"build_filter: own_pid={own_pid!r}; accepted: a pid, 1 .. {OWN_PID:#x} (OWN_PID)")
    a = ABIS[abi]
    deny_socket = SECCOMP_RET_ERRNO | errno.EACCES
    deny_call = SECCOMP_RET_ERRNO | errno.EPERM
    no_call = SECCOMP_RET_ERRNO | errno.ENOSYS
    inet = [(BPF_JEQ_K, AF_INET, "allow", None), (BPF_JEQ_K, AF_INET6, "allow", "deny_socket")]
    program = [
        (BPF_LD_W_ABS, OFF_ARCH, None, None),
        (BPF_JEQ_K, a.audit_arch, None, "kill"),
        (BPF_LD_W_ABS, OFF_NR, None, None),
        *([(BPF_JGE_K, X32_SYSCALL_BIT, "deny_call", None)] if a.x32_trap else []),
        (BPF_JEQ_K, a.socket, "socket", None),
        (BPF_JEQ_K, a.socketpair, "socketpair", None),
        *[(BPF_JEQ_K, nr, "deny_call", None) for nr in (*a.ipc_gets, a.unshare)],
        *([] if allow_signals else [*[(BPF_JEQ_K, nr, "signal", None) for nr in a.signals], *[
            (BPF_JEQ_K, nr, "deny_call", None) for nr in (*a.tracing, PIDFD_SEND_SIGNAL, PIDFD_GETFD)]]),
        (BPF_JEQ_K, CLONE3, "no_call", None),
        (BPF_JEQ_K, a.clone, "clone", None),
        (BPF_JGE_K, a.add_key, None, "io_uring"),
        (BPF_JGT_K, a.add_key + 2, None, "deny_call"),  # add_key .. keyctl
        "io_uring",
        (BPF_JGE_K, IO_URING_SETUP, None, "allow"),
        (BPF_JGT_K, IO_URING_REGISTER, "allow", "deny_call"),
        "socket",
        *([(BPF_LD_W_ABS, OFF_ARG0, None, None), *inet] if allow_inet else
          [(BPF_RET_K, deny_socket, None, None)]),  # no network namespace: no domain at all
        "socketpair",
        (BPF_LD_W_ABS, OFF_ARG0, None, None),
        (BPF_JEQ_K, AF_UNIX, None, "deny_socket"),
        (BPF_LD_W_ABS, OFF_ARG1, None, None),
        (BPF_AND_K, SOCK_TYPE_MASK, None, None),
        (BPF_JEQ_K, SOCK_STREAM, "allow", None),
        (BPF_JEQ_K, SOCK_SEQPACKET, "allow", "deny_socket"),
        "clone",  # flags: the first argument on both ABIs
        (BPF_LD_W_ABS, OFF_ARG0, None, None),
        (BPF_AND_K, CLONE_NAMESPACE_FLAGS, None, None),
        (BPF_JEQ_K, 0, "allow", "deny_call"),
        # the target pid (tgid): the first argument, an int (the low word); 0: its own group (kill
        # only; for the others no process: EINVAL / ESRCH)
        *([] if allow_signals else ["signal", (BPF_LD_W_ABS, OFF_ARG0, None, None), (BPF_JEQ_K, 0, "allow", None),
                                    (BPF_JEQ_K, own_pid, "allow", "deny_call")]),
        "allow", (BPF_RET_K, SECCOMP_RET_ALLOW, None, None),
        "deny_socket", (BPF_RET_K, deny_socket, None, None),
        "deny_call", (BPF_RET_K, deny_call, None, None),
        "no_call", (BPF_RET_K, no_call, None, None),
        "kill", (BPF_RET_K, SECCOMP_RET_KILL_PROCESS, None, None),
    ]
    return _assemble(program)


def native_abi() -> str | None:
    """The ABI of this interpreter's own system calls when the filter knows it, else None. The
    kernel's machine name is not enough: a 32-bit interpreter on a 64-bit kernel reports x86_64
    or aarch64 from uname but makes 32-bit calls, which the filter would kill."""
    machine = platform.machine()
    if sys.platform != "linux" or sys.byteorder != "little" or sys.maxsize <= 2**32 or machine not in ABIS:
        return None
    return machine


@functools.lru_cache(maxsize=4)
def native_filter(allow_inet: bool = True, allow_signals: bool = True) -> bytes | None:
    abi = native_abi()
    return build_filter(abi, allow_inet=allow_inet, allow_signals=allow_signals) if abi else None


def child_filters() -> dict[str, str]:
    """The sandbox child's filters (hex), keyed by whether its namespaces came up ("netns": the PID
    namespace too): outside them AF_INET / AF_INET6, signals to other processes and ptrace are
    denied too. Empty where the ABI is not known here."""
    return {k: f.hex() for k in ("netns", "no_netns") if (f := native_filter(k == "netns", k == "netns"))}


# Landlock (Linux >= 5.13): the rights governed here are all writes: write_file, remove_dir / file,
# make_char / dir / reg / sock / fifo / block / sym (ABI 1), refer (ABI 2), truncate (ABI 3); a rule
# on a file (a device) may hold only write_file and truncate. Scopes (ABI 6): abstract unix sockets,
# signals. Same system call numbers on x86_64 and aarch64.
LANDLOCK_CREATE_RULESET = 444
LL_WRITES, LL_REFER, LL_TRUNCATE, LL_WRITE_FILE, LL_SCOPES = 0x1FF2, 1 << 13, 1 << 14, 1 << 1, 0x3


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    """This kernel's Landlock ABI version; 0 where there is none (not Linux, not enabled, too old)."""
    import ctypes

    if sys.platform != "linux":  # the number means another call elsewhere
        return 0
    try:
        abi = ctypes.CDLL(None, use_errno=True).syscall(LANDLOCK_CREATE_RULESET, None, 0, 1)  # _VERSION
    except (OSError, AttributeError):
        return 0
    return max(abi, 0)


def landlock_rules(workdir: str, devices: tuple[str, ...], abi: int | None = None) -> list:
    """The sandbox child's Landlock ruleset: [struct landlock_ruleset_attr as hex, [path, rights],
    ...]; empty without Landlock. The program may write (create, delete, rename) only under
    `workdir` and to `devices`; a Landlock domain also keeps it from ptrace (so from
    /proc/PID/environ and mem) of any process outside it, and with ABI 6 from signalling one.

    Why: outside the namespaces (Docker's default profile refuses them to root, Ubuntu 24.04's
    restricted user namespaces to a user) no read-only mount exists, and the program could
    overwrite or delete every file its uid may (a user's home, root's checkpoints and data) and read
    the API keys in its uid's processes' environments, past the Python guard. Landlock needs no
    privilege and no namespace. Inside them it repeats what the mounts do."""
    abi = landlock_abi() if abi is None else abi
    if abi < 1:
        return []
    writes = LL_WRITES | LL_REFER * (abi >= 2) | LL_TRUNCATE * (abi >= 3)
    attr = struct.pack("<QQQ", writes, 0, LL_SCOPES if abi >= 6 else 0)  # fs rights, net rights, scopes
    device = LL_WRITE_FILE | LL_TRUNCATE * (abi >= 3)
    return [attr.hex(), [workdir, writes], *([d, device] for d in devices)]
