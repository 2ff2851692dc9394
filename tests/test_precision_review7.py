"""Review 7 of the precision path (`--precision bf16|fp8|nvfp4` x `--precision-backend`): resume
under another precision, the emulated nvfp4 numerics against an independent reference, and the
headline GB10 (sm_121) recipe, simulated on CPU with SimpleProps devices and a fake TE."""

from __future__ import annotations

import dataclasses
import enum
import json
import types

import pytest
import torch
import torch.nn.functional as F

from nanochat import precision as PR
from nanochat.errors import RequestError
from nanochat.platform import SimpleProps, detect_device
from nanochat.precision_te import build_te_recipe
from nanochat.training import resume_precision

GB10 = detect_device(props=SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9))
H100 = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 * 10**9))
A100 = detect_device(props=SimpleProps("NVIDIA A100-SXM4-80GB", 8, 0, 108, 80 * 10**9))


# ------------------------------------------------------------------------------------ resume

def test_resume_precision_change_is_said_and_recorded():
    """A resume under another precision ran silently, and the next checkpoint's meta said bf16 for
    steps an nvfp4 run had trained."""
    nvfp4 = {"precision": "nvfp4", "backend": "emulated"}
    bf16 = {"precision": "bf16", "backend": "none"}
    history, note = resume_precision(nvfp4, bf16, 2)
    assert history == [{"from_step": 0, **nvfp4}, {"from_step": 2, **bf16}]
    assert "--precision nvfp4" in note and "--precision bf16" in note and "steps 0-2" in note
    # the same precision again: the history is carried on, nothing said
    again, note = resume_precision({**bf16, "precision_history": history}, bf16, 4)
    assert again == history and note is None
    # resumed from an earlier checkpoint than the last change: later entries are dropped
    back, note = resume_precision({**bf16, "precision_history": history}, nvfp4, 1)
    assert back == [{"from_step": 0, **nvfp4}, {"from_step": 1, **nvfp4}] and note is not None
    assert resume_precision({}, bf16, 3) == ([{"from_step": 3, **bf16}], None)   # an old meta


def test_base_train_resume_in_another_precision(env, base_dir, capsys):
    """End to end on CPU: an emulated-nvfp4 run saved at step 1, resumed in bf16: the change is
    printed and the new checkpoint's meta keeps which precision trained which steps."""
    from nanochat import checkpoint as ck
    from scripts import base_train
    tiny = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "64", "--head-dim", "32", "--max-seq-len", "32",
            "--device-batch-size", "4", "--total-batch-size", "128", "--sample-every", "-1", "--eval-every", "-1",
            "--eval-tokens", "128", "--no-compile", "--model-tag", "prec7", "--save-every", "1", *env]
    base_train.main(tiny + ["--precision", "nvfp4", "--precision-backend", "emulated", "--num-iterations", "1"])
    capsys.readouterr()
    base_train.main(tiny + ["--precision", "bf16", "--num-iterations", "2", "--resume", "1"])
    assert "trained in --precision nvfp4 (backend emulated); this run continues in --precision bf16" in \
        capsys.readouterr().out
    meta = json.loads((ck.checkpoint_dir("base", "prec7", base_dir) / "step_000002" / "meta.json").read_text())
    assert [(h["from_step"], h["precision"]) for h in meta["train"]["precision_history"]] == [(0, "nvfp4"), (1, "bf16")]


# ------------------------------------------------------------------------------------ emulated numerics

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def reference_nvfp4(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """NVFP4 dequantised, written independently: fp32 tensor scale amax / (6 * 448), e4m3 block
    scales through torch's float8 cast, e2m1 by brute-force nearest with ties to the even code."""
    xb = x.double().reshape(-1, block)
    ts = x.double().abs().max() / (6 * 448)
    bs = (xb.abs().amax(dim=1) / 6 / ts).clamp(max=448).float().to(torch.float8_e4m3fn).double()
    y = (xb / (bs * ts)[:, None]).nan_to_num(0.0)
    dist = (y.abs().clamp(max=6)[..., None] - E2M1).abs()
    best = dist.min(dim=-1, keepdim=True).values
    code = torch.where(dist == best, torch.arange(8) + 100 * (torch.arange(8) % 2), 1000).argmin(dim=-1)
    return (torch.sign(y) * E2M1[code] * bs[:, None] * ts).reshape(x.shape)


def test_emulated_nvfp4_matches_an_independent_reference():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 128, generator=gen) * torch.logspace(-3, 2, 128)   # blocks of very different range
    x[3, :16] = 0.0                                                          # an all-zero block
    values, bs, ts = PR.quantize_nvfp4(x)
    ours = (values * bs[..., None] * ts).reshape(x.shape).double()
    ref = reference_nvfp4(x)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-6
    assert ours[3, :16].abs().max() == 0


