"""Decode products with int8 weights: python -m scripts.bench_int8 [--depth 20] [--rows 1,8,32]

For each matrix of a d<depth> decode step (fused q/k/v, attention projection, MLP in and out,
lm_head) and each row count, times y = x @ W.T three ways on the GPU: the bf16 weight through
torch (cuBLAS, what an unquantised decode step runs), the int8 weight through
nanochat/triton_int8.py's kernel (what `--quantize int8` runs for up to 64 rows), and the int8
weight dequantised then cuBLAS (quantize.int8_linear's path for more rows). Each timing is a
CUDA graph of launches between CUDA events (GPU time, as in a graphed decode step), rotating over enough weight copies that they cannot sit
in L2; the median of --reps batches is reported with the weight bytes streamed per second and
that rate's share of the device's bandwidth (nanochat.platform's table). One JSON line per row,
then a table.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from nanochat.flags import FlagParser, require_int, script_main

L2_SPAN = 4   # weight copies cover this many times the L2 (or 200 MB where the size is unknown)


def parse_args(argv=None):
    p = FlagParser(prog="python -m scripts.bench_int8", description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=20, help="model size whose matrices are timed (as base_train builds it: width 64 x "
                   "depth rounded up to a multiple of 128, the vocab padded to a multiple of 64)")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--rows", default="1,8,32", help="comma list of input rows (decode batch sizes), 1..64")
    p.add_argument("--reps", type=int, default=7, help="timed batches per measurement (median reported)")
    p.add_argument("--launches", type=int, default=50, help="products per timed batch")
    p.add_argument("--sweep", action="store_true", help="also time the int8 kernel at every tile config of "
                   "SWEEP and print the fastest per matrix and row count (to tune triton_int8.gemv_config)")
    a = p.parse_args(argv)
    require_int(a.depth, "--depth", 1)
    require_int(a.vocab_size, "--vocab-size", 1)
    require_int(a.reps, "--reps", 1)
    require_int(a.launches, "--launches", 1)
    try:
        a.rows = [int(r) for r in a.rows.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--rows: got {a.rows!r}; accepted: a comma list of integers 1..64") from None
    if not a.rows or min(a.rows) < 1 or max(a.rows) > 64:
        raise ValueError(f"--rows: got {a.rows}; accepted: a comma list of integers 1..64 (the kernel's range)")
    if not torch.cuda.is_available():
        raise ValueError("bench_int8 times CUDA kernels; this machine has no CUDA GPU")
    return a


def matrices(depth: int, vocab: int) -> dict[str, tuple[int, int]]:
    """name -> (out, in) features of a d<depth> model's decode matrices, from the config base_train
    builds: its width is 64 x depth rounded up to a multiple of the head dim (d21: 1408, not 1344)
    and its lm_head has the padded vocab's rows (50,257 -> 50,304)."""
    from nanochat.gpt_config import config_for_depth

    cfg = config_for_depth(depth, vocab, 256)   # the sequence length shapes no matrix
    c, q, kv = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    return {"qkv": (q + 2 * kv, c), "attn_proj": (c, q), "mlp_fc": (4 * c, c), "mlp_proj": (c, 4 * c),
            "lm_head": (cfg.padded_vocab_size, c)}


def time_us(fn, copies: int, launches: int, reps: int) -> float:
    """Median GPU microseconds per call of fn(i), i rotating over the weight copies (a CUDA graph
    of `launches` calls, as a decode step's graph runs them: nanochat/gpu_timing.py)."""
    from nanochat.gpu_timing import graph_times

    return statistics.median(graph_times(lambda i: fn(i % copies), launches, reps, warmup=copies)) * 1e6


