"""Training mechanics shared by every recipe (base, mid, SFT, RL): the step, batch arithmetic,
schedules, the non-finite-loss guard and loop-state/RNG capture (validation bits per byte:
nanochat/eval_bpb.py; the throughput/MFU meter and the per-step log line: nanochat/step_meter.py,
re-exported here; flag parsing: nanochat/flags.py; the optional wandb tracker: nanochat/tracker.py).

A recipe (scripts/*.py) builds a model, an optimizer and a loader, then:

    plan = plan_batch(total_batch_size, device_batch_size, seq_len, rt.world_size)
    trainer = Trainer(model, optimizer, loader, plan, Schedule(num_iterations), rt)
    for step in range(start, num_iterations):
        result = trainer.step(step)                 # raises NonFiniteLossError on nan/inf
        print0(meter.log_line(meter.update(result), num_iterations))

Everything here is device-agnostic (CPU/CUDA/MPS, torchrun or not) and imports nothing heavy.
"""

from __future__ import annotations

import math
import re
import random
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch

from nanochat import weight_cache
from nanochat.errors import RequestError
from nanochat.flags import require, require_float, require_int
from nanochat.checkpoint import build_model  # noqa: F401  (re-exported: recipes import it from here)
from nanochat.step_meter import (  # noqa: F401  (re-exported: recipes, scripts and tests import them from here)
    StepMeter, describe_peaks, format_eta, resolve_peak_flops)

# ------------------------------------------------------------------------------------ errors

class NonFiniteLossError(RequestError, RuntimeError):
    """Training produced a nan/inf loss (or gradient norm, val bpb, weights). Names the step, the
    last good checkpoint and what to try; weights in memory are not trusted after this. The scripts
    print it as one line from rank 0 and exit 3 (a RequestError for script_main, not a traceback on
    every rank)."""

    exit_code = 3

    def __init__(self, step: int, what: str, value: float, last_checkpoint: str | None, hint: str):
        self.step, self.value, self.last_checkpoint = step, value, last_checkpoint
        # its step named: after a resume from an older step, `latest` may be another checkpoint
        saved = re.search(r"step_0*(\d+)$", str(last_checkpoint or ""))
        how = f"--resume {saved.group(1)}" if saved else "--resume"
        # not "use --save-every": a run that used it and diverged before its first save was told to
        where = (f"last good checkpoint: {last_checkpoint} (resume from it with {how})" if last_checkpoint
                 else "no checkpoint was saved in this run yet (--save-every N saves one every N steps)")
        super().__init__(f"non-finite {what} ({value}) at step {step}; {where}; hint: {hint}")


# names the scripts of each flag: the hint is shared by base_train, mid_train, chat_sft and chat_rl
_LR_HINT = "lower the learning rates (e.g. --matrix-lr, --embedding-lr of base_train, mid_train, chat_sft, chat_rl)"
_REST_HINT = "try base_train --precision bf16 if the run used fp8/nvfp4, and check the data for broken shards"
DEFAULT_HINT = f"{_LR_HINT}, set --grad-clip 1.0 (base_train, mid_train, chat_sft), {_REST_HINT}"


def nonfinite_hint(grad_clip: float | None) -> str:
    """DEFAULT_HINT for a run without clipping; a run that clipped is told to lower it, not to set 1.0."""
    if not grad_clip:
        return DEFAULT_HINT
    return f"{_LR_HINT}, lower --grad-clip (this run: {grad_clip:g}), {_REST_HINT}"


# ------------------------------------------------------------------------------------ batch arithmetic

# Auto total batch size (the rule upstream nanochat uses, re-derived here): d12 trains best at
# 2**19 tokens per step at its compute-optimal horizon D_ref; the optimal batch grows with the
# training horizon D as D**0.383 (Power Lines, arXiv:2505.13738), rounded to a power of two.
REF_BATCH_TOKENS = 2**19
REF_DEPTH = 12
BATCH_EXPONENT = 0.383


