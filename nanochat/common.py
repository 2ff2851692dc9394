"""Process-wide basics: the base directory, rank-0 printing and (via init_runtime) the Runtime.

Nothing here runs at import time; `init_runtime()` is the one explicit entry point that touches
devices, seeds and the process group. `Runtime` is the one small object that carries the
distributed state (rank, world size, device, compute dtype) through every recipe.
A script's `__main__` (`script_main`, `run_cli`) lives in the torch-free nanochat/flags.py.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from nanochat.errors import RequestError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "mps")
DTYPE_ALIASES = {
    "auto": None,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp32": torch.float32, "float32": torch.float32,
}
DTYPE_ENV = "NANOCHAT_DTYPE"


def get_base_dir() -> Path:
    """Where artefacts live: $NANOCHAT_BASE_DIR or ~/.cache/nanochat (created on demand). A leading
    `~` in the variable is expanded: set quoted ("~/runs", a .env file, a unit file) it reached
    here as is, and the run's data went to a folder named `~` under whatever the current directory
    was. A path that cannot be a directory is a RequestError naming the variable, not a traceback."""
    given = os.environ.get("NANOCHAT_BASE_DIR")
    base = os.path.expanduser(given or os.path.join("~", ".cache", "nanochat"))
    path = Path(base)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # a file in the way, no permission, a read-only file system
        what = f"NANOCHAT_BASE_DIR: got {given!r}" if given else f"the base directory {base} (NANOCHAT_BASE_DIR unset)"
        raise RequestError(f"{what}, which cannot be used ({e.strerror or e}); accepted: a directory you can "
                           "write to, existing or one that can be created (set NANOCHAT_BASE_DIR)") from None
    return path


def fmt_bytes(n: float) -> str:
    """A size for people: "9.2 GB", "67 MB", "12 KB" (decimal units, as df -H and disk makers use)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if unit == "GB" else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only; safe before the process group exists (reads RANK)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs)


