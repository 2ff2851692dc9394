"""Platform layer: the device table and every torch/triton workaround, applied in one place.

Owns:
- `detect_device()`: the DeviceSpec of this process's device. The table itself (`DeviceSpec`,
  `DEVICE_TABLE`, `spec_from_props`, `SimpleProps`) and `peak_flops()` (what the trainer uses for
  MFU: None = unknown, never 0) live in nanochat/device_table.py and are re-exported here.
  `check_benchmark_device()`: GPU-sized benchmarks refuse `--device auto` without CUDA.
- `configure_env_before_cuda()` and `apply_patches()`: each workaround is a small function that
  takes the spec and a `PatchContext` (env mapping, dynamo/inductor config objects, version
  probes) so tests can check on a CPU box exactly which patches a simulated device gets; each
  names the versions it targets, and applying them again reports the same names (the variables
  they set are listed in NANOCHAT_PLATFORM_ENV).
- `memory_budget_bytes()`: on unified memory the free memory comes from /proc/meminfo
  MemAvailable (cudaMemGetInfo counts the page cache as used there), bounded by a container's
  cgroup memory limit (nanochat/memory_limits.py); `patch_memory_cap` caps the allocator at it,
  so that a batch too big fails instead of hanging the host or being OOM-killed.
- `patch_cpu_amx()` (CPU bf16 on VMs that advertise AMX, run by init_runtime; in
  nanochat/cpu_patches.py) and `usable_sms()` (the SMs a process may hold, e.g. under CUDA MPS;
  in device_table.py).
- `prepare_te_import()` (Transformer Engine made to load torch's own cuDNN; in nanochat/te_cudnn.py,
  re-exported here with `torch_cudnn_dir()`).
- `python -m nanochat.platform`: a preflight report, built by nanochat/preflight.py.
The toolchain's version probes (Triton, the ptxas binaries and what an arch needs) live in
nanochat/toolchain.py and are re-exported here; the ptxas patch that acts on them stays here.

Nothing runs at import time: torch is imported, but no CUDA call happens until a function asks.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, MutableMapping

import torch

from nanochat.device_table import (CPU_SPEC, DEVICE_TABLE, MPS_SPEC, PRECISIONS,  # noqa: F401 (re-exported)
                                   DeviceSpec, SimpleProps, peak_flops, peak_key, peaks,
                                   spec_from_props, usable_sms)
from nanochat.cpu_patches import (AMX_FALLBACK_ISA, ONEDNN_ISA_ENV, _bf16_matmul_in_child, cpu_amx_applied,  # noqa: F401
                                  patch_cpu_amx)
from nanochat.errors import RequestError
from nanochat.te_cudnn import _CUDNN_LOAD_ORDER, prepare_te_import, torch_cudnn_dir  # noqa: F401 (re-exported)
from nanochat.memory_limits import (CGROUP_ROOT, MEMINFO, PROC_SELF_CGROUP, memory_budget_bytes,  # noqa: F401
                                    unified_memory_budget)
from nanochat.toolchain import (_bundled_ptxas_by_triton, _version_tuple, bundled_ptxas_version,  # noqa: F401
                                find_system_ptxas, ptxas_version, required_ptxas, triton_version)

log = logging.getLogger("nanochat.platform")


# --------------------------------------------------------------------------------------------
# Device detection (the table itself: nanochat/device_table.py)

def detect_device(device: torch.device | str | None = None, props: Any = None) -> DeviceSpec:
    """The DeviceSpec of `device` (default: cuda if available, else mps, else cpu).

    `props` simulates `torch.cuda.get_device_properties` (name, major, minor,
    multi_processor_count, total_memory) so tests can pretend to be a GB10 on a CPU box."""
    if props is not None:
        return spec_from_props(props)
    if device is None:
        if torch.cuda.is_available():
            device = "cuda"
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            device = "mps"
        else:
            device = "cpu"
    dev = torch.device(device)
    if dev.type in ("cpu", "mps"):
        return CPU_SPEC if dev.type == "cpu" else MPS_SPEC
    if dev.type != "cuda":
        raise RequestError(f"--device: got {dev.type!r}; accepted: cuda|cpu|mps")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return spec_from_props(torch.cuda.get_device_properties(index))


def check_benchmark_device(device: str, smoke_run: str) -> None:
    """For the benchmarks whose defaults are sized for a GPU (d20, 2048-token rows): `--device auto`
    on a machine with no CUDA GPU raises a RequestError saying so, instead of falling back to the CPU
    and grinding through the GPU-sized defaults for many minutes without a word. An explicit
    `--device cpu` (or mps) is a smoke run the user asked for and passes; `smoke_run` is the
    script's documented small CPU command, quoted in the message."""
    if device == "auto" and not torch.cuda.is_available():
        raise RequestError("--device auto: no CUDA GPU is visible, and this benchmark's defaults are sized "
                           f"for one; for a CPU smoke run pass --device cpu with small sizes: {smoke_run}")


