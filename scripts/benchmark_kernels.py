"""Loss-kernel and precision benchmark: python -m scripts.benchmark_kernels [--mode loss|model|both|cast|rope]

loss mode: the fused linear + softcap + cross-entropy alone at (--rows, --n-embd, --vocab):
  for each --kernels backend (current: the model's default loss, as --kernel current trains),
  forward+backward time (CUDA events, median of --reps), peak memory above the inputs, and loss /
  grad agreement against `current` (relative L2 error). --compile also compiles each loss
  function (how the model uses it).
model mode: the real GPT (nanochat.gpt via nanochat.training.build_model) at --depth and
  --device-batch-size x --seq: for each kernel x precision, the same initial weights and batch;
  median forward+backward time -> tok/s and MFU (estimate_flops vs the dense bf16 peak: each row's
  mfu_peak_tflops and peak_source say which), peak memory, and the loss / lm_head-grad agreement with
  current+bf16, which runs first (without it in the lists: the first row measured; each row's `ref`
  says which). The optimizer is left out on purpose (scripts/bench_train.py times whole training steps).
cast mode: the fp8 cast + transpose pass at (--rows, --n-embd) and (--rows, 4 x --n-embd) for a
  set of tiles: ms, GB/s and bit-equality with the default tile (CUDA only; e.g. --rows 65536).
rope mode: the QK-norm + RoPE backward of one (--device-batch-size, --seq, n_embd / 128, 128)
  tensor, compiled plain (gpt._RotaryNorm's math) vs --kernel triton's one Triton pass, for both
  gradient layouts: ms, GB/s and the max difference (CUDA only).

Output: one JSON line per result, then a table. Needs a CUDA GPU (loss mode also runs on CPU,
slowly, for a smoke test: --device cpu). Exit status: 1 when any row failed (EXIT_STATUS, shown by --help).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from nanochat.flags import FlagParser, require, require_float, script_main
from nanochat.kernels import build_loss_fn, cross_entropy_loss
from nanochat.platform import apply_patches, check_benchmark_device, detect_device, peak_flops, triton_version

COMPILE_MODES = ("default", "reduce-overhead")
EXIT_STATUS = """exit status: 0 when every requested row was measured; 1 when any row failed (a kernel or
precision that cannot run here, a non-finite loss, cast / rope without a CUDA GPU): the measured rows
are still printed, each failed one carries an "error" field, and stderr says how many failed, or
"nothing measured" when none was; 2 for a bad flag or a request this machine cannot meet. Leave out of
--kernels / --precisions what this machine cannot run (liger on a CPU) for a CI check to pass."""
# --kernels without liger, which needs a CUDA GPU: its error row made the smoke run exit 1
SMOKE_RUN = ("python -m scripts.benchmark_kernels --device cpu --mode loss --kernels current,triton --rows 256 "
             "--n-embd 64 --vocab 512 --reps 3 --no-compile")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _timed(fn, reps: int, device, inner: int = 1) -> float:
    """Median milliseconds of fn() (CUDA events; elsewhere the wall clock between synchronisations).
    `inner` > 1 times that many back-to-back calls per sample and divides: for kernels of ~0.1 ms, whose
    launch from Python (~20-40 us) would otherwise sit inside a single call's events while the
    GPU waits; queued back to back, the launches overlap the previous call's work, as in training."""
    import time
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / inner)
        else:
            # MPS queues its work like CUDA: without a synchronize on either side the clock timed
            # the launches (model mode on a Mac printed a tok/s and MFU of the host's Python alone)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            samples.append((time.perf_counter() - t0) * 1e3 / inner)
    return statistics.median(samples)


def _sync(device) -> None:
    if device.type == "mps":
        torch.mps.synchronize()


# model mode's rows are compared with this (kernel, precision), as the docstring says
MODEL_REFERENCE = ("current", "bf16")
LOSS_VOCAB = 65536    # loss mode: a large head, where fusing the loss matters most
MODEL_VOCAB = 32768   # model mode: the tokenizer default, so MFU matches bench_train / base_train


