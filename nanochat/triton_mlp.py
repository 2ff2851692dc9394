"""The ReLU^2 MLP with its two elementwise passes fused into GEMMs (`--kernel triton`, bf16 and fp8).

The MLP is y = relu(x W_fc^T)^2 W_proj^T. Through cuBLAS each 4C-wide elementwise pass is a
kernel of its own that reads and writes (B*T, 4C) tensors: relu^2 in forward and, in backward,
dL/dh = (dL/dy W_proj) * 2 relu(h) = (dL/dy W_proj) * 2 sqrt(h2), h2 = relu(h)^2 (saved). At
d20, batch 32 x 2048, they took 0.44 and 0.65 ms per layer on an H100 (profile_training), ~5%
of a step. Here both run in the epilogue of a Triton GEMM on the float32 accumulator, before
anything is stored. The kernel is persistent (one program per SM walks the output tiles in
grouped order) and reads A and B through TMA tensor descriptors. At d20's shape (65536 x 5120 x
1280) on an H100 it ran as fast as cuBLAS (1.16 vs 1.15 ms, 739 TFLOP/s) with relu^2 costing
nothing on top; `scripts/bench_gemm.py --mlp` (inputs rotated past L2): forward 1.34 ms vs 1.62
for cuBLAS + relu^2, backward 1.68 vs 1.87.

- `mm_epilogue(a, b, "relu2")`:           relu(a @ b)^2
- `mm_epilogue(a, b, "relu2_grad", aux)`: (a @ b) * 2 sqrt(aux)

`relu2_mlp(x, w_fc, w_proj)` is the whole MLP as a custom op with its backward (the other four
GEMMs stay cuBLAS); it saves what the plain MLP saves (x, h2). Needs TMA (compute capability
>= 9); `probe(device)` proves it with a tiny real launch before kernels.build_mlp installs it.

`fp8_relu2_mlp(x, w_fc, w_proj, grad_dtype)` is the same for precision.py's native fp8 layers
(Fp8Linear's recipe, weights and saved tensors): the kernel reads fp8 operands, multiplies by the
two inverse scales and also returns the output's abs-max, the scale of the fp8 cast that follows,
so relu^2, its gradient and two abs-max passes leave the step. H100, d20: 204.4k vs 192.8k tok/s
(`bench_train --precision fp8,fp8mlp0`); the fp8-vs-bf16 val loss after 200 steps is unchanged.
With e5m2 gradients the backward GEMM writes its output's two fp8 layouts itself, scaled by a
bound rather than an abs-max (`gh_bound_scale`): 216.7k vs 211.4k tok/s at 2^20 tokens.
CPU / interpreter: `mm_epilogue` runs the same kernel under TRITON_INTERPRET=1 (float32 tensors;
the interpreter mishandles bf16 descriptors) and `relu2_mlp` falls back to the same math in torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

EPILOGUES = {"none": 0, "relu2": 1, "relu2_grad": 2}


def _set_blocks(nargs):
    """Autotune pre-hook: the descriptors' block shapes follow the config being tried."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bk, bn] if nargs["B_KN"] else [bn, bk]
    nargs["c_desc"].block_shape = [bm, bn]
    nargs["aux_desc"].block_shape = [bm, bn]
    nargs["ct_desc"].block_shape = [bn, bm]


# Two tile sets, chosen by the GPU's opt-in shared memory per block (tile_set): "large"
# for Hopper and B200 (227 KB), "small" for GB10 and the RTX 50 parts (99 KB), where every tile of
# the large set but its two smallest is out of resources (the autotuner used to compile all six
# and keep two). Every small tile fits GB10 with the forward (relu^2) epilogue; relu^2's gradient
# also stages its aux tile, and there a few drop out at autotune (tests/test_triton_aot.py checks
# both with Triton's own compiler for sm_121). The small tiles are not measured on a GB10 (none
# here): they are what fits, with deeper pipelines or 8 warps where they fit, and the autotuner
# picks among them on the GPU itself.
LARGE_SMEM_BYTES = 200 * 1024


@dataclass(frozen=True)
class GemmGpu:
    """What a persistent GEMM launch needs of its GPU: the SM count (the grid) and the opt-in
    shared memory per block (the tile set). nanochat/triton_aot passes an AotTarget, which has
    the same two fields."""

    sms: int
    smem_per_block: int


