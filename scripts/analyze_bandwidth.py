"""Roofline of one training step: python -m scripts.analyze_bandwidth --depth 12 [--predict gb10]

For each major op class of a GPT training step (forward + backward + optimizer) it derives FLOPs
and the minimum bytes moved from the model config (each operand read once, each result written
once), the arithmetic intensity, and compares it with the device's ridge point (peak bf16
FLOP/s / memory bandwidth, from nanochat/platform.py's table). The op classes are measured
on this GPU at the step's real shapes (CUDA events, median), the whole step is measured too, and
what the op benchmarks do not cover (norms, RoPE, activations, residual glue, embedding
lookups) is reported as the residual. Verdict per op: compute- or bandwidth-bound; for the step:
the share of measured time spent in each kind.

--predict KEY (a platform table key such as gb10, h100-sxm, rtx-5090) adds, per op, the time
predicted on that device: max(FLOPs / peak, bytes / bandwidth) scaled by the efficiency this
GPU achieved against its own roofline for that op. It is a PREDICTION from datasheet numbers.

This GPU's roofline is its bf16 peak and bandwidth from the table; --peak-flops / --bandwidth-gbs
replace them (a measured GEMM peak, or a GPU the table lacks, which needs both).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys

import torch

from nanochat.errors import RequestError
from nanochat.flags import FlagParser, require_float, require_int, script_main
from nanochat.platform import DEVICE_TABLE, DeviceSpec, detect_device, triton_version

BF16 = 2


def gemm_train(m: int, n: int, k: int, count: int = 1) -> tuple[float, float]:
    """FLOPs and bytes of y = x @ W.T (x: m x k, W: n x k) forward + dgrad + wgrad, bf16."""
    flops = 3 * 2.0 * m * n * k
    bytes_ = 3 * BF16 * (m * k + n * k + m * n)
    return flops * count, bytes_ * count


def visible_pairs(seq: int, window: int | None) -> int:
    """(query, key) pairs causal attention over `seq` tokens scores, a query seeing the last `window`
    keys up to itself (nanochat/attention.py's semantics; None = all of them)."""
    w = seq if window is None else min(window, seq)
    return w * (w + 1) // 2 + (seq - w) * w


def attention_op(cfg, batch: int, seq: int) -> dict:
    """FLOPs and minimum bytes of every layer's attention, forward + backward, at the model's own
    windows (nanochat.gpt.layer_windows; SSSL at d12: 9 of 12 layers see 512 keys, not 2048).
    FLOPs: QK^T and PV, 2 * 2 * head_dim per visible (query, key) pair and head, forward; a
    flash-style backward runs five such products (QK^T recomputed, dV, dP, dQ, dK): 3.5x forward.
    Bytes, each operand once in bf16: forward reads q, k, v and writes o (+ the fp32 log-sum-exp
    per query row and head); backward reads q, k, v, o, dO and the log-sum-exp and writes dq, dk,
    dv: three times the forward's q/k/v/o traffic (it was charged 3.5x, the FLOP ratio)."""
    from nanochat.gpt import layer_windows

    N, H, Hkv, D = batch * seq, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    pairs = sum(visible_pairs(seq, w) for w in layer_windows(cfg))
    per_layer_bytes = 3 * BF16 * N * D * (2 * H + 2 * Hkv) + 2 * 4 * N * H
    return {"flops": 3.5 * 4.0 * batch * H * D * pairs, "bytes": cfg.n_layer * per_layer_bytes}


# Bytes per logit the loss itself moves beyond the head's three GEMMs (which write the logits once
# and read their gradient twice, in gemm_train): `current` (the model's compiled softcap + CE) reads
# the bf16 logits in the forward, reads them again and writes their gradient in the backward;
# `liger` / `triton` (chunked) read each chunk's logits once and overwrite them with the gradient.
# It was 20 for every kernel (an fp32 chain: the reference `current_loss`, not what a step runs),
# which made the loss look bandwidth-bound at d12 (28 GB against a 13 GB minimum).
LOSS_BYTES_PER_LOGIT = {"current": 2 + 2 + 2, "liger": 2 + 2, "triton": 2 + 2}


def op_table(cfg, batch: int, seq: int, kernel: str = "current") -> dict[str, dict]:
    """Analytic FLOPs/bytes per op class for one step (what is actually computed), the loss as
    --kernel computes it."""
    N, C, L = batch * seq, cfg.n_embd, cfg.n_layer
    H, Hkv, D, V = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.padded_vocab_size
    ops = {}
    f1, b1 = gemm_train(N, H * D, C)
    f2, b2 = gemm_train(N, 2 * Hkv * D, C)
    f3, b3 = gemm_train(N, C, H * D)
    ops["attn_proj_gemms"] = {"flops": L * (f1 + f2 + f3), "bytes": L * (b1 + b2 + b3)}
    f4, b4 = gemm_train(N, 4 * C, C)
    f5, b5 = gemm_train(N, C, 4 * C)
    ops["mlp_gemms"] = {"flops": L * (f4 + f5), "bytes": L * (b4 + b5)}
    ops["attention"] = attention_op(cfg, batch, seq)
    fl, bl = gemm_train(N, V, C)
    ops["lm_head_loss"] = {"flops": fl + 10.0 * N * V, "bytes": bl + N * V * LOSS_BYTES_PER_LOGIT[kernel]}
    params = L * (C * H * D * 2 + C * Hkv * D * 2 + 8 * C * C)
    ns_flops = 0.0
    for m, n in [(H * D, C), (Hkv * D, C), (Hkv * D, C), (C, H * D), (4 * C, C), (C, 4 * C)]:
        a, b = min(m, n), max(m, n)
        ns_flops += L * 5 * (4.0 * a * a * b + 2.0 * a ** 3)   # 5 Newton-Schulz iterations
    from nanochat.gpt import has_value_embed
    emb = V * C * 2 + sum(has_value_embed(i, L) for i in range(L)) * V * Hkv * D
    ops["optimizer"] = {"flops": ns_flops + 10.0 * (params + emb),
                        "bytes": 4 * (6 * params + 7 * emb)}   # fp32 param/grad/state passes
    return ops


def _median_ms(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def _gemm_fn(shapes: list[tuple[int, int, int]], dev):
    mats = [(torch.randn(m, k, device=dev, dtype=torch.bfloat16), torch.randn(n, k, device=dev, dtype=torch.bfloat16),
             torch.randn(m, n, device=dev, dtype=torch.bfloat16)) for m, n, k in shapes]

    def run():
        for x, w, g in mats:
            torch.mm(x, w.t())   # forward
            torch.mm(g, w)       # dgrad
            torch.mm(g.t(), x)   # wgrad
    return run


def step_loss_fn(kernel: str, dev):
    """The loss a training step runs for --kernel (training.setup_precision_and_kernel): the model's
    default `cross_entropy_loss` for current (build_loss_fn("current") is the reference chain that
    tests compare with: fp32 logits, separate softcap and CE; it was what the op was timed as)."""
    from nanochat.kernels import build_loss_fn, cross_entropy_loss
    return cross_entropy_loss if kernel == "current" else build_loss_fn(kernel, dev)


def measure_ops(cfg, batch: int, seq: int, dev, kernel: str) -> dict[str, float]:
    N, C, L = batch * seq, cfg.n_embd, cfg.n_layer
    H, Hkv, D, V = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.padded_vocab_size
    ms = {"attn_proj_gemms": L * _median_ms(_gemm_fn([(N, H * D, C), (N, 2 * Hkv * D, C), (N, C, H * D)], dev)),
          "mlp_gemms": L * _median_ms(_gemm_fn([(N, 4 * C, C), (N, C, 4 * C)], dev))}
    ms["attention"] = attention_ms(cfg, batch, seq, dev)
    loss_fn = torch.compile(step_loss_fn(kernel, dev), dynamic=False)   # compiled with the model in a step
    h = torch.randn(N, C, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, C, device=dev) / C**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, cfg.vocab_size, (N,), device=dev)

    def loss_step():
        h.grad = w.grad = None   # no gradient accumulation pass inside the timing
        loss_fn(h, w, t, cfg.softcap, cfg.vocab_size, "mean").backward()
    ms["lm_head_loss"] = _median_ms(loss_step)
    return ms


def attention_ms(cfg, batch: int, seq: int, dev) -> float:
    """Forward + backward ms of every layer's attention as the model runs it: nanochat.attention
    with the backend the model resolves on this GPU, each distinct window timed once and counted
    per layer. (It timed full causal SDPA for every layer: at SSSL the window layers cost ~half
    that, so the residual below was squeezed by the difference.)"""
    from nanochat.attention import attention, prepare_masks
    from nanochat.gpt import layer_windows

    windows = layer_windows(cfg)
    backend = prepare_masks(seq, windows, dev, "auto")
    shape = (batch, cfg.n_head, seq, cfg.head_dim)
    q = torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, cfg.n_kv_head, seq, cfg.head_dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)

    def run(window):
        q.grad = k.grad = v.grad = None   # no gradient accumulation pass inside the timing
        attention(q, k, v, window=window, backend=backend).sum().backward()

    return sum(windows.count(w) * _median_ms(lambda w=w: run(w)) for w in dict.fromkeys(windows))


