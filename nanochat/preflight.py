"""Preflight report (`python -m nanochat.platform`, or `python -m nanochat.preflight`): device,
compute capability, torch/triton/cuDNN/TE/Liger versions, arch list, the ptxas Triton uses, the
patches that apply, attention backends proven by a real launch, the resolved precision recipe,
and with `--nccl` the NCCL environment checks and an all-reduce bus-bandwidth self-test.

Split out of platform.py (which owns the device table and the workarounds this reports on).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any

import torch

from nanochat.errors import RequestError
from nanochat.platform import (KERNELS, DeviceSpec, apply_patches, bundled_ptxas_version, configure_env_before_cuda,
                               detect_device, memory_budget_bytes, patch_cpu_amx, ptxas_problem, spec_from_props)

UNAVAILABLE = "unavailable: "   # a report value that starts with it: what a run with these flags would hit


def _te_version() -> str:
    from nanochat.platform import prepare_te_import
    prepare_te_import()   # before TE loads a cuDNN of its own choosing (platform.py says why)
    return _module_version("transformer_engine")


def _module_version(name: str, dist: str | None = None) -> str:
    try:
        module = __import__(name)
    except ImportError:
        return "not installed"
    except Exception as exc:  # a broken install (e.g. TE built for another torch) is reportable
        return f"broken ({type(exc).__name__}: {exc})"[:120]
    from importlib import metadata
    try:
        return metadata.version(dist or name.replace("_", "-"))
    except metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "?"))


def probe_attention_backends(device: str = "cuda") -> dict[str, str]:
    """A real tiny forward+backward launch per backend: 'ok' or the error (DESIGN s4.6)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    results = {}
    q, k, v = (torch.randn(1, 2, 256, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    for label, backend in [("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                           ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
            torch.cuda.synchronize()
            results[label] = "ok"
        except RuntimeError as exc:
            results[label] = f"fails: {str(exc).splitlines()[0][:100]}"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 256, 256, device=device)
        torch.compile(flex_attention)(q, k, v, block_mask=mask).sum().backward()
        torch.cuda.synchronize()
        results["flex_attention"] = "ok"
    except Exception as exc:  # report any failure mode of compile + launch, this is a report
        results["flex_attention"] = f"fails: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
    from nanochat.cudnn_attention import probe

    reason = probe(torch.device(device))  # window kernel, checked against the reference math
    results["cudnn-window"] = "ok" if reason is None else f"fails: {reason[:160]}"
    from nanochat import fa4_attention

    reason = fa4_attention.probe(torch.device(device))  # cuDNN fwd + FA4 bwd (says so if not installed)
    results["cudnn-fa4"] = "ok" if reason is None else f"fails: {reason[:160]}"
    return results


def triton_ptxas_in_use(spec: DeviceSpec) -> str:
    """The ptxas Triton would run for this GPU's arch, as Triton itself picks it (`get_ptxas`:
    which of its two bundled binaries, e.g. Triton 3.9 takes `ptxas-blackwell` from sm_90 on and
    3.6-3.7 from sm_100, or the TRITON_PTXAS*_PATH variable that overrides it); older Triton
    releases without that function (<= 3.5, one bundled ptxas): TRITON_PTXAS_PATH, the only
    variable they read, else the bundled binary."""
    if spec.cc is None:
        return "n/a"
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        tool = get_ptxas(spec.cc[0] * 10 + spec.cc[1])
        return f"{tool.path} (CUDA {tool.version})"
    except (ImportError, AttributeError, TypeError, RuntimeError):
        pass
    if os.environ.get("TRITON_PTXAS_PATH"):   # TRITON_PTXAS_BLACKWELL_PATH came with get_ptxas (3.6)
        return f"{os.environ['TRITON_PTXAS_PATH']} (from TRITON_PTXAS_PATH)"
    version = bundled_ptxas_version(spec.cc)
    return f"bundled with triton (CUDA {version[0]}.{version[1]})" if version else "n/a"


def te_recipe_as_built(precision: str, spec: DeviceSpec, compile: bool) -> dict[str, Any]:
    """The Transformer Engine recipe a run builds (precision_te.build_te_recipe: the installed TE's
    real fields, read back): on sm_12x nvfp4 that is RHT and stochastic rounding off and the bf16
    backward (DESIGN s4.7), which the report showed only as 'NVFP4BlockScaling'."""
    import transformer_engine.common.recipe as te_recipe
    from nanochat.precision_te import build_te_recipe
    return build_te_recipe(precision, spec, te_recipe, compile=compile)[1]


_ARCH = re.compile(r"(sm|compute)_(\d+)(\d)([af]?)")


def arch_support(cc: tuple[int, int], arch_list: list[str]) -> str:
    """Whether this torch build has code the GPU runs (DESIGN s4.4): SASS for its own cc, or for an
    older minor of its major (sm_120 runs on a GB10's 12.1; arch-specific `a` code runs only on its
    own cc), else PTX of an older cc that the driver compiles at first use. Said, not refused:
    torch warns too, and the env stage proves the GPU with a kernel launch."""
    sass, ptx = [], []
    for arch in arch_list:
        m = _ARCH.fullmatch(arch)
        if m is None:
            continue
        kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "sm" and major == cc[0] and (minor == cc[1] or (minor < cc[1] and suffix != "a")):
            sass.append((minor, arch))
        elif kind == "compute" and (major, minor) <= cc:
            ptx.append(arch)
    here = f"cc {cc[0]}.{cc[1]}"
    if sass:
        minor, arch = max(sass)
        if minor == cc[1]:
            return f"ok: {arch} code for this {here}"
        return (f"ok: {arch} code runs on this {here} (same major: torch's 'Minimum and Maximum cuda "
                f"capability ... ({cc[0]}.{minor})' warning is a false positive)")
    if ptx:
        return f"PTX only ({', '.join(ptx)}): the driver compiles every kernel for this {here} at first use (slow start)"
    return (f"no code for this {here} in this torch build ({', '.join(arch_list) or 'none'}): kernels fail with "
            f"'no kernel image is available'; install a torch build with sm_{cc[0]}x code "
            "(a DGX Spark: the cu130 wheel index, as ./setup.sh --only env does)")


def run_dtype(precision: str, spec: DeviceSpec) -> str:
    """The compute dtype base_train starts a --precision run in (fp8/nvfp4 keep their non-matmul
    work in bf16; auto: $NANOCHAT_DTYPE, else bf16 on a GPU with native bf16, cc >= 8.0, else fp32),
    refusing what init_runtime refuses: a bad $NANOCHAT_DTYPE, or one that conflicts with the dtype
    an explicit --precision sets."""
    from nanochat.common import DTYPE_ALIASES, DTYPE_ENV
    from nanochat.precision_request import runtime_dtype   # base_train's own rule and refusal
    chosen = runtime_dtype(precision)
    if chosen == "auto" and (env_value := os.environ.get(DTYPE_ENV, "").strip()):
        chosen = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(DTYPE_ALIASES[env_value], "auto")
    if chosen != "auto":
        return chosen
    return "bf16" if spec.cc is not None and spec.cc >= (8, 0) else "fp32"


def check_dtype(dtype: str, precision: str, spec: DeviceSpec) -> None:
    """init_runtime refuses bf16 on a GPU without native bf16 (cc < 8.0): so does the report."""
    if dtype == "bf16" and spec.is_cuda and spec.cc < (8, 0):
        raise RequestError(f"--precision {precision}: {spec.name} (cc {spec.cc[0]}.{spec.cc[1]}) has no native "
                           "bf16 (compute capability >= 8.0), which this precision computes in; use --precision fp32")


def check_kernel_here(kernel: str, spec: DeviceSpec, compile: bool = False) -> str:
    """`kernel`, or why it cannot run on this device (as training would refuse or fail on it), under
    torch.compile when `compile` (whose kernels are Triton's on a GPU: without Triton the report said
    `kernel: current` and exit 0 where base_train's default compiled run is refused)."""
    from nanochat.kernels import check_kernel
    device = "cuda" if spec.is_cuda else "mps" if spec.key == "mps" else "cpu"
    try:
        check_kernel(kernel, device, compile=compile)
    except ValueError as exc:   # RequestError: not installed, wrong device
        return f"{UNAVAILABLE}{exc}"
    return kernel


def _peak_source(spec: DeviceSpec) -> str:
    """Where the MFU peaks come from; for a GPU outside the table, how to get MFU at all."""
    if spec.is_cuda and not spec.peak_tflops:
        return ("not in nanochat/device_table.py: training prints MFU n/a unless base_train / bench_train "
                "get --peak-flops <dense bf16 FLOP/s per GPU>")
    return spec.source or "n/a"


def visible_gpus() -> list[str] | None:
    """Every visible GPU when there are several (None for one): the rest of the report describes the
    current one (GPU 0) only, while a torchrun launch gives each rank its own, and on a machine with
    GPUs of different kinds the others' arch, SMs and peaks (hence patches and MFU) differ."""
    count = torch.cuda.device_count()
    if count < 2:
        return None
    rows = []
    for index in range(count):
        spec = spec_from_props(torch.cuda.get_device_properties(index))
        rows.append(f"{index}: {spec.name} (cc {spec.cc[0]}.{spec.cc[1]}, {spec.sms} SMs, {spec.key})")
    kinds = {row.split(": ", 1)[1] for row in rows}
    if len(kinds) > 1:
        rows.append("GPUs of different kinds: the device, peak and patch rows describe GPU 0; each torchrun "
                    "rank applies its own GPU's patches and MFU divides by the sum of the GPUs' peaks")
    return rows


def preflight_report(kernel: str = "current", compile: bool | None = True, precision: str = "auto",
                     backend: str = "auto") -> dict[str, Any]:
    """`compile` None: the training scripts' default (training.resolve_compile): on for CUDA unless
    Triton cannot build kernels here, then off, and the report's `compile` row says why."""
    # as init_runtime does: allocator settings and torch's sm_121 warning filter before CUDA starts
    # (detect_device initialises CUDA; on a GB10 with torch 2.9-2.10 the warning printed first)
    configure_env_before_cuda()
    spec = detect_device()
    compile_row = "on" if compile else "off (--no-compile)"
    if compile is None:
        problem = ptxas_problem(spec)
        compile = spec.is_cuda and problem is None
        compile_row = "on (auto)" if compile else f"off (auto): {problem or 'not a CUDA device'}"
    report: dict[str, Any] = {
        "device": spec.name, "table_key": spec.key, "cc": spec.cc, "sms": spec.sms,
        "memory_gb": spec.memory_gb, "unified_memory": spec.unified_memory, "bandwidth_gbs": spec.bandwidth_gbs,
        "peak_tflops": spec.peak_tflops, "peak_source": _peak_source(spec), "python": sys.version.split()[0],
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "triton": _module_version("triton"), "liger_kernel": _module_version("liger_kernel"),
        "transformer_engine": _te_version(),
        "torchao": _module_version("torchao"), "compile": compile_row,
    }
    # init_runtime gives every CUDA process the runtime set first (apply_runtime_patches: Triton's
    # ptxas, is_big_gpu, ... whatever the flags; a missing ptxas only warns there), then training
    # its own: the report names both, as a run with these flags gets them
    runtime = apply_patches(spec, kernel="current", compile=True, ptxas_missing_ok=True) if spec.is_cuda else []
    # and on every device, init_runtime's CPU one: bf16 matmuls capped below AMX on a CPU where AMX
    # kernels crash (the report said "patches: []" on such a VM while every run there applied it)
    runtime += [name for name in [patch_cpu_amx()] if name]
    try:
        asked = apply_patches(spec, kernel=kernel, compile=compile)
        report["patches"] = asked + [name for name in runtime if name not in asked]
    except RuntimeError as exc:   # platform.PtxasMissing: a run with these flags stops there too
        report["patches"] = f"{UNAVAILABLE}{exc}"
    report["kernel"] = check_kernel_here(kernel, spec, compile)
    if spec.is_cuda:
        if (gpus := visible_gpus()) is not None:
            report["gpus"] = gpus
        report["cudnn"] = torch.backends.cudnn.version()
        report["arch_list"] = torch.cuda.get_arch_list()
        report["arch_support"] = arch_support(spec.cc, report["arch_list"])
        report["ptxas"] = triton_ptxas_in_use(spec)
        try:   # an unreadable /proc/meminfo (unified memory) or a failing cudaMemGetInfo: said, not a traceback
            report["memory_budget_gb"] = round(memory_budget_bytes(spec) / 1e9, 1)
        except RuntimeError as exc:
            report["memory_budget_gb"] = f"{UNAVAILABLE}{exc}"
        report["attention"] = probe_attention_backends()
    from nanochat import precision as precision_mod
    try:
        dtype = run_dtype(precision, spec)
        plan = precision_mod.resolve(precision, backend, spec, compute_dtype=dtype)
        check_dtype(dtype, precision, spec)
        if plan.backend == "te":   # resolve names only the class: show the recipe training builds
            plan.recipe = te_recipe_as_built(plan.precision, spec, compile)
        report["precision"] = plan.describe()
    except (ValueError, RuntimeError) as exc:
        report["precision"] = f"{UNAVAILABLE}{exc}"
    return report


def failures(report: dict[str, Any], args) -> list[str]:
    """What a run with these flags would stop on: an explicit --precision / --precision-backend or
    --kernel this machine cannot serve, or a workaround that cannot be applied (no usable ptxas)."""
    found = []
    dtype_env = bool(os.environ.get("NANOCHAT_DTYPE", "").strip())   # asked for too (init_runtime reads it)
    for key, explicit in (("patches", True), ("kernel", args.kernel != "current" or not args.no_compile),
                          ("precision", args.precision != "auto" or args.precision_backend != "auto" or dtype_env)):
        value = report.get(key)
        if explicit and isinstance(value, str) and value.startswith(UNAVAILABLE):
            problem = value.removeprefix(UNAVAILABLE)
            if not any(earlier in problem for earlier in found):   # a missing ptxas: patches and kernel say it
                found.append(problem)
    return found


def parse_args(argv: list[str] | None = None):
    """The command line: a ValueError names a bad flag (FlagParser: each flag in its underscore spelling too)."""
    from nanochat.flags import FlagParser
    from nanochat.precision import BACKENDS, PRECISIONS

    parser = FlagParser(prog="python -m nanochat.platform", description="nanochat-spark preflight report")
    parser.add_argument("--kernel", "--kernel-name", default="current", choices=KERNELS)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument("--precision-backend", default="auto", choices=BACKENDS)
    parser.add_argument("--compile", action="store_true", help="as base_train --compile (default: auto, as there)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of a table")
    parser.add_argument("--nccl", action="store_true", help="NCCL env checks + all-reduce busbw self-test "
                        "(under torchrun: its ranks; else one process per GPU, 2 gloo processes on CPU)")
    parser.add_argument("--nccl-procs", type=int, default=None, help="--nccl without torchrun: processes to spawn")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.nccl_procs is not None and not args.nccl:
        raise ValueError("--nccl-procs: only with --nccl")
    if args.compile and args.no_compile:
        raise ValueError("--compile / --no-compile: give one of them (neither: auto, as base_train)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit 2 when a --precision / --precision-backend or --kernel asked for
    explicitly cannot run here, or a needed workaround cannot be applied (the report says why), so
    `python -m nanochat.platform --precision fp8 && ...` stops where the training run would. A bad
    flag raises ValueError (script_main: one line)."""
    import json

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.nccl:  # the logic lives in nanochat/distributed.py
        from nanochat.distributed import selftest_main
        return selftest_main(args.nccl_procs, as_json=args.json)
    compile = True if args.compile else False if args.no_compile else None   # None: auto, as base_train
    report = preflight_report(args.kernel, compile, args.precision, args.precision_backend)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        for key, value in report.items():
            print(f"{key:>20}: {value}")
    problems = failures(report, args)
    for problem in problems:
        print(f"preflight: error: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("preflight", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
