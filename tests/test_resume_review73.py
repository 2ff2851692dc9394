"""Resume review 73, as a user who changes things between runs: a reader of a model tag that a run is
still training into (base_eval, chat_eval, chat_web, mid_train reading base) overtaken by --keep-last's
pruning reads the new latest instead of failing with a bare FileNotFoundError, a spurious "sums file
missing" warning, or "file missing ... use another step" as if the step were damaged; a step removed
for good while read is said as such; a save cut short (step_N.partial) is said at the resume that
skips it, and by --resume auto when it was the first save."""

from __future__ import annotations

import pathlib

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_io as cio
from nanochat.checkpoint_runs import remove_old_step, resolve_resume


def _save(d, step):
    return ck.save_checkpoint(d, step, model_state={"w": torch.full((64,), float(step))},
                              optimizer_state={"state": {}, "param_groups": [], "step": step},
                              loader_state={"row": step}, loop_state={"step": step},
                              meta={"model_config": {"n_layer": 2}, "train": {"world_size": 1}})


def _train_on(d, step: int):
    """What a run training into `d` with --keep-last 1 does once a reader has started: saves `step`
    (latest.json -> it) and removes the step before it."""
    new = _save(d, step)
    remove_old_step(d / ck.step_dirname(step - 1), new, 1, say=lambda m: None)
    assert ck.list_steps(d) == [step]


def _once(act):
    done = []

    def run():
        if not done:
            done.append(True)
            act()
    return run


def _prune_after_meta_read(monkeypatch, prune) -> None:
    """The reader's meta.json read, then `prune` (the writer's prune or re-save, once): the race's
    first window."""
    real_meta = ck.read_meta

    def read_meta(ckpt_dir, step="latest"):
        meta = real_meta(ckpt_dir, step)
        prune()
        return meta
    monkeypatch.setattr(ck, "read_meta", read_meta)


@pytest.mark.parametrize("where", ["meta read", "file checked", "sums read"])
def test_a_reader_of_latest_overtaken_by_keep_last_reads_the_new_latest(tmp_path, monkeypatch, capsys, where):
    """The step latest.json named is pruned while the reader is inside it: after its meta.json was read
    (the old code: "model.pt: file missing from the checkpoint; use another step ([2])"), between a
    file's sums and its stat (a bare FileNotFoundError, no CheckpointError at all), and between
    model.pt's check and its sums file's (a WARNING that the sums were lost and the file loaded
    unverified). Each time the reader loads step 2, whole, and warns of nothing."""
    d = tmp_path / "ck"
    _save(d, 1)
    prune = _once(lambda: _train_on(d, 2))
    if where == "meta read":
        _prune_after_meta_read(monkeypatch, prune)
    elif where == "file checked":
        real_sum = cio.saved_sum

        def saved_sum(path, rank, summed=False):
            want = real_sum(path, rank, summed)
            prune()
            return want
        monkeypatch.setattr(cio, "saved_sum", saved_sum)
    else:
        real_is_file = pathlib.Path.is_file

        def is_file(self):
            if self.name == "sums_rank0.json" and self.parent.name == "step_000001":
                prune()
            return real_is_file(self)
        monkeypatch.setattr(pathlib.Path, "is_file", is_file)
    got = ck.load_checkpoint(d, "latest")
    assert got["step"] == 2 and torch.equal(got["model"]["w"], torch.full((64,), 2.0))
    assert got["loop"] == {"step": 2} and got["meta"]["step"] == 2
    assert "WARNING" not in capsys.readouterr().err


def test_a_step_named_by_number_and_removed_while_read_is_said_as_removed(tmp_path, monkeypatch):
    """--step 1 of a tag whose run prunes it meanwhile: there is nothing to read again, and the error
    says what happened (the old code: "file missing from the checkpoint", as for a damaged step)."""
    d = tmp_path / "ck"
    _save(d, 1)
    _prune_after_meta_read(monkeypatch, _once(lambda: _train_on(d, 2)))
    with pytest.raises(ck.CheckpointError, match=r"step_000001 was removed while it was being read .*--keep-last.*"
                                                 r"steps on disk now: \[2\]"):
        ck.load_checkpoint(d, 1)


