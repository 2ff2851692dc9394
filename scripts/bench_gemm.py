"""GEMM throughput: python -m scripts.bench_gemm [--dtypes bf16,fp8,fp8-rowwise,nvfp4] [--shapes MxNxK,...]

`--linears M:INxOUT,...` times instead the three products a training Linear runs, in the
layouts autograd (bf16) and precision.py (fp8 tensor-wise) use: fwd x @ W.T, dgrad g @ W and
wgrad g.T @ x (reduction over the M tokens). `--blas cublas|cublaslt` picks torch's BLAS path.
`--mlp M:C` times the ReLU^2 MLP's two 4C-wide GEMMs with their elementwise pass, bf16 and fp8
(`--dtypes`, default both): cuBLAS (`_scaled_mm` for fp8, tensor-wise) then a compiled
elementwise kernel (the `current` path; for fp8 also the abs-max the next cast needs) vs
nanochat/triton_mlp.py's GEMM with the pass (and the abs-max) in its epilogue (`--kernel
triton`): forward relu(x W_fc^T)^2, backward (g W_proj) * 2 sqrt(h2). `--qk M:C` times a q
projection (C -> C, heads of 128, positions t = row % 2048) with its QK-norm + RoPE, bf16: cuBLAS
then the compiled rotary norm (the model's forward) vs nanochat/triton_qk.py's GEMM with it in the
epilogue, and the bare cuBLAS product for reference.

For each (dtype, shape) it times C = A @ B.T with CUDA events around a batch of products,
rotating over enough input sets that they cannot all sit in L2, and reports the median TFLOP/s
of --reps batches (the clock is only read after the events complete: no async over-reporting).
`--burn-in SECONDS` then runs the first bf16 shape continuously and prints rolling TFLOP/s
once a second (thermal/power throttling shows up as a falling rate, e.g. on a DGX Spark).

Output: one JSON line per result (device, versions, dtype, shape, tflops, pct_of_peak), then a
table. Unsupported combinations (nvfp4 before Blackwell, row-wise fp8 on sm_12x) are reported as
such, with the error, instead of aborting the run.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
import time

import torch

from nanochat.errors import RequestError
from nanochat.flags import FlagParser, require_float, script_main
from nanochat.platform import apply_patches, detect_device, peak_flops, triton_version

DEFAULT_SHAPES = "4096x4096x4096,8192x8192x8192,16384x5120x1280,16384x1280x5120,16384x65536x1280"
DTYPES = ("bf16", "fp8", "fp8-rowwise", "nvfp4")
PASSES = ("fwd", "dgrad", "wgrad")
# --layouts: the same three bf16 products with the other operand layouts cuBLAS can take for free
# (a transposed contiguous weight copy; the weight gradient as (x^T g)^T), to pick the fastest
LAYOUT_PASSES = ("fwd", "fwd_wt", "dgrad", "dgrad_wt", "wgrad", "wgrad_xg")
LINEAR_DTYPES = ("bf16", "fp8")
DEFAULT_LINEARS = "65536:1280x1280,65536:1280x5120,65536:5120x1280,65536:1280x32768"


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for item in text.split(","):
        parts = item.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--shapes: got {item!r}; expected MxNxK with positive integers")
        shapes.append(tuple(int(p) for p in parts))
    return shapes


def parse_linears(text: str) -> list[tuple[int, int, int]]:
    """'M:INxOUT,...' -> [(M, IN, OUT)]: M tokens through a Linear of IN -> OUT features."""
    out = []
    for item in text.split(","):
        m, _, rest = item.partition(":")
        parts = rest.lower().split("x")
        if not (m.isdigit() and len(parts) == 2 and all(p.isdigit() for p in parts)) or \
                min(int(m), *(int(p) for p in parts)) <= 0:
            raise ValueError(f"--linears: got {item!r}; expected M:INxOUT with positive integers")
        out.append((int(m), int(parts[0]), int(parts[1])))
    return out


def parse_mlp(text: str) -> tuple[int, int]:
    """'M:C' -> (M, C); both positive, C a multiple of 8 (16-byte rows for TMA)."""
    try:
        m, c = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--mlp: got {text!r}; expected M:C, e.g. 65536:1280") from None
    if m <= 0 or c <= 0 or c % 8:
        raise ValueError(f"--mlp: got {text!r}; M and C must be positive and C a multiple of 8")
    return m, c


def make_mlp_pass(variant: str, m: int, c: int, device, dtype: str = "bf16"):
    """One operand set and a closure running `variant`: fwd|bwd x cublas|fused, in `dtype`."""
    if dtype == "fp8":
        return _make_mlp_pass_fp8(variant, m, c, device)
    from nanochat.triton_mlp import mm_epilogue
    bf = dict(device=device, dtype=torch.bfloat16)
    a = torch.randn(m, c, **bf)
    w_fc = torch.randn(4 * c, c, **bf) / c**0.5
    w_proj = torch.randn(c, 4 * c, **bf) / (4 * c) ** 0.5
    h2 = torch.relu(torch.randn(m, 4 * c, **bf)).square()
    relu2, grad = _mlp_elementwise()
    return {"fwd/cublas": lambda: relu2(a @ w_fc.t()),
            "fwd/fused": lambda: mm_epilogue(a, w_fc, "relu2", b_kn=False),
            "bwd/cublas": lambda: grad(a @ w_proj, h2),
            "bwd/fused": lambda: mm_epilogue(a, w_proj, "relu2_grad", h2)}[variant]


QK_SEQ, QK_HEAD_DIM = 2048, 128


def make_qk_pass(variant: str, m: int, c: int, device):
    """One operand set and a closure for the q projection + QK-norm + RoPE: cublas|cublas+rope|fused."""
    from nanochat import triton_qk
    from nanochat.gpt import rotary_tables
    bf = dict(device=device, dtype=torch.bfloat16)
    x, w = torch.randn(m, c, **bf), torch.randn(c, c, **bf) / c**0.5
    cos, sin = rotary_tables(QK_SEQ, QK_HEAD_DIM, device)
    tables = [t.reshape(QK_SEQ, -1).contiguous() for t in (cos, sin)]
    shape = (m // QK_SEQ, QK_SEQ, c // QK_HEAD_DIM, QK_HEAD_DIM)
    rope = _qk_rotary()
    return {"cublas": lambda: torch.mm(x, w.t()),
            "cublas+rope": lambda: rope(torch.mm(x, w.t()).view(shape), cos, sin),
            "fused": functools.partial(triton_qk.mm_rotary_norm, x, triton_qk.interleave(w, QK_HEAD_DIM).contiguous(),
                                       *tables, QK_SEQ)}[variant]


@functools.cache
def _qk_rotary():
    from nanochat.gpt import rotary_norm_forward
    return torch.compile(rotary_norm_forward)


def parse_qk(text: str) -> tuple[int, int]:
    """'M:C' -> (M, C): M a positive multiple of the sequence (2048), C of the head dim (128)."""
    try:
        m, c = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"--qk: got {text!r}; expected M:C, e.g. 65536:1280") from None
    if m <= 0 or c <= 0 or m % QK_SEQ or c % QK_HEAD_DIM:
        raise ValueError(f"--qk: got {text!r}; M must be a positive multiple of {QK_SEQ} and C of {QK_HEAD_DIM}")
    return m, c


def _make_mlp_pass_fp8(variant: str, m: int, c: int, device):
    """The fp8 MLP's two GEMMs as precision.py's Fp8Linear path runs them (`_scaled_mm`, then
    relu^2 or its gradient and the abs-max of the result, compiled) and as triton_mlp's
    fp8_relu2_mlp does (one Triton GEMM each, abs-max in the epilogue)."""
    from nanochat.triton_mlp import mm_epilogue
    e4, bf16 = torch.float8_e4m3fn, torch.bfloat16
    x = torch.randn(m, c, device=device).to(e4)
    g = torch.randn(m, c, device=device).to(torch.float8_e5m2)
    w_fc = (torch.randn(4 * c, c, device=device) / c**0.5).to(e4)
    w_proj_t = (torch.randn(4 * c, c, device=device) / c**0.5).to(e4)   # W_proj.T, K-major
    h2 = torch.relu(torch.randn(m, 4 * c, device=device, dtype=bf16)).square()
    one, amax = torch.ones((), device=device), torch.zeros(1, device=device)
    relu2, grad = _mlp_elementwise_fp8()
    return {"fwd/cublas": lambda: relu2(torch._scaled_mm(x, w_fc.t(), scale_a=one, scale_b=one, out_dtype=bf16,
                                                         use_fast_accum=True)),
            "fwd/fused": lambda: mm_epilogue(x, w_fc, "relu2", b_kn=False, scale=one.reshape(1), amax=amax,
                                             out_dtype=bf16),
            "bwd/cublas": lambda: grad(torch._scaled_mm(g, w_proj_t.t(), scale_a=one, scale_b=one,
                                                        out_dtype=bf16), h2),
            "bwd/fused": lambda: mm_epilogue(g, w_proj_t, "relu2_grad", h2, b_kn=False, scale=one.reshape(1),
                                             amax=amax, out_dtype=bf16)}[variant]


@functools.cache
def _mlp_elementwise():
    """The compiled elementwise kernels of the current path (one fused kernel each)."""
    return (torch.compile(lambda h: torch.relu(h).square()),
            torch.compile(lambda g, h2: g * 2 * h2.sqrt()))


@functools.cache
def _mlp_elementwise_fp8():
    """The same with the abs-max that the next fp8 cast's scale needs."""
    def relu2(h):
        h2 = torch.relu(h).square()
        return h2, h2.abs().amax()

    def grad(g, h2):
        gh = g * 2 * h2.sqrt()
        return gh, gh.abs().amax()
    return torch.compile(relu2), torch.compile(grad)


