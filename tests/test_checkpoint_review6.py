"""Checkpoints, sixth review: a full disk met inside torch.save, a disk that refuses writes, a save
killed at each file boundary, a step number that is a digit but not a number, what to do about a
damaged meta.json or sums file, and a move to earlier_runs/ cut short."""

import errno
import io
import json
import os
import shutil

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_runs as cr


def _save(d, step, seed=0):
    g = torch.Generator().manual_seed(seed)
    return ck.save_checkpoint(d, step, model_state={"w": torch.randn(64, 64, generator=g)},
                              optimizer_state={"m": torch.ones(2) * step}, loader_state={"row": step},
                              loop_state={"step": step}, meta={})


def _only_the_kept_step(d, step):
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", ck.step_dirname(step)]
    assert ck.load_checkpoint(d, load_optimizer=True)["step"] == step


class _FillsAfter(io.RawIOBase):
    """A file whose disk fills after `room` bytes (what torch.save's zip writer meets on a full disk)."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, b):
        if self.room < len(b):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)


def test_the_disk_filling_inside_torch_save_is_one_checkpoint_error(tmp_path, monkeypatch):
    """torch.save turns the file's ENOSPC into a RuntimeError ("unexpected pos ...", the OSError
    only its __context__): the save used to end in that traceback, leaving step_N.partial; it is
    now the CheckpointError of any save without room, naming the step kept."""
    d = tmp_path / "ck"
    _save(d, 2)
    real = torch.save
    monkeypatch.setattr(ck.torch, "save", lambda obj, f: real(obj, _FillsAfter(f, 1000)))
    with pytest.raises(ck.CheckpointError, match=r"step 4 not written .*no room.*No space left on device.*"
                                                 r"step 2 is intact, free space and resume"):
        _save(d, 4)
    monkeypatch.undo()
    _only_the_kept_step(d, 2)


@pytest.mark.parametrize("where", ["staging directory", "model.pt"])
def test_a_disk_that_refuses_writes_is_one_checkpoint_error(tmp_path, monkeypatch, where):
    """A disk remounted read-only mid-run (ext4 after I/O errors) failed the save with a raw
    OSError (a traceback), the later ones leaving step_N.partial; now one CheckpointError says
    which step is intact and to make the disk writable, and nothing is left under any step name."""
    d = tmp_path / "ck"
    _save(d, 2)
    erofs = OSError(errno.EROFS, "Read-only file system", str(d / "x"))
    if where == "model.pt":
        def refuse(obj, f):
            raise erofs
        monkeypatch.setattr(ck.torch, "save", refuse)
    else:
        real_mkdir = ck.Path.mkdir

        def refuse(self, *a, **k):
            if self.name.endswith(".partial"):
                raise erofs
            return real_mkdir(self, *a, **k)
        monkeypatch.setattr(ck.Path, "mkdir", refuse)
    with pytest.raises(ck.CheckpointError, match=r"step 4 not written .*refused the write \(Read-only file "
                                                 r"system: .*step 2 is intact, make it writable"):
        _save(d, 4)
    monkeypatch.undo()
    _only_the_kept_step(d, 2)


@pytest.mark.parametrize("boundary", ["after model.pt", "before meta.json", "before the rename", "before latest.json"])
def test_a_save_killed_at_each_file_boundary_keeps_a_complete_latest(tmp_path, monkeypatch, boundary):
    d = tmp_path / "ck"
    _save(d, 2, seed=2)
    real_json, real_replace, real_save = ck.write_json, ck.os.replace, ck.save_hashed
    saved = []

    def save_hashed(path, obj):
        if boundary == "after model.pt" and saved:
            raise KeyboardInterrupt
        saved.append(path.name)
        return real_save(path, obj)

    def write_json(path, obj):
        if (boundary, path.name) in (("before meta.json", "meta.json"), ("before latest.json", "latest.json")):
            raise KeyboardInterrupt
        return real_json(path, obj)

    def replace(src, dst):
        if boundary == "before the rename" and str(src).endswith(".partial"):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(ck, "save_hashed", save_hashed)
    monkeypatch.setattr(ck, "write_json", write_json)
    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        _save(d, 4, seed=4)
    monkeypatch.undo()
    out = ck.load_checkpoint(d, load_optimizer=True)   # latest.json names a complete, verified step
    assert out["step"] == 2 and out["optimizer"]["m"].tolist() == [2.0, 2.0]
    assert ck.list_steps(d) == ([2, 4] if boundary == "before latest.json" else [2])
    _save(d, 4, seed=4)   # the next save of that step succeeds and sweeps the leftovers
    assert ck.read_latest(d) == 4 and not list(d.glob("*.partial"))


def test_a_step_that_is_a_digit_but_not_a_number_is_refused_naming_the_accepted_values(tmp_path):
    """"²" passes str.isdigit(): --resume ² was accepted, then int() failed with "invalid literal
    for int()", naming no flag."""
    assert not ck.valid_resume("²") and ck.valid_resume("12")
    with pytest.raises(ValueError, match=r"step: got '²'; accepted: 'latest' or an integer >= 0"):
        ck.resolve_step(tmp_path, "²")
    assert ck.resolve_step(tmp_path, "007") == 7


