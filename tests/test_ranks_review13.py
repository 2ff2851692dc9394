"""Thirteenth review of evaluation under torchrun (CPU, gloo, 2 processes) as one rank versus two:

* chat_eval: categorical tasks score each problem in the batch one process scores it in (ranks take
  whole batches: a batch's shape picks its kernels on a GPU), generative tasks sample problem i with
  seed + i on any rank, and the pass@k sums are made in problem order: the same scores to the last bit;
* a rank whose part of a task fails alone (its own out of memory) makes every rank raise at the
  task's end: the rank that speaks names the failed rank and the flag to lower. Before, the other
  ranks waited at the counts all-reduce, which failed when the failed rank tore its group down
  ("Connection closed by peer"), and torchrun killed the failed rank before it said why;
* group_left_on_success leaves the process group only when the work ended normally;
* base_eval's bpb is over the same batches on any number of ranks (every rank reads the one stream,
  distributed.StridedMicroBatches deals it); before, each rank packed its own documents and the
  batch count was --eval-tokens // (rows x ranks): another token set and another bpb on 2 ranks;
* StridedMicroBatches over a finite stream keeps the last items (it dropped a rank's item when the
  stream ended on a later rank's turn) and stops at `limit`;
* results JSON files are written once (rank 0), with no temporary file left.

Spawned workers set up their own gloo group with a short timeout: a rank stuck at a collective fails
the test in seconds instead of hanging it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.multiprocessing as mp

from nanochat.distributed import StridedMicroBatches, free_port
from tests import test_multiprocess as _mp_tests

REPO = Path(__file__).resolve().parents[1]
WORLD = 2


# ------------------------------------------------------------------ StridedMicroBatches

def test_strided_batches_keep_a_finite_streams_last_items_and_stop_at_limit():
    for n in range(8):   # every item once over the ranks, in rank order of a round, whatever the count
        for world in (1, 2, 3):
            shares = [list(StridedMicroBatches(range(n), r, world)) for r in range(world)]
            assert shares == [list(range(r, n, world)) for r in range(world)], (n, world)
    assert [list(StridedMicroBatches(range(10), r, 2, limit=5)) for r in range(2)] == [[0, 2, 4], [1, 3]]
    it = StridedMicroBatches(iter(range(3)), 0, 2)
    assert list(it) == [0, 2] and list(it) == []   # ended: a later call reads nothing more
    with pytest.raises(ValueError, match="limit"):
        StridedMicroBatches(range(3), 0, 2, limit=-1)


# ------------------------------------------------------------------ eval loops on 2 gloo ranks

class _Tok:
    bos_token_id = 0

    def encode(self, text):
        return [ord(text)]

    def render_for_completion(self, conv):
        return [0, 1 + conv["id"]] + [2] * (conv["id"] % 4)   # prompts of several lengths


# the categorical / generative problem sets of tests/test_multiprocess.py (gold "A" for i % 3 == 0)
_Letters, _Generative = _mp_tests._Letters, _mp_tests._Generative


class _RecordingModel:
    """Answers "A"; records each batch it is given as the problem ids of its rows."""

    def __init__(self):
        self.batches = []

    def __call__(self, x):
        self.batches.append([int(t) - 1 for t in x[:, 1]])
        logits = torch.zeros(*x.shape, 128)
        logits[..., ord("A")] = 1.0
        return logits


class _Engine:
    """Sample j of problem i passes when j < i % 4: 0..3 of 4 samples pass, and pass@k fractions whose
    float sums depend on their order. Records (problem, seed) per call;
    `fail_on` raises the CUDA allocator's error at that problem."""

    max_seq_len = 64

    def __init__(self, fail_on: int | None = None):
        self.calls, self.fail_on = [], fail_on

    def generate_batch(self, prompt, num_samples, max_tokens, temperature, top_k, seed):
        i = prompt[1] - 1
        if i == self.fail_on:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.calls.append((i, seed))
        return [prompt + [100 + int(j < i % 4)] for j in range(num_samples)], None


N_PROBLEMS, BATCH, SAMPLES = 11, 3, 4


def _score(fail_on: int | None = None):
    import nanochat.tasks.evaluate as ev
    model, engine = _RecordingModel(), _Engine(fail_on)
    cat = ev.run_categorical(model, _Tok(), _Letters(N_PROBLEMS), "cpu", batch_size=BATCH)
    gen = ev.run_generative(engine, _Tok(), _Generative(N_PROBLEMS), "cpu", num_samples=SAMPLES,
                            temperature=1.0, seed=5)
    return {"cat": [cat.passed, cat.total], "gen": [gen.passed, gen.total, list(gen.passed_at)],
            "batches": model.batches, "draws": engine.calls}