# --------------------------------------------------------------------------------------------
# Patches

@dataclass
class PatchContext:
    """Everything a patch reads or writes, injectable for tests. `None` fields are filled from
    the real process (os.environ, torch._dynamo.config, ...) by `PatchContext.real()`."""

    env: MutableMapping[str, str]
    dynamo_config: Any = None
    inductor_config: Any = None
    inductor_modules: list[Any] = field(default_factory=list)   # modules holding is_big_gpu
    triton_version: str | None = None          # None = triton not importable
    bundled_ptxas_version: tuple[int, int] | None = None   # what triton would use for this arch
    ptxas_candidates: list[tuple[str, tuple[int, int]]] = field(default_factory=list)
    cuda_initialized: bool = False
    set_allocator_settings: Callable[[str], None] | None = None
    filter_warning: Callable[..., None] | None = None   # warnings.filterwarnings in real runs
    torch_version: str = torch.__version__     # what version-gated patches read
    # `ptxas --version` of a user's TRITON_PTXAS*_PATH (None = not checked, as in tests' contexts)
    ptxas_version_of: Callable[[str], tuple[int, int] | None] | None = None
    # unified memory's allocator cap (patch_memory_cap): None = not capped, as in tests' contexts
    set_memory_fraction: Callable[[float], None] | None = None
    total_memory: Callable[[], int] | None = None
    meminfo: str | None = None                 # /proc/meminfo's text (None: read MEMINFO)
    cgroup_root: str | None = None             # its memory limit's cgroup fs (None: none read, as in tests)
    self_cgroup: str = PROC_SELF_CGROUP

    @classmethod
    def real(cls, spec: DeviceSpec) -> "PatchContext":
        import warnings
        ctx = cls(env=os.environ, filter_warning=warnings.filterwarnings, cgroup_root=CGROUP_ROOT)
        if spec.is_cuda:
            # only GPU patches touch these, and importing torch._dynamo costs ~6 s of CPU (torch
            # 2.15): every CPU run (the tests' subprocesses, tiny runs) would pay it for nothing
            import torch._dynamo.config as dynamo_config
            ctx.dynamo_config = dynamo_config
            import torch._inductor.config as inductor_config
            import torch._inductor.utils as inductor_utils
            ctx.inductor_config = inductor_config
            ctx.inductor_modules = [inductor_utils]
            ctx.cuda_initialized = torch.cuda.is_initialized()
            ctx.set_allocator_settings = getattr(torch.cuda.memory, "_set_allocator_settings", None)
            if spec.unified_memory:   # called by the patch, after CUDA is up (init_runtime)
                ctx.set_memory_fraction = torch.cuda.set_per_process_memory_fraction
                ctx.total_memory = lambda: torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        ctx.triton_version = triton_version()
        if spec.cc is not None and ctx.triton_version is not None:
            ctx.bundled_ptxas_version = bundled_ptxas_version(spec.cc)
            ctx.ptxas_candidates = find_system_ptxas()
            ctx.ptxas_version_of = ptxas_version
        return ctx


_LOGGED: set[str] = set()

# The environment variables the patches below set, recorded in the environment itself (so torchrun
# workers inherit the record): a patch applied again, in this process or a child, finds its own
# setting and reports it under the same name, where a user's own setting is left alone and named so.
PATCHED_ENV = "NANOCHAT_PLATFORM_ENV"