def tile_set(gpu) -> str:
    """"large" or "small": which of _TILES (and triton_qk's) a GPU with gpu.smem_per_block gets."""
    return "large" if gpu.smem_per_block >= LARGE_SMEM_BYTES else "small"


@functools.cache
def device_gpu(index: int) -> GemmGpu:
    props = torch.cuda.get_device_properties(index)
    return GemmGpu(props.multi_processor_count, props.shared_memory_per_block_optin)


def launch_gpu(t: torch.Tensor, gpu) -> GemmGpu:
    """The GPU a launch on tensor t runs on, or `gpu` when given (ahead-of-time capture)."""
    if gpu is not None:
        return gpu
    return device_gpu(t.device.index if t.device.index is not None else torch.cuda.current_device())


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
_TILES = {
    # the first four won or came close on the H100; the last two are smaller
    (False, "large"): ((128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 4), (256, 128, 64, 3, 8),
                       (128, 128, 64, 2, 4), (128, 64, 64, 3, 4)),
    # the H100 sweep at d20's shape (2026-11-24, ms per GEMM incl. epilogue): relu2 128x256x128/3
    # stages 0.712, 128x256x64/5 0.744; relu2_grad (its aux tile needs shared memory too)
    # 128x256x64/4 0.983, 128x128x128/4 1.07
    (True, "large"): ((128, 256, 128, 3, 8), (128, 256, 64, 4, 8), (128, 256, 64, 5, 8), (128, 128, 128, 4, 4),
                      (128, 64, 128, 2, 4), (64, 64, 128, 3, 4)),
    # relu2_grad drops 128x128x32/4 and 128x256x32/2 (112 / 152 KB)
    (False, "small"): ((128, 128, 64, 2, 8), (128, 128, 64, 2, 4), (128, 128, 32, 3, 4), (128, 128, 32, 4, 8),
                       (128, 64, 64, 3, 4), (64, 128, 64, 3, 4), (128, 64, 32, 4, 4), (128, 256, 32, 2, 8)),
    # every one fits with both epilogues (<= 96 KB)
    (True, "small"): ((128, 128, 128, 3, 8), (128, 128, 128, 2, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 8),
                      (128, 64, 128, 3, 4), (64, 128, 128, 3, 4), (128, 64, 128, 2, 4)),
}


def _configs(fp8: bool, tiles: str):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_stages=st, num_warps=w, pre_hook=_set_blocks)
            for bm, bn, bk, st, w in _TILES[fp8, tiles]]


