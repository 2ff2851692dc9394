"""The ReLU^2 MLP with its two elementwise passes fused into GEMMs (`--kernel triton`, bf16).

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
CPU / interpreter: `mm_epilogue` runs the same kernel under TRITON_INTERPRET=1 (float32 tensors;
the interpreter mishandles bf16 descriptors) and `relu2_mlp` falls back to the same math in torch.
"""

from __future__ import annotations

import functools

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


def _configs():
    # (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps). The first four won or came close on the H100
    # (228 KB shared memory per SM); the last two fit GB10's 101,376 bytes per block, where
    # the autotuner discards the larger ones as out of resources.
    tiles = ((128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 4), (256, 128, 64, 3, 8),
             (128, 128, 64, 2, 4), (128, 64, 64, 3, 4))
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                          num_stages=st, num_warps=w, pre_hook=_set_blocks)
            for bm, bn, bk, st, w in tiles]


@triton.jit
def _mm_epilogue_kernel(a_desc, b_desc, c_desc, aux_desc, M, N, K, NUM_PROGRAMS: tl.constexpr,
                        EPILOGUE: tl.constexpr, B_KN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    n_m, n_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGRAMS, flatten=True):
        # grouped order: GROUP_M row tiles in a row share their B columns while those are in L2
        group = tile // (GROUP_M * n_n)
        size_m = min(n_m - group * GROUP_M, GROUP_M)
        off_m = (group * GROUP_M + (tile % (GROUP_M * n_n)) % size_m) * BLOCK_M
        off_n = ((tile % (GROUP_M * n_n)) // size_m) * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            a = a_desc.load([off_m, k * BLOCK_K])
            if B_KN:   # b (K, N) row-major
                acc = tl.dot(a, b_desc.load([k * BLOCK_K, off_n]), acc)
            else:      # b given as the (N, K) row-major weight
                acc = tl.dot(a, b_desc.load([off_n, k * BLOCK_K]).T, acc)
        if EPILOGUE == 1:
            acc = tl.maximum(acc, 0.0)
            acc = acc * acc
        elif EPILOGUE == 2:
            acc = acc * 2.0 * tl.sqrt(aux_desc.load([off_m, off_n]).to(tl.float32))
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


_mm_epilogue_tuned = triton.autotune(configs=_configs(), key=["M", "N", "K", "EPILOGUE", "B_KN"])(
    _mm_epilogue_kernel)


def available(device: torch.device | str) -> bool:
    """TMA descriptors need compute capability >= 9 (Hopper, Blackwell incl. GB10)."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9


try:
    from triton.errors import TritonError as _TritonError
except ImportError:   # older layouts: the two errors a launch can raise
    from triton.compiler.errors import CompilationError as _TritonError   # type: ignore[assignment]
_PROBED: dict[int, str | None] = {}


def probe(device: torch.device | str) -> str | None:
    """None when both epilogue GEMMs compile, launch and match torch on `device` (a tiny real
    launch, once per device), else why not: a GPU where the kernel was never run (e.g. GB10's
    smaller shared memory) falls back to cuBLAS instead of failing in the first step."""
    dev = torch.device(device)
    if not available(dev):
        return ("needs compute capability >= 9 (TMA)" if dev.type == "cuda"
                else f"needs a CUDA GPU (device is {dev.type})")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index not in _PROBED:
        _PROBED[index] = _probe_launch(torch.device("cuda", index))
    return _PROBED[index]


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
                *, b_kn: bool = True) -> torch.Tensor:
    """epilogue(a @ B) in a's dtype, float32 accumulation. a (M, K) contiguous; B = b (K, N)
    contiguous when b_kn, else b is an (N, K) contiguous weight and B = b.T; aux (M, N)
    contiguous for relu2_grad. Rows of 16 bytes or more (TMA)."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue: got {epilogue!r}; accepted: {'|'.join(EPILOGUES)}")
    M, K = a.shape
    N = b.shape[1] if b_kn else b.shape[0]
    assert a.is_contiguous() and b.is_contiguous() and (b.shape[0] if b_kn else b.shape[1]) == K
    assert (aux is not None) == (epilogue == "relu2_grad")
    assert aux is None or (aux.shape == (M, N) and aux.is_contiguous())
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if not (M and N):
        return c
    descs = [TensorDescriptor.from_tensor(t, [1, 1]) for t in (a, b, c, aux if aux is not None else c)]
    flags = dict(EPILOGUE=EPILOGUES[epilogue], B_KN=b_kn)
    if a.is_cuda:
        n_sm = torch.cuda.get_device_properties(a.device).multi_processor_count

        def grid(meta):
            return (min(n_sm, triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])),)
        _mm_epilogue_tuned[grid](*descs, M, N, K, NUM_PROGRAMS=n_sm, **flags)
    else:   # the interpreter: one small config, 3 programs (each walks several tiles)
        meta = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
        _set_blocks({"a_desc": descs[0], "b_desc": descs[1], "c_desc": descs[2], "aux_desc": descs[3],
                     **meta, **flags})
        _mm_epilogue_kernel[(3,)](*descs, M, N, K, NUM_PROGRAMS=3, **flags, **meta)
    return c


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
    _ops()


def relu2_mlp(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor) -> torch.Tensor:
    """relu(x w_fc^T)^2 w_proj^T for x (..., C) and the (fp32 master) weights, computed in x's
    dtype like gpt.Linear (weights cast in forward, their gradients cast back)."""
    if not torch.compiler.is_compiling():
        _ops()
    c = x.shape[-1]
    y, _ = torch.ops.nanochat.relu2_mlp(x.reshape(-1, c).contiguous(), w_fc.to(x.dtype).contiguous(),
                                        w_proj.to(x.dtype).contiguous())
    return y.view(*x.shape[:-1], w_proj.shape[0])
