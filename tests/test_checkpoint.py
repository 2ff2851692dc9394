"""Checkpoints: round trip, latest pointer, crash atomicity, schema version, load_model."""

import hashlib
import json
import math
import os
import time

from pathlib import Path

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_io as cio


def _model_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)}


def _save(d, step, seed=0, **kw):
    return ck.save_checkpoint(d, step, model_state=_model_state(seed),
                              optimizer_state={"state": {0: {"m": torch.full((2,), float(step))}}, "param_groups": []},
                              loader_state={"shard": 1, "row": step}, loop_state={"step": step, "rng": torch.get_rng_state()},
                              meta={"model_config": {"n_layer": 2}, **kw})


def test_checkpoint_dir_layout(tmp_path):
    assert ck.checkpoint_dir("sft", "d4", tmp_path) == tmp_path / "checkpoints" / "sft" / "d4"
    with pytest.raises(ValueError, match="phase.*base\\|mid\\|sft\\|rl"):
        ck.checkpoint_dir("pretrain", "d4", tmp_path)
    with pytest.raises(ValueError, match="--model-tag"):
        ck.checkpoint_dir("base", "../evil", tmp_path)


def test_round_trip_and_latest(tmp_path):
    d = tmp_path / "ck"
    p2 = _save(d, 2, seed=2)
    p5 = _save(d, 5, seed=5)
    assert p5 == d / "step_000005" and p2.is_dir()
    assert json.loads((d / "latest.json").read_text())["step"] == 5
    assert ck.list_steps(d) == [2, 5]
    out = ck.load_checkpoint(d, load_optimizer=True)
    assert out["step"] == 5
    assert torch.equal(out["model"]["w"], _model_state(5)["w"])
    assert out["optimizer"]["state"][0]["m"].tolist() == [5.0, 5.0]
    assert out["loader"] == {"shard": 1, "row": 5}
    assert out["loop"]["step"] == 5 and out["loop"]["rng"].dtype == torch.uint8
    meta = out["meta"]
    assert meta["schema_version"] == ck.SCHEMA_VERSION and meta["step"] == 5 and meta["world_size"] == 1
    for key in ("git_sha", "torch_version", "python_version", "saved_at"):
        assert key in meta
    # explicit step (int or string), optimizer not loaded by default
    old = ck.load_checkpoint(d, "2")
    assert old["step"] == 2 and old["optimizer"] is None
    assert torch.equal(old["model"]["b"], _model_state(2)["b"])
    with pytest.raises(ck.CheckpointError, match="no checkpoint for step 3.*\\[2, 5\\]"):
        ck.load_checkpoint(d, 3)


def test_latest_is_recorded_not_guessed(tmp_path):
    d = tmp_path / "ck"
    _save(d, 7)
    _save(d, 3)   # saved later but a lower step: latest follows the record, i.e. the last save
    assert ck.load_checkpoint(d)["step"] == 3
    os.utime(d / "step_000007", (2e9, 2e9))  # mtimes are irrelevant
    assert ck.read_latest(d) == 3
    (d / "latest.json").unlink()
    with pytest.raises(ck.CheckpointError, match=r"latest.json missing.*\[3, 7\]"):
        ck.load_checkpoint(d)


@pytest.mark.parametrize("target", ["torch.save", "os.replace"])
def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch, target):
    d = tmp_path / "ck"
    _save(d, 10, seed=10)
    calls = {"n": 0}

    if target == "torch.save":
        real = torch.save

        def boom(obj, f, *a, **k):
            calls["n"] += 1
            if calls["n"] == 2:        # model written, optimizer write dies half-way
                f.write(b"partial garbage")
                raise OSError("disk full (simulated)")
            return real(obj, f, *a, **k)
        monkeypatch.setattr(ck.torch, "save", boom)
    else:
        real = os.replace

        def boom(src, dst):
            calls["n"] += 1
            if calls["n"] == 3:       # the third file's rename dies
                raise OSError("power loss (simulated)")
            return real(src, dst)
        monkeypatch.setattr(ck.os, "replace", boom)

    with pytest.raises(OSError, match="simulated"):
        _save(d, 20, seed=20)
    monkeypatch.undo()
    assert ck.read_latest(d) == 10
    assert ck.list_steps(d) == [10]          # the half-written step is not a checkpoint
    out = ck.load_checkpoint(d, load_optimizer=True)
    assert out["step"] == 10 and torch.equal(out["model"]["w"], _model_state(10)["w"])
    assert not list(d.glob("step_000010/.*tmp*"))
    # the next save of the same step cleans the partial directory up and succeeds
    _save(d, 20, seed=20)
    assert ck.read_latest(d) == 20 and not (d / "step_000020.partial").exists()


