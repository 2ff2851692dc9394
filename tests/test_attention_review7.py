"""Review 7 of attention on CPU: the module docstring's semantics at edge sizes (float64, every
CPU backend against reference_attention and an independent per-query loop), KV-cache prefill +
decode with windows and per-row lengths, and the errors for bad backends, caches and
--window-pattern strings."""

import math

import pytest
import torch

from nanochat import attention as A
from nanochat.errors import RequestError
from nanochat.gpt import GPT, GPTConfig, layer_windows
from nanochat.kv_cache import KVCache, StaticKV

CPU_BACKENDS = ["sdpa", "flex", "reference", "auto"]


def _qkv(B=2, Hq=4, Hkv=2, T=6, D=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda H: torch.randn(B, H, T, D, generator=g, dtype=torch.float64)   # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv)


def _loop(q, k, v, window):
    """The docstring's definition, one query at a time: keys j with 0 <= i - j < W, query head h
    reads kv head h // (Hq // Hkv), scale 1/sqrt(D)."""
    Hq, T, D = q.size(1), q.size(2), q.size(3)
    out = torch.empty_like(q)
    for h in range(Hq):
        kh, vh = k[:, h // (Hq // k.size(1))], v[:, h // (Hq // k.size(1))]
        for i in range(T):
            js = [j for j in range(T) if 0 <= i - j < (window or T + 1)]
            s = (q[:, h, i:i + 1] @ kh[:, js].transpose(-1, -2)) / math.sqrt(D)
            out[:, h, i] = (s.softmax(-1) @ vh[:, js])[:, 0]
    return out


# window 4 with T in {1, 3, 4, 5}: T = 1, T < W, T = W, T = W + 1; window 1; GQA 1/2/4; odd/tiny D
@pytest.mark.parametrize("T,window,Hq,Hkv,D", [
    (1, 4, 4, 1, 5), (3, 4, 2, 2, 1), (4, 4, 4, 2, 3), (5, 4, 4, 1, 5), (5, 4, 2, 2, 1), (5, 4, 4, 2, 3),
    (5, 1, 4, 1, 5), (5, 1, 2, 2, 1), (5, None, 4, 2, 3)])
def test_every_cpu_backend_honours_the_semantics_in_float64(T, window, Hq, Hkv, D):
    q, k, v = _qkv(Hq=Hq, Hkv=Hkv, T=T, D=D)
    want = _loop(q, k, v, window)
    torch.testing.assert_close(A.reference_attention(q, k, v, window=window), want, rtol=0, atol=1e-12)
    for backend in CPU_BACKENDS:
        out = A.attention(q, k, v, window=window, backend=backend)
        assert out.dtype == torch.float64 and out.shape == q.shape
        torch.testing.assert_close(out, want, rtol=0, atol=1e-10, msg=backend)


@pytest.mark.parametrize("window", [None, 1, 3, 4, 5])
@pytest.mark.parametrize("backend", ["sdpa", "reference"])   # flex and auto decode through sdpa's path
def test_prefill_then_single_token_decode_equals_the_full_forward(backend, window):
    q, k, v = _qkv(Hq=4, Hkv=1, T=9, D=3)
    cache = KVCache(2, 1, 9, 3, 1, "cpu", torch.float64)
    outs = [A.attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], window=window, backend=backend,
                        kv_cache=cache, layer_idx=0)]
    cache.advance(4)
    for t in range(4, 9):
        outs.append(A.attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], window=window,
                                backend=backend, kv_cache=cache, layer_idx=0))
        cache.advance(1)
    torch.testing.assert_close(torch.cat(outs, 2), _loop(q, k, v, window), rtol=0, atol=1e-10)


@pytest.mark.parametrize("window", [None, 2])
def test_static_decode_rows_of_different_lengths(window):
    """Two rows at their own positions (continuous batching) over one cache bucket."""
    q, k, v = _qkv(Hq=4, Hkv=2, T=7, D=3)
    cache, lengths = KVCache(2, 2, 8, 3, 1, "cpu", torch.float64), (7, 4)
    for row, n in enumerate(lengths):   # each row's prompt, written through its own batch-1 cache
        one = KVCache(1, 2, 8, 3, 1, "cpu", torch.float64)
        A.attention(q[row:row + 1, :, :n - 1], k[row:row + 1, :, :n - 1], v[row:row + 1, :, :n - 1],
                    window=window, backend="sdpa", kv_cache=one, layer_idx=0)
        cache.copy_row(row, one, 0, n - 1)
    pick = lambda t: torch.stack([t[r, :, n - 1:n] for r, n in enumerate(lengths)])   # noqa: E731
    step = StaticKV(cache, torch.tensor([n - 1 for n in lengths]), torch.arange(8))
    out = A.attention(pick(q), pick(k), pick(v), window=window, backend="sdpa", kv_cache=step, layer_idx=0)
    for row, n in enumerate(lengths):
        want = _loop(q[row:row + 1, :, :n], k[row:row + 1, :, :n], v[row:row + 1, :, :n], window)
        torch.testing.assert_close(out[row, :, 0], want[0, :, n - 1], rtol=0, atol=1e-10)


