"""Supervised fine-tuning for chat: python -m scripts.chat_sft [flags]   (or torchrun ...)

Loads the `mid` checkpoint (--source mid, the default; --source base fine-tunes the base model
directly), trains with the loss on assistant tokens only (user turns, tool outputs and padding
are target -1) on a small conversation mixture (chat, identity, ARC, GSM8K with tool calls,
spelling), rows packed best-fit with whole conversations and padded, the loss averaged over the
real target tokens of the whole accumulated batch; saves the `sft` checkpoint under the same tag.
Defaults follow nanochat: lr x 0.02 (--init-lr-frac), linear decay to 0, -1 iterations = one epoch.
The recipe lives in nanochat/chat_train.py (shared with mid_train); the loop in nanochat/loop.py.
The log's MFU divides by the device table's peak; --peak-flops gives it for a GPU the table lacks
(as base_train's).

Your own data and name: `--extra-conversations my_chats.jsonl` (one {"messages": [...]} per line,
repeatable) and `--identity NAME` (or `--no-identity`); mid_train takes the same flags.

Tiny CPU example (after mid_train):
    python -m scripts.chat_sft --device cpu --num-iterations 10 --device-batch-size 4 \
        --max-seq-len 64 --test-holdout 100 --eval-every 5
"""

from __future__ import annotations

import sys

from nanochat.chat_flags import parse_config
from nanochat.chat_train import SFT, ChatTrainConfig
from nanochat.chat_train import main as run_stage


def parse(argv: list[str] | None = None) -> ChatTrainConfig:
    return parse_config(SFT, argv)


def main(argv: list[str] | None = None) -> dict:
    """Parse, validate, train; returns the run summary (with per-step losses)."""
    return run_stage(SFT, argv)


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("chat_sft", lambda: parse(sys.argv[1:]), lambda: main(sys.argv[1:]))