def test_a_step_saved_again_while_read_is_read_in_its_new_copy(tmp_path, monkeypatch):
    """A re-save of the step being read (a resume at the last step saves it again) swaps the directory:
    the reader reads the new copy, not half of each or an error."""
    d = tmp_path / "ck"
    _save(d, 1)
    resave = _once(lambda: ck.save_checkpoint(d, 1, model_state={"w": torch.full((64,), 7.0)},
                                              loader_state={"row": 7}, loop_state={"step": 1},
                                              meta={"model_config": {"n_layer": 2}, "train": {"world_size": 1}}))
    _prune_after_meta_read(monkeypatch, resave)
    got = ck.load_checkpoint(d, 1)
    assert torch.equal(got["model"]["w"], torch.full((64,), 7.0)) and got["loader"] == {"row": 7}
    assert got["meta"]["has_optimizer"] is False   # the new copy's meta.json too (the old one's said True)


def test_a_step_damaged_in_place_is_refused_at_once_not_read_again(tmp_path, monkeypatch):
    """Only a directory renamed or replaced is read again: a file deleted inside a step that stays is
    the damaged-step error, read once (each read of the step counted)."""
    d = tmp_path / "ck"
    _save(d, 1)
    (d / "step_000001" / "model.pt").unlink()
    reads = []
    real_meta = ck.read_meta
    monkeypatch.setattr(ck, "read_meta", lambda *a, **k: reads.append(1) or real_meta(*a, **k))
    with pytest.raises(ck.CheckpointError, match=r"model.pt: file missing from the checkpoint; use another step"):
        ck.load_checkpoint(d, "latest")
    assert len(reads) == 1


def test_a_save_cut_short_is_said_at_the_resume_that_skips_it(tmp_path, capsys):
    """A run killed while saving step 2 leaves step_000002.partial: the resume takes step 1 (as before)
    and now says why step 2 is not taken and what becomes of the leftover; a plain read (an eval)
    says nothing."""
    d = tmp_path / "ck"
    _save(d, 1)
    (d / "step_000002.partial").mkdir()
    (d / "step_000002.partial" / "model.pt").write_bytes(b"half")
    assert ck.load_checkpoint(d, "latest")["step"] == 1
    assert "partial" not in capsys.readouterr().out
    assert ck.load_checkpoint(d, "latest", load_optimizer=True)["step"] == 1
    out = capsys.readouterr().out
    assert "step_000002.partial in " in out and "a save cut short" in out
    assert "this run resumes step 1 and deletes the leftover at its first save" in out


def test_resume_auto_over_only_a_first_save_cut_short_says_it_starts_over(tmp_path):
    """--resume auto (setup.sh's rerun) where the first save was cut short: nothing to resume, and the
    start says the step_N.partial there is no checkpoint, not only "no checkpoint yet"."""
    d = tmp_path / "ck"
    (d / "step_000050.partial").mkdir(parents=True)
    said = []
    assert resolve_resume("auto", d, log=said.append) is None
    assert "no checkpoint yet" in said[0] and "step_000050.partial there is a save cut short" in said[0]
    said.clear()
    assert resolve_resume("auto", tmp_path / "empty", log=said.append) is None
    assert "partial" not in said[0]


