"""Causal self-attention backends and backend selection (the KV caches live in nanochat/kv_cache.py).

Owns: `attention()` (the one call the model makes), `resolve_backend()` and the plain
math `reference_attention()` that every backend is tested against.

Semantics (every backend honours all of them, or raises):
  * causal always; `window=W` means a query at position i sees keys j with 0 <= i - j < W
    (W keys including itself); `window=None` (or W >= number of keys) is full causal attention;
  * GQA: q has Hq heads, k/v have Hkv heads, Hq % Hkv == 0, query head h reads kv head
    h // (Hq // Hkv) (the `repeat_interleave` convention of SDPA's and flex's `enable_gqa`);
  * softmax scale 1/sqrt(head_dim); layout (B, H, T, D) in and out.

Backends (the names `resolve_backend` returns):
  * "sdpa_flex" (auto on CUDA while cuDNN's window kernel is not proven, where Triton builds
    kernels; else auto is "sdpa"): full layers through F.scaled_dot_product_attention(is_causal=
    True) (flash / cuDNN kernels), window layers through flex_attention with a cached block-sparse
    BlockMask. No dense mask is ever built. On H100, torch 2.11, d20 shapes (B=32, 10 heads,
    T=2048, D=128, bf16, fwd+bwd, median): SDPA full causal 2.92 ms (cuDNN picked; flash-only
    5.04 ms), flex window 512 2.31 ms, flex full 3.66 ms.
  * "sdpa_cudnn" (`cudnn`; auto on CUDA once prepare_masks' probe launch passed): full layers as
    in sdpa_flex, window layers through cuDNN's fused kernel with a diagonal band
    (nanochat/cudnn_attention.py; needs nvidia-cudnn-frontend). H100, same shapes: 1.80 ms.
    That kernel takes bf16/fp16 only: fp32 window layers run flex_attention, as in sdpa_flex.
  * "cudnn_fa4" (auto on an H100-class GPU, cc 9.0, once fa4_attention's probe launch passed;
    needs flash-attn-4): every layer, full and window, through cuDNN's forward (the kernel
    above; full layers without a band) and FlashAttention-4's backward on that forward's output
    and statistics (nanochat/fa4_attention.py). H100, same shapes: full layer 2.99 -> 2.50 ms,
    window layer 2.30 -> 1.83 ms. fp32 inputs (which neither kernel takes) run as "sdpa_cudnn".
  * "sdpa" (auto on CPU/MPS): SDPA for everything; window layers pass a cached dense boolean mask.
    That is the CPU training path (flex_attention has no CPU backward) and the upstream-nanochat
    baseline on GPU (slow there: 8.55 ms vs 3.02 ms per d20 layer, DESIGN.md section 3).
  * "flex": flex_attention for every layer (causal layers too), for benchmarking. CUDA: fwd+bwd;
    CPU: forward only (torch raises on a CPU backward).
  * "reference": explicit math in the input dtype (float64 capable); slow, for tests.

Compile: on CUDA flex_attention always runs as its Triton-compiled kernel, in an eager model
(--no-compile) too: eager flex on CUDA materialises every (T, T) score of every head (d20, batch
32 x 2048: 5 GiB or more per layer), so `_flex` compiles the flex op alone, once, and says so in one line
(`flex_compile_note`: the banner's word). Where Triton cannot build kernels (platform.ptxas_problem,
the case the --no-compile advice is for) `auto` picks "sdpa" (window layers: SDPA with a dense
mask) and an explicit `flex` is refused; `--attn-backend sdpa` keeps every kernel eager anywhere.

Flex kernel options (`set_flex_kernel_options`): explicit Triton tile/warp/stage choices for the
flex kernels and the block-mask BLOCK_SIZE, passed as `kernel_options=` to every flex call. Unset
(None), a tuned entry of FLEX_TUNED_OPTIONS for the device's compute capability applies (at head
dim FLEX_TUNED_HEAD_DIM, bf16/fp16), else torch's own heuristics; `{}` forces torch's heuristics.
Sweep candidates with scripts/bench_attention.py.

KV-cache path (inference): `attention(..., kv_cache=c, layer_idx=i)` writes this call's k/v at
positions [c.pos, c.pos + T) of layer i and attends over the cache; the caller (GPT.forward)
advances `c.pos` once after the last layer. Decode uses SDPA with a small explicit mask (or the
reference math); windows are respected by slicing the cache to the visible span.

Static decode path (`kv_cache=StaticKV(cache, pos_tensor, key_pos)`, used by nanochat/decode.py
for CUDA-graph decoding): the position is a device tensor, the k/v write is an index_copy_ and
attention reads a fixed-length bucket of the cache with a causal + window mask computed from the
position, so no shape depends on the position: on CUDA the project's split-key Triton kernel
(`nanochat::decode_attention`, triton_kernels.decode_attention_triton, merged by the last
program of each row: `triton_fused`), elsewhere SDPA with that
mask, whatever the backend name. `set_decode_kernel("sdpa")` puts SDPA back on CUDA too (an
escape hatch on a GPU where the kernel has not been measured, e.g. a DGX Spark).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch
import torch.nn.functional as F

from nanochat import cudnn_attention  # defines two custom ops; imports nothing from cuDNN
from nanochat import fa4_attention  # imports nothing from flash-attn-4
from nanochat.attention_flex_options import (DEFAULT_FLEX_BLOCK_SIZE, FLEX_OPTION_KEYS,  # noqa: F401 (re-exported)
                                             validate_flex_kernel_options)
from nanochat.errors import RequestError
from nanochat.fa4_attention import FA4_AUTO_CAPABILITIES  # where auto may pick cudnn_fa4
from nanochat.kv_cache import KVCache, StaticKV, check_layer  # read here; also re-exported (callers import them from here)

BACKEND_CHOICES = ("auto", "sdpa", "flex", "cudnn", "cudnn_fa4", "reference")
RESOLVED_BACKENDS = ("sdpa_flex", "sdpa_cudnn", "cudnn_fa4", "sdpa", "flex", "reference")
CUDNN_DTYPES = (torch.bfloat16, torch.float16)   # all cuDNN's window kernel (and FA4's backward) take

# Caches keyed by (T, window, device). Filled in eager mode only: under torch.compile a cache miss
# builds the mask inside the graph (correct, a few tiny kernels per step) and a hit is lifted as a
# graph input; adding keys later does not trigger a recompile (checked on torch 2.15).
_BLOCK_MASKS: dict = {}
_DENSE_MASKS: dict = {}
_PREPARED_DENSE: set = set()   # keys prepare_masks built: a compiled graph may hold them, never evicted
_COMPILED_FLEX = None  # torch.compile(flex_attention), created on first eager CUDA use
_FLEX_PROBLEM: dict = {}  # CUDA device index -> None, or why Triton cannot build flex's kernel there


def resolve_backend(name: str, device) -> str:
    """Map a requested backend ("auto"|"sdpa"|"flex"|"cudnn"|"cudnn_fa4"|"reference") to a resolved name."""
    if name in ("sdpa_flex", "sdpa_cudnn"):   # already resolved (cudnn_fa4 is both a choice and a resolved name)
        device_type = torch.device(device).type
        if device_type not in ("cuda", "meta"):   # a CUDA resolution on a CPU ran flex and blamed --attn-backend flex
            raise RequestError(f"--attn-backend: {name} (resolved for a CUDA device) needs a CUDA device, got "
                               f"{device_type}; accepted here: {_accepted_off_cuda(device_type)}")
        return name
    if name not in BACKEND_CHOICES:
        raise RequestError(f"--attn-backend: got {name!r}; accepted: {'|'.join(BACKEND_CHOICES)}")
    device_type = torch.device(device).type
    if name == "auto":
        # CUDA: the window layers need a block-sparse kernel: cuDNN's band-masked one where
        # prepare_masks() proved it (1.29x flex's at d20 on H100), else flex_attention. flex has
        # no CPU backward, so elsewhere SDPA (+ dense mask for windows) is the fastest.
        if device_type != "cuda":
            return "sdpa"
        if fa4_attention.proven(device):  # probed by prepare_masks on FA4_AUTO_CAPABILITIES only
            return "cudnn_fa4"
        if cudnn_attention.proven(device):
            return "sdpa_cudnn"
        # flex's kernel is Triton's: where Triton cannot build kernels (compile then auto-off) the
        # window layers take SDPA's dense mask; sdpa_flex died at its first window layer there
        return "sdpa_flex" if flex_problem(device) is None else "sdpa"
    if name in ("cudnn", "cudnn_fa4"):
        if device_type != "cuda":
            raise RequestError(f"--attn-backend: {name} needs a CUDA device, got {device_type}; "
                               f"accepted here: {_accepted_off_cuda(device_type)}")
        if not torch.compiler.is_compiling():  # eager check
            cudnn_reason = cudnn_attention.available()
            reason = cudnn_reason or (fa4_attention.available() if name == "cudnn_fa4" else None)
            if reason is not None:
                raise RequestError(f"--attn-backend {name}: {reason}; accepted here: "
                                   f"{_accepted_on_cuda(cudnn_ok=cudnn_reason is None)}")
        return "sdpa_cudnn" if name == "cudnn" else name
    if name == "flex" and device_type not in ("cuda", "cpu"):
        raise RequestError(f"--attn-backend: flex needs a cuda or cpu device, got {device_type}; "
                           f"accepted here: {_accepted_off_cuda(device_type)}")
    if name == "flex" and (reason := flex_problem(device)) is not None:
        raise RequestError(f"--attn-backend flex: its CUDA kernel is built by Triton, which cannot run here "
                           f"({reason}); accepted here: auto|sdpa|reference (sdpa: no Triton)")
    return name


def flex_problem(device) -> str | None:
    """Why flex_attention's kernel (Triton-compiled on CUDA, under --no-compile too: module
    docstring) cannot run on `device`, else None: platform.ptxas_problem, asked once per CUDA
    device. None off CUDA (eager flex), inside a compiled graph (its kernels are Triton's, so
    Triton works) and without that CUDA device to ask (tests resolving for "cuda:7")."""
    device = torch.device(device)
    if device.type != "cuda" or torch.compiler.is_compiling() or not torch.cuda.is_available():
        return None
    index = cudnn_attention._index(device)
    if index not in _FLEX_PROBLEM and index < torch.cuda.device_count():
        from nanochat.platform import detect_device, ptxas_problem

        _FLEX_PROBLEM[index] = ptxas_problem(detect_device(torch.device("cuda", index)))
    return _FLEX_PROBLEM.get(index)


def flex_compile_note(resolved: str, dtype: torch.dtype, *, compiled: bool, device=None) -> str:
    """The banner's note after the attention backend of a model that runs eager while its window
    layers run flex_attention (compiled on its own: module docstring), else ""."""
    if compiled or effective_backend(resolved, dtype, device) not in ("sdpa_flex", "flex"):
        return ""
    return (" (flex_attention compiled on its own for the window layers, also under --no-compile: eager "
            "flex holds every T x T score; --attn-backend sdpa runs them eager)")


def _accepted_on_cuda(cudnn_ok: bool) -> str:
    """The --attn-backend choices left on a GPU that refused cudnn or cudnn_fa4 (cudnn stays when
    only FA4's backward failed). The refusals named the fix but no choice that runs meanwhile."""
    return "auto|sdpa|flex|cudnn|reference" if cudnn_ok else "auto|sdpa|flex|reference"


def _accepted_off_cuda(device_type: str, training: bool = False) -> str:
    """The --attn-backend choices a non-CUDA device takes: flex runs on CPU only, forward only.
    (The cudnn error listed flex on any device, so MPS and CPU-training users met a second refusal.)"""
    return "auto|sdpa|flex|reference" if device_type == "cpu" and not training else "auto|sdpa|reference"


def check_training_backend(name: str, device, dtype: torch.dtype | None = None) -> str:
    """resolve_backend for a training run: flex has no backward on CPU (attention() raises at the
    first step), so a CPU run that asks for it is refused with the flags. So is an explicit cudnn
    or cudnn_fa4 in an fp32 run: neither kernel takes fp32, and attention() would run flex instead
    (an explicit request is met or refused; only auto falls back)."""
    if torch.device(device).type == "cpu" and name in ("flex", "cudnn", "cudnn_fa4"):
        why = "has no backward on CPU" if name == "flex" else "needs a CUDA device"
        raise RequestError(f"--attn-backend {name} {why}; accepted for CPU training: "
                           f"{_accepted_off_cuda('cpu', training=True)}")
    if name in ("cudnn", "cudnn_fa4") and dtype is not None and dtype not in CUDNN_DTYPES:
        raise RequestError(f"--attn-backend {name}: cuDNN's attention takes bf16/fp16, this run computes in "
                           f"{str(dtype).removeprefix('torch.')} (--precision); accepted with it: auto|sdpa|flex|reference")
    return resolve_backend(name, device)


def effective_backend(resolved: str, dtype: torch.dtype, device=None) -> str:
    """The backend attention() runs for `dtype` inputs: the cuDNN backends' kernels take bf16/fp16
    only, so an fp32 run of either is sdpa_flex's (SDPA full layers, flex window layers), or sdpa's
    on a `device` where flex cannot run (flex_problem). What the banner and checkpoint name, so an
    fp32 run is not labelled as a cuDNN one."""
    if resolved in ("sdpa_cudnn", "cudnn_fa4") and dtype not in CUDNN_DTYPES:
        return "sdpa_flex" if device is None or flex_problem(device) is None else "sdpa"
    return resolved


# ----------------------------------------------------------------------------------------------
# Flex kernel options (which keys and values are accepted: nanochat/attention_flex_options.py)

FLEX_KERNEL_OPTIONS: dict | None = None  # set only through set_flex_kernel_options
# Tuned options per compute capability (major, minor), measured with scripts/bench_attention.py
# at d20 shapes; used when FLEX_KERNEL_OPTIONS is None, for head dim FLEX_TUNED_HEAD_DIM and
# bf16/fp16 only. Empty: torch's heuristics everywhere (no measured win yet).
FLEX_TUNED_HEAD_DIM = 128
FLEX_TUNED_OPTIONS: dict[tuple[int, int], dict] = {}


def set_flex_kernel_options(opts: dict | None) -> None:
    """Set the flex kernel options every flex call uses (validated; a copy is kept). None resets
    to automatic (a FLEX_TUNED_OPTIONS entry for the device, else torch's heuristics); {} forces
    torch's heuristics. A compiled graph recompiles on the next call (dynamo guards the dict)."""
    global FLEX_KERNEL_OPTIONS
    FLEX_KERNEL_OPTIONS = None if opts is None else validate_flex_kernel_options(opts)


def flex_options_for(device, head_dim: int | None = None, dtype: torch.dtype | None = None) -> dict | None:
    """The options flex calls on `device` use (BLOCK_SIZE included); None = torch's heuristics.
    head_dim/dtype None (prepare_masks, which does not know them) assume a tuned-entry match."""
    if FLEX_KERNEL_OPTIONS is not None:
        return FLEX_KERNEL_OPTIONS or None
    device = torch.device(device)
    if not FLEX_TUNED_OPTIONS or device.type != "cuda":
        return None
    if head_dim not in (None, FLEX_TUNED_HEAD_DIM) or dtype not in (None, torch.bfloat16, torch.float16):
        return None
    return FLEX_TUNED_OPTIONS.get(tuple(torch.cuda.get_device_capability(device)))


def _split_flex_options(opts: dict | None) -> tuple[int | None, dict | None]:
    """(block-mask BLOCK_SIZE or None, kernel_options for flex_attention or None)."""
    if not opts:
        return None, None
    kernel = {k: v for k, v in opts.items() if k != "BLOCK_SIZE"}
    return opts.get("BLOCK_SIZE"), kernel or None


# ----------------------------------------------------------------------------------------------
# Masks


def _outside_inference_mode():
    """Where the cached masks are built: outside inference mode, so a mask that an eval under
    torch.inference_mode() built first is a normal tensor. A training forward at that length
    reuses it, and flex's autograd saves a BlockMask's tensors for backward, which refuses
    inference tensors ("Inference tensors cannot be saved for backward"). In-graph builds
    (compiling) are never cached and stay as the graph runs them."""
    return contextlib.nullcontext() if torch.compiler.is_compiling() else torch.inference_mode(False)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean (Tq, Tk): causal, and within the window when one is given."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = diff >= 0
    if window is not None:
        ok = ok & (diff < window)
    return ok


def _dense_mask(T: int, window: int, device: torch.device, prepared: bool = False) -> torch.Tensor:
    """Cached dense (T, T) boolean window mask for the SDPA backend (never used by sdpa_flex).
    Evals pad batches to many lengths (T^2 bytes each), so at most 8 other lengths are kept, the
    oldest evicted first; masks prepare_masks built (`prepared`) stay, since a compiled graph
    that found one cached would recompile once it is gone."""
    key = (T, window, str(device))
    if prepared:
        _PREPARED_DENSE.add(key)
    mask = _DENSE_MASKS.get(key)
    if mask is None:
        with _outside_inference_mode():
            pos = torch.arange(T, device=device)
            mask = _visible(pos, pos, window)
        if not torch.compiler.is_compiling():
            others = [k for k in _DENSE_MASKS if k not in _PREPARED_DENSE]
            if key not in _PREPARED_DENSE and len(others) >= 8:
                _DENSE_MASKS.pop(others[0])
            _DENSE_MASKS[key] = mask
    return mask


def _block_mask(T: int, window: int | None, device: torch.device, block_size: int | None = None):
    """Cached flex BlockMask for causal (+ window) attention over T tokens (block_size None:
    create_block_mask's default of 128)."""
    key = (T, window, str(device)) if block_size is None else (T, window, str(device), block_size)
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
        extra = {} if block_size is None else {"BLOCK_SIZE": block_size}
        with _outside_inference_mode():
            mask = create_block_mask(mask_mod, None, None, T, T, device=device, **extra)
        if not torch.compiler.is_compiling():
            _BLOCK_MASKS[key] = mask
    return mask


def prepare_masks(seq_len: int, windows, device, backend: str, *, backward: bool = True) -> str:
    """Build the masks a forward at `seq_len` will use, in eager mode, so a compiled graph finds
    them cached (call before the first compiled step; optional, a miss is built in-graph). On
    CUDA with backend "auto" this also probes cuDNN's window kernel and, if `backward` (the model
    will be trained), cuDNN forward + FA4 backward (see resolve_backend; inference skips that
    probe's ~20 s of FA4 import and JIT). Returns the resolved backend."""
    device = torch.device(device)
    if backend == "auto" and device.type == "cuda":
        cudnn_attention.probe(device)  # one tiny real launch, so that "auto" may pick cuDNN
        if (backward and torch.cuda.get_device_capability(device) in FA4_AUTO_CAPABILITIES
                and fa4_attention.available() is None):
            fa4_attention.probe(device)  # and cuDNN forward + FA4 backward
    elif backend in ("cudnn", "cudnn_fa4") and device.type == "cuda":
        # an explicit choice is proven by a real launch too (an import check alone proves nothing,
        # DESIGN.md 4.6): cuDNN's window kernels for both, FA4's backward for cudnn_fa4
        cudnn_reason = cudnn_attention.probe(device)
        reason = cudnn_reason or (fa4_attention.probe(device) if backend == "cudnn_fa4" else None)
        if reason is not None:
            raise RequestError(f"--attn-backend {backend}: {reason}; accepted here: "
                               f"{_accepted_on_cuda(cudnn_ok=cudnn_reason is None)}")
    backend = resolve_backend(backend, device)
    # the cuDNN backends' window layers run flex only in an fp32 run (attention()): its masks too (tiny)
    cudnn = backend in ("sdpa_cudnn", "cudnn_fa4")
    flexible = ("flex", "sdpa_flex", "sdpa_cudnn", "cudnn_fa4")
    block_size = (_split_flex_options(flex_options_for(device, dtype=torch.float32 if cudnn else None))[0]
                  if backend in flexible else None)
    for window in set(windows):
        if window is not None and window >= seq_len:
            window = None
        if backend == "flex" or (backend in flexible and window is not None):
            _block_mask(seq_len, window, device, block_size)
        elif backend == "sdpa" and window is not None:
            _dense_mask(seq_len, window, device, prepared=True)
    return backend


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
    gqa = {"enable_gqa": True} if q.size(1) != k.size(1) else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **gqa)


