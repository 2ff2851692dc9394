"""Checkpoint save and load time: python -m scripts.bench_checkpoint --depth 20 [--reps 3]

Builds a model of --depth with its MuonAdamW state filled by one step (as base_train holds them,
on the device), then times, --reps times each, alternating:
  plain:      torch.save of the model and optimizer state dicts, each written temp + fsync +
              rename (checkpoint.atomic_write), and torch.load of both back onto the device;
  checkpoint: checkpoint.save_checkpoint (the same files, plus the size + sha256 sums, the loop
              state and meta.json) and load_checkpoint(load_optimizer=True), which verifies the sums.
The difference is what the sums cost. Loads read files just written, so from the page cache as
far as memory allows: a resume after a reboot also waits for the disk.

Why it matters: a d20 checkpoint is ~9 GB, written at every --save-every step while training
waits; on a DGX Spark the disk and the memory the page cache competes for are shared with training.

CPU smoke run: python -m scripts.bench_checkpoint --device cpu --depth 1 --vocab-size 256 --reps 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from nanochat import checkpoint as ck
from nanochat.checkpoint_io import atomic_write
from nanochat.common import DEVICE_CHOICES, destroy_runtime, get_base_dir, init_runtime
from nanochat.flags import FlagParser, check_out_dir, require, require_int, script_main
from nanochat.platform import check_benchmark_device, detect_device

SMOKE_RUN = "python -m scripts.bench_checkpoint --device cpu --depth 1 --vocab-size 256 --reps 1"


def parse_args(argv=None):
    p = FlagParser(prog="python -m scripts.bench_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--reps", type=int, default=3, help="timed saves and loads of each kind")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir in the base dir); removed after")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    require_int(a.depth, "--depth", 1)
    require_int(a.vocab_size, "--vocab-size", 16)
    require_int(a.reps, "--reps", 1)
    require(a.device in DEVICE_CHOICES, "--device", a.device, "|".join(DEVICE_CHOICES))
    if a.dir is not None:   # a file or an unwritable place: a FileExistsError traceback from mkdir
        check_out_dir(a.dir, "--dir")
    return a


def state_dicts(args, device) -> tuple[dict, dict]:
    """The model's and the optimizer's state dicts after one step on random gradients."""
    from scripts.bench_optim import build

    model, optimizer = build(argparse.Namespace(depth=args.depth, vocab_size=args.vocab_size, weight_decay=0.0),
                             device)
    optimizer.step()
    return model.state_dict(), optimizer.state_dict()


def _sync(device) -> None:
    """Wait for the device's queued work (CUDA and MPS run it asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def plain_round(root: Path, model_state: dict, optim_state: dict, device) -> tuple[float, float]:
    root.mkdir()
    t0 = time.perf_counter()
    for name, obj in (("model.pt", model_state), ("optim.pt", optim_state)):
        atomic_write(root / name, lambda f, obj=obj: torch.save(obj, f))
    t1 = time.perf_counter()
    for name in ("model.pt", "optim.pt"):
        torch.load(root / name, map_location=device, weights_only=True)
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def checkpoint_round(root: Path, model_state: dict, optim_state: dict, device) -> tuple[float, float]:
    t0 = time.perf_counter()
    ck.save_checkpoint(root, 1, model_state=model_state, optimizer_state=optim_state,
                       loop_state={"step": 1}, meta={"bench": "bench_checkpoint"})
    t1 = time.perf_counter()
    ck.load_checkpoint(root, 1, device=device, load_optimizer=True)
    _sync(device)
    return t1 - t0, time.perf_counter() - t1


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    check_benchmark_device(args.device, SMOKE_RUN)
    rt = init_runtime(args.device, "fp32", seed=0)
    parent = Path(args.dir) if args.dir else get_base_dir()
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=parent))
    try:
        model_state, optim_state = state_dicts(args, rt.device)
        # the optimizer step that filled the state is still queued on a GPU: unsynchronised, the first
        # plain save (torch.save waits for it) was charged with it, and so was "the sums cost"
        _sync(rt.device)
        times = {"plain": [], "checkpoint": []}
        sizes = {}   # per kind: the plain row reported the checkpoint kind's bytes (the last measured)
        for _ in range(args.reps):
            for kind, round_ in (("plain", plain_round), ("checkpoint", checkpoint_round)):
                times[kind].append(round_(root / kind, model_state, optim_state, rt.device))
                sizes[kind] = sum(p.stat().st_size for p in (root / kind).rglob("*.pt"))
                shutil.rmtree(root / kind)
        results = [report(kind, t, sizes[kind], args, rt) for kind, t in times.items()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        destroy_runtime(rt)
    # from the unrounded medians: the rows' seconds are rounded to 1 ms, which made the share of a
    # small model's few-ms rounds tens of percent off (and a 0.000 s plain load divided by zero)
    (save_p, load_p), (save_c, load_c) = (medians(times[kind]) for kind in ("plain", "checkpoint"))
    save_extra, load_extra = save_c / save_p - 1, load_c / load_p - 1
    print(f"the sums cost {save_extra:+.0%} on save and {load_extra:+.0%} on load (medians)")
    return results


def medians(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """(save, load) seconds: the median of each over the rounds."""
    return statistics.median(t[0] for t in rounds), statistics.median(t[1] for t in rounds)


def report(kind: str, rounds: list[tuple[float, float]], size: int, args, rt) -> dict:
    save, load = medians(rounds)
    # the device's name, as the other benchmarks print it (str(rt.device) said "cuda" on every GPU)
    row = {"bench": "checkpoint", "kind": kind, "depth": args.depth, "device": detect_device(rt.device).name,
           "torch": torch.__version__, "bytes": size, "gb": round(size / 1e9, 3), "reps": args.reps, "save_s": round(save, 3),
           "load_s": round(load, 3), "save_gbs": round(size / 1e9 / save, 2), "load_gbs": round(size / 1e9 / load, 2)}
    print(json.dumps(row))
    print(f"{kind:<11} {row['gb']:>7.2f} GB  save {save:7.2f} s ({row['save_gbs']:5.2f} GB/s)  "
          f"load {load:7.2f} s ({row['load_gbs']:5.2f} GB/s)  median of {args.reps}", flush=True)
    return row


if __name__ == "__main__":
    script_main("bench_checkpoint", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
