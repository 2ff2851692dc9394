"""Checkpoints: atomic save, load, exact resume, phase tags and metadata.

Layout (one directory per phase and model tag):

    <base_dir>/checkpoints/<phase>/<model_tag>/
        latest.json                 {"step": N, "dir": "step_00000N"}  (written last, atomically)
        step_00000N/
            meta.json               schema version, step, configs, git sha, versions, device,
                                    tokenizer fingerprint, world size
            model.pt                model state_dict (rank 0; every rank holds the full model)
            optim_rank<R>.pt        optimizer state of rank R (sharded optimizers differ by rank)
            state_rank<R>.pt        {"loader": dataloader state, "loop": loop state incl. RNG}
            sums_rank<R>.json       size and sha256 of each file rank R wrote (model.pt: rank 0)

A step is written into `step_00000N.partial/` by every rank and renamed to `step_00000N/` by rank 0
once all ranks are done, so a step directory is either complete or absent; `latest.json` then
moves to it. A part that fails on one rank (no room for its optimizer shard) fails the save on
every rank, each told which rank failed and why (never a rank left waiting at a barrier). A crash
at any point leaves the previous checkpoint and pointer intact. Every individual file is also
written temp + fsync + os.replace. Multi-node runs need a shared filesystem for the checkpoint
directory. Files are read with torch.load(weights_only=True) and
their size and sha256 checked against the sums written with them (hashed on helper threads while
the IO runs: during a save's fsync, during a load's torch.load): a file changed or
damaged on disk since (a bad block, a partial copy) is refused with its path, never loaded as
slightly wrong weights (torch.load does not notice most flipped bytes). Checkpoints from before
the sums load unchecked (one whose sums file is lost, meta.json's "checksummed", with a warning).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch

from nanochat.common import fmt_bytes, get_base_dir, print0
# CheckpointError, list_steps, step_dirname, read_latest, model_digest and the names below are part of this
# module's interface too (they live in checkpoint_io.py, which imports no torch: nanochat/resume_point.py)
from nanochat.checkpoint_io import (LATEST_NAME, META_NAME, MODEL_NAME, PHASES, CheckpointError, check_meta,
                                    cut_short_saves, dir_identity, fsync_dir, leftover_bytes, list_steps, load_verified,
                                    make_dirs, read_latest, restore_or_wait, save_hashed, start_check, step_dirname,
                                    sweep_superseded, write_json, _NO_ROOM, _model_tags, _other_tags, _state_device,
                                    _strip_compile_prefix, _use_another_step, _write_error)
from nanochat.checkpoint_io import _has_checkpoint, model_digest, saved_sum  # noqa: F401 (re-exported)
# sizes: re-exported for the recipes' disk plans
from nanochat.checkpoint_io import checkpoint_bytes, planned_saves, tensor_bytes  # noqa: F401
# EarlierRun, fresh_start and the --resume / --overwrite flags' checks live in checkpoint_runs.py; the
# recipes import them from here
from nanochat.checkpoint_runs import (EARLIER_RUNS, RESUME_HELP, EarlierRun, branch_start,  # noqa: F401
                                      check_resume_flags, fresh_start, kept_runs_note, resolve_resume, valid_resume,
                                      _is_step_number)
from nanochat.distributed import rank_failures
from nanochat.errors import RequestError
from nanochat.report_env import environment_meta, git_sha  # noqa: F401 (re-exported: checkpoint metadata)
from nanochat.flags import check_model_tag

SCHEMA_VERSION = 1


# ------------------------------------------------------------------------------------ paths

def checkpoint_dir(phase: str, model_tag: str, base_dir: str | Path | None = None) -> Path:
    """<base_dir>/checkpoints/<phase>/<model_tag> (not created)."""
    if phase not in PHASES:
        raise ValueError(f"phase: got {phase!r}; accepted: {'|'.join(PHASES)}")
    check_model_tag(model_tag or "")
    base = Path(base_dir) if base_dir is not None else get_base_dir()
    return base / "checkpoints" / phase / model_tag


def resolve_step(ckpt_dir: str | Path, step: int | str) -> int:
    """'latest' -> the recorded step; an int or digit string -> that step."""
    if step == "latest":
        return read_latest(ckpt_dir)
    if isinstance(step, str) and _is_step_number(step):
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: got {step!r}; accepted: 'latest' or an integer >= 0")
    return step


def remove_checkpoint(ckpt_dir, step: int) -> None:
    """Delete one step's directory (renamed away first, so it vanishes at once). Never the step
    latest.json points to: that is the one a resume takes. The name it is renamed to, step_N.del-PID,
    is not a re-save's step_N.old-PID: a removal killed halfway through its rmtree leaves a partial
    directory that a later read of step N must not restore (restore_swapped_out); leftovers of
    such removals are swept here."""
    ckpt_dir = Path(ckpt_dir)
    assert step != read_latest(ckpt_dir), f"refusing to remove the latest checkpoint {step} of {ckpt_dir}"
    path = ckpt_dir / step_dirname(step)
    trash = ckpt_dir / (step_dirname(step) + f".del-{os.getpid()}")
    sweep_superseded(ckpt_dir, step)   # else a read of step N would restore one of them
    # first: a removal of step N killed in a process of this pid (a container's are alike from run to run)
    # left this very name, and os.replace onto it failed (ENOTEMPTY) at every later removal of step N
    _sweep_removals(ckpt_dir)
    os.replace(path, trash)
    fsync_dir(ckpt_dir)
    shutil.rmtree(trash, ignore_errors=True)


def _sweep_removals(ckpt_dir: Path) -> None:
    for leftover in ckpt_dir.glob("step_*.del-*"):
        shutil.rmtree(leftover, ignore_errors=True)


# ------------------------------------------------------------------------------------ disk space

def _needed(n: int) -> int:
    """Disk a checkpoint of that many tensor bytes needs: 2% + 64 MiB more (pickles, zip records)."""
    return int(n * 1.02) + (64 << 20)


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem that holds `path` (or would: its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def disk_plan(ckpt_dir, bytes_each: int, saves: int, keep_last: int = 0, earlier: EarlierRun | None = None) -> str:
    """The banner's checkpoint line: size, planned saves, free space. Raises CheckpointError before
    training when not even one checkpoint fits, so a run never trains for hours towards a save that
    cannot be written; when only some fit, says how many (a save that does not fit stops the run).
    With keep_last > 0 at most keep_last + 1 of them are on disk at once (a save, then the pruning).
    Where it is short of room, it names the earlier runs kept in the directory's earlier_runs/ (never
    deleted by a run), and `earlier`, the checkpoints this run moves there at its first save (fresh_start,
    branch_start): they stay on the disk, so an --overwrite frees nothing. Saves cut short (step_N.partial)
    count as room: the first save deletes them before it writes."""
    need = _needed(bytes_each)
    cut = leftover_bytes(ckpt_dir)   # saves cut short (a kill mid-save): the first save deletes them first
    free = free_bytes(ckpt_dir) + cut
    staying = earlier.room_note() if earlier is not None else ""
    if free < need:
        raise CheckpointError(f"{ckpt_dir}: {fmt_bytes(free)} free on its disk, but one checkpoint of this run needs "
                              f"~{fmt_bytes(need)}; free space{kept_runs_note(ckpt_dir)}, or set NANOCHAT_BASE_DIR to a "
                              f"disk with room{staying}")
    at_once = saves if keep_last <= 0 else min(saves, keep_last + 1)
    text = f"~{fmt_bytes(bytes_each)} each, {saves} save(s) planned"
    text += f", at most {at_once} on disk at once (--keep-last {keep_last})" if at_once < saves else ""
    text += f" (~{fmt_bytes(bytes_each * at_once)}), {fmt_bytes(free)} free"
    text += f" (with {fmt_bytes(cut)} of saves cut short, deleted at the first save)" if cut else ""
    if free // need < at_once:
        room = free // need   # --keep-last K holds K + 1 at once (a save, then the pruning)
        keep = f"{'lower' if keep_last > 0 else 'set'} --keep-last to {room - 1}, " if room >= 2 else ""
        text += (f"; room for {room}: a save that does not fit stops the run, keeping the last one "
                 f"(raise --save-every, {keep}or free space{kept_runs_note(ckpt_dir)}){staying}")
    return text


def _check_space(staging: Path, states: list, rank: int, step: int) -> None:
    need = _needed(sum(tensor_bytes(s) for s in states))
    free = free_bytes(staging)
    if free < need:
        raise CheckpointError(_no_room(staging, step, f"rank {rank} needs ~{fmt_bytes(need)}, {fmt_bytes(free)} free"))


def _no_room(staging: Path, step: int, detail: str, why: str = "no room on its disk",
             remedy: str = "free space") -> str:
    """The refusal, naming the step a --resume latest takes (latest.json's: after a --resume STEP
    of an older step, the newest on disk can be another branch's; a failed re-save of step N
    leaves the earlier copy of N in place). None on disk (a fresh run's first save): rerun."""
    on_disk = list_steps(staging.parent)
    try:
        latest = read_latest(staging.parent)
    except CheckpointError:
        latest = ([s for s in on_disk if s != step] or [None])[-1]
    head = f"checkpoint of step {step} not written to {staging.parent}: {why} ({detail}); "
    if not on_disk:   # "resume with --resume" had nothing to resume
        return f"{head}there is no checkpoint there to resume: {remedy} and rerun"
    return (f"{head}{'the checkpoint of step ' + str(latest) + ' is intact, ' if latest in on_disk else ''}"
            f"{remedy} and resume with --resume")


# ------------------------------------------------------------------------------------ save

def save_checkpoint(ckpt_dir, step: int, *, model_state: dict, optimizer_state: dict | None = None,
                    loader_state: dict | None = None, loop_state: dict | None = None, meta: dict,
                    rank: int = 0) -> Path:
    """Write one checkpoint (collective under torch.distributed: every rank must call it).

    Rank 0 writes the model and meta; every rank writes its optimizer and loader/loop state.
    Returns the final step directory. Updates latest.json after the step directory is complete.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: got {step!r}; accepted: an integer >= 0")
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_dirname(step)
    staging = ckpt_dir / (step_dirname(step) + ".partial")
    world_size = _world_size()
    with _on_every_rank(staging, step, rank):   # rank 0 sets up; the others learn whether it could
        if rank == 0:
            make_dirs(ckpt_dir)
            # leftovers of saves cut short (a second Ctrl-C, a SIGKILL, a crash), of this step or any other:
            # no resume reads them, and at d20 each can hold ~9 GB the disk plan never counted
            for leftover in ckpt_dir.glob("step_*.partial"):
                shutil.rmtree(leftover, ignore_errors=True)
            sweep_superseded(ckpt_dir)
            _sweep_removals(ckpt_dir)   # --keep-last's, killed mid-rmtree (a run without it never swept them)
            staging.mkdir()
    with _on_every_rank(staging, step, rank):
        _write_rank_files(staging, step, rank, model_state if rank == 0 else None, optimizer_state,
                          loader_state, loop_state)
    with _on_every_rank(staging, step, rank):   # only once every rank's files are in: latest.json
        if rank == 0:
            _finish(ckpt_dir, staging, final, step, _full_meta(model_state, optimizer_state, meta, step, world_size))
    return final


def _full_meta(model_state, optimizer_state, meta: dict, step: int, world_size: int) -> dict:
    # the weights' device: a meta that names none (chat_rl's) recorded None
    return {**environment_meta(_state_device(model_state)), **meta, "schema_version": SCHEMA_VERSION,
            "step": step, "world_size": world_size, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "has_optimizer": optimizer_state is not None, "checksummed": True}   # every file has its sums


def _finish(ckpt_dir: Path, staging: Path, final: Path, step: int, full_meta: dict) -> None:
    """Rank 0, every rank's files in staging: meta.json, staging -> final, latest.json -> final."""
    write_json(staging / META_NAME, full_meta)   # the tensors fitted, the disk may have filled since
    fsync_dir(staging)
    if final.exists():  # re-saving a step: move the old copy aside, swap, then delete it
        trash = ckpt_dir / (step_dirname(step) + f".old-{os.getpid()}")
        os.replace(final, trash)
        os.replace(staging, final)
        # the swap on disk before the old copy goes: deleted first, a directory fsync that failed (EIO:
        # the renames may not be on disk) left neither copy certain, and the error said step N intact
        fsync_dir(ckpt_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, final)
    fsync_dir(ckpt_dir)
    _point_latest(ckpt_dir, final, step)


@contextlib.contextmanager
def _on_every_rank(staging: Path, step: int, rank: int):
    """One part of a save, then (collective) whether it went well on every rank. A rank that failed
    (no room for its optimizer shard, a disk refusing its writes) raised alone, and the others hung at
    the save's next barrier; now the failing rank raises its own error and every other rank a
    CheckpointError naming it and what went wrong. The staging directory is removed (by rank 0, once
    no rank writes into it any more), so latest.json never names the step."""
    error = None
    try:
        with _unwritable_is_a_checkpoint_error(staging, step):
            yield
    except Exception as e:   # a bug too (a tensor torch.save refuses): the other ranks must not wait for it
        error = e
    own = None if error is None else str(error) if isinstance(error, CheckpointError) else \
        f"{type(error).__name__}: {error} (saving the checkpoint of step {step} into {staging})"
    failed = rank_failures(own)
    if failed and rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
    if error is not None:
        raise error
    if failed:
        said = "; ".join(f"rank {r}: {m}" for r, m in failed.items())
        raise CheckpointError(f"checkpoint save of step {step} failed on rank(s) {', '.join(map(str, failed))} of "
                              f"{_world_size()}, so every rank stops: {said}")


def _point_latest(ckpt_dir: Path, final: Path, step: int) -> None:
    """latest.json -> `final` (complete by now). The disk filling (or refusing writes) here left a
    traceback while latest.json still named an older step, which --resume latest|auto then took
    (no latest.json at all: auto started afresh and moved this run aside): one CheckpointError
    naming the step to pass to --resume instead."""
    for stale in ckpt_dir.glob(f".{LATEST_NAME}.tmp-*"):   # left by a process killed mid-write
        stale.unlink(missing_ok=True)
    try:
        write_json(ckpt_dir / LATEST_NAME, {"step": step, "dir": final.name})
    except OSError as e:
        if _write_error(e) is None:
            raise
        try:
            pointed = f"still names step {read_latest(ckpt_dir)}"
        except CheckpointError:
            pointed = "is missing"
        raise CheckpointError(f"checkpoint of step {step} saved to {final}, but {ckpt_dir / LATEST_NAME} could not "
                              f"be updated ({e.strerror}) and {pointed}: free space (or make the disk writable) and "
                              f"continue with --resume {step}, not latest or auto") from e


@contextlib.contextmanager
def _unwritable_is_a_checkpoint_error(staging: Path, step: int):
    """A save refused for room, the disk filling mid-write, or a disk that refuses writes (remounted
    read-only after errors, permissions changed): one CheckpointError naming the step kept and what
    to do (_on_every_rank removes the staging directory, once no rank writes into it)."""
    try:
        yield
    except (OSError, RuntimeError) as e:
        cause = _write_error(e)
        if cause is None:
            raise
        if cause.errno in _NO_ROOM:
            detail = f"{cause.strerror}; {fmt_bytes(free_bytes(staging.parent))} free now"
            raise CheckpointError(_no_room(staging, step, detail)) from e
        detail = f"{cause.strerror}: {cause.filename or staging}"
        raise CheckpointError(_no_room(staging, step, detail, why="its disk refused the write", remedy="make it "
                                       "writable (a disk remounted read-only after errors: see `dmesg`)")) from e


def _write_rank_files(staging: Path, step: int, rank: int, model_state, optimizer_state, loader_state,
                      loop_state) -> None:
    """This rank's files (model.pt: rank 0) and sums_rank<R>.json, after a free-space check."""
    states = [s for s in (model_state, optimizer_state, loader_state, loop_state) if s is not None]
    _check_space(staging, states, rank, step)
    sums = {}   # size and sha256 of each file this rank wrote, hashed alongside the IO
    if model_state is not None:
        sums[MODEL_NAME] = save_hashed(staging / MODEL_NAME, _strip_compile_prefix(model_state))
    if optimizer_state is not None:
        sums[f"optim_rank{rank}.pt"] = save_hashed(staging / f"optim_rank{rank}.pt", optimizer_state)
    if loader_state is not None or loop_state is not None:
        sums[f"state_rank{rank}.pt"] = save_hashed(staging / f"state_rank{rank}.pt",
                                                   {"loader": loader_state, "loop": loop_state})
    if sums:
        write_json(staging / f"sums_rank{rank}.json", {name: f.result() for name, f in sums.items()})


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# ------------------------------------------------------------------------------------ load

def read_meta(ckpt_dir, step: int | str = "latest") -> dict:
    """meta.json of a step, schema-checked."""
    ckpt_dir = Path(ckpt_dir)
    step = resolve_step(ckpt_dir, step)
    step_dir = ckpt_dir / step_dirname(step)
    path = step_dir / META_NAME
    if not step_dir.is_dir():
        restore_or_wait(ckpt_dir, step, META_NAME)
    if not path.is_file():
        if not step_dir.is_dir():
            have = list_steps(ckpt_dir)
            raise CheckpointError(f"no checkpoint for step {step} in {ckpt_dir}; steps on disk: {have or 'none'}"
                                  f"{_other_tags(ckpt_dir)}")
        raise CheckpointError(f"{step_dir}: incomplete checkpoint ({META_NAME} missing); {_use_another_step(path)}")
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path}: corrupt metadata ({e}); {_use_another_step(path)}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: corrupt metadata (a JSON {type(meta).__name__}, not an object); "
                              f"{_use_another_step(path)}")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise CheckpointError(f"{path}: checkpoint schema version {version!r} is not supported by this code "
                              f"(it reads version {SCHEMA_VERSION}); use the nanochat version that wrote it "
                              "or retrain")
    check_meta(meta, path, step)
    return meta


