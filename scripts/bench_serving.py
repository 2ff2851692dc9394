"""Serving benchmark: many concurrent generation requests through continuous batching
(nanochat/batching.py, what chat_web serves with by default) against one request at a time (what
chat_web --batch-slots 1 does), on a random model of the requested depth. No HTTP: this measures
the engine side; scripts/load_test.py measures the server end to end.

    python -m scripts.bench_serving                             # d20 on the GPU, slots 1 and 8
    python -m scripts.bench_serving --slots 1,8,16 --clients 16 --requests 48
    python -m scripts.bench_serving --device cpu --depth 2 --seq-len 256 --prompt-lens 8,40 --max-tokens 16

`--clients` threads each send requests back to back (a closed loop) until `--requests` have been
served; prompts are random token ids of lengths cycling through `--prompt-lens`, every request
generates `--max-tokens` tokens (no stop tokens) at temperature 1, top-k 50. Prints one JSON line
per mode (tok/s over the whole run, latency and time to first token p50 / p95, the scheduler's
mean batch) and a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from scripts.load_test import pct   # the q-quantile, linear between order statistics (p50 = median)

SMOKE_RUN = ("python -m scripts.bench_serving --device cpu --depth 2 --seq-len 256 --prompt-lens 8,40 "
             "--max-tokens 16")


def parse_args(argv=None) -> argparse.Namespace:
    from nanochat.engine import DECODE_MODES, GRAPH_STEPS
    from nanochat.flags import FlagParser

    p = FlagParser(prog="python -m scripts.bench_serving", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=int, default=32768)
    p.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=2048, help="model context")
    p.add_argument("--slots", default="1,8", help="comma-separated; 1 = one request at a time (plain Engine)")
    p.add_argument("--clients", type=int, default=8, help="concurrent request threads")
    p.add_argument("--requests", type=int, default=32, help="requests per mode")
    p.add_argument("--prompt-lens", "--prompt_lens", dest="prompt_lens", default="100,500,1000,300")
    p.add_argument("--max-tokens", "--max_tokens", dest="max_tokens", type=int, default=128)
    p.add_argument("--decode", default="auto",
                   help=f"the Engine's decode mode: {'|'.join(DECODE_MODES)} (auto: graphs on CUDA)")
    p.add_argument("--graph-step", "--graph_step", dest="graph_step", default="auto",
                   help=f"what a static/graphs step runs: {'|'.join(GRAPH_STEPS)} (nanochat/engine.py)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda|mps")
    p.add_argument("--dtype", default="auto", help="auto|bf16|fp32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.slots = _ints("--slots", args.slots)
    args.prompt_lens = _ints("--prompt-lens", args.prompt_lens)
    if min(args.slots) < 1:
        raise ValueError(f"--slots: got {args.slots}; accepted: comma-separated integers >= 1")
    for name in ("clients", "requests", "max_tokens", "depth", "vocab_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: an integer >= 1")
    if min(args.prompt_lens) < 1 or max(args.prompt_lens) + args.max_tokens >= args.seq_len:
        raise ValueError(f"--prompt-lens: got {args.prompt_lens}; accepted: integers >= 1 with prompt + "
                         f"--max-tokens ({args.max_tokens}) < --seq-len ({args.seq_len})")
    from scripts.bench_inference import check_model_flags

    if args.decode not in DECODE_MODES:
        raise ValueError(f"--decode: got {args.decode!r}; accepted: {'|'.join(DECODE_MODES)}")
    if args.graph_step not in GRAPH_STEPS:
        raise ValueError(f"--graph-step: got {args.graph_step!r}; accepted: {'|'.join(GRAPH_STEPS)}")
    check_model_flags(args)
    if args.decode == "graphs" and args.device in ("cpu", "mps"):   # else the Engine refuses after the model
        raise ValueError(f"--decode: got 'graphs' with --device {args.device}; accepted there: "
                         "auto|eager|compile|static (graphs needs CUDA)")
    return args


def _ints(flag: str, text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag}: got {text!r}; accepted: comma-separated integers") from None
    return values


def run_mode(engine, slots: int, prompts: list[list[int]], args) -> dict:
    """Serve every prompt from `args.clients` threads; slots 1: the plain Engine behind a lock."""
    from nanochat.batching import BatchedEngine

    batched = BatchedEngine(engine, slots) if slots > 1 else None
    warm = batched.warmup() if batched else engine.warmup(batch_sizes=(1,))
    lock, todo, results, errors = threading.Lock(), list(range(len(prompts))), [], []

    def client():
        try:
            serve_requests()
        except Exception as e:  # noqa: BLE001 - re-raised by run_mode: figures over fewer requests were printed
            errors.append(e)

    def serve_requests():
        while True:
            with lock:
                if not todo or errors:
                    return
                i = todo.pop(0)
            t0, first, n = time.perf_counter(), None, 0
            kw = dict(max_tokens=args.max_tokens, temperature=1.0, top_k=50, seed=i, stop_tokens=())
            if batched is None:
                serve_lock.acquire()   # one request at a time, as a one-slot replica
            try:
                for _ in (batched or engine).generate(prompts[i], **kw):
                    first = first or time.perf_counter() - t0
                    n += 1
            finally:
                if batched is None:
                    serve_lock.release()
            results.append((time.perf_counter() - t0, first, n))

    serve_lock = threading.Lock()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if batched is not None:
        batched.close()   # its thread, cache and decoders would stay for the next mode
    if errors:
        raise RuntimeError(f"bench_serving: slots {slots}: a request failed ({len(results)} of {len(prompts)} "
                           f"done): {type(errors[0]).__name__}: {errors[0]}") from errors[0]
    lat, ttft = [r[0] for r in results], [r[1] for r in results]
    tokens = sum(r[2] for r in results)
    return {"bench": "serving", "slots": slots, "clients": args.clients, "requests": len(results),
            "tokens": tokens, "wall_s": round(wall, 3), "tok_per_s": round(tokens / wall, 1),
            "latency_p50_s": round(pct(lat, 0.5), 3), "latency_p95_s": round(pct(lat, 0.95), 3),
            "ttft_p50_s": round(pct(ttft, 0.5), 4), "ttft_p95_s": round(pct(ttft, 0.95), 4),
            "mean_batch": round(batched.rows_stepped / max(batched.steps, 1), 2) if batched else 1.0,
            "row_moves": batched.moves if batched else 0, "warmup_s": round(warm, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from nanochat.common import init_runtime
    from nanochat.engine import Engine
    from nanochat.platform import check_benchmark_device, detect_device
    from scripts.bench_inference import build_model

    check_benchmark_device(args.device, SMOKE_RUN)
    rt = init_runtime(args.device, args.dtype, seed=args.seed)
    args.window_pattern = "SSSL"
    model = build_model(args, rt)
    spec = detect_device(rt.device)
    print(json.dumps({"bench": "config", "device": spec.name, "torch": torch.__version__, "dtype": rt.dtype_name,
                      "depth": args.depth, "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                      "clients": args.clients, "requests": args.requests, "prompt_lens": args.prompt_lens,
                      "max_tokens": args.max_tokens}), flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, args.vocab_size, (args.prompt_lens[i % len(args.prompt_lens)],),
                             generator=gen).tolist() for i in range(args.requests)]
    rows = []
    for slots in args.slots:
        engine = Engine(model, None, decode=args.decode, graph_step=args.graph_step)
        rows.append(run_mode(engine, slots, prompts, args))
        print(json.dumps(rows[-1]), flush=True)
        del engine
    print_table(rows)
    return 0


def print_table(rows: list[dict]) -> None:
    """The rows for people, each column with its unit: latency and TTFT in seconds (the header named
    no unit, and load_test's table prints the same figures in milliseconds)."""
    print(f"\n{'slots':>5} {'tok/s':>9} {'lat p50 s':>10} {'lat p95 s':>10} {'ttft p50 s':>11} {'ttft p95 s':>11} "
          f"{'mean batch':>10}")
    for r in rows:
        print(f"{r['slots']:>5} {r['tok_per_s']:>9.1f} {r['latency_p50_s']:>10.2f} {r['latency_p95_s']:>10.2f} "
              f"{r['ttft_p50_s']:>11.3f} {r['ttft_p95_s']:>11.3f} {r['mean_batch']:>10.2f}")


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("bench_serving", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
