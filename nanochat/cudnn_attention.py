"""Causal sliding-window attention through cuDNN's fused SDPA kernels (cudnn-frontend Python API).

Owns: `available()`, `probe(device)`, `window_attention(q, k, v, window, bwd=)` and the two custom ops
behind it (`nanochat::cudnn_window_fwd` / `nanochat::cudnn_window_bwd`, autograd-registered, with
fake implementations, so torch.compile keeps them in one graph as opaque kernels), the per-shape
cuDNN graph cache and the per-device cuDNN handles, and the probes' inputs and tolerance
(`probe_inputs`, `probe_error`; fa4_attention's probe uses them too).

Why: PyTorch's SDPA reaches cuDNN only for full causal attention (`is_causal=True`); a window
becomes a dense mask there. cuDNN itself supports a diagonal band (`diagonal_band_left_bound`)
and skips the tiles outside it, so a window-512 layer at T=2048 does about half the work of a
causal one. Before this module the window layers ran flex_attention, whose kernels were no faster
than cuDNN's full causal kernel at d20 shapes (H100: flex window 512 fwd 0.75 + bwd 1.95 ms,
cuDNN causal 0.69 + 2.14 ms per layer). On sm_12x (GB10) cuDNN SDPA supports bf16 forward and
backward with sliding windows and GQA (DESIGN.md 4.6), where flex's Triton kernels are untuned.

Semantics (those of nanochat.attention): causal, and a query at i sees keys j with
0 <= i - j < window (cuDNN: top-left aligned band, right bound 0, left bound `window`); GQA with
Hq a multiple of Hkv; scale 1/sqrt(D); q/k/v (B, H, T, D) in fp16/bf16 with unit stride on D
(any other strides, e.g. the transposed (B, T, H, D) projections the model produces). The output
is allocated (B, T, H, D) in memory and returned as its (B, H, T, D) view, so the model's
`transpose(1, 2).reshape(B, T, C)` after attention is free.

Needs the `nvidia-cudnn-frontend` package (>= 1.13, pure pybind module; it loads the libcudnn
that torch ships). Nothing is imported or probed until a function here is called.

`window=0` is plain causal attention (no band), and `bwd="fa4"` runs the backward through
FlashAttention-4's kernels (nanochat/fa4_attention.py) on this forward's output and statistics:
together that is the `cudnn_fa4` backend, for full and window layers alike.
"""

from __future__ import annotations

import math
import threading

import torch

_GRAPHS: dict = {}   # key -> (graph, tensors by role, workspace bytes)
_HANDLES: dict = {}  # device index -> cuDNN handle
_PROBED: dict = {}   # device index -> None (works) or the reason it does not
_LOCK = threading.Lock()
# diagonal_band_left/right_bound, and sdpa's generate_stats (new in 1.13, replacing is_inference: its
# release notes): 1.12 passed this check, then every graph build raised TypeError (unknown keyword)
MIN_FRONTEND = (1, 13)
MAX_GRAPHS = 64
_INPUTS = {"fwd": ("q", "k", "v"), "bwd": ("q", "k", "v", "o", "do", "lse")}


def _cudnn():
    import cudnn  # nvidia-cudnn-frontend

    return cudnn


def available() -> str | None:
    """None if the cuDNN frontend imports and is new enough, else why not (with the fix)."""
    try:
        cudnn = _cudnn()
    except ImportError as exc:
        return (f"nvidia-cudnn-frontend is not installed ({exc}); "
                f"pip install 'nvidia-cudnn-frontend>={'.'.join(map(str, MIN_FRONTEND))}'")
    said = str(getattr(cudnn, "__version__", "(no __version__)"))
    version = tuple(int(p) for p in said.split(".")[:2] if p.isdigit())
    if version < MIN_FRONTEND:
        return f"nvidia-cudnn-frontend {said} is too old; need >= {'.'.join(map(str, MIN_FRONTEND))}"
    return None


