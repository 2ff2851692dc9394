"""nanochat/quantize.py and nanochat/triton_int8.py: int8 weight-only inference. CPU: the rounding,
the model transform (fused q/k/v views, bytes, logits, loss, KV-cache decode), refusals, the
kernel under TRITON_INTERPRET=1 and the scripts' --quantize flags; CUDA: the kernel in bf16 at
d20's shapes and CUDA-graph decode of a quantised model."""

import pytest
import torch

from nanochat.gpt import GPT, config_for_depth
from nanochat.quantize import (GEMV_MAX_ROWS, Int8Linear, check_quantize, int8_linear, matrix_bytes,
                               quantize_model, quantize_rows)


def tiny_model(device="cpu", depth=2, vocab=512, seq=128, seed=0):
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(config_for_depth(depth, vocab, seq))
    model.to_empty(device=device)
    model.init_weights()
    with torch.no_grad():   # the zero-initialised projections get values, so every matrix matters
        for p in model.parameters():
            if p.dim() == 2 and not p.abs().max() > 0:
                p.normal_(0, 0.05)
    return model.eval()


def test_quantize_rows_error_range_and_zero_rows():
    w = torch.randn(33, 70) * torch.logspace(-3, 1, 33)[:, None]   # rows of very different scales
    w[5] = 0
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (33,)
    assert int(q.abs().max()) == 127 and int(q[5].abs().max()) == 0 and s[5] == 1
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-7).all())   # round to nearest: at most half a step per row
    with pytest.raises(ValueError, match="2-D float"):
        quantize_rows(torch.ones(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_rows(torch.ones(3, 3, dtype=torch.int32))


def test_int8_linear_cpu_path_matches_dequantised_weight():
    q, s = quantize_rows(torch.randn(40, 24))
    x = torch.randn(2, 3, 24)
    want = x @ (q.float() * s[:, None]).T
    assert torch.allclose(int8_linear(x, q, s), want, atol=1e-5)
    assert int8_linear(x, q, s).shape == (2, 3, 40)


def test_quantize_model_views_bytes_logits_and_loss():
    model = tiny_model()
    x = torch.randint(0, 512, (2, 19))
    with torch.no_grad():
        ref = model(x)
        fp_bytes = matrix_bytes(model)
        quantize_model(model, "int8")
        got = model(x)
        loss = model(x[:, :-1], targets=x[:, 1:])
    attn = model.blocks[0].attn
    assert model.quantization == "int8" and isinstance(attn.qkv_quant, Int8Linear)
    # c_q / c_k / c_v are row slices of the fused matrix: no second copy
    fused_ptr = attn.qkv_quant.qweight.data_ptr()
    assert attn.c_q.qweight.data_ptr() == fused_ptr
    assert attn.c_k.qweight.data_ptr() == fused_ptr + attn.c_q.out_features * attn.c_q.in_features
    assert isinstance(model.lm_head, Int8Linear) and isinstance(model.blocks[1].mlp.c_proj, Int8Linear)
    # fp32 matrices -> int8 + one float32 per row: ~4x fewer bytes
    assert 3.5 < fp_bytes / matrix_bytes(model) < 4.0
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 0 < rel < 0.05, rel
    # the loss path (evaluation) uses the same quantised head as the logits
    logits = got[:, :-1]   # causal: the first T-1 positions' logits are those of x[:, :-1]
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    assert abs(loss.item() - want.item()) < 1e-3


def test_quantised_kv_cache_decode_equals_recompute():
    from nanochat.engine import Engine

    model = tiny_model(seed=1)
    quantize_model(model, "int8")
    prompt = [3, 17, 200, 45, 9, 311]
    for mode in ("eager", "static"):
        engine = Engine(model, None, decode=mode)
        tokens, _ = engine.generate_batch(prompt, max_tokens=12, temperature=0.0)
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(12):   # greedy by full recomputation of the quantised model
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
        assert tokens[0][len(prompt):] == ids[len(prompt):], mode


def test_moving_a_quantised_model_keeps_float32_scales():
    model = quantize_model(tiny_model(), "int8")
    scales = {name: m.scale.clone() for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    model = model.to(torch.bfloat16)
    lin = model.blocks[0].mlp.c_fc
    assert lin.qweight.dtype == torch.int8 and lin.scale.dtype == torch.float32 and lin.kernel is None
    # the values too, not their bf16 round trip (that rounded each row's scale by up to 0.4%)
    for name, m in model.named_modules():
        if isinstance(m, Int8Linear):
            assert torch.equal(m.scale, scales[name]), name
    assert model(torch.randint(0, 512, (1, 5))).dtype == torch.float32


def test_quantised_state_dict_round_trips_strictly():
    """A quantised model's state_dict holds every int8 matrix (once: c_q/c_k/c_v are views of the
    fused rows) and float32 scales; saved and read back as checkpoints are (torch.save, then
    torch.load(weights_only=True)), it loads strictly into a freshly quantised model of the same
    config, which then gives the same outputs. A float model refuses it."""
    import io

    src = quantize_model(tiny_model(seed=3), "int8")
    state = src.state_dict()
    for name in ("blocks.0.attn.qkv_quant", "blocks.1.attn.c_proj", "blocks.0.mlp.c_fc", "blocks.1.mlp.c_proj",
                 "lm_head"):
        assert state[name + ".qweight"].dtype == torch.int8 and state[name + ".scale"].dtype == torch.float32, name
    assert not any(k.startswith(("blocks.0.attn.c_q.", "blocks.0.attn.c_k.", "blocks.0.attn.c_v.")) for k in state)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    dst = quantize_model(tiny_model(seed=4), "int8")
    x = torch.randint(0, 512, (2, 11))
    with torch.no_grad():
        want = src(x)
        assert not torch.equal(dst(x), want)   # other weights before the load
        dst.load_state_dict(state, strict=True)
        assert torch.equal(dst(x), want)
        # the views read the loaded rows too (the training-mode path and the decode step use them)
        attn, ref = dst.blocks[1].attn, src.blocks[1].attn
        assert attn.c_v.qweight.data_ptr() == attn.qkv_quant.qweight.data_ptr() + \
            (attn.c_q.out_features + attn.c_k.out_features) * attn.c_q.in_features
        assert torch.equal(attn.c_k.qweight, ref.c_k.qweight) and torch.equal(attn.c_k.scale, ref.c_k.scale)
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\).*qkv_quant\.qweight"):
        tiny_model().load_state_dict(state, strict=True)


def test_moved_quantised_model_keeps_views_and_loads():
    """A move after quantising (to_empty: new storage for every tensor, as .to(another device)
    makes) re-slices c_q/c_k/c_v from the fused rows instead of leaving copies, so a state_dict
    loaded afterwards reaches them too."""
    src = quantize_model(tiny_model(seed=5), "int8")
    dst = quantize_model(tiny_model(seed=6), "int8").to_empty(device="cpu")
    attn = dst.blocks[0].attn
    assert attn.c_q.qweight.data_ptr() == attn.qkv_quant.qweight.data_ptr()
    assert attn.c_k.scale.data_ptr() == attn.qkv_quant.scale.data_ptr() + 4 * attn.c_q.out_features
    dst.load_state_dict(src.state_dict(), strict=True)
    x = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        assert torch.equal(dst(x), src(x))
    assert torch.equal(attn.c_q.dequantize(), src.blocks[0].attn.c_q.dequantize())


def test_quantize_refusals():
    from nanochat import precision

    assert check_quantize("int8") == "int8"
    with pytest.raises(ValueError, match=r"--quantize: got 'int4'; accepted: none\|int8"):
        check_quantize("int4")
    model = tiny_model()
    assert quantize_model(model, "none") is model and not hasattr(model, "quantization")
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(model, "int8")
    with pytest.raises(ValueError, match="needs a nanochat GPT"):
        quantize_model(torch.nn.Linear(3, 3), "int8")
    swapped = tiny_model()
    precision.swap_linears(swapped, "nvfp4", lambda old: precision._rebuild(precision.EmulatedNVFP4Linear, old))
    with pytest.raises(ValueError, match="precision.py's fp8/nvfp4"):
        quantize_model(swapped, "int8")


def test_persistent_step_takes_int8_models_and_says_why_not_others():
    """The persistent batch-1 step (nanochat/triton_decode.py) reads quantize_model's int8 rows;
    a model whose matrices are not all Int8Linear (one put back as float) or whose weights are
    another format is refused with the reason."""
    from nanochat.attention import KVCache
    from nanochat.gpt import Linear
    from nanochat.triton_decode import unsupported

    model = tiny_model()
    quantize_model(model, "int8")
    cfg = model.config
    cache = KVCache(1, cfg.n_kv_head, 64, cfg.head_dim, cfg.n_layer, torch.device("cpu"), torch.float32)
    assert unsupported(model, cache, device_check=False) is None
    head = model.lm_head
    model.lm_head = Linear(cfg.n_embd, head.out_features)
    assert "not an Int8Linear" in unsupported(model, cache, device_check=False)
    model.lm_head, model.quantization = head, "int4"
    assert "weights are int4" in unsupported(model, cache, device_check=False)


def test_non_finite_and_columnless_weights_are_refused():
    """A NaN row came out as finite integers at scale 1 and an inf row as NaN, so a diverged
    checkpoint quantised into a model that hid the damage; a (N, 0) weight was an IndexError.
    quantize_model names the matrices and leaves the model as it was."""
    for bad in (float("nan"), float("inf")):
        w = torch.randn(4, 8)
        w[1, 2] = bad
        with pytest.raises(ValueError, match="1 of 4 rows hold NaN or inf"):
            quantize_rows(w)
    with pytest.raises(ValueError, match=r"at least one column, got \(3, 0\)"):
        quantize_rows(torch.ones(3, 0))
    for shape in ((1, 1), (1, 9), (9, 1)):   # edge shapes round-trip within half a step per row
        w = torch.randn(shape)
        q, s = quantize_rows(w)
        assert bool(((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()), shape
    model = tiny_model()
    with torch.no_grad():
        model.blocks[1].mlp.c_fc.weight[3, 0] = float("nan")
    with pytest.raises(ValueError, match=r"--quantize int8: non-finite weights in blocks\.1\.mlp\.c_fc;"):
        quantize_model(model, "int8")
    assert not hasattr(model, "quantization") and not any(isinstance(m, Int8Linear) for m in model.modules())


def test_prefill_path_scales_rows_in_float32():
    """The dequantising path (CPU, and prefills on CUDA) multiplied by a bf16 copy of the float32
    row scales: a systematic per-row gain error of up to 0.4%, ten times the float32 kernel's."""
    torch.manual_seed(0)
    q, s = quantize_rows(torch.randn(256, 512))
    x = torch.randn(4096, 512).to(torch.bfloat16)
    ref = x.double() @ (q.double() * s.double()[:, None]).T
    got = int8_linear(x, q, s)
    assert got.dtype == torch.bfloat16
    gain = (got.double() * ref).sum(0) / (ref * ref).sum(0)   # each output row's least-squares gain
    assert (gain - 1).abs().max() < 1e-3, (gain - 1).abs().max()


def test_quantising_frees_the_float_qkv_copy_of_an_earlier_engine():
    """A float Engine run before quantising (bench_inference --quantize none,int8) left each
    layer's fused float q/k/v copy (GPT.inference_weights) alive on the int8 model."""
    import gc
    import weakref

    from nanochat.engine import Engine

    model = tiny_model(seed=2)
    Engine(model, None).generate_batch([3, 4, 5], max_tokens=2, temperature=0.0)
    copies = [weakref.ref(b.attn._qkv_buffer) for b in model.blocks]
    assert all(c() is not None for c in copies)
    quantize_model(model, "int8")
    gc.collect()
    assert all(c() is None for c in copies)
    tokens, _ = Engine(model, None).generate_batch([3, 4, 5], max_tokens=4, temperature=0.0)
    assert len(tokens[0]) == 7


KERNEL_SCRIPT = f"""
import torch
from nanochat.quantize import quantize_rows
from nanochat.triton_int8 import int8_gemv, gemv_config, register
register()
torch.manual_seed(0)
for M, N, K in [(1, 40, 96), (1, 7, 1500), (3, 70, 200), (17, 33, 130), ({GEMV_MAX_ROWS}, 16, 16), (5, 9000, 40)]:
    q, s = quantize_rows(torch.randn(N, K))
    x = torch.randn(M, 2 * K)[:, ::2]          # a strided input is made contiguous first
    got = int8_gemv(x, q, s)
    want = x @ (q.float() * s[:, None]).T
    assert got.shape == (M, N) and (got - want).abs().max() < 1e-4, (M, N, K)
assert gemv_config(1, 1280, 1280)["ROW"] and gemv_config(2, 32768, 1280)["BLOCK_N"] == 32
assert gemv_config(40, 1280, 1280)["BLOCK_M"] == 64
print("OK")
"""

MODEL_SCRIPT = """
import torch
from tests.test_quantize import tiny_model
from nanochat.quantize import quantize_model, int8_linear
model = quantize_model(tiny_model(depth=1, vocab=128, seq=96), "int8")
lin = model.blocks[0].mlp.c_proj   # 128 output rows: 128 interpreted programs (c_fc: 512)
assert lin.kernel is not None
for rows in (1, 70):
    x = torch.randn(rows, lin.in_features)
    assert (lin(x) - int8_linear(x, lin.qweight, lin.scale, kernel=None)).abs().max() < 1e-4
print("OK")
"""

# Both scripts run in one interpreted subprocess (conftest's `interpreted` fixture).
# MODEL_SCRIPT first: the model path must register the kernel op itself (KERNEL_SCRIPT calls
# register() directly, which would hide a model path that stopped doing so).
SCRIPTS = {"MODEL_SCRIPT": MODEL_SCRIPT, "KERNEL_SCRIPT": KERNEL_SCRIPT}


def test_int8_kernel_interpreted(interpreted):
    assert interpreted["KERNEL_SCRIPT"] is None, interpreted["KERNEL_SCRIPT"]


def test_quantised_model_runs_the_kernel_interpreted(interpreted):
    """Under the interpreter the quantised layers pick the Triton product (as on CUDA) for decode
    rows and the dequantising GEMM for a long prefill; both agree with the CPU path."""
    assert interpreted["MODEL_SCRIPT"] is None, interpreted["MODEL_SCRIPT"]


def test_script_quantize_flags_fail_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    from scripts import base_eval, bench_inference, chat_cli, chat_eval, chat_web

    with pytest.raises(ValueError, match=r"--quantize: got 'fp4'; accepted: none\|int8"):
        base_eval.parse_config(["--quantize", "fp4", "--eval", "bpb"])
    with pytest.raises(ValueError, match="--quantize: got 'fp4'"):
        chat_cli.parse_args(["--quantize", "fp4"])
    with pytest.raises(ValueError, match="--quantize: got 'fp4'"):
        chat_eval.parse_args(["-i", "sft", "--quantize", "fp4"])
    with pytest.raises(ValueError, match="--quantize: got 'fp4'"):
        chat_web.validate(chat_web.parse_args(["--quantize", "fp4"]))
    with pytest.raises(ValueError, match="--quantize: got 'int8,int8'"):
        bench_inference.parse_args(["--quantize", "int8,int8"])
    assert bench_inference.parse_args(["--quantize", "int8,none", "--device", "cpu"]).quantize == ["none", "int8"]


@pytest.mark.cuda
def test_int8_kernel_cuda_bf16_d20_shapes():
    from nanochat.triton_int8 import int8_gemv, register

    register()
    torch.manual_seed(0)
    for n, k in ((3840, 1280), (1280, 5120), (32768, 1280)):
        q, s = quantize_rows(torch.randn(n, k, device="cuda") / k**0.5)
        w = (q.float() * s[:, None]).to(torch.bfloat16)
        for m in (1, 8, 33, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            got = int8_gemv(x, q, s).float()
            want = (x.float() @ w.float().T)
            assert (got - want).abs().max() <= 0.02 * want.abs().max(), (n, k, m)


@pytest.mark.cuda
@pytest.mark.parametrize("graph_step", ["compiled", "auto"])
def test_quantised_graphs_decode_matches_static(graph_step):
    """CUDA-graph decoding of an int8 model (the compiled step, and auto: the persistent batch-1
    kernel reading the int8 rows) greedily agrees with its eager static decode."""
    from nanochat.engine import Engine

    model = tiny_model("cuda", depth=4, vocab=1024, seq=512, seed=2)
    with torch.no_grad():   # peaked logits: greedy choices without near-ties for rounding to flip
        model.lm_head.weight.normal_(0, 1.0)
    model = model.to(torch.bfloat16)
    quantize_model(model, "int8")
    prompt = list(range(5, 40))
    static = Engine(model, None, decode="static", graph_step="eager").generate_batch(prompt, max_tokens=24,
                                                                                      temperature=0.0)[0]
    engine = Engine(model, None, decode="graphs", graph_step=graph_step)
    assert engine.graph_step == {"auto": "persistent"}.get(graph_step, graph_step), engine.graph_step_note
    graphs = engine.generate_batch(prompt, max_tokens=24, temperature=0.0)[0]
    n = len(prompt)
    agree = sum(a == b for a, b in zip(static[0][n:], graphs[0][n:])) / max(1, len(static[0]) - n)
    assert agree >= 0.9, (static, graphs)   # compiled vs eager bf16 rounding may flip a late near-tie