def auto_total_batch_size(target_tokens: float, ref_target_tokens: float) -> int:
    """2**round(log2(REF_BATCH_TOKENS * (target_tokens / ref_target_tokens) ** 0.383))."""
    assert target_tokens > 0 and ref_target_tokens > 0
    predicted = REF_BATCH_TOKENS * (target_tokens / ref_target_tokens) ** BATCH_EXPONENT
    return 2 ** max(0, round(math.log2(predicted)))


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's tokens split over ranks and micro-batches."""

    total_batch_size: int          # tokens per optimizer step, all ranks
    device_batch_size: int         # sequences per micro-batch per rank
    seq_len: int
    world_size: int
    grad_accum_steps: int

    @property
    def world_tokens_per_micro_batch(self) -> int:  # one forward/backward on every rank
        return self.device_batch_size * self.seq_len * self.world_size

    def describe(self) -> str:
        return (f"{self.total_batch_size:,} tokens/step = {self.device_batch_size} seqs x {self.seq_len} tokens"
                f" x {self.world_size} rank(s) x {self.grad_accum_steps} micro-batch(es)")


def plan_batch(total_batch_size: int, device_batch_size: int, seq_len: int, world_size: int,
               *, flag: str = "--total-batch-size") -> BatchPlan:
    """Gradient accumulation to reach `total_batch_size` tokens; raises with the numbers when it
    does not divide evenly."""
    require_int(device_batch_size, "--device-batch-size")
    require_int(seq_len, "--max-seq-len")
    require_int(world_size, "WORLD_SIZE")
    require_int(total_batch_size, flag)
    per_micro = device_batch_size * seq_len * world_size
    if total_batch_size % per_micro != 0:
        raise RequestError(
            f"{flag}: got {total_batch_size:,} tokens, which is not a multiple of --device-batch-size x "
            f"--max-seq-len x world size = {device_batch_size} x {seq_len} x {world_size} = {per_micro:,}; "
            f"accepted: a multiple of {per_micro:,} (e.g. {max(per_micro, total_batch_size // per_micro * per_micro):,})")
    return BatchPlan(total_batch_size, device_batch_size, seq_len, world_size, total_batch_size // per_micro)


def fit_auto_batch(predicted: int, device_batch_size: int, seq_len: int, world_size: int) -> int:
    """Round an auto-computed batch up to a multiple of one micro-batch over all ranks."""
    per_micro = device_batch_size * seq_len * world_size
    return max(1, math.ceil(predicted / per_micro)) * per_micro


def resolve_total_batch_size(requested: int, target_tokens: float, ref_target_tokens: float,
                             device_batch_size: int, seq_len: int, world_size: int) -> int:
    """`--total-batch-size`: -1 = auto (`auto_total_batch_size` of the training horizon vs the
    reference depth's, rounded up to whole micro-batches); any other value is returned as given
    (plan_batch checks it). base_train and bench_train share this rule, so a benchmark's step is
    the step base_train would run."""
    if requested != -1:
        return requested
    return fit_auto_batch(auto_total_batch_size(target_tokens, ref_target_tokens), device_batch_size,
                          seq_len, world_size)


# ------------------------------------------------------------------------------------ schedules

@dataclass
class Schedule:
    """Per-step hyperparameter multipliers, applied to the optimizer before each step.

    lr:       warmup -> constant -> linear warmdown to final_lr_frac (optim.lr_multiplier)
    momentum: Muon momentum ramp (optim.muon_momentum), Muon groups only
    wd:       weight decay multiplier (optim.weight_decay_multiplier: linear decay to 0)
    Each can be replaced by a callable (tests, other recipes); defaults come from optim.py.
    """

    num_iterations: int
    warmup_ratio: float = 0.0
    warmdown_ratio: float = 0.4
    final_lr_frac: float = 0.0
    warmup_steps: int = 0                               # > 0: the warmup in steps (wins over the ratio)
    lr_fn: Callable[..., float] | None = None          # (step, num_iterations, **ratios) -> mult
    momentum_fn: Callable[[int], float] | None = None   # step -> Muon momentum
    wd_fn: Callable[[int, int], float] | None = None    # (step, num_iterations) -> mult

    def validate(self) -> "Schedule":
        require_int(self.num_iterations, "--num-iterations")
        require_float(self.warmup_ratio, "--warmup-ratio", 0.0, 1.0)
        require_float(self.warmdown_ratio, "--warmdown-ratio", 0.0, 1.0)
        require(self.warmup_ratio + self.warmdown_ratio <= 1.0, "--warmup-ratio + --warmdown-ratio",
                self.warmup_ratio + self.warmdown_ratio, "<= 1")
        require_float(self.final_lr_frac, "--final-lr-frac", 0.0, 1.0)
        require_int(self.warmup_steps, "--warmup-steps", 0)
        require(not (self.warmup_steps and self.warmup_ratio), "--warmup-steps and --warmup-ratio",
                f"{self.warmup_steps} and {self.warmup_ratio}", "one of the two (the other 0)")
        return self

    def _defaults(self) -> None:
        if self.lr_fn is None or self.momentum_fn is None or self.wd_fn is None:
            from nanochat import optim
            self.lr_fn = self.lr_fn or optim.lr_multiplier
            self.momentum_fn = self.momentum_fn or optim.muon_momentum
            self.wd_fn = self.wd_fn or optim.weight_decay_multiplier

    def multipliers(self, step: int) -> tuple[float, float, float]:
        """(lr multiplier, Muon momentum, weight-decay multiplier) at `step`."""
        self._defaults()
        lrm = float(self.lr_fn(step, self.num_iterations, warmup_ratio=self.warmup_ratio,
                               warmdown_ratio=self.warmdown_ratio, final_lr_frac=self.final_lr_frac,
                               warmup_steps=self.warmup_steps))
        return lrm, float(self.momentum_fn(step)), float(self.wd_fn(step, self.num_iterations))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set lr / momentum / weight decay for `step` on every group; returns the lr multiplier."""
        lrm, momentum, wdm = self.multipliers(step)
        if hasattr(optimizer, "set_hparams"):  # MuonAdamW knows its own group kinds
            optimizer.set_hparams(lr_mult=lrm, momentum=momentum, wd_mult=wdm)
            return lrm
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if "initial_weight_decay" in group:
                group["weight_decay"] = group["initial_weight_decay"] * wdm
            if group.get("kind") == "muon":
                group["momentum"] = momentum
        return lrm


# ------------------------------------------------------------------------------------ RNG / loop state

def capture_rng_state() -> dict:
    """Every RNG a step can touch, in types torch.load(weights_only=True) accepts."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    return state


def restore_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch_cpu"].cpu())
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"].cpu())
    if "numpy" in state:
        import numpy as np
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ------------------------------------------------------------------------------------ the step

@dataclass
class StepResult:
    step: int
    loss: float            # mean training loss of the step (all micro-batches, all ranks)
    lrm: float             # learning-rate multiplier applied
    dt: float              # seconds, device-synchronised
    tokens: int            # tokens processed by the step (all ranks)
    grad_norm: float | None = None


def casts_pay(grad_accum_steps: int, dtype: torch.dtype) -> bool:
    """Whether weight_cache's once-per-step casts (and gradient sinks) save work: only when a step
    accumulates micro-batches and computes in a dtype narrower than the float32 masters."""
    return grad_accum_steps > 1 and dtype != torch.float32


class Trainer:
    """Runs optimizer steps: micro-batches with loss scaling, optional grad clipping, schedules,
    optimizer step, zero_grad(set_to_none). Holds the one prefetched batch so that the loader
    state it reports always resumes at exactly the next unseen batch.

    `model(x, y)` must return the mean loss (float32 scalar); with `token_weighted=True` it is
    called as `model(x, y, loss_reduction="sum")` and the step normalises by the number of
    target tokens != -1 across all micro-batches and ranks (right for masked SFT batches).
    The optimizer reduces gradients across ranks itself (MuonAdamW), so the model is not DDP-wrapped.
    """

    def __init__(self, model, optimizer, loader: Iterable, plan: BatchPlan, schedule: Schedule, rt, *,
                 grad_clip: float | None = None, token_weighted: bool = False, hint: str | None = None,
                 cast_once: bool = True, grad_sinks: bool = True):
        self.model, self.optimizer, self.plan, self.schedule, self.rt = model, optimizer, plan, schedule, rt
        self.loader, self._iter = loader, iter(loader)
        self.grad_clip = grad_clip if grad_clip and grad_clip > 0 else None
        self.token_weighted, self.hint = token_weighted, hint or nonfinite_hint(self.grad_clip)
        self.last_checkpoint: str | None = None
        self._held = self._held_state = None  # prefetched (x, y) for the next step; loader state before it
        self._params = [p for p in model.parameters() if p.requires_grad]
        # cast the fp32 master weights to the compute dtype once per step, not per micro-batch
        # (nanochat/weight_cache.py; same numbers): only pays with accumulation and a narrower dtype
        self.cast_once = cast_once and casts_pay(plan.grad_accum_steps, rt.dtype)
        self.grad_sinks = grad_sinks   # with cast_once: the weights' gradients summed in place (same module)

    # -- data ---------------------------------------------------------------------------------
    def _next_batch(self):
        if self._held is not None:
            batch, self._held, self._held_state = self._held, None, None
            return batch
        return next(self._iter)

    def _prefetch(self) -> None:
        state = self.loader.state_dict() if hasattr(self.loader, "state_dict") else None
        try:
            self._held = next(self._iter)
        except StopIteration:
            self._held = None
            return
        self._held_state = state

    def loader_state(self) -> dict | None:
        """Loader state that resumes at the first batch the next step will use."""
        if self._held is not None:
            return self._held_state
        return self.loader.state_dict() if hasattr(self.loader, "state_dict") else None

    def note_checkpoint(self, path) -> None:
        self.last_checkpoint = str(path)

    # -- step ---------------------------------------------------------------------------------
    def step_context(self):
        """What a step's micro-batches run in: the once-per-step weight casts and gradient sinks
        (weight_cache.step_weights), which change the graph torch.compile traces (warm_up_ranks)."""
        return weight_cache.step_weights(self.model, self.rt.dtype, enabled=self.cast_once, sinks=self.grad_sinks)

    def step(self, step: int) -> StepResult:
        """One optimizer step at index `step` (0-based). Raises NonFiniteLossError."""
        rt, plan = self.rt, self.plan
        rt.synchronize()
        t0 = time.perf_counter()
        with self.step_context():
            loss_sum = self._accumulate_token_weighted() if self.token_weighted else self._accumulate_mean()
        loss = loss_sum.detach()
        if rt.world_size > 1:  # mean over ranks (SUM: gloo has no AVG); a nan anywhere stops every rank
            import torch.distributed as dist
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            loss = loss / rt.world_size
        grad_norm = None
        # MuonAdamW on several ranks (not FSDP) averages the gradients inside step(): a norm taken
        # here would be this rank's alone, so it clips there, on the global norm
        clip_in_step = self.grad_clip is not None and getattr(self.optimizer, "reduces_gradients", False)
        if self.grad_clip is not None and not clip_in_step:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, self.grad_clip))
        lrm = self.schedule.apply(self.optimizer, step)
        if grad_norm is None or math.isfinite(grad_norm):
            if clip_in_step:
                self.optimizer.step(max_norm=self.grad_clip)
                grad_norm = self.optimizer.grad_norm
            else:
                self.optimizer.step()
        if grad_norm is not None and not math.isfinite(grad_norm):   # every rank sees the same norm
            raise NonFiniteLossError(step, "gradient norm", grad_norm, self.last_checkpoint, self.hint)
        self.model.zero_grad(set_to_none=True)
        loss_f = float(loss)  # one host sync per step
        rt.synchronize()
        dt = time.perf_counter() - t0
        if not math.isfinite(loss_f):
            raise NonFiniteLossError(step, "loss", loss_f, self.last_checkpoint, self.hint)
        return StepResult(step, loss_f, lrm, dt, plan.total_batch_size, grad_norm)

    def _accumulate_mean(self) -> torch.Tensor:
        n = self.plan.grad_accum_steps
        x, y = self._next_batch()
        total = torch.zeros((), device=self.rt.device, dtype=torch.float32)
        for micro in range(n):
            loss = self.model(x, y)
            total += loss.detach().float()
            (loss / n).backward()  # each backward sums into .grad: scale so the step sees the mean
            if micro < n - 1:
                x, y = self._next_batch()
            else:
                self._prefetch()   # overlaps host-side loading with the queued device work
        return total / n

    def _accumulate_token_weighted(self) -> torch.Tensor:
        batches = [self._next_batch() for _ in range(self.plan.grad_accum_steps)]
        self._prefetch()
        count = sum((y >= 0).sum() for _, y in batches).float()
        if self.rt.world_size > 1:
            import torch.distributed as dist
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
        # Local sum / global count: the optimizer's cross-rank gradient average multiplies by 1/world.
        denom = count.clamp(min=1.0) / self.rt.world_size
        total = torch.zeros((), device=self.rt.device, dtype=torch.float32)
        for x, y in batches:
            loss_sum = self.model(x, y, loss_reduction="sum")
            total += loss_sum.detach().float()
            (loss_sum / denom).backward()
        return total / denom

    # -- loop state -----------------------------------------------------------------------------
    def loop_state(self, step: int, meter: "StepMeter | None" = None, **extra) -> dict:
        """What a checkpoint needs besides model/optimizer/loader: the next step, RNG, meter."""
        return {"step": step, "rng": capture_rng_state(),
                "meter": meter.state_dict() if meter is not None else None, **extra}


