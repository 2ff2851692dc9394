"""Attention backends vs a float64 reference: causal, windows, GQA, KV-cache decode.

Tolerances: float64 inputs through any backend agree with the float64 reference to 1e-10
(max abs); float32 to 2e-5; bf16 on CUDA to 3e-2 (forward and gradients).
"""

import math

import pytest
import torch

from nanochat import attention as A

CPU_BACKENDS = ["sdpa", "flex", "sdpa_flex", "reference"]


def _qkv(B=2, Hq=4, Hkv=2, T=40, D=16, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda H: torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return mk(Hq), mk(Hkv), mk(Hkv)


def _naive(q, k, v, window):
    """Per-query loop: the definition, independent of reference_attention's vectorisation."""
    B, Hq, T, D = q.shape
    rep = Hq // k.size(1)
    out = torch.zeros_like(q)
    for h in range(Hq):
        kh, vh = k[:, h // rep], v[:, h // rep]
        for i in range(T):
            lo = 0 if window is None else max(0, i - window + 1)
            s = q[:, h, i:i + 1] @ kh[:, lo:i + 1].transpose(-1, -2) / math.sqrt(D)
            out[:, h, i] = (s.softmax(-1) @ vh[:, lo:i + 1])[:, 0]
    return out


@pytest.mark.parametrize("window", [None, 1, 5, 24, 100])
def test_reference_matches_naive_definition(window):
    q, k, v = _qkv(B=1, T=24)
    ref = A.reference_attention(q, k, v, window=window)
    assert (ref - _naive(q, k, v, window)).abs().max() < 1e-12


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("Hkv", [4, 2, 1])
@pytest.mark.parametrize("window", [None, 1, 7, 49, 50, 64])
def test_backend_float64_matches_reference(backend, Hkv, window):
    q, k, v = _qkv(Hq=4, Hkv=Hkv, T=50)  # T not a multiple of flex's 128 block
    out = A.attention(q, k, v, window=window, backend=backend)
    ref = A.reference_attention(q, k, v, window=window)
    assert out.shape == q.shape and out.dtype == torch.float64
    assert (out - ref).abs().max() < 1e-10


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_float32_matches_reference(backend):
    q, k, v = _qkv(Hq=6, Hkv=2, T=200, dtype=torch.float32)  # spans two flex blocks
    for window in (None, 50, 130):
        out = A.attention(q, k, v, window=window, backend=backend)
        ref = A.reference_attention(q.double(), k.double(), v.double(), window=window)
        assert (out.double() - ref).abs().max() < 2e-5, (backend, window)


def test_window_changes_the_result():
    """Guards against a backend silently ignoring the window."""
    q, k, v = _qkv(T=40)
    for backend in CPU_BACKENDS:
        full = A.attention(q, k, v, window=None, backend=backend)
        win = A.attention(q, k, v, window=4, backend=backend)
        assert (full - win).abs().max() > 1e-3, backend


@pytest.mark.parametrize("window", [None, 6])
def test_sdpa_backward_matches_reference(window):
    """The CPU training path (SDPA + cached dense mask for windows) has correct gradients."""
    q, k, v = (t.requires_grad_() for t in _qkv(Hq=4, Hkv=2, T=30))
    A.attention(q, k, v, window=window, backend="sdpa").pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    A.reference_attention(q, k, v, window=window).pow(2).sum().backward()
    for g, t in zip(grads, (q, k, v)):
        assert (g - t.grad).abs().max() < 1e-10


def test_flex_cpu_backward_raises_clearly():
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float32))
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        A.attention(q, k, v, window=8, backend="flex")


def test_resolve_backend():
    assert A.resolve_backend("auto", "cpu") == "sdpa"
    assert A.resolve_backend("auto", torch.device("cuda")) == "sdpa_flex"
    assert A.resolve_backend("flex", "cpu") == "flex"
    assert A.resolve_backend("reference", "cuda:0") == "reference"
    with pytest.raises(ValueError, match="--attn-backend.*accepted"):
        A.resolve_backend("flash3", "cpu")
    with pytest.raises(ValueError, match="flex needs"):
        A.resolve_backend("flex", "mps")
    with pytest.raises(ValueError, match="--attn-backend: cudnn needs a CUDA device"):
        A.resolve_backend("cudnn", "cpu")


