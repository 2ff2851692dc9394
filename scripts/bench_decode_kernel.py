"""Benchmark the persistent batch-1 decode kernel alone (nanochat/triton_decode.py) over tile configs.

For a randomly initialised model (d20 by default) with a KV cache filled to --prompt-len, each
config's one-launch decode step is captured in a CUDA graph of --steps launches and replayed;
the median over --repeats replays gives ms per step, and (weight bytes + visible KV bytes) / time
the achieved bandwidth and its share of the device's (nanochat/platform.py). Prints one JSON line
per config, then a table. A config that cannot be resident on the GPU, or fails to compile, is
reported and skipped.

    python -m scripts.bench_decode_kernel --depth 20 --trace --configs 16x256x512,16x256x512p0,16x256x1024
    python -m scripts.bench_decode_kernel --quantize none,int8 --configs 16x256x512,32x512x1024

--quantize int8 runs the configs again over the same model's matrices as int8 (nanochat/quantize.py;
bytes per step count the int8 weights and their scales).

Config syntax: ROWSxKxKMLP[wWARPS][uUNROLL][kKEYS][qROWS][fROWS][pMASK][hSTAGES][nPROGRAMS]: block_rows x
block_k x block_k_mlp, then optionally num_warps, unroll, key_block, block_rows_qkv, block_rows_fc,
preload (a phase bit mask: 1 q/k/v, 2 proj, 4 fc, 8 MLP proj), head_stages, programs (the grid;
default one per SM); PersistentDecodeStep's
defaults otherwise. The end-to-end comparison with the compiled CUDA-graph step is
`scripts/bench_inference.py --graph-step persistent,compiled`.
"""

from __future__ import annotations

import json
import re
import statistics
import sys

CONFIG_RE = re.compile(r"^(\d+)x(\d+)x(\d+)(?:w(\d+))?(?:u(\d+))?(?:k(\d+))?(?:q(\d+))?(?:f(\d+))?(?:p(\d+))?"
                       r"(?:h(\d+))?(?:n(\d+))?$")
FIELDS = (("w", "num_warps"), ("u", "unroll"), ("k", "key_block"), ("q", "block_rows_qkv"), ("f", "block_rows_fc"),
          ("p", "preload"), ("h", "head_stages"), ("n", "programs"))


def parse_config(text: str) -> dict:
    m = CONFIG_RE.match(text.strip())
    if m is None:
        raise ValueError(f"--configs: got {text!r}; accepted: "
                         "ROWSxKxKMLP[wWARPS][uUNROLL][kKEYS][qROWS][fROWS][pMASK][hSTAGES][nPROGRAMS], e.g. 16x512x512w8u10k64q32p1h1n100")
    rows, k, kmlp, *rest = m.groups()
    conf = dict(block_rows=int(rows), block_k=int(k), block_k_mlp=int(kmlp))
    return conf | {name: int(v) for (_, name), v in zip(FIELDS, rest) if v is not None}


def config_name(conf: dict) -> str:
    return (f"{conf['block_rows']}x{conf['block_k']}x{conf['block_k_mlp']}"
            + "".join(f"{tag}{conf[name]}" for tag, name in FIELDS if name in conf))


