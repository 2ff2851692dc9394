"""What a resumed training run may continue (base, mid, SFT, RL): the checkpoint's model, world
size, batch, optimizer layout and tokenizer against this run's (check_resume_compatible, and
check_resume_world from meta.json alone, before data or weights load), a checkpoint past the run's
last step (check_resume_step), base_train's auto total batch on a resume (resumed_total), the
schedule values that changed (say_schedule_changes) and every other flag that differs from the
checkpoint's run (say_config_changes). Each refusal is a CheckpointError (resumed_total's: a
RequestError) naming what differs and the flag that sets it."""

from __future__ import annotations


# model_config fields and the flags that set them (base_train; mid/SFT take them from the checkpoint)
_CONFIG_FLAGS = {"n_layer": "base_train --depth", "n_embd": "base_train --depth / --aspect-ratio",
                 "n_head": "base_train --head-dim", "n_kv_head": "base_train --head-dim",
                 "sequence_len": "base_train --max-seq-len", "vocab_size": "the tokenizer",
                 "window_pattern": "base_train --window-pattern"}


def _resume_mismatch(what, saved, now, remedy="use the flags of the original run"):
    from nanochat.checkpoint import CheckpointError
    raise CheckpointError(f"--resume: the checkpoint has {what} {saved!r} but this run has {now!r}; "
                          f"{remedy} (or start a new --model-tag)")


def check_resume_world(meta: dict, world_size: int) -> None:
    """The checkpoint's world size (meta.json) is this run's: a CheckpointError naming both, which
    a stage can raise from meta.json alone, before it reads data or loads weights."""
    saved = (meta.get("train") or {}).get("world_size", 1)
    if saved != world_size:   # not a flag: the launch (its optimizer and loader state are per rank)
        launch = ("run it without torchrun (one process)" if saved == 1 else
                  f"launch it on {saved} processes in all (torchrun --nproc_per_node x --nnodes = {saved})")
        _resume_mismatch("a world size (torchrun processes)", saved, world_size, launch)


def check_resume_compatible(meta: dict, model_config: dict, plan, world_size: int, fingerprint: str,
                            fsdp: bool | None = None) -> None:
    """A resumed run must continue the same model, batch layout, tokenizer and optimizer state
    layout (`fsdp`: sharded or not; None: not checked): a RequestError that names what differs and
    the flag that sets it."""
    from dataclasses import asdict

    from nanochat.gpt_config import GPTConfig

    mismatch = _resume_mismatch
    # a field the checkpoint lacks (code older than the field) is its default, as config_from_meta
    # builds it for every reader: else each field GPTConfig gains would refuse every earlier run's resume
    saved_config = meta.get("model_config") or {}
    if saved_config:
        saved_config = {**{k: v for k, v in asdict(GPTConfig()).items() if k in model_config}, **saved_config}
    # the fields flags set first, in _CONFIG_FLAGS' order: a new --depth is named as n_layer, not as the
    # n_embd it also changes (sorted, n_embd came first and the error read as an --aspect-ratio change)
    order = list(_CONFIG_FLAGS)
    for key in sorted(set(saved_config) | set(model_config),
                      key=lambda k: (order.index(k) if k in order else len(order), k)):
        if saved_config.get(key) != model_config.get(key):
            flag = _CONFIG_FLAGS.get(key)
            mismatch(f"{key}" + (f" (set by {flag})" if flag else ""), saved_config.get(key), model_config.get(key))
    check_resume_world(meta, world_size)   # first: it also changes the batch arithmetic below
    train = meta.get("train") or {}   # null: a recipe that recorded none (read_meta allows it)
    if train.get("total_batch_size") != plan.total_batch_size:
        mismatch("--total-batch-size", train.get("total_batch_size"), plan.total_batch_size)
    saved_fsdp = (meta.get("config") or {}).get("fsdp")
    if fsdp is not None and saved_fsdp is not None and bool(saved_fsdp) != fsdp:
        mismatch("--fsdp (sharded optimizer state)" if saved_fsdp else "no --fsdp (whole optimizer state)",
                 bool(saved_fsdp), fsdp)
    if meta.get("tokenizer_fingerprint") not in (None, fingerprint):
        mismatch("tokenizer fingerprint", meta.get("tokenizer_fingerprint"), fingerprint)


