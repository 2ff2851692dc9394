"""The launches nanochat/triton_aot compiles: every Triton kernel of the project, at d20's shapes
(width 1280, 10 heads of 128, vocabulary 32768, sequence 2048), each recorded from the host
function that launches it in training or serving, driven with small CPU tensors (only dtypes,
strides, integers and constexprs reach the compiler, so tensor sizes do not matter).

Where host code picks the launch from the tensors' device, a case says what a CUDA tensor would
select: the persistent GEMMs get the target itself (`gpu=`: its SM count and its shared memory,
which picks the tile set), the softcapped loss its PTX tanh (`FAST_TANH`), and the persistent
decode step is built with `aot=True` for the target's SMs. Each case returns a list of
triton_aot.Launch; CASES maps a case name to it.
"""

from __future__ import annotations

import torch

from nanochat.triton_aot import AotTarget, Launch, captured

C, HEADS, D, V, T = 1280, 10, 128, 32768, 2048   # d20
ROWS = 64                                        # rows of the row-wise kernels: any multiple of 16
BF16, F32 = torch.bfloat16, torch.float32


def _empty(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype)


def ce_rows(target: AotTarget) -> list[Launch]:
    """--kernel triton's softcapped cross-entropy: the forward rows (with the gradient written in
    place) and the gradient rows from a saved lse (kernels.py's chunked loss)."""
    from nanochat import triton_kernels as tk

    logits, targets = _empty(ROWS, V), torch.zeros(ROWS, dtype=torch.long)
    with captured("ce_rows") as launches:
        _, lse = tk.ce_rows_triton(logits, targets, 15.0, torch.ones(1))
        tk.ce_grad_rows_triton(logits, targets, lse, torch.ones(ROWS), 15.0)
    for launch in launches:
        launch.kwargs["FAST_TANH"] = True   # what a CUDA tensor selects (triton_kernels._fast_tanh)
    return launches


def mix_norm(target: AotTarget) -> list[Launch]:
    """The residual mix + RMSNorm forward (with and without the fused residual add) and backward
    (with and without the x0 gradient accumulated in float32)."""
    from nanochat import triton_kernels as tk

    r, x0, lam_mu = _empty(ROWS, C), _empty(ROWS, C), torch.ones(2)
    with captured("mix_norm") as launches:
        for add in (None, _empty(ROWS, C)):
            s, y, rstd = tk.mix_norm_fwd_triton(r, x0, lam_mu, 1e-6, add)
        for acc in (None, _empty(ROWS, C, dtype=F32)):
            tk.mix_norm_bwd_triton(_empty(ROWS, C), _empty(ROWS, C), y, rstd, x0, lam_mu, acc)
    return launches