def test_the_disk_plan_counts_a_save_cut_short_as_room(tmp_path, monkeypatch):
    """A rerun after a kill mid-save on a nearly full disk: the step_N.partial left behind (up to a
    whole checkpoint) is deleted by the first save before it writes, so it is room. The old plan
    refused the run ("one checkpoint needs ...; free space"), naming no leftover to delete."""
    d = tmp_path / "ck"
    (d / "step_000004.partial").mkdir(parents=True)
    (d / "step_000004.partial" / "model.pt").write_bytes(b"\0" * (6 << 20))
    need = int((1 << 20) * 1.02) + (64 << 20)
    monkeypatch.setattr(ck, "free_bytes", lambda path: need - (4 << 20))
    text = ck.disk_plan(d, 1 << 20, 2)
    assert "(with 6 MB of saves cut short, deleted at the first save)" in text
    (d / "step_000004.partial" / "model.pt").unlink()
    with pytest.raises(ck.CheckpointError, match="one checkpoint of this run needs"):
        ck.disk_plan(d, 1 << 20, 2)


def test_a_model_config_field_newer_than_the_checkpoint_is_its_default_on_resume():
    """A checkpoint saved before GPTConfig gained a field (its meta.json's model_config lacks it) loads
    for every reader with the field's default (config_from_meta); the resume check compared the missing
    field as None and refused to continue the run ("softcap None but this run has 15.0"). A value that
    does differ is still refused."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from nanochat.gpt_config import GPTConfig
    from nanochat.resume_checks import check_resume_compatible

    now = asdict(GPTConfig(n_layer=2, n_head=2, n_kv_head=2, n_embd=64, vocab_size=1024, sequence_len=64))
    older = {k: v for k, v in now.items() if k != "softcap"}
    meta = {"model_config": older, "train": {"world_size": 1, "total_batch_size": 512}, "tokenizer_fingerprint": "f"}
    plan = SimpleNamespace(total_batch_size=512)
    check_resume_compatible(meta, now, plan, 1, "f")
    with pytest.raises(ck.CheckpointError, match="softcap 30.0 but this run has 15.0"):
        check_resume_compatible({**meta, "model_config": {**older, "softcap": 30.0}}, now, plan, 1, "f")
    with pytest.raises(ck.CheckpointError, match=r"n_layer \(set by base_train --depth\) 4 but this run has 2"):
        check_resume_compatible({**meta, "model_config": {**older, "n_layer": 4}}, now, plan, 1, "f")


def test_a_reader_waits_out_a_live_writers_resave_swap(tmp_path):
    """A reader of a step that a running writer is re-saving (step_N moved to step_N.old-PID, the new
    copy not yet in) renamed the old copy back between the writer's two renames, and the writer's
    second rename failed (Directory not empty). Now a reader beside a live writer (the writer lock
    held by another process) waits for the swap and reads the new copy."""
    import os
    import subprocess
    import sys
    import threading

    import torch

    from nanochat import checkpoint as ck
    d = tmp_path / "ck"
    ck.save_checkpoint(d, 1, model_state={"w": torch.full((4,), 1.0)}, meta={"model_config": {}, "train": {"run": "old"}})
    fresh = tmp_path / "fresh"
    ck.save_checkpoint(fresh, 1, model_state={"w": torch.full((4,), 2.0)}, meta={"model_config": {}, "train": {"run": "new"}})
    code = ("import sys, time; from nanochat.writer_lock import claim_checkpoint_dir; "
            "claim_checkpoint_dir(sys.argv[1]); print('held', flush=True); time.sleep(60)")
    writer = subprocess.Popen([sys.executable, "-c", code, str(d)], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        assert writer.stdout.readline().strip() == "held"
        os.replace(d / "step_000001", d / "step_000001.old-424242")   # the writer's first rename
        errors = []

        def second_rename():
            try:
                os.replace(fresh / "step_000001", d / "step_000001")
            except OSError as e:
                errors.append(e)

        timer = threading.Timer(0.3, second_rename)
        timer.start()
        meta = ck.read_meta(d, 1)
        timer.join()
        assert errors == [] and meta["train"]["run"] == "new", (errors, meta["train"])
        assert (d / "step_000001.old-424242").is_dir()   # the writer deletes it, not the reader
    finally:
        writer.kill()
        writer.wait()