def load_checkpoint(ckpt_dir, step: int | str = "latest", *, device="cpu", rank: int = 0,
                    load_optimizer: bool = False) -> dict:
    """Read a checkpoint. Returns {"model", "optimizer", "loader", "loop", "meta", "step"};
    optimizer is None unless load_optimizer; loader/loop are None when they were not saved. A step
    removed or replaced while read (a run training there: --keep-last, a re-save) is read again
    ("latest": what latest.json names then); one removed for good is said (an eval during training
    met a bare FileNotFoundError, or "file missing ... use another step" as if it were damaged)."""
    ckpt_dir, attempt = Path(ckpt_dir), 0
    while True:
        at = resolve_step(ckpt_dir, step)
        step_dir = ckpt_dir / step_dirname(at)
        before = dir_identity(step_dir)
        try:
            out = _load_step(ckpt_dir, at, device, rank, load_optimizer)
            if before is None or dir_identity(step_dir) in (before, None) or attempt == _REREADS:
                return out   # read from one copy (removed after: still whole)
            attempt += 1   # swapped for a re-save meanwhile: meta.json of one copy, weights of the other
            continue
        except (CheckpointError, FileNotFoundError) as e:
            after = dir_identity(step_dir)
            raced = before is not None and after != before   # renamed away, or swapped for a re-save
            if before is None and step == "latest":   # gone before this read began: latest.json moved on?
                with contextlib.suppress(CheckpointError):
                    raced = read_latest(ckpt_dir) != at
            if not raced:   # never there, or damaged in place
                if isinstance(e, CheckpointError):
                    raise
                missing = Path(e.filename or step_dir)
                raise CheckpointError(f"{missing}: file missing from the checkpoint; "
                                      f"{_use_another_step(missing)}") from e
            if attempt < _REREADS and (step == "latest" or after is not None):
                attempt += 1
                continue
            raise CheckpointError(f"{step_dir} was removed while it was being read (by a run training into "
                                  f"{ckpt_dir}: --keep-last, or a move to {EARLIER_RUNS}/); steps on disk now: "
                                  f"{list_steps(ckpt_dir) or 'none'}") from e


