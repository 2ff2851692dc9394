"""Ninth review of checkpoint saves under torch.distributed (CPU, gloo, 2 processes):

* a save whose part fails on ONE rank (its optimizer shard meets a full disk, a bug in what it
  saves, rank 0 refused its meta.json) fails on every rank with an error naming the failing rank
  and the path, instead of the other ranks waiting at the save's next barrier; latest.json keeps
  naming the previous step, no directory of the failed step is left, and the same step saves and
  resumes afterwards;
* a fresh run's first save that cannot move the earlier run aside on rank 0 fails on every rank
  (the other ranks waited at a barrier for rank 0).

Workers set up their own gloo group with a short timeout: a rank stuck at a collective (the
defect) fails the test in seconds instead of hanging it."""

from __future__ import annotations

import errno
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

from nanochat.distributed import free_port

WORLD = 2


def _group(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=8))


def _failing(real, rank: int, on_rank: int, name: str, error: Exception):
    """`real` (save_hashed / write_json), raising `error` on rank `on_rank` for the file `name`."""
    def call(path, obj):
        if rank == on_rank and Path(path).name == name:
            raise error
        return real(path, obj)
    return call


def _save_worker(rank: int, port: int, out: str) -> None:
    _group(rank, port)
    import torch.distributed as dist

    import nanochat.checkpoint as ck
    ckpt = Path(out) / "ckpt"

    def save(step: int):
        return ck.save_checkpoint(ckpt, step, model_state={"w": torch.arange(4.0) + step},
                                  optimizer_state={"m": torch.full((3,), float(rank))}, loader_state={"pos": rank},
                                  loop_state={"step": step}, meta={"phase": "base"}, rank=rank)

    save_hashed, write_json = ck.save_hashed, ck.write_json
    full = OSError(errno.ENOSPC, "No space left on device")
    cases = {   # (the function to replace, its failing stand-in)
        "rank1_disk_full": ("save_hashed", _failing(save_hashed, rank, 1, "optim_rank1.pt", full)),
        "rank1_bug": ("save_hashed", _failing(save_hashed, rank, 1, "state_rank1.pt", RuntimeError("boom"))),
        "rank0_meta_refused": ("write_json", _failing(write_json, rank, 0, "meta.json", PermissionError(
            errno.EACCES, "Permission denied", str(ckpt / "step_000002.partial" / "meta.json")))),
    }
    result = {"first": str(save(1))}
    for case, (name, stand_in) in cases.items():
        setattr(ck, name, stand_in)
        try:
            save(2)
            result[case] = "saved"
        except Exception as e:   # noqa: BLE001 - the type and text are the result
            result[case] = f"{type(e).__name__}: {e}"
        setattr(ck, name, {"save_hashed": save_hashed, "write_json": write_json}[name])
        dist.barrier()   # rank 0 looks at the directory only once both ranks are out of the save
        if rank == 0:
            result[case + "_dir"] = {"latest": ck.read_latest(ckpt), "entries": sorted(os.listdir(ckpt))}
        dist.barrier()
    save(2)   # the same step saves once the disk is fixed, and resumes on every rank
    loaded = ck.load_checkpoint(ckpt, "latest", rank=rank, load_optimizer=True)
    result["resumed"] = [loaded["step"], loaded["optimizer"]["m"].tolist(), loaded["loader"]["pos"]]
    result["settle"] = _settle_refused(rank, Path(out) / "other")
    dist.barrier()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)   # no gloo teardown race after the result is written (tests/test_multiprocess.py)


def _settle_refused(rank: int, ckpt: Path) -> str:
    """A fresh run's first save moving an earlier run aside, where earlier_runs is a file: rank 0 fails."""
    import torch.distributed as dist

    from nanochat.checkpoint import EarlierRun
    if rank == 0:
        (ckpt / "step_000001").mkdir(parents=True)
        (ckpt / "earlier_runs").write_text("not a directory")
    dist.barrier()
    try:
        EarlierRun(ckpt, [1]).settle(is_master=rank == 0)
        return "settled"
    except Exception as e:   # noqa: BLE001 - the type and text are the result
        return f"{type(e).__name__}: {e}"


def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path):
    mp.spawn(_save_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD))
    ckpt = tmp_path / "ckpt"
    # rank 1's shard met a full disk: rank 1 says so; rank 0 names rank 1, the error and the directory
    assert r1["rank1_disk_full"].startswith("CheckpointError: checkpoint of step 2 not written") \
        and "No space left on device" in r1["rank1_disk_full"]
    assert r0["rank1_disk_full"].startswith("CheckpointError: checkpoint save of step 2 failed on rank(s) 1 of 2")
    assert "No space left on device" in r0["rank1_disk_full"] and str(ckpt) in r0["rank1_disk_full"]
    # a bug on rank 1 is its own error there (with its traceback); rank 0 names it and the staging directory
    assert r1["rank1_bug"] == "RuntimeError: boom"
    assert "rank(s) 1 of 2" in r0["rank1_bug"] and "RuntimeError: boom" in r0["rank1_bug"] \
        and str(ckpt / "step_000002.partial") in r0["rank1_bug"]
    # rank 0 could not write meta.json: rank 1 learns which rank and which file
    assert r0["rank0_meta_refused"].startswith("CheckpointError: checkpoint of step 2 not written")
    assert "rank(s) 0 of 2" in r1["rank0_meta_refused"] and "Permission denied" in r1["rank0_meta_refused"] \
        and str(ckpt / "step_000002.partial" / "meta.json") in r1["rank0_meta_refused"]
    for case in ("rank1_disk_full", "rank1_bug", "rank0_meta_refused"):   # step 1 stays the latest, whole
        assert r0[case + "_dir"] == {"latest": 1, "entries": ["latest.json", "step_000001"]}, case
    assert r0["resumed"] == [2, [0.0] * 3, 0] and r1["resumed"] == [2, [1.0] * 3, 1]
    # the earlier run could not be moved on rank 0: rank 1 is told, instead of waiting at a barrier
    assert r0["settle"].startswith("CheckpointError: --resume auto: could not move the earlier run's checkpoints "
                                   "(steps [1])") and "NotADirectoryError" in r0["settle"]   # one line, not a traceback
    assert r1["settle"].startswith("CheckpointError: rank 0 could not move the earlier run's checkpoints (steps [1])") \
        and "NotADirectoryError" in r1["settle"] and str(tmp_path / "other") in r1["settle"]
