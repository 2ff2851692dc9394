"""Review of platform detection, precision resolution and attention backend routing as a DGX Spark
(GB10, sm_121) user meets them, on simulated device properties (no GPU). Each test failed before
its fix."""

import types

import pytest
import torch

from nanochat import attention as A
from nanochat import platform as P
from nanochat import precision as PR
from nanochat.errors import RequestError
from nanochat.platform import PatchContext, SimpleProps, detect_device

GB = 10**9
GB10 = detect_device(props=SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True))
H100 = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 * GB))
CUDA13 = [("/usr/local/cuda-13.0/bin/ptxas", (13, 0))]


def ctx(env, triton="3.5.1", bundled=(12, 8), candidates=CUDA13):
    return PatchContext(env=env, dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
                        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
                        inductor_modules=[types.SimpleNamespace(is_big_gpu=lambda *_: False)],
                        triton_version=triton, bundled_ptxas_version=bundled, ptxas_candidates=list(candidates),
                        torch_version="2.10.0")


@pytest.mark.parametrize("user_name, other", [("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"),
                                              ("TRITON_PTXAS_BLACKWELL_PATH", "TRITON_PTXAS_PATH")])
def test_a_user_ptxas_under_either_name_reaches_the_name_triton_reads(user_name, other):
    """Triton 3.6-3.8 read only TRITON_PTXAS_BLACKWELL_PATH for sm_100+ (older releases only
    TRITON_PTXAS_PATH). A GB10 user who followed DESIGN s4.1 and exported TRITON_PTXAS_PATH got
    'using TRITON_PTXAS_PATH=... as set' logged and Triton still ran its bundled 12.8 ptxas-blackwell,
    which rejects sm_121a. Now the user's path is carried to the unset name; a value the user gave
    both names is never replaced, and applying the patch again leaves the same state."""
    env = {user_name: "/opt/cuda-13.1/bin/ptxas"}
    assert P.patch_ptxas(GB10, ctx(env), uses_triton=True) == "ptxas(user)"
    assert env[user_name] == env[other] == "/opt/cuda-13.1/bin/ptxas"   # the user's, not the one found
    before = dict(env)
    assert P.patch_ptxas(GB10, ctx(env), uses_triton=True) == "ptxas(user)" and env == before
    # the user's own path in a (child) process that inherits our copy: the copy follows it
    env[user_name] = "/opt/cuda-13.2/bin/ptxas"
    P.patch_ptxas(GB10, ctx(env), uses_triton=True)
    assert env[other] == "/opt/cuda-13.2/bin/ptxas"
    both = {"TRITON_PTXAS_PATH": "/a/ptxas", "TRITON_PTXAS_BLACKWELL_PATH": "/b/ptxas"}
    assert P.patch_ptxas(GB10, ctx(both), uses_triton=True) == "ptxas(user)"
    assert both == {"TRITON_PTXAS_PATH": "/a/ptxas", "TRITON_PTXAS_BLACKWELL_PATH": "/b/ptxas"}
    # a Triton whose bundled ptxas is new enough: the user's variables are not touched at all
    env = {"TRITON_PTXAS_PATH": "/opt/ptxas"}
    assert P.patch_ptxas(GB10, ctx(env, triton="3.6.0", bundled=(13, 0)), uses_triton=True) is None
    assert env == {"TRITON_PTXAS_PATH": "/opt/ptxas"}


def test_fp8_native_does_not_import_transformer_engine(monkeypatch):
    """resolve() imported Transformer Engine (and loaded torch's cuDNN for it) for every fp8 and
    nvfp4 request, native fp8 included: a broken TE install (its shared library failing to load
    raises OSError, which te_available does not catch) stopped `--precision fp8` runs that never
    use TE. Now TE is probed only for --precision-backend te, or nvfp4's auto; torchao only for
    --precision-backend torchao."""
    def broken():
        raise OSError("libtransformer_engine.so: undefined symbol: cudnnGetVersion")
    monkeypatch.setattr(PR, "_te_importable", broken)
    monkeypatch.setattr(PR, "_torchao_available", broken)
    for spec in (GB10, H100):
        for backend in ("auto", "native"):
            plan = PR.resolve("fp8", backend, spec)
            assert (plan.precision, plan.backend) == ("fp8", "native")
        assert PR.resolve("nvfp4", "emulated", spec).backend == "emulated"
    for backend in ("auto", "te"):   # a GPU too old for nvfp4: said so, TE's state does not matter
        with pytest.raises(RequestError, match="--precision nvfp4: needs a Blackwell GPU"):
            PR.resolve("nvfp4", backend, H100)
    with pytest.raises(OSError):   # asked for TE: its breakage is the answer
        PR.resolve("fp8", "te", H100)
    with pytest.raises(OSError):
        PR.resolve("fp8", "torchao", H100)


