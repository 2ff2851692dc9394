"""The evaluations that run during training give the same number on 1 and on 2 ranks (CPU, gloo):
base_train's periodic val bpb and mid_train / chat_sft's (nanochat/chat_train.py), as base_eval's
and chat_eval's already did (tests/test_ranks_review13.py).

Before, each rank read a val loader of its own documents (base) or conversations (chat), which
packed into other rows than one process packs, and the batch count was --eval-tokens // (rows x
ranks): 2 ranks scored other (and fewer) tokens than 1, so a val bpb moved with the launch. Now
every rank reads the one stream a single process reads (eval_bpb.eval_loader, rank 0 of 1),
eval_bpb.EvalBatches deals its first N batches to the ranks, and evaluate_bpb sums the per-batch
nats and bytes of every rank with math.fsum (exactly rounded, so independent of which rank held
which batch): the same float to the last bit, compared with ==. (A batch's own float64 sum is the
same on any rank: the same rows through the same weights, one thread per process here.)

chat_rl's periodic eval needed no change: it is run_generative, which samples problem i with seed
+ i on whichever rank holds it and sums pass@k in problem order (tests/test_ranks_review13.py).

Also: a rank left without a batch of its own (fewer batches than ranks) still runs the unscored
forward an FSDP model's collectives need, on a batch it read for another rank.

Workers set up their own gloo group with a short timeout (a rank stuck at a collective fails the
test in seconds) and os._exit(0) on success, as tests/test_multiprocess.py's do."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.multiprocessing as mp

from nanochat.distributed import free_port
from tests.test_distributed import _torchrun_env
from tests.test_multiprocess import _Gathering, _masked_batches
from tests.test_multiprocess import _tiny_model as _small_model
from tests.test_ranks_review13 import _corpus

WORLD = 2
ROWS, SEQ = 8, 64
# 3 val batches of 8 x 64 tokens (and a remainder): odd, so 2 ranks score 2 + 1 of them
BASE = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", str(SEQ),
        "--device-batch-size", str(ROWS), "--total-batch-size", "1024", "--window-pattern", "SL",
        "--sample-every", "-1", "--eval-every", "100", "--eval-tokens", str(3 * ROWS * SEQ + 100), "--no-compile",
        "--num-iterations", "1", "--wandb", "off"]
# SFT from the 1-process base checkpoint "one"; 5 val batches of 2 x 64 tokens
SFT = ["--source", "base", "--model-tag", "one", "--device", "cpu", "--device-batch-size", "2", "--max-seq-len",
       str(SEQ), "--test-holdout", "100", "--no-compile", "--eval-every", "100", "--eval-tokens", str(5 * 2 * SEQ),
       "--num-iterations", "1", "--total-batch-size", "256", "--wandb", "off"]


def _val_bpbs(base_argv: list[str], sft_argv: list[str], patch) -> dict:
    """Runs base_train then chat_sft; returns each one's evaluate_bpb results in order (step 0 first).
    `patch(obj, name, value)` sets an attribute (monkeypatch.setattr in this process). The process
    group is kept across both runs (a worker's own, torn down at its exit)."""
    import nanochat.common as common
    from nanochat import eval_bpb, writer_lock
    from scripts import base_train, chat_sft

    seen: list[float] = []
    real = eval_bpb.evaluate_bpb

    def recording(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    patch(base_train, "evaluate_bpb", recording)   # imported at its top
    patch(eval_bpb, "evaluate_bpb", recording)     # chat_train imports it inside train()
    patch(base_train, "destroy_runtime", lambda rt: None)
    patch(common, "destroy_runtime", lambda rt: None)
    base_train.main(base_argv)
    base = list(seen)
    seen.clear()
    chat_sft.main(sft_argv)
    writer_lock.release_all()   # this run is over: another process writes its tag next
    return {"base": base, "sft": list(seen)}


def _stand_in_forwards() -> int:
    """evaluate_bpb over a stream of ONE batch on 2 ranks with a model that runs a collective in
    every forward (as FSDP's all-gathers): rank 1 has no batch, and must still take that forward."""
    from nanochat.eval_bpb import EvalBatches, evaluate_bpb

    class Rt:
        rank, world_size, device = int(os.environ["RANK"]), WORLD, torch.device("cpu")

    model = _Gathering(_small_model().eval())
    batches = EvalBatches(iter(_masked_batches(1)), 1, Rt())
    evaluate_bpb(model, batches, batches.steps, torch.ones(128, dtype=torch.long))
    assert batches.tokens() > 0
    return model.calls


def _worker(rank: int, port: int, out: str, base_argv: list[str], sft_argv: list[str]) -> None:
    _torchrun_env(rank, WORLD, port)
    torch.set_num_threads(1)   # as the 1-process run: the same kernels' sums
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    result = _val_bpbs(base_argv, sft_argv, setattr)
    result["stand_in_forwards"] = _stand_in_forwards()
    Path(out, f"r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)   # as tests/test_multiprocess.py: no interpreter teardown racing gloo's threads


def test_periodic_val_bpb_is_the_same_on_one_and_two_ranks(env, shared_data, tmp_path, monkeypatch):
    # 10 train documents (quick to read) x 4: a rank's half of them fills a batch of 8 x 65 tokens (the
    # loader refuses a train split smaller than one batch); 60 val documents of 20..~900 characters: rows pack several
    corpus = _corpus(tmp_path, shared_data)
    train = pq.read_table(corpus / "shard_00000.parquet")
    pq.write_table(pa.concat_tables([train] * 4), corpus / "shard_00000.parquet")
    data = ["--data-dir", str(corpus)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = _val_bpbs(BASE + data + ["--model-tag", "one"], SFT, monkeypatch.setattr)
    finally:
        torch.set_num_threads(threads)
    # two ranks: a base run of its own, and the SFT of the same base checkpoint (replacing that run's)
    mp.spawn(_worker, args=(free_port(), str(tmp_path), BASE + data + ["--model-tag", "two"], SFT + ["--overwrite"]),
             nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD))
    assert len(one["base"]) == len(one["sft"]) == 2   # step 0 and the last step
    # step 0: the same weights on every launch, so the same val bpb to the last bit (the last step's
    # weights differ by the summation order of 2 ranks' gradients, so its bpb is not compared)
    assert r0["base"][0] == r1["base"][0] == one["base"][0], (one["base"], r0["base"])
    assert r0["sft"][0] == r1["sft"][0] == one["sft"][0], (one["sft"], r0["sft"])
    assert r0["stand_in_forwards"] == r1["stand_in_forwards"] == 1


def test_eval_set_reads_its_stream_once_and_replays_this_ranks_batches():
    """EvalSet (base_train's and chat_train's periodic batches): every rank read the whole val stream
    (tokenizing, packing) at every evaluation. Now the first evaluation reads it and keeps this rank's
    share; later ones replay the same batches."""
    from nanochat.eval_bpb import EvalBatches, EvalSet

    class Rt:
        device = torch.device("cpu")

        def __init__(self, rank, world_size):
            self.rank, self.world_size = rank, world_size

    opened = []

    def stream():
        opened.append(1)
        for i in range(5):
            x = torch.full((2, 4), i, dtype=torch.long)
            yield x, x + 100

    for rank, world in ((0, 1), (0, 2), (1, 2)):
        opened.clear()
        kept = EvalSet(stream, 5, Rt(rank, world))
        fresh = list(EvalBatches(stream(), 5, Rt(rank, world)))
        for _ in range(3):
            got = list(kept)
            assert [int(x[0, 0]) for x, _ in got] == [int(x[0, 0]) for x, _ in fresh] == list(range(rank, 5, world))
            assert all(torch.equal(y, x + 100) for x, y in got)
        assert len(opened) == 2 and kept.steps == -(-5 // world)   # one read by EvalSet, one by `fresh`
    lone = EvalSet(stream, 1, Rt(1, 2))   # rank 1 of 2, one batch in all: none of its own
    assert list(lone) == [] and int(lone.seen[0][0, 0]) == 0


def test_eval_set_closes_a_stream_that_failed_and_starts_over_next_time():
    """A fill that raised (an out-of-memory mid-read) left the loader's reader threads running and
    its position mid-stream; it is closed, and the next evaluation reads from the start."""
    from nanochat.eval_bpb import EvalSet

    class Rt:
        rank, world_size, device = 0, 1, torch.device("cpu")

    class Stream:
        closed, fail = 0, True

        def __iter__(self):
            for i in range(3):
                if i == 1 and Stream.fail:
                    raise MemoryError("mid-read")
                yield torch.full((1, 2), i), torch.full((1, 2), i)

        def close(self):
            Stream.closed += 1

    kept = EvalSet(Stream, 3, Rt())
    try:
        list(kept)
        raise AssertionError("the failure was swallowed")
    except MemoryError:
        pass
    assert Stream.closed == 1
    Stream.fail = False
    assert [int(x[0, 0]) for x, _ in kept] == [0, 1, 2] and Stream.closed == 2
    assert kept._kept[0][0].dtype == torch.int32 and next(iter(kept))[0].dtype == torch.long   # host copies: int32
