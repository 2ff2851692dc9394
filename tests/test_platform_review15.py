"""Review 15 of base_train's hardware-dependent choices, on simulated device properties (no GPU):
a compiled model (inductor's kernels are Triton's on a GPU), native fp8's Triton casts or --kernel
liger on a CUDA box where Triton cannot build kernels at all (no Triton package; a GPU older than
Triton's cc 7.0) passed every early check and died at the first compiled step or the precision
start-up check, after the checkpoint directory, the data and the model. Now refused with the other
checks, naming the flag and what runs instead; and the preflight report says so, as the run would.
Plus a refusal that names Transformer Engine's own import error instead of "not installed".
Each test failed before its fix."""

from __future__ import annotations

import types

import pytest
import torch

import nanochat.precision as PR  # bound before detect_device is patched (test_gb10_review10 says why)
from nanochat import platform as P
from nanochat import precision_te, preflight
from nanochat.errors import RequestError
from nanochat.platform import SimpleProps, detect_device
from tests import test_matrix_review13 as M

DEVICES = M.DEVICES
cell = M.cell   # the fixture: scripts.base_train.train up to its checkpoint directory, on a simulated device

GB = 10**9
H100, GB10 = DEVICES["h100"], DEVICES["gb10"]
P100 = SimpleProps("Tesla P100-PCIE-16GB", 6, 0, 56, 16 * GB)   # Pascal: cu126 wheels still run it