# ------------------------------------------------------------------------------------ model set-up

def resolve_compile(flag: bool | None, rt, say: Callable[[str], None] | None = None) -> bool:
    """--compile / --no-compile as given; left out (auto): on for CUDA unless Triton cannot build
    kernels for this GPU (platform.ptxas_problem: no Triton, a GPU older than cc 7.0, no usable
    ptxas), and then off with one start-up line saying why. Without it the auto default was refused
    there (the rules: only auto choices fall back)."""
    if flag is not None:
        return flag
    if rt.device_type != "cuda":
        return False
    from nanochat.platform import detect_device, ptxas_problem
    problem = ptxas_problem(detect_device(rt.device))
    if problem is not None:
        from nanochat.common import print0
        (say or print0)(f"compile: off (auto; --compile forces it): {problem}")
    return problem is None


def setup_precision_and_kernel(model, precision: str, kernel: str, rt, *, compile: bool,
                               precision_backend: str = "auto", fp8_wgrad: str = "save") -> dict:
    """Platform workarounds, the --precision recipe and the --kernel loss backend, applied to
    `model` before it is compiled. Returns what was resolved (for the banner and the checkpoint):
    keys precision (bf16|fp32|fp8|nvfp4), peak_key (which peak FLOP/s applies), kernel, patches, ..."""
    from nanochat.kernel_fusions import build_mix_norm, build_mlp, build_qkv_projection, build_rotary_norm
    from nanochat.kernels import build_loss_fn
    from nanochat.platform import apply_patches, apply_runtime_patches, detect_device

    spec = detect_device(rt.device)
    patches = apply_patches(spec, kernel=kernel, compile=compile)
    if spec.is_cuda:   # and init_runtime's set, whatever the flags (as the preflight report names them):
        # with --no-compile the banner and checkpoint left out the ptxas and is_big_gpu it had applied
        patches += [name for name in apply_runtime_patches(spec) if name not in patches]
    resolved = apply_precision(model, precision, rt, backend=precision_backend, compile=compile,
                               fp8_wgrad=fp8_wgrad)
    if kernel != "current":
        model.set_loss_fn(build_loss_fn(kernel, rt.device))
    mix = build_mix_norm(kernel, rt.device)
    mlp = build_mlp(kernel, rt.device, resolved["precision"], layer=model.blocks[0].mlp.c_fc)
    rotary = build_rotary_norm(kernel, rt.device)
    model.set_mix_norm(mix)
    model.set_mlp_fn(mlp)
    model.set_rotary_norm(rotary)
    qk = build_qkv_projection(kernel, rt.device)
    model.set_qkv_projection(qk)
    qk_fp8 = qk is not None and resolved.get("fp8_wgrad") == "save"   # native fp8 layers it fuses
    qk_gemm = qk is not None and qk.keywords["bf16_gemm"] and resolved["precision"] == "bf16"
    mlp_name = "relu2_mlp" if resolved["precision"] != "fp8" else "relu2_mlp_fp8"
    # the fp8 MLP's relu^2 gradient cast in its GEMM's epilogue (e5m2 gradients: triton_mlp.gh_bound_scale)
    gh_cast = mlp is not None and getattr(mlp, "keywords", {}).get("grad_dtype") == torch.float8_e5m2
    fused = [name for name, on in (("linear_ce", kernel != "current"), ("mix_norm", mix is not None),
                                   ("mix_add", mix is not None and model.mix_norm_fuses_add),
                                   ("x0_grad_acc", mix is not None and model.mix_norm_chains_x0),
                                   ("rotary_norm", rotary is not None), (mlp_name, mlp is not None),
                                   ("qk_amax_fp8", qk_fp8), ("gh_cast_fp8", gh_cast),
                                   ("qk_rope_gemm", qk_gemm)) if on]
    return {**resolved, "kernel": kernel, "kernel_fusions": ",".join(fused) or "none", "patches": patches}


