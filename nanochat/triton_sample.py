"""sampling.sample_next's distribution in Triton, two or three small launches per decode step (CUDA).

The one-program sampler (`_sample_kernel`): one program per row holds the whole row in registers
(vocabularies up to MAX_TRITON_VOCAB at SAMPLE_WARPS warps; ptxas on sm_90: 64 registers, ~40
bytes of spills). The top-k and top-p cut-offs are found by a 5-way search over the bits of the
values (_kth_key, _nucleus_cut: four counts or sums per reduction, ~14 rounds) instead of a
sort, and the draw is the exponential race argmax p_i / E_i with E_i = -log(1 - u_i), u_i a hash
of (seed, position, row, token) with 24 bits. So the draw depends only on (seed, position,
logits): a step re-run at the same position draws the same token, whatever ran before. Seeds: all
64 bits of a seed in 0..MAX_SEED enter the hash (`seed_halves`; it took seed % 2^62, so s and
s + 2^62 drew the same tokens). Per position the hash's key has 32 bits: two seeds may share one
step's noise, not a generation's. The bin u = 0 gives E its midpoint, not 0: the token that drew
E = 0 (1 in 2^24 per token and step: 0.2% of the steps at V = 32768) won whatever its
probability, so sampling without top-k drew a near-uniformly random token every ~500 steps. NaN
logits are read as -inf (never drawn), as sample_next does.

With top-k (1 <= k <= TWO_STAGE_MAX_K, the chat default is 50) one SM doing a whole row was the
cost (39 us of the ~750 us batch-1 d20 token on the H100), so the row is split (two_stage_plan):
  1. `_candidates_kernel`, one program per chunk of TWO_STAGE_CHUNK tokens: the chunk's tokens
     at or above its own k-th largest logit, in token order (-inf left out: never drawn). Every
     drawable token of the row's top-k is among them (the row's k-th largest is >= every
     chunk's), so the race over the candidates is the race over the row: same cut-offs, same
     noise per token, same order for argmax's ties, hence the same token as the one-program
     path (with top-p the sum of p is taken in another order, so a token right at the nucleus
     edge can differ in the last bit).
  2. `_candidates_sample_kernel`, one program per row: the race over the (chunks x slots)
     candidates.
  3. Ties at a chunk's k-th logit can leave more candidates than its slots; stage 2 then flags
     the row and `_sample_kernel` (launched with FLAGGED, a no-op for unflagged rows) draws it
     from the whole row, so the result is exact in every case.
Ties: top-k keeps every logit equal to the k-th largest, and top-p decides by a cut-off value, so
tokens of equal probability are kept or dropped together; sample_next does the same, so the two
samplers have one distribution (their noise differs: one seed, other tokens).
"""

from __future__ import annotations

from numbers import Integral

import torch
import triton
import triton.language as tl

from nanochat.sampling import MAX_SEED, greedy_tokens, is_greedy

MAX_TRITON_VOCAB = 32768  # a row lives in registers: 32 float32 per thread at SAMPLE_WARPS
SAMPLE_WARPS = 32
TWO_STAGE_CHUNK = 1024    # stage 1's tokens per program (32 programs per row at V = 32768)
TWO_STAGE_MAX_K = 256     # larger k: one program per row


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


@triton.jit
def _draw(key, tok, live, row, V, inv_temp, top_k, top_p, seed_lo, seed_hi, position, hash_row, keep_ptr,
          KEEP: tl.constexpr):
    """The race over the tokens `tok` whose ordered keys are `key` (INT32_MIN: not drawable):
    top-k (top_k < V), softmax at 1 / inv_temp, top-p, then argmax p / E. Returns the position
    of the winner in `key`. Only one key-sized float tensor is live at a time (registers)."""
    top_key = tl.max(key, 0)
    top = _key_value(top_key)
    if top_k < V:
        key = tl.where(key >= _kth_key(key, top_k), key, -2147483648)
    # the max has p = 1, by its key: a +inf logit (no softcap, an overflow) gave inf - inf = NaN, every
    # p NaN or 0, and token 0 was drawn where sample_next draws the +inf token
    shifted = tl.where(key == top_key, 0.0, _key_value(key) - top)
    p = tl.where(key != -2147483648, tl.exp(shifted * inv_temp), 0.0)
    if top_p < 1.0:
        p = _nucleus_cut(p, top_p * tl.sum(p, 0))
    if KEEP:  # tests: which tokens can be drawn
        tl.store(keep_ptr + row * V + tok, (p > 0.0).to(tl.int8), mask=live)
    # Noise: a hash of (seed, position, row, token) -> uniform u in [0, 1) with 24 bits
    k = _mix32(seed_lo.to(tl.uint32) ^ _mix32(seed_hi.to(tl.uint32) ^ _mix32(position.to(tl.uint32))))
    h = _mix32(_mix32((hash_row * V + tok).to(tl.uint32) ^ k))
    u = (h >> 8).to(tl.float32) * (1.0 / 16777216.0)
    # Exp(1) = -log(1 - u). The bin u = 0 stands for E in [0, 6e-8): its midpoint, 3e-8, not 0
    # (floored at the smallest normal, E = 0 made that token win whatever its p: 1 token in 2^24
    # per step, 0.2% of the steps at V = 32768, drew a near-uniformly random token); every other
    # bin is as before, so a seed draws what it drew. E > 0 keeps 0 / E at 0.
    e = tl.maximum(-tl.log(1.0 - u), 2.9802322e-08)
    return tl.argmax(p / e, 0)


