"""Where a training step's time goes: python -m scripts.profile_training --depth 12 [--trace trace.json]

Builds the model as training does (precision recipe, loss kernel, torch.compile, MuonAdamW),
warms up, then
1. times --steps steps of --accum micro-batches each (default 1; base_train accumulates 16 at d20)
   split into weights (the once-per-step cast, with --accum > 1) / data / forward / backward /
   optimizer with CUDA events (the wall clock on a CPU): the median of each phase, its share of their sum, and the step as
   the median of the steps' own totals (tok/s is taken from that); with --accum > 1 the timings
   and the kernel profile include the gradient accumulation of micro-batches 2..n, inside the
   Trainer's block (master weights cast once, gradients summed in place: --no-cast-once for the
   plain path);
2. (CUDA) measures memory per phase of one more step: the allocated bytes before it (weights
   and optimizer state), after the forward (+ what autograd saved for backward) and the peak of
   each phase, once for a first micro-batch (no gradients yet) and once for an accumulating one
   (gradients of the previous micro-batch still live, as in every micro-batch after the first
   when base_train accumulates): where the peak happens and how much of it is activations;
3. runs torch.profiler over --profile-steps steps and lists the top kernels by device time
   (share of the profiled device time, calls, mean us), optionally writing a Chrome trace, and
   how busy the GPU was (`device_busy`: kernel time vs span, the largest idle gaps);
4. samples the GPU's SM clock and power during the timed steps (nanochat/gpu_monitor.py).
Output: JSON lines (one per phase, one per memory reading, one per top kernel) and tables.
Synthetic token batches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

SMOKE_RUN = ("python -m scripts.profile_training --device cpu --depth 1 --device-batch-size 1 --seq 16 "
             "--vocab 64 --no-compile --steps 1 --warmup 0 --profile-steps 1")


def build(args, rt):
    from nanochat.gpt import config_for_depth
    from nanochat.optim import build_optimizer
    from nanochat.training import build_model, setup_precision_and_kernel

    config = config_for_depth(args.depth, args.vocab, args.seq)
    model = build_model(config, rt.device, compute_dtype=rt.dtype, attn_backend=args.attn_backend)
    info = setup_precision_and_kernel(model, args.precision, args.kernel, rt, compile=args.compile,
                                      precision_backend=args.precision_backend)
    run = torch.compile(model, dynamic=False) if args.compile else model
    optimizer = build_optimizer(model, world_size=rt.world_size, rank=rt.rank)
    return model, run, optimizer, info


def make_batch(args, device, gen):
    """Host-side batch creation + copy: what a prefetching loader costs at minimum."""
    data = torch.randint(0, args.vocab, (args.device_batch_size, args.seq + 1), generator=gen)
    if device.type == "cuda":
        data = data.pin_memory().to(device, non_blocking=True)
    return data[:, :-1], data[:, 1:]


def casts_once(args, rt) -> bool:
    """Whether a step starts by casting the master weights (step_block enabled)."""
    from nanochat.training import casts_pay
    return args.cast_once and casts_pay(args.accum, rt.dtype)


def step_block(args, rt, model):
    """What nanochat.training.Trainer wraps a step's micro-batches in: the master weights cast once
    and the weights' gradients summed in place (nanochat/weight_cache.py), when it accumulates;
    --no-cast-once profiles the plain path (per-use casts, autograd's accumulation)."""
    from nanochat import weight_cache
    return weight_cache.step_weights(model, rt.dtype, enabled=casts_once(args, rt), sinks=True)


def timed_steps(args, rt, model, run, optimizer, monitor=None) -> dict:
    """{"phases": median ms per phase, "step_ms": median of the steps' totals} for steps of --accum
    micro-batches (data, forward, backward summed over them), one optimizer step and, when the step
    casts its weights once (casts_once), that cast ("weights", before the first micro-batch: it
    was left out of every phase, and of the step). Off CUDA the marks are the wall clock after a
    synchronisation (it returned {} there: a CPU run printed no phase and no step time). The step is the median of whole
    steps: the sum of the phase medians (what tok/s was taken from) is no step's time when the slow
    steps are slow in different phases. `monitor` (a GpuMonitor) is started with the first timed
    step: started before the warm-up, its clock and power figures were mostly the idle GPU of the
    compilation (tens of seconds against a few seconds of timed steps)."""
    gen = torch.Generator().manual_seed(0)
    casting = casts_once(args, rt)
    phases = (("weights",) if casting else ()) + ("data", "forward", "backward", "optimizer")
    samples = {p: [] for p in phases}
    totals = []
    cuda = rt.device.type == "cuda"
    for i in range(args.warmup + args.steps):
        if i == args.warmup and monitor is not None:
            monitor.start()
        # (phase, event at its start) through the step, read after the step's one synchronisation
        marks = []

        def mark(phase):
            if cuda:
                ev = torch.cuda.Event(enable_timing=True)
                ev.record()
                marks.append((phase, ev))
            else:
                rt.synchronize()   # a no-op on a CPU; MPS queues its work as CUDA does
                marks.append((phase, time.perf_counter()))

        if casting:
            mark("weights")
        with step_block(args, rt, model):
            for _ in range(args.accum):
                mark("data")
                x, y = make_batch(args, rt.device, gen)
                mark("forward")
                loss = run(x, y)
                mark("backward")
                loss.backward()
        mark("optimizer")
        optimizer.step()
        model.zero_grad(set_to_none=True)
        mark("end")
        if cuda:
            marks[-1][1].synchronize()
        if i >= args.warmup:
            ms = dict.fromkeys(phases, 0.0)
            for (phase, a), (_, b) in zip(marks, marks[1:]):
                ms[phase] += a.elapsed_time(b) if cuda else 1e3 * (b - a)
            for p in phases:
                samples[p].append(ms[p])
            totals.append(sum(ms.values()))
    return {"phases": {p: statistics.median(v) for p, v in samples.items()}, "step_ms": statistics.median(totals)}


def memory_phases(args, rt, model, run, optimizer) -> dict[str, float]:
    """GiB allocated at each phase boundary and each phase's peak (allocator statistics are updated
    when the host issues an allocation, so no synchronisation is needed between phases)."""
    gen = torch.Generator().manual_seed(2)
    gib = lambda v: round(v / 2**30, 3)
    cuda = torch.cuda
    out = {"before_step": gib(cuda.memory_allocated())}

    def micro(tag):
        x, y = make_batch(args, rt.device, gen)
        cuda.reset_peak_memory_stats()
        loss = run(x, y)
        out[f"{tag}_forward_peak"] = gib(cuda.max_memory_allocated())
        out[f"{tag}_after_forward"] = gib(cuda.memory_allocated())
        cuda.reset_peak_memory_stats()
        loss.backward()
        out[f"{tag}_backward_peak"] = gib(cuda.max_memory_allocated())
        out[f"{tag}_after_backward"] = gib(cuda.memory_allocated())

    with step_block(args, rt, model):
        micro("first")        # gradients were set to None by the previous step
        micro("accumulating")  # the first micro-batch's gradients are live, as in micro-batches 2..n
    cuda.reset_peak_memory_stats()
    optimizer.step()
    out["optimizer_peak"] = gib(cuda.max_memory_allocated())
    model.zero_grad(set_to_none=True)
    out["saved_for_backward"] = round(out["first_after_forward"] - out["before_step"], 3)
    rt.synchronize()
    return out


def profile_kernels(args, rt, model, run, optimizer) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile, record_function

    gen = torch.Generator().manual_seed(1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            with step_block(args, rt, model):
                for _ in range(args.accum):
                    with record_function("data"):
                        x, y = make_batch(args, rt.device, gen)
                    with record_function("forward"):
                        loss = run(x, y)
                    with record_function("backward"):
                        loss.backward()
            with record_function("optimizer"):
                optimizer.step()
                model.zero_grad(set_to_none=True)
        rt.synchronize()
    if args.trace:
        write_trace(prof, args.trace)
    if rt.device.type == "cuda":
        print(json.dumps({"device_busy": device_busy(prof.events(), args.profile_steps)}), flush=True)
    return top_kernels(prof, args.profile_steps, args.top, skip=("data", "forward", "backward", "optimizer"))


def write_trace(prof, path: str) -> None:
    """The Chrome trace at `path`, its missing directories created (parse_args accepted them as "to
    be created"), written to a temp file beside it and renamed over it once whole. The profiler only
    logs a failed write, so the temp file is checked: checking `path` itself passed on the trace of
    an earlier run (exit 0, an old trace), and a run killed mid-write left a truncated one. The
    temp name ends in the target's name, so a `.gz` target is still compressed by the profiler."""
    import os
    from pathlib import Path

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
    try:
        prof.export_chrome_trace(str(tmp))
        if not tmp.is_file():
            from nanochat.errors import RequestError
            raise RequestError(f"--trace: the profiler wrote no trace to {path} (see its error above)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def top_kernels(prof, steps: int, top: int, skip=()) -> list[dict]:
    """The `top` kernels of a finished torch.profiler run by device time (CPU operators when no
    CUDA kernel ran), per profiled step; `skip`: record_function labels to leave out."""
    events = [e for e in prof.key_averages() if _device_us(e) > 0 and not e.key.startswith("ProfilerStep")
              and e.key not in skip]
    kernels = [e for e in events if _is_kernel(e)] or events
    total = sum(_device_us(e) for e in kernels) or 1.0
    kernels.sort(key=_device_us, reverse=True)
    return [{"kernel": e.key[:120], "device_ms_per_step": round(_device_us(e) / 1e3 / steps, 3),
             "share_pct": round(100 * _device_us(e) / total, 1), "calls_per_step": e.count // steps,
             "mean_us": round(_device_us(e) / max(e.count, 1), 1)} for e in kernels[:top]]


def device_busy(events, steps: int, top_gaps: int = 8) -> dict:
    """How much of the profiled span the GPU ran kernels: the union of kernel intervals vs the span
    from the first kernel's start to the last one's end, per step, and the largest idle gaps with the
    kernels on either side (a kernel saving that does not shorten the step shows up here as idle time)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                   if _is_kernel(e) and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    busy, gaps, end, prev = 0.0, [], spans[0][0], spans[0][2]
    for start, stop, name in spans:
        if start > end:
            gaps.append((start - end, prev, name))
        if stop > end:
            busy += stop - max(start, end)
            end, prev = stop, name
    span = end - spans[0][0]
    gaps.sort(reverse=True)
    # how many kernels a step launches, and how many of them are short: each kernel boundary costs a
    # wave's drain and fill beyond its own time, so many short kernels cost more than their sum
    durations = [stop - start for start, stop, _ in spans]
    short = {f"under_{cut}us": {"per_step": sum(d < cut for d in durations) / steps,
                                "ms_per_step": round(sum(d for d in durations if d < cut) / 1e3 / steps, 3)}
             for cut in (10, 50, 200)}
    return {"span_ms_per_step": round(span / 1e3 / steps, 3), "busy_ms_per_step": round(busy / 1e3 / steps, 3),
            "kernels_per_step": len(spans) / steps, "short_kernels": short,
            "idle_ms_per_step": round((span - busy) / 1e3 / steps, 3),
            "gaps_over_20us_per_step": sum(g[0] > 20 for g in gaps) / steps,
            "largest_gaps": [{"us": round(g, 1), "after": a[:60], "before": b[:60]} for g, a, b in gaps[:top_gaps]]}


def _is_kernel(e) -> bool:
    """A device event that is a kernel (or copy), not the GPU-side span of a record_function label
    (torch.profiler's user annotations, device type CUDA too): torch's own Optimizer.step#...
    annotation was listed as the top "kernel" (82% of a d4 step on an H200, its kernels counted
    twice) and the labels' spans, idle gaps included, counted as busy time."""
    return e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)


def _device_us(e) -> float:
    """Self device time across torch versions (self_device_time_total; older: self_cuda_time_total)."""
    for name in ("self_device_time_total", "self_cuda_time_total", "self_cpu_time_total"):
        value = getattr(e, name, None)
        if value:
            return float(value)
    return 0.0


def parse_args(argv=None):
    """Parse and validate every flag before the model is built; a bad value raises ValueError
    naming the flag and the accepted values."""
    from nanochat.attention import BACKEND_CHOICES
    from nanochat.common import DEVICE_CHOICES
    from nanochat.flags import FlagParser, check_output_file, require, require_int
    from nanochat.precision import BACKENDS, PRECISIONS

    p = FlagParser(prog="python -m scripts.profile_training", description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--device-batch-size", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--kernel", default="current", choices=["current", "liger", "triton"])
    p.add_argument("--precision", default="auto", help="|".join(PRECISIONS))
    p.add_argument("--precision-backend", default="auto", help="|".join(BACKENDS))
    p.add_argument("--attn-backend", default="auto",
                   help="auto|sdpa|flex|cudnn|cudnn_fa4|reference (nanochat/attention.py)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches per optimizer step (base_train accumulates 16 at d20): the timings "
                        "and the kernel profile then include the gradient accumulation of micro-batches 2..n")
    p.add_argument("--cast-once", action=argparse.BooleanOptionalAction, default=True,
                   help="as base_train's Trainer: with --accum > 1, cast the master weights once per step and sum "
                        "the weights' gradients in place (nanochat/weight_cache.py); --no-cast-once: the plain path")
    p.add_argument("--trace", default=None, help="write a Chrome trace JSON here")
    p.add_argument("--device", default="auto", help="|".join(DEVICE_CHOICES))
    args = p.parse_args(argv)
    for name in ("depth", "device_batch_size", "seq", "steps", "profile_steps", "top", "accum"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; must be >= 1")
    require_int(args.warmup, "--warmup", 0)
    require_int(args.vocab, "--vocab", 1)
    require(args.precision in PRECISIONS, "--precision", args.precision, "|".join(PRECISIONS))
    require(args.precision_backend in BACKENDS, "--precision-backend", args.precision_backend, "|".join(BACKENDS))
    require(args.attn_backend in BACKEND_CHOICES, "--attn-backend", args.attn_backend, "|".join(BACKEND_CHOICES))
    require(args.device in DEVICE_CHOICES, "--device", args.device, "|".join(DEVICE_CHOICES))
    check_output_file(args.trace, "--trace")   # written after the profile: a bad path failed only then
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from nanochat.common import init_runtime
    from nanochat.platform import check_benchmark_device
    from nanochat.precision_request import runtime_dtype   # $NANOCHAT_DTYPE vs --precision, as base_train
    from nanochat.training import check_precision
    check_benchmark_device(args.device, SMOKE_RUN)
    rt = init_runtime(args.device, runtime_dtype(args.precision), dtype_flag=f"--precision {args.precision}")
    check_precision(args.precision, rt, args.precision_backend)   # before the model: --precision fp8 on an A100
    from nanochat.attention import check_training_backend
    # as base_train: flex has no backward on a CPU, which raised a RuntimeError traceback at the first step
    check_training_backend(args.attn_backend, rt.device, rt.dtype)
    model, run, optimizer, info = build(args, rt)
    print(json.dumps({"header": True, "device": torch.cuda.get_device_name() if rt.device.type == "cuda" else "cpu",
                      "torch": torch.__version__, "depth": args.depth, "batch": args.device_batch_size,
                      "seq": args.seq, "kernel": args.kernel, "precision": info.get("precision"),
                      "compile": args.compile, "accum": args.accum, "cast_once": args.cast_once}), flush=True)
    from nanochat.gpu_monitor import GpuMonitor
    monitor = GpuMonitor(rt.device)  # the GPU's clocks and power cap over the timed steps only
    try:
        timing = timed_steps(args, rt, model, run, optimizer, monitor)
    finally:
        monitor.stop()  # also when a step fails: no sampler left running
    print(json.dumps({"gpu": monitor.summary()}), flush=True)
    split, step_ms = timing.get("phases", {}), timing.get("step_ms")
    phase_sum = sum(split.values())   # the shares add up to 100% of the phase medians' sum
    for phase, ms in split.items():
        print(json.dumps({"phase": phase, "ms": round(ms, 3), "share_pct": round(100 * ms / phase_sum, 1)}))
    if split:
        tok_s = args.accum * args.device_batch_size * args.seq / (step_ms * 1e-3)
        print(json.dumps({"step_ms": round(step_ms, 3), "tok_per_s": round(tok_s), "steps": args.steps,
                          "phase_medians_sum_ms": round(phase_sum, 3)}), flush=True)
    memory = memory_phases(args, rt, model, run, optimizer) if rt.device.type == "cuda" else {}
    if memory:
        print(json.dumps({"memory_gib": memory}), flush=True)
    top = profile_kernels(args, rt, model, run, optimizer)
    for row in top:
        print(json.dumps(row))
    if split:
        print(f"\nstep {step_ms:.1f} ms (median of {args.steps}; {tok_s:,.0f} tok/s); phase medians: " +
              ", ".join(f"{k} {v:.1f} ms ({100 * v / phase_sum:.0f}%)" for k, v in split.items()))
    if memory:
        print("memory GiB: " + ", ".join(f"{k} {v}" for k, v in memory.items()))
    print(f"\n{'share%':>6} {'ms/step':>8} {'calls':>6} {'mean us':>8}  kernel")
    for r in top:
        print(f"{r['share_pct']:>6} {r['device_ms_per_step']:>8} {r['calls_per_step']:>6} {r['mean_us']:>8}  "
              f"{r['kernel'][:90]}")
    return 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("profile_training", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
