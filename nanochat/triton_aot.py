"""Ahead-of-time compilation of the project's Triton kernels for GPUs that are not on this machine.

Owns: `TARGETS` (the Triton target and the per-block / per-SM limits of each GPU we check:
H100 sm_90, GB10 sm_121, B200 sm_100, RTX 5090 sm_120), `captured()` (records the launches that
host code makes instead of running them), `compile_launch()` (Triton's own binder and compiler
for another target, then the cubin's resource usage from the `cuobjdump` that ships with Triton),
and `check()` (every case of nanochat/triton_aot_cases.py for the asked targets).

Why: the GPU box runs one Triton (3.6) on one GPU kind (sm_90), while a fresh install gets the
newest Triton and the project is built first for GB10 (sm_121, 99 KB of shared memory per block,
48 SMs), where none of its kernels has ever run. A CPU can still run Triton's whole pipeline to
a cubin for any target: that proves a kernel compiles with the installed Triton for that GPU and
gives its shared memory, registers and spills, which decide whether it can launch there (Triton
raises OutOfResources above the per-block shared-memory limit; the persistent decode kernel
also needs every program resident at once). It proves nothing about speed or numerics: those
stay measurements on the real GPU.

Triton internals used (present in Triton 3.4-3.9): `JITFunction.signature/params/_pack_args`,
`create_function_from_signature`, `Autotuner.fn/configs/early_config_prune`, `ASTSource`,
`make_backend`, `compile`. `check()` raises `AotUnsupported` naming the missing piece if a
future Triton moves one, so a test fails loudly instead of skipping.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import triton


@dataclass(frozen=True)
class AotTarget:
    """A GPU as Triton's compiler and CUDA's launch limits see it (per-block shared memory is the
    opt-in maximum, cudaDevAttrMaxSharedMemoryPerBlockOptin)."""

    key: str                 # nanochat.platform DEVICE_TABLE key
    arch: int                # Triton's GPUTarget arch (90 -> sm_90a, 121 -> sm_121a)
    sms: int
    smem_per_block: int      # bytes
    smem_per_sm: int         # bytes
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048


# CUDA C Programming Guide, "Technical Specifications per Compute Capability" (9.0, 10.0, 12.x);
# GB10 (cc 12.1) as DESIGN.md section 4.2: 101,376 bytes per block, 48 SMs, 1536 threads per SM.
TARGETS: dict[str, AotTarget] = {t.key: t for t in (
    AotTarget("h100-sxm", 90, 132, 232_448, 233_472),
    AotTarget("gb10", 121, 48, 101_376, 102_400, threads_per_sm=1536),
    AotTarget("b200", 100, 148, 232_448, 233_472),
    AotTarget("rtx-5090", 120, 170, 101_376, 102_400, threads_per_sm=1536),
)}


class AotUnsupported(RuntimeError):
    """The installed Triton lacks a piece this module drives (named in the message)."""


def resolve_targets(spec: str) -> list[AotTarget]:
    """'h100-sxm,gb10' or 'all' -> targets; ValueError naming the accepted keys."""
    keys = list(TARGETS) if spec == "all" else [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in keys if k not in TARGETS]
    if bad or not keys:
        raise ValueError(f"--targets: got {spec!r}; accepted: all or a comma list of {', '.join(TARGETS)}")
    return [TARGETS[k] for k in keys]


def resolve_cases(spec: str) -> list[str] | None:
    """'mlp_gemm,decode_step' -> those names, 'all' -> None (every case); ValueError naming --cases."""
    from nanochat.triton_aot_cases import CASES

    if spec == "all":
        return None
    names = [c.strip() for c in spec.split(",") if c.strip()]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        raise ValueError(f"--cases: got {spec!r}; accepted: all or a comma list of {', '.join(CASES)}")
    return names


# --------------------------------------------------------------------------------------------
# Capturing launches

@dataclass
class Launch:
    """One kernel launch as host code made it: the JITFunction, its arguments, and the autotune
    config it would try (None for a plain launch; an autotuned launch becomes one Launch per
    config left after the kernel's own early pruning)."""

    case: str
    fn: Any
    args: tuple
    kwargs: dict
    config: Any = None

    @property
    def label(self) -> str:
        if self.config is None:
            return ""
        kw = self.config.all_kwargs()
        blocks = "x".join(str(v) for k, v in kw.items() if k.startswith("BLOCK"))
        return f"{blocks}/s{kw.get('num_stages')}/w{kw.get('num_warps')}"


@contextlib.contextmanager
def captured(case: str) -> Iterator[list[Launch]]:
    """Within the block, `kernel[grid](...)` and autotuned launches are recorded, not run (so
    host code can be driven with small CPU tensors: only dtypes, strides, integers and
    constexprs reach the compiler). Not thread-safe: it swaps the two run methods for the block."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []

    def jit_run(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(case, self, args, kwargs))

    def tuned_run(self, *args, **kwargs):
        launches.extend(expand_autotuned(case, self, args, kwargs))

    saved = JITFunction.run, Autotuner.run
    JITFunction.run, Autotuner.run = jit_run, tuned_run
    try:
        yield launches
    finally:
        JITFunction.run, Autotuner.run = saved


def expand_autotuned(case: str, tuner, args: tuple, kwargs: dict) -> list[Launch]:
    """One Launch per config of an Autotuner that its early prune keeps, with the config's
    pre-hook applied (it sets TMA descriptor block shapes) to a copy of the named arguments."""
    for attr in ("fn", "configs", "early_config_prune", "arg_names"):
        if not hasattr(tuner, attr):
            raise AotUnsupported(f"triton {triton.__version__}: Autotuner has no '{attr}'")
    kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}   # launch, not kernel, arguments
    named = dict(zip(tuner.arg_names, args)) | kwargs
    configs = tuner.configs
    if tuner.early_config_prune:
        configs = tuner.early_config_prune(configs, named, **kwargs)
    out = []
    for cfg in configs:
        call = _copy_descriptors(named) | cfg.all_kwargs()
        if cfg.pre_hook:
            cfg.pre_hook(call)
        out.append(Launch(case, tuner.fn, (), call, cfg))
    return out


def _copy_descriptors(named: dict) -> dict:
    """Pre-hooks mutate TMA descriptors' block shapes: give each config its own copies."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return {k: TensorDescriptor(v.base, list(v.shape), list(v.strides), list(v.block_shape))
            if isinstance(v, TensorDescriptor) else v for k, v in named.items()}


