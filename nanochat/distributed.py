"""Distributed helpers on PyTorch's own stack (torchrun + NCCL/gloo): timed barrier, NCCL
environment checks, an all-reduce bus-bandwidth self-test, FSDP2 wrapping, and rank-strided
micro-batches.

* `timed_barrier` is a host-side barrier through the process group's TCPStore: every rank marks
  its arrival; a rank that waits longer than the timeout raises `BarrierTimeout` naming the ranks
  that never arrived (a crashed rank, or one still compiling: warm up on every rank first). Its
  timeout, and check_shared_dir's and warm_up_ranks', default to NANOCHAT_DIST_TIMEOUT (600 s;
  nanochat/roll_call.py, which also bounds the start and the group's collectives).
* `rank_failures` gathers what failed where in a task every rank does its part of (a checkpoint
  save), so every rank raises together instead of the others waiting for the failed one;
  `failing_together` wraps a block each rank does alone (a resume reading its own shards) in it.
* `group_left_on_success` leaves the process group when a script's work ends normally, and keeps
  it up on an error, so that a rank that failed alone is heard (torchrun then ends the others).
* `check_shared_dir` checks at start-up that every rank sees the same checkpoint directory: two
  nodes with separate disks otherwise train until the first save (by default the last) and fail.
* `check_nccl_env` validates NCCL_* variables against the machine (interfaces in
  /sys/class/net, HCAs in /sys/class/infiniband, MTU) and refuses NCCL_NVLS_ENABLE != 0:
  NVLink multicast stays off in this project (`nccl_env_defaults` sets it to 0). Both live in
  nanochat/nccl_env.py (torch-free) and are importable from here too.
* `allreduce_bandwidth` times all-reduce at several sizes and reports algbw = bytes / time and
  busbw = algbw * 2(n-1)/n (the nccl-tests convention, comparable across world sizes).
  `selftest_main` runs the checks + bandwidth test under torchrun, or spawns one process per GPU
  (2 gloo processes on CPU) when started directly: `python -m nanochat.platform --nccl`.
* `apply_fsdp` shards a GPT with FSDP2 (`fully_shard`, Shard(0) per parameter): each Block, then
  the root. MuonAdamW (optim.py) detects DTensor parameters, takes the already reduce-scattered
  gradients, and all-gathers each Muon stack for the orthogonalisation. `model.state_dict()`
  returns full (gathered) tensors, so rank 0 can save an ordinary model.pt.
* `torchrun_stop_grace` says how long torchrun lets its workers run after passing a stop signal
  on (then SIGKILL): a graceful stop (loop.py) needs the step in flight plus a checkpoint save.
* `StridedMicroBatches` deals micro-batches of one global stream to ranks (rank r gets items
  r, r+W, ...): W ranks x accumulation k then see exactly the batches 1 rank x accumulation W*k
  sees, which makes loss-equivalence checks across world sizes exact up to float reordering.
"""

from __future__ import annotations

import itertools
import os
import time
import contextlib
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from nanochat.nccl_env import check_nccl_env, nccl_env_defaults
from nanochat.roll_call import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, dist_timeout_s

DEFAULT_BARRIER_TIMEOUT_S = DEFAULT_TIMEOUT_S   # NANOCHAT_DIST_TIMEOUT when the caller gives none
TORCHRUN_DEFAULT_GRACE_S = 30      # torchrun's SIGTERM -> SIGKILL wait when nothing sets it
STOP_GRACE_S = 3600                # what run_train.sh / launch_multinode.sh ask torchrun for
_barrier_counter = itertools.count()


class BarrierTimeout(RuntimeError):
    """A rank waited past the timeout at a barrier; the message names the missing ranks."""


# ------------------------------------------------------------------------------------ barrier

def _default_store():
    # The process group's own rendezvous store (TCPStore under torchrun / tcp://, FileStore for
    # file://). torch.distributed exposes no public getter; its own barrier code uses this one.
    from torch.distributed.distributed_c10d import _get_default_store
    return _get_default_store()