def test_auto_backend_on_cuda_without_a_cudnn_probe_is_flex():
    """'auto' picks cuDNN only after prepare_masks' probe launch proved it on that device."""
    assert A.resolve_backend("auto", "cuda:7") == "sdpa_flex"


def test_cudnn_window_op_shapes_on_meta():
    """The fake (meta) implementations the compiler traces: (B, H, T, D) outputs laid out
    (B, T, H, D) in memory, so the model's transpose + reshape after attention is a view."""
    from nanochat import cudnn_attention  # noqa: F401  (registers the ops; imports no cuDNN)

    q = torch.empty(2, 6, 96, 32, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(2, 3, 96, 32, device="meta", dtype=torch.bfloat16)
    for bwd in ("cudnn", "fa4"):
        o, lse = torch.ops.nanochat.cudnn_window_fwd(q, kv, kv, 16, bwd)
        assert o.shape == q.shape and o.transpose(1, 2).is_contiguous()
        assert lse.shape == (2, 6, 96, 1) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.nanochat.cudnn_window_bwd(o, q, kv, kv, o, lse, 16, bwd)
        assert dq.shape == q.shape and dk.shape == kv.shape and dv.shape == kv.shape
        assert dk.transpose(1, 2).is_contiguous()


def test_cudnn_fa4_backend_choice_and_errors(monkeypatch):
    """cudnn_fa4: an explicit choice that raises off CUDA and when flash-attn-4 is missing (naming
    the flag and the fix); auto picks it only on a device where fa4_attention's probe passed."""
    from nanochat import cudnn_attention, fa4_attention

    with pytest.raises(ValueError, match="--attn-backend: cudnn_fa4 needs a CUDA device"):
        A.resolve_backend("cudnn_fa4", "cpu")
    monkeypatch.setattr(fa4_attention, "_bwd_fn", lambda: (_ for _ in ()).throw(ImportError("no flash_attn")))
    monkeypatch.setattr(cudnn_attention, "available", lambda: None)
    assert "pip install 'flash-attn-4==" in fa4_attention.available()
    with pytest.raises(ValueError, match="--attn-backend cudnn_fa4: flash-attn-4 is not installed"):
        A.resolve_backend("cudnn_fa4", "cuda:0")
    assert fa4_attention.probe("cpu") == "needs a CUDA device, got cpu"
    assert A.resolve_backend("auto", "cuda:5") == "sdpa_flex"
    monkeypatch.setitem(fa4_attention._PROBED, 5, None)  # as if the probe launch passed on cuda:5
    assert A.resolve_backend("auto", "cuda:5") == "cudnn_fa4"
    assert A.resolve_backend("auto", "cuda:6") == "sdpa_flex"
    monkeypatch.setitem(fa4_attention._PROBED, 6, "FA4 backward disagrees")  # a failed probe
    assert A.resolve_backend("auto", "cuda:6") == "sdpa_flex"
    q = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bwd: got 'fa3'; accepted: cudnn\\|fa4"):
        cudnn_attention.window_attention(q, q, q, 4, bwd="fa3")


def test_bad_shapes_raise():
    q, k, v = _qkv(Hq=3, Hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        A.attention(q, k, v, window=None, backend="sdpa")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="window"):
        A.attention(q, k, v, window=0, backend="sdpa")


def test_masks_are_cached():
    q, k, v = _qkv(T=33, dtype=torch.float32)
    A.attention(q, k, v, window=5, backend="flex")
    A.attention(q, k, v, window=5, backend="sdpa")
    bm = A._BLOCK_MASKS[(33, 5, "cpu")]
    dm = A._DENSE_MASKS[(33, 5, "cpu")]
    A.attention(q, k, v, window=5, backend="flex")
    A.attention(q, k, v, window=5, backend="sdpa")
    assert A._BLOCK_MASKS[(33, 5, "cpu")] is bm and A._DENSE_MASKS[(33, 5, "cpu")] is dm
    for T in range(40, 60):   # batches padded to many lengths (an eval) keep a bounded set of T^2 masks
        q, k, v = _qkv(T=T, dtype=torch.float32)
        A.attention(q, k, v, window=5, backend="sdpa")
    # masks prepare_masks built earlier in the session (other test files' models) are never evicted
    others = [key for key in A._DENSE_MASKS if key not in A._PREPARED_DENSE]
    assert len(others) <= 8 and (59, 5, "cpu") in A._DENSE_MASKS


def test_prepared_dense_masks_outlive_the_eval_lengths():
    """A mask prepare_masks built for training (a compiled graph looked it up) is never evicted by
    the bounded cache of other lengths: evicted, the graph would recompile at its next step."""
    A.prepare_masks(97, [7, None], "cpu", "sdpa")
    prepared = A._DENSE_MASKS[(97, 7, "cpu")]
    for T in range(60, 80):
        q, k, v = _qkv(T=T, dtype=torch.float32)
        A.attention(q, k, v, window=7, backend="sdpa")
    assert A._DENSE_MASKS[(97, 7, "cpu")] is prepared
    assert len([key for key in A._DENSE_MASKS if key not in A._PREPARED_DENSE]) <= 8


# ----------------------------------------------------------------------------------------------
# KV cache


def _decode(q, k, v, window, backend, prefill, chunk=1):
    """Prefill `prefill` tokens, then feed the rest `chunk` tokens at a time through a cache."""
    B, Hkv, T, D = k.shape
    cache = A.KVCache(B, Hkv, T + 3, D, num_layers=2, device="cpu", dtype=q.dtype)
    outs, pos = [], 0
    steps = [prefill] + [chunk] * ((T - prefill) // chunk)
    for n in steps:
        sl = slice(pos, pos + n)
        outs.append(A.attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], window=window, backend=backend,
                                kv_cache=cache, layer_idx=1))
        cache.advance(n)
        pos += n
    assert cache.pos == T
    return torch.cat(outs, dim=2)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("window", [None, 1, 5, 12, 30])
