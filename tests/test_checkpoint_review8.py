"""Checkpoints and the training loop, eighth review: the disk filling while latest.json is written
(a complete step that --resume latest|auto skipped), the temp file of a latest.json write killed
midway, the device recorded when a recipe's meta names none, the NaN stop's advice to a run that
already saves, and the out-of-memory hint's unified-memory cap in the unit its variable takes."""

from __future__ import annotations

import errno
import math
import types

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import loop
from nanochat.training import BatchPlan, NonFiniteLossError


def _save(d, step, meta=None):
    return ck.save_checkpoint(d, step, model_state={"w": torch.full((8,), float(step))},
                              optimizer_state={"m": torch.ones(2) * step}, loader_state={"row": step},
                              loop_state={"step": step}, meta=meta or {})


def test_a_full_disk_at_the_latest_pointer_names_the_step_to_resume(tmp_path, monkeypatch):
    """Step 4 was complete on disk, but the ENOSPC of latest.json's write ended the run in a raw
    OSError traceback with latest.json naming step 2, which --resume latest (and auto) then took:
    now one CheckpointError says step 4 is saved and to continue with --resume 4."""
    d = tmp_path / "ck"
    _save(d, 2)
    real = ck.write_json

    def full_disk_at_latest(path, obj):
        if path.name == ck.LATEST_NAME:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)
    monkeypatch.setattr(ck, "write_json", full_disk_at_latest)
    with pytest.raises(ck.CheckpointError, match=r"checkpoint of step 4 saved to .*step_000004, but .*latest\.json "
                                                 r"could not be updated \(No space left on device\) and still names "
                                                 r"step 2: free space .* continue with --resume 4, not latest"):
        _save(d, 4)
    monkeypatch.undo()
    assert ck.read_latest(d) == 2 and ck.load_checkpoint(d, 4, load_optimizer=True)["optimizer"]["m"].tolist() == [4, 4]
    # any other error still propagates as it is
    monkeypatch.setattr(ck, "write_json", lambda path, obj: (_ for _ in ()).throw(ValueError("bug"))
                        if path.name == ck.LATEST_NAME else real(path, obj))
    with pytest.raises(ValueError, match="bug"):
        _save(d, 6)


def test_the_temp_file_of_a_latest_pointer_write_killed_midway_is_swept(tmp_path):
    """A process killed while writing latest.json left .latest.json.tmp-PID in the tag's directory
    for good (the step_*.partial sweep never looked at it); the next save removes it."""
    d = tmp_path / "ck"
    _save(d, 2)
    stale = d / f".{ck.LATEST_NAME}.tmp-999999"
    stale.write_text('{"step": 9')
    _save(d, 4)
    assert not stale.exists() and ck.read_latest(d) == 4


def test_the_metadata_names_the_device_when_the_recipes_meta_does_not(tmp_path):
    """save_checkpoint records git sha, versions and device, but took the device only from the
    recipe's meta: chat_rl's names none, so its checkpoints recorded device_name None."""
    d = tmp_path / "ck"
    _save(d, 1)
    meta = ck.read_meta(d, 1)
    assert meta["device_name"] == ck.environment_meta("cpu")["device_name"] and meta["device_name"].startswith("cpu")
    assert meta["torch_version"] == torch.__version__ and "git_sha" in meta and meta["schema_version"] == 1
    _save(d, 2, meta={"device_name": "NVIDIA GB10"})   # a recipe's own name wins
    assert ck.read_meta(d, 2)["device_name"] == "NVIDIA GB10"


def test_a_nan_before_the_first_save_does_not_tell_a_saving_run_to_use_save_every():
    """A run with --save-every 2 (chat_rl's default is 60) that diverged at step 1 was told "no
    checkpoint was saved in this run yet (use --save-every)": the flag it was using."""
    msg = str(NonFiniteLossError(1, "loss", math.nan, None, "lower the LR"))
    assert "use --save-every" not in msg
    assert "no checkpoint was saved in this run yet (--save-every N saves one every N steps)" in msg


def test_the_out_of_memory_hint_gives_the_cap_in_the_unit_its_variable_takes(monkeypatch):
    """NANOCHAT_GPU_MEMORY_CAP=100 (GB; platform's start-up line: "capped at 100.0 GB") made the hint
    read "the unified-memory cap of 93.1 GiB (NANOCHAT_GPU_MEMORY_CAP)", as if 100 had not been
    taken: it now gives the GB figure too, and how the variable sets it."""
    from nanochat import platform as P

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: 90 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: types.SimpleNamespace(total_memory=128e9))
    monkeypatch.setattr(P, "_MEMORY_CAP", [int(100e9)])
    trainer = types.SimpleNamespace(plan=BatchPlan(524_288, 32, 2048, 1, 8))
    msg = loop.out_of_memory_hint(trainer, 3)
    assert "(90.0 GiB allocated at the peak of the unified-memory cap of 93.1 GiB = 100.0 GB " \
           "(NANOCHAT_GPU_MEMORY_CAP=<GB> sets it))" in msg and "lower --device-batch-size (e.g. 16)" in msg
    monkeypatch.setattr(P, "_MEMORY_CAP", [])   # no cap: the device's memory, as before
    assert "(90.0 GiB allocated at the peak of 119.2 GiB); lower" in loop.out_of_memory_hint(trainer, 3)
