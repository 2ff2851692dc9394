"""Review 8 of the model and optimizer as base_train uses them: the checkpoint-size estimate with
NorMuon (recipe v2's default), plus checks of what held up: the FLOPs estimate against a hand
count on a GQA model narrower than the value-embedding gate, the optimizer groups of that model,
an exact state round trip with NorMuon and schedules on odd (1-row, tall, wide) matrices, the LR
schedule of a one-step run, and precision refusals on simulated devices."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch

from nanochat import precision as PR
from nanochat.checkpoint import checkpoint_bytes
from nanochat.device_table import CPU_SPEC
from nanochat.errors import RequestError
from nanochat.gpt import GPT, GPTConfig
from nanochat.optim import build_optimizer, lr_multiplier, optimizer_state_bytes
from tests.test_optim import fake_grads, set_grads, tiny_model

# GQA (2 query heads, 1 kv head), n_embd 16 < the gate's 32 channels, windows S, L, full (last)
ODD = GPTConfig(sequence_len=16, vocab_size=100, n_layer=3, n_head=2, n_kv_head=1, n_embd=16, window_pattern="SL")


def _state_bytes(opt) -> int:
    """What the optimizer state holds, without AdamW's 0-dim step counters."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def test_state_bytes_count_normuons_second_moment():
    """Recipe v2 runs NorMuon, whose factored second moment is optimizer state too: the estimate
    (disk planning) left it out, so a v2 checkpoint came out larger than base_train planned."""
    model = tiny_model()
    opt = build_optimizer(model, normuon_beta2=0.95, weight_decay=0.1)
    set_grads(model, fake_grads(model, 0))
    opt.step()
    assert optimizer_state_bytes(model, normuon=True) == _state_bytes(opt)
    with torch.device("meta"):
        meta = GPT(model.config)
    assert optimizer_state_bytes(meta, normuon=True) == _state_bytes(opt)
    extra = sum(s["second_moment"].nbytes for s in opt.state.values() if "second_moment" in s)
    assert extra > 0 and checkpoint_bytes(meta, normuon=True) - checkpoint_bytes(meta) == extra
    assert optimizer_state_bytes(model) == _state_bytes(opt) - extra   # plain Muon (v1): as before


def test_flops_and_param_counts_by_hand_for_a_gqa_model_narrower_than_the_gate():
    model = GPT(ODD)
    C, D, L, V = 16, 8, 3, 128   # head_dim 8, padded vocab 128
    per_layer = C * C + 2 * C * D + C * C + 8 * C * C   # q, k + v (one kv head), proj, MLP
    gates = 2 * C * 1                                   # VE layers 0 and 2, gate reads all 16 channels
    matrices = L * per_layer + gates
    assert model.param_counts()["transformer_matrices"] == matrices
    assert sum(model.param_counts().values()) == sum(p.numel() for p in model.parameters())
    attn = 12 * 2 * D * (4 + 16 + 16)                   # windows: S = 16 // 4, L, last layer full
    assert model.estimate_flops() == 6 * (matrices + V * C) + attn
    assert model.estimate_flops(2) == 6 * (matrices + V * C) + 12 * 2 * D * 2 * 3   # every window capped at T


def test_groups_cover_every_parameter_once_with_1_row_gates():
    model = GPT(ODD)
    opt = build_optimizer(model)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    shapes = {g["name"]: tuple(g["params"][0].shape) for g in opt.param_groups if g["kind"] == "muon"}
    assert shapes["muon_1x16"] == (1, 16) and shapes["muon_64x16"] == (64, 16) and shapes["muon_16x64"] == (16, 64)


def _step(model, opt, seed, mult):
    torch.manual_seed(seed)
    x = torch.randint(0, ODD.vocab_size, (2, 16))
    model(x, x).backward()
    opt.set_hparams(lr_mult=mult, momentum=0.9 + 0.01 * seed, wd_mult=1 - 0.1 * seed)
    opt.step()
    model.zero_grad(set_to_none=True)


def test_state_round_trip_reproduces_the_next_step_on_odd_shapes():
    torch.manual_seed(0)
    model = GPT(ODD)
    model.init_weights()
    opt = build_optimizer(model, weight_decay=0.2, normuon_beta2=0.95)
    for s in range(2):
        _step(model, opt, s, 0.5 + s)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _step(model, opt, 2, 0.7)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    again = GPT(ODD)
    again.load_state_dict(saved["model"])
    opt2 = build_optimizer(again, weight_decay=0.2, normuon_beta2=0.95)
    opt2.load_state_dict(saved["optim"])
    _step(again, opt2, 2, 0.7)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name


def test_one_step_runs_and_full_warmdown():
    assert lr_multiplier(0, 1, warmdown_ratio=1.0, final_lr_frac=0.05) == 1.0   # warmdown starts after step 0
    assert lr_multiplier(1, 1, warmdown_ratio=1.0, final_lr_frac=0.05) == pytest.approx(0.05)
    assert lr_multiplier(0, 1, warmdown_ratio=1.0, warmup_steps=40) == 1.0      # warmup capped to 0 steps
    assert [lr_multiplier(s, 4, warmdown_ratio=0.0) for s in range(6)] == [1.0] * 6
    with pytest.raises(ValueError, match="--num-iterations: got 0"):
        lr_multiplier(0, 0)


@pytest.mark.parametrize("precision, spec, match", [
    ("fp8", CPU_SPEC, r"^--precision fp8: needs an NVIDIA GPU .*this is CPU; accepted on this device: --precision auto"),
    ("nvfp4", dataclasses.replace(CPU_SPEC, name="H100", cc=(9, 0), key="h100"),
     r"^--precision nvfp4: needs a Blackwell GPU.*\(cc 9\.0\).*--precision-backend emulated"),
])
def test_explicit_low_precision_on_a_device_without_it_names_the_flag(precision, spec, match):
    with pytest.raises(RequestError, match=match):
        PR.resolve(precision, "auto", spec, te_available=False)


def test_auto_says_what_it_chose():
    plan = PR.resolve("auto", "auto", CPU_SPEC, compute_dtype="fp32")
    assert plan.precision == "fp32" and plan.chosen.startswith("--precision auto -> fp32")
    h100 = dataclasses.replace(CPU_SPEC, name="H100", cc=(9, 0), key="h100")
    plan = PR.resolve("fp8", "auto", h100)
    assert plan.backend == "native" and plan.chosen.startswith("--precision-backend auto -> native")
    assert copy.deepcopy(plan).describe()["chosen"] == plan.chosen