def _flex(q, k, v, window: int | None):
    from torch.nn.attention.flex_attention import flex_attention

    block_size, options = _split_flex_options(flex_options_for(q.device, q.size(-1), q.dtype))
    block_mask = _block_mask(q.size(2), window, q.device, block_size)
    gqa = q.size(1) != k.size(1)
    if torch.compiler.is_compiling():
        # Inside a compiled model inductor generates the fused kernel itself.
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)
    if q.device.type == "cuda":
        return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError("attention backend 'flex' has no backward on CPU; use --attn-backend "
                           "auto|sdpa|reference for CPU training")
    with warnings.catch_warnings():
        # CPU eager flex is an unfused (dense) implementation; fine for CPU inference and tests.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, kernel_options=options)


def _compiled_flex():
    """torch.compile(flex_attention), made once on first eager CUDA use (never at import), with one
    line saying so: eager flex on CUDA materialises the full score matrix, the compiled op is the
    block-sparse kernel, so an eager model (--no-compile) compiles this op alone (module docstring)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        from nanochat.common import print0
        print0("attention: compiling flex_attention alone for the window layers (eager flex would hold every "
               "T x T score; the rest of the model runs as --compile / --no-compile say; --attn-backend sdpa "
               "runs them without Triton)")
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def _prefill_sdpa(q, k, v, *, is_causal: bool, attn_mask=None):
    """_sdpa without cuDNN's kernel: SDPA picks cuDNN on an H100 (torch 2.11) and builds a cuDNN
    graph per new shape, so the first request at each new prompt length waited 0.1-1.2 s for its
    first token (d20; 51-62 ms without cuDNN, CHANGELOG_GB10.md), and a chat server rarely sees a
    length twice. Flash and the efficient kernel take any length. Training shapes are fixed, so
    training keeps cuDNN."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return _sdpa(q, k, v, is_causal=is_causal, attn_mask=attn_mask)


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
        return _prefill_sdpa(q, k_all, v_all, is_causal=True)  # plain prefill: the fast causal kernel
    # Decode / chunked prefill: explicit (T, pos+T-start) mask; small for decode (T == 1).
    q_pos = torch.arange(pos, pos + T, device=q.device)
    k_pos = torch.arange(start, pos + T, device=q.device)
    return _prefill_sdpa(q, k_all, v_all, is_causal=False, attn_mask=_visible(q_pos, k_pos, window))


