"""The whole batch-1 decode step as one persistent Triton kernel (Engine graph_step="persistent").

Why: a one-token decode step of a d20 model reads ~870 MB of weights, 0.26 ms at the H100's
3.35 TB/s, but through torch.compile + CUDA graphs it ran ~200 dependent kernels (GEMVs through
cuBLAS, fused elementwise kernels, attention) at ~5 us each, because every dependent 3-13 MB read
pays its launch, ramp-up and tail (H100 GEMV study, CHANGELOG_GB10.md): 0.98 ms, 25% of the
bandwidth roofline. Here one program per SM walks every layer and the phases meet at software
grid barriers, so there are no launches between phases.

Measured (H100, torch 2.11, Triton 3.6, d20 bf16 random weights, prompt 512 + 128 tokens, one
machine, bench_inference --graph-step persistent,compiled): model step 0.757 ms vs 0.984 ms for
the compiled CUDA graph, 1,067 vs 871 tok/s end to end (+22%), TTFT 25.9 vs 41.2 ms, 36% of the
HBM roofline by bytes read; logits 3x closer to a float32 model than the eager bf16 step's. Where
the time goes (bench_decode_kernel --trace, us per step summed over layers, each phase with its
closing barrier): qkv 153, attention 138, proj 76, fc 183, proj2 159, lm_head 40. A barrier
costs ~1.7 us (101 per d20 step) and each GEMV phase pays a DRAM round trip per row tile, which
is why it stays far from the roofline. Tried and slower (CHANGELOG_GB10.md has the numbers): L2
prefetch of coming phases' weights (per-thread prefetch.global.L2, before or two phases ahead),
two programs per SM, the next row tile loaded one step ahead, 8-row tiles, 32-key blocks.

Per layer l (residual stream kept in float32, slot 2l = the block input, slot 2l+1 = after
attention, slot 2l+2 = after the MLP; slot 0 = x0 = norm(wte[token])):
  1. qkv:   s = lam_l * r + mu_l * x0; rows of [Wq; Wk; Wv] @ norm(s) -> qkv (each program its
            contiguous share of rows, norm(s) recomputed per program); program 0 also computes
            the value-embedding gate 2 sigmoid(Wg @ norm(s)[:32]).
  2. attn:  units (head, key chunk): RoPE + QK-norm of q and the new k (recomputed per unit), the
            new v (+ gate * value-embedding row); the unit (kv head, chunk 0) writes the new k/v
            into the cache; online softmax over the chunk (keys < pos from the cache, key pos from
            registers, only keys inside the layer's window; a program's first key block is loaded
            before the barrier opens); the last unit of a head to finish (an atomic counter) merges
            the head's chunks into y.
  3. proj:  r_mid = s + Wo @ y.
  4. fc:    h = relu(Wfc @ norm(r_mid))^2.
  5. proj2: r_out = r_mid + Wp2 @ h.
and finally logits = softcap * tanh(lm_head @ norm(r_L)) over the real vocabulary.

Every phase ends at a grid barrier (_arrive/_wait: per-program int64 flags that only grow), so
all programs must be resident at once: one program per SM, launched alone on its stream (a CUDA
graph replays it that way), and the first launch checks the compiled kernel's registers and shared
memory against the SMs (`_check_resident`: a grid that cannot be resident would wait forever).
Data written by other programs is read with .cg loads (L2, never a stale L1 line). Under
TRITON_INTERPRET=1 (CPU tests) programs run one after another, so a barrier would never open:
the host launches one phase at a time (`PHASE` >= 0); the GPU runs all in one launch (`PHASE` =
-1). Accumulation is float32 throughout; weights, the KV cache and every product's inputs are in
the model's dtype (the inputs rounded to it, as the eager model's are).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Per-layer pointer table columns (int64 addresses).
P_QKV = tl.constexpr(0)
P_WO = tl.constexpr(1)
P_FC = tl.constexpr(2)
P_P2 = tl.constexpr(3)
P_KC = tl.constexpr(4)
P_VC = tl.constexpr(5)
P_VE = tl.constexpr(6)
P_GATE = tl.constexpr(7)
N_PTRS = tl.constexpr(8)
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
    other programs (loading cached keys) goes between _arrive and _wait. A barrier
    costs ~1.7 us on the H100 with 132 programs, the same as one shared atomic counter and as
    polling with ld.acquire instead of the final acquire atomic (all measured)."""
    i = tl.arange(0, P_P2)
    seen = tl.min(tl.load(flags + i, mask=i < nprog, other=epoch, volatile=True), 0)
    while seen < epoch:
        seen = tl.min(tl.load(flags + i, mask=i < nprog, other=epoch, volatile=True), 0)
    tl.atomic_add(flags + pid, 0, sem="acquire", scope="gpu")  # later loads see the others' stores
    tl.debug_barrier()
    if TRACE:
        if pid == 0:  # when the barrier opened, for the phase timings (PersistentDecodeStep.trace)
            tl.store(trace_ptr + slot, _globaltimer())


