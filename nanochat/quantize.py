"""Weight-only int8 quantisation of a trained GPT for inference (`--quantize int8` in chat_web,
chat_cli, chat_eval, base_eval and bench_inference).

Decoding a few rows at a time is bound by the bytes of weights each step streams (a d20 step
reads ~0.9 GB of bf16 matrices; a DGX Spark streams ~273 GB/s), so storing the matrices as int8
with one float32 scale per output row halves that stream. Round-to-nearest per-row absmax
(scale = max|w_row| / 127) is the plain recipe of LLM.int8()'s weight side (arXiv 2208.07339)
and of gpt-fast's int8 mode; activations, the KV cache, embeddings and norms stay in the compute
dtype.

What is quantised: every block's q/k/v (stored as one fused (3C, C) matrix whose row slices are
c_q / c_k / c_v, so the decode step runs one product per layer without the extra copy
GPT.inference_weights makes for bf16), the attention output projection, both MLP matrices and
the lm_head. The value-embedding gates (C=32 wide) and the lookup tables are left as they are:
a lookup reads one row per token.

How a product runs (`int8_linear`): up to GEMV_MAX_ROWS input rows on CUDA, the Triton kernel of
nanochat/triton_int8.py (int8 tiles widened in registers, no dequantised copy); more rows (a
prompt's prefill) or the CPU: the weight dequantised into the input's dtype, then the BLAS GEMM.
The persistent batch-1 decode kernel (nanochat/triton_decode.py) reads the same int8 rows and
scales in its own GEMV phases. A quantised model is for inference only: it has no float weights
to train.

Saving and loading: `qweight` and `scale` are persistent buffers, so a quantised model's
state_dict holds every int8 matrix once (the fused q/k/v rows under `attn.qkv_quant`; the c_q /
c_k / c_v views of them are not saved twice) with float32 scales. It loads strictly into a model
of the same config that quantize_model has transformed (any weights: the load overwrites them);
a float model refuses it (its keys are `weight`, not `qweight` / `scale`).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

QUANTIZE_MODES = ("none", "int8")
INT8_MAX = 127
GEMV_MAX_ROWS = 64   # inputs with more rows (a prefill) are a GEMM: dequantise and use the BLAS


def check_quantize(mode: str, flag: str = "--quantize") -> str:
    """`mode` if it is one of QUANTIZE_MODES, else a RequestError (a ValueError) naming the flag."""
    from nanochat.flags import require

    require(mode in QUANTIZE_MODES, flag, mode, "|".join(QUANTIZE_MODES))
    return mode


def parse_quantize_list(text: str, flag: str = "--quantize") -> list[str]:
    """A benchmark's comma list of QUANTIZE_MODES (each once), none first (int8 quantises the
    model in place, so the float runs must come before it); a ValueError naming the flag otherwise."""
    modes = [v.strip() for v in text.split(",") if v.strip()]
    if not modes or set(modes) - set(QUANTIZE_MODES) or len(set(modes)) != len(modes):
        raise ValueError(f"{flag}: got {text!r}; accepted: comma-separated {'|'.join(QUANTIZE_MODES)}, each once")
    return sorted(modes, key=QUANTIZE_MODES.index)


@torch.no_grad()
def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 q, float32 scale) with weight ~= q * scale[:, None]: per-row absmax, round to
    nearest (half to even). An all-zero row gets scale 1 (its q is 0), and so does a row whose
    absmax / 127 underflows to 0 (|w| < ~1e-43): divided by a zero scale its values were +-inf
    (q +-127) and NaN, cast to int8 (undefined). A non-finite value is refused: a NaN row came
    out as finite integers at scale 1, an inf row as NaN."""
    if weight.dim() != 2 or not weight.is_floating_point() or weight.shape[1] == 0:
        raise ValueError(f"quantize_rows: expected a 2-D float weight with at least one column, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    w = weight.detach().float()
    absmax = w.abs().amax(dim=1)
    if w.device.type != "meta" and not bool(torch.isfinite(absmax).all()):
        bad = int((~torch.isfinite(absmax)).sum())
        raise ValueError(f"quantize_rows: {bad} of {w.shape[0]} rows hold NaN or inf; quantise finite weights")
    scale = absmax / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def _kernel_for(device: torch.device):
    """The Triton product for tensors on `device`, or None (CPU without the interpreter, no
    Triton): resolved once, when the model is quantised, not inside a compiled step."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return None
    try:
        from nanochat.triton_int8 import int8_gemv, register
    except ImportError:   # no Triton on this platform: the dequantising path serves every size
        return None
    register()
    return _interpreted_gemv if interpreted else int8_gemv


def _interpreted_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_gemv under TRITON_INTERPRET=1 for float32 / float16 inputs; bfloat16 ones take the
    dequantising path: the interpreter (numpy underneath) mishandles bf16 (an int8 -> bf16 cast
    came out as inf / NaN / denormals, a bf16 tl.dot off by 1e10), so a bf16 model quantised
    under it decoded garbage while the kernel is right on the GPU."""
    if x.dtype == torch.bfloat16:
        return int8_linear(x, q, scale)
    from nanochat.triton_int8 import int8_gemv

    return int8_gemv(x, q, scale)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, kernel=None) -> torch.Tensor:
    """x (..., K) @ (q * scale[:, None]).T in x's dtype: `kernel` (triton_int8.int8_gemv) for
    small inputs, else the int8 weight in x's dtype through the BLAS, its rows then scaled in
    float32 as the kernel scales them (a bf16 copy of the scales put a systematic error of up to
    0.4% on every output row of a prefill, which the decode kernel's rows did not have). float16
    inputs take that product in float32: the unscaled sums reach 127 * K * |x|, past float16's
    65504 (inf) where the scaled output is small; bf16 has float32's range."""
    rows = x.numel() // x.shape[-1]
    if kernel is not None and rows <= GEMV_MAX_ROWS:
        return kernel(x, q, scale)
    dtype = torch.float32 if x.dtype == torch.float16 else x.dtype
    return (F.linear(x.to(dtype), q.to(dtype)) * scale.float()).to(x.dtype)


