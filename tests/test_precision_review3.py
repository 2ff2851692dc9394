"""Third review of --precision / --precision-backend / --kernel as a user picks them: regressions
for what it found (each test names the symptom), all in-process on CPU with simulated devices."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from nanochat import precision as PR
from nanochat import weight_cache
from nanochat.gpt import GPT, Linear, config_for_depth
from nanochat.platform import SimpleProps, detect_device

H100 = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 * 10**9))
GB10 = detect_device(props=SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9))
CPU = detect_device("cpu")


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = GPT(config_for_depth(2, 96, 32, aspect_ratio=64, head_dim=32), attn_backend="sdpa", compute_dtype=dtype)
    model.init_weights()
    return model


# ------------------------------------------------------------------------------------ weight-cache slots

@pytest.mark.parametrize("plan", [PR.PrecisionPlan("nvfp4", "emulated"), PR.PrecisionPlan("fp8", "native")])
def test_swapped_layers_get_no_step_cast_copy(plan):
    """precision.py's layers cast their own (fp32 master) weights; weight_cache's docstring says they
    have no slot. _rebuild copied gpt.Linear's slot and sink buffers into them, so with gradient
    accumulation every step also made a bf16 copy and a zeroed float32 sink of each swapped weight
    (d20 fp8: ~1.3 GB never read, plus a pass over them per step), and the fused fp8 MLP
    (weight_or_copy) quantised the bf16-rounded copy instead of the master Fp8Linear uses."""
    model = _model()
    plain = {id(m) for m in weight_cache.slots(model)}
    PR.convert_model(model, plan, CPU if plan.backend == "emulated" else H100)
    swapped = [m for m in model.modules() if isinstance(m, (PR.Fp8Linear, PR.EmulatedNVFP4Linear))]
    assert len(swapped) == len(plan.converted) > 0
    slots = weight_cache.slots(model)
    assert not [m for m in slots if m in swapped]
    assert {id(m) for m in slots} < plain and model.lm_head in slots   # the kept layers keep theirs
    with weight_cache.step_weights(model, torch.bfloat16) as n:
        assert n == len(slots)
        for m in swapped:   # what the fused MLP / q/k/v ops read: the master itself
            assert weight_cache.weight_or_copy(m, torch.bfloat16) is m.weight
    assert set(model.state_dict()) == set(_model().state_dict())   # checkpoint keys unchanged


def test_emulated_training_step_same_gradients_with_and_without_cast_once():
    """Two accumulated micro-batches at emulated nvfp4: the same loss and gradients whether the
    Trainer casts once per step (weight_cache) or per use."""
    def grads(cached):
        model = _model()
        PR.convert_model(model, PR.PrecisionPlan("nvfp4", "emulated"), CPU)
        g = torch.Generator().manual_seed(1)
        with weight_cache.step_weights(model, torch.bfloat16, enabled=cached):
            for _ in range(2):
                idx, tgt = (torch.randint(0, 96, (2, 32), generator=g) for _ in range(2))
                (model(idx, tgt) / 2).backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    a, b = grads(False), grads(True)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------ TE without the fp8 recipe

class _Format:
    HYBRID = "HYBRID"


def _te_without_current_scaling():
    """The recipe module of an older TE (1.x, as in 2024 NGC containers): DelayedScaling only."""
    delayed = dataclasses.make_dataclass("DelayedScaling", [("fp8_format", object, dataclasses.field(default=None))])
    return types.SimpleNamespace(Format=_Format, DelayedScaling=delayed)


@pytest.mark.parametrize("spec", [H100, GB10], ids=["h100", "gb10"])
def test_te_fp8_without_float8_current_scaling_refused_before_the_model(spec):
    """--precision fp8 --precision-backend te with a TE that has no Float8CurrentScaling: resolve()
    (check_precision, before the model and the data) passed it, and the run died with an
    AttributeError in build_te_recipe after the model was built."""
    te = _te_without_current_scaling()
    with pytest.raises(ValueError, match=r"^--precision-backend te: .*Float8CurrentScaling.*native"):
        PR.resolve("fp8", "te", spec, te_available=True, te_recipe=te)
    from nanochat.precision_te import build_te_recipe
    with pytest.raises(ValueError, match="Float8CurrentScaling"):
        build_te_recipe("fp8", spec, te)
    # a TE that has it still resolves (and auto never needs TE for fp8)
    te.Float8CurrentScaling = te.DelayedScaling
    assert PR.resolve("fp8", "te", spec, te_available=True, te_recipe=te).backend == "te"
    no_cs = _te_without_current_scaling()
    assert PR.resolve("fp8", "auto", spec, te_available=True, te_recipe=no_cs).backend == "native"


# ------------------------------------------------------------------------------------ nothing to convert

def test_precision_request_that_converts_no_layer_raises():
    """A model whose widths are not multiples of the format's alignment (e.g. --head-dim 8
    --aspect-ratio 4: width 8) kept every Linear in bf16: `--precision nvfp4|fp8` then ran a plain
    bf16 run labelled nvfp4/fp8 in the banner, the checkpoint and util(); an explicit request that
    is not met must raise, naming the flag and what would work."""
    rt = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16, dtype_name="bf16")
    model = GPT(config_for_depth(2, 96, 32, aspect_ratio=4, head_dim=8), attn_backend="sdpa",
                compute_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^--precision nvfp4: .*no Linear layer.*multiples of 32.*--precision auto"):
        PR.apply_precision(model, "nvfp4", rt, "emulated", compile=False)
    assert all(type(m) is Linear for m in model.modules() if isinstance(m, torch.nn.Linear))   # left as it was
    info = PR.apply_precision(_model(), "nvfp4", rt, "emulated", compile=False)   # width 128: converted
    assert info["converted"] > 0


# ------------------------------------------------------------------------------------ emulated nvfp4 without float8

def test_e4m3_rounding_without_the_float8_dtype_is_bit_exact():
    """The emulated block scales' e4m3 rounding, done in float32 arithmetic, equals torch's
    float8_e4m3fn cast on every representable value, every midpoint (ties to even) and a sweep."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    sweep = torch.logspace(-12, torch.log10(torch.tensor(448.0)).item(), 20001)
    v = torch.cat([grid, mids, sweep, torch.tensor([0.0, 1e-30, 2.0**-10, 447.9, 448.0])])
    assert torch.equal(PR.round_to_e4m3(v), v.to(torch.float8_e4m3fn).float())


def test_emulated_nvfp4_runs_where_float8_dtypes_do_not(monkeypatch):
    """--precision nvfp4 --precision-backend emulated "runs on any GPU or CPU", but its block scales
    went through a float8_e4m3fn tensor, which MPS lacked (pytorch #132624, torch <= 2.11) ("Trying to
    convert Float8_e4m3fn to the MPS backend"): the start-up check crashed after the model was
    built. Simulated here by refusing float8 casts; results equal the float8 path's."""
    torch.manual_seed(0)
    x = torch.randn(8, 64) * torch.logspace(-6, 2, 64)   # blocks far below the tensor's amax: subnormal scales
    ref = PR.quantize_nvfp4(x)
    real_to = torch.Tensor.to

    def no_float8(self, *args, **kwargs):
        if any(a in (torch.float8_e4m3fn, torch.float8_e5m2) for a in (*args, kwargs.get("dtype"))):
            raise TypeError("Trying to convert Float8_e4m3fn to the MPS backend but it does not have support")
        return real_to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", no_float8)
    got = PR.quantize_nvfp4(x)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    rel = PR.startup_check(PR.PrecisionPlan("nvfp4", "emulated"), CPU, torch.device("cpu"), torch.bfloat16, False)
    assert 0 < rel < 0.25
