"""Benchmark the Engine's samplers (nanochat/sampling.py) against torch.multinomial sampling.

Times each sampling setting for a (batch, vocab) row of logits over --calls back-to-back calls
(CUDA events on a GPU, the wall clock on a CPU), the way the Engine calls it once per decode
step. `multinomial` is the textbook sampler (top-k mask, softmax, torch.multinomial), which
synchronises with the host on CUDA (pytorch/pytorch#108968); `topk` is torch.topk's k-th value
alone next to sampling.kth_largest; `Sampler torch t1 seed 2**40` is a generation's torch sampler
with a seed past 2**32 (on the CPU its noise comes from two generators); `triton ...` (CUDA only)
is the Triton sampler (nanochat/triton_sample.py) that the Engine uses on CUDA, two-stage with
top-k, and `triton 1-program ...` its one-program path; they are also timed replayed from a CUDA
graph (GPU time without Python's launch overhead). Prints one JSON line per setting, then a table.

    python -m scripts.bench_sampler --vocab-size 32768 --batch 1
"""

from __future__ import annotations

import json
import sys
import time

TOP_K = 50              # the k of the top-k cases on every device
TRITON_TOP_K_MAX = 200  # the largest k of the Triton cases (CUDA only)


def parse_args(argv=None):
    from nanochat.flags import FlagParser

    p = FlagParser(prog="python -m scripts.bench_sampler", description=__doc__.split("\n")[0])
    p.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--device", default="cuda", help="cuda | cpu")
    args = p.parse_args(argv)
    for name in ("vocab_size", "batch", "calls"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: an integer >= 1")
    if args.device not in ("cuda", "cpu"):
        raise ValueError(f"--device: got {args.device!r}; accepted: cuda, cpu")
    # a top-k case needs more tokens than k: torch.topk crashed the run ("selected index k out of
    # range") below it, and at k == V sample_next skips the mask, so a "top-k" row timed plain sampling
    k_max = TRITON_TOP_K_MAX if args.device == "cuda" else TOP_K
    if args.vocab_size <= k_max:
        raise ValueError(f"--vocab-size: got {args.vocab_size}; accepted: an integer > {k_max} with --device "
                         f"{args.device} (the largest top-k its cases sample from)")
    return args


def triton_skip_reason(device: str, vocab_size: int) -> str | None:
    """Why the Triton sampler cases do not run on `device` at `vocab_size` (None: they run). On CUDA
    above the kernel's vocabulary limit they were left out silently: the table lacked the rows the
    Engine would not use either, and nothing said so."""
    if device != "cuda":
        return None   # CUDA-only by design (module docstring); a CPU run never lists them
    from nanochat.triton_sample import MAX_TRITON_VOCAB
    if vocab_size > MAX_TRITON_VOCAB:
        return (f"--vocab-size {vocab_size} > {MAX_TRITON_VOCAB}, the Triton sampler's limit: the Engine "
                "samples with torch here, so the triton cases are not timed")
    return None


def multinomial_sampler(logits, temperature, top_k, generator):
    import torch

    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


def time_calls(fn, calls: int, device: str) -> float:
    """Microseconds per call of `calls` back-to-back calls, after 10 warm-up calls."""
    import torch

    for _ in range(10):
        fn()
    if device == "cpu":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def graph_us(fn, calls: int = 50) -> float | None:
    """GPU microseconds per call with no launch overhead: `calls` calls captured in one CUDA graph
    and replayed (nanochat/gpu_timing.py). None where capture is refused (torch's RNG with a
    private generator)."""
    from nanochat.gpu_timing import graph_times

    try:
        times = graph_times(lambda i: fn(), calls, 5)
    except RuntimeError:
        return None
    return sum(times) / len(times) * 1e6


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from nanochat.sampling import Sampler, kth_largest, sample_next

    if args.device == "cuda" and not torch.cuda.is_available():
        from nanochat.errors import RequestError

        raise RequestError("--device cuda: needs a CUDA GPU; none is visible (pass --device cpu)")
    gen = torch.Generator(device=args.device).manual_seed(0)
    logits = torch.randn(args.batch, args.vocab_size, device=args.device, generator=gen) * 3
    wide = Sampler(torch.device(args.device), 1.0, None, None, 2**40, backend="torch")
    cases = {
        "greedy": lambda: sample_next(logits, 0.0, None, None, None),
        "t1": lambda: sample_next(logits, 1.0, None, None, gen),
        "t1 top-k 50": lambda: sample_next(logits, 1.0, TOP_K, None, gen),
        "t1 top-p 0.9": lambda: sample_next(logits, 1.0, None, 0.9, gen),
        "multinomial t1": lambda: multinomial_sampler(logits, 1.0, None, gen),
        "multinomial t1 top-k 50": lambda: multinomial_sampler(logits, 1.0, TOP_K, gen),
        "topk k-th value (k 50)": lambda: torch.topk(logits, TOP_K, dim=-1).values[:, -1:],
        "kth_largest (k 50)": lambda: kth_largest(logits, TOP_K),
        "t1 top-k 50 top-p 0.9": lambda: sample_next(logits, 1.0, TOP_K, 0.9, gen),
        # a generation's sampler with a seed past 2**32: on the CPU its noise comes from two
        # generators (sampling.SplitSeedGenerator), one per half of the seed
        "Sampler torch t1 seed 2**40": lambda: wide(logits, 0),
    }
    skipped = triton_skip_reason(args.device, args.vocab_size)
    if skipped:
        print(json.dumps({"bench": "sampler", "case": "triton", "device": args.device, "skipped": skipped}), flush=True)
    elif args.device == "cuda":
        from nanochat.triton_sample import sample_triton

        for name, (k, p) in {"t1": (None, None), "t1 top-k 50": (TOP_K, None), "t1 top-p 0.9": (None, 0.9),
                             "t1 top-k 50 top-p 0.9": (TOP_K, 0.9), "t1 top-k 200": (TRITON_TOP_K_MAX, None)}.items():
            cases[f"triton {name}"] = lambda k=k, p=p: sample_triton(logits, 1.0, k, p, 0, 1)
            if k is not None:  # the one-program path next to the two-stage one it replaced
                cases[f"triton 1-program {name}"] = lambda k=k, p=p: sample_triton(logits, 1.0, k, p, 0, 1, chunk=0)
    rows = []
    for name, fn in cases.items():
        us = time_calls(fn, args.calls, args.device)
        gpu = graph_us(fn) if args.device == "cuda" and name.startswith(("triton", "greedy")) else None
        row = {"bench": "sampler", "case": name, "device": args.device, "batch": args.batch,
               "vocab_size": args.vocab_size, "us_per_call": round(us, 1),
               "gpu_us_per_call": None if gpu is None else round(gpu, 1), "torch": torch.__version__}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(f"\n{args.device}, batch {args.batch}, vocab {args.vocab_size}, {args.calls} calls each "
          "(us/call: back to back from Python; GPU us: replayed from a CUDA graph)")
    print(f"{'case':<42}{'us/call':>10}{'GPU us':>10}")
    for r in rows:
        gpu = "-" if r["gpu_us_per_call"] is None else f"{r['gpu_us_per_call']:.1f}"
        print(f"{r['case']:<42}{r['us_per_call']:>10.1f}{gpu:>10}")
    if skipped:
        print(f"(triton cases skipped: {skipped})")
    return 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("bench_sampler", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