@triton.jit
def _grid_sync(flags, epoch, pid, nprog, trace_ptr, slot, P_P2: tl.constexpr, TRACE: tl.constexpr):
    _arrive(flags, epoch, pid)
    _wait(flags, epoch, pid, nprog, trace_ptr, slot, P_P2, TRACE)


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
def _input(a_ptr, b_ptr, lam, mu, scale, cols, K, MIX: tl.constexpr, wty: tl.constexpr):
    """A chunk of a product's input vector: ((lam * a + mu * b) or a) * scale, rounded to the
    weights' dtype like the eager model's matmul input, returned in float32."""
    x = tl.load(a_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    if MIX:
        x = lam * x + mu * tl.load(b_ptr + cols, mask=cols < K, other=0.0, cache_modifier=".cg")
    return (x * scale).to(wty).to(tl.float32)


@triton.jit
def _gemv(w_ptr, N, K: tl.constexpr, xa_ptr, xb_ptr, x_lam, x_mu, x_scale, out_ptr, ra_ptr, rb_ptr, r_lam, r_mu,
          softcap, pid, nprog, MIX: tl.constexpr, EPI: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          UNROLL: tl.constexpr):
    """out[n] = epilogue(W[n, :] . x) for this program's contiguous share of the N rows.

    x = _input(xa, xb, x_lam, x_mu, x_scale). Epilogues: 0 store; 1 add the residual
    r_lam * ra[n] + r_mu * rb[n]; 2 relu^2; 3 softcap * tanh(. / softcap).
    The K loop is unrolled by UNROLL chunks (static_range), so that many weight loads of a
    row tile are issued before the first is used: a decode GEMV is bound by the bytes each SM
    has in flight."""
    wty = w_ptr.dtype.element_ty
    NK: tl.constexpr = (K + BK - 1) // BK
    KU: tl.constexpr = NK if NK < UNROLL else UNROLL
    n0 = pid * N // nprog
    n1 = (pid + 1) * N // nprog
    for n in range(n0, n1, BN):
        rows = n + tl.arange(0, BN)
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(0, K, BK * KU):
            for kk in tl.static_range(0, BK * KU, BK):
                cols = k0 + kk + tl.arange(0, BK)
                w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :],
                            mask=(rows[:, None] < n1) & (cols[None, :] < K), other=0.0,
                            eviction_policy="evict_first")
                x = _input(xa_ptr, xb_ptr, x_lam, x_mu, x_scale, cols, K, MIX, wty)
                acc += w.to(tl.float32) * x[None, :]
        out = tl.sum(acc, 1)
        if EPI == 1:
            out += r_lam * tl.load(ra_ptr + rows, mask=rows < n1, other=0.0, cache_modifier=".cg")
            out += r_mu * tl.load(rb_ptr + rows, mask=rows < n1, other=0.0, cache_modifier=".cg")
        elif EPI == 2:
            out = tl.maximum(out, 0.0)
            out = out * out
        elif EPI == 3:
            out = softcap * (1.0 - 2.0 / (tl.exp(2.0 * out / softcap) + 1.0))  # tanh, inf-safe
        tl.store(out_ptr + rows, out, mask=rows < n1)


@triton.jit
def _layer_ptr(table, layer, col, ty: tl.constexpr):
    # An address loaded as an integer carries no alignment, so without the hint every weight
    # load compiled to 2-byte scalar loads (ld.global.b16, 448 of them: 255 registers and ~1.2
    # TB/s per GEMV); 16 bytes is checked on the host (_pointer_table), and gives 16-byte loads.
    return tl.multiple_of(tl.load(table + layer * N_PTRS + col).to(tl.pointer_type(ty)), 16)


@triton.jit
def _rotary_norm(base_ptr, d, partner, sign, cs, sn, eps, D: tl.constexpr):
    """norm(rotate(x)) of one head's float32 vector: (x1, x2) -> (x1 c + x2 s, x2 c - x1 s)."""
    x = tl.load(base_ptr + d, cache_modifier=".cg")
    xp = tl.load(base_ptr + partner, cache_modifier=".cg")
    r = x * cs + sign * xp * sn
    return r * tl.rsqrt(tl.sum(r * r, 0) / D + eps)