# Which kernel the static (CUDA-graph) decode step uses: "triton_fused" (default on CUDA: the
# split-key kernel whose last program per row merges, one launch), "triton" (the same with a
# separate merge launch) or "sdpa" (the mask formulation, also what CPU and non-power-of-two head
# dims use). Set only through set_decode_kernel (bench_inference --decode-kernel compares them).
# H100, d20, prompt 512, graph replay (2026-11-23): batch 1 0.976 / 0.993 / 1.006 ms and batch 8
# 1.163 / 1.170 / 1.150 ms for triton_fused / triton / sdpa; at prompt 1800 triton beat SDPA by
# 2-29% (batch 1-32), CHANGELOG_GB10.md.
DECODE_KERNELS = ("triton", "triton_fused", "sdpa")
DEFAULT_DECODE_KERNEL = "triton_fused"
DECODE_KERNEL = DEFAULT_DECODE_KERNEL


def set_decode_kernel(name: str) -> None:
    """Pick the static decode step's attention kernel (DECODE_KERNELS); takes effect for steps
    compiled or captured afterwards (compiled code guards on it and recompiles)."""
    global DECODE_KERNEL
    if name not in DECODE_KERNELS:
        raise ValueError(f"decode kernel: got {name!r}; accepted: {'|'.join(DECODE_KERNELS)}")
    DECODE_KERNEL = name