def test_fp32_window_layers_on_the_cudnn_backends_run_flex_not_cudnn(monkeypatch):
    """auto resolves to sdpa_cudnn (or cudnn_fa4) on a GPU once cuDNN's window kernel is proven,
    whatever the run's dtype; that kernel takes bf16/fp16 only, so every window layer of a
    `--precision fp32` GPU run raised "attention backend 'cudnn': dtype torch.float32 is not
    supported". fp32 window layers now take sdpa_flex's block-sparse path (same causal + window +
    GQA contract); bf16 still goes to cuDNN. Checked on CPU tensors (flex's CPU forward)."""
    from nanochat import cudnn_attention

    calls = []
    monkeypatch.setattr(cudnn_attention, "window_attention",
                        lambda q, k, v, window, bwd="cudnn": calls.append((q.dtype, window, bwd)) or q)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 16, generator=g) for h in (4, 2, 2))
    ref = A.reference_attention(q, k, v, window=8)
    with torch.no_grad():
        for backend in ("sdpa_cudnn", "cudnn_fa4"):
            out = A.attention(q, k, v, window=8, backend=backend)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
            full = A.attention(q, k, v, window=None, backend=backend)
            torch.testing.assert_close(full, A.reference_attention(q, k, v), atol=2e-5, rtol=0)
    assert calls == []
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    A.attention(qb, kb, vb, window=8, backend="sdpa_cudnn")
    A.attention(qb, kb, vb, window=8, backend="cudnn_fa4")
    assert calls == [(torch.bfloat16, 8, "cudnn"), (torch.bfloat16, 8, "fa4")]


def test_a_child_process_own_value_of_a_patched_variable_is_kept():
    """The record of what the platform patches set (NANOCHAT_PLATFORM_ENV, inherited by children)
    held names only: a child launched with its own value of such a variable (e.g. its own
    TRITON_PTXAS_BLACKWELL_PATH beside the parent's TRITON_PTXAS_PATH that the parent had copied
    there) had that value taken for ours and replaced. The record now carries a checksum of the
    value, so a different value is the user's."""
    env = {"TRITON_PTXAS_PATH": "/opt/cuda-13.1/bin/ptxas"}
    P.patch_ptxas(GB10, ctx(env), uses_triton=True)   # the parent: copied to the Blackwell name
    assert env["TRITON_PTXAS_BLACKWELL_PATH"] == "/opt/cuda-13.1/bin/ptxas"
    child = dict(env, TRITON_PTXAS_BLACKWELL_PATH="/opt/cuda-13.2/bin/ptxas")   # its launcher's own
    assert P.patch_ptxas(GB10, ctx(child), uses_triton=True) == "ptxas(user)"
    assert child["TRITON_PTXAS_BLACKWELL_PATH"] == "/opt/cuda-13.2/bin/ptxas"
    assert child["TRITON_PTXAS_PATH"] == "/opt/cuda-13.1/bin/ptxas"
    # the same for a patch's own setting: ours is recognised, another value is not
    env = {}
    P._set_env(env, "PYTORCH_ALLOC_CONF", "expandable_segments:True")
    assert P._set_by_us(env, "PYTORCH_ALLOC_CONF")
    env["PYTORCH_ALLOC_CONF"] = "max_split_size_mb:512"
    assert not P._set_by_us(env, "PYTORCH_ALLOC_CONF")
    assert P._set_by_us({"X": "v", P.PATCHED_ENV: "X"}, "X")   # an earlier release's bare record


def test_prepare_masks_builds_the_fp32_window_masks_of_the_cudnn_backends(monkeypatch):
    """fp32 window layers on sdpa_cudnn / cudnn_fa4 run flex (above), but prepare_masks built block
    masks for the flex backends only: under compile each forward built the mask in-graph. It now
    builds them with the block size the fp32 flex call uses (checked on CPU by naming the backend)."""
    monkeypatch.setattr(A, "_BLOCK_MASKS", {})
    monkeypatch.setattr(A, "resolve_backend", lambda backend, device: backend)
    for backend in ("sdpa_cudnn", "cudnn_fa4"):
        A._BLOCK_MASKS.clear()
        assert A.prepare_masks(64, [16, None], "cpu", backend) == backend
        assert set(A._BLOCK_MASKS) == {(64, 16, "cpu")}   # the window layer's, block size as _flex asks