_REREADS = 3   # a reader overtaken this often by saves (seconds apart at least) is told, not looped


def _load_step(ckpt_dir: Path, step: int, device, rank: int, load_optimizer: bool) -> dict:
    """load_checkpoint's read of one step (a training resume, load_optimizer: saves cut short said)."""
    meta = read_meta(ckpt_dir, step)
    if load_optimizer and (cut := cut_short_saves(ckpt_dir)):
        print0(f"checkpoint: {', '.join(step_dirname(n) + '.partial' for n in cut)} in {ckpt_dir}: a save cut short "
               f"(killed or crashed mid-save), not a checkpoint; this run resumes step {step} and deletes the "
               "leftover at its first save")
    step_dir = ckpt_dir / step_dirname(step)
    saved_world = meta["world_size"]   # read_meta checked it
    if rank >= saved_world and (load_optimizer or (step_dir / "state_rank0.pt").exists()):
        raise CheckpointError(f"{step_dir}: saved by {saved_world} rank(s) but loading as rank {rank}; "
                              f"resume with the same number of processes ({saved_world})")
    if load_optimizer and not meta.get("has_optimizer", False):
        raise CheckpointError(f"{step_dir}: no optimizer state was saved (cannot resume training from it)")
    model_path = step_dir / MODEL_NAME
    optim_path, state_path = step_dir / f"optim_rank{rank}.pt", step_dir / f"state_rank{rank}.pt"
    # every file's hash starts now (model.pt's sum is rank 0's), so the optimizer's runs while the model loads
    summed = meta.get("checksummed") is True   # then a sums file gone is said, not taken for "before the sums"
    checks = {model_path: start_check(model_path, 0, summed), state_path: start_check(state_path, rank, summed)}
    if load_optimizer:
        checks[optim_path] = start_check(optim_path, rank, summed)
    model = load_verified(model_path, device, check=checks[model_path])
    out = {"step": step, "meta": meta, "model": _strip_compile_prefix(model) if isinstance(model, dict) else model,
           "optimizer": None, "loader": None, "loop": None}
    if load_optimizer:
        out["optimizer"] = load_verified(optim_path, device, rank, check=checks[optim_path])
    if state_path.exists():
        state = load_verified(state_path, "cpu", rank, check=checks[state_path])
        if not isinstance(state, dict):
            raise CheckpointError(f"{state_path}: corrupt loop state (not a dict)")
        out["loader"], out["loop"] = state.get("loader"), state.get("loop")
    elif load_optimizer:  # resuming needs the loop state (step, meter, RNG) as much as the optimizer
        raise CheckpointError(f"{step_dir}: incomplete checkpoint ({state_path.name} missing); resume another "
                              f"step ({[s for s in list_steps(ckpt_dir) if s != step] or 'none on disk'})")
    return out