@triton.jit
def _row_draw(row, info_ptr, seed_lo, seed_hi, position, PER_ROW: tl.constexpr):
    """(seed_lo, seed_hi, position, hash row) of `row`: the call's scalars and the row itself, or
    with PER_ROW the row's own from info (B, 4) int64 (continuous batching: one launch draws the
    rows of several requests exactly as their own calls would)."""
    # int32 either way (the table's values fit: seed_halves are int32): one return type
    if PER_ROW:
        seed_lo = tl.load(info_ptr + row * 4).to(tl.int32)
        seed_hi = tl.load(info_ptr + row * 4 + 1).to(tl.int32)
        position = tl.load(info_ptr + row * 4 + 2).to(tl.int32)
        row = tl.load(info_ptr + row * 4 + 3).to(tl.int32)
    return seed_lo, seed_hi, position, row


@triton.jit
def _sample_row(logits_ptr, stride, out_ptr, keep_ptr, info_ptr, row, V, inv_temp, top_k, top_p, seed_lo, seed_hi,
                position, VP2: tl.constexpr, KEEP: tl.constexpr, PER_ROW: tl.constexpr):
    j = tl.arange(0, VP2)
    logit = tl.load(logits_ptr + row * stride + j, mask=j < V, other=float("-inf")).to(tl.float32)
    logit = tl.where(logit == logit, logit, float("-inf"))  # NaN: never drawn (its key topped the row)
    key = tl.where(j < V, _ordered_key(logit), -2147483648)
    seed_lo, seed_hi, position, hash_row = _row_draw(row, info_ptr, seed_lo, seed_hi, position, PER_ROW)
    win = _draw(key, j, j < V, row, V, inv_temp, top_k, top_p, seed_lo, seed_hi, position, hash_row, keep_ptr, KEEP)
    tl.store(out_ptr + row, win.to(tl.int64))


@triton.jit(do_not_specialize=["top_k", "seed_lo", "seed_hi", "position"])
def _sample_kernel(logits_ptr, stride, out_ptr, keep_ptr, flag_ptr, info_ptr, V, inv_temp, top_k, top_p, seed_lo,
                   seed_hi, position, VP2: tl.constexpr, KEEP: tl.constexpr, FLAGGED: tl.constexpr,
                   PER_ROW: tl.constexpr):
    # One program per row. FLAGGED: the two-stage sampler's fallback, which draws only the rows
    # whose candidates overflowed (flag != 0) and leaves the others' draws alone.
    row = tl.program_id(0)
    if FLAGGED:
        if tl.load(flag_ptr + row) != 0:
            _sample_row(logits_ptr, stride, out_ptr, keep_ptr, info_ptr, row, V, inv_temp, top_k, top_p, seed_lo,
                        seed_hi, position, VP2, KEEP, PER_ROW)
    else:
        _sample_row(logits_ptr, stride, out_ptr, keep_ptr, info_ptr, row, V, inv_temp, top_k, top_p, seed_lo,
                    seed_hi, position, VP2, KEEP, PER_ROW)


