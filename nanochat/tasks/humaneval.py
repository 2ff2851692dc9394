"""HumanEval: write a Python function from its signature + docstring; scored by running the tests.

The completion is executed with `nanochat.execution.execute_code` (separate process, time and
memory limits, no network, read-only filesystem where the OS allows it).
Local file: `humaneval.jsonl` (fields as released). Hub: openai/openai_humaneval.
"""

from __future__ import annotations

import re

from nanochat.execution import execute_code
from nanochat.tasks.common import Task, check_rows, load_rows

_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_program(completion: str, prompt: str, entry_point: str) -> str:
    """The code to run: the prompt, then the first fenced block if any, else the raw completion.

    The prompt always comes first (as in the official HumanEval harness): it carries the imports
    and any helper functions the entry point uses (HumanEval/10, 32, 38, 50). A completion that
    defines `entry_point` itself simply redefines the prompt's docstring-only stub.
    """
    m = _FENCE.search(completion)
    code = m.group(1) if m else completion
    if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is None:
        return prompt + code  # a function body continues the prompt's signature
    return prompt.rstrip("\n") + "\n\n\n" + code


class HumanEval(Task):
    eval_type = "generative"
    name = "HumanEval"

    def __init__(self, *, data_dir=None, timeout_s: float = 10.0, memory_mb: int = 1024, **kw):
        super().__init__(**kw)
        self.rows, self.source = load_rows("eval", ["humaneval.jsonl"], data_dir=data_dir,
                                           hub=("openai/openai_humaneval", None, "test"))
        check_rows(self.rows, self.source, ("task_id", "prompt", "canonical_solution", "test", "entry_point"))
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        r = self.rows[index]
        return {"messages": [{"role": "user", "content": r["prompt"]},
                             {"role": "assistant", "content": r["prompt"] + r["canonical_solution"]}],
                "task_id": r["task_id"], "prompt": r["prompt"], "test": r["test"],
                "entry_point": r["entry_point"]}

    def program(self, conversation: dict, completion: str) -> str:
        code = extract_program(completion, conversation["prompt"], conversation["entry_point"])
        return f"{code}\n\n{conversation['test']}\n\ncheck({conversation['entry_point']})\n"

    def evaluate(self, conversation: dict, completion: str) -> bool:
        result = execute_code(self.program(conversation, completion), timeout_s=self.timeout_s,
                              memory_mb=self.memory_mb)
        return result.passed

    def reward(self, conversation: dict, completion: str) -> float:
        return float(self.evaluate(conversation, completion))
