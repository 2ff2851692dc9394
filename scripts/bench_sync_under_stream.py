"""Benchmark a design question of batch-1 decode: does a weight stream slow the grid's sync traffic
on the SMs that issue it, or on every SM?

Session 23's ring probe (scripts/bench_gemv_ring.py) found that in a chain of GEMVs whose weights
stream through shared memory, each grid barrier and each dependent activation load costs several
times its unloaded latency: they wait behind the stream. If that queueing is per SM (the SM's
load path and its return port), a kernel with SMs in two roles (streamers that only move weights,
syncers that carry the barriers and the activations, joined by a cluster's shared memory) would
keep the sync chain at its unloaded cost; if it is in the L2 / DRAM queues every SM shares, no
role split can help and the chain's sync cost is a floor at this layer size.

This kernel measures it directly. Every program has one role (`--placement`: `halves` puts the
streamers on the low program ids, `parity` on the even ones):
- a streamer moves its share of a weight matrix (`--stream-mb`) through a shared-memory ring by
  cp.async (`--depth` bands of 8 x 1280 bf16 in flight) and computes nothing;
- a syncer runs `--iters` rounds of a grid barrier among the syncers (the decode kernel's
  flag barrier) followed by the dependent load of a 1280-float activation the other syncers wrote
  in the round before (`--x live`) or no load (`--x none`); or `--x ll`: no barrier, the values carry
  their round's epoch and readers re-load until all are fresh (NCCL's LL protocol).
Each program records its start and end (%globaltimer). The script prints, per configuration, the
syncers' microseconds per round with the streamers idle and while they stream, and the
streamers' TB/s alone and beside the syncers (JSON lines, then a table).

    python -m scripts.bench_sync_under_stream --streamers 66,99,120 --placement halves,parity

Needs a CUDA GPU with cp.async (sm_80+) and Triton's Gluon (Triton >= 3.6).
"""

from __future__ import annotations

import json
import sys

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as ac

# Triton 3.9 renamed gluon's async copies to async_load (the old names now raise; same arguments)
# and thread_barrier to barrier
_cp_async_load = getattr(ac, "async_load", None) or ac.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

from nanochat.errors import RequestError
from nanochat.flags import FlagParser
from scripts.bench_gemv_ring import CB, K, NCB, _choices, _grid_barrier, _ints, cuda_device

RB = 8  # rows per band (one per warp)


@gluon.jit
def _now():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _issue(ring, w, band, r0, r1, rows_l, cols_l, NSLOT: gl.constexpr, K: gl.constexpr, CB: gl.constexpr,
           NCB: gl.constexpr, RB: gl.constexpr):
    rows = r0 + band * RB + rows_l
    slot = band % NSLOT
    for cb in gl.static_range(NCB):
        ptrs = w + rows[:, None].to(gl.int64) * K + cb * CB + cols_l[None, :]
        mask = (rows[:, None] < r1) & (cols_l[None, :] < CB)
        _cp_async_load(ring.index(slot * NCB + cb), ptrs, mask, cache_modifier=".cg")
    ac.commit_group()


