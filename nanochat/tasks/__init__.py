"""Evaluation and fine-tuning tasks (conversations + scoring); see common.py for the interface.

`get_task(name, **kw)` builds an eval task by the name chat_eval uses.
"""

from __future__ import annotations

from nanochat.tasks.arc import ARC
from nanochat.tasks.common import DataUnavailableError, Task, TaskMixture, TaskSequence
from nanochat.tasks.conversations import ConversationFile, LocalConversations, SmolTalk, get_conversations
from nanochat.tasks.gsm8k import GSM8K
from nanochat.tasks.humaneval import HumanEval
from nanochat.tasks.identity import IdentityConversations
from nanochat.tasks.mmlu import MMLU
from nanochat.tasks.spelling import SimpleSpelling, SpellingBee

# name -> (factory, random-guess baseline used for centering in ChatCORE)
EVAL_TASKS = {
    "ARC-Easy": (lambda **kw: ARC("easy", "test", **kw), 0.25),
    "ARC-Challenge": (lambda **kw: ARC("challenge", "test", **kw), 0.25),
    "MMLU": (lambda **kw: MMLU("test", **kw), 0.25),
    "GSM8K": (lambda **kw: GSM8K("test", **kw), 0.0),
    "HumanEval": (lambda **kw: HumanEval(**kw), 0.0),
    "SpellingBee": (lambda **kw: SpellingBee(size=256, split="test", **kw), 0.0),
}
# each eval task's class, for what is known before its data loads (eval_type: chat_eval's -n applies to
# generative tasks only)
EVAL_TASK_CLASSES = {"ARC-Easy": ARC, "ARC-Challenge": ARC, "MMLU": MMLU, "GSM8K": GSM8K, "HumanEval": HumanEval,
                     "SpellingBee": SpellingBee}
# which problems chat_eval --max-problems N scores (its --help says it): each task's first N in its
# own order (evaluate._indices)
MAX_PROBLEMS_HELP = ("N: score each task's first N problems, the same every run: MMLU's and HumanEval's in one "
                     "seed-42 shuffle of the file (a spread of the set); GSM8K's file order, already random; "
                     "ARC's file order (grouped by exam in places), which --test-holdout models were split by; "
                     "SpellingBee's words drawn per problem. -1 or not given: every problem")


def get_task(name: str, **kw) -> Task:
    if name not in EVAL_TASKS:
        raise ValueError(f"-a/--task-name: got {name!r}; accepted: {'|'.join(EVAL_TASKS)}")
    return EVAL_TASKS[name][0](**kw)


__all__ = ["ARC", "MMLU", "GSM8K", "HumanEval", "SimpleSpelling", "SpellingBee", "IdentityConversations", "LocalConversations",
           "ConversationFile", "SmolTalk", "get_conversations", "Task", "TaskMixture", "TaskSequence", "DataUnavailableError",
           "EVAL_TASKS", "EVAL_TASK_CLASSES", "MAX_PROBLEMS_HELP", "get_task"]