def _eval_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    import nanochat.tasks.evaluate as ev
    from nanochat.common import init_runtime
    from nanochat.distributed import group_left_on_success
    from nanochat.errors import RequestError
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    rt = init_runtime("cpu", "fp32", seed=0)   # joins the group above
    ev.completion_text = lambda tok, ids: "ok" if ids[-1] == 101 else "no"
    result = _score()
    # rank 1 alone runs out of memory at its second problem (3): every rank raises, none waits
    try:
        with ev.out_of_memory_hint("chat_eval GSM8K", "--num-samples", SAMPLES):
            _score(fail_on=3)
        result["oom"] = None
    except RequestError as e:
        result["oom"] = str(e)
    # the group stays up when the block raised, and is left when it ends normally
    try:
        with group_left_on_success(rt):
            raise ValueError("a rank's own error")
    except ValueError:
        result["kept"] = dist.is_initialized()
    dist.barrier()
    with group_left_on_success(rt):
        pass
    result["left"] = not dist.is_initialized()
    Path(out, f"eval{rank}.json").write_text(json.dumps(result))
    os._exit(0)   # as tests/test_multiprocess.py: no interpreter teardown racing gloo's threads


def test_eval_loops_score_as_one_process_and_fail_together(tmp_path, monkeypatch):
    import nanochat.tasks.evaluate as ev
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(ev, "completion_text", lambda tok, ids: "ok" if ids[-1] == 101 else "no")
    one = _score()   # this process: no group, world 1
    mp.spawn(_eval_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"eval{r}.json").read_text()) for r in range(WORLD))
    assert r0["cat"] == r1["cat"] == one["cat"] and one["cat"][1] == N_PROBLEMS
    # the same floats, not just close: summed in problem order on every rank
    assert r0["gen"] == r1["gen"] == one["gen"] and one["gen"][1] == N_PROBLEMS
    assert 0 < one["gen"][2][0] < one["gen"][2][-1] < N_PROBLEMS   # the check can fail: partial passes
    # categorical: the batches one process makes, dealt whole (rank 0: 1st, 3rd, ...; rank 1: 2nd, ...)
    assert one["batches"] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert r0["batches"] == one["batches"][0::2] and r1["batches"] == one["batches"][1::2]
    # generative: problem i sampled with seed + i on whichever rank has it
    assert sorted(map(tuple, r0["draws"] + r1["draws"])) == [(i, 5 + i) for i in range(N_PROBLEMS)]
    # one rank out of memory: the other names it, each says the flag; nobody hung at a collective
    assert r1["oom"].startswith("chat_eval GSM8K: out of memory at --num-samples 4")
    assert r0["oom"].startswith("chat_eval GSM8K: out of memory on rank 1 of 2 at --num-samples 4"), r0["oom"]
    assert r0["kept"] and r1["kept"] and r0["left"] and r1["left"]


# ------------------------------------------------------------------ the scripts under torchrun

SEQ = 128


def _corpus(root: Path, shared_data: Path) -> Path:
    """Train + val text shards; val: 60 documents of 20..~900 characters, so that rows pack several
    documents and crop their tails (one rank's documents pack into other rows than all of them)."""
    texts = pq.read_table(shared_data / "pretrain" / "tiny" / "shard_00001.parquet",
                          columns=["text"]).column("text").to_pylist()
    words = " ".join(texts).split()
    docs, at = [], 0
    for i in range(60):
        n = 4 + (i * 37) % 150
        docs.append(" ".join(words[at: at + n]))
        at += n
    d = root / "shards"
    d.mkdir()
    pq.write_table(pa.table({"text": docs[:10]}), d / "shard_00000.parquet")
    pq.write_table(pa.table({"text": docs}), d / "shard_00001.parquet")
    return d


def _checkpoint(base_dir: Path, tokenizer, data: Path) -> None:
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.gpt import GPT, GPTConfig
    config = GPTConfig(sequence_len=SEQ, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=2,
                       n_embd=32, window_pattern="L")
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_checkpoint(checkpoint_dir("base", "r13", base_dir), 1, model_state=model.state_dict(),
                    meta={"model_config": asdict(config), "tokenizer_fingerprint": tokenizer.fingerprint,
                          "config": {"data_dir": str(data)}})


# base_eval, then chat_eval, in one torchrun launch: the first keeps the process group for the
# second (a second init_process_group under torchrun's agent store hangs)
RUNNER = """import sys
import nanochat.common as common
from scripts import base_eval, chat_eval
argv = sys.argv[1:]
cut = argv.index("--then")
leave = common.destroy_runtime
common.destroy_runtime = lambda rt: None
base_eval.main(argv[:cut])
common.destroy_runtime = leave
chat_eval.main(argv[cut + 1:])
"""

