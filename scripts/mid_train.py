"""Mid-train a base model on conversations: python -m scripts.mid_train [flags]   (or torchrun ...)

Teaches the base model the chat format, tool use and multiple choice before SFT: loads the `base`
checkpoint (--model-tag, default: the only tag, else the deepest d<N>), trains on a conversation mixture (local
conversations or SmolTalk, identity chats, MMLU/ARC rendered as multiple-choice chats, GSM8K with
calculator tool calls, SimpleSpelling and SpellingBee: upstream nanochat's sizes, so next to the
offline data's ~1.9K local chats the 280K spelling drills are ~93% of the conversations) packed into
BOS-aligned rows of --max-seq-len tokens (every token trains; rows are filled by cropping), and
saves the `mid` checkpoint under the same tag.
-1 iterations = one epoch of the mixture. The recipe lives in nanochat/chat_train.py (shared
with chat_sft); the loop in nanochat/loop.py.
The log's MFU divides by the device table's peak; --peak-flops gives it for a GPU the table lacks
(as base_train's).

Offline (no hub): --test-holdout N trains MMLU/ARC/GSM8K on the local test files minus their
first N problems, so `chat_eval --max-problems N` still scores unseen problems.

Tiny CPU example (after the base_train example; --total-batch-size: the default -1 is the 524,288-token
mid step, 2,048 micro-batches of 4 x 64 here):
    python -m scripts.mid_train --device cpu --num-iterations 20 --device-batch-size 4 \
        --total-batch-size 256 --max-seq-len 64 --test-holdout 100 --eval-every 10
"""

from __future__ import annotations

import sys

from nanochat.chat_flags import parse_config
from nanochat.chat_train import MID, ChatTrainConfig
from nanochat.chat_train import main as run_stage


def parse(argv: list[str] | None = None) -> ChatTrainConfig:
    return parse_config(MID, argv)


def main(argv: list[str] | None = None) -> dict:
    """Parse, validate, train; returns the run summary (with per-step losses)."""
    return run_stage(MID, argv)


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("mid_train", lambda: parse(sys.argv[1:]), lambda: main(sys.argv[1:]))
