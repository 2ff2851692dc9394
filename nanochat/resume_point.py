"""Where setup.sh's rerun of a training stage continues when its latest checkpoint cannot be resumed.

A stage's latest checkpoint with a file deleted, or no longer the size or sha256 its
sums_rank<R>.json recorded (damaged on disk), or a latest.json naming no step, stopped the stage's
`--resume auto` at every rerun with "use another step", a step setup.sh's command line cannot name.
`resume_point` decides instead, from the checkpoint files alone (their sums checked as a load checks
them, the files of every rank that saved the step):

- keep: the latest step is whole (also as the old copy a re-save killed between its two renames left,
  which the stage's load renames back); `--resume auto` stays;
- resume N: N is the newest whole step before it (`--resume N`; the stage moves the later steps to
  earlier_runs/ at its first save);
- fresh: no earlier step is whole, or (mid / SFT) the newest whole one is a run the stage's own
  `--resume auto` would not continue either (`--overwrite`): one started from other source weights
  than the source's latest now (nanochat.chat_start._auto_resume's comparison), or one saved by
  another number of processes than setup.sh's one. An explicit `--resume N` does not check the
  weights (chat_start._check_source_of_resumed_run refuses only another --source phase or --step,
  neither of which setup.sh passes): it would continue the run on the replaced weights and hand on
  a model of the old source; another process count it refuses, at every rerun.

`python -m nanochat.resume_point CKPT_DIR [SOURCE_DIR]` prints the verdict as lines for
scripts/setup_stages.sh: `keep`; `resume`, N, which checkpoint, why; `fresh`, `-`, which
checkpoint, why, why no earlier step. It runs under the stage's own interpreter (the venv) but imports
no torch (nanochat.checkpoint_io only): a check takes a fraction of a second, not torch's import.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# checkpoint_io, not checkpoint: it imports no torch (setup.sh runs this check before every training stage)
from nanochat.checkpoint_io import (LATEST_NAME, META_NAME, MODEL_NAME, CheckpointError, list_steps, model_digest,
                                    read_latest, readable_step_dir, saved_sum, sha256_file, step_dirname)

# setup.sh runs every training stage as one process (stage_cmd in setup.sh: `python -m scripts.X`, no
# torchrun; a multi-GPU run is run_train.sh --nproc's)
_STAGE_PROCESSES = 1
# the twin of nanochat.chat_start._SOURCE_KEYS (importing it would import torch): the fields of a mid / SFT
# step's `source` record that its --resume auto compares with the source it would start from now
_SOURCE_KEYS = ("phase", "model_tag", "step", "model_sha256")


@dataclass(frozen=True)
class ResumePoint:
    """A verdict: how (keep | resume | fresh); for resume the step; for resume and fresh which
    checkpoint cannot be resumed (`where`: "step N" or "latest.json") and why; for fresh why no
    earlier step is taken (`why_fresh`)."""
    how: str
    step: int | None = None
    where: str = ""
    why: str = ""
    why_fresh: str = ""

    def lines(self) -> list[str]:
        """What setup_stages.sh's resume_point reads, one field a line."""
        if self.how == "keep":
            return ["keep"]
        if self.how == "resume":
            return ["resume", str(self.step), self.where, self.why]
        return ["fresh", "-", self.where, self.why, self.why_fresh]


def _latest(ckpt_dir: Path) -> int | None:
    """latest.json's step; None when it is missing, unreadable or names no whole number."""
    try:
        return read_latest(ckpt_dir)
    except (CheckpointError, OSError):
        return None


def _file_damage(path: Path, rank: int) -> str | None:
    """Why one file of a step is not the one saved (gone, or another size / sha256 than its rank's
    sums recorded), or None; a file the sums do not cover is taken as it is."""
    if not path.is_file():
        return f"{path.name} is gone"
    try:
        want = saved_sum(path, rank)
    except (CheckpointError, OSError):
        return f"sums_rank{rank}.json is damaged"
    if want is not None and (path.stat().st_size != want["bytes"] or sha256_file(path) != want["sha256"]):
        return f"{path.name} is not the file saved (sums_rank{rank}.json recorded another size or sha256)"
    return None


def _rank_files(rank: int) -> list[str]:
    """The files a resume reads as `rank` (checkpoint.py's _load_step): model.pt (rank 0's; every rank
    loads it, also under --fsdp, whose state_dict gathers the full weights), its optimizer state (its
    shard, under DDP or --fsdp) and its loader / loop state."""
    return ([MODEL_NAME] if rank == 0 else []) + [f"optim_rank{rank}.pt", f"state_rank{rank}.pt"]