def parse_args(argv=None):
    from nanochat.flags import FlagParser

    p = FlagParser(prog="python -m scripts.bench_decode_kernel", description=__doc__.split("\n")[0])
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--vocab-size", "--vocab_size", dest="vocab_size", type=int, default=32768)
    p.add_argument("--seq-len", "--seq_len", dest="seq_len", type=int, default=2048)
    p.add_argument("--window-pattern", "--window_pattern", dest="window_pattern", default="SSSL")
    p.add_argument("--prompt-len", "--prompt_len", dest="prompt_len", type=int, default=512,
                   help="position of the decoded token (keys before it are visible)")
    p.add_argument("--configs", default="16x256x512,16x256x512p0", help="comma list, see the module docstring")
    p.add_argument("--steps", type=int, default=50, help="launches per CUDA graph")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", default="none",
                   help="comma list of none|int8: the matrices as the step reads them (nanochat/quantize.py); "
                        "every config runs for each, none first")
    p.add_argument("--trace", action="store_true",
                   help="also time each phase kind in-kernel (%%globaltimer at every grid barrier), "
                        "mean of --steps launches")
    args = p.parse_args(argv)
    args.configs = [parse_config(c) for c in args.configs.split(",") if c.strip()]
    if not args.configs:
        raise ValueError("--configs: empty; accepted: a comma list of "
                         "ROWSxKxKMLP[wWARPS][uUNROLL][kKEYS][qROWS][fROWS][pMASK][hSTAGES][nPROGRAMS]")
    from nanochat.quantize import parse_quantize_list

    args.quantize = parse_quantize_list(args.quantize)
    for name in ("depth", "steps", "repeats", "vocab_size", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: an integer >= 1")
    if not 0 <= args.prompt_len < args.seq_len:
        raise ValueError(f"--prompt-len: got {args.prompt_len}; accepted: 0 <= prompt-len < --seq-len {args.seq_len}")
    from scripts.bench_inference import check_model_flags

    check_model_flags(args)  # --seed, --window-pattern
    return args


def time_config(step, ids, pos, steps: int, repeats: int) -> float:
    """Median seconds per step of `steps` launches replayed from one CUDA graph."""
    from nanochat.gpu_timing import graph_times

    return statistics.median(graph_times(lambda i: step.launch(ids, pos), steps, repeats))


def trace_phases(step, ids, pos, launches: int) -> dict:
    """Mean in-kernel microseconds per phase kind over `launches` direct launches."""
    import torch

    step.launch(ids, pos)
    sums: dict = {}
    for _ in range(launches):
        step.launch(ids, pos)
        torch.cuda.synchronize()
        for k, v in step.phase_times().items():
            sums[k] = sums.get(k, 0.0) + v / launches
    return {k: round(v, 1) for k, v in sums.items()}


def time_configs(args, model, cache, ids, pos, quant: str, nbytes: int, spec) -> list[dict]:
    """One JSON row per config of --configs: ms per step, registers, achieved GB/s (nbytes per
    step), or the error that kept the config from running."""
    import torch

    from nanochat.triton_decode import PersistentDecodeStep

    rows = []
    with torch.no_grad(), model.inference_weights():
        for conf in args.configs:
            row = {"bench": "persistent_step", "quantize": quant, "bytes_per_step": nbytes, **conf}
            try:
                step = PersistentDecodeStep(model, cache, **conf)
                t = time_config(step, ids, pos, args.steps, args.repeats)
            except (ValueError, RuntimeError) as e:  # not resident, out of resources: report, go on
                row["error"] = str(e).splitlines()[0][:200]
            else:
                gbs = nbytes / t / 1e9
                row.update(step_ms=1e3 * t, registers=step.registers, achieved_gbs=gbs,
                           bandwidth_util=gbs / spec.bandwidth_gbs if spec.bandwidth_gbs else None)
                if args.trace:
                    row["phase_us"] = trace_phases(PersistentDecodeStep(model, cache, trace=True, **conf), ids, pos,
                                                   args.steps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    from nanochat.attention import KVCache
    from nanochat.common import init_runtime
    from nanochat.platform import detect_device
    from nanochat.quantize import quantize_model
    from scripts.bench_inference import build_model, visible_kv_bytes, weight_bytes_per_step

    if not torch.cuda.is_available():
        from nanochat.errors import RequestError

        raise RequestError("needs a CUDA GPU (it times the kernel in CUDA graphs); the CPU path of the kernel "
                           "is tested under TRITON_INTERPRET=1 in tests/test_triton_decode.py")
    rt = init_runtime("cuda", "bf16", seed=args.seed)
    spec = detect_device(rt.device)
    model = build_model(args, rt)
    cfg = model.config
    cache = KVCache(1, cfg.n_kv_head, cfg.sequence_len, cfg.head_dim, cfg.n_layer, rt.device, rt.dtype)
    for k, v in zip(cache.k, cache.v):  # a filled prefix; its values do not change the timing
        k.normal_()
        v.normal_()
    ids = torch.zeros(1, 1, dtype=torch.long, device=rt.device)
    pos = torch.full((1,), args.prompt_len, dtype=torch.long, device=rt.device)
    print(json.dumps({"bench": "config", "device": spec.name, "torch": torch.__version__,
                      "triton": triton.__version__, "depth": args.depth, "prompt_len": args.prompt_len,
                      "quantize": args.quantize, "bandwidth_gbs": spec.bandwidth_gbs}), flush=True)
    rows = []
    for quant in args.quantize:
        quantize_model(model, quant)
        nbytes = weight_bytes_per_step(model, 1) + visible_kv_bytes(model, args.prompt_len, 2)
        rows += time_configs(args, model, cache, ids, pos, quant, nbytes, spec)
    print(f"\n{spec.name}, d{args.depth}, prompt {args.prompt_len}")
    print(f"{'weights':<8}{'config':<24}{'step ms':>9}{'regs':>6}{'GB/s':>8}{'BW util':>8}")
    for r in rows:
        name = config_name(r)
        if "error" in r:
            print(f"{r['quantize']:<8}{name:<24}  {r['error'][:60]}")
        else:
            util = f"{100 * r['bandwidth_util']:.0f}%" if r["bandwidth_util"] else "-"
            print(f"{r['quantize']:<8}{name:<24}{r['step_ms']:>9.3f}{r['registers']:>6}{r['achieved_gbs']:>8.0f}"
                  f"{util:>8}")
            if "phase_us" in r:
                print("    phases (us, summed over layers, each with its closing barrier): "
                      + ", ".join(f"{k} {v}" for k, v in r["phase_us"].items()))
    return 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("bench_decode_kernel", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