@gluon.jit
def _stream(w, R, s, S, NSLOT: gl.constexpr, K: gl.constexpr, CB: gl.constexpr, NCB: gl.constexpr,
            RB: gl.constexpr):
    """Streamer s of S: its rows of the (R, K) weights through the ring, NSLOT bands in flight."""
    NW: gl.constexpr = gl.num_warps()
    L2: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [RB, NW // RB], [1, 0])
    ring = gl.allocate_shared_memory(gl.bfloat16, [NSLOT * NCB, RB, CB], gl.SwizzledSharedLayout(8, 1, 1, [1, 0]))
    rows_l = gl.arange(0, RB, layout=gl.SliceLayout(1, L2))
    cols_l = gl.arange(0, CB, layout=gl.SliceLayout(0, L2))
    r0 = s * R // S
    r1 = (s + 1) * R // S
    nb = (r1 - r0 + RB - 1) // RB
    for b in range(NSLOT):
        _issue(ring, w, b, r0, r1, rows_l, cols_l, NSLOT, K, CB, NCB, RB)
    for b in range(nb):
        ac.wait_group(NSLOT - 1)
        _cta_barrier()  # the slot is free once every warp saw it land
        _issue(ring, w, b + NSLOT, r0, r1, rows_l, cols_l, NSLOT, K, CB, NCB, RB)
    ac.wait_group(0)


@gluon.jit
def _sync_rounds(act, flags, q, Q, iters, LOADX: gl.constexpr, K: gl.constexpr, CB: gl.constexpr,
                 RB: gl.constexpr):
    """Syncer q of Q: `iters` rounds of barrier -> load the activation the others wrote -> write a slice."""
    NW: gl.constexpr = gl.num_warps()
    L2: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [RB, NW // RB], [1, 0])
    L1: gl.constexpr = gl.BlockedLayout([2048 // (32 * NW)], [32], [NW], [0])
    cols_l = gl.arange(0, CB, layout=gl.SliceLayout(0, L2))
    fi = gl.arange(0, 2048, layout=L1)
    lo = q * K // Q
    hi = (q + 1) * K // Q
    epoch = gl.atomic_add(flags + q, 0, sem="acquire", scope="gpu")
    for it in range(iters):
        src = act + (it % 2) * K
        total = 0.0
        if LOADX:  # the decode kernel's pattern: every warp loads the chunk it multiplies (.cg: from L2)
            for cb in gl.static_range(K // CB):
                total += gl.sum(gl.load(src + cb * CB + cols_l, cache_modifier=".cg"), 0)
        dst = act + ((it + 1) % 2) * K
        gl.store(dst + fi, total * 1e-3 + fi.to(gl.float32), mask=(fi >= lo) & (fi < hi))
        epoch += 1
        _grid_barrier(flags, epoch, q, Q, fi)  # among the syncers only


@gluon.jit
def _ll_poll(buf, fi, e, K: gl.constexpr):
    """(words at buf[:K] not yet of epoch e, their values): one load per word per program (each thread its
    own words), not one per warp: a re-poll costs 8 B per word of the program's L2 bandwidth."""
    v = gl.load(buf + fi, mask=fi < K, other=e << 32, volatile=True)
    stale = gl.sum(((v >> 32) != e).to(gl.int32), 0)
    return stale, (v & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)


@gluon.jit
def _ll_rounds(tagged, q, Q, iters, base, K: gl.constexpr, CB: gl.constexpr, RB: gl.constexpr):
    """Syncer q of Q, the same rounds with no barrier: every value travels with its round's epoch in one
    8-byte word (value bits | epoch << 32; an aligned 8-byte store is single-copy atomic), and a reader
    re-loads the activation until every word carries the round's epoch: the data is the barrier (NCCL's
    LL protocol). Two buffers alternate: a syncer can only write round n + 2 after every syncer has read
    round n + 1, hence finished reading round n."""
    NW: gl.constexpr = gl.num_warps()
    L1: gl.constexpr = gl.BlockedLayout([2048 // (32 * NW)], [32], [NW], [0])
    fi = gl.arange(0, 2048, layout=L1)
    lo = q * K // Q
    hi = (q + 1) * K // Q
    total = (lo * 0).to(gl.float32)
    for it in range(iters):
        e = (base + it + 1).to(gl.int64)
        buf = tagged + (it % 2) * K
        val = total * 1e-3 + fi.to(gl.float32)
        word = (val.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF) | (e << 32)
        gl.store(buf + fi, word, mask=(fi >= lo) & (fi < hi))
        stale, vals = _ll_poll(buf, fi, e, K)
        while stale > 0:
            stale, vals = _ll_poll(buf, fi, e, K)
        total = gl.sum(gl.where(fi < K, vals, 0.0), 0)


@gluon.jit
def sync_under_stream(w, R, role, act, tagged, flags, times, S, Q, iters, base, NSLOT: gl.constexpr,
                      LOADX: gl.constexpr, K: gl.constexpr, CB: gl.constexpr, NCB: gl.constexpr, RB: gl.constexpr):
    """role[pid] >= 0: streamer number role[pid] of S; < 0: syncer -role[pid] - 1 of Q. LOADX 2: LL rounds."""
    pid = gl.program_id(0)
    r = gl.load(role + pid)
    t0 = _now()
    if r >= 0:
        _stream(w, R, r, S, NSLOT, K, CB, NCB, RB)
    elif LOADX == 2:
        _ll_rounds(tagged, -r - 1, Q, iters, base, K, CB, RB)
    else:
        _sync_rounds(act, flags, -r - 1, Q, iters, LOADX, K, CB, RB)
    t1 = _now()
    gl.store(times + 2 * pid, t0)
    gl.store(times + 2 * pid + 1, t1)


def roles(P: int, S: int, placement: str) -> list[int]:
    """Per program: streamer index (>= 0) or -(syncer index) - 1."""
    if placement == "halves":
        is_streamer = [p < S for p in range(P)]
    else:  # parity: streamers on even program ids first, then odd ones if S > P / 2
        order = list(range(0, P, 2)) + list(range(1, P, 2))
        chosen = set(order[:S])
        is_streamer = [p in chosen for p in range(P)]
    out, s, q = [], 0, 0
    for flag in is_streamer:
        out.append(s if flag else -q - 1)
        s, q = (s + 1, q) if flag else (s, q + 1)
    return out


def _chain_error(P, act, tagged, flags, times, w, depth, ll: bool, rounds: int = 6) -> float:
    """One launch (half the programs streaming) of `rounds` live rounds (flag barrier, or LL with `ll`) from a
    zero activation, against the recurrence in float64: round n writes v[i] = 1e-3 * sum(v_prev) + i."""
    import torch

    S = P // 2
    role = torch.tensor(roles(P, S, "parity"), dtype=torch.int32, device=act.device)
    act.zero_()
    tagged.zero_()
    flags.zero_()
    sync_under_stream[(P,)](w, w.shape[0], role, act, tagged, flags, times, S, P - S, rounds, 0, NSLOT=depth,
                            LOADX=2 if ll else 1, K=K, CB=CB, NCB=NCB, RB=RB, num_warps=RB)
    idx = torch.arange(K, dtype=torch.float64)
    v = torch.zeros(K, dtype=torch.float64)
    for _ in range(rounds):
        v = 1e-3 * v.sum() + idx
    if ll:
        words = tagged[(rounds - 1) % 2].cpu()
        assert bool(((words >> 32) == rounds).all()), "LL: a word without the last round's epoch"
        got = (words & 0xFFFFFFFF).to(torch.int32).view(torch.float32).double()
    else:
        got = act[rounds % 2].double().cpu()
    return ((got - v).abs().max() / v.abs().max()).item()


def parse_args(argv=None):
    p = FlagParser(prog="python -m scripts.bench_sync_under_stream",
                   description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--streamers", default="66,99,120", help="programs that stream, comma list (1..SMs-2)")
    p.add_argument("--placement", default="halves,parity", help="comma list of halves | parity")
    p.add_argument("--x", default="live,none,ll",
                   help="syncers' round, comma list: live (barrier + load), none (barrier), ll (tagged data)")
    p.add_argument("--depth", type=int, default=8, help="bands (8 x 1280 bf16 = 20 KB) in flight per streamer, 1..10")
    p.add_argument("--stream-mb", dest="stream_mb", type=int, default=6144, help="weights streamed, MB (64..8192)")
    p.add_argument("--iters", type=int, default=100, help="syncer rounds per launch (1..10000)")
    p.add_argument("--repeats", type=int, default=5, help="launches per configuration (median)")
    args = p.parse_args(argv)
    args.streamers = _ints("--streamers", args.streamers, 1, 100000)
    args.placement = _choices("--placement", args.placement, ("halves", "parity"))
    args.x = _choices("--x", args.x, ("live", "none", "ll"))
    for name, lo, hi in (("depth", 1, 10), ("stream_mb", 64, 8192), ("iters", 1, 10000), ("repeats", 1, 1000)):
        v = getattr(args, name)
        if not lo <= v <= hi:
            raise ValueError(f"--{name.replace('_', '-')}: got {v}; accepted: an integer in {lo}..{hi}")
    return args


def _median(vals):
    vals = sorted(vals)
    return vals[len(vals) // 2]


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import triton

    dev, props = cuda_device()
    P = props.multi_processor_count
    bad = [s for s in args.streamers if not 1 <= s <= P - 2]
    if bad:
        raise RequestError(f"--streamers: got {bad}; accepted: 1..{P - 2} on this GPU ({P} SMs, two syncers at least)")
    R = args.stream_mb * 10**6 // (K * 2)
    w = torch.randn(R, K, device=dev, dtype=torch.bfloat16)
    act = torch.zeros(2, K, device=dev, dtype=torch.float32)
    tagged = torch.zeros(2, K, device=dev, dtype=torch.int64)
    epoch = [0]  # LL rounds' epochs only grow across launches
    flags = torch.zeros(P, dtype=torch.int64, device=dev)
    times = torch.zeros(P, 2, dtype=torch.int64, device=dev)
    print(json.dumps({"bench": "config", "device": props.name, "torch": torch.__version__, "triton": triton.__version__,
                      "programs": P, "stream_bytes": R * K * 2, "depth": args.depth, "iters": args.iters}), flush=True)

    def run(role_list, S, Q, rows, iters, loadx):
        role = torch.tensor(role_list, dtype=torch.int32, device=dev)
        spans = []
        for _ in range(args.repeats):
            flags.zero_()  # configurations differ in their syncers: every launch starts its epochs at 0
            sync_under_stream[(P,)](w, rows, role, act, tagged, flags, times, S, Q, iters, epoch[0],
                                    NSLOT=args.depth, LOADX=loadx, K=K, CB=CB, NCB=NCB, RB=RB, num_warps=RB)
            epoch[0] += iters
            torch.cuda.synchronize()
            t = times.cpu().tolist()
            st = [t[p] for p in range(P) if role_list[p] >= 0]
            sy = [t[p] for p in range(P) if role_list[p] < 0]
            spans.append((max(e for _, e in st) - min(b for b, _ in st), _median([e - b for b, e in sy]),
                          max(e for _, e in sy) <= max(e for _, e in st)))
        i = sorted(range(len(spans)), key=lambda k: spans[k][0])[len(spans) // 2]
        return spans[i]

    errs = [_chain_error(P, act, tagged, flags, times, w, args.depth, ll) for ll in (False, True)]
    err = max(errs)
    print(json.dumps({"bench": "chain_check", "rel_err_flag": errs[0], "rel_err_ll": errs[1]}), flush=True)
    tagged.zero_()  # the LL check's epochs restart from 0 below
    if not err < 1e-5:
        print(f"bench_sync_under_stream: the syncers' chain is wrong (rel_err {err}): a barrier let a stale "
              "activation through", file=sys.stderr)
        return 1
    rows_out = []
    for x in args.x:
        for placement in args.placement:
            for S in args.streamers:
                rl = roles(P, S, placement)
                Q = P - S
                loadx = {"none": 0, "live": 1, "ll": 2}[x]
                _, sync_alone, _ = run(rl, S, Q, 0, args.iters, loadx)
                stream_alone, _, _ = run(rl, S, Q, R, 0, loadx)
                stream_both, sync_both, inside = run(rl, S, Q, R, args.iters, loadx)
                row = dict(bench="sync_under_stream", placement=placement, streamers=S, syncers=Q, x=x,
                           sync_us_alone=round(sync_alone / 1e3 / args.iters, 3),
                           sync_us_streaming=round(sync_both / 1e3 / args.iters, 3),
                           stream_tb_s_alone=round(R * K * 2 / stream_alone / 1e3, 3),
                           stream_tb_s_with_sync=round(R * K * 2 / stream_both / 1e3, 3), sync_inside_stream=inside)
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    print(f"\n{props.name}, {P} programs; streamers move {R * K * 2 / 1e6:.0f} MB, {args.depth} x 20 KB in flight "
          f"each; syncers run {args.iters} rounds (us per round)")
    print(f"{'x':<6}{'placement':<10}{'S':>5}{'Q':>5}{'sync alone':>12}{'streaming':>11}{'TB/s alone':>12}"
          f"{'with sync':>11}{'inside':>8}")
    for r in rows_out:
        print(f"{r['x']:<6}{r['placement']:<10}{r['streamers']:>5}{r['syncers']:>5}{r['sync_us_alone']:>12.3f}"
              f"{r['sync_us_streaming']:>11.3f}{r['stream_tb_s_alone']:>12.3f}{r['stream_tb_s_with_sync']:>11.3f}"
              f"{str(r['sync_inside_stream']):>8}")
    if not all(r["sync_inside_stream"] for r in rows_out):
        print("note: where `inside` is False the syncers outlasted the stream: raise --stream-mb or lower --iters")
    return 0


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("bench_sync_under_stream", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