def precision_module(precision: str):
    """nanochat.precision, or None when it is absent (then fp8/nvfp4 raise "not built yet")."""
    try:
        import nanochat.precision as P
    except ImportError:
        if precision in ("fp8", "nvfp4"):
            raise RequestError(f"--precision {precision}: not built yet (nanochat/precision.py is missing); "
                             "accepted now: auto|bf16|fp32") from None
        return None
    return P


def check_precision(precision: str, rt, backend: str = "auto") -> None:
    """Validate --precision/--precision-backend against the device before any model exists."""
    if (P := precision_module(precision)) is not None:
        from nanochat.platform import detect_device
        P.resolve(precision, backend, detect_device(rt.device), compute_dtype=rt.dtype_name)


def apply_precision(model, precision: str, rt, *, backend: str = "auto", compile: bool = True,
                    fp8_wgrad: str = "save") -> dict:
    """precision.py converts the model's linears for fp8/nvfp4; bf16/fp32 = the runtime dtype."""
    if (P := precision_module(precision)) is None:
        if fp8_wgrad != "save":
            raise RequestError(f"--fp8-wgrad {fp8_wgrad}: applies to --precision fp8 only (got {precision})")
        return {"precision": rt.dtype_name, "backend": "none", "peak_key": rt.dtype_name}
    return P.apply_precision(model, precision, rt, backend, compile=compile, fp8_wgrad=fp8_wgrad)