def timed_barrier(timeout_s: float | None = None, *, name: str = "barrier", poll_s: float = 0.02) -> float:
    """Wait until every rank reaches this call; returns seconds waited. No-op without a group.

    Raises BarrierTimeout after `timeout_s` (None: NANOCHAT_DIST_TIMEOUT, default 600 s) naming the
    ranks that did not arrive. Every rank must call the timed barriers in the same order (the n-th
    call on each rank pairs up)."""
    timeout_s = dist_timeout_s() if timeout_s is None else timeout_s
    if not (timeout_s > 0):
        raise ValueError(f"timed_barrier timeout_s: got {timeout_s}; accepted: seconds > 0")
    if not (dist.is_available() and dist.is_initialized()):
        return 0.0
    world, rank = dist.get_world_size(), dist.get_rank()
    store = _default_store()
    key = f"nanochat/barrier/{next(_barrier_counter)}/{name}"
    t0 = time.monotonic()
    store.set(f"{key}/rank{rank}", "1")
    arrived = store.add(f"{key}/count", 1)
    while arrived < world:
        waited = time.monotonic() - t0
        if waited > timeout_s:
            missing = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
            raise BarrierTimeout(
                f"{name}: rank(s) {missing} of {world} did not arrive within {timeout_s:.0f}s ({TIMEOUT_ENV}; seen from rank "
                f"{rank}, waited {waited:.1f}s). A missing rank crashed (see its log), hangs, or is still "
                "compiling: warm up torch.compile on every rank before the loop; NCCL_DEBUG=INFO shows more")
        time.sleep(poll_s)
        arrived = store.add(f"{key}/count", 0)
    return time.monotonic() - t0


def rank_failures(message: str | None) -> dict[int, str]:
    """Collective: every rank passes what went wrong in its part of a shared task (None: nothing);
    returns {rank: message} of the ranks that failed, alike on every rank ({} when none did). A rank
    that raised alone left the others waiting at the task's next barrier (until the process group's
    timeout, or torchrun's SIGKILL after its grace): with this, every rank raises together. Without
    a process group: this process's own ({0: message}, or {})."""
    if not (dist.is_available() and dist.is_initialized()):
        return {} if message is None else {0: message}
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, message)   # NCCL: through the current CUDA device (init_runtime's)
    return {r: m for r, m in enumerate(gathered) if m is not None}


@contextmanager
def failing_together(what: str, error_type: type[Exception] | None = None):
    """`with failing_together("resuming ..."):` around work each rank does on its own (reading its
    own files: a resume's optimizer and loader shards), then one collective (rank_failures): a rank
    whose part raised re-raises its own error, every other rank an `error_type` (default RequestError:
    one line from the scripts) naming that rank and its error. Without it a rank that failed alone (its
    optim_rank1.pt damaged) left the others building the model and entering the loop, where their first
    collective ended in gloo's "Connection closed by peer" traceback (NCCL: a wait for its timeout)
    instead of the line naming the file. No collective may run inside the block (a failed rank skips
    it). Without a process group: the block as it is."""
    error = None
    try:
        yield
    except Exception as e:   # noqa: BLE001 - a bug too: the other ranks must not wait for it
        error = e
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    from nanochat.errors import RequestError
    said = None if error is None else str(error) if isinstance(error, RequestError) else f"{type(error).__name__}: {error}"
    failed = rank_failures(said)
    if error is not None:
        raise error
    if failed:
        where = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise (error_type or RequestError)(
            f"{what} failed on rank(s) {', '.join(map(str, failed))} of {dist.get_world_size()}, so every rank "
            f"stops: {where}")


@contextmanager
def group_left_on_success(rt):
    """`with group_left_on_success(rt):` runs a script's work, then leaves the process group
    (destroy_runtime) when the block ends normally. On an error the group is left up, for the
    process exit to free: a rank that failed alone (its own OOM, a split with no documents for it)
    prints its line only after flags.SPEAKER_GRACE_S, and a group it tore down first failed the
    other ranks' next collective at once ("Connection closed by peer"), so that torchrun ended the
    job on their traceback and killed the failed rank before its line. Kept up, the others wait at
    that collective until the failed rank has said why and exited, and torchrun then ends them."""
    yield
    from nanochat.common import destroy_runtime
    destroy_runtime(rt)


