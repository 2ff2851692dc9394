"""Checkpoint durability review 15: meta.json fields checked on load, a lost sums file said, removal
leftovers swept, directory fsync errors and new directories' entries made durable, and (regression
cover) a save killed by os._exit at each rename and a writer lock whose holder was SIGKILLed."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_io as cio
from nanochat import writer_lock
from nanochat.errors import RequestError
from nanochat.resume_checks import check_resume_compatible, check_resume_world


def _save(d, step, seed=0, **meta):
    return ck.save_checkpoint(d, step, model_state={"w": torch.full((16,), float(seed))},
                              optimizer_state={"state": {0: {"m": torch.full((2,), float(step))}}, "param_groups": []},
                              loader_state={"row": step}, loop_state={"step": step},
                              meta={"model_config": {"n_layer": 2}, "train": {"world_size": 1, "total_batch_size": 8},
                                    **meta})


def _edit_meta(step_dir: Path, **fields) -> None:
    meta = json.loads((step_dir / "meta.json").read_text())
    for key, value in fields.items():
        if value is _DROP:
            meta.pop(key)
        else:
            meta[key] = value
    (step_dir / "meta.json").write_text(json.dumps(meta))


_DROP = object()


@pytest.mark.parametrize("fields, said", [
    ({"world_size": None}, r"'world_size' is null \(null\), not an integer"),       # was int(None): TypeError
    ({"world_size": "two"}, r"'world_size' is a string \(\"two\"\), not an integer"),  # was int("two"): ValueError
    ({"world_size": 0}, r"'world_size' is 0, not >= 1"),
    ({"has_optimizer": "no"}, r"'has_optimizer' is a string \(\"no\"\), not true or false"),  # was read as true
    ({"train": [8]}, r"'train' is an array \(\[8\]\), not an object"),    # check_resume_world: AttributeError
    ({"config": "x"}, r"'config' is a string"),
    ({"tokenizer_fingerprint": 5}, r"'tokenizer_fingerprint' is an integer \(5\), not a string"),
    ({"step": 7}, r"'step' is 7 but the directory is step_000003 \(renamed by hand\? name it step_000007 again\)"),
    ({"world_size": _DROP, "step": _DROP}, r"'step' is missing; 'world_size' is missing"),
])
def test_meta_json_fields_missing_or_of_the_wrong_type_are_named(tmp_path, fields, said):
    d = tmp_path / "ck"
    _save(d, 1)
    _edit_meta(_save(d, 3), **fields)
    pattern = rf"step_000003/meta.json: invalid metadata: {said}.*use another step \(\[1\]\)"
    with pytest.raises(ck.CheckpointError, match=pattern):
        ck.load_checkpoint(d, load_optimizer=True)
    with pytest.raises(ck.CheckpointError, match=pattern):   # what a resume reads before any weights
        check_resume_world(ck.read_meta(d), 1)
    assert ck.load_checkpoint(d, 1)["step"] == 1   # the other step is untouched


def test_null_recipe_fields_are_accepted_and_a_resume_check_takes_them(tmp_path):
    """null where a recipe had nothing to record reads as none; check_resume_compatible read
    meta.get("train", {}).get(...) and raised AttributeError on a null "train"."""
    d = tmp_path / "ck"
    _edit_meta(_save(d, 2), train=None, config=None, source=None, tokenizer_fingerprint=None)
    meta = ck.read_meta(d)

    class Plan:
        total_batch_size = 8
    with pytest.raises(ck.CheckpointError, match=r"--total-batch-size None but this run has 8"):
        check_resume_compatible(meta, {"n_layer": 2}, Plan(), 1, "f" * 64)


def test_a_lost_sums_file_is_said_not_taken_for_a_checkpoint_from_before_the_sums(tmp_path, capsys):
    """sums_rank0.json gone (a partial copy): a bit-flipped model.pt loaded without a word, the
    sums check silently off. meta.json now records that the step was saved with sums."""
    d = tmp_path / "ck"
    step_dir = _save(d, 2, seed=2)
    assert ck.read_meta(d)["checksummed"] is True
    (step_dir / "sums_rank0.json").unlink()
    ck.load_checkpoint(d, load_optimizer=True)
    err = capsys.readouterr().err
    assert f"WARNING: {step_dir / 'sums_rank0.json'} is missing, though this checkpoint was saved with it: " \
           "model.pt is loaded unverified" in err, err
    assert "optim_rank0.pt is loaded unverified" in err
    _edit_meta(step_dir, checksummed=_DROP)   # a checkpoint from before the sums: unchecked, as before
    ck.load_checkpoint(d)
    assert "WARNING" not in capsys.readouterr().err


def test_a_removal_leftover_neither_blocks_the_next_removal_nor_outlives_a_save(tmp_path):
    """--keep-last's removal renames step_N to step_N.del-PID, then deletes it. Killed mid-delete, it
    left that name; a later removal of step N in a process of the same pid (containers number alike
    from run to run) failed on it (ENOTEMPTY, every time), and a run without --keep-last never swept it."""
    d = tmp_path / "ck"
    for step in (1, 2, 3):
        _save(d, step)
    same_pid = d / f"step_000001.del-{os.getpid()}"
    (same_pid / "sub").mkdir(parents=True)
    (same_pid / "sub" / "model.pt").write_bytes(b"half deleted")
    ck.remove_checkpoint(d, 1)
    assert ck.list_steps(d) == [2, 3] and not list(d.glob("*.del-*"))
    other = d / "step_000002.del-99999999"
    other.mkdir()
    (other / "optim_rank0.pt").write_bytes(b"x" * 100)
    _save(d, 4)   # a save without pruning frees it too
    assert not other.exists() and ck.list_steps(d) == [2, 3, 4]


def _fsync_fails_on_directories(code: int):
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(code, os.strerror(code))
        return real(fd)
    return fsync


def test_a_directory_fsync_error_fails_the_save_instead_of_being_passed_over(tmp_path, monkeypatch):
    """fsync_dir swallowed every error: an EIO syncing the directory (its rename not on disk) and the
    save was reported done, latest.json moved, --keep-last pruned the step before it. EINVAL (a
    filesystem that cannot sync a directory) is still passed over."""
    d = tmp_path / "ck"
    _save(d, 1, seed=1)
    monkeypatch.setattr(os, "fsync", _fsync_fails_on_directories(errno.EIO))
    with pytest.raises(ck.CheckpointError, match=r"checkpoint of step 2 not written to .*its disk refused the write "
                                                 r"\(Input/output error: .*step_000002.partial\).*step 1 is intact"):
        _save(d, 2, seed=2)
    monkeypatch.setattr(os, "fsync", _fsync_fails_on_directories(errno.EINVAL))
    assert ck.read_latest(d) == 1 and ck.list_steps(d) == [1] and not list(d.glob("*.partial"))
    _save(d, 3, seed=3)
    assert ck.load_checkpoint(d)["step"] == 3


def test_new_checkpoint_directories_are_fsynced_into_their_parents(tmp_path, monkeypatch):
    """mkdir -p of a first save's checkpoints/<phase>/<tag> synced none of the new entries: the step's
    files and rename were durable, the directories holding them not."""
    synced = []
    real = cio.fsync_dir
    monkeypatch.setattr(cio, "fsync_dir", lambda p: (synced.append(Path(p)), real(p))[1])
    d = tmp_path / "new" / "checkpoints" / "base" / "d2"
    _save(d, 1)
    for made in (tmp_path / "new", d.parent.parent, d.parent, d):
        assert made.parent in synced, (made, synced)
    synced.clear()
    lock_dir = tmp_path / "other" / "sft" / "d3"
    writer_lock.claim_checkpoint_dir(lock_dir)   # the training scripts make the directory here first
    try:
        assert {tmp_path, tmp_path / "other", lock_dir.parent.parent, lock_dir.parent} <= set(synced), synced
    finally:
        writer_lock.release_all()


_BOUNDARIES = [f"{when}{n}" for n in range(1, 9) for when in ("before", "after")]


def test_a_save_killed_at_each_rename_leaves_a_complete_checkpoint_to_resume(tmp_path):
    """A real kill (os._exit: no except/finally runs) before and after each os.replace of a save and
    of --keep-last's removal, fresh and re-saved: --resume latest and auto take a complete step that
    loads with its optimizer, and the next save works. (The existing tests raise KeyboardInterrupt,
    which runs the temp-file cleanups a SIGKILL never does.)"""
    if not hasattr(os, "fork"):
        pytest.skip("needs fork")
    for resave in (False, True):
        for point in _BOUNDARIES:
            d = tmp_path / f"{point}-{resave}"
            _save(d, 2, seed=2)
            if resave:
                _save(d, 4, seed=3)
            pid = os.fork()
            if pid == 0:   # the child: die at the chosen rename
                try:
                    _die_at(point)
                    _save(d, 4, seed=4)
                    ck.remove_checkpoint(d, 2)
                finally:
                    os._exit(0)
            os.waitpid(pid, 0)
            out = ck.load_checkpoint(d, load_optimizer=True)
            got = (out["step"], out["model"]["w"][0].item())
            assert got in ((2, 2.0), (4, 3.0 if resave else 4.0), (4, 4.0)), (point, resave, got)
            assert ck.resolve_resume("auto", d, log=lambda _: None) == "latest"
            for step in ck.list_steps(d):
                ck.load_checkpoint(d, step, load_optimizer=True)
            _save(d, 6, seed=6)
            assert ck.load_checkpoint(d)["step"] == 6 and not list(d.glob("*.partial")), point


def _die_at(point: str) -> None:
    real, seen = os.replace, [0]

    def replace(src, dst):
        seen[0] += 1
        if point == f"before{seen[0]}":
            os._exit(9)
        real(src, dst)
        if point == f"after{seen[0]}":
            os._exit(9)
    os.replace = replace


def test_the_lock_of_a_killed_holder_is_free_and_no_flock_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    """A holder SIGKILLed leaves its description in .writer.lock but no lock (the kernel drops a
    flock with its last holder: no pid to check, so no pid reuse to fool it); a filesystem without
    flock (ENOLCK: NFS without its lock daemon; Lustre without -o flock) goes on with a warning."""
    d = tmp_path / "ck"
    d.mkdir()
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'pid 1 on elsewhere: killed run'); "
            "print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(d / writer_lock.LOCK_NAME)], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert writer_lock.holder(d) == "pid 1 on elsewhere: killed run"
        with pytest.raises(RequestError, match=r"another training run is saving checkpoints there \(pid 1 on "):
            writer_lock.claim_checkpoint_dir(d)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    try:
        assert writer_lock.holder(d) is None
        writer_lock.claim_checkpoint_dir(d)
        assert (d / writer_lock.LOCK_NAME).read_text().startswith(f"pid {os.getpid()} on ")
    finally:
        writer_lock.release_all()

    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_flock)
    other = tmp_path / "nfs"
    writer_lock.claim_checkpoint_dir(other)   # no refusal, no traceback
    assert "this filesystem has no flock; going on without the one-run-per-checkpoint-directory check" \
        in capsys.readouterr().err
    assert writer_lock.holder(other) is None
    writer_lock.release_all()


def test_atomic_write_from_two_threads_of_one_process(tmp_path):
    """Two threads writing one path at once each use their own temp file: with the temp named by
    the process alone, one thread's replace took the other's file (FileNotFoundError)."""
    import threading

    from nanochat.checkpoint_io import atomic_write

    target, errors, inside = tmp_path / "f.json", [], threading.Barrier(2)

    def write(f, text):
        f.write(text)
        inside.wait(timeout=10)   # both temps exist before either is replaced

    def worker(text):
        try:
            atomic_write(target, lambda f: write(f, text))
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in (b"one", b"two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and target.read_bytes() in (b"one", b"two")
    assert not list(tmp_path.glob(".f.json.tmp-*"))
