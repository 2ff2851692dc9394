"""The command line of mid_train / chat_sft: their flags' help text and `parse_config`, which turns
argv (dash or underscore spellings) into a validated `ChatTrainConfig` (nanochat/chat_train.py owns
the config, its checks and the recipe that runs it)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, fields

from nanochat.chat_train import ChatStage, ChatTrainConfig
from nanochat.flags import FlagParser, require
from nanochat.loop import TRAIN_FLAG_HELP
from nanochat.tasks.identity import check_identity_name

_FLAG_TYPES = {"int": int, "float": float, "str": str, "str | None": str}
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
    "eval_tokens": "validation tokens per evaluation; -1: 20 micro-batches",
    "data_dir": "a data root holding eval/ sft/ words/ (or one of them); not given: $NANOCHAT_EVAL_DIR / "
                "$NANOCHAT_SFT_DIR, else eval_data/ / sft_data/ in the base dir, else ../shared/data",
    "no_decontaminate": "keep the conversations whose user turn is word for word a local MMLU / ARC / GSM8K test "
                        "question (left out by default): to resume a run started before that check",
    "test_holdout": "N >= 0: also train on the local MMLU / ARC / GSM8K test files minus their first N problems "
                    "(offline, no train splits); -1: off",
}


def _identity_flag(text: str) -> str:
    """--identity's value, checked as it is parsed: "" is --no-identity's value in the config, and
    an empty --identity (e.g. "$NAME" with NAME unset) left the identity out as if it were."""
    try:
        return check_identity_name(text)
    except ValueError as e:   # argparse words it "argument --identity: <message>"
        raise argparse.ArgumentTypeError(str(e).removeprefix("--identity: ")) from None


def parse_config(stage: ChatStage, argv: list[str] | None = None) -> ChatTrainConfig:
    """Flags (dash or underscore spellings) -> a validated config; ValueError names the flag."""
    parser = FlagParser(prog=stage.prog, description=f"{stage.title}: train the {stage.name} checkpoint.")
    defaults = {**asdict(ChatTrainConfig()), "source": stage.sources[0], **stage.defaults}
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
