"""Causal self-attention backends, the KV cache and backend selection.

Owns: `attention()` (the one call the model makes), `resolve_backend()`, `KVCache`, and the plain
math `reference_attention()` that every backend is tested against.

Semantics (every backend honours all of them, or raises):
  * causal always; `window=W` means a query at position i sees keys j with 0 <= i - j < W
    (W keys including itself); `window=None` (or W >= number of keys) is full causal attention;
  * GQA: q has Hq heads, k/v have Hkv heads, Hq % Hkv == 0, query head h reads kv head
    h // (Hq // Hkv) (the `repeat_interleave` convention of SDPA's and flex's `enable_gqa`);
  * softmax scale 1/sqrt(head_dim); layout (B, H, T, D) in and out.

Backends (the names `resolve_backend` returns):
  * "sdpa_flex" (auto on CUDA): full layers through F.scaled_dot_product_attention(is_causal=True)
    (flash / cuDNN kernels), window layers through flex_attention with a cached block-sparse
    BlockMask. The training path on GPU: no dense mask is ever built. Measured on H100, torch
    2.11, d20 shapes (B=32, 10 heads, T=2048, D=128, bf16, fwd+bwd, median): SDPA full causal
    2.92 ms (cuDNN picked; flash-only 5.04 ms), flex window 512 2.31 ms, flex full 3.66 ms.
  * "sdpa" (auto on CPU/MPS): SDPA for everything; window layers pass a cached dense boolean mask.
    That is the CPU training path (flex_attention has no CPU backward) and the upstream-nanochat
    baseline on GPU (slow there: 8.55 ms vs 3.02 ms per d20 layer, DESIGN.md section 3).
  * "flex": flex_attention for every layer (causal layers too), for benchmarking. CUDA: fwd+bwd;
    CPU: forward only (torch raises on a CPU backward).
  * "reference": explicit math in the input dtype (float64 capable); slow, for tests.

KV-cache path (inference): `attention(..., kv_cache=c, layer_idx=i)` writes this call's k/v at
positions [c.pos, c.pos + T) of layer i and attends over the cache; the caller (GPT.forward)
advances `c.pos` once after the last layer. Decode uses SDPA with a small explicit mask (or the
reference math); windows are respected by slicing the cache to the visible span.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

BACKEND_CHOICES = ("auto", "sdpa", "flex", "reference")
RESOLVED_BACKENDS = ("sdpa_flex", "sdpa", "flex", "reference")

# Caches keyed by (T, window, device). Filled in eager mode only: under torch.compile a cache miss
# builds the mask inside the graph (correct, a few tiny kernels per step) and a hit is lifted as a
# graph input; adding keys later does not trigger a recompile (checked on torch 2.15).
_BLOCK_MASKS: dict = {}
_DENSE_MASKS: dict = {}
_COMPILED_FLEX = None  # torch.compile(flex_attention), created on first eager CUDA use


def resolve_backend(name: str, device) -> str:
    """Map a requested backend ("auto"|"sdpa"|"flex"|"reference") to a resolved backend name."""
    if name == "sdpa_flex":
        return name  # already resolved (what "auto" gives on CUDA)
    if name not in BACKEND_CHOICES:
        raise ValueError(f"--attn-backend: got {name!r}; accepted: {'|'.join(BACKEND_CHOICES)}")
    device_type = torch.device(device).type
    if name == "auto":
        # flex_attention needs a compiled kernel for speed and has no CPU backward, so only CUDA
        # gets the block-sparse window kernel; elsewhere SDPA (+ dense mask for windows) is fastest.
        return "sdpa_flex" if device_type == "cuda" else "sdpa"
    if name == "flex" and device_type not in ("cuda", "cpu"):
        raise ValueError(f"--attn-backend: flex needs a cuda or cpu device, got {device_type}; "
                         "accepted here: auto|sdpa|reference")
    return name


# ----------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Preallocated k/v buffers (L, B, Hkv, Tmax, D) for incremental decoding.

    `pos` counts the tokens already written for every layer. `insert()` writes one layer's new
    k/v at [pos, pos+T) and returns views of the valid prefix; `advance(T)` (called by GPT.forward
    after the last layer) moves `pos`.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, seq_len: int, head_dim: int,
                 num_layers: int, device, dtype: torch.dtype):
        for field, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                             ("seq_len", seq_len), ("head_dim", head_dim), ("num_layers", num_layers)):
            if int(value) < 1:
                raise ValueError(f"KVCache {field}: got {value}; accepted: an integer >= 1")
        shape = (num_layers, batch_size, num_kv_heads, seq_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.pos = 0

    @property
    def batch_size(self) -> int:
        return self.k.size(1)

    @property
    def seq_len(self) -> int:
        return self.k.size(3)

    def reset(self) -> None:
        self.pos = 0

    def advance(self, num_tokens: int) -> None:
        assert self.pos + num_tokens <= self.seq_len, "advance past the cache end"
        self.pos += num_tokens

    def insert(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (B, Hkv, T, D) at [pos, pos+T) of `layer_idx`; return k/v over [0, pos+T)."""
        T = k.size(2)
        end = self.pos + T
        if end > self.seq_len:
            raise ValueError(f"KVCache: {end} tokens exceed the cache length {self.seq_len}; "
                             "create the cache with a larger seq_len")
        if k.size(0) != self.batch_size:
            raise ValueError(f"KVCache: batch {k.size(0)} != cache batch {self.batch_size}")
        self.k[layer_idx, :, :, self.pos:end].copy_(k)
        self.v[layer_idx, :, :, self.pos:end].copy_(v)
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]

    def prefill_from(self, other: "KVCache") -> None:
        """Copy a batch-1 cache (e.g. a prompt prefill) into every row of this cache."""
        if other.batch_size != 1:
            raise ValueError(f"KVCache.prefill_from: source batch must be 1, got {other.batch_size}")
        same = (other.k.size(0), other.k.size(2), other.k.size(4)) == (self.k.size(0), self.k.size(2), self.k.size(4))
        if not same:
            raise ValueError(f"KVCache.prefill_from: layers/heads/head_dim differ: {tuple(other.k.shape)} "
                             f"vs {tuple(self.k.shape)}")
        if other.pos > self.seq_len:
            raise ValueError(f"KVCache.prefill_from: source holds {other.pos} tokens, cache fits {self.seq_len}")
        n = other.pos
        self.k[:, :, :, :n].copy_(other.k[:, :, :, :n])  # broadcasts batch 1 -> B
        self.v[:, :, :, :n].copy_(other.v[:, :, :, :n])
        self.pos = n