def _handle(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = _HANDLES.get(index)
    if handle is None:
        with torch.cuda.device(index):
            handle = _HANDLES[index] = _cudnn().create_handle()
    return handle


def _io_type(dtype: torch.dtype):
    cudnn = _cudnn()
    if dtype == torch.bfloat16:
        return cudnn.data_type.BFLOAT16
    if dtype == torch.float16:
        return cudnn.data_type.HALF
    raise ValueError(f"attention backend 'cudnn': dtype {dtype} is not supported; accepted: bf16|fp16")


def _bhtd_out(q: torch.Tensor, heads: int | None = None) -> torch.Tensor:
    """An empty (B, H, T, D) tensor laid out (B, T, H, D) in memory (H defaults to q's)."""
    B, H, T, D = q.shape
    H = H if heads is None else heads
    return q.new_empty((B, T, H, D)).transpose(1, 2)


def _lse_like(q: torch.Tensor) -> torch.Tensor:
    B, H, T, _ = q.shape
    return q.new_empty((B, H, T, 1), dtype=torch.float32)


def _build(kind: str, window: int, tensors: dict):
    """Build (once per shapes + strides + window) the forward or backward cuDNN graph."""
    key = (kind, window, tensors["q"].device.index,
           tuple((name, t.dtype, tuple(t.shape), t.stride()) for name, t in tensors.items()))
    entry = _GRAPHS.get(key)
    if entry is not None:
        return entry
    cudnn = _cudnn()
    q = tensors["q"]
    io = _io_type(q.dtype)
    with _LOCK:
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                              compute_data_type=cudnn.data_type.FLOAT, handle=_handle(q.device))
        node = {name: graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()),
                                   data_type=io if t.dtype != torch.float32 else cudnn.data_type.FLOAT)
                for name, t in tensors.items() if name in _INPUTS[kind]}
        band = dict(attn_scale=1.0 / math.sqrt(q.size(-1)),
                    diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT, diagonal_band_right_bound=0)
        if window > 0:  # else plain causal
            band["diagonal_band_left_bound"] = window
        if kind == "fwd":
            o, lse = graph.sdpa(name="window_fwd", q=node["q"], k=node["k"], v=node["v"],
                                generate_stats=True, **band)
            outputs = {"o": o, "lse": lse}
        else:
            dq, dk, dv = graph.sdpa_backward(name="window_bwd", q=node["q"], k=node["k"], v=node["v"],
                                             o=node["o"], dO=node["do"], stats=node["lse"], **band)
            outputs = {"dq": dq, "dk": dk, "dv": dv}
        for name, t in outputs.items():
            ref = tensors[name]
            t.set_output(True).set_dim(list(ref.shape)).set_stride(list(ref.stride())).set_data_type(
                cudnn.data_type.FLOAT if ref.dtype == torch.float32 else io)
        node.update(outputs)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        if len(_GRAPHS) >= MAX_GRAPHS:  # shape churn (e.g. eval at many lengths): drop the oldest
            _GRAPHS.pop(next(iter(_GRAPHS)))
        entry = _GRAPHS[key] = (graph, node, graph.get_workspace_size())
    return entry


def _execute(kind: str, window: int, tensors: dict) -> None:
    graph, node, workspace_bytes = _build(kind, window, tensors)
    device = tensors["q"].device
    handle = _handle(device)
    _cudnn().set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    workspace = torch.empty(max(1, workspace_bytes), dtype=torch.uint8, device=device)
    graph.execute({node[name]: t for name, t in tensors.items()}, workspace, handle=handle)


def _dense_d(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("nanochat::cudnn_window_fwd", mutates_args=())
def _window_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                bwd: str) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _bhtd_out(q), _lse_like(q)
    _execute("fwd", window, {"q": q, "k": k, "v": v, "o": o, "lse": lse})
    return o, lse


@_window_fwd.register_fake
def _window_fwd_fake(q, k, v, window, bwd):
    return _bhtd_out(q), _lse_like(q)


@torch.library.custom_op("nanochat::cudnn_window_bwd", mutates_args=())
def _window_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, window: int, bwd: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _bhtd_out(q), _bhtd_out(k), _bhtd_out(v)
    if bwd == "fa4":
        from nanochat import fa4_attention

        fa4_attention.backward(_dense_d(do), q, k, v, o, lse, window, dq, dk, dv)
    else:
        _execute("bwd", window, {"q": q, "k": k, "v": v, "o": o, "do": _dense_d(do), "lse": lse,
                                 "dq": dq, "dk": dk, "dv": dv})
    return dq, dk, dv


@_window_bwd.register_fake
def _window_bwd_fake(do, q, k, v, o, lse, window, bwd):
    return _bhtd_out(q), _bhtd_out(k), _bhtd_out(v)


def _setup_context(ctx, inputs, output):
    q, k, v, window, bwd = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.window, ctx.bwd = window, bwd


def _backward(ctx, grad_o, grad_lse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _window_bwd(grad_o, q, k, v, o, lse, ctx.window, ctx.bwd)
    return dq, dk, dv, None, None


_window_fwd.register_autograd(_backward, setup_context=_setup_context)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *,
                     bwd: str = "cudnn") -> torch.Tensor:
    """Causal attention over the last `window` keys (itself included; 0: all earlier keys).
    q (B, Hq, T, D), k/v (B, Hkv, T, D), CUDA, fp16/bf16; returns (B, Hq, T, D) (memory laid out
    (B, T, Hq, D)). `bwd`: the backward's kernels, "cudnn" or "fa4" (FlashAttention-4)."""
    if bwd not in ("cudnn", "fa4"):
        raise ValueError(f"cudnn window attention bwd: got {bwd!r}; accepted: cudnn|fa4")
    if not q.dtype == k.dtype == v.dtype:   # the graph reads k and v as q's type: fp16 bits as bf16, no error
        raise ValueError(f"attention backend 'cudnn': q, k, v must share one dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; accepted: all bf16 or all fp16")
    if q.device.type != "cuda":
        raise ValueError(f"attention backend 'cudnn' needs a CUDA device, got {q.device.type}")
    if window < 0:
        raise ValueError(f"attention: window must be >= 1 (or 0 for full causal), got {window}")
    q, k, v = _dense_d(q), _dense_d(k), _dense_d(v)
    return _window_fwd(q, k, v, int(window), bwd)[0]


