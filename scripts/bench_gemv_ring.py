"""Benchmark a design question of batch-1 decode: can a shared-memory weight ring beat register preloads?

The persistent decode kernel (nanochat/triton_decode_kernels.py) holds each phase's weight tile
in registers, issued only at the grid barrier before the phase. A ring in shared memory could keep
weights streaming *across* barriers, DEPTH bands ahead, without register pressure. This script
measures that idea on its own: a persistent Gluon kernel runs a chain of dependent GEMVs with the
byte count of d20's four per-layer products (3840, 1280, 5120 and 5120 rows of 1280 bf16 columns;
GEMV g reads the first 1280 outputs of GEMV g - 1), --layers times over distinct weights (L2-cold),
with a grid barrier after every GEMV like the decode kernel's. Each program streams its share of
rows as bands (--band-rows x 1280) into a ring, by cp.async (`cpasync`) or by TMA boxes of 2 x 256
(`tma`, band rows 8).

Switches that take the chain apart (`--x`): `live` is the real chain (a GEMV's input is loaded
after the barrier, written by the other programs); `const` uses a constant input (no dependent
load); `none` skips the products (the ring alone: what it can stream). `--barriers on,off`.
Prints one JSON line per run (us per layer, TB/s over the weight bytes), a reference stream
(`max()` over the same weights), then a table. Results: CHANGELOG_GB10.md, session 23.

    python -m scripts.bench_gemv_ring --mode cpasync --depths 1,4,10 --x live,const,none
    python -m scripts.bench_gemv_ring --mode cpasync --band-rows 2 --depths 2,4,8,16
    python -m scripts.bench_gemv_ring --mode tma --depths 2,10

Needs a CUDA GPU with cp.async (sm_80+; `tma`: sm_90+) and Triton's Gluon (Triton >= 3.6).
"""

from __future__ import annotations

import json
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as ac
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from nanochat.errors import RequestError
from nanochat.flags import FlagParser

# Triton 3.9 renamed gluon's async copies to async_load (the old names now raise; same arguments)
# and thread_barrier to barrier
_cp_async_load = getattr(ac, "async_load", None) or ac.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

K = 1280  # columns of every product (d20's width)
ROWS = (3840, 1280, 5120, 5120)  # q/k/v, attention proj, fc, and the MLP proj's bytes as 5120 x 1280
CB = 256  # columns per block; a band is NCB blocks
NCB = K // CB
X_MODES = {"live": 1, "const": 2, "none": 0}


@gluon.jit
def _acquire(ptr):
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [ptr], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _grid_barrier(flags, epoch, pid, P, fi):
    """The decode kernel's barrier: publish `epoch` in this program's flag, poll all flags, acquire."""
    _cta_barrier()
    gl.atomic_xchg(flags + pid, epoch, sem="release", scope="gpu")
    seen = gl.min(gl.load(flags + fi, mask=fi < P, other=epoch, volatile=True), 0)
    while seen < epoch:
        seen = gl.min(gl.load(flags + fi, mask=fi < P, other=epoch, volatile=True), 0)
    _acquire(flags + pid)
    _cta_barrier()


@gluon.jit
def _band(i, pid, P, nb0, nb1, nb2, nb3, N0: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr,
          N3: gl.constexpr):
    """Band i of this program's stream -> (layer, first weight row in the packed weights, rows end)."""
    nbl = nb0 + nb1 + nb2 + nb3
    layer = i // nbl
    r = i % nbl
    g = gl.where(r < nb0, 0, gl.where(r < nb0 + nb1, 1, gl.where(r < nb0 + nb1 + nb2, 2, 3)))
    b = r - gl.where(g == 0, 0, gl.where(g == 1, nb0, gl.where(g == 2, nb0 + nb1, nb0 + nb1 + nb2)))
    n = gl.where(g == 0, N0, gl.where(g == 1, N1, gl.where(g == 2, N2, N3)))
    goff = gl.where(g == 0, 0, gl.where(g == 1, N0, gl.where(g == 2, N0 + N1, N0 + N1 + N2)))
    base = layer * (N0 + N1 + N2 + N3) + goff
    return layer, base + pid * n // P, base + (pid + 1) * n // P, b


@gluon.jit
def _issue_cpasync(ring, w, i, L, pid, P, nb0, nb1, nb2, nb3, rows_l, cols_l, NSLOT: gl.constexpr,
                   N0: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr, N3: gl.constexpr, K: gl.constexpr,
                   CB: gl.constexpr, NCB: gl.constexpr, RB: gl.constexpr):
    layer, r0, r1, b = _band(i, pid, P, nb0, nb1, nb2, nb3, N0, N1, N2, N3)
    rows = r0 + b * RB + rows_l
    lim = gl.where(layer < L, r1, 0)  # past the last layer: an empty group
    slot = i % NSLOT
    for cb in gl.static_range(NCB):
        ptrs = w + rows[:, None].to(gl.int64) * K + cb * CB + cols_l[None, :]
        mask = (rows[:, None] < lim) & (cols_l[None, :] < CB)
        _cp_async_load(ring.index(slot * NCB + cb), ptrs, mask, cache_modifier=".cg")
    ac.commit_group()