@triton.jit
def _attn_split(pos, window, NCH: tl.constexpr, BKEY: tl.constexpr):
    """The visible keys [lo, pos] of a layer split into nch chunks of `chunk` keys (whole blocks)."""
    lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    nkeys = pos - lo + 1
    chunk = tl.cdiv(tl.cdiv(nkeys, NCH), BKEY) * BKEY
    return lo, chunk, tl.cdiv(nkeys, chunk)


@triton.jit
def _kv_block(head_k, head_v, keys, limit, d, D: tl.constexpr):
    """K and V rows `keys` (those < limit; others 0) of one kv head's cache."""
    m = (keys < limit)[:, None]
    return (tl.load(head_k + keys[:, None] * D + d[None, :], mask=m, other=0.0),
            tl.load(head_v + keys[:, None] * D + d[None, :], mask=m, other=0.0))


@triton.jit
def _attn_prefetch(kc, vc, pos, window, T_CACHE, pid, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                   NCH: tl.constexpr, BKEY: tl.constexpr):
    """The first key block of this program's first attention unit (u = pid), loaded before the
    barrier that opens the attention phase: cached keys do not depend on this step's q/k/v, so
    the DRAM latency overlaps the barrier (~1.7 us) instead of following it."""
    lo, chunk, nch = _attn_split(pos, window, NCH, BKEY)
    g = (pid // nch) // (H // HKV)
    j0 = lo + (pid % nch) * chunk
    limit = tl.where(pid < H * nch, tl.minimum(tl.minimum(j0 + chunk, pos + 1), pos), 0)
    return _kv_block(kc + g * T_CACHE * D, vc + g * T_CACHE * D, j0 + tl.arange(0, BKEY), limit,
                     tl.arange(0, D), D)


@triton.jit
def _attend(kt, vt, keys, j1, pos, q, s_new, v_new, m_i, l_i, acc):
    """Online-softmax update with one key block (the key at `pos` comes from registers)."""
    s = tl.sum(kt.to(tl.float32) * q[None, :], 1)
    s = tl.where(keys == pos, s_new, s)
    s = tl.where(keys < j1, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))
    p = tl.exp(s - m_new)
    alpha = tl.exp(m_i - m_new)
    p_new = tl.sum(tl.where(keys == pos, p, 0.0), 0)
    acc = acc * alpha + tl.sum(p[:, None] * vt.to(tl.float32), 0) + p_new * v_new
    return m_new, l_i * alpha + tl.sum(p, 0), acc


@triton.jit
def _attention_phase(qkv_ptr, gate_ptr, kc, vc, ve, has_ve, tok, pos, window, T_CACHE, cos_ptr, sin_ptr,
                     part_ptr, count_ptr, y_ptr, eps, sm_scale, pid, nprog, kt0, vt0,
                     H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NCH: tl.constexpr,
                     NCH_P2: tl.constexpr, BKEY: tl.constexpr):
    cty = kc.dtype.element_ty
    lo, chunk, nch = _attn_split(pos, window, NCH, BKEY)
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    partner = (d + HALF) % D
    sign = tl.where(d < HALF, 1.0, -1.0)
    cs = tl.load(cos_ptr + pos * HALF + d % HALF).to(tl.float32)
    sn = tl.load(sin_ptr + pos * HALF + d % HALF).to(tl.float32)
    GROUP: tl.constexpr = H // HKV
    for u in range(pid, H * nch, nprog):
        h = u // nch
        c = u % nch
        g = h // GROUP
        head_k = kc + g * T_CACHE * D
        head_v = vc + g * T_CACHE * D
        j0 = lo + c * chunk
        j1 = tl.minimum(j0 + chunk, pos + 1)
        keys = j0 + tl.arange(0, BKEY)
        if u == pid:  # the block _attn_prefetch loaded before the barrier
            kt, vt = kt0, vt0
        else:  # issued before the q/k/v math below, so their latencies overlap
            kt, vt = _kv_block(head_k, head_v, keys, tl.minimum(j1, pos), d, D)
        q = _rotary_norm(qkv_ptr + h * D, d, partner, sign, cs, sn, eps, D) * sm_scale
        k_new = _rotary_norm(qkv_ptr + (H + g) * D, d, partner, sign, cs, sn, eps, D)
        v_new = tl.load(qkv_ptr + (H + HKV + g) * D + d, cache_modifier=".cg")
        if has_ve != 0:
            gate = tl.load(gate_ptr + g, cache_modifier=".cg")
            v_new += gate * tl.load(ve + tok * (HKV * D) + g * D + d).to(tl.float32)
        k_new = k_new.to(cty).to(tl.float32)  # what the cache holds for later steps
        v_new = v_new.to(cty).to(tl.float32)
        if (c == 0) & (h % GROUP == 0):
            tl.store(head_k + pos * D + d, k_new.to(cty))
            tl.store(head_v + pos * D + d, v_new.to(cty))
        s_new = tl.sum(q * k_new, 0)
        m_i, l_i, acc = _attend(kt, vt, keys, j1, pos, q, s_new, v_new, tl.full([], float("-inf"), tl.float32),
                                tl.zeros([], tl.float32), tl.zeros([D], tl.float32))
        for j in range(j0 + BKEY, j1, BKEY):
            keys = j + tl.arange(0, BKEY)
            kt, vt = _kv_block(head_k, head_v, keys, tl.minimum(j1, pos), d, D)
            m_i, l_i, acc = _attend(kt, vt, keys, j1, pos, q, s_new, v_new, m_i, l_i, acc)
        slot = part_ptr + (h * NCH + c) * (D + 2)
        tl.store(slot + d, acc)
        tl.store(slot + D, m_i)
        tl.store(slot + D + 1, l_i)
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + h, 1, sem="acq_rel", scope="gpu")
        if done == nch - 1:  # the head's last chunk: merge its partial softmaxes
            tl.atomic_xchg(count_ptr + h, 0, sem="relaxed", scope="gpu")
            ci = tl.arange(0, NCH_P2)
            rows = part_ptr + (h * NCH + ci) * (D + 2)
            m_c = tl.load(rows + D, mask=ci < nch, other=float("-inf"), cache_modifier=".cg")
            l_c = tl.load(rows + D + 1, mask=ci < nch, other=0.0, cache_modifier=".cg")
            wgt = tl.exp(m_c - tl.max(m_c, 0))
            a_c = tl.load(rows[:, None] + d[None, :], mask=(ci < nch)[:, None], other=0.0, cache_modifier=".cg")
            y = tl.sum(wgt[:, None] * a_c, 0) / tl.sum(wgt * l_c, 0)
            tl.store(y_ptr + h * D + d, y)


