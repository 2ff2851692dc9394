"""Checkpoints, second review: a damaged latest pointer or sums file, files missing from a step,
the disk filling while meta.json is written, and the superseded copy a re-save leaves behind when
its deletion is cut short."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from nanochat import checkpoint as ck


def _state(seed=0):
    return {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))}


def _save(d, step, seed=0):
    return ck.save_checkpoint(d, step, model_state=_state(seed), optimizer_state={"m": torch.ones(2) * step},
                              loader_state={"row": step}, loop_state={"step": step}, meta={})


@pytest.mark.parametrize("record", ['{"step": 1.5}', '{"step": true}', '{"step": -3}',
                                    '{"dir": "step_000002"}', "[2]", ""])
def test_a_damaged_latest_pointer_is_refused_naming_it_and_the_steps_on_disk(tmp_path, record):
    """latest.json with a step that is not a whole number >= 0 used to be taken as one (1.5 and
    true loaded step 1) or refused as a bad `step:` argument the user never gave (-3); any damage
    now names the file, the steps on disk and --resume STEP (what gets a run going again)."""
    d = tmp_path / "ck"
    _save(d, 1, seed=1)
    _save(d, 2, seed=2)
    (d / "latest.json").write_text(record)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load_checkpoint(d)
    msg = str(e.value)
    assert str(d / "latest.json") in msg and "[1, 2]" in msg and "--resume N" in msg and "--step N" in msg, msg


def test_a_sums_entry_without_size_or_hash_is_a_checkpoint_error(tmp_path):
    """A sums_rank0.json entry that is a dict without "bytes" crashed with a TypeError from the
    message's number formatting instead of naming the damaged file."""
    d = tmp_path / "ck"
    _save(d, 1)
    for entry in ({}, {"bytes": "12", "sha256": "ab"}, {"bytes": 10}):
        (d / "step_000001" / "sums_rank0.json").write_text(json.dumps({"model.pt": entry}))
        with pytest.raises(ck.CheckpointError, match=r"sums_rank0\.json: corrupt"):
            ck.load_checkpoint(d)


def test_a_file_missing_from_a_step_names_the_steps_to_use_instead(tmp_path):
    d = tmp_path / "ck"
    _save(d, 1)
    _save(d, 2)
    (d / "step_000002" / "optim_rank0.pt").unlink()
    with pytest.raises(ck.CheckpointError, match=r"optim_rank0\.pt: file missing .*use another step \(\[1\]\)"):
        ck.load_checkpoint(d, load_optimizer=True)


def test_the_disk_filling_while_meta_json_is_written_is_a_clean_checkpoint_error(tmp_path, monkeypatch):
    """The tensors fit, then meta.json meets a full disk: a raw OSError used to escape (a traceback)
    and leave step_N.partial; now it is the CheckpointError of any save without room."""
    d = tmp_path / "ck"
    _save(d, 2)
    real = ck.write_json

    def full(path, obj):
        if path.name == "meta.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, obj)

    monkeypatch.setattr(ck, "write_json", full)
    with pytest.raises(ck.CheckpointError, match=r"step 4 not written .*no room.*step 2 is intact"):
        _save(d, 4)
    monkeypatch.undo()
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000002"]
    assert ck.load_checkpoint(d)["step"] == 2


def _resave_killed_while_deleting_the_old_copy(d, monkeypatch, step):
    real_rmtree = ck.shutil.rmtree

    def killed(path, ignore_errors=False):
        if ".old-" in Path(path).name:
            (Path(path) / "model.pt").unlink()   # meta.json still there: it looks like a checkpoint
            raise KeyboardInterrupt("killed while deleting the superseded copy")
        return real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ck.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(d, step, seed=99)
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    assert list(d.glob(f"step_{step:06d}.old-*")), "the test no longer reaches the deletion"


def test_a_superseded_copy_left_by_a_cut_short_resave_is_swept_and_never_restored(tmp_path, monkeypatch):
    """A re-save of step N (a resumed run reaching a step the earlier one saved) deletes the old
    copy after the new one is in place. Killed during that delete, it left step_N.old-PID (up to a
    whole checkpoint) that nothing ever removed; and once step N was pruned (--keep-last), a read of
    step N renamed that partial, superseded copy back as if it were the checkpoint."""
    d = tmp_path / "ck"
    for step in (2, 4):
        _save(d, step, seed=step)
    _resave_killed_while_deleting_the_old_copy(d, monkeypatch, 2)
    ck.remove_checkpoint(d, 2)   # --keep-last's pruning (latest.json still names step 4)
    with pytest.raises(ck.CheckpointError, match="no checkpoint for step 2"):
        ck.load_checkpoint(d, 2)
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000004"]
    # the next save sweeps it too (the step itself still there)
    _resave_killed_while_deleting_the_old_copy(d, monkeypatch, 4)
    _save(d, 8, seed=8)
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000004", "step_000008"]
    assert torch.equal(ck.load_checkpoint(d, 4)["model"]["w"], _state(99)["w"])


def test_an_earlier_run_is_settled_with_its_superseded_copies(tmp_path, monkeypatch):
    """--overwrite moves the earlier run aside at the first save (it deleted it): a leftover
    step_N.old-PID of it stayed, and `--resume N` then restored the earlier run's (partial) step N
    into the new run."""
    d = tmp_path / "ck"
    _save(d, 2, seed=2)
    _resave_killed_while_deleting_the_old_copy(d, monkeypatch, 2)
    earlier = ck.fresh_start(d, None, overwrite=True)
    earlier.settle()
    assert sorted(p.name for p in d.iterdir()) == ["earlier_runs"]
    with pytest.raises(ck.CheckpointError, match="no checkpoint for step 2"):
        ck.read_meta(d, 2)
    # --resume auto starting fresh alike: the leftover is deleted, not left behind
    _save(d, 3, seed=3)
    _resave_killed_while_deleting_the_old_copy(d, monkeypatch, 3)
    moved = ck.fresh_start(d, "auto", overwrite=False).settle()
    assert not list(d.glob("step_*")) and (moved / "step_000003").is_dir()


