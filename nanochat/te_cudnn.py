"""Transformer Engine's cuDNN: `prepare_te_import()` makes TE load torch's own cuDNN before any other
on the system (the why is in its docstring), `torch_cudnn_dir()` finds that cuDNN. A workaround of
nanochat/platform.py, which re-exports both (callers import them from there) and whose preflight
report names it; moved here so platform.py stays under the ~600-line rule. Nothing runs at import:
the libraries load only when prepare_te_import is called, with TE installed.
"""

from __future__ import annotations

import os
from typing import Any, Callable, MutableMapping


def torch_cudnn_dir() -> str | None:
    """The folder of the cuDNN that torch's wheel depends on (pip package nvidia-cudnn-*), or None."""
    import importlib.util
    try:
        spec = importlib.util.find_spec("nvidia.cudnn")
    except ImportError:   # no `nvidia` namespace at all
        return None
    for path in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isdir(os.path.join(path, "lib")):
            return path
    return None


# cuDNN 9's libraries in load order: each one's dependencies first (their RUNPATH is $ORIGIN)
_CUDNN_LOAD_ORDER = ("graph", "ops", "heuristic", "engines_runtime_compiled", "engines_precompiled",
                     "engines_tensor_ir", "cnn", "adv", "ext")


def prepare_te_import(env: MutableMapping[str, str] | None = None, cudnn_dir: str | None = None,
                      loader: Callable[[str], Any] | None = None, te_installed: bool | None = None) -> str | None:
    """Call before importing Transformer Engine: make it use torch's own cuDNN.
    Why: TE 2.x dlopens libcudnn from CUDNN_HOME / CUDNN_PATH / CUDA_HOME / /usr/local/cuda or the
    loader path *before* the pip package torch uses (`transformer_engine/common/__init__.py`,
    `_load_cuda_library`), and its core library names every cuDNN sub-library (libcudnn_cnn.so.9,
    ...) with no RUNPATH, so the dynamic loader takes whichever it finds first. Where the system has
    another cuDNN 9 (the H100 box: 9.14 in /lib beside torch 2.11's 9.19, 2026-11-24) the versions mix:
    TE's import fails ("libcudnn_cnn.so.9: undefined symbol ... version libcudnn_graph.so.9") or torch
    refuses cuDNN ("cuDNN version incompatibility"). So: CUDNN_HOME = torch's cuDNN folder (unless
    the user set CUDNN_HOME / CUDNN_PATH), and torch's cuDNN libraries loaded globally, dependencies
    first, so every later lookup by name finds them. Targets TE 2.x with torch wheels that ship
    cuDNN as a pip package (torch >= 2.1). Without TE installed it does nothing: loading ~1 GB of
    cuDNN libraries for a module that will not import only costs start-up time and memory.
    Returns the patch name, or None when nothing applied."""
    env = os.environ if env is None else env
    if te_installed is None:
        import importlib.util
        te_installed = importlib.util.find_spec("transformer_engine") is not None
    if not te_installed or env.get("CUDNN_HOME") or env.get("CUDNN_PATH"):
        return None
    cudnn_dir = cudnn_dir if cudnn_dir is not None else torch_cudnn_dir()
    if not cudnn_dir:
        return None
    env["CUDNN_HOME"] = cudnn_dir
    if loader is None:
        import ctypes
        loader = lambda path: ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)   # noqa: E731
    libs = {}
    for name in os.listdir(os.path.join(cudnn_dir, "lib")):
        if name.startswith("libcudnn") and ".so" in name:
            libs[name.split(".so")[0].removeprefix("libcudnn").lstrip("_") or "main"] = name
    rank = {k: i for i, k in enumerate(_CUDNN_LOAD_ORDER)}
    for key in sorted(libs, key=lambda k: (k == "main", rank.get(k, len(rank)), k)):
        loader(os.path.join(cudnn_dir, "lib", libs[key]))
    from nanochat.platform import _log_once   # its once-per-process record (platform imports this module)
    _log_once("te_cudnn", f"Transformer Engine: torch's cuDNN ({cudnn_dir}) loaded first, CUDNN_HOME set")
    return "te_cudnn"