@triton.jit(do_not_specialize=["top_k"])
def _candidates_kernel(logits_ptr, stride, key_ptr, tok_ptr, count_ptr, V, top_k, NCH, CH: tl.constexpr,
                       CAP: tl.constexpr):
    """Stage 1, one program per (row, chunk of CH tokens): the chunk's tokens at or above its own
    k-th largest logit (ties included), in token order, as (key, token) in the chunk's CAP slots,
    and how many there were (> CAP: they did not fit)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    j = c * CH + tl.arange(0, CH)
    logit = tl.load(logits_ptr + row * stride + j, mask=j < V, other=float("-inf")).to(tl.float32)
    # NaN as -inf, as the one-program path reads it (a NaN took a slot of the chunk's top k and
    # pushed a real candidate out)
    logit = tl.where(logit == logit, logit, float("-inf"))
    key = tl.where(j < V, _ordered_key(logit), -2147483648)
    # -inf is never drawn (p = 0), so it is no candidate: a run of masked tokens (a whole chunk
    # tied at -inf) would otherwise overflow the slots. A chunk with fewer than k tokens keeps
    # all its finite ones.
    keep = (key >= _kth_key(key, top_k)) & (logit > float("-inf"))
    slot = tl.cumsum(keep.to(tl.int32), 0) - 1
    base = (row * NCH + c) * CAP
    tl.store(key_ptr + base + slot, key, mask=keep & (slot < CAP))
    tl.store(tok_ptr + base + slot, j, mask=keep & (slot < CAP))
    tl.store(count_ptr + row * NCH + c, tl.sum(keep.to(tl.int32), 0))


@triton.jit(do_not_specialize=["top_k", "seed_lo", "seed_hi", "position"])
def _candidates_sample_kernel(key_ptr, tok_ptr, count_ptr, flag_ptr, out_ptr, keep_ptr, info_ptr, V, NCH, inv_temp,
                              top_k, top_p, seed_lo, seed_hi, position, CAP: tl.constexpr, NP2: tl.constexpr,
                              KEEP: tl.constexpr, PER_ROW: tl.constexpr):
    """Stage 2, one program per row: the race over the row's candidates, or flag = 1 for the
    fallback when a chunk had more than CAP (ties at its k-th logit)."""
    row = tl.program_id(0)
    f = tl.arange(0, NP2)
    c = f // CAP
    n = tl.load(count_ptr + row * NCH + c, mask=c < NCH, other=0)
    # the candidates are loaded before the max over the counts: a load after that reduction
    # (a bar.sync) would wait for it
    live = (c < NCH) & (f % CAP < n)
    key = tl.load(key_ptr + row * NCH * CAP + f, mask=live, other=-2147483648)
    tok = tl.load(tok_ptr + row * NCH * CAP + f, mask=live, other=0)
    fits = tl.max(n, 0) <= CAP
    tl.store(flag_ptr + row, tl.where(fits, 0, 1))
    if fits:
        seed_lo, seed_hi, position, hash_row = _row_draw(row, info_ptr, seed_lo, seed_hi, position, PER_ROW)
        win = _draw(key, tok, live, row, V, inv_temp, top_k, top_p, seed_lo, seed_hi, position, hash_row, keep_ptr,
                    KEEP)
        tl.store(out_ptr + row, tl.sum(tl.where(f == win, tok, 0), 0).to(tl.int64))


def two_stage_plan(vocab_size: int, top_k: int | None, chunk: int = TWO_STAGE_CHUNK) -> tuple[int, int, int] | None:
    """(chunk, chunks, slots per chunk) when the two-stage sampler applies, else None: top-k set, at
    most TWO_STAGE_MAX_K and below the vocabulary, at least two chunks, and k's slots (a power of
    two >= 16) no wider than half a chunk, so stage 2 has fewer candidates than the row has tokens.
    `chunk`: a power of two (a program's tl.arange), or 0 for none."""
    if chunk and chunk & (chunk - 1):
        raise ValueError(f"sample_triton: chunk {chunk}; accepted: 0 or a power of two")
    if not chunk or top_k is None or not 1 <= top_k <= TWO_STAGE_MAX_K or top_k >= vocab_size:
        return None
    cap = max(16, triton.next_power_of_2(top_k))
    chunks = triton.cdiv(vocab_size, chunk)
    if chunks < 2 or 2 * cap > chunk:
        return None
    return chunk, chunks, cap


def sample_triton(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                  seed: int, position: int, keep_out: torch.Tensor | None = None,
                  chunk: int | None = None, fallback_out: torch.Tensor | None = None,
                  row_draws: torch.Tensor | None = None) -> torch.Tensor:
    """sample_next's distribution in Triton: one token per row of `logits` (B, V) as a (B,) long
    tensor. The draw is a function of (seed, position, row, logits): a step re-run at the same
    position draws the same tokens, and with top-k alone the two-stage and one-program paths
    draw the same token. `keep_out` (B, V) int8, for tests: 1 where a token could be drawn
    (inside top-k and top-p, probability > 0). `chunk`: the two-stage sampler's chunk width
    (two_stage_plan; None = TWO_STAGE_CHUNK, 0 = one program per row). `fallback_out` (B,)
    int32, for tests: 1 where a row's candidates overflowed and the one-program fallback drew it.
    `row_draws` (B, 4) int64 on the device (`row_draw_table`): each row's own (seed, position, row)
    instead of `seed`, `position` and its index, so rows of different requests (same temperature,
    top-k and top-p) draw in one call what each request's own call would."""
    B, V = logits.shape
    if V > MAX_TRITON_VOCAB:
        raise ValueError(f"sample_triton: vocabulary {V} > {MAX_TRITON_VOCAB} (a row must fit in registers); "
                         "use sample_next")
    seed_lo, seed_hi = seed_halves(seed)
    if is_greedy(temperature):
        return greedy_tokens(logits)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(B, dtype=torch.long, device=logits.device)
    vp2 = triton.next_power_of_2(V)
    k = V if top_k is None else min(top_k, V)
    p = 1.0 if top_p is None else top_p
    draw = (1.0 / temperature, k, p, seed_lo, seed_hi, position)
    keep = out if keep_out is None else keep_out  # KEEP=False: a pointer the kernels never touch
    if row_draws is not None and (row_draws.shape != (B, 4) or row_draws.dtype != torch.int64):
        raise ValueError(f"sample_triton row_draws: expected ({B}, 4) int64, got {tuple(row_draws.shape)} "
                         f"{row_draws.dtype}")
    info = out if row_draws is None else row_draws  # PER_ROW=False: never read
    plan = two_stage_plan(V, k, TWO_STAGE_CHUNK if chunk is None else chunk)
    flags = out  # likewise without FLAGGED
    if plan is not None:
        width, chunks, cap = plan
        if keep_out is not None:
            keep_out.zero_()  # the candidate path writes the candidates' entries only
        buf = torch.empty(B * chunks * (2 * cap + 1) + B, dtype=torch.int32, device=logits.device)
        keys, toks = buf[:B * chunks * cap], buf[B * chunks * cap:2 * B * chunks * cap]
        counts, flags = buf[2 * B * chunks * cap:-B], buf[-B:]
        _candidates_kernel[(B, chunks)](logits, logits.stride(0), keys, toks, counts, V, k, chunks, CH=width,
                                        CAP=cap, num_warps=4)
        np2 = triton.next_power_of_2(chunks) * cap
        _candidates_sample_kernel[(B,)](keys, toks, counts, flags, out, keep, info, V, chunks, *draw, CAP=cap,
                                        NP2=np2, KEEP=keep_out is not None, PER_ROW=row_draws is not None,
                                        num_warps=4 if np2 <= 4096 else 8)
    _sample_kernel[(B,)](logits, logits.stride(0), out, keep, flags, info, V, *draw, VP2=vp2, KEEP=keep_out is not None,
                         FLAGGED=plan is not None, PER_ROW=row_draws is not None,
                         num_warps=max(4, min(SAMPLE_WARPS, vp2 // 1024)))
    if fallback_out is not None:
        fallback_out.copy_(flags if plan is not None else torch.ones_like(fallback_out))
    return out


def seed_halves(seed: int) -> tuple[int, int]:
    """Two 32-bit words holding all 64 bits of `seed` (0..MAX_SEED), each as a signed int32 (the
    kernels read their bits as uint32; int32 arguments for every seed: one compiled kernel): bits
    0-30 and 31-61 as the kernels always took them (seed % 2^62 split at bit 31, so every seed
    below 2^62 draws what it drew), bits 62 and 63 in the words' top bits (they were dropped: s
    and s + 2^62 drew the same tokens)."""
    if isinstance(seed, bool) or not isinstance(seed, Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"sample_triton seed: got {seed!r}; accepted: an integer in 0..{MAX_SEED}")
    seed = int(seed)
    lo = (seed & 0x7FFFFFFF) | ((seed >> 62) & 1) << 31
    hi = ((seed >> 31) & 0x7FFFFFFF) | (seed >> 63) << 31
    return tuple(h - (1 << 32) if h >> 31 else h for h in (lo, hi))


def row_draw_table(draws) -> torch.Tensor:
    """sample_triton's `row_draws` from (seed, position, row) per row (host ints), on the CPU."""
    return torch.tensor([(*seed_halves(seed), position, row) for seed, position, row in draws], dtype=torch.int64)
