"""The conversation-training recipe shared by mid-training and SFT (scripts/mid_train.py,
scripts/chat_sft.py): flags, loading the previous stage's checkpoint (which one, and whether a
resume continues it: nanochat/chat_start.py), the conversation mixture, packing
(nanochat/chat_data.py), the shared Trainer and loop (nanochat/training.py, loop.py), checkpoints
under the stage's own tag, and the report section.

The two stages differ only in their `ChatStage`: which checkpoint they start from, which tokens
carry the loss (mid: every token, rows filled by cropping; SFT: assistant tokens only, rows
padded, loss averaged over the real target tokens of the whole accumulated batch) and their
default learning rates and schedule.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nanochat import chat_start   # its functions called as chat_start.X: one place to patch in tests
from nanochat.chat_resume import SAID_ON_RESUME, _check_same_data, check_auto_batch_resume  # noqa: F401  (also re-exported)
from nanochat.checkpoint import check_resume_flags
from nanochat.common import env_world_size, get_base_dir, print0
from nanochat.tasks.identity import NAME as IDENTITY_NAME, check_identity_name
from nanochat.tracker import check_wandb_flags, resolve_wandb_mode
from nanochat.training import Schedule, check_peak_flops, plan_batch, warm_up_compile
from nanochat.flags import check_dir_flag, check_model_tag, require, require_float, require_int


@dataclass(frozen=True)
class ChatStage:
    name: str                   # checkpoint phase written: mid | sft
    title: str                  # report section
    prog: str                   # for --help and error messages
    sources: tuple[str, ...]    # accepted --source phases (first = default)
    mask: str                   # chat_data mask: all | assistant
    fill: str                   # chat_data fill: crop | pad
    step_tokens: int = 0        # --total-batch-size -1: this many tokens per step ...
    step_rows: int = 0          # ... or this many rows of --max-seq-len tokens
    defaults: dict = field(default_factory=dict)  # flag defaults that differ from ChatTrainConfig's

    def auto_batch(self, device_batch_size: int, seq_len: int, world_size: int) -> int:
        """--total-batch-size -1: the stage's step size in tokens whatever the number of GPUs (upstream
        nanochat's 8-GPU step: mid 524,288 tokens, SFT 32 rows), reached by gradient accumulation and
        rounded up to whole micro-batches over all ranks. One GPU (a Spark) thus trains the model
        8 GPUs would, not one with an 8x smaller batch at the same learning rates."""
        want = self.step_tokens or self.step_rows * seq_len
        per_micro = device_batch_size * seq_len * world_size
        return max(1, -(-want // per_micro)) * per_micro

    def step_text(self, total: int | None = None, seq_len: int | None = None) -> str:
        """The stage's step ("524,288 tokens", "32 rows"); given the total auto_batch made of it,
        also what that rounds it up to when the micro-batches do not divide it (the banner's figure)."""
        text = f"{self.step_tokens:,} tokens" if self.step_tokens else f"{self.step_rows} rows"
        if total is None or total == (self.step_tokens or self.step_rows * seq_len):
            return text
        got = f"{total:,} tokens" if self.step_tokens else f"{total // seq_len} rows"
        return f"{text}, rounded up to {got} (whole micro-batches on every rank)"


MID = ChatStage("mid", "Midtraining", "python -m scripts.mid_train", ("base",), mask="all", fill="crop",
                step_tokens=524288, defaults={"warmdown_ratio": 0.2, "eval_every": 150})
SFT = ChatStage("sft", "Chat SFT", "python -m scripts.chat_sft", ("mid", "base"), mask="assistant", fill="pad",
                step_rows=32,
                defaults={"init_lr_frac": 0.02, "warmdown_ratio": 1.0, "eval_every": 100, "device_batch_size": 4})
_STAGE_SOURCES = {MID.name: MID.sources, SFT.name: SFT.sources}   # chat_rl's own are its script's
DEVICES = ("auto", "cpu", "cuda", "mps")
KERNELS = ("current", "liger", "triton")


@dataclass
class ChatTrainConfig:
    """Every flag of mid_train / chat_sft; `validate(stage)` checks them before anything is built."""

    source: str = ""                        # phase to start from (default: the stage's first source)
    model_tag: str | None = None            # default: the source phase's newest/only tag
    step: str = "latest"                    # step of the source checkpoint
    num_iterations: int = -1                # -1 = one epoch of the mixture
    device_batch_size: int = 32
    max_seq_len: int = -1                   # -1 = the source model's sequence length
    total_batch_size: int = -1              # tokens per step; -1 = the stage's (ChatStage.auto_batch)
    matrix_lr: float = 0.02
    embedding_lr: float = 0.2
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.5
    init_lr_frac: float = 1.0               # every lr above is multiplied by this
    weight_decay: float = 0.0
    grad_clip: float = 0.0
    warmup_ratio: float = 0.0
    warmdown_ratio: float = 0.2
    final_lr_frac: float = 0.0
    eval_every: int = 150                   # -1/0 = off (else also at the last step)
    eval_tokens: int = -1                   # -1 = 20 micro-batches (in all, not per rank)
    save_every: int = -1
    keep_last: int = 0                      # > 0: keep this run's newest N checkpoints (older ones deleted)
    resume: str | None = None               # "latest", a step of this stage's own checkpoints, or "auto"
    overwrite: bool = False                 # a fresh run may start in a tag that holds this stage's checkpoints (moved to earlier_runs/)
    device: str = "auto"
    dtype: str = "auto"
    kernel: str = "current"
    compile: bool | None = None             # default: on for CUDA
    peak_flops: float | None = None         # dense bf16 FLOP/s per device (unknown GPUs), as base_train's
    seed: int = 42
    data_dir: str | None = None             # root or folder of the local eval/sft/words files
    test_holdout: int = -1                  # >= 0: train MMLU/ARC/GSM8K on local test[N:] (offline)
    extra_conversations: list[str] = field(default_factory=list)   # the user's JSONL files (repeatable flag)
    identity: str = IDENTITY_NAME           # the model's name in the built-in identity conversations; "" = none
    no_decontaminate: bool = False          # keep chats that ask a chat_eval test question (a run from before)
    run: str = "dummy"
    wandb: str | None = None

    def validate(self, stage: ChatStage) -> "ChatTrainConfig":
        check_model_tag(self.model_tag, new=True)   # a run writes under it
        self.source = self.source or stage.sources[0]
        require(self.source in stage.sources, "--source", self.source, "|".join(stage.sources))
        require(self.step == "latest" or re.fullmatch("[0-9]+", self.step) is not None, "--step", self.step, "latest or a step number")
        require_int(self.num_iterations, "--num-iterations", 1, allow=(-1,))
        require_int(self.device_batch_size, "--device-batch-size", 1)
        require_int(self.max_seq_len, "--max-seq-len", 8, allow=(-1,))
        require_int(self.total_batch_size, "--total-batch-size", 1, allow=(-1,))
        for flag in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr", "weight_decay", "grad_clip"):
            require_float(getattr(self, flag), "--" + flag.replace("_", "-"), 0.0)
        require_float(self.init_lr_frac, "--init-lr-frac", 0.0, low_inclusive=False)
        Schedule(1, self.warmup_ratio, self.warmdown_ratio, self.final_lr_frac).validate()
        for flag in ("eval_every", "save_every"):
            require_int(getattr(self, flag), "--" + flag.replace("_", "-"), 1, allow=(-1, 0))
        require_int(self.eval_tokens, "--eval-tokens", 1, allow=(-1,))
        if self.total_batch_size != -1 and self.max_seq_len != -1:
            plan_batch(self.total_batch_size, self.device_batch_size, self.max_seq_len,
                       env_world_size())
        check_resume_flags(self.resume, self.overwrite)
        require_int(self.keep_last, "--keep-last", 0)
        require(self.device in DEVICES, "--device", self.device, "|".join(DEVICES))
        require(self.dtype in ("auto", "bf16", "fp32"), "--dtype", self.dtype, "auto|bf16|fp32")
        require(self.kernel in KERNELS, "--kernel", self.kernel, "|".join(KERNELS))
        require_int(self.seed, "--seed", 0)
        check_peak_flops(self.peak_flops)
        require(self.seed < 2**64, "--seed", self.seed, "an integer >= 0 and < 2**64 (what torch.manual_seed takes)")
        require_int(self.test_holdout, "--test-holdout", 0, allow=(-1,))
        check_dir_flag(self.data_dir, "--data-dir", "an existing directory (a data root with eval/ sft/ words/, "
                       "or one of them)")
        if self.identity:
            check_identity_name(self.identity)
        for path in self.extra_conversations:
            require(Path(path).is_file(), "--extra-conversations", path,
                    'an existing JSONL file, one {"messages": [...]} conversation per line')
        check_wandb_flags(self.wandb, self.run)
        return self


def main(stage: ChatStage, argv: list[str] | None = None) -> dict:
    from nanochat.common import destroy_runtime, init_runtime
    from nanochat.chat_flags import parse_config   # it imports this module
    cfg = parse_config(stage, argv)
    rt = init_runtime(cfg.device, cfg.dtype, cfg.seed)
    try:
        return train(cfg, stage, rt)
    finally:
        destroy_runtime(rt)


def _load_start(cfg: ChatTrainConfig, start: "StartPlan", rt, base_dir):
    """(model, tokenizer, resume dict | None): the weights `_plan_start` settled on, read last."""
    from nanochat.checkpoint import load_checkpoint, load_model, model_from_meta, step_dirname
    from nanochat.tokenizer import get_tokenizer
    if start.resume_step is not None:
        resume = load_checkpoint(start.ckpt_dir, start.resume_step, device=rt.device, rank=rt.rank,
                                 load_optimizer=True)
        model = model_from_meta(resume["meta"], resume["model"], start.ckpt_dir / step_dirname(resume["step"]),
                                rt.device, compute_dtype=rt.dtype)
        return model, get_tokenizer(base_dir), resume
    model, tokenizer, _ = load_model(cfg.source, rt.device, model_tag=start.tag, step=start.source["step"],
                                     base_dir=base_dir, compute_dtype=rt.dtype, for_training=True)
    model.train()
    return model, tokenizer, None


def mixture_record(cfg: ChatTrainConfig, train_mix) -> dict:
    """What a checkpoint records of the user's choices in its training mixture: the name in the
    built-in identity conversations ("" = left out) and each --extra-conversations file with its
    sha256, in the order given; and, per source, the conversations decontamination left out (they
    ask a chat_eval test question: a start-up line alone was gone with the terminal)."""
    from nanochat.tasks import ConversationFile
    files = [t for t in train_mix.tasks if isinstance(t, ConversationFile)]
    return {"identity": cfg.identity,
            "extra_conversations": [{"path": t.source, "sha256": t.sha256, "conversations": len(t)} for t in files],
            "decontaminated": dict(getattr(train_mix, "decontaminated", {}))}


@dataclass
class StartPlan:
    """What a chat stage settles from meta.json, the tokenizer and the mixture before any weights
    load: where it starts and saves, the step it resumes (None: a fresh start) with that step's
    meta.json, the rows, the batch and the run's length in steps."""
    tag: str
    ckpt_dir: Path
    source: dict
    resume_step: int | None
    saved: dict | None
    config: object              # gpt_config.GPTConfig of the weights it loads
    seq_len: int
    plan: object                # training.BatchPlan
    epoch_rows: float           # rows one epoch of the mixture packs into (the banner's epochs)
    epoch_steps: int
    num_iterations: int


def _plan_start(cfg: ChatTrainConfig, stage: ChatStage, rt, base_dir, mixture: dict, train_mix) -> StartPlan:
    """start_point + the rows, batch plan and number of steps, all from meta.json: a resume these
    flags cannot continue (another mixture, --max-seq-len, batch, world size, model or tokenizer)
    or one past the run's last step is refused before the weights and optimizer state load (GBs
    at d20, which were read before these checks). A checkpoint --resume auto picked that this run
    cannot continue (e.g. a stage rerun by setup.sh after its flags changed) is left alone, unread,
    for a fresh start, said in one line; an explicit --resume raises instead."""
    from nanochat.chat_data import epoch_iterations, estimate_epoch_rows
    from nanochat.checkpoint import CheckpointError, config_from_meta, read_meta, resolve_step, step_dirname
    from nanochat.distributed import check_shared_dir
    from nanochat.resume_checks import check_resume_compatible, check_resume_step
    from nanochat.tokenizer import get_tokenizer
    from nanochat.writer_lock import claim_checkpoint_dir

    tag, ckpt_dir, source, resume_at = chat_start.start_point(stage.name, cfg, base_dir, check_tokenizer=False)
    check_shared_dir(ckpt_dir)   # every rank writes into the step directory rank 0 renames (several nodes: a shared FS)
    claim_checkpoint_dir(ckpt_dir)   # one run per directory (nanochat/writer_lock.py), held until exit
    tokenizer = get_tokenizer(base_dir)

    def rows_and_batch(meta: dict, step_dir):
        config = config_from_meta(meta, step_dir)
        seq_len = cfg.max_seq_len if cfg.max_seq_len != -1 else config.sequence_len
        require(seq_len <= config.sequence_len, "--max-seq-len", seq_len,
                f"<= the model's sequence length {config.sequence_len}")
        _check_eval_tokens(cfg, seq_len)
        total = cfg.total_batch_size if cfg.total_batch_size != -1 else \
            stage.auto_batch(cfg.device_batch_size, seq_len, rt.world_size)
        return config, seq_len, plan_batch(total, cfg.device_batch_size, seq_len, rt.world_size)

    resume_step = saved = None
    if resume_at is not None:
        resume_step = resolve_step(ckpt_dir, resume_at)   # one step for every read (latest could move)
        saved = read_meta(ckpt_dir, resume_step)
        saved_world = int(saved.get("world_size", 1))
        if cfg.resume == "auto" and saved_world != rt.world_size:
            # decided from meta.json, alike on every rank, before any rank reads its own files (a rank
            # the checkpoint has no files for would fail alone while the others started fresh)
            chat_start.say_fresh_start(f"{ckpt_dir}'s latest checkpoint cannot be continued (it was saved by "
                                       f"{saved_world} rank(s), this run has {rt.world_size})")
            resume_step = saved = None
    if resume_step is not None:
        config, seq_len, plan = rows_and_batch(saved, ckpt_dir / step_dirname(resume_step))
        try:
            # the data first: --total-batch-size -1 follows --max-seq-len, so another --max-seq-len
            # was named as "--total-batch-size", a flag the user never passed
            _check_same_data(saved, mixture, len(train_mix), cfg.seed, seq_len)
            check_auto_batch_resume(saved, cfg, plan, rt.world_size, stage)
            check_resume_compatible(saved, asdict(config), plan, rt.world_size, tokenizer.fingerprint)
        except CheckpointError as e:
            if cfg.resume != "auto":
                raise
            reason = str(e).removeprefix("--resume: ").split("; use the flags")[0]
            chat_start.say_fresh_start(f"{ckpt_dir}'s latest checkpoint cannot be continued ({reason})")
            resume_step = saved = None
        else:
            source = saved.get("source") or source   # a resume keeps the weights its run started from
    if resume_step is None:
        src_dir = Path(source["dir"])
        config, seq_len, plan = rows_and_batch(read_meta(src_dir, source["step"]), src_dir / step_dirname(source["step"]))
    # one epoch of the mixture = -1 iterations (its rows kept for the banner's epoch count)
    epoch_rows = estimate_epoch_rows(train_mix, tokenizer, seq_len, mask=stage.mask, fill=stage.fill)
    epoch_steps = epoch_iterations(epoch_rows, plan.total_batch_size, seq_len)
    num_iterations = cfg.num_iterations if cfg.num_iterations > 0 else epoch_steps
    if resume_step is not None:
        check_resume_step(resume_step, num_iterations, ckpt_dir)
    return StartPlan(tag, ckpt_dir, source, resume_step, saved, config, seq_len, plan, epoch_rows, epoch_steps,
                     num_iterations)


def _check_eval_tokens(cfg: ChatTrainConfig, seq_len: int) -> None:
    """As base_train's: a positive --eval-tokens below one micro-batch is refused (it became one)."""
    per_batch = cfg.device_batch_size * seq_len
    require(cfg.eval_tokens == -1 or cfg.eval_tokens >= per_batch, "--eval-tokens", cfg.eval_tokens,
            f"-1 or at least one micro-batch, --device-batch-size x --max-seq-len = {per_batch:,}")


EVAL_MICRO_BATCHES = 20   # --eval-tokens -1: this many micro-batches of the run's first device batch


def eval_rows_of(cfg: ChatTrainConfig, seq_len: int, saved: dict | None) -> int:
    """Validation rows each evaluation scores: --eval-tokens N: N // --max-seq-len; -1: 20 micro-batches
    of the run's device batch, and a resume (`saved`: the meta.json it continues) keeps the rows its run
    scored. Counted in micro-batches of this process's --device-batch-size, the resume an out-of-memory
    stop names (half the device batch) scored half the rows from then on: another set's val bpb."""
    config, train = (saved or {}).get("config") or {}, (saved or {}).get("train") or {}
    if cfg.eval_tokens != -1:
        if saved is not None and "eval_rows" not in train and config.get("eval_tokens") == cfg.eval_tokens:
            # a checkpoint from before eval_rows: its run scored whole micro-batches of its device batch
            dbs = config.get("device_batch_size", cfg.device_batch_size)
            return max(1, cfg.eval_tokens // (dbs * seq_len)) * dbs
        return cfg.eval_tokens // seq_len
    if saved is None or config.get("eval_tokens", -1) != -1:   # a fresh run, or the flag changed from N to -1
        return EVAL_MICRO_BATCHES * cfg.device_batch_size
    # a checkpoint from before train.eval_rows was recorded: its run scored 20 micro-batches of its device batch
    return int(train.get("eval_rows") or EVAL_MICRO_BATCHES * config.get("device_batch_size", cfg.device_batch_size))


def describe_evals(cfg: ChatTrainConfig, eval_rows: int, val_mix, tokenizer, seq_len: int, stage: ChatStage) -> str:
    """The banner's evaluation: the rows each one scores. The validation mixture is a few hundred
    conversations, which can pack into fewer rows than asked for: at mid's defaults (20 micro-batches
    of 32 rows of 2,048 tokens) the banner said 640 rows while each evaluation scored the 90 the
    mixture packs into (measured with a 1,024-token test vocabulary; a larger one makes fewer)."""
    from nanochat.chat_data import estimate_epoch_rows
    held = int(estimate_epoch_rows(val_mix, tokenizer, seq_len, mask=stage.mask, fill=stage.fill))  # exact below 4,000
    if eval_rows <= held:
        return f"eval every {cfg.eval_every} ({eval_rows} rows, {-(-eval_rows // cfg.device_batch_size)} batches)"
    asked = f"--eval-tokens {cfg.eval_tokens}" if cfg.eval_tokens != -1 else "--eval-tokens -1 (20 micro-batches)"
    return (f"eval every {cfg.eval_every} ({held} rows, {-(-held // cfg.device_batch_size)} batches: all the validation "
            f"mixture packs into, of the {eval_rows} rows {asked} asks for)")


def check_rows(cfg: ChatTrainConfig, stage: ChatStage, base_dir, world_size: int) -> int | None:
    """Is there a checkpoint to start from, may a fresh run write into this stage's tag, and do --max-seq-len and --total-batch-size fit its model
    (its sequence length read from meta.json)? Said before the mixture is read and the model loaded
    (seconds to minutes at d20); `_plan_start` checks them again from the checkpoint it continues or
    starts from, with what needs the mixture (a resume's data, a step past the run's end). Returns
    the rows' length (None: meta.json does not say the model's)."""
    from nanochat.checkpoint import CheckpointError, checkpoint_dir, fresh_start, read_meta
    from nanochat.resume_checks import check_resume_world
    tag, src_dir = chat_start.resolve_source(stage.name, cfg.source, cfg.model_tag, base_dir)
    chat_start.check_named_steps(cfg, src_dir, checkpoint_dir(stage.name, tag, base_dir))
    chat_start.check_source_tokenizer(cfg, tag, src_dir, base_dir)
    if cfg.resume is None:   # a fresh run into a tag holding this stage's checkpoints: refused now, not after the load
        fresh_start(checkpoint_dir(stage.name, tag, base_dir), None, cfg.overwrite)
    elif cfg.resume != "auto":   # another world size: refused now, not after the mixture is read (auto starts fresh)
        try:
            resumed = read_meta(checkpoint_dir(stage.name, tag, base_dir), cfg.resume)
        except CheckpointError:   # a missing or damaged meta.json: the load names it in full
            resumed = None
        if resumed is not None:
            check_resume_world(resumed, world_size)
    try:
        model_len = (read_meta(src_dir, cfg.step).get("model_config") or {}).get("sequence_len")
    except CheckpointError:   # a damaged meta.json of the latest step: the load names it, in full
        return None
    if not isinstance(model_len, int):
        return None
    seq_len = cfg.max_seq_len if cfg.max_seq_len != -1 else model_len
    require(seq_len <= model_len, "--max-seq-len", seq_len, f"<= the model's sequence length {model_len}")
    _check_eval_tokens(cfg, seq_len)
    if cfg.total_batch_size != -1:
        plan_batch(cfg.total_batch_size, cfg.device_batch_size, seq_len, world_size)
    return seq_len


def train(cfg: ChatTrainConfig, stage: ChatStage, rt) -> dict:
    import torch

    from nanochat.chat_data import ChatLoader, build_mixture, check_replies_fit, first_rows, validation_overlap
    from nanochat.chat_flags import (describe_epochs, epochs_of, next_commands, print_banner,   # it imports this module
                                     resume_command)
    from nanochat.checkpoint import (CheckpointError, branch_start, build_model, checkpoint_bytes, disk_plan,
                                     fresh_start, planned_saves, save_checkpoint, step_dirname)
    from nanochat.distributed import failing_together
    from nanochat.kernels import check_kernel
    from nanochat.loop import SETUP_STAGE_ENV, LoopSpec, log_stage_report, resume_loop_state, run_training_loop
    from nanochat.optim import build_optimizer
    from nanochat.resume_checks import say_config_changes, say_schedule_changes
    from nanochat.tokenizer import get_token_bytes
    from nanochat.tracker import Tracker
    from nanochat.eval_bpb import EvalSet, evaluate_bpb
    from nanochat.training import (StepMeter, Trainer, resolve_compile, resolve_peak_flops, restore_rng_state,
                                   setup_precision_and_kernel)

    base_dir = get_base_dir()
    compile_model = resolve_compile(cfg.compile, rt)
    rows_len = check_rows(cfg, stage, base_dir, rt.world_size)  # cheap: a checkpoint to start from, rows that fit it
    check_kernel(cfg.kernel, rt.device, compile=compile_model)
    # ---- data before the model: the mixtures read and check every task file (DataError /
    # MissingDataError name the file) before any weights are loaded ----
    train_mix = build_mixture(stage.name, "train", data_dir=cfg.data_dir, test_holdout=cfg.test_holdout, seed=cfg.seed,
                              extra=cfg.extra_conversations, identity=cfg.identity,
                              decontaminate=not cfg.no_decontaminate)
    val_mix = build_mixture(stage.name, "val", data_dir=cfg.data_dir, test_holdout=cfg.test_holdout)  # not --seed's
    for path, n in validation_overlap(train_mix, val_mix).items():
        print0(f"WARNING: --extra-conversations {path}: {n} of its conversations are validation conversations; "
               "training on them makes val bpb read better than the model is")
    if stage.mask == "assistant" and rows_len is not None:   # replies a prompt cuts off train nothing
        from nanochat.tokenizer import get_tokenizer
        check_replies_fit(train_mix, val_mix, get_tokenizer(base_dir), rows_len)
    mixture = mixture_record(cfg, train_mix)
    # the run's steps and every resume check from meta.json: a refusal comes before the weights load
    start = _plan_start(cfg, stage, rt, base_dir, mixture, train_mix)
    tag, ckpt_dir, source, seq_len, plan = start.tag, start.ckpt_dir, start.source, start.seq_len, start.plan
    epoch_rows, epoch_steps, num_iterations = start.epoch_rows, start.epoch_steps, start.num_iterations
    if start.saved is not None:
        saved_cfg = {**(start.saved.get("config") or {}),
                     "num_iterations": (start.saved.get("train") or {}).get("num_iterations")}
        say_schedule_changes(saved_cfg, {"num_iterations": num_iterations, "warmup_ratio": cfg.warmup_ratio,
                                         "warmdown_ratio": cfg.warmdown_ratio, "final_lr_frac": cfg.final_lr_frac})
        say_config_changes(start.saved.get("config") or {}, asdict(cfg), said=SAID_ON_RESUME)
    # the checkpoints this run's saves must not mix with, moved aside at its first save: a fresh
    # start's tag's earlier run; a resume's steps past the one it continues (the run it branches from:
    # they were replaced one by one, and a later --resume N took either run's)
    earlier = fresh_start(ckpt_dir, cfg.resume, cfg.overwrite) if start.resume_step is None else \
        branch_start(ckpt_dir, start.resume_step, f"--resume {cfg.resume}")
    # room for the checkpoints (refused when not even one fits): sized on a shapes-only model, before the load
    first_step = start.resume_step if start.resume_step is not None else 0
    disk = disk_plan(ckpt_dir, checkpoint_bytes(build_model(start.config, "meta"), world_size=rt.world_size),
                     planned_saves(first_step, num_iterations, cfg.save_every), cfg.keep_last, earlier)
    if earlier is not None:
        disk += f"; {earlier.describe()}"
    schedule = Schedule(num_iterations, cfg.warmup_ratio, cfg.warmdown_ratio, cfg.final_lr_frac).validate()
    eval_rows = eval_rows_of(cfg, seq_len, start.saved)
    eval_batches = -(-eval_rows // cfg.device_batch_size)   # the last one's surplus rows unscored (first_rows)
    loader_kw = dict(batch_size=cfg.device_batch_size, seq_len=seq_len, device=rt.device, mask=stage.mask,
                     fill=stage.fill)
    # each rank reads its own optimizer and loader shards: one rank's damaged file stops every rank here,
    # the others naming it (they went on into the loop and died at its first collective, in a traceback)
    loading = f"resuming {ckpt_dir / step_dirname(start.resume_step)}" if start.resume_step is not None else \
        f"loading {source.get('phase', cfg.source)}/{tag} step {source.get('step')}"
    with failing_together(loading, CheckpointError):
        model, tokenizer, resume = _load_start(cfg, start, rt, base_dir)
        # epochs after the first in a fresh order drawn from --seed and the epoch (a resumed state keeps its run's)
        loader = ChatLoader(train_mix, tokenizer, rank=rt.rank, world_size=rt.world_size, seed=cfg.seed, **loader_kw)
        if resume is not None and resume["loader"] is not None:
            loader.load_state_dict(resume["loader"])

    # ---- model set-up and optimizer (lrs scaled by --init-lr-frac) ----
    precision_info = setup_precision_and_kernel(model, "auto", cfg.kernel, rt, compile=compile_model)
    if seq_len != model.config.sequence_len:   # load_model cached the masks of the model's own length
        model.prepare_attention(seq_len)        # these rows' masks, cached before compile traces them
    train_model = torch.compile(model, dynamic=False) if compile_model else model
    f = cfg.init_lr_frac
    optimizer = build_optimizer(model, matrix_lr=cfg.matrix_lr * f, embedding_lr=cfg.embedding_lr * f,
                                unembedding_lr=cfg.unembedding_lr * f, scalar_lr=cfg.scalar_lr * f,
                                weight_decay=cfg.weight_decay, world_size=rt.world_size, rank=rt.rank,
                                compile=None if compile_model else False)   # eager too when the model is
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
    trainer = Trainer(train_model, optimizer, loader, plan, schedule, rt, grad_clip=cfg.grad_clip,
                      token_weighted=stage.mask == "assistant")
    # the loop's graphs compiled now, not inside a collective or a mid-run evaluation (DESIGN pitfalls 3, 9)
    warm_up_compile(train_model, cfg.device_batch_size, seq_len, model.config.vocab_size, rt, compiled=compile_model,
                    eval_every=cfg.eval_every, num_iterations=num_iterations, loop_state=resume and resume["loop"],
                    loss_reduction="sum" if trainer.token_weighted else None, around=trainer.step_context)
    peak_bf16, peak_active, device_name = resolve_peak_flops(rt, precision_info["peak_key"], cfg.peak_flops,
                                                             warn=lambda m: print0(f"WARNING: {m}"))
    # FLOPs of the rows trained (--max-seq-len may be shorter than the model's context: attention
    # then sees fewer keys per query), not of the model's full sequence length
    meter = StepMeter(model.estimate_flops(seq_len), rt.world_size, peak_bf16=peak_bf16, peak_active=peak_active,
                      precision=precision_info["peak_key"], peak_memory=rt.peak_memory_bytes,
                      low_precision_flops=precision_info.get("low_precision_flops"))
    train_meta = {"num_iterations": num_iterations, "total_batch_size": plan.total_batch_size,
                  "grad_accum_steps": plan.grad_accum_steps, "seq_len": seq_len, "world_size": rt.world_size,
                  "mixture_conversations": len(train_mix), "mixture": mixture, "mask": stage.mask, "fill": stage.fill,
                  "eval_rows": eval_rows, "epoch_order": "repeated" if loader.seed is None else "reshuffled",
                  "compile": compile_model, "dtype": rt.dtype_name, **precision_info}
    tracker = Tracker(resolve_wandb_mode(cfg.wandb, cfg.run), run=cfg.run, project=f"nanochat-{stage.name}",
                      config={**asdict(cfg), **train_meta}, is_master=rt.is_master, directory=str(base_dir),
                      resume_state=resume and resume["loop"], branch=earlier is not None)   # a resume: its wandb run
    start_step, resume_loop = resume_loop_state(resume, meter, trainer, ckpt_dir)
    epochs = epochs_of(num_iterations, plan.total_batch_size // seq_len, epoch_rows)
    print_banner(cfg, stage, rt, source=source, tag=tag, ckpt_dir=ckpt_dir, disk=disk, plan=plan, train_mix=train_mix,
                 mixture=mixture, seq_len=seq_len, compile_model=compile_model, device_name=device_name,
                 resumed_at=resume["step"] if resume is not None else None,
                 iterations=describe_epochs(num_iterations, cfg.num_iterations, epoch_steps, epochs),
                 evals=describe_evals(cfg, eval_rows, val_mix, tokenizer, seq_len, stage) if cfg.eval_every > 0
                 else "eval off")
    if resume is not None and loader.seed is None and epochs > 1:   # a run from before the reshuffle, continued as it began
        print0(f"note: {ckpt_dir / step_dirname(resume['step'])} was saved before mid / SFT reshuffled each "
               "epoch: this run keeps its order (every epoch repeats the first's conversations in the same "
               "order) so that it continues exactly; a fresh run (--overwrite, or another --model-tag) reshuffles")
    if resume is not None:
        restore_rng_state(resume_loop["rng"])

    token_bytes = get_token_bytes(device=rt.device, base_dir=base_dir)
    val_kw = {**loader_kw, "device": torch.device("cpu")}   # the whole val stream (rank 0 of 1) on the host, once:
    val_set = EvalSet(lambda: first_rows(ChatLoader(val_mix, tokenizer, loop=False, **val_kw), eval_rows),
                      eval_batches, rt)   # EvalSet deals it

    def evaluate(_step: int) -> dict:
        model.eval()
        bpb = evaluate_bpb(train_model, val_set, val_set.steps, token_bytes)
        model.train()
        return {"val_bpb": bpb}

    def save(at: int, loop_state: dict):
        if earlier is not None:   # the earlier run goes once this one has trained up to a save
            earlier.settle(rt.is_master)
        meta = {"phase": stage.name, "model_tag": tag, "model_config": asdict(model.config), "train": train_meta,
                "config": asdict(cfg), "source": source, "val_bpb": loop_state["val_bpb"],
                "val_bpb_step": loop_state.get("val_bpb_step"),   # an earlier step's when this one did not evaluate
                "tokenizer_fingerprint": tokenizer.fingerprint, "device_name": device_name}
        return save_checkpoint(ckpt_dir, at, model_state=model.state_dict(), optimizer_state=optimizer.state_dict(),
                               loader_state=trainer.loader_state(), loop_state=loop_state, meta=meta, rank=rt.rank)

    def continue_command(**flags) -> str:
        # --total-batch-size -1 rounds the stage's step up to whole micro-batches: at an out-of-memory stop's
        # lower --device-batch-size it can round to another total, which the resume refuses: this run's goes along
        if "device_batch_size" in flags and cfg.total_batch_size == -1 and \
                stage.auto_batch(flags["device_batch_size"], seq_len, rt.world_size) != plan.total_batch_size:
            flags["total_batch_size"] = plan.total_batch_size
        return resume_command(stage, cfg, tag, rt.world_size, **flags)

    # a stop (and an out-of-memory stop) names the whole command that continues the run (--overwrite refused)
    spec = LoopSpec(stage.name, num_iterations, eval_every=cfg.eval_every, save_every=cfg.save_every,
                    evaluate=evaluate, save=save, is_master=rt.is_master, keep_last=cfg.keep_last,
                    resumed_from=ckpt_dir / step_dirname(resume["step"]) if resume is not None else None,
                    model_tag=tag, resume_command=continue_command)
    result = run_training_loop(trainer, meter, spec, tracker, start_step=start_step, resume_state=resume_loop)
    # each rank's loader reads its own share: the run's row fill and skips are the sums over ranks
    # as of the batches trained: the loader has read one more (the trainer's prefetch) past the last step
    done = trainer.loader_state()
    counts = torch.tensor([done["conversations_used"], done["skipped"], done["truncated"], done["tokens_real"],
                           done["tokens_total"]], dtype=torch.int64, device=rt.device)
    if rt.world_size > 1:
        torch.distributed.all_reduce(counts)
    trained, skipped, truncated, real, total = (int(v) for v in counts.tolist())
    summary = {"model_tag": tag, "checkpoint_dir": str(ckpt_dir), "num_iterations": num_iterations,
               "final_val_bpb": result.val_bpb, "val_bpb_step": result.val_bpb_step,
               "avg_tok_per_sec": meter.average_tok_per_sec(), "epochs": float(f"{epochs:.4g}"),
               # what the skips and cuts are out of: the conversations (or mid's cropped parts) in rows
               "row_fill": round(real / total, 4) if total else 0.0, "conversations_trained": trained,
               "conversations_skipped": skipped,
               "conversations_truncated": truncated,
               "conversations_decontaminated": sum(mixture["decontaminated"].values()),
               "peak_mem_gib": rt.peak_memory_bytes() / 2**30}
    print0("done: " + json.dumps(summary))
    if not os.environ.get(SETUP_STAGE_ENV):   # setup.sh runs the next stage itself
        for what, command in next_commands(stage, cfg, tag, rt.world_size):
            print0(f"next, {what}: {command}")
    log_stage_report(stage.title, stage.name, config=asdict(cfg), result=result, meter=meter,
                     extra={**train_meta, **summary, "source": source}, is_master=rt.is_master)
    tracker.finish()
    return {**summary, "losses": result.losses}
