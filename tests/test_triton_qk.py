"""nanochat/triton_qk.py: the q / k projection with RoPE + QK-norm in its GEMM's epilogue, in the
interleaved head order. On CPU the whole model runs with it (torch math) and must give the plain
model's loss and gradients, which is what shows that the interleaved order is invisible outside
attention; the kernels run under TRITON_INTERPRET=1; the real ones on the GPU."""
import functools

import pytest
import torch

from nanochat import fp8_qk, fused_norm, triton_qk
from nanochat.gpt import GPT, CausalSelfAttention, Linear, config_for_depth, rotary_norm, rotary_tables
from nanochat.kernels import build_qkv_projection


def _loss_and_grads(model, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("n_kv_head", [None, 1])
def test_model_with_interleaved_qk_equals_plain_model(n_kv_head):
    """Depth 2 (both layer kinds: window and full, value embeddings), GQA too: the same loss and
    the same gradient for every parameter, incl. c_q / c_k (mapped back through the interleave)."""
    torch.manual_seed(0)
    cfg = config_for_depth(2, 96, 32, aspect_ratio=64, head_dim=32)
    if n_kv_head:
        cfg.n_kv_head = n_kv_head
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():   # c_proj starts at zero: give every path a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    idx, targets = torch.randint(0, 96, (3, 32)), torch.randint(0, 96, (3, 32))
    want_loss, want = _loss_and_grads(model, idx, targets)
    model.set_qkv_projection(triton_qk.qkv_rotary_norm)
    got_loss, got = _loss_and_grads(model, idx, targets)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert want["blocks.0.attn.c_q.weight"].abs().max() > 0


def test_interleave_pairs_each_heads_halves():
    w = torch.arange(2 * 8).float().view(2 * 8, 1)   # 2 heads of D = 8: rows 0..7, 8..15
    got = triton_qk.interleave(w, 8).flatten().tolist()
    assert got == [0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15]


def _attn(C, H, D, Hkv=None, device="cpu", dtype=torch.float64, seed=0, layer=0):
    """Layer 0 of a depth-2 model, or layer 1: with a value-embedding gate (random, not zero)."""
    cfg = config_for_depth(2, 64, 8, aspect_ratio=C // 2, head_dim=D)
    cfg.n_kv_head = Hkv or H
    attn = CausalSelfAttention(cfg, layer).to(device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in (attn.c_q, attn.c_k, attn.c_v, attn.ve_gate):
            if lin is not None:
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.weight.shape[1] ** 0.5)
    return attn.to(dtype)


def _uninterleave(t: torch.Tensor) -> torch.Tensor:
    """The plain head-dim order back from triton_qk's interleaved one (last dim)."""
    d = t.shape[-1]
    perm = triton_qk.interleave(torch.arange(d)[:, None], d)[:, 0]
    return t[..., torch.argsort(perm).to(t.device)]


def _plain_qkv(attn, x, cos, sin):
    B, T, _ = x.shape
    H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
    gate = attn.ve_gate(x[..., :attn.gate_channels]) if attn.ve_gate is not None else None
    return (rotary_norm(attn.c_q(x).view(B, T, H, D), cos, sin), rotary_norm(attn.c_k(x).view(B, T, Hkv, D), cos, sin),
            attn.c_v(x), gate)


@pytest.mark.parametrize("layer", [0, 1])
def test_output_is_the_plain_rotary_norm_interleaved(layer):
    """q and k are rotary_norm(c(x)) with each head's halves interleaved; v is c_v(x) (GQA); the
    gate's logits ve_gate(x[..., :channels]) in a value-embedding layer (1), else None. The
    gradients of x and of every weight (the gate's input gradient summed into dx by the op) are
    those of the plain chain."""
    B, T, D = 2, 8, 16
    attn = _attn(48, 3, D, Hkv=1, layer=layer)
    assert (attn.ve_gate is not None) == (layer == 1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, 48, generator=g, dtype=torch.float64)
    cos, sin = rotary_tables(T, D)
    ups = [torch.randn(shape, generator=g, dtype=torch.float64) for shape in
           ((B, T, 3, D), (B, T, 1, D), (B, T, D), (B, T, 1))]

    def run(fn):
        attn.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_()
        out = list(fn(attn, xl, cos, sin))
        if fn is triton_qk.qkv_rotary_norm:
            out[0], out[1] = _uninterleave(out[0]), _uninterleave(out[1])
        live = [(o, u) for o, u in zip(out, ups) if o is not None]
        torch.autograd.backward([o for o, _ in live], [u for _, u in live])
        return out, xl.grad, {n: p.grad for n, p in attn.named_parameters()}

    (got, gx, gw), (want, wx, ww) = run(triton_qk.qkv_rotary_norm), run(_plain_qkv)
    assert got[0].shape == (B, T, 3, D) and got[1].shape == (B, T, 1, D) and got[2].shape == (B, T, D)
    assert (got[3] is None) == (layer == 0)
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a, b)
    torch.testing.assert_close(gx, wx)
    assert gw.keys() == ww.keys()
    for name in ww:
        torch.testing.assert_close(gw[name], ww[name], msg=name)


def test_fusable_and_dispatch_on_cpu():
    """fusable needs the model's own Linear, a CUDA bf16/fp16 input with grad, whole power-of-two
    heads: on CPU the hook keeps the plain chain even with bf16_gemm; build_qkv_projection turns
    the GEMM off where the probe cannot run, saying why."""
    lin, x = Linear(32, 64), torch.randn(2, 4, 32)
    assert not triton_qk.fusable(lin, x, 2)   # CPU
    assert not triton_qk.fusable(torch.nn.Linear(32, 64, bias=False), x, 2)
    attn = _attn(32, 2, 16, dtype=torch.float32)
    assert not triton_qk.fusable_qkv(attn, x)
    cos, sin = rotary_tables(4, 16)
    got = fp8_qk.qkv_projection(attn, x, cos, sin, bf16_gemm=True)
    want = (rotary_norm(attn.c_q(x).view(2, 4, 2, 16), cos, sin), rotary_norm(attn.c_k(x).view(2, 4, 2, 16), cos, sin),
            attn.c_v(x))
    assert len(got) == 4 and got[3] is None   # the plain chain leaves the gate to the caller
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert triton_qk.probe("cpu") == "needs a CUDA GPU (device is cpu)"
    fn = build_qkv_projection("triton", "cpu")
    assert isinstance(fn, functools.partial) and fn.keywords == {"bf16_gemm": False}
    assert build_qkv_projection("current", "cpu") is None


def test_kernels_interpreted(run_triton_interpreted):
    """The GEMM + rotary-norm epilogue (tiles of one head, rows that do not fill a tile) and the
    rotary backward's paired mode under TRITON_INTERPRET=1 (float32), against the torch math."""
    script = (
        "import torch\n"
        "from nanochat import triton_qk\n"
        "from nanochat.gpt import rotary_tables\n"
        "from nanochat.triton_kernels import rotary_norm_bwd_triton\n"
        "torch.manual_seed(0)\n"
        "T, H, D, C = 24, 3, 16, 32\n"
        "a, w = torch.randn(2 * T, C), torch.randn(H * D, C) / C ** 0.5\n"
        "cos, sin = (t.reshape(T, -1).contiguous() for t in rotary_tables(T, D))\n"
        "got, got_rstd = triton_qk.mm_rotary_norm(a, w, cos, sin, T)\n"
        "want, want_rstd = triton_qk._mm_rotary_norm_torch(a, w, cos, sin)\n"
        "torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)\n"
        "torch.testing.assert_close(got_rstd, want_rstd, rtol=1e-5, atol=1e-6)\n"
        "y, rstd = got.view(2, T, H, D), got_rstd.view(2, T, H, 1)\n"
        "dy = torch.randn(2, H, T, D).transpose(1, 2)\n"   # attention's gradient layout
        "g = rotary_norm_bwd_triton(dy, y, rstd, cos, sin, paired=True)\n"
        "import os; os.environ.pop('TRITON_INTERPRET')\n"
        "ref = triton_qk.rotary_norm_bwd_paired(dy, y, rstd, cos, sin)\n"
        "torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-5)\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


# ------------------------------------------------------------------------------------ GPU

@pytest.mark.cuda
@pytest.mark.parametrize("tiles", ["large", "small"])
def test_cuda_every_tile_of_a_set_matches_torch(tiles, each_tile_on_gpu):
    """Each tile of a set (triton_mlp.tile_set), launched on its own, gives the rotary norm of the
    product within 1e-2 of float32 torch (the small set is GB10's; here its arithmetic only)."""
    from nanochat import triton_mlp as tm
    if triton_qk.probe("cuda") is not None:
        pytest.skip(triton_qk.probe("cuda"))
    here = tm.device_gpu(torch.cuda.current_device())
    gpu = here if tiles == "large" else tm.GemmGpu(here.sms, 101_376)
    if tm.tile_set(gpu) != tiles:
        pytest.skip(f"this GPU has {here.smem_per_block} B of shared memory per block: the small set")
    T, C, D = 512, 1280, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2 * T, C, device="cuda", generator=g).bfloat16()
    w = (torch.randn(C, C, device="cuda", generator=g) / C**0.5).bfloat16()
    cos, sin = (t[0, :, 0, :].bfloat16().contiguous() for t in rotary_tables(T, D, "cuda"))
    want, want_rstd = triton_qk._mm_rotary_norm_torch(a.float(), w.float(), cos.float(), sin.float())
    got = {}

    def calls():
        got["out"], got["rstd"] = triton_qk.mm_rotary_norm(a, w, cos, sin, T, gpu=gpu)
    n = 0
    for launch, ok in each_tile_on_gpu(calls, gpu):
        assert ok, launch.label   # every tile of a set fits the GPUs it is for
        torch.cuda.synchronize()
        err = ((got["out"].float() - want).norm() / want.norm()).item()
        assert err < 1e-2 and torch.allclose(got["rstd"], want_rstd, rtol=1e-2), (launch.label, err)
        got["out"].zero_()
        n += 1
    assert n == len(triton_qk._TILES[tiles])


@pytest.mark.cuda
def test_cuda_fused_qkv_projection_matches_plain_bf16():
    """d20's width, bf16, (B, T) = (4, 2048): q / k / v (q, k interleaved back) and the gradients of
    x and of the three weights at least as close to float64 as the plain bf16 chain's (2x + 1e-3),
    under 2e-2."""
    if triton_qk.probe("cuda") is not None:
        pytest.skip(triton_qk.probe("cuda"))
    B, T, H, D, C = 4, 2048, 10, 128, 1280
    attn = _attn(C, H, D, device="cuda", dtype=torch.float32, layer=1)   # with the value-embedding gate
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, T, C, device="cuda", generator=g)
    grads = [torch.randn(B, T, H, D, device="cuda", generator=g) for _ in range(2)]
    grads.append(torch.randn(B, T, C, device="cuda", generator=g))
    grads.append(torch.randn(B, T, H, device="cuda", generator=g))   # the gate's logits
    cos, sin = rotary_tables(T, D, "cuda")
    attn.rotary_norm = fused_norm.rotary_norm

    def run(dtype, bf16_gemm):
        lins = (attn.c_q, attn.c_k, attn.c_v, attn.ve_gate)
        for lin in lins:
            lin.weight.grad = None
        xl = x.to(dtype).requires_grad_()
        q, k, v, gate = fp8_qk.qkv_projection(attn, xl, cos.to(dtype), sin.to(dtype), bf16_gemm=bf16_gemm)
        assert (gate is None) == (not bf16_gemm)   # the plain chain leaves the gate to the caller
        if bf16_gemm:
            q, k = _uninterleave(q), _uninterleave(k)
        else:
            gate = attn.ve_gate(xl[..., :attn.gate_channels])
        out = (q, k, v, gate)
        torch.autograd.backward(out, [gr.to(dtype) for gr in grads])
        return [t.double() for t in (*out, xl.grad, *(lin.weight.grad for lin in lins))]

    ref, base = run(torch.float64, False), run(torch.bfloat16, False)
    assert triton_qk.fusable_qkv(attn, x.bfloat16().requires_grad_())
    got = run(torch.bfloat16, True)
    for name, a, b, r in zip(("q", "k", "v", "gate", "dx", "dwq", "dwk", "dwv", "dwg"), got, base, ref):
        err, err_base = ((a - r).norm() / r.norm()).item(), ((b - r).norm() / r.norm()).item()
        assert err < 2e-2 and err < 2 * err_base + 1e-3, (name, err, err_base)