def check_shared_dir(path: str | Path, *, what: str = "checkpoint directory",
                     timeout_s: float | None = None) -> None:
    """Raise RequestError (a ValueError; scripts print `<name>: error: ...` and exit 2) on every
    rank unless every rank sees the same directory `path` (collective; a no-op without a process
    group). Call it at start-up, before training.

    A checkpoint is written by every rank into one staging directory that rank 0 then renames
    (checkpoint.py). Two nodes with their own disks (two Sparks without NFS) train normally and
    fail only at the first save, which is the final one by default: a rank on node 1 finds no
    staging directory (FileNotFoundError) after the whole run. Rank 0 writes a marker file with a
    unique token here; each rank looks for it; the message names the ranks and hosts that did not
    see it."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    import socket

    from nanochat.errors import RequestError
    world, rank, host = dist.get_world_size(), dist.get_rank(), socket.gethostname()
    store, path = _default_store(), Path(path)
    timeout_s = dist_timeout_s() if timeout_s is None else timeout_s
    key = f"nanochat/shared_dir/{next(_barrier_counter)}"
    marker = None
    if rank == 0:
        token = f"{host}:{os.getpid()}:{time.time_ns()}"
        try:
            path.mkdir(parents=True, exist_ok=True)
            marker = path / f".shared-check-{os.getpid()}-{time.time_ns()}"
            marker.write_text(token)
        except OSError as e:   # the others wait on the store: tell them before raising
            store.set(f"{key}/marker", "")
            raise RequestError(f"{what} {path}: rank 0 cannot write there ({e.strerror})") from e
        store.set(f"{key}/marker", f"{marker.name}\n{token}")
    else:   # store.get alone would wait the store's own timeout (30 min on gloo), not timeout_s
        try:
            store.wait([f"{key}/marker"], timedelta(seconds=timeout_s))
        except dist.DistError:
            raise BarrierTimeout(
                f"shared {what} check: rank(s) [0] of {world} did not arrive within {timeout_s:.0f}s (seen from "
                f"rank {rank}). Rank 0 crashed (see its log), hangs, or cannot reach {path}") from None
    name, _, token = store.get(f"{key}/marker").decode().partition("\n")
    if not name:
        raise RequestError(f"{what} {path}: rank 0 cannot write there (see rank 0's log)")
    try:
        seen = (path / name).read_text() == token
    except OSError:
        seen = False
    store.set(f"{key}/rank{rank}", "" if seen else host)
    try:
        timed_barrier(timeout_s, name=f"shared {what} check")
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
    blind = {r: store.get(f"{key}/rank{r}").decode() for r in range(world)}
    blind = {r: h for r, h in blind.items() if h}
    if blind:
        hosts = ", ".join(sorted(set(blind.values())))
        raise RequestError(
            f"{what} {path}: rank(s) {sorted(blind)} of {world} (host {hosts}) do not see the file rank 0 "
            f"(host {token.split(':')[0]}) wrote there. Every rank must see the same directory: on several "
            "nodes put NANOCHAT_BASE_DIR (or the checkpoint directory) on a filesystem shared by all of them "
            "(e.g. NFS), mounted at the same path on each")


def warm_up_ranks(train_model, batch_size: int, seq_len: int, vocab_size: int, device, *,
                  timeout_s: float | None = None, loss_reduction: str | None = None,
                  around=None, evaluates: bool = False) -> float:
    """Compile before the loop on every rank, then meet at a timed barrier; returns seconds taken.

    One forward+backward of the (compiled) training model on a fixed dummy batch, so every rank
    pays torch.compile / autotuning up front instead of inside the first collective, where a rank
    that compiles for minutes trips the NCCL watchdog (DESIGN.md pitfall 9). Leaves no trace:
    no RNG draw (the batch is arange-based), gradients cleared, no optimizer step, so exact
    resume is unaffected. Under FSDP the forward/backward collectives run on every rank alike.
    The graphs compiled are the ones the loop runs: the call as the Trainer makes it
    (`loss_reduction`: "sum" for token-weighted chat stages), inside its step context (`around()`:
    Trainer.step_context, whose once-per-step weight casts change what is traced), and with
    `evaluates`, evaluate_bpb's no-grad eval-mode forward (per-token losses), whose first call came
    inside the step-0 evaluation's collectives. Called through training.warm_up_compile."""
    from nanochat.training import compile_eval_forward, warm_up_batch
    t0 = time.monotonic()
    idx = warm_up_batch(batch_size, seq_len, vocab_size, device)
    with around() if around is not None else contextlib.nullcontext():
        loss = train_model(idx, idx) if loss_reduction is None else train_model(idx, idx, loss_reduction=loss_reduction)
        loss.backward()
    for p in train_model.parameters():
        p.grad = None
    if evaluates:
        compile_eval_forward(train_model, idx)
    timed_barrier(timeout_s, name="compile warm-up")
    return time.monotonic() - t0