# ----------------------------------------------------------------------------------------------
# Masks


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean (Tq, Tk): causal, and within the window when one is given."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if window is not None:
        ok = ok & (diff < window)
    return ok


def _dense_mask(T: int, window: int, device: torch.device) -> torch.Tensor:
    """Cached dense (T, T) boolean window mask for the SDPA backend (never used by sdpa_flex)."""
    key = (T, window, str(device))
    mask = _DENSE_MASKS.get(key)
    if mask is None:
        pos = torch.arange(T, device=device)
        mask = _visible(pos, pos, window)
        if not torch.compiler.is_compiling():
            _DENSE_MASKS[key] = mask
    return mask


def _block_mask(T: int, window: int | None, device: torch.device):
    """Cached flex BlockMask for causal (+ window) attention over T tokens."""
    key = (T, window, str(device))
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        if window is None:
            def mask_mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
        # B=None, H=None: one mask broadcast over batch and heads (the sparsity is shared).
        mask = create_block_mask(mask_mod, None, None, T, T, device=device)
        if not torch.compiler.is_compiling():
            _BLOCK_MASKS[key] = mask
    return mask


def prepare_masks(seq_len: int, windows, device, backend: str) -> None:
    """Build the masks a forward at `seq_len` will use, in eager mode, so a compiled graph finds
    them cached (call before the first compiled step; optional, a miss is built in-graph)."""
    backend = resolve_backend(backend, device)
    device = torch.device(device)
    for window in set(windows):
        if window is not None and window >= seq_len:
            window = None
        if backend == "flex" or (backend == "sdpa_flex" and window is not None):
            _block_mask(seq_len, window, device)
        elif backend == "sdpa" and window is not None:
            _dense_mask(seq_len, window, device)


# ----------------------------------------------------------------------------------------------
# Kernels