@pytest.fixture
def cuda_box(monkeypatch):
    """A visible CUDA GPU (the checks that ask Triton run only where one is) with Triton installed at
    `triton` (None: not importable); its bundled ptxas serves every arch (the ptxas cases are
    test_gb10_review10's)."""
    def use(triton: str | None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(P, "triton_version", lambda: triton)
        monkeypatch.setattr(P, "bundled_ptxas_version", lambda cc: (13, 1))
    return use


# ------------------------------------------------------------------ no Triton on a CUDA box

def test_compiled_model_without_triton_is_refused_in_the_early_check(cuda_box, monkeypatch):
    """check_kernel (base_train's check before it claims the checkpoint directory) let a compiled
    run through on a GPU without Triton: inductor then raised TritonMissing at the first step."""
    from nanochat.kernels import check_kernel
    cuda_box(None)
    monkeypatch.setattr(P, "detect_device", lambda *a, **k: detect_device(props=H100))
    with pytest.raises(RequestError, match=r"^the compiled model \(--no-compile avoids it\): Triton is not "
                                           r"installed.*--kernel current --no-compile"):
        check_kernel("current", "cuda", compile=True)
    check_kernel("current", "cuda", compile=False)   # eager PyTorch needs no Triton
    assert P.ptxas_problem(P.CPU_SPEC) is None        # nor does a CPU (Triton is optional there)


def test_base_train_without_triton_stops_before_the_checkpoint_dir(cell, cuda_box, capsys):
    """The whole recipe: an explicit --compile and native fp8 (its casts are Triton kernels whatever
    --compile says) are refused before the checkpoint directory; what the refusals offer runs. The
    compile default (auto) falls back to eager and says why in one start-up line."""
    cuda_box(None)
    how, got = cell("current", "auto", "h100", False, False, "--compile")
    assert how == "refused" and "Triton is not installed" in got and "--no-compile" in got, got
    capsys.readouterr()
    assert cell("current", "auto", "h100", False, False)[0] == "runs"   # compile: auto -> off here
    out = capsys.readouterr().out
    assert "compile: off (auto; --compile forces it): Triton is not installed" in out, out
    how, got = cell("current", "fp8", "h100", False, False, "--no-compile")
    assert how == "refused" and got.startswith("--precision fp8 (backend native): its fp8 casts are Triton"), got
    assert "Triton is not installed" in got and "--precision-backend te" in got, got
    assert cell("current", "auto", "h100", False, False, "--no-compile")[0] == "runs"
    assert cell("current", "fp8", "h100", False, True, "--no-compile", "--precision-backend", "te")[0] == "runs"


def test_a_gpu_older_than_triton_refuses_compile_but_runs_eagerly(cell, cuda_box, monkeypatch):
    """A Pascal GPU (cc 6.0; setup's cu126 wheels serve it) with Triton installed: inductor raised
    GPUTooOldForTriton at the first compiled step. auto precision there is fp32 (no native bf16)."""
    cuda_box("3.6.0")
    monkeypatch.setitem(DEVICES, "p100", P100)
    how, got = cell("current", "auto", "p100", False, False, "--compile")
    assert how == "refused" and "compute capability >= 7.0" in got and "--no-compile" in got, got
    assert cell("current", "auto", "p100", False, False)[0] == "runs"   # compile auto: off there
    how, got = cell("current", "auto", "p100", False, False, "--no-compile")
    assert how == "runs" and f"{got.precision}/{got.backend}" == "fp32/none", got
    assert cell("triton", "auto", "p100", False, False, "--no-compile")[1].startswith("--kernel triton: Triton")


def test_triton_that_builds_for_the_gpu_passes(cuda_box, monkeypatch):
    """The check refuses nothing that works: Triton installed, a GPU of cc >= 7.0 (and on a CPU box
    the simulated GPUs of the other tests are never asked about, torch.cuda.is_available False)."""
    from nanochat.kernels import check_kernel
    cuda_box("3.6.0")
    for props in (H100, GB10, SimpleProps("Tesla V100-SXM2-32GB", 7, 0, 80, 32 * GB)):
        spec = detect_device(props=props)
        assert P.ptxas_problem(spec) is None, props.name
        monkeypatch.setattr(P, "detect_device", lambda *a, spec=spec, **k: spec)
        check_kernel("current", "cuda", compile=True)


def test_preflight_says_a_compiled_run_cannot_start_and_exits_2(monkeypatch):
    """The report checked --kernel without --compile, and only an explicit --kernel counted: on a GPU
    without Triton it printed `kernel: current` and exited 0 where base_train's default run is
    refused. A missing ptxas (reported by the patches row too) is said once."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P, "triton_version", lambda: None)
    monkeypatch.setattr(P, "detect_device", lambda *a, **k: detect_device(props=H100))
    h100 = detect_device(props=H100)
    row = preflight.check_kernel_here("current", h100, compile=True)
    assert row.startswith(preflight.UNAVAILABLE + "the compiled model") and "Triton is not installed" in row
    assert preflight.check_kernel_here("current", h100, compile=False) == "current"
    args = types.SimpleNamespace(kernel="current", no_compile=False, precision="auto", precision_backend="auto")
    assert preflight.failures({"patches": [], "kernel": row}, args) == [row.removeprefix(preflight.UNAVAILABLE)]
    args.no_compile = True
    assert preflight.failures({"patches": [], "kernel": "current"}, args) == []
    ptxas = "Triton 3.5.1's bundled ptxas (12.8) cannot target sm_121"
    report = {"patches": preflight.UNAVAILABLE + ptxas,
              "kernel": f"{preflight.UNAVAILABLE}the compiled model (--no-compile avoids it): {ptxas}"}
    args.no_compile = False
    assert preflight.failures(report, args) == [ptxas]


# ------------------------------------------------------------------ a Transformer Engine that does not import

class _BrokenTE:
    """A meta-path finder for which transformer_engine.pytorch's import fails with `error`, as a TE
    built for another torch does ("undefined symbol") or one whose cuDNN cannot be opened."""

    def __init__(self, error: Exception):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine.pytorch":
            raise self.error


def broken_te(monkeypatch, tmp_path, error: Exception) -> None:
    import importlib.machinery
    import sys
    pkg = types.ModuleType("transformer_engine")
    pkg.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTE(error), *sys.meta_path])
    monkeypatch.setenv("CUDNN_HOME", str(tmp_path))   # prepare_te_import: no cuDNN loaded for a stand-in


def test_a_broken_transformer_engine_is_named_as_such_not_as_missing(monkeypatch, tmp_path):
    """TE installed but failing to import (built for another torch, a cuDNN of another version: the
    H100 box's "undefined symbol", nanochat/te_cudnn.py) was refused as "not installed (pip install
    ...)"; an OSError from its library loader was a traceback. The refusal now quotes the error."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    h100, b200 = detect_device(props=H100), detect_device(props=DEVICES["b200"])
    broken_te(monkeypatch, tmp_path, ImportError("libtransformer_engine.so: undefined symbol: _ZN5torch3jit"))
    assert precision_te.te_available() is False
    with pytest.raises(RequestError, match=r"^--precision-backend te: Transformer Engine is installed but fails to "
                                           r"import \(ImportError: .*undefined symbol.*--precision-backend native"):
        PR.resolve("fp8", "te", h100)
    with pytest.raises(RequestError, match=r"^--precision nvfp4: needs Transformer Engine >= 2.8, which is "
                                           r"installed but fails to import \(ImportError.*reinstall it"):
        PR.resolve("nvfp4", "auto", b200)
    broken_te(monkeypatch, tmp_path, OSError("libcudnn_cnn.so.9: cannot open shared object file"))
    with pytest.raises(RequestError, match=r"fails to import \(OSError: libcudnn_cnn"):
        PR.resolve("fp8", "te", h100)
    monkeypatch.setitem(__import__("sys").modules, "transformer_engine", None)   # not installed: as before
    with pytest.raises(RequestError, match=r"^--precision-backend te: Transformer Engine is not installed \(pip"):
        PR.resolve("fp8", "te", h100)


# ------------------------------------------------------------------ the CPU patch, reported again

AMX_FLAGS = "fpu sse avx512f amx_bf16 amx_tile amx_int8"


def test_the_cpu_amx_patch_is_reported_by_every_call_and_by_apply_patches(monkeypatch):
    """patch_cpu_amx caps oneDNN below AMX where AMX kernels crash (init_runtime, first). A second
    call took that cap for a user's and returned None, and apply_patches (the list a training run's
    banner and checkpoint record) never named it: a CPU run there showed `patches: []`."""
    import os

    from nanochat import cpu_patches
    monkeypatch.setenv(P.ONEDNN_ISA_ENV, "recorded")   # so that teardown restores the variable's absence
    monkeypatch.delenv(P.ONEDNN_ISA_ENV)
    monkeypatch.setattr(cpu_patches, "_CAPPED", [], raising=False)
    monkeypatch.setattr(cpu_patches, "_LOGGED", set())
    assert P.patch_cpu_amx(None, AMX_FLAGS, probe=lambda: 4) == "cpu_amx"      # as init_runtime
    assert os.environ[P.ONEDNN_ISA_ENV] == P.AMX_FALLBACK_ISA
    assert P.patch_cpu_amx(None, AMX_FLAGS, probe=lambda: 0) == "cpu_amx"      # idempotent: same report
    assert P.apply_patches(P.CPU_SPEC, compile=False, ctx=P.PatchContext(env=os.environ)) == ["cpu_amx"]
    # a cap of the user's (or of a parent process) is not this process's patch
    monkeypatch.setenv(P.ONEDNN_ISA_ENV, "AVX2")
    assert P.patch_cpu_amx(None, AMX_FLAGS, probe=lambda: 4) is None
    assert P.apply_patches(P.CPU_SPEC, compile=False, ctx=P.PatchContext(env=os.environ)) == []
    assert P.apply_patches(P.CPU_SPEC, compile=False, ctx=P.PatchContext(env={})) == []


def test_preflight_follows_the_compile_default(cuda_box, monkeypatch, capsys):
    """The report without --compile / --no-compile is base_train's default (auto): on a GPU without
    Triton it said a compiled run stops (exit 2) where base_train now runs eagerly; --compile asks
    for compile and gets the refusal."""
    import json

    cuda_box(None)
    monkeypatch.setattr(P, "detect_device", lambda *a, **k: detect_device(props=H100))
    monkeypatch.setattr(preflight, "detect_device", lambda *a, **k: detect_device(props=H100))
    monkeypatch.setattr(preflight, "memory_budget_bytes", lambda s: 64 * GB)
    monkeypatch.setattr(preflight, "probe_attention_backends", lambda: {"sdpa-cudnn": "ok"})
    monkeypatch.setattr(preflight, "triton_ptxas_in_use", lambda s: "simulated")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90"])
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    monkeypatch.setattr(preflight, "visible_gpus", lambda: None)
    assert preflight.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compile"].startswith("off (auto): Triton is not installed") and report["kernel"] == "current"
    assert preflight.main(["--json", "--compile"]) == 2
    capsys.readouterr()
    with pytest.raises(ValueError, match="--compile / --no-compile"):
        preflight.parse_args(["--compile", "--no-compile"])


class _Built(Exception):
    pass


def test_the_optimizer_follows_the_run_s_compile_decision(env, monkeypatch):
    """base_train hands its compile decision to the optimizer, whose update functions compiled on
    CUDA whatever --no-compile said: a run the refusal sent to --no-compile (no Triton) then failed
    at its first optimizer step."""
    from nanochat import optim
    from scripts import base_train
    from tests.test_base_train import TINY

    def recorded(model, **kw):
        raise _Built(kw.get("compile", "not passed"))

    monkeypatch.setattr(optim, "build_optimizer", recorded)
    with pytest.raises(_Built) as e:
        base_train.main(TINY + env + ["--num-iterations", "1", "--eval-every", "-1"])
    assert e.value.args[0] is False
