"""nanochat/fused_norm.py: the fused residual mix + RMSNorm (--kernel triton) against the plain
autograd path (gpt.plain_mix_norm) and float64; its Triton kernels in the interpreter; what the
compile partitioner keeps with it; the GPU path."""

import pytest
import torch

from nanochat import fused_norm
from nanochat.gpt import GPT, config_for_depth, plain_mix_norm
from nanochat.kernels import build_mix_norm


def _case(dtype, n=96, c=80, lam=1.0, mu=0.1, seed=0):
    """r, x0, upstream grads (float64 masters) and the two scalars; gs is correlated with r and x0
    so the scalars' gradients sum(g * r), sum(g * x0) are not near-zero sums of random signs."""
    g = torch.Generator().manual_seed(seed)
    r = 3 * torch.randn(n, c, generator=g, dtype=torch.float64)
    x0 = torch.randn(n, c, generator=g, dtype=torch.float64)
    gs = 1e-3 * torch.randn(n, c, generator=g, dtype=torch.float64) + 2e-4 * (r + x0)
    gy = 1e-3 * torch.randn(n, c, generator=g, dtype=torch.float64)
    return r, x0, gs, gy, lam, mu


def _grads(fn, case, dtype, device="cpu"):
    """(s, y, dr, dx0, dlam, dmu) in float64 for fn(r, x0, lam, mu) in `dtype`."""
    r64, x064, gs, gy, lam_v, mu_v = case
    pdtype = torch.float64 if dtype == torch.float64 else torch.float32
    r = r64.to(device, dtype).requires_grad_()
    x0 = x064.to(device, dtype).requires_grad_()
    scalars = torch.tensor([lam_v, mu_v], dtype=pdtype, device=device, requires_grad=True)
    s, y = fn(r, x0, scalars[0], scalars[1])   # 0-dim views, as GPT passes resid_lambdas[i]
    loss = (s.double() * gs.to(device)).sum() + (y.double() * gy.to(device)).sum()
    dr, dx0, dsc = torch.autograd.grad(loss, (r, x0, scalars))
    return [t.detach().double().cpu() for t in (s, y, dr, dx0, dsc[0], dsc[1])]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_equals_plain_autograd(dtype):
    """Same values and gradients as the plain path; resid_lambdas' gradient, the only one that
    uses the rebuilt s = y / rstd, to the dtype's rounding."""
    case = _case(dtype)
    want, got = _grads(plain_mix_norm, case, dtype), _grads(fused_norm.mix_norm, case, dtype)
    for a, b in zip(got[:4], want[:4]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(got[5], want[5], rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)
    assert _rel(got[4], want[4]) < (1e-12 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("lam", [1.0, 0.3, 0.05])
def test_bf16_gradients_as_close_to_float64_as_the_plain_path(lam):
    """In bf16 the rebuild is no worse than plain autograd (which rounds lam * r and mu * x0
    separately): every gradient within 2x the plain path's error vs float64 + 1e-3, and < 1e-2."""
    case = _case(torch.bfloat16, n=512, c=256, lam=lam)
    ref = _grads(plain_mix_norm, case, torch.float64)
    plain = _grads(plain_mix_norm, case, torch.bfloat16)
    fused = _grads(fused_norm.mix_norm, case, torch.bfloat16)
    for i in range(2, 6):
        err = _rel(fused[i], ref[i])
        assert err < 1e-2 and err < 2 * _rel(plain[i], ref[i]) + 1e-3, (i, err)


def test_zero_resid_lambda_gives_zero_gradient_not_nan():
    """lam == 0 leaves r unrecoverable: its gradient is 0 (documented), never inf/NaN, and the
    other gradients are still exact."""
    case = _case(torch.float64, lam=0.0)
    want, got = _grads(plain_mix_norm, case, torch.float64), _grads(fused_norm.mix_norm, case, torch.float64)
    assert got[4].item() == 0.0
    for a, b in zip(got[:4] + got[5:], want[:4] + want[5:]):
        torch.testing.assert_close(a, b)


def test_shapes_and_meta():
    """(B, T, C) in and out, the fake impl on the meta device (what compile traces)."""
    r = torch.randn(2, 3, 16)
    s, y = fused_norm.mix_norm(r, torch.randn(2, 3, 16), torch.tensor(1.0), torch.tensor(0.5))
    assert s.shape == y.shape == (2, 3, 16)
    m = torch.empty(6, 16, device="meta", dtype=torch.bfloat16)
    s, y, rstd = torch.ops.nanochat.mix_norm(m, m, torch.empty(2, device="meta"))
    assert s.shape == y.shape == (6, 16) and s.dtype == torch.bfloat16 and rstd.shape == (6, 1)
    assert rstd.dtype == torch.float32


def test_gpt_uses_the_fused_mix_only_while_training():
    calls = []

    def mix(r, x0, lam, mu, add=None):
        calls.append(r.shape)
        return plain_mix_norm(r, x0, lam, mu, add)

    model = GPT(config_for_depth(2, 64, 16, aspect_ratio=32, head_dim=32))
    model.init_weights()
    model.set_mix_norm(mix)
    idx = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        model(idx)
    assert calls == []
    model(idx, idx)
    assert len(calls) == 2


@pytest.mark.parametrize("fn", [plain_mix_norm, fused_norm.mix_norm], ids=["plain", "fused"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_add_inside_equals_the_separate_add(fn, dtype):
    """mix_norm(r, x0, lam, mu, add=a) is mix_norm(r + a, ...) bit for bit: values, and the one
    gradient that r and a share."""
    r64, x064, gs, gy, lam_v, mu_v = _case(dtype)
    a64 = torch.randn(r64.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    outs = []
    for fused_add in (True, False):
        r, a, x0 = (t.to(dtype).requires_grad_() for t in (r64, a64, x064))
        scalars = torch.tensor([lam_v, mu_v], dtype=torch.float32, requires_grad=True)
        s, y = (fn(r, x0, scalars[0], scalars[1], add=a) if fused_add else fn(r + a, x0, scalars[0], scalars[1]))
        loss = (s.double() * gs).sum() + (y.double() * gy).sum()
        outs.append((s, y, *torch.autograd.grad(loss, (r, a, x0, scalars))))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(outs[0][2], outs[0][3])   # dr == da


@pytest.mark.parametrize("fuse_add,chain_x0", [(True, False), (False, True), (True, True)])
def test_gpt_fused_add_and_x0_chain_match_the_separate_passes(fuse_add, chain_x0):
    """The model with each block's output summed inside the fused mix-norm and/or x0 passed
    through it (its gradient summed in the backward op; the defaults) against both as separate
    passes (set_mix_norm(..., fuse_add=False, chain_x0=False): bench_train --unfuse
    mixadd,x0acc): loss and every gradient bit for bit (float32, eager), the embedding's, whose
    x0 gradient adds up in another order, to float32 rounding."""
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    for flags in ((fuse_add, chain_x0), (False, False)):
        model = _tiny_model(fused_norm.mix_norm).float()
        model.compute_dtype = torch.float32
        model.set_mix_norm(fused_norm.mix_norm, fuse_add=flags[0], chain_x0=flags[1])
        loss = model(idx, idx.roll(-1, 1))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    assert torch.equal(l0, l1)
    for name in g0:
        if name == "wte.weight" and chain_x0:
            torch.testing.assert_close(g0[name], g1[name], rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(g0[name], g1[name]), name


def test_x0_chain_is_the_default_of_the_fused_op():
    model = GPT(config_for_depth(2, 64, 16, aspect_ratio=32, head_dim=32))
    assert not model.mix_norm_chains_x0
    model.set_mix_norm(fused_norm.mix_norm)
    assert model.mix_norm_chains_x0 and model.mix_norm_fuses_add
    model.set_mix_norm(plain_mix_norm)   # a fn without chains_x0 gets the plain call
    assert not model.mix_norm_chains_x0


def test_build_mix_norm_per_kernel():
    assert build_mix_norm("current") is None and build_mix_norm("liger") is None
    assert build_mix_norm("triton") is fused_norm.mix_norm
    with pytest.raises(ValueError, match="--kernel: got 'fast'; accepted: current|liger|triton"):
        build_mix_norm("fast")
    with pytest.raises(ValueError, match="set_mix_norm: expected a callable"):
        GPT(config_for_depth(2, 64, 16, aspect_ratio=32, head_dim=32)).set_mix_norm(3)


def _tiny_model(mix, seed=0):
    torch.manual_seed(seed)
    cfg = config_for_depth(3, 256, 32, aspect_ratio=64, head_dim=64)
    model = GPT(cfg, attn_backend="sdpa", compute_dtype=torch.float64).double()
    model.init_weights()
    with torch.no_grad():   # leave the zero-init projections and scalars off their start values
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.set_mix_norm(mix)
    if mix is not None:
        model.set_rotary_norm(fused_norm.rotary_norm)
    return model


@pytest.mark.parametrize("compiled", [False, True])
def test_gpt_with_fused_mix_matches_plain(compiled):
    """The whole model with --kernel triton's mix and QK-norm (CPU paths) vs the plain model, float64, eager and
    traced whole (fullgraph): loss and every parameter's gradient to 1e-9. (The fused loss,
    float32 inside, is compared in test_kernels.py.)"""
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    grads = []
    for kernel in ("current", "triton"):
        model = _tiny_model(build_mix_norm(kernel))
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        loss = run(idx, idx.roll(-1, 1))
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=1e-10, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-9, atol=1e-12, msg=name)


def test_triton_kernels_interpreted(run_triton_interpreted):
    """The Triton kernels themselves (TRITON_INTERPRET=1) against the torch twin: a width that
    is not a power of two, float32 and bfloat16."""
    script = (
        "import torch\n"
        "from nanochat import fused_norm as F\n"
        "from nanochat.triton_kernels import mix_norm_fwd_triton, mix_norm_bwd_triton\n"
        "torch.manual_seed(0)\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    r, x0, gs, gy = (torch.randn(5, 48).to(dt) for _ in range(4))\n"
        "    lm = torch.tensor([0.8, 0.2])\n"
        "    got = mix_norm_fwd_triton(r, x0, lm, torch.finfo(torch.float32).eps)\n"
        "    want = F.mix_norm_torch(r, x0, lm)\n"
        "    tol = dict(rtol=1e-5, atol=1e-6) if dt == torch.float32 else dict(rtol=1e-2, atol=1e-2)\n"
        "    for a, b in zip(got, want):\n"
        "        torch.testing.assert_close(a.float(), b.float(), **tol)\n"
        "    s, y, rstd = want\n"
        "    acc = torch.randn(5, 48).to(dt)\n"   # the later blocks' x0 gradient, summed in the kernel
        "    _, gx0a, _ = mix_norm_bwd_triton(gs, gy, y, rstd, x0, lm, acc)\n"
        "    _, wx0a, _ = F.mix_norm_bwd_torch(gs, gy, y, rstd, x0, lm, acc)\n"
        "    torch.testing.assert_close(gx0a.float(), wx0a.float(), **tol)\n"
        "    gr, gx0, part = mix_norm_bwd_triton(gs, gy, y, rstd, x0, lm)\n"
        "    wr, wx0, wpart = F.mix_norm_bwd_torch(gs, gy, y, rstd, x0, lm)\n"
        "    torch.testing.assert_close(gx0a.float(), (gx0.float() + acc.float()), **tol)\n"
        "    torch.testing.assert_close(gr.float(), wr.float(), **tol)\n"
        "    torch.testing.assert_close(gx0.float(), wx0.float(), **tol)\n"
        "    assert part.shape == (5, 2)\n"
        "    torch.testing.assert_close(part.sum(0), wpart.sum(0), rtol=1e-4, atol=1e-5)\n"
        "    add = torch.randn(5, 48).to(dt)\n"   # the residual add inside: as if r + add came in
        "    got = mix_norm_fwd_triton(r, x0, lm, torch.finfo(torch.float32).eps, add)\n"
        "    want = mix_norm_fwd_triton(r + add, x0, lm, torch.finfo(torch.float32).eps)\n"
        "    if dt == torch.float32:\n"   # the interpreter casts float32 -> bf16 by truncation, not RN
        "        for a, b, c in zip(got, want, F.mix_norm_torch(r, x0, lm, add)):\n"
        "            assert torch.equal(a, b)\n"
        "            torch.testing.assert_close(a, c, **tol)\n"
        "    else:\n"
        "        assert all(torch.allclose(a.float(), b.float(), 1e-2, 2e-2) for a, b in zip(got, want))\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


# ------------------------------------------------------------------------------------ GPU

@pytest.mark.cuda
def test_cuda_fused_matches_plain_in_bf16():
    """The Triton kernels on the GPU, bf16 at d20's width: every gradient within 2x the plain bf16
    path's error vs float64 + 1e-3."""
    case = _case(torch.bfloat16, n=8192, c=1280)
    ref = _grads(plain_mix_norm, case, torch.float64)
    plain = _grads(plain_mix_norm, case, torch.bfloat16, "cuda")
    fused = _grads(fused_norm.mix_norm, case, torch.bfloat16, "cuda")
    for i in range(6):
        err = _rel(fused[i], ref[i])
        assert err < 1e-2 and err < 2 * _rel(plain[i], ref[i]) + 1e-3, (i, err)
    # the residual add inside the kernel gives what the separate add (rounded to bf16) gives
    r, a, x0 = (torch.randn(8192, 1280, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    lam, mu = torch.tensor(0.9, device="cuda"), torch.tensor(0.2, device="cuda")
    for got, want in zip(fused_norm.mix_norm(r, x0, lam, mu, add=a), fused_norm.mix_norm(r + a, x0, lam, mu)):
        assert torch.equal(got, want)


# ------------------------------------------------------------------------------ QK-norm + RoPE

def _rotary_case(B=2, T=6, H=3, D=16, seed=0):
    from nanochat.gpt import rotary_tables
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    dy = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    cos, sin = rotary_tables(T, D)
    return x, dy, cos, sin


def _rotary_grads(fn, x, dy, cos, sin, dtype, device="cpu"):
    xl = x.to(device, dtype).requires_grad_()
    y = fn(xl, cos.to(device, dtype), sin.to(device, dtype))
    (gx,) = torch.autograd.grad((y.double() * dy.to(device)).sum(), xl)
    return y.detach().double().cpu(), gx.double().cpu()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rotary_norm_one_pass_backward_equals_plain(dtype):
    """fused_norm.rotary_norm: the same output and the same input gradient as gpt.rotary_norm
    (float64: to rounding; float32: the same float32 math)."""
    from nanochat.gpt import rotary_norm as plain
    case = _rotary_case()
    y0, g0 = _rotary_grads(plain, *case, dtype)
    y1, g1 = _rotary_grads(fused_norm.rotary_norm, *case, dtype)
    assert torch.equal(y0, y1)
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(g1, g0, rtol=tol, atol=tol)


def test_gpt_rotary_norm_setter_and_build():
    from nanochat import gpt
    from nanochat.kernels import build_rotary_norm
    assert build_rotary_norm("current") is None and build_rotary_norm("liger") is None
    fn = build_rotary_norm("triton", "cpu")
    assert fn is fused_norm.rotary_norm
    model = GPT(config_for_depth(2, 64, 32, head_dim=16))
    model.set_rotary_norm(fn)
    assert all(b.attn.rotary_norm is fn for b in model.blocks)
    model.set_rotary_norm(None)
    assert all(b.attn.rotary_norm is gpt.rotary_norm for b in model.blocks)
    with pytest.raises(ValueError, match="--kernel"):
        build_rotary_norm("fast")


def test_rotary_norm_bwd_kernel_interpreted(run_triton_interpreted):
    """The Triton kernel (TRITON_INTERPRET=1) against the torch twin: a strided dy (attention's
    (B, H, T, D) gradient seen as (B, T, H, D)), rows not a multiple of the block, bf16 and float32;
    with_amax returns the same gradient and exactly its abs-max (atomics over several programs)."""
    script = (
        "import torch\n"
        "from nanochat import fused_norm as F\n"
        "from nanochat.gpt import _rms, apply_rotary, rotary_tables\n"
        "from nanochat.triton_kernels import rotary_norm_bwd_triton\n"
        "torch.manual_seed(0)\n"
        "B, T, H, D = 2, 5, 3, 16\n"
        "cos, sin = rotary_tables(T, D)\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    x = torch.randn(B, T, H, D)\n"
        "    y, rstd = _rms(apply_rotary(x, cos, sin))\n"
        "    y = y.to(dt)\n"
        "    dy = torch.randn(B, H, T, D).to(dt).transpose(1, 2)\n"
        "    c, s = cos.reshape(T, D // 2).contiguous(), sin.reshape(T, D // 2).contiguous()\n"
        "    got = rotary_norm_bwd_triton(dy, y, rstd, c, s, block_rows=4)\n"
        "    want = F.rotary_norm_bwd_torch(dy, y, rstd, c, s)\n"
        "    assert got.dtype == dt and got.is_contiguous()\n"
        "    tol = dict(rtol=1e-5, atol=1e-6) if dt == torch.float32 else dict(rtol=1e-2, atol=1e-2)\n"
        "    torch.testing.assert_close(got.float(), want.float(), **tol)\n"
        "    got2, amax = rotary_norm_bwd_triton(dy, y, rstd, c, s, block_rows=4, with_amax=True)\n"
        "    assert torch.equal(got2, got) and amax.dtype == torch.float32 and amax.ndim == 0\n"
        "    assert amax.item() == got.float().abs().max().item()   # the stored values' max, exactly\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


@pytest.mark.cuda
def test_cuda_rotary_norm_one_pass_matches_plain_bf16():
    """On the GPU at d20's head shape (bf16): the one-pass backward's gradient is as close to
    float64 as the plain bf16 backward's."""
    from nanochat.gpt import rotary_norm as plain
    case = _rotary_case(B=4, T=256, H=10, D=128)
    _, ref = _rotary_grads(plain, *case, torch.float64)
    _, g_plain = _rotary_grads(plain, *case, torch.bfloat16, "cuda")
    _, g_fused = _rotary_grads(fused_norm.rotary_norm, *case, torch.bfloat16, "cuda")
    assert _rel(g_fused, ref) < 1.1 * _rel(g_plain, ref) + 1e-4


def test_benchmark_kernels_rope_mode_on_cpu(capsys):
    """benchmark_kernels --mode rope is a CUDA benchmark: on a CPU it reports that, in a row."""
    from scripts import benchmark_kernels
    assert benchmark_kernels.main(["--mode", "rope", "--device", "cpu", "--no-compile"]) == 1   # nothing measured: exit 1
    out = capsys.readouterr().out
    assert "rope" in out and "needs a CUDA GPU" in out
