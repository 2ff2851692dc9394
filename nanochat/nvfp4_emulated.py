"""Emulated nvfp4 (`--precision nvfp4 --precision-backend emulated`): fake quantisation of a
Linear's input and weight to e2m1 values with 16-element e4m3 block scales and a per-tensor fp32
scale, as NVIDIA's NVFP4 format stores them, with straight-through gradients (the backward runs in
bf16). Plain torch, so it runs on any GPU, MPS or CPU: for numerics studies, not for speed.
nanochat/precision.py owns the choice of backend and the layer swap.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def round_to_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round |y| <= 6 to the nearest e2m1 value, ties to the even mantissa (as hardware does)."""
    grid = torch.tensor(E2M1_GRID, device=y.device, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2
    a = y.abs().float().clamp(max=E2M1_MAX)
    idx = torch.bucketize(a, mids)                   # a == mid -> lower neighbour
    odd_lower = torch.tensor([0, 1, 0, 1, 0, 1, 0], device=y.device, dtype=torch.bool)
    tie = a == mids[idx.clamp(max=len(mids) - 1)]
    idx = idx + (tie & odd_lower[idx.clamp(max=len(mids) - 1)]).long()   # round up to the even one
    return torch.copysign(grid[idx], y.float())


def round_to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float32 0 <= v <= 448 to the nearest e4m3 value (ties to even), as the float8_e4m3fn
    cast does, in float32 arithmetic: MPS had no float8 dtypes up to torch 2.11 at least (pytorch
    #132624), and the emulation is meant to run there. 3 mantissa bits: steps of 2^(e-3) in
    [2^e, 2^(e+1)), 2^-9 below 2^-6."""
    e = torch.floor(torch.log2(v.clamp(min=2.0**-9)))
    p = torch.exp2(e)   # log2 may round across a power of two: fix e so that 2^e <= v < 2^(e+1)
    e = torch.where(p > v, e - 1, torch.where(2 * p <= v, e + 1, e)).clamp(min=-6)
    step = torch.exp2(e - 3)
    return torch.round(v / step) * step


def quantize_nvfp4(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e2m1 values as float, e4m3 block scales as float, fp32 tensor scale) along the last dim;
    x ~= values * block_scale[..., None] * tensor_scale."""
    if x.shape[-1] % block:
        raise ValueError(f"nvfp4 needs the last dim ({x.shape[-1]}) divisible by {block}")
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = x.detach().abs().amax().float()
    tensor_scale = torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))
    block_amax = xb.detach().abs().amax(dim=-1)
    block_scale = (block_amax / E2M1_MAX / tensor_scale).clamp(max=E4M3_MAX)
    block_scale = round_to_e4m3(block_scale)
    denom = block_scale * tensor_scale
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    values = torch.where(denom[..., None] > 0, round_to_e2m1(xb / safe[..., None]), 0.0)
    return values, block_scale, tensor_scale


def fake_quant_nvfp4(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Dequantised nvfp4 with straight-through gradient (identity in backward)."""
    values, block_scale, tensor_scale = quantize_nvfp4(x, block)
    deq = (values * block_scale[..., None] * tensor_scale).reshape(x.shape).to(x.dtype)
    return x + (deq - x).detach()


class EmulatedNVFP4Linear(nn.Linear):
    """nn.Linear whose training forward sees nvfp4-quantised x and w (16-blocks along K)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled():
            # the master weight is quantised (as native fp8 and TE quantise theirs), then cast:
            # quantising its bf16-rounded copy rounded twice, and its amax, block scales and codes
            # were the copy's (~2% of the block scales and ~1% of the e2m1 codes differed on Gaussian
            # weights; e.g. 0.2500001 x scale became the 0.25 tie and rounded to 0, not 0.5)
            x, w = fake_quant_nvfp4(x), fake_quant_nvfp4(w)
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