def test_emulated_nvfp4_linear_close_to_bf16_and_really_quantised():
    """Relative error of an emulated layer's training forward vs the unquantised product: NVFP4 on
    Gaussian data sits near 0.1-0.15 (2 mantissa bits); a bound of 0.2 fails if the scales go wrong,
    and the lower bound fails if the layer stops quantising (a silent bf16 run)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen) * 0.05
    x = torch.randn(32, 128, generator=gen)
    layer = PR._rebuild(PR.EmulatedNVFP4Linear, torch.nn.Linear(128, 96, bias=False))
    layer.weight.data.copy_(w)
    ref = F.linear(x, w)
    rel = ((layer(x) - ref).norm() / ref.norm()).item()
    assert 0.02 < rel < 0.2, rel
    with PR.eval_precision():   # evaluation runs the plain product
        assert torch.equal(layer(x), ref)


# ------------------------------------------------------------------------------------ GB10, simulated

class Format(enum.Enum):
    E2M1 = 0
    E4M3 = 1
    HYBRID = 2


def te_with(nvfp4_fields: dict):
    def dc(name, fields):
        return dataclasses.make_dataclass(name, [(k, object, dataclasses.field(default=v)) for k, v in fields.items()])
    return types.SimpleNamespace(Format=Format, Float8CurrentScaling=dc("Float8CurrentScaling", {"fp8_format": None}),
                                 NVFP4BlockScaling=dc("NVFP4BlockScaling", nvfp4_fields))


def test_gb10_headline_nvfp4_recipe():
    """`--precision nvfp4` on a GB10: TE, RHT and stochastic rounding off (DESIGN s4.7), a bf16
    backward, all read back from the built recipe; fp8's auto is tensor-wise native (s4.5)."""
    te = te_with({"disable_rht": False, "disable_stochastic_rounding": False, "backward_override": None})
    plan = PR.resolve("nvfp4", "auto", GB10, te_available=True, te_recipe=te)
    assert (plan.backend, plan.peak_key) == ("te", "nvfp4") and "auto -> te" in plan.chosen
    recipe, desc = build_te_recipe("nvfp4", GB10, te)
    assert (recipe.disable_rht, recipe.disable_stochastic_rounding, recipe.backward_override) == \
        (True, True, "high_precision")
    assert desc["disable_rht"] == "True" and desc["disable_stochastic_rounding"] == "True"
    fp8 = PR.resolve("fp8", "auto", GB10)
    assert fp8.backend == "native" and fp8.recipe["scaling"] == "tensorwise"
    with pytest.raises(RequestError, match=r"disable_rht.*sm_12x"):   # a TE without the fields: refused up front
        PR.resolve("nvfp4", "auto", GB10, te_available=True, te_recipe=te_with({"backward_override": None}))


@pytest.mark.parametrize("request_, backend, spec, te, match", [
    ("nvfp4", "auto", H100, True, r"--precision nvfp4: needs a Blackwell GPU.*accepted on this device: "
                                  r"--precision auto\|bf16\|fp32\|fp8"),
    ("fp8", "auto", A100, False, r"--precision fp8: needs .* >= 8.9.*--precision auto\|bf16\|fp32,"),
    ("nvfp4", "auto", GB10, False, r"--precision nvfp4: needs Transformer Engine.*auto\|bf16\|fp32\|fp8"),
    ("fp8", "te", GB10, False, r"--precision-backend te: Transformer Engine is not installed"),
])
def test_explicit_requests_the_device_cannot_meet_raise(request_, backend, spec, te, match):
    with pytest.raises(RequestError, match=match):
        PR.resolve(request_, backend, spec, te_available=te)


@pytest.mark.parametrize("backend, applies", [("emulated", "nvfp4"), ("native", "fp8"), ("torchao", "fp8"),
                                              ("te", "fp8|nvfp4")])
def test_backend_without_fp8_or_nvfp4_names_the_precision_it_serves(backend, applies):
    """`--precision auto --precision-backend emulated` said "only applies to --precision fp8|nvfp4",
    and following it with fp8 got the next refusal (emulated is nvfp4 only)."""
    with pytest.raises(RequestError, match=rf"only applies to --precision {applies};"):
        PR.resolve("auto", backend, H100)
