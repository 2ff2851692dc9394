"""Review 10 of `--quantize int8`: quantize_rows against a hand computation, matrix_bytes of a
quantised model built on the meta device (a size estimate), and chat_cli / chat_web computing in
the dtype --dtype names (as chat_eval / base_eval score the int8 model), not the GPT's default."""

from __future__ import annotations

import pytest
import torch

from nanochat.gpt import GPT, config_for_depth
from nanochat.quantize import Int8Linear, matrix_bytes, quantize_model, quantize_rows
from tests.test_engine import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # the sft_checkpoint fixture saves it


def test_quantize_rows_by_hand():
    """Per-row absmax / 127, round half to even, zero row at scale 1, a row with one huge value
    keeps it (within half a step) and its small values round to 0."""
    w = torch.tensor([[127.0, 0.5, 1.5, -2.5],     # scale 1: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2
                      [0.0, 0.0, 0.0, 0.0],        # all zero: scale 1, q 0
                      [-254.0, 1.0, 3.0, 0.9],     # scale 2: 1/2 -> 0, 3/2 -> 2, 0.45 -> 0
                      [1e6, 1.0, -1.0, 3e3]])      # one huge value: the rest is below half a step
    q, s = quantize_rows(w)
    assert s.tolist() == pytest.approx([1.0, 1.0, 2.0, 1e6 / 127])
    assert q.tolist() == [[127, 0, 2, -2], [0, 0, 0, 0], [-127, 0, 2, 0], [127, 0, 0, 0]]
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 * (1 + 1e-6)).all())


def _gpt(device):
    with torch.device("meta"):
        model = GPT(config_for_depth(2, 512, 128))
    if device != "meta":
        model.to_empty(device=device)
        model.init_weights()
    return model


def test_matrix_bytes_of_a_quantised_meta_model():
    """Storages were told apart by address, which is 0 for every meta tensor: a quantised model
    built on the meta device (estimating the bytes a decode step streams without allocating it)
    counted one layer's int8 rows and scales, 2,192 bytes instead of 470,160."""
    real = quantize_model(_gpt("cpu"), "int8")
    meta = quantize_model(_gpt("meta"), "int8")
    int8 = sum(m.qweight.numel() + 4 * m.scale.numel() for m in real.modules()
               if isinstance(m, Int8Linear) and m._rows is None)
    floats = sum(p.numel() * 4 for n, p in real.named_parameters() if "wte" not in n and "value_embeds" not in n)
    assert matrix_bytes(real) == int8 + floats
    assert matrix_bytes(meta) == matrix_bytes(real)
    # the views c_q / c_k / c_v are rows of the fused matrix: counted once, as before
    fused = real.blocks[0].attn.qkv_quant
    assert fused.qweight.numel() == sum(getattr(real.blocks[0].attn, n).qweight.numel() for n in ("c_q", "c_k", "c_v"))


def test_chat_scripts_compute_in_the_dtype_flag(sft_checkpoint, monkeypatch):
    """chat_cli / chat_web cast the weights to --dtype but left the GPT's compute dtype at its
    default (bf16 on CUDA, fp32 elsewhere): --dtype bf16 on a CPU computed in fp32 (the int8
    layers gave fp32 activations and the KV cache was fp32), and --dtype fp32 on CUDA in bf16,
    unlike chat_eval / base_eval --dtype, which score the model in that dtype."""
    from nanochat import engine as engine_mod
    from scripts import chat_cli, chat_web

    seen = []
    real = engine_mod.Engine

    class Recording(real):
        def __init__(self, model, *args, **kwargs):
            super().__init__(model, *args, **kwargs)
            seen.append(self)

    monkeypatch.setattr(engine_mod, "Engine", Recording)
    flags = ["--device", "cpu", "--dtype", "bf16", "--quantize", "int8"]
    assert chat_cli.main(["-p", "Hi", "-t", "0", "-m", "2", *flags]) == 0
    chat_web.load_replicas(chat_web.parse_args(flags))
    assert len(seen) == 2
    for engine in seen:
        model = engine.model
        assert model.runtime_dtype(torch.device("cpu")) == torch.bfloat16
        assert engine.cache_dtype == torch.bfloat16
        assert isinstance(model.lm_head, Int8Linear)
        out = []   # the dtype an int8 layer's product comes out in: the activations'
        handle = model.blocks[0].mlp.c_fc.register_forward_hook(lambda mod, i, o: out.append(o.dtype))
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        handle.remove()
        assert out == [torch.bfloat16]