@gluon.jit
def _issue_tma(desc, ring, bars, i, L, pid, P, nb0, nb1, nb2, nb3, NSLOT: gl.constexpr, N0: gl.constexpr,
               N1: gl.constexpr, N2: gl.constexpr, N3: gl.constexpr, CB: gl.constexpr, NCB: gl.constexpr,
               RB: gl.constexpr, BR: gl.constexpr):
    layer, r0, r1, b = _band(i, pid, P, nb0, nb1, nb2, nb3, N0, N1, N2, N3)
    live = layer < L
    slot = i % NSLOT
    bar = bars.index(slot)
    mbarrier.expect(bar, NCB * RB * CB * 2, pred=live)
    first = r0 + b * RB
    for rr in gl.static_range(RB // BR):
        # the barrier expects the whole band's bytes: a box past the share re-reads the band's first
        # box (an L2 hit), so DRAM reads only the share
        row = gl.where(first + rr * BR < r1, first + rr * BR, first)
        for cb in gl.static_range(NCB):
            _tma_load(desc, [row, cb * CB], bar,
                      ring.index(slot * NCB + cb).slice(rr * BR, BR, dim=0), pred=live)


@gluon.jit
def _input(xin, cols_l, X: gl.constexpr, CB: gl.constexpr):
    if X == 2:
        x0 = cols_l.to(gl.float32) * 0.001
        return x0, x0 + 1.0, x0 + 2.0, x0 + 3.0, x0 + 4.0
    else:
        return (gl.load(xin + cols_l, cache_modifier=".cg"), gl.load(xin + CB + cols_l, cache_modifier=".cg"),
                gl.load(xin + 2 * CB + cols_l, cache_modifier=".cg"),
                gl.load(xin + 3 * CB + cols_l, cache_modifier=".cg"),
                gl.load(xin + 4 * CB + cols_l, cache_modifier=".cg"))


@gluon.jit
def _band_product(ring, sb, xs, L2: gl.constexpr):
    acc = ring.index(sb + 0).load(L2).to(gl.float32) * xs[0][None, :]
    acc += ring.index(sb + 1).load(L2).to(gl.float32) * xs[1][None, :]
    acc += ring.index(sb + 2).load(L2).to(gl.float32) * xs[2][None, :]
    acc += ring.index(sb + 3).load(L2).to(gl.float32) * xs[3][None, :]
    acc += ring.index(sb + 4).load(L2).to(gl.float32) * xs[4][None, :]
    return gl.sum(acc, 1)


@gluon.jit
def gemv_ring_chain(w, desc, act, flags, L, N0: gl.constexpr, N1: gl.constexpr, N2: gl.constexpr,
                    N3: gl.constexpr, K: gl.constexpr, CB: gl.constexpr, NCB: gl.constexpr, RB: gl.constexpr,
                    NSLOT: gl.constexpr, TMA: gl.constexpr, BAR: gl.constexpr, X: gl.constexpr, AW: gl.constexpr):
    """Layer loop of four GEMVs; the ring always holds NSLOT bands issued ahead (one cp.async group or
    one mbarrier per band), refilled with band i + NSLOT as soon as band i is consumed."""
    NW: gl.constexpr = gl.num_warps()
    L2: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [RB, NW // RB], [1, 0])
    L1: gl.constexpr = gl.BlockedLayout([256 // (32 * NW)], [32], [NW], [0])
    SH: gl.constexpr = gl.NVMMASharedLayout(0, 16, 2) if TMA else gl.SwizzledSharedLayout(8, 1, 1, [1, 0])
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * NCB, RB, CB], SH)
    bars = gl.allocate_shared_memory(gl.int64, [NSLOT, 1], mbarrier.MBarrierLayout())
    if TMA:
        for si in gl.static_range(NSLOT):
            mbarrier.init(bars.index(si), count=1)
    rows_l = gl.arange(0, RB, layout=gl.SliceLayout(1, L2))
    cols_l = gl.arange(0, CB, layout=gl.SliceLayout(0, L2))
    fi = gl.arange(0, 256, layout=L1)
    nb0 = ((pid + 1) * N0 // P - pid * N0 // P + RB - 1) // RB
    nb1 = ((pid + 1) * N1 // P - pid * N1 // P + RB - 1) // RB
    nb2 = ((pid + 1) * N2 // P - pid * N2 // P + RB - 1) // RB
    nb3 = ((pid + 1) * N3 // P - pid * N3 // P + RB - 1) // RB
    epoch = gl.atomic_add(flags + pid, 0, sem="acquire", scope="gpu")
    for i in range(NSLOT):
        if TMA:
            _issue_tma(desc, ring, bars, i, L, pid, P, nb0, nb1, nb2, nb3, NSLOT, N0, N1, N2, N3, CB, NCB, RB, 2)
        else:
            _issue_cpasync(ring, w, i, L, pid, P, nb0, nb1, nb2, nb3, rows_l, cols_l, NSLOT, N0, N1, N2, N3, K, CB,
                           NCB, RB)
    cons = 0
    for layer in range(L):
        for g in range(4):
            nb = gl.where(g == 0, nb0, gl.where(g == 1, nb1, gl.where(g == 2, nb2, nb3)))
            lay, r0, r1, b0 = _band(cons, pid, P, nb0, nb1, nb2, nb3, N0, N1, N2, N3)  # the phase's first band
            row0 = r0 - (layer * (N0 + N1 + N2 + N3) + gl.where(g == 0, 0, gl.where(
                g == 1, N0, gl.where(g == 2, N0 + N1, N0 + N1 + N2))))
            nrow = r1 - r0
            xout = act + ((g + 1) % 4) * AW
            xs = _input(act + g * AW, cols_l, X, CB)
            for b in range(nb):
                slot = cons % NSLOT
                if TMA:
                    mbarrier.wait(bars.index(slot), (cons // NSLOT) & 1)
                else:
                    ac.wait_group(NSLOT - 1)
                    _cta_barrier()
                if X != 0:
                    out = _band_product(ring, slot * NCB, xs, L2)
                    rows = b * RB + rows_l
                    gl.store(xout + row0 + rows, out * 0.03125, mask=rows < nrow)
                _cta_barrier()  # every warp is done with the slot before it is refilled
                if TMA:
                    _issue_tma(desc, ring, bars, cons + NSLOT, L, pid, P, nb0, nb1, nb2, nb3, NSLOT, N0, N1, N2, N3,
                               CB, NCB, RB, 2)
                else:
                    _issue_cpasync(ring, w, cons + NSLOT, L, pid, P, nb0, nb1, nb2, nb3, rows_l, cols_l, NSLOT,
                                   N0, N1, N2, N3, K, CB, NCB, RB)
                cons += 1
            if BAR:
                epoch += 1
                _grid_barrier(flags, epoch, pid, P, fi)
    if not TMA:
        ac.wait_group(0)


def _ints(flag: str, text: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or any(not lo <= v <= hi for v in vals):
        raise ValueError(f"{flag}: got {text!r}; accepted: a comma list of integers in {lo}..{hi}")
    return vals


def _choices(flag: str, text: str, accepted) -> list[str]:
    vals = [v.strip() for v in text.split(",") if v.strip()]
    if not vals or any(v not in accepted for v in vals):
        raise ValueError(f"{flag}: got {text!r}; accepted: a comma list of {', '.join(accepted)}")
    return vals


def parse_args(argv=None):
    p = FlagParser(prog="python -m scripts.bench_gemv_ring", description=__doc__.split("\n")[0])
    p.add_argument("--mode", default="cpasync", help="how bands reach shared memory: cpasync | tma")
    p.add_argument("--depths", default="1,4,10", help="bands in flight (ring slots), comma list")
    p.add_argument("--band-rows", dest="band_rows", type=int, default=8,
                   help="rows per band (cpasync: 2, 4 or 8 = warps; tma: 8)")
    p.add_argument("--x", default="live,const", help="comma list of live | const | none (module docstring)")
    p.add_argument("--barriers", default="on,off", help="comma list of on | off")
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if args.mode not in ("cpasync", "tma"):
        raise ValueError(f"--mode: got {args.mode!r}; accepted: cpasync, tma")
    if args.band_rows not in ((8,) if args.mode == "tma" else (2, 4, 8)):
        raise ValueError(f"--band-rows: got {args.band_rows}; accepted: "
                         + ("8 with --mode tma" if args.mode == "tma" else "2, 4, 8"))
    max_depth = (200 * 1024) // (args.band_rows * K * 2)  # the ring within ~200 KB of shared memory
    args.depths = _ints("--depths", args.depths, 1, max_depth)
    args.x = _choices("--x", args.x, X_MODES)
    args.barriers = [v == "on" for v in _choices("--barriers", args.barriers, ("on", "off"))]
    for name in ("layers", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: got {getattr(args, name)}; accepted: an integer >= 1")
    return args


def _reference(weights, x):
    """The chain in float32 on the GPU: what `--x live --barriers on` must produce."""
    cur = x
    for layer in weights:
        for w in layer:
            cur = (w.float() @ cur[:K]) * 0.03125
    return cur[:K]


def cuda_device(major: int = 0, need: str = ""):
    """(device, properties) of the GPU; RequestError (one line from script_main, which names the
    script) when there is none, or when it is below compute capability `major`.0 that `need` needs."""
    import torch

    if not torch.cuda.is_available():
        raise RequestError("needs a CUDA GPU; none is visible")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    if props.major < major:
        raise RequestError(f"needs {need} (compute capability >= {major}.0); this GPU is "
                           f"{props.major}.{props.minor}")
    return dev, props


def chain_weights(layers: int, dev):
    """The chain's packed bf16 weights (seed 0; layer l's four matrices are packed[l] split by ROWS), a
    random input and the float32 chain's result on it (what the probes' kernels must reproduce)."""
    import torch

    torch.manual_seed(0)
    packed = torch.randn(layers, sum(ROWS), K, device=dev, dtype=torch.bfloat16)
    x = torch.randn(K, device=dev)
    return packed, x, _reference([list(torch.split(packed[i], list(ROWS))) for i in range(layers)], x)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    from scripts.benchmark_kernels import _timed  # median ms of back-to-back calls, CUDA events

    dev, props = cuda_device(9 if args.mode == "tma" else 0, "TMA for --mode tma")
    P = props.multi_processor_count
    if P > min(ROWS):
        raise RequestError(f"{P} SMs; the chain gives every program rows of every GEMV only up to "
                         f"{min(ROWS)} programs")
    packed, x, ref = chain_weights(args.layers, dev)
    nbytes = packed.numel() * 2
    aw = max(ROWS)
    act = torch.zeros(4, aw, device=dev, dtype=torch.float32)
    flags = torch.zeros(P, dtype=torch.int64, device=dev)
    desc = None
    if args.mode == "tma":
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        desc = TensorDescriptor.from_tensor(packed.view(-1, K), [2, CB], gl.NVMMASharedLayout(0, 16, 2))
    flat = packed.view(-1)
    t_ref = 1e3 * _timed(lambda: flat.max(), args.repeats, dev, inner=20)
    print(json.dumps({"bench": "config", "device": props.name, "torch": torch.__version__,
                      "triton": triton.__version__, "programs": P, "layers": args.layers, "weight_bytes": nbytes,
                      "stream_ref_us": round(t_ref, 1), "stream_ref_tb_s": round(nbytes / t_ref / 1e6, 3)}),
          flush=True)
    rows = []
    for x_mode in args.x:
        for bar in args.barriers:
            for depth in args.depths:
                meta = dict(N0=ROWS[0], N1=ROWS[1], N2=ROWS[2], N3=ROWS[3], K=K, CB=CB, NCB=NCB, RB=args.band_rows,
                            NSLOT=depth, TMA=args.mode == "tma", BAR=bar, X=X_MODES[x_mode], AW=aw)
                warps = 8 if args.mode == "tma" else args.band_rows

                def launch():
                    gemv_ring_chain[(P,)](packed, desc, act, flags, args.layers, num_warps=warps, **meta)
                act.zero_()
                act[0, :K] = x
                launch()
                torch.cuda.synchronize()
                err = None
                if x_mode == "live" and bar:
                    err = ((act[0, :K] - ref).abs().max() / ref.abs().max()).item()
                t = 1e3 * _timed(launch, args.repeats, dev, inner=20)
                row = dict(bench="gemv_ring", mode=args.mode, band_rows=args.band_rows, x=x_mode, barriers=bar,
                           depth=depth, inflight_kb=depth * args.band_rows * K * 2 / 1024, us=round(t, 1),
                           us_per_layer=round(t / args.layers, 2), tb_s=round(nbytes / t / 1e6, 3), rel_err=err)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print(f"\n{props.name}, {P} programs, {args.layers} layers x 4 GEMVs, {nbytes / 1e6:.0f} MB of weights; "
          f"reference stream (max()) {nbytes / t_ref / 1e6:.2f} TB/s")
    print(f"{'mode':<9}{'rows':>5}{'x':>7}{'barrier':>9}{'depth':>6}{'KB':>6}{'us/layer':>10}{'TB/s':>7}")
    for r in rows:
        print(f"{r['mode']:<9}{r['band_rows']:>5}{r['x']:>7}{'on' if r['barriers'] else 'off':>9}{r['depth']:>6}"
              f"{r['inflight_kb']:>6.0f}{r['us_per_layer']:>10.2f}{r['tb_s']:>7.2f}")
    bad = [r for r in rows if r["rel_err"] is not None and not r["rel_err"] < 1e-3]
    if bad:
        print(f"bench_gemv_ring: {len(bad)} run(s) differ from the float32 chain (rel_err >= 1e-3)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("bench_gemv_ring", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
