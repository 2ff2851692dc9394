"""Evaluation edge cases (session audit): HumanEval completions that carry their own
`if __name__ == "__main__":` block, GSM8K answers written "-$5", and CORE's per-task counts
(no device tensor on one process; every item counted once over 2 gloo processes)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from nanochat import core_eval
from nanochat.core_eval import CoreTask, evaluate_task
from nanochat.tasks import HumanEval
from nanochat.tasks.gsm8k import GSM8K, extract_answer
from nanochat.tasks.humaneval import extract_program


# ------------------------------------------------------------------ HumanEval: the model's main block

MAIN_BLOCKS = [
    # unittest.main() / sys.exit() raised SystemExit before check() ran: "error"
    '\n\nif __name__ == "__main__":\n    import unittest\n    unittest.main()\n',
    "\n\nif __name__ == '__main__':\n    import sys\n    sys.exit(0)\n",
    # input() on the sandbox's closed stdin: EOFError
    '\n\nif __name__ == "__main__":\n    print(has_close_elements(list(map(float, input().split())), 0.5))\n',
    # a demo whose own expectation is wrong: the official harness never runs it
    '\n\nif ("__main__" == __name__):\n    assert has_close_elements([1.0], 0.5)\n',
    '\n\ndef main():\n    raise SystemExit(main_args())\n\nif __name__ == "__main__": main()\n',
]


@pytest.mark.parametrize("block", MAIN_BLOCKS, ids=["unittest", "sys.exit", "input", "reversed", "one-line"])
def test_humaneval_does_not_run_the_models_main_block(shared_data, block):
    """A correct solution followed by a main block scored as a failure: the sandbox runs the
    program as __main__, the official harness exec()s it where __name__ is "builtins"."""
    he = HumanEval(data_dir=shared_data, timeout_s=5.0)
    conv = he.file_example(0)
    solution = conv["messages"][1]["content"]               # prompt + canonical solution
    assert he.evaluate(conv, f"```python\n{solution}{block}```")
    body = solution[len(conv["prompt"]):]                   # a base model's continuation of the prompt
    assert he.evaluate(conv, body + block)


def test_humaneval_main_guard_keeps_the_rest_of_the_program(shared_data):
    """Only the condition changes: a wrong solution still fails, module-level prints still run,
    and a name merely containing __main__ is left alone."""
    he = HumanEval(data_dir=shared_data, timeout_s=5.0)
    conv = he.file_example(0)
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    assert not he.evaluate(conv, wrong + '\nif __name__ == "__main__":\n    print("demo")\n')
    solution = conv["messages"][1]["content"]
    assert he.evaluate(conv, f"{solution}\nprint('at module level', has_close_elements([1.0, 1.1], 0.5))\n")
    program = extract_program('x = 1\nif __name__ == "__main__":\n    x = 2\nif __name__ == "__main__x":\n    x = 3\n',
                              "", "f")
    assert 'if False:\n    x = 2\nif __name__ == "__main__x":' in program


# ------------------------------------------------------------------ GSM8K answers

@pytest.mark.parametrize("text, number", [
    ("so the loss is #### -$10", "-10"), ("#### - $1,250.50.", "-1250.50"), ("#### $-3", "-3"),
    ("#### -3", "-3"), ("#### $1,000", "1000"), ("#### 18.", "18"), ("#### -.5", "-.5"),
])
def test_gsm8k_signed_dollar_answers(text, number):
    """"#### -$10" (a negative amount written with its currency sign) read as no answer at all:
    the test set has negative golds (-10, -3)."""
    assert extract_answer(text) == number
    assert GSM8K.__new__(GSM8K).evaluate({"answer": number}, text)   # the scoring path, no data needed


# ------------------------------------------------------------------ CORE counts

class ByteTok:
    bos_token_id = 256

    def encode(self, text, prepend=None):
        if isinstance(text, list):
            return [self.encode(t, prepend) for t in text]
        return ([prepend] if prepend is not None else []) + list(text.encode())


LM = CoreTask("lm", "language_modeling", 1, 0.0, " ")


def lm_items(n: int) -> list[dict]:
    return [{"context": f"item {i}", "continuation": "ok" if i % 3 else "no"} for i in range(n)]


def fake_scores(seqs):
    """Correct (greedy exact match) exactly for the continuations ending in 'k'."""
    return [(0.0, 0.0, ids[-1] == ord("k")) for ids, _ in seqs]


def test_core_counts_make_no_device_tensor_on_one_process(monkeypatch):
    """evaluate_task built a float64 tensor on the model's device for its two counts even on one
    process: MPS has no float64, so `base_eval --eval core` on a Mac failed after scoring the
    first task. (Here the device is one this build cannot make a tensor on at all.)"""
    monkeypatch.setattr(core_eval, "score_sequences", lambda model, seqs, device, **kw: fake_scores(seqs))
    assert evaluate_task(None, ByteTok(), LM, lm_items(9), "mps") == pytest.approx(6 / 9)


def _ok_model(x):
    """Greedy next byte: 'o' after a space, 'k' after 'o', else a space: "item 4" + " ok" is
    reproduced exactly, " no" is not (the fake_scores verdicts, through real batches)."""
    import torch

    nxt = torch.full((257,), ord(" "))
    nxt[ord(" ")], nxt[ord("o")] = ord("o"), ord("k")
    return torch.nn.functional.one_hot(nxt[x], 257).float() * 10


def _core_worker(rank: int, port: int, out: str, n: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        seen, rows = [], []
        real = core_eval.render_prompts
        core_eval.render_prompts = lambda task, item, shots: (seen.append(item["context"]), real(task, item, shots))[1]
        model = lambda x: (rows.append(x.shape[0]), _ok_model(x))[1]   # noqa: E731
        acc = evaluate_task(model, ByteTok(), LM, lm_items(n), "cpu", chunk_items=2, batch_tokens=1)
        dist.barrier()
        Path(out, f"core{rank}.json").write_text(json.dumps({"acc": acc, "seen": seen, "rows": rows}))
    finally:
        dist.destroy_process_group()


def test_core_sharding_scores_every_item_once_over_two_processes(tmp_path):
    """Contract since CORE deals one process's batches (core_eval.evaluate_task): rank r renders and
    tokenizes the items i % 2 == r, and the ranks gather them; one process's batches (one sequence
    each here, batch_tokens=1) are dealt whole, each scored once over the two ranks; the accuracy is
    one process's."""
    from nanochat.distributed import free_port

    n = 11   # not a multiple of the 2 ranks, and several chunks
    assert evaluate_task(_ok_model, ByteTok(), LM, lm_items(n), "cpu") == sum(i % 3 != 0 for i in range(n)) / n
    mp.spawn(_core_worker, args=(free_port(), str(tmp_path), n), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"core{r}.json").read_text()) for r in range(2))
    assert r0["seen"] == [f"item {i}" for i in range(0, n, 2)] and r1["seen"] == [f"item {i}" for i in range(1, n, 2)]
    assert len(r0["rows"]) == 6 and len(r1["rows"]) == 5 and sum(r0["rows"] + r1["rows"]) == n
    single = sum(i % 3 != 0 for i in range(n)) / n
    assert r0["acc"] == r1["acc"] == pytest.approx(single, abs=1e-12)


def test_a_data_dir_naming_the_eval_folder_finds_the_sibling_word_list(tmp_path):
    """--data-dir .../eval (the help allows naming one of the folders): SpellingBee's words.txt in the
    sibling words/ folder was not found, and chat_eval stopped naming every path it tried."""
    from nanochat.tasks.common import find_local_file, local_dirs

    (tmp_path / "eval").mkdir()
    (tmp_path / "words").mkdir()
    (tmp_path / "words" / "words.txt").write_text("apple\n")
    path, _ = find_local_file("words", ["words.txt"], tmp_path / "eval")
    assert path == tmp_path / "words" / "words.txt"
    assert find_local_file("words", ["words.txt"], tmp_path)[0] == path              # the data root
    assert find_local_file("words", ["words.txt"], tmp_path / "words")[0] == path    # the folder itself
    assert local_dirs("eval", tmp_path / "eval")[0] == tmp_path / "eval"
