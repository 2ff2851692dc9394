"""Review 76 of multi-process runs on a CPU (gloo, 2 ranks), as `torchrun --nproc_per_node=2 -m
scripts.<stage>` meets them:

* a resume whose files are damaged on ONE rank only (its optim_rank1.pt changed on disk): that rank
  raised its CheckpointError alone, while rank 0 built the model, warmed up and entered the loop,
  where its first collective died in gloo's "Connection closed by peer" traceback (under NCCL it
  would wait for the timeout); the user saw rank 0's traceback next to rank 1's line, said late
  (a rank that is not its node's speaker waits flags.SPEAKER_GRACE_S). Now every rank stops at the
  load (distributed.failing_together): rank 0 says at once which rank failed and why.

Probed and found sound (no change): mid / SFT at 2 ranks (checkpoints and report sections written once,
by rank 0); base_eval and chat_eval scores at 2 ranks equal 1 rank's to the last digit (odd
--max-problems too); an explicit --resume at another world size refused with the launch to use;
SIGTERM to torchrun and Ctrl-C to the whole group save one checkpoint and stop every rank; a rank
SIGKILLed mid-run ends the job within a second (torchrun); a second run on the same tag is refused.

Workers set up their own gloo group with a short timeout (a rank stuck at a collective fails the
test in seconds) and os._exit(0) at the end, as tests/test_multiprocess.py's do. The SFT test takes
~11 s on 2 busy cores (under the `slow` mark's 20 s)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nanochat.distributed import free_port
from tests.test_chat_stage_review import train_tiny_base
from tests.test_distributed import _torchrun_env

WORLD = 2
TAG = "r76"
BASE_TAG = "r76base"
SFT = ["--source", "base", "--model-tag", TAG, "--device", "cpu", "--device-batch-size", "2", "--max-seq-len", "64",
       "--total-batch-size", "256", "--test-holdout", "50", "--eval-every", "-1", "--no-compile", "--save-every", "1"]


def _group(rank: int, port: int, timeout_s: float = 20.0) -> None:
    _torchrun_env(rank, WORLD, port)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=timeout_s))


def _outcome(fn) -> dict:
    """What fn() did: {"ok": value} or {"error": type name, "message": text}, and the seconds it took."""
    t0 = time.monotonic()
    try:
        out = {"ok": fn()}
    except Exception as e:   # noqa: BLE001 - the type and the text are the result
        out = {"error": type(e).__name__, "message": str(e)}
    return {**out, "seconds": time.monotonic() - t0}


# ------------------------------------------------------------------ failing_together on its own

def _together_worker(rank: int, port: int, out: str) -> None:
    _group(rank, port, timeout_s=10)
    import torch.distributed as dist

    from nanochat.checkpoint import CheckpointError
    from nanochat.distributed import failing_together

    def part(failing_rank: int | None, error: Exception):
        with failing_together("reading shards", CheckpointError):
            if rank == failing_rank:
                raise error
            return rank

    result = {"none": _outcome(lambda: part(None, RuntimeError())),
              "rank1": _outcome(lambda: part(1, CheckpointError("optim_rank1.pt: damaged"))),
              "rank0_bug": _outcome(lambda: part(0, KeyError("boom")))}
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)   # the group is still whole after the failures: nobody was left mid-collective
    result["sum"] = float(t)
    Path(out, f"r{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    os._exit(0)


def test_failing_together_stops_every_rank_naming_the_one_that_failed(tmp_path):
    mp.spawn(_together_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD))
    assert r0["none"]["ok"] == 0 and r1["none"]["ok"] == 1
    # the failed rank keeps its own error; the other names it and what it said (one line: a RequestError)
    assert r1["rank1"] == {**r1["rank1"], "error": "CheckpointError", "message": "optim_rank1.pt: damaged"}
    assert r0["rank1"]["error"] == "CheckpointError"
    assert r0["rank1"]["message"] == ("reading shards failed on rank(s) 1 of 2, so every rank stops: "
                                      "rank 1: optim_rank1.pt: damaged")
    assert r0["rank0_bug"]["error"] == "KeyError"
    assert r1["rank0_bug"]["error"] == "CheckpointError" and "rank 0: KeyError: 'boom'" in r1["rank0_bug"]["message"]
    assert r0["sum"] == r1["sum"] == 3.0


def test_failing_together_without_a_group_is_the_block_itself():
    from nanochat.distributed import failing_together
    with pytest.raises(KeyError):
        with failing_together("x"):
            raise KeyError("own")
    with failing_together("x"):
        pass


# ------------------------------------------------------------------ chat_sft resume, one rank's shard damaged

def _resume_worker(rank: int, port: int, out: str) -> None:
    _group(rank, port)

    import nanochat.chat_data as chat_data
    import nanochat.common as common
    from nanochat.checkpoint import checkpoint_dir
    from scripts import chat_sft

    chat_data.SFT_CONVERSATIONS = 200   # a faster mixture and epoch estimate
    common.destroy_runtime = lambda rt: None   # one process group for both runs (torn down at exit)
    _run_damage_resume(rank, out, lambda: chat_sft.main(SFT + ["--num-iterations", "1"])["num_iterations"],
                       checkpoint_dir("sft", TAG) / "step_000001",
                       lambda: chat_sft.main(SFT + ["--num-iterations", "2", "--resume", "latest"]))


def _run_damage_resume(rank: int, out: str, first_run, step_dir: Path, resume_run) -> None:
    """first_run() on every rank, one byte of rank 1's optimizer shard in step_dir changed on disk,
    then resume_run(); each rank's outcomes go to r<rank>.json and the process exits."""
    import torch.distributed as dist

    from nanochat import writer_lock
    first = _outcome(first_run)
    writer_lock.release_all()
    dist.barrier()
    if rank == 0:
        shard = step_dir / "optim_rank1.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    dist.barrier()
    resumed = _outcome(resume_run)
    resumed.pop("ok", None)
    Path(out, f"r{rank}.json").write_text(json.dumps({"first": first, "resumed": resumed}))
    os._exit(0)   # no barrier: before the fix rank 0 was inside a collective of the loop