def test_cache_overflow_is_refused_before_any_write():
    q, k, v = _qkv(T=5)
    cache = KVCache(2, 2, 4, 3, 1, "cpu", torch.float64)
    with pytest.raises(ValueError, match="5 tokens exceed the cache length 4"):
        A.attention(q, k, v, window=2, backend="sdpa", kv_cache=cache, layer_idx=0)
    assert cache.pos == 0 and not cache.k[0].any()


def test_cache_layer_index_outside_the_cache_is_refused():
    """A cache made for fewer layers than the model failed with a bare IndexError, and a negative
    index silently wrote another layer's slots."""
    q, k, v = _qkv(T=2)
    cache = KVCache(2, 2, 4, 3, 2, "cpu", torch.float64)
    for bad in (2, -1):
        with pytest.raises(ValueError, match=r"layer .* outside 0\.\.1.*num_layers"):
            A.attention(q, k, v, window=None, backend="sdpa", kv_cache=cache, layer_idx=bad)
    assert not cache.k[1].any()
    step = StaticKV(cache, torch.tensor([0]), torch.arange(4))
    with pytest.raises(ValueError, match=r"layer 5 outside 0\.\.1"):
        A.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], window=None, backend="sdpa", kv_cache=step, layer_idx=5)


def test_cuda_only_backend_errors_list_only_what_the_device_takes():
    """cudnn off CUDA listed flex as accepted, but flex is refused on MPS (resolve_backend) and for
    CPU training (check_training_backend): the user was sent to a second refusal."""
    with pytest.raises(RequestError, match=r"accepted here: auto\|sdpa\|flex\|reference"):
        A.resolve_backend("cudnn", "cpu")
    for name in ("cudnn", "cudnn_fa4"):
        with pytest.raises(RequestError, match=r"--attn-backend.*accepted here: auto\|sdpa\|reference$"):
            A.resolve_backend(name, "mps")
        with pytest.raises(RequestError, match=r"--attn-backend.*accepted for CPU training: auto\|sdpa\|reference$"):
            A.check_training_backend(name, "cpu")
    with pytest.raises(RequestError, match=r"accepted for CPU training: auto\|sdpa\|reference"):
        A.check_training_backend("flex", "cpu")
    assert A.check_training_backend("auto", "cpu") == "sdpa"
    assert A.check_training_backend("reference", "cpu") == "reference"


@pytest.mark.parametrize("pattern", ["", "SXL", "sl", "S L", None])
def test_bad_window_patterns_are_refused_naming_the_flag(pattern):
    """GPT() refused them, but layer_windows (read by scripts/analyze_bandwidth.py and the model)
    took any non-L letter, lowercase l included, as a window and failed on "" with a
    ZeroDivisionError."""
    cfg = GPTConfig(sequence_len=16, vocab_size=64, n_layer=3, n_head=2, n_kv_head=1, n_embd=8,
                    window_pattern=pattern)
    for build in (layer_windows, GPT):
        with pytest.raises(ValueError, match=r"--window-pattern.*S .*and L"):
            build(cfg)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])   # flex: its full forward is above, decode is SDPA
def test_sssl_model_decode_equals_full_forward(backend):
    """GPT with SSSL windows (4 of 16): prefill 6 tokens, then single-token steps past the window
    and past sequence_len, against the full forward."""
    torch.manual_seed(0)
    cfg = GPTConfig(sequence_len=16, vocab_size=64, n_layer=4, n_head=4, n_kv_head=2, n_embd=16,
                    window_pattern="SSSL")
    model = GPT(cfg, attn_backend=backend, compute_dtype=torch.float64).double()
    model.init_weights()
    for block in model.blocks:   # c_proj = 0 at init would hide attention entirely
        torch.nn.init.normal_(block.attn.c_proj.weight, std=0.5)
    assert model.windows == [4, 4, 4, None]
    idx = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2, 2, 20, 4, 4, "cpu", torch.float64)
        steps = [model(idx[:, :6], kv_cache=cache)] + [model(idx[:, t:t + 1], kv_cache=cache) for t in range(6, 20)]
    assert cache.pos == 20
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-6)
