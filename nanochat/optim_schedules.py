"""The optimizer's schedules as functions of the step: the learning-rate multiplier (warmup,
constant, warmdown), Muon momentum (recipe v1's ramp, v2's ramp-then-anneal) and the weight-decay
multipliers. nanochat/optim.py re-exports them (optim.lr_multiplier, ...): training.Schedule and
recipe.py build a run's schedule from them.
"""

from __future__ import annotations

import functools
import math


def lr_multiplier(step: int, num_iterations: int, *, warmup_ratio: float = 0.0, warmdown_ratio: float = 0.4,
                  final_lr_frac: float = 0.0, warmup_steps: int = 0) -> float:
    """Linear warmup, constant, then linear warmdown to final_lr_frac at step == num_iterations.
    The warmup is `warmup_steps` steps when > 0 (capped where the warmdown starts, so a short run
    still warms down), else warmup_ratio x num_iterations."""
    if num_iterations < 1:
        raise ValueError(f"--num-iterations: got {num_iterations}; accepted: an integer >= 1")
    if not (0 <= warmup_ratio <= 1 and 0 <= warmdown_ratio <= 1 and warmup_ratio + warmdown_ratio <= 1):
        raise ValueError(f"--warmup-ratio/--warmdown-ratio: got {warmup_ratio}/{warmdown_ratio}; "
                         "accepted: each in [0, 1], sum <= 1")
    if not 0 <= final_lr_frac <= 1:
        raise ValueError(f"--final-lr-frac: got {final_lr_frac}; accepted: [0, 1]")
    if warmup_steps < 0:
        raise ValueError(f"--warmup-steps: got {warmup_steps}; accepted: an integer >= 0")
    warmdown = round(warmdown_ratio * num_iterations)
    warmup = min(warmup_steps, num_iterations - warmdown) if warmup_steps > 0 else round(warmup_ratio * num_iterations)
    if step < warmup:
        return (step + 1) / warmup
    if step <= num_iterations - warmdown or warmdown == 0:   # no warmdown: full LR past the end too
        return 1.0
    progress = max(0.0, (num_iterations - step) / warmdown)
    return progress + (1 - progress) * final_lr_frac


def muon_momentum(step: int, *, start: float = 0.85, end: float = 0.95, ramp_steps: int = 300) -> float:
    """Muon momentum: linear from `start` to `end` over the first `ramp_steps` steps (0: `end` throughout)."""
    if ramp_steps < 0:
        raise ValueError(f"muon_momentum ramp_steps: got {ramp_steps}; accepted: an integer >= 0 (0 = no ramp)")
    frac = 1.0 if ramp_steps == 0 else min(max(step, 0) / ramp_steps, 1.0)
    return (1 - frac) * start + frac * end


def muon_momentum_peaked(step: int, num_iterations: int, warmdown_ratio: float, *, start: float = 0.85,
                         peak: float = 0.97, end: float = 0.90, ramp_steps: int = 400) -> float:
    """Recipe v2's Muon momentum: the ramp from `start` to `peak` over `ramp_steps`, then during
    the LR warmdown linear from wherever the ramp stands there down to `end` at the last step
    (less momentum while the LR anneals: the update follows the recent gradients more closely)."""
    ramp = functools.partial(muon_momentum, start=start, end=peak, ramp_steps=ramp_steps)
    warmdown = round(warmdown_ratio * num_iterations)
    begin = num_iterations - warmdown
    if warmdown == 0 or step <= begin:
        return ramp(step)
    progress = min((step - begin) / warmdown, 1.0)
    return (1 - progress) * ramp(begin) + progress * end


def weight_decay_multiplier(step: int, num_iterations: int) -> float:
    """Weight decay decays linearly to 0 over the run (multiply initial_weight_decay by this)."""
    if num_iterations < 1:
        raise ValueError(f"--num-iterations: got {num_iterations}; accepted: an integer >= 1")
    return max(0.0, 1.0 - step / num_iterations)


def weight_decay_cosine(step: int, num_iterations: int) -> float:
    """Recipe v2's weight decay: a half cosine from 1 at step 0 to 0 at the last step."""
    if num_iterations < 1:
        raise ValueError(f"--num-iterations: got {num_iterations}; accepted: an integer >= 1")
    return 0.5 * (1 + math.cos(math.pi * min(max(step, 0), num_iterations) / num_iterations))
