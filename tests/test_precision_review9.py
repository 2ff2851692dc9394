"""Review 9 of the precision path: the emulated nvfp4 layer checked against a float64 reference of
NVIDIA's two-level scaling (fp32 tensor scale amax / (6 * 448), e4m3 16-element block scales, e2m1
codes with ties to even), including saturation, zeros and non-finite inputs. CPU only, < 2 s."""

from __future__ import annotations

import torch

from nanochat import precision as PR

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
EVEN = torch.tensor([True, False, True, False, True, False, True, False])   # mantissa bit 0


def nvfp4_f64(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Dequantised NVFP4 of `x` computed in float64 from the exact input (brute-force nearest code)."""
    xb = x.double().reshape(-1, block)
    ts = x.double().abs().max() / (6 * 448)
    bs = (xb.abs().amax(dim=1) / 6 / ts).clamp(max=448).to(torch.float8_e4m3fn).double()
    den = (bs * ts)[:, None]
    y = (xb / torch.where(den > 0, den, 1.0)).abs().clamp(max=6)
    dist = (y[..., None] - E2M1).abs()
    tied = dist == dist.min(dim=-1, keepdim=True).values
    pick = torch.where(tied.sum(-1) > 1, (tied & EVEN).float().argmax(-1), tied.float().argmax(-1))
    return (torch.sign(xb) * E2M1[pick] * den).reshape(x.shape)


def _effective_weight(layer: torch.nn.Linear) -> torch.Tensor:
    """The weight the layer's training forward multiplies by: an identity input quantises exactly
    (every block is one 1.0 or zeros), so layer(I) = I @ Wq.T = Wq.T."""
    eye = torch.eye(layer.in_features, dtype=torch.bfloat16)
    return layer(eye).t().float()


def _layer(weight: torch.Tensor) -> PR.EmulatedNVFP4Linear:
    layer = PR._rebuild(PR.EmulatedNVFP4Linear, torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    layer.weight.data.copy_(weight)
    return layer


def test_emulated_layer_quantises_the_fp32_master_weight():
    """The layer quantised the bf16-rounded copy of its fp32 master weight: a second rounding
    (0.2500001 became the tie 0.25 and went to 0 instead of 0.5) and amax / block scales taken from
    the copy, so ~1% of the codes and ~2% of the block scales were not those of the master, which
    native fp8 and TE quantise."""
    w = torch.zeros(32, 32)
    w[0, 0], w[0, 1] = 6.0, 0.2500001   # scale 1: 0.2500001 is above the 0-0.5 midpoint
    assert _effective_weight(_layer(w))[0, 1].item() == 0.5

    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 64, generator=gen) * 0.05).clamp(-0.6, 0.6)
    w[5, 7] = 2688 / 4096   # amax: tensor scale 2^-12, so every dequantised value is exact in bf16
    want = nvfp4_f64(w).float()
    got = _effective_weight(_layer(w))
    assert torch.equal(got, want), (got != want).sum().item()


def test_quantiser_matches_float64_reference_over_a_wide_range():
    """Blocks spanning 10 decades, an all-zero block, exact e2m1 midpoints (ties to even) and values
    that saturate after the block scale rounds down: values and scales agree with float64."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(32, 64, generator=gen) * torch.logspace(-6, 4, 64)
    x[2, :16] = 0.0
    values, bs, ts = PR.quantize_nvfp4(x)
    ours = (values.double() * bs.double()[..., None] * ts.double()).reshape(x.shape)
    assert torch.allclose(ours, nvfp4_f64(x), rtol=1e-6, atol=0)
    assert ours[2, :16].abs().max() == 0
    assert values.abs().max() <= 6 and bs.max() <= 448
    # amax 10.5: tensor scale 2^-8, block scale 448, so x / 1.75 lands exactly on each midpoint
    mids = torch.tensor([6, .25, .75, 1.25, 1.75, 2.5, 3.5, 5, -.25, -.75, -1.25, -1.75, -2.5, -3.5, -5, 0])
    values, bs, ts = PR.quantize_nvfp4(1.75 * mids)
    assert (ts.item(), bs.item()) == (2.0**-8, 448.0)
    assert values.flatten().tolist() == [6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4, 0]


def test_non_finite_inputs_stay_non_finite():
    """A NaN or inf must reach the loss (the trainer's non-finite guard), never quantise to a finite
    value: its block (NaN) or the whole tensor (inf: the tensor scale is inf) comes out non-finite."""
    x = torch.randn(4, 32)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[1, 3] = bad
        q = PR.fake_quant_nvfp4(y)
        assert not torch.isfinite(q[1, :16]).any(), bad
    assert torch.equal(PR.fake_quant_nvfp4(torch.zeros(2, 32)), torch.zeros(2, 32))
