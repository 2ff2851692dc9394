"""nanochat.resume_point, review follow-ups; each test failed before its fix.

- A mid / SFT step whose meta.json recorded no `source` (or one without its step or sha256) was taken
  as started from other weights: "fresh" (--overwrite), while the stage's own --resume auto
  (chat_start._auto_resume) compares only the fields recorded and would have continued it. A
  recorded model tag or phase other than the source's was not compared at all.
- A step saved by several processes was checked only for the ranks that had a sums file: one whose
  rank 1 lost all its files (sums included) was "keep", and the launch that continues it failed.
- A mid / SFT step saved by 2 processes was offered as `--resume N` to setup.sh's one-process stage,
  which refuses another process count at every rerun (its --resume auto starts afresh instead).

The checkpoints are real saves (save_checkpoint; rank 1's files written by the save's own per-rank
writer) of tiny states.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_resume_point74
import torch

from nanochat import chat_start
from nanochat import resume_point as rp
from nanochat.checkpoint import _write_rank_files, checkpoint_dir, model_digest, save_checkpoint
from nanochat.resume_point import ResumePoint, resume_point


def _save(ckpt: Path, step: int, source: dict | None = None, world: int = 1) -> None:
    """A step as `world` processes save it: rank 0 by save_checkpoint, the other ranks' optimizer
    shard, loader / loop state and sums by the same per-rank writer, meta.json's world size set."""
    save_checkpoint(ckpt, step, model_state={"w": torch.full((4,), float(step))},
                    optimizer_state={"state": {}, "param_groups": [{"lr": 0.1}]},
                    loader_state={"pos": step}, loop_state={"step": step}, meta={"source": source})
    step_dir = _step(ckpt, step)
    for rank in range(1, world):
        _write_rank_files(step_dir, step, rank, None, {"state": {}, "param_groups": [{"lr": 0.1}], "rank": rank},
                          {"pos": step, "rank": rank}, {"step": step})
    if world != 1:
        meta = json.loads((step_dir / "meta.json").read_text())
        (step_dir / "meta.json").write_text(json.dumps({**meta, "world_size": world}))


# the same fixture and step path (assigned, not imported: linters would read the tests' arguments as redefinitions)
base, _step = test_resume_point74.base, test_resume_point74._step


def _now(base: Path) -> dict:
    """The source record a mid run of tag d2 starts from now: base's latest step."""
    return {"phase": "base", "model_tag": "d2", "step": 40, "model_sha256": model_digest(base, 40)}


# the `source` a mid step recorded -> whether its --resume auto continues it (base's latest now: step 40)
RECORDED = {
    "none recorded (null)": (lambda now: None, True),
    "an empty record": (lambda now: {}, True),
    "the step alone": (lambda now: {"step": 40}, True),
    "all but the sha256": (lambda now: {k: v for k, v in now.items() if k != "model_sha256"}, True),
    "all four, as now": (lambda now: now, True),
    "another base step": (lambda now: {**now, "step": 20}, False),
    "other weights": (lambda now: {**now, "model_sha256": "0" * 64}, False),
    "another model tag": (lambda now: {**now, "model_tag": "d4"}, False),
    "another phase": (lambda now: {**now, "phase": "mid"}, False),
}


@pytest.mark.parametrize("case", list(RECORDED))
def test_mid_resumes_what_its_own_auto_resume_would_continue(base, tmp_path, case):
    """The verdict on the newest whole step agrees with chat_start._auto_resume on the same meta.json
    (a run whose latest step it is): resume it when auto continues it, afresh when auto would not."""
    record, continued = RECORDED[case]
    now = _now(base)
    mid = checkpoint_dir("mid", "d2", tmp_path)
    _save(mid, 20, record(now))
    _save(mid, 40, now)
    (_step(mid, 40) / "model.pt").unlink()
    got = resume_point(mid, base)
    if continued:
        assert got == ResumePoint("resume", 20, "step 40", "model.pt is gone")
    else:
        assert got == ResumePoint("fresh", None, "step 40", "model.pt is gone",
                                  "step 20, the newest whole one, started from other base weights")
    alone = checkpoint_dir("mid", "alone", tmp_path)   # the same step as a run's latest: what auto does
    _save(alone, 20, record(now))
    assert (chat_start._auto_resume(alone, now) is not None) is continued   # ("latest" or None)


def test_the_compared_fields_are_chat_starts():
    """resume_point keeps a twin of chat_start's field list (importing chat_start imports torch)."""
    assert rp._SOURCE_KEYS == chat_start._SOURCE_KEYS


def test_a_rank_that_lost_every_file_is_damage(base):
    """Rank 1 of a 2-process step lost its optimizer shard, loop state and sums file: the step is not
    whole (the 2-process launch that continues it would fail on it), so the step before it resumes."""
    _save(base, 60, world=2)
    for name in ("optim_rank1.pt", "state_rank1.pt", "sums_rank1.json"):
        (_step(base, 60) / name).unlink()
    assert resume_point(base) == ResumePoint("resume", 40, "step 60", "optim_rank1.pt is gone")


def test_a_whole_multi_process_step_is_kept_and_its_ranks_files_are_checked(base):
    _save(base, 60, world=2)
    assert resume_point(base) == ResumePoint("keep")
    state = _step(base, 60) / "state_rank1.pt"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF   # same size, other bytes
    state.write_bytes(bytes(data))
    assert resume_point(base) == ResumePoint(
        "resume", 40, "step 60", "state_rank1.pt is not the file saved (sums_rank1.json recorded another size or sha256)")


@pytest.mark.parametrize("world", [None, 0, "2"])
def test_a_meta_without_a_usable_world_size_is_damage(base, world):
    meta_path = _step(base, 40) / "meta.json"
    meta_path.write_text(json.dumps({**json.loads(meta_path.read_text()), "world_size": world}))
    assert resume_point(base) == ResumePoint("resume", 20, "step 40",
                                             "meta.json names no world size (a whole number >= 1)")


def test_mid_does_not_resume_a_step_of_another_process_count(base, tmp_path):
    """setup.sh's one-process mid refuses an explicit --resume of a 2-process step at every rerun (its
    --resume auto starts afresh): afresh. base_train's auto refuses it too, so base keeps --resume N."""
    mid = checkpoint_dir("mid", "d2", tmp_path)
    _save(mid, 20, _now(base), world=2)
    _save(mid, 40, _now(base))
    (_step(mid, 40) / "state_rank0.pt").unlink()
    assert resume_point(mid, base) == ResumePoint(
        "fresh", None, "step 40", "state_rank0.pt is gone",
        "step 20, the newest whole one, was saved by 2 processes and setup.sh's stage runs 1")
    assert resume_point(mid) == ResumePoint("resume", 20, "step 40", "state_rank0.pt is gone")
