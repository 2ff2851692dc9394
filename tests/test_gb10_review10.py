"""Review 10 of what base_train decides on a DGX Spark (GB10), on simulated device properties (no
GPU): an explicit --kernel triton|liger that no ptxas can serve is refused with the recipes' other
checks (before the checkpoint directory, data and model exist), and the patch list the banner and
checkpoint record names every workaround the process applied. Plus the MFU peaks per precision of
the simulated GB10 / H100 / H200 / B200 / RTX 5090 rows (DESIGN.md s3), as a guard."""

import types

import pytest
import torch

import nanochat.precision  # noqa: F401  (imported before a test patches platform.detect_device: it binds the name
from nanochat import platform as P  # at import, and a first import under the patch kept the simulated GB10 for good)
from nanochat.platform import PatchContext, PtxasMissing, SimpleProps, detect_device
from tests.test_precision_review2 import fake_liger

GB = 10**9
GB10 = SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True)
H100 = SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 * GB)
H200 = SimpleProps("NVIDIA H200", 9, 0, 132, 141 * GB)
B200 = SimpleProps("NVIDIA B200", 10, 0, 148, 180 * GB)
RTX5090 = SimpleProps("NVIDIA GeForce RTX 5090", 12, 0, 170, 32 * GB)


@pytest.fixture
def old_triton(monkeypatch):
    """A CUDA box whose Triton (3.5.1) bundles a CUDA 12.8 ptxas; `use(props, candidates)` picks the
    GPU and the system ptxas binaries found."""
    for name in P.PTXAS_ENV + (P.PATCHED_ENV,):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(P, "triton_version", lambda: "3.5.1")
    monkeypatch.setattr(P, "bundled_ptxas_version", lambda cc: (12, 8))

    def use(props, candidates=()):
        spec = detect_device(props=props)
        monkeypatch.setattr(P, "detect_device", lambda *a, **k: spec)
        monkeypatch.setattr(P, "find_system_ptxas", lambda: list(candidates))
        monkeypatch.setattr(P, "ptxas_version", lambda path: dict(candidates).get(path))
        return spec
    return use


@pytest.mark.parametrize("kernel", ["triton", "liger"])
def test_kernel_that_no_ptxas_serves_is_refused_in_the_early_check(old_triton, monkeypatch, kernel):
    """GB10 + Triton 3.5 + no CUDA 13 ptxas: check_kernel (base_train's check before it claims the
    checkpoint directory) passed, and training's apply_patches raised PtxasMissing only after the
    directory (with its writer lock), the data loaders and the model on the GPU existed."""
    import os

    from nanochat.kernels import check_kernel
    fake_liger(monkeypatch)
    old_triton(GB10)
    with pytest.raises(PtxasMissing, match=rf"^--kernel {kernel}: Triton 3\.5\.1's bundled ptxas \(12\.8\) cannot "
                                           r"target sm_121 .*--kernel current --no-compile"):
        check_kernel(kernel, "cuda")
    before = dict(os.environ)
    old_triton(GB10, [("/usr/local/cuda-13.0/bin/ptxas", (13, 0))])
    check_kernel(kernel, "cuda")            # a CUDA 13 ptxas on the box: fine,
    assert dict(os.environ) == before       # and the check is a dry run (the patch sets the env later)
    old_triton(H100)
    check_kernel(kernel, "cuda")            # sm_90: the bundled 12.8 serves it
    old_triton(RTX5090)
    check_kernel(kernel, "cuda")            # sm_120 too (12.8 is its minimum)


def _fake_ctx(env):
    return PatchContext(env=env, dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
                        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
                        inductor_modules=[types.SimpleNamespace(is_big_gpu=lambda *_: False)],
                        triton_version="3.5.1", bundled_ptxas_version=(12, 8),
                        ptxas_candidates=[("/usr/local/cuda-13.0/bin/ptxas", (13, 0))], torch_version="2.10.0")


def test_no_compile_run_records_the_patches_init_runtime_applied(monkeypatch):
    """GB10 with --no-compile: init_runtime had applied the runtime set (ptxas, is_big_gpu, ...), but
    the banner's and checkpoint's `patches` listed only training's own call (expandable_segments,
    sm121_warning), while the preflight report for the same flags names both sets."""
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth
    from nanochat.training import setup_precision_and_kernel

    spec = detect_device(props=GB10)
    env: dict = {}
    monkeypatch.setattr(P, "detect_device", lambda *a, **k: spec)
    monkeypatch.setattr(PatchContext, "real", classmethod(lambda cls, s: _fake_ctx(env)))
    monkeypatch.setattr(P, "_LOGGED", set())
    runtime = P.apply_runtime_patches(spec)          # what init_runtime does on this GPU
    assert {"ptxas", "is_big_gpu"} <= set(runtime)
    rt = types.SimpleNamespace(device=torch.device("cpu"), device_type="cpu", dtype=torch.float32,
                               dtype_name="fp32", world_size=1, rank=0)
    model = build_model(config_for_depth(1, 64, 16, aspect_ratio=32, head_dim=16, window_pattern="L"), "cpu")
    info = setup_precision_and_kernel(model, "auto", "current", rt, compile=False)
    assert set(runtime) <= set(info["patches"]), info["patches"]
    assert len(info["patches"]) == len(set(info["patches"]))   # each once
    assert env["TRITON_PTXAS_PATH"] == "/usr/local/cuda-13.0/bin/ptxas"


@pytest.mark.parametrize("props, expect", [
    (GB10, {"bf16": 125, "fp8": 250, "nvfp4": 500}),      # spec-derived (DESIGN.md s3)
    (H100, {"bf16": 989.4, "fp8": 1978.9, "nvfp4": None}),
    (H200, {"bf16": 989.4, "fp8": 1978.9, "nvfp4": None}),
    (B200, {"bf16": 2250, "fp8": 4500, "nvfp4": 9000}),
    (RTX5090, {"bf16": 209.5, "fp8": 419.0, "nvfp4": 1676.0}),
])
def test_mfu_peaks_per_precision(monkeypatch, props, expect):
    """The peaks base_train's meter divides by (resolve_peak_flops): MFU always against bf16, util
    against the active precision's own; emulated nvfp4 (peak key bf16) against bf16."""
    from nanochat.step_meter import resolve_peak_flops
    spec = detect_device(props=props)
    monkeypatch.setattr(P, "detect_device", lambda *a, **k: spec)
    rt = types.SimpleNamespace(device=torch.device("cpu"), device_type="cuda", world_size=1)
    for key, tflops in expect.items():
        bf16, act, name = resolve_peak_flops(rt, key, warn=pytest.fail)
        assert bf16 == pytest.approx(expect["bf16"] * 1e12) and name == props.name
        assert act == (None if tflops is None else pytest.approx(tflops * 1e12))
    assert spec.cc == (props.major, props.minor) and spec.sms == props.multi_processor_count
    assert spec.unified_memory == (props is GB10)
