"""The GPT model: layers, forward/loss, FLOPs estimate and parameter groups (its config,
GPTConfig, config_for_depth and the per-layer windows, is nanochat/gpt_config.py's, re-exported here).

Architecture (modern nanochat class), sized by one dial (`config_for_depth`):
  token embedding -> RMSNorm -> n_layer x Block -> RMSNorm -> lm_head -> tanh softcap.
  * Block: x = resid_lambdas[i] * x + x0_lambdas[i] * x0 (x0 = the normed embedding), then
    x += attn(norm(x)); x += mlp(norm(x)). RMSNorm is parameter-free F.rms_norm; no biases anywhere.
  * Attention: RoPE (precomputed cos/sin, half-split rotation, base 10000) then QK RMSNorm,
    GQA (n_kv_head | n_head), per-layer sliding windows from `window_pattern` (S = T/4 window,
    L = full; the pattern tiles across layers; the last layer is always full).
  * Value embeddings on alternating layers (the last layer included): a separate
    (vocab, n_kv_head*head_dim) table per VE layer, added into v through a per-head gate
    2*sigmoid(ve_gate(x[..., :32])).
  * MLP: 4x, ReLU^2. Untied embedding / lm_head; vocab padded to a multiple of 64 (padding
    logits are sliced off before the softcap, so they are never returned and never win).

Dtype policy: parameters stay float32 (master weights); activations flow in the compute dtype
(`compute_dtype`, default bf16 on CUDA, fp32 elsewhere; pass Runtime.dtype to override). The
embedding output is cast once; `Linear` casts its weight to the input dtype in forward (so bf16
matmuls read bf16 weights, gradients land in fp32 params, and precision.py can swap the class),
or reads the copy cast once per optimizer step (nanochat/weight_cache.py, the Trainer's
accumulation); RMSNorm/RoPE (nanochat/norms.py) take and return the compute dtype (math in
float32, float64 for float64); logits are float32, and so is the loss (float64 in a float64
model, as the tests' references run). No autocast anywhere.

Init (`init_weights`, needed after construction, also after `to_empty` from the meta device):
  wte ~ N(0, 1); c_q, c_k, c_v, c_fc ~ U(-s, s) with s = sqrt(3/n_embd) (std 1/sqrt(fan_in));
  attention c_proj and MLP c_proj = 0 (every block starts as the identity); value embeddings
  ~ U(-s, s); ve_gate = 0 (gate 1 at start); lm_head ~ N(0, 0.001) (initial loss ~ ln(vocab));
  resid_lambdas = 1, x0_lambdas = 0.1.
"""

from __future__ import annotations

import contextlib
import math
import numbers

import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat import weight_cache
from nanochat.attention import (BACKEND_CHOICES, RESOLVED_BACKENDS, KVCache, StaticKV, attention, prepare_masks,
                                resolve_backend)
from nanochat.gpt_config import (GPTConfig, check_window_pattern, config_for_depth,  # noqa: F401 (re-exported)
                                 has_value_embed, layer_windows)
from nanochat.kernels import check_temperature, cross_entropy_loss, loss_takes_temperature   # (GPT's loss)
from nanochat.norms import (ROTARY_BASE, _RMSNorm, _RotaryNorm, _rms, _rms_backward, apply_rotary,  # noqa: F401
                            norm, plain_mix_norm, rotary_norm, rotary_norm_forward, rotary_tables)   # (re-exported)

LOSS_REDUCTIONS = ("mean", "sum", "none")
VE_GATE_CHANNELS = 32
ROTARY_LENGTH_FACTOR = 10  # rotary tables cover 10 x sequence_len (generation past training T)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
TOKEN_DTYPES = (torch.int64, torch.int32)   # what the embedding lookup and the loss's gather take


class _ReluSquare(torch.autograd.Function):
    """relu(x)^2 that saves only its output: d/dx = 2 relu(x) = 2 sqrt(out). The c_proj matmul
    saves the same tensor, so the MLP keeps one 4C-wide activation per layer instead of two
    (measured on the compile partitioner: it saved both relu(x) and relu(x)^2; 13 GB at d20)."""

    @staticmethod
    def forward(ctx, x):
        out = F.relu(x).square()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return grad * 2 * out.sqrt()