def bench_loss(args, device) -> list[dict]:
    n, c, vocab = args.rows, args.n_embd, args.vocab if args.vocab is not None else LOSS_VOCAB
    vpad = (vocab + 127) // 128 * 128
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(n, c, generator=g).to(device, dtype)
    weight = (torch.randn(vpad, c, generator=g) / c**0.5).to(device, dtype)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[: n // 10]] = -1   # some ignored positions
    targets = targets.to(device)
    rows, ref = [], None
    # `current` first: the rows are compared with it, and a row run before it (--kernels triton,current)
    # printed no agreement at all
    for name in sorted(args.kernels, key=lambda k: k.partition("@")[0] != "current"):
        rec = {"mode": "loss", "kernel": name, "rows": n, "n_embd": c, "vocab": vocab,
               "compile": args.compile, "dtype": str(dtype).replace("torch.", "")}
        try:
            base, _, chunk = name.partition("@")   # triton@8192: rows per chunk
            # `current` = what --kernel current trains with (the model's cross_entropy_loss, saving
            # bf16 logits); build_loss_fn("current") is the fp32 reference chain the tests compare
            # with, whose time and memory (two fp32 (N, V) tensors kept) this row used to print
            fn = cross_entropy_loss if base == "current" else build_loss_fn(base, device, chunk_rows=int(chunk or 0))
            if args.compile:
                fn = torch.compile(fn)
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()

            def step():
                h.grad = w.grad = None
                loss = fn(h, w, targets, args.softcap, vocab, "mean")
                loss.backward()
                return loss

            for _ in range(3):
                loss = step()   # warm-up: compile, autotune
            # the warm-up's gradients were counted in the baseline and freed by the first timed
            # step: the peak "above the inputs" came out short by the size of h and w
            h.grad = w.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                mem0 = torch.cuda.memory_allocated()
            ms = _timed(step, args.reps, device)
            if device.type == "cuda":
                rec["peak_mem_gib"] = round((torch.cuda.max_memory_allocated() - mem0) / 2**30, 3)
            loss = step()
            result = (loss.detach(), h.grad.detach().clone(), w.grad.detach().clone())
            rec.update(ms=round(ms, 3), loss=round(loss.item(), 5))
            flops = 6.0 * n * c * vocab
            rec["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
            if ref is None and base == "current":
                ref = result
            if ref is not None:
                rec.update(loss_rel_err=_rel(result[0], ref[0]), grad_hidden_rel_err=_rel(result[1], ref[1]),
                           grad_weight_rel_err=_rel(result[2], ref[2]))
        except (RuntimeError, ValueError) as exc:
            rec["error"] = error_text(exc)
        print(json.dumps(finite_row(rec)), flush=True)
        rows.append(rec)
    return rows


def error_text(exc: BaseException) -> str:
    """A failed row's error: the exception's type and first line, whole up to ERROR_CHARS. It was cut at
    160 characters, which ended precision.py's refusals mid-list ("accepted on this device: --precision
    auto|bf16|fp32, "): the part saying what this machine can run was lost."""
    lines = str(exc).splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0][:ERROR_CHARS]}"


ERROR_CHARS = 400


def finite_row(rec: dict) -> dict:
    """`rec` with its non-finite figures (a kernel returning NaN or inf: the loss, an error against
    current) set to null and named in its error: json.dumps wrote them as NaN / Infinity literals,
    which strict JSON readers reject, and the row read as a result."""
    bad = [k for k, v in rec.items() if isinstance(v, float) and not math.isfinite(v)]
    for k in bad:
        rec[k] = None
    if bad:
        rec.setdefault("error", f"non-finite {', '.join(bad)}")
    return rec


@torch.no_grad()
def _perturb_zero_init(model) -> None:
    """The GPT starts with zero output projections (every block is the identity), which would
    hide any precision difference in the first loss/grad: give them small random values
    (same seed for every configuration)."""
    g = torch.Generator(device="cpu").manual_seed(1)
    for p in model.parameters():
        if p.dim() == 2 and not p.any():
            p.copy_(0.02 * torch.randn(p.shape, generator=g))


