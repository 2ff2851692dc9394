"""Attention at d20 shapes and a sweep of flex_attention kernel_options for the window layers.

Usage (GPU box; every flex row runs the compiled kernel, as training does):
  python3 -m scripts.bench_attention                         # d20: B=32, 10 heads, T=2048, D=128
  python3 -m scripts.bench_attention --only f128x128_w8_s2,b64x64_w4_s3 --reps 30
  python3 -m scripts.bench_attention --configs '[{"fwd_BLOCK_M": 128, "bwd_num_warps": 4}]'
  python3 -m scripts.bench_attention --configs sweep.json    # a file holding such a JSON list
  python3 -m scripts.bench_attention --no-sweep              # baselines only

Rows, each forward+backward of one attention layer through nanochat.attention.attention(), median
of --reps after --warmup calls, timed with CUDA events (torch.cuda.synchronize before reading):
  sdpa_causal      F.scaled_dot_product_attention(is_causal=True) (the full layers)
  flex_causal      flex_attention with a causal block mask, torch's kernel heuristics
  window_default   flex window --window (default T/4), torch's heuristics (kernel_options={})
  window_cudnn     the window layer through cuDNN's band-masked kernel (--attn-backend cudnn)
  causal_cudnn_fa4 / window_cudnn_fa4   the full / window layer through cuDNN's forward and
                   FlashAttention-4's backward (--attn-backend cudnn_fa4; needs flash-attn-4)
  window_tuned     the same under nanochat's FLEX_TUNED_OPTIONS entry for this GPU, if any
  <name>           the window layer under each sweep config (built-in SWEEP, or --configs)

Each window row's output and q/k/v gradients are compared with window_default (max abs error;
`err_flag` above 2e-2). A config that fails to compile or launch (e.g. out of shared memory) is
an error row and the sweep goes on. TFLOP/s counts only unmasked score entries: forward
4*B*H*D*pairs, backward 2.5x that. Output: one JSON line per row, then a table sorted by time
with the speed-up over window_default. Each config recompiles (roughly 20-60 s); split long
sweeps with --only to stay under a job time limit. A winner becomes the default through
FLEX_TUNED_OPTIONS in nanochat/attention.py (keyed by compute capability).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanochat import attention as A
from nanochat.errors import RequestError
from nanochat.flags import FlagParser, script_main

ERR_FLAG = 2e-2

# Candidates for H100 (sm_90, 227 KiB shared memory per block), head dim 128, bf16. Torch's own
# choice there: forward 128x64 (M x N), 8 warps, 3 stages; backward M1/N1/M2/N2 = 64/128/128/64,
# 8 warps, 3 stages (torch/_inductor template heuristics). Forward-only (f*) and backward-only
# (b*) variations, so the best of each can be combined with --configs.
SWEEP: dict[str, dict] = {
    "f128x128_w8_s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "f128x128_w8_s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "f128x64_w4_s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "f64x64_w4_s3": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "f64x128_w4_s3": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "b64x64_w4_s3": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                     "bwd_num_warps": 4, "bwd_num_stages": 3},
    "b32x64_w4_s3": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
                     "bwd_num_warps": 4, "bwd_num_stages": 3},
    "b64x128_w8_s2": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                      "bwd_num_warps": 8, "bwd_num_stages": 2},
    "b128x128_w8_s2": {"bwd_BLOCK_M1": 128, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128,
                       "bwd_BLOCK_N2": 128, "bwd_num_warps": 8, "bwd_num_stages": 2},
    "tma": {"USE_TMA": True},
    "prescale_qk": {"PRESCALE_QK": True},
    # May be an error row: some torch versions reject a 64 mask in the backward (attention.py).
    "bs64": {"BLOCK_SIZE": 64, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "bwd_BLOCK_M1": 64,
             "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64},
    "bs256": {"BLOCK_SIZE": 256},
}


@dataclass
class BenchConfig:
    batch: int = 32
    heads: int = 10
    kv_heads: int = 10
    seq: int = 2048
    head_dim: int = 128
    window: int = 512
    reps: int = 20
    warmup: int = 3
    device: str = "cuda"
    sweep: dict = field(default_factory=dict)  # name -> kernel options


def _load_configs(text: str) -> dict:
    """--configs: inline JSON or a path to a JSON file; a list of option dicts (optionally with
    a "name"), or a {name: options} dict."""
    source = text if text.lstrip().startswith(("[", "{")) else None
    if source is None:
        path = Path(text)
        if not path.is_file():
            raise ValueError(f"--configs: {text!r} is neither inline JSON nor an existing file")
        source = path.read_text()
    try:
        data = json.loads(source)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--configs: invalid JSON ({exc})") from None
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list):
        items = []
        for i, opts in enumerate(data):
            if not isinstance(opts, dict):
                raise ValueError(f"--configs: entry {i} is {type(opts).__name__}, expected an object")
            opts = dict(opts)
            items.append((str(opts.pop("name", f"cfg{i}")), opts))
    else:
        raise ValueError("--configs: expected a JSON list of option objects or a {name: options} object")
    names = [name for name, _ in items]
    if len(set(names)) < len(names):   # dict(items) kept the last of them: a config silently not run
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"--configs: got the name {dup!r} twice; accepted: a distinct \"name\" per config")
    return dict(items)


def parse_args(argv=None) -> BenchConfig:
    """Parse and validate every flag (no CUDA work); raises ValueError naming the flag."""
    p = FlagParser(prog="python -m scripts.bench_attention", description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=10, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=None, help="default: seq // 4 (the S layers)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--configs", default=None, help="JSON list of kernel_options dicts, or a file")
    p.add_argument("--only", default=None, help="comma list of built-in sweep names")
    p.add_argument("--no-sweep", action="store_true", help="baselines only")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    for flag in ("batch", "heads", "seq", "head_dim"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: got {getattr(args, flag)}; need >= 1")
    kv_heads = args.heads if args.kv_heads is None else args.kv_heads
    if kv_heads < 1 or args.heads % kv_heads:
        raise ValueError(f"--kv-heads: got {kv_heads}; need >= 1 and dividing --heads={args.heads}")
    window = args.seq // 4 if args.window is None else args.window
    if not 1 <= window < args.seq:
        raise ValueError(f"--window: got {window}; need 1 <= window < --seq={args.seq} "
                         "(a window covering every key is full causal attention)")
    if args.reps < 3:
        raise ValueError(f"--reps: got {args.reps}; need >= 3 for a median")
    if args.warmup < 1:
        raise ValueError(f"--warmup: got {args.warmup}; need >= 1 (the first call compiles)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device: got {args.device!r}; accepted: cuda or cuda:N") from None
    if device.type != "cuda":
        raise ValueError(f"--device: got {args.device!r}; this benchmark times CUDA kernels, "
                         "accepted: cuda or cuda:N")
    sweep: dict = {}
    if args.configs is not None and args.only is not None:
        raise ValueError("--only selects built-in configs; do not combine it with --configs")
    if args.configs is not None:
        sweep = _load_configs(args.configs)
    elif args.only is not None:
        for name in args.only.split(","):
            if name not in SWEEP:
                raise ValueError(f"--only: unknown config {name!r}; accepted: {', '.join(SWEEP)}")
            sweep[name] = SWEEP[name]
    elif not args.no_sweep:
        sweep = dict(SWEEP)
    for name, opts in sweep.items():
        try:
            A.validate_flex_kernel_options(opts)
        except ValueError as exc:
            raise ValueError(f"--configs: config {name!r}: {exc}") from None
    return BenchConfig(batch=args.batch, heads=args.heads, kv_heads=kv_heads, seq=args.seq,
                       head_dim=args.head_dim, window=window, reps=args.reps, warmup=args.warmup,
                       device=str(device), sweep=sweep)


def visible_pairs(T: int, window: int | None) -> int:
    """Number of (query, key) pairs a causal (windowed) mask keeps over T tokens."""
    if window is None or window >= T:
        return T * (T + 1) // 2
    return window * (window + 1) // 2 + (T - window) * window


def fwd_bwd_flops(cfg: BenchConfig, window: int | None) -> float:
    """Unmasked FLOPs of forward (QK^T and PV: 4*D per pair) plus backward (2.5x forward)."""
    return 3.5 * 4 * cfg.batch * cfg.heads * cfg.head_dim * visible_pairs(cfg.seq, window)


def time_layer(fn, q, k, v, grad_out, reps: int, warmup: int):
    """Median ms of fwd+bwd and of fwd alone; also the last output and q/k/v gradients."""
    for _ in range(warmup):
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize()
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(reps)]
    for e0, e1, e2 in events:
        e0.record()
        out = fn(q, k, v)
        e1.record()
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        e2.record()
    torch.cuda.synchronize()
    total = statistics.median(e0.elapsed_time(e2) for e0, _, e2 in events)
    fwd = statistics.median(e0.elapsed_time(e1) for e0, e1, _ in events)
    return total, fwd, out.detach(), [g.detach() for g in grads]


def max_errors(out, grads, ref) -> dict:
    names = ("out", "dq", "dk", "dv")
    return {n: (a.float() - b.float()).abs().max().item() for n, a, b in zip(names, [out, *grads], ref)}


def run_row(cfg: BenchConfig, name: str, kind: str, options, window, backend, tensors, ref=None):
    """Time one row; options None leaves nanochat's automatic choice, a dict sets it."""
    q, k, v, grad_out = tensors
    shown = A.flex_options_for(q.device, q.size(-1), q.dtype) if options is None else options
    rec = {"name": name, "kind": kind, "window": window, "config": shown}
    try:
        A.set_flex_kernel_options(options)
        torch._dynamo.reset()  # a fresh compile per config (and no recompile limit)
        fn = lambda q_, k_, v_: A.attention(q_, k_, v_, window=window, backend=backend)
        ms, ms_fwd, out, grads = time_layer(fn, q, k, v, grad_out, cfg.reps, cfg.warmup)
    except Exception as exc:  # noqa: BLE001 - any compile/launch failure is a reported row
        lines = str(exc).strip().splitlines() or [""]
        rec["error"] = f"{type(exc).__name__}: {lines[0][:300]}"
        torch.cuda.synchronize()  # a sticky CUDA error aborts the sweep here, loudly
        return rec, None
    finally:
        A.set_flex_kernel_options(None)
    rec.update(ms=round(ms, 4), ms_fwd=round(ms_fwd, 4), ms_bwd=round(ms - ms_fwd, 4),
               tflops=round(fwd_bwd_flops(cfg, window) / (ms * 1e-3) / 1e12, 1))
    if ref is not None:
        # a NaN error (a config computing garbage) compared False with ERR_FLAG and Python's max()
        # dropped it unless it came first, so the row was not flagged, and json.dumps printed a
        # NaN literal that strict JSON readers reject: non-finite errors are null and flagged
        errs = {n: e if math.isfinite(e) else None for n, e in max_errors(out, grads, ref).items()}
        finite = [e for e in errs.values() if e is not None]
        rec["max_err"] = max(finite) if len(finite) == len(errs) else None
        rec["errs"] = {n: None if e is None else float(f"{e:.3g}") for n, e in errs.items()}
        rec["err_flag"] = rec["max_err"] is None or rec["max_err"] > ERR_FLAG
    return rec, (out, *grads)


