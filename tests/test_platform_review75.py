"""Review 75 of the platform / precision / MFU layer, on simulated devices (no GPU).

Fixed here (each test failed before its fix):
- A Transformer Engine install whose own loader refuses it (the metapackage, core and torch
  extension at different versions, or a source build next to leftover wheels: TE asserts "Could not
  find `transformer-engine` PyPI package", TE issue #2410; a missing core library is its
  RuntimeError; TE 1.x wheels without the extension raised StopIteration) escaped
  `te_import_error`, which caught only ImportError / OSError: `--precision nvfp4` or
  `--precision-backend te` ended in that traceback instead of the refusal naming the flag, and so
  did a `--precision bf16 --precision-backend te` refusal on a Blackwell (its accepted list asks
  whether nvfp4 runs) and the preflight report (which catches ValueError / RuntimeError only).
- A MIG compute instance smaller than its GPU instance is named by both profiles ("NVIDIA H100 80GB
  HBM3 MIG 1c.3g.40gb", as `nvidia-smi -L` and CUDA name it): the profile pattern wanted
  "MIG <n>g.<m>gb" right after "MIG", so such a slice kept the whole board's bandwidth (3350 GB/s
  instead of the 40 GB instance's 1675): decode and roofline bandwidth utilisation 2x too low.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

import nanochat.precision as PR  # bound before detect_device is patched (test_gb10_review10 says why)
from nanochat import precision_te
from nanochat.device_table import DEVICE_TABLE, SimpleProps, spec_from_props
from nanochat.errors import RequestError

GB = 10**9
H100 = spec_from_props(SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 * GB))
B200 = spec_from_props(SimpleProps("NVIDIA B200", 10, 0, 148, 191 * GB))
GB10 = spec_from_props(SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True))


# ------------------------------------------------------------------ TE refused by its own loader

class _RefusingTE:
    """A meta-path finder for which `import transformer_engine.pytorch` fails with `error`, as TE's
    loader (transformer_engine/common/__init__.py) fails on a mixed install."""

    def __init__(self, error: BaseException):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "transformer_engine.pytorch":
            raise self.error


def _refusing_te(monkeypatch, tmp_path, error: BaseException) -> None:
    pkg = types.ModuleType("transformer_engine")
    pkg.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None, is_package=True)
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "transformer_engine", pkg)
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_RefusingTE(error), *sys.meta_path])
    monkeypatch.setenv("CUDNN_HOME", str(tmp_path))   # prepare_te_import: no cuDNN loaded for a stand-in


LOADER_ERRORS = [
    AssertionError("Could not find `transformer-engine` PyPI package."),
    AssertionError("Transformer Engine package version mismatch. Found transformer_engine_torch v2.9.0, "
                   "transformer-engine v2.10.0, and transformer-engine-cu12 v2.10.0."),
    RuntimeError("cudnn shared object not found."),
    StopIteration(),
]


@pytest.mark.parametrize("error", LOADER_ERRORS, ids=lambda e: type(e).__name__)
def test_te_refused_by_its_own_loader_is_named_not_a_traceback(monkeypatch, tmp_path, error):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refusing_te(monkeypatch, tmp_path, error)
    why = precision_te.te_import_error()
    assert why is not None and why.startswith(f"installed but fails to import ({type(error).__name__}")
    assert precision_te.te_available() is False
    with pytest.raises(RequestError, match=r"^--precision-backend te: Transformer Engine is installed but fails "
                                           rf"to import \({type(error).__name__}.*--precision-backend native"):
        PR.resolve("fp8", "te", H100)
    for spec in (B200, GB10):
        with pytest.raises(RequestError, match=r"^--precision nvfp4: needs Transformer Engine >= 2.8, which is "
                                               rf"installed but fails to import \({type(error).__name__}"):
            PR.resolve("nvfp4", "auto", spec)
    # the bf16 refusal's accepted list asks whether nvfp4 runs here: it says what runs, nvfp4 not among it
    with pytest.raises(RequestError, match=r"^--precision-backend te: only applies.*--precision auto\|bf16\|fp32\|fp8,"):
        PR.resolve("bf16", "te", B200)
    # a request that never uses TE does not import it, broken or not
    assert PR.resolve("fp8", "auto", H100).backend == "native"


def test_an_unrelated_error_inside_te_still_surfaces(monkeypatch, tmp_path):
    """Only the loader's failure modes are a refusal; anything else stays a traceback (no blanket
    `except Exception`)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refusing_te(monkeypatch, tmp_path, KeyError("a bug, not an install problem"))
    with pytest.raises(KeyError):
        precision_te.te_import_error()


# ------------------------------------------------------------------ MIG compute instances

# (torch's name, SMs the compute instance reports, the board's row, GB of its GPU instance)
MIG_COMPUTE_INSTANCES = [
    ("NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb", 16, "h100-sxm", 40),
    ("NVIDIA H100 80GB HBM3 MIG 2c.4g.40gb", 32, "h100-sxm", 40),
    ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", 14, "a100-40gb", 20),
    ("NVIDIA H200 MIG 1c.2g.35gb", 16, "h200", 35),
    ("NVIDIA B200 MIG 1c.2g.45gb", 16, "b200", 45),
]


@pytest.mark.parametrize("name,sms,key,gi_gb", MIG_COMPUTE_INSTANCES)
def test_a_mig_compute_instance_gets_its_gpu_instances_bandwidth(name, sms, key, gi_gb):
    spec = spec_from_props(SimpleProps(name, *DEVICE_TABLE[key].cc, sms, gi_gb * GB))
    row = DEVICE_TABLE[key]
    assert spec.key == key
    assert spec.bandwidth_gbs == round(row.bandwidth_gbs * gi_gb / row.memory_gb, 1)   # was the whole board's
    assert f"MIG profile's {gi_gb} of" in spec.source
    assert spec.peak_tflops["bf16"] == round(row.peak_tflops["bf16"] * sms / row.sms, 1)   # SMs: as before


def test_mig_profiles_without_a_compute_instance_prefix_are_unchanged():
    spec = spec_from_props(SimpleProps("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 9, 0, 60, 40 * GB))
    assert spec.bandwidth_gbs == 1675.0
    spec = spec_from_props(SimpleProps("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", 9, 0, 16, 10 * GB))
    assert spec.bandwidth_gbs == 418.8
    whole = spec_from_props(SimpleProps("NVIDIA H100 80GB HBM3 MIG 7g.80gb", 9, 0, 132, 80 * GB))
    assert whole.bandwidth_gbs == 3350 and "MIG profile" not in whole.source


@pytest.mark.parametrize("message", ["CUDA error: an illegal memory access was encountered",
                                     "CUDA driver version is insufficient for CUDA runtime version"])
def test_a_cuda_error_while_te_loads_is_not_called_an_install_problem(monkeypatch, tmp_path, message):
    """TE initialises the device on import; a CUDA failure there is the GPU's or the driver's state,
    so the refusal quotes it and points at the device, not at a reinstall (session 75 left this)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refusing_te(monkeypatch, tmp_path, RuntimeError(message))
    why = precision_te.te_import_error()
    text = precision_te.te_missing(why)
    assert message in text and "nvidia-smi" in text and "reinstall" not in text
    with pytest.raises(RequestError, match=r"^--precision-backend te: .*the GPU or its driver failed"):
        PR.resolve("fp8", "te", H100)
    # the loader's own install errors keep the reinstall advice
    assert "reinstall it" in precision_te.te_missing("installed but fails to import (RuntimeError: cudnn shared "
                                                     "object not found.)")
