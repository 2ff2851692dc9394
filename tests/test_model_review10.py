"""Review 10 of the model and optimizer on CPU: a compute dtype given by name and token ids of a
non-integer dtype are refused by name up front (they failed later, inside torch, with messages that
named neither), plus a guard of FLOPs / parameter counts against a hand calculation and of an
exact optimizer resume through the checkpoint module."""

from __future__ import annotations

import copy

import pytest
import torch

from nanochat.checkpoint import load_checkpoint, save_checkpoint
from nanochat.gpt import GPT, GPTConfig
from nanochat.optim import build_optimizer

CFG = dict(sequence_len=16, vocab_size=70, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, window_pattern="SL")


def _model(**kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG), attn_backend="sdpa", **kw)
    model.init_weights()
    return model


# ---- defects fixed in this review ---------------------------------------------------------------

@pytest.mark.parametrize("bad", ["bf16", "bfloat16", torch.int64])
def test_compute_dtype_must_be_a_float_torch_dtype(bad):
    """precision.resolve's compute_dtype is a name ("bf16"); GPT's is a torch dtype. A name was
    stored and the first forward died with "Invalid device string: 'bf16'" (an int dtype with a
    matmul dtype mismatch), neither naming compute_dtype."""
    with pytest.raises(ValueError, match=r"GPT compute_dtype: got .*; accepted: None .*torch\.bfloat16"):
        GPT(GPTConfig(**CFG), compute_dtype=bad)
    assert _model(compute_dtype=torch.bfloat16).compute_dtype is torch.bfloat16


@pytest.mark.parametrize("which", ["idx", "targets"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.uint8])
def test_token_ids_of_a_non_integer_dtype_are_refused_before_the_forward(which, dtype):
    """Float targets ran the whole forward and then failed in the loss's gather(); float / bool idx
    failed in the embedding with "argument #1 'indices'". Both are refused first, by name."""
    model = _model()
    calls = []
    model.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    idx = torch.randint(0, CFG["vocab_size"], (2, 8))
    args = (idx.to(dtype), idx) if which == "idx" else (idx, idx.to(dtype))
    with pytest.raises(ValueError, match=f"GPT.forward {which}: got dtype {dtype}; accepted: torch.int64"):
        model(*args)
    assert calls == [], "refused only after running the blocks"
    # int32 ids keep working (the embedding and the loss take them)
    assert torch.isfinite(model(idx.int(), idx.int()))


# ---- guards (probed and found right) -----------------------------------------------------------

def test_flops_and_params_match_a_hand_count():
    """C=32, 4 heads of 8, 2 kv heads, padded vocab 128, layers (S=4, L, L), VE on layers 0 and 2."""
    model = _model()
    per_layer = 32 * 32 * 2 + 32 * 16 * 2 + 8 * 32 * 32            # q + proj, k + v, MLP
    matrices = 3 * per_layer + 2 * 32 * 2                          # + two 32 -> 2 gates
    assert model.param_counts() == {"wte": 128 * 32, "value_embeds": 2 * 128 * 16,
                                    "transformer_matrices": matrices, "lm_head": 128 * 32, "scalars": 6}
    assert sum(model.param_counts().values()) == sum(p.numel() for p in model.parameters())
    attn = 12 * 4 * 8 * (4 + 16 + 16)
    assert model.estimate_flops() == 6 * (matrices + 128 * 32) + attn
    assert model.estimate_flops(2) == 6 * (matrices + 128 * 32) + 12 * 4 * 8 * 2 * 3


def test_resume_through_the_checkpoint_module_is_exact(tmp_path):
    """Three steps, save, three more == load, three more (NorMuon, cautious decay, schedules)."""
    data = [torch.randint(0, CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(i))
            for i in range(6)]

    def steps(model, opt, start):
        for i in range(start, start + 3):
            opt.set_hparams(lr_mult=1 - i / 10, momentum=0.9, wd_mult=1 - i / 6)
            model(data[i], data[i]).backward()
            opt.step()
            model.zero_grad(set_to_none=True)

    model = _model()
    opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=0.95)
    steps(model, opt, 0)
    save_checkpoint(tmp_path, 3, model_state=copy.deepcopy(model.state_dict()), meta={"model_config": CFG},
                    optimizer_state=copy.deepcopy(opt.state_dict()), loader_state={}, loop_state={})
    steps(model, opt, 3)
    saved = load_checkpoint(tmp_path, 3, load_optimizer=True)
    resumed = _model()
    resumed.load_state_dict(saved["model"])
    opt2 = build_optimizer(resumed, weight_decay=0.1, normuon_beta2=0.95)
    opt2.load_state_dict(saved["optimizer"])
    steps(resumed, opt2, 3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