def _set_env(env: MutableMapping[str, str], name: str, value: str) -> None:
    """env[name] = value, recorded as ours with a checksum of the value: a child process whose
    launcher set its own value of that variable then finds a value that is not ours, and keeps it."""
    env[name] = value
    ours = {e.split("=")[0]: e for e in env.get(PATCHED_ENV, "").split(",") if e}
    ours[name] = f"{name}={zlib.crc32(value.encode()):08x}"
    env[PATCHED_ENV] = ",".join(sorted(ours.values()))


def _set_by_us(env: MutableMapping[str, str], name: str) -> bool:
    if name not in env:
        return False
    for entry in env.get(PATCHED_ENV, "").split(","):
        n, _, crc = entry.partition("=")
        if n == name:   # a bare name: the record of an earlier release, which kept no checksum
            return not crc or crc == f"{zlib.crc32(env[name].encode()):08x}"
    return False


def _log_once(name: str, message: str) -> None:
    if name not in _LOGGED:
        _LOGGED.add(name)
        log.warning("[platform] %s: %s", name, message)


def patch_ptxas(spec: DeviceSpec, ctx: PatchContext, uses_triton: bool) -> str | None:
    """Triton <= 3.5 bundles a ptxas that rejects sm_121a (DESIGN s4.1): point TRITON_PTXAS_PATH
    (and TRITON_PTXAS_BLACKWELL_PATH, the name newer Triton reads) at a CUDA 13 ptxas. Targets
    Triton 3.x whose bundled ptxas (probed, or by release: `_bundled_ptxas_by_triton`) is older than
    the arch needs (`required_ptxas`); on a GB10 Triton 3.6+ (a 12.9+ Blackwell ptxas) gets nothing.
    A user's value of either variable is kept, and carried to the other name when that one is unset
    (or holds only our earlier copy)."""
    if not spec.is_cuda or ctx.triton_version is None or not uses_triton:
        return None
    need = required_ptxas(spec.cc)
    bundled = ctx.bundled_ptxas_version
    # not probed (no bundled binary found): what that Triton release ships, by its version
    expected = bundled or _bundled_ptxas_by_triton(ctx.triton_version)
    if expected >= need:
        return None
    said = (f"{bundled[0]}.{bundled[1]}" if bundled
            else f"not probed; Triton {ctx.triton_version} ships <= {expected[0]}.{expected[1]}")
    user = {n: ctx.env[n] for n in PTXAS_ENV if ctx.env.get(n) and not _set_by_us(ctx.env, n)}
    if user:   # the user's choice, either name (Triton >= 3.6 reads the Blackwell one for sm_100+)
        _check_user_ptxas(spec, ctx, user, need, said)
        # Triton reads only one of the two names for a given arch (3.6-3.8: the Blackwell one from
        # sm_100 on, older releases: TRITON_PTXAS_PATH for every arch), so a user who set only the
        # other one (DESIGN s4.1 says TRITON_PTXAS_PATH) still got the bundled ptxas on sm_121:
        # carry their path to the unset name, never over a value of its own.
        for name in PTXAS_ENV:
            if not ctx.env.get(name) or _set_by_us(ctx.env, name):
                _set_env(ctx.env, name, next(iter(user.values())))
        _log_once("ptxas", f"Triton {ctx.triton_version} bundled ptxas ({said}) too old for sm_{spec.cc[0]}{spec.cc[1]}; "
                           "using " + ", ".join(f"{n}={v}" for n, v in user.items()) + " as set"
                           + ("" if len(user) == len(PTXAS_ENV) else " (for both TRITON_PTXAS*_PATH names)"))
        return "ptxas(user)"
    if all(_set_by_us(ctx.env, n) for n in PTXAS_ENV):   # this patch, applied before
        return "ptxas"
    usable = [(p, v) for p, v in ctx.ptxas_candidates if v >= max(need, (13, 0))]
    if not usable:
        raise PtxasMissing(
            f"Triton {ctx.triton_version}'s bundled ptxas ({said}) cannot target "
            f"sm_{spec.cc[0]}{spec.cc[1]} and no CUDA >= 13.0 ptxas was found. Install the CUDA 13 "
            "toolkit (or pip install 'triton>=3.6') and/or set TRITON_PTXAS_PATH=/path/to/ptxas; "
            "or run base_train / mid_train / chat_sft with --kernel current --no-compile.")
    path = usable[0][0]
    _set_env(ctx.env, "TRITON_PTXAS_PATH", path)
    _set_env(ctx.env, "TRITON_PTXAS_BLACKWELL_PATH", path)
    _log_once("ptxas", f"Triton {ctx.triton_version} bundled ptxas ({said}) < {need[0]}.{need[1]} needed by "
                       f"sm_{spec.cc[0]}{spec.cc[1]}: TRITON_PTXAS_PATH={path} (CUDA {usable[0][1][0]}.{usable[0][1][1]})")
    return "ptxas"