def test_kv_cache_decode_equals_full(backend, window):
    q, k, v = _qkv(Hq=4, Hkv=2, T=24)
    ref = A.reference_attention(q, k, v, window=window)
    assert (_decode(q, k, v, window, backend, prefill=9) - ref).abs().max() < 1e-10
    assert (_decode(q, k, v, window, backend, prefill=3, chunk=7) - ref).abs().max() < 1e-10


def test_kv_cache_attention_runs_without_cudnn_sdpa(monkeypatch):
    """The KV-cache path (prefill of variable-length prompts, chunks) keeps SDPA off cuDNN, which
    builds a graph per new shape; the training path leaves SDPA's choice alone."""
    seen = []
    real = A.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(A.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(Hq=4, Hkv=2, T=24)
    _decode(q, k, v, 5, "sdpa", prefill=9, chunk=5)     # masked prefill, then masked chunks
    _decode(q, k, v, None, "sdpa", prefill=24)           # plain causal prefill
    assert seen and all(s == (False, True) for s in seen), seen
    seen.clear()
    A.attention(q, k, v, window=None, backend="sdpa")
    assert seen == [(torch.backends.cuda.cudnn_sdp_enabled(), True)] and torch.backends.cuda.cudnn_sdp_enabled()


def test_kv_cache_prefill_from_reset_and_overflow():
    src = A.KVCache(1, 2, 8, 4, num_layers=3, device="cpu", dtype=torch.float32)
    k = torch.randn(1, 2, 5, 4)
    for layer in range(3):
        src.insert(layer, k * layer, k * -layer)
    src.advance(5)
    dst = A.KVCache(3, 2, 8, 4, num_layers=3, device="cpu", dtype=torch.float32)
    dst.prefill_from(src)
    assert dst.pos == 5
    assert torch.equal(dst.k[2][1, :, :5], k[0] * 2) and torch.equal(dst.v[1][2, :, :5], -k[0])
    dst.reset()
    assert dst.pos == 0
    with pytest.raises(ValueError, match="exceed"):
        dst.insert(0, torch.zeros(3, 2, 9, 4), torch.zeros(3, 2, 9, 4))
    with pytest.raises(ValueError, match="batch must be 1"):
        src.prefill_from(dst)
    with pytest.raises(ValueError, match="KVCache seq_len"):
        A.KVCache(1, 1, 0, 4, 1, "cpu", torch.float32)


def test_decode_attention_triton_kernel_in_interpreter(run_triton_interpreted):
    """The split-key decode kernel itself (TRITON_INTERPRET=1, in a subprocess: the flag must be
    set before triton is imported) through the custom op, against the float64 reference over the
    visible keys: GQA, windows (inside, straddling and covering the bucket), the first and last
    position, partial chunks, several splits, cache-bucket views with the full cache's strides."""
    script = (
        "import torch\n"
        "from nanochat import attention as A\n"
        "g = torch.Generator().manual_seed(0)\n"
        "cases = [(2, 4, 2, 40, 37, None, 16), (1, 2, 2, 33, 20, 8, 16), (2, 4, 4, 64, 63, 16, 8),\n"
        "         (1, 2, 1, 17, 0, None, 16), (1, 3, 1, 50, 49, 1, 16), (2, 2, 2, 24, 10, 100, 64)]\n"
        "for B, Hq, Hkv, L, pos, window, chunk in cases:\n"
        "  q = torch.randn(B, Hq, 1, 32, generator=g)\n"
        "  kc, vc = torch.randn(2, B, Hkv, 70, 32, generator=g)\n"
        "  from nanochat import triton_kernels as TK\n"
        "  ref = A.reference_attention(q.double(), kc[:, :, :pos + 1].double(), vc[:, :, :pos + 1].double(),\n"
        "                              window=window, q_offset=pos)\n"
        "  for fused in (True, False):  # merge by the last program (atomic counter) / a second kernel\n"
        "    out = TK.decode_attention_triton(q, kc[:, :, :L], vc[:, :, :L], torch.tensor([pos]), window,\n"
        "                                     chunk=chunk, fused=fused)\n"
        "    assert out.shape == q.shape and (out.double() - ref).abs().max() < 1e-5, (B, Hq, L, pos, window, fused)\n"
        "  assert not TK._DECODE_COUNTERS[torch.device('cpu')].any()  # left at 0 for the next call\n"
        "  op = torch.ops.nanochat.decode_attention(q, kc[:, :, :L], vc[:, :, :L], torch.tensor([pos]), window or 0)\n"
        "  assert (op.double() - ref).abs().max() < 1e-5\n"
        "# a position per row (continuous batching): each row against its own reference\n"
        "q = torch.randn(3, 4, 1, 32, generator=g)\n"
        "kc, vc = torch.randn(2, 3, 2, 70, 32, generator=g)\n"
        "for window in (None, 8):\n"
        "  rows = torch.tensor([3, 40, 17])\n"
        "  out = TK.decode_attention_triton(q, kc[:, :, :48], vc[:, :, :48], rows, window, chunk=16, fused=True)\n"
        "  for b, p in enumerate(rows.tolist()):\n"
        "    ref = A.reference_attention(q[b:b + 1].double(), kc[b:b + 1, :, :p + 1].double(),\n"
        "                                vc[b:b + 1, :, :p + 1].double(), window=window, q_offset=p)\n"
        "    assert (out[b:b + 1].double() - ref).abs().max() < 1e-5, (b, p, window)\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


def test_decode_attention_op_shapes_on_meta():
    q = torch.empty(3, 4, 1, 128, device="meta").transpose(1, 2).transpose(1, 2)
    k = torch.empty(3, 2, 256, 128, device="meta", dtype=torch.bfloat16)
    out = A._decode_attention_fake(q, k, k, torch.empty(1, dtype=torch.long, device="meta"), 0)
    assert out.shape == (3, 4, 1, 128) and out.is_contiguous()
    assert not A._triton_decode_ok(torch.empty(1, 1, 1, 128))          # CPU: SDPA path


# ----------------------------------------------------------------------------------------------
# CUDA (run on the GPU box with `pytest -m cuda`)


def _require_cudnn_frontend():
    """Skip when the optional `gpu` extra's cuDNN frontend is not installed; once it is, its probe
    (a real launch against plain math) must pass: a failing probe fails the test."""
    from nanochat import cudnn_attention

    pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (pip install -e '.[gpu]')")
    assert cudnn_attention.probe(torch.device("cuda")) is None


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["sdpa_flex", "sdpa", "flex", "sdpa_cudnn", "cudnn_fa4"])
@pytest.mark.parametrize("window", [None, 64, 512])
def test_cuda_bf16_forward_backward(backend, window):
    if backend in ("sdpa_cudnn", "cudnn_fa4"):
        _require_cudnn_frontend()
    if backend == "cudnn_fa4":
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed (gpu_check.sh installs it)")
    q, k, v = (t.requires_grad_() for t in _qkv(B=2, Hq=4, Hkv=2, T=1000, D=64, dtype=torch.bfloat16, device="cuda"))
    out = A.attention(q, k, v, window=window, backend=backend)
    g = torch.randn_like(out)
    out.backward(g)
    grads = [t.grad.double() for t in (q, k, v)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = A.reference_attention(q64, k64, v64, window=window)
    ref.backward(g.double())
    assert (out.double() - ref).abs().max() < 3e-2
    for got, t in zip(grads, (q64, k64, v64)):
        assert (got - t.grad).abs().max() / t.grad.abs().max() < 3e-2


@pytest.mark.cuda
@pytest.mark.parametrize("backend,window", [("sdpa_cudnn", 128), ("cudnn_fa4", 128), ("cudnn_fa4", None)])
def test_cuda_cudnn_window_in_model_layout_under_compile(backend, window):
    """q/k/v as the model makes them ((B, T, H, D) projections viewed as (B, H, T, D)), inside
    torch.compile, against flex (the other block-sparse kernel): outputs and gradients agree."""
    from nanochat import fa4_attention

    _require_cudnn_frontend()
    if backend == "cudnn_fa4":
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed (gpu_check.sh installs it)")
        assert fa4_attention.probe(torch.device("cuda")) is None
    g = torch.Generator(device="cuda").manual_seed(0)
    base = [torch.randn(4, 512, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in base]
        fn = torch.compile(lambda q, k, v: A.attention(q, k, v, window=window, backend=backend)
                           .transpose(1, 2).reshape(4, 512, -1))
        out = fn(*(t.transpose(1, 2) for t in leaves))
        out.float().square().mean().backward()
        return out.float(), [t.grad.float() for t in leaves]

    # probed: auto picks cuDNN now (and FA4's backward where that probe passed too)
    assert A.resolve_backend("auto", "cuda:0") in ("sdpa_cudnn", "cudnn_fa4")
    out_c, grads_c = run(backend)
    out_f, grads_f = run("flex")
    assert (out_c - out_f).abs().max() < 2e-2
    for a, b in zip(grads_c, grads_f):
        assert (a - b).abs().max() / b.abs().max() < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 100])
def test_cuda_static_decode_per_row_positions(window):
    """The static decode step with a position per row (continuous batching), compiled, bf16:
    each row writes its k/v at its own slot and attends to its own prefix, as the float64
    reference; the SDPA formulation agrees."""
    B, Hq, Hkv, D = 3, 8, 4, 128
    cache = A.KVCache(B, Hkv, 512, D, num_layers=1, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g, device="cuda"))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g, device="cuda"))
    key_pos = torch.arange(300, device="cuda")
    pos = torch.tensor([0, 299, 140], device="cuda")
    q, k, v = (torch.randn(B, h, 1, D, generator=g, device="cuda", dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv))
    step = torch.compile(lambda q, k, v, kv: A.attention(q, k, v, window=window, backend="auto",
                                                         kv_cache=kv, layer_idx=0))
    out = step(q, k, v, A.StaticKV(cache, pos, key_pos))
    A.set_decode_kernel("sdpa")
    try:
        sdpa = A.attention(q, k, v, window=window, backend="auto", kv_cache=A.StaticKV(cache, pos, key_pos),
                           layer_idx=0)
    finally:
        A.set_decode_kernel(A.DEFAULT_DECODE_KERNEL)
    for b, p in enumerate(pos.tolist()):
        assert torch.equal(cache.k[0][b, :, p], k[b, :, 0]) and torch.equal(cache.v[0][b, :, p], v[b, :, 0])
        ref = A.reference_attention(q[b:b + 1].double(), cache.k[0][b:b + 1, :, :p + 1].double(),
                                    cache.v[0][b:b + 1, :, :p + 1].double(), window=window, q_offset=p)
        assert (out[b:b + 1].double() - ref).abs().max() < 2e-2, (b, p)
        assert (sdpa[b:b + 1].double() - ref).abs().max() < 2e-2, (b, p)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 100])
