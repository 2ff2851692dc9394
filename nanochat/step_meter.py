"""The training step meter: throughput, MFU against the device's dense bf16 peak, utilisation of
the active precision's peak (blended with bf16 for the FLOPs that run in bf16), an EMA-smoothed loss, the fixed-field per-step log line and its ETA.
Also where the peak FLOP/s come from (`resolve_peak_flops`, `describe_peaks`: nanochat/device_table.py's
table or --peak-flops). nanochat/training.py re-exports every name here (recipes import them from
there).
"""

from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from nanochat.training import StepResult


def resolve_peak_flops(rt, precision: str, override: float | None = None,
                       warn: Callable[[str], None] | None = None) -> tuple[float | None, float | None, str]:
    """(bf16 dense peak, active-precision peak, device name) in FLOP/s per device.

    CPU/MPS -> (None, None). An unknown GPU without --peak-flops warns once and returns None, so
    the log says "mfu n/a" instead of a silent 0%. Under torchrun every rank must call it (it
    gathers the ranks' peaks): an unknown GPU on any rank makes MFU n/a everywhere, and GPUs of
    different kinds give the ranks' mean peak (MFU then divides by the sum of their peaks)."""
    from nanochat.platform import detect_device, peak_flops, peaks
    spec = detect_device(rt.device)
    if rt.device_type != "cuda":   # the override checked as on a GPU (0, nan, negatives refused)
        return (peak_flops(spec, "bf16", override) if override is not None else None), None, spec.name
    bf16, act = peaks(spec, precision, override)   # a precision name or precision.py's peak_key
    ranks = _every_rank((bf16, act, spec.name), getattr(rt, "world_size", 1))
    unknown = sorted({name for b, _, name in ranks if b is None})
    if unknown:   # on any rank: rank 0 (the one that prints, print0) says so, naming every such GPU
        (warn or _warn)(f"GPU {', '.join(repr(n) for n in unknown)} is not in nanochat/device_table.py: "
                        "MFU cannot be computed; base_train, mid_train, chat_sft and bench_train take --peak-flops "
                        "<dense bf16 FLOP/s per GPU, e.g. 989e12> for it")
        return None, None, spec.name
    if len({(b, a) for b, a, _ in ranks}) > 1:
        # GPUs of different kinds: the meter divides by peak x world size, so the ranks' mean peak
        # makes that the sum of every GPU's own (rank 0's peak alone overstated or understated MFU)
        bf16 = sum(b for b, _, _ in ranks) / len(ranks)
        act = None if any(a is None for _, a, _ in ranks) else sum(a for _, a, _ in ranks) / len(ranks)
    names = list(dict.fromkeys(name for _, _, name in ranks))
    return bf16, act, " + ".join(names)


def _every_rank(own: tuple, world_size: int) -> list[tuple]:
    """`own` (bf16 peak, active peak, device name) of every rank of a torchrun launch (a collective:
    every rank calls resolve_peak_flops), or just `own` in a single process."""
    import torch.distributed as dist
    if world_size <= 1 or not dist.is_available() or not dist.is_initialized():
        return [own]
    out: list = [None] * world_size
    dist.all_gather_object(out, own)
    return out


def blended_peak(bf16: float | None, act: float | None, flops_per_token: float,
                 low_flops: float | None) -> float | None:
    """The peak util() divides by: a token's FLOPs over the time they take at their own peaks,
    `low_flops` of them (precision.low_precision_flops: the converted layers' GEMMs) at `act` and
    the rest (attention, lm_head, a bf16 backward) at bf16. `act` itself when either peak is
    unknown or the caller does not know the split (low_flops None)."""
    if not bf16 or not act or low_flops is None or flops_per_token <= 0:
        return act
    low = min(max(float(low_flops), 0.0), flops_per_token)
    return flops_per_token / (low / act + (flops_per_token - low) / bf16)