def measure_step(cfg, args, rt) -> tuple[float, float]:
    """(whole step ms, optimizer ms) of the real model, compiled as in training."""
    from nanochat.optim import build_optimizer
    from nanochat.training import build_model, setup_precision_and_kernel
    model = build_model(cfg, rt.device, compute_dtype=rt.dtype)
    setup_precision_and_kernel(model, "bf16", args.kernel, rt, compile=True)
    run = torch.compile(model, dynamic=False)
    opt = build_optimizer(model)
    x = torch.randint(0, cfg.vocab_size, (args.device_batch_size, args.seq), device=rt.device)

    def step():
        run(x, x).backward()
        opt.step()
        model.zero_grad(set_to_none=True)

    step_ms = _median_ms(step, 5)
    run(x, x).backward()
    opt_ms = _median_ms(opt.step, 5)
    return step_ms, opt_ms


def roofline_ms(op: dict, spec: DeviceSpec) -> tuple[float, str]:
    peak = spec.peak_tflops["bf16"] * 1e12
    bw = spec.bandwidth_gbs * 1e9
    t_c, t_b = op["flops"] / peak, op["bytes"] / bw
    return 1e3 * max(t_c, t_b), ("compute" if t_c >= t_b else "bandwidth")


def prediction_label(target: DeviceSpec) -> str:
    """What a --predict figure is: the target's table roofline (whose peaks may be spec-derived, as
    GB10's are, above what its GEMMs reach) times the efficiency measured here. Not a measurement."""
    return (f"PREDICTION, not a measurement: {target.key}'s table roofline (bf16 {target.peak_tflops['bf16']:g} "
            f"TFLOP/s, {target.bandwidth_gbs:g} GB/s; {target.source}) x this GPU's measured efficiency")


