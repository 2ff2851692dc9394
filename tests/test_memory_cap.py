"""On unified memory (GB10) the caching allocator is capped at MemAvailable less 10%, once per
process: without a cap a batch too big grows into the host's RAM and can hang the machine instead
of raising out-of-memory (DESIGN s4.3). Simulated device properties, a fake allocator setter."""

import re

import pytest
import torch
from test_platform import GB10, H100, fake_ctx

from nanochat import platform as P
from nanochat.platform import detect_device

MEMINFO = "MemTotal:  125000000 kB\nMemAvailable:  100000000 kB\n"   # 102.4 GB available


def _ctx(env=None, meminfo=MEMINFO, total=128 * 10**9):
    ctx, calls = fake_ctx(env=env), []
    ctx.set_memory_fraction, ctx.total_memory, ctx.meminfo = calls.append, (lambda: total), meminfo
    return ctx, calls


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
    monkeypatch.setattr(P, "_MEMORY_CAP", [])
    monkeypatch.setattr(P, "_LOGGED", set())


def test_gb10_allocator_capped_once_at_mem_available_less_headroom(caplog):
    gb10 = detect_device(props=GB10)
    ctx, calls = _ctx()
    with caplog.at_level("WARNING"):
        assert P.patch_memory_cap(gb10, ctx) == "memory_cap"
    assert calls == [pytest.approx(100_000_000 * 1024 * 0.9 / 128e9)]
    assert P.memory_cap_bytes() == int(100_000_000 * 1024 * 0.9)
    assert "allocator capped at 92.2 GB of 128.0" in caplog.text and P.MEMORY_CAP_ENV in caplog.text
    # later calls (training's apply_patches after init_runtime's) keep the first cap: MemAvailable
    # then counts this process's own memory as used
    ctx.meminfo = "MemAvailable:  1000 kB\n"
    assert P.patch_memory_cap(gb10, ctx) == "memory_cap" and len(calls) == 1
    assert "memory_cap" in P.apply_patches(gb10, compile=False, ctx=ctx) and len(calls) == 1


def test_the_cap_follows_the_environment_variable():
    gb10 = detect_device(props=GB10)
    ctx, calls = _ctx(env={P.MEMORY_CAP_ENV: "off"})
    assert P.patch_memory_cap(gb10, ctx) is None and calls == [] and P.memory_cap_bytes() is None
    ctx, calls = _ctx(env={P.MEMORY_CAP_ENV: "64"})
    assert P.patch_memory_cap(gb10, ctx) == "memory_cap" and calls == [pytest.approx(0.5)]
    for bad in ("abc", "0", "-5", "inf", "nan"):
        P._MEMORY_CAP.clear()
        ctx, calls = _ctx(env={P.MEMORY_CAP_ENV: bad})
        with pytest.raises(ValueError, match=rf"^{P.MEMORY_CAP_ENV}='{re.escape(bad)}': accepted: a size in GB .* or off"):
            P.patch_memory_cap(gb10, ctx)
        assert calls == []
    P._MEMORY_CAP.clear()   # more than the GPU's memory: fraction 1, the cap is the memory itself
    ctx, calls = _ctx(env={P.MEMORY_CAP_ENV: "500"})
    assert P.patch_memory_cap(gb10, ctx) == "memory_cap" and calls == [1.0] and P.memory_cap_bytes() == 128 * 10**9


def test_no_cap_on_discrete_gpus_in_tests_or_without_mem_available(caplog):
    ctx, calls = _ctx()
    assert P.patch_memory_cap(detect_device(props=H100), ctx) is None and calls == []
    assert P.patch_memory_cap(detect_device(props=GB10), fake_ctx()) is None   # no setter: tests' contexts
    ctx, calls = _ctx(meminfo="MemTotal:  1 kB\n")
    with caplog.at_level("WARNING"):
        assert P.patch_memory_cap(detect_device(props=GB10), ctx) is None and calls == []
    assert "not capped" in caplog.text and "MemAvailable" in caplog.text


def test_the_patch_names_its_versions_and_torch_has_the_call():
    assert re.search(r"torch >= \d+\.\d+", P.patch_memory_cap.__doc__)
    assert callable(torch.cuda.set_per_process_memory_fraction)


CUDA_CHILD = r"""
import dataclasses, sys, torch
from nanochat import platform as P
spec = dataclasses.replace(P.detect_device("cuda"), unified_memory=True)   # a GB10's cap on this GPU
ctx = P.PatchContext.real(spec)
ctx.meminfo = "MemAvailable:  2000000 kB\n"      # 2.05 GB: capped at 1.84 GB
assert "memory_cap" in P.apply_patches(spec, compile=False, ctx=ctx)
small = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")     # 1 GiB fits
try:
    big = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")   # 3 GiB does not
except torch.cuda.OutOfMemoryError as e:
    print("OOM", P.memory_cap_bytes())
    sys.exit(0)
print("NO OOM")
sys.exit(1)
"""


@pytest.mark.cuda
@pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"])
def test_the_cap_turns_an_oversized_allocation_into_out_of_memory_on_a_gpu(alloc_conf):
    """On a real GPU (any: the cap is the caching allocator's, unified memory or not), with and
    without expandable segments (GB10 runs with them)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTORCH_ALLOC_CONF": alloc_conf}
    out = subprocess.run([sys.executable, "-c", CUDA_CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("OOM 1843200000"), out.stdout + out.stderr