def config_from_meta(meta: dict, step_dir):
    """The GPTConfig a meta.json records (torch-free: the chat stages plan rows and batch from it
    before any weights load); a missing or unfitting one is a CheckpointError naming the directory."""
    from nanochat.gpt_config import GPTConfig
    if not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{step_dir}: meta.json has no model_config; cannot rebuild the model")
    try:
        config = GPTConfig(**meta["model_config"])
    except TypeError as e:
        raise CheckpointError(f"{step_dir}: meta.json's model_config does not fit this code ({e})") from e
    try:
        config.validate()
    except ValueError as e:   # named by its checkpoint (and a CheckpointError: --resume auto starts afresh)
        raise CheckpointError(f"{step_dir}: meta.json's model_config: {e}") from e
    return config


def model_from_meta(meta: dict, state: dict, step_dir, device, **build_kwargs):
    """The GPT of a checkpoint's meta.json with its weights loaded; a config or weights that do not
    fit this code (an unknown field, a shape mismatch) is a CheckpointError naming the directory."""
    config = config_from_meta(meta, step_dir)
    if not isinstance(state, dict):   # load_state_dict's bare TypeError named no file
        raise CheckpointError(f"{step_dir}: model.pt holds a {type(state).__name__}, not a model state_dict; "
                              "it is not a nanochat checkpoint's model file")
    if any(isinstance(k, str) and k.endswith(".qweight") for k in state):
        # the missing-keys message listed c_q.weight... and never said why
        raise CheckpointError(f"{step_dir}: model.pt holds int8-quantised weights (nanochat/quantize.py), which "
                              "cannot be loaded back; load the float checkpoint and pass --quantize int8")
    model = build_model(config, device, **build_kwargs)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        first = str(e).strip().splitlines()
        raise CheckpointError(f"{step_dir}: model.pt does not match meta.json's model_config "
                              f"({' '.join(first[:2])[:300]})") from e
    return model