def describe_peaks(rt, precision: str, bf16: float | None, act: float | None, override: float | None,
                   blended: float | None = None, low_share: float | None = None) -> str:
    """The banner's peak line: the bf16 peak MFU divides by, the active precision's, the blend of
    the two util() divides by (`blended`, with `low_share` of the FLOPs at the active precision), and
    where the peaks come from (--peak-flops, the vendor datasheet, or spec-derived, as GB10's are)."""
    from nanochat.platform import detect_device, peak_key
    if bf16 is None:
        return "n/a (MFU not computed; --peak-flops)"
    key = peak_key(precision)
    text = f"bf16 {bf16:.4e}" + (f", {key} {act:.4e}" if key != "bf16" and act else "")
    if key != "bf16" and act and blended and low_share is not None:
        text += f", util() against {blended:.4e} ({low_share:.0%} of the FLOPs at {key}, the rest at bf16)"
    if override is not None:
        # the factor is said: for a card outside the table it is an assumption (a GeForce Blackwell's
        # nvfp4 is 8x bf16, the generic Blackwell ratio 4x), and util() divides by it
        return text + " (--peak-flops" + (f"; {key} = {act / bf16:g}x bf16, the dense ratio)" if key != "bf16" and act else ")")
    return text + f" ({detect_device(rt.device).source})"


def _warn(msg: str) -> None:
    warnings.warn(msg, stacklevel=3)