def bench_matrix(name: str, n: int, k: int, rows: list[int], args, l2_bytes: int, bandwidth_gbs) -> list[dict]:
    from nanochat.quantize import int8_linear, quantize_rows
    from nanochat.triton_int8 import int8_gemv, register

    register()

    copies = max(2, -(-L2_SPAN * l2_bytes // (n * k * 2)))
    bf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    quant = [quantize_rows(w) for w in bf]
    out = []
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ways = {"bf16": (lambda i: torch.nn.functional.linear(x, bf[i]), n * k * 2),
                "int8": (lambda i: int8_gemv(x, *quant[i]), n * k + 4 * n),
                "int8_dequant": (lambda i: int8_linear(x, *quant[i], kernel=None), n * k + 4 * n)}
        row = {"bench": "int8", "matrix": name, "n": n, "k": k, "rows": m}
        for way, (fn, nbytes) in ways.items():
            us = time_us(fn, copies, args.launches, args.reps)
            gbs = nbytes / us / 1e3
            row[way] = {"us": round(us, 2), "gbs": round(gbs, 1),
                        "bw_util": round(gbs / bandwidth_gbs, 3) if bandwidth_gbs else None}
        row["speedup"] = round(row["bf16"]["us"] / row["int8"]["us"], 2)
        if args.sweep:
            row["sweep"] = sweep(x, quant, copies, args)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3) for bn in (16, 32, 64) for bk in (64, 128, 256)
         for w in (2, 4, 8)]
ROW_SWEEP = [dict(ROW=True, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=3) for bn in (1, 2, 4, 8, 16)
             for bk in (256, 512, 1024, 2048) for w in (1, 2, 4, 8) if bn * bk <= 8192]


def sweep(x, quant, copies: int, args) -> list[dict]:
    """The int8 kernel at each tile of SWEEP (BLOCK_M from gemv_config) or, for one row, of
    ROW_SWEEP (the row kernel), fastest first (top 3)."""
    from nanochat import triton_int8

    row = x.shape[0] == 1
    base = {} if row else triton_int8.gemv_config(x.shape[0], quant[0][0].shape[0], x.shape[1])
    timed = []
    for tile in ROW_SWEEP if row else SWEEP:
        cfg = base | tile
        try:
            us = time_us(lambda i: triton_int8.launch(x, *quant[i], config=cfg), copies, args.launches, args.reps)
        except Exception as e:  # noqa: BLE001 - a tile out of this GPU's resources is skipped, with its error
            print(json.dumps({"bench": "int8_sweep_skip", "tile": tile, "error": str(e)[:120]}))
            continue
        timed.append({**{k: v for k, v in tile.items() if k != "ROW"}, "us": round(us, 2)})
    timed.sort(key=lambda t: t["us"])
    return timed[:3]


def main(argv=None) -> int:
    args = parse_args(argv)
    from nanochat.platform import detect_device

    spec = detect_device(torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    print(json.dumps({"bench": "config", "device": spec.name, "torch": torch.__version__, "depth": args.depth,
                      "bandwidth_gbs": spec.bandwidth_gbs, "l2_bytes": l2}), flush=True)
    rows = []
    for name, (n, k) in matrices(args.depth, args.vocab_size).items():
        rows += bench_matrix(name, n, k, args.rows, args, l2, spec.bandwidth_gbs)
    print(f"\n{spec.name}, d{args.depth} matrices, median of {args.reps} x {args.launches} products")
    print(f"{'matrix':<10}{'out x in':>14}{'rows':>6}{'bf16 us':>9}{'GB/s':>7}{'int8 us':>9}{'GB/s':>7}"
          f"{'dequant us':>11}{'speedup':>8}")
    for r in rows:
        print(f"{r['matrix']:<10}{r['n']:>7}x{r['k']:<6}{r['rows']:>6}{r['bf16']['us']:>9.1f}{r['bf16']['gbs']:>7.0f}"
              f"{r['int8']['us']:>9.1f}{r['int8']['gbs']:>7.0f}{r['int8_dequant']['us']:>11.1f}{r['speedup']:>8.2f}")
        if r.get("sweep"):
            print(f"{'':<10}  fastest tiles: " + "; ".join(
                f"N{t['BLOCK_N']} K{t['BLOCK_K']} w{t['num_warps']} s{t['num_stages']} {t['us']:.1f} us"
                for t in r["sweep"]))
    return 0


if __name__ == "__main__":
    script_main("bench_int8", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