PTXAS_ENV = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")
TRITON_MIN_CC = (7, 0)   # Triton's NVIDIA floor: inductor (torch 2.9-2.15) raises GPUTooOldForTriton below


def ptxas_problem(spec: DeviceSpec, env: Mapping[str, str] | None = None) -> str | None:
    """Why a run launching Triton kernels on `spec` (compiled model, --kernel liger|triton, native
    fp8's casts) would stop, or None: no Triton, a GPU below cc 7.0, or patch_ptxas's PtxasMissing (a
    dry run on a copy of the environment). Asked with the recipes' early checks: a CUDA box without
    Triton died at the first compiled step, after data and model. CPU/MPS: None (Triton optional)."""
    if not spec.is_cuda:
        return None
    where = f"this {spec.name} (cc {spec.cc[0]}.{spec.cc[1]})"
    if spec.cc < TRITON_MIN_CC:
        return (f"Triton builds kernels for compute capability >= {TRITON_MIN_CC[0]}.{TRITON_MIN_CC[1]} only, and "
                f"{where} is older; run with --kernel current --no-compile (eager PyTorch).")
    version = triton_version()
    if version is None:
        return (f"Triton is not installed, and on {where} torch.compile's kernels and the project's own are "
                "Triton's: pip install triton (the release this torch was built with), or run with "
                "--kernel current --no-compile (eager PyTorch).")
    ctx = PatchContext(env=dict(os.environ if env is None else env), triton_version=version,
                       bundled_ptxas_version=bundled_ptxas_version(spec.cc))
    if (ctx.bundled_ptxas_version or _bundled_ptxas_by_triton(version)) < required_ptxas(spec.cc):
        ctx.ptxas_candidates, ctx.ptxas_version_of = find_system_ptxas(), ptxas_version
    try:
        patch_ptxas(spec, ctx, uses_triton=True)
    except PtxasMissing as exc:
        return str(exc)
    return None


def _check_user_ptxas(spec: DeviceSpec, ctx: PatchContext, user: Mapping[str, str],
                      need: tuple[int, int], said: str) -> None:
    """A user's TRITON_PTXAS*_PATH is kept, but one that does not run (Triton skips it) or is too old
    met the sm_121a error after a log line said it was used: PtxasMissing naming the variable (a
    warning in apply_runtime_patches). Only the name this Triton reads is checked (3.6+: the
    Blackwell one from sm_100 on); a ptxas that runs but prints no version is a warning."""
    if ctx.ptxas_version_of is None:
        return
    # 3.6 added ptxas-blackwell and its variable: 3.5 reads TRITON_PTXAS_PATH for every arch
    blackwell = _version_tuple(ctx.triton_version or "0")[:2] >= (3, 6) and spec.cc[0] >= 10
    name = PTXAS_ENV[1] if blackwell else PTXAS_ENV[0]
    name = name if name in user else next(iter(user))   # the other one is carried to it
    path, want = user[name], need   # 12.8 serves sm_120: the auto-search's 13.0 floor is for sm_121
    version = ctx.ptxas_version_of(path)
    if version is None and os.path.isfile(path) and os.access(path, os.X_OK):
        _log_once("ptxas_version", f"{name}={path}: its version query names no CUDA release; used as set")
        return
    if version is not None and version >= want:
        return
    problem = ("does not run (no such file, or not executable)" if version is None else
               f"is CUDA {version[0]}.{version[1]}'s ptxas, older than the {want[0]}.{want[1]} it needs")
    raise PtxasMissing(f"{name}={path} {problem}; sm_{spec.cc[0]}{spec.cc[1]} cannot use Triton "
                       f"{ctx.triton_version}'s bundled ptxas ({said}) either. Point {name} at a CUDA "
                       f">= {want[0]}.{want[1]} ptxas (or unset it to let nanochat look for one), or pip install "
                       "'triton>=3.6'.")


