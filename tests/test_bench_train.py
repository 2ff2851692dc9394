"""scripts/bench_train.py on CPU: the smoke run (one JSON row per kernel, the fusions --kernel triton
installs, tok/s and the step's batch arithmetic), its default batch (base_train's auto batch for
the depth), --unfuse (one --kernel triton fusion dropped for an A/B) and --precision-backend (a
request the device cannot run comes back as an error row). base_train itself:
tests/test_base_train.py."""

from __future__ import annotations

import json
import math

import pytest
import torch


def test_bench_train_cpu_smoke(capsys):
    from scripts import bench_train
    rows = bench_train.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "2", "--seq", "32",
                             "--steps", "3", "--warmup", "1", "--vocab-size", "256", "--no-compile",
                             "--aspect-ratio", "32", "--head-dim", "32", "--kernel", "current,triton",
                             "--total-batch-size", "128"])
    out = capsys.readouterr().out
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    assert [l["kernel"] for l in lines] == ["current", "triton"]
    # what --kernel triton installs on a CPU: its loss, mix-norm and QK-norm ops (the fused MLP needs TMA)
    assert [l["kernel_fusions"] for l in lines] == ["none", "linear_ce,mix_norm,mix_add,x0_grad_acc,rotary_norm"]
    for r in lines:
        assert r["timed_steps"] == 3 and r["tok_per_sec"] > 0 and r["flops_per_token"] > 0
        assert r["total_batch_size"] == 128 and r["grad_accum_steps"] == 2   # 2 micro-batches of 2 x 32
        assert r["cast_once"] is False   # fp32 on CPU: nothing to cast
        assert r["mfu_pct"] is None and math.isfinite(r["last_loss"])
        assert r["gpu"] == {"samples": 0, "unavailable": "not a CUDA device"}  # nanochat/gpu_monitor.py
    assert "tok/s" in out and "MFU%" in out and "capped%" in out


def test_bench_train_default_batch_is_base_trains():
    """bench_train's default step is base_train's auto batch for the depth (2**20 tokens at d20,
    2**19 at d12 with seq 2048), so its tok/s includes the optimizer as often as a real run does."""
    from scripts import bench_train
    cfg = bench_train.parse_config(["--depth", "12,20"])
    assert cfg.total_batch_size == -1
    assert bench_train.total_batch_for(cfg, 20, 32768, 1) == 2**20
    assert bench_train.total_batch_for(cfg, 12, 32768, 1) == 2**19
    assert bench_train.total_batch_for(cfg, 12, 32768, 8) == 2**19   # 8 ranks x 32 x 2048 divides it
    fixed = bench_train.parse_config(["--total-batch-size", "65536"])
    assert bench_train.total_batch_for(fixed, 20, 32768, 1) == 65536
    with pytest.raises(ValueError, match="--total-batch-size"):
        bench_train.parse_config(["--total-batch-size", "0"])


def test_bench_train_unfuse():
    """--unfuse drops one --kernel triton fusion for an A/B (bf16 or fp8); names are checked."""
    from scripts import bench_train
    from nanochat.gpt import GPT, GPTConfig
    assert bench_train.parse_config(["--unfuse", "mlp,rope"]).unfuse == ("mlp", "rope")
    with pytest.raises(ValueError, match="--unfuse.*mlp\\|rope"):
        bench_train.parse_config(["--unfuse", "norm"])
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=32))
    model.set_mlp_fn(lambda x, w_fc, w_proj: x)
    for fusions in ("linear_ce,mix_norm,relu2_mlp_fp8", "linear_ce,mix_norm,relu2_mlp"):
        assert bench_train.unfuse_model(model, {"mlp"}, fusions) == "linear_ce,mix_norm"
        assert model.blocks[0].mlp.fused is None
    # mixadd: the same mix-norm, told to take each block's output already summed
    from nanochat import fused_norm
    model.set_mix_norm(fused_norm.mix_norm)
    assert model.mix_norm_fuses_add
    assert model.mix_norm_chains_x0
    assert bench_train.unfuse_model(model, {"mixadd"}, "linear_ce,mix_norm,mix_add,x0_grad_acc") \
        == "linear_ce,mix_norm,x0_grad_acc"
    assert model.mix_norm is fused_norm.mix_norm and not model.mix_norm_fuses_add and model.mix_norm_chains_x0
    assert bench_train.unfuse_model(model, {"x0acc"}, "mix_norm,x0_grad_acc") == "mix_norm"
    assert not model.mix_norm_fuses_add and not model.mix_norm_chains_x0
    # ghcast: the fp8 MLP keeps running, with gh_cast="pass" (the other keywords kept)
    import functools
    from nanochat.gpt import Linear
    from nanochat.triton_mlp import fp8_relu2_mlp
    fn = functools.partial(fp8_relu2_mlp, grad_dtype=torch.float8_e5m2)
    fn.replaces = (Linear,)
    model.set_mlp_fn(fn)
    assert bench_train.unfuse_model(model, {"ghcast"}, "mix_norm,relu2_mlp_fp8,gh_cast_fp8") == "mix_norm,relu2_mlp_fp8"
    got = model.blocks[0].mlp.fused
    assert got.keywords == {"grad_dtype": torch.float8_e5m2, "gh_cast": "pass"} and got.func is fp8_relu2_mlp
    assert bench_train.unfuse_model(model, {"mlp"}, "relu2_mlp_fp8,gh_cast_fp8") == "none"
    with pytest.raises(ValueError, match="gh_cast.*epilogue\\|pass"):
        fp8_relu2_mlp(torch.zeros(16, 32), torch.zeros(64, 32), torch.zeros(32, 64), gh_cast="late")
    # qkgemm: the q/k projection hook stays, with the bf16 GEMM epilogue off
    from nanochat import fp8_qk
    model.set_qkv_projection(functools.partial(fp8_qk.qkv_projection, bf16_gemm=True))
    assert bench_train.unfuse_model(model, {"qkgemm"}, "rotary_norm,qk_rope_gemm") == "rotary_norm"
    qk = model.blocks[0].attn.qkv_projection
    assert qk.func is fp8_qk.qkv_projection and qk.keywords == {"bf16_gemm": False}
    model.set_rotary_norm(lambda x, cos, sin: x)
    assert bench_train.unfuse_model(model, {"rope"}, "linear_ce,rotary_norm,qk_rope_gemm") == "linear_ce"
    assert model.blocks[0].attn.qkv_projection is None
    from nanochat.gpt import rotary_norm
    assert model.blocks[0].attn.rotary_norm is rotary_norm


def test_bench_train_precision_backends():
    """--precision-backend is a comma list checked against base_train's accepted values; on a CPU an
    fp8 request comes back as an error row naming why, not a crash."""
    from scripts import bench_train
    assert bench_train.parse_config(["--precision-backend", "te,native"]).precision_backends == ("te", "native")
    with pytest.raises(ValueError, match="--precision-backend.*auto\\|te\\|native"):
        bench_train.parse_config(["--precision-backend", "te,foo"])
    rows = bench_train.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "2", "--seq", "32",
                             "--steps", "3", "--warmup", "1", "--vocab-size", "256", "--no-compile",
                             "--precision", "fp8", "--precision-backend", "native"])
    assert len(rows) == 1 and "compute capability" in rows[0]["error"], rows

