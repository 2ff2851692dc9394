"""The persistent batch-1 decode kernel (host side and measurements: nanochat/triton_decode.py).

Per layer l (residual stream kept in float32, slot 2l = the block input, slot 2l+1 = after
attention, slot 2l+2 = after the MLP; slot 0 = x0 = norm(wte[token])):
  1. qkv:   s = lam_l * r + mu_l * x0; rows of [Wq; Wk; Wv] @ norm(s) -> qkv (each program its
            contiguous share of rows; norm's 1/rms is taken with the dot products and scales
            them, _gemv); program 0 also computes the value-embedding gate
            2 sigmoid(Wg @ norm(s)[:32]).
  2. attn:  units (head, key chunk): RoPE + QK-norm of q and the new k (recomputed per unit), the
            new v (+ gate * value-embedding row); the unit (kv head, chunk 0) writes the new k/v
            into the cache; the chunk's softmax sums (keys < pos from the cache, key pos from
            registers, only keys inside the layer's window; a program's first key block is loaded
            before the barrier opens) added into y_num / y_den with float64 atomics (zeroed by
            the q/k/v phase; why: nanochat/triton_decode_attention.py).
  3. proj:  r_mid = s + Wo @ y, y = y_num / y_den (one y_den per head).
  4. fc:    h = relu(Wfc @ norm(r_mid))^2.
  5. proj2: r_out = r_mid + Wp2 @ h.
and finally logits = softcap * tanh(lm_head @ norm(r_L)) over the real vocabulary.

Every phase ends at a grid barrier (_arrive/_wait: per-program int64 flags that only grow).
Between a program's _arrive and its _wait it loads what the next phase needs and no other
program writes: that phase's first weight tile (_sync_w, `PRE`) or first key block, so DRAM
works while the barrier waits (d20 on the H100: 0.766 -> 0.680 ms per step). All programs must
be resident at once: one program per SM, launched alone on its stream (a CUDA
graph replays it that way), and the first launch checks the compiled kernel's registers and shared
memory against the SMs (`_check_resident`: a grid that cannot be resident would wait forever).
Data written by other programs is read with .cg loads (L2, never a stale L1 line). Under
TRITON_INTERPRET=1 (CPU tests) programs run one after another, so a barrier would never open:
the host launches one phase at a time (`PHASE` >= 0); the GPU runs all in one launch (`PHASE` =
-1). Accumulation is float32 throughout; weights and the KV cache are in the model's dtype, and
so is every product's input (rounded to it, as the eager model's are) except the normed ones,
which stay float32 (the norm's scale is applied after the dot products). With QUANT the four
matrices per layer and the lm_head are int8 (nanochat/quantize.py): the same tiles, half the
bytes, widened in registers, and each row's sum times its float32 scale (pointer table columns
P_SQKV..P_SP2, `hscale_ptr` for the head); lookups, gates and the cache keep the model's dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nanochat.triton_decode_attention import _attention_phase, _attn_prefetch
from nanochat.triton_int8 import widen

# Per-layer pointer table columns (int64 addresses).
P_QKV = tl.constexpr(0)
P_WO = tl.constexpr(1)
P_FC = tl.constexpr(2)
P_P2 = tl.constexpr(3)
P_KC = tl.constexpr(4)
P_VC = tl.constexpr(5)
P_VE = tl.constexpr(6)
P_GATE = tl.constexpr(7)
P_SQKV = tl.constexpr(8)   # int8 weights (QUANT): the float32 row scales of q/k/v, proj, fc, proj2
P_SWO = tl.constexpr(9)
P_SFC = tl.constexpr(10)
P_SP2 = tl.constexpr(11)
N_PTRS = tl.constexpr(12)
PHASES = 7  # 0 x0, 1 qkv, 2 attention, 3 proj, 4 fc, 5 proj2, 6 lm_head (interpreter launches)


@triton.jit
def _arrive(flags, epoch, pid):
    """First half of the grid barrier: publish `epoch` in this program's flag. Flags only grow (a
    step's k-th barrier uses epoch = the flag at step start + k), so nothing is ever reset."""
    tl.debug_barrier()  # every thread's stores are issued before the release below
    tl.atomic_xchg(flags + pid, epoch, sem="release", scope="gpu")


