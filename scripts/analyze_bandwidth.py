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
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
import torch.nn.functional as F

from nanochat.errors import RequestError
from nanochat.flags import FlagParser, require_int, script_main
from nanochat.platform import DEVICE_TABLE, DeviceSpec, detect_device

BF16 = 2


def gemm_train(m: int, n: int, k: int, count: int = 1) -> tuple[float, float]:
    """FLOPs and bytes of y = x @ W.T (x: m x k, W: n x k) forward + dgrad + wgrad, bf16."""
    flops = 3 * 2.0 * m * n * k
    bytes_ = 3 * BF16 * (m * k + n * k + m * n)
    return flops * count, bytes_ * count


def op_table(cfg, batch: int, seq: int) -> dict[str, dict]:
    """Analytic FLOPs/bytes per op class for one step (what is actually computed)."""
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
    # causal flash attention (windows counted as full: an upper bound); bwd ~ 2.5x fwd
    attn_fwd = 4.0 * batch * H * seq * seq * D * 0.5
    ops["attention"] = {"flops": L * 3.5 * attn_fwd,
                        "bytes": L * BF16 * N * D * (H * 2 + Hkv * 2) * 3.5}
    fl, bl = gemm_train(N, V, C)
    # + the logits passes of an unfused loss: write bf16, read, fp32 softcap/CE and its grad
    ops["lm_head_loss"] = {"flops": fl + 10.0 * N * V, "bytes": bl + N * V * (2 + 2 + 4 * 4)}
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


def measure_ops(cfg, batch: int, seq: int, dev, kernel: str) -> dict[str, float]:
    from nanochat.kernels import build_loss_fn
    N, C, L = batch * seq, cfg.n_embd, cfg.n_layer
    H, Hkv, D, V = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.padded_vocab_size
    ms = {"attn_proj_gemms": L * _median_ms(_gemm_fn([(N, H * D, C), (N, 2 * Hkv * D, C), (N, C, H * D)], dev)),
          "mlp_gemms": L * _median_ms(_gemm_fn([(N, 4 * C, C), (N, C, 4 * C)], dev))}
    q = torch.randn(batch, H, seq, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, Hkv, seq, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    gqa = {"enable_gqa": True} if H != Hkv else {}
    ms["attention"] = L * _median_ms(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa).sum().backward())
    loss_fn = build_loss_fn(kernel, dev)
    h = torch.randn(N, C, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, C, device=dev) / C**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, cfg.vocab_size, (N,), device=dev)
    ms["lm_head_loss"] = _median_ms(lambda: loss_fn(h, w, t, cfg.softcap, cfg.vocab_size, "mean").backward())
    return ms


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


def parse_args(argv=None):
    """Parse and validate every flag (no GPU work); a bad value raises ValueError naming the flag."""
    p = FlagParser(prog="python -m scripts.analyze_bandwidth", description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--device-batch-size", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--kernel", default="current", choices=["current", "liger", "triton"])
    p.add_argument("--predict", default=None, help=f"table key: {'|'.join(DEVICE_TABLE)}")
    args = p.parse_args(argv)
    if args.predict is not None and args.predict not in DEVICE_TABLE:
        raise ValueError(f"--predict: got {args.predict!r}; accepted: {'|'.join(DEVICE_TABLE)}")
    for name in ("depth", "device_batch_size", "seq", "vocab"):
        require_int(getattr(args, name), "--" + name.replace("_", "-"), 1)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from nanochat.common import init_runtime
    from nanochat.gpt import config_for_depth
    rt = init_runtime("auto", "auto")
    if rt.device.type != "cuda":
        raise RequestError("measures on a CUDA GPU; none is visible")
    spec = detect_device(rt.device)
    if spec.bandwidth_gbs is None or "bf16" not in spec.peak_tflops:
        raise RequestError(f"{spec.name} is not in nanochat/platform.py's table (no peak/bandwidth)")
    cfg = config_for_depth(args.depth, args.vocab, args.seq)
    ops = op_table(cfg, args.device_batch_size, args.seq)
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
                        "predicted_bound": t_bound, "label": "PREDICTION (datasheet roofline x measured efficiency)"})
        rows.append(row)
    residual = max(0.0, step_ms - sum(measured.values()))
    rows.append({"op": "residual (norms, rope, act, glue)", "measured_ms": round(residual, 3), "bound": "bandwidth"})
    bound_ms["bandwidth"] += residual
    for r in rows:
        print(json.dumps(r))
    verdict = max(bound_ms, key=bound_ms.get)
    summary = {"step_ms": round(step_ms, 2), "device": spec.name, "compute_bound_ms": round(bound_ms["compute"], 2),
               "bandwidth_bound_ms": round(bound_ms["bandwidth"], 2), "verdict": f"{verdict}-bound step"}
    if target is not None:
        pred = sum(r.get("predicted_ms", 0.0) for r in rows)
        # residual glue scales with bandwidth
        pred += residual * spec.bandwidth_gbs / target.bandwidth_gbs
        summary.update({"predicted_step_ms": round(pred, 1), "predicted_device": target.key,
                        "predicted_tok_per_sec": round(args.device_batch_size * args.seq / (pred * 1e-3)),
                        "label": "PREDICTION"})
    print(json.dumps(summary))
    print(f"\n{'op':<34} {'GFLOP':>9} {'GB':>7} {'AI':>6} {'bound':>9} {'roof ms':>8} {'meas ms':>8} {'eff%':>5}"
          + (f" {'pred ms':>8}" if target else ""))
    for r in rows:
        cells = [str(r.get(k, "")) for k in ("gflops", "gbytes", "intensity")]
        print(f"{r['op']:<34} {cells[0]:>9} {cells[1]:>7} {cells[2]:>6} {r['bound']:>9} "
              f"{str(r.get('roofline_ms', '')):>8} {r['measured_ms']:>8} {str(r.get('efficiency_pct', '')):>5}"
              + (f" {str(r.get('predicted_ms', '')):>8}" if target else ""))
    print(f"ridge point {ridge:.0f} FLOP/byte; step {step_ms:.1f} ms; verdict: {summary['verdict']}"
          + (f"; predicted on {target.key}: {summary['predicted_step_ms']} ms (PREDICTION)" if target else ""))
    return 0


if __name__ == "__main__":
    script_main("analyze_bandwidth", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