def linear_pass_shape(pass_: str, m: int, k: int, n: int) -> tuple[int, int, int]:
    """(rows, cols, reduction) of one training pass of a Linear K -> N over M tokens."""
    return {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}[pass_.split("_")[0]]


def make_linear_pass(dtype: str, pass_: str, m: int, k: int, n: int, device):
    """One product of a training Linear (K -> N features, M tokens) with fresh random operands:
    bf16 as F.linear's autograd runs it, fp8 as precision.py's tensor-wise matmuls do."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    if dtype == "bf16":
        wt = w.t().contiguous()   # (K, N) row-major: the other layout a weight copy can have
        return {"fwd": lambda: torch.mm(x, w.t()), "dgrad": lambda: torch.mm(g, w),
                "wgrad": lambda: torch.mm(g.t(), x), "fwd_wt": lambda: torch.mm(x, wt),
                "dgrad_wt": lambda: torch.mm(g, wt.t()), "wgrad_xg": lambda: torch.mm(x.t(), g).t()}[pass_]
    one = torch.tensor(1.0, device=device)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    if pass_ == "fwd":
        a, b, out = x.to(e4), w.to(e4).t(), torch.bfloat16
    elif pass_ == "dgrad":   # b: W (N, K) column-major, as precision._fp8_grad_input makes it
        a, b, out = g.to(e5), w.to(e4).t().contiguous().t(), torch.bfloat16
    else:                    # a: g^T row-major, b: x column-major (the fused transposed copies)
        a, b, out = g.t().contiguous().to(e5), x.t().contiguous().to(e4).t(), torch.float32
    return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=out,
                                    use_fast_accum=pass_ == "fwd")


def _fp4_scale_len(rows: int, k: int) -> int:
    """Elements of a swizzled e4m3 block-scale tensor (128x4 tiles) for 16-element blocks."""
    return (math.ceil(rows / 128) * 128) * (math.ceil(k // 16 / 4) * 4)


def make_operands(dtype: str, m: int, n: int, k: int, device):
    """A callable running one product of freshly generated (non-zero, random) operands."""
    a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    if dtype == "bf16":
        return lambda: torch.mm(a, b.t())
    if dtype in ("fp8", "fp8-rowwise"):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        if dtype == "fp8":
            sa = sb = torch.tensor(1.0, device=device)
        else:
            sa = torch.ones(m, 1, device=device)
            sb = torch.ones(1, n, device=device)
        return lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=True)
    if dtype == "nvfp4":
        fp4 = getattr(torch, "float4_e2m1fn_x2", None)
        if fp4 is None:
            raise RuntimeError("this torch has no float4_e2m1fn_x2")
        a4 = torch.randint(0, 255, (m, k // 2), device=device, dtype=torch.uint8).view(fp4)
        b4 = torch.randint(0, 255, (n, k // 2), device=device, dtype=torch.uint8).view(fp4)
        sa = torch.ones(_fp4_scale_len(m, k), device=device).to(torch.float8_e4m3fn)
        sb = torch.ones(_fp4_scale_len(n, k), device=device).to(torch.float8_e4m3fn)
        return lambda: torch._scaled_mm(a4, b4.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    raise ValueError(f"--dtypes: got {dtype!r}; accepted: {'|'.join(DTYPES)}")


def time_gemm(dtype: str, shape, *, reps: int, l2_bytes: int, device, make=None, peak: float | None = None) -> dict:
    """Median ms and TFLOP/s of C (m x n) = A (m x k) @ B (k x n), and its % of `peak` (FLOP/s;
    None: None); `make()` builds one operand set (default: make_operands(dtype, m, n, k))."""
    m, n, k = shape
    elem = {"bf16": 2, "fp8": 1, "fp8-rowwise": 1, "nvfp4": 0.5}[dtype]
    set_bytes = (m * k + n * k) * elem
    n_sets = max(2, min(8, math.ceil(3 * l2_bytes / set_bytes)))
    make = make or (lambda: make_operands(dtype, m, n, k, device))
    runs = [make() for _ in range(n_sets)]
    for run in runs:   # warm-up: cuBLAS heuristics, workspace, clocks
        run()
    torch.cuda.synchronize()
    flops = 2.0 * m * n * k
    # aim for ~20 ms per timed batch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    runs[0]()
    end.record()
    end.synchronize()
    per_call_ms = max(start.elapsed_time(end), 1e-3)
    iters = max(n_sets, min(200, int(20 / per_call_ms)))
    samples = []
    for _ in range(reps):
        start.record()
        for i in range(iters):
            runs[i % n_sets]()
        end.record()
        end.synchronize()   # the clock is read only once the products are done
        samples.append(start.elapsed_time(end) / iters)
    ms = statistics.median(samples)
    return gemm_figures(flops, ms, samples, peak) | {"iters": iters, "input_sets": n_sets}


def gemm_figures(flops: float, ms: float, samples: list[float], peak: float | None) -> dict:
    """ms, TFLOP/s, % of peak and spread of one timed product. The % is taken from the unrounded
    rate: it was taken from the TFLOP/s rounded to 0.1 (a 0.04 TFLOP/s row read 0% of any peak)."""
    rate = flops / (ms * 1e-3)
    return {"ms": round(ms, 4), "tflops": round(rate / 1e12, 1),
            "pct_of_peak": round(100 * rate / peak, 1) if peak else None,
            "spread_pct": round(100 * (max(samples) - min(samples)) / ms, 1)}


def burn_in(seconds: float, shape, device, emit) -> None:
    m, n, k = shape
    run = make_operands("bf16", m, n, k, device)
    flops = 2.0 * m * n * k
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        count = 0
        start.record()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            for _ in range(10):
                run()
            count += 10
            end.record()
            end.synchronize()
        emit({"burn_in": True, "t": round(seconds - (t_end - time.perf_counter()), 1),
              "tflops": round(flops * count / (start.elapsed_time(end) * 1e-3) / 1e12, 1)})


# what torch._scaled_mm requires of its operands (torch/_meta_registrations.py): a's columns and both
# of b's dimensions multiples of 16 elements; fp4 packs two per byte, so K counts double there
ALIGN = {"fp8": (16, 16), "fp8-rowwise": (16, 16), "nvfp4": (32, 16)}   # (K, N) multiples


def check_alignment(args) -> None:
    """A size the low-precision GEMM cannot take raises here, naming the flag, instead of an
    'unsupported' row (--shapes) or a traceback after the bf16 rows ran (--linears, --mlp)."""
    for dtype in args.dtypes:
        if dtype not in ALIGN:
            continue
        k_mult, n_mult = ALIGN[dtype]
        fix = f"multiples of {k_mult} (K) and {n_mult} (N) for {dtype}, or --dtypes bf16"
        if args.mlp:
            if args.mlp[1] % 16:
                raise ValueError(f"--mlp: got {args.mlp[0]}:{args.mlp[1]}; C must be a multiple of 16 for {dtype} "
                                 "(or --dtypes bf16)")
        elif args.linears:   # fwd, dgrad and wgrad reduce over IN, OUT and M in turn
            for m, k, n in args.linears:
                if m % 16 or k % 16 or n % 16:
                    raise ValueError(f"--linears: got {m}:{k}x{n}; M, IN and OUT must be multiples of 16 for "
                                     f"{dtype} (or --dtypes bf16)")
        elif not args.qk:
            for m, n, k in args.shapes:
                if k % k_mult or n % n_mult:
                    raise ValueError(f"--shapes: got {m}x{n}x{k}; accepted: N and K {fix}")


def parse_peaks(text: str) -> dict[str, float]:
    """--peak-flops DTYPE=FLOP/s,... -> {dtype: FLOP/s}, each value checked as bench_train checks its own."""
    peaks = {}
    for item in filter(None, text.split(",")):
        dtype, sep, value = item.partition("=")
        if not sep or dtype not in DTYPES:
            raise ValueError(f"--peak-flops: got {item!r}; accepted: DTYPE=FLOP/s with DTYPE one of "
                             f"{'|'.join(DTYPES)} (e.g. bf16=989e12,fp8=1979e12)")
        try:
            peaks[dtype] = float(value)
        except ValueError:
            raise ValueError(f"--peak-flops: got {item!r}; the value must be a number of FLOP/s") from None
        require_float(peaks[dtype], "--peak-flops", 1e9)   # below 1e9 it was surely given in TFLOP/s
    return peaks


def resolve_peaks(spec, dtypes, overrides: dict[str, float], say=functools.partial(print, flush=True)
                  ) -> dict[str, float | None]:
    """Each dtype's dense peak (FLOP/s): --peak-flops first, then the device table. A dtype with
    neither is named once (`say`), so its '% peak' column reads None for a reason the user can fix."""
    alias = {"fp8-rowwise": "fp8"}   # the same tensor-core peak; --peak-flops fp8=X covers both
    peaks = {d: overrides.get(d) or overrides.get(alias.get(d, d)) or peak_flops(spec, alias.get(d, d)) for d in dtypes}
    missing = [d for d, v in peaks.items() if v is None]
    if missing:
        say(f"% peak n/a for {','.join(missing)}: '{spec.name}' has no such peak in nanochat/device_table.py; "
            f"pass --peak-flops {missing[0]}=<dense FLOP/s> to get it")
    return peaks


def parse_args(argv=None):
    """Parse and validate every flag (no CUDA work); a bad value raises ValueError naming the flag."""
    p = FlagParser(prog="python -m scripts.bench_gemm", description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default=None, help="default bf16,fp8,fp8-rowwise,nvfp4 (with --linears "
                   "or --mlp: bf16,fp8, the only ones those accept; with --qk: bf16, the only one it accepts)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of MxNxK")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--peak-flops", default="", help="DTYPE=FLOP/s comma list (e.g. bf16=989e12,fp8=1979e12): "
                   "the dense peak each '%% peak' is taken against, for GPUs not in the device table")
    p.add_argument("--burn-in", type=float, default=0.0, help="seconds of rolling bf16 TFLOP/s")
    p.add_argument("--linears", default="", help=f"M:INxOUT list (e.g. {DEFAULT_LINEARS}): "
                   "time fwd/dgrad/wgrad of training Linears instead of --shapes (dtypes bf16, fp8)")
    p.add_argument("--mlp", default="", help="M:C (e.g. 65536:1280): the MLP GEMMs with relu^2 "
                   "epilogues, fused (Triton) vs cuBLAS + elementwise, instead of --shapes")
    p.add_argument("--qk", default="", help="M:C (e.g. 65536:1280): the q projection with QK-norm + "
                   "RoPE, fused into a Triton GEMM vs cuBLAS + the compiled pass, instead of --shapes")
    p.add_argument("--blas", default="default", choices=("default", "cublas", "cublaslt"),
                   help="torch.backends.cuda.preferred_blas_library for the bf16 products")
    p.add_argument("--layouts", action="store_true", help="with --linears: also time each bf16 "
                   "product in its other free layouts (fwd_wt / dgrad_wt: a (K, N) weight copy; "
                   "wgrad_xg: (x^T g)^T)")
    args = p.parse_args(argv)
    args.shapes = parse_shapes(args.shapes)
    args.linears = parse_linears(args.linears) if args.linears else []
    args.mlp = parse_mlp(args.mlp) if args.mlp else None
    args.qk = parse_qk(args.qk) if args.qk else None
    # --qk times bf16 only: another dtype was accepted and silently not run
    accepted = LINEAR_DTYPES if (args.linears or args.mlp) else ("bf16",) if args.qk else DTYPES
    # None = the default list; an explicit "" is an empty list, refused below (it silently meant "all")
    args.dtypes = args.dtypes.split(",") if args.dtypes is not None else list(accepted)
    for d in args.dtypes:
        if d not in accepted:
            mode = "--linears" if args.linears else "--mlp" if args.mlp else "--qk" if args.qk else None
            flag = f"--dtypes (with {mode})" if mode else "--dtypes"
            raise ValueError(f"{flag}: got {d!r}; accepted: {'|'.join(accepted)}")
    if args.layouts and not args.linears:
        raise ValueError("--layouts: only with --linears")
    if args.burn_in and (args.linears or args.mlp or args.qk):   # it was ignored without a word
        raise ValueError(f"--burn-in: got {args.burn_in}; accepted: 0 with --linears, --mlp or --qk "
                         "(the burn-in follows the --shapes table)")
    check_alignment(args)
    if args.reps < 3:
        raise ValueError(f"--reps: got {args.reps}; need >= 3 for a median")
    require_float(args.burn_in, "--burn-in", 0.0)
    args.peak_flops = parse_peaks(args.peak_flops)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    shapes, linears, mlp, qk, dtypes = args.shapes, args.linears, args.mlp, args.qk, args.dtypes
    if not torch.cuda.is_available():
        raise RequestError("needs a CUDA GPU (it times the products with CUDA events); none is visible. It has no "
                           "CPU variant: run it on the GPU machine, e.g. python -m scripts.bench_gemm --dtypes bf16,fp8")
    device = torch.device("cuda")
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    spec = detect_device(device)
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    notes: list[str] = []   # said after the header, which stays the first line
    peaks = resolve_peaks(spec, dtypes, args.peak_flops, say=notes.append)
    header = {"device": spec.name, "cc": spec.cc, "sms": spec.sms, "l2_mb": round(l2 / 2**20),
              "torch": torch.__version__, "triton": triton_version(), "cuda": torch.version.cuda,
              "cublas": torch.backends.cuda.preferred_blas_library().name
              if hasattr(torch.backends.cuda, "preferred_blas_library") else "?",
              # what each row's pct_of_peak divides by, and where it comes from: GB10's table peaks are
              # spec-derived (its GEMMs reach ~2/3 of bf16's); the rows alone could not be checked
              "peak_tflops": {d: None if v is None else v / 1e12 for d, v in peaks.items()},
              "peak_source": (f"--peak-flops for {','.join(args.peak_flops)}; the rest: " if args.peak_flops else "")
              + spec.source}
    print(json.dumps({"header": True, **header}), flush=True)
    for note in notes:
        print(note, flush=True)
    if mlp or qk:   # Triton GEMMs and compiled passes: the workarounds training applies (ptxas on a GB10, ...)
        apply_patches(spec, kernel="triton", compile=True)
    if linears:
        return _run_linears(linears, dtypes, args.reps, l2, spec, peaks, device, args.layouts)
    if mlp:
        return _run_mlp(*mlp, dtypes, args.reps, l2, spec, peaks, device)
    if qk:
        return _run_qk(*qk, args.reps, l2, spec, peaks, device)
    rows = []
    for dtype in dtypes:
        peak = peaks[dtype]
        for shape in shapes:
            rec = {"dtype": dtype, "shape": "x".join(map(str, shape)), "device": spec.name}
            try:
                rec.update(time_gemm(dtype, shape, reps=args.reps, l2_bytes=l2, device=device, peak=peak))
            except (RuntimeError, TypeError, ValueError) as exc:
                rec["unsupported"] = str(exc).splitlines()[0][:160]
            print(json.dumps(rec), flush=True)
            rows.append(rec)
            torch.cuda.empty_cache()
    if args.burn_in > 0:
        burn_in(args.burn_in, shapes[0], device, lambda r: print(json.dumps(r), flush=True))
    print(f"\n{'dtype':<12} {'shape (MxNxK)':<20} {'TFLOP/s':>9} {'% peak':>7} {'spread%':>8}")
    for r in rows:
        if "unsupported" in r:
            print(f"{r['dtype']:<12} {r['shape']:<20} {'n/a':>9}  unsupported: {r['unsupported'][:60]}")
        else:
            print(f"{r['dtype']:<12} {r['shape']:<20} {r['tflops']:>9} {str(r['pct_of_peak']):>7} "
                  f"{r['spread_pct']:>8}")
    return 0


def _timed_row(rec: dict, dtype: str, shape, make, reps: int, l2: int, peak, device) -> dict:
    """rec + time_gemm's figures + pct_of_peak, printed as one JSON line."""
    rec.update(time_gemm(dtype, shape, reps=reps, l2_bytes=l2, device=device, make=make, peak=peak))
    print(json.dumps(rec), flush=True)
    torch.cuda.empty_cache()
    return rec


