"""The command line of mid_train / chat_sft: their flags' help text and `parse_config`, which turns
argv (dash or underscore spellings) into a validated `ChatTrainConfig` (nanochat/chat_train.py owns
the config, its checks and the recipe that runs it); and the way back, what the stages tell their
user in flags: the resolved choices of the start-up banner (the mixture by source, the epochs, what
each `auto` became), the command that resumes a stopped run and the next stage's command."""

from __future__ import annotations

import argparse
import os
import shlex
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path

from nanochat.chat_train import ChatStage, ChatTrainConfig
from nanochat.common import print0
from nanochat.flags import FlagParser, require
from nanochat.loop import TRAIN_FLAG_HELP, as_flags, launcher, resume_command as loop_resume_command
from nanochat.tasks.identity import NAME as IDENTITY_NAME, check_identity_name
from nanochat.training import PEAK_FLOPS_HELP

_FLAG_TYPES = {"int": int, "float": float, "str": str, "str | None": str, "float | None": float}
EXTRA_HELP = {
    "extra_conversations": 'a JSONL file of your own conversations, one {"messages": [{"role": "user", ...}, '
                           '{"role": "assistant", ...}]} per line, mixed into training (e.g. an identity of '
                           'your own); repeat the flag for more files, name a file twice to mix it in twice',
    "identity": "the model's name in the built-in identity conversations (\"My name is NAME.\"); default: "
                "nanochat-spark",
}


CHAT_FLAG_HELP = {   # what a flag does where "default: X" alone does not say it
    **TRAIN_FLAG_HELP,
    "model_tag": "the model tag of the --source checkpoint, and of this stage's own; not given: the --source "
                 "phase's only tag, or its deepest d<N>",
    "num_iterations": "optimizer steps; -1: one epoch of the conversation mixture, rounded up to a whole step (the "
                      "last one continues into the next epoch)",
    "max_seq_len": "tokens per row; -1: the model's sequence length",
    "init_lr_frac": "every learning rate above is multiplied by this",
    "eval_tokens": "validation tokens per evaluation (of all ranks together): N // --max-seq-len rows; -1: 20 "
                   "micro-batches of the run's first --device-batch-size in all (a resume keeps its rows)",
    "data_dir": "a data root holding eval/ sft/ words/ (or one of them); not given: $NANOCHAT_EVAL_DIR / "
                "$NANOCHAT_SFT_DIR, else eval_data/ / sft_data/ in the base dir, else ../shared/data",
    "no_decontaminate": "keep the conversations whose user turn is word for word a local MMLU / ARC / GSM8K test "
                        "question (left out by default): to resume a run started before that check",
    "test_holdout": "N >= 0: also train on the local MMLU / ARC / GSM8K test files minus their first N problems "
                    "(offline, no train splits); -1: off",
    "peak_flops": PEAK_FLOPS_HELP,
}


def _identity_flag(text: str) -> str:
    """--identity's value, checked as it is parsed: "" is --no-identity's value in the config, and
    an empty --identity (e.g. "$NAME" with NAME unset) left the identity out as if it were."""
    try:
        return check_identity_name(text)
    except ValueError as e:   # argparse words it "argument --identity: <message>"
        raise argparse.ArgumentTypeError(str(e).removeprefix("--identity: ")) from None


def stage_defaults(stage: ChatStage) -> dict:
    """Every flag's default for this stage (ChatTrainConfig's, overridden by the stage's own)."""
    return {**asdict(ChatTrainConfig()), "source": stage.sources[0], **stage.defaults}


def parse_config(stage: ChatStage, argv: list[str] | None = None) -> ChatTrainConfig:
    """Flags (dash or underscore spellings) -> a validated config; ValueError names the flag."""
    parser = FlagParser(prog=stage.prog, description=(
        f"{stage.title}: train the {stage.name} checkpoint from a {' or '.join(stage.sources)} checkpoint (--source) "
        "of the same --model-tag. Ctrl-C or SIGTERM finishes the step, saves a checkpoint and prints the command "
        "that resumes it; the end prints the next stage's command."))
    defaults = stage_defaults(stage)
    for f in fields(ChatTrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", help=CHAT_FLAG_HELP[f.name])
        elif f.type == "bool | None":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help="default: on for CUDA, off elsewhere")
        elif f.name == "identity":
            either = parser.add_mutually_exclusive_group()   # both at once: an error, not "last wins"
            either.add_argument(flag, default=defaults[f.name], metavar="NAME", help=EXTRA_HELP[f.name],
                                type=_identity_flag)
            either.add_argument("--no-identity", dest=f.name, action="store_const", const="",
                                help="leave the built-in identity conversations out (e.g. for your own, "
                                     "--extra-conversations)")
        elif f.type == "list[str]":
            parser.add_argument(flag, action="append", default=[], metavar="PATH", help=EXTRA_HELP[f.name])
        else:
            about = CHAT_FLAG_HELP.get(f.name)
            help_text = (f"{about}; " if about else "") + f"default: {defaults[f.name]}"
            if f.name == "source":
                help_text = (f"{'|'.join(stage.sources)}: the checkpoint phase to start from; "
                             f"default: {stage.sources[0]}")
            if f.name == "eval_every":
                help_text = ("N: evaluate val bpb at step 0, every N steps and at the last step; -1 or 0: never, "
                             f"not even at the last step; default: {defaults[f.name]}")
            if f.name == "total_batch_size":
                help_text += f" ({stage.step_text()} a step on any number of GPUs, by gradient accumulation)"
            parser.add_argument(flag, type=_FLAG_TYPES[f.type], default=defaults[f.name], help=help_text)
    args = vars(parser.parse_args(argv))
    # validate() reads "" as "the stage's default" (the dataclass default): an explicit empty
    # --source ("$SRC" unset) silently started from that instead
    require(args["source"] != "", "--source", "", "|".join(stage.sources))
    return ChatTrainConfig(**args).validate(stage)


