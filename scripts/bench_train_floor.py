"""The time floor of a training micro-batch: its matmuls and attention alone, run back to back for
long enough that the GPU settles at its power cap.

    python -m scripts.bench_train_floor --depth 20                 # H100: ~1 minute
    python -m scripts.bench_train_floor --depth 20 --parts all --seconds 30 --attn-backend cudnn_fa4

Why: on an H100 the d20 bf16 training step runs at the board's 700 W cap (CHANGELOG_GB10.md,
session 22: SM clock ~1600 MHz of 1980), so a kernel that gets shorter but spends the same energy
hands its time back through lower clocks. Kernel times measured in short bursts (a profile, an
isolated GEMM) therefore overstate what the rest of the step could shrink to. This script measures
the floor under the same power regime: for one micro-batch of --device-batch-size x --seq tokens
it runs, per layer, every matrix of the block (the model's own shapes, read from a GPT built on the
meta device) as the three products of training (forward y = x W^T, input gradient dy W, weight
gradient dy^T x), the layer's attention forward + backward through nanochat.attention with the
layer's window and the resolved backend, and the lm_head's three products (in row chunks, as the
fused loss does). Nothing else: no norms, activations, residual adds, loss, optimizer or data, and
cuBLAS for every product (the model's fused MLP GEMM is slower than cuBLAS's plain one), so the
result is a lower bound on the real micro-batch under the same clocks.

--parts: `both` (default; products + attention), `gemm`, `attn`, or `all` (the three, one after
another). Each part runs --warmup micro-batches, then micro-batches for --seconds, each timed with
CUDA events; nvidia-smi samples SM clock, power and the power-cap flag meanwhile
(nanochat/gpu_monitor.py). Output: one JSON line per part (median and min ms per micro-batch, the
tok/s that floor allows, executed matmul FLOPs, which equal 6 x scaling params x tokens), then a
table. Compare with `bench_train` in the same call: the difference is everything outside matmuls
and attention.

CPU smoke run: python -m scripts.bench_train_floor --device cpu --depth 1 --device-batch-size 1 \
                   --seq 64 --vocab-size 256 --seconds 0 --warmup 0
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from nanochat import attention as A
from nanochat.common import DEVICE_CHOICES, destroy_runtime, init_runtime
from nanochat.gpt import GPT, config_for_depth
from nanochat.gpu_monitor import GpuMonitor
from nanochat.platform import check_benchmark_device
from nanochat.flags import FlagParser, require, require_float, require_int, script_main

SMOKE_RUN = ("python -m scripts.bench_train_floor --device cpu --depth 1 --device-batch-size 1 --seq 64 "
             "--vocab-size 256 --seconds 0 --warmup 0")

PARTS = ("both", "gemm", "attn")
LM_HEAD_CHUNK = 8192  # rows per lm_head chunk (the fused loss works in chunks too)


def parse_args(argv=None):
    p = FlagParser(prog="python -m scripts.bench_train_floor", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--device-batch-size", type=int, default=32)
    p.add_argument("--seq", "--max-seq-len", dest="seq", type=int, default=2048)
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--window-pattern", default="SSSL")
    p.add_argument("--attn-backend", default="auto")
    p.add_argument("--parts", default="both", help="both|gemm|attn|all")
    p.add_argument("--seconds", type=float, default=20.0, help="sustained run per part (after warm-up)")
    p.add_argument("--warmup", type=int, default=3, help="untimed micro-batches first")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    require_int(a.depth, "--depth", 1)
    require_int(a.device_batch_size, "--device-batch-size", 1)
    require_int(a.seq, "--seq", 8)
    require_int(a.vocab_size, "--vocab-size", 16)
    require_int(a.warmup, "--warmup", 0)
    require_float(a.seconds, "--seconds", 0.0, 3600.0)
    require(a.parts in PARTS + ("all",), "--parts", a.parts, "|".join(PARTS + ("all",)))
    require(a.device in DEVICE_CHOICES, "--device", a.device, "|".join(DEVICE_CHOICES))
    require(a.attn_backend in A.BACKEND_CHOICES, "--attn-backend", a.attn_backend, "|".join(A.BACKEND_CHOICES))
    config_for_depth(a.depth, a.vocab_size, a.seq, window_pattern=a.window_pattern)  # --window-pattern
    a.parts = PARTS if a.parts == "all" else (a.parts,)
    return a


def block_shapes(model: GPT) -> list[list[tuple[int, int]]]:
    """Per layer, the (out, in) shape of every matrix its block multiplies by (the parameters
    MuonAdamW treats as matrices: q/k/v/o, MLP, value-embedding gates)."""
    return [[tuple(p.shape) for p in block.parameters() if p.dim() == 2] for block in model.blocks]


class Floor:
    """The buffers and the one micro-batch of products and attention (`run(part)`)."""

    def __init__(self, model: GPT, tokens: int, batch: int, backend: str, device, dtype):
        cfg = model.config
        self.shapes, self.windows, self.backend = block_shapes(model), model.windows, backend
        self.M = tokens
        gen = torch.Generator(device=device).manual_seed(0)

        def rand(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=gen) * 0.02

        widths = {n for layer in self.shapes for n, k in layer} | {k for layer in self.shapes for n, k in layer}
        widths.add(cfg.n_embd)
        self.act = {w: rand(tokens, w) for w in widths}  # inputs x and output gradients dy
        self.out = {w: torch.empty(tokens, w, device=device, dtype=dtype) for w in widths}
        self.weights = [[rand(n, k) for n, k in layer] for layer in self.shapes]
        self.wgrad = [[torch.empty(n, k, device=device, dtype=dtype) for n, k in layer] for layer in self.shapes]
        V, C = cfg.padded_vocab_size, cfg.n_embd
        self.head, self.head_grad = rand(V, C), torch.zeros(V, C, device=device, dtype=dtype)
        chunk = min(LM_HEAD_CHUNK, tokens)
        self.logits = torch.empty(chunk, V, device=device, dtype=dtype)
        self.dlogits = rand(chunk, V)
        T, H, Hkv, D = tokens // batch, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.qkv = [rand(batch, h, T, D).requires_grad_() for h in (H, Hkv, Hkv)]
        self.dout = rand(batch, H, T, D)

    def matmul_flops(self) -> int:
        per_layer = sum(6 * self.M * n * k for layer in self.shapes for n, k in layer)
        return per_layer + 6 * self.M * self.head.numel()

    def _products(self, layer: int) -> None:
        for (n, k), w, dw in zip(self.shapes[layer], self.weights[layer], self.wgrad[layer]):
            x, dy = self.act[k], self.act[n]
            torch.mm(x, w.t(), out=self.out[n])        # forward
            torch.mm(dy, w, out=self.out[k])           # input gradient
            torch.mm(dy.t(), x, out=dw)                # weight gradient

    def _lm_head(self) -> None:
        x, dx, chunk = self.act[self.head.size(1)], self.out[self.head.size(1)], self.logits.size(0)
        for r in range(0, self.M, chunk):
            rows = min(chunk, self.M - r)
            torch.mm(x[r:r + rows], self.head.t(), out=self.logits[:rows])
            torch.mm(self.dlogits[:rows], self.head, out=dx[r:r + rows])
            self.head_grad.addmm_(self.dlogits[:rows].t(), x[r:r + rows])

    def _attention(self, layer: int) -> None:
        q, k, v = self.qkv
        y = A.attention(q, k, v, window=self.windows[layer], backend=self.backend)
        torch.autograd.backward(y, self.dout, inputs=[q, k, v])
        for t in self.qkv:
            t.grad = None

    def run(self, part: str) -> None:
        for layer in range(len(self.shapes)):
            if part in ("both", "gemm"):
                self._products(layer)
            if part in ("both", "attn"):
                self._attention(layer)
        if part in ("both", "gemm"):
            self._lm_head()


def _sync(device) -> None:
    if device.type == "mps":
        torch.mps.synchronize()


def measure(floor: Floor, part: str, warmup: int, seconds: float, device) -> dict:
    cuda = device.type == "cuda"
    for _ in range(warmup):
        floor.run(part)
    times = []
    with GpuMonitor(device) as mon:
        t_end = time.perf_counter() + seconds
        while not times or time.perf_counter() < t_end:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                floor.run(part)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:   # MPS queues its work as CUDA does: unsynchronised, the clock timed the launches only
                _sync(device)
                t0 = time.perf_counter()
                floor.run(part)
                _sync(device)
                times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    return {"part": part, "micro_batches": len(times), "ms_median": round(ms, 3), "ms_min": round(min(times), 3),
            "tok_per_s_floor": round(floor.M / ms * 1e3), "gpu": mon.summary()}


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    check_benchmark_device(args.device, SMOKE_RUN)
    rt = init_runtime(device=args.device, seed=0)
    try:
        cfg = config_for_depth(args.depth, args.vocab_size, args.seq, window_pattern=args.window_pattern)
        with torch.device("meta"):
            model = GPT(cfg)
        backend = A.prepare_masks(args.seq, model.windows, rt.device, args.attn_backend)
        tokens = args.device_batch_size * args.seq
        floor = Floor(model, tokens, args.device_batch_size, backend, rt.device, rt.dtype)
        flops = floor.matmul_flops()
        assert flops == 6 * model.num_scaling_params() * tokens, "the floor must run the model's matmuls"
        name = torch.cuda.get_device_name(rt.device) if rt.device_type == "cuda" else rt.device_type
        rows = []
        for part in args.parts:
            row = {"device": name, "depth": args.depth, "tokens": tokens, "attn_backend": backend,
                   "dtype": str(rt.dtype).removeprefix("torch."), "matmul_flops": flops,
                   "model_flops_per_token": model.estimate_flops(), **measure(floor, part, args.warmup,
                                                                              args.seconds, rt.device)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        print(f"\n{'part':<6} {'ms/mb':>9} {'min':>9} {'tok/s floor':>12} {'SM MHz':>7} {'W':>6} {'capped%':>8}")
        for r in rows:
            # a figure the board does not report is None in the summary (power on some boards): "-" too,
            # as format(None, ">7") raised TypeError after the whole measurement
            g = {k: "-" if v is None else v for k, v in r["gpu"].items()}
            print(f"{r['part']:<6} {r['ms_median']:>9.2f} {r['ms_min']:>9.2f} {r['tok_per_s_floor']:>12,} "
                  f"{g.get('sm_clock_mhz_median', '-'):>7} {g.get('power_w_median', '-'):>6} "
                  f"{g.get('power_capped_pct', '-'):>8}")
        return rows
    finally:
        destroy_runtime(rt)


if __name__ == "__main__":
    script_main("bench_train_floor", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