class Int8Linear(nn.Module):
    """A bias-free Linear holding int8 weights `qweight` (out, in) and float32 row scales `scale`
    (out,) as buffers. Built by `from_weight` (quantising a float weight) or `view_rows` (a row
    slice of another Int8Linear, sharing its storage). The buffers are persistent (in
    state_dict) except a view's: its rows are saved and loaded as part of its source."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, kernel=None, *, persistent: bool = True):
        super().__init__()
        assert qweight.dtype == torch.int8 and qweight.dim() == 2 and scale.shape == qweight.shape[:1]
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight, persistent=persistent)
        self.register_buffer("scale", scale.float(), persistent=persistent)
        self.kernel = kernel
        # views of this module's rows, and (for a view) its (source, start, stop): plain attributes
        # (a list, a tuple), so neither is registered as a submodule nor saved twice
        self._views: list[Int8Linear] = []
        self._rows: tuple | None = None

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> "Int8Linear":
        q, scale = quantize_rows(weight)
        return cls(q, scale, _kernel_for(weight.device))

    def _apply(self, fn, recurse=True):
        """After .to() / .cuda() / .half() / to_empty(): scales stay float32, the product is
        re-chosen for the new device, and row views are re-sliced from their source (a move copies
        each tensor on its own: c_q/c_k/c_v would otherwise become copies that a later
        load_state_dict, which writes the fused rows, leaves stale)."""
        scale = self.scale
        super()._apply(fn, recurse)
        if self.scale.dtype != torch.float32:
            # fn cast the scales (model.to(bf16)): take the float32 values, not their round trip
            # through fn's dtype (bf16 rounded every row's scale by up to 0.4%)
            self.scale = scale.to(self.scale.device)
        self.kernel = _kernel_for(self.qweight.device)
        # whichever of source and view model._apply reaches last leaves them sharing storage
        for view in self._views:
            view._take_rows()
        if self._rows is not None:
            self._take_rows()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        """A load with assign=True replaces the source's tensors: re-slice the row views (c_q / c_k /
        c_v kept the old rows, which grad-enabled forwards and the loss read), and keep the scales
        float32 (assign kept a state_dict's bf16 scales, whose addresses the persistent decode step
        reads as float32)."""
        super()._load_from_state_dict(*args, **kwargs)
        if self.scale.dtype != torch.float32:
            self.scale = self.scale.float()
        self.kernel = _kernel_for(self.qweight.device)   # from meta: the kernel chosen there was none
        for view in self._views:
            view._take_rows()

    def _take_rows(self) -> None:
        source, start, stop = self._rows
        self.qweight, self.scale, self.kernel = source.qweight[start:stop], source.scale[start:stop], source.kernel

    def view_rows(self, start: int, stop: int) -> "Int8Linear":
        view = Int8Linear(self.qweight[start:stop], self.scale[start:stop], self.kernel, persistent=False)
        view._rows = (self, start, stop)
        self._views.append(view)
        return view

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.kernel)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


def quantize_model(model, mode: str):
    """Quantise `model` (a nanochat GPT, in place) for inference; returns it. mode "none" leaves
    it as it is. Refuses models whose Linear layers precision.py swapped (fp8/nvfp4 training
    modules) and models already quantised."""
    from nanochat.gpt import GPT, Linear

    check_quantize(mode)
    if mode == "none":
        return model
    if not isinstance(model, GPT):
        raise ValueError(f"--quantize {mode}: needs a nanochat GPT, got {type(model).__name__}")
    if getattr(model, "quantization", "none") != "none":
        raise ValueError(f"--quantize {mode}: the model is already quantised ({model.quantization})")
    linears = model.decode_matrices()
    swapped = sorted({type(m).__name__ for m in linears if type(m) is not Linear})
    if swapped:
        raise ValueError(f"--quantize {mode}: the model's matrices are {swapped} modules (precision.py's "
                         "fp8/nvfp4 training layers); quantise the model as loaded from its checkpoint instead")
    _check_finite(model, linears, mode)   # before any layer changes: a refusal leaves the model as it was
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            # the float q/k/v copy GPT.inference_weights made for an earlier (float) Engine: the
            # quantised layer never reads it, and it held as many bytes as c_q/c_k/c_v in float
            attn.qkv_weight = attn._qkv_buffer = None
            parts = (attn.c_q, attn.c_k, attn.c_v)
            fused = Int8Linear.from_weight(torch.cat([m.weight for m in parts]))
            attn.qkv_quant = fused   # one product per layer; c_q/c_k/c_v are views of its rows
            start = 0
            for name, m in zip(("c_q", "c_k", "c_v"), parts):
                setattr(attn, name, fused.view_rows(start, start + m.out_features))
                start += m.out_features
            attn.c_proj = Int8Linear.from_weight(attn.c_proj.weight)
            block.mlp.c_fc = Int8Linear.from_weight(block.mlp.c_fc.weight)
            block.mlp.c_proj = Int8Linear.from_weight(block.mlp.c_proj.weight)
        model.lm_head = Int8Linear.from_weight(model.lm_head.weight)
    model.quantization = mode
    return model


def _check_finite(model, linears, mode: str) -> None:
    """A ValueError naming the matrices holding NaN or inf (a diverged checkpoint): quantising
    them would hide the damage (a NaN row came out finite)."""
    ids = {id(m) for m in linears}
    bad = [name for name, m in model.named_modules() if id(m) in ids and m.weight.device.type != "meta"
           and not bool(torch.isfinite(m.weight).all())]
    if bad:
        raise ValueError(f"--quantize {mode}: non-finite weights in {', '.join(bad[:4])}"
                         f"{f' and {len(bad) - 4} more' if len(bad) > 4 else ''}; the checkpoint is damaged "
                         "(a diverged run): load an earlier step")


def matrix_bytes(model) -> int:
    """Bytes of matrices a decode step streams: float parameters other than the lookup tables
    (wte, value embeddings), plus the int8 weights and scales of quantised layers."""
    lookups = {id(model.wte.weight)} | {id(e.weight) for e in model.value_embeds.values()}
    total = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lookups)
    # c_q/c_k/c_v are views of the fused q/k/v rows: only layers that are no view count. Not keyed
    # by storage address: on the meta device every storage's is 0, so a quantised meta model (a
    # size estimate) counted one layer's bytes (2 KB of a 0.47 MB d2)
    return total + sum(t.numel() * t.element_size() for m in model.modules()
                       if isinstance(m, Int8Linear) and m._rows is None for t in (m.qweight, m.scale))