def test_cuda_static_decode_triton_equals_sdpa(window):
    """The CUDA static decode step (Triton split-key kernel) against the SDPA formulation it
    replaced and the float64 reference, bf16, inside torch.compile, at positions in the first,
    a middle and the last chunk of a 300-slot bucket of a 512-slot cache; then the fused merge
    (each row's last program) 50 times in a row, equal to its first result (a merge that read a
    chunk before its writer finished would show), and close to the two-kernel merge."""
    B, Hq, Hkv, D = 2, 8, 4, 128
    cache = A.KVCache(B, Hkv, 512, D, num_layers=1, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g, device="cuda"))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g, device="cuda"))
    key_pos = torch.arange(300, device="cuda")
    step = torch.compile(lambda q, k, v, kv: A.attention(q, k, v, window=window, backend="auto",
                                                         kv_cache=kv, layer_idx=0))
    for p in (0, 150, 299):
        pos = torch.tensor([p], device="cuda")
        q, k, v = (torch.randn(B, h, 1, D, generator=g, device="cuda", dtype=torch.bfloat16)
                   for h in (Hq, Hkv, Hkv))
        out = step(q, k, v, A.StaticKV(cache, pos, key_pos))
        keys, values = cache.k[0][:, :, :p + 1].double(), cache.v[0][:, :, :p + 1].double()
        assert torch.equal(cache.k[0][:, :, p], k[:, :, 0])       # the step wrote its k/v
        ref = A.reference_attention(q.double(), keys, values, window=window, q_offset=p)
        visible = (key_pos <= p) & ((key_pos > p - window) if window else True)
        sdpa = A._sdpa(q, cache.k[0][:, :, :300], cache.v[0][:, :, :300], is_causal=False,
                       attn_mask=visible.view(1, 1, 1, 300))
        assert (out.double() - ref).abs().max() < 2e-2
        assert (out.double() - sdpa.double()).abs().max() < 2e-2
    from nanochat import triton_kernels as TK

    keys, values = cache.k[0][:, :, :300], cache.v[0][:, :, :300]
    first = TK.decode_attention_triton(q, keys, values, pos, window, fused=True)
    for _ in range(50):
        assert torch.equal(TK.decode_attention_triton(q, keys, values, pos, window, fused=True), first)
    assert (TK.decode_attention_triton(q, keys, values, pos, window, fused=False) - first).abs().max() < 1e-2
    assert not TK._DECODE_COUNTERS[torch.device("cuda", 0)].any()


