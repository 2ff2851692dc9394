"""Pretrain the base model: python -m scripts.base_train [flags]   (or torchrun ... -m scripts.base_train)

The recipe, top to bottom: flags -> runtime -> tokenizer -> model config, batch arithmetic, recipe
and a resume's checks from its meta.json (plan_run: before any data is read or weights exist) -> data
(train and val loaders: damaged or mismatched shards fail here, in seconds) -> optional resume ->
model, precision, loss kernel, compile -> optimizer -> banner -> loop (eval bpb, samples,
checkpoints, one step, one log line) -> final checkpoint. The mechanics live in nanochat/training.py
and nanochat/checkpoint.py.

Tiny CPU example (seconds):
    python -m scripts.base_train --depth 2 --max-seq-len 64 --device-batch-size 4 \
        --total-batch-size 512 --num-iterations 20 --eval-every 10 --eval-tokens 2048
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import asdict, dataclass, fields, replace
from types import SimpleNamespace

import torch

from nanochat.attention import effective_backend, flex_compile_note, resolve_backend
from nanochat.checkpoint import check_resume_flags, read_meta
from nanochat.common import destroy_runtime, env_world_size, get_base_dir, init_runtime, print0
from nanochat.errors import RequestError
from nanochat.loop import (SETUP_STAGE_ENV, TRAIN_FLAG_HELP, LoopSpec, as_flags, launcher, log_stage_report,
                           resume_command, resume_loop_state, run_training_loop)
from nanochat.recipe import (DEFAULT_RECIPE, RECIPE_FLAGS, RECIPES, Horizon, plan_warnings, recipe_for_resume,
                             resolve_recipe)
from nanochat.resume_checks import check_resume_compatible, check_resume_step, resumed_total, say_config_changes, \
    say_schedule_changes
from nanochat.tracker import Tracker, check_wandb_flags, resolve_wandb_mode
from nanochat.eval_bpb import EvalSet, eval_loader, evaluate_bpb
from nanochat.training import (DEFAULT_PROMPTS, REF_DEPTH, Schedule, StepMeter, Trainer, describe_peaks, plan_batch,
                               PEAK_FLOPS_HELP, check_peak_flops, resolve_peak_flops, warm_up_compile,
                               resolve_total_batch_size, restore_rng_state, resume_precision, sample_prompts)
from nanochat.precision_request import check_request, runtime_dtype
from nanochat.flags import FlagParser, check_dir_flag, check_model_tag, require, require_float, require_int, script_main

PRECISIONS = ("auto", "bf16", "fp32", "fp8", "nvfp4")
KERNELS = ("current", "liger", "triton")
DEVICES = ("auto", "cpu", "cuda", "mps")
ATTN_BACKENDS = ("auto", "sdpa", "flex", "cudnn", "cudnn_fa4", "reference")
PRECISION_BACKENDS = ("auto", "te", "native", "torchao", "emulated")
FP8_WGRAD = ("save", "recompute", "plain")   # precision.FP8_WGRAD_MODES
SCHEDULE_FLAGS = ("warmup_ratio", "warmup_steps", "warmdown_ratio", "final_lr_frac")
# flags a resume's change of which another line names (the schedule, the optimizer's values, grad clip,
# precision; the banner: --seed, unused) or a check refuses (recipe, total batch): say_config_changes the others
SAID_ON_RESUME = ("resume", "overwrite", "model_tag", "recipe", "num_iterations", "grad_clip", "total_batch_size",
                  "precision", "precision_backend", "seed", *RECIPE_FLAGS)


@dataclass
class BaseTrainConfig:
    """Every flag of this script; `validate()` checks them before anything is built."""

    # model
    depth: int = 20
    aspect_ratio: int = 64                 # model dim = depth x aspect ratio (rounded to head dim)
    head_dim: int = 128
    max_seq_len: int = 2048
    window_pattern: str = "SSSL"           # per-layer attention: S = sliding window, L = full
    attn_backend: str = "auto"
    # horizon: --num-iterations, else --target-flops, else tokens = ratio x scaling params (Chinchilla ~20)
    num_iterations: int = -1
    target_flops: float = -1.0              # a compute budget in training FLOPs; -1 = off
    target_param_data_ratio: float = 20.0
    # batch: --total-batch-size -1 = auto from depth (training.auto_total_batch_size)
    device_batch_size: int = 32
    total_batch_size: int = -1
    # optimizer (Muon for matrices, AdamW for the rest) and schedules: --recipe sets them
    # (nanochat/recipe.py; a resumed run keeps its checkpoint's); a flag given overrides its value
    recipe: str | None = None               # v1|v2; default recipe.DEFAULT_RECIPE
    matrix_lr: float | None = None
    embedding_lr: float | None = None
    unembedding_lr: float | None = None
    scalar_lr: float | None = None
    weight_decay: float | None = None       # at d12 and 2^19 tokens a step (v2 scales it to the run)
    warmup_ratio: float | None = None
    warmup_steps: int | None = None
    warmdown_ratio: float | None = None
    final_lr_frac: float | None = None
    normuon_beta2: float | None = None      # 0 = plain Muon
    grad_clip: float = 0.0                  # 0 = off
    # evaluation, sampling, checkpoints (-1 or 0 = off, also at the last step; the last step is always saved)
    eval_every: int = 250
    eval_tokens: int = 10 * 524288
    sample_every: int = 2000
    save_every: int = -1
    keep_last: int = 0                      # > 0: keep this run's newest N checkpoints (older ones deleted)
    overwrite: bool = False                 # a fresh run may start in a tag that holds checkpoints (moved to earlier_runs/)
    resume: str | None = None               # "latest", a step number or "auto" (latest if any, else fresh)
    model_tag: str | None = None            # default d<depth>
    # runtime
    device: str = "auto"
    precision: str = "auto"
    precision_backend: str = "auto"         # fp8/nvfp4 implementation (precision.py)
    fp8_wgrad: str = "save"                 # native fp8: save|recompute|plain (speed vs memory)
    kernel: str = "current"
    compile: bool | None = None             # default: on for CUDA, off elsewhere
    fsdp: bool = False                      # FSDP2-shard weights/grads/optimizer state (torchrun)
    seed: int = 42
    peak_flops: float | None = None         # dense bf16 FLOP/s per device (unknown GPUs)
    data_dir: str | None = None
    run: str = "dummy"                      # wandb run name; "dummy" = no wandb
    wandb: str | None = None                # off|offline|online (default: offline iff --run given)

    def validate(self) -> "BaseTrainConfig":
        check_model_tag(self.model_tag, new=True)   # a run writes under it
        require_int(self.depth, "--depth", 1)
        require(self.depth <= 256, "--depth", self.depth, "1..256")
        require_int(self.aspect_ratio, "--aspect-ratio", 1)
        require_int(self.head_dim, "--head-dim", 8)
        require(self.head_dim % 2 == 0, "--head-dim", self.head_dim, "an even number (rotary embeddings)")
        require_int(self.max_seq_len, "--max-seq-len", 8)
        require(bool(self.window_pattern) and set(self.window_pattern.upper()) <= {"S", "L"},
                "--window-pattern", self.window_pattern, "a non-empty string of S and L (e.g. SSSL, L)")
        self.window_pattern = self.window_pattern.upper()   # accepted in either case; GPTConfig wants S/L
        require(self.attn_backend in ATTN_BACKENDS, "--attn-backend", self.attn_backend, "|".join(ATTN_BACKENDS))
        require_int(self.num_iterations, "--num-iterations", 1, allow=(-1,))
        require_float(self.target_param_data_ratio, "--target-param-data-ratio", 0.0, low_inclusive=False)
        if self.target_flops != -1:   # one horizon: the steps or the budget, not both
            require(isinstance(self.target_flops, (int, float)) and math.isfinite(self.target_flops)
                    and self.target_flops > 0, "--target-flops", self.target_flops, "a finite number > 0, or -1: off")
            require(self.num_iterations == -1, "--num-iterations and --target-flops",
                    f"{self.num_iterations} and {self.target_flops:g}", "one of the two (the other -1)")
        require_int(self.device_batch_size, "--device-batch-size", 1)
        require_int(self.total_batch_size, "--total-batch-size", 1, allow=(-1,))
        require(self.recipe is None or self.recipe in RECIPES, "--recipe", self.recipe, "|".join(RECIPES))
        for flag in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay", "grad_clip"):
            if getattr(self, flag) is not None:
                require_float(getattr(self, flag), "--" + flag.replace("_", "-"), 0.0)
        if self.normuon_beta2 is not None:
            require_float(self.normuon_beta2, "--normuon-beta2", 0.0)
            require(self.normuon_beta2 < 1, "--normuon-beta2", self.normuon_beta2, "a number in [0, 1) (0 = off)")
        if self.warmup_steps is not None:
            require_int(self.warmup_steps, "--warmup-steps", 0)
        sched = {k: getattr(self, k) for k in ("warmup_ratio", "warmdown_ratio", "final_lr_frac", "warmup_steps")
                 if getattr(self, k) is not None}   # each value's range; their sum here only if both are flags:
        Schedule(1, **{"warmdown_ratio": 0.0, **sched}).validate()   # else recipe.schedule's, with the recipe's value
        if self.resume is None:   # a fresh run's recipe + flags (a resume takes its checkpoint's recipe, later)
            resolve_recipe(self.recipe or DEFAULT_RECIPE, {k: getattr(self, k) for k in RECIPE_FLAGS},
                           total_batch_size=1, target_tokens=1, ref_tokens=1).schedule(1)
        for flag in ("eval_every", "sample_every", "save_every"):
            require_int(getattr(self, flag), "--" + flag.replace("_", "-"), 1, allow=(-1, 0))
        world = env_world_size()   # a malformed WORLD_SIZE / RANK named
        per_micro = self.device_batch_size * self.max_seq_len   # one batch in all: ranks without one still pair up
        require_int(self.eval_tokens, "--eval-tokens", 1)
        require(self.eval_tokens >= per_micro, "--eval-tokens", self.eval_tokens,
                f"at least one micro-batch, --device-batch-size x --max-seq-len = "
                f"{self.device_batch_size} x {self.max_seq_len} = {per_micro:,}")
        if self.total_batch_size != -1:  # explicit batch: check the arithmetic now (raises with numbers)
            plan_batch(self.total_batch_size, self.device_batch_size, self.max_seq_len, world)
        check_resume_flags(self.resume, self.overwrite)
        require_int(self.keep_last, "--keep-last", 0)
        require(self.device in DEVICES, "--device", self.device, "|".join(DEVICES))
        require(self.precision in PRECISIONS, "--precision", self.precision, "|".join(PRECISIONS))
        runtime_dtype(self.precision)   # $NANOCHAT_DTYPE that disagrees with --precision: refused, naming both
        require(self.precision_backend in PRECISION_BACKENDS, "--precision-backend", self.precision_backend,
                "|".join(PRECISION_BACKENDS))
        require(self.kernel in KERNELS, "--kernel", self.kernel, "|".join(KERNELS))
        require(self.fp8_wgrad in FP8_WGRAD, "--fp8-wgrad", self.fp8_wgrad, "|".join(FP8_WGRAD))
        if self.fp8_wgrad != "save":
            require(self.precision == "fp8" and self.precision_backend in ("auto", "native"), "--fp8-wgrad",
                    self.fp8_wgrad, "save unless --precision fp8 with the native backend")
        if self.precision == "fp8" or (self.precision == "nvfp4" and self.precision_backend != "emulated"):
            # fp8 GEMMs (other micro-batches ran bf16) and TE's nvfp4 quantiser take rows in multiples
            # of 16; the emulation quantises along K only
            require(self.device_batch_size * self.max_seq_len % 16 == 0, "--max-seq-len", self.max_seq_len,
                    f"with --precision {self.precision}, --device-batch-size x --max-seq-len a multiple of 16")
        if self.fsdp:  # FSDP2 needs a process group (torchrun, any WORLD_SIZE >= 1) and collective-only work
            if "RANK" not in os.environ:   # not require(): its "got True" says nothing
                raise RequestError("--fsdp needs a torchrun launch (torchrun --nproc_per_node=N -m scripts.base_train "
                                   "--fsdp ...): it shards the model over that run's processes; without torchrun, "
                                   "leave --fsdp out")
            require(self.sample_every <= 0, "--sample-every", self.sample_every,
                    "-1 with --fsdp (sampling runs on rank 0 alone; sharded weights need every rank)")
            require(self.precision in ("auto", "bf16", "fp32"), "--precision", self.precision,
                    "auto|bf16|fp32 with --fsdp (fp8/nvfp4 modules are not FSDP-tested)")
        require_int(self.seed, "--seed", 0)
        check_peak_flops(self.peak_flops)
        if self.data_dir is not None:   # saved absolute: base_eval reads it back (from its own working dir)
            check_dir_flag(self.data_dir, "--data-dir", "an existing directory of *.parquet shards")
            self.data_dir = os.path.abspath(self.data_dir)
        check_wandb_flags(self.wandb, self.run)
        return self


_FLAG_TYPES = {"int": int, "float": float, "str": str, "str | None": str, "float | None": float, "int | None": int}


BASE_FLAG_HELP = {   # what a flag does where "default: X" alone does not say it (nanochat/loop.py: the shared ones)
    **TRAIN_FLAG_HELP,
    "aspect_ratio": "model dim = --depth x this, rounded to --head-dim",
    "window_pattern": "per-layer attention, repeated over the layers: S = sliding window, L = full (e.g. SSSL, L)",
    "attn_backend": f"{'|'.join(ATTN_BACKENDS)} (auto: the best that passes its probe on this device)",
    "num_iterations": "optimizer steps; -1: --target-param-data-ratio x scaling params (or --target-flops / "
                      "FLOPs per token) / --total-batch-size",
    "target_flops": "the horizon as a compute budget in training FLOPs (e.g. 1e18), in place of "
                    "--target-param-data-ratio; -1: off",
    "target_param_data_ratio": "training tokens per scaling parameter when --num-iterations and --target-flops are -1",
    "total_batch_size": "tokens per optimizer step (gradient accumulation fills it); -1: auto from --depth",
    # not the shared text: base_train's auto never sets a run aside because its flags differ (days of
    # pretraining): such a resume is refused as with latest, naming the flag
    "resume": "continue this --model-tag's run: latest, a step number, or auto (latest when the tag has one, "
              "refused like latest when these flags cannot continue it; else a fresh start); not given: a fresh start",
    "eval_tokens": "validation tokens per evaluation, in whole micro-batches (of all ranks together; read "
                   "once, then kept in host memory: 8 bytes a token)",
    "sample_every": "N: print samples every N steps and at the last step; -1 or 0: never",
    "model_tag": "the checkpoint directory's name under checkpoints/base/; not given: d<depth>",
    "precision": f"{'|'.join(PRECISIONS)} (auto: $NANOCHAT_DTYPE, else bf16 on a GPU that has it, else fp32)",
    "precision_backend": f"{'|'.join(PRECISION_BACKENDS)}: the fp8 / nvfp4 implementation",
    "fp8_wgrad": f"{'|'.join(FP8_WGRAD)}: how native fp8 keeps what its weight gradient needs (recompute, "
                 "plain: ~10 GiB less at d20, a little slower)",
    "peak_flops": PEAK_FLOPS_HELP,
    "fsdp": "shard weights, gradients and optimizer state over the ranks (FSDP2; a torchrun launch)",
    "data_dir": "a directory of *.parquet text shards; not given: <base dir>/base_data",
}


def _flag_help(name: str, default) -> str:
    if name == "eval_every":
        return ("N: evaluate val bpb at step 0, every N steps and at the last step; -1 or 0: never, "
                f"not even at the last step; default: {default}")
    if name == "recipe":
        return (f"optimizer recipe: {'|'.join(RECIPES)} (nanochat/recipe.py); default {DEFAULT_RECIPE}, "
                "or the checkpoint's when resuming")
    if name in RECIPE_FLAGS:
        values = ", ".join(f"{r} {RECIPES[r][name]}" for r in RECIPES)
        scaled = {"weight_decay": ", under v2 x sqrt(batch / 2^19) x d12's horizon / this depth's (both "
                                  "--target-param-data-ratio x scaling params, whatever --num-iterations says)"}.get(
            name, ", under v2 x sqrt(batch / 2^19)" if name.endswith("_lr") else "")
        return f"default: from --recipe ({values}){scaled}"
    about = BASE_FLAG_HELP.get(name)
    return (f"{about}; " if about else "") + f"default: {default}"


def parse_config(argv: list[str] | None = None) -> BaseTrainConfig:
    """Flags (dash or underscore spellings) -> a validated BaseTrainConfig; ValueError names the flag."""
    parser = FlagParser(prog="python -m scripts.base_train", description="Pretrain the base model.")
    defaults = BaseTrainConfig()
    for f in fields(BaseTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", "bool | None"):   # --x / --no-x; None (--compile's): auto
            default = getattr(defaults, f.name)
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_flag_help(
                f.name, default if default is not None else "on for CUDA (off where Triton cannot build kernels for "
                "the GPU, said at the start), off elsewhere"))
        else:
            default = getattr(defaults, f.name)
            parser.add_argument(flag, type=_FLAG_TYPES[f.type], default=default, help=_flag_help(f.name, default))
    return BaseTrainConfig(**vars(parser.parse_args(argv))).validate()


def plan_run(cfg: BaseTrainConfig, tokenizer, world_size: int, ckpt_dir, log=print0) -> SimpleNamespace:
    """What the flags, the tokenizer and a resume's meta.json decide before any data is read or
    weights exist: the model's shape (meta device), horizon, batch, recipe, and a resume's checks (the
    checkpoint there, its model, batch, world, tokenizer and recipe, its step within the horizon) or a
    fresh start's (a tag holding checkpoints). Each refusal names its flag; cfg.recipe becomes the one
    trained (a resume's: the checkpoint's). run_train.sh calls it before its background start."""
    from nanochat.checkpoint import fresh_start, resolve_resume, resolve_step
    from nanochat.gpt import GPT, config_for_depth

    def shapes(config, **kwargs):   # on the meta device: no memory, no init (as precision_request's check)
        with torch.device("meta"):
            return GPT(config, **kwargs)

    def config_at(depth: int):
        return config_for_depth(depth, tokenizer.vocab_size, cfg.max_seq_len, aspect_ratio=cfg.aspect_ratio,
                                head_dim=cfg.head_dim, window_pattern=cfg.window_pattern)

    model_config = config_at(cfg.depth)
    meta_model = shapes(model_config, attn_backend=cfg.attn_backend)
    horizon = Horizon(cfg.num_iterations, cfg.target_flops, cfg.target_param_data_ratio, meta_model.estimate_flops(),
                      meta_model.num_scaling_params(), shapes(config_at(REF_DEPTH)).num_scaling_params(),
                      ratio_given=cfg.target_param_data_ratio != BaseTrainConfig.target_param_data_ratio)
    resume_at = resolve_resume(cfg.resume, ckpt_dir, log=log)
    resume_step = resolve_step(ckpt_dir, resume_at) if resume_at is not None else None
    saved_meta = read_meta(ckpt_dir, resume_step) if resume_at is not None else None
    total_batch_size = resolve_total_batch_size(
        resumed_total(cfg.total_batch_size, cfg.device_batch_size, cfg.max_seq_len, saved_meta, world_size),
        horizon.target_tokens, horizon.ref_tokens, cfg.device_batch_size, cfg.max_seq_len, world_size)
    plan = plan_batch(total_batch_size, cfg.device_batch_size, cfg.max_seq_len, world_size)
    num_iterations = horizon.steps(total_batch_size)
    earlier = None   # a fresh run's earlier one: moved to earlier_runs/<N>/ at the first save
    if saved_meta is None:
        earlier = fresh_start(ckpt_dir, cfg.resume, cfg.overwrite)
    else:
        check_resume_compatible(saved_meta, asdict(model_config), plan, world_size, tokenizer.fingerprint,
                                fsdp=cfg.fsdp)
        check_resume_step(resume_step, num_iterations, ckpt_dir)
    # the recipe (nanochat/recipe.py): LRs, weight decay, schedules; a resume's from meta.json
    cfg.recipe = recipe_for_resume(cfg.recipe, saved_meta.get("config", {}) if saved_meta is not None else None)
    recipe = resolve_recipe(cfg.recipe, {k: getattr(cfg, k) for k in RECIPE_FLAGS}, total_batch_size=total_batch_size,
                            target_tokens=horizon.target_tokens, ref_tokens=horizon.ref_tokens)
    return SimpleNamespace(model_config=model_config, meta_model=meta_model, horizon=horizon, plan=plan,
                           total_batch_size=total_batch_size, num_iterations=num_iterations, resume_step=resume_step,
                           saved_meta=saved_meta, earlier=earlier, recipe=recipe, schedule=recipe.schedule(num_iterations))


def say_grad_clip_change(saved, now: float) -> str | None:
    """A resume clips as this run's --grad-clip says: one line when that differs from the checkpoint's
    run (a --grad-clip left off the resume turned clipping off without a word, and the losses parted
    from the uninterrupted run's). None: the same (or a checkpoint that recorded none)."""
    if not isinstance(saved, (int, float)) or float(saved or 0) == float(now or 0):
        return None
    line = (f"--resume: gradient clipping follows this run's flags, not the checkpoint's: --grad-clip "
            f"{saved:g} -> {now:g}" + (" (off)" if not now else "")
            + (f"; pass --grad-clip {saved:g} to continue as before" if saved else ""))
    print0(line)
    return line


# ----------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict:
    """Parse, validate, train; returns the run summary (also printed)."""
    return run(parse_config(argv))


def run(cfg: BaseTrainConfig) -> dict:
    rt = init_runtime(cfg.device, runtime_dtype(cfg.precision), cfg.seed, dtype_flag=f"--precision {cfg.precision}")
    try:
        return train(cfg, rt)
    finally:
        destroy_runtime(rt)


def train(cfg: BaseTrainConfig, rt) -> dict:
    from nanochat.checkpoint import (branch_start, build_model, checkpoint_bytes, checkpoint_dir, disk_plan,
                                     load_checkpoint, planned_saves, save_checkpoint, step_dirname)
    from nanochat.dataloader import DataLoader
    from nanochat.gpt import config_for_depth
    from nanochat.optim import build_optimizer
    from nanochat.tokenizer import get_token_bytes, get_tokenizer
    from nanochat.attention import check_training_backend
    from nanochat.kernels import check_kernel
    from nanochat.checkpoint_io import CheckpointError
    from nanochat.distributed import check_shared_dir, failing_together
    from nanochat.training import resolve_compile, setup_precision_and_kernel
    from nanochat.writer_lock import claim_checkpoint_dir

    # can this device run these? (raises; before the checkpoint directory exists: a refused run left
    # one holding only its writer lock)
    compile_model = resolve_compile(cfg.compile, rt)
    check_request(cfg.precision, cfg.precision_backend, rt, config_for_depth(   # + fp8/nvfp4 widths (any vocab)
        cfg.depth, 1, cfg.max_seq_len, aspect_ratio=cfg.aspect_ratio, head_dim=cfg.head_dim), compile=compile_model)
    check_kernel(cfg.kernel, rt.device, compile=compile_model)
    check_training_backend(cfg.attn_backend, rt.device, rt.dtype)

    base_dir = get_base_dir()
    model_tag = cfg.model_tag or f"d{cfg.depth}"
    given = replace(cfg)   # the flags as given (cfg.recipe is resolved below): the resume command's
    ckpt_dir = checkpoint_dir("base", model_tag, base_dir)
    check_shared_dir(ckpt_dir)   # every rank writes into the step directory rank 0 renames (several nodes: a shared FS)
    claim_checkpoint_dir(ckpt_dir)   # one run per directory (nanochat/writer_lock.py), held until exit

    # ---- tokenizer ----
    tokenizer = get_tokenizer(base_dir)
    token_bytes = get_token_bytes(device=rt.device, base_dir=base_dir)

    # ---- model shape, horizon, batch arithmetic, recipe; a resume's checks from its meta.json: each
    # refusal before the data is read, the weights load (GBs) or any model exists ----
    run_plan = plan_run(cfg, tokenizer, rt.world_size, ckpt_dir)
    model_config, meta_model, horizon, plan = run_plan.model_config, run_plan.meta_model, run_plan.horizon, run_plan.plan
    total_batch_size, num_iterations, resume_step = run_plan.total_batch_size, run_plan.num_iterations, run_plan.resume_step
    saved_meta, earlier, recipe, schedule = run_plan.saved_meta, run_plan.earlier, run_plan.recipe, run_plan.schedule
    target_tokens, ref_tokens = horizon.target_tokens, horizon.ref_tokens
    flops_per_token, scaling_params = meta_model.estimate_flops(), meta_model.num_scaling_params()
    num_params = sum(p.numel() for p in meta_model.parameters())
    eval_batches = cfg.eval_tokens // (cfg.device_batch_size * cfg.max_seq_len)   # of all ranks together

    # ---- data: constructing the loaders opens and checks every shard (DataError / MissingDataError)
    # before any model exists; batches are only produced once training starts ----
    loader_kwargs = dict(device=rt.device, data_dir=cfg.data_dir, rank=rt.rank, world_size=rt.world_size)
    train_loader = DataLoader(tokenizer, cfg.device_batch_size, cfg.max_seq_len, "train", **loader_kwargs)

    # one finite pass, read whole on every rank and dealt (eval_bpb.py), as base_eval: the same val bpb
    # on any number of ranks. Checked now, read at the first evaluation (EvalSet keeps the batches): the
    # kind the train loader reads and the shards listed now, so a pretokenize run during training (its directory unfinished, then
    # one shard more: the last one, val, another) cannot fail an evaluation or move val mid-run
    def open_val():
        return eval_loader(tokenizer, cfg.device_batch_size, cfg.max_seq_len, "val", device=torch.device("cpu"),
                           data_dir=cfg.data_dir, source=train_loader.source_kind)   # EvalSet keeps it on the host

    val_loader = open_val()

    # ---- resume: the weights, optimizer and loader state of the checkpoint checked above ----
    resume = None
    if saved_meta is not None:
        # each rank reads its own shards: one rank's damaged file stops every rank here, naming it
        with failing_together(f"resuming {ckpt_dir / step_dirname(resume_step)}", CheckpointError):
            resume = load_checkpoint(ckpt_dir, resume_step, device=rt.device, rank=rt.rank, load_optimizer=True)
            if resume["loader"] is not None:
                train_loader.load_state_dict(resume["loader"])
        saved_cfg = saved_meta.get("config") or {}
        say_config_changes(saved_cfg, asdict(given), said=SAID_ON_RESUME)
        # later steps on disk are the run this one branches from: moved aside at the first save, not replaced
        earlier = branch_start(ckpt_dir, resume_step, f"--resume {cfg.resume}")
        if val_loader.source_kind != train_loader.source_kind:   # the loader went back to the checkpoint's kind
            val_loader = open_val()
        saved = resolve_recipe(cfg.recipe, {k: saved_cfg.get(k) for k in RECIPE_FLAGS},   # the checkpoint run's schedule
                               total_batch_size=total_batch_size, target_tokens=target_tokens, ref_tokens=ref_tokens)
        say_schedule_changes({"num_iterations": (saved_meta.get("train") or {}).get("num_iterations"),
                              **{k: getattr(saved, k) for k in SCHEDULE_FLAGS}},
                             {"num_iterations": num_iterations, **{k: getattr(recipe, k) for k in SCHEDULE_FLAGS}})
        say_grad_clip_change(saved_cfg.get("grad_clip"), cfg.grad_clip)

    # ---- disk: is there room for the checkpoints? (raises if not even one fits) ----
    first_step = resume["step"] if resume is not None else 0
    size = checkpoint_bytes(meta_model, normuon=recipe.normuon_beta2 > 0,   # v2: NorMuon's moments too
                            world_size=rt.world_size, fsdp=cfg.fsdp)
    disk = disk_plan(ckpt_dir, size, planned_saves(first_step, num_iterations, cfg.save_every), cfg.keep_last, earlier)
    disk += f"; {earlier.describe()}" if earlier is not None else ""

    # ---- model, precision, loss kernel, compile ----
    model = build_model(model_config, rt.device, attn_backend=cfg.attn_backend, compute_dtype=rt.dtype)
    if resume is not None:
        model.load_state_dict(resume["model"], strict=True)
    precision_info = setup_precision_and_kernel(model, cfg.precision, cfg.kernel, rt, compile=compile_model,
                                                precision_backend=cfg.precision_backend,
                                                fp8_wgrad=cfg.fp8_wgrad)
    precision_history = None   # which precision trained which steps, once a resume changed it
    if resume is not None:
        precision_history, note = resume_precision(resume["meta"].get("train") or {}, precision_info, resume["step"])
        if note is not None:
            print0(note)
    if cfg.fsdp:  # shard before compile and before the optimizer (it must see the DTensor params)
        from nanochat.distributed import apply_fsdp
        apply_fsdp(model, rt)
    train_model = torch.compile(model, dynamic=False) if compile_model else model

    # ---- optimizer ----
    optimizer = build_optimizer(model, **recipe.optimizer_kwargs(), world_size=rt.world_size, rank=rt.rank,
                                compile=None if compile_model else False)   # eager too when the model is
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])

    # ---- meter, tracker, trainer, loop state ----
    peak_bf16, peak_active, device_name = resolve_peak_flops(rt, precision_info["peak_key"], cfg.peak_flops,
                                                             warn=lambda m: print0(f"WARNING: {m}"))
    meter = StepMeter(flops_per_token, rt.world_size, peak_bf16=peak_bf16, peak_active=peak_active,
                      precision=precision_info["peak_key"], peak_memory=rt.peak_memory_bytes,
                      low_precision_flops=precision_info.get("low_precision_flops"))
    trainer = Trainer(train_model, optimizer, train_loader, plan, schedule, rt, grad_clip=cfg.grad_clip)
    # the loop's graphs compiled now, not inside a collective or a mid-run evaluation (DESIGN pitfalls 3, 9)
    warm_up_compile(train_model, cfg.device_batch_size, cfg.max_seq_len, tokenizer.vocab_size, rt, compiled=compile_model,
                    eval_every=cfg.eval_every, num_iterations=num_iterations, loop_state=resume and resume["loop"],
                    around=trainer.step_context)
    train_meta = {"num_iterations": num_iterations, "total_batch_size": total_batch_size,
                  "grad_accum_steps": plan.grad_accum_steps, "flops_per_token": flops_per_token,
                  "scaling_params": scaling_params, "num_params": num_params, "compile": compile_model,
                  "world_size": rt.world_size, "dtype": rt.dtype_name, "cast_once": trainer.cast_once,
                  # what auto chose (probe-dependent, so not in the flags): a slower resume is explainable
                  "attention": effective_backend(resolve_backend(cfg.attn_backend, rt.device), rt.dtype, rt.device),
                  **precision_info,
                  **({"precision_history": precision_history} if precision_history and len(precision_history) > 1
                     else {}),
                  # the LRs and weight decay this run applied (scaled to its batch and horizon): its
                  # flags alone do not say them ("recipe" above is precision.py's)
                  "optimizer_recipe": asdict(recipe)}
    # one namespace: train_meta's "recipe" (precision.py's) took the place of --recipe's name
    tracker = Tracker(resolve_wandb_mode(cfg.wandb, cfg.run), run=cfg.run, is_master=rt.is_master,
                      directory=str(base_dir), resume_state=resume and resume["loop"], branch=earlier is not None,
                      config={**asdict(cfg), **train_meta, "recipe": cfg.recipe,
                              "precision_recipe": train_meta.get("recipe")})
    step, resume_loop = resume_loop_state(resume, meter, trainer, ckpt_dir)

    passes = train_loader.pass_size()   # one pass over the training data (nanochat/data_passes.py)
    print_banner(cfg, rt, device_name, model_config, num_params, scaling_params, flops_per_token, plan,
                 num_iterations, eval_batches, compile_model, precision_info,
                 describe_peaks(rt, precision_info["peak_key"], peak_bf16, peak_active, cfg.peak_flops,
                                meter.peak_util, meter.low_share), ckpt_dir, optimizer,
                 tracker.describe(), resume_step=step if resume is not None else None, recipe=recipe,
                 cast_once=trainer.cast_once, data=train_loader.describe_source(), disk=disk,
                 iterations=horizon.describe(total_batch_size), passes=passes)
    planned = num_iterations * total_batch_size   # tokens; passes.warnings: when the data is read more than once
    for hint in plan_warnings(recipe, total_batch_size, rt.device_type, flops_per_token * planned) + passes.warnings(planned):
        print0(f"WARNING: {hint}")
    if resume is not None:  # last, so that model init above consumed nothing we restore
        restore_rng_state(resume_loop["rng"])

    val_set = EvalSet(lambda: (val_loader.rewind(), val_loader)[1], eval_batches, rt)

    def evaluate(_step: int) -> dict:
        model.eval()
        val_bpb = evaluate_bpb(train_model, val_set, val_set.steps, token_bytes)
        model.train()
        return {"val_bpb": val_bpb}

    def sample(_step: int) -> list[str]:
        model.eval()
        texts = sample_prompts(model, tokenizer, DEFAULT_PROMPTS, max_tokens=16)
        model.train()
        return texts

    def save(at: int, loop_state: dict):
        if earlier is not None:   # the earlier run moves aside once this one has trained up to a save
            earlier.settle(rt.is_master)
        meta = {"phase": "base", "model_tag": model_tag, "model_config": asdict(model_config),
                "train": train_meta, "config": asdict(cfg), "val_bpb": loop_state["val_bpb"],
                "tokenizer_fingerprint": tokenizer.fingerprint, "device_name": device_name}
        return save_checkpoint(ckpt_dir, at, model_state=model.state_dict(),
                               optimizer_state=optimizer.state_dict(), loader_state=trainer.loader_state(),
                               loop_state=loop_state, meta=meta, rank=rt.rank)

    # ---- the loop (nanochat/loop.py): eval / sample / save at a step, then the step ----
    spec = LoopSpec("base", num_iterations, eval_every=cfg.eval_every, sample_every=cfg.sample_every,
                    save_every=cfg.save_every, evaluate=evaluate, sample=sample, save=save,
                    is_master=rt.is_master, keep_last=cfg.keep_last,
                    resumed_from=ckpt_dir / step_dirname(resume["step"]) if resume is not None else None,
                    model_tag=model_tag,
                    resume_command=lambda **flags: resume_command("base_train", given, asdict(BaseTrainConfig()),
                                                                  model_tag, rt.world_size, **flags))
    result = run_training_loop(trainer, meter, spec, tracker, start_step=step, resume_state=resume_loop)
    val_bpb, min_val_bpb, losses = result.val_bpb, result.min_val_bpb, result.losses

    summary = {"model_tag": model_tag, "checkpoint_dir": str(ckpt_dir), "num_iterations": num_iterations,
               "final_val_bpb": val_bpb, "val_bpb_step": result.val_bpb_step,
               "min_val_bpb": min_val_bpb if min_val_bpb < math.inf else None,
               "avg_tok_per_sec": meter.average_tok_per_sec(), "avg_mfu": meter.average_mfu()[0],
               "peak_mem_gib": rt.peak_memory_bytes() / 2**30,
               # the whole run's, from step 0: a resume's earlier part too (its checkpoint carries the time)
               "total_time_s": round(result.elapsed_s, 2), "tokens_trained": result.step * total_batch_size,
               "training_flops": flops_per_token * result.step * total_batch_size,
               "resumed_from_step": resume["step"] if resume is not None else None}
    print0("done: " + json.dumps(summary))
    if not os.environ.get(SETUP_STAGE_ENV):   # setup.sh runs the next stage itself
        for what, script in (("evaluate it", "base_eval"), ("mid-train it for chat", "mid_train")):
            print0(f"next, {what}: {launcher(script, rt.world_size)} {shlex.join(as_flags('model_tag', model_tag))}")
    log_stage_report("Base model training", "base", config=asdict(cfg), result=result, meter=meter,
                     extra={**train_meta, **summary}, is_master=rt.is_master)
    summary["losses"] = losses  # raw per-step training losses of this process (tests, tooling)
    train_loader.close()
    tracker.finish()
    return summary