def build_model(config, device, *, attn_backend: str = "auto", compute_dtype: torch.dtype | None = None,
                for_training: bool = True):
    """GPT built on the meta device (shapes only), then materialised on `device` and initialised
    (fp32 master weights; activations in `compute_dtype`, default bf16 on CUDA / fp32 elsewhere).
    With device "meta" the shapes-only model is returned (for FLOPs / parameter counts).
    `for_training=False` (inference) skips probing backward-only attention kernels."""
    from nanochat.gpt import GPT
    with torch.device("meta"):
        model = GPT(config, attn_backend=attn_backend, compute_dtype=compute_dtype)
    if torch.device(device).type == "meta":
        return model
    # to_empty, but with empty instead of empty_like: empty_like of a meta tensor imports sympy, ~1.7 s
    # of every chat_cli / chat_web / chat_eval start-up (torch 2.15); the model's tensors are contiguous
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.init_weights()       # also rebuilds the non-persistent rotary tables left as garbage here
    model.prepare_attention(backward=for_training)  # masks built once, before torch.compile sees the model
    return model


_MAKES_PHASE = {"base": "base_train", "mid": "mid_train", "sft": "chat_sft", "rl": "chat_rl"}   # its recipe


class AmbiguousModelTag(CheckpointError):
    """Several model tags and no rule to pick one: the answer is --model-tag, not training one."""