@dataclass
class Runtime:
    """Device, compute dtype and distributed position of this process (one per process)."""

    device: torch.device
    device_type: str        # "cuda" | "cpu" | "mps"
    dtype: torch.dtype      # compute dtype
    rank: int
    local_rank: int
    world_size: int
    ddp: bool               # launched by torchrun (WORLD_SIZE > 1 or RANK set)
    is_master: bool         # rank == 0

    def synchronize(self) -> None:
        """Wait for queued device work (needed before reading a wall clock)."""
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        elif self.device_type == "mps":
            torch.mps.synchronize()

    def peak_memory_bytes(self) -> int:
        """Peak allocated device memory since start / last reset; on CPU the process's peak
        resident set size (Linux/macOS `ru_maxrss`; 0 where the platform has no such counter)."""
        if self.device_type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self.device_type == "mps":
            return int(torch.mps.driver_allocated_memory())
        try:
            import resource
        except ImportError:  # Windows
            return 0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux

    def reset_peak_memory(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    @property
    def dtype_name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(self.dtype, str(self.dtype))


def _torchrun_position() -> tuple[bool, int, int, int]:
    """(ddp, rank, local_rank, world_size) from the torchrun environment variables."""
    env = os.environ
    world_size, rank, local_rank = (_env_int(var, default) for var, default in
                                    (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")))
    ddp = world_size > 1 or "RANK" in env
    if world_size > 1 and "RANK" not in env:   # else it would run as rank 0 and wait for ranks nobody started
        raise RequestError(f"WORLD_SIZE={world_size} is set but RANK is not: {_TORCHRUN_HINT}")
    if world_size < 1 or not (0 <= rank < world_size) or not (0 <= local_rank < world_size):
        raise RequestError(f"torchrun environment is inconsistent: RANK={rank} WORLD_SIZE={world_size} "
                           f"LOCAL_RANK={local_rank} (accepted: 0 <= RANK, LOCAL_RANK < WORLD_SIZE)")
    return ddp, rank, local_rank, world_size


def _env_int(var: str, default: str) -> int:
    """An integer torchrun variable; a malformed one is named with its value (int()'s own message,
    "invalid literal ... ''", said neither which variable nor, for an empty one, that it was set)."""
    raw = os.environ.get(var, default)
    try:
        return int(raw)
    except ValueError:
        raise RequestError(f"torchrun environment is malformed (RANK/LOCAL_RANK/WORLD_SIZE must be integers): "
                           f"got {var}={raw!r}; accepted: an integer. {_TORCHRUN_HINT}") from None


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 without torchrun), checked as init_runtime checks it: for a
    script's flag validation (batch sizes that must divide by it), which runs before the runtime,
    so that WORLD_SIZE=0 or "two" is named, not a ZeroDivisionError or int()'s message."""
    return _torchrun_position()[3]


_TORCHRUN_HINT = ("torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for each process it "
                  "starts; launch with torchrun --nproc_per_node=N -m scripts.<name> ..., or unset RANK and "
                  "WORLD_SIZE for a single process")


def _init_process_group(backend: str, rank: int, world_size: int, *, dtype: str | None = None, **kwargs) -> None:
    """dist.init_process_group over env:// with the failures a user can cause said in one line:
    torchrun's variables set by hand without the rendezvous ones, and a MASTER_PORT that another
    process holds or a MASTER_ADDR where no rank 0 listens (torch raises tracebacks for both).

    The rendezvous store comes first, for nanochat/roll_call.py's roll call: every rank arrives
    within NANOCHAT_DIST_TIMEOUT (a rank that stopped before is named, or its posted error raised)
    and runs the same code, torch, backend, dtype (`dtype`) and command line. The same timeout
    bounds the group's collectives (`timeout` in kwargs overrides it): gloo's default was 30 min."""
    from datetime import timedelta

    import torch.distributed as dist

    from nanochat.roll_call import dist_timeout_s, rank_facts, roll_call
    env = os.environ
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
    if missing:
        given = [f"{v}={env[v]}" for v in ("RANK", "WORLD_SIZE") if v in env]   # not "WORLD_SIZE=None"
        raise RequestError(f"{' '.join(given)} {'is' if len(given) == 1 else 'are'} set but {' and '.join(missing)} "
                           f"{'is' if len(missing) == 1 else 'are'} not: {_TORCHRUN_HINT}")
    _check_master_env(env["MASTER_ADDR"], env["MASTER_PORT"], world_size)
    timeout = kwargs.pop("timeout", None) or timedelta(seconds=dist_timeout_s())
    facts = rank_facts(backend, dtype)
    where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
        roll_call(store, rank, world_size, facts, timeout.total_seconds())
        # the prefix init_process_group puts on a store it creates itself
        dist.init_process_group(backend=backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                                world_size=world_size, timeout=timeout, **kwargs)
    except dist.DistError as e:   # DistNetworkError (bind/connect), DistStoreError (rendezvous timeout)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        busy = "EADDRINUSE" in str(e) or "address already in use" in str(e)
        hint = ("another process holds that port (an earlier run still alive?): pick a free one "
                "(torchrun --master_port N, or MASTER_PORT)" if busy else
                "check that rank 0 runs there and that every rank was started with the same MASTER_ADDR, "
                "MASTER_PORT and WORLD_SIZE")
        raise RequestError(f"rank {rank} of {world_size}: the process-group rendezvous at {where} failed "
                           f"({'address already in use' if busy else first}); {hint}") from e


def _check_master_env(addr: str, port: str, world_size: int) -> None:
    """MASTER_PORT and MASTER_ADDR as the rendezvous will use them. torch raised a bare ValueError
    traceback for a port that is not a number in 0..65535 ("invalid literal for int()"), and for a
    host name that does not resolve it retried with a warning a few seconds apart until the group's
    timeout (30 minutes on gloo). Port 0 (any free port) only for one process: no other rank could
    find the port rank 0 picked."""
    import socket
    lowest = 0 if world_size == 1 else 1
    if not (port.strip().isascii() and port.strip().isdigit() and lowest <= int(port) <= 65535):
        raise RequestError(f"MASTER_PORT: got {port!r}; accepted: a TCP port {lowest}..65535 "
                           f"(torchrun --master_port N sets it). {_TORCHRUN_HINT}")
    try:
        socket.getaddrinfo(addr, int(port), type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:   # UnicodeError: an empty or over-long label ("10.0..1")
        if getattr(e, "errno", None) == socket.EAI_AGAIN:   # DNS briefly unreachable: torch's retries may get through
            return
        raise RequestError(f"MASTER_ADDR: got {addr!r}, which does not resolve to an address "
                           f"({getattr(e, 'strerror', None) or e}); "
                           "accepted: rank 0's host name or IP address, as every rank reaches it (alone, "
                           "without the port: that is MASTER_PORT)") from None


def _resolve_device_type(device: str) -> str:
    if device not in DEVICE_CHOICES:
        raise RequestError(f"--device: got {device!r}; accepted: {'|'.join(DEVICE_CHOICES)}")
    if device == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if torch.backends.mps.is_available():
            return "mps"
        return "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RequestError(f"--device cuda: no CUDA device is visible (torch {torch.__version__}, "
                         f"built for CUDA {torch.version.cuda}); use --device cpu or auto")
    if device == "mps" and not torch.backends.mps.is_available():
        raise RequestError("--device mps: the MPS backend is not available on this machine; use --device cpu or auto")
    return device


def _resolve_dtype(dtype: str, device_type: str, flag: str | None = None) -> torch.dtype:
    """Explicit argument, else $NANOCHAT_DTYPE, else bf16 on a bf16-capable GPU and fp32 elsewhere.
    `flag`: what the user passed that set `dtype` (base_train: '--precision fp8'); default --dtype."""
    if dtype not in DTYPE_ALIASES:
        raise RequestError(f"--dtype: got {dtype!r}; accepted: auto|bf16|fp32")
    env_value = os.environ.get(DTYPE_ENV, "").strip()
    if env_value and env_value not in DTYPE_ALIASES:
        raise RequestError(f"{DTYPE_ENV}: got {env_value!r}; accepted: auto|bf16|fp32")
    requested = DTYPE_ALIASES[dtype]
    from_env = DTYPE_ALIASES[env_value] if env_value else None
    if requested is not None and from_env is not None and requested != from_env:
        raise RequestError(f"--dtype {dtype} conflicts with {DTYPE_ENV}={env_value}; drop one of them (base_train and "
                           "profile_training set the dtype from --precision)")
    chosen = requested or from_env
    bf16_gpu = device_type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    if chosen is None:
        return torch.bfloat16 if bf16_gpu else torch.float32
    if chosen == torch.bfloat16 and device_type == "cuda" and not bf16_gpu:
        name = torch.cuda.get_device_name()
        source = (flag or "--dtype bf16") if requested is not None else f"{DTYPE_ENV}={env_value}"   # where bf16 came from
        use = "--precision fp32" if flag else "--dtype fp32 (base_train and profile_training: --precision fp32)"
        raise RequestError(f"{source}: {name} has no native bf16 support; use {use}"
                           + (f" or unset {DTYPE_ENV}" if requested is None else ""))
    return chosen


def _seed_everything(seed: int, device_type: str) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np  # optional: only seeded when present
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def init_runtime(device: str = "auto", dtype: str = "auto", seed: int = 42, *, dtype_flag: str | None = None) -> Runtime:
    """Pick the device and compute dtype, join the process group under torchrun, seed, enable TF32.
    `dtype_flag`: the flag a refused dtype is named by (default --dtype; base_train passes its precision flag).
    Under torchrun a request this rank refuses is also left for the other ranks, which raise it at
    once (nanochat/roll_call.py) instead of waiting for this one at the start."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:   # torch.manual_seed's range
        raise RequestError(f"--seed: got {seed!r}; accepted: an integer >= 0 and < 2**64")
    ddp, rank, local_rank, world_size = _torchrun_position()
    try:
        from nanochat.roll_call import dist_timeout_s
        if ddp:
            dist_timeout_s()   # a malformed NANOCHAT_DIST_TIMEOUT on one node: said by every rank
        device_type = _resolve_device_type(device)
        if device_type == "cuda":
            # Before CUDA initialises, which _resolve_dtype's bf16 check does (torch.cuda.current_device):
            # torch reads the allocator settings (expandable segments on unified memory) and prints its
            # sm_121 capability warning then, so the env and the warning filter set after it came too late.
            from nanochat.platform import configure_env_before_cuda
            configure_env_before_cuda()
        compute_dtype = _resolve_dtype(dtype, device_type, dtype_flag)
        # Before any CPU matmul: cap oneDNN below AMX where AMX kernels crash (platform.py).
        from nanochat.platform import patch_cpu_amx
        patch_cpu_amx()
        if device_type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise RequestError(f"--device cuda: LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} "
                                   f"GPU(s) are visible; launch with --nproc_per_node <= {torch.cuda.device_count()}")
            torch_device = torch.device("cuda", local_rank)
            torch.cuda.set_device(torch_device)
            # ptxas / fp-fusion workarounds for every Triton launch, not only training's (platform.py)
            from nanochat.platform import apply_runtime_patches, detect_device
            apply_runtime_patches(detect_device(torch_device))
            # TF32 for the fp32 matmuls that remain (optimizer maths, fp32 runs); bf16 is unaffected.
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
        else:
            torch_device = torch.device(device_type)
        if ddp and device_type == "mps":
            raise RequestError("--device mps: torchrun (distributed) is not supported on MPS; use cuda or cpu")
    except RequestError as e:
        if ddp:   # the other ranks would wait for this one at the start until the timeout
            from nanochat.roll_call import post_start_failure
            post_start_failure(str(e))
            e.start_failure_posted = True   # flags._exit_with_error: not twice
        raise

    if ddp:
        import torch.distributed as dist
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            kwargs = {"device_id": torch_device} if device_type == "cuda" else {}
            if backend == "nccl":  # NVLink multicast stays off unless the user set it (distributed.py)
                from nanochat.nccl_env import nccl_env_defaults
                nccl_env_defaults()
            _init_process_group(backend, rank, world_size, dtype=str(compute_dtype).removeprefix("torch."), **kwargs)
    # Every rank gets the same seed: the model must initialise identically on all ranks
    # (data differs by rank through the loader's sharding, not through the RNG).
    _seed_everything(seed, device_type)
    return Runtime(device=torch_device, device_type=device_type, dtype=compute_dtype, rank=rank,
                   local_rank=local_rank, world_size=world_size, ddp=ddp, is_master=rank == 0)


def destroy_runtime(rt: Runtime) -> None:
    """Leave the process group (if any); safe to call twice. Called while an exception propagates
    (a script's `try: ... finally: destroy_runtime(rt)` on an error), it leaves the group up for
    the process exit to free, as distributed.group_left_on_success does: a rank that failed alone
    (its own out-of-memory, a shard of its own unreadable) and tore the group down at once failed
    the other ranks' next collective ("Connection closed by peer"), and torchrun ended the job on
    their traceback, killing the failed rank before it printed why (flags.SPEAKER_GRACE_S). A
    stop (an error with an exit_code: SIGTERM, --stop; every rank stops at the same step) still
    leaves the group, as a normal end does."""
    error = sys.exc_info()[1]
    if rt.ddp and (error is None or hasattr(error, "exit_code")):
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def barrier() -> None:
    """dist.barrier() when a process group is up; a no-op in single-process runs."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