@triton.jit
def tile_offsets(tile, n_m, n_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(off_m, off_n) of output tile `tile` in grouped order: GROUP_M row tiles in a row share
    their B columns while those are in L2."""
    group = tile // (GROUP_M * n_n)
    size_m = min(n_m - group * GROUP_M, GROUP_M)
    off_m = (group * GROUP_M + (tile % (GROUP_M * n_n)) % size_m) * BLOCK_M
    off_n = ((tile % (GROUP_M * n_n)) // size_m) * BLOCK_N
    return off_m, off_n


@triton.jit
def tile_acc(a_desc, b_desc, off_m, off_n, K, B_KN: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The float32 (BLOCK_M, BLOCK_N) tile of A @ B at (off_m, off_n), operands through TMA."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([off_m, k * BLOCK_K])
        if B_KN:   # b (K, N) row-major
            acc = tl.dot(a, b_desc.load([k * BLOCK_K, off_n]), acc)
        else:      # b given as the (N, K) row-major weight
            acc = tl.dot(a, b_desc.load([off_n, k * BLOCK_K]).T, acc)
    return acc


@triton.jit
def _mm_epilogue_kernel(a_desc, b_desc, c_desc, aux_desc, ct_desc, scale_ptr, amax_ptr, M, N, K,
                        NUM_PROGRAMS: tl.constexpr, EPILOGUE: tl.constexpr, B_KN: tl.constexpr,
                        HAS_SCALE: tl.constexpr, AMAX: tl.constexpr, SATURATE: tl.constexpr,
                        TRANSPOSED: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGRAMS, flatten=True):
        off_m, off_n = tile_offsets(tile, n_m, n_n, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tile_acc(a_desc, b_desc, off_m, off_n, K, B_KN, BLOCK_M, BLOCK_N, BLOCK_K)
        if HAS_SCALE:   # fp8 operands: undo both tensor-wise scales (one float32 scalar)
            acc = acc * tl.load(scale_ptr)
        if EPILOGUE == 1:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        elif EPILOGUE == 2:
            acc = acc * 2.0 * tl.sqrt(aux_desc.load([off_m, off_n]).to(tl.float32))
        if SATURATE > 0:   # an fp8 output (the scale already applied): clamp to the format's range
            acc = tl.clamp(acc, -SATURATE, SATURATE)
        out = acc.to(c_desc.dtype)
        if AMAX:   # the output's abs-max, of the stored (rounded) values: the next fp8 cast's scale
            tl.atomic_max(amax_ptr, tl.max(tl.abs(out.to(tl.float32))), sem="relaxed")
        c_desc.store([off_m, off_n], out)
        if TRANSPOSED:   # the same tile transposed (through shared memory), for a wgrad GEMM
            ct_desc.store([off_n, off_m], tl.trans(out))


_AUTOTUNE_KEY = ["M", "N", "K", "EPILOGUE", "B_KN", "HAS_SCALE", "AMAX", "SATURATE", "TRANSPOSED"]
_mm_epilogue_tuned = {key: triton.autotune(configs=_configs(*key), key=_AUTOTUNE_KEY)(_mm_epilogue_kernel)
                      for key in _TILES}


def available(device: torch.device | str) -> bool:
    """TMA descriptors need compute capability >= 9 (Hopper, Blackwell incl. GB10)."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9


try:
    from triton.errors import TritonError as _TritonError
except ImportError:   # older layouts: the two errors a launch can raise
    from triton.compiler.errors import CompilationError as _TritonError   # type: ignore[assignment]
_PROBED: dict[tuple[int, bool], str | None] = {}


def probe(device: torch.device | str, fp8: bool = False) -> str | None:
    """None when both epilogue GEMMs (bf16, or with `fp8` the fp8 MLP's forward and backward)
    compile, launch and match torch on `device` (a tiny real launch, once per device), else why
    not: a GPU where the kernel was never run (e.g. GB10's smaller shared memory) falls back to
    cuBLAS instead of failing in the first step."""
    dev = torch.device(device)
    if not available(dev):
        return ("needs compute capability >= 9 (TMA)" if dev.type == "cuda"
                else f"needs a CUDA GPU (device is {dev.type})")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if (index, fp8) not in _PROBED:
        launch = _probe_launch_fp8 if fp8 else _probe_launch
        _PROBED[index, fp8] = launch(torch.device("cuda", index))
    return _PROBED[index, fp8]


def _probe_launch_fp8(dev: torch.device) -> str | None:
    """The fp8 MLP's forward and backward against the same math in float32 torch."""
    g = torch.Generator(device=dev).manual_seed(0)
    x, gy = (torch.randn(256, 128, device=dev, generator=g).bfloat16() for _ in range(2))
    w_fc = torch.randn(512, 128, device=dev, generator=g) / 128**0.5
    w_proj = torch.randn(128, 512, device=dev, generator=g) / 512**0.5
    try:
        got = _fp8_probe_outputs(x, gy, w_fc, w_proj)
        torch.cuda.synchronize(dev)
    except (RuntimeError, _TritonError) as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    want = _fp8_probe_outputs(x, gy, w_fc, w_proj, torch_math=True)   # the same casts and cuBLAS calls
    for a, b in zip(got, want):
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        if not err < 2e-2:
            return f"wrong fp8 result on this GPU (relative error {err:.3g})"
    return None


def _fp8_probe_outputs(x, gy, w_fc, w_proj, torch_math=False):
    from nanochat.precision import to_fp8
    (w_fc_q, w_fc_inv), (w_proj_q, w_proj_inv) = (to_fp8(w, torch.float8_e4m3fn) for w in (w_fc, w_proj))
    x_scale = torch.full((1,), 2.0, device=x.device)
    y, h2, x_qt, h_qt, h_scale = _fp8_mlp_fwd(x, x_scale, w_fc_q, w_fc_inv.reshape(1), w_proj_q,
                                              w_proj_inv.reshape(1), torch_math)
    grads = [_fp8_mlp_bwd(gy, torch.full((1,), 4.0, device=x.device), x_qt, x_scale, h2, h_qt, h_scale,
                          w_fc_q, w_fc_inv.reshape(1), w_proj_q, w_proj_inv.reshape(1), True, torch_math,
                          direct=direct) for direct in (True, False)]   # both ways to dL/dh's fp8 copies
    return (y, h2, *grads[0], *grads[1])


def _probe_launch(dev: torch.device) -> str | None:
    g = torch.Generator(device=dev).manual_seed(0)
    x, gy = (torch.randn(256, 128, device=dev, generator=g).bfloat16() for _ in range(2))
    w_fc = (torch.randn(512, 128, device=dev, generator=g) / 128**0.5).bfloat16()
    w_proj = (torch.randn(128, 512, device=dev, generator=g) / 512**0.5).bfloat16()
    try:
        h2 = mm_epilogue(x, w_fc, "relu2", b_kn=False)
        gh = mm_epilogue(gy, w_proj, "relu2_grad", h2)
        torch.cuda.synchronize(dev)
    except (RuntimeError, _TritonError) as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    want_h2 = torch.relu(x.float() @ w_fc.float().t()).square()
    want_gh = (gy.float() @ w_proj.float()) * 2 * h2.float().sqrt()
    for got, want in ((h2, want_h2), (gh, want_gh)):
        err = ((got.float() - want).norm() / want.norm()).item()
        if not err < 2e-2:
            return f"wrong result on this GPU (relative error {err:.3g})"
    return None


def mm_epilogue(a: torch.Tensor, b: torch.Tensor, epilogue: str = "none", aux: torch.Tensor | None = None,
                *, b_kn: bool = True, scale: torch.Tensor | None = None, amax: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None, saturate: float = 0.0, transposed: bool = False,
                gpu: GemmGpu | None = None):
    """epilogue(scale * (a @ B)) in `out_dtype` (default a's dtype), float32 accumulation. a (M, K)
    contiguous; B = b (K, N) contiguous when b_kn, else b is an (N, K) contiguous weight and
    B = b.T (the only layout fp8 operands have: Hopper's fp8 MMA reads both K-major); aux (M, N)
    contiguous for relu2_grad. `scale`: a float32 one-element tensor (fp8 operands: the product
    of their inverse scales). `amax`: a float32 one-element tensor that receives
    max(amax, max |output|). `saturate` > 0 clamps the result to +-saturate before the cast (an
    fp8 output). `transposed` also writes the output's (N, M) transpose and returns both. TMA
    needs every row a multiple of 16 bytes: K and N elements (and M with `transposed`); Triton's
    TensorDescriptor asserts it. `gpu`: its SMs (the persistent grid) and shared memory (the tile set);
    default the tensors' GPU; nanochat/triton_aot passes a target to record the CUDA launch from
    CPU tensors."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue: got {epilogue!r}; accepted: {'|'.join(EPILOGUES)}")
    M, K = a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    assert a.is_contiguous() and b.is_contiguous() and (b.shape[0] if b_kn else b.shape[1]) == K
    assert (aux is not None) == (epilogue == "relu2_grad")
    assert aux is None or (aux.shape == (M, N) and aux.is_contiguous())
    fp8 = a.element_size() == 1
    assert not (fp8 and b_kn), "fp8 operands: pass b as the (N, K) K-major weight"
    for t in (scale, amax):
        assert t is None or (t.dtype == torch.float32 and t.numel() == 1 and t.device == a.device)
    c = torch.empty((M, N), dtype=out_dtype or a.dtype, device=a.device)
    ct = torch.empty((N, M), dtype=c.dtype, device=a.device) if transposed else c
    if not (M and N):
        return (c, ct) if transposed else c
    descs = [TensorDescriptor.from_tensor(t, [1, 1]) for t in (a, b, c, aux if aux is not None else c, ct)]
    ptrs = (c if scale is None else scale, c if amax is None else amax)
    flags = dict(EPILOGUE=EPILOGUES[epilogue], B_KN=b_kn, HAS_SCALE=scale is not None, AMAX=amax is not None,
                 SATURATE=float(saturate), TRANSPOSED=transposed)
    if a.is_cuda or gpu is not None:
        gpu = launch_gpu(a, gpu)

        def grid(meta):
            return (min(gpu.sms, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
        _mm_epilogue_tuned[fp8, tile_set(gpu)][grid](*descs, *ptrs, M, N, K, NUM_PROGRAMS=gpu.sms, **flags)
    else:   # the interpreter: one small config, 3 programs (each walks several tiles)
        meta = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
        _set_blocks({"a_desc": descs[0], "b_desc": descs[1], "c_desc": descs[2], "aux_desc": descs[3],
                     "ct_desc": descs[4], **meta, **flags})
        _mm_epilogue_kernel[(3,)](*descs, *ptrs, M, N, K, NUM_PROGRAMS=3, **flags, **meta)
    return (c, ct) if transposed else c


# --------------------------------------------------------------------------------------------
# the MLP as a custom op
# --------------------------------------------------------------------------------------------

def _mlp_fwd(x, w_fc, w_proj):
    if x.is_cuda:
        h2 = mm_epilogue(x, w_fc, "relu2", b_kn=False)
    else:
        h2 = torch.relu(torch.mm(x, w_fc.t())).square()
    return torch.mm(h2, w_proj.t()), h2


def _mlp_bwd(gy, x, h2, w_fc, w_proj):
    if gy.is_cuda:
        gh = mm_epilogue(gy, w_proj, "relu2_grad", h2, b_kn=True)
    else:
        gh = torch.mm(gy, w_proj) * 2 * h2.sqrt()
    return torch.mm(gh, w_fc), torch.mm(gh.t(), x), torch.mm(gy.t(), h2)


@functools.cache
def _ops():
    @torch.library.custom_op("nanochat::relu2_mlp", mutates_args=())
    def relu2_mlp_op(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _mlp_fwd(x, w_fc, w_proj)

    @relu2_mlp_op.register_fake
    def _(x, w_fc, w_proj):
        return x.new_empty((x.shape[0], w_proj.shape[0])), x.new_empty((x.shape[0], w_fc.shape[0]))

    @torch.library.custom_op("nanochat::relu2_mlp_bwd", mutates_args=())
    def relu2_mlp_bwd_op(gy: torch.Tensor, x: torch.Tensor, h2: torch.Tensor, w_fc: torch.Tensor,
                         w_proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _mlp_bwd(gy, x, h2, w_fc, w_proj)

    @relu2_mlp_bwd_op.register_fake
    def _(gy, x, h2, w_fc, w_proj):
        return torch.empty_like(x), torch.empty_like(w_fc), torch.empty_like(w_proj)

    def setup_context(ctx, inputs, output):
        x, w_fc, w_proj = inputs
        _y, h2 = output
        ctx.mark_non_differentiable(h2)
        ctx.save_for_backward(x, h2, w_fc, w_proj)

    def backward(ctx, gy, _g_h2):
        x, h2, w_fc, w_proj = ctx.saved_tensors
        return torch.ops.nanochat.relu2_mlp_bwd(gy.contiguous(), x, h2, w_fc, w_proj)

    relu2_mlp_op.register_autograd(backward, setup_context=setup_context)
    return torch.ops.nanochat.relu2_mlp


def register() -> None:
    """Register the custom ops (bf16 and fp8 MLPs) before a model using them is compiled."""
    _ops()
    _fp8_ops()


def relu2_mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
    """relu(x w_fc^T)^2 w_proj^T for x (..., C) and the (fp32 master) weights, computed in x's
    dtype like gpt.Linear (weights cast in forward, their gradients cast back)."""
    if not torch.compiler.is_compiling():
        _ops()
    c = x.shape[-1]
    y, _ = torch.ops.nanochat.relu2_mlp(x.reshape(-1, c).contiguous(), w_fc.to(x.dtype).contiguous(),
                                        w_proj.to(x.dtype).contiguous())
    return y.view(*x.shape[:-1], w_proj.shape[0])


# --------------------------------------------------------------------------------------------
# the same MLP in fp8 (precision.py's native tensor-wise recipe): relu^2 and its gradient in the
# epilogues of fp8 GEMMs, which also produce the abs-max that the next cast's scale needs
# --------------------------------------------------------------------------------------------

def _fp8_epilogue_mm(a_q, b_q, scale, epilogue, aux, out_dtype, torch_math=False):
    """(epilogue(scale * a_q @ b_q.T), its abs-max) for fp8 a_q (M, K) and an (N, K) fp8 b_q.
    CUDA: one Triton GEMM. Elsewhere (or with `torch_math`: the probe's reference) the same math
    in float32 torch."""
    amax = torch.zeros(1, dtype=torch.float32, device=a_q.device)
    if a_q.is_cuda and not torch_math:
        return mm_epilogue(a_q, b_q, epilogue, aux, b_kn=False, scale=scale, amax=amax, out_dtype=out_dtype), amax
    acc = (a_q.float() @ b_q.float().t()) * scale
    acc = torch.relu(acc).square() if epilogue == "relu2" else acc * 2 * aux.float().sqrt()
    out = acc.to(out_dtype)
    return out, out.float().abs().amax().reshape(1)


def gh_bound_scale(k: int, g_inv: torch.Tensor, w_proj_inv: torch.Tensor, h_scale: torch.Tensor) -> torch.Tensor:
    """The e5m2 scale of dL/dh = (gy @ w_proj) * 2 sqrt(h2) from a bound on its magnitude, not
    its abs-max: every |gy| <= E5M2_MAX * g_inv, |w_proj| <= E4M3_MAX * w_proj_inv and
    h2 <= E4M3_MAX / h_scale (the scales' own abs-maxes), so |dL/dh| <= k * amax(gy) *
    amax(w_proj) * 2 sqrt(amax(h2)) for the k-term dot products. Mapping that bound onto
    E5M2_MAX cannot overflow, so relu^2's backward GEMM can write the fp8 copies itself instead
    of a bf16 tensor that an abs-max and a cast + transpose pass read again (d20: 0.47 ms per
    layer on an H100). The bound is loose: in the first 60 steps of d20 training on an H100 it
    sat 2^4.5-2^10.2 (median ~2^7) above the real abs-max. e5m2 spans ~2^30 of normal values,
    so the gradient's bulk stays normal at full 2-bit precision; only values more than ~2^-20
    below its largest lose bits (to subnormals), and those hardly count in the GEMMs' sums."""
    from nanochat.precision import E4M3_MAX, E5M2_MAX
    bound = k * (E5M2_MAX * g_inv) * (E4M3_MAX * w_proj_inv) * 2 * (E4M3_MAX / h_scale).sqrt()
    return E5M2_MAX / bound.clamp(min=1e-12)


def _fp8_epilogue_pair(g_q, w_t, scale, h2, torch_math=False):
    """(q, q.T) with q = e5m2(clamp(scale * (g_q @ w_t.T) * 2 sqrt(h2))): relu^2's backward with
    the fp8 cast applied in the epilogue, both layouts written by the GEMM. CUDA: one Triton
    GEMM; elsewhere (or `torch_math`) the same math in float32 torch."""
    from nanochat.precision import E5M2_MAX
    e5 = torch.float8_e5m2
    if g_q.is_cuda and not torch_math:
        return mm_epilogue(g_q, w_t, "relu2_grad", h2, b_kn=False, scale=scale, out_dtype=e5,
                           saturate=E5M2_MAX, transposed=True)
    acc = (g_q.float() @ w_t.float().t()) * scale * 2 * h2.float().sqrt()
    q = acc.clamp(-E5M2_MAX, E5M2_MAX).to(e5)
    return q, q.t().contiguous()


def _fp8_mlp_fwd(x, x_scale, w_fc_q, w_fc_inv, w_proj_q, w_proj_inv, torch_math=False):
    """Forward of the fp8 MLP: c_fc (e4m3 x, e4m3 w) with relu^2 and its abs-max in the
    epilogue, then h2's two e4m3 layouts in one pass and c_proj through cuBLAS."""
    from nanochat.precision import E4M3_MAX, fp8_cast_transpose
    x_q, x_qt = fp8_cast_transpose(x, x_scale, False)
    h2, amax = _fp8_epilogue_mm(x_q, w_fc_q, x_scale.reciprocal() * w_fc_inv, "relu2", None, x.dtype, torch_math)
    h_scale = E4M3_MAX / amax.clamp(min=1e-12)
    h_q, h_qt = fp8_cast_transpose(h2, h_scale, False)
    y = torch._scaled_mm(h_q, w_proj_q.t(), scale_a=h_scale.reciprocal(), scale_b=w_proj_inv,
                         out_dtype=x.dtype, use_fast_accum=True)
    return y, h2, x_qt, h_qt, h_scale


def _fp8_mlp_bwd(gy, g_scale, x_qt, x_scale, h2, h_qt, h_scale, w_fc_q, w_fc_inv, w_proj_q, w_proj_inv,
                 e5m2: bool, torch_math=False, direct: bool = True):
    """Backward: gy's fp8 layouts, c_proj's weight gradient, c_proj's input gradient with the
    relu^2 derivative in the epilogue, then c_fc's two gradients (cuBLAS). With e5m2 gradients and
    `direct` the epilogue writes that gradient's two fp8 layouts (gh_bound_scale); otherwise it
    writes bf16 and its abs-max, and a cast + transpose pass follows."""
    from nanochat.precision import E4M3_MAX, E5M2_MAX, _fp8_grad_input, fp8_cast_transpose
    g_q, g_qt = fp8_cast_transpose(gy, g_scale, e5m2)
    g_inv = g_scale.reciprocal()
    dw_proj = torch._scaled_mm(g_qt, h_qt.t(), scale_a=g_inv, scale_b=h_scale.reciprocal(),
                               out_dtype=torch.float32)
    # dL/dh2 = gy @ w_proj: as an (N, K) K-major operand the fp8 GEMM needs w_proj transposed
    w_proj_t = w_proj_q.t().contiguous()
    if e5m2 and direct:   # the epilogue writes both fp8 layouts itself, scaled by a bound
        gh_scale = gh_bound_scale(gy.shape[1], g_inv, w_proj_inv, h_scale)
        gh_q, gh_qt = _fp8_epilogue_pair(g_q, w_proj_t, g_inv * w_proj_inv * gh_scale, h2, torch_math)
    else:   # (e4m3's range is too narrow for a bound) the output's abs-max, then a cast
        gh, amax = _fp8_epilogue_mm(g_q, w_proj_t, g_inv * w_proj_inv, "relu2_grad", h2, gy.dtype, torch_math)
        gh_scale = (E5M2_MAX if e5m2 else E4M3_MAX) / amax.clamp(min=1e-12)
        gh_q, gh_qt = fp8_cast_transpose(gh, gh_scale, e5m2)
    gh_inv = gh_scale.reciprocal()
    dx = _fp8_grad_input(gh_q, gh_inv, w_fc_q, w_fc_inv, gy.dtype)   # Fp8Linear's own dgrad
    dw_fc = torch._scaled_mm(gh_qt, x_qt.t(), scale_a=gh_inv, scale_b=x_scale.reciprocal(),
                             out_dtype=torch.float32)
    return dx, dw_fc, dw_proj


@functools.cache
def _fp8_ops():
    from nanochat.precision import fp8_cast_transpose   # registers that op before ours use it
    del fp8_cast_transpose

    @torch.library.custom_op("nanochat::fp8_relu2_mlp", mutates_args=())
    def fwd_op(x: torch.Tensor, x_scale: torch.Tensor, w_fc_q: torch.Tensor, w_fc_inv: torch.Tensor,
               w_proj_q: torch.Tensor, w_proj_inv: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _fp8_mlp_fwd(x, x_scale, w_fc_q, w_fc_inv, w_proj_q, w_proj_inv)

    @fwd_op.register_fake
    def _(x, x_scale, w_fc_q, w_fc_inv, w_proj_q, w_proj_inv):
        m, hid = x.shape[0], w_fc_q.shape[0]
        e4 = torch.float8_e4m3fn
        return (x.new_empty((m, w_proj_q.shape[0])), x.new_empty((m, hid)),
                x.new_empty((x.shape[1], m), dtype=e4), x.new_empty((hid, m), dtype=e4),
                x_scale.new_empty(1))

    @torch.library.custom_op("nanochat::fp8_relu2_mlp_bwd", mutates_args=())
    def bwd_op(gy: torch.Tensor, g_scale: torch.Tensor, x_qt: torch.Tensor, x_scale: torch.Tensor,
               h2: torch.Tensor, h_qt: torch.Tensor, h_scale: torch.Tensor, w_fc_q: torch.Tensor,
               w_fc_inv: torch.Tensor, w_proj_q: torch.Tensor, w_proj_inv: torch.Tensor,
               e5m2: bool, direct: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _fp8_mlp_bwd(gy, g_scale, x_qt, x_scale, h2, h_qt, h_scale, w_fc_q, w_fc_inv, w_proj_q,
                            w_proj_inv, e5m2, direct=direct)

    @bwd_op.register_fake
    def _(gy, g_scale, x_qt, x_scale, h2, h_qt, h_scale, w_fc_q, w_fc_inv, w_proj_q, w_proj_inv, e5m2, direct):
        f32 = torch.float32
        return (gy.new_empty((gy.shape[0], w_fc_q.shape[1])), gy.new_empty(w_fc_q.shape, dtype=f32),
                gy.new_empty(w_proj_q.shape, dtype=f32))
    return fwd_op, bwd_op


class _Fp8Relu2Mlp(torch.autograd.Function):
    """relu(x w_fc^T)^2 w_proj^T with precision.py's native fp8 recipe (e4m3 activations and
    weights, tensor-wise scales, `grad_dtype` gradients, x's transposed copy saved as in
    --fp8-wgrad save), its two elementwise passes and two of its abs-max passes in GEMM
    epilogues. The scales of x, of the weights and of the incoming gradient are torch ops outside
    the custom ops, so the compiler can fuse those reductions into the kernels producing them."""

    @staticmethod
    def forward(ctx, x, w_fc, w_proj, grad_dtype, direct):
        from nanochat.precision import E4M3_MAX, fp8_scale, to_fp8
        w_fc_q, w_fc_inv = to_fp8(w_fc, torch.float8_e4m3fn)
        w_proj_q, w_proj_inv = to_fp8(w_proj, torch.float8_e4m3fn)
        x_scale = fp8_scale(x, E4M3_MAX).reshape(1)
        y, h2, x_qt, h_qt, h_scale = torch.ops.nanochat.fp8_relu2_mlp(
            x, x_scale, w_fc_q, w_fc_inv.reshape(1), w_proj_q, w_proj_inv.reshape(1))
        ctx.save_for_backward(x_qt, x_scale, h2, h_qt, h_scale, w_fc_q, w_fc_inv, w_proj_q, w_proj_inv)
        ctx.e5m2, ctx.w_dtypes = grad_dtype == torch.float8_e5m2, (w_fc.dtype, w_proj.dtype)
        ctx.direct = direct
        return y

    @staticmethod
    def backward(ctx, gy):
        from nanochat.precision import E4M3_MAX, E5M2_MAX, fp8_scale
        x_qt, x_scale, h2, h_qt, h_scale, w_fc_q, w_fc_inv, w_proj_q, w_proj_inv = ctx.saved_tensors
        g_scale = fp8_scale(gy, E5M2_MAX if ctx.e5m2 else E4M3_MAX).reshape(1)
        dx, dw_fc, dw_proj = torch.ops.nanochat.fp8_relu2_mlp_bwd(
            gy.contiguous(), g_scale, x_qt, x_scale, h2, h_qt, h_scale, w_fc_q, w_fc_inv.reshape(1), w_proj_q,
            w_proj_inv.reshape(1), ctx.e5m2, ctx.direct)
        return dx, dw_fc.to(ctx.w_dtypes[0]), dw_proj.to(ctx.w_dtypes[1]), None, None


GH_CASTS = ("epilogue", "pass")


def fp8_relu2_mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor,
                  grad_dtype: torch.dtype = torch.float8_e5m2, gh_cast: str = "epilogue") -> torch.Tensor:
    """The MLP of two precision.Fp8Linear layers (same weights, same recipe) in fused form;
    x (..., C) in the compute dtype, w_fc / w_proj the master weights. `gh_cast`: how relu^2's
    input gradient becomes fp8 with e5m2 gradients: 'epilogue' (its GEMM writes the fp8 layouts,
    scaled by gh_bound_scale) or 'pass' (bf16 + abs-max, then a cast + transpose: the A/B of
    `bench_train --unfuse ghcast`). A row count that is not a
    multiple of 16 (the fp8 GEMMs' alignment; e.g. an odd batch x sequence length) runs what the
    Fp8Linear layers run then: the plain MLP in the compute dtype."""
    if gh_cast not in GH_CASTS:
        raise ValueError(f"gh_cast: got {gh_cast!r}; accepted: {'|'.join(GH_CASTS)}")
    c = x.shape[-1]
    rows = x.numel() // c
    if rows % 16:
        h = torch.relu(torch.nn.functional.linear(x, w_fc.to(x.dtype))).square()
        return torch.nn.functional.linear(h, w_proj.to(x.dtype))
    if not torch.compiler.is_compiling():
        _fp8_ops()   # registered once, eagerly (never inside a traced region)
    y = _Fp8Relu2Mlp.apply(x.reshape(rows, c).contiguous(), w_fc, w_proj, grad_dtype, gh_cast == "epilogue")
    return y.view(*x.shape[:-1], w_proj.shape[0])