class _ValueEmbedMix(torch.autograd.Function):
    """v + gate * table[idx] (value embeddings) that recomputes the lookup in backward.

    Why: the gate's gradient needs table[idx], and saved as such it is one more (B, T, kv_dim)
    tensor per value-embedding layer (half the layers; ~1.6 GiB at d20, batch 32 x 2048). The
    lookup is a gather, so backward recomputes it from the token ids and the weight, both kept
    anyway. Shapes: v (B, T, H, D) in the compute dtype, gate (B, T, H), idx (B, T), table (V, H*D)
    (fp32 master weight, cast like the plain path's `.to(dtype)`).
    """

    @staticmethod
    def forward(ctx, v, gate, idx, table, copy, sink):
        src = table if copy is None else copy   # copy: weight_cache's cast of table (same rows)
        ve = F.embedding(idx, src).to(v.dtype).view_as(v)
        ctx.save_for_backward(gate, idx, table, src, sink)   # sink: weight_cache's gradient sink
        return v + gate.unsqueeze(-1) * ve

    @staticmethod
    def backward(ctx, grad):
        gate, idx, table, src, sink = ctx.saved_tensors
        # index_select, not embedding: the compile partitioner would merge an identical lookup
        # with the forward's and save its output after all
        ve = src.index_select(0, idx.flatten()).to(grad.dtype).view_as(grad)
        grad_gate = (grad * ve).sum(-1) if ctx.needs_input_grad[1] else None
        grad_table = None
        if ctx.needs_input_grad[3]:
            rows = (grad * gate.unsqueeze(-1)).flatten(2).to(table.dtype)
            grad_table = weight_cache.table_grad(sink, idx, rows, table.shape[0])
        return grad, grad_gate, None, grad_table, None, None


class Linear(nn.Linear):
    """Bias-free Linear whose forward casts the (fp32 master) weight to the input's dtype.

    precision.py swaps this class (fp8/nvfp4); keep it the only matmul module in the model.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        weight_cache.add_slot(self)   # the step's cast copy of the weight (nanochat/weight_cache.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight_cache.weight_as(self, x.dtype))


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        C, kv_dim = config.n_embd, config.n_kv_head * config.head_dim
        self.c_q = Linear(C, config.n_head * config.head_dim)
        self.c_k = Linear(C, kv_dim)
        self.c_v = Linear(C, kv_dim)
        self.c_proj = Linear(config.n_head * config.head_dim, C)
        self.gate_channels = min(VE_GATE_CHANNELS, C)
        self.ve_gate = Linear(self.gate_channels, config.n_kv_head) if has_value_embed(layer_idx, config.n_layer) else None
        self.qkv_weight: torch.Tensor | None = None  # set inside GPT.inference_weights() only
        self.qkv_quant = None   # the fused int8 q/k/v Linear of a quantised model (nanochat/quantize.py)
        self._qkv_buffer: torch.Tensor | None = None  # its storage, kept (CUDA graphs hold its address)
        self.rotary_norm = rotary_norm   # GPT.set_rotary_norm
        self.qkv_projection = None   # fn(attn, x, cos, sin) -> (q, k, v, gate) (GPT.set_qkv_projection)

    def forward(self, x, ve, cos, sin, window, backend, kv_cache):
        B, T, _ = x.shape
        gate_logits = None   # the value-embedding gate's, when qkv_projection computed them
        if (self.qkv_weight is not None or self.qkv_quant is not None) and not torch.is_grad_enabled():
            # one GEMM (a GEMV when decoding): the inference copy, or the quantised fused rows
            qkv = F.linear(x, self.qkv_weight.to(x.dtype)) if self.qkv_quant is None else self.qkv_quant(x)
            q, k, v = qkv.split((self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                 self.n_kv_head * self.head_dim), dim=-1)
        elif self.qkv_projection is not None and torch.is_grad_enabled():   # q, k come back normed
            q, k, v, gate_logits = self.qkv_projection(self, x, cos, sin)
        else:
            q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # (token ids, value-embedding table)
            if gate_logits is None:
                gate_logits = self.ve_gate(x[..., :self.gate_channels])
            gate = 2 * torch.sigmoid(gate_logits)  # (B, T, Hkv)
            v = _ValueEmbedMix.apply(v, gate, *ve)
        # RoPE + QK-norm in the (B, T, H, D) layout the projections produce: one fused elementwise
        # kernel per tensor under torch.compile; the transposes below are free views.
        if q.ndim == 3:
            q = self.rotary_norm(q.view(B, T, self.n_head, self.head_dim), cos, sin)
            k = self.rotary_norm(k.view(B, T, self.n_kv_head, self.head_dim), cos, sin)
        y = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window=window,
                      backend=backend, kv_cache=kv_cache, layer_idx=self.layer_idx)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd)
        self.fused = None   # fn(x, w_fc, w_proj) -> y replacing the three steps (GPT.set_mlp_fn)

    def forward(self, x):
        # training only: the fused kernels exist for backward's memory and passes; inference
        # (KV-cache decode, CUDA graphs) keeps the Linear path and its shapes
        if self.fused is not None and torch.is_grad_enabled():
            return self.fused(x, *(weight_cache.weight_or_copy(m, x.dtype) for m in (self.c_fc, self.c_proj)))
        return self.c_proj(_ReluSquare.apply(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, x_normed, ve, cos, sin, window, backend, kv_cache):
        """x: the block input (after the residual mix); x_normed = norm(x), computed with the mix
        by GPT.mix_norm. Returns (residual stream after attention, MLP output): the block's output
        is their sum, which the next block's mix_norm (or the final norm) forms, fused with it."""
        x = x + self.attn(x_normed, ve, cos, sin, window, backend, kv_cache)
        return x, self.mlp(norm(x))