def _run_linears(linears, dtypes, reps, l2, spec, peaks, device, layouts: bool = False) -> int:
    rows = []
    for dtype in dtypes:
        peak = peaks[dtype]
        for m, k, n in linears:
            for pass_ in (LAYOUT_PASSES if layouts and dtype == "bf16" else PASSES):
                shape = linear_pass_shape(pass_, m, k, n)
                rec = {"dtype": dtype, "linear": f"{m}:{k}x{n}", "pass": pass_,
                       "shape": "x".join(map(str, shape)), "device": spec.name}
                make = functools.partial(make_linear_pass, dtype, pass_, m, k, n, device)
                rows.append(_timed_row(rec, dtype, shape, make, reps, l2, peak, device))
    print(f"\n{'dtype':<6} {'linear M:INxOUT':<18} {'pass':<9} {'ms':>8} {'TFLOP/s':>9} {'% peak':>7}")
    for r in rows:
        print(f"{r['dtype']:<6} {r['linear']:<18} {r['pass']:<9} {r['ms']:>8} {r['tflops']:>9} "
              f"{str(r['pct_of_peak']):>7}")
    return 0


def _run_mlp(m, c, dtypes, reps, l2, spec, peaks, device) -> int:
    """Time the four MLP variants per dtype; TFLOP/s counts the GEMM's FLOPs only, so the
    elementwise pass shows as lost throughput on the cuBLAS rows."""
    rows = []
    for dtype in dtypes:
        peak = peaks[dtype]
        for variant in ("fwd/cublas", "fwd/fused", "bwd/cublas", "bwd/fused"):
            rec = {"mlp": f"{m}:{c}", "dtype": dtype, "variant": variant, "shape": f"{m}x{4 * c}x{c}",
                   "device": spec.name}
            make = functools.partial(make_mlp_pass, variant, m, c, device, dtype)
            rows.append(_timed_row(rec, dtype, (m, 4 * c, c), make, reps, l2, peak, device))
    print(f"\n{'mlp M:C':<12} {'dtype':<6} {'variant':<11} {'ms':>8} {'GEMM TFLOP/s':>13}")
    for r in rows:
        print(f"{r['mlp']:<12} {r['dtype']:<6} {r['variant']:<11} {r['ms']:>8} {r['tflops']:>13}")
    return 0


def _run_qk(m, c, reps, l2, spec, peaks, device) -> int:
    rows = []
    for variant in ("cublas", "cublas+rope", "fused"):
        rec = {"qk": f"{m}:{c}", "dtype": "bf16", "variant": variant, "shape": f"{m}x{c}x{c}", "device": spec.name}
        make = functools.partial(make_qk_pass, variant, m, c, device)
        rows.append(_timed_row(rec, "bf16", (m, c, c), make, reps, l2, peaks["bf16"], device))
    print(f"\n{'qk M:C':<12} {'variant':<12} {'ms':>8} {'GEMM TFLOP/s':>13}")
    for r in rows:
        print(f"{r['qk']:<12} {r['variant']:<12} {r['ms']:>8} {r['tflops']:>13}")
    return 0


if __name__ == "__main__":
    script_main("bench_gemm", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