# --------------------------------------------------------------------------------------------
# Compiling for a target

@dataclass
class AotResult:
    case: str
    kernel: str
    config: str
    target: str
    ok: bool
    seconds: float
    shared: int | None = None       # bytes of dynamic shared memory Triton asks for
    registers: int | None = None    # per thread
    spill_bytes: int | None = None  # local memory per thread (spills and stack)
    error: str = ""
    notes: list[str] = field(default_factory=list)

    def fits(self, target: AotTarget, num_warps: int) -> bool:
        """Compiled, and one program fits an SM of `target` (shared memory, registers, threads)."""
        return self.ok and programs_per_sm(target, self.registers or 0, self.shared or 0, num_warps) >= 1


def programs_per_sm(target, registers: int, shared: int, num_warps: int) -> int:
    """How many programs of `num_warps` warps fit on one SM at once: registers are allocated per
    warp in 256-register units, and one block may use at most `smem_per_block` bytes.
    `target` needs regs_per_sm, threads_per_sm, smem_per_sm and smem_per_block (an AotTarget,
    or the same read from a real device by triton_decode)."""
    if shared > target.smem_per_block:
        return 0
    regs_per_warp = -(-registers * 32 // 256) * 256
    return min(target.regs_per_sm // max(1, regs_per_warp * num_warps),
               target.threads_per_sm // (32 * num_warps),
               target.smem_per_sm // max(1, shared))


AST_RACE = "AST constructor recursion depth mismatch"


def _causes(exc: BaseException):
    """exc and the exceptions it was raised from, outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ if exc.__cause__ is not None else (
            None if exc.__suppress_context__ else exc.__context__)


def _is_ast_race(exc: BaseException) -> bool:
    return any(isinstance(e, SystemError) and AST_RACE in str(e) for e in _causes(exc))


def _compile(triton_compile, src, gpu, options: dict, attempts: int = 3):
    """triton.compile, retried when CPython 3.11's AST constructor raises its spurious SystemError
    (python/cpython#106905; seen only when several threads parse at once, as check()'s compile
    threads do: one of ~1,100 CPU tests failed on it once, session 45). The race may surface
    bare or, when it hits a callee's parse, wrapped in Triton's CompilationError (its message
    then ends in the caret line alone: CI failed on that once, session 52). Other errors propagate."""
    for attempt in range(attempts):
        try:
            return triton_compile(src, target=gpu, options=options)
        except Exception as exc:  # noqa: BLE001 - only the race is retried; the rest re-raised
            if not _is_ast_race(exc) or attempt == attempts - 1:
                raise


def _describe(exc: BaseException) -> str:
    """'Type: last line' of each exception in the chain, caret lines left out, so a CompilationError
    wrapping a callee's failure (message: source excerpt and a caret) names the call and the real
    error."""
    parts = []
    for e in _causes(exc):
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and set(ln.strip()) != {"^"}]
        if lines:
            parts.append(f"{type(e).__name__}: {lines[-1][:300]}")
    return " <- ".join(parts) or type(exc).__name__


def compile_launch(launch: Launch, target: AotTarget) -> AotResult:
    """Bind the launch's arguments as Triton would for `target`, compile to a cubin, and read
    its resources. A compile error is a result (ok=False, error), not an exception."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile as triton_compile, make_backend
        from triton.runtime.jit import create_function_from_signature
    except ImportError as exc:
        raise AotUnsupported(f"triton {triton.__version__}: {exc}") from exc
    fn, name = launch.fn, launch.fn.__name__
    if not hasattr(fn, "_pack_args"):
        raise AotUnsupported(f"triton {triton.__version__}: JITFunction has no _pack_args")
    # fused multiply-adds on, as nanochat.platform's fp_fusion patch keeps them at run time
    kwargs = {"enable_fp_fusion": True, **launch.kwargs}
    t0 = time.perf_counter()
    gpu = GPUTarget("cuda", target.arch, 32)
    backend = make_backend(gpu)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    result = AotResult(launch.case, name, launch.label, target.key, ok=False, seconds=0.0)
    try:
        kernel = _compile(triton_compile, ASTSource(fn, signature, constexprs, attrs), gpu, options.__dict__)
    except Exception as exc:  # noqa: BLE001 - any compiler failure is the result being reported
        result.error = _describe(exc)
        result.seconds = time.perf_counter() - t0
        return result
    result.ok, result.shared = True, int(kernel.metadata.shared)
    result.registers, result.spill_bytes = cubin_resources(kernel.asm["cubin"], name)
    result.seconds = time.perf_counter() - t0
    return result


_RES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)")


def cubin_resources(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers per thread, local bytes per thread = stack + spills) of kernel `name` in a
    cubin, from `cuobjdump -res-usage` (Triton ships it beside its ptxas)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise AotUnsupported(f"triton {triton.__version__}: no bundled cuobjdump at {tool}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    for fname, regs, stack, local in _RES.findall(text):
        if fname == name:
            return int(regs), int(stack) + int(local)
    raise AotUnsupported(f"cuobjdump -res-usage printed no entry for {name}:\n{text[:500]}")


def num_warps_of(launch: Launch) -> int:
    return int(launch.kwargs.get("num_warps", 4))


def check(targets: list[AotTarget], cases: dict[str, Callable[[AotTarget], list[Launch]]] | None = None,
          only: list[str] | None = None, workers: int | None = None) -> list[tuple[Launch, AotResult]]:
    """Compile every launch of every case (nanochat/triton_aot_cases.CASES by default) for every
    target, in order. `only`: case names to keep (resolve_cases checks them). The compiles run on
    `workers` threads (default: one per CPU, at most 8): Triton's passes and ptxas release the GIL
    for most of a compile, so two threads on a 2-core CI machine take ~0.55x the time, with
    the same registers, shared memory and spills as one at a time."""
    if cases is None:
        from nanochat.triton_aot_cases import CASES as cases
    if only:
        cases = {k: v for k, v in cases.items() if k in resolve_cases(",".join(only))}
    launches = [(launch, target) for target in targets for make in cases.values() for launch in make(target)]
    if workers is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(8, cpus)
    if workers <= 1 or len(launches) <= 1:
        return [(launch, compile_launch(launch, target)) for launch, target in launches]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="triton-aot") as pool:
        return list(zip((launch for launch, _ in launches), pool.map(lambda lt: compile_launch(*lt), launches)))