def say_schedule_changes(saved: dict, now: dict) -> list[str]:
    """A resumed run's schedules are computed from this run's flags: one line naming each value
    (flag -> number; None: unknown) that differs from the checkpoint's run, e.g. an extended
    --num-iterations, or a flag of the original run left off the resume (its default then
    applies). The optimizer names its own LR / weight-decay changes (MuonAdamW.load_state_dict)."""
    changed = [f"--{k.replace('_', '-')} {saved[k]:g} -> {v:g}" for k, v in now.items()
               if saved.get(k) is not None and v is not None and saved[k] != v]
    if changed:
        from nanochat.loop import _say   # print0 that survives a terminal gone (a hung-up ssh session)
        _say("--resume: the optimizer's schedules (LR, weight decay; v2: momentum too) follow this run's flags, not the checkpoint's: " + ", ".join(changed))
    return changed


def say_config_changes(saved: dict, now: dict, said: tuple[str, ...] = ()) -> list[str]:
    """A resume runs with this run's flags: one line naming each flag (a config field) whose value
    differs from the one the checkpoint's run recorded, e.g. a new --eval-tokens (its val bpb is then
    measured over other tokens than the earlier evaluations') or --data-dir, which a resume took
    without a word. `said`: fields a line of their own names (the schedule, the optimizer's values),
    or that a refusal checks; a field the checkpoint did not record (older code) is not compared."""
    def shown(value) -> str:
        return "(not given)" if value is None else f"{value:,}" if isinstance(value, int) and \
            not isinstance(value, bool) else str(value)

    changed = [f"--{k.replace('_', '-')} {shown(saved[k])} -> {shown(v)}" for k, v in now.items()
               if k not in said and k in saved and saved[k] != v]
    if changed:
        from nanochat.loop import _say
        _say("--resume: these flags differ from the checkpoint's run, and this run's apply: " + ", ".join(changed))
    return changed


def check_resume_step(step: int, num_iterations: int, ckpt_dir) -> None:
    """A checkpoint past the run's last step cannot be continued (the loop would never reach its
    end): say so before anything is built. At exactly the last step the rerun trains no step: it saves
    that step again (evaluating and sampling there only where the checkpoint had not)."""
    from nanochat.checkpoint import CheckpointError, list_steps

    if step > num_iterations:
        earlier = [s for s in list_steps(ckpt_dir) if s <= num_iterations]
        raise CheckpointError(f"--resume: {ckpt_dir} is at step {step}, past --num-iterations {num_iterations}; "
                              f"pass --num-iterations > {step} to train on, or resume an earlier step "
                              f"({earlier or 'none on disk'})")


def resumed_total(total_batch_size: int, device_batch_size: int, seq_len: int, meta: dict | None,
                  world_size: int) -> int:
    """base_train's --total-batch-size for this run: as given, but auto (-1) on a resume (`meta`: the
    checkpoint's meta.json; None: a fresh run) keeps the checkpoint's total when this run's
    micro-batches divide it. Auto rounds up to whole micro-batches of the --device-batch-size, so the
    rerun at a lower one that an out-of-memory stop advises would otherwise compute another total
    and be refused."""
    from nanochat.errors import RequestError

    if total_batch_size != -1 or meta is None:
        return total_batch_size
    saved = (meta.get("train") or {}).get("total_batch_size")
    saved_seq = (meta.get("model_config") or {}).get("sequence_len")
    row = seq_len * world_size
    # another seq len / world size: refused later, naming that flag (a seq len that happened to divide
    # the total used to be refused here as a --device-batch-size the user never changed)
    if not isinstance(saved, int) or saved <= 0 or saved % row or saved_seq != seq_len:
        return -1
    if saved % (device_batch_size * row):
        fits = [d for d in range(1, saved // row + 1) if saved // row % d == 0][:8]
        raise RequestError(f"--device-batch-size {device_batch_size}: the checkpoint's total batch of "
                           f"{saved:,} tokens per step is not a whole number of this run's micro-batches "
                           f"({device_batch_size} x {seq_len} tokens x {world_size} rank(s)); "
                           f"resume with a --device-batch-size that divides it: {', '.join(map(str, fits))}, ...")
    return saved
