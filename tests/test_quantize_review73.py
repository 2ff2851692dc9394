"""Review 73 of `--quantize int8` (nanochat/quantize.py, scripts/bench_int8.py): the dequantising
product in float16 (the unscaled int8 sums overflowed fp16 where the answer was small), rows whose
absmax / 127 underflows (a zero scale: inf / NaN quotients cast to int8), a load with assign=True
keeping another dtype's row scales (the kernels read float32), bench_int8 timing matrices of
another shape than the model's, and the documented per-element error bound of the product."""

from __future__ import annotations

import pytest
import torch

from nanochat.gpt import GPT, config_for_depth
from nanochat.quantize import Int8Linear, int8_linear, quantize_model, quantize_rows


def test_fp16_dequantising_product_does_not_overflow():
    """CPU (and CUDA prefills over 64 rows) multiplied x by the unscaled int8 weight in fp16 and
    scaled afterwards: sum(x * q) reaches 127 * K * |x|, past fp16's 65504, though the scaled
    output (here ~33) fits easily. It came out inf; the Triton kernel (float32 sums) gave 33."""
    torch.manual_seed(0)
    w = torch.randn(8, 4096) * 0.01
    q, s = quantize_rows(w)
    x = torch.sign(w[:1]).repeat(3, 1).to(torch.float16)   # a row aligned with weight row 0
    want = x.double() @ (q.double() * s.double()[:, None]).T
    got = int8_linear(x, q, s)
    assert got.dtype == torch.float16 and bool(torch.isfinite(got).all()), got[:, 0]
    assert 20 < want[0, 0] < 60
    assert (got.double() - want).abs().max() <= 1e-3 * want.abs().max()


def test_rows_whose_scale_underflows_are_zero_rows():
    """absmax / 127 of a row of denormals rounds to 0: w / 0 gave +-inf (clamped to +-127) and
    0 / 0 NaN, cast to int8 (undefined behaviour; 0 on this CPU): q held +-127 at scale 0."""
    w = torch.tensor([[1e-45, 0.0, -1e-45, 0.0],   # the smallest denormal: absmax / 127 == 0
                      [1e-39, 5e-40, 0.0, -1e-39],  # a denormal scale, still > 0
                      [1.0, 0.25, 0.0, -1.0]])
    q, s = quantize_rows(w)
    assert bool((s > 0).all()), s
    assert q[0].tolist() == [0, 0, 0, 0] and s[0] == 1
    assert q[1].tolist() == [127, 64, 0, -127] and q[2].tolist() == [127, 32, 0, -127]
    assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 * (1 + 1e-6)).all())


def _tiny(seed: int) -> GPT:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(config_for_depth(2, 512, 128))
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():   # the zero-initialised projections get values
        for p in model.parameters():
            if p.dim() == 2 and not p.abs().max() > 0:
                p.normal_(0, 0.05)
    return model.eval()


def test_assign_load_keeps_float32_scales():
    """load_state_dict(assign=True) put the state_dict's tensors in place as they were: scales
    saved in bf16 (a state_dict cast to shrink it) stayed bf16 in the model, while the persistent
    decode step reads each scale's address as float32 (triton_decode's pointer table)."""
    src = quantize_model(_tiny(1), "int8")
    state = {k: v.to(torch.bfloat16) if k.endswith(".scale") else v for k, v in src.state_dict().items()}
    dst = quantize_model(_tiny(2), "int8")
    dst.load_state_dict(state, strict=True, assign=True)
    for name, m in dst.named_modules():
        if isinstance(m, Int8Linear):
            assert m.scale.dtype == torch.float32 and m.qweight.dtype == torch.int8, name
            assert torch.equal(m.scale, state.get(name + ".scale", m.scale).float()), name
    attn = dst.blocks[1].attn   # the q/k/v views follow the converted rows, not the bf16 ones
    assert attn.c_k.scale.data_ptr() == attn.qkv_quant.scale.data_ptr() + 4 * attn.c_q.out_features
    x = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        assert bool(torch.isfinite(dst(x)).all())


@pytest.mark.parametrize("depth,vocab", [(1, 512), (20, 32768), (21, 50257)])
def test_bench_int8_times_the_models_matrices(depth, vocab):
    """bench_int8 built its shapes as width 64 x depth and the raw vocab: d21's model is 1408 wide
    (rounded up to a multiple of the head dim), not 1344, and a 50,257-token lm_head has 50,304
    (padded) rows, so the benchmark timed matrices no model has."""
    from scripts.bench_int8 import matrices

    with torch.device("meta"):
        model = GPT(config_for_depth(depth, vocab, 256))
    a, m = model.blocks[0].attn, model.blocks[0].mlp
    want = {"qkv": (a.c_q.out_features + a.c_k.out_features + a.c_v.out_features, a.c_q.in_features),
            "attn_proj": tuple(a.c_proj.weight.shape), "mlp_fc": tuple(m.c_fc.weight.shape),
            "mlp_proj": tuple(m.c_proj.weight.shape), "lm_head": tuple(model.lm_head.weight.shape)}
    assert matrices(depth, vocab) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_product_error_within_half_a_step_per_weight(dtype):
    """The documented bound: each weight is within half its row's step (absmax / 254) of q *
    scale, so |x @ W.T - int8_linear(x)| <= sum|x| * absmax / 254 per output, plus the output's
    rounding to the compute dtype. Rows of very different scales and one huge outlier."""
    torch.manual_seed(3)
    w = torch.randn(48, 320) * torch.logspace(-3, 0, 48)[:, None]
    w[7, 11] = 40.0   # one outlier: the rest of that row rounds coarsely, still within the bound
    q, s = quantize_rows(w)
    for rows in (1, 5, 130):
        x = torch.randn(rows, 320).to(dtype)
        exact = x.double() @ w.double().T
        got = int8_linear(x, q, s).double()
        eps = {torch.float32: 2**-23, torch.bfloat16: 2**-8, torch.float16: 2**-10}[dtype]
        bound = x.double().abs().sum(1, keepdim=True) * (w.double().abs().amax(1) / 254) + 2 * eps * exact.abs() + 1e-6
        assert bool(((got - exact).abs() <= bound).all()), (dtype, rows)