def print_banner(cfg, rt, device_name, model_config, num_params, scaling_params, flops_per_token, plan,
                 num_iterations, eval_batches, compile_model, precision_info, peaks: str, ckpt_dir, optimizer,
                 tracking, resume_step, recipe, cast_once: bool = False, data: str = "", disk: str = "",
                 iterations: str = "", passes=None) -> None:
    """Every resolved value, once, at start-up (rank 0)."""
    total_tokens = plan.total_batch_size * num_iterations
    attn = effective_backend(resolve_backend(cfg.attn_backend, rt.device), rt.dtype, rt.device)
    rows = [
        ("device", f"{rt.device} ({device_name}), world size {rt.world_size}, rank {rt.rank}"),
        ("data", data or "n/a"),
        ("compute dtype", rt.dtype_name),
        ("precision", json.dumps(precision_info)),
        ("kernel / compile / attention", f"{cfg.kernel} / {compile_model}{' (auto)' * (cfg.compile is None)} / "
         f"{cfg.attn_backend} -> {attn}{flex_compile_note(attn, rt.dtype, compiled=compile_model, device=rt.device)}"),
        ("model", ", ".join(f"{k}={v}" for k, v in asdict(model_config).items())),
        ("parameters", f"{num_params:,} total, {scaling_params:,} scaling"),
        ("FLOPs / token", f"{flops_per_token:.4e}"),
        ("batch", plan.describe() + (" (auto: --total-batch-size -1)" if cfg.total_batch_size == -1 else "")),
        ("weight casts", f"to {rt.dtype_name} once per optimizer step (nanochat/weight_cache.py)" if cast_once
                         else "per use"),
        ("iterations", iterations or f"{num_iterations:,}"),
        ("tokens", f"{total_tokens:,} (tokens : scaling params = {total_tokens / scaling_params:.2f})"),
        ("data passes", passes.describe(total_tokens) if passes is not None else "n/a"),
        ("training FLOPs", f"{flops_per_token * total_tokens:.4e}"),
        ("peak FLOP/s", peaks),
        ("recipe", f"{recipe.describe(num_iterations)}; grad clip {cfg.grad_clip or 'off'}"),
        ("eval", f"every {cfg.eval_every} steps, {eval_batches} x {cfg.device_batch_size * cfg.max_seq_len:,} tokens "
                 "(or the whole val split, if it holds fewer)" if cfg.eval_every > 0 else "off (--eval-every <= 0)"),
        ("samples / saves", (f"every {cfg.sample_every} steps (+ last)" if cfg.sample_every > 0 else "off") + " / "
                            + (f"every {cfg.save_every} steps (+ last)" if cfg.save_every > 0
                               else "at the last step only")),
        ("checkpoints", str(ckpt_dir) + (f" (resuming at step {resume_step})" if resume_step is not None else "")
                        + (f"; {disk}" if disk else "")),
        ("tracking", tracking),
        ("seed", f"{cfg.seed}" + (" (unused: a resume loads the weights and RNG state)" if resume_step is not None else "")),
    ]
    # a group's own momentum / weight_decay are build_optimizer's defaults (a fresh run: momentum 0.95,
    # never applied) or the checkpoint's last applied values (a resume, also under a new --weight-decay):
    # print the momentum the first step applies and the peak weight decay the schedule scales
    momentum = recipe.schedule(num_iterations).multipliers(resume_step or 0)[1]
    for i, group in enumerate(optimizer.param_groups):
        n = sum(p.numel() for p in group["params"])
        now = {**group, "momentum": round(momentum, 6), "weight_decay": group.get("initial_weight_decay",
                                                                                group.get("weight_decay"))}
        extra = {k: now[k] for k in ("kind", "momentum", "weight_decay", "betas", "beta2") if k in group}
        rows.append((f"LR group {i}", f"lr {group['initial_lr']:.5g}, {len(group['params'])} tensors, "
                                      f"{n:,} params {extra}"))
    width = max(len(k) for k, _ in rows)
    print0("=" * 100)
    for k, v in rows:
        print0(f"{k:<{width}} : {v}")
    print0("=" * 100)


if __name__ == "__main__":
    script_main("base_train", lambda: parse_config(sys.argv[1:]), lambda: main(sys.argv[1:]))
