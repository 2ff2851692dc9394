"""Evaluation and benchmark review 9: defects found using the eval and benchmark scripts as a user would.

* scripts/benchmark_kernels.py exited 0 when every row was an error (a GPU that could run none of
  the requested kernels, --mode rope on a CPU): a CI job "passed" having measured nothing. Now any
  failed row makes it exit 1 with a line on stderr ("nothing measured" when no row was), as
  documented in --help.
* An out-of-memory error during chat_eval or base_eval was torch's raw traceback; now a one-line
  RequestError naming the flag that sizes the batch and its current value (chat_eval: --batch-size
  for categorical tasks, --num-samples / --max-new-tokens for generative ones; base_eval:
  --device-batch-size, which now sizes CORE's batches too: they were a fixed 16,384 tokens that no
  flag could lower).
* Multiple-choice letters (tasks/arc.py extract_letter): "option B", "Option (B)", "The answer is
  option B." named no answer; "A lot of ..." was read as choice A.
"""

from __future__ import annotations

import json

import pytest
import torch

from nanochat.errors import RequestError

# ------------------------------------------------------------------ benchmark_kernels exit status

TINY_LOSS = ["--device", "cpu", "--mode", "loss", "--rows", "64", "--n-embd", "16", "--vocab", "128",
             "--reps", "1", "--no-compile"]


def test_benchmark_kernels_exits_1_when_nothing_was_measured(capsys):
    from scripts import benchmark_kernels as bk

    assert bk.main(["--device", "cpu", "--mode", "rope", "--no-compile"]) == 1   # rope needs CUDA: one error row
    err = capsys.readouterr().err
    assert "nothing measured" in err and "rope" in err


def test_benchmark_kernels_exits_1_when_a_requested_row_failed(capsys):
    from scripts import benchmark_kernels as bk

    assert bk.main([*TINY_LOSS, "--kernels", "current,liger"]) == 1   # liger needs a CUDA GPU
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"mode"')]
    assert [("error" in r) for r in rows] == [False, True]   # the measured row is still printed
    assert "1 of 2 rows failed (loss/liger)" in err


def test_benchmark_kernels_exits_0_when_every_row_was_measured(capsys):
    from scripts import benchmark_kernels as bk

    assert bk.main([*TINY_LOSS, "--kernels", "current,triton"]) == 0
    assert capsys.readouterr().err == ""
    assert "--kernels current,triton" in bk.SMOKE_RUN   # the documented smoke run must pass on a CPU


def test_benchmark_kernels_help_documents_the_exit_status(capsys):
    from scripts import benchmark_kernels as bk

    with pytest.raises(SystemExit):
        bk.parse_args(["--help"])
    assert "exit status: 0 when every requested row was measured; 1 when any row failed" in capsys.readouterr().out


# ------------------------------------------------------------------ out of memory during evaluation

def chat_cfg(**kw):
    from scripts.chat_eval import ChatEvalConfig

    return ChatEvalConfig(source="sft", **kw).validate()


