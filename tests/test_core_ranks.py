"""CORE under torchrun scores as one process does (nanochat/core_eval.py): the same per-item
verdicts, the same per-sequence scores to the last bit, and the same task scores and CORE, on 1 and
on 2 ranks (CPU, gloo), as val bpb (eval_bpb.py) and chat_eval already were.

Before, each rank rendered, batched and scored its own share of the items: a sequence sat in a batch
of other rows, another padding and another shape than on one process (on a GPU the shape picks the
kernels), so near-ties between choices could break differently on 2 GPUs than on 1. Now the ranks
tokenize a share of the items each and gather the sequences, every rank makes one process's batches
of them (plan_batches), the task's batch g goes whole to rank g % world (dealt_batches), and each
chunk's per-sequence scores are gathered before any item is decided.

Also: a rank that runs out of memory alone makes every rank raise, the others naming it (no rank
left waiting at the gather). Workers set up their own gloo group with a short timeout (a rank stuck
at a collective fails the test in seconds) and leave with os._exit(0), as tests/test_multiprocess.py's
and tests/test_ranks_review13.py's do."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nanochat import core_eval
from nanochat.core_eval import CoreData, CoreTask, dealt_batches, plan_batches, run_core_eval
from nanochat.distributed import free_port
from tests.test_eval_edge import ByteTok   # bytes as token ids, BOS 256

WORLD = 2
BATCH_TOKENS = 192   # 21, 8 and 3 batches of 1..5 rows: ragged lengths, odd batch counts


def _tiny_gpt(state_path: str):
    from nanochat.gpt import GPT, GPTConfig

    cfg = GPTConfig(sequence_len=256, vocab_size=257, n_layer=1, n_head=2, n_kv_head=2, n_embd=32,
                    window_pattern="L")
    model = GPT(cfg)
    model.load_state_dict(torch.load(state_path))
    return model.eval()


def _save_tiny_gpt(path: Path) -> None:
    from nanochat.gpt import GPT, GPTConfig

    cfg = GPTConfig(sequence_len=256, vocab_size=257, n_layer=1, n_head=2, n_kv_head=2, n_embd=32,
                    window_pattern="L")
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():   # init zeroes the output projections: spread the choices' scores apart
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    torch.save(model.state_dict(), path)


def _core_data() -> CoreData:
    words = "red blue green amber violet cyan teal olive".split()
    mc = [{"query": f"Q{i}: pick {'x' * (i % 5)}", "choices": words[i % 3: i % 3 + 2 + i % 3], "gold": i % 2}
          for i in range(14)]
    sc = [{"context_options": [f"The {w} one" + "." * (i % 4), f"A {w}"], "continuation": "was there.",
           "gold": i % 2} for i, w in enumerate(words + words[:5])]
    lm = [{"context": f"{i} {'ab' * (i % 6)}", "continuation": "ab" if i % 2 else "ba"} for i in range(11)]
    tasks = [(CoreTask("mc", "multiple_choice", 2, 0.3, "\nAnswer: "), mc),
             (CoreTask("sc", "schema", 1, 0.5, " "), sc),
             (CoreTask("lm", "language_modeling", 2, 0.0, " "), lm)]
    return CoreData("test", [t.label for t, _ in tasks], tasks)


def _evaluate(model) -> dict:
    """run_core_eval with per-item verdicts, every forward's input and every gathered score."""
    forwards, scores = [], []
    real_dealt = core_eval._score_dealt

    def dealt(*args, **kwargs):
        got, n = real_dealt(*args, **kwargs)
        scores.append(got)
        return got, n

    def recording(x):
        forwards.append(x.tolist())
        return model(x)
    recording.config, recording.eval, recording.train = model.config, model.eval, model.train
    core_eval._score_dealt = dealt
    try:
        out = run_core_eval(recording, ByteTok(), "cpu", data=_core_data(), batch_tokens=BATCH_TOKENS,
                            per_item=True, log=lambda *a: None)
    finally:
        core_eval._score_dealt = real_dealt
    out.pop("seconds")
    return {"out": out, "forwards": forwards, "scores": scores}


def _worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    from nanochat.errors import RequestError
    from nanochat.tasks.evaluate import out_of_memory_hint
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=20))
    model = _tiny_gpt(str(Path(tmp, "model.pt")))
    result = _evaluate(model)
    # rank 1 alone runs out of memory at its first batch: both raise, rank 0 naming rank 1
    oom_model = model
    if rank == 1:
        def oom_model(x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        oom_model.config, oom_model.eval, oom_model.train = model.config, model.eval, model.train
    try:
        with out_of_memory_hint("base_eval CORE", "--device-batch-size", 8):
            run_core_eval(oom_model, ByteTok(), "cpu", data=_core_data(), batch_tokens=BATCH_TOKENS,
                          log=lambda *a: None)
        result["oom"] = None
    except RequestError as e:
        result["oom"] = str(e)
    dist.barrier()
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)   # no interpreter teardown racing gloo's threads


