"""util(fp8|nvfp4) divides by the peak the run's FLOPs can reach: the converted layers' GEMMs at the
precision's peak, the rest (attention, lm_head, a bf16 backward) at bf16."""

import types

import pytest
import torch

from nanochat import precision as PR
from nanochat.gpt import GPT, config_for_depth
from nanochat.platform import detect_device
from nanochat.step_meter import StepMeter, blended_peak, describe_peaks


def _model():
    return GPT(config_for_depth(2, 256, 64, aspect_ratio=64, head_dim=64), attn_backend="sdpa",
               compute_dtype=torch.bfloat16)


def _converted(precision, backend, recipe):
    model = _model()
    plan = PR.PrecisionPlan(precision, backend, recipe)
    if backend == "te":   # TE is not installed here: the swap alone, as te_factory would do it
        plan.converted, plan.kept_high_precision = PR.swap_linears(model, precision, lambda old: old)
    else:
        PR.convert_model(model, plan, detect_device("cpu"), compile=False)
    return model, plan


def test_low_precision_flops_follow_the_recipe():
    model, native = _converted("fp8", "native", {"scaling": "tensorwise"})
    # every block Linear but the value-embedding gates (dims not multiples of 16: kept, bf16)
    matrices = sum(m.weight.numel() for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.startswith("blocks.") and min(m.weight.shape) >= 16)
    assert 0 < model.param_counts()["transformer_matrices"] - matrices <= 64
    assert native.converted and native.backward_low
    assert PR.low_precision_flops(model, native) == 6 * matrices        # fwd, dgrad and wgrad in fp8
    # TE NVFP4 with backward_override: only the forward (2 of the 6 FLOPs per weight) runs in fp4
    _, te_bf16_bwd = _converted("nvfp4", "te", {"recipe": "NVFP4BlockScaling", "backward_override": "high_precision"})
    assert not te_bf16_bwd.backward_low and PR.low_precision_flops(model, te_bf16_bwd) == 2 * matrices
    _, te_fp4_bwd = _converted("nvfp4", "te", {"recipe": "NVFP4BlockScaling", "backward_override": "None"})
    assert PR.low_precision_flops(model, te_fp4_bwd) == 6 * matrices
    _, emulated = _converted("nvfp4", "emulated", {})
    assert emulated.converted and PR.low_precision_flops(model, emulated) == 0   # bf16 matmuls


def test_blended_peak_and_util():
    bf16, fp4 = 125e12, 500e12        # GB10's spec-derived dense peaks
    assert blended_peak(bf16, fp4, 6.0, 6.0) == pytest.approx(fp4)
    assert blended_peak(bf16, fp4, 6.0, 0.0) == pytest.approx(bf16)
    # 2 of 6 FLOPs at fp4: 6 / (2/500 + 4/125) TFLOP/s = 166.7
    assert blended_peak(bf16, fp4, 6.0, 2.0) == pytest.approx(6 / (2 / fp4 + 4 / bf16))
    assert blended_peak(bf16, fp4, 6.0, None) == fp4 and blended_peak(None, fp4, 6.0, 2.0) == fp4
    meter = StepMeter(6e9, 1, peak_bf16=bf16, peak_active=fp4, precision="nvfp4", warmup_steps=0,
                      low_precision_flops=2e9)
    r = types.SimpleNamespace(step=0, loss=1.0, lrm=1.0, dt=1.0, tokens=20_000, grad_norm=None)
    m = meter.update(r)
    # 1.2e14 FLOP/s: 96% of the bf16 peak (MFU), 72% of the blend, 24% of the fp4 peak alone
    assert m["mfu"] == pytest.approx(96.0) and m["util"] == pytest.approx(72.0)
    assert meter.low_share == pytest.approx(1 / 3)
    rt = types.SimpleNamespace(device=torch.device("cpu"))
    text = describe_peaks(rt, "nvfp4", bf16, fp4, None, meter.peak_util, meter.low_share)
    assert "util() against 1.6667e+14 (33% of the FLOPs at nvfp4, the rest at bf16)" in text