def find_model_tag(phase: str, base_dir: str | Path | None = None) -> str:
    """The model tag to use when none is given: the only one, or the deepest `d<N>`
    (AmbiguousModelTag when several tags exist and none is a `d<N>`). Tags with a checkpoint
    count; the others only when none has one: a run that stopped before its first save leaves
    its directory behind (its .writer.lock, nanochat/writer_lock.py)."""
    root = checkpoint_dir(phase, "x", base_dir).parent
    tags = _model_tags(root)
    if not tags:
        how = f"python -m scripts.{_MAKES_PHASE.get(phase, 'base_train')}"   # setup.sh runs no RL stage
        raise CheckpointError(f"no {phase} checkpoints under {root}; train one first "
                              f"({how}{'' if phase == 'rl' else ', or ./setup.sh'})")
    if len(tags) == 1:
        return tags[0]
    depth_tags = [(int(t[1:]), t) for t in tags if re.fullmatch(r"d\d+", t)]
    if not depth_tags:
        raise AmbiguousModelTag(f"several {phase} model tags under {root}: {tags}; pass --model-tag")
    return max(depth_tags)[1]


def check_model_tag_exists(phase: str, model_tag: str | None, base_dir=None, flag: str = "-g/--model-tag") -> None:
    """An explicit model tag that has no directory: a RequestError naming `flag` and the tags there
    are, before a runtime starts and a model loads (chat_cli, chat_web). None: nothing to check."""
    if model_tag is None:   # load_model picks one, or says there is none
        return
    root = checkpoint_dir(phase, model_tag, base_dir).parent
    if not (root / model_tag).is_dir():
        find_model_tag(phase, base_dir)   # no tags at all: says so, with how to train one
        raise RequestError(f"{flag}: got {model_tag!r}; accepted: {'|'.join(_model_tags(root))} (the {phase} "
                           f"models under {root})")