def test_prepare_masks_probes_fa4_only_for_training_on_hopper(monkeypatch):
    """auto on an H100-class device probes cuDNN + FA4 only when the model will be trained
    (backward=True): inference loads skip FA4's import and JIT; other capabilities never probe it."""
    from nanochat import cudnn_attention, fa4_attention

    calls = []
    monkeypatch.setattr(cudnn_attention, "probe", lambda device: calls.append("cudnn") or "no cuDNN here")
    monkeypatch.setattr(fa4_attention, "available", lambda: None)
    monkeypatch.setattr(fa4_attention, "probe", lambda device: calls.append("fa4") or "not probed for real")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert A.prepare_masks(256, [None], "cuda:3", "auto", backward=False) == "sdpa_flex"
    assert calls == ["cudnn"]
    A.prepare_masks(256, [None], "cuda:3", "auto")
    assert calls == ["cudnn", "cudnn", "fa4"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 1))  # GB10: unmeasured
    A.prepare_masks(256, [None], "cuda:3", "auto")
    assert calls == ["cudnn", "cudnn", "fa4", "cudnn"]
    with pytest.raises(ValueError, match="--attn-backend cudnn_fa4: no cuDNN here"):   # its forward is cuDNN's
        A.prepare_masks(256, [None], "cuda:3", "cudnn_fa4")
    monkeypatch.setattr(cudnn_attention, "probe", lambda device: None)
    with pytest.raises(ValueError, match="--attn-backend cudnn_fa4: not probed for real"):
        A.prepare_masks(256, [None], "cuda:3", "cudnn_fa4")