def test_sft_resume_with_one_ranks_shard_damaged_stops_every_rank_at_the_load(base_dir, tiny_corpus, tmp_path,
                                                                              monkeypatch):
    train_tiny_base(base_dir, tiny_corpus, TAG)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    for var in ("NANOCHAT_SETUP_STAGE", "NANOCHAT_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    mp.spawn(_resume_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    _assert_every_rank_stopped(tmp_path, base_dir / "checkpoints" / "sft" / TAG / "step_000001", first=1)


def _assert_every_rank_stopped(out: Path, step_dir: Path, first) -> None:
    """Both ranks' first runs gave `first`; the resume failed on rank 1 naming its shard, and rank 0 (its
    node's speaker) says which rank and which file, not gloo's "Connection closed by peer"."""
    r0, r1 = (json.loads((out / f"r{r}.json").read_text()) for r in range(WORLD))
    assert r0["first"]["ok"] == r1["first"]["ok"] == first, (r0, r1)
    damaged = f"{step_dir}/optim_rank1.pt: the file differs from the one saved"
    assert r1["resumed"]["error"] == "CheckpointError" and r1["resumed"]["message"].startswith(damaged), r1
    assert r0["resumed"]["error"] == "CheckpointError", r0
    assert r0["resumed"]["message"].startswith(
        f"resuming {step_dir} failed on rank(s) 1 of 2, so every rank stops: rank 1: {damaged}"), r0


# ------------------------------------------------------------------ base_train resume, one rank's shard damaged

def _base_resume_worker(rank: int, port: int, out: str, corpus: str) -> None:
    _group(rank, port)

    from nanochat.checkpoint import checkpoint_dir
    from scripts import base_train
    from tests.test_distributed import _base_train_args

    base_train.destroy_runtime = lambda rt: None   # one process group for both runs (torn down at exit)
    args = _base_train_args(Path(corpus))
    args[args.index("--num-iterations") + 1] = "2"
    args[args.index("--model-tag") + 1] = BASE_TAG   # not TAG: the SFT test trains its source model there
    more = args[:args.index("--num-iterations")] + ["--num-iterations", "4"] + args[args.index("--num-iterations") + 2:]
    _run_damage_resume(rank, out, lambda: sorted(base_train.main(args)["losses"]),
                       checkpoint_dir("base", BASE_TAG) / "step_000002", lambda: base_train.main(more + ["--resume", "2"]))


def test_base_train_resume_with_one_ranks_shard_damaged_stops_every_rank_at_the_load(base_dir, tiny_corpus,
                                                                                     tmp_path, monkeypatch):
    """base_train had the same defect as mid / SFT (helper review 76): rank 0 went on into the loop."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    for var in ("NANOCHAT_SETUP_STAGE", "NANOCHAT_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    mp.spawn(_base_resume_worker, args=(free_port(), str(tmp_path), str(tiny_corpus)), nprocs=WORLD, join=True)
    _assert_every_rank_stopped(tmp_path, base_dir / "checkpoints" / "base" / BASE_TAG / "step_000002", first=[0, 1])