def print_table(rows: list[dict]) -> None:
    base = next((r.get("ms") for r in rows if r["name"] == "window_default"), None)
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    print(f"\n{'name':<20} {'ms fwd+bwd':>10} {'fwd':>7} {'bwd':>7} {'TFLOP/s':>8} {'speed-up':>8} "
          f"{'max err':>9}  config")
    for r in ok:
        speed = f"{base / r['ms']:.3f}x" if base and r["kind"] == "window" else "-"
        shown = "non-finite" if r.get("max_err", 0) is None else f"{r.get('max_err', 0):.2e}"
        err = shown + (" !" if r.get("err_flag") else "") if "max_err" in r else "-"
        print(f"{r['name']:<20} {r['ms']:>10.3f} {r['ms_fwd']:>7.3f} {r['ms_bwd']:>7.3f} "
              f"{r['tflops']:>8.1f} {speed:>8} {err:>9}  {json.dumps(r['config'])}")
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<20} {'error':>10}  {r['error'][:100]}  {json.dumps(r['config'])}")
    print(f"(speed-up: window_default ms / row ms; '!' marks max err > {ERR_FLAG})")


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if not torch.cuda.is_available():
        raise RequestError("--device cuda: needs a CUDA GPU; none is visible. It has no CPU variant (it times the "
                           "GPU attention kernels): run it on the GPU machine, e.g. python -m scripts.bench_attention "
                           "--no-sweep")
    import triton

    device = torch.device(cfg.device)
    header = {"device": torch.cuda.get_device_name(device),
              "cc": ".".join(map(str, torch.cuda.get_device_capability(device))),
              "torch": torch.__version__, "triton": triton.__version__,
              "shape": {"batch": cfg.batch, "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                        "seq": cfg.seq, "head_dim": cfg.head_dim, "window": cfg.window}}
    print(json.dumps({"header": True, **header}), flush=True)
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda h: torch.randn(cfg.batch, h, cfg.seq, cfg.head_dim, device=device, generator=g,
                               dtype=torch.bfloat16).requires_grad_()
    q, k, v = mk(cfg.heads), mk(cfg.kv_heads), mk(cfg.kv_heads)
    grad_out = torch.randn(q.shape, device=device, generator=g, dtype=torch.bfloat16)
    tensors = (q, k, v, grad_out)
    rows = []

    def emit(rec):
        rec = {"device": header["device"], "torch": header["torch"], "triton": header["triton"], **rec}
        print(json.dumps(rec), flush=True)
        rows.append(rec)

    emit(run_row(cfg, "sdpa_causal", "causal", {}, None, "sdpa_flex", tensors)[0])
    emit(run_row(cfg, "flex_causal", "causal", {}, None, "flex", tensors)[0])
    rec, ref = run_row(cfg, "window_default", "window", {}, cfg.window, "sdpa_flex", tensors)
    emit(rec)
    if ref is None:
        print("window_default failed: no reference for the sweep's error check", flush=True)
    from nanochat.cudnn_attention import probe

    reason = probe(device)
    if reason is None:
        emit(run_row(cfg, "window_cudnn", "window", {}, cfg.window, "sdpa_cudnn", tensors, ref)[0])
    else:
        emit({"name": "window_cudnn", "kind": "window", "window": cfg.window, "config": {}, "error": reason})
    from nanochat.fa4_attention import probe as fa4_probe

    reason = fa4_probe(device)
    for name, kind, window in (("causal_cudnn_fa4", "causal", None), ("window_cudnn_fa4", "window", cfg.window)):
        if reason is None:
            emit(run_row(cfg, name, kind, {}, window, "cudnn_fa4", tensors, ref if window else None)[0])
        else:
            emit({"name": name, "kind": kind, "window": window, "config": {}, "error": reason})
    if A.flex_options_for(device, cfg.head_dim, torch.bfloat16) is not None:
        emit(run_row(cfg, "window_tuned", "window", None, cfg.window, "sdpa_flex", tensors, ref)[0])
    for name, opts in cfg.sweep.items():
        emit(run_row(cfg, name, "window", opts, cfg.window, "sdpa_flex", tensors, ref)[0])
        torch.cuda.empty_cache()
    print_table(rows)
    return 0


if __name__ == "__main__":
    script_main("bench_attention", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