def _index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def proven(device) -> bool:
    """True once probe() passed on this device (a dict lookup: safe inside a compiled forward)."""
    device = torch.device(device)
    return device.type == "cuda" and _PROBED.get(_index(device), "not probed") is None


def probe(device: torch.device) -> str | None:
    """One tiny real forward + backward against plain math (cached per device): None if cuDNN's
    window kernels run and agree, else the reason (an import check alone proves nothing: a
    backend can import and then fail at its first launch, DESIGN.md 4.6)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    index = _index(device)
    if index in _PROBED:
        return _PROBED[index]
    reason = available()
    if reason is None:
        reason = _probe_launch(torch.device("cuda", index))
    _PROBED[index] = reason
    return reason


# The probes' launch (here and fa4_attention's): inputs, window and the error they accept.
# A one-key window error (cuDNN's band bound read as inclusive, FA's window_size_left = window
# instead of window - 1) must fail them. Measured on the CPU (tests/test_attention_review73.py: a
# float64 reference and a simulated bf16 kernel, P and dS rounded to bf16): with q, k, v ~ N(0, 1)
# (score std 1, what the probes used) a backward that used window 65 differed from window 64's
# gradients by only 0.032-0.25 of their largest value over 20 seeds, 0.032-0.044 in 6 of them, under
# the 5e-2 the probes accepted, so whether the probe caught it was the luck of the device's random
# stream. With q scaled by 2 (score std 2: the key just past the window edge often carries real
# weight) a correct kernel stays within 0.013 and any one-key error (forward or backward alone, one
# key more or less) is >= 0.19 over 40 seeds. The inputs are made on the CPU, so every device probes
# these very numbers; the reference is float64 (on CUDA, fp32 matmuls may run as TF32).
PROBE_SHAPE = (1, 256, 4, 64)   # (B, T, H, D) in memory
PROBE_WINDOW = 64
PROBE_Q_SCALE = 2.0
PROBE_TOLERANCE = 5e-2          # max |kernel - reference| / max |reference|, per tensor


def probe_inputs(device, *, bthd: bool = False, seed: int = 0) -> list[torch.Tensor]:
    """The probes' bf16 q, k, v as (B, H, T, D) leaves that require grad, made on the CPU from
    `seed` (the same numbers on every device); `bthd`: laid out (B, T, H, D) in memory, as the
    model's projections are, else contiguous (B, H, T, D)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(PROBE_SHAPE, generator=g) for _ in range(3))
    out = []
    for t in (q * PROBE_Q_SCALE, k, v):
        t = t.to(device=device, dtype=torch.bfloat16).transpose(1, 2)
        out.append((t if bthd else t.contiguous()).requires_grad_())
    return out


def probe_error(out: torch.Tensor, leaves, window: int) -> float:
    """The largest error of a kernel's output `out` and its inputs' gradients (of sum(out^2), on
    `leaves` = q, k, v) against float64 math at `window` (0: full causal), each relative to the
    reference tensor's largest value."""
    from nanochat.attention import reference_attention

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = reference_attention(*ref_leaves, window=window or None)
    ref.square().sum().backward()
    pairs = [(out, ref)] + [(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
    return max(((a.double() - b).abs().max() / b.abs().max()).item() for a, b in pairs)


def _probe_launch(device: torch.device) -> str | None:
    q, k, v = probe_inputs(device)
    try:
        out = window_attention(q, k, v, PROBE_WINDOW)
        out.float().square().sum().backward()
    except (RuntimeError, ValueError, TypeError, _cudnn().cudnnGraphNotSupportedError) as exc:
        # TypeError: a frontend whose pybind signatures differ (a keyword renamed or dropped, as
        # is_inference -> generate_stats was) raised out of prepare_masks instead of leaving auto flex
        return f"cuDNN window attention failed to run: {type(exc).__name__}: {exc}"
    err = probe_error(out.detach(), (q, k, v), PROBE_WINDOW)
    if not err < PROBE_TOLERANCE:
        return (f"cuDNN window attention disagrees with the reference (window {PROBE_WINDOW}: max error "
                f"{err:.3g}, accepted < {PROBE_TOLERANCE:g})")
    return None
