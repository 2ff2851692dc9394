"""Review 13: items earlier sessions noticed and left alone.

1. HumanEval was in file order (short solutions first), so chat_eval --max-problems N scored the
   easiest; it now takes one fixed seed-42 shuffle as MMLU does: every prefix a spread of the set,
   the same each run, the full set unchanged, each problem keeping its sampling seed. ARC keeps the
   file order --test-holdout models were split by.
2. The calculator wrote whole results past 1e15 with 15 significant digits (1e15 + 1 -> "1e+15",
   2**60 / 2 -> "5.76460752303423e+17"); a refused call now has a visible output to force.
3. chat_rl's out-of-memory stop said "lower the device batch size" (no such chat_rl knob for the
   rollouts); it names --sample-batch-size / --device-batch-size and the command that resumes.
4. nanochat/platform.py was 601 lines: Transformer Engine's cuDNN loading moved to te_cudnn.py.
5. Nothing checked that base_train warms torch.compile up on every rank (distributed.warm_up_ranks).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from nanochat.loop import CPU_OUT_OF_MEMORY
from tests.test_engine import tiny_chat_model

REPO = Path(__file__).resolve().parents[1]


def _file_rows(shared_data, name):
    with open(shared_data / "eval" / name, encoding="utf-8") as f:   # by "\n" only: rows hold U+2028
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------ 1. --max-problems: a fixed spread sample

@pytest.mark.parametrize("subset, name", [("easy", "arc_easy.jsonl"), ("challenge", "arc_challenge.jsonl")])
def test_arc_keeps_the_file_order_held_out_models_were_split_by(shared_data, subset, name):
    """ARC stays in file order (a shuffle was tried this review and reverted): a --test-holdout N
    model trained on test[N:] of the file's order, and chat_eval scores test[:N] as its held-out
    problems; reordered, an existing model's "held-out" problems would be ~90% trained-on ones and
    its ARC score inflated with no warning. The help says which problems --max-problems takes."""
    from nanochat.tasks import ARC, MAX_PROBLEMS_HELP
    file_ids = [r["id"] for r in _file_rows(shared_data, name)]
    assert [r["id"] for r in ARC(subset, data_dir=shared_data).rows] == file_ids
    assert "ARC's file order" in MAX_PROBLEMS_HELP


def test_mmlu_keeps_the_order_it_had(shared_data):
    """MMLU's shuffle now goes through the shared fixed_order: the same order as random.Random(42).shuffle."""
    from nanochat.tasks import MMLU
    rows = _file_rows(shared_data, "mmlu.jsonl")
    random.Random(42).shuffle(rows)
    assert [r["question"] for r in MMLU(data_dir=shared_data).rows] == [r["question"] for r in rows]


def test_humaneval_prefix_is_a_spread_and_each_problem_keeps_its_seed(shared_data, tiny_tokenizer, tmp_path):
    """HumanEval's file runs from short solutions to long ones; its first 41 were the easiest quarter.
    Shuffled, a problem still samples with seed + its file position (run_generative), so a sampled
    full run draws what it drew before."""
    from nanochat.tasks import HumanEval
    from nanochat.tasks.evaluate import run_generative
    file_ids = [r["task_id"] for r in _file_rows(shared_data, "humaneval.jsonl")]
    he = HumanEval(data_dir=shared_data)
    first = [file_ids.index(he[i]["task_id"]) for i in range(41)]
    assert sum(p < 41 for p in first) < 20 and max(first) > 120
    assert he.file_example(10)["task_id"] == "HumanEval/10"

    class Seeds:   # an engine that records each call's seed and answers nothing
        max_seq_len = 1 << 20

        def __init__(self):
            self.seeds = []

        def generate_batch(self, prompt, *, num_samples, max_tokens, temperature, top_k, seed):
            self.seeds.append(seed)
            return [list(prompt)] * num_samples, None

    small = tmp_path / "humaneval.jsonl"
    small.write_text("".join(json.dumps(dict(r, task_id=f"t/{k}")) + "\n"
                             for k, r in enumerate(_file_rows(shared_data, "humaneval.jsonl")[:8])))
    task = HumanEval(data_dir=tmp_path)
    task.evaluate = lambda conv, completion: False
    engine = Seeds()
    run_generative(engine, tiny_tokenizer, task, "cpu", temperature=1.0, seed=100)
    drawn = {task[i]["task_id"]: s for i, s in enumerate(engine.seeds)}
    assert drawn == {f"t/{k}": 100 + k for k in range(8)}          # what file order drew
    assert [task[i]["task_id"] for i in range(8)] != [f"t/{k}" for k in range(8)]


