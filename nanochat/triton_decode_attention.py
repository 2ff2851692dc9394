"""The attention phase of the persistent batch-1 decode kernel (nanochat/triton_decode_kernels.py):
RoPE + QK-norm of the step's q and k, the new k/v written into the cache, and the softmax sums
of (head, key chunk) units, added into the head's numerator and denominator.

No running maximum: QK-norm bounds every score. After the norm |q| = |k| <= sqrt(D) (rms <= 1),
so |q . k| * sm_scale <= D * sm_scale = `shift`, and p = exp(s - shift) lies in
[exp(-2 shift), ~1]: with D <= 1024 (shift <= 32, checked on the host) no p overflows or
underflows in float32. So a key block costs two key-axis reductions (sum p, sum p v) instead of
four (max, sum p, sum p v, the new key's weight), and the chunks of a head combine by plain sums:
each unit adds its sum p v and sum p into y_num / y_den with float64 atomics, and the proj phase
reads y = y_num / y_den. That drops the per-head atomic counter and the last unit's merge (two
L2 round trips before the barrier; d20 on the H100: attention 135 -> 105-113 us per step). Why
float64: a head's partials are float32 and at most NCH (~13) of them, so their float64 sum is
exact, hence the same in whatever order the atomics land, unless their magnitudes span more
than ~2^25 (then it differs in float64's last bit, below float32's). 300 launches gave identical
logits; with float32 atomics 278 of 300 differed (up to 0.2% of the largest logit)."""

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
def _attend(kt, vt, keys, lim, q, shift, l_i, acc):
    """A key block's terms added to the unit's sums: p = exp(q . k - shift) of the cached keys
    < lim (the new key's term comes from registers, _attention_phase). No running maximum:
    QK-norm bounds every score (module docstring)."""
    s = tl.sum(kt.to(tl.float32) * q[None, :], 1)
    p = tl.where(keys < lim, tl.exp(s - shift), 0.0)
    return l_i + tl.sum(p, 0), acc + tl.sum(p[:, None] * vt.to(tl.float32), 0)


@triton.jit
def _attention_phase(qkv_ptr, gate_ptr, kc, vc, ve, has_ve, tok, pos, window, T_CACHE, cos_ptr, sin_ptr,
                     ynum_ptr, yden_ptr, eps, sm_scale, pid, nprog, kt0, vt0,
                     H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, NCH: tl.constexpr, BKEY: tl.constexpr):
    """Every unit adds its chunk's sum p v into y_num[h] (D values) and sum p into y_den[h]
    (float64 atomics; both zeroed by the q/k/v phase; module docstring)."""
    cty = kc.dtype.element_ty
    lo, chunk, nch = _attn_split(pos, window, NCH, BKEY)
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, D)
    partner = (d + HALF) % D
    sign = tl.where(d < HALF, 1.0, -1.0)
    cs = tl.load(cos_ptr + pos * HALF + d % HALF).to(tl.float32)
    sn = tl.load(sin_ptr + pos * HALF + d % HALF).to(tl.float32)
    shift = D * sm_scale  # the largest possible score (module docstring)
    GROUP: tl.constexpr = H // HKV
    for u in range(pid, H * nch, nprog):
        h = u // nch
        c = u % nch
        g = h // GROUP
        head_k = kc + g * T_CACHE * D
        head_v = vc + g * T_CACHE * D
        j0 = lo + c * chunk
        j1 = tl.minimum(j0 + chunk, pos + 1)
        lim = tl.minimum(j1, pos)  # cached keys of the unit; key pos is this step's, in registers
        keys = j0 + tl.arange(0, BKEY)
        if u == pid:  # the block _attn_prefetch loaded before the barrier
            kt, vt = kt0, vt0
        else:  # issued before the q/k/v math below, so their latencies overlap
            kt, vt = _kv_block(head_k, head_v, keys, lim, d, D)
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
        p_new = tl.where(pos < j1, tl.exp(tl.sum(q * k_new, 0) - shift), 0.0)  # the unit holding key pos
        l_i, acc = _attend(kt, vt, keys, lim, q, shift, p_new, p_new * v_new)
        for j in range(j0 + BKEY, j1, BKEY):
            keys = j + tl.arange(0, BKEY)
            kt, vt = _kv_block(head_k, head_v, keys, lim, d, D)
            l_i, acc = _attend(kt, vt, keys, lim, q, shift, l_i, acc)
        tl.atomic_add(ynum_ptr + h * D + d, acc.to(tl.float64), sem="relaxed", scope="gpu")
        tl.atomic_add(yden_ptr + h, l_i.to(tl.float64), sem="relaxed", scope="gpu")