def parse_args(argv=None):
    """Parse and validate every flag (no GPU work); a bad value raises ValueError naming the flag."""
    p = FlagParser(prog="python -m scripts.analyze_bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--device-batch-size", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--kernel", default="current", choices=["current", "liger", "triton"])
    p.add_argument("--predict", default=None, help=f"table key: {'|'.join(DEVICE_TABLE)}")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="this GPU's dense bf16 FLOP/s (e.g. 989e12) in place of the device table's: a measured "
                        "peak (bench_gemm), or a GPU the table lacks (then with --bandwidth-gbs)")
    p.add_argument("--bandwidth-gbs", type=float, default=None,
                   help="this GPU's memory bandwidth in GB/s (e.g. 3350) in place of the device table's")
    args = p.parse_args(argv)
    if args.predict is not None and args.predict not in DEVICE_TABLE:
        raise ValueError(f"--predict: got {args.predict!r}; accepted: {'|'.join(DEVICE_TABLE)}")
    for name in ("depth", "device_batch_size", "seq", "vocab"):
        require_int(getattr(args, name), "--" + name.replace("_", "-"), 1)
    if args.peak_flops is not None:   # FLOP/s; below 1e9 it was surely given in TFLOP/s
        require_float(args.peak_flops, "--peak-flops", 1e9)
    if args.bandwidth_gbs is not None:
        require_float(args.bandwidth_gbs, "--bandwidth-gbs", 1.0)
    return args


