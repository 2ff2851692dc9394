"""The optimizer step alone: python -m scripts.bench_optim --depth 20 [--top 25]

MuonAdamW.step() for a model of --depth, as base_train builds it (build_optimizer's groups: Muon
for the blocks' matrices, one stacked group per shape, AdamW for the embedding, value-embedding
and lm_head tables and the scalars), on fixed random gradients. It warms up (the CUDA step
functions compile on first use), times --steps steps with CUDA events (wall clock on CPU) and
prints the median and min ms per step; with --top N it profiles one step and lists the N kernels
with the most device time (calls, ms) and, on CUDA, how busy the GPU was (kernels per step, idle
time, the largest gaps: profile_training's device_busy).

Why a benchmark of its own: at d20 the step runs once per 16 micro-batches (~0.6% of base_train's
time on an H100), below what a whole-step A/B resolves, but a change to it shows here directly.
Run it from another tree's root to compare two versions of nanochat/optim.py on one machine
(`bash scripts/gpu_check.sh optab`).

CPU smoke run: python -m scripts.bench_optim --device cpu --depth 1 --vocab-size 256 --steps 2 --warmup 1
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from nanochat.common import DEVICE_CHOICES, destroy_runtime, init_runtime
from nanochat.gpt import GPT, config_for_depth
from nanochat.optim import build_optimizer
from nanochat.platform import check_benchmark_device
from nanochat.flags import FlagParser, require, require_float, require_int, script_main

SMOKE_RUN = "python -m scripts.bench_optim --device cpu --depth 1 --vocab-size 256 --steps 2 --warmup 1"


def parse_args(argv=None):
    p = FlagParser(prog="python -m scripts.bench_optim", description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the step functions compile)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="Muon's (cautious) weight decay, as base_train's flag")
    p.add_argument("--normuon-beta2", type=float, default=0.0, help="NorMuon's rescale in the Muon step (0 = off; "
                   "base_train's default recipe v2 uses 0.95)")
    p.add_argument("--top", type=int, default=0, help="profile one step and list its N heaviest kernels")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    require_int(a.depth, "--depth", 1)
    require_int(a.vocab_size, "--vocab-size", 16)
    require_int(a.steps, "--steps", 1)
    require_int(a.warmup, "--warmup", 0)
    require_int(a.top, "--top", 0)
    require_float(a.weight_decay, "--weight-decay", 0.0)
    require(0 <= a.normuon_beta2 < 1, "--normuon-beta2", a.normuon_beta2, "a number in [0, 1) (0 = off)")
    require(a.device in DEVICE_CHOICES, "--device", a.device, "|".join(DEVICE_CHOICES))
    return a


def build(args, device):
    """The model's float32 master weights with fixed random gradients, and its optimizer."""
    with torch.device("meta"):  # shapes first, then the weights straight on the device (as build_model)
        model = GPT(config_for_depth(args.depth, args.vocab_size, 64))  # seq len: shapes no parameter
    model.to_empty(device=device)
    model.init_weights()
    gen = torch.Generator(device=device).manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, device=device, dtype=p.dtype, generator=gen) * 1e-3
    return model, build_optimizer(model, weight_decay=args.weight_decay,
                                  normuon_beta2=getattr(args, "normuon_beta2", 0.0))


def timed(rt, optimizer, steps: int) -> list[float]:
    """ms per optimizer step: CUDA events around each (the GPU's time), wall clock elsewhere (between
    synchronisations, for MPS)."""
    out = []
    for _ in range(steps):
        if rt.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            optimizer.step()
            stop.record()
            stop.synchronize()
            out.append(start.elapsed_time(stop))
        else:   # MPS queues its work as CUDA does: unsynchronised, the clock timed the launches only
            rt.synchronize()
            t0 = time.perf_counter()
            optimizer.step()
            rt.synchronize()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def profiled(rt, optimizer, n: int) -> dict:
    """One step under torch.profiler: its n heaviest kernels and (CUDA) how busy the GPU was."""
    from torch.profiler import ProfilerActivity, profile

    from scripts.profile_training import device_busy, top_kernels
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        optimizer.step()
        rt.synchronize()
    out = {"top": top_kernels(prof, 1, n, skip=("Optimizer.step#MuonAdamW.step",))}
    if rt.device.type == "cuda":
        out["device_busy"] = device_busy(prof.events(), 1)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    check_benchmark_device(args.device, SMOKE_RUN)
    rt = init_runtime(args.device)
    try:
        model, optimizer = build(args, rt.device)
        timed(rt, optimizer, args.warmup)
        ms = timed(rt, optimizer, args.steps)
        kinds = {k: sum(p.numel() for g in optimizer.param_groups if g["kind"] == k for p in g["params"])
                 for k in ("muon", "adamw")}
        row = {"bench": "optim", "device": torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else rt.device.type,
               "torch": torch.__version__, "depth": args.depth, "vocab_size": args.vocab_size, "weight_decay": args.weight_decay,
               "normuon_beta2": args.normuon_beta2,
               "muon_params": kinds["muon"], "adamw_params": kinds["adamw"], "steps": args.steps,
               "ms_median": round(statistics.median(ms), 3), "ms_min": round(min(ms), 3)}
        if args.top:
            row.update(profiled(rt, optimizer, args.top))
        print(json.dumps(row), flush=True)
        print(f"\n{'depth':>5} {'Muon params':>12} {'AdamW params':>13} {'ms median':>10} {'ms min':>8}")
        print(f"{args.depth:>5} {kinds['muon']:>12,} {kinds['adamw']:>13,} {row['ms_median']:>10.3f} {row['ms_min']:>8.3f}")
        for k in row.get("top", []):
            print(f"  {k['device_ms_per_step']:>8.3f} ms {k['calls_per_step']:>5}x  {k['kernel']}")
        return row
    finally:
        destroy_runtime(rt)


if __name__ == "__main__":
    script_main("bench_optim", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
