"""The GPT's configuration (nanochat/gpt.py builds the model from it and re-exports these names):
GPTConfig, its sizes, window pattern and softcap, and validate(), which checks types too (a
meta.json's model_config arrives unconverted); config_for_depth, the one dial (width = depth x
aspect ratio); and what the config decides of the layers: each layer's attention window
(layer_windows) and which layers carry value embeddings (has_value_embed).

Torch-free, so a tool can size a model without importing torch. Checkpoints record the config as
a dict (dataclasses.asdict) and rebuild it with GPTConfig(**model_config), not as a pickled class.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768  # the tokenizer's; padded inside to a multiple of 64
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_pattern: str = "SSSL"
    softcap: float = 15.0

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return ((self.vocab_size + 63) // 64) * 64

    def validate(self) -> None:
        # types too: a meta.json's model_config lands here unconverted (a float layer count failed
        # inside nn.ModuleList; softcap inf made every logit inf * tanh(0) = NaN)
        for field in ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"GPTConfig.{field}: got {value!r}; accepted: an integer >= 1")
        if self.n_embd % self.n_head or self.head_dim % 2:
            raise ValueError(f"GPTConfig.n_embd: {self.n_embd} must split into n_head={self.n_head} "
                             "heads of an even head_dim (RoPE rotates pairs)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_kv_head: got {self.n_kv_head}; accepted: a divisor of n_head={self.n_head}")
        check_window_pattern(self.window_pattern)
        cap = self.softcap
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0 < cap < math.inf:
            raise ValueError(f"GPTConfig.softcap: got {self.softcap!r}; accepted: a finite number > 0")


def check_window_pattern(pattern) -> None:
    """Raise unless `pattern` is a non-empty string of S and L (--window-pattern)."""
    if not isinstance(pattern, str) or not pattern or set(pattern) - {"S", "L"}:
        raise ValueError(f"--window-pattern: got {pattern!r}; accepted: a non-empty "
                         "string of S (window T/4) and L (full), e.g. SSSL or L")


def config_for_depth(depth: int, vocab_size: int, sequence_len: int, *, aspect_ratio: int = 64,
                     head_dim: int = 128, n_kv_head: int | None = None,
                     window_pattern: str = "SSSL") -> GPTConfig:
    """width = depth * aspect_ratio rounded up to a multiple of head_dim; n_head = width / head_dim."""
    # integers only: depth "4" failed with a TypeError, and 2.5 / True / aspect_ratio 64.0 were
    # refused as GPTConfig.n_layer or n_head (a field the caller never passed)
    for flag, value in (("--depth", depth), ("--aspect-ratio", aspect_ratio), ("--head-dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{flag}: got {value!r}; accepted: an integer")
    if depth < 1:
        raise ValueError(f"--depth: got {depth}; accepted: an integer >= 1")
    if aspect_ratio < 1 or head_dim < 2 or head_dim % 2:
        raise ValueError(f"--aspect-ratio/--head-dim: got {aspect_ratio}/{head_dim}; accepted: "
                         "aspect_ratio >= 1 and an even head_dim >= 2")
    n_embd = -(-depth * aspect_ratio // head_dim) * head_dim
    n_head = n_embd // head_dim
    cfg = GPTConfig(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                    n_kv_head=n_head if n_kv_head is None else n_kv_head, n_embd=n_embd,
                    window_pattern=window_pattern)
    cfg.validate()
    return cfg


def layer_windows(config: GPTConfig) -> list[int | None]:
    """Per-layer attention window in tokens (None = full). S = sequence_len // 4; last layer full."""
    # checked here too: callers pass configs that never met validate() (a config edited after it),
    # and every letter but "L" (a lowercase "l" included) became a window, "" a ZeroDivisionError
    check_window_pattern(config.window_pattern)
    short = max(1, config.sequence_len // 4)
    pattern = config.window_pattern
    windows = [None if pattern[i % len(pattern)] == "L" else short for i in range(config.n_layer)]
    windows[-1] = None
    return windows


def has_value_embed(layer_idx: int, n_layer: int) -> bool:
    """Alternating layers, always including the last one."""
    return (n_layer - 1 - layer_idx) % 2 == 0