@triton.jit
def _qkv_phase(layer, table, resid, lam_ptr, mu_ptr, qkv_ptr, gate_ptr, eps, pid, nprog, wty: tl.constexpr,
               C: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, GATE: tl.constexpr,
               HKV_P2: tl.constexpr, BN_Q: tl.constexpr, BK_C: tl.constexpr, UNROLL: tl.constexpr):
    r = resid + 2 * layer * C
    lam = tl.load(lam_ptr + layer).to(tl.float32)
    mu = tl.load(mu_ptr + layer).to(tl.float32)
    rstd = _rstd(r, resid, lam, mu, C, eps, True, BK_C)
    _gemv(_layer_ptr(table, layer, P_QKV, wty), (H + 2 * HKV) * D, C, r, resid, lam, mu, rstd, qkv_ptr,
          r, r, 0.0, 0.0, 0.0, pid, nprog, True, 0, BN_Q, BK_C, UNROLL)
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
def _proj_phase(layer, table, resid, lam_ptr, mu_ptr, y_ptr, pid, nprog, wty: tl.constexpr, C: tl.constexpr,
                H: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK_C: tl.constexpr, UNROLL: tl.constexpr):
    lam = tl.load(lam_ptr + layer).to(tl.float32)
    mu = tl.load(mu_ptr + layer).to(tl.float32)
    r = resid + 2 * layer * C
    _gemv(_layer_ptr(table, layer, P_WO, wty), C, H * D, y_ptr, y_ptr, 1.0, 0.0, 1.0, r + C,
          r, resid, lam, mu, 0.0, pid, nprog, False, 1, BN, BK_C, UNROLL)


@triton.jit
def _fc_phase(layer, table, resid, hid_ptr, eps, pid, nprog, wty: tl.constexpr, C: tl.constexpr,
              F: tl.constexpr, BN_FC: tl.constexpr, BK_C: tl.constexpr, UNROLL: tl.constexpr):
    r_mid = resid + (2 * layer + 1) * C
    rstd = _rstd(r_mid, r_mid, 1.0, 0.0, C, eps, False, BK_C)
    _gemv(_layer_ptr(table, layer, P_FC, wty), F, C, r_mid, r_mid, 1.0, 0.0, rstd, hid_ptr,
          r_mid, r_mid, 0.0, 0.0, 0.0, pid, nprog, False, 2, BN_FC, BK_C, UNROLL)


