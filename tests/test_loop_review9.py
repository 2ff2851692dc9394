"""Ninth review of nanochat/loop.py's --keep-last pruning (CPU):

* a checkpoint the pruning cannot delete (a permission error, a busy NFS file) ended the run on
  rank 0 alone, and the other ranks waited at the next step's collective; now it is a warning that
  names the path and the run goes on, on every rank (a single process and 2 gloo processes);
* an unexpected failure in the pruning (a bug) is raised on every rank, not on rank 0 alone;
* the pruning never deletes the step latest.json names nor the one just saved (a latest.json
  naming an old step killed rank 0 with an AssertionError), nor earlier_runs/ or *.partial dirs.
"""

from __future__ import annotations

import errno
import json
import os
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

import nanochat.checkpoint as ck
from nanochat.distributed import free_port
from nanochat.loop import LoopSpec, _prune, run_training_loop


class _Trainer:
    """A trainer whose steps do nothing (no model: no weight check before a save)."""

    model = None

    def __init__(self):
        self.steps = []
        self.meter = types.SimpleNamespace(update=lambda result: {}, log_line=lambda metrics, n: "step")

    def step(self, step):
        self.steps.append(step)
        return types.SimpleNamespace(loss=1.0, extra=None, lrm=1.0)

    def loop_state(self, step, meter, **kw):
        return {"step": step}

    def note_checkpoint(self, path):
        pass


def _saver(ckpt: Path, rank: int = 0, after=None):
    def save(step, loop_state):
        path = ck.save_checkpoint(ckpt, step, model_state={"w": torch.full((2,), float(step))},
                                  loop_state=loop_state, meta={"phase": "base"}, rank=rank)
        if after is not None:
            after(step)
        return path
    return save


def _refusing(rank_of_failure: int, rank: int, error: Exception):
    real = ck.remove_checkpoint

    def remove(ckpt_dir, step):
        if rank == rank_of_failure:
            raise error
        return real(ckpt_dir, step)
    return remove


def test_a_prune_that_cannot_delete_warns_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpt"
    denied = PermissionError(errno.EACCES, "Permission denied", str(ckpt / "step_000002"))
    monkeypatch.setattr(ck, "remove_checkpoint", _refusing(0, 0, denied))
    trainer = _Trainer()
    spec = LoopSpec("base", 6, save_every=2, save=_saver(ckpt), keep_last=1, report=False)
    res = run_training_loop(trainer, trainer.meter, spec)
    assert trainer.steps == list(range(6)) and res.last_checkpoint == str(ckpt / "step_000006")
    out = capsys.readouterr().out
    assert (f"warning: could not remove old checkpoint {ckpt / 'step_000002'} (--keep-last 1): PermissionError: "
            "[Errno 13] Permission denied") in out and "training goes on (delete it by hand)" in out
    assert ck.list_steps(ckpt) == [2, 4, 6] and ck.read_latest(ckpt) == 6


def test_a_prune_never_deletes_the_step_latest_json_names(tmp_path, capsys):
    """latest.json naming an old step (another process re-pointed it): that step is a resume's, so
    it stays; remove_checkpoint's assert used to end the run on rank 0."""
    ckpt = tmp_path / "ckpt"

    def pin(step):   # latest.json back at step 2 after every save
        if step > 2:
            (ckpt / "latest.json").write_text(json.dumps({"step": 2, "dir": "step_000002"}))
    trainer = _Trainer()
    spec = LoopSpec("base", 6, save_every=2, save=_saver(ckpt, after=pin), keep_last=1, report=False)
    run_training_loop(trainer, trainer.meter, spec)
    out = capsys.readouterr().out
    assert f"warning: not removing checkpoint {ckpt / 'step_000002'}: {ckpt / 'latest.json'} names it" in out
    assert f"removed checkpoint {ckpt / 'step_000004'} (--keep-last 1)" in out
    assert ck.list_steps(ckpt) == [2, 6]


def test_a_prune_touches_only_this_run_s_step_directories(tmp_path, capsys):
    """Candidates that are not a complete step_N beside the newest save (earlier_runs/<N>/step_N, a
    step_N.partial) are left alone (the .partial one raised ValueError parsing its step); the newest
    save is never deleted, however the list reads."""
    ckpt = tmp_path / "ckpt"
    for step in (2, 4):
        ck.save_checkpoint(ckpt, step, model_state={"w": torch.zeros(1)}, meta={})
    earlier = ckpt / "earlier_runs" / "1" / "step_000001"
    partial = ckpt / "step_000003.partial"
    for d in (earlier, partial):
        d.mkdir(parents=True)
    newest = ckpt / "step_000004"
    spec = LoopSpec("base", 6, keep_last=1, report=False)
    assert _prune(spec, [earlier, partial, newest, newest]) == [newest]
    assert earlier.is_dir() and partial.is_dir() and newest.is_dir() and ck.list_steps(ckpt) == [2, 4]
    assert "removed" not in capsys.readouterr().out


# ------------------------------------------------------------------ two processes (gloo)

def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=8))
    result = {}
    cases = {"denied": PermissionError(errno.EACCES, "Permission denied"), "bug": KeyError("boom")}
    for case, error in cases.items():
        ck.remove_checkpoint = _refusing(0, rank, error)
        trainer = _Trainer()
        spec = LoopSpec("base", 4, save_every=1, save=_saver(Path(out) / case, rank), keep_last=1, report=False,
                        is_master=rank == 0)
        try:
            res = run_training_loop(trainer, trainer.meter, spec)
            result[case] = f"finished at {res.step}"
        except Exception as e:   # noqa: BLE001 - the type and text are the result
            result[case] = f"{type(e).__name__}: {e}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)   # no gloo teardown race after the result is written


def test_a_failed_prune_leaves_no_rank_waiting(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    # a delete refused on rank 0: a warning there, and both ranks train to the end
    assert r0["denied"] == r1["denied"] == "finished at 4"
    assert ck.list_steps(tmp_path / "denied") == [1, 2, 3, 4]
    # a bug in the pruning: rank 0 raises it, rank 1 learns of it (instead of timing out at a collective)
    assert r0["bug"] == "KeyError: 'boom'"
    assert r1["bug"] == "RuntimeError: --keep-last's pruning failed on rank 0: KeyError: 'boom'"
