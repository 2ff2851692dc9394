"""Inference benchmark: prefill tok/s, decode tok/s at several batch sizes, time to first token, and
decode memory-bandwidth utilisation, for a randomly initialised model (d20-sized by default).

    python -m scripts.bench_inference                                    # d20 on the GPU
    python -m scripts.bench_inference --decode eager                     # without torch.compile
    python -m scripts.bench_inference --device cpu --depth 2 --prompt-len 64 --decode-tokens 16 \
        --batch-sizes 1,4 --vocab-size 4096                              # a CPU smoke run

Prints one JSON line per measurement and a table. Bandwidth utilisation = (bytes of the weights
every decode step reads + bytes of KV cache it reads) / step time / the device's bandwidth from
nanochat.platform's device table (absent for CPUs and unknown GPUs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=int, default=32768)
    p.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=2048, help="model context")
    p.add_argument("--window-pattern", "--window_pattern", dest="window_pattern", default="SSSL")
    p.add_argument("--prompt-len", "--prompt_len", dest="prompt_len", type=int, default=512)
    p.add_argument("--decode-tokens", "--decode_tokens", dest="decode_tokens", type=int, default=128)
    p.add_argument("--batch-sizes", "--batch_sizes", dest="batch_sizes", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (median reported)")
    p.add_argument("--decode", default="auto", help="auto|eager|compile (auto: compile on CUDA)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda|mps")
    p.add_argument("--dtype", default="auto", help="auto|bf16|fp32 (weights and activations)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes: got {args.batch_sizes!r}; accepted: comma-separated integers >= 1") from None
    for name in ("depth", "prompt_len", "decode_tokens", "repeats", "vocab_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: an integer >= 1")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes: got {args.batch_sizes}; accepted: comma-separated integers >= 1")
    if args.prompt_len + args.decode_tokens + 1 > args.seq_len:
        raise ValueError(f"--prompt-len + --decode-tokens: {args.prompt_len} + {args.decode_tokens} + 1 exceeds "
                         f"--seq-len {args.seq_len}")
    return args


def build_model(args, rt):
    """A random model of the requested size with weights stored in the compute dtype (inference
    keeps no fp32 master copy, so a decode step reads 2-byte weights on the GPU)."""
    import torch

    from nanochat.gpt import GPT, config_for_depth

    config = config_for_depth(args.depth, args.vocab_size, args.seq_len, window_pattern=args.window_pattern)
    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = GPT(config, compute_dtype=rt.dtype)
    model.to_empty(device=rt.device)
    model.init_weights()
    return model.to(rt.dtype).eval()


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters a decode step reads: every matrix; embedding tables are row lookups."""
    lookups = {id(model.wte.weight)} | {id(e.weight) for e in model.value_embeds.values()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in lookups)


def kv_bytes_per_step(model, batch: int, pos: float, elem_size: int) -> float:
    """Bytes of K and V a decode step reads at position `pos` (windowed layers read the window)."""
    cfg = model.config
    per_token = 2 * cfg.n_kv_head * cfg.head_dim * elem_size * batch
    return sum(per_token * (pos if w is None else min(pos, w)) for w in model.windows)


def timed(rt, fn) -> float:
    rt.synchronize()
    t0 = time.perf_counter()
    fn()
    rt.synchronize()
    return time.perf_counter() - t0


def bench_prefill(engine, rt, prompt, repeats) -> dict:
    import torch

    def prefill():
        cache = engine.new_cache(1, len(prompt))
        with torch.inference_mode():
            engine.model(torch.tensor([prompt], device=rt.device), kv_cache=cache)

    prefill()  # warm-up
    t = statistics.median(timed(rt, prefill) for _ in range(repeats))
    return {"bench": "prefill", "batch": 1, "prompt_len": len(prompt), "seconds": t, "tok_per_s": len(prompt) / t}


