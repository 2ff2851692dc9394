"""nanochat/triton_mlp.py: the GEMM with fused relu^2 / relu^2-gradient epilogues (interpreter on
CPU, the real kernel on the GPU) and the MLP custom op against the plain Linear MLP."""

import functools

import pytest
import torch

from nanochat.gpt import GPT, MLP, config_for_depth
from nanochat.kernels import build_mlp
from nanochat.triton_mlp import relu2_mlp


def _plain_mlp(x, w_fc, w_proj):
    return torch.relu(x @ w_fc.to(x.dtype).t()).square() @ w_proj.to(x.dtype).t()


def _mlp_grads(fn, x, w_fc, w_proj, gy):
    x, w_fc, w_proj = (t.detach().clone().requires_grad_() for t in (x, w_fc, w_proj))
    y = fn(x, w_fc, w_proj)
    grads = torch.autograd.grad(y, (x, w_fc, w_proj), gy.to(y.dtype))
    return [y.detach().double()] + [g.double() for g in grads]


def _case(n, c, device="cpu", dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, generator=g, dtype=torch.float64)
    w_fc = torch.randn(4 * c, c, generator=g, dtype=torch.float64) / c**0.5
    w_proj = torch.randn(c, 4 * c, generator=g, dtype=torch.float64) / (4 * c) ** 0.5
    gy = torch.randn(n, c, generator=g, dtype=torch.float64)
    return x.to(device, dtype), w_fc.to(device), w_proj.to(device), gy.to(device)


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_relu2_mlp_op_matches_plain_mlp_on_cpu():
    """The custom op (CPU math) = the plain MLP through autograd: output and the three gradients,
    float64, with fp32 master weights cast like Linear (their gradients come back fp32)."""
    x, w_fc, w_proj, gy = _case(24, 16)
    w_fc, w_proj = w_fc.float(), w_proj.float()
    x = x.float()
    want = _mlp_grads(_plain_mlp, x, w_fc, w_proj, gy)
    got = _mlp_grads(relu2_mlp, x, w_fc, w_proj, gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gpt_set_mlp_fn_contract():
    """The model's MLPs call the installed function with fp32 master weights; swapped precision
    layers refuse it; None restores the Linear path; bad values raise."""
    torch.manual_seed(0)
    model = GPT(config_for_depth(2, 64, 16, aspect_ratio=32, head_dim=32))
    model.init_weights()
    idx = torch.randint(0, 64, (2, 16))
    ref = model(idx, idx)
    calls = []

    def fn(x, w_fc, w_proj):
        calls.append(w_fc.dtype)
        return _plain_mlp(x, w_fc, w_proj)

    model.set_mlp_fn(fn)
    torch.testing.assert_close(model(idx, idx), ref)
    assert calls == [torch.float32] * 2
    with torch.no_grad():   # inference keeps the Linear path
        torch.testing.assert_close(model(idx, idx), ref)
    assert len(calls) == 2
    model.set_mlp_fn(relu2_mlp)
    torch.testing.assert_close(model(idx, idx), ref, rtol=1e-5, atol=1e-6)
    model.set_mlp_fn(None)
    assert all(b.mlp.fused is None for b in model.blocks)
    with pytest.raises(ValueError, match="set_mlp_fn: expected a callable"):
        model.set_mlp_fn("fast")
    model.blocks[0].mlp.c_fc = torch.nn.Linear(32, 128, bias=False)   # what precision.py swaps in
    with pytest.raises(ValueError, match="layers are Linear .swapped by precision.py"):
        model.set_mlp_fn(relu2_mlp)
    assert isinstance(model.blocks[1].mlp, MLP)


def _fp8_model_mlp(c, fused):
    """An MLP whose Linears are precision.py's Fp8Linear; `fused` installs the fp8 fused op the
    way GPT.set_mlp_fn does."""
    from nanochat.precision import Fp8Linear
    from nanochat.triton_mlp import fp8_relu2_mlp
    mlp = MLP(config_for_depth(2, 64, 16, aspect_ratio=c // 2, head_dim=c // 2))
    mlp.c_fc.__class__, mlp.c_proj.__class__ = Fp8Linear, Fp8Linear
    mlp.fused = fp8_relu2_mlp if fused else None
    return mlp


def _fp8_grads(mlp, x, gy):
    x = x.detach().clone().requires_grad_()
    y = mlp(x)
    grads = torch.autograd.grad(y, (x, mlp.c_fc.weight, mlp.c_proj.weight), gy.to(y.dtype))
    return [y.detach().double()] + [g.double() for g in grads]


def test_fp8_relu2_mlp_matches_fp8_linears_on_cpu():
    """The fused fp8 MLP (CPU: the same scales, casts and _scaled_mm calls, the epilogue GEMM in
    float32 torch) against two Fp8Linear layers and relu^2: the same recipe, so both sit about
    equally far from the float64 MLP, and close to each other; weight gradients come back in
    the master weights' dtype."""
    from test_precision import _has_cpu_scaled_mm
    if not _has_cpu_scaled_mm():
        pytest.skip("this torch has no CPU _scaled_mm")
    torch.manual_seed(0)
    plain, fused = _fp8_model_mlp(64, False), _fp8_model_mlp(64, True)
    fused.load_state_dict(plain.state_dict())
    x, gy = torch.randn(96, 64).bfloat16(), torch.randn(96, 64)
    ref = _mlp_grads(_plain_mlp, x.double(), plain.c_fc.weight.double(), plain.c_proj.weight.double(), gy)
    got_p, got_f = _fp8_grads(plain, x, gy), _fp8_grads(fused, x, gy)
    for i, (f, p, r) in enumerate(zip(got_f, got_p, ref)):
        assert _rel(f, r) < 0.15 and _rel(f, r) < 1.5 * _rel(p, r) + 1e-2, (i, _rel(f, r), _rel(p, r))
        assert _rel(f, p) < 0.06, (i, _rel(f, p))
    assert fused.c_fc.weight.dtype == torch.float32
    # 15 rows (not a multiple of 16): both run the plain MLP in the compute dtype, as Fp8Linear does
    odd, g_odd = torch.randn(3, 5, 64).bfloat16(), torch.randn(3, 5, 64)
    for a, b in zip(_fp8_grads(fused, odd, g_odd), _fp8_grads(plain, odd, g_odd)):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_fp8_probe_reference_plumbing_on_cpu():
    """The fp8 probe compares the GPU kernels with `torch_math=True` on the same device; on CPU
    both are the torch math, so the two runs agree exactly (the flag reaches both GEMMs)."""
    from test_precision import _has_cpu_scaled_mm
    from nanochat.triton_mlp import _fp8_probe_outputs
    if not _has_cpu_scaled_mm():
        pytest.skip("this torch has no CPU _scaled_mm")
    g = torch.Generator().manual_seed(0)
    x, gy = (torch.randn(32, 16, generator=g).bfloat16() for _ in range(2))
    w_fc, w_proj = torch.randn(64, 16, generator=g) / 4, torch.randn(16, 64, generator=g) / 8
    a, b = _fp8_probe_outputs(x, gy, w_fc, w_proj), _fp8_probe_outputs(x, gy, w_fc, w_proj, torch_math=True)
    assert len(a) == 8 and all(torch.equal(u, v) for u, v in zip(a, b))
    # y, h2, then dx, dw_fc, dw_proj with dL/dh cast in the epilogue and by a separate pass
    assert [tuple(t.shape) for t in a] == [(32, 16), (32, 64)] + [(32, 16), (64, 16), (16, 64)] * 2
    for u, v in zip(a[2:5], a[5:]):   # the two casts' scales differ: close, not equal
        assert ((u - v).norm() / v.norm()).item() < 0.1


def test_gh_bound_scale_never_overflows_and_stays_close():
    """The e5m2 scale of relu^2's input gradient comes from a bound, not an abs-max: on random
    data and on the worst case (every term at its maximum, signs aligned) the scaled gradient
    never exceeds E5M2_MAX; on random data the bound sits well inside e5m2's range (the real
    abs-max lands above 2^-2, i.e. the gradient's bulk stays in normal numbers); the fused fp8
    backward's dL/dh equals the bf16-rounded product cast with that scale (CPU torch math)."""
    from nanochat.precision import E4M3_MAX, E5M2_MAX, to_fp8
    from nanochat.triton_mlp import _fp8_epilogue_pair, gh_bound_scale
    g = torch.Generator().manual_seed(0)
    k, n, m = 256, 1024, 512
    for worst in (False, True):
        gy = torch.ones(m, k) if worst else torch.randn(m, k, generator=g)
        w = torch.ones(k, n) * 0.03 if worst else torch.randn(k, n, generator=g) * 0.03
        h2 = torch.ones(m, n) * 9 if worst else torch.rand(m, n, generator=g).square() * 9
        (g_q, g_inv), (w_q, w_inv) = to_fp8(gy, torch.float8_e5m2), to_fp8(w.t(), torch.float8_e4m3fn)
        h_scale = (E4M3_MAX / h2.abs().amax()).reshape(1)
        s = gh_bound_scale(k, g_inv, w_inv, h_scale)
        exact = (g_q.float() * g_inv) @ (w_q.float() * w_inv).t() * 2 * h2.sqrt()
        peak = (exact.abs().max() * s).item()
        assert peak <= E5M2_MAX * (1 + 1e-5), (worst, peak)
        if worst:
            assert peak > E5M2_MAX * 0.99   # the bound is tight there
        else:
            assert 2.0 ** -2 < peak < E5M2_MAX / 64, peak
        q, qt = _fp8_epilogue_pair(g_q, w_q.t().contiguous().t().contiguous(), g_inv * w_inv * s, h2)
        assert q.dtype == torch.float8_e5m2 and torch.equal(qt, q.t())
        rel = ((q.float() / s - exact).norm() / exact.norm()).item()
        assert rel < 0.1, rel   # e5m2's 2-bit mantissa: ~4-6% relative error in norm


def test_set_mlp_fn_accepts_only_the_layers_fn_replaces():
    from nanochat.precision import Fp8Linear
    from nanochat.triton_mlp import fp8_relu2_mlp
    model = GPT(config_for_depth(2, 64, 16, aspect_ratio=32, head_dim=32))
    fn = functools.partial(fp8_relu2_mlp, grad_dtype=torch.float8_e5m2)
    fn.replaces = (Fp8Linear,)
    with pytest.raises(ValueError, match="layers are Linear .*replaces only Fp8Linear"):
        model.set_mlp_fn(fn)
    per_run = type("Fp8LinearG", (Fp8Linear,), {"grad_dtype": torch.float8_e4m3fn})   # as convert_model makes
    for block in model.blocks:
        block.mlp.c_fc.__class__, block.mlp.c_proj.__class__ = per_run, per_run
    model.set_mlp_fn(fn)
    assert all(b.mlp.fused is fn for b in model.blocks)
    with pytest.raises(ValueError, match="layers are Fp8LinearG"):
        model.set_mlp_fn(relu2_mlp)


def test_probe_names_why_not_without_a_gpu():
    from nanochat.triton_mlp import probe
    assert probe("cpu") == "needs a CUDA GPU (device is cpu)"


def test_build_mlp_only_for_triton_bf16_on_tma_gpus():
    for args in (("current", "cuda", "bf16"), ("triton", "cuda", "fp8"), ("triton", "cpu", "bf16"),
                 ("liger", "cuda", "bf16"), ("triton", "cuda", "nvfp4")):
        assert build_mlp(*args) is None, args
    # fp8 only through native Fp8Linear layers whose wgrad mode the fused op implements (save):
    # not TE / torchao modules, not a layer kept high-precision, not the recompute mode
    from nanochat.precision import Fp8Linear
    recompute = _fp8_model_mlp(64, False).c_fc
    recompute.wgrad_mode = "recompute"
    for layer in (None, torch.nn.Linear(64, 256, bias=False), MLP(config_for_depth(2, 64, 16)).c_fc, recompute):
        assert build_mlp("triton", "cuda", "fp8", layer=layer) is None, layer
    assert isinstance(recompute, Fp8Linear)
    assert build_mlp("triton", "cpu", "fp8", layer=_fp8_model_mlp(64, False).c_fc) is None
    with pytest.raises(ValueError, match="--kernel: got 'x'"):
        build_mlp("x", "cpu", "bf16")


def test_epilogue_gemm_interpreted(run_triton_interpreted):
    """The persistent TMA kernel itself under TRITON_INTERPRET=1 (float32: the interpreter
    mishandles bf16 descriptors): both B layouts, all epilogues, tiles that do not divide M, N."""
    script = (
        "import torch\n"
        "from nanochat.triton_mlp import mm_epilogue\n"
        "torch.manual_seed(0)\n"
        "a, w, wkn, aux = torch.randn(70, 48), torch.randn(40, 48), torch.randn(48, 40), torch.rand(70, 40)\n"
        "for b, kn in ((w, False), (wkn, True)):\n"
        "    c = a @ (b if kn else b.t())\n"
        "    for ep, ax, want in (('none', None, c), ('relu2', None, torch.relu(c).square()),\n"
        "                         ('relu2_grad', aux, c * 2 * aux.sqrt())):\n"
        "        got = mm_epilogue(a, b, ep, ax, b_kn=kn)\n"
        "        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)\n"
        "        amax = torch.full((1,), 0.5)\n"   # the kernel max()es into it, never lowers it
        "        got = mm_epilogue(a, b, ep, ax, b_kn=kn, scale=torch.full((1,), 0.25), amax=amax)\n"
        "        want_s = {'none': c / 4, 'relu2': torch.relu(c / 4).square(),\n"
        "                  'relu2_grad': c / 4 * 2 * aux.sqrt()}[ep]\n"
        "        torch.testing.assert_close(got, want_s, rtol=1e-5, atol=1e-4)\n"
        "        assert amax.item() == max(0.5, got.abs().max().item()), (ep, amax, got.abs().max())\n"
        "# transposed + saturate (the fp8 backward's form; float32 here): both layouts, clamped\n"
        "a, aux = torch.randn(72, 48), torch.rand(72, 40)\n"   # rows of the transpose: 16-byte multiples
        "c = a @ w.t()\n"
        "got, got_t = mm_epilogue(a, w, 'relu2_grad', aux, b_kn=False, scale=torch.full((1,), 0.5),\n"
        "                         saturate=1.5, transposed=True)\n"
        "want = (c * 0.5 * 2 * aux.sqrt()).clamp(-1.5, 1.5)\n"
        "assert want.abs().max() == 1.5 and got_t.shape == (40, 72)\n"
        "torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)\n"
        "assert torch.equal(got_t, got.t())\n"
        "try:\n"
        "    mm_epilogue(a, w, 'gelu', b_kn=False)\n"
        "    raise SystemExit('no error')\n"
        "except ValueError as e:\n"
        "    assert 'accepted: none|relu2|relu2_grad' in str(e)\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


# ------------------------------------------------------------------------------------ GPU

@pytest.mark.cuda
def test_cuda_relu2_mlp_matches_plain_bf16():
    """d20's width, bf16: the fused MLP's output and gradients are at least as close to float64
    as the plain bf16 MLP's (2x + 1e-3), and under 2e-2."""
    from nanochat.triton_mlp import available, probe
    if not available("cuda"):
        pytest.skip("needs compute capability >= 9 (TMA)")
    assert probe("cuda") is None and build_mlp("triton", "cuda", "bf16") is relu2_mlp
    x, w_fc, w_proj, gy = _case(4096, 1280, "cuda", torch.float64)
    ref = _mlp_grads(_plain_mlp, x, w_fc, w_proj, gy)
    xb, wf, wp = x.bfloat16(), w_fc.float(), w_proj.float()
    plain = _mlp_grads(_plain_mlp, xb, wf, wp, gy)
    fused = _mlp_grads(relu2_mlp, xb, wf, wp, gy)
    for i, (f, p, r) in enumerate(zip(fused, plain, ref)):
        err = _rel(f, r)
        assert err < 2e-2 and err < 2 * _rel(p, r) + 1e-3, (i, err, _rel(p, r))


@pytest.mark.cuda
@pytest.mark.parametrize("tiles", ["large", "small"])
def test_cuda_every_tile_of_a_set_computes_both_epilogues(tiles, each_tile_on_gpu):
    """Each bf16 tile of a set, launched on its own: relu^2 and relu^2's gradient within 1e-2 of
    float32 torch. The small set is GB10's; on a Hopper this checks its tiles' arithmetic and
    descriptors (not its speed there, nor sm_121's code)."""
    from nanochat import triton_mlp as tm
    if not tm.available("cuda"):
        pytest.skip("needs compute capability >= 9 (TMA)")
    here = tm.device_gpu(torch.cuda.current_device())
    gpu = here if tiles == "large" else tm.GemmGpu(here.sms, 101_376)
    if tm.tile_set(gpu) != tiles:
        pytest.skip(f"this GPU has {here.smem_per_block} B of shared memory per block: the small set")
    g = torch.Generator(device="cuda").manual_seed(0)
    M, N, K = 1024, 768, 512
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).bfloat16()
    aux = torch.randn(M, N, device="cuda", generator=g).relu().square().bfloat16()
    h = a.float() @ w.float().t()
    out = {}

    def calls():
        out[1] = tm.mm_epilogue(a, w, "relu2", b_kn=False, gpu=gpu)
        out[2] = tm.mm_epilogue(a, w, "relu2_grad", aux, b_kn=False, gpu=gpu)
    want = {1: h.relu().square(), 2: h * 2 * aux.float().sqrt()}
    ran = []
    for launch, ok in each_tile_on_gpu(calls, gpu):
        epi = launch.kwargs["EPILOGUE"]
        if ok:
            torch.cuda.synchronize()
            ran.append((epi, launch.label))
            assert _rel(out[epi].float(), want[epi]) < 1e-2, (epi, launch.label)
            out[epi].zero_()   # the next config writes it again
    forward = sum(epi == 1 for epi, _ in ran)
    # the small set: every forward tile fits (on GB10 too: test_triton_aot); the large set's
    # four-stage 128x256 tile is over even an H100's 227 KB and the autotuner skips it there
    assert forward == len(tm._TILES[False, tiles]) - (tiles == "large"), ran


@pytest.mark.cuda
def test_cuda_fp8_relu2_mlp_matches_fp8_linears():
    """d20's width, 4096 rows: the probe passes, and the fused fp8 MLP's output and gradients are
    within 1.5x (+ 5e-3) of the Fp8Linear path's distance to float64, and near that path."""
    from nanochat.triton_mlp import available, probe
    if not available("cuda"):
        pytest.skip("needs compute capability >= 9 (TMA)")
    assert probe("cuda", fp8=True) is None
    fn = build_mlp("triton", "cuda", "fp8", layer=_fp8_model_mlp(64, False).c_fc)
    assert fn is not None and fn.keywords["grad_dtype"] == torch.float8_e5m2
    torch.manual_seed(0)
    plain, fused = _fp8_model_mlp(1280, False).cuda(), _fp8_model_mlp(1280, True).cuda()
    fused.load_state_dict(plain.state_dict())
    x, gy = torch.randn(4096, 1280, device="cuda").bfloat16(), torch.randn(4096, 1280, device="cuda")
    ref = _mlp_grads(_plain_mlp, x.double(), plain.c_fc.weight.double(), plain.c_proj.weight.double(), gy)
    got_p, got_f = _fp8_grads(plain, x, gy), _fp8_grads(fused, x, gy)
    for i, (f, p, r) in enumerate(zip(got_f, got_p, ref)):
        assert _rel(f, r) < 1.5 * _rel(p, r) + 5e-3 and _rel(f, p) < 0.1, (i, _rel(f, r), _rel(p, r), _rel(f, p))