# ------------------------------------------------------------------------------------ bandwidth

def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests all-reduce bus bandwidth: algbw * 2(n-1)/n (0 for one rank: nothing moves)."""
    return algbw * 2 * (world_size - 1) / world_size


def allreduce_bandwidth(sizes_bytes: Iterable[int], *, device: torch.device | str = "cpu", iters: int = 5,
                        warmup: int = 2, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Time dist.all_reduce (SUM) for each size on the current process group (collective: every
    rank calls it). Returns one dict per size: bytes, median seconds, algbw and busbw in GB/s."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("allreduce_bandwidth: needs an initialised process group (torchrun)")
    if iters < 1 or warmup < 0:
        raise ValueError(f"allreduce_bandwidth iters/warmup: got {iters}/{warmup}; accepted: iters >= 1, warmup >= 0")
    device, world = torch.device(device), dist.get_world_size()
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for size in sizes_bytes:
        x = torch.ones(max(1, int(size) // elem), dtype=dtype, device=device)
        times = []
        for i in range(warmup + iters):
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            sync()  # the clock is read only after the collective finished on the device
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        dt = sorted(times)[len(times) // 2]
        nbytes = x.numel() * elem
        algbw = nbytes / dt / 1e9
        rows.append({"bytes": nbytes, "seconds": dt, "algbw_gbs": algbw,
                     "busbw_gbs": bus_bandwidth(algbw, world), "world_size": world})
    return rows


def format_bandwidth_table(rows: list[dict]) -> str:
    lines = [f"{'size':>10} {'time ms':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for r in rows:   # KiB below 1 MiB: the CPU default 64 KiB read "0.1Mi"
        size = f"{r['bytes'] / 2**20:>8.1f}Mi" if r["bytes"] >= 2**20 else f"{r['bytes'] / 2**10:>8.1f}Ki"
        lines.append(f"{size} {r['seconds'] * 1e3:>10.3f} {r['algbw_gbs']:>11.2f} "
                     f"{r['busbw_gbs']:>11.2f}")
    return "\n".join(lines)


def _selftest_rank(sizes_bytes: list[int], timeout_s: float, iters: int) -> dict:
    """Inside an initialised group: barrier, correctness all-reduce, bandwidth rows."""
    world, rank = dist.get_world_size(), dist.get_rank()
    on_cuda = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    waited = timed_barrier(timeout_s, name="nccl-selftest")
    x = torch.full((4,), float(rank), device=device)
    dist.all_reduce(x)
    expected = world * (world - 1) / 2
    if not torch.allclose(x.cpu(), torch.full((4,), expected)):
        raise RuntimeError(f"all_reduce returned {x.tolist()} on rank {rank}; expected {expected} everywhere")
    rows = allreduce_bandwidth(sizes_bytes, device=device, iters=iters)
    return {"backend": dist.get_backend(), "world_size": world, "barrier_s": waited,
            "device": torch.cuda.get_device_name(device) if on_cuda else "cpu", "allreduce": rows}


def _spawned_selftest(rank: int, world: int, port: int, sizes: list[int], timeout_s: float, iters: int,
                      out_path: str) -> None:
    import json
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=max(60.0, timeout_s)), **kwargs)
    try:
        result = _selftest_rank(sizes, timeout_s, iters)
        dist.barrier()
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last `--name V` / `--name=V` in argv (None: absent)."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(name + "="):
                value = arg[len(name) + 1:]
    return value


def _parent_argv() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:                      # not Linux, or the parent is gone
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def torchrun_stop_grace(env: Mapping[str, str] | None = None,
                        parent_argv: list[str] | None = None) -> tuple[int, str] | None:
    """Under torchrun (None otherwise): the seconds torchrun waits after passing a SIGTERM or
    Ctrl-C on to its workers before it SIGKILLs them, and where that number comes from.

    A graceful stop finishes the step in flight, then saves: a d20 step on a Spark alone takes
    ~30 s, torchrun's fixed wait until torch added `--shutdown-timeout` /
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT (pytorch/pytorch#172596; the installed torch is asked whether
    its LaunchConfig has the field). The worker's parent is torchrun itself, so its command line
    shows the flag; the environment variable is inherited."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig
    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return TORCHRUN_DEFAULT_GRACE_S, f"fixed in torch {torch.__version__}'s torchrun"
    argv = _parent_argv() if parent_argv is None else parent_argv
    flag = _flag_value(argv, ("--shutdown-timeout", "--shutdown_timeout"))
    for raw, source in ((flag, "torchrun --shutdown-timeout"),
                        (env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"), "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")):
        if raw is not None and raw.strip().isdigit():
            return int(raw), source
    return TORCHRUN_DEFAULT_GRACE_S, "torchrun's default"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local rendezvous (tests, spawned self-test)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_sizes(cuda: bool) -> list[int]:
    mib = 1 << 20
    return [mib, 16 * mib, 128 * mib, 512 * mib] if cuda else [64 << 10, mib, 4 * mib]


def run_selftest(*, nproc: int | None = None, sizes_bytes: list[int] | None = None,
                 timeout_s: float = 120.0, iters: int = 5) -> dict:
    """NCCL env checks + barrier + all-reduce bandwidth. Under torchrun: uses (or creates) the
    process group of the launch. Otherwise spawns `nproc` local processes (default: one per GPU,
    or 2 gloo processes on CPU). Returns the report (rank 0's view; other ranks get theirs)."""
    import tempfile

    import torch.multiprocessing as mp

    if "RANK" in os.environ and nproc is not None:   # it would test the launch's ranks without a word
        raise ValueError(f"--nccl-procs: got {nproc}; accepted: only without torchrun (under torchrun its "
                         "--nproc_per_node sets the processes)")
    cuda = torch.cuda.is_available()
    nccl_env_defaults()
    warnings = check_nccl_env()
    sizes = sizes_bytes or default_sizes(cuda)
    if "RANK" in os.environ:  # torchrun: every rank runs this function
        created = not dist.is_initialized()
        if created:
            # init_runtime's checks of the torchrun variables: a bare init_process_group hung for
            # RANK=1 WORLD_SIZE=1 and named no variable for a MASTER_PORT that is not a number
            from nanochat.common import _init_process_group, _torchrun_position
            _, rank, local, world = _torchrun_position()
            backend = "nccl" if cuda else "gloo"
            kwargs = {}
            if cuda:
                torch.cuda.set_device(local)
                kwargs["device_id"] = torch.device("cuda", local)
            _init_process_group(backend, rank, world, timeout=timedelta(seconds=max(60.0, timeout_s)), **kwargs)
        try:
            result = _selftest_rank(sizes, timeout_s, iters)
        finally:
            if created:
                dist.destroy_process_group()
        return {**result, "warnings": warnings, "launcher": "torchrun"}
    n = nproc if nproc is not None else (torch.cuda.device_count() if cuda else 2)
    if n < 1 or (cuda and n > torch.cuda.device_count()):
        raise ValueError(f"--nccl-procs: got {n}; accepted: 1..{torch.cuda.device_count() if cuda else 'any'}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "selftest.json")
        mp.spawn(_spawned_selftest, args=(n, free_port(), sizes, timeout_s, iters, out), nprocs=n, join=True)
        import json
        result = json.loads(Path(out).read_text())
    return {**result, "warnings": warnings, "launcher": "spawn"}


def selftest_main(nproc: int | None = None, *, as_json: bool = False) -> int:
    """`python -m nanochat.platform --nccl`: print the self-test (rank 0) and return an exit code."""
    import json
    import sys
    try:
        report = run_selftest(nproc=nproc)
    except (ValueError, BarrierTimeout) as e:  # bad NCCL env, missing rank: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if as_json:
        print(json.dumps(report))
        return 0
    print(f"backend {report['backend']}, world size {report['world_size']}, device {report['device']}, "
          f"launcher {report['launcher']}, barrier {report['barrier_s'] * 1e3:.1f} ms")
    for w in report["warnings"]:
        print(f"WARNING: {w}")
    print(format_bandwidth_table(report["allreduce"]))
    best = max(r["busbw_gbs"] for r in report["allreduce"])
    print(f"peak all-reduce busbw: {best:.2f} GB/s (busbw = algbw * 2(n-1)/n"
          + (", 0 with one rank: nothing crosses a link)" if report["world_size"] == 1 else ")"))
    return 0


# ------------------------------------------------------------------------------------ FSDP2

def _gather_full_state(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: DTensor shards -> full tensors (collective: all ranks call state_dict)."""
    from torch.distributed.tensor import DTensor
    for key, value in list(state_dict.items()):
        if isinstance(value, DTensor):
            state_dict[key] = value.full_tensor()


def apply_fsdp(model, rt, *, reshard_after_forward: bool = True):
    """Shard `model` (a GPT: `model.blocks` + root params) with FSDP2 over all ranks, in place.

    Each Block is its own FSDP unit (all-gathered just before its forward, resharded after when
    `reshard_after_forward`); the root unit holds embeddings, value embeddings, lm_head and
    scalars and stays unsharded between forward and backward. Gradients arrive reduce-scattered
    and averaged, so MuonAdamW must be built AFTER this call (it sees DTensor parameters and
    skips its own gradient reduction). Load weights before wrapping; `model.state_dict()` returns
    full tensors afterwards (a collective: call it on every rank)."""
    if not rt.ddp or not (dist.is_available() and dist.is_initialized()):
        raise ValueError("--fsdp: needs a process group; launch with torchrun (e.g. torchrun --nproc_per_node=2 "
                         "-m scripts.base_train --fsdp ...)")
    if not hasattr(model, "blocks"):
        raise ValueError(f"--fsdp: expected a GPT with .blocks, got {type(model).__name__}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model.register_state_dict_post_hook(_gather_full_state)
    return model


# ------------------------------------------------------------------------------------ data order

class StridedMicroBatches:
    """Rank `rank`'s share of one global stream of micro-batches: items rank, rank+W, rank+2W, ...
    of its first `limit` items (None: all).

    With every rank reading the same stream (e.g. a DataLoader built with world_size=1), W ranks
    at gradient accumulation k consume, per optimizer step, exactly the W*k micro-batches that one
    rank at accumulation W*k consumes: the same data order for any world size. Over a finite stream
    (an evaluation's pass) the ranks together get each of its items once, the last ones included:
    a stream that ended after this rank's item of a round still yields it (it was lost when the
    end came on a later rank's turn), and `limit` caps the global count, so the ranks score the
    same batches as one process that stops after `limit`."""

    def __init__(self, batches: Iterable, rank: int, world_size: int, limit: int | None = None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank/world_size: got {rank}/{world_size}; accepted: 0 <= rank < world_size")
        if limit is not None and limit < 0:
            raise ValueError(f"limit: got {limit}; accepted: None or >= 0 items")
        self.rank, self.world_size, self.limit = rank, world_size, limit
        self._it: Iterator = iter(batches)
        self._taken = 0   # items of the global stream read so far

    def __iter__(self):
        return self

    def __next__(self):
        mine, have = None, False
        for i in range(self.world_size):
            if self.limit is not None and self._taken >= self.limit:
                break
            try:
                item = next(self._it)
            except StopIteration:
                self.limit = self._taken   # ended: a later call does not read on
                break
            self._taken += 1
            if i == self.rank:
                mine, have = item, True
        if not have:
            raise StopIteration
        return mine