# ------------------------------------------------------------------ what the stages say in flags

def spell_flags(name: str, value) -> list[str]:
    """A config value back as the flags that set it (loop.as_flags: a value starting with "-", such as
    --identity=-Bob, stays one word with its flag), but an identity of "" is --no-identity."""
    return ["--no-identity"] if name == "identity" and value == "" else as_flags(name, value)


def resume_command(stage: ChatStage, cfg: ChatTrainConfig, tag: str, world_size: int = 1, **overrides) -> str:
    """The command that continues a stopped run (loop.resume_command): the flags it was given (those
    that differ from the stage's defaults; `overrides` replace values, e.g. an out-of-memory stop's
    lower --device-batch-size), its model tag as resolved, and --resume latest; no --overwrite."""
    return loop_resume_command(stage.prog.rsplit(".", 1)[-1], cfg, stage_defaults(stage), tag, world_size,
                               spell=spell_flags, **overrides)


# the flags of a finished stage that its next chat stage takes, with the same meaning: where the data
# is, the user's own conversations and name, the rows, and the device the user picked (and its peak)
_CARRIED = ("device", "dtype", "kernel", "compile", "data_dir", "test_holdout", "max_seq_len", "extra_conversations",
            "identity", "peak_flops")


def next_commands(stage: ChatStage, cfg: ChatTrainConfig, tag: str, world_size: int = 1) -> list[tuple[str, str]]:
    """(what it does, command) of what comes after this stage, for the model tag it trained: chat_sft
    after mid (with the flags of _CARRIED the user set: an offline --test-holdout, their own
    --extra-conversations and --identity, so that SFT trains the same model on the same kind of
    data), chat_eval and chat_web after SFT."""
    defaults = stage_defaults(stage)
    given = {name: getattr(cfg, name) for name in _CARRIED if getattr(cfg, name) != defaults[name]}
    if stage.name == "mid":
        args = spell_flags("model_tag", tag) + [a for name, value in given.items() for a in spell_flags(name, value)]
        return [("fine-tune it for chat", f"{launcher('chat_sft', world_size)} {shlex.join(args)}")]
    args = ["-i", stage.name, *spell_flags("model_tag", tag)] + [a for name in ("device", "dtype") if name in given
                                                      for a in spell_flags(name, given[name])]
    eval_args = args + (spell_flags("data_dir", given["data_dir"]) if "data_dir" in given else [])
    return [("evaluate it", f"python -m scripts.chat_eval {shlex.join(eval_args)}"),
            ("talk to it", f"python -m scripts.chat_web {shlex.join(args)}")]


def describe_mixture(mix) -> str:
    """The training mixture by source, in mixture order: "chat 1,874 (a.jsonl), Identity 1,000 x2,
    MMLU 13,940 (mmlu.jsonl), ..." (a task listed twice is oversampled: "x2")."""
    counts: dict[int, list] = {}
    for task in mix.tasks:
        entry = counts.setdefault(id(task), [task, 0])
        entry[1] += 1
    parts = []
    for task, times in counts.values():
        name = getattr(task, "name", None) or ("chat" if hasattr(task, "rows") else type(task).__name__)
        source = getattr(task, "source", None)
        files = ", ".join(Path(p).name for p in str(source).split(", ")) if source else ""
        if type(task).__name__ == "ConversationFile":   # the user's own file: its name is the label
            name, files = files, ""
        parts.append(f"{name} {len(task):,}" + (f" x{times}" if times > 1 else "") + (f" ({files})" if files else ""))
    return ", ".join(parts)