def load_model(phase: str, device, *, model_tag: str | None = None, step: int | str = "latest",
               base_dir: str | Path | None = None, attn_backend: str = "auto",
               compute_dtype: torch.dtype | None = None, for_training: bool = False):
    """Build the GPT recorded in a checkpoint, load its weights and the matching tokenizer
    (`for_training`: the caller will train it; see build_model).

    Returns (model in eval mode on `device`, tokenizer, meta). Raises CheckpointError when the
    tokenizer on disk is not the one the model was trained with (fingerprint mismatch).
    """
    from nanochat.tokenizer import get_tokenizer, tokenizer_dir

    device = torch.device(device)
    model_tag = model_tag or find_model_tag(phase, base_dir)
    ckpt_dir = checkpoint_dir(phase, model_tag, base_dir)
    ckpt = load_checkpoint(ckpt_dir, step, device=device)
    meta = ckpt["meta"]
    tokenizer = get_tokenizer(base_dir)
    want = meta.get("tokenizer_fingerprint")
    if want is not None and want != tokenizer.fingerprint:
        raise CheckpointError(
            f"{ckpt_dir / step_dirname(ckpt['step'])} was trained with tokenizer {want[:16]}... but "
            f"{tokenizer_dir(base_dir)} holds {tokenizer.fingerprint[:16]}...; restore the original "
            "tokenizer or retrain the model")
    model = model_from_meta(meta, ckpt["model"], ckpt_dir / step_dirname(ckpt["step"]), device,
                            attn_backend=attn_backend, compute_dtype=compute_dtype, for_training=for_training)
    model.eval()
    return model, tokenizer, meta