def test_damaged_metadata_and_sums_say_which_steps_to_use_instead(tmp_path):
    """A missing or corrupt meta.json or sums file named the file but not what to do; a bit-flipped
    file of the right size read "(N bytes, N when saved, or another sha256)", as if sizes differed."""
    d = tmp_path / "ck"
    _save(d, 1)
    step_dir = _save(d, 2)
    model = step_dir / "model.pt"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 1
    model.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=r"model.pt: .*its sha256 is not the [0-9a-f]{16}\.\.\. recorded"):
        ck.load_checkpoint(d)
    (step_dir / "sums_rank0.json").write_text("{")
    with pytest.raises(ck.CheckpointError, match=r"sums_rank0.json: corrupt .*use another step \(\[1\]\)"):
        ck.load_checkpoint(d)
    (step_dir / "meta.json").write_text("{")
    with pytest.raises(ck.CheckpointError, match=r"corrupt metadata .*use another step \(\[1\]\)"):
        ck.load_checkpoint(d)
    (step_dir / "meta.json").unlink()
    with pytest.raises(ck.CheckpointError, match=r"meta.json missing\); use another step \(\[1\]\)"):
        ck.load_checkpoint(d)


def _move_killed_after_two_renames(d, monkeypatch) -> None:
    """A --resume auto move of d's run to earlier_runs/ killed after its first two renames
    (latest.json and step 1)."""
    real, calls = os.replace, []

    def killed(src, dst):
        calls.append(src)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(cr.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.fresh_start(d, "auto", False).settle()
    monkeypatch.undo()


def test_a_move_to_earlier_runs_cut_short_is_finished_whole_not_split(tmp_path, monkeypatch):
    """A kill between the renames of a move to earlier_runs/ left earlier_runs/1 with the run's
    latest.json and first step, and its other steps here: the next move put them in earlier_runs/2,
    splitting the run (earlier_runs/1's latest.json naming a step that is not there). The move now
    goes through earlier_runs/<N>.moving, which the next move finishes."""
    d = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(d, step, seed=step)
    _move_killed_after_two_renames(d, monkeypatch)
    assert not (d / "earlier_runs" / "1").exists() and ck.list_steps(d) == [2, 3]
    assert ck.resolve_resume("auto", d, log=lambda s: None) is None   # no latest.json here: a fresh start
    assert ck.fresh_start(d, "auto", False).settle() == d / "earlier_runs" / "1"
    assert [p.name for p in (d / "earlier_runs").iterdir()] == ["1"]
    run = d / "earlier_runs" / "1"
    assert ck.list_steps(run) == [1, 2, 3] and json.loads((run / "latest.json").read_text())["step"] == 3
    assert ck.load_checkpoint(run, load_optimizer=True)["step"] == 3
    _save(d, 1)   # a later move takes the next number
    assert ck.fresh_start(d, "auto", False).settle() == d / "earlier_runs" / "2"


def test_a_leftover_moving_folder_takes_only_the_run_it_was_cut_from(tmp_path, monkeypatch):
    """A run saved since a cut-short move (after the steps here were deleted by hand) has its own
    latest.json and may share step numbers with the leftover earlier_runs/<N>.moving: joining it
    replaced the old run's latest.json and failed on the shared step mid-move (ENOTEMPTY). It goes to
    a new number; the leftover stays as it is."""
    d = tmp_path / "ck"
    for step in (1, 2):
        _save(d, step, seed=step)
    _move_killed_after_two_renames(d, monkeypatch)
    leftover = d / "earlier_runs" / "1.moving"
    assert ck.list_steps(leftover) == [1]
    shutil.rmtree(d / "step_000002")      # deleted by hand, the leftover stays
    for step in (1, 2):
        _save(d, step, seed=10 + step)       # the overwrite run: its own latest.json, step 1 again
    assert ck.fresh_start(d, "auto", False).settle() == d / "earlier_runs" / "2"
    assert ck.list_steps(d / "earlier_runs" / "2") == [1, 2] and ck.list_steps(leftover) == [1]