@triton.jit
def _proj2_phase(layer, table, resid, hid_ptr, pid, nprog, wty: tl.constexpr, C: tl.constexpr,
                 F: tl.constexpr, BN: tl.constexpr, BK_F: tl.constexpr, UNROLL: tl.constexpr):
    r_mid = resid + (2 * layer + 1) * C
    _gemv(_layer_ptr(table, layer, P_P2, wty), C, F, hid_ptr, hid_ptr, 1.0, 0.0, 1.0, r_mid + C,
          r_mid, r_mid, 1.0, 0.0, 0.0, pid, nprog, False, 1, BN, BK_F, UNROLL)


@triton.jit
def _head_phase(head_ptr, r_last, logits_ptr, V, softcap, eps, pid, nprog, C: tl.constexpr,
                BN: tl.constexpr, BK_C: tl.constexpr, UNROLL: tl.constexpr):
    rstd = _rstd(r_last, r_last, 1.0, 0.0, C, eps, False, BK_C)
    _gemv(head_ptr, V, C, r_last, r_last, 1.0, 0.0, rstd, logits_ptr, r_last, r_last, 0.0, 0.0,
          softcap, pid, nprog, False, 3, BN, BK_C, UNROLL)


@triton.jit
def _decode_step_kernel(
        tok_ptr, pos_ptr, wte_ptr, head_ptr, cos_ptr, sin_ptr, lam_ptr, mu_ptr, table, windows_ptr,
        resid, qkv_ptr, gate_ptr, part_ptr, count_ptr, y_ptr, hid_ptr, bar_ptr, logits_ptr, trace_ptr,
        layer_arg, L, V, T_CACHE, softcap, eps, sm_scale,
        C: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
        GATE: tl.constexpr, HKV_P2: tl.constexpr, NCH: tl.constexpr, NCH_P2: tl.constexpr,
        PHASE: tl.constexpr, BN: tl.constexpr, BN_Q: tl.constexpr, BN_FC: tl.constexpr, BK_C: tl.constexpr,
        BK_F: tl.constexpr,
        BKEY: tl.constexpr, P_P2: tl.constexpr, UNROLL: tl.constexpr,
        TRACE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wty: tl.constexpr = wte_ptr.dtype.element_ty
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
    if PHASE < 0:
        _grid_sync(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, P_P2, TRACE)
        for layer in range(L):
            _qkv_phase(layer, table, resid, lam_ptr, mu_ptr, qkv_ptr, gate_ptr, eps, pid, nprog, wty,
                       C, H, HKV, D, GATE, HKV_P2, BN_Q, BK_C, UNROLL)
            kc = _layer_ptr(table, layer, P_KC, wty)
            vc = _layer_ptr(table, layer, P_VC, wty)
            window = tl.load(windows_ptr + layer)
            epoch += 1
            _arrive(bar_ptr, epoch, pid)
            kt0, vt0 = _attn_prefetch(kc, vc, pos, window, T_CACHE, pid, H, HKV, D, NCH, BKEY)
            _wait(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, P_P2, TRACE)
            _attention_phase(qkv_ptr, gate_ptr, kc, vc, _layer_ptr(table, layer, P_VE, wty),
                             tl.load(table + layer * N_PTRS + P_VE), tok, pos, window, T_CACHE, cos_ptr, sin_ptr,
                             part_ptr, count_ptr, y_ptr, eps, sm_scale, pid, nprog, kt0, vt0,
                             H, HKV, D, NCH, NCH_P2, BKEY)
            epoch += 1
            _grid_sync(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, P_P2, TRACE)
            _proj_phase(layer, table, resid, lam_ptr, mu_ptr, y_ptr, pid, nprog, wty, C, H, D, BN, BK_C, UNROLL)
            epoch += 1
            _grid_sync(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, P_P2, TRACE)
            _fc_phase(layer, table, resid, hid_ptr, eps, pid, nprog, wty, C, F, BN_FC, BK_C, UNROLL)
            epoch += 1
            _grid_sync(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, P_P2, TRACE)
            _proj2_phase(layer, table, resid, hid_ptr, pid, nprog, wty, C, F, BN, BK_F, UNROLL)
            epoch += 1
            _grid_sync(bar_ptr, epoch, pid, nprog, trace_ptr, epoch - base, P_P2, TRACE)
        _head_phase(head_ptr, resid + 2 * L * C, logits_ptr, V, softcap, eps, pid, nprog, C, BN, BK_C, UNROLL)
        if TRACE:
            tl.debug_barrier()
            if pid == 0:  # program 0's own lm_head share done (no barrier follows)
                tl.store(trace_ptr + epoch - base + 1, _globaltimer())
    elif PHASE == 1:
        _qkv_phase(layer_arg, table, resid, lam_ptr, mu_ptr, qkv_ptr, gate_ptr, eps, pid, nprog, wty,
                   C, H, HKV, D, GATE, HKV_P2, BN_Q, BK_C, UNROLL)
    elif PHASE == 2:
        kc = _layer_ptr(table, layer_arg, P_KC, wty)
        vc = _layer_ptr(table, layer_arg, P_VC, wty)
        window = tl.load(windows_ptr + layer_arg)
        kt0, vt0 = _attn_prefetch(kc, vc, pos, window, T_CACHE, pid, H, HKV, D, NCH, BKEY)
        _attention_phase(qkv_ptr, gate_ptr, kc, vc, _layer_ptr(table, layer_arg, P_VE, wty),
                         tl.load(table + layer_arg * N_PTRS + P_VE), tok, pos, window, T_CACHE, cos_ptr, sin_ptr,
                         part_ptr, count_ptr, y_ptr, eps, sm_scale, pid, nprog, kt0, vt0, H, HKV, D, NCH, NCH_P2,
                         BKEY)
    elif PHASE == 3:
        _proj_phase(layer_arg, table, resid, lam_ptr, mu_ptr, y_ptr, pid, nprog, wty, C, H, D, BN, BK_C, UNROLL)
    elif PHASE == 4:
        _fc_phase(layer_arg, table, resid, hid_ptr, eps, pid, nprog, wty, C, F, BN_FC, BK_C, UNROLL)
    elif PHASE == 5:
        _proj2_phase(layer_arg, table, resid, hid_ptr, pid, nprog, wty, C, F, BN, BK_F, UNROLL)
    elif PHASE == 6:
        _head_phase(head_ptr, resid + 2 * L * C, logits_ptr, V, softcap, eps, pid, nprog, C, BN, BK_C, UNROLL)


# ----------------------------------------------------------------------------------------------
# Host side


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unsupported(model, cache) -> str | None:
    """Why `PersistentDecodeStep(model, cache)` cannot run, or None. Needs: batch 1; the model's
    matrices as plain gpt.Linear weights (not precision.py's fp8/nvfp4 modules) stored in one
    dtype (bf16, fp16 or fp32) that the cache also uses; a power-of-two head_dim >= 16; a CUDA
    device of compute capability >= 8, or the Triton interpreter."""
    from nanochat.gpt import GPT, Linear

    if not isinstance(model, GPT):
        return f"{type(model).__name__} is not a nanochat GPT"
    if cache.batch_size != 1:
        return f"batch {cache.batch_size} (the persistent step decodes one row)"
    dtype = model.wte.weight.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weights in {dtype}"
    linears = [model.lm_head] + [m for b in model.blocks for m in (b.attn.c_q, b.attn.c_k, b.attn.c_v,
                                                                    b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)]
    if any(type(m) is not Linear for m in linears):
        return "precision.py swapped the Linear layers (fp8/nvfp4); the step reads plain weights"
    tensors = [m.weight for m in linears] + [e.weight for e in model.value_embeds.values()]
    if any(t.dtype != dtype for t in tensors) or cache.k[0].dtype != dtype:
        return (f"weights and KV cache must share one dtype (wte {dtype}, cache {cache.k[0].dtype}); "
                "load the model in its compute dtype (inference keeps no fp32 master copy)")
    D = model.config.head_dim
    if D < 16 or D & (D - 1):
        return f"head_dim {D} (needs a power of two >= 16)"
    device = cache.k[0].device
    if _interpreted():
        return None if device.type == "cpu" else "TRITON_INTERPRET=1 runs CPU tensors only"
    if device.type != "cuda":
        return f"needs a CUDA GPU (the cache is on {device.type})"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 8.0"
    return None


class PersistentDecodeStep:
    """step(ids (1, 1) long, kv_cache=StaticKV) -> logits (1, 1, vocab) float32 (its own buffer,
    overwritten by the next call): the model's one-token forward over `cache`, as one kernel.

    A drop-in `step_model` for nanochat/decode.py's StaticDecoder (batch 1). Build it inside
    `model.inference_weights()` (it reads the concatenated q/k/v copy made there); it holds the
    addresses of the weights, the cache and its scratch, so like a CUDA graph it must not outlive
    them, and weights must be updated in place. It reads only the visible keys (pos and the
    window), whatever the StaticKV's length bucket is. Tuning (defaults measured best on the H100
    with scripts/bench_decode_kernel.py; powers of two but `unroll`): `block_rows` x `block_k`
    (`block_k_mlp` for the K = 4C product) weight tile per GEMV step, `block_rows_qkv` and
    `block_rows_fc` for those two products (None: `block_rows`), `unroll` K chunks issued before
    the first is used, `num_warps` per program, `key_block` keys per attention step,
    `programs_per_sm`. `trace=True` records when each barrier opened (`phase_times()`)."""

    def __init__(self, model, cache, *, programs: int | None = None, block_rows: int = 16, block_k: int = 512,
                 block_k_mlp: int = 512, num_warps: int = 8, key_block: int = 64, unroll: int = 10,
                 block_rows_qkv: int | None = 32, block_rows_fc: int | None = None,
                 programs_per_sm: int = 1, trace: bool = False):
        block_rows_qkv = block_rows if block_rows_qkv is None else block_rows_qkv
        block_rows_fc = block_rows if block_rows_fc is None else block_rows_fc
        for name, value in (("block_rows", block_rows), ("block_k", block_k), ("block_k_mlp", block_k_mlp),
                            ("num_warps", num_warps), ("key_block", key_block), ("block_rows_qkv", block_rows_qkv),
                            ("block_rows_fc", block_rows_fc)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"persistent decode step {name}: got {value}; accepted: a power of two")
        if unroll < 1:
            raise ValueError(f"persistent decode step unroll: got {unroll}; accepted: an integer >= 1")
        reason = unsupported(model, cache)
        if reason is not None:
            raise ValueError(f"persistent decode step: {reason}")
        if any(b.attn.qkv_weight is None for b in model.blocks):
            raise ValueError("persistent decode step: build it inside model.inference_weights() "
                             "(it reads the fused q/k/v weights made there)")
        cfg, dev = model.config, cache.k[0].device
        self.model, self.cache, self.config = model, cache, cfg
        if programs is None:
            sms = 4 if dev.type == "cpu" else torch.cuda.get_device_properties(dev).multi_processor_count
            programs = programs_per_sm * sms
        if programs < 1:
            raise ValueError(f"programs: got {programs}; accepted: an integer >= 1")
        self.programs = programs
        self._table = self._pointer_table(model, cache)
        self._windows = torch.tensor([w or 0 for w in model.windows], dtype=torch.int32, device=dev)
        self._alloc_scratch(cfg, dev)
        C, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        p2 = triton.next_power_of_2
        self._meta = dict(C=C, H=H, HKV=Hkv, D=D, F=4 * C, GATE=min(32, C), HKV_P2=p2(Hkv), NCH=self._nch,
                          NCH_P2=p2(self._nch), BN=block_rows, BN_Q=block_rows_qkv, BN_FC=block_rows_fc,
                          BK_C=block_k, BK_F=block_k_mlp, BKEY=key_block, P_P2=p2(programs), UNROLL=unroll,
                          TRACE=trace, num_warps=num_warps)

    @staticmethod
    def _pointer_table(model, cache) -> torch.Tensor:
        """(n_layer, N_PTRS) int64 addresses: fused q/k/v, attention c_proj, c_fc, MLP c_proj, the
        layer's k and v cache (row 0), its value-embedding table and gate weight (0 if none)."""
        rows = []
        for i, b in enumerate(model.blocks):
            ve = model.value_embeds[str(i)].weight if str(i) in model.value_embeds else None
            gate = b.attn.ve_gate.weight if b.attn.ve_gate is not None else None
            tensors = (b.attn.qkv_weight, b.attn.c_proj.weight, b.mlp.c_fc.weight, b.mlp.c_proj.weight,
                       cache.k[i][0], cache.v[i][0], ve, gate)
            assert all(t is None or t.is_contiguous() for t in tensors), "persistent step needs contiguous tensors"
            rows.append([0 if t is None else t.data_ptr() for t in tensors])
            if any(a % 16 for a in rows[-1]):  # the kernel's loads assume it (_layer_ptr)
                raise ValueError(f"persistent decode step: layer {i} has a weight or cache tensor not aligned "
                                 "to 16 bytes (a view into another tensor?); give it its own storage")
        assert len(rows[0]) == N_PTRS.value
        return torch.tensor(rows, dtype=torch.int64, device=cache.k[0].device)

    def _alloc_scratch(self, cfg, dev) -> None:
        """The step's float32 working set (a few hundred KB at d20) and its barrier flags."""
        f32 = dict(dtype=torch.float32, device=dev)
        C, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self._nch = max(1, self.programs // H)  # key chunks per head in the attention phase
        self._resid = torch.zeros((2 * cfg.n_layer + 1) * C, **f32)
        self._qkv = torch.zeros((H + 2 * Hkv) * D, **f32)
        self._gate = torch.zeros(Hkv, **f32)
        self._part = torch.zeros(H * self._nch * (D + 2), **f32)
        self._count = torch.zeros(H, dtype=torch.int32, device=dev)
        self._y = torch.zeros(H * D, **f32)
        self._hidden = torch.zeros(4 * C, **f32)
        self._barrier = torch.zeros(self.programs, dtype=torch.int64, device=dev)  # grid-barrier flags
        self._trace = torch.zeros(5 * cfg.n_layer + 3, dtype=torch.int64, device=dev)  # trace=True
        self.logits = torch.zeros(cfg.vocab_size, **f32)
        self._resident_checked, self.registers = False, None

    def __call__(self, ids: torch.Tensor, kv_cache=None) -> torch.Tensor:
        if kv_cache is None or kv_cache.k is not self.cache.k:
            raise ValueError("persistent decode step: pass the StaticKV of the cache it was built for")
        if ids.shape != (1, 1):
            raise ValueError(f"persistent decode step: ids must be (1, 1), got {tuple(ids.shape)}")
        self.launch(ids, kv_cache.pos)
        return self.logits.view(1, 1, -1)

    def phase_times(self) -> dict:
        """Microseconds of each phase kind in the last launch (built with trace=True), summed over
        layers: from the barrier that opened it to the one that closed it, so a phase's time
        includes its closing barrier (program 0's clock, %globaltimer)."""
        assert self._meta["TRACE"], "phase_times needs PersistentDecodeStep(..., trace=True)"
        t = self._trace.tolist()
        d = [(b - a) / 1e3 for a, b in zip(t, t[1:])]
        L = self.config.n_layer
        names = ("qkv", "attention", "proj", "fc", "proj2")
        out = {"x0": d[0]} | {n: sum(d[1 + 5 * i + j] for i in range(L)) for j, n in enumerate(names)}
        return out | {"lm_head": d[-1], "total": (t[-1] - t[0]) / 1e3}

    def _check_resident(self, args, scalars) -> None:
        """Compile the kernel and prove the whole grid fits on the GPU at once (the barriers wait
        for every program: a program left waiting for a free SM would hang the step)."""
        kernel = _decode_step_kernel.warmup(*args, layer_arg=0, **scalars, PHASE=-1, grid=(self.programs,),
                                            **self._meta)
        kernel._init_handles()
        props = torch.cuda.get_device_properties(self.cache.k[0].device)
        warps = self._meta["num_warps"]
        regs_per_warp = -(-kernel.n_regs * 32 // 256) * 256  # allocated in 256-register units
        fits = min(props.regs_per_multiprocessor // max(1, regs_per_warp * warps),
                   props.max_threads_per_multi_processor // (32 * warps),
                   props.shared_memory_per_multiprocessor // max(1, kernel.metadata.shared))
        if fits * props.multi_processor_count < self.programs:
            raise ValueError(f"persistent decode step: {self.programs} programs of {warps} warps "
                             f"({kernel.n_regs} registers/thread, {kernel.metadata.shared} B shared) "
                             f"do not fit at once on {props.multi_processor_count} SMs ({fits} per SM); "
                             "lower programs_per_sm or num_warps")
        self.registers = kernel.n_regs
        self._resident_checked = True

    def launch(self, ids: torch.Tensor, pos: torch.Tensor) -> None:
        m, cfg = self.model, self.config
        args = (ids, pos, m.wte.weight, m.lm_head.weight, m.cos, m.sin, m.resid_lambdas, m.x0_lambdas,
                self._table, self._windows, self._resid, self._qkv, self._gate, self._part, self._count,
                self._y, self._hidden, self._barrier, self.logits, self._trace)
        scalars = dict(L=cfg.n_layer, V=cfg.vocab_size, T_CACHE=self.cache.seq_len, softcap=float(cfg.softcap),
                       eps=torch.finfo(torch.float32).eps, sm_scale=cfg.head_dim ** -0.5)
        grid = (self.programs,)
        if not _interpreted():
            if not self._resident_checked:
                self._check_resident(args, scalars)
            _decode_step_kernel[grid](*args, layer_arg=0, **scalars, PHASE=-1, **self._meta)
            return
        # Interpreter: programs run in turn, so each phase is its own launch (module docstring).
        _decode_step_kernel[grid](*args, layer_arg=0, **scalars, PHASE=0, **self._meta)
        for layer in range(cfg.n_layer):
            for phase in range(1, 6):
                _decode_step_kernel[grid](*args, layer_arg=layer, **scalars, PHASE=phase, **self._meta)
        _decode_step_kernel[grid](*args, layer_arg=0, **scalars, PHASE=6, **self._meta)