@torch.library.custom_op("nanochat::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor,
                     window: int, fused: bool = False) -> torch.Tensor:
    """One query token per (row, head) over a cache bucket k/v (B, Hkv, L, D), keys 0..pos
    visible (the last `window` of them when window > 0). CUDA (or TRITON_INTERPRET=1): the
    split-key Triton kernel; q's dtype out, fp32 softmax."""
    from nanochat.triton_kernels import decode_attention_triton
    return decode_attention_triton(q, k, v, pos, window if window > 0 else None, fused=fused)


@decode_attention.register_fake
def _decode_attention_fake(q, k, v, pos, window, fused=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _triton_decode_ok(q: torch.Tensor) -> bool:
    D = q.size(-1)
    return DECODE_KERNEL != "sdpa" and q.is_cuda and D >= 16 and D & (D - 1) == 0


def _static_decode_attention(q, k, v, window, kv: StaticKV, layer_idx: int):
    """One-token decode over a length bucket of the cache (StaticKV), shapes independent of the
    position. CUDA: `decode_attention`, the split-key Triton kernel (two launches, chunks outside
    the window read nothing). Elsewhere: SDPA with a (1, 1, 1, L) boolean mask from the position
    (scores in fp32), which on CUDA ran cuDNN's kernel plus a mask and a reduction kernel (~10 us
    per layer at batch 1, ~20% of the step) and read the whole bucket in the window layers.
    bench_inference d20, CUDA-graph step, one H100, SDPA -> Triton (2026-11-23): prompt 1800
    (bucket 2048): batch 1 1.23 -> 1.20 ms, batch 8 1.67 -> 1.58, batch 32 3.62 -> 2.81 ms
    (+29% tok/s); prompt 512 (bucket 768), graph replay, two runs: batch 1 -2%, batch 32 -6.5%,
    batch 8 +3% (slower: 960 programs of 2 warps against cuDNN at short context)."""
    B, Hq, T, D = q.shape
    if T != 1:
        raise ValueError(f"attention: a StaticKV step feeds one token per row, got {T}")
    check_layer(kv.k, layer_idx)
    k_cache, v_cache = kv.k[layer_idx], kv.v[layer_idx]
    if k.size(0) != k_cache.size(0):
        raise ValueError(f"attention: batch {k.size(0)} != cache batch {k_cache.size(0)}")
    if (k.size(1), D) != (k_cache.size(1), k_cache.size(3)):   # else torch's index_copy_ slice-shape error
        raise ValueError(f"attention: {k.size(1)} kv heads x head dim {D} given, the cache holds "
                         f"{k_cache.size(1)} x {k_cache.size(3)}; create it with the model's n_kv_head and head_dim")
    if kv.pos.numel() == 1:
        k_cache.index_copy_(2, kv.pos, k.to(k_cache.dtype))
        v_cache.index_copy_(2, kv.pos, v.to(v_cache.dtype))
    else:  # each row's own position. An index_put, not scatter_: under torch.compile scatter_ (and
        # index_copy_ on a flattened view) copied every cache layer whole, 2.45 ms per d20 batch-8 step
        # on an H100 against 0.004 ms for this (a throwaway benchmark of the 40 inserts, CUDA graph)
        rows = torch.arange(B, device=k.device)
        k_cache[rows, :, kv.pos] = k[:, :, 0].to(k_cache.dtype)
        v_cache[rows, :, kv.pos] = v[:, :, 0].to(v_cache.dtype)
    L = kv.key_pos.numel()
    keys, values = k_cache[:, :, :L], v_cache[:, :, :L]
    if _triton_decode_ok(q):
        return torch.ops.nanochat.decode_attention(q, keys, values, kv.pos, window or 0,
                                                   DECODE_KERNEL == "triton_fused")
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    pos = kv.pos.view(-1, 1)
    visible = kv.key_pos <= pos  # causal; slots past the position are stale
    if window is not None:
        visible = visible & (kv.key_pos > pos - window)
    return _sdpa(q, keys, values, is_causal=False, attn_mask=visible.view(-1, 1, 1, L))


def attention(q, k, v, *, window: int | None, backend: str, kv_cache: KVCache | StaticKV | None = None,
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
        if isinstance(kv_cache, StaticKV):
            return _static_decode_attention(q, k, v, window, kv_cache, layer_idx)
        return _cached_attention(q, k, v, window, backend, kv_cache, layer_idx)
    T = q.size(2)
    if window is not None and window >= T:
        window = None  # the window covers every key: plain causal (full-attention kernels)
    if backend == "reference":
        return reference_attention(q, k, v, window=window)
    if backend == "flex" or (backend == "sdpa_flex" and window is not None):
        return _flex(q, k, v, window)
    cudnn_dtype = q.dtype in CUDNN_DTYPES
    if backend == "cudnn_fa4" and cudnn_dtype:
        return cudnn_attention.window_attention(q, k, v, window or 0, bwd="fa4")
    if backend in ("sdpa_cudnn", "cudnn_fa4") and window is not None:
        if cudnn_dtype:
            return cudnn_attention.window_attention(q, k, v, window)
        # an fp32 run (--precision fp32 on a GPU where auto proved cuDNN): sdpa_flex's window path,
        # block-sparse, where the cuDNN kernel raised "dtype torch.float32 is not supported"; sdpa's
        # dense mask (below) where Triton cannot build flex's kernel (effective_backend names it)
        if flex_problem(q.device) is None:
            return _flex(q, k, v, window)
    if window is None:
        return _sdpa(q, k, v, is_causal=True)
    return _sdpa(q, k, v, is_causal=False, attn_mask=_dense_mask(T, window, q.device))