@triton.jit
def _wait(flags, epoch, pid, nprog, trace_ptr, slot, P_P2: tl.constexpr, TRACE: tl.constexpr):
    """Second half: wait until every flag reaches `epoch`. Work that does not depend on the
    other programs (weight tiles, cached keys) goes between _arrive and _wait. A barrier
    costs ~1.4 us on the H100 with 132 programs; one shared atomic counter (1.7 us) and polling
    with ld.acquire were no faster (all measured). The poll is volatile (relaxed); _acquire after
    it orders this program's later loads after the other programs' released stores."""
    i = tl.arange(0, P_P2)
    seen = tl.min(tl.load(flags + i, mask=i < nprog, other=epoch, volatile=True), 0)
    while seen < epoch:
        seen = tl.min(tl.load(flags + i, mask=i < nprog, other=epoch, volatile=True), 0)
    _acquire(flags + pid)  # later loads see the others' stores
    tl.debug_barrier()
    if TRACE:
        if pid == 0:  # when the barrier opened, for the phase timings (PersistentDecodeStep.trace)
            tl.store(trace_ptr + slot, _globaltimer())


@triton.jit
def _acquire(ptr):
    """An ld.acquire.gpu of `ptr` (its value unused). Not tl.atomic_add(ptr, 0, sem="acquire"):
    Triton 3.6 turns that into a load and, its result unused, deletes it (the PTX had no acquire).
    ptxas follows this load with CCTL.IVALL (L1 invalidated), so even L1-cached loads after the
    barrier would see the other programs' stores; the kernel reads those with .cg anyway (L1
    reads of them were not faster: CHANGELOG_GB10.md, session 22)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _rstd(a_ptr, b_ptr, lam, mu, K, eps, MIX: tl.constexpr, BK: tl.constexpr):
    """1 / rms(s) of s = lam * a + mu * b (MIX) or s = a, over K float32 values."""
    acc = tl.zeros([BK], tl.float32)
    for k in range(0, K, BK):
        offs = k + tl.arange(0, BK)
        s = tl.load(a_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        if MIX:
            s = lam * s + mu * tl.load(b_ptr + offs, mask=offs < K, other=0.0, cache_modifier=".cg")
        acc += s * s
    return tl.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _mix(a_ptr, b_ptr, lam, mu, cols, K, MIX: tl.constexpr):
    """A chunk of float32 s: MIX 0 a, 1 lam * a + mu * b, and MIX = D >= 2 a / b[col // D] (the
    attention's float64 sums, b one per head: the compiler sees col // D constant over a
    thread's columns and loads it once); columns >= K read as 0."""
    x = tl.load(a_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    if MIX >= 2:
        x = x / tl.load(b_ptr + cols // MIX, mask=cols < K, other=1.0, cache_modifier=".cg").to(tl.float32)
    elif MIX == 1:
        x = lam * x + mu * tl.load(b_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg")
    return x


@triton.jit
def _input(a_ptr, b_ptr, lam, mu, scale, cols, K, MIX: tl.constexpr, wty: tl.constexpr):
    """A chunk of a product's input vector: _mix * scale, rounded to the weights' dtype like the
    eager model's matmul input, returned in float32."""
    return (_mix(a_ptr, b_ptr, lam, mu, cols, K, MIX) * scale).to(wty).to(tl.float32)


@triton.jit
def _w_cols(w_ptr, rows, n1, K, c0, BW: tl.constexpr):
    """W[rows, c0:c0 + BW] (rows >= n1 and columns >= K read as 0), streamed past L1."""
    cols = c0 + tl.arange(0, BW)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                   mask=(rows[:, None] < n1) & (cols[None, :] < K), other=0.0, eviction_policy="evict_first")


@triton.jit
def _w_first(w_ptr, s_ptr, N, K: tl.constexpr, pid, nprog, BN: tl.constexpr, BK: tl.constexpr,
             UNROLL: tl.constexpr, QUANT: tl.constexpr):
    """This program's first weight tile of a GEMV: its first BN rows, as a tuple of their int8 row
    scales (QUANT; else 1.0) and then the first min(UNROLL, ceil(K / BK)) column chunks of BK
    (what _gemv's first K step uses). Weights do not depend on the step's activations, so the tile
    is loaded between a barrier's _arrive and _wait and its DRAM latency overlaps the barrier. At
    d20 that is a program's whole share of q/k/v, proj and proj2. The scales come with it: loaded
    after the barrier they were a DRAM round trip per phase before the first tile's epilogue
    (H200 d20 int8 step: CHANGELOG_GB10.md, session 45). N = 0: nothing is read."""
    NK: tl.constexpr = (K + BK - 1) // BK
    KU: tl.constexpr = NK if NK < UNROLL else UNROLL
    n0 = pid * N // nprog
    rows = n0 + tl.arange(0, BN)
    n1 = (pid + 1) * N // nprog
    ws = (_row_scale(s_ptr, rows, n1, QUANT),)
    for kk in tl.static_range(0, BK * KU, BK):
        ws = ws + (_w_cols(w_ptr, rows, n1, K, kk, BK),)
    return ws


@triton.jit
def _x_chunk(xa_ptr, xb_ptr, x_lam, x_mu, cols, K, MIX: tl.constexpr, NORM: tl.constexpr, wty: tl.constexpr):
    # NORM: the float32 s itself (the 1/rms scale is applied to the dot products); else rounded
    # to the weights' dtype like the eager model's matmul input
    if NORM:
        return _mix(xa_ptr, xb_ptr, x_lam, x_mu, cols, K, MIX)
    else:
        return _input(xa_ptr, xb_ptr, x_lam, x_mu, 1.0, cols, K, MIX, wty)


@triton.jit
def _w_stream(w_ptr, ws, rows, n1, K: tl.constexpr, xa_ptr, xb_ptr, x_lam, x_mu, MIX: tl.constexpr,
              NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr, FIRST: tl.constexpr,
              wty: tl.constexpr):
    """(W[rows, :] . x, sum of x^2) in BK-column chunks, UNROLL chunks issued before the first is
    used (static_range): a decode GEMV is bound by the bytes each SM has in flight. FIRST: the
    first UNROLL chunks are `ws[1:]` (_w_first), already loaded. `wty`: the model's compute dtype,
    what x is rounded to (W's own dtype unless W is int8)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    KU: tl.constexpr = NK if NK < UNROLL else UNROLL
    acc = tl.zeros([BN, BK], tl.float32)
    sq = tl.zeros([BK], tl.float32)
    if FIRST:
        for i in tl.static_range(KU):
            x = _x_chunk(xa_ptr, xb_ptr, x_lam, x_mu, i * BK + tl.arange(0, BK), K, MIX, NORM, wty)
            acc += widen(ws[i + 1]) * x[None, :]
            sq += x * x
    for k0 in range(BK * KU if FIRST else 0, K, BK * KU):
        for kk in tl.static_range(0, BK * KU, BK):
            w = _w_cols(w_ptr, rows, n1, K, k0 + kk, BK)
            x = _x_chunk(xa_ptr, xb_ptr, x_lam, x_mu, k0 + kk + tl.arange(0, BK), K, MIX, NORM, wty)
            acc += widen(w) * x[None, :]
            sq += x * x
    return tl.sum(acc, 1), tl.sum(sq, 0)


@triton.jit
def _residual(rows, n1, ra_ptr, rb_ptr, EPI: tl.constexpr):
    """(ra[rows], rb[rows]) for an EPI = 1 epilogue (else zeros, nothing read). Loaded before the
    tile's dot products: written phases ago, they wait on nothing, and issued after the
    products' cross-warp reduction (a bar.sync, which loads do not cross) they cost every
    program one more L2 round trip before the barrier."""
    if EPI == 1:
        ra = tl.load(ra_ptr + rows, mask=rows < n1, other=0.0, cache_modifier=".cg")
        rb = tl.load(rb_ptr + rows, mask=rows < n1, other=0.0, cache_modifier=".cg")
    else:
        ra = tl.zeros(rows.shape, tl.float32)
        rb = tl.zeros(rows.shape, tl.float32)
    return ra, rb


@triton.jit
def _row_scale(s_ptr, rows, n1, QUANT: tl.constexpr):
    """The float32 scales of int8 rows (QUANT; loaded with _residual's, for the same reason), else 1."""
    if QUANT:
        return tl.load(s_ptr + rows, mask=rows < n1, other=0.0)
    else:
        return 1.0


@triton.jit
def _epilogue(out, rows, n1, out_ptr, ra, rb, r_lam, r_mu, softcap, EPI: tl.constexpr):
    """0 store; 1 add the residual r_lam * ra + r_mu * rb (_residual's values); 2 relu^2;
    3 softcap * tanh(. / softcap)."""
    if EPI == 1:
        out += r_lam * ra
        out += r_mu * rb
    elif EPI == 2:
        out = tl.maximum(out, 0.0)
        out = out * out
    elif EPI == 3:
        out = softcap * (1.0 - 2.0 / (tl.exp(2.0 * out / softcap) + 1.0))  # tanh, inf-safe
    tl.store(out_ptr + rows, out, mask=rows < n1)


@triton.jit
def _gemv(w_ptr, s_ptr, ws, N, K: tl.constexpr, xa_ptr, xb_ptr, x_lam, x_mu, eps, out_ptr, ra_ptr, rb_ptr,
          r_lam, r_mu, softcap, pid, nprog, MIX: tl.constexpr, NORM: tl.constexpr, EPI: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr, QUANT: tl.constexpr, wty: tl.constexpr):
    """out[n] = _epilogue(W[n, :] . x) for this program's contiguous share of the N rows, with
    x = norm(s) (NORM) or s, s = _mix(xa, xb, x_lam, x_mu); `ws` is the first tile, from
    _w_first. Returns 1 / rms(s) (NORM; else 1). The norm costs no pass of its own: its sum of
    squares comes with the first row tile's dot products, which it then scales, so nothing waits
    for it between the barrier and the first FMA. QUANT: W is int8 and W[n, :] . x is scaled by
    s_ptr[n] (nanochat/quantize.py's per-row scales), like the 1/rms after the sums."""
    n0 = pid * N // nprog
    n1 = (pid + 1) * N // nprog
    rows = n0 + tl.arange(0, BN)
    ra, rb = _residual(rows, n1, ra_ptr, rb_ptr, EPI)
    sc = ws[0]   # the first tile's row scales came with its weights (_w_first)
    out, ss = _w_stream(w_ptr, ws, rows, n1, K, xa_ptr, xb_ptr, x_lam, x_mu, MIX, NORM, BN, BK, UNROLL, True, wty)
    rstd = tl.rsqrt(ss / K + eps) if NORM else 1.0
    _epilogue(out * sc * rstd, rows, n1, out_ptr, ra, rb, r_lam, r_mu, softcap, EPI)
    for n in range(n0 + BN, n1, BN):
        rows = n + tl.arange(0, BN)
        ra, rb = _residual(rows, n1, ra_ptr, rb_ptr, EPI)
        sc = _row_scale(s_ptr, rows, n1, QUANT)
        out, _ = _w_stream(w_ptr, ws, rows, n1, K, xa_ptr, xb_ptr, x_lam, x_mu, MIX, NORM, BN, BK, UNROLL, False,
                           wty)
        _epilogue(out * sc * rstd, rows, n1, out_ptr, ra, rb, r_lam, r_mu, softcap, EPI)
    return rstd


@triton.jit
def _layer_ptr(table, layer, col, ty: tl.constexpr):
    # An address loaded as an integer carries no alignment, so without the hint every weight
    # load compiled to 2-byte scalar loads (ld.global.b16, 448 of them: 255 registers and ~1.2
    # TB/s per GEMV); 16 bytes is checked on the host (_pointer_table), and gives 16-byte loads.
    return tl.multiple_of(tl.load(table + layer * N_PTRS + col).to(tl.pointer_type(ty)), 16)


@triton.jit
def _qkv_phase(layer, table, resid, lam_ptr, mu_ptr, qkv_ptr, gate_ptr, ynum_ptr, yden_ptr, eps, pid, nprog, ws,
               wty: tl.constexpr, mty: tl.constexpr, QUANT: tl.constexpr, C: tl.constexpr, H: tl.constexpr,
               HKV: tl.constexpr, D: tl.constexpr, GATE: tl.constexpr, HKV_P2: tl.constexpr, BN_Q: tl.constexpr,
               BK_C: tl.constexpr, UNROLL: tl.constexpr):
    r = resid + 2 * layer * C
    lam = tl.load(lam_ptr + layer).to(tl.float32)
    mu = tl.load(mu_ptr + layer).to(tl.float32)
    rstd = _gemv(_layer_ptr(table, layer, P_QKV, mty), _layer_ptr(table, layer, P_SQKV, tl.float32), ws,
                 (H + 2 * HKV) * D, C, r, resid, lam, mu, eps, qkv_ptr, r, r, 0.0, 0.0, 0.0, pid, nprog, True, True, 0,
                 BN_Q, BK_C, UNROLL, QUANT, wty)
    if pid == nprog - 1:  # the attention's sums start at zero (program 0 computes the gate below)
        zi = tl.arange(0, D)
        for z0 in range(0, H * D, D):
            tl.store(ynum_ptr + z0 + zi, tl.zeros([D], tl.float64))
        for z0 in range(0, H, D):
            tl.store(yden_ptr + z0 + zi, tl.zeros([D], tl.float64), mask=z0 + zi < H)
    gate_w = tl.load(table + layer * N_PTRS + P_GATE)
    if (pid == 0) & (gate_w != 0):
        gi = tl.arange(0, HKV_P2)
        x = _input(r, resid, lam, mu, rstd, tl.arange(0, GATE), GATE, True, wty)
        gw = tl.multiple_of(gate_w.to(tl.pointer_type(wty)), 16)
        w = tl.load(gw + gi[:, None] * GATE + tl.arange(0, GATE)[None, :],
                    mask=(gi < HKV)[:, None], other=0.0)
        z = tl.sum(w.to(tl.float32) * x[None, :], 1).to(wty).to(tl.float32)
        tl.store(gate_ptr + gi, 2.0 / (1.0 + tl.exp(-z)), mask=gi < HKV)


@triton.jit
def _proj_phase(layer, table, resid, lam_ptr, mu_ptr, ynum_ptr, yden_ptr, pid, nprog, ws, wty: tl.constexpr,
                mty: tl.constexpr, QUANT: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BN: tl.constexpr,
                BK_C: tl.constexpr, UNROLL: tl.constexpr):
    lam = tl.load(lam_ptr + layer).to(tl.float32)
    mu = tl.load(mu_ptr + layer).to(tl.float32)
    r = resid + 2 * layer * C
    _gemv(_layer_ptr(table, layer, P_WO, mty), _layer_ptr(table, layer, P_SWO, tl.float32), ws, C, C, ynum_ptr,
          yden_ptr, 1.0, 0.0, 0.0, r + C, r, resid, lam, mu, 0.0, pid, nprog, D, False, 1, BN, BK_C, UNROLL, QUANT,
          wty)


@triton.jit
def _fc_phase(layer, table, resid, hid_ptr, eps, pid, nprog, ws, wty: tl.constexpr, mty: tl.constexpr,
              QUANT: tl.constexpr, C: tl.constexpr, BN_FC: tl.constexpr, BK_C: tl.constexpr, UNROLL: tl.constexpr):
    r_mid = resid + (2 * layer + 1) * C
    _gemv(_layer_ptr(table, layer, P_FC, mty), _layer_ptr(table, layer, P_SFC, tl.float32), ws, 4 * C, C, r_mid,
          r_mid, 1.0, 0.0, eps, hid_ptr, r_mid, r_mid, 0.0, 0.0, 0.0, pid, nprog, False, True, 2, BN_FC, BK_C, UNROLL,
          QUANT, wty)


@triton.jit
def _proj2_phase(layer, table, resid, hid_ptr, pid, nprog, ws, wty: tl.constexpr, mty: tl.constexpr,
                 QUANT: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, BK_F: tl.constexpr, UNROLL: tl.constexpr):
    r_mid = resid + (2 * layer + 1) * C
    _gemv(_layer_ptr(table, layer, P_P2, mty), _layer_ptr(table, layer, P_SP2, tl.float32), ws, C, 4 * C, hid_ptr,
          hid_ptr, 1.0, 0.0, 0.0, r_mid + C, r_mid, r_mid, 1.0, 0.0, 0.0, pid, nprog, False, False, 1, BN, BK_F,
          UNROLL, QUANT, wty)


@triton.jit
def _head_phase(head_ptr, hscale_ptr, r_last, logits_ptr, V, softcap, eps, pid, nprog, wty: tl.constexpr,
                QUANT: tl.constexpr, C: tl.constexpr, BN: tl.constexpr, BK_C: tl.constexpr, UNROLL: tl.constexpr,
                HS: tl.constexpr):
    """logits = softcap * tanh(lm_head @ norm(r_L)), this program's ~V / nprog rows in tiles of
    BN (~16 tiles at d20). HS = 0: _gemv, whose loop issues a tile's loads only when the tile
    before it is reduced; otherwise x = norm's input is held in registers and HS = 1 issues the
    next tile's loads before this tile's sums (two tiles in registers; the default: lm_head 42.6
    -> 29.9 us per step at d20 on the H100), HS >= 2 software-pipelines the loop with tl.range
    (33.2 us at 2 stages, 31.0 at 3). The same sums in the same order in every case. QUANT: an
    int8 head, each row's sum scaled by hscale_ptr[row]."""
    if HS == 0:
        ws = _w_first(head_ptr, hscale_ptr, V, C, pid, nprog, BN, BK_C, UNROLL, QUANT)
        _gemv(head_ptr, hscale_ptr, ws, V, C, r_last, r_last, 1.0, 0.0, eps, logits_ptr, r_last, r_last, 0.0, 0.0,
              softcap, pid, nprog, False, True, 3, BN, BK_C, UNROLL, QUANT, wty)
    else:
        NK: tl.constexpr = (C + BK_C - 1) // BK_C
        xs = ()
        sq = tl.zeros([BK_C], tl.float32)
        for i in tl.static_range(NK):
            x = _mix(r_last, r_last, 1.0, 0.0, i * BK_C + tl.arange(0, BK_C), C, False)
            xs = xs + (x,)
            sq += x * x
        rstd = tl.rsqrt(tl.sum(sq, 0) / C + eps)
        n0 = pid * V // nprog
        n1 = (pid + 1) * V // nprog
        if HS == 1:  # the next tile's loads issued before this one is reduced (registers)
            ws = _w_first(head_ptr, hscale_ptr, V, C, pid, nprog, BN, BK_C, NK, QUANT)
            for n in range(n0, n1, BN):
                rows = n + tl.arange(0, BN)
                nxt = n + BN + tl.arange(0, BN)
                wn = (_row_scale(hscale_ptr, nxt, n1, QUANT),)
                for i in tl.static_range(NK):
                    wn = wn + (_w_cols(head_ptr, nxt, n1, C, i * BK_C, BK_C),)
                acc = tl.zeros([BN, BK_C], tl.float32)
                for i in tl.static_range(NK):
                    acc += widen(ws[i + 1]) * xs[i][None, :]
                _epilogue(tl.sum(acc, 1) * ws[0] * rstd, rows, n1, logits_ptr, 0.0, 0.0, 0.0, 0.0, softcap, 3)
                ws = wn
        else:
            for n in tl.range(n0, n1, BN, num_stages=HS):
                rows = n + tl.arange(0, BN)
                sc = _row_scale(hscale_ptr, rows, n1, QUANT)
                acc = tl.zeros([BN, BK_C], tl.float32)
                for i in tl.static_range(NK):
                    acc += widen(_w_cols(head_ptr, rows, n1, C, i * BK_C, BK_C)) * xs[i][None, :]
                _epilogue(tl.sum(acc, 1) * sc * rstd, rows, n1, logits_ptr, 0.0, 0.0, 0.0, 0.0, softcap, 3)


@triton.jit
def _w_phase(table, layer, live, PHASE: tl.constexpr, mty: tl.constexpr, QUANT: tl.constexpr, pid, nprog,
             C: tl.constexpr, QKV_N: tl.constexpr, BN: tl.constexpr, BN_Q: tl.constexpr, BN_FC: tl.constexpr,
             BK_C: tl.constexpr, BK_F: tl.constexpr, UNROLL: tl.constexpr):
    """_w_first of phase PHASE (1 qkv, 3 proj, 4 fc, 5 proj2) of `layer`; nothing is read unless `live`."""
    col: tl.constexpr = P_QKV if PHASE == 1 else (P_WO if PHASE == 3 else (P_FC if PHASE == 4 else P_P2))
    scol: tl.constexpr = P_SQKV if PHASE == 1 else (P_SWO if PHASE == 3 else (P_SFC if PHASE == 4 else P_SP2))
    N: tl.constexpr = QKV_N if PHASE == 1 else (4 * C if PHASE == 4 else C)
    K: tl.constexpr = 4 * C if PHASE == 5 else C
    BR: tl.constexpr = BN_Q if PHASE == 1 else (BN_FC if PHASE == 4 else BN)
    BK: tl.constexpr = BK_F if PHASE == 5 else BK_C
    return _w_first(_layer_ptr(table, layer, col, mty), _layer_ptr(table, layer, scol, tl.float32),
                    tl.where(live, N, 0), K, pid, nprog, BR, BK, UNROLL, QUANT)


@triton.jit
def _sync_w(bar_ptr, epoch, pid, nprog, trace_ptr, slot, table, layer, live, PHASE: tl.constexpr,
            PRE: tl.constexpr, mty: tl.constexpr, QUANT: tl.constexpr, C: tl.constexpr, QKV_N: tl.constexpr,
            BN: tl.constexpr, BN_Q: tl.constexpr, BN_FC: tl.constexpr, BK_C: tl.constexpr, BK_F: tl.constexpr,
            UNROLL: tl.constexpr, P_P2: tl.constexpr, TRACE: tl.constexpr):
    """The grid barrier that opens phase PHASE, returning that phase's first weight tile: loaded
    between _arrive and _wait if PRE has the phase's bit (1 qkv, 2 proj, 4 fc, 8 proj2), else
    after _wait."""
    BIT: tl.constexpr = 1 if PHASE == 1 else (2 if PHASE == 3 else (4 if PHASE == 4 else 8))
    _arrive(bar_ptr, epoch, pid)
    if (PRE & BIT) != 0:
        ws = _w_phase(table, layer, live, PHASE, mty, QUANT, pid, nprog, C, QKV_N, BN, BN_Q, BN_FC, BK_C, BK_F, UNROLL)
        _wait(bar_ptr, epoch, pid, nprog, trace_ptr, slot, P_P2, TRACE)
    else:
        _wait(bar_ptr, epoch, pid, nprog, trace_ptr, slot, P_P2, TRACE)
        ws = _w_phase(table, layer, live, PHASE, mty, QUANT, pid, nprog, C, QKV_N, BN, BN_Q, BN_FC, BK_C, BK_F, UNROLL)
    return ws


@triton.jit
def decode_step_kernel(
        tok_ptr, pos_ptr, wte_ptr, head_ptr, hscale_ptr, cos_ptr, sin_ptr, lam_ptr, mu_ptr, table, windows_ptr,
        resid, qkv_ptr, gate_ptr, ynum_ptr, yden_ptr, hid_ptr, bar_ptr, logits_ptr, trace_ptr,
        layer_arg, L, V, T_CACHE, softcap, eps, sm_scale,
        C: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
        GATE: tl.constexpr, HKV_P2: tl.constexpr, NCH: tl.constexpr,
        PHASE: tl.constexpr, BN: tl.constexpr, BN_Q: tl.constexpr, BN_FC: tl.constexpr, BK_C: tl.constexpr,
        BK_F: tl.constexpr,
        BKEY: tl.constexpr, P_P2: tl.constexpr, UNROLL: tl.constexpr, PRE: tl.constexpr, TRACE: tl.constexpr,
        HS: tl.constexpr, QUANT: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wty: tl.constexpr = wte_ptr.dtype.element_ty   # the compute dtype (activations, cache, lookups)
    mty: tl.constexpr = head_ptr.dtype.element_ty  # the matrices': wty, or int8 (QUANT)
    tok = tl.load(tok_ptr)
    pos = tl.load(pos_ptr)
    if PHASE < 0:
        epoch = tl.atomic_add(bar_ptr + pid, 0, sem="acquire", scope="gpu") + 1  # next barrier's
        base = epoch - 1
        if TRACE:
            if pid == 0:
                tl.store(trace_ptr, _globaltimer())
    if PHASE <= 0:  # x0 = norm(wte[token]); this program's share into slot 0
        row = wte_ptr + tok * C
        rstd0 = _rstd(row, row, 1.0, 0.0, C, eps, False, BK_C)
        n0 = pid * C // nprog
        n1 = (pid + 1) * C // nprog
        for n in range(n0, n1, BN):
            cols = n + tl.arange(0, BN)
            x0 = tl.load(row + cols, mask=cols < n1, other=0.0).to(tl.float32) * rstd0
            tl.store(resid + cols, x0.to(wty).to(tl.float32), mask=cols < n1)
    QKV_N: tl.constexpr = (H + 2 * HKV) * D
    if PHASE < 0:
        # Each barrier: _arrive, then the next phase's first weight tile (or first K/V block),
        # which does not depend on the other programs, then _wait (_sync_w, _attn_prefetch).
        ws = _sync_w(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, table, 0, True, 1, PRE, mty, QUANT, C, QKV_N,
                     BN, BN_Q, BN_FC, BK_C, BK_F, UNROLL, P_P2, TRACE)
        for layer in range(L):
            _qkv_phase(layer, table, resid, lam_ptr, mu_ptr, qkv_ptr, gate_ptr, ynum_ptr, yden_ptr, eps, pid,
                       nprog, ws, wty, mty, QUANT, C, H, HKV, D, GATE, HKV_P2, BN_Q, BK_C, UNROLL)
            kc = _layer_ptr(table, layer, P_KC, wty)
            vc = _layer_ptr(table, layer, P_VC, wty)
            window = tl.load(windows_ptr + layer)
            epoch += 1
            _arrive(bar_ptr, epoch, pid)
            kt0, vt0 = _attn_prefetch(kc, vc, pos, window, T_CACHE, pid, H, HKV, D, NCH, BKEY)
            _wait(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, P_P2, TRACE)
            _attention_phase(qkv_ptr, gate_ptr, kc, vc, _layer_ptr(table, layer, P_VE, wty),
                             tl.load(table + layer * N_PTRS + P_VE), tok, pos, window, T_CACHE, cos_ptr, sin_ptr,
                             ynum_ptr, yden_ptr, eps, sm_scale, pid, nprog, kt0, vt0, H, HKV, D, NCH, BKEY)
            epoch += 1
            wo = _sync_w(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, table, layer, True, 3, PRE, mty, QUANT, C,
                         QKV_N, BN, BN_Q, BN_FC, BK_C, BK_F, UNROLL, P_P2, TRACE)
            _proj_phase(layer, table, resid, lam_ptr, mu_ptr, ynum_ptr, yden_ptr, pid, nprog, wo, wty, mty, QUANT,
                        C, D, BN, BK_C, UNROLL)
            epoch += 1
            wf = _sync_w(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, table, layer, True, 4, PRE, mty, QUANT, C,
                         QKV_N, BN, BN_Q, BN_FC, BK_C, BK_F, UNROLL, P_P2, TRACE)
            _fc_phase(layer, table, resid, hid_ptr, eps, pid, nprog, wf, wty, mty, QUANT, C, BN_FC, BK_C, UNROLL)
            epoch += 1
            wp = _sync_w(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, table, layer, True, 5, PRE, mty, QUANT, C,
                         QKV_N, BN, BN_Q, BN_FC, BK_C, BK_F, UNROLL, P_P2, TRACE)
            _proj2_phase(layer, table, resid, hid_ptr, pid, nprog, wp, wty, mty, QUANT, C, BN, BK_F, UNROLL)
            epoch += 1  # then the next layer's q/k/v tile (none after the last layer)
            ws = _sync_w(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, table, tl.minimum(layer + 1, L - 1),
                         layer + 1 < L, 1, PRE, mty, QUANT, C, QKV_N, BN, BN_Q, BN_FC, BK_C, BK_F, UNROLL, P_P2, TRACE)
        _head_phase(head_ptr, hscale_ptr, resid + 2 * L * C, logits_ptr, V, softcap, eps, pid, nprog, wty, QUANT, C, BN,
                    BK_C, UNROLL, HS)
        if TRACE:
            tl.debug_barrier()
            if pid == 0:  # program 0's own lm_head share done (no barrier follows)
                tl.store(trace_ptr + epoch - base + 1, _globaltimer())
    elif PHASE == 2:
        kc = _layer_ptr(table, layer_arg, P_KC, wty)
        vc = _layer_ptr(table, layer_arg, P_VC, wty)
        window = tl.load(windows_ptr + layer_arg)
        kt0, vt0 = _attn_prefetch(kc, vc, pos, window, T_CACHE, pid, H, HKV, D, NCH, BKEY)
        _attention_phase(qkv_ptr, gate_ptr, kc, vc, _layer_ptr(table, layer_arg, P_VE, wty),
                         tl.load(table + layer_arg * N_PTRS + P_VE), tok, pos, window, T_CACHE, cos_ptr, sin_ptr,
                         ynum_ptr, yden_ptr, eps, sm_scale, pid, nprog, kt0, vt0, H, HKV, D, NCH, BKEY)
    elif PHASE == 6:
        _head_phase(head_ptr, hscale_ptr, resid + 2 * L * C, logits_ptr, V, softcap, eps, pid, nprog, wty, QUANT, C, BN,
                    BK_C, UNROLL, HS)
    elif PHASE > 0:  # a GEMV phase of layer_arg: 1 qkv, 3 proj, 4 fc, 5 proj2
        ws = _w_phase(table, layer_arg, True, PHASE, mty, QUANT, pid, nprog, C, QKV_N, BN, BN_Q, BN_FC, BK_C, BK_F,
                      UNROLL)
        if PHASE == 1:
            _qkv_phase(layer_arg, table, resid, lam_ptr, mu_ptr, qkv_ptr, gate_ptr, ynum_ptr, yden_ptr, eps, pid,
                       nprog, ws, wty, mty, QUANT, C, H, HKV, D, GATE, HKV_P2, BN_Q, BK_C, UNROLL)
        elif PHASE == 3:
            _proj_phase(layer_arg, table, resid, lam_ptr, mu_ptr, ynum_ptr, yden_ptr, pid, nprog, ws, wty, mty,
                        QUANT, C, D, BN, BK_C, UNROLL)
        elif PHASE == 4:
            _fc_phase(layer_arg, table, resid, hid_ptr, eps, pid, nprog, ws, wty, mty, QUANT, C, BN_FC, BK_C, UNROLL)
        else:
            _proj2_phase(layer_arg, table, resid, hid_ptr, pid, nprog, ws, wty, mty, QUANT, C, BN, BK_F, UNROLL)