def test_core_on_two_ranks_scores_as_one_process(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    _save_tiny_gpt(tmp_path / "model.pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the workers: the same kernels' float reduction order
    try:
        one = json.loads(json.dumps(_evaluate(_tiny_gpt(str(tmp_path / "model.pt")))))   # floats as the workers'
    finally:
        torch.set_num_threads(threads)
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))

    verdicts = one["out"]["per_item"]
    assert {k: len(v) for k, v in verdicts.items()} == {"mc": 14, "sc": 13, "lm": 11}
    assert 0 < sum(verdicts["mc"]) < 14 and 0 < sum(verdicts["sc"]) < 13   # the comparison can fail
    # the same verdicts, scores, centered scores and CORE on both ranks as on one process, exactly
    assert r0["out"] == r1["out"] == one["out"]
    # every sequence's (mean NLL, total NLL, exact) the same floats, on each rank
    assert r0["scores"] == r1["scores"] == one["scores"]
    # one process's batches (the same rows, padding and shapes), dealt whole per task: batch g -> rank g % 2
    per_task = [len(plan_batches([len(ids) for ids in _sequences(t, items)], batch_tokens=BATCH_TOKENS))
                for t, items in _core_data().tasks]
    assert min(per_task) >= 3 and sum(n % 2 for n in per_task) >= 1, per_task   # odd counts: uneven shares
    want, at = {0: [], 1: []}, 0
    for n in per_task:
        task_forwards = one["forwards"][at: at + n]
        at += n
        for rank in (0, 1):
            want[rank] += task_forwards[rank::2]
    assert at == len(one["forwards"])
    assert r0["forwards"] == want[0] and r1["forwards"] == want[1]
    # a rank out of memory alone: the other names it; nobody waited at the gather
    assert r1["oom"].startswith("base_eval CORE: out of memory at --device-batch-size 8"), r1["oom"]
    assert r0["oom"].startswith("base_eval CORE: out of memory on rank 1 of 2 at --device-batch-size 8"), r0["oom"]


def _sequences(task, items):
    """The token ids of a task's scored sequences, as evaluate_task makes them (all items, one chunk)."""
    from nanochat.core_eval import fewshot_indices, render_prompts, tokenize_items
    rendered = [render_prompts(task, item, [items[j] for j in fewshot_indices(i, len(items), task.num_fewshot)])
                for i, item in enumerate(items)]
    return [ids for seqs in tokenize_items(ByteTok(), task, rendered, 256) for ids, _ in seqs]


# ------------------------------------------------------------------ the dealing itself

def test_dealt_batches_give_each_batch_to_one_rank_in_turn_across_chunks():
    for world in (1, 2, 3, 5):
        for first in (0, 1, 4, 7):
            for n in range(9):
                shares = [list(dealt_batches(n, r, world, first)) for r in range(world)]
                assert sorted(j for s in shares for j in s) == list(range(n)), (world, first, n)
                for r, share in enumerate(shares):
                    assert all((first + j) % world == r for j in share)
    # a task's batches numbered across chunks: chunks of 3, 2 and 2 batches on 2 ranks
    firsts, got = [0, 3, 5], {0: [], 1: []}
    for first, n in zip(firsts, [3, 2, 2]):
        for r in (0, 1):
            got[r] += [first + j for j in dealt_batches(n, r, 2, first)]
    assert got == {0: [0, 2, 4, 6], 1: [1, 3, 5]}
    for bad in ((3, 2, 2), (3, -1, 2), (3, 0, 0), (-1, 0, 2)):
        with pytest.raises(ValueError, match="accepted"):
            dealt_batches(*bad)


def test_plan_is_one_process_batching_and_covers_each_sequence_once():
    lengths = [30, 70, 30, 5, 129, 64, 64, 12, 30]
    plan = plan_batches(lengths, batch_tokens=128, max_len=256)
    assert [k for _, _, rows in plan for k in rows] == [4, 1, 5, 6, 0, 2, 8, 7, 3]   # longest first, stable
    assert [(T, B) for T, B, _ in plan] == [(129, 1), (70, 1), (64, 2), (30, 4), (5, 1)]
    assert all(B == len(rows) and T == max(lengths[k] for k in rows) for T, B, rows in plan)
    fixed = plan_batches(lengths, batch_tokens=128, max_len=256, fixed_shapes=True)
    assert [(T, B) for T, B, _ in fixed] == [(256, 1), (128, 1), (64, 2), (32, 4), (32, 4)]
    assert sorted(k for _, _, rows in fixed for k in rows) == list(range(len(lengths)))
