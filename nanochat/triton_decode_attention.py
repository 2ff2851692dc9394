"""The attention phase of the persistent batch-1 decode kernel (nanochat/triton_decode_kernels.py):
RoPE + QK-norm of the step's q and k, the new k/v written into the cache, online softmax over
(head, key chunk) units, and the per-head merge of the chunks' partial softmaxes."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotary_norm(x, xp, sign, cs, sn, eps, D: tl.constexpr):
    """norm(rotate(x)) of one head's float32 vector x (xp: x at the partner index):
    (x1, x2) -> (x1 c + x2 s, x2 c - x1 s)."""
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
        # Every load of the unit goes out before the first reduction: a load after a cross-warp
        # reduction (a bar.sync, which loads do not cross) would wait for it, one more L2 round
        # trip each for k, v and the value embedding.
        qx = tl.load(qkv_ptr + h * D + d, cache_modifier=".cg")
        qp = tl.load(qkv_ptr + h * D + partner, cache_modifier=".cg")
        kx = tl.load(qkv_ptr + (H + g) * D + d, cache_modifier=".cg")
        kp = tl.load(qkv_ptr + (H + g) * D + partner, cache_modifier=".cg")
        v_new = tl.load(qkv_ptr + (H + HKV + g) * D + d, cache_modifier=".cg")
        gate = tl.load(gate_ptr + g, cache_modifier=".cg")  # scratch: used only with value embeddings
        ve_d = d < tl.where(has_ve != 0, D, 0)  # a (D,) mask: no table, nothing read
        ve_row = tl.load(ve + tok * (HKV * D) + g * D + d, mask=ve_d, other=0.0).to(tl.float32)
        q = _rotary_norm(qx, qp, sign, cs, sn, eps, D) * sm_scale
        k_new = _rotary_norm(kx, kp, sign, cs, sn, eps, D)
        if has_ve != 0:
            v_new += gate * ve_row
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