def bench_model(args, rt) -> list[dict]:
    from nanochat.gpt import config_for_depth
    from nanochat.training import build_model, setup_precision_and_kernel

    spec = detect_device(rt.device)
    peak = peak_flops(spec, "bf16", args.peak_flops)
    if peak is None:
        print(f"MFU n/a: '{spec.name}' is not in nanochat/device_table.py; pass --peak-flops <dense bf16 FLOP/s>",
              flush=True)
    # what mfu_pct divides by, and where it comes from: GB10's table peak is spec-derived, and a row
    # saying only "mfu_pct" could not be told from one against a measured peak
    peak_label = {"mfu_peak_tflops": None if peak is None else round(peak / 1e12, 3),
                  "peak_source": None if peak is None else "--peak-flops" if args.peak_flops else spec.source}
    g = torch.Generator().manual_seed(0)
    vocab = args.vocab if args.vocab is not None else MODEL_VOCAB
    data = torch.randint(0, vocab, (args.device_batch_size, args.seq + 1), generator=g).to(rt.device)
    x, y = data[:, :-1], data[:, 1:].clone()
    y[:, : args.seq // 8] = -1   # an ignored prefix, as in SFT batches
    config = config_for_depth(args.depth, vocab, args.seq)
    rows, ref = [], None
    from scripts.bench_train import runtime_for
    kernels = dict.fromkeys(k.partition("@")[0] for k in args.kernels)
    # the reference configuration first (MODEL_REFERENCE): the first row run was the reference, so with
    # --kernels triton,current every row was compared with triton's, and no row said with what
    configs = sorted(((entry, kernel) for entry in args.precisions for kernel in kernels),
                     key=lambda c: (c[1], c[0].partition(":")[0]) != MODEL_REFERENCE)
    for entry, kernel in configs:
        precision, _, backend = entry.partition(":")   # e.g. nvfp4:emulated
        # each precision in its own compute dtype, as base_train starts its runtime from --precision:
        # in the process's one dtype, bf16 failed on a CPU (fp32) and fp32 on a GPU (bf16), with a
        # hint to "start the run in bf16" that no flag of this script can follow
        prt = runtime_for(rt, precision)
        rec = {"mode": "model", "depth": args.depth, "vocab": vocab, "kernel": kernel, "precision": entry,
               "batch": args.device_batch_size, "seq": args.seq, "compile": args.compile,
               "compile_mode": args.compile_mode,
               "device": spec.name}
        try:
            torch.manual_seed(0)
            model = build_model(config, rt.device, compute_dtype=prt.dtype)
            _perturb_zero_init(model)
            info = setup_precision_and_kernel(model, precision, kernel, prt, compile=args.compile,
                                              precision_backend=backend or "auto")
            mode = None if args.compile_mode == "default" else args.compile_mode
            run = torch.compile(model, dynamic=False, mode=mode) if args.compile else model

            def step():
                model.zero_grad(set_to_none=True)
                if mode == "reduce-overhead":   # a new iteration: the last one's graph outputs may be reused
                    torch.compiler.cudagraph_mark_step_begin()
                loss = run(x, y)
                loss.backward()
                return loss

            if mode == "reduce-overhead":   # the graphs' memory pool is allocated while they are recorded
                rt.reset_peak_memory()
            for _ in range(3):
                step()
            rt.synchronize()
            if mode != "reduce-overhead":
                rt.reset_peak_memory()
            ms = _timed(step, args.reps, rt.device)
            # copies: a CUDA graph's outputs are overwritten by its next replay (and by the next
            # configuration's graphs, which share the pool) while `ref` is still compared against
            loss = step().detach().clone()
            head_grad = model.lm_head.weight.grad.detach().float().clone()
            tok_s = args.device_batch_size * args.seq / (ms * 1e-3)
            rec.update(ms=round(ms, 2), tok_per_sec=round(tok_s), loss=round(loss.item(), 5),
                       peak_mem_gib=round(rt.peak_memory_bytes() / 2**30, 2),
                       resolved=info.get("backend"),
                       mfu_pct=round(100 * model.estimate_flops() * tok_s / peak, 1) if peak else None,
                       **peak_label)
            if ref is None:   # the reference, or (not asked for, or it failed) the first row measured
                ref = (loss, head_grad, f"{kernel}/{entry}")
            rec.update(loss_rel_err=_rel(loss, ref[0]), head_grad_rel_err=_rel(head_grad, ref[1]), ref=ref[2])
            model = run = None   # free before the next configuration is built
        except (RuntimeError, ValueError) as exc:
            rec["error"] = error_text(exc)
        print(json.dumps(finite_row(rec)), flush=True)
        rows.append(rec)
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()
    return rows


CAST_TILES = tuple((bm, bn, w, nf) for nf in (False, True) for bm, bn, w in (
    (64, 64, 4), (32, 128, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8), (64, 256, 8),
    (256, 64, 8), (32, 64, 2), (64, 32, 2)))


def bench_cast(args, device) -> list[dict]:
    """The fp8 cast + transpose pass (precision.py's wgrad input, triton_kernels.py) at d20's
    activation shapes, for each tile (BLOCK_M, BLOCK_N, warps); outputs must be bit-equal to the
    width-picked default tile's. Traffic = 2 bytes read + 2 x 1 byte written per element."""
    from nanochat.triton_kernels import fp8_cast_transpose_triton
    if device.type != "cuda":
        return [{"mode": "cast", "kernel": "-", "error": "needs a CUDA GPU"}]
    rows = []
    for m, n in ((args.rows, args.n_embd), (args.rows, 4 * args.n_embd)):
        x = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        scale = (448.0 / x.abs().amax().float()).reshape(1)
        ref = fp8_cast_transpose_triton(x, scale, torch.float8_e4m3fn, 448.0)
        for tile in CAST_TILES:
            got = fp8_cast_transpose_triton(x, scale, torch.float8_e4m3fn, 448.0, tile)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, got))
            ms = _timed(lambda: fp8_cast_transpose_triton(x, scale, torch.float8_e4m3fn, 448.0, tile),
                        args.reps, device, inner=20)
            name = "x".join(map(str, tile[:2])) + f"w{tile[2]}" + ("n" if tile[3] else "m")   # n: row-band order
            rows.append({"mode": "cast", "kernel": name, "shape": [m, n],
                         "ms": ms, "gbs": traffic_gbs(4 * m * n, ms), "bit_equal": same})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_rope(args, device) -> list[dict]:
    """fused_norm's QK-norm + RoPE backward: the compiled torch twin vs the Triton pass. Traffic =
    3 tensors of 2-byte elements (gradient and saved output read, input gradient written)."""
    from nanochat import fused_norm
    from nanochat.gpt import _rms, apply_rotary, rotary_tables
    from nanochat.triton_kernels import rotary_norm_bwd_triton
    if device.type != "cuda":
        return [{"mode": "rope", "kernel": "-", "error": "needs a CUDA GPU"}]
    B, T, D = args.device_batch_size, args.seq, 128
    H = max(1, args.n_embd // D)
    cos, sin = rotary_tables(T, D, device)
    y, rstd = _rms(apply_rotary(torch.randn(B, T, H, D, device=device), cos, sin))
    y = y.bfloat16()
    c, s = (t.reshape(T, D // 2).contiguous() for t in (cos, sin))
    plain = torch.compile(fused_norm.rotary_norm_bwd_torch)
    rows = []
    for layout, dy in (("bthd", torch.randn(B, T, H, D, device=device, dtype=torch.bfloat16)),
                       ("bhtd", torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16).transpose(1, 2))):
        ref = plain(dy, y, rstd, c, s)
        for name, fn in (("compiled", lambda: plain(dy, y, rstd, c, s)),
                         ("triton", lambda: rotary_norm_bwd_triton(dy, y, rstd, c, s))):
            diff = (fn().float() - ref.float()).abs().max().item()
            ms = _timed(fn, args.reps, device, inner=20)
            rows.append({"mode": "rope", "kernel": name, "layout": layout, "shape": [B, T, H, D], "ms": ms,
                         "gbs": traffic_gbs(3 * 2 * y.numel(), ms), "max_abs_diff": diff})
            print(json.dumps(finite_row(rows[-1])), flush=True)
    return rows


def traffic_gbs(num_bytes: float, ms: float) -> float:
    """GB/s (10^9 bytes per second) of `num_bytes` moved in `ms` milliseconds. The cast and rope rows
    printed this as a string ("850GB/s") under the key "tflops": a JSON reader comparing TFLOP/s
    across rows took a bandwidth for a FLOP rate."""
    return round(num_bytes / (ms * 1e-3) / 1e9, 1)


def speed_cell(r: dict) -> str:
    """A row's rate with its unit: tok/s (model), TFLOP/s (loss) or GB/s (cast, rope). The column
    printed the bare numbers of all three ("412.3" beside "150000")."""
    for key, unit in (("tok_per_sec", "tok/s"), ("tflops", "TFLOP/s"), ("gbs", "GB/s")):
        if r.get(key) is not None:
            return f"{r[key]:,} {unit}"
    return ""


def print_table(rows: list[dict]) -> None:
    print(f"\n{'mode':<6} {'kernel':<8} {'prec':<6} {'ms':>9} {'speed':>16} {'MFU%':>6} {'memGiB':>7} "
          f"{'loss_err':>9} {'grad_err':>9}  error")
    for r in rows:
        speed = speed_cell(r)
        grad = r.get("grad_hidden_rel_err", r.get("head_grad_rel_err"))
        fmt = lambda v, f: format(v, f) if isinstance(v, (int, float)) else "n/a"  # noqa: E731
        print(f"{r['mode']:<6} {r['kernel']:<8} {r.get('precision', '-'):<6} {fmt(r.get('ms'), '.2f'):>9} "
              f"{speed:>16} {fmt(r.get('mfu_pct'), '.1f'):>6} {fmt(r.get('peak_mem_gib'), '.2f'):>7} "
              f"{fmt(r.get('loss_rel_err'), '.1e'):>9} {fmt(grad, '.1e'):>9}  {r.get('error', '')}")


def parse_args(argv=None):
    """Parse and validate every flag (no GPU work); a bad value raises ValueError naming the flag."""
    from nanochat.common import DEVICE_CHOICES
    from nanochat.precision import BACKENDS, PRECISIONS

    p = FlagParser(prog="python -m scripts.benchmark_kernels", description=__doc__.splitlines()[0],
                   epilog=EXIT_STATUS)
    p.add_argument("--mode", default="both", choices=["loss", "model", "both", "cast", "rope"])
    p.add_argument("--kernels", default="current,liger,triton")
    p.add_argument("--precisions", default="bf16,fp8", help="comma list of PREC[:BACKEND], e.g. nvfp4:emulated")
    # each size flag says the modes that read it: --rows said "loss mode" and cast mode sizes by it too,
    # --softcap said nothing of model mode's loss keeping the model's own softcap
    p.add_argument("--rows", type=int, default=16384, help="loss and cast modes: rows (B*T tokens)")
    p.add_argument("--n-embd", type=int, default=1280,
                   help="loss, cast and rope modes: the hidden width (model mode: --depth sets it)")
    p.add_argument("--vocab", type=int, default=None,
                   help="default: 65536 in loss mode, 32768 (the tokenizer default) in model mode")
    p.add_argument("--softcap", type=float, default=15.0,
                   help="loss mode's logit softcap, 0: none (model mode: the model's own)")
    p.add_argument("--depth", type=int, default=12, help="model mode: the GPT's depth")
    p.add_argument("--device-batch-size", type=int, default=16, help="model and rope modes: rows per batch")
    p.add_argument("--seq", type=int, default=2048, help="model and rope modes: tokens per row")
    p.add_argument("--reps", type=int, default=10, help="timed repeats per row (the median is printed)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="model mode: dense bf16 FLOP/s per GPU for MFU (e.g. 989e12), for GPUs not in the device table")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile-mode", default="default", choices=list(COMPILE_MODES),
                   help="model mode: torch.compile's mode; reduce-overhead replays forward and backward as CUDA "
                        "graphs (no per-kernel launch cost from Python)")
    p.add_argument("--device", default="auto", help="|".join(DEVICE_CHOICES))
    args = p.parse_args(argv)
    args.kernels = args.kernels.split(",")
    args.precisions = args.precisions.split(",")
    for k in args.kernels:
        base, _, chunk = k.partition("@")
        if base not in ("current", "liger", "triton") or (chunk and not chunk.isdigit()) or \
                ("@" in k and (base != "triton" or not chunk)):   # current@N / liger@N: the chunk was silently ignored
            raise ValueError(f"--kernels: got {k!r}; accepted: current|liger|triton (triton@ROWS sets the chunk)")
    for entry in args.precisions:
        precision, _, backend = entry.partition(":")
        require(precision in PRECISIONS and (not backend or backend in BACKENDS), "--precisions", entry,
                f"a comma list of PREC[:BACKEND], PREC {'|'.join(PRECISIONS)}, BACKEND {'|'.join(BACKENDS)}")
    vocab_check = 1 if args.vocab is None else args.vocab
    for name, v in (("--rows", args.rows), ("--n-embd", args.n_embd), ("--vocab", vocab_check),
                    ("--reps", args.reps), ("--seq", args.seq), ("--depth", args.depth),
                    ("--device-batch-size", args.device_batch_size)):
        if v < 1:
            raise ValueError(f"{name}: got {v}; must be >= 1")
    require_float(args.softcap, "--softcap", 0.0)
    if args.peak_flops is not None:   # FLOP/s; below 1e9 it was surely given in TFLOP/s
        require_float(args.peak_flops, "--peak-flops", 1e9)
    require(args.device in DEVICE_CHOICES, "--device", args.device, "|".join(DEVICE_CHOICES))
    if args.compile_mode != "default" and not args.compile:
        raise ValueError(f"--compile-mode: got {args.compile_mode!r} with --no-compile; accepted: default there "
                         "(a mode is how torch.compile compiles)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from nanochat.common import init_runtime
    check_benchmark_device(args.device, SMOKE_RUN)
    rt = init_runtime(args.device, "auto")
    if args.compile_mode == "reduce-overhead" and rt.device_type != "cuda":
        raise ValueError(f"--compile-mode: 'reduce-overhead' replays CUDA graphs, this run is on {rt.device_type}; "
                         "accepted there: default")
    # each loss backend's workarounds before loss mode runs them (a `triton` list with --no-compile
    # got kernel="current" here: no ptxas redirect for Triton <= 3.5 on a GB10); applying twice is a no-op
    for kernel in dict.fromkeys(k.partition("@")[0] for k in args.kernels):
        apply_patches(detect_device(rt.device), kernel=kernel, compile=args.compile)
    print(json.dumps({"header": True, "device": detect_device(rt.device).name, "torch": torch.__version__,
                      "triton": triton_version()}))
    rows = []
    if args.mode in ("loss", "both"):
        rows += bench_loss(args, rt.device)
    if args.mode in ("model", "both"):
        rows += bench_model(args, rt)
    if args.mode == "cast":
        rows += bench_cast(args, rt.device)
    if args.mode == "rope":
        rows += bench_rope(args, rt.device)
    print_table(rows)
    return exit_status(rows)


def exit_status(rows: list[dict]) -> int:
    """EXIT_STATUS: 1 (and a line on stderr naming the failed rows) when any row has an error, else 0.
    Every row failing exited 0 too, so a CI job whose GPU could run nothing passed."""
    failed = [r for r in rows if "error" in r]
    if rows and not failed:
        return 0
    names = ", ".join("/".join(str(r[k]) for k in ("mode", "kernel", "precision") if k in r) for r in failed)
    if len(failed) == len(rows):
        print(f"benchmark_kernels: nothing measured: all {len(rows)} row(s) failed ({names}); see each row's "
              "error", file=sys.stderr, flush=True)
    else:
        print(f"benchmark_kernels: {len(failed)} of {len(rows)} rows failed ({names}); see each row's error, "
              "or leave those kernels / precisions out", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    script_main("benchmark_kernels", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