def bench_decode(engine, rt, prompt, batch, n, repeats, bandwidth_gbs) -> dict:
    """Time to first token (prefill + first sample) and decode steps after it, at `batch`."""
    firsts, decodes = [], []
    for rep in range(repeats + 1):  # the first run warms up (and compiles)
        rt.reset_peak_memory()
        rt.synchronize()
        t0 = time.perf_counter()
        gen = engine.generate(prompt, num_samples=batch, max_tokens=n + 1, temperature=1.0, top_k=50,
                              seed=rep, stop_tokens=())
        next(gen)
        t1 = time.perf_counter()
        steps = sum(1 for _ in gen)
        rt.synchronize()
        t2 = time.perf_counter()
        assert steps == n, f"expected {n} decode steps, got {steps}"
        if rep:
            firsts.append(t1 - t0)
            decodes.append(t2 - t1)
    step = statistics.median(decodes) / n
    elem = engine.cache_dtype.itemsize if hasattr(engine.cache_dtype, "itemsize") else 2
    read = weight_bytes_per_step(engine.model) + kv_bytes_per_step(engine.model, batch, len(prompt) + n / 2, elem)
    gbs = read / step / 1e9
    return {"bench": "decode", "batch": batch, "prompt_len": len(prompt), "decode_tokens": n,
            "ttft_s": statistics.median(firsts), "step_ms": step * 1e3, "tok_per_s": batch / step,
            "bytes_per_step": int(read), "achieved_gbs": gbs,
            "bandwidth_util": gbs / bandwidth_gbs if bandwidth_gbs else None,
            "peak_mem_gb": rt.peak_memory_bytes() / 1e9}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from nanochat.common import init_runtime
    from nanochat.engine import Engine
    from nanochat.platform import detect_device

    rt = init_runtime(args.device, args.dtype, seed=args.seed)
    spec = detect_device(rt.device)
    model = build_model(args, rt)
    engine = Engine(model, None, decode=args.decode)
    params = sum(p.numel() for p in model.parameters())
    header = {"bench": "config", "device": spec.name, "torch": torch.__version__, "dtype": rt.dtype_name,
              "decode": engine.decode_mode, "depth": args.depth, "n_embd": model.config.n_embd,
              "n_head": model.config.n_head, "vocab": args.vocab_size, "params_m": params / 1e6,
              "weight_bytes_per_step": weight_bytes_per_step(model), "bandwidth_gbs": spec.bandwidth_gbs}
    print(json.dumps(header), flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, args.vocab_size, (args.prompt_len,), generator=gen).tolist()
    rows = [bench_prefill(engine, rt, prompt, args.repeats)]
    print(json.dumps(rows[-1]), flush=True)
    for batch in args.batch_sizes:
        rows.append(bench_decode(engine, rt, prompt, batch, args.decode_tokens, args.repeats, spec.bandwidth_gbs))
        print(json.dumps(rows[-1]), flush=True)

    print(f"\n{spec.name}, d{args.depth} ({params / 1e6:.0f}M params, {rt.dtype_name}), decode={engine.decode_mode}, "
          f"prompt {args.prompt_len}, {args.decode_tokens} decode tokens")
    print(f"{'measurement':<14}{'batch':>6}{'tok/s':>12}{'step ms':>10}{'TTFT ms':>10}{'GB/s':>9}{'BW util':>9}")
    for r in rows:
        util = f"{100 * r['bandwidth_util']:.0f}%" if r.get("bandwidth_util") else "-"
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else f"{1e3 * r['seconds']:.1f}"
        ttft = f"{1e3 * r['ttft_s']:.1f}" if "ttft_s" in r else "-"
        gbs = f"{r['achieved_gbs']:.0f}" if "achieved_gbs" in r else "-"
        print(f"{r['bench']:<14}{r['batch']:>6}{r['tok_per_s']:>12,.0f}{step:>10}{ttft:>10}{gbs:>9}{util:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
