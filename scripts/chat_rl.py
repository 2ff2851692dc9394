"""Reinforcement learning on GSM8K: python -m scripts.chat_rl [flags]   (or torchrun ...)

Loads the `sft` checkpoint (--source sft; mid also accepted), and per step samples --num-samples
completions for each of --examples-per-step GSM8K problems with the Engine (calculator tool on;
CUDA graphs on a GPU (--decode); --sample-batch-size rows per call, default all; a prompt with no
room for --max-new-tokens is skipped and counted),
rewards a correct final answer with 1, uses reward - group mean as the advantage and takes a
policy-gradient step on the sampled tokens (nanochat/rl.py). Evaluates greedy pass@1 on the first
--eval-examples GSM8K test problems (never one trained on: at most --test-holdout, and the --source
model's own --test-holdout) at step 0, every --eval-every steps and at the last step (-1 or
0: never, as base_train / mid_train / chat_sft) (with --eval-samples K also pass@1..K of K samples
drawn as training draws them, the figure upstream nanochat reports); saves the `rl` checkpoint under
the same tag (every --save-every steps and at the last step); the end names the chat_eval and
chat_web commands of that checkpoint.
-1 iterations = one pass over the training problems in whole steps (the last len % --examples-per-step
are left out). Loop: nanochat/loop.py.

Offline (no hub): --test-holdout N trains on the local GSM8K test file minus its first N problems.

Tiny CPU example:
    python -m scripts.chat_rl --device cpu --num-iterations 2 --examples-per-step 2 --num-samples 4 \
        --max-new-tokens 16 --test-holdout 100 --eval-examples 4
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass, fields

from nanochat.checkpoint import check_resume_flags
from nanochat.common import destroy_runtime, env_world_size, get_base_dir, init_runtime, print0
from nanochat.errors import RequestError
from nanochat.tracker import check_wandb_flags, resolve_wandb_mode
from nanochat.training import Schedule
from nanochat.flags import (FlagParser, check_dir_flag, check_model_tag, normalize_flags, require, require_float,
                            require_int, script_main)
from nanochat.loop import TRAIN_FLAG_HELP
from nanochat.sampling import GREEDY_BELOW, MAX_SEED   # the greedy cut; manual_seed's and the Engine's range

SOURCES = ("sft", "mid")
RL_MOMENTUM = 0.95   # Muon's, constant


@dataclass
class ChatRLConfig:
    source: str = "sft"
    model_tag: str | None = None
    step: str = "latest"
    num_iterations: int = -1                # -1 = one pass over the training problems
    examples_per_step: int = 16             # problems per optimizer step (all ranks)
    num_samples: int = 16                   # completions per problem (the advantage group)
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 50                         # 0 = off
    device_batch_size: int = 8              # sequences per forward/backward chunk
    sample_batch_size: int = 0              # rows per sampling call; 0 = a problem's whole group at once
    decode: str = "auto"                    # rollouts' Engine decode: auto = CUDA graphs on CUDA, else eager
    matrix_lr: float = 0.02
    embedding_lr: float = 0.2
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.5
    init_lr_frac: float = 0.05
    eval_every: int = 60
    eval_examples: int = 400
    eval_samples: int = 0                   # > 0: also sampled pass@1..K (--temperature/--top-k), as upstream reports
    save_every: int = 60
    keep_last: int = 0                      # > 0: keep this run's newest N checkpoints (older ones deleted)
    resume: str | None = None               # "latest", a step number or "auto" (latest if any, else fresh)
    overwrite: bool = False                 # a fresh run may start in a tag that holds rl checkpoints (moved to earlier_runs/)
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 42
    data_dir: str | None = None
    test_holdout: int = -1
    run: str = "dummy"
    wandb: str | None = None

    def validate(self) -> "ChatRLConfig":
        check_model_tag(self.model_tag, new=True)   # a run writes under it
        require(self.source in SOURCES, "--source", self.source, "|".join(SOURCES))
        require(self.step == "latest" or re.fullmatch("[0-9]+", self.step) is not None, "--step", self.step, "latest or a step number")
        require_int(self.num_iterations, "--num-iterations", 1, allow=(-1,))
        world = env_world_size()   # a RequestError naming a malformed WORLD_SIZE / RANK
        require_int(self.examples_per_step, "--examples-per-step", 1)
        require(self.examples_per_step % world == 0, "--examples-per-step", self.examples_per_step,
                f"a multiple of the world size {world}")
        require_int(self.num_samples, "--num-samples", 2)  # a group of one has zero advantage
        require_int(self.max_new_tokens, "--max-new-tokens", 1)
        # greedy sampling (a temperature below GREEDY_BELOW, or top-k 1) draws every sample of a
        # group alike: every advantage is 0 and RL trains nothing, silently (as --num-samples 1 would)
        require_float(self.temperature, "--temperature", 0.0, low_inclusive=False)
        require(self.temperature >= GREEDY_BELOW, "--temperature", self.temperature, f"a finite number >= "
                f"{GREEDY_BELOW} (below it sampling is greedy: every sample of a group alike, nothing trained)")
        require_int(self.top_k, "--top-k", 0)
        require(self.top_k != 1, "--top-k", self.top_k, "0 (off) or an integer >= 2 (top-k 1 samples greedily: "
                "every sample of a group alike, every advantage 0, nothing trained)")
        require_int(self.device_batch_size, "--device-batch-size", 1)
        require_int(self.sample_batch_size, "--sample-batch-size", 0)
        from nanochat.engine import DECODE_MODES
        require(self.decode in DECODE_MODES, "--decode", self.decode, "|".join(DECODE_MODES))
        for flag in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr"):
            require_float(getattr(self, flag), "--" + flag.replace("_", "-"), 0.0)
        require_float(self.init_lr_frac, "--init-lr-frac", 0.0, low_inclusive=False)
        for flag in ("eval_every", "save_every"):
            require_int(getattr(self, flag), "--" + flag.replace("_", "-"), 1, allow=(-1, 0))
        require_int(self.eval_examples, "--eval-examples", 1)
        require_int(self.eval_samples, "--eval-samples", 0)
        check_resume_flags(self.resume, self.overwrite)
        require_int(self.keep_last, "--keep-last", 0)
        require(self.device in ("auto", "cpu", "cuda", "mps"), "--device", self.device, "auto|cpu|cuda|mps")
        require(self.dtype in ("auto", "bf16", "fp32"), "--dtype", self.dtype, "auto|bf16|fp32")
        require(isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED, "--seed", self.seed,
                f"an integer in 0..{MAX_SEED}")
        require_int(self.test_holdout, "--test-holdout", 0, allow=(-1,))
        # the evaluation scores the first --test-holdout GSM8K test problems: 0 leaves it none
        require(self.test_holdout != 0 or self.eval_every <= 0, "--test-holdout", self.test_holdout,
                "-1 or >= 1 (the evaluation's held-out problems), or --eval-every -1 (or 0) to train without "
                "evaluating")
        check_wandb_flags(self.wandb, self.run)
        return self


_TYPES = {"int": int, "float": float, "str": str, "str | None": str}
# what 0 / -1 mean (nanochat/loop.py's rule, as base_train / mid_train / chat_sft say it)
FLAG_HELP = {
    **TRAIN_FLAG_HELP,
    "source": f"{'|'.join(SOURCES)}: the checkpoint phase to start from",
    "model_tag": "the model tag of the --source checkpoint, and of the rl checkpoint; not given: the --source "
                 "phase's only tag, or its deepest d<N>",
    "num_iterations": "optimizer steps; -1: one pass over the training problems in whole steps (the last problems "
                      "that do not fill a step are left out)",
    "examples_per_step": "GSM8K problems per optimizer step (over all ranks)",
    "num_samples": "completions sampled per problem: the group its advantage is taken in",
    "max_new_tokens": "the most tokens a completion may have; a training prompt that leaves less room in the "
                      "model's context is skipped (counted: the start-up line and the summary's prompts_skipped)",
    "eval_samples": "K > 0: also sampled pass@1..K of K samples drawn as training draws them; 0: greedy only",
    "top_k": "sample from the k most likely tokens (k >= 2: 1 is greedy, every sample of a group alike); 0: all",
    "temperature": f"the sampling temperature of rollouts and --eval-samples, and of the log-probabilities the "
                   f"policy gradient trains (>= {GREEDY_BELOW}: below it, greedy; any value trains through the "
                   "model's own loss, in the memory temperature 1 takes)",
    "device_batch_size": "sequences per forward/backward chunk",
    "sample_batch_size": "N > 0: a problem's --num-samples (and --eval-samples) are drawn N at a time (a KV cache of N rows; under "
                         "--decode graphs each call size keeps a cache over the whole context for the run, so pick "
                         "N dividing --num-samples); lower it if sampling runs out of memory; 0: all in one call",
    "decode": "the Engine's decode mode for rollouts and the GSM8K eval: auto (CUDA graphs of the plain model on "
              "a GPU, eager elsewhere)|eager|compile|static|graphs",
    "init_lr_frac": "every learning rate above is multiplied by this",
    "eval_examples": "GSM8K test problems scored (at most --test-holdout of them, and of the --source model's "
                     "own held-out ones: it trained on the rest)",
    "test_holdout": "N >= 0: train on the local GSM8K test file minus its first N problems, evaluate on those "
                    "(offline, no train split); -1: the train split",
    "data_dir": "a data root holding eval/ (or eval/ itself); not given: $NANOCHAT_EVAL_DIR, else eval_data/ in "
                "the base dir, else ../shared/data/eval",
    "eval_every": "N: evaluate GSM8K pass@1 at step 0, every N steps and at the last step; -1 or 0: never, "
                  "not even at the last step",
    "save_every": "N: save a checkpoint every N steps; -1 or 0: only the one at the last step (always saved)",
}


def parse_config(argv: list[str] | None = None) -> ChatRLConfig:
    parser = FlagParser(prog="python -m scripts.chat_rl", description="RL on GSM8K rewards.")
    d = ChatRLConfig()
    for f in fields(ChatRLConfig):
        about = FLAG_HELP.get(f.name)
        if f.type == "bool":
            parser.add_argument("--" + f.name, action="store_true", help=about)
            continue
        parser.add_argument("--" + f.name.replace("_", "-"), type=_TYPES[f.type], default=getattr(d, f.name),
                            help=(f"{about}; " if about else "") + f"default: {getattr(d, f.name)}")
    cfg = ChatRLConfig(**vars(parser.parse_args(argv))).validate()
    # the flags the command line named (not a field: kept out of the checkpoint's config)
    cfg.given_flags = frozenset(a.partition("=")[0][2:].replace("-", "_")
                                for a in normalize_flags(sys.argv[1:] if argv is None else argv) if a.startswith("--"))
    return cfg


def _given(cfg: ChatRLConfig, name: str) -> bool:
    """Whether the command line named flag `name` (a config built without parse_config: whether it
    differs from the default)."""
    given = getattr(cfg, "given_flags", None)
    return name in given if given is not None else getattr(cfg, name) != getattr(ChatRLConfig, name)


def unused_eval_flags(cfg: ChatRLConfig) -> str | None:
    """The notice for --eval-examples / --eval-samples given while --eval-every never evaluates
    (a notice, not an error: a run that turns the evaluation off keeps its other flags, as chat_sft
    keeps an --eval-tokens); None when they take effect or were not given. A config built without
    parse_config counts a value other than the default as given."""
    if cfg.eval_every > 0:
        return None
    named = [f for f in ("eval_examples", "eval_samples") if _given(cfg, f)]
    if not named:
        return None
    flags = ", ".join(f"--{f.replace('_', '-')} {getattr(cfg, f)}" for f in named)
    return f"  {flags}: no effect, --eval-every {cfg.eval_every} never evaluates (no GSM8K pass@k this run)"


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)
    rt = init_runtime(cfg.device, cfg.dtype, cfg.seed)
    try:
        return train(cfg, rt)
    finally:
        destroy_runtime(rt)


def rerun_command(cfg: ChatRLConfig, tag: str, world_size: int, **overrides) -> str:
    """The command that continues this run from checkpoint step overrides["resume"] (loop.resume_command:
    the flags that differ from the defaults, the tag as resolved), or without "resume" (a stop before the
    run's first save) the run's own command again, its --resume / --overwrite kept; either with the
    other `overrides` (an out-of-memory stop's lower --sample-batch-size, ...)."""
    from nanochat.chat_flags import spell_flags   # a value starting with "-" as --flag=value
    from nanochat.loop import resume_command
    if "resume" in overrides:
        return resume_command("chat_rl", cfg, asdict(ChatRLConfig()), tag, world_size, spell=spell_flags, **overrides)
    again = resume_command("chat_rl", cfg, asdict(ChatRLConfig()), tag, world_size, spell=spell_flags, **overrides,
                           resume="latest")
    again = again.removesuffix(" --resume latest")
    return again + (f" --resume {cfg.resume}" if cfg.resume else "") + (" --overwrite" if cfg.overwrite else "")


def next_commands(cfg: ChatRLConfig, tag: str) -> list[tuple[str, str]]:
    """(what it does, command) after RL, as chat_sft's end names them: chat_eval and chat_web of the
    rl checkpoint it trained, with the device the user picked (and chat_eval the --data-dir). The run
    ended on its summary line alone, leaving its user to find that both take `-i rl`."""
    import shlex
    from nanochat.chat_flags import spell_flags
    args = ["-i", "rl", *spell_flags("model_tag", tag)] + [word for name in ("device", "dtype")
                                               if getattr(cfg, name) != getattr(ChatRLConfig, name)
                                               for word in spell_flags(name, getattr(cfg, name))]
    eval_args = args + (spell_flags("data_dir", cfg.data_dir) if cfg.data_dir is not None else [])
    return [("evaluate it", f"python -m scripts.chat_eval {shlex.join(eval_args)}"),
            ("talk to it", f"python -m scripts.chat_web {shlex.join(args)}")]


def rl_schedule(num_iterations: int) -> Schedule:
    """lr: linear decay to 0. Muon momentum held at RL_MOMENTUM from the first step, as upstream's
    RL: a trained model needs no momentum warmup, and the shared 0.85 -> 0.95 ramp over 300 steps
    would span ~2/3 of an epoch of GSM8K."""
    return Schedule(num_iterations, 0.0, 1.0, 0.0, momentum_fn=lambda step: RL_MOMENTUM).validate()


# what a checkpoint's loader position means: a count of problems of this task (--test-holdout,
# --data-dir; file order, not shuffled), taken this many at a time with this many samples each;
# --seed draws the rollouts (from seed, problem and position), so a resume that changed it would not be exact
RESUME_FLAGS = {"test_holdout": "--test-holdout", "data_dir": "--data-dir", "seed": "--seed",
                "examples_per_step": "--examples-per-step", "num_samples": "--num-samples"}
# config fields a resume's say_config_changes leaves out: the schedule's line and the optimizer's name
# theirs, resume_mismatch and start_point refuse a change of the others (--source: the run's own weights)
# (not --data-dir: resume_mismatch compares only the training file it gives; a new one that changes
# only the test file scored is said in the line of changed flags)
SAID_ON_RESUME = ("resume", "overwrite", "model_tag", "source", "step", "num_iterations", "matrix_lr", "embedding_lr",
                  "unembedding_lr", "scalar_lr", "init_lr_frac", *(k for k in RESUME_FLAGS if k != "data_dir"))


def resume_mismatch(meta: dict, cfg: ChatRLConfig, world_size: int = 1, fingerprint: str | None = None,
                    data_source: str | None = None) -> str | None:
    """What keeps this run from continuing the checkpoint `meta` describes (None: nothing);
    `fingerprint`: the base dir's tokenizer's (None: not checked); `data_source`: the file this
    run's training problems were read from (compared with the checkpoint's, when it recorded one,
    in place of the --data-dir text: None and the path it resolves to are the same data, and one
    relative path run from two directories is not)."""
    saved_world = int(meta.get("world_size", 1))
    if saved_world != world_size:   # per-rank optimizer and sampler state
        return f"it was saved by {saved_world} rank(s), this run has {world_size}"
    saved_tokenizer = meta.get("tokenizer_fingerprint")
    if fingerprint is not None and saved_tokenizer not in (None, fingerprint):
        return (f"it was trained with tokenizer {saved_tokenizer[:16]}..., the base dir's tokenizer is "
                f"{fingerprint[:16]}... (restore the tokenizer it was trained with)")
    # a resume keeps the weights of the phase its run started from: a --source naming another
    # phase was silently ignored (and recorded in the new checkpoint's config as if it applied)
    saved_phase = (meta.get("source") or {}).get("phase")
    if saved_phase is not None and saved_phase != cfg.source and _given(cfg, "source"):
        return f"its run started from --source {saved_phase}, this run has --source {cfg.source}"
    saved = meta.get("config") or {}
    saved_data = (meta.get("train") or {}).get("data_source")
    for key, flag in RESUME_FLAGS.items():
        if key == "data_dir" and data_source is not None and saved_data is not None:
            if saved_data != data_source:
                return f"the checkpoint's run trained on {saved_data}, this run's --data-dir gives {data_source}"
        elif key in saved and saved[key] != getattr(cfg, key):
            return f"the checkpoint's run had {flag} {saved[key]!r}, this run has {getattr(cfg, key)!r}"
    return None


def training_source(task) -> str:
    """The file the training problems come from, as resume_mismatch compares it: a local file's
    real path (a relative --data-dir names other files from another directory), or the hub's name."""
    import os
    source = str(task.source)
    return source if source.startswith("hub:") else os.path.realpath(source)


HOLDOUT_FLAGS = {"mid": "mid_train --test-holdout", "sft": "chat_sft --test-holdout"}


def eval_plan(cfg: ChatRLConfig, test_problems: int, source: dict) -> tuple[int, str | None]:
    """(how many of the first GSM8K test problems the evaluation scores, the line saying why fewer
    than --eval-examples; None: nothing to say). Never one a model was trained on: this run trains on
    test[N:] under --test-holdout N, and the --source checkpoint (or one it was trained from: meta
    "source" -> "test_holdouts") on test[M:] under its own --test-holdout M, so a score past either
    would read as the model's own (as chat_eval cuts it). None left while evaluating: a RequestError."""
    cuts = [(cfg.test_holdout, f"the {cfg.test_holdout} held-out GSM8K test problems (--test-holdout "
                               f"{cfg.test_holdout}; the rest are trained on)")] if cfg.test_holdout >= 0 else []
    held = (source.get("test_holdouts") or {}).get("GSM8K")
    if isinstance(held, (list, tuple)) and len(held) == 2 and isinstance(held[0], int) and held[0] >= 0:
        flag = f"{HOLDOUT_FLAGS.get(held[1], str(held[1]) + ' --test-holdout')} {held[0]}"
        cuts.append((held[0], f"the first {held[0]} GSM8K test problems only: the {held[1]} model it starts from "
                              f"trained on the rest ({flag})"))
        if held[0] == 0 and cfg.eval_every > 0:
            raise RequestError(f"--eval-every: got {cfg.eval_every}; accepted: -1 or 0 (train without evaluating): the "
                               f"{held[1]} model it starts from trained on every GSM8K test problem ({flag}), so "
                               "none is left to score")
    problems = min(cfg.eval_examples, test_problems, *(n for n, _ in cuts))
    why = next((about for n, about in cuts if n == problems), None)
    if cfg.eval_every <= 0 or problems >= cfg.eval_examples or why is None:
        return problems, None
    return problems, f"  --eval-examples {cfg.eval_examples}: scoring {why}"


def _source_context(source: dict) -> int | None:
    """The context length of the model RL starts from, read from its meta.json (None: it does not
    say; the trainer still skips what does not fit, the model's own length deciding)."""
    from pathlib import Path
    from nanochat.checkpoint import read_meta
    from nanochat.checkpoint_io import CheckpointError
    try:
        length = (read_meta(Path(source["dir"]), source["step"]).get("model_config") or {}).get("sequence_len")
    except CheckpointError:   # the load names a damaged checkpoint, in full
        return None
    return length if isinstance(length, int) else None


def train(cfg: ChatRLConfig, rt) -> dict:
    from nanochat.chat_data import build_mixture
    from nanochat.chat_start import say_fresh_start, start_point
    from nanochat.checkpoint_io import CheckpointError
    from nanochat.checkpoint import (branch_start, checkpoint_bytes, disk_plan, fresh_start, load_checkpoint,
                                     load_model, model_from_meta, planned_saves, read_meta, resolve_step,
                                     save_checkpoint, step_dirname)
    from nanochat.loop import LoopSpec, log_stage_report, run_training_loop
    from nanochat.resume_checks import check_resume_step, say_config_changes, say_schedule_changes
    from nanochat.optim import build_optimizer
    from nanochat.training import resolve_compile
    from nanochat.rl import PolicyGradientTrainer, check_prompts_fit
    from nanochat.tasks import GSM8K
    from nanochat.tasks.evaluate import out_of_memory_hint, run_generative
    from nanochat.tokenizer import get_tokenizer
    from nanochat.distributed import check_shared_dir, failing_together
    from nanochat.tracker import Tracker
    from nanochat.writer_lock import claim_checkpoint_dir
    from nanochat.training import StepMeter, restore_rng_state

    if cfg.decode == "graphs" and rt.device.type != "cuda":   # the Engine would refuse it after the load
        raise RequestError(f"--decode graphs: needs a CUDA device, this run's is {rt.device.type}; accepted here: "
                           "auto|eager|compile|static")
    # as mid_train / chat_sft's: a typo was a "dataset not found" list of paths naming no flag, after the
    # checkpoint was resolved; an empty value ("$DATA" unset) read ./eval, or the hub, in silence
    check_dir_flag(cfg.data_dir, "--data-dir", "an existing directory (a data root holding eval/, or eval/ itself)")
    base_dir = get_base_dir()
    tag, ckpt_dir, source, resume_at = start_point("rl", cfg, base_dir)
    check_shared_dir(ckpt_dir)   # every rank writes into the step directory rank 0 renames (several nodes: a shared FS)
    claim_checkpoint_dir(ckpt_dir)   # one run per directory (nanochat/writer_lock.py), held until exit
    if resume_at is None:   # a fresh run into a tag holding rl checkpoints: refused now, not after the load
        fresh_start(ckpt_dir, cfg.resume, cfg.overwrite)
    # data before the model: the problems trained on, and the ones scored (never the same: with
    # --test-holdout N training takes the test split from N on, so the evaluation takes at most N)
    task = build_mixture("rl", "train", data_dir=cfg.data_dir, test_holdout=cfg.test_holdout, seed=cfg.seed)
    eval_task = GSM8K("test", data_dir=cfg.data_dir)
    eval_problems, eval_notice = eval_plan(cfg, len(eval_task), source)
    # more than one pass a step would draw a problem twice with the same seed (the same samples),
    # and a huge value rendered that many prompts before the first rollout (all of the memory)
    if cfg.examples_per_step > len(task):
        raise RequestError(f"--examples-per-step: got {cfg.examples_per_step}; accepted: 1..{len(task)} (the "
                           "training problems" + (f" left by --test-holdout {cfg.test_holdout})" if
                                                  cfg.test_holdout >= 0 else ")"))
    # prompts with no room for --max-new-tokens are skipped: said (or, none fitting, refused) now,
    # from meta.json's context, before any weights load
    context = _source_context(source)
    fit_notice = check_prompts_fit(task, get_tokenizer(base_dir), context, cfg.max_new_tokens) if context else None
    num_iterations = cfg.num_iterations if cfg.num_iterations > 0 else max(1, len(task) // cfg.examples_per_step)
    resume = None
    if resume_at is not None:
        # decided from meta.json, alike on every rank, before any rank reads its own files (a rank
        # the checkpoint has no files for would fail alone while the others started fresh)
        resume_step = resolve_step(ckpt_dir, resume_at)   # one step for every read (latest could move)
        saved = read_meta(ckpt_dir, resume_step)
        why = resume_mismatch(saved, cfg, rt.world_size, get_tokenizer(base_dir).fingerprint,
                              training_source(task))
        if why is not None and cfg.resume != "auto":
            raise CheckpointError(f"--resume: {why}; run it as the original run was (its flags and number of "
                                  "processes), or start a new --model-tag")
        if why is not None:
            say_fresh_start(f"{ckpt_dir}'s latest checkpoint cannot be continued ({why})")
        else:
            if "test_holdouts" in (saved.get("source") or {}):   # the weights descend from that run's source
                eval_problems, eval_notice = eval_plan(cfg, len(eval_task), saved["source"])
            # a step past --num-iterations refused before the weights and optimizer state load (GBs)
            check_resume_step(resume_step, num_iterations, ckpt_dir)   # the LR decays over this run's horizon:
            say_schedule_changes({"num_iterations": (saved.get("train") or {}).get("num_iterations")},
                                 {"num_iterations": num_iterations})
            say_config_changes(saved.get("config") or {}, asdict(cfg), said=SAID_ON_RESUME)
            with failing_together(f"resuming {ckpt_dir / step_dirname(resume_step)}", CheckpointError):
                resume = load_checkpoint(ckpt_dir, resume_step, device=rt.device, rank=rt.rank, load_optimizer=True)
    if resume is not None:
        tokenizer = get_tokenizer(base_dir)
        model = model_from_meta(resume["meta"], resume["model"], ckpt_dir / step_dirname(resume["step"]), rt.device,
                                compute_dtype=rt.dtype)
        source = resume["meta"]["source"]
    else:
        model, tokenizer, _ = load_model(cfg.source, rt.device, model_tag=tag, step=source["step"],
                                         base_dir=base_dir, compute_dtype=rt.dtype, for_training=True)
    model.train()
    schedule = rl_schedule(num_iterations)
    first_step = resume["step"] if resume is not None else 0
    # moved aside at the first save: a fresh start's tag's earlier run, or a resume's steps past the one it
    # continues (the run it branches from: its saves replaced them one by one, mixing the two runs' steps)
    earlier = fresh_start(ckpt_dir, cfg.resume, cfg.overwrite) if resume is None else \
        branch_start(ckpt_dir, first_step, f"--resume {cfg.resume}")
    disk = disk_plan(ckpt_dir, checkpoint_bytes(model, world_size=rt.world_size),   # every rank's optimizer file
                     planned_saves(first_step, num_iterations, cfg.save_every), cfg.keep_last, earlier)
    if earlier is not None:
        disk += f"; {earlier.describe()}"
    f = cfg.init_lr_frac
    optimizer = build_optimizer(model, matrix_lr=cfg.matrix_lr * f, embedding_lr=cfg.embedding_lr * f,
                                unembedding_lr=cfg.unembedding_lr * f, scalar_lr=cfg.scalar_lr * f,
                                world_size=rt.world_size, rank=rt.rank,
                                compile=None if resolve_compile(None, rt) else False)   # no Triton: eager
    trainer = PolicyGradientTrainer(model, model, optimizer, task, tokenizer, schedule, rt,
                                    examples_per_step=cfg.examples_per_step, num_samples=cfg.num_samples,
                                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                    top_k=cfg.top_k or None, device_batch_size=cfg.device_batch_size, seed=cfg.seed,
                                    sample_batch_size=cfg.sample_batch_size, decode=cfg.decode,
                                    command=lambda **flags: rerun_command(cfg, tag, rt.world_size, **flags))
    meter = StepMeter(model.estimate_flops(), rt.world_size, peak_bf16=None, precision=rt.dtype_name,
                      warmup_steps=1, peak_memory=rt.peak_memory_bytes)
    start_step, resume_loop = 0, None
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        trainer.load_loader_state(resume["loader"])
        resume_loop = resume["loop"]
        start_step = resume_loop["step"]
        meter.load_state_dict(resume_loop["meter"])
        trainer.note_checkpoint(ckpt_dir / f"step_{start_step:06d}")
        restore_rng_state(resume_loop["rng"])
    train_meta = {"num_iterations": num_iterations, "problems": len(task), "world_size": rt.world_size,
                  "dtype": rt.dtype_name, "eval_problems": eval_problems, "data_source": training_source(task)}
    tracker = Tracker(resolve_wandb_mode(cfg.wandb, cfg.run), run=cfg.run, project="nanochat-rl",
                      config={**asdict(cfg), **train_meta}, is_master=rt.is_master, directory=str(base_dir),
                      resume_state=resume_loop, branch=earlier is not None)   # a resume: its wandb run
    print0(f"RL: {source['phase']}/{tag} step {source['step']} -> {ckpt_dir} ({disk}); {num_iterations} iterations x "
           f"{cfg.examples_per_step} problems x {cfg.num_samples} samples (max {cfg.max_new_tokens} new tokens); "
           f"{len(task):,} training problems; device {rt.device} ({rt.dtype_name})")
    rows = min(trainer.sample_rows, cfg.num_samples)
    print0(f"  rollouts: decode {trainer.engine.decode_mode}" + (" (--decode auto)" if cfg.decode == "auto" else "") +
           f", {-(-cfg.num_samples // rows)} sampling call(s) of up to {rows} rows per problem")
    for notice in (fit_notice, unused_eval_flags(cfg), eval_notice):
        if notice:
            print0(notice)

    # problem i samples with seed + i (run_generative): kept in the Engine's range for any --seed
    eval_seed = min(cfg.seed, MAX_SEED + 1 - max(eval_problems, 1))

    def evaluate(_step: int) -> dict:
        model.eval()
        engine = trainer.engine   # its decoders (CUDA graphs under --decode graphs) serve the eval too
        res = run_generative(engine, tokenizer, eval_task, rt.device, num_samples=1,
                             max_new_tokens=cfg.max_new_tokens, temperature=0.0, max_problems=eval_problems,
                             name="GSM8K")
        metrics = {"gsm8k_pass@1": res.accuracy}
        if cfg.eval_samples > 0:  # upstream's figure: pass@k of k samples drawn as training draws them
            # in chunks of --sample-batch-size rows, as rollouts are (one call of K rows ignored the
            # flag a user set to fit the KV cache in memory)
            rows = cfg.sample_batch_size
            with out_of_memory_hint("chat_rl --eval-samples", "--sample-batch-size" if rows else "--eval-samples",
                                    rows or cfg.eval_samples):
                sampled = run_generative(engine, tokenizer, eval_task, rt.device, num_samples=cfg.eval_samples,
                                         max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                         top_k=cfg.top_k or None, seed=eval_seed, max_problems=eval_problems,
                                         name="GSM8K", rows_per_call=rows)
            metrics.update({f"gsm8k_sampled_pass@{k}": sampled.pass_at(k) for k in range(1, cfg.eval_samples + 1)})
        model.train()
        return metrics

    def save(at: int, loop_state: dict):
        if earlier is not None:   # the earlier run goes once this one has trained up to a save
            earlier.settle(rt.is_master)
        meta = {"phase": "rl", "model_tag": tag, "model_config": asdict(model.config), "train": train_meta,
                "config": asdict(cfg), "source": source, "tokenizer_fingerprint": tokenizer.fingerprint}
        return save_checkpoint(ckpt_dir, at, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(),
                               loader_state=trainer.loader_state(), loop_state=loop_state, meta=meta, rank=rt.rank)

    spec = LoopSpec("rl", num_iterations, eval_every=cfg.eval_every, save_every=cfg.save_every,
                    evaluate=evaluate, save=save, is_master=rt.is_master, keep_last=cfg.keep_last,
                    resumed_from=ckpt_dir / step_dirname(resume["step"]) if resume is not None else None,
                    model_tag=tag, resume_command=lambda **flags: rerun_command(
                        cfg, tag, rt.world_size, **{"resume": "latest", **flags}))
    result = run_training_loop(trainer, meter, spec, tracker, start_step=start_step, resume_state=resume_loop)
    summary = {"model_tag": tag, "checkpoint_dir": str(ckpt_dir), "num_iterations": num_iterations,
               "final_gsm8k_pass@1": result.last_eval.get("gsm8k_pass@1"), "total_time_s": round(result.elapsed_s, 2),
               "prompts_skipped": trainer.skipped,
               **{f"final_{k}": v for k, v in result.last_eval.items() if k.startswith("gsm8k_sampled_pass@")}}
    print0("done: " + json.dumps(summary))
    for what, command in next_commands(cfg, tag):
        print0(f"next, {what}: {command}")
    log_stage_report("Chat RL", "rl", config=asdict(cfg), result=result, meter=meter,
                     extra={**train_meta, "model_tag": tag, "checkpoint_dir": str(ckpt_dir), "source": source},
                     is_master=rt.is_master)
    tracker.finish()
    return {**summary, "losses": result.losses}


if __name__ == "__main__":
    script_main("chat_rl", lambda: parse_config(sys.argv[1:]), lambda: main(sys.argv[1:]))