def rotary_norm_bwd(target: AotTarget) -> list[Launch]:
    """QK-norm + RoPE backward: rotate-half pairs, triton_qk's adjacent pairs, and the fp8 path's
    variant that also returns max |dx|."""
    from nanochat import triton_kernels as tk

    y, rstd = _empty(1, 16, HEADS, D), _empty(1, 16, HEADS, 1, dtype=F32)
    cos, sin = _empty(16, D // 2, dtype=F32), _empty(16, D // 2, dtype=F32)
    with captured("rotary_norm_bwd") as launches:
        tk.rotary_norm_bwd_triton(_empty(1, 16, HEADS, D), y, rstd, cos, sin)
        tk.rotary_norm_bwd_triton(_empty(1, 16, HEADS, D), y, rstd, cos, sin, paired=True)
        tk.rotary_norm_bwd_triton(_empty(1, 16, HEADS, D), y, rstd, cos, sin, with_amax=True)
    return launches


def fp8_cast_transpose(target: AotTarget) -> list[Launch]:
    """precision.py's native fp8 cast + transposed copy, narrow (C) and wide (4C) inputs."""
    from nanochat import triton_kernels as tk

    with captured("fp8_cast_transpose") as launches:
        for width in (C, 4 * C):
            tk.fp8_cast_transpose_triton(_empty(ROWS, width), torch.ones(1), torch.float8_e4m3fn, 448.0)
    return launches


def decode_attention(target: AotTarget) -> list[Launch]:
    """The CUDA-graph decode step's split-key attention over a 2048-key cache: window and full
    layers, the one-launch (fused merge) and two-launch forms, one position or one per row."""
    from nanochat import triton_kernels as tk

    q, k, v = _empty(1, HEADS, 1, D), _empty(1, HEADS, T, D), _empty(1, HEADS, T, D)
    with captured("decode_attention") as launches:
        for window in (T // 4, None):
            tk.decode_attention_triton(q, k, v, torch.zeros(1, dtype=torch.long), window, fused=True)
        tk.decode_attention_triton(q, k, v, torch.zeros(1, dtype=torch.long), None, fused=False)
        q8, k8 = _empty(8, HEADS, 1, D), _empty(8, HEADS, T, D)
        tk.decode_attention_triton(q8, k8, k8, torch.zeros(8, dtype=torch.long), T // 4, fused=True)
    return launches


def sampler(target: AotTarget) -> list[Launch]:
    """The Triton sampler: top-k 50 (two-stage: candidates, then the draw), top-k + top-p, no
    top-k (one program per row), and per-row draws of continuous batching."""
    from nanochat import triton_sample as ts

    logits = _empty(4, V, dtype=F32)
    with captured("sampler") as launches:
        ts.sample_triton(logits, 1.0, 50, None, 1, 0)
        ts.sample_triton(logits, 0.8, 50, 0.9, 1, 0)
        ts.sample_triton(logits, 1.0, None, 0.9, 1, 0)
        ts.sample_triton(logits, 1.0, 50, None, 0, 0, row_draws=torch.zeros(4, 4, dtype=torch.long))
    return launches


def mlp_gemm(target: AotTarget) -> list[Launch]:
    """triton_mlp's persistent TMA GEMM with the relu^2 epilogues, bf16 and fp8 (abs-max, scale,
    e5m2 with both layouts), every autotune config its own launch."""
    from nanochat import triton_mlp as tm

    x, w_fc, w_proj = _empty(ROWS, C), _empty(4 * C, C), _empty(C, 4 * C)
    gy, h2 = _empty(ROWS, C), _empty(ROWS, 4 * C)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    one = torch.ones(1)
    with captured("mlp_gemm") as launches:
        tm.mm_epilogue(x, w_fc, "relu2", b_kn=False, gpu=target)
        tm.mm_epilogue(gy, w_proj, "relu2_grad", h2, b_kn=True, gpu=target)
        tm.mm_epilogue(_empty(ROWS, C, dtype=e4), _empty(4 * C, C, dtype=e4), "relu2", b_kn=False, scale=one,
                       amax=torch.zeros(1), out_dtype=e4, gpu=target)
        tm.mm_epilogue(_empty(ROWS, C, dtype=e5), _empty(4 * C, C, dtype=e4), "relu2_grad",
                       _empty(ROWS, 4 * C, dtype=e4), b_kn=False, scale=one, out_dtype=e5, saturate=57344.0, transposed=True, gpu=target)
    return launches


def qk_gemm(target: AotTarget) -> list[Launch]:
    """triton_qk's q/k projection with QK-norm + RoPE in the epilogue (bf16 tables), every
    autotune config that holds whole heads."""
    from nanochat import triton_qk as tq

    cos, sin = _empty(T, D // 2), _empty(T, D // 2)
    with captured("qk_gemm") as launches:
        tq.mm_rotary_norm(_empty(T, C), _empty(C, C), cos, sin, T, gpu=target)
    return launches


def decode_step(target: AotTarget) -> list[Launch]:
    """The persistent batch-1 decode kernel (one program per SM, grid barriers) at d20's width:
    its constexprs depend on the width, heads and tiles, not on depth, vocabulary or cache length
    (runtime integers), so a 2-layer model with a small vocabulary compiles the same kernel. Twice:
    over bf16 matrices, then over the same model quantised to int8 (nanochat/quantize.py)."""
    from nanochat.attention import KVCache
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.quantize import quantize_model
    from nanochat.triton_decode import PersistentDecodeStep
    from nanochat.triton_decode_kernels import decode_step_kernel

    cfg = GPTConfig(sequence_len=T, vocab_size=256, n_layer=2, n_head=HEADS, n_kv_head=HEADS, n_embd=C)
    with torch.device("meta"):
        model = GPT(cfg, compute_dtype=BF16)
    model = model.to_empty(device="cpu").to(BF16).eval()   # compiled, never run: zeros will do
    for p in model.parameters():
        p.data.zero_()
    cache = KVCache(1, HEADS, T, D, cfg.n_layer, torch.device("cpu"), BF16)
    launches = []
    for quant in ("none", "int8"):
        quantize_model(model, quant)
        with torch.no_grad(), model.inference_weights():
            step = PersistentDecodeStep(model, cache, programs=target.sms, aot=True)
            _, args, kwargs = step.launch_args(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
        launches.append(Launch("decode_step", decode_step_kernel, args, kwargs))
    return launches


def int8_gemv(target: AotTarget) -> list[Launch]:
    """--quantize int8's decode product (nanochat/triton_int8.py) at d20's matrices (fused q/k/v,
    attention and MLP projections, lm_head) for 1, 8 and 64 input rows, bf16: every tile
    gemv_config picks there."""
    from nanochat import triton_int8

    shapes = ((3 * C, C), (C, C), (4 * C, C), (C, 4 * C), (V, C))
    with captured("int8_gemv") as launches:
        for rows in (1, 8, 64):
            for n, k in shapes:
                triton_int8.launch(_empty(rows, k), torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=F32))
    return launches


CASES = {f.__name__: f for f in (ce_rows, mix_norm, rotary_norm_bwd, fp8_cast_transpose, decode_attention,
                                 sampler, mlp_gemm, qk_gemm, int8_gemv, decode_step)}