def describe_epochs(num_iterations: int, given: int, epoch_steps: int, epochs: float) -> str:
    """What the run's steps are in epochs of the mixture (one epoch: every conversation once, as
    -1 iterations trains; estimated from the packing of its first conversations)."""
    steps = f"{num_iterations:,} iteration{'s' if num_iterations != 1 else ''}"
    if given == -1:   # a mixture smaller than one step: its one step repeats it (said, not hidden in "one epoch")
        return f"{steps} (-1: one epoch of the mixture" + (f"; a step holds {epochs:.3g} epochs of it)" if epochs >= 1.5
                                                            else ")")
    text = f"{steps} = {epochs:.3g} epochs of the mixture (one is ~{epoch_steps:,} steps"
    return text + ("; its conversations repeat, each epoch in a new order)" if epochs > 1 else ")")


def auto_choices(cfg: ChatTrainConfig, rt, tag: str, seq_len: int, compile_model: bool) -> list[str]:
    """What each flag left to `auto` (or not given) became on this machine."""
    said = []
    if cfg.model_tag is None:
        said.append(f"--model-tag {tag} (the {cfg.source} checkpoints' only tag, or their deepest d<N>)")
    if cfg.device == "auto":
        said.append(f"--device {rt.device}")
    if cfg.dtype == "auto":
        said.append(f"--dtype {rt.dtype_name}" + (" ($NANOCHAT_DTYPE)" if os.environ.get("NANOCHAT_DTYPE") else ""))
    if cfg.compile is None:
        said.append(("--compile" if compile_model else "--no-compile") + " (compile: on for CUDA only)")
    if cfg.max_seq_len == -1:
        said.append(f"--max-seq-len {seq_len} (the model's sequence length)")
    return said


def print_banner(cfg: ChatTrainConfig, stage: ChatStage, rt, *, source: dict, tag: str, ckpt_dir, disk: str, plan,
                 train_mix, mixture: dict, seq_len: int, compile_model: bool, device_name: str,
                 resumed_at: int | None, iterations: str, evals: str) -> None:
    """The start-up lines (rank 0): the checkpoint it starts from (with its model.pt's sha256) and
    where it saves, the step it resumes, the mixture by source, the batch, the steps in epochs,
    the device, and what each flag left to auto became."""
    from nanochat.checkpoint import step_dirname
    sha = (source.get("model_sha256") or "")[:12]
    print0(f"{stage.title}: {source['phase']}/{tag} step {source['step']}" + (f" (model.pt sha256 {sha})" if sha else "")
           + f" -> {ckpt_dir} ({disk})")
    if resumed_at is not None:
        print0(f"  resuming from {Path(ckpt_dir) / step_dirname(resumed_at)}: continues at step {resumed_at}")
    print0(f"  mixture of {len(train_mix):,} conversations (mask {stage.mask}, fill {stage.fill}): "
           f"{describe_mixture(train_mix)}")
    if cfg.total_batch_size == -1:
        print0(f"  --total-batch-size -1: the {stage.name} step of {stage.step_text(plan.total_batch_size, seq_len)} "
               "on any number of GPUs")
    print0(f"  {plan.describe()}; {iterations}; lr x {cfg.init_lr_frac}; {evals}; "
           f"device {rt.device} ({device_name}, {rt.dtype_name}); compile {'on' if compile_model else 'off'}, "
           f"kernel {cfg.kernel}")
    auto = auto_choices(cfg, rt, tag, seq_len, compile_model)
    if auto:
        print0(f"  auto: {'; '.join(auto)}")
    for path, count in Counter(cfg.extra_conversations).items():
        n = next(f["conversations"] for f in mixture["extra_conversations"] if f["path"] == path)
        print0(f"  --extra-conversations {path}: {n:,} conversation{'s' if n != 1 else ''}"
               + (f", mixed in {count}x" if count > 1 else ""))
    if not cfg.identity:
        print0("  --no-identity: without the built-in identity conversations")
    elif cfg.identity != IDENTITY_NAME:
        print0(f"  --identity {cfg.identity}: the identity conversations name the model {cfg.identity}")


MADE_FROM = {"mid": "base", "sft": "mid"}   # HOW_TO_MAKE's command starts from this phase's checkpoint


def tag_with_checkpoint(phase: str | None, model_tag: str | None, base_dir) -> str | None:
    """`model_tag` (or, not given, the phase's default tag) when it has a checkpoint of `phase`."""
    from nanochat.checkpoint import LATEST_NAME, CheckpointError, checkpoint_dir, find_model_tag
    try:
        tag = model_tag or (find_model_tag(phase, base_dir) if phase else None)
    except CheckpointError:   # none, or several and no d<N>
        return None
    return tag if tag and (checkpoint_dir(phase, tag, base_dir) / LATEST_NAME).is_file() else None


def epochs_of(num_iterations: int, rows_per_step: int, epoch_rows: float) -> float:
    """Epochs of the mixture the run's rows are (a mixture packs into at least one row)."""
    return num_iterations * rows_per_step / max(epoch_rows, 1.0)