def test_a_save_cut_short_leaves_no_partial_directory_behind_the_next_save(tmp_path, monkeypatch):
    """A save interrupted mid-write (a second Ctrl-C is a KeyboardInterrupt, not an OSError) leaves
    step_N.partial; the run resumed from the checkpoint before trains past N without saving N again
    (a stop's save is at an odd step), so only a sweep of every step's leftover frees its space
    (~9 GB at d20)."""
    d = tmp_path / "ck"
    _save(d, 10, seed=10)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(ck, "save_hashed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _save(d, 13, seed=13)
    monkeypatch.undo()
    assert (d / "step_000013.partial").is_dir() and ck.read_latest(d) == 10
    _save(d, 20, seed=20)
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000010", "step_000020"]


def test_crash_during_pointer_update(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    _save(d, 1)
    real = ck.write_json

    def boom(path, obj):
        if path.name == "latest.json":
            raise OSError("crash before pointer (simulated)")
        return real(path, obj)
    monkeypatch.setattr(ck, "write_json", boom)
    with pytest.raises(OSError):
        _save(d, 2)
    monkeypatch.undo()
    assert ck.load_checkpoint(d)["step"] == 1      # pointer still at the last complete save
    assert ck.load_checkpoint(d, 2)["step"] == 2   # and the new step is complete on disk


def test_resave_same_step_replaces_it(tmp_path):
    d = tmp_path / "ck"
    _save(d, 4, seed=1)
    _save(d, 4, seed=2)
    assert torch.equal(ck.load_checkpoint(d, 4)["model"]["w"], _model_state(2)["w"])
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000004"]


def test_a_crash_between_the_resave_renames_is_recovered(tmp_path, monkeypatch):
    """The re-save moves the old copy aside, then the new one in: killed between the two renames,
    latest.json named a step with no directory (and --resume failed) while the old copy sat in
    step_N.old-PID. Loading it now renames that copy back."""
    d = tmp_path / "ck"
    _save(d, 4, seed=1)
    real_replace = os.replace

    def crash_before_moving_the_new_copy_in(src, dst):
        if str(src).endswith(".partial"):   # the old copy is already aside
            raise KeyboardInterrupt("killed between the renames")
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", crash_before_moving_the_new_copy_in)
    with pytest.raises(KeyboardInterrupt):
        _save(d, 4, seed=2)
    monkeypatch.setattr(ck.os, "replace", real_replace)
    assert not (d / "step_000004").exists() and ck.read_latest(d) == 4
    ckpt = ck.load_checkpoint(d, "latest", load_optimizer=True)
    assert torch.equal(ckpt["model"]["w"], _model_state(1)["w"]) and ck.list_steps(d) == [4]


def test_a_removal_killed_halfway_is_not_restored(tmp_path, monkeypatch):
    """--keep-last pruning renames a step away, then deletes it. Killed during the delete, it left a
    partial directory under the re-save's name (step_N.old-PID), which a later read of step N
    restored as if it were a complete checkpoint. Now it is step_N.del-PID: never restored, and
    swept by the next removal."""
    d = tmp_path / "ck"
    for step in (2, 4, 6):
        _save(d, step, seed=step)
    real_rmtree = ck.shutil.rmtree

    def killed_after_the_first_file(path, ignore_errors=False):
        (Path(path) / "model.pt").unlink()   # meta.json still there: it looks like a checkpoint
        raise KeyboardInterrupt("killed while deleting")

    monkeypatch.setattr(ck.shutil, "rmtree", killed_after_the_first_file)
    with pytest.raises(KeyboardInterrupt):
        ck.remove_checkpoint(d, 2)
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    with pytest.raises(Exception):
        ck.load_checkpoint(d, 2)
    assert not (d / "step_000002").exists() and ck.list_steps(d) == [4, 6]
    ck.remove_checkpoint(d, 4)
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000006"]


def test_unknown_schema_version(tmp_path):
    d = tmp_path / "ck"
    path = _save(d, 3)
    meta = json.loads((path / "meta.json").read_text())
    meta["schema_version"] = 99
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ck.CheckpointError, match="schema version 99.*reads version 1"):
        ck.load_checkpoint(d)


def test_incomplete_and_wrong_world_size(tmp_path):
    d = tmp_path / "ck"
    path = _save(d, 3)
    with pytest.raises(ck.CheckpointError, match="saved by 1 rank.*rank 1"):
        ck.load_checkpoint(d, rank=1, load_optimizer=True)
    (path / "meta.json").unlink()
    with pytest.raises(ck.CheckpointError, match="incomplete checkpoint"):
        ck.load_checkpoint(d)


def test_weights_only_refuses_code(tmp_path):
    d = tmp_path / "ck"
    path = _save(d, 1)
    torch.save({"w": torch.zeros(1), "evil": print}, path / "model.pt")  # a pickled global
    with pytest.raises(ck.CheckpointError, match="differs from the one saved"):
        ck.load_checkpoint(d)
    (path / "sums_rank0.json").unlink()   # a checkpoint from before the sums: weights_only still refuses it
    with pytest.raises(ck.CheckpointError, match="cannot read"):
        ck.load_checkpoint(d)


def test_a_file_damaged_on_disk_is_refused_not_loaded(tmp_path):
    """torch.load reads a model.pt with a few zeroed bytes as slightly different weights; the sums
    written at save time refuse it (and name the other steps), for every file a resume loads."""
    d = tmp_path / "ck"
    _save(d, 2)
    path = _save(d, 4)
    sums = json.loads((path / "sums_rank0.json").read_text())
    assert set(sums) == {"model.pt", "optim_rank0.pt", "state_rank0.pt"}
    assert sums["model.pt"]["bytes"] == (path / "model.pt").stat().st_size
    assert torch.equal(ck.load_checkpoint(d, load_optimizer=True)["model"]["w"], _model_state(0)["w"])
    for name in ("model.pt", "optim_rank0.pt", "state_rank0.pt"):
        good = (path / name).read_bytes()
        damaged = bytearray(good)
        damaged[len(good) // 2] ^= 0x01
        (path / name).write_bytes(bytes(damaged))
        with pytest.raises(ck.CheckpointError, match=f"{name}: the file differs.*another step \\(\\[2\\]\\)"):
            ck.load_checkpoint(d, load_optimizer=True)
        (path / name).write_bytes(good[:-10])   # truncated: the size differs
        with pytest.raises(ck.CheckpointError, match="differs from the one saved"):
            ck.load_checkpoint(d, load_optimizer=True)
        (path / name).write_bytes(good)
    ck.load_checkpoint(d, load_optimizer=True)


def test_sums_are_hashed_alongside_the_io(tmp_path):
    """The sums, hashed on a helper thread from the temp file during its fsync, equal a re-read of
    each final file (an empty file included); a damaged file is refused even though torch.load,
    running next to the hash, reads it without complaint."""
    d = tmp_path / "ck"
    big = {"w": torch.randn(3, 1 << 19), "b": torch.randn(7), "i": torch.arange(5)}   # 6 MB + tiny records
    path = ck.save_checkpoint(d, 3, model_state=big, optimizer_state={"m": torch.randn(1 << 18)},
                              loop_state={"step": 3}, meta={})
    sums = json.loads((path / "sums_rank0.json").read_text())
    for name, want in sums.items():
        assert want == {"bytes": (path / name).stat().st_size, "sha256": cio.sha256_file(path / name)}, name
    out = ck.load_checkpoint(d, load_optimizer=True)
    assert all(torch.equal(out["model"][k], v) for k, v in big.items())
    (tmp_path / "empty").write_bytes(b"")
    assert cio.sha256_file(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()
    assert cio.sha256_file(path / "model.pt") == hashlib.sha256((path / "model.pt").read_bytes()).hexdigest()
    raw = bytearray((path / "model.pt").read_bytes())
    raw[len(raw) // 3] ^= 0x80        # inside w's data: torch.load itself reads it as a changed weight
    (path / "model.pt").write_bytes(bytes(raw))
    assert not torch.equal(torch.load(path / "model.pt", weights_only=True)["w"], big["w"])
    with pytest.raises(ck.CheckpointError, match="model.pt: the file differs"):
        ck.load_checkpoint(d)


def test_missing_loop_state_and_bad_meta_are_checkpoint_errors(tmp_path):
    d = tmp_path / "ck"
    path = _save(d, 3)
    (path / "state_rank0.pt").unlink()
    assert ck.load_checkpoint(d)["loop"] is None          # weights alone still load (chat, eval)
    with pytest.raises(ck.CheckpointError, match="incomplete checkpoint \\(state_rank0.pt missing\\)"):
        ck.load_checkpoint(d, load_optimizer=True)       # a resume needs the step, meter and RNG
    (path / "meta.json").write_text("[]")
    with pytest.raises(ck.CheckpointError, match="corrupt metadata \\(a JSON list"):
        ck.load_checkpoint(d)


def test_model_from_meta_names_what_does_not_fit(tmp_path):
    from nanochat.gpt import config_for_depth
    from dataclasses import asdict
    config = asdict(config_for_depth(2, 128, 32, aspect_ratio=32, head_dim=32))
    state = ck.build_model(config_for_depth(2, 128, 32, aspect_ratio=32, head_dim=32), "cpu").state_dict()
    model = ck.model_from_meta({"model_config": config}, state, tmp_path, "cpu")
    assert torch.equal(model.state_dict()["lm_head.weight"], state["lm_head.weight"])
    with pytest.raises(ck.CheckpointError, match="model_config does not fit this code.*n_experts"):
        ck.model_from_meta({"model_config": {**config, "n_experts": 8}}, state, tmp_path, "cpu")
    with pytest.raises(ck.CheckpointError, match="model.pt does not match meta.json's model_config"):
        ck.model_from_meta({"model_config": {**config, "n_layer": 3}}, state, tmp_path, "cpu")
    with pytest.raises(ck.CheckpointError, match="no model_config"):
        ck.model_from_meta({}, state, tmp_path, "cpu")


def test_compile_prefix_stripped(tmp_path):
    d = tmp_path / "ck"
    ck.save_checkpoint(d, 0, model_state={"_orig_mod.w": torch.ones(1)}, meta={})
    assert list(ck.load_checkpoint(d)["model"]) == ["w"]


def test_find_model_tag(tmp_path):
    for tag in ("d4", "d12", "custom"):
        (ck.checkpoint_dir("base", tag, tmp_path)).mkdir(parents=True)
    assert ck.find_model_tag("base", tmp_path) == "d12"
    with pytest.raises(ck.CheckpointError, match="no mid checkpoints"):
        ck.find_model_tag("mid", tmp_path)


def _ddp_worker(rank: int, world: int, port: int, ckpt_dir: str, results):
    """One torchrun-like rank: 2 MuonAdamW steps on a tiny GPT, then a collective save + load."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from nanochat.common import destroy_runtime, init_runtime
    from nanochat.gpt import config_for_depth
    from nanochat.optim import build_optimizer
    from nanochat.training import Schedule, Trainer, plan_batch
    rt = init_runtime("cpu", seed=0)
    try:
        model = ck.build_model(config_for_depth(1, 64, 16, aspect_ratio=32, head_dim=32), "cpu")
        opt = build_optimizer(model, world_size=world, rank=rank)
        g = torch.Generator().manual_seed(100 + rank)     # each rank sees different data
        batches = iter([(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))
                        for _ in range(6)])
        trainer = Trainer(model, opt, batches, plan_batch(2 * 16 * world * 2, 2, 16, world), Schedule(4), rt)
        losses = [trainer.step(s).loss for s in range(2)]
        path = ck.save_checkpoint(ckpt_dir, 2, model_state=model.state_dict(), optimizer_state=opt.state_dict(),
                                  loader_state={"rank": rank}, loop_state={"step": 2}, meta={}, rank=rank)
        back = ck.load_checkpoint(ckpt_dir, rank=rank, load_optimizer=True)
        same_opt = all(torch.equal(a, b) for pa, pb in zip(opt.state_dict()["state"].values(),
                                                           back["optimizer"]["state"].values())
                       for a, b in zip(pa.values(), pb.values()) if torch.is_tensor(a))
        results[rank] = (losses, str(path), back["loader"], same_opt, back["meta"]["world_size"])
    finally:
        destroy_runtime(rt)


def test_two_rank_save_and_load(tmp_path):
    """torchrun-style 2-process gloo run: every rank writes its optimizer/loader state, losses are
    averaged over ranks, and each rank reads back its own files."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path / "ck"), results), nprocs=2, join=True)
    (l0, p0, loader0, same0, ws0), (l1, p1, loader1, same1, ws1) = results[0], results[1]
    assert l0 == l1 and all(math.isfinite(x) for x in l0)      # the logged loss is the all-rank mean
    assert p0 == p1 and ws0 == ws1 == 2 and same0 and same1
    assert loader0 == {"rank": 0} and loader1 == {"rank": 1}
    files = sorted(p.name for p in (tmp_path / "ck" / "step_000002").iterdir())
    assert files == ["meta.json", "model.pt", "optim_rank0.pt", "optim_rank1.pt", "state_rank0.pt", "state_rank1.pt",
                     "sums_rank0.json", "sums_rank1.json"]
    sums1 = json.loads((tmp_path / "ck" / "step_000002" / "sums_rank1.json").read_text())
    assert set(sums1) == {"optim_rank1.pt", "state_rank1.pt"}   # each rank sums what it wrote


def test_bench_checkpoint_cpu_smoke(tmp_path, capsys):
    """scripts/bench_checkpoint times plain torch.save/load against save/load_checkpoint of the same
    state (the sums' cost), prints a JSON row per kind and cleans up after itself."""
    from scripts import bench_checkpoint

    rows = bench_checkpoint.main(["--device", "cpu", "--depth", "1", "--vocab-size", "256", "--reps", "2",
                                  "--dir", str(tmp_path)])
    assert [r["kind"] for r in rows] == ["plain", "checkpoint"]
    assert all(r["save_s"] > 0 and r["load_s"] > 0 and r["gb"] > 0 and r["reps"] == 2 for r in rows)
    assert rows[1]["gb"] >= rows[0]["gb"]          # the same tensors plus the loop state
    out = capsys.readouterr().out
    assert out.count('"bench": "checkpoint"') == 2 and "the sums cost" in out
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_bytes_predicts_a_real_save(tmp_path):
    """checkpoint_bytes (meta-device arithmetic: the state dict + Muon's momentum + AdamW's two
    moments) matches what save_checkpoint writes after an optimizer step, to within the zip's
    per-record overhead; tensor_bytes counts a shared storage once."""
    from nanochat.gpt import GPT, config_for_depth
    from nanochat.optim import build_optimizer

    config = config_for_depth(2, 256, 32, aspect_ratio=32, head_dim=32)
    model = GPT(config)
    model.init_weights()
    optimizer = build_optimizer(model, compile=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    path = ck.save_checkpoint(tmp_path / "ck", 1, model_state=model.state_dict(),
                              optimizer_state=optimizer.state_dict(), meta={})
    written = sum((path / n).stat().st_size for n in ("model.pt", "optim_rank0.pt"))
    with torch.device("meta"):
        predicted = ck.checkpoint_bytes(GPT(config))
    assert predicted <= written <= predicted * 1.02 + 200_000, (predicted, written)
    assert predicted == ck.tensor_bytes(model.state_dict()) + ck.tensor_bytes(optimizer.state_dict()["state"]) \
        - sum(s["step"].nbytes for s in optimizer.state_dict()["state"].values() if "step" in s)  # AdamW's counters
    t = torch.zeros(10)
    assert ck.tensor_bytes({"a": t, "b": [t[2:], (t,)], "c": 3}) == 40


@pytest.mark.parametrize("start, n, every", [(0, 10, 3), (0, 9, 3), (4, 10, 3), (0, 5, -1), (6, 10, 3), (9, 10, 3),
                                             (0, 1, 1), (3, 12, 4)])
def test_planned_saves_counts_what_the_loop_saves(start, n, every):
    """The loop saves at step % save_every == 0 after the start step, and at the end (once)."""
    saved = {s for s in range(start, n + 1) if (every > 0 and s % every == 0 and s != start) or s == n}
    assert ck.planned_saves(start, n, every) == len(saved)


def test_disk_plan_refuses_a_run_whose_checkpoint_cannot_fit(tmp_path, monkeypatch):
    gb = 10**9
    monkeypatch.setattr(ck, "free_bytes", lambda path: 20 * gb)
    plan = ck.disk_plan(tmp_path / "not" / "yet", 9 * gb, 2)
    assert plan == "~9.0 GB each, 2 save(s) planned (~18.0 GB), 20.0 GB free"
    text = ck.disk_plan(tmp_path, 9 * gb, 5)
    assert "room for 2: a save that does not fit stops the run" in text and "--save-every" in text
    with pytest.raises(ck.CheckpointError, match=r"20.0 GB free on its disk, but one checkpoint .* needs ~25.6 GB"):
        ck.disk_plan(tmp_path, 25 * gb, 1)
    monkeypatch.undo()   # the real one: a path not created yet is measured at its nearest parent
    assert abs(ck.free_bytes(tmp_path / "a" / "b") - ck.shutil.disk_usage(tmp_path).free) < gb


def test_a_save_without_room_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """No room before writing (the free-space check) or the disk filling mid-write (ENOSPC): one
    CheckpointError naming the step kept; no staging directory is left, latest still points at it."""
    import errno

    d = tmp_path / "ck"
    _save(d, 2)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    with pytest.raises(ck.CheckpointError, match=r"step 4 not written .* no room on its disk .* the checkpoint of "
                                                 r"step 2 is intact, free space and resume with --resume"):
        _save(d, 4)
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000002"]
    monkeypatch.undo()
    real_save = torch.save

    def disk_fills(obj, f):
        real_save(obj, f)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", disk_fills)
    with pytest.raises(ck.CheckpointError, match=r"step 4 not written .*No space left on device; .* GB free now"):
        _save(d, 4)
    assert sorted(p.name for p in d.iterdir()) == ["latest.json", "step_000002"]
    assert ck.load_checkpoint(d)["step"] == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_hash_pool_works_in_a_forked_child(tmp_path):
    """A process forked after a checkpoint was hashed (its copy of the executor has no threads)
    still saves and loads: the child makes its own helper threads instead of waiting forever."""
    import warnings

    _save(tmp_path / "parent", 1)                       # the parent's helper threads exist now
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # fork() of a multi-threaded process
        pid = os.fork()
    if pid == 0:
        try:
            _save(tmp_path / "child", 2)
            ok = ck.load_checkpoint(tmp_path / "child", load_optimizer=True)["step"] == 2
            os._exit(0 if ok else 1)
        except BaseException:
            os._exit(2)
    for _ in range(300):                                  # 30 s, then the child is a hang
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's save/load hung")
    assert os.waitstatus_to_exitcode(status) == 0


def test_build_model_for_inference_imports_neither_dynamo_nor_sympy():
    """Built on the meta device and materialised, an inference model pulls in neither torch._dynamo
    (nn.init.normal_ of a meta embedding table did: ~4 s) nor sympy (empty_like of a meta tensor:
    ~1.7 s), seconds of every chat_cli / chat_web / chat_eval start-up. Its tables are initialised."""
    import subprocess
    import sys
    probe = ("import sys\nfrom nanochat.checkpoint import build_model\nfrom nanochat.gpt import config_for_depth\n"
             "m = build_model(config_for_depth(2, 128, 32, aspect_ratio=32, head_dim=32), 'cpu', for_training=False)\n"
             "print(sorted(k for k in ('torch._dynamo', 'sympy') if k in sys.modules), "
             "round(m.wte.weight.std().item(), 1), m.wte.weight.requires_grad)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "[] 1.0 True", (proc.stdout, proc.stderr[-2000:])


def test_a_fresh_run_over_an_earlier_one_refuses_or_moves_it_aside(tmp_path, capsys):
    """fresh_start: no flag -> refused (naming the ways on); --overwrite or --resume auto (which chose
    a fresh start) -> moved to earlier_runs/<N>/ with its latest.json at the first save, a new number
    each time, and kept. Before settle() nothing is touched (a run that fails early loses nothing)."""
    d = tmp_path / "ck"
    assert ck.fresh_start(d, None, False) is None   # nothing there yet
    for step in (2, 4):
        _save(d, step)
    with pytest.raises(ck.CheckpointError, match=r"steps \[2, 4\]\); .* --resume latest \(or auto\) .* --overwrite"):
        ck.fresh_start(d, None, False)
    aside = ck.fresh_start(d, "auto", False)
    assert ck.list_steps(d) == [2, 4] and "moved to" in aside.describe()
    assert aside.settle() == d / "earlier_runs" / "1" and aside.settle() is None   # once
    assert ck.list_steps(d) == [] and not (d / "latest.json").exists()
    assert ck.list_steps(d / "earlier_runs" / "1") == [2, 4] and ck.read_latest(d / "earlier_runs" / "1") == 4
    ck.load_checkpoint(d / "earlier_runs" / "1", "latest")   # still whole and verifiable where it went
    _save(d, 3)
    assert ck.fresh_start(d, "auto", False).settle() == d / "earlier_runs" / "2"
    _save(d, 5)
    kept = ck.fresh_start(d, "auto", True)   # --overwrite: moved aside and kept too (it deleted them)
    assert kept.describe().startswith(
        f"--overwrite: the earlier run's checkpoints (steps [5], ") and kept.describe().endswith(
        f") in {d} are moved to {d / 'earlier_runs' / '3'} at this run's first save and kept there (delete that "
        "folder once you no longer need them)")
    assert kept.settle() == d / "earlier_runs" / "3" and ck.list_steps(d) == [] and not (d / "latest.json").exists()
    assert f"--overwrite: moved the earlier run's checkpoints (steps [5]) to {d / 'earlier_runs' / '3'}" in \
        capsys.readouterr().out
    assert ck.read_latest(d / "earlier_runs" / "3") == 5
    assert sorted(p.name for p in (d / "earlier_runs").iterdir()) == ["1", "2", "3"]


@pytest.mark.parametrize("resume", ["latest", "7"])
def test_overwrite_is_refused_with_a_resume_of_every_training_recipe(resume):
    from nanochat.chat_flags import parse_config as chat_parse
    from nanochat.chat_train import MID, SFT
    from scripts.chat_rl import parse_config as rl_parse

    for parse in (lambda a: chat_parse(MID, a), lambda a: chat_parse(SFT, a), rl_parse):
        assert parse(["--overwrite"]).overwrite and not parse([]).overwrite
        assert parse(["--overwrite", "--resume", "auto"]).overwrite
        with pytest.raises(ValueError, match=f"^--overwrite cannot be combined with --resume {resume}: --overwrite "
                                             "starts a fresh run .*earlier_runs/<N>/"):
            parse(["--overwrite", "--resume", resume])


def test_a_model_config_that_fails_validation_is_a_checkpoint_error_naming_the_step(tmp_path):
    """config_from_meta (the chat stages' plan and model_from_meta): GPTConfig.validate's bare
    ValueError named no checkpoint, and --resume auto, which starts afresh on a CheckpointError,
    crashed on it instead."""
    meta = {"model_config": {"sequence_len": 64, "vocab_size": 97, "n_layer": 2.5, "n_head": 2, "n_kv_head": 2,
                             "n_embd": 32}}
    with pytest.raises(ck.CheckpointError, match=r"^.*step_000010: meta.json's model_config: GPTConfig.n_layer"):
        ck.config_from_meta(meta, tmp_path / "step_000010")
