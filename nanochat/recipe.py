"""Pretraining recipes: what `base_train --recipe v1|v2` stands for, scaled to this run, and the
run's horizon (`Horizon`: --num-iterations, --target-flops or --target-param-data-ratio).

A recipe is the optimizer's hyperparameters and schedules. Its values are stated for upstream
nanochat's reference point, d12 at 2^19 tokens a step; `resolve_recipe` turns them into the numbers
of this run (depth, batch) and the `Schedule` the trainer applies. Flags given explicitly override
a recipe's value (then scaled the same way); the banner prints both.

v1  what nanochat-spark trained with through session 42 (upstream nanochat of January 2026):
    unembedding LR 0.004, no weight decay, no warmup, warmdown 40% of the run to 0, Muon momentum
    0.85 -> 0.95 over 300 steps, plain Muon, no scaling with the batch size.
v2  upstream nanochat's later recipe (karpathy/nanochat scripts/base_train.py and optim.py, 2026):
    * LRs x sqrt(B / 2^19): the square-root rule for adaptive optimizers, applied to Muon too;
    * cautious weight decay 0.28 at the reference, x sqrt(B / 2^19) x D_ref / D (D = the run's
      token horizon), which keeps T_epoch = B / (lr x wd x D) of arXiv 2405.13698 constant; it
      decays to 0 on a half cosine;
    * warmup 40 steps, warmdown 65% of the run to 5% of the LR;
    * Muon momentum 0.85 -> 0.97 over 400 steps, down to 0.90 over the warmdown;
    * NorMuon (arXiv 2510.05491) with beta2 0.95; unembedding LR 0.008.
A resumed run keeps the recipe its checkpoint was trained with (`recipe_for_resume`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from nanochat.errors import RequestError
from nanochat.training import Schedule

REF_BATCH_TOKENS = 2 ** 19     # the batch size the recipes' values are stated for (upstream's d12 optimum)
DEFAULT_RECIPE = "v2"

# Per recipe: the flag-level values (before scaling) and the mechanics around them.
RECIPES: dict[str, dict] = {
    "v1": dict(matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.004, scalar_lr=0.5, weight_decay=0.0,
               warmup_ratio=0.0, warmup_steps=0, warmdown_ratio=0.4, final_lr_frac=0.0, normuon_beta2=0.0,
               scale_with_batch=False, momentum="ramp", weight_decay_shape="linear"),
    "v2": dict(matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.008, scalar_lr=0.5, weight_decay=0.28,
               warmup_ratio=0.0, warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05, normuon_beta2=0.95,
               scale_with_batch=True, momentum="peaked", weight_decay_shape="cosine"),
}
# The flags a recipe sets (each overridable on the command line).
RECIPE_FLAGS = ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay", "warmup_ratio",
                "warmup_steps", "warmdown_ratio", "final_lr_frac", "normuon_beta2")


@dataclass(frozen=True)
class ResolvedRecipe:
    """A recipe's values for one run: LRs and weight decay already scaled, schedules named."""

    name: str
    matrix_lr: float
    embedding_lr: float
    unembedding_lr: float
    scalar_lr: float
    weight_decay: float          # this run's (scaled) peak weight decay
    weight_decay_ref: float      # the value at the reference point (the flag or the recipe's)
    lr_scale: float              # sqrt(B / 2^19) under v2, else 1
    warmup_ratio: float
    warmup_steps: int
    warmdown_ratio: float
    final_lr_frac: float
    normuon_beta2: float
    momentum: str                # "ramp" | "peaked"
    weight_decay_shape: str      # "linear" | "cosine"
    overridden: tuple[str, ...]  # flags given explicitly

    def optimizer_kwargs(self) -> dict:
        """build_optimizer's keyword arguments."""
        return dict(matrix_lr=self.matrix_lr, embedding_lr=self.embedding_lr, unembedding_lr=self.unembedding_lr,
                    scalar_lr=self.scalar_lr, weight_decay=self.weight_decay, normuon_beta2=self.normuon_beta2)

    def schedule(self, num_iterations: int) -> Schedule:
        from nanochat import optim
        momentum_fn = (functools.partial(optim.muon_momentum_peaked, num_iterations=num_iterations,
                                         warmdown_ratio=self.warmdown_ratio)
                       if self.momentum == "peaked" else optim.muon_momentum)
        wd_fn = optim.weight_decay_cosine if self.weight_decay_shape == "cosine" else optim.weight_decay_multiplier
        if self.warmup_ratio + self.warmdown_ratio > 1:   # Schedule's message named flags the user never gave
            def said(k):
                return f"--{k.replace('_', '-')} {getattr(self, k):g}" + (
                    "" if k in self.overridden else f" (recipe {self.name}'s)")
            raise RequestError(f"{said('warmup_ratio')} + {said('warmdown_ratio')} = "
                               f"{self.warmup_ratio + self.warmdown_ratio:g}; accepted: a sum <= 1 "
                               f"(e.g. --warmdown-ratio {1 - self.warmup_ratio:g}, or --warmup-steps)")
        return Schedule(num_iterations, self.warmup_ratio, self.warmdown_ratio, self.final_lr_frac,
                        warmup_steps=self.warmup_steps, momentum_fn=momentum_fn, wd_fn=wd_fn).validate()

    def _momentum_path(self, num_iterations: int) -> str:
        """Muon's momentum at the start, where the warmdown begins (v2) and at the end of this run:
        a run shorter than the ramp (v1 300 steps, v2 400) never reaches its nominal peak."""
        from nanochat import optim
        if self.momentum != "peaked":
            values = [optim.muon_momentum(0), optim.muon_momentum(num_iterations)]
        else:
            begin = num_iterations - round(self.warmdown_ratio * num_iterations)
            steps = [0, begin, num_iterations] if begin < num_iterations else [0, num_iterations]
            values = [optim.muon_momentum_peaked(s, num_iterations, self.warmdown_ratio) for s in steps]
        return "->".join(f"{v:.3g}" for v in values)

    def describe(self, num_iterations: int) -> str:
        """One banner line: what the recipe resolved to for a run of `num_iterations`, and which
        flags overrode it."""
        warmdown = round(self.warmdown_ratio * num_iterations)
        warmup = (f"{min(self.warmup_steps, num_iterations - warmdown)} steps" if self.warmup_steps
                  else f"{round(self.warmup_ratio * num_iterations)} steps")
        parts = [f"{self.name}: LR scale {self.lr_scale:.4g} (sqrt(batch / 2^19))" if self.lr_scale != 1
                 else f"{self.name}: LR scale 1",
                 f"weight decay {self.weight_decay:.4g} (ref {self.weight_decay_ref:g}, {self.weight_decay_shape} to 0)",
                 f"warmup {warmup}, warmdown {self.warmdown_ratio:g} to {self.final_lr_frac:g}",
                 f"momentum {self._momentum_path(num_iterations)}",
                 f"NorMuon beta2 {self.normuon_beta2:g}" if self.normuon_beta2 else "plain Muon"]
        if self.overridden:
            parts.append("flags: " + " ".join("--" + f.replace("_", "-") for f in self.overridden))
        return ", ".join(parts)


