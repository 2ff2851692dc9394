"""base_train's precision request, checked before its data loaders and its model exist (precision.py
owns the plans, the layers and the conversion): the compute dtype a --precision runs in and what
$NANOCHAT_DTYPE may say about it (runtime_dtype), the widths the fp8 / nvfp4 GEMMs need
(check_widths, also apply_precision's check on the model it converts), and check_request, which
resolves the plan on this device, checks the widths on the meta-device model of the flags and
proves the backend with precision.startup_check's tiny launch. A refusal is a RequestError naming
the flag (and the environment variable) and what this device accepts instead.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.nn as nn

from nanochat.common import DTYPE_ALIASES, DTYPE_ENV
from nanochat.errors import RequestError
from nanochat.platform import DeviceSpec
from nanochat.precision import ALIGN, PrecisionPlan, accepted_values, keep_high_precision, resolve, startup_check

# what a --precision computes in outside its GEMMs (init_runtime's dtype argument); auto: init_runtime's choice
PRECISION_DTYPE = {"fp32": "fp32", "bf16": "bf16", "fp8": "bf16", "nvfp4": "bf16"}


def runtime_dtype(precision: str) -> str:
    """The compute dtype (init_runtime's argument) of a --precision run: as named for bf16|fp32, bf16
    for fp8|nvfp4 (their work outside the GEMMs), auto: $NANOCHAT_DTYPE, else the device's. Which
    wins: the flag; $NANOCHAT_DTYPE decides only auto (the banner's precision row says so), and one
    that disagrees with the flag is refused naming both: init_runtime's refusal named a `--dtype`
    base_train does not have ("--dtype bf16 conflicts with NANOCHAT_DTYPE=fp32" for --precision fp8)."""
    dtype = PRECISION_DTYPE.get(precision, "auto")
    env = os.environ.get(DTYPE_ENV, "").strip()
    if env and env not in DTYPE_ALIASES:
        raise RequestError(f"{DTYPE_ENV}: got {env!r}; accepted: auto|bf16|fp32 (or unset)")
    if dtype != "auto" and DTYPE_ALIASES.get(env) not in (None, DTYPE_ALIASES[dtype]):
        other = "fp32" if DTYPE_ALIASES[env] == torch.float32 else "bf16"
        outside = f" (outside its {precision} GEMMs)" if precision in ALIGN else ""
        raise RequestError(f"--precision {precision} computes in {dtype}{outside}, but {DTYPE_ENV}={env} asks for "
                           f"{other}: drop one of them: unset {DTYPE_ENV} (or set it to {dtype}), or pass "
                           f"--precision {other}|auto")
    return dtype


def check_widths(model: nn.Module, precision: str, spec: DeviceSpec, *, base_train_flags: bool = False) -> None:
    """Refuse --precision fp8|nvfp4 for a model none of whose Linears their GEMMs take (in and out
    features multiples of precision.ALIGN; the lm_head stays high-precision anyway): it ran a bf16
    model that the banner, the checkpoint and util() called fp8/nvfp4. Both paths' check:
    check_request runs it on the flags' meta-device model before the data and the model exist,
    precision.apply_precision on the model it converts (bench_train, profile_training, tests).
    `base_train_flags`: end with base_train's flags for a width that works (other callers lack them)."""
    if precision not in ALIGN:
        return
    kept = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            if (reason := keep_high_precision(name, module, precision)) is None:
                return
            kept.append(f"{name} ({reason})")
    align, cfg = ALIGN[precision], getattr(model, "config", None)
    width = f"width {cfg.n_embd} (n_embd) is not" if cfg is not None else "Linear layers' dims: none is"
    # what runs at this width: the device's precisions whose GEMMs take it (fp8 at 48 when nvfp4 cannot)
    here = [p for p in accepted_values(spec) if p not in ALIGN or (cfg is not None and cfg.n_embd % ALIGN[p] == 0)]
    raise RequestError(
        f"--precision {precision}: the model's {width} a multiple of {align}, which its GEMMs need: no Linear "
        f"layer can run in {precision} (kept: {', '.join(kept[:3])}{', ...' * (len(kept) > 3)}); "
        f"accepted on this device: --precision {'|'.join(here)} at this width, or --precision {precision} with "
        f"a width that is a multiple of {align}" + (_wider(cfg, align) if cfg is not None and base_train_flags else ""))


def _wider(cfg: Any, align: int) -> str:
    """base_train's flags for a width that is a multiple of `align` (width = --depth x --aspect-ratio
    rounded up to a multiple of --head-dim): the narrowest --aspect-ratio at this --depth and
    --head-dim that is at least as wide as `cfg`, or the next --head-dim that is a multiple of it."""
    depth, head_dim = cfg.n_layer, cfg.head_dim
    width = lambda ar: -(-depth * ar // head_dim) * head_dim   # noqa: E731 (gpt_config.config_for_depth's)
    ratio = next(ar for ar in itertools.count(1) if width(ar) >= cfg.n_embd and width(ar) % align == 0)
    return (f" (width = --depth x --aspect-ratio rounded up to a multiple of --head-dim): e.g. --aspect-ratio "
            f"{ratio} (width {width(ratio)}) or --head-dim {-(-head_dim // align) * align}")


def check_request(precision: str, backend: str, rt: Any, config: Any, *, compile: bool = True) -> PrecisionPlan:
    """base_train's --precision x --precision-backend before its data and its model: resolve() on
    this device, check_widths() on `config`'s model built on the meta device (no memory; `config`
    is the flags' GPTConfig, its vocab_size any: the lm_head is never converted), and, where the
    device is real, precision.startup_check's launch: a TE or Triton that fails it stopped the run
    only after the data and the model (apply_precision runs it again, a tiny layer)."""
    from nanochat.gpt import GPT
    from nanochat.platform import detect_device   # looked up now: the tests simulate devices
    spec = detect_device(rt.device)
    plan = resolve(precision, backend, spec, compute_dtype=rt.dtype_name)
    if plan.backend != "none":
        with torch.device("meta"):
            model = GPT(config)
        check_widths(model, plan.precision, spec, base_train_flags=True)
        # a real GPU only: init_runtime's bf16 probe initialised it; one simulated on a CPU box (the
        # tests' device specs, torch.cuda.is_available patched) never was
        if rt.device.type != "cuda" or torch.cuda.is_initialized():
            startup_check(plan, spec, rt.device, rt.dtype, compile)
    return plan