class PtxasMissing(RequestError, RuntimeError):
    """No ptxas can target this GPU for a run that uses Triton: a request this machine cannot meet
    (scripts print it as one line), and a RuntimeError for callers that catch those."""


def patch_is_big_gpu(spec: DeviceSpec, ctx: PatchContext, compile: bool, max_autotune: bool) -> str | None:
    """Inductor's is_big_gpu() wants >= 68 SMs; GB10 has 48, so max-autotune GEMM templates are
    skipped (DESIGN s4.2). Override it (and turn on max_autotune_gemm when asked). Targets torch
    2.9-2.15 (`torch._inductor.utils.is_big_gpu`, min_sms = 68 as read in torch 2.15, called from
    that module's own globals, so replacing the module attribute takes effect). Outside those
    releases it is skipped, and said: a torch whose inductor calls it from elsewhere would ignore
    the replacement while the log claimed it applied."""
    if not spec.is_cuda or not compile or spec.sms is None or spec.sms >= 68:
        return None
    low, high = IS_BIG_GPU_TORCH
    if not low <= _version_tuple(ctx.torch_version)[:2] <= high:
        _log_once("is_big_gpu", f"{spec.sms} SMs < 68 and torch {ctx.torch_version} is outside the releases "
                                f"this patch was checked against ({low[0]}.{low[1]}-{high[0]}.{high[1]}): inductor's "
                                "is_big_gpu() left alone, so max-autotune GEMM templates are skipped")
        return None
    for module in ctx.inductor_modules:
        if hasattr(module, "is_big_gpu"):
            module.is_big_gpu = _always_big_gpu
    if max_autotune and ctx.inductor_config is not None:
        ctx.inductor_config.max_autotune_gemm = True
    _log_once("is_big_gpu", f"{spec.sms} SMs < 68: inductor is_big_gpu() -> True" + (" and max_autotune_gemm on" if
                            max_autotune else " (takes effect with max-autotune GEMM)") + f"; targets torch "
                            f"{low[0]}.{low[1]}-{high[0]}.{high[1]} (this is {ctx.torch_version})")
    return "is_big_gpu"


IS_BIG_GPU_TORCH = ((2, 9), (2, 15))   # the torch releases whose inductor source patch_is_big_gpu was read in


def _always_big_gpu(index_or_device=0) -> bool:
    return True


def alloc_conf_with_expandable(env: MutableMapping[str, str]) -> str | None:
    """New PYTORCH_ALLOC_CONF value with expandable_segments:True, None if already decided."""
    current = env.get("PYTORCH_ALLOC_CONF") or env.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    # the option's own key, not a substring: torch 2.15's expandable_segments_handle_type and
    # expandable_segments_reserve say nothing about whether expandable segments are on
    if "expandable_segments" in (part.split(":")[0].strip() for part in current.split(",")):
        return None
    return ",".join(p for p in (current, "expandable_segments:True") if p)