OOM_RUNNER = """import os, sys, torch
from nanochat.flags import script_main
import nanochat.tasks.evaluate as ev
if os.environ["RANK"] == "1":   # this rank alone runs out of memory
    def draw(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    ev._draw = draw
from scripts import chat_eval
script_main("chat_eval", lambda: chat_eval.parse_args(sys.argv[1:]), lambda: chat_eval.main(sys.argv[1:]))
"""


def _torchrun(script: Path, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_port",
           str(free_port()), str(script), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)


def test_scripts_on_two_ranks_score_as_on_one(tmp_path, base_dir, tiny_tokenizer, shared_data, monkeypatch):
    data = _corpus(tmp_path, shared_data)
    _checkpoint(base_dir, tiny_tokenizer, data)
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "NANOCHAT_EVAL_DIR": str(shared_data / "eval"),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE"):
        env.pop(var, None)
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    monkeypatch.setenv("NANOCHAT_EVAL_DIR", str(shared_data / "eval"))
    # 7 batches of 2 x 128 tokens: odd, and not 2 ranks x 3
    bpb = ["--model-tag", "r13", "--eval", "bpb", "--device", "cpu", "--device-batch-size", "2",
           "--eval-tokens", str(7 * 2 * SEQ + 100), "--splits", "train,val"]
    chat = ["-i", "base", "--model-tag", "r13", "--device", "cpu", "-a", "ARC-Easy|SpellingBee",
            "--max-problems", "7", "-b", "3", "-t", "0.9", "-n", "3", "--max-new-tokens", "6"]
    from scripts import base_eval, chat_eval
    one = tmp_path / "one"
    base_eval.main(bpb + ["--output", str(one / "bpb.json")])
    chat_eval.main(chat + ["--out", str(one / "chat.json")])
    two = tmp_path / "two"
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    r = _torchrun(runner, bpb + ["--output", str(two / "bpb.json"), "--then"] + chat + ["--out", str(two / "chat.json")],
                  env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    b1, b2 = (json.loads((d / "bpb.json").read_text()) for d in (one, two))
    assert b2["world_size"] == 2 and b1["bpb_tokens_by_split"] == b2["bpb_tokens_by_split"]
    assert b1["bpb_tokens_by_split"]["val"] == 7 * 2 * SEQ   # the planned batches: the split holds more
    assert b1["bpb_tokens_by_split"]["train"] < 7 * 2 * SEQ   # ... and a split that ends first (odd batches)
    assert b2["bpb"] == pytest.approx(b1["bpb"], rel=1e-12, abs=0)
    c1, c2 = (json.loads((d / "chat.json").read_text()) for d in (one, two))
    for result in (c1, c2):
        for r_ in result["results"].values():
            r_.pop("seconds")
    assert c1["results"] == c2["results"] and c1["ChatCORE"] == c2["ChatCORE"]
    assert c1["results"]["SpellingBee"]["total"] == 7 and "pass_at" in c1["results"]["SpellingBee"]
    # written once, by rank 0, through a temporary file that is gone
    assert sorted(p.name for p in two.iterdir()) == ["bpb.json", "chat.json"]


def test_a_rank_out_of_memory_alone_is_said_once_and_ends_the_run(tmp_path, base_dir, tiny_tokenizer, shared_data):
    _checkpoint(base_dir, tiny_tokenizer, _corpus(tmp_path, shared_data))
    runner = tmp_path / "oom_runner.py"
    runner.write_text(OOM_RUNNER)
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "NANOCHAT_EVAL_DIR": str(shared_data / "eval"),
           "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE"):
        env.pop(var, None)
    r = _torchrun(runner, ["-i", "base", "--model-tag", "r13", "--device", "cpu", "-a", "SpellingBee",
                           "--max-problems", "4", "--max-new-tokens", "4"], env)
    said = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("chat_eval: error:")]
    assert r.returncode != 0 and said == [
        "chat_eval: error: chat_eval SpellingBee: out of memory on rank 1 of 2 at --num-samples 1; pass a "
        "smaller --max-new-tokens (now 4)"], r.stdout[-3000:] + r.stderr[-3000:]
    assert "Connection closed by peer" not in r.stderr   # no rank failed at a collective


def test_a_world_size_mismatch_says_how_to_launch():
    """A resume on another number of processes said "use the flags of the original run": the world
    size is no flag but the launch, so it now says how to launch the resume."""
    from nanochat.checkpoint import CheckpointError
    from nanochat.resume_checks import check_resume_world

    with pytest.raises(CheckpointError, match=r"world size \(torchrun processes\) 2 but this run has 1; launch it on 2 "
                                              r"processes in all \(torchrun --nproc_per_node x --nnodes = 2\)"):
        check_resume_world({"train": {"world_size": 2}}, 1)
    with pytest.raises(CheckpointError, match=r"processes\) 1 but this run has 2; run it without torchrun \(one process\)"):
        check_resume_world({"train": {"world_size": 1}}, 2)
    check_resume_world({"train": {"world_size": 2}}, 2)
