"""sampling.sample_next's distribution as one Triton kernel launch per decode step (CUDA).

One program per row holds the whole row in registers (vocabularies up to MAX_TRITON_VOCAB at
SAMPLE_WARPS warps; ptxas on sm_90: 64 registers, ~40 bytes of spills). The top-k and top-p
cut-offs are found by a 5-way search over the bits of the values (_kth_key, _nucleus_cut: four
counts or sums per reduction, ~14 rounds) instead of a sort, and the draw is the exponential
race argmax p_i / E_i with E_i = -log(1 - u_i), u_i a hash of (seed, position, row, token). So
the draw depends only on (seed, position, logits): a step re-run at the same position draws the
same token, whatever ran before.

H100, V = 32768, batch 1, GPU time per call (scripts/bench_sampler.py): temperature only 13.6 us,
top-k 50 39 us, top-k 50 + top-p 0.9 82 us, where the torch sampler runs ~8 kernels (~150 us
for top-k 50 back to back). One SM does all of a row's work: splitting a row over programs is
the next step.
Ties: top-k keeps every logit equal to the k-th largest, as sample_next does; top-p decides by a
cut-off value, so tokens of equal probability are kept or dropped together (sample_next breaks
such ties by sort order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TRITON_VOCAB = 32768  # a row lives in registers: 32 float32 per thread at SAMPLE_WARPS
SAMPLE_WARPS = 32


@triton.jit
def _ordered_key(x):
    """float32 -> int32 with the same order (negative floats: magnitude bits flipped); its own
    inverse up to the bitcast, so a row can be held as keys alone (_key_value)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _key_value(key):
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _mix32(x):
    """A bijective 32-bit integer hash with full avalanche (C. Wellons' "lowbias32",
    https://nullprogram.com/blog/2018/07/31/); Philox (tl.rand) spilled registers here, with a
    whole row per program."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _cuts(lo, hi):
    """Four cut points splitting (lo, hi) into five near-equal parts (hi - lo >= 2: the last one is
    > lo, so every round narrows the bracket)."""
    w = hi - lo
    return lo + w // 5, lo + 2 * w // 5, lo + 3 * w // 5, lo + 4 * w // 5


@triton.jit
def _pick_lo(ok0, ok1, ok2, ok3, c0, c1, c2, c3, lo):
    """The largest cut whose test holds (tests hold for a prefix of the cuts), else lo."""
    return tl.where(ok3, c3, tl.where(ok2, c2, tl.where(ok1, c1, tl.where(ok0, c0, lo))))


@triton.jit
def _pick_hi(ok0, ok1, ok2, ok3, c0, c1, c2, c3, hi):
    """The smallest cut whose test fails, else hi."""
    return tl.where(~ok0, c0, tl.where(~ok1, c1, tl.where(~ok2, c2, tl.where(~ok3, c3, hi))))


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit
def _kth_key(key, k):
    """The k-th largest `key` (padding holds INT32_MIN, below every float's key), or a key that
    keeps exactly the same k tokens: a 5-way search over the key range for the largest t with
    count(key >= t) >= k. A round costs one reduction, whose latency (barriers across the
    program's warps) dominates, so each counts four cuts at once, packed as 16-bit fields of one
    int64 (V <= 32768 < 2^16), and the search stops as soon as a cut keeps exactly k."""
    lo = tl.min(tl.where(key == -2147483648, 2147483647, key), 0).to(tl.int64)  # count(key >= lo) >= k
    hi = tl.max(key, 0).to(tl.int64) + 1                                         # count(key >= hi) = 0 < k
    while hi - lo > 1:
        c0, c1, c2, c3 = _cuts(lo, hi)
        packed = ((key >= c0.to(tl.int32)).to(tl.int64) | ((key >= c1.to(tl.int32)).to(tl.int64) << 16)
                  | ((key >= c2.to(tl.int32)).to(tl.int64) << 32) | ((key >= c3.to(tl.int32)).to(tl.int64) << 48))
        n = tl.sum(packed, 0)
        n0, n1, n2, n3 = n & 0xFFFF, (n >> 16) & 0xFFFF, (n >> 32) & 0xFFFF, (n >> 48) & 0xFFFF
        lo_new = _pick_lo(n0 >= k, n1 >= k, n2 >= k, n3 >= k, c0, c1, c2, c3, lo)
        hi = _pick_hi(n0 >= k, n1 >= k, n2 >= k, n3 >= k, c0, c1, c2, c3, hi)
        n_lo = tl.where(lo_new == c3, n3, tl.where(lo_new == c2, n2, tl.where(lo_new == c1, n1, n0)))
        hi = tl.where((lo_new != lo) & (n_lo == k), lo_new + 1, hi)  # exactly k at or above it: done
        lo = lo_new
    return lo.to(tl.int32)


@triton.jit
def _nucleus_cut(p, target):
    """p with the tokens outside the nucleus zeroed: keeps bits(p) >= t for the smallest float bit
    pattern t with sum(p where bits(p) > t) < target, i.e. exactly the tokens whose higher-ranked
    mass is below target. p is in [0, 1] (its int32 bits order like its values) and target > 0,
    so t = bits(1.0) always qualifies. 5-way search as in _kth_key, four sums per reduction."""
    bits = p.to(tl.int32, bitcast=True)
    lo = tl.full([], -1, tl.int64)          # the sum over bits > -1 is everything, >= target
    hi = tl.full([], 0x3F800000, tl.int64)  # bits of 1.0: nothing is above it
    while hi - lo > 1:
        c0, c1, c2, c3 = _cuts(lo, hi)  # int64: 4 (hi - lo) overflows int32
        s0, s1, s2, s3 = tl.reduce((tl.where(bits > c0.to(tl.int32), p, 0.0), tl.where(bits > c1.to(tl.int32), p, 0.0),
                                    tl.where(bits > c2.to(tl.int32), p, 0.0), tl.where(bits > c3.to(tl.int32), p, 0.0)),
                                   0, _add4)
        lo_new = _pick_lo(s0 >= target, s1 >= target, s2 >= target, s3 >= target, c0, c1, c2, c3, lo)
        hi = _pick_hi(s0 >= target, s1 >= target, s2 >= target, s3 >= target, c0, c1, c2, c3, hi)
        lo = lo_new
    return tl.where(bits >= hi.to(tl.int32), p, 0.0)


@triton.jit(do_not_specialize=["top_k", "seed_lo", "seed_hi", "position"])
def _sample_kernel(logits_ptr, stride, out_ptr, keep_ptr, V, inv_temp, top_k, top_p, seed_lo, seed_hi, position,
                   VP2: tl.constexpr, KEEP: tl.constexpr):
    # Registers bound the row size, so only one (VP2,) tensor is live at a time: the logits as
    # keys through the top-k bisection, then the probabilities.
    row = tl.program_id(0)
    j = tl.arange(0, VP2)
    logit = tl.load(logits_ptr + row * stride + j, mask=j < V, other=float("-inf")).to(tl.float32)
    key = tl.where(j < V, _ordered_key(logit), -2147483648)
    top = tl.max(logit, 0)
    if top_k < V:
        key = tl.where(key >= _kth_key(key, top_k), key, -2147483648)
    p = tl.where(key != -2147483648, tl.exp((_key_value(key) - top) * inv_temp), 0.0)  # the max has p = 1
    if top_p < 1.0:
        p = _nucleus_cut(p, top_p * tl.sum(p, 0))
    if KEEP:  # tests: which tokens can be drawn
        tl.store(keep_ptr + row * V + j, (p > 0.0).to(tl.int8), mask=j < V)
    # Noise: a hash of (seed, position, row, token) -> uniform u in [0, 1) with 24 bits
    k = _mix32(seed_lo.to(tl.uint32) ^ _mix32(seed_hi.to(tl.uint32) ^ _mix32(position.to(tl.uint32))))
    h = _mix32(_mix32((row * V + tl.arange(0, VP2)).to(tl.uint32) ^ k))
    u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    e = tl.maximum(-tl.log(1.0 - u), 1.1754944e-38)   # Exp(1); E > 0 so 0 / E stays 0
    tl.store(out_ptr + row, tl.argmax(p / e, 0).to(tl.int64))


def sample_triton(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                  seed: int, position: int, keep_out: torch.Tensor | None = None) -> torch.Tensor:
    """sample_next's distribution as one Triton launch: one token per row of `logits` (B, V) as a
    (B,) long tensor. The draw is a function of (seed, position, row, logits): a step re-run at
    the same position draws the same tokens. `keep_out` (B, V) int8, for tests: 1 where a token
    could be drawn (inside top-k and top-p, probability > 0)."""
    B, V = logits.shape
    if V > MAX_TRITON_VOCAB:
        raise ValueError(f"sample_triton: vocabulary {V} > {MAX_TRITON_VOCAB} (a row must fit in registers); "
                         "use sample_next")
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    vp2 = triton.next_power_of_2(V)
    seed %= 1 << 62
    _sample_kernel[(B,)](logits, logits.stride(0), out, out if keep_out is None else keep_out, V,
                         1.0 / temperature, V if top_k is None else min(top_k, V), 1.0 if top_p is None else top_p,
                         seed & 0x7FFFFFFF, seed >> 31, position, VP2=vp2, KEEP=keep_out is not None,
                         num_warps=max(4, min(SAMPLE_WARPS, vp2 // 1024)))
    return out