# ------------------------------------------------------------------------------------ compile warm-up

# --peak-flops of base_train, mid_train and chat_sft (one meaning, one text)
PEAK_FLOPS_HELP = ("dense bf16 FLOP/s of one device that MFU divides by (a GPU not in the device table, or a "
                   "measured figure); the fp8 / nvfp4 peak follows it by the dense ratio")


def check_peak_flops(value: float | None) -> None:
    """--peak-flops: not given (the device table's), or a finite FLOP/s of at least 1e9 (a figure in
    TFLOP/s, e.g. 989, would make MFU a million times too high)."""
    if value is not None:
        require_float(value, "--peak-flops", 1e9)


def warm_up_batch(batch_size: int, seq_len: int, vocab_size: int, device) -> torch.Tensor:
    """The loop's batch shape, arange-based: a warm-up draws no random numbers (exact resume)."""
    return torch.arange(batch_size * seq_len, device=device).remainder(vocab_size).view(batch_size, seq_len)


def compile_eval_forward(train_model, idx: torch.Tensor) -> None:
    """evaluate_bpb's call: eval mode, no grad, per-token losses (the graph torch.compile traces for
    it differs from the step's: mode, grad and loss reduction are all guarded on)."""
    train_model.eval()
    with torch.no_grad():
        train_model(idx, idx, loss_reduction="none")
    train_model.train()