def roofline_spec(spec: DeviceSpec, peak_flops: float | None, bandwidth_gbs: float | None) -> DeviceSpec:
    """`spec` with --peak-flops (FLOP/s) / --bandwidth-gbs in place of its table figures. A GPU with
    neither in the table raises, naming the flags it needs: it raised "not in the table" with no
    way to run the script on that GPU at all."""
    peaks = dict(spec.peak_tflops)
    if peak_flops is not None:
        peaks["bf16"] = peak_flops / 1e12
    bandwidth = bandwidth_gbs if bandwidth_gbs is not None else spec.bandwidth_gbs
    missing = [flag for flag, known in (("--peak-flops", "bf16" in peaks), ("--bandwidth-gbs", bandwidth))
               if not known]
    if missing:
        raise RequestError(f"{' and '.join(missing)}: {spec.name!r} has no bf16 peak / bandwidth in "
                           "nanochat/device_table.py; accepted: pass this GPU's "
                           + " and ".join({"--peak-flops": "--peak-flops <dense bf16 FLOP/s, e.g. 989e12>",
                                           "--bandwidth-gbs": "--bandwidth-gbs <GB/s, e.g. 3350>"}[f] for f in missing))
    given = [f for f, v in (("--peak-flops", peak_flops), ("--bandwidth-gbs", bandwidth_gbs)) if v is not None]
    source = spec.source + (f"; {' and '.join(given)} given" if given else "")
    return dataclasses.replace(spec, peak_tflops=peaks, bandwidth_gbs=bandwidth, source=source)