def patch_expandable_segments(spec: DeviceSpec, ctx: PatchContext) -> str | None:
    """Unified memory (GB10): expandable segments avoid fragmentation that otherwise eats the
    shared system RAM (DESIGN s4.3). Env before CUDA init; the allocator setter after. Targets
    torch >= 2.9 (PYTORCH_ALLOC_CONF, which replaced PYTORCH_CUDA_ALLOC_CONF; both are read)."""
    if not (spec.is_cuda and spec.unified_memory):
        return None
    value = alloc_conf_with_expandable(ctx.env)
    if value is None:   # decided already: by this patch (e.g. configure_env_before_cuda) or the user
        return "expandable_segments" if _set_by_us(ctx.env, "PYTORCH_ALLOC_CONF") else None
    _set_env(ctx.env, "PYTORCH_ALLOC_CONF", value)
    if ctx.cuda_initialized and ctx.set_allocator_settings is not None:
        ctx.set_allocator_settings("expandable_segments:True")
    _log_once("expandable_segments", f"unified memory: PYTORCH_ALLOC_CONF={value} (targets torch >= 2.9, which reads it)")
    return "expandable_segments"


MEMORY_CAP_ENV = "NANOCHAT_GPU_MEMORY_CAP"
_MEMORY_CAP: list[int] = []   # the cap this process set, in bytes (once: MemAvailable then includes no run)


