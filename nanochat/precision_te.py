"""Transformer Engine backend of precision.py (`--precision-backend te`): whether TE imports,
the recipe built from the installed TE's real fields and read back, and the te.pytorch.Linear
subclass the model's layers become. The TE modules are passed in, so the CPU tests use a fake TE;
`tests/test_te.py` runs the real one on a GPU (`scripts/te_install.sh` puts it on the GPU box)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.nn as nn

from nanochat.errors import RequestError
from nanochat.platform import DeviceSpec, prepare_te_import

log = logging.getLogger("nanochat.precision")


def te_available() -> bool:
    """Whether transformer_engine.pytorch imports (with torch's cuDNN loaded first)."""
    return te_import_error() is None


def te_import_error() -> str | None:
    """None when Transformer Engine imports; else why not, for a refusal to quote: "not installed",
    or "installed but fails to import (<error>)". A TE built for another torch or loading another
    cuDNN (te_cudnn.py: "undefined symbol") was refused as "not installed (pip install ...)", and an
    OSError from its library loader (a cuDNN it cannot open) ended the run with a traceback. TE's
    loader itself asserts that its packages match (AssertionError: "Could not find `transformer-engine`
    PyPI package", TE #2410, or a version mismatch), raises RuntimeError for a missing core library,
    and TE 1.x wheels without the extension raised StopIteration: each is an install problem too."""
    if not _te_installed():
        return "not installed"
    try:
        _import_te()
    except (ImportError, OSError, RuntimeError, AssertionError, StopIteration) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"installed but fails to import ({type(exc).__name__}: {first})"
    return None


def te_missing(why: str) -> str:
    """How a refusal names TE's absence (`why`: te_import_error's answer). A CUDA error raised while
    TE loaded (it initialises the device on import: "CUDA error: ...", "CUDA driver version is
    insufficient") is the GPU's or the driver's state, which a reinstall does not change."""
    install = "pip install 'transformer-engine[pytorch]'"
    if why == "not installed":
        return f"is not installed ({install})"
    if why.startswith("installed but fails to import (RuntimeError: ") and _is_cuda_error(why):
        return f"is {why}: the GPU or its driver failed while TE loaded (check `nvidia-smi`), not the install"
    return f"is {why}: reinstall it ({install})"


def _is_cuda_error(text: str) -> bool:
    return any(mark in text for mark in ("CUDA error", "CUDA driver", "cudaError", "CUDA-capable device"))


def _te_installed() -> bool:
    import importlib.util
    import sys
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except ValueError:   # a module in sys.modules without a spec (a stand-in): there
        return sys.modules.get("transformer_engine") is not None


def _import_te() -> None:
    prepare_te_import()   # torch's cuDNN first (platform.py says why)
    import transformer_engine.pytorch  # noqa: F401


def recipe_fields(cls) -> set[str]:
    """The keyword fields a TE recipe class really has (pydantic dataclass or dataclass)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    model_fields = getattr(cls, "model_fields", None) or getattr(cls, "__fields__", None)
    if model_fields:
        return set(model_fields)
    import inspect
    return set(inspect.signature(cls).parameters)


SM12X_NVFP4_FIELDS = ("disable_rht", "disable_stochastic_rounding")   # RHT crashes; SR wrote zeros up to TE 2.18 (#3281)
# read back and reported as built (TE takes their defaults from NVTE_* variables): newer TEs' nvfp4
# row-scaled activations and 4over6 block scaling too, which change the forward's quantisation
REPORTED_FIELDS = ("fp8_format", "backward_override", *SM12X_NVFP4_FIELDS, "disable_2d_quantization",
                   "row_scaled_activation", "nvfp4_4over6")


def te_nvfp4_problem(spec: DeviceSpec, te_recipe: Any = None) -> str | None:
    """Why the installed TE cannot build the nvfp4 recipe `spec` needs (None = it can): no
    NVFP4BlockScaling (TE < 2.8; the attribute lookup failed with an AttributeError after the
    model was built), or, on sm_12x, a recipe without the fields that turn the crashing random
    Hadamard transform and the all-zero stochastic rounding off (DESIGN s4.7)."""
    if te_recipe is None:
        import transformer_engine.common.recipe as te_recipe
    cls = getattr(te_recipe, "NVFP4BlockScaling", None)
    if cls is None:
        return ("--precision nvfp4: the installed Transformer Engine has no NVFP4BlockScaling recipe (needs TE "
                ">= 2.8: pip install -U 'transformer-engine[pytorch]'); or use --precision fp8")
    missing = [n for n in SM12X_NVFP4_FIELDS if n not in recipe_fields(cls)]
    if spec.cc is not None and spec.cc[0] == 12 and missing:
        return (f"--precision nvfp4: the installed Transformer Engine's NVFP4BlockScaling has no {missing} "
                "field(s), required on sm_12x (DESIGN s4.7): upgrade TE; or use --precision fp8")
    return None


def te_fp8_problem(te_recipe: Any = None) -> str | None:
    """Why the installed TE cannot build the fp8 recipe (None = it can): no Float8CurrentScaling
    (older TEs, e.g. the 1.x of 2024 NGC containers), which failed with an AttributeError in
    build_te_recipe after the model was built (DelayedScaling alone errors under torch.compile)."""
    if te_recipe is None:
        import transformer_engine.common.recipe as te_recipe
    if getattr(te_recipe, "Float8CurrentScaling", None) is None:
        return ("--precision-backend te: the installed Transformer Engine has no Float8CurrentScaling recipe "
                "(an older TE; pip install -U 'transformer-engine[pytorch]'); or use --precision-backend native")
    return None


def build_te_recipe(precision: str, spec: DeviceSpec, te_recipe: Any, *, compile: bool = True,
                    fp8_recipe: str = "current") -> tuple[Any, dict[str, Any]]:
    """Construct and verify the TE recipe; returns (recipe, the fields we asserted)."""
    if precision == "fp8":
        if fp8_recipe == "delayed":
            if compile:
                raise RequestError("--precision-backend te with DelayedScaling errors under torch.compile; "
                                 "use the default Float8CurrentScaling or turn compile off")
            cls = te_recipe.DelayedScaling
        else:
            if (problem := te_fp8_problem(te_recipe)) is not None:
                raise RequestError(problem)
            cls = te_recipe.Float8CurrentScaling
        wanted = {"fp8_format": te_recipe.Format.HYBRID}
    elif precision == "nvfp4":
        if (problem := te_nvfp4_problem(spec, te_recipe)) is not None:
            raise RequestError(problem)
        cls = te_recipe.NVFP4BlockScaling
        wanted = {}
        fields = recipe_fields(cls)
        if spec.cc is not None and spec.cc[0] == 12:   # sm_12x: RHT crashes, SR wrote zeros
            wanted.update(dict.fromkeys(SM12X_NVFP4_FIELDS, True))
        if "backward_override" in fields:
            wanted["backward_override"] = "high_precision"
        else:
            log.warning("TE NVFP4BlockScaling has no backward_override (TE < 2.15): the backward "
                        "runs in NVFP4 too")
    else:
        raise RequestError(f"--precision {precision}: no Transformer Engine recipe")
    unknown = set(wanted) - recipe_fields(cls)
    if unknown:
        raise RuntimeError(f"TE {cls.__name__} lacks fields {sorted(unknown)}; upgrade TE")
    recipe = cls(**wanted)
    for name, value in wanted.items():   # pydantic recipes drop what they do not know: read back
        got = getattr(recipe, name, None)
        if got != value:
            raise RuntimeError(f"TE {cls.__name__}.{name} = {got!r} after construction, wanted {value!r}")
    # the fields we leave at TE's defaults are reported as built: TE takes their defaults from the
    # environment (NVTE_BACKWARD_OVERRIDE, NVTE_NVFP4_DISABLE_RHT, ...), so a shell variable changed
    # the backward or the transform while the banner showed only what we had set
    effective = {n: str(getattr(recipe, n)) for n in REPORTED_FIELDS if n in recipe_fields(cls) and hasattr(recipe, n)}
    return recipe, {"recipe": cls.__name__, **effective, **{k: str(v) for k, v in wanted.items()}}


def make_te_linear_class(te: Any, recipe: Any) -> type:
    """A te.pytorch.Linear subclass that enters its own autocast, so the training loop needs
    no context manager; grad-disabled calls run with TE's quantisation off (bf16)."""
    autocast = getattr(te, "autocast", None)

    def quant_ctx(enabled: bool):
        if autocast is not None:   # TE >= 2.8 name
            return autocast(enabled=enabled, recipe=recipe if enabled else None)
        return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe if enabled else None)

    class TELinear(te.Linear):
        def forward(self, x):
            # fp32 master weights with bf16 activations: TE refuses mixed dtypes outside autocast
            # ("Data types for parameters must match"), and under it casts the weight itself.
            # One `with` per frame: dynamo (torch 2.11) asserts when a graph break (TE modules
            # break graphs where TE's compile support is off) sits inside `with a, b:`.
            with torch.autocast(x.device.type, dtype=x.dtype, enabled=self.weight.dtype != x.dtype):
                return self._quantised(x)

        def _quantised(self, x):
            with quant_ctx(torch.is_grad_enabled()):
                return te.Linear.forward(self, x)

    return TELinear


def te_factory(te, recipe):
    cls = make_te_linear_class(te, recipe)

    def factory(old: nn.Linear):
        new = cls(old.in_features, old.out_features, bias=old.bias is not None,
                  params_dtype=old.weight.dtype, device=old.weight.device)
        new.weight = old.weight   # share the Parameter the optimizer and checkpoint know
        return new
    return factory