def first_eval_step(eval_every: int, start_step: int, num_iterations: int,
                    evaluated_at: int | None = None) -> int | None:
    """The step of the loop's first evaluation (nanochat/loop.py's rule: step 0, every `eval_every`
    steps and the last, less the one the checkpoint a run resumes from made at its own step,
    `evaluated_at`); None: it never evaluates."""
    from nanochat.loop import _due
    step = start_step
    while eval_every > 0:
        last = step >= num_iterations
        if _due(eval_every, step, last) and evaluated_at != step:
            return step
        if last:
            return None
        step = min(num_iterations, (step // eval_every + 1) * eval_every)
    return None


def warm_up_compile(train_model, batch_size: int, seq_len: int, vocab_size: int, rt, *, compiled: bool,
                    eval_every: int, num_iterations: int, loop_state: dict | None = None,
                    loss_reduction: str | None = None, around=None, say=None) -> float | None:
    """Compile the loop's graphs before the loop where it would otherwise compile them mid-run, and
    say so in one line (`say`, default print0); returns the seconds taken (None: nothing ran).

    Several ranks: the step and (if it ever evaluates) the evaluation on every rank, then a timed
    barrier (distributed.warm_up_ranks, DESIGN.md pitfall 9). One process: the evaluation forward
    only, and only when the first evaluation is not at the loop's first step: a resume from a step
    that is not a multiple of --eval-every (or whose checkpoint evaluated there) first compiled it
    at its first evaluation, mid-run, with the run's memory in use (GB10's unified memory: pitfall 3).
    A run that evaluates at its first step compiles it there, before any training step (a warm-up
    would only repeat that forward); the step's own graph compiles in the first step either way.
    `loop_state`: the resumed checkpoint's (its step and evaluated_at); None for a fresh start."""
    if not compiled:
        return None
    from nanochat.common import print0
    say = say or print0
    start = loop_state["step"] if loop_state is not None else 0
    first = first_eval_step(eval_every, start, num_iterations, (loop_state or {}).get("evaluated_at"))
    if rt.world_size > 1:
        from nanochat.distributed import warm_up_ranks
        took = warm_up_ranks(train_model, batch_size, seq_len, vocab_size, rt.device, loss_reduction=loss_reduction,
                             around=around, evaluates=first is not None)
        say(f"compile warm-up on {rt.world_size} ranks: {took:.1f} s")
        return took
    if first is None or first == start:
        return None
    t0 = time.monotonic()
    compile_eval_forward(train_model, warm_up_batch(batch_size, seq_len, vocab_size, rt.device))
    took = time.monotonic() - t0
    say(f"compile warm-up: the evaluation graph compiled before the loop in {took:.1f} s (the first "
        f"evaluation is at step {first}, not at the first step {start})")
    return took


# ------------------------------------------------------------------------------------ evaluation
# (validation bpb: nanochat/eval_bpb.py)

def sample_prompts(model, tokenizer, prompts: Sequence[str], max_tokens: int = 16,
                   temperature: float = 0.0, seed: int = 42) -> list[str]:
    """Decode a short continuation of each prompt (greedy by default) with the Engine."""
    from nanochat.engine import Engine
    engine = Engine(model, tokenizer)
    out = []
    for prompt in prompts:
        tokens = tokenizer.encode(prompt, prepend="<|bos|>")
        samples, _ = engine.generate_batch(tokens, num_samples=1, max_tokens=max_tokens,
                                           temperature=temperature, seed=seed)
        out.append(tokenizer.decode(samples[0]))
    return out


DEFAULT_PROMPTS = [
    "The capital of France is",
    "The chemical symbol of gold is",
    "If yesterday was Friday, then tomorrow will be",
    "The opposite of hot is",
    "The planets of the solar system are:",
]


def resume_precision(saved_train: dict, now: dict, step: int) -> tuple[list[dict], str | None]:
    """A resume may change the precision (finish a diverging nvfp4 run in bf16: the master weights
    and optimizer state are the same in every precision), but it went unsaid and the next meta
    named only the new one. Returns the history ([{from_step, precision, backend}], the last this
    run's) and the line saying what changed (None: nothing). `saved_train`: the checkpoint's
    meta["train"]; `now`: apply_precision()'s description; `step`: where this run resumes."""
    def entry(d: dict, at: int) -> dict:
        return {"from_step": at, "precision": d.get("precision"), "backend": d.get("backend")}

    if saved_train.get("precision") is None:   # a checkpoint from before the field: nothing to compare
        return [entry(now, step)], None
    history = list(saved_train.get("precision_history") or [entry(saved_train, 0)])
    last = history[-1]
    if (last["precision"], last["backend"]) == (now.get("precision"), now.get("backend")):
        return history, None
    history = [h for h in history if h["from_step"] < step] + [entry(now, step)]
    return history, (f"--resume: steps {last['from_step']}-{step} of the checkpoint trained in --precision "
                     f"{last['precision']} (backend {last['backend']}); this run continues in --precision "
                     f"{now.get('precision')} (backend {now.get('backend')}) (train.precision_history in its meta)")