def test_the_max_problems_help_says_which_problems():
    from nanochat.tasks import MAX_PROBLEMS_HELP
    assert "a spread of the set" in MAX_PROBLEMS_HELP and "seed-42" in MAX_PROBLEMS_HELP


# ------------------------------------------------------------------ 2. the calculator's numbers and refusals

@pytest.mark.parametrize("expr, out", [
    ("2**60/2", str(2**59)),                        # was 5.76460752303423e+17: an int quotient is exact
    ("2000000000000002/2", "1000000000000001"),     # was 1e+15
    ("1e15 + 1", "1000000000000001"),               # a whole float below 1e16 is exact: was 1e+15
    ("9007199254740992.0 * 1", "9007199254740992"),
    ("1000000000000000.5 + 0", "1000000000000000.5"),   # was 1e+15
    ("2.0**60", "1.152921504606847e+18"),           # repr: reads back as the same double (was ...685e+18)
    ("7/2", "3.5"), ("6/2", "3"), ("10**300/10**299", "10"), ("1e20", "1e+20"), ("0.1+0.2", "0.3"),
])
def test_calculator_writes_large_results_exactly(expr, out):
    from nanochat.calculator import use_calculator
    assert use_calculator(expr) == out


def test_every_whole_float_reads_back_as_itself():
    from nanochat.calculator import format_result
    for k in range(45, 80):
        for v in (float(2**k), float(2**k + 3 * 2 ** max(0, k - 52)), float(10 ** (k - 40)) * 7.0):   # whole
            text = format_result(v)
            assert float(text) == v, (v, text)
            if v < 1e16:
                assert text == str(int(v)), (v, text)


def test_a_refused_call_has_a_visible_output():
    """The engine forced an empty output for a refused call, shown "<<2^3=>>"; tool_output gives it
    a word to force (REFUSED_OUTPUT) and a result otherwise; use_calculator still says None."""
    from nanochat.calculator import REFUSED_OUTPUT, tool_output, use_calculator
    assert tool_output("2^3") == REFUSED_OUTPUT == "error" and use_calculator("2^3") is None
    assert tool_output("1/0") == "error" and tool_output("6*7") == "42"
    assert not REFUSED_OUTPUT.strip("-").replace(".", "").isdigit()   # never read as a number


# ------------------------------------------------------------------ 3. chat_rl's out-of-memory stop

@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


RL = ["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
      "--max-new-tokens", "4", "--test-holdout", "1", "--eval-every", "-1", "--save-every", "1",
      "--num-iterations", "2"]


def _out_of_memory_at_second_call(monkeypatch, owner, name):
    real, calls = getattr(owner, name), []

    def fail_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError(f"{CPU_OUT_OF_MEMORY} 123 bytes")
        return real(*args, **kw)
    monkeypatch.setattr(owner, name, fail_second)


@pytest.mark.parametrize("where, flag", [("sampling", "--sample-batch-size"), ("training", "--device-batch-size")])
def test_chat_rl_out_of_memory_names_its_flag_and_the_command_that_resumes(sft_checkpoint, chat_model, monkeypatch,
                                                                          where, flag):
    """Out of memory in step 1 (after step 1's save): the stop said "lower the device batch size"; it
    names the chat_rl flag that cuts what ran out (the rollouts' KV cache or the backward's chunk), a
    value, and the command that resumes step 1 with it, which continues the run."""
    from nanochat import rl
    from scripts import chat_rl
    monkeypatch.delenv("NANOCHAT_SETUP_STAGE", raising=False)
    if where == "sampling":
        _out_of_memory_at_second_call(monkeypatch, rl.PolicyGradientTrainer, "_sample_rows")
    else:
        _out_of_memory_at_second_call(monkeypatch, rl, "policy_gradient_loss")
    with pytest.raises(ValueError, match="out of CPU memory in step 1 ") as err:
        chat_rl.main(RL + ["--overwrite", "--device-batch-size", "2"])
    message = str(err.value)
    assert f"lower {flag} (e.g. 1:" in message, message
    argv = shlex.split(message.split("; resume with: ")[1])
    assert argv[:5] == ["python", "-m", "scripts.chat_rl", "--model-tag", "d2"] and "--overwrite" not in argv
    assert argv[argv.index(flag) + 1] == "1" and argv[-2:] == ["--resume", "1"]
    monkeypatch.undo()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(sft_checkpoint))
    assert sorted(chat_rl.main(argv[3:])["losses"]) == [1]


