"""Inference benchmark: prefill tok/s, decode tok/s at several batch sizes, time to first token, and
decode memory-bandwidth utilisation, for a randomly initialised model (d20-sized by default).

    python -m scripts.bench_inference                                    # d20 on the GPU
    python -m scripts.bench_inference --decode graphs,compile,eager      # compare decode modes
    python -m scripts.bench_inference --device cpu --depth 2 --prompt-len 64 --decode-tokens 16 \
        --batch-sizes 1,4 --vocab-size 4096                              # a CPU smoke run

Prints one JSON line per measurement and a table. Bandwidth utilisation = (bytes of the weights
every decode step reads (every matrix whole, the embedding rows it gathers) + bytes of KV cache it
reads) / step time / the device's bandwidth from
nanochat.platform's device table (absent for CPUs and unknown GPUs). The KV bytes are what the mode
actually reads: eager/compile, the persistent batch-1 step and the static/graphs steps' Triton
decode kernel (CUDA, --decode-kernel triton|triton_fused: its masked loads skip invisible keys)
read the filled prefix (window layers only their window); the static/graphs steps through SDPA
(--decode-kernel sdpa, and every CPU run) read the whole length bucket in every layer (masked).
`step_ms` is the engine's end-to-end step (model + sampling + the per-token Python); for
static/graphs, `model_step_ms` is the decode step alone (input copy + graph replay), timed back to
back at one position, and its bandwidth uses the bytes of a step at that position.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SMOKE_RUN = ("python -m scripts.bench_inference --device cpu --depth 2 --prompt-len 64 --decode-tokens 16 "
             "--batch-sizes 1,4 --vocab-size 4096")


def parse_args(argv=None) -> argparse.Namespace:
    from nanochat.flags import FlagParser

    p = FlagParser(prog="python -m scripts.bench_inference", description=__doc__.split("\n\n")[0],
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=int, default=32768)
    p.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=2048, help="model context")
    p.add_argument("--window-pattern", "--window_pattern", dest="window_pattern", default="SSSL")
    p.add_argument("--prompt-len", "--prompt_len", dest="prompt_len", type=int, default=512)
    p.add_argument("--decode-tokens", "--decode_tokens", dest="decode_tokens", type=int, default=128)
    p.add_argument("--batch-sizes", "--batch_sizes", dest="batch_sizes", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (median reported)")
    p.add_argument("--decode", default="auto",
                   help="comma-separated decode modes to compare: auto|graphs|compile|eager|static "
                        "(auto: graphs on CUDA, eager elsewhere)")
    p.add_argument("--graph-step", "--graph_step", dest="graph_step", default="compiled",
                   help="comma list of auto|compiled|eager|persistent: what a graphs step runs (persistent: "
                        "batch 1 as one persistent Triton kernel, nanochat/triton_decode.py); static runs the plain "
                        "model (compiled is eager there) or persistent; rows whose step is not the mode's own "
                        "(graphs: compiled, static: eager) are labelled <mode>/<graph step>; warmup and decode rows "
                        "name the step in graph_step")
    p.add_argument("--decode-bucket", "--decode_bucket", dest="decode_bucket", type=int, default=256,
                   help="attention length bucket of the static/graphs steps")
    p.add_argument("--fused-qkv", "--fused_qkv", dest="fused_qkv", default="on",
                   help="on|off|on,off: decode with one q/k/v matmul per layer (GPT.inference_weights) "
                        "or three; 'off' rows are labelled <mode>/unfused (none only: int8 is always fused)")
    p.add_argument("--decode-kernel", "--decode_kernel", dest="decode_kernel", default="triton_fused",
                   help="comma list of triton|triton_fused|sdpa: the static/graphs step's attention "
                        "(attention.set_decode_kernel); rows other than the default (triton_fused) are labelled <mode>/<kernel>")
    p.add_argument("--sampler", default="auto",
                   help="comma list of auto|torch|triton: how tokens are drawn (nanochat/sampling.py; auto: "
                        "the Triton kernel on CUDA); rows other than auto are labelled <mode>+<sampler>")
    p.add_argument("--quantize", default="none",
                   help="comma list of none|int8: the weights as served (nanochat/quantize.py); int8 runs after "
                        "none (the model is quantised in place) and its rows are labelled <mode>+int8")
    p.add_argument("--profile", action="store_true",
                   help="static/graphs modes: print the top kernels of one decode step, and the GPU "
                        "timeline of generated tokens end to end (busy, idle, the largest gaps; torch.profiler)")
    p.add_argument("--ttft-lengths", "--ttft_lengths", dest="ttft_lengths", default="",
                   help="comma list of prompt lengths: after warmup, the time to first token of one "
                        "request at each (lengths not seen before: what a chat server's requests pay)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda|mps")
    p.add_argument("--dtype", default="auto", help="auto|bf16|fp32 (weights and activations)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes: got {args.batch_sizes!r}; accepted: comma-separated integers >= 1") from None
    for name in ("depth", "prompt_len", "decode_tokens", "repeats", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: an integer >= 1")
    if args.vocab_size < 2:   # the --ttft-lengths prompts cycle through tokens 1..vocab-1 (a modulo by zero)
        raise ValueError(f"--vocab-size: got {args.vocab_size}; accepted: an integer >= 2")
    from nanochat.engine import DECODE_MODES, GRAPH_STEPS

    args.fused_qkv = [v.strip() for v in args.fused_qkv.split(",") if v.strip()]
    if not args.fused_qkv or set(args.fused_qkv) - {"on", "off"}:
        raise ValueError(f"--fused-qkv: got {','.join(args.fused_qkv)!r}; accepted: on|off|on,off")
    from nanochat.attention import DECODE_KERNELS

    args.decode_kernel = [v.strip() for v in args.decode_kernel.split(",") if v.strip()]
    if not args.decode_kernel or set(args.decode_kernel) - set(DECODE_KERNELS):
        raise ValueError(f"--decode-kernel: got {','.join(args.decode_kernel)!r}; accepted: comma-separated "
                         f"{'|'.join(DECODE_KERNELS)}")
    from nanochat.sampling import SAMPLER_BACKENDS

    args.sampler = [v.strip() for v in args.sampler.split(",") if v.strip()]
    if not args.sampler or set(args.sampler) - set(SAMPLER_BACKENDS):
        raise ValueError(f"--sampler: got {','.join(args.sampler)!r}; accepted: comma-separated "
                         f"{'|'.join(SAMPLER_BACKENDS)}")
    from nanochat.quantize import parse_quantize_list

    args.quantize = parse_quantize_list(args.quantize)
    args.decode = [m.strip() for m in args.decode.split(",") if m.strip()]
    if not args.decode or set(args.decode) - set(DECODE_MODES):
        raise ValueError(f"--decode: got {','.join(args.decode)!r}; accepted: comma-separated {'|'.join(DECODE_MODES)}")
    args.graph_step = [v.strip() for v in args.graph_step.split(",") if v.strip()]
    if not args.graph_step or set(args.graph_step) - set(GRAPH_STEPS):
        raise ValueError(f"--graph-step: got {','.join(args.graph_step)!r}; accepted: comma-separated "
                         f"{'|'.join(GRAPH_STEPS)}")
    # combinations the Engine refuses, refused here: they raised after the model was built (d20 on
    # a CPU: minutes), or in the middle of a run after the rows before them
    if "persistent" in args.graph_step and "off" in args.fused_qkv:
        raise ValueError("--graph-step persistent: reads the fused q/k/v weights; it cannot run with "
                         "--fused-qkv off (accepted: --fused-qkv on, or a --graph-step list without persistent)")
    if "int8" in args.quantize and "on" not in args.fused_qkv:
        # an int8 model's q/k/v is always one fused product (quantize.py): its rows would be
        # labelled /unfused while running fused
        raise ValueError("--fused-qkv off: an int8 model always runs q/k/v as one fused product "
                         "(nanochat/quantize.py); accepted with --quantize int8: --fused-qkv on or on,off "
                         "(int8 then runs the on rows only)")
    if "graphs" in args.decode and args.device in ("cpu", "mps"):
        raise ValueError(f"--decode graphs: needs a CUDA device, got --device {args.device}; accepted there: "
                         "auto|eager|compile|static")
    try:
        args.ttft_lengths = [int(n) for n in args.ttft_lengths.split(",") if n.strip()]
    except ValueError:
        raise ValueError(f"--ttft-lengths: got {args.ttft_lengths!r}; accepted: comma-separated integers") from None
    if any(n < 1 or n + 2 > args.seq_len for n in args.ttft_lengths):
        raise ValueError(f"--ttft-lengths: got {args.ttft_lengths}; accepted: integers from 1 to --seq-len - 2")
    if args.decode_bucket < 1:
        raise ValueError(f"--decode-bucket: got {args.decode_bucket}; accepted: an integer >= 1")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes: got {args.batch_sizes}; accepted: comma-separated integers >= 1")
    if args.prompt_len + args.decode_tokens + 1 > args.seq_len:
        raise ValueError(f"--prompt-len + --decode-tokens: {args.prompt_len} + {args.decode_tokens} + 1 exceeds "
                         f"--seq-len {args.seq_len}")
    check_model_flags(args)
    return args


def check_model_flags(args) -> None:
    """--device, --dtype, --seed and --window-pattern, checked before anything is built (shared with
    bench_serving and bench_decode_kernel, whose models build_model makes)."""
    from nanochat.common import DEVICE_CHOICES, DTYPE_ALIASES
    from nanochat.flags import require, require_int

    if hasattr(args, "device"):
        require(args.device in DEVICE_CHOICES, "--device", args.device, "|".join(DEVICE_CHOICES))
    if hasattr(args, "dtype"):
        require(args.dtype in DTYPE_ALIASES, "--dtype", args.dtype, "|".join(DTYPE_ALIASES))
    require_int(args.seed, "--seed", 0)
    pattern = getattr(args, "window_pattern", "SSSL")
    require(bool(pattern) and not set(pattern) - {"S", "L"}, "--window-pattern", pattern,
            "a non-empty string of S (short window) and L (full) letters, e.g. SSSL")


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


def weight_bytes_per_step(model, batch: int = 0) -> int:
    """Bytes of weights a decode step of `batch` rows reads: every matrix, read whole (lm_head
    included; int8 ones with their scales) and the per-layer scalars, plus the embedding rows it
    gathers: one row of the token table and one of each value-embedding table per row (the tables
    themselves are never streamed). RMSNorm has no weights. batch 0: the matrices alone."""
    from nanochat.quantize import matrix_bytes

    return matrix_bytes(model) + batch * lookup_row_bytes(model)


def lookup_row_bytes(model) -> int:
    """Bytes one row's decode step gathers from the embedding tables: a token-table row and, per
    value-embedding layer, a row of its table."""
    tables = [model.wte.weight] + [e.weight for e in model.value_embeds.values()]
    return sum(t.shape[1] * t.element_size() for t in tables)


def kv_bytes_per_step(engine, batch: int, first_pos: int, n: int) -> float:
    """Mean bytes of K and V a decode step reads over the positions [first_pos, first_pos + n):
    static/graphs steps through SDPA read the whole length bucket in every layer; the dynamic
    paths, the persistent batch-1 step and the Triton decode kernel read the filled prefix,
    window layers at most their window."""
    from nanochat.decode import bucket_length

    model = engine.model
    cfg = model.config
    elem = torch_itemsize(engine.cache_dtype)
    per_token = 2 * cfg.n_kv_head * cfg.head_dim * elem * batch
    reads_bucket = static_step_reads_bucket(engine, batch)
    total = 0
    for pos in range(first_pos, first_pos + n):
        if reads_bucket:
            total += per_token * len(model.windows) * bucket_length(pos + 1, engine.max_seq_len, engine.decode_bucket)
        else:
            total += visible_kv_bytes(model, pos, elem) * batch
    return total / n


def static_step_reads_bucket(engine, batch: int) -> bool:
    """Whether this engine's decode step at `batch` reads the whole length bucket of every layer:
    a static/graphs step (not the persistent batch-1 kernel) whose attention is SDPA with a mask.
    The Triton decode kernel that attention._static_decode_attention picks on CUDA (its own test,
    asked with a probe tensor) loads only the visible keys (masked loads read no memory), so
    counting the bucket there overstated the bytes, and the bandwidth, by up to ~1.5x at d20."""
    import torch

    from nanochat import attention

    if engine.decode_mode not in ("static", "graphs") or (engine.graph_step == "persistent" and batch == 1):
        return False
    probe = torch.empty((1, 1, 1, engine.model.config.head_dim), device=engine.device)
    return not attention._triton_decode_ok(probe)


def visible_kv_bytes(model, pos: int, elem: int) -> int:
    """K and V bytes one row's step reads at `pos` when it reads only visible keys: the filled
    prefix, window layers at most their window."""
    cfg = model.config
    per_key = 2 * cfg.n_kv_head * cfg.head_dim * elem
    return sum(per_key * (pos + 1 if w is None else min(pos + 1, w)) for w in model.windows)


def torch_itemsize(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def timed(rt, fn) -> float:
    rt.synchronize()
    t0 = time.perf_counter()
    fn()
    rt.synchronize()
    return time.perf_counter() - t0


def label(engine, batch: int | None = None) -> str:
    """The engine's configuration as a row label; with `batch`, the step that batch really runs
    (the persistent kernel runs batch 1 only: a batch-8 row of a persistent engine says so)."""
    from nanochat.attention import DECODE_KERNEL, DEFAULT_DECODE_KERNEL

    kernel = "" if DECODE_KERNEL == DEFAULT_DECODE_KERNEL or engine.decode_mode not in ("static", "graphs") else f"/{DECODE_KERNEL}"
    own_step = {"graphs": "compiled", "static": "eager"}.get(engine.decode_mode)   # what the bare mode name means
    runs = engine.graph_step if batch is None or own_step is None else engine.step_at(batch)
    step = "" if own_step in (None, runs) else f"/{runs}"
    if own_step and runs != engine.graph_step:
        step += f"(not {engine.graph_step})"
    sampler = "" if engine.sampler == "auto" else f"+{engine.sampler}"
    quant = getattr(engine.model, "quantization", "none")
    return (engine.decode_mode + ("" if engine.fused_qkv else "/unfused") + kernel + step + sampler
            + ("" if quant == "none" else f"+{quant}"))


def graph_step_of(engine) -> str | None:
    """What the engine's static/graphs steps run (Engine.graph_step); None for eager/compile decoding,
    which has no such step (its Engine still says eager: what a BatchedEngine's rows would run)."""
    return engine.graph_step if engine.decode_mode in ("static", "graphs") else None


def bench_prefill(engine, rt, prompt, repeats) -> dict:
    import torch

    def prefill():   # the Engine's own path (logits for the last position only)
        with engine.inference_weights(), torch.inference_mode():
            engine.prefill(prompt)

    # warm-up: >= 3 calls and 0.3 s, so the GPU's clock has left its idle state (one call left the
    # first timed ones at an idle clock: 31.7 ms for a prefill the TTFT row, which includes it, put
    # under 23 ms; H200, session 64)
    warm_until, calls = time.perf_counter() + 0.3, 0
    while calls < 3 or time.perf_counter() < warm_until:
        prefill()
        calls += 1
    rt.synchronize()
    t = statistics.median(timed(rt, prefill) for _ in range(repeats))
    return {"bench": "prefill", "batch": 1, "prompt_len": len(prompt), "seconds": t, "tok_per_s": len(prompt) / t}


def first_request_ttft(engine, rt, prompt) -> float:
    """Seconds to the first token of one batch-1 request (the benchmark's prompt, 2 tokens)."""
    rt.synchronize()
    t0 = time.perf_counter()
    gen = engine.generate(prompt, num_samples=1, max_tokens=2, temperature=1.0, top_k=50, seed=0, stop_tokens=())
    next(gen)
    seconds = time.perf_counter() - t0
    for _ in gen:
        pass
    return seconds


def bench_decode(engine, rt, prompt, batch, n, repeats, bandwidth_gbs) -> dict:
    """Time to first token (prefill + first sample) and decode steps after it, at `batch`."""
    firsts, decodes = [], []
    for rep in range(repeats + 1):  # the first run warms up (and compiles / captures)
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
    weights = weight_bytes_per_step(engine.model, batch)
    kv = kv_bytes_per_step(engine, batch, len(prompt), n)
    row = {"bench": "decode", "decode": label(engine, batch), "graph_step": engine.step_at(batch), "batch": batch,
           "prompt_len": len(prompt),
           "decode_tokens": n, "ttft_s": statistics.median(firsts), "step_ms": step * 1e3,
           "tok_per_s": batch / step, "weight_bytes": weights, "kv_bytes": int(kv),
           "bytes_per_step": int(weights + kv), "peak_mem_gb": rt.peak_memory_bytes() / 1e9,
           "sampler": engine.sampler_backend}
    row.update(bandwidth(weights + kv, step, bandwidth_gbs))
    decoder = engine.decoders.get(batch)
    if decoder is not None:
        position = len(prompt) + n // 2
        model_step = bench_model_step(decoder, rt, position, repeats)
        # the bytes of a step at that one position (the generation's mean is over other buckets
        # when the positions cross a bucket boundary)
        model_bytes = weights + kv_bytes_per_step(engine, batch, position, 1)
        row["model_step_ms"] = model_step * 1e3
        row["model_bytes_per_step"] = int(model_bytes)
        row.update({f"model_{k}": v for k, v in bandwidth(model_bytes, model_step, bandwidth_gbs).items()})
        row["graph_captures"] = decoder.captures
        row["capture_s"] = decoder.capture_seconds
    return row


def bandwidth(num_bytes: float, seconds: float, bandwidth_gbs) -> dict:
    gbs = num_bytes / seconds / 1e9
    return {"achieved_gbs": gbs, "bandwidth_util": gbs / bandwidth_gbs if bandwidth_gbs else None}


def bench_model_step(decoder, rt, position: int, repeats: int, steps: int = 100) -> float:
    """Seconds per static decode step alone (input copy + replay), back to back at one position
    (rewriting that slot's k/v each time), median over `repeats` runs of `steps` steps."""
    import torch

    column = [0] * decoder.batch_size
    with torch.inference_mode():
        decoder.step(column, position)  # captures this bucket if the generations did not
        times = [timed(rt, lambda: [decoder.step(column, position) for _ in range(steps)]) / steps
                 for _ in range(repeats)]
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from nanochat.attention import DEFAULT_DECODE_KERNEL, set_decode_kernel
    from nanochat.common import init_runtime
    from nanochat.platform import check_benchmark_device, detect_device
    from nanochat.quantize import quantize_model

    check_benchmark_device(args.device, SMOKE_RUN)
    rt = init_runtime(args.device, args.dtype, seed=args.seed)
    spec = detect_device(rt.device)
    model = build_model(args, rt)
    params = sum(p.numel() for p in model.parameters())
    header = {"bench": "config", "device": spec.name, "torch": torch.__version__, "dtype": rt.dtype_name,
              "decode": args.decode, "decode_kernel": args.decode_kernel, "graph_step": args.graph_step,
              "sampler": args.sampler, "quantize": args.quantize,
              "decode_bucket": args.decode_bucket,
              "depth": args.depth, "n_embd": model.config.n_embd, "n_head": model.config.n_head,
              "vocab": args.vocab_size, "params_m": params / 1e6,
              "weight_bytes_per_step": weight_bytes_per_step(model), "bandwidth_gbs": spec.bandwidth_gbs}
    print(json.dumps(header), flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, args.vocab_size, (args.prompt_len,), generator=gen).tolist()
    rows = []
    static = ("static", "graphs") + (("auto",) if rt.device_type == "cuda" else ())
    runs = [(m, f, k, g, s) for m in args.decode for f in args.fused_qkv
            for k in (args.decode_kernel if m in static else args.decode_kernel[:1])
            for g in graph_steps(m, args.graph_step, static) for s in args.sampler]
    try:
        for quant in args.quantize:
            quantize_model(model, quant)
            for mode, fused, kernel, graph_step, sampler in runs:
                if quant != "none" and fused == "off":   # the int8 q/k/v is fused either way (parse_args)
                    continue
                set_decode_kernel(kernel)
                _bench_mode(args, model, rt, spec, prompt, mode, fused, graph_step, sampler, rows)
    finally:
        set_decode_kernel(DEFAULT_DECODE_KERNEL)
    print_table(rows, spec, args, params, rt)
    return 0


def graph_steps(mode: str, requested: list[str], static: tuple) -> list[str]:
    """The --graph-step values worth a run of `mode`: each one for graphs; for static, whose step
    is the plain model unless persistent (Engine), compiled runs as eager, once; the first for the
    modes without a static step (it does not matter there)."""
    if mode == "static":
        return list(dict.fromkeys("eager" if g == "compiled" else g for g in requested))
    return requested if mode in static else requested[:1]


def _bench_mode(args, model, rt, spec, prompt, mode, fused, graph_step, sampler, rows) -> None:
    """Warm up one Engine configuration, then time prefill and decode at every batch size."""
    from nanochat.engine import Engine

    engine = Engine(model, None, decode=mode, decode_bucket=args.decode_bucket, graph_step=graph_step,
                    fused_qkv=fused == "on", sampler=sampler)
    t0 = time.perf_counter()
    warm = engine.warmup(all_buckets=False)  # the benchmark's buckets capture on first use
    first = first_request_ttft(engine, rt, prompt)   # what a server's first user sees after warmup
    print(json.dumps({"bench": "warmup", "decode": label(engine), "graph_step": graph_step_of(engine),
                      "graph_step_note": graph_step_of(engine) and engine.graph_step_note, "seconds": warm,
                      "first_ttft_s": first}), flush=True)
    for n in args.ttft_lengths:   # prompts of n distinct-from-earlier lengths, tokens 1..n
        ttft = first_request_ttft(engine, rt, [1 + i % (args.vocab_size - 1) for i in range(n)])
        print(json.dumps({"bench": "ttft_length", "decode": label(engine), "prompt_len": n, "ttft_s": ttft}),
              flush=True)
    rows.append(bench_prefill(engine, rt, prompt, args.repeats) | {"decode": label(engine)})
    print(json.dumps(rows[-1]), flush=True)
    for batch in args.batch_sizes:
        rows.append(bench_decode(engine, rt, prompt, batch, args.decode_tokens, args.repeats, spec.bandwidth_gbs))
        print(json.dumps(rows[-1]), flush=True)
    if args.profile and engine.decoders and rt.device_type == "cuda":
        profile_step(engine, args.batch_sizes[0], len(prompt) + args.decode_tokens // 2)
        profile_generate(engine, prompt, args.batch_sizes[0])
    print(json.dumps({"bench": "mode_done", "decode": label(engine),
                      "seconds": time.perf_counter() - t0}), flush=True)
    del engine


def profile_step(engine, batch: int, position: int, steps: int = 5) -> None:
    """Kernel time table of `steps` static decode steps launched without the graph (the kernels a
    graph replays are the same; replayed kernels are not attributed by the profiler), inside the
    engine's inference_weights() context like the timed steps (fused q/k/v when it is on)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanochat.decode import bucket_length

    decoder = engine.decoders.get(batch) or next(iter(engine.decoders.values()))
    length = bucket_length(position + 1, decoder.cache.seq_len, decoder.bucket)
    with engine.inference_weights(), torch.inference_mode():
        decoder.step([0] * decoder.batch_size, position)  # inputs in place
        decoder._run(length)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                decoder._run(length)
            torch.cuda.synchronize()
    print(f"profile: batch {decoder.batch_size}, bucket {length}, per {steps} steps", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70), flush=True)


def timeline(events) -> tuple[float, dict]:
    """(busy, gaps) of (name, start, end) events sorted by start: busy is the length of their
    union; gaps maps "A -> B" to [count, total] of the idle stretches that B ended, A being the
    event that had ended last before it (events on other streams may overlap)."""
    busy, gaps, last, end = 0.0, {}, None, None
    for name, start, stop in events:
        if end is not None and start > end:
            g = gaps.setdefault(f"{last[:40]} -> {name[:40]}", [0, 0.0])
            g[0] += 1
            g[1] += start - end
        if end is None or stop > end:
            busy += stop - (start if end is None else max(start, end))
            last, end = name, stop
    return busy, gaps


def profile_generate(engine, prompt, batch: int, tokens: int = 50) -> None:
    """GPU timeline of `tokens` tokens of Engine.generate (temperature 1, top-k 50) after 10 warm
    ones: per token the span from the first kernel's start to the last's end, the time some
    kernel or copy ran (busy), the rest (idle: launch gaps, waits), and the largest idle gaps, each
    named by the event that ended last before it and the one that ended it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gen = engine.generate(prompt, num_samples=batch, max_tokens=tokens + 11, temperature=1.0, top_k=50,
                          stop_tokens=())
    for _ in range(10):
        next(gen)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(tokens):
            next(gen)
        torch.cuda.synchronize()
    gen.close()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    span = (evs[-1].time_range.end - evs[0].time_range.start) / tokens
    busy, gaps = timeline([(e.name, e.time_range.start, e.time_range.end) for e in evs])
    busy /= tokens
    print(f"generate timeline: batch {batch}, {tokens} tokens: span {span:.1f} us per token, "
          f"busy {busy:.1f}, idle {span - busy:.1f}", flush=True)
    for name, (n, us) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:6]:
        print(f"  gap {us / n:7.1f} us x{n:4d}  {name}", flush=True)


def print_table(rows, spec, args, params, rt) -> None:
    print(f"\n{spec.name}, d{args.depth} ({params / 1e6:.0f}M params, {rt.dtype_name}), "
          f"prompt {args.prompt_len}, {args.decode_tokens} decode tokens, bucket {args.decode_bucket}")
    print(f"{'measurement':<12}{'decode':>8}{'batch':>6}{'tok/s':>11}{'step ms':>9}{'TTFT ms':>9}"
          f"{'MB/step':>9}{'BW util':>8}{'model ms':>9}{'model BW':>9}")
    pct = lambda u: f"{100 * u:.0f}%" if u else "-"  # noqa: E731
    for r in rows:
        step = f"{r['step_ms']:.2f}" if "step_ms" in r else f"{1e3 * r['seconds']:.1f}"
        ttft = f"{1e3 * r['ttft_s']:.1f}" if "ttft_s" in r else "-"
        mb = f"{r['bytes_per_step'] / 1e6:.0f}" if "bytes_per_step" in r else "-"
        model_ms = f"{r['model_step_ms']:.3f}" if "model_step_ms" in r else "-"
        print(f"{r['bench']:<12}{r['decode']:>8}{r['batch']:>6}{r['tok_per_s']:>11,.0f}{step:>9}{ttft:>9}{mb:>9}"
              f"{pct(r.get('bandwidth_util')):>8}{model_ms:>9}{pct(r.get('model_bandwidth_util')):>9}")


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("bench_inference", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