def step_damage(step_dir: Path) -> tuple[str | None, dict]:
    """(why the step cannot be resumed or None, its meta.json ({} when damaged)). A step saved by W
    processes is continued only by W (base_train refuses another count even under --resume auto;
    optimizer shards are per rank), so it is whole when every rank in range(W) has its files, also
    when setup.sh's one process cannot continue it: base_train's own refusal then names the launch
    that can (run_train.sh --nproc W), which reads them all. Checking only the ranks with a sums file
    kept a step whose rank 3 lost all its files (sums included), and that launch failed at every rerun."""
    try:
        meta = json.loads((step_dir / META_NAME).read_text())
    except OSError:
        return f"{META_NAME} is gone", {}
    except ValueError:
        return f"{META_NAME} is not JSON", {}
    # absent: 1, as chat_train's resume reads it (a load's check_meta requires it; it is always saved)
    world = meta.get("world_size", 1) if isinstance(meta, dict) else None
    if type(world) is not int or world < 1:
        return f"{META_NAME} names no world size (a whole number >= 1)", {}
    names = [(rank, name) for rank in range(world) for name in _rank_files(rank)]
    gone = next((f"{name} is gone" for _, name in names if not (step_dir / name).is_file()), None)
    if gone is not None:   # (said before any file is hashed)
        return gone, {}
    why = next(filter(None, (_file_damage(step_dir / name, rank) for rank, name in names)), None)
    return (why, {}) if why is not None else (None, meta)


def _source_now(source_dir: Path) -> tuple[int | None, str | None]:
    """(step, model.pt's recorded sha256) a mid / SFT run of this tag would start from now."""
    step = _latest(source_dir)
    try:
        return step, model_digest(source_dir, step) if step is not None else None
    except (CheckpointError, OSError):
        return step, None


def _not_continued(meta: dict, source_dir: Path) -> str | None:
    """Why a mid / SFT run's --resume auto, in setup.sh's one process, would start afresh rather than
    continue the step of this meta.json (chat_train: another process count; chat_start._auto_resume:
    a recorded source field other than the source's now; a field not recorded is not compared), or None."""
    world = meta.get("world_size", 1)   # (step_damage checked it)
    if world != _STAGE_PROCESSES:
        return f"was saved by {world} processes and setup.sh's stage runs {_STAGE_PROCESSES}"
    recorded = meta.get("source") if isinstance(meta.get("source"), dict) else {}
    step, digest = _source_now(source_dir)
    now = {"phase": source_dir.parent.name, "model_tag": source_dir.name, "step": step, "model_sha256": digest}
    if any(key in recorded and recorded[key] != now[key] for key in _SOURCE_KEYS):   # as _auto_resume's `changed`
        return f"started from other {source_dir.parent.name} weights"
    return None


def resume_point(ckpt_dir: str | Path, source_dir: str | Path | None = None) -> ResumePoint:
    """The verdict for a stage's checkpoint directory; `source_dir`: the checkpoints its run starts
    from (mid: base's, SFT: mid's), whose latest step a resumed run must have started from."""
    ckpt_dir = Path(ckpt_dir)
    top = _latest(ckpt_dir)
    if top is None:
        where, why = LATEST_NAME, "it names no step"
    else:
        # a re-save killed between its renames left step_N only as its old copy, which the stage's load
        # restores: judged as step_N ("meta.json is gone" resumed an earlier step, or with none started
        # afresh, and the old copy was deleted at a later save)
        where, why = f"step {top}", step_damage(readable_step_dir(ckpt_dir, top))[0]
        if why is None:
            return ResumePoint("keep")
    for step in sorted((s for s in list_steps(ckpt_dir) if top is None or s < top), reverse=True):
        bad, meta = step_damage(ckpt_dir / step_dirname(step))
        if bad is not None:
            continue
        not_auto = _not_continued(meta, Path(source_dir)) if source_dir is not None else None
        if not_auto is not None:
            return ResumePoint("fresh", None, where, why, f"step {step}, the newest whole one, {not_auto}")
        return ResumePoint("resume", step, where, why)
    return ResumePoint("fresh", None, where, why, "no earlier step is whole")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanochat.resume_point",
                                     description="keep | resume N | fresh for a training stage's checkpoints")
    parser.add_argument("ckpt_dir", help="the stage's checkpoints/<phase>/<tag>")
    parser.add_argument("source_dir", nargs="?", help="mid / SFT: the checkpoints/<source phase>/<tag> it starts from")
    args = parser.parse_args(argv)
    print("\n".join(resume_point(args.ckpt_dir, args.source_dir or None).lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