@pytest.mark.parametrize("overwrite", [True, False])
def test_an_earlier_runs_step_left_only_as_its_old_copy_goes_with_the_run(tmp_path, overwrite):
    """A re-save cut between its two renames leaves step N only as step_N.old-PID (latest.json names
    N). Settling the earlier run left that copy behind: a moved run's archive named a step it
    lacked; a later read of the new run's step N could restore the earlier run's copy."""
    d = tmp_path / "ck"
    _save(d, 1, seed=1)
    _save(d, 2, seed=2)
    os.replace(d / "step_000002", d / "step_000002.old-123")
    moved = ck.fresh_start(d, None if overwrite else "auto", overwrite=overwrite).settle()
    assert not list(d.glob("step_*"))
    # the archive holds it (--overwrite's too), restorable there as in the run's own directory
    assert ck.read_meta(moved, "latest")["step"] == 2


# ------------------------------------------------------------------ base_train, as a user

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "8", "--total-batch-size", "512", "--window-pattern", "SL", "--sample-every", "-1",
        "--eval-every", "-1", "--no-compile", "--num-iterations", "8", "--save-every", "2"]


@pytest.mark.slow
def test_a_run_killed_mid_save_resumes_exactly_from_the_last_complete_checkpoint(env, base_dir, monkeypatch):
    """base_train killed while writing step 6 (a second Ctrl-C mid-save), rerun with --resume auto
    --keep-last 1: it continues from step 4, never from the half-written 6, and its losses and final
    weights equal those of a run that was never interrupted; pruning keeps only the newest."""
    from scripts import base_train

    straight = base_train.main(TINY + env + ["--model-tag", "straight"])
    d = ck.checkpoint_dir("base", "cut", base_dir)
    real = ck.save_hashed

    def killed_at_step_6(path, obj):
        if path.parent.name == "step_000006.partial" and path.name.startswith("optim"):
            raise KeyboardInterrupt("second Ctrl-C mid-save")
        return real(path, obj)

    monkeypatch.setattr(ck, "save_hashed", killed_at_step_6)
    with pytest.raises(KeyboardInterrupt):
        base_train.main(TINY + env + ["--model-tag", "cut", "--keep-last", "1"])
    monkeypatch.setattr(ck, "save_hashed", real)
    assert ck.read_latest(d) == 4 and ck.list_steps(d) == [4] and (d / "step_000006.partial").is_dir()
    resumed = base_train.main(TINY + env + ["--model-tag", "cut", "--keep-last", "1", "--resume", "auto"])
    assert sorted(resumed["losses"]) == [4, 5, 6, 7]
    assert all(resumed["losses"][s] == straight["losses"][s] for s in range(4, 8))   # exact, not approx
    assert sorted(p.name for p in d.iterdir()) == [".writer.lock", "latest.json", "step_000008"]
    a = ck.load_checkpoint(ck.checkpoint_dir("base", "straight", base_dir), 8, load_optimizer=True)
    b = ck.load_checkpoint(d, 8, load_optimizer=True)
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    assert a["loader"] == b["loader"] and a["loop"]["meter"] == b["loop"]["meter"]


def test_a_model_trained_with_te_layers_saves_weights_that_load_into_the_plain_gpt(tmp_path):
    """Transformer Engine's Linear (--precision fp8 --precision-backend te, swapped in place by
    precision.py) puts a `<layer>._extra_state` entry (its fp8 metadata, a uint8 tensor) into the
    model's state_dict. model.pt held them, so every consumer, which builds the plain GPT and loads
    strictly (load_model for eval / chat, base_train's --resume before it swaps the layers again),
    refused the checkpoint as not matching its model_config. The recipes built here (current
    scaling, block scaling) keep no state across steps: the entries are left out of model.pt."""
    from dataclasses import asdict

    from nanochat.gpt import config_for_depth
    from nanochat.precision import swap_linears

    class ExtraStateLinear(torch.nn.Linear):   # what te.Linear adds to a Linear, as far as state goes
        def get_extra_state(self):
            return torch.tensor(list(b"fp8 meta"), dtype=torch.uint8)

        def set_extra_state(self, state):
            pass

    def like_te(old):
        new = ExtraStateLinear(old.in_features, old.out_features, bias=False, device="meta")
        new.weight = old.weight
        return new

    config = config_for_depth(1, 64, 16, aspect_ratio=32, head_dim=32)
    model = ck.build_model(config, "cpu")
    swap_linears(model, "fp8", like_te)
    assert any(k.endswith("._extra_state") for k in model.state_dict())
    d = tmp_path / "ck"
    ck.save_checkpoint(d, 1, model_state=model.state_dict(), meta={"model_config": asdict(config)})
    ckpt = ck.load_checkpoint(d)
    plain = ck.model_from_meta(ckpt["meta"], ckpt["model"], d / "step_000001", "cpu")
    for name, p in model.named_parameters():
        assert torch.equal(p, plain.get_parameter(name)), name
    # a checkpoint written before (its model.pt holds the entries) loads too
    torch.save(model.state_dict(), d / "step_000001" / "model.pt")
    (d / "step_000001" / "sums_rank0.json").unlink()
    ckpt = ck.load_checkpoint(d)
    assert not any(k.endswith("._extra_state") for k in ckpt["model"])
    ck.model_from_meta(ckpt["meta"], ckpt["model"], d / "step_000001", "cpu")