def oom(*_a, **_k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")


@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr("nanochat.engine.Engine", lambda *a, **k: None)


def test_chat_eval_out_of_memory_names_the_batch_size(monkeypatch, no_engine):
    from types import SimpleNamespace

    from scripts import chat_eval

    monkeypatch.setattr("nanochat.tasks.evaluate.run_categorical", oom)
    task = SimpleNamespace(eval_type="categorical")
    with pytest.raises(RequestError) as e:
        chat_eval.evaluate(chat_cfg(task_name="ARC-Easy"), {"ARC-Easy": task}, None, None, "cpu")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("chat_eval ARC-Easy: out of memory at --batch-size 8")
    assert "a smaller --batch-size (e.g. 4)" in msg
    assert isinstance(e.value.__cause__, torch.cuda.OutOfMemoryError)


def test_chat_eval_generative_out_of_memory_names_samples_and_length(monkeypatch, no_engine):
    from types import SimpleNamespace

    from scripts import chat_eval

    monkeypatch.setattr("nanochat.tasks.evaluate.run_generative", oom)
    task = SimpleNamespace(eval_type="generative")
    cfg = chat_cfg(task_name="GSM8K", max_new_tokens=16)
    with pytest.raises(RequestError, match=r"^chat_eval GSM8K: out of memory at --num-samples 1; pass a smaller "
                                           r"--max-new-tokens \(now 16\)$"):
        chat_eval.evaluate(cfg, {"GSM8K": task}, None, None, "cpu")


def test_the_cpu_allocator_failure_is_one_line_too_and_other_errors_are_not(monkeypatch, no_engine):
    from types import SimpleNamespace

    from scripts import chat_eval

    def cpu_oom(*_a, **_k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 1099511627776 bytes.")

    task = {"MMLU": SimpleNamespace(eval_type="categorical")}
    monkeypatch.setattr("nanochat.tasks.evaluate.run_categorical", cpu_oom)
    with pytest.raises(RequestError, match="out of memory at --batch-size 1; --batch-size is at its smallest"):
        chat_eval.evaluate(chat_cfg(task_name="MMLU", batch_size=1), task, None, None, "cpu")

    def shape_bug(*_a, **_k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr("nanochat.tasks.evaluate.run_categorical", shape_bug)
    with pytest.raises(RuntimeError, match="shapes") as e:   # a bug keeps its traceback
        chat_eval.evaluate(chat_cfg(task_name="MMLU"), task, None, None, "cpu")
    assert not isinstance(e.value, RequestError)


SEQ_LEN = 64


from tests.test_base_eval import checkpoint  # noqa: E402,F401  (fixture: base/d1, a 1-layer GPT of SEQ_LEN 64)


@pytest.mark.usefixtures("checkpoint")
def test_base_eval_bpb_out_of_memory_is_one_line_naming_the_flag(env, tmp_path, monkeypatch, capsys):
    from nanochat.flags import script_main
    from scripts import base_eval

    monkeypatch.setattr(base_eval, "evaluate_bpb", oom)
    argv = [*env, "--eval", "bpb", "--device", "cpu", "--device-batch-size", "6", "--output", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit) as e:
        script_main("base_eval", lambda: base_eval.parse_config(argv), lambda: base_eval.main(argv))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["base_eval: error: base_eval bpb: out of memory at --device-batch-size 6; "
                   "pass a smaller --device-batch-size (e.g. 3)"]


@pytest.mark.usefixtures("checkpoint")
def test_base_eval_core_batches_follow_the_device_batch_size(env, tmp_path, monkeypatch):
    """CORE's batches were a fixed 16,384 tokens: no flag lowered them when CORE ran out of memory."""
    from nanochat import core_eval
    from scripts import base_eval

    seen = {}

    def run_core_eval(*_a, batch_tokens, **_k):
        seen["batch_tokens"] = batch_tokens
        oom()

    monkeypatch.setattr(core_eval, "load_core_data", lambda: None)
    monkeypatch.setattr(core_eval, "run_core_eval", run_core_eval)
    with pytest.raises(RequestError, match=r"^base_eval CORE: out of memory at --device-batch-size 2; pass a "
                                           r"smaller --device-batch-size \(e.g. 1\)$"):
        base_eval.main([*env, "--eval", "core", "--device", "cpu", "--device-batch-size", "2",
                        "--output", str(tmp_path / "r.json")])
    assert seen["batch_tokens"] == 2 * SEQ_LEN


# ------------------------------------------------------------------ multiple-choice letters

def mc(gold: str) -> dict:
    from nanochat.tasks.arc import mc_conversation

    return mc_conversation("Sky colour?", ["green", "blue", "red", "black"], "ABCD".index(gold))


@pytest.mark.parametrize("completion, gold", [
    ("option B", "B"), ("Option (B)", "B"), ("The answer is option B.", "B"), ("Option: D", "D"),
    ("The correct option is C", "C"), ("I choose option c.", "C"), ("Choice A", "A"),
    ("the answer is choice (D)", "D"), ("**Option B**", "B"), ("A lot of people pick option B", "B"),
    ("The answer is C. Option A is wrong.", "C"),   # "answer" outranks a later "option"
    ("A", "A"), ("A, because the sky", "A"), ("__Answer__: (A)", "A"),
    # a leading "A <word>" is the answer unless a letter is named later (the article rule read these as none)
    ("A is correct.", "A"), ("A because plants need light", "A"), ("A is the answer", "A"),
])
def test_option_and_choice_name_a_letter(completion, gold):
    from nanochat.tasks.arc import evaluate_letter

    assert evaluate_letter(mc(gold), completion)
    assert not evaluate_letter(mc("A" if gold != "A" else "B"), completion)


@pytest.mark.parametrize("completion", [
    "Both", "I think so", "optional B", "Options", "option B or C",
    "option B or option C", "The answer is option A or B", "Both A and B",
    "Option C is correct. Option D is wrong.",   # a walk through the options settles nothing
])
def test_words_and_hedges_are_no_answer(completion):
    from nanochat.tasks.arc import evaluate_letter

    assert not any(evaluate_letter(mc(g), completion) for g in "ABCD")