def reference_attention(q, k, v, *, window: int | None = None, q_offset: int = 0, k_offset: int = 0):
    """Plain math attention (any float dtype, float64 included); positions q_offset+i, k_offset+j."""
    rep = q.size(1) // k.size(1)
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    work = torch.promote_types(q.dtype, torch.float32)  # softmax in >= fp32
    scores = (q.to(work) @ k.to(work).transpose(-1, -2)) / math.sqrt(q.size(-1))
    q_pos = torch.arange(q.size(2), device=q.device) + q_offset
    k_pos = torch.arange(k.size(2), device=q.device) + k_offset
    scores = scores.masked_fill(~_visible(q_pos, k_pos, window), float("-inf"))
    return (scores.softmax(dim=-1) @ v.to(work)).to(q.dtype)


def _sdpa(q, k, v, *, is_causal: bool, attn_mask=None):
    # enable_gqa only when needed: with equal head counts the plain call keeps every kernel
    # (flash, cuDNN, efficient) eligible.
    if q.size(1) != k.size(1):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                              enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal)


def _flex(q, k, v, window: int | None):
    from torch.nn.attention.flex_attention import flex_attention

    global _COMPILED_FLEX
    block_mask = _block_mask(q.size(2), window, q.device)
    gqa = q.size(1) != k.size(1)
    if torch.compiler.is_compiling():
        # Inside a compiled model inductor generates the fused kernel itself.
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if q.device.type == "cuda":
        # Eager flex_attention on CUDA materialises the full score matrix; the compiled op is the
        # real block-sparse kernel. Compile once, lazily (never at import).
        if _COMPILED_FLEX is None:
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        return _COMPILED_FLEX(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError("attention backend 'flex' has no backward on CPU; use --attn-backend "
                           "auto|sdpa|reference for CPU training")
    with warnings.catch_warnings():
        # CPU eager flex is an unfused (dense) implementation; fine for CPU inference and tests.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _cached_attention(q, k, v, window, backend, kv_cache: KVCache, layer_idx: int):
    """Attend the T new queries (absolute positions pos..pos+T-1) over the cache."""
    T, pos = q.size(2), kv_cache.pos
    k_all, v_all = kv_cache.insert(layer_idx, k, v)
    if k_all.dtype != q.dtype:
        k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
    # Only keys some query can see: the first query (at pos) reaches back to pos - window + 1.
    start = 0 if window is None else max(0, pos + 1 - window)
    k_all, v_all = k_all[:, :, start:], v_all[:, :, start:]
    if backend == "reference":
        return reference_attention(q, k_all, v_all, window=window, q_offset=pos, k_offset=start)
    if start == 0 and pos == 0 and (window is None or window >= T):
        return _sdpa(q, k_all, v_all, is_causal=True)  # plain prefill: the fast causal kernel
    # Decode / chunked prefill: explicit (T, pos+T-start) mask; small for decode (T == 1).
    q_pos = torch.arange(pos, pos + T, device=q.device)
    k_pos = torch.arange(start, pos + T, device=q.device)
    return _sdpa(q, k_all, v_all, is_causal=False, attn_mask=_visible(q_pos, k_pos, window))


def attention(q, k, v, *, window: int | None, backend: str, kv_cache: KVCache | None = None,
              layer_idx: int | None = None):
    """Causal (windowed) GQA attention. q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, Hq, T, D)."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"attention: expected q (B,Hq,T,D), k/v (B,Hkv,T,D); got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.size(1) % k.size(1) != 0:
        raise ValueError(f"attention: Hq={q.size(1)} is not a multiple of Hkv={k.size(1)}")
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be None or >= 1, got {window}")
    if backend not in RESOLVED_BACKENDS:
        backend = resolve_backend(backend, q.device)
    if kv_cache is not None:
        if layer_idx is None:
            raise ValueError("attention: layer_idx is required with a kv_cache")
        return _cached_attention(q, k, v, window, backend, kv_cache, layer_idx)
    T = q.size(2)
    if window is not None and window >= T:
        window = None  # the window covers every key: plain causal (full-attention kernels)
    if backend == "reference":
        return reference_attention(q, k, v, window=window)
    if backend == "flex" or (backend == "sdpa_flex" and window is not None):
        return _flex(q, k, v, window)
    if window is None:
        return _sdpa(q, k, v, is_causal=True)
    return _sdpa(q, k, v, is_causal=False, attn_mask=_dense_mask(T, window, q.device))
