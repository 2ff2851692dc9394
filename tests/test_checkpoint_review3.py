"""Checkpoints and the optimizer, third review: the writer lock's file in a checkpoint directory
(nanochat/writer_lock.py) next to the tags and an earlier run's move, the recipe's printed Muon
momentum for runs shorter than its ramp, and the modules split out of checkpoint.py / optim.py."""

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_runs
from nanochat.recipe import resolve_recipe


def _save(d, step):
    return ck.save_checkpoint(d, step, model_state={"w": torch.ones(2) * step}, optimizer_state={"m": torch.ones(1)},
                              loader_state={"row": step}, loop_state={"step": step}, meta={})


def _lock(d):
    """What claim_checkpoint_dir leaves in a directory at a run's start-up (before any save)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / ".writer.lock").write_text("pid 1 on host: python -m scripts.base_train\n")


def test_a_tag_holding_only_a_writer_lock_is_not_picked_as_the_model(tmp_path):
    """A training run claims its directory at start-up (.writer.lock), before its first save: one
    that stopped there (a bad flag found late, an OOM at the first step) left a tag with no
    checkpoint. find_model_tag took it as the deepest d<N> (chat_cli / chat_eval / mid_train then
    failed with 'no checkpoint recorded') or called the tags ambiguous."""
    _save(ck.checkpoint_dir("base", "d12", tmp_path), 5)
    _lock(ck.checkpoint_dir("base", "d26", tmp_path))
    assert ck.find_model_tag("base", tmp_path) == "d12"
    _save(ck.checkpoint_dir("mid", "mine", tmp_path), 3)
    _lock(ck.checkpoint_dir("mid", "typo", tmp_path))
    assert ck.find_model_tag("mid", tmp_path) == "mine"
    _lock(ck.checkpoint_dir("sft", "d4", tmp_path))    # no tag with a checkpoint: named as before
    assert ck.find_model_tag("sft", tmp_path) == "d4"


def test_an_earlier_runs_move_leaves_the_writer_lock_in_place(tmp_path):
    """--resume auto starting fresh moves the earlier run aside at its first save: its steps and
    latest.json go, the running writer's lock stays (the flock is on that file), and the disk plan
    / listing ignore it."""
    d = tmp_path / "ck"
    _save(d, 1)
    _save(d, 2)
    _lock(d)
    earlier = ck.fresh_start(d, "auto", overwrite=False)
    assert earlier.steps == [1, 2] and checkpoint_runs.steps_bytes(d, [1, 2]) > 0
    moved = earlier.settle()
    assert (d / ".writer.lock").is_file() and not (moved / ".writer.lock").exists()
    assert ck.list_steps(moved) == [1, 2] and ck.list_steps(d) == []
    _save(d, 1)
    assert ck.read_latest(d) == 1 and ck.load_checkpoint(d)["model"]["w"][0] == 1


def test_split_modules_keep_their_names_importable():
    """EarlierRun / fresh_start moved to checkpoint_runs.py and the update math to optim_updates.py:
    the recipes import them from their old modules."""
    from nanochat import optim, optim_updates
    assert ck.fresh_start is checkpoint_runs.fresh_start and ck.EarlierRun is checkpoint_runs.EarlierRun
    assert ck.EARLIER_RUNS == "earlier_runs" and ck.LATEST_NAME == "latest.json"
    assert optim.orthogonalize is optim_updates.orthogonalize and optim.state_zeros is optim_updates.state_zeros


@pytest.mark.parametrize("name,steps,want", [
    ("v2", 250, "momentum 0.85->0.876->0.9,"),     # setup.sh's tiny preset: the warmdown starts at step 88
    ("v2", 1000, "momentum 0.85->0.955->0.9,"),
    ("v2", 5000, "momentum 0.85->0.97->0.9,"),
    ("v1", 100, "momentum 0.85->0.883,"),
    ("v1", 5000, "momentum 0.85->0.95,"),
])
def test_the_printed_momentum_is_the_runs(name, steps, want):
    """The banner printed v2's momentum as 0.85->0.97->0.90 whatever the run's length, but the
    ramp (400 steps) stops where the warmdown begins: the tiny preset's momentum never passed
    0.876 (v1's 300-step ramp alike). The line gives the values the schedule applies."""
    r = resolve_recipe(name, {}, total_batch_size=2 ** 19, target_tokens=1e9, ref_tokens=1e9)
    assert want in r.describe(steps)
    sched = r.schedule(steps)
    begin = steps - round(r.warmdown_ratio * steps)
    top = max(sched.multipliers(s)[1] for s in range(steps + 1))
    assert f"{top:.3g}" in want and f"{sched.multipliers(steps)[1]:.3g}," in want
    if name == "v2":
        assert f"->{sched.multipliers(begin)[1]:.3g}->" in want


def test_the_disk_plans_hint_names_a_keep_last_that_fits(tmp_path, monkeypatch):
    """Room for 2 of 5 planned saves: the hint said 'set --keep-last' also to a run that had set it
    (to 3, which needs 4 at once): it now names the value that fits (K + 1 on disk at once)."""
    gb = 10**9
    monkeypatch.setattr(ck, "free_bytes", lambda path: 20 * gb)
    text = ck.disk_plan(tmp_path, 9 * gb, 5, keep_last=3)
    assert "at most 4 on disk at once (--keep-last 3)" in text and "room for 2" in text
    assert "lower --keep-last to 1," in text, text
    assert "set --keep-last to 1," in ck.disk_plan(tmp_path, 9 * gb, 5)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 10 * gb)   # room for one: no --keep-last holds it
    assert "keep-last to" not in ck.disk_plan(tmp_path, 9 * gb, 5, keep_last=2)


def test_a_save_without_room_names_the_step_a_resume_takes(tmp_path, monkeypatch):
    """After --resume 1 of a run that had reached step 3, the newest step on disk (3) is the
    abandoned branch's; a save refused for room named it as 'intact, resume with --resume', but
    --resume latest takes latest.json's step (2, this run's last save)."""
    d = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(d, step)
    (d / "latest.json").write_text('{"step": 2, "dir": "step_000002"}')   # resumed 1, saved 2 again
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    with pytest.raises(ck.CheckpointError, match=r"the checkpoint of step 2 is intact, free space and resume"):
        _save(d, 4)
    with pytest.raises(ck.CheckpointError, match=r"the checkpoint of step 2 is intact"):   # a re-save of 2
        _save(d, 2)
    monkeypatch.undo()
    assert ck.read_latest(d) == 2 and ck.load_checkpoint(d)["model"]["w"][0] == 2
