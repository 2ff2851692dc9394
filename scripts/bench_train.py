"""Training-step benchmark: python -m scripts.bench_train --depth 12,20 [--kernel current,triton] [--precision bf16,fp8]

For every (depth, kernel, precision) it builds the model exactly as base_train does (precision
recipe, loss kernel, torch.compile, MuonAdamW, the shared Trainer step), runs --warmup steps
(compilation, autotuning), then times --steps steps and prints one JSON line: the median
steady-state tok/s, MFU against the dense bf16 peak, utilisation of the active precision's peak
blended with bf16 for the FLOPs that stay in bf16 (util_peak_flops, low_precision_share: StepMeter's
peak_util and low_share, as base_train's banner prints them), FLOPs/token, peak memory and, on
NVIDIA GPUs, the median SM clock, power and the share of the timed steps spent at the power cap
(nanochat/gpu_monitor.py). A table follows.

A step is one optimizer step of --total-batch-size tokens, as in base_train: the default (-1) is
base_train's own auto batch for the depth (`training.resolve_total_batch_size`: 2**20 tokens = 16
micro-batches of 32 x 2048 at d20, 2**19 at d12), so the optimizer runs once per that many tokens,
exactly as in a real run. `--total-batch-size` = device batch x seq x world size runs the optimizer
after every micro-batch instead (how the figures before 2026-11-23 session 7 were measured).
Batches are synthetic random tokens by default (--data real reads the train split through the
DataLoader and the trained tokenizer).

CPU smoke run:  python -m scripts.bench_train --device cpu --depth 1 --device-batch-size 2 \
                    --seq 64 --total-batch-size 128 --steps 3 --warmup 1 --vocab-size 512 --no-compile
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import statistics
import sys
from dataclasses import dataclass

import torch

from nanochat.attention import BACKEND_CHOICES, effective_backend, resolve_backend
from nanochat.common import DEVICE_CHOICES, destroy_runtime, env_world_size, init_runtime
from nanochat.gpu_monitor import GpuMonitor
from nanochat.platform import check_benchmark_device
from nanochat.precision import BACKENDS as PRECISION_BACKENDS
from nanochat.errors import RequestError
from nanochat.flags import FlagParser, require, require_float, require_int, script_main
from nanochat.recipe import DEFAULT_RECIPE, RECIPES, resolve_recipe

MIN_GPU_STEPS = 20
SMOKE_RUN = ("python -m scripts.bench_train --device cpu --depth 1 --device-batch-size 2 --seq 64 "
             "--total-batch-size 128 --steps 3 --warmup 1 --vocab-size 512 --no-compile")
# --precision values -> the fp8 wgrad mode they set (None: not an fp8 variant; plain fp8 = "save")
UNFUSE = {"mlp": "relu2_mlp", "rope": "rotary_norm", "qkamax": "qk_amax",
          "ghcast": "gh_cast", "qkgemm": "qk_rope_gemm", "mixadd": "mix_add", "x0acc": "x0_grad_acc",
          "wcache": "cast_once", "gsink": "grad_sinks"}   # --unfuse name -> kernel_fusions entry (wcache: Trainer(cast_once=False))
PRECISIONS = {"auto": None, "bf16": None, "fp32": None, "fp8": "save", "fp8lean": "recompute", "fp8plain": "plain",
              "fp8mlp0": "save", "nvfp4": None}


@dataclass
class BenchConfig:
    depths: list[int]
    kernels: list[str]
    precisions: list[str]                  # "auto" = the runtime's dtype (bf16 on a GPU, fp32 on a CPU)
    device_batch_size: int = 32
    seq: int = 2048
    total_batch_size: int = -1
    steps: int = MIN_GPU_STEPS
    warmup: int = 3
    compile: bool | None = None
    data: str = "synthetic"
    vocab_size: int = 32768
    window_pattern: str = "SSSL"
    attn_backend: str = "auto"
    device: str = "auto"
    peak_flops: float | None = None
    aspect_ratio: int = 64
    head_dim: int = 128
    unfuse: tuple[str, ...] = ()
    precision_backends: tuple[str, ...] = ("auto",)
    recipe: str = DEFAULT_RECIPE           # the optimizer base_train builds under it (NorMuon, weight decay)


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    p = FlagParser(prog="python -m scripts.bench_train", description="Benchmark training steps.")
    p.add_argument("--depth", default="12,20", help="comma list, e.g. 12,20")
    p.add_argument("--kernel", default="current", help="comma list of current|liger|triton")
    p.add_argument("--precision", default="auto",
                   help="comma list of auto|bf16|fp32|fp8|fp8lean|fp8plain|fp8mlp0|nvfp4 (auto: bf16 on a GPU, "
                        "fp32 on a CPU; each runs in its own compute dtype; fp8 variants: the "
                        "weight-gradient input's transposed copy saved (fp8), recomputed (fp8lean) or made "
                        "by compiled copies (fp8plain): base_train --fp8-wgrad save|recompute|plain; "
                        "fp8mlp0: fp8 without --kernel triton's fused fp8 MLP)")
    p.add_argument("--precision-backend", default="auto",
                   help="comma list of fp8/nvfp4 implementations, as base_train's --precision-backend: "
                        "auto|native|te|torchao|emulated")
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--seq", "--max-seq-len", dest="seq", type=int, default=2048)
    p.add_argument("--total-batch-size", type=int, default=-1,
                   help="tokens per optimizer step; -1 = base_train's auto batch for the depth")
    p.add_argument("--steps", type=int, default=MIN_GPU_STEPS, help="timed optimizer steps (>= 20 on GPU)")
    p.add_argument("--warmup", type=int, default=3, help="untimed optimizer steps first (compilation)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--data", default="synthetic", help="synthetic|real")
    p.add_argument("--vocab-size", type=int, default=32768, help="synthetic data only")
    # these said nothing in --help: --peak-flops not even its unit (FLOP/s, not the TFLOP/s of the tables)
    p.add_argument("--window-pattern", default="SSSL", help="S (short window) and L (full) letters per layer")
    p.add_argument("--attn-backend", default="auto", help="|".join(BACKEND_CHOICES))
    p.add_argument("--device", default="auto", help="|".join(DEVICE_CHOICES))
    p.add_argument("--peak-flops", type=float, default=None,
                   help="dense bf16 FLOP/s per GPU that MFU divides by (e.g. 989e12), in place of the device "
                        "table's: a measured peak, or a GPU the table lacks")
    p.add_argument("--aspect-ratio", type=int, default=64,
                   help="model width = depth x this, rounded up to a multiple of --head-dim")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--unfuse", default="", help=f"comma list of {'|'.join(UNFUSE)}: run --kernel triton "
                   "without that fusion (the A/B of one fusion)")
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"optimizer recipe, as base_train's: {'|'.join(RECIPES)} "
                   f"(default {DEFAULT_RECIPE})")
    a = p.parse_args(argv)

    def ints(text, flag):
        try:
            return [int(v) for v in text.split(",") if v]
        except ValueError:
            raise ValueError(f"{flag}: got {text!r}; accepted: a comma list of integers") from None

    cfg = BenchConfig(depths=ints(a.depth, "--depth"), kernels=a.kernel.split(","),
                      precisions=a.precision.split(","), device_batch_size=a.device_batch_size, seq=a.seq,
                      total_batch_size=a.total_batch_size, steps=a.steps, warmup=a.warmup, compile=a.compile,
                      data=a.data, vocab_size=a.vocab_size,
                      window_pattern=a.window_pattern, attn_backend=a.attn_backend, device=a.device,
                      peak_flops=a.peak_flops, aspect_ratio=a.aspect_ratio, head_dim=a.head_dim,
                      unfuse=tuple(v for v in a.unfuse.split(",") if v),
                      precision_backends=tuple(a.precision_backend.split(",")), recipe=a.recipe)
    require(cfg.recipe in RECIPES, "--recipe", cfg.recipe, "|".join(RECIPES))
    for d in cfg.depths:
        require_int(d, "--depth", 1)
    for k in cfg.kernels:
        require(k in ("current", "liger", "triton"), "--kernel", k, "current|liger|triton")
    for pr in cfg.precisions:
        require(pr in tuple(PRECISIONS), "--precision", pr, "|".join(PRECISIONS))
    for b in cfg.precision_backends:
        require(b in PRECISION_BACKENDS, "--precision-backend", b, "|".join(PRECISION_BACKENDS))
    require_int(cfg.device_batch_size, "--device-batch-size", 1)
    require_int(cfg.seq, "--seq", 8)
    if cfg.total_batch_size != -1:
        require_int(cfg.total_batch_size, "--total-batch-size", 1)
    require_int(cfg.steps, "--steps", 1)
    require_int(cfg.warmup, "--warmup", 0)
    require(cfg.data in ("synthetic", "real"), "--data", cfg.data, "synthetic|real")
    require_int(cfg.vocab_size, "--vocab-size", 16)
    for name in cfg.unfuse:
        require(name in UNFUSE, "--unfuse", name, "|".join(UNFUSE))
    _check_before_any_model(cfg)
    return cfg


def _check_before_any_model(cfg: BenchConfig) -> None:
    """What used to fail inside every configuration (an error row each, after the runtime and the
    models were built) or, for --peak-flops, print MFU nan% / negative: checked with the flags."""
    from nanochat.gpt import config_for_depth
    from nanochat.training import plan_batch

    require(bool(cfg.depths), "--depth", "", "a comma list of integers >= 1, e.g. 12,20")
    require(cfg.device in DEVICE_CHOICES, "--device", cfg.device, "|".join(DEVICE_CHOICES))
    require(cfg.attn_backend in BACKEND_CHOICES, "--attn-backend", cfg.attn_backend, "|".join(BACKEND_CHOICES))
    require_int(cfg.aspect_ratio, "--aspect-ratio", 1)
    require(isinstance(cfg.head_dim, int) and cfg.head_dim >= 2 and cfg.head_dim % 2 == 0, "--head-dim",
            cfg.head_dim, "an even integer >= 2 (RoPE rotates pairs)")
    if cfg.peak_flops is not None:   # FLOP/s per device; below 1e9 it was surely given in TFLOP/s
        require_float(cfg.peak_flops, "--peak-flops", 1e9)
    for depth in cfg.depths:   # --window-pattern and the head split, as the model will check them
        config_for_depth(depth, cfg.vocab_size, cfg.seq, aspect_ratio=cfg.aspect_ratio, head_dim=cfg.head_dim,
                         window_pattern=cfg.window_pattern)
    if cfg.total_batch_size != -1:   # divisibility over this launch's ranks, with the numbers
        plan_batch(cfg.total_batch_size, cfg.device_batch_size, cfg.seq, env_world_size())


def runtime_for(rt, precision: str):
    """The runtime a configuration runs in: its own compute dtype (fp32 for --precision fp32, bf16
    for bf16 and the fp8/nvfp4 variants, the runtime's for auto), as base_train starts its runtime
    from --precision. One process measures several precisions, so the rows say what really ran."""
    dtype = {"auto": rt.dtype, "fp32": torch.float32}.get(precision, torch.bfloat16)
    return rt if dtype == rt.dtype else dataclasses.replace(rt, dtype=dtype)


def unfuse_model(model, names: set[str], fusions: str) -> str:
    """Turn off the named --kernel triton fusions (UNFUSE) of a set-up model; the fusions left."""
    if "mlp" in names:
        model.set_mlp_fn(None)
    elif "ghcast" in names and isinstance(model.blocks[0].mlp.fused, functools.partial):
        fn = model.blocks[0].mlp.fused   # the fp8 MLP: its relu^2 gradient cast as a separate pass
        slow = functools.partial(fn.func, *fn.args, **{**fn.keywords, "gh_cast": "pass"})
        slow.replaces = fn.replaces
        model.set_mlp_fn(slow)
    if names & {"mixadd", "x0acc"}:   # a separate pass for each block's output sum / x0 gradient sum
        model.set_mix_norm(model.mix_norm, fuse_add=model.mix_norm_fuses_add and "mixadd" not in names,
                           chain_x0=model.mix_norm_chains_x0 and "x0acc" not in names)
    if "rope" in names:
        model.set_rotary_norm(None)
    qk = model.blocks[0].attn.qkv_projection
    if "rope" in names or "qkamax" in names:   # the fused q/k path runs the rotary kernel
        model.set_qkv_projection(None)
    elif "qkgemm" in names and isinstance(qk, functools.partial):   # cuBLAS + the rotary pass
        model.set_qkv_projection(functools.partial(qk.func, *qk.args, **{**qk.keywords, "bf16_gemm": False}))
    dropped = ({UNFUSE[n] for n in names} | ({"qk_amax", "qk_rope_gemm"} if names & {"rope", "qkamax"} else set())
               | ({"gh_cast"} if "mlp" in names else set()))
    return ",".join(f for f in fusions.split(",") if f not in dropped and f.split("_fp8")[0] not in dropped) or "none"


class SyntheticBatches:
    """A few fixed random batches, cycled (host-side cost ~0, like a prefetching loader)."""

    def __init__(self, batch_size, seq, vocab, device, n=4):
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, vocab, (n, batch_size, seq + 1), generator=g)
        self.batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in data]
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return self.batches[self.i % len(self.batches)]


def _scaling_params(cfg: BenchConfig, depth: int, vocab: int) -> int:
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth
    conf = config_for_depth(depth, vocab, cfg.seq, aspect_ratio=cfg.aspect_ratio, head_dim=cfg.head_dim,
                            window_pattern=cfg.window_pattern)
    return build_model(conf, "meta").num_scaling_params()


def total_batch_for(cfg: BenchConfig, depth: int, vocab: int, world_size: int) -> int:
    """Tokens per optimizer step: --total-batch-size, or base_train's auto rule for this depth
    (its target-param-data ratio cancels: the rule compares two horizons of the same ratio)."""
    from nanochat.training import REF_DEPTH, resolve_total_batch_size

    if cfg.total_batch_size != -1:
        return cfg.total_batch_size
    return resolve_total_batch_size(-1, _scaling_params(cfg, depth, vocab), _scaling_params(cfg, REF_DEPTH, vocab),
                                    cfg.device_batch_size, cfg.seq, world_size)


def recipe_optimizer(cfg: BenchConfig, model, depth: int, vocab: int, total_batch: int, rt):
    """The optimizer base_train builds for this depth and batch under --recipe (the tokens:params
    ratio cancels in v2's weight-decay scaling, as in the batch rule)."""
    from nanochat.optim import build_optimizer
    from nanochat.training import REF_DEPTH
    recipe = resolve_recipe(cfg.recipe, {}, total_batch_size=total_batch, target_tokens=_scaling_params(cfg, depth, vocab),
                            ref_tokens=_scaling_params(cfg, REF_DEPTH, vocab))
    return build_optimizer(model, **recipe.optimizer_kwargs(), world_size=rt.world_size, rank=rt.rank)


def bench_one(cfg: BenchConfig, rt, depth: int, kernel: str, precision: str, backend: str = "auto") -> dict:
    rt = runtime_for(rt, precision)
    from nanochat.gpt import config_for_depth
    from nanochat.checkpoint import build_model
    from nanochat.training import (Schedule, StepMeter, Trainer, describe_peaks, plan_batch, resolve_peak_flops,
                                   setup_precision_and_kernel)

    compile_model = cfg.compile if cfg.compile is not None else rt.device_type == "cuda"
    if cfg.data == "real":
        from nanochat.dataloader import DataLoader
        from nanochat.tokenizer import get_tokenizer
        tokenizer = get_tokenizer()
        vocab = tokenizer.vocab_size
        loader = DataLoader(tokenizer, cfg.device_batch_size, cfg.seq, "train", device=rt.device,
                            rank=rt.rank, world_size=rt.world_size)
    else:
        vocab = cfg.vocab_size
        loader = SyntheticBatches(cfg.device_batch_size, cfg.seq, vocab, rt.device)
    model_config = config_for_depth(depth, vocab, cfg.seq, aspect_ratio=cfg.aspect_ratio, head_dim=cfg.head_dim,
                                    window_pattern=cfg.window_pattern)
    rt.reset_peak_memory()
    model = build_model(model_config, rt.device, attn_backend=cfg.attn_backend, compute_dtype=rt.dtype)
    info = setup_precision_and_kernel(model, "fp8" if PRECISIONS[precision] else precision, kernel, rt,
                                      compile=compile_model, fp8_wgrad=PRECISIONS[precision] or "save",
                                      precision_backend=backend)
    unfuse = set(cfg.unfuse) | ({"mlp"} if precision == "fp8mlp0" else set())
    info = {**info, "kernel_fusions": unfuse_model(model, unfuse, info["kernel_fusions"])}
    if precision in ("fp8lean", "fp8plain", "fp8mlp0"):
        info = {**info, "precision": precision}
    train_model = torch.compile(model, dynamic=False) if compile_model else model
    total_batch = total_batch_for(cfg, depth, vocab, rt.world_size)
    optimizer = recipe_optimizer(cfg, model, depth, vocab, total_batch, rt)
    plan = plan_batch(total_batch, cfg.device_batch_size, cfg.seq, rt.world_size)
    total = cfg.warmup + cfg.steps
    schedule = Schedule(total, warmdown_ratio=0.0)  # constant lr: the benchmark measures speed only
    trainer = Trainer(train_model, optimizer, loader, plan, schedule, rt, cast_once="wcache" not in cfg.unfuse,
                      grad_sinks="gsink" not in cfg.unfuse)
    flops_per_token = model.estimate_flops()
    peak_bf16, peak_active, device_name = resolve_peak_flops(rt, info["peak_key"], cfg.peak_flops,
                                                             warn=lambda m: print(f"WARNING: {m}", file=sys.stderr))
    dts, losses = [], []
    monitor = GpuMonitor(rt.device)  # clocks and power over the timed steps (nanochat/gpu_monitor.py)
    try:
        for step in range(total):
            if step == cfg.warmup:
                monitor.start()
            r = trainer.step(step)
            losses.append(r.loss)
            if step >= cfg.warmup:
                dts.append(r.dt)
    finally:
        gpu = monitor.stop()  # also when a step fails (out of memory): no sampler left running
    dt = statistics.median(dts)
    tok_s = plan.total_batch_size / dt
    meter = StepMeter(flops_per_token, rt.world_size, peak_bf16=peak_bf16, peak_active=peak_active,
                      low_precision_flops=info.get("low_precision_flops"))
    mfu, util = meter._frac(flops_per_token * tok_s, peak_bf16), meter._frac(flops_per_token * tok_s, meter.peak_util)
    return {"device": device_name, "torch": torch.__version__, "triton": _triton_version(),
            "depth": depth, "kernel": kernel, "kernel_fusions": info["kernel_fusions"],
            "precision": info["precision"], "precision_backend": info.get("backend"), "compile": compile_model,
            "device_batch_size": cfg.device_batch_size, "seq": cfg.seq, "world_size": rt.world_size,
            "window_pattern": cfg.window_pattern,
            "attention": effective_backend(resolve_backend(cfg.attn_backend, rt.device), rt.dtype, rt.device),
            "data": cfg.data, "recipe": cfg.recipe, "total_batch_size": plan.total_batch_size,
            "grad_accum_steps": plan.grad_accum_steps,
            "cast_once": trainer.cast_once, "grad_sinks": trainer.cast_once and trainer.grad_sinks,
            "timed_steps": len(dts),
            "median_step_ms": dt * 1e3, "tok_per_sec": tok_s, "mfu_pct": mfu, "util_pct": util,
            # what util_pct divides by: an fp8/nvfp4 row's peak is a blend, not the datasheet figure
            "util_peak_flops": meter.peak_util, "low_precision_share": meter.low_share,
            # the peaks and where they come from, as base_train's banner says them: a GB10's are
            # spec-derived, and the row gave its MFU with no word of what it divides by
            "peaks": describe_peaks(rt, info["peak_key"], peak_bf16, peak_active, cfg.peak_flops, meter.peak_util,
                                    meter.low_share),
            "flops_per_token": flops_per_token, "num_params": sum(p.numel() for p in model.parameters()),
            "peak_mem_gib": rt.peak_memory_bytes() / 2**30, "first_loss": losses[0], "last_loss": losses[-1], "gpu": gpu}


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def print_table(rows: list[dict]) -> None:
    head = (f"{'depth':>5} {'kernel':>8} {'prec':>6} {'compile':>7} {'accum':>5} {'tok/s':>12} {'MFU%':>6} {'util%':>6} "
            f"{'mem GiB':>8} {'SM MHz':>7} {'capped%':>7}  error")
    print(head)
    print("-" * len(head))
    for r in rows:
        fmt = lambda v, spec: format(v, spec) if v is not None else "n/a"
        prec = r["precision"] + ("/" + r["precision_backend"] if r.get("precision_backend") == "te" else "")
        gpu = r.get("gpu") or {}
        print(f"{r['depth']:>5} {r['kernel']:>8} {prec:>6} {str(r.get('compile', '')):>7} "
              f"{str(r.get('grad_accum_steps', '')):>5} "
              f"{fmt(r.get('tok_per_sec'), ',.0f'):>12} {fmt(r.get('mfu_pct'), '.1f'):>6} "
              f"{fmt(r.get('util_pct'), '.1f'):>6} {fmt(r.get('peak_mem_gib'), '.1f'):>8} "
              f"{fmt(gpu.get('sm_clock_mhz_median'), '.0f'):>7} {fmt(gpu.get('power_capped_pct'), '.0f'):>7}  "
              f"{r.get('error', '')}")


def main(argv: list[str] | None = None) -> list[dict]:
    cfg = parse_config(argv)
    check_benchmark_device(cfg.device, SMOKE_RUN)
    rt = init_runtime(cfg.device, "auto")
    if rt.device_type == "cuda" and cfg.steps < MIN_GPU_STEPS:
        destroy_runtime(rt)
        raise RequestError(f"--steps: got {cfg.steps}; accepted on GPU: >= {MIN_GPU_STEPS} (steady-state median)")
    rows = []
    try:
        for depth, kernel, precision, backend in itertools.product(cfg.depths, cfg.kernels, cfg.precisions,
                                                                   cfg.precision_backends):
            # an error row names its backend too: with --precision-backend te,native the two failed
            # rows of a configuration were indistinguishable (and the table's "fp8/te" lost its "/te")
            what = {"depth": depth, "kernel": kernel, "precision": precision, "precision_backend": backend}
            try:
                row = bench_one(cfg, rt, depth, kernel, precision, backend)
            except torch.cuda.OutOfMemoryError:
                row = {**what, "error": "out of memory"}
            except (ValueError, RuntimeError) as e:  # e.g. a precision the device cannot run
                row = {**what, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            if rt.is_master:
                print(json.dumps(row), flush=True)
            rows.append(row)
            if rt.device_type == "cuda":
                torch.cuda.empty_cache()
        if rt.is_master:
            print_table(rows)
    finally:
        destroy_runtime(rt)
    return rows


if __name__ == "__main__":
    script_main("bench_train", lambda: parse_config(sys.argv[1:]),
                lambda: 1 if any("error" in r for r in main(sys.argv[1:])) else 0)
