"""fp8_qk: the fp8 q/k projection + QK-norm + RoPE as one autograd function, whose backward takes
the gradient's abs-max from the rotary kernel. It must reproduce Fp8Linear ('save') followed by
fused_norm.rotary_norm exactly (same scales, casts and GEMMs); on CPU the fp8 GEMM is emulated in
float64 (torch has no CPU _scaled_mm), on the GPU the real one runs."""
import pytest
import torch
import torch.nn as nn

from nanochat import fp8_qk, fused_norm
from nanochat import precision as PR
from nanochat.gpt import rotary_tables
from tests.test_precision import _emulated_scaled_mm


def _case(device="cpu", dtype=torch.float32, B=2, T=8, H=2, D=16, C=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, C, generator=g).to(device, dtype)
    lin = nn.Linear(C, H * D, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(H * D, C, generator=g) / C ** 0.5)
    layer = PR._rebuild(type("Fp8LinearG", (PR.Fp8Linear,), {"grad_dtype": torch.float8_e5m2}), lin.to(device))
    cos, sin = rotary_tables(T, D, device)
    dout = torch.randn(B, T, H, D, generator=g).to(device, dtype)
    return layer, x, cos, sin, dout, H


def _run(fn, layer, x, cos, sin, dout, H):
    layer.weight.grad = None
    xl = x.clone().requires_grad_()
    out = fn(layer, xl, cos, sin, H, fused_norm.rotary_norm)
    out.backward(dout)
    return out.detach(), xl.grad, layer.weight.grad


def _plain(layer, x, cos, sin, heads, rotary_norm):
    B, T, _ = x.shape
    return rotary_norm(layer(x).view(B, T, heads, -1), cos, sin)


def test_fused_equals_fp8_linear_then_rotary_norm(monkeypatch):
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm)
    case = _case()
    assert fp8_qk.fusable(case[0], case[1])
    fused = _run(fp8_qk.proj_rotary_norm, *case)
    plain = _run(_plain, *case)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
    assert fused[2].abs().max() > 0 and fused[1].abs().max() > 0


def test_unfusable_layers_take_the_plain_path():
    """A bf16 Linear, a non-'save' fp8 layer, grad disabled or rows not a multiple of 16: the plain
    chain (what the model did before), never the fused function."""
    layer, x, cos, sin, dout, H = _case()
    plain_lin = nn.Linear(x.shape[-1], layer.weight.shape[0], bias=False)
    assert not fp8_qk.fusable(plain_lin, x)
    layer.wgrad_mode = "recompute"
    assert not fp8_qk.fusable(layer, x)
    layer.wgrad_mode = "save"
    assert not fp8_qk.fusable(layer, x[:, :3])     # 6 rows
    with torch.no_grad():
        assert not fp8_qk.fusable(layer, x)
        out = fp8_qk.proj_rotary_norm(plain_lin, x, cos, sin, H, fused_norm.rotary_norm)
    assert out.shape == (x.shape[0], x.shape[1], H, layer.weight.shape[0] // H)


def test_gpt_uses_the_qkv_projection_while_training_only():
    """GPT.set_qkv_projection: called once per layer with grad enabled, with the same loss as
    without it; never under no_grad (inference); a non-callable is refused."""
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth
    torch.manual_seed(0)
    model = build_model(config_for_depth(2, 128, 32, aspect_ratio=32, head_dim=32), "cpu")
    idx = torch.randint(0, 128, (2, 32))
    want = model(idx, idx)
    calls = []

    def recording(attn, x, cos, sin):
        calls.append(attn.layer_idx)
        return fp8_qk.qkv_projection(attn, x, cos, sin)

    model.set_qkv_projection(recording)
    assert torch.equal(model(idx, idx), want) and calls == list(range(len(model.blocks)))
    with torch.no_grad():
        model(idx)
    assert len(calls) == len(model.blocks)
    model.set_qkv_projection(None)
    with pytest.raises(ValueError, match="set_qkv_projection"):
        model.set_qkv_projection("fast")


@pytest.mark.cuda
def test_cuda_fused_equals_plain_bf16():
    """The real fp8 GEMMs and the Triton rotary kernel (its atomic abs-max) at a d20-like head
    shape: output and both gradients equal to the unfused chain's."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs cc >= 8.9")
    case = _case("cuda", torch.bfloat16, B=4, T=256, H=10, D=128, C=1280)
    fused = _run(fp8_qk.proj_rotary_norm, *case)
    plain = _run(_plain, *case)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)