def patch_memory_cap(spec: DeviceSpec, ctx: PatchContext) -> str | None:
    """Unified memory (GB10): the caching allocator can grow into all of the host's RAM, and memory
    pressure there can hang the whole machine instead of failing (DESIGN s4.3). Capped once per
    process, at MemAvailable (or what a cgroup's memory limit leaves, if less) at its start less
    10% (unified_memory_budget), by
    torch.cuda.set_per_process_memory_fraction (torch >= 2.9; applies with expandable segments):
    a batch too big then raises torch's OutOfMemoryError, which training turns into a
    --device-batch-size hint. NANOCHAT_GPU_MEMORY_CAP: a size in GB instead, or off."""
    if not (spec.is_cuda and spec.unified_memory) or ctx.set_memory_fraction is None or ctx.total_memory is None:
        return None
    if _MEMORY_CAP:
        return "memory_cap"
    value = ctx.env.get(MEMORY_CAP_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        try:
            cap = float(value) * 1e9
        except ValueError:
            cap = float("nan")
        if not 0 < cap < float("inf"):
            raise RequestError(f"{MEMORY_CAP_ENV}={value!r}: accepted: a size in GB (> 0, e.g. 100) or off")
        why = f"{MEMORY_CAP_ENV}={value}"
    else:
        try:
            cap, source = unified_memory_budget(meminfo=ctx.meminfo, cgroup_root=ctx.cgroup_root,
                                                self_cgroup=ctx.self_cgroup)
        except RuntimeError as exc:   # no MemAvailable to go by: say so, run uncapped
            _log_once("memory_cap", f"unified memory: the allocator is not capped ({exc})")
            return None
        why = f"{source} at start less 10%; {MEMORY_CAP_ENV}=<GB>|off overrides"
    total = ctx.total_memory()
    ctx.set_memory_fraction(min(1.0, cap / total))
    _MEMORY_CAP.append(int(min(cap, total)))
    _log_once("memory_cap", f"unified memory: PyTorch's allocator capped at {min(cap, total) / 1e9:.1f} GB of "
                            f"{total / 1e9:.1f} ({why}; targets torch >= 2.9): a batch too big raises out-of-memory "
                            "instead of pushing the host into swap or a hang")
    return "memory_cap"


def memory_cap_bytes() -> int | None:
    """The cap patch_memory_cap set in this process (None: none), for out-of-memory hints."""
    return _MEMORY_CAP[0] if _MEMORY_CAP else None


def patch_capture_scalar_outputs(spec: DeviceSpec, ctx: PatchContext, kernel: str, compile: bool) -> str | None:
    """Liger's fused CE calls .item() in forward: without this dynamo breaks the graph there.
    Targets liger-kernel >= 0.6 (LigerFusedLinearCrossEntropyLoss) under torch >= 2.9's dynamo."""
    if not spec.is_cuda or kernel != "liger" or not compile or ctx.dynamo_config is None:
        return None
    ctx.dynamo_config.capture_scalar_outputs = True
    _log_once("capture_scalar_outputs", "--kernel liger: torch._dynamo.config.capture_scalar_outputs=True (targets "
                                        "liger-kernel >= 0.6 under torch >= 2.9)")
    return "capture_scalar_outputs"


# torch 2.9-2.10's warning on a GB10 with a wheel built up to sm_120 ("\n    Found GPU0 NVIDIA GB10
# which is of cuda capability 12.1.\n    Minimum and Maximum cuda capability supported by this version
# of PyTorch is\n    (8.0) - (12.0)\n"). A warnings filter is re.match'ed from the message's first
# character, here a newline, hence the leading \s*; only a maximum of 12.0 is silenced (a build
# without sm_12x code is really unsupported, and torch's "is not compatible" warning stays too).
SM121_WARNING = (r"\s*Found GPU\d+ .* which is of cuda capability 12\.1\.\s+Minimum and Maximum cuda "
                 r"capability supported by this version of PyTorch is\s+\(\d+\.\d+\) - \(12\.0\)")


def patch_sm121_warning(spec: DeviceSpec, ctx: PatchContext) -> str | None:
    """Wheels built up to sm_120 warn 'Minimum and Maximum cuda capability ... (12.0)' on 12.1;
    binary compatible within the major, so the warning is a false positive (DESIGN s4.4).
    Targets torch 2.9-2.10 (torch 2.11's cuda/__init__.py, read on the GPU box, has no such text;
    2.15's check counts sm_120 code as runnable on 12.1). torch warns when CUDA initialises, so
    configure_env_before_cuda installs the filter too."""
    if spec.cc != (12, 1) or _version_tuple(ctx.torch_version) >= (2, 11):
        return None
    if ctx.filter_warning is not None:
        ctx.filter_warning("ignore", message=SM121_WARNING, category=UserWarning)
    _log_once("sm121_warning", f"cc 12.1: torch {ctx.torch_version}'s false-positive 'Minimum and Maximum cuda "
                               "capability ... (12.0)' warning filtered (targets torch 2.9-2.10)")
    return "sm121_warning"


def patch_triton_fp_fusion(spec: DeviceSpec, ctx: PatchContext, uses_triton: bool) -> str | None:
    """Triton 3.9 warns that 3.10 turns multiply-add fusion off by default; our kernels were tested
    (bit-equality tests included) with it on: pin TRITON_DEFAULT_FP_FUSION=1 unless the user set it."""
    if (not spec.is_cuda or not uses_triton or ctx.triton_version is None
            or _version_tuple(ctx.triton_version) < (3, 9)):
        return None
    if "TRITON_DEFAULT_FP_FUSION" in ctx.env:   # this patch, applied before, or the user's choice
        return "fp_fusion" if _set_by_us(ctx.env, "TRITON_DEFAULT_FP_FUSION") else None
    _set_env(ctx.env, "TRITON_DEFAULT_FP_FUSION", "1")
    _log_once("fp_fusion", f"Triton {ctx.triton_version}: TRITON_DEFAULT_FP_FUSION=1 (as tested; targets Triton >= 3.9)")
    return "fp_fusion"


KERNELS = ("current", "liger", "triton")


def apply_patches(spec: DeviceSpec, *, kernel: str = "current", compile: bool = True,
                  max_autotune: bool = False, ctx: PatchContext | None = None,
                  ptxas_missing_ok: bool = False) -> list[str]:
    """Apply the workarounds `spec` needs and return their names (each logged once).
    Tests pass a fake `ctx`; the default touches the real process. `ptxas_missing_ok`: no usable
    ptxas is a logged warning and the other patches still apply (else PtxasMissing)."""
    if kernel not in KERNELS:
        raise RequestError(f"--kernel: got {kernel!r}; accepted: {'|'.join(KERNELS)}")
    ctx = ctx or PatchContext.real(spec)
    uses_triton = compile or kernel in ("liger", "triton")
    segments = patch_expandable_segments(spec, ctx)
    try:
        ptxas = patch_ptxas(spec, ctx, uses_triton)
    except PtxasMissing as e:
        if not ptxas_missing_ok:
            raise
        _log_once("ptxas", str(e))
        ptxas = None
    applied = [
        segments,
        ptxas,
        patch_is_big_gpu(spec, ctx, compile, max_autotune),
        patch_capture_scalar_outputs(spec, ctx, kernel, compile),
        patch_sm121_warning(spec, ctx),
        patch_triton_fp_fusion(spec, ctx, uses_triton),
        patch_memory_cap(spec, ctx),
        "cpu_amx" if cpu_amx_applied(ctx.env) else None,   # init_runtime applies it (before any matmul)
    ]
    return [name for name in applied if name]


def apply_runtime_patches(spec: DeviceSpec, ctx: PatchContext | None = None) -> list[str]:
    """The workarounds every CUDA process needs, whatever it runs (init_runtime calls this): chat,
    evaluation and the benchmarks launch Triton kernels (decode, sampler, compiled steps) without
    going through training's apply_patches, and on a Spark with Triton <= 3.5 the first one would
    fail in ptxas. Training applies its own set later (the same state: the patches are idempotent).
    A ptxas that cannot be found is a warning here, not an error: a process that launches no Triton
    kernel still runs, and one that does fails with this line already said."""
    return apply_patches(spec, kernel="current", compile=True, ctx=ctx, ptxas_missing_ok=True)


def configure_env_before_cuda(spec_hint: DeviceSpec | str | None = None,
                              env: MutableMapping[str, str] | None = None,
                              filter_warning: Callable[..., None] | None = None,
                              torch_version: str = torch.__version__) -> list[str]:
    """What must be in place before CUDA initialises (call from init_runtime first): allocator
    environment, and the filter for torch's warning at initialisation. `spec_hint`: a DeviceSpec,
    a table key ("gb10") or None = ask nvidia-smi (no CUDA context); `filter_warning`: default
    warnings.filterwarnings (tests pass a recorder); `torch_version`: tests simulate others."""
    env = os.environ if env is None else env
    spec = spec_hint
    if isinstance(spec_hint, str):
        if spec_hint not in DEVICE_TABLE:
            raise ValueError(f"spec_hint: got {spec_hint!r}; accepted: {'|'.join(DEVICE_TABLE)}")
        spec = DEVICE_TABLE[spec_hint]
    elif spec_hint is None:
        spec = _spec_from_nvidia_smi()
    if spec is None:
        return []
    if filter_warning is None:
        import warnings
        filter_warning = warnings.filterwarnings
    ctx = PatchContext(env=env, filter_warning=filter_warning, torch_version=torch_version)
    return [n for n in [patch_expandable_segments(spec, ctx), patch_sm121_warning(spec, ctx)] if n]


def _first_visible_gpu(env: Mapping[str, str]) -> str | None:
    """nvidia-smi's -i (GPU id) for the one CUDA will call device 0: the first entry of
    CUDA_VISIBLE_DEVICES (an index or a GPU-/MIG- UUID), "0" when unset, None when it hides every
    GPU ("", "-1", or a first entry that names no device)."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return "0"
    first = value.split(",")[0].strip()
    if re.fullmatch(r"[0-9]+|(GPU|MIG)-[0-9A-Za-z/-]+", first):
        return first
    return None   # CUDA stops at the first invalid entry: nothing before it is visible


def _spec_from_nvidia_smi(env: Mapping[str, str] | None = None) -> DeviceSpec | None:
    """Identify the process's device 0 (CUDA_VISIBLE_DEVICES' first GPU) without creating a
    CUDA context (so allocator env still takes effect)."""
    gpu = _first_visible_gpu(os.environ if env is None else env)
    smi = shutil.which("nvidia-smi")
    if smi is None or gpu is None:
        return None
    try:
        out = subprocess.run([smi, "-i", gpu, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    line = out.strip().splitlines()[0] if out.strip() else ""
    m = re.match(r"(.+?),\s*(\d+)\.(\d+)", line)
    if not m:
        return None
    return spec_from_props(SimpleProps(m.group(1).strip(), int(m.group(2)), int(m.group(3)), 0, 0))


def main(argv: list[str] | None = None) -> int:
    """`python -m nanochat.platform`: the preflight report (nanochat/preflight.py)."""
    from nanochat.preflight import main as preflight_main
    return preflight_main(argv)


if __name__ == "__main__":
    from nanochat.flags import script_main
    from nanochat.preflight import parse_args

    script_main("preflight", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