def test_chat_rl_out_of_memory_before_a_save_and_at_one_row():
    """Before the first save: the run's own command with the lower value; at one row, --max-new-tokens."""
    from nanochat.rl import PolicyGradientTrainer
    trainer = PolicyGradientTrainer.__new__(PolicyGradientTrainer)
    trainer.num_samples, trainer.sample_batch_size, trainer.sample_rows = 16, 0, 16
    trainer.device_batch_size, trainer.max_new_tokens, trainer.last_checkpoint = 1, 256, None
    trainer.command = lambda **flags: " ".join(f"--{k} {v}" for k, v in flags.items())
    msg = trainer.out_of_memory_hint(3, "sampling", 300, "GPU memory")
    assert "a KV cache of 16 rows x up to 300 tokens (--sample-batch-size 0: a problem's 16 samples in one call)" in msg
    assert msg.endswith("lower --sample-batch-size (e.g. 8: a problem's 16 samples drawn 8 at a time); "
                        "run again with: --sample_batch_size 8"), msg
    msg = trainer.out_of_memory_hint(3, "training", 300, "GPU memory")
    assert "--device-batch-size is at 1: lower --max-new-tokens (now 256, e.g. 128" in msg
    assert msg.endswith("run again with: --max_new_tokens 128"), msg


def test_chat_rl_rerun_command_keeps_the_runs_own_resume_and_overwrite():
    from scripts.chat_rl import parse_config, rerun_command
    cfg = parse_config(["--seed", "3", "--overwrite"])
    assert rerun_command(cfg, "d2", 1, sample_batch_size=4) == \
        "python -m scripts.chat_rl --model-tag d2 --sample-batch-size 4 --seed 3 --overwrite"
    assert rerun_command(cfg, "d2", 1, resume="5").endswith("--seed 3 --resume 5")


# ------------------------------------------------------------------ 4. platform.py's size