def test_fa4_backward_glue_with_a_stand_in_package(monkeypatch):
    """fa4_attention.backward hands flash-attn-4 what its backward expects: (B, T, H, D) views of
    the (B, H, T, D) tensors (no copies), lse as (B, H, T), causal, FA's window convention (keys
    before the query: window - 1; None for full causal) and the output buffers to fill; the JIT's
    warnings are filtered once. The package itself runs only on the GPU box (CUDA tests above)."""
    import sys
    import types
    import warnings

    from nanochat import fa4_attention

    seen = {}

    def fake_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, **kw):
        seen.update(q=q, lse=lse, causal=causal, scale=softmax_scale, **kw)
        kw["dq"].fill_(1.0)

    pkg = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    iface = types.ModuleType("flash_attn.cute.interface")
    iface._flash_attn_bwd = fake_bwd
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", iface)
    monkeypatch.setattr(fa4_attention, "_QUIET", [])
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    assert fa4_attention.available() is None
    B, H, T, D = 2, 3, 8, 16
    bthd = lambda: torch.randn(B, T, H, D).transpose(1, 2)   # the layout cudnn_attention allocates
    q, k, v, o, do, dq, dk, dv = (bthd() for _ in range(8))
    lse = torch.randn(B, H, T, 1)
    for window, left, right in ((4, 3, 0), (0, None, None)):
        fa4_attention.backward(do, q, k, v, o, lse, window, dq, dk, dv)
        assert seen["window_size_left"] == left and seen["window_size_right"] == right
        assert seen["causal"] is True and seen["scale"] is None
        assert seen["q"].shape == (B, T, H, D) and seen["q"].data_ptr() == q.data_ptr()
        assert seen["dq"].data_ptr() == dq.data_ptr() and seen["lse"].shape == (B, H, T)
        assert torch.all(dq == 1.0)
    assert fa4_attention._QUIET and any("aux_data" in str(f[1].pattern) for f in warnings.filters if f[1])


def test_explicit_cudnn_backend_is_proven_by_a_launch(monkeypatch):
    """--attn-backend cudnn was only import-checked: a cuDNN that imports and then fails at its first
    launch got through to the first training step (DESIGN.md 4.6). prepare_masks now runs the probe
    launch for an explicit cudnn / cudnn_fa4 and refuses with its reason."""
    from nanochat import attention as A
    from nanochat import cudnn_attention, fa4_attention
    from nanochat.errors import RequestError

    launched = []
    monkeypatch.setattr(cudnn_attention, "probe", lambda dev: launched.append(dev) or "launch failed: bad arch")
    monkeypatch.setattr(fa4_attention, "probe", lambda dev: None)
    for backend in ("cudnn", "cudnn_fa4"):
        with pytest.raises(RequestError, match=f"^--attn-backend {backend}: launch failed: bad arch"):
            A.prepare_masks(256, [128, None], "cuda", backend)
    assert len(launched) == 2
