"""The KV caches of inference: `KVCache` (preallocated per-layer k/v buffers that prefill and
eager decode write at a host-side position) and `StaticKV` (the same buffers seen by one
fixed-shape decode step whose position is a device tensor, for CUDA graphs and continuous
batching). nanochat/attention.py reads them; it re-exports both names, which other modules import
from there (docs/INTERFACES.md)."""

from __future__ import annotations

import numbers

import torch


def check_layer(layers: list, layer_idx: int) -> None:
    """A layer index must name one of the cache's layers: a cache made for fewer layers than the
    model failed with a bare IndexError, and a negative index wrote another layer's slots."""
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, numbers.Integral) or not 0 <= layer_idx < len(layers):
        raise ValueError(f"KVCache: layer {layer_idx!r} outside 0..{len(layers) - 1} (num_layers="
                         f"{len(layers)}); create the cache with the model's n_layer")


class KVCache:
    """Preallocated k/v buffers for incremental decoding: per layer one (B, Hkv, Tmax, D) tensor.

    `pos` counts the tokens already written for every layer. `insert()` writes one layer's new
    k/v at [pos, pos+T) and returns views of the valid prefix; `advance(T)` (called by GPT.forward
    after the last layer) moves `pos`. Layers are separate tensors, not views of one block: a
    compiled static decode step (StaticKV) mutates them in place, and mutated graph inputs that
    alias one storage would make torch.compile copy the whole block every step.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, seq_len: int, head_dim: int,
                 num_layers: int, device, dtype: torch.dtype):
        for field, value in (("batch_size", batch_size), ("num_kv_heads", num_kv_heads),
                             ("seq_len", seq_len), ("head_dim", head_dim), ("num_layers", num_layers)):
            # int(value) let 2.5 and "8" through to a TypeError inside torch.zeros, and True as 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"KVCache {field}: got {value!r}; accepted: an integer >= 1")
        shape = (batch_size, num_kv_heads, seq_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.pos = 0

    @property
    def batch_size(self) -> int:
        return self.k[0].size(0)

    @property
    def seq_len(self) -> int:
        return self.k[0].size(2)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def rows(self, n: int) -> "KVCache":
        """A cache over this one's first `n` rows (views: batch sizes share one cache)."""
        if not 1 <= n <= self.batch_size:
            raise ValueError(f"KVCache.rows: got {n}; accepted: 1..{self.batch_size}")
        view = object.__new__(KVCache)
        view.k, view.v = [t[:n] for t in self.k], [t[:n] for t in self.v]
        view.pos = self.pos
        return view

    def copy_row(self, dst: int, src_cache: "KVCache", src: int, length: int) -> None:
        """Slots [0, length) of row `src` of `src_cache` -> row `dst` of this cache."""
        if not (0 <= dst < self.batch_size and 0 <= src < src_cache.batch_size):
            raise ValueError(f"KVCache.copy_row: rows {src} -> {dst} outside the caches' batches")
        if not 0 <= length <= min(self.seq_len, src_cache.seq_len) or src_cache.num_layers != self.num_layers:
            raise ValueError(f"KVCache.copy_row: {length} slots or {src_cache.num_layers} layers do not fit")
        # copy_ broadcasts: a 1-head row went into every head of another cache without a word
        self._check_heads("copy_row", src_cache.k[0].shape)
        for mine, theirs in zip(self.k + self.v, src_cache.k + src_cache.v):
            mine[dst, :, :length].copy_(theirs[src, :, :length])

    def reset(self) -> None:
        self.pos = 0

    def advance(self, num_tokens: int) -> None:
        assert self.pos + num_tokens <= self.seq_len, "advance past the cache end"
        self.pos += num_tokens

    def insert(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v (B, Hkv, T, D) at [pos, pos+T) of `layer_idx`; return k/v over [0, pos+T)."""
        check_layer(self.k, layer_idx)
        end = self.pos + k.size(2)
        if end > self.seq_len:
            raise ValueError(f"KVCache: {end} tokens exceed the cache length {self.seq_len}; "
                             "create the cache with a larger seq_len")
        if k.size(0) != self.batch_size:
            raise ValueError(f"KVCache: batch {k.size(0)} != cache batch {self.batch_size}")
        self._check_heads("insert", k.shape)
        self.k[layer_idx][:, :, self.pos:end].copy_(k)
        self.v[layer_idx][:, :, self.pos:end].copy_(v)
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]

    def _check_heads(self, caller: str, shape) -> None:
        """k/v of `shape` (B, Hkv, T, D) must have this cache's kv heads and head dim (copy_ would
        broadcast one kv head into all of them, or fail with torch's slice-shape message)."""
        mine = self.k[0].shape
        if (shape[1], shape[3]) != (mine[1], mine[3]):
            raise ValueError(f"KVCache.{caller}: {shape[1]} kv heads x head dim {shape[3]} given, the cache "
                             f"holds {mine[1]} x {mine[3]}; create it with the model's n_kv_head and head_dim")

    def prefill_from(self, other: "KVCache") -> None:
        """Copy a batch-1 cache (e.g. a prompt prefill) into every row of this cache."""
        if other.batch_size != 1:
            raise ValueError(f"KVCache.prefill_from: source batch must be 1, got {other.batch_size}")
        src, dst = other.k[0], self.k[0]
        if other.num_layers != self.num_layers or (src.size(1), src.size(3)) != (dst.size(1), dst.size(3)):
            raise ValueError(f"KVCache.prefill_from: layers/heads/head_dim differ: {other.num_layers} x "
                             f"{tuple(src.shape)} vs {self.num_layers} x {tuple(dst.shape)}")
        if other.pos > self.seq_len:
            raise ValueError(f"KVCache.prefill_from: source holds {other.pos} tokens, cache fits {self.seq_len}")
        n = other.pos
        for mine, theirs in zip(self.k + self.v, other.k + other.v):
            mine[:, :, :n].copy_(theirs[:, :, :n])  # broadcasts batch 1 -> B
        self.pos = n


class StaticKV:
    """A KVCache seen by one fixed-shape decode step (one new token per row).

    The position is a (1,) long tensor on the cache's device (every row at the same position), or
    a (B,) one with each row's own position (continuous batching, nanochat/batching.py), and the
    step attends over the first `key_pos.numel()` cache slots (a length bucket) with a mask built
    from the position(s), so every tensor shape is independent of the positions: one captured
    CUDA graph (or one compiled graph) serves every step of a bucket. The caller owns the
    position: it refills `pos` before each step, and `advance` is a no-op. Slots past a row's
    position may hold stale k/v from earlier use of the cache; the mask hides them (the cache is
    zero-initialised, so they are always finite).
    """

    def __init__(self, cache: KVCache, pos: torch.Tensor, key_pos: torch.Tensor):
        if pos.dim() != 1 or pos.numel() not in (1, cache.batch_size) or pos.dtype != torch.long:
            raise ValueError(f"StaticKV pos: expected a (1,) or (batch,) = ({cache.batch_size},) long tensor, "
                             f"got {tuple(pos.shape)} {pos.dtype}")
        if not 1 <= key_pos.numel() <= cache.seq_len:
            raise ValueError(f"StaticKV: length {key_pos.numel()} outside 1..{cache.seq_len} (the cache length)")
        self.k, self.v = cache.k, cache.v
        self.pos = pos            # where this step's token goes
        self.key_pos = key_pos    # arange(length): the slots this step reads

    def advance(self, num_tokens: int) -> None:
        """No-op: the position lives in `pos`, which the caller refills for the next step."""