def test_platform_is_under_the_size_rule_and_still_owns_the_te_workaround():
    from nanochat import platform, te_cudnn
    assert (REPO / "nanochat" / "platform.py").read_text().count("\n") <= 560
    for name in ("prepare_te_import", "torch_cudnn_dir", "_CUDNN_LOAD_ORDER"):
        assert getattr(platform, name) is getattr(te_cudnn, name), name
    out = subprocess.run([sys.executable, "-c", "import sys, nanochat.te_cudnn; print('torch' in sys.modules)"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr[-2000:]   # nothing heavy at import


# ------------------------------------------------------------------ 5. base_train's compile warm-up on every rank

class _WarmedUp(Exception):
    pass


def _record_warm_up(rank: int, port: int, base_dir: str, record) -> None:
    """Makes this spawned process rank `rank` of a 2-process gloo run with --compile, torch.compile
    standing in as the eager model: distributed.warm_up_ranks runs (its barrier too), then
    `record(args, kwargs, seconds)` notes the call and _WarmedUp ends the run."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      NANOCHAT_BASE_DIR=base_dir)
    import torch
    from nanochat import distributed
    torch.compile = lambda model, **kw: model
    real = distributed.warm_up_ranks

    def recording(*args, **kw):
        record(args, kw, real(*args, **kw))
        raise _WarmedUp
    distributed.warm_up_ranks = recording


def _warm_up_worker(rank: int, port: int, base_dir: str, data_dir: str, out: str) -> None:
    """One rank of base_train: its warm-up's batch shape, vocabulary, device and time recorded."""
    _record_warm_up(rank, port, base_dir, lambda a, kw, took: Path(out, f"rank{rank}.json").write_text(
        json.dumps([a[1], a[2], a[3], str(a[4]), took])))
    from scripts import base_train
    try:
        base_train.main(["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32",
                         "--max-seq-len", "32", "--device-batch-size", "2", "--total-batch-size", "128",
                         "--window-pattern", "L", "--sample-every", "-1", "--eval-every", "-1", "--compile",
                         "--num-iterations", "1", "--model-tag", "warm", "--data-dir", data_dir])
    except _WarmedUp:
        pass


def test_base_train_warms_up_compile_on_every_rank(base_dir, tiny_corpus, tmp_path):
    """Under torchrun with --compile, base_train compiles on every rank before the loop
    (distributed.warm_up_ranks, DESIGN pitfall 9): each rank records one warm-up at its batch shape."""
    import torch.multiprocessing as mp
    from nanochat.distributed import free_port
    mp.spawn(_warm_up_worker, args=(free_port(), str(base_dir), str(tiny_corpus), str(tmp_path)), nprocs=2, join=True)
    calls = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [c[:4] for c in calls] == [[2, 32, calls[0][2], "cpu"]] * 2 and calls[0][2] > 256


def _sft_warm_up_worker(rank: int, port: int, base_dir: str, out: str, sft_argv: list) -> None:
    """One rank of chat_sft: its warm-up's batch shape and loss reduction recorded."""
    _record_warm_up(rank, port, base_dir, lambda a, kw, took: Path(out, f"sft{rank}.json").write_text(
        json.dumps([a[1], a[2], kw.get("loss_reduction")])))
    from datetime import timedelta
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))   # a stuck rank fails soon
    from scripts import chat_sft
    try:
        chat_sft.main(sft_argv)
    except _WarmedUp:
        # out only once both ranks are past the warm-up's barrier (an exit while the other rank was
        # still in it reset its connection), then without interpreter teardown (tests/test_multiprocess.py)
        import time
        deadline = time.monotonic() + 30
        while not all(Path(out, f"sft{r}.json").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os._exit(0)


def test_chat_sft_warms_up_compile_on_every_rank(env, tmp_path):
    """mid_train / chat_sft compiled under torchrun had no warm-up (DESIGN pitfall 9: a rank compiling
    for minutes inside the first collective trips the NCCL watchdog). Now every rank compiles first,
    with the call the Trainer makes (SFT's token-weighted loss_reduction="sum": another graph)."""
    import torch.multiprocessing as mp
    from nanochat import writer_lock
    from nanochat.distributed import free_port
    from scripts import base_train
    from tests.test_train_eval_ranks import BASE, SFT
    base_train.main(BASE + env + ["--model-tag", "one", "--eval-every", "-1"])
    writer_lock.release_all()
    sft = [a for a in SFT if a != "--no-compile"] + ["--compile"]
    mp.spawn(_sft_warm_up_worker, args=(free_port(), os.environ["NANOCHAT_BASE_DIR"], str(tmp_path), sft),
             nprocs=2, join=True)
    calls = [json.loads((tmp_path / f"sft{r}.json").read_text()) for r in (0, 1)]
    assert calls == [[2, 64, "sum"]] * 2, calls


def test_humaneval_log_names_the_problem_by_its_file_position(shared_data, tiny_tokenizer):
    """After the shuffle, run_generative's example lines said "HumanEval example 0" for the shuffled
    task's first problem, which is not HumanEval/0: the log names the file position (the task_id's number)."""
    from nanochat.tasks import HumanEval
    from nanochat.tasks.evaluate import run_generative

    class Engine:
        max_seq_len = 100_000

        def generate_batch(self, prompt, num_samples, **kw):
            return [list(prompt) for _ in range(num_samples)], None

    he, lines = HumanEval(data_dir=shared_data), []
    run_generative(Engine(), tiny_tokenizer, he, "cpu", num_samples=1, max_problems=1, name="HumanEval",
                   log=lines.append)
    number = int(he[0]["task_id"].split("/")[1])
    assert number != 0 and lines[0].startswith(f"  HumanEval example {number}: "), (number, lines)