def main(argv=None) -> int:
    args = parse_args(argv)
    from nanochat.common import init_runtime
    from nanochat.gpt import config_for_depth
    rt = init_runtime("auto", "auto")
    if rt.device.type != "cuda":
        raise RequestError("measures on a CUDA GPU; none is visible. It has no CPU variant (its efficiencies and "
                           "--predict figures scale times measured on the GPU): run it on the GPU machine, e.g. "
                           "python -m scripts.analyze_bandwidth --depth 12 --predict gb10")
    spec = roofline_spec(detect_device(rt.device), args.peak_flops, args.bandwidth_gbs)
    cfg = config_for_depth(args.depth, args.vocab, args.seq)
    ops = op_table(cfg, args.device_batch_size, args.seq, args.kernel)
    measured = measure_ops(cfg, args.device_batch_size, args.seq, rt.device, args.kernel)
    step_ms, measured["optimizer"] = measure_step(cfg, args, rt)
    target = DEVICE_TABLE[args.predict] if args.predict else None
    ridge = spec.peak_tflops["bf16"] * 1e3 / spec.bandwidth_gbs
    rows, bound_ms = [], {"compute": 0.0, "bandwidth": 0.0}
    for name, op in ops.items():
        floor, bound = roofline_ms(op, spec)
        row = {"op": name, "gflops": round(op["flops"] / 1e9, 1), "gbytes": round(op["bytes"] / 1e9, 2),
               "intensity": round(op["flops"] / op["bytes"], 1), "ridge": round(ridge, 1), "bound": bound,
               "roofline_ms": round(floor, 3), "measured_ms": round(measured[name], 3),
               "efficiency_pct": round(100 * floor / measured[name], 1)}
        bound_ms[bound] += measured[name]
        if target is not None:
            t_floor, t_bound = roofline_ms(op, target)
            row.update({"predicted_device": target.key, "predicted_ms": round(t_floor * measured[name] / floor, 3),
                        "predicted_bound": t_bound, "label": prediction_label(target)})
        rows.append(row)
    residual = max(0.0, step_ms - sum(measured.values()))
    rows.append({"op": "residual (norms, rope, act, glue)", "measured_ms": round(residual, 3), "bound": "bandwidth"})
    # the ops timed alone can sum to more than the step (small shapes are launch-bound alone, and ops
    # overlap in the step): the residual then read a plain 0.0, as if the glue cost nothing
    excess = sum(measured.values()) - step_ms
    if excess > 0:
        rows[-1]["ops_sum_exceeds_step_ms"] = round(excess, 3)
    bound_ms["bandwidth"] += residual
    if target is not None:   # the glue scales with bandwidth; in its row, so the table's pred column adds up
        rows[-1].update({"predicted_device": target.key, "label": prediction_label(target),
                         "predicted_bandwidth_scaled_ms": round(residual * spec.bandwidth_gbs / target.bandwidth_gbs, 3)})
    for r in rows:
        print(json.dumps(r))
    verdict = max(bound_ms, key=bound_ms.get)
    # what ran, as the other benchmarks' lines carry it: the rows said neither the versions nor the config
    summary = {"step_ms": round(step_ms, 2), "device": spec.name, "torch": torch.__version__,
               "triton": triton_version(), "depth": args.depth, "device_batch_size": args.device_batch_size,
               "seq": args.seq, "vocab": args.vocab, "kernel": args.kernel,
               # the roofline the rows are against (a table figure or a flag's), so its % can be checked
               "peak_bf16_tflops": spec.peak_tflops["bf16"], "bandwidth_gbs": spec.bandwidth_gbs,
               "roofline_source": spec.source,
               "compute_bound_ms": round(bound_ms["compute"], 2),
               "bandwidth_bound_ms": round(bound_ms["bandwidth"], 2), "verdict": f"{verdict}-bound step"}
    if target is not None:
        pred = sum(r.get("predicted_ms", 0.0) for r in rows)
        # residual glue scales with bandwidth
        pred += residual * spec.bandwidth_gbs / target.bandwidth_gbs
        summary.update({"predicted_step_ms": round(pred, 1), "predicted_device": target.key,
                        "predicted_tok_per_sec": round(args.device_batch_size * args.seq / (pred * 1e-3)),
                        "label": prediction_label(target)})
    print(json.dumps(summary))
    print_table(rows, ridge, step_ms, summary, target)
    return 0


def print_table(rows: list[dict], ridge: float, step_ms: float, summary: dict, target: DeviceSpec | None) -> None:
    """The rows for people: every column with its unit, and which are measured (meas, eff = roof /
    meas), analytic (GFLOP, GB, FLOP/B, roof: this GPU's table roofline) or predicted (pred)."""
    print(f"\n{'op':<34} {'GFLOP':>9} {'GB':>7} {'FLOP/B':>6} {'bound':>9} {'roof ms':>8} {'meas ms':>8} {'eff%':>5}"
          + (f" {'pred ms':>8}" if target else ""))
    for r in rows:
        cells = [str(r.get(k, "")) for k in ("gflops", "gbytes", "intensity")]
        pred = r.get("predicted_ms", r.get("predicted_bandwidth_scaled_ms", ""))
        print(f"{r['op']:<34} {cells[0]:>9} {cells[1]:>7} {cells[2]:>6} {r['bound']:>9} "
              f"{str(r.get('roofline_ms', '')):>8} {r['measured_ms']:>8} {str(r.get('efficiency_pct', '')):>5}"
              + (f" {str(pred):>8}" if target else ""))
    excess = rows[-1].get("ops_sum_exceeds_step_ms")
    if excess is not None:
        print(f"residual unknown: the ops timed alone sum to {excess} ms more than the step (launch-bound alone "
              "at these sizes, or overlapping in the step); try a larger --device-batch-size / --depth")
    print(f"ridge point {ridge:.0f} FLOP/byte; measured step {step_ms:.1f} ms; verdict: {summary['verdict']}"
          + (f"\npredicted step on {target.key}: {summary['predicted_step_ms']} ms, "
             f"{summary['predicted_tok_per_sec']:,} tok/s ({summary['label']})" if target else ""))


if __name__ == "__main__":
    script_main("analyze_bandwidth", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