def _rebuild_rotary_after_load(module: "GPT", incompatible_keys) -> None:
    device = module.wte.weight.device
    if module.cos.device != device:
        # built on meta, loaded with assign=True: the weights moved, the (unsaved) tables stayed on
        # meta and the first forward failed ("Tensor on device meta is not on the expected device")
        module.cos = torch.empty(module.cos.shape, device=device)
        module.sin = torch.empty(module.sin.shape, device=device)
    module._init_rotary()


def _embedding(n: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its own random init when built on the meta device (build_model):
    init_weights sets every table anyway, and nn.init.normal_ on a meta tensor imports
    torch._dynamo, ~4 s of every chat_cli / chat_web / chat_eval start-up (torch 2.15)."""
    weight = torch.empty(n, dim)   # the device of the enclosing `with torch.device(...)`
    return nn.Embedding(n, dim, _weight=weight) if weight.is_meta else nn.Embedding(n, dim)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, *, attn_backend: str = "auto",
                 compute_dtype: torch.dtype | None = None):
        super().__init__()
        config.validate()
        if attn_backend not in BACKEND_CHOICES + RESOLVED_BACKENDS:
            raise ValueError(f"--attn-backend: got {attn_backend!r}; accepted: {'|'.join(BACKEND_CHOICES)}")
        self.config = config
        if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
            # else a name ("bf16": precision.py's compute_dtype) failed in the first forward
            raise ValueError(f"GPT compute_dtype: got {compute_dtype!r}; accepted: None (bf16 on CUDA, fp32 "
                             f"elsewhere) or a torch dtype: {'|'.join(map(str, COMPUTE_DTYPES))} (Runtime.dtype)")
        self.attn_backend = attn_backend  # resolved per device at forward time (may build on meta)
        self.compute_dtype = compute_dtype  # None = bf16 on CUDA, fp32 elsewhere
        self.windows = layer_windows(config)
        self.loss_fn, self.loss_fn_tempers = cross_entropy_loss, True   # set_loss_fn
        self.mix_norm = plain_mix_norm
        self.mix_norm_fuses_add, self.mix_norm_chains_x0 = True, False   # set_mix_norm
        V, C = config.padded_vocab_size, config.n_embd
        kv_dim = config.n_kv_head * config.head_dim
        self.wte = _embedding(V, C)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.n_layer)])
        self.value_embeds = nn.ModuleDict({str(i): _embedding(V, kv_dim) for i in range(config.n_layer)
                                           if has_value_embed(i, config.n_layer)})
        self.lm_head = Linear(C, V)
        for emb in (self.wte, *self.value_embeds.values()):
            weight_cache.add_slot(emb)
        self.resid_lambdas = nn.Parameter(torch.ones(config.n_layer))
        self.x0_lambdas = nn.Parameter(torch.full((config.n_layer,), 0.1))
        # Rotary tables are derived state: non-persistent buffers, rebuilt by init_weights() and after
        # load_state_dict() (to_empty leaves garbage); not filled on meta (slow first meta kernels).
        shape = (1, config.sequence_len * ROTARY_LENGTH_FACTOR, 1, config.head_dim // 2)
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)
        self._init_rotary()
        self.register_load_state_dict_post_hook(_rebuild_rotary_after_load)

    # ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_rotary(self) -> None:
        if self.cos.device.type == "meta":
            return
        cos, sin = rotary_tables(self.cos.size(1), self.config.head_dim, device=self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self) -> None:
        C = self.config.n_embd
        s = math.sqrt(3.0 / C)  # uniform bound with std 1/sqrt(fan_in)
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -s, s)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)
        for emb in self.value_embeds.values():
            nn.init.uniform_(emb.weight, -s, s)
        self.resid_lambdas.fill_(1.0)
        self.x0_lambdas.fill_(0.1)
        self._init_rotary()

    @contextlib.contextmanager
    def inference_weights(self):
        """Within this context, grad-disabled forwards run each layer's q/k/v projections as one
        matmul over a concatenated copy of c_q/c_k/c_v (made on entry from the current weights,
        in the compute dtype, into a buffer reused across entries so CUDA graphs captured inside
        stay valid). A batch-1 decode step is launch-bound (H100 profile: ~300 kernels per d20
        token, CHANGELOG_GB10.md), so one GEMV instead of three per layer is fewer launches over a
        3x larger read. Training forwards (grad enabled) and forwards outside the context use the
        live weights; weights must not change while the context is open (a generator left
        suspended keeps it open: close it). Re-entrant; Engine.generate and Engine.warmup enter
        it. Costs one extra copy of the q/k/v weights (196 MB at d20, bf16)."""
        self._inference_depth = getattr(self, "_inference_depth", 0) + 1
        try:
            if self._inference_depth == 1:
                self._refresh_qkv()
            yield self
        finally:
            self._inference_depth -= 1
            if self._inference_depth == 0:
                for block in self.blocks:
                    block.attn.qkv_weight = None

    # inference_mode(False) first: a normal tensor even when entered under inference_mode (later
    # refreshes copy into it from outside that mode); it turns grad mode back on, so no_grad inside
    # it: the copy carried an autograd graph to the weights (and deepcopy of the model failed)
    @torch.inference_mode(False)
    @torch.no_grad()
    def _refresh_qkv(self) -> None:
        dtype = self.runtime_dtype(self.wte.weight.device)
        for block in self.blocks:
            attn = block.attn
            if attn.qkv_quant is not None:   # quantised: already one fused matrix
                continue
            fused = torch.cat([attn.c_q.weight, attn.c_k.weight, attn.c_v.weight]).to(dtype)
            buf = attn._qkv_buffer
            if buf is None or buf.shape != fused.shape or buf.dtype != dtype or buf.device != fused.device:
                attn._qkv_buffer = buf = torch.empty_like(fused)
            buf.copy_(fused)
            attn.qkv_weight = buf

    def set_loss_fn(self, fn) -> None:
        """fn(hidden (N,C), lm_head_weight (Vpad,C), targets (N,), softcap, vocab_size, reduction,
        *, temperature=1.0); hidden and weight arrive in the compute dtype. The keyword comes only
        when forward's temperature is not 1, so a fn without it serves every other forward.
        None restores the default."""
        if fn is not None and not callable(fn):
            raise ValueError(f"set_loss_fn: expected a callable or None, got {type(fn).__name__}")
        self.loss_fn = cross_entropy_loss if fn is None else fn
        self.loss_fn_tempers = loss_takes_temperature(self.loss_fn)

    def set_mix_norm(self, fn, *, fuse_add: bool = True, chain_x0: bool | None = None) -> None:
        """fn(r, x0, lam, mu, add=None) -> (s, norm(s)) with s = lam * (r + add) + mu * x0
        (plain_mix_norm's contract), each block's residual mix and input norm, used while grad is
        enabled (training; inference keeps plain_mix_norm). None restores plain_mix_norm.
        fuse_add=False forms each block's output r + add before calling fn; chain_x0 (default:
        fn.chains_x0) calls fn(..., x0_chain=True) -> (s, norm(s), x0 for the next block), so the
        x0 gradients add up inside fn's backward (fused_norm.mix_norm); False for A/B runs."""
        if fn is not None and not callable(fn):
            raise ValueError(f"set_mix_norm: expected a callable or None, got {type(fn).__name__}")
        if chain_x0 and (fn is None or fn is plain_mix_norm):
            # else the first training forward failed with a TypeError (unexpected x0_chain)
            raise ValueError("set_mix_norm: chain_x0=True needs a fn that takes x0_chain (e.g. "
                             "fused_norm.mix_norm); plain_mix_norm does not")
        self.mix_norm = plain_mix_norm if fn is None else fn
        self.mix_norm_fuses_add = fuse_add
        self.mix_norm_chains_x0 = getattr(fn, "chains_x0", False) if chain_x0 is None else chain_x0

    def set_rotary_norm(self, fn) -> None:
        """fn(x, cos, sin) -> rotary_norm(x, cos, sin) (same contract and values, e.g. another
        backward) for q and k in every layer; None restores rotary_norm."""
        if fn is not None and not callable(fn):   # else a TypeError inside the first forward
            raise ValueError(f"set_rotary_norm: expected a callable or None, got {type(fn).__name__}")
        for block in self.blocks:
            block.attn.rotary_norm = rotary_norm if fn is None else fn

    def set_qkv_projection(self, fn) -> None:
        """fn(attn, x, cos, sin) -> (q, k, v, gate logits or None) for every layer's attention while
        grad is enabled, q / k = attn.rotary_norm(c(x).view(B, T, heads, D), cos, sin), v = c_v(x),
        the logits attn.ve_gate(x[..., :channels]) or None to leave them to the caller
        (fp8_qk.qkv_projection); the same values, up to one head-dim order of q and k alike
        (triton_qk). None: the plain ops."""
        if fn is not None and not callable(fn):
            raise ValueError(f"set_qkv_projection: expected a callable or None, got {type(fn).__name__}")
        for block in self.blocks:
            block.attn.qkv_projection = fn

    def set_mlp_fn(self, fn) -> None:
        """fn(x, w_fc, w_proj) -> relu(x w_fc^T)^2 w_proj^T for every block's MLP (fp32 master
        weights; fn casts them to x's dtype like Linear). Only for the layer class fn stands in
        for: `fn.replaces` (a tuple of classes; default the plain Linear), so a fused MLP never
        bypasses precision modules it does not implement. Used while grad is enabled (training;
        inference keeps the Linear path). None restores the Linear path."""
        if fn is not None and not callable(fn):
            raise ValueError(f"set_mlp_fn: expected a callable or None, got {type(fn).__name__}")
        replaces = getattr(fn, "replaces", (Linear,))
        for block in self.blocks:
            for layer in (block.mlp.c_fc, block.mlp.c_proj):
                if fn is not None and not isinstance(layer, replaces):
                    raise ValueError(f"set_mlp_fn: the MLP's layers are {type(layer).__name__} (swapped by "
                                     f"precision.py?); this fused MLP replaces only "
                                     f"{'|'.join(c.__name__ for c in replaces)}")
            block.mlp.fused = fn

    def decode_matrices(self) -> list[nn.Module]:
        """The matrix layers a decode step streams: lm_head, then each block's q, k, v, attention
        projection, MLP in and out (the value-embedding gates are 32 columns wide and left out)."""
        return [self.lm_head] + [m for b in self.blocks for m in (b.attn.c_q, b.attn.c_k, b.attn.c_v,
                                                                  b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]

    def runtime_dtype(self, device: torch.device) -> torch.dtype:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def prepare_attention(self, seq_len: int | None = None, *, backward: bool = True) -> str:
        """Build and cache this model's attention masks for `seq_len` (default config.sequence_len)
        on its device (and, for "auto" on CUDA, probe cuDNN's window kernel, plus FA4's backward
        if `backward`). Call once before torch.compile so the compiled graph reuses them. Returns
        the resolved backend."""
        return prepare_masks(self._seq_len(seq_len, "prepare_attention"), self.windows, self.wte.weight.device,
                             self.attn_backend, backward=backward)

    def _seq_len(self, seq_len, caller: str) -> int:
        """seq_len, or config.sequence_len for None. 0 used to mean the default and a negative
        length gave a negative attention term (a wrong FLOPs figure, hence a wrong MFU)."""
        if seq_len is None:
            return self.config.sequence_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral) or seq_len < 1:
            raise ValueError(f"GPT.{caller} seq_len: got {seq_len!r}; accepted: None or an integer >= 1")
        return int(seq_len)

    def _rotary(self, T: int, kv_cache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for positions [pos, pos + T) (pos = 0 without a cache)."""
        if isinstance(kv_cache, StaticKV):
            # Device-side position: a gather, so the step's shapes do not depend on it. The
            # position stays below the cache length (its k/v write needs a slot), so a cache no
            # longer than the table bounds it: a longer one gathered past the table (a bounds
            # error on CPU, a device-side assert on CUDA) once a step reached that far.
            if kv_cache.k[0].size(2) > self.cos.size(1):
                raise ValueError(f"GPT.forward: a StaticKV cache of {kv_cache.k[0].size(2)} positions exceeds the "
                                 f"rotary table ({self.cos.size(1)}); create the cache with at most that many")
            if kv_cache.pos.numel() == 1:
                return (self.cos.index_select(1, kv_cache.pos).to(dtype),
                        self.sin.index_select(1, kv_cache.pos).to(dtype))
            # a position per row (continuous batching): (B, 1, 1, D/2) rows
            return (self.cos[0].index_select(0, kv_cache.pos).unsqueeze(1).to(dtype),
                    self.sin[0].index_select(0, kv_cache.pos).unsqueeze(1).to(dtype))
        T0 = 0 if kv_cache is None else kv_cache.pos
        if T0 + T > self.cos.size(1):
            raise ValueError(f"GPT.forward: positions {T0}..{T0 + T - 1} reach past the rotary table's "
                             f"{self.cos.size(1)} positions (0..{self.cos.size(1) - 1})")
        return self.cos[:, T0:T0 + T].to(dtype), self.sin[:, T0:T0 + T].to(dtype)

    # ------------------------------------------------------------------------------------------
    def forward(self, idx, targets=None, kv_cache: KVCache | StaticKV | None = None, loss_reduction: str = "mean",
                logits_at: torch.Tensor | None = None, temperature: float = 1.0):
        """Logits (B, T, V), or the loss with `targets`. `logits_at`, a 1-D long tensor of sequence
        positions (on the model's device), limits the logits to those positions, (B, len, V): a
        prompt prefill needs only its last position's, and V-wide logits for every prompt token
        cost a (T, C) x (C, V) product and T x V floats (268 MB at T = 2048, V = 32768).
        `temperature` T (with targets only): the loss of softmax(softcapped logits / T), what the
        sampler draws from, computed inside the loss backend (no (B, T, V) float32 logits)."""
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction: got {loss_reduction!r}; accepted: mean|sum|none")
        if temperature != 1.0:
            check_temperature(temperature)
            if targets is None or not self.loss_fn_tempers:
                raise ValueError("GPT.forward temperature: accepted only with targets and a loss fn that takes "
                                 f"`temperature` (the kernels.py backends); got temperature {temperature!r}")
        if logits_at is not None and (targets is not None or logits_at.dim() != 1):
            raise ValueError("GPT.forward logits_at: a 1-D tensor of positions, and only without targets")
        if idx.dim() != 2 or 0 in idx.shape:   # else a reshape deep inside attention failed
            raise ValueError(f"GPT.forward idx: expected (B, T) token ids with B, T >= 1; "
                             f"got shape {tuple(idx.shape)}")
        if targets is not None and targets.shape != idx.shape:   # (T, B) targets lined up silently
            raise ValueError(f"GPT.forward targets: expected the shape of idx {tuple(idx.shape)}; "
                             f"got {tuple(targets.shape)}")
        for name, t in (("idx", idx), ("targets", targets)):
            # float targets failed only in the loss (after the whole forward) as a gather() error
            if t is not None and t.dtype not in TOKEN_DTYPES:
                raise ValueError(f"GPT.forward {name}: got dtype {t.dtype}; accepted: torch.int64|torch.int32")
        B, T = idx.shape
        dtype = self.runtime_dtype(idx.device)
        backend = resolve_backend(self.attn_backend, idx.device)  # string ops: constant under compile
        cos, sin = self._rotary(T, kv_cache, dtype)
        x = norm(weight_cache.lookup(idx, self.wte, dtype))
        x0 = x
        training = torch.is_grad_enabled()
        mix_norm = self.mix_norm if training else plain_mix_norm   # as in MLP.forward
        fuse_add = self.mix_norm_fuses_add or not training
        chain = self.mix_norm_chains_x0 and training
        add = None   # the previous block's MLP output, not yet added into x
        for i, block in enumerate(self.blocks):
            if add is not None and not fuse_add:
                x, add = x + add, None
            lam, mu = self.resid_lambdas[i], self.x0_lambdas[i]
            # x0 passes through each block's mix (its gradient adds up in the op); not the last
            # block's, whose x0 output nothing reads (compiled, its gradient would be zeros)
            if chain and i < len(self.blocks) - 1:
                x, x_normed, x0 = mix_norm(x, x0, lam, mu, add=add, x0_chain=True)
            else:
                x, x_normed = mix_norm(x, x0, lam, mu, add=add)
            key = str(i)
            ve = (idx, *weight_cache.table_and_copy(self.value_embeds[key], dtype)) if key in self.value_embeds else None
            x, add = block(x, x_normed, ve, cos, sin, self.windows[i], backend, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        x = norm(x + add)
        cfg = self.config
        if targets is not None:
            # a quantised head (nanochat/quantize.py; evaluation only) hands the loss its dequantised rows
            head = (self.lm_head.dequantize(dtype) if hasattr(self.lm_head, "dequantize")
                    else weight_cache.weight_as(self.lm_head, dtype))
            tempered = {} if temperature == 1.0 else {"temperature": float(temperature)}
            loss = self.loss_fn(x.reshape(B * T, -1), head, targets.reshape(-1), cfg.softcap, cfg.vocab_size,
                                loss_reduction, **tempered)
            return loss.view(B, T) if loss_reduction == "none" else loss
        if logits_at is not None:
            x = x.index_select(1, logits_at)
        logits = self.lm_head(x)[..., :cfg.vocab_size].float()
        return cfg.softcap * torch.tanh(logits / cfg.softcap)

    # ------------------------------------------------------------------------------------------
    def param_counts(self) -> dict[str, int]:
        """Parameter counts by role, from the config (valid on meta and for any Linear class)."""
        cfg = self.config
        C, H, Hkv, D, V, L = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.padded_vocab_size, cfg.n_layer
        n_ve = sum(has_value_embed(i, L) for i in range(L))
        gate_in = min(VE_GATE_CHANNELS, C)
        per_layer = C * H * D * 2 + C * Hkv * D * 2 + 8 * C * C  # q, proj, k, v, mlp fc + proj
        return {
            "wte": V * C,
            "value_embeds": n_ve * V * Hkv * D,
            "transformer_matrices": L * per_layer + n_ve * gate_in * Hkv,
            "lm_head": V * C,
            "scalars": 2 * L,
        }

    def num_scaling_params(self) -> int:
        """Transformer matrices + lm_head: the count the tokens:params ratio uses (embedding
        tables, value embeddings and the per-layer scalars are lookups, not compute)."""
        counts = self.param_counts()
        return counts["transformer_matrices"] + counts["lm_head"]

    def estimate_flops(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward) at `seq_len` (default config.sequence_len):

            6 * (transformer_matrices + lm_head)                      # matmuls, padded vocab
          + sum over layers of 12 * n_head * head_dim * min(window_l, T)

        The attention term counts QK^T and AV (2 * 2 * head_dim * keys per head, x3 for fwd+bwd)
        with every query charged min(window, T) keys, i.e. causal masking is NOT halved (the
        nanochat / modded-nanogpt convention, so MFU numbers stay comparable). Computed from the
        config, so precision.py's Linear swaps do not change it.
        """
        cfg = self.config
        T = self._seq_len(seq_len, "estimate_flops")
        attn = sum(12 * cfg.n_head * cfg.head_dim * (T if w is None else min(w, T)) for w in self.windows)
        return float(6 * self.num_scaling_params() + attn)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Optimizer roles; every parameter appears exactly once."""
        matrix = [p for block in self.blocks for p in block.parameters()]
        return {
            "matrix": matrix,
            "embedding": [self.wte.weight],
            "value_embeds": [emb.weight for emb in self.value_embeds.values()],
            "lm_head": [self.lm_head.weight],
            "scalars": [self.resid_lambdas, self.x0_lambdas],
        }