MAX_STEPS = 10**9   # years of steps at any speed: more is a typo


@dataclass(frozen=True)
class Horizon:
    """How long base_train trains: --num-iterations when given, else a --target-flops compute budget,
    else --target-param-data-ratio x scaling params (base_train refuses --num-iterations with
    --target-flops); and the token horizon the auto batch and v2's weight decay scale to."""

    num_iterations: int          # the flag; -1: from the budget or the ratio
    target_flops: float          # the flag; -1: off
    ratio: float                 # --target-param-data-ratio
    flops_per_token: float
    scaling_params: int
    ref_scaling_params: int      # the reference depth's (d12)
    ratio_given: bool = False    # a --target-param-data-ratio other than the default (said when unused)

    @property
    def target_tokens(self) -> float:
        if self.target_flops > 0:
            return self.target_flops / self.flops_per_token
        return self.ratio * self.scaling_params

    @property
    def ref_tokens(self) -> float:
        """d12's horizon at this run's tokens : params ratio (so target / ref depends on the depth alone)."""
        if self.target_flops > 0:
            return self.target_tokens * self.ref_scaling_params / self.scaling_params
        return self.ratio * self.ref_scaling_params

    def steps(self, total_batch_size: int) -> int:
        """Optimizer steps; RequestError past MAX_STEPS (a typo like --target-flops 1e40 ended in an
        OverflowError traceback where the save plan counts its steps)."""
        n = self.num_iterations if self.num_iterations > 0 else max(1, int(self.target_tokens // total_batch_size))
        if n > MAX_STEPS:
            flag = ("--num-iterations" if self.num_iterations > 0 else
                    "--target-flops" if self.target_flops > 0 else "--target-param-data-ratio")
            raise RequestError(f"{flag}: makes {n:.3g} steps of {total_batch_size:,} tokens; accepted: at most "
                               f"{MAX_STEPS:,} steps")
        return n

    def describe(self, total_batch_size: int) -> str:
        """The banner's iterations row: the steps and the arithmetic behind them, a horizon shorter
        than one step (trained as one) and a --target-param-data-ratio that sets nothing said."""
        steps = self.steps(total_batch_size)
        unused = f"; --target-param-data-ratio {self.ratio:g} unused" if self.ratio_given else ""
        if self.num_iterations > 0:
            return f"{steps:,} (from --num-iterations{unused})"
        tokens = self.target_tokens
        how = (f"--target-flops {self.target_flops:.4g} / {self.flops_per_token:.4e} FLOPs per token"
               if self.target_flops > 0 else
               f"--target-param-data-ratio {self.ratio:g} x {self.scaling_params:,} scaling params")
        short = (f", less than one step: trained as 1 step of {total_batch_size:,} tokens"
                 if tokens < total_batch_size else f" / {total_batch_size:,} tokens a step")
        return f"{steps:,} ({how} = {tokens:,.0f} tokens{short}{unused if self.target_flops > 0 else ''})"


CPU_FLOPS_PER_S = 1e11   # a fast many-core CPU's fp32 training rate, generously (a 2-core VM: ~4e10)


def cpu_plan_hint(device_type: str, training_flops: float) -> str | None:
    """A warning when a CPU is asked for more than a day's training: bare `base_train` plans d20 on
    8.7B tokens (~3e19 FLOPs), and on a CPU its first step line took longer than a user waits."""
    days = training_flops / CPU_FLOPS_PER_S / 86400
    if device_type != "cpu" or days < 1:
        return None
    return (f"this plan is {training_flops:.2g} training FLOPs: {days:,.0f} days on a CPU even at "
            f"{CPU_FLOPS_PER_S:.0e} FLOP/s; for a CPU run see README's \"Step by step on a CPU\" "
            "(./setup.sh --preset tiny), or set --depth and --num-iterations")


def small_batch_hint(recipe: ResolvedRecipe, total_batch_size: int) -> str | None:
    """A warning when v2's square-root rule takes the LRs far below its reference (tiny CPU runs):
    it is stated for batches near 2^19 tokens, and setup.sh's tiny preset (4,096 tokens, 250 steps)
    ended 0.12 bpb worse under v2 than under v1."""
    if recipe.lr_scale >= 0.25:
        return None
    return (f"--recipe {recipe.name} scales the LRs by {recipe.lr_scale:.3g} at {total_batch_size:,} tokens a step "
            f"(its values are for ~{REF_BATCH_TOKENS:,}); short runs at small batches learn faster with --recipe v1")


def plan_warnings(recipe: ResolvedRecipe, total_batch_size: int, device_type: str, training_flops: float) -> list[str]:
    """The start-up warnings about the run's plan (base_train prints each as "WARNING: ...")."""
    hints = (small_batch_hint(recipe, total_batch_size), cpu_plan_hint(device_type, training_flops))
    return [h for h in hints if h is not None]


def resolve_recipe(name: str, overrides: dict, *, total_batch_size: int, target_tokens: float,
                   ref_tokens: float) -> ResolvedRecipe:
    """`name`'s values, `overrides` (flag -> value, None = not given) on top, scaled to a run of
    `total_batch_size` tokens a step and a `target_tokens` horizon (`ref_tokens`: d12's horizon at
    the same tokens:params ratio)."""
    if name not in RECIPES:
        raise RequestError(f"--recipe: got {name!r}; accepted: {'|'.join(RECIPES)}")
    unknown = set(overrides) - set(RECIPE_FLAGS)
    assert not unknown, f"not recipe flags: {sorted(unknown)}"
    assert total_batch_size > 0 and target_tokens > 0 and ref_tokens > 0
    base = RECIPES[name]
    given = {k: v for k, v in overrides.items() if v is not None}
    values = {k: given.get(k, base[k]) for k in RECIPE_FLAGS}
    if "warmup_ratio" in given and "warmup_steps" not in given:
        values["warmup_steps"] = 0      # an explicit ratio replaces the recipe's step count
    lr_scale, wd_scale = 1.0, 1.0
    if base["scale_with_batch"]:
        lr_scale = math.sqrt(total_batch_size / REF_BATCH_TOKENS)
        wd_scale = lr_scale * ref_tokens / target_tokens
    return ResolvedRecipe(
        name=name, matrix_lr=values["matrix_lr"] * lr_scale, embedding_lr=values["embedding_lr"] * lr_scale,
        unembedding_lr=values["unembedding_lr"] * lr_scale, scalar_lr=values["scalar_lr"] * lr_scale,
        weight_decay=values["weight_decay"] * wd_scale, weight_decay_ref=values["weight_decay"], lr_scale=lr_scale,
        warmup_ratio=values["warmup_ratio"], warmup_steps=int(values["warmup_steps"]),
        warmdown_ratio=values["warmdown_ratio"], final_lr_frac=values["final_lr_frac"],
        normuon_beta2=values["normuon_beta2"], momentum=base["momentum"],
        weight_decay_shape=base["weight_decay_shape"], overridden=tuple(k for k in RECIPE_FLAGS if k in given))


def recipe_for_resume(requested: str | None, saved_config: dict | None) -> str:
    """The recipe of a run: the one asked for, else (resuming) the checkpoint's, else the default.
    A checkpoint from before recipes existed was trained with v1. Asking for another recipe than
    the checkpoint's raises: changing optimizer mechanics mid-run is not a resume."""
    if saved_config is None:
        return requested or DEFAULT_RECIPE
    saved = saved_config.get("recipe") or "v1"
    if requested is not None and requested != saved:
        raise RequestError(f"--recipe: got {requested!r} but the checkpoint was trained with {saved!r}; "
                         f"resume with --recipe {saved} (or leave the flag out), or start a new --model-tag")
    return saved
