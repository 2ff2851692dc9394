"""Transformer Engine with the real library on a GPU: the fp8 backend's model conversion, a
training step against the bf16 model, and bf16 evaluation without recompiling. Skipped where TE
or an fp8-capable GPU is missing (CI has neither; `scripts/te_install.sh` puts TE on the offline
GPU box, `gpu_check.sh te` runs this file). The recipe logic itself is tested on CPU with a fake
TE in test_precision.py."""
import copy
import types

import pytest
import torch

pytestmark = pytest.mark.cuda


def _setup():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs an NVIDIA GPU with cc >= 8.9")
    te = pytest.importorskip("transformer_engine.pytorch")
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth
    torch.manual_seed(0)
    # depth 4: width 256, two heads of 128
    model = build_model(config_for_depth(4, 512, 128), "cuda", compute_dtype=torch.bfloat16)
    with torch.no_grad():   # the init zeroes the output projections: every fp8 layer must matter here
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
    rt = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, dtype_name="bf16")
    idx = torch.randint(0, 512, (4, 128), device="cuda")
    tgt = torch.randint(0, 512, (4, 128), device="cuda")
    return te, model, rt, idx, tgt


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_te_fp8_step_close_to_bf16(compile):
    from nanochat.precision import apply_precision, eval_precision
    te, ref, rt, idx, tgt = _setup()
    model = copy.deepcopy(ref)
    info = apply_precision(model, "fp8", rt, backend="te", compile=compile)
    print("resolved:", info)   # shown by pytest when an assertion below fails
    assert info["backend"] == "te" and info["recipe"]["recipe"] == "Float8CurrentScaling", info
    # the head stays bf16 by rule; the value-embedding gates (32 x n_kv_head) are too small for fp8
    assert info["converted"] > 0
    assert all(k.startswith("lm_head") or ".ve_gate" in k for k in info["kept_high_precision"]), info
    assert sum(isinstance(m, te.Linear) for m in model.modules()) == info["converted"], info
    run = torch.compile(model, dynamic=False) if compile else model
    loss = run(idx, tgt)
    loss_ref = ref(idx, tgt)
    assert abs(loss.item() - loss_ref.item()) / loss_ref.item() < 0.02, (loss.item(), loss_ref.item())
    loss.backward()
    loss_ref.backward()
    print("losses:", loss.item(), loss_ref.item(), "c_fc grad rel err:",
          [round(_rel(p.grad, q.grad), 4) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
           if "mlp.c_fc" in n and p.grad is not None])
    assert ref.blocks[0].mlp.c_fc.weight.grad.abs().max() > 0
    for (name, p), (_, p_ref) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if p.ndim == 2 and ("mlp.c_" in name or "attn.c_" in name):   # e5m2 gradients: a few % off
            assert _rel(p.grad, p_ref.grad) < 0.25, (name, _rel(p.grad, p_ref.grad))
    with eval_precision():   # grad disabled: TE's quantisation off, so the bf16 model's numbers
        logits = run(idx)
        logits_ref = ref(idx)
    assert _rel(logits, logits_ref) < 2e-2, _rel(logits, logits_ref)