class StepMeter:
    """Throughput, MFU and an EMA-smoothed loss. MFU is against the dense bf16 peak (comparable
    across precisions); `util` is against `peak_util`: the active precision's own peak, blended
    with bf16 by `low_precision_flops` when given (blended_peak). The first
    `warmup_steps` of every process (compilation, allocator warm-up; also after a resume) are
    left out of the cumulative time (average_tok_per_sec says what it averages when no process got
    past them). The ETA is wall-clock time per step since the warm-up (so evals, samples and
    checkpoints between steps count) times the steps left: a d20 run on a GB10 takes days, and its
    user should know how many after a few minutes. During the warm-up (also a resume's) it is a
    rough figure marked '~' from the second step: the wall time per step since this process's first
    step (whose own time is mostly the compilation, so it says nothing alone): a slow run (a CPU, a
    big model) would otherwise show '-' for its first hours."""

    def __init__(self, flops_per_token: float, world_size: int, *, peak_bf16: float | None,
                 peak_active: float | None = None, precision: str = "bf16", ema_beta: float = 0.9,
                 warmup_steps: int = 10, peak_memory: Callable[[], int] | None = None,
                 low_precision_flops: float | None = None):
        self.flops_per_token, self.world_size = float(flops_per_token), world_size
        self.peak_bf16, self.peak_active, self.precision = peak_bf16, peak_active, precision
        self.peak_util = blended_peak(peak_bf16, peak_active, self.flops_per_token, low_precision_flops)
        self.low_share = (None if low_precision_flops is None or self.flops_per_token <= 0
                          else min(1.0, max(0.0, low_precision_flops / self.flops_per_token)))
        self.ema_beta, self.warmup_steps = ema_beta, warmup_steps
        self.peak_memory = peak_memory or (lambda: 0)
        self.smooth_loss = 0.0
        self.updates = 0              # EMA updates so far (debias)
        self.total_time = 0.0         # seconds of timed (post-warm-up) steps
        self.timed_steps = 0
        self.timed_tokens = 0
        # this process's steps past its first (the compilation): the average's basis while no step is
        # timed (every process so far ended inside its warm-up: a run resumed every few steps). Not in
        # state_dict: a resume's is its own (and a run's and its resume's checkpoints stay alike)
        self._settled_time = 0.0
        self._settled_tokens = 0
        self._steps_this_process = 0  # warm-up counts from this process's start (also after resume)
        self._wall_start: float | None = None  # perf_counter at the start of the first timed step
        self._wall_steps = 0                   # steps since then (this process)
        self._first_end: float | None = None   # perf_counter at the end of this process's first step

    def update(self, r: StepResult) -> dict:
        b = self.ema_beta
        self.smooth_loss = b * self.smooth_loss + (1 - b) * r.loss
        self.updates += 1
        self._steps_this_process += 1
        now = time.perf_counter()
        if self._steps_this_process == 1:
            self._first_end = now
        else:
            self._settled_time += r.dt
            self._settled_tokens += r.tokens
        if self._steps_this_process > self.warmup_steps:
            self.total_time += r.dt
            self.timed_steps += 1
            self.timed_tokens += r.tokens
            if self._wall_start is None:
                self._wall_start = time.perf_counter() - r.dt
            self._wall_steps += 1
        wall_per_step = ((time.perf_counter() - self._wall_start) / self._wall_steps
                         if self._wall_steps else None)
        rough = None   # the warm-up's rough figure (the log line's '~' ETA), None once wall_per_step is measured
        if wall_per_step is None and self._steps_this_process > 1:   # not from the first step: its time
            # is mostly torch.compile's (a 90 s compile at 20,000 steps read "eta ~20d19h")
            rough = (now - self._first_end) / (self._steps_this_process - 1)
        tok_s = r.tokens / r.dt if r.dt > 0 else float("inf")
        flops_s = self.flops_per_token * tok_s
        return {"step": r.step, "loss": r.loss, "smooth_loss": self.smooth_loss / (1 - b ** self.updates),
                "lrm": r.lrm, "dt": r.dt, "tok_per_sec": tok_s, "grad_norm": r.grad_norm,
                "mfu": self._frac(flops_s, self.peak_bf16), "util": self._frac(flops_s, self.peak_util),
                "peak_mem_gib": self.peak_memory() / 2**30, "wall_per_step": wall_per_step,
                "rough_per_step": rough}

    def _frac(self, flops_s: float, peak: float | None) -> float | None:
        return None if not peak else 100.0 * flops_s / (peak * self.world_size)

    def log_line(self, m: dict, num_iterations: int) -> str:
        """The one fixed-field line per step (fields never appear or disappear)."""
        mfu = f"{m['mfu']:5.2f}%" if m["mfu"] is not None else "  n/a"
        util = f"{m['util']:5.2f}%" if m["util"] is not None else "  n/a"
        width = max(5, len(str(num_iterations)))
        per_step, mark = m.get("wall_per_step"), ""
        if per_step is None and m.get("rough_per_step") is not None:   # still in the warm-up: rough
            per_step, mark = m["rough_per_step"], "~"
        eta = mark + format_eta(per_step * (num_iterations - m["step"] - 1)) if per_step is not None else "-"
        return (f"step {m['step']:0{width}d}/{num_iterations:0{width}d} | loss {m['smooth_loss']:.4f} | "
                f"lrm {m['lrm']:.3f} | dt {m['dt'] * 1e3:8.1f}ms | tok/s {m['tok_per_sec']:>11,.0f} | "
                f"mfu {mfu} | util({self.precision}) {util} | mem {m['peak_mem_gib']:6.2f}GiB | eta {eta:>6}")

    def average_tok_per_sec(self) -> float | None:
        """Tokens per second of the timed steps: every process's steps past its first `warmup_steps`
        (compilation and allocator warm-up left out; a resumed process warms up again), summed over
        the run's processes (the meter's state rides in the checkpoints). A run none of whose
        processes got past its warm-up (resumed every few steps) averages this process's steps past
        its first one instead (the one that compiles): the segment that ends the run; None while
        there is no such step."""
        if self.total_time > 0:
            return self.timed_tokens / self.total_time
        return self._settled_tokens / self._settled_time if self._settled_time > 0 else None

    def average_mfu(self) -> tuple[float | None, float | None]:
        """(MFU %, util %) of the timed steps' average throughput (the report's figures; the log
        line's are per step), None where the rate or the peak is unknown."""
        tok_s = self.average_tok_per_sec()
        if tok_s is None:
            return None, None
        flops_s = self.flops_per_token * tok_s
        return self._frac(flops_s, self.peak_bf16), self._frac(flops_s, self.peak_util)

    def state_dict(self) -> dict:
        return {"smooth_loss": self.smooth_loss, "updates": self.updates, "total_time": self.total_time,
                "timed_steps": self.timed_steps, "timed_tokens": self.timed_tokens}

    def load_state_dict(self, s: dict) -> None:
        self.smooth_loss, self.updates = float(s["smooth_loss"]), int(s["updates"])
        self.total_time, self.timed_steps = float(s["total_time"]), int(s["timed_steps"])
        self.timed_tokens = int(s["timed_tokens"])


def format_eta(seconds: float) -> str:
    """At most 6 characters, coarsest two units: '6d03h', '13h05m', '4m07s', '9s'."""
    s = max(0, int(round(seconds)))
    d, rem = divmod(s, 86400)
    h, rem = divmod(rem, 3600)
    mins, secs = divmod(rem, 60)
    if d:
        return f"{d}d{h:02d}h" if d < 100 else f"{d}d"
    if h:
        return f"{h}h{mins:02d}m"
    return f"{mins}m{secs:02d}s" if mins else f"{secs}s"
