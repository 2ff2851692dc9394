"""Where a chat stage (mid, SFT, RL) starts: the checkpoint its --source / --model-tag / --step name
(`resolve_source`, a CheckpointError with the command that creates a missing one), the steps an
explicit --step or --resume names checked before any data is read (`check_named_steps`), as is
the --source checkpoint's tokenizer (`check_source_tokenizer`: the base dir's), and
`start_point`: the stage's own checkpoint directory, the `source` record a checkpoint keeps (the
weights' sha256, the test problems they trained on) and the step --resume continues, which must
be a run that started from those same weights (--resume auto starts afresh instead, said in one
line by `say_fresh_start`; an explicit --resume raises naming both).

Used by nanochat/chat_train.py (mid_train, chat_sft) and scripts/chat_rl.py.
"""

from __future__ import annotations

from pathlib import Path

from nanochat.common import print0

HOW_TO_MAKE = {"base": "python -m scripts.base_train --model-tag {tag}",
               "mid": "python -m scripts.mid_train --model-tag {tag}",
               "sft": "python -m scripts.chat_sft --model-tag {tag}"}


def resolve_source(stage: str, source: str, model_tag: str | None, base_dir=None,
                   flag: str = "--source") -> tuple[str, Path]:
    """(model tag, checkpoint dir) of the checkpoint a stage starts from; CheckpointError naming
    the flag and the command that creates it when there is none."""
    from nanochat.checkpoint import AmbiguousModelTag, CheckpointError, checkpoint_dir, find_model_tag, read_latest
    try:
        tag = model_tag or find_model_tag(source, base_dir)
        ckpt_dir = checkpoint_dir(source, tag, base_dir)
        read_latest(ckpt_dir)
    except AmbiguousModelTag:   # checkpoints exist: the answer is --model-tag, not "create one"
        raise
    except CheckpointError as e:
        from nanochat.chat_flags import MADE_FROM, tag_with_checkpoint   # it imports chat_train, which imports this
        from nanochat.chat_train import _STAGE_SOURCES
        # "<tag>" sent a user whose base (or mid) model has a tag looking for one: the tag it has
        tag_text = model_tag or tag_with_checkpoint(MADE_FROM.get(source), None, base_dir) or "<tag>"
        # mid_train takes --source base only: "or pick another --source" sent its user looking for one
        others = [s for s in _STAGE_SOURCES.get(stage, ()) if s != source]
        there = [f"{s}/{t}" for s in others if (t := tag_with_checkpoint(s, model_tag, base_dir))]
        raise CheckpointError(
            f"{flag} {source}: {stage} starts from a {source} checkpoint, and none was found ({e}); create it "
            f"with `{HOW_TO_MAKE[source].format(tag=tag_text)}`" + (
                f", or pick another {flag}" + (f" ({'|'.join(others)}" + (f": {', '.join(there)} is there" if there
                                                                         else "") + ")" if others else "")
                if flag == "--source" and (others or stage not in _STAGE_SOURCES) else "")) from None
    return tag, ckpt_dir


_SOURCE_KEYS = ("phase", "model_tag", "step", "model_sha256")


def say_fresh_start(why: str) -> None:
    print0(f"--resume auto: {why}: starting fresh instead (its checkpoints are moved to earlier_runs/ at this "
           "run's first save)")


def _auto_resume(ckpt_dir, source: dict) -> str | None:
    """--resume auto for a chat stage: the latest checkpoint, unless that run started from other
    weights than --source names now (e.g. base was retrained under the same tag since): then a
    fresh start, said in one line. Continuing would hand on a model of the old base."""
    from nanochat.checkpoint import read_meta, resolve_resume

    resume_at = resolve_resume("auto", ckpt_dir)
    if resume_at is None:
        return None
    recorded = read_meta(ckpt_dir, resume_at).get("source") or {}
    changed = [k for k in _SOURCE_KEYS if k in recorded and recorded[k] != source.get(k)]
    if not changed:
        return resume_at
    say_fresh_start(f"that run started from {recorded.get('phase')}/{recorded.get('model_tag')} step "
                     f"{recorded.get('step')}, and {source['phase']}/{source['model_tag']} is now step "
                     f"{source['step']}{' with other weights' if 'model_sha256' in changed else ''}")
    return None


def check_named_steps(cfg, src_dir, ckpt_dir) -> None:
    """A --step of the --source checkpoint, and an explicit --resume latest|N of this stage's own
    run, name checkpoints on disk: else a CheckpointError naming the flag (and the steps there),
    said before any data is read or weights load. The load said it later (after the whole mixture
    was read; in chat_rl, after the prompt-fit check had been skipped for want of the step's
    meta.json), naming neither flag."""
    from nanochat.checkpoint import CheckpointError, read_meta
    for flag, value, where in (("--step", cfg.step, src_dir), ("--resume", cfg.resume, ckpt_dir)):
        if value in (None, "auto") or (flag == "--step" and value == "latest"):   # resolve_source read it
            continue
        try:
            read_meta(where, value)
        except CheckpointError as e:
            raise CheckpointError(f"{flag} {value}: {e}") from None


def check_source_tokenizer(cfg, tag: str, src_dir, base_dir) -> None:
    """The --source checkpoint a fresh start loads was trained with the base dir's tokenizer: else a
    CheckpointError naming --source / --model-tag, said before any data is read. load_model refused
    it only after the whole mixture had been read and checked (in chat_rl, after the prompts had been
    measured with the wrong tokenizer), naming neither flag. An explicit --resume
    loads its own run's weights (the resume checks compare that checkpoint's tokenizer)."""
    from nanochat.checkpoint import CheckpointError, read_meta, resolve_step
    from nanochat.tokenizer import get_tokenizer, tokenizer_dir
    if cfg.resume not in (None, "auto"):
        return
    try:
        step = resolve_step(src_dir, cfg.step)
        want = read_meta(src_dir, step).get("tokenizer_fingerprint")
    except CheckpointError:   # a damaged checkpoint: the load names it, in full
        return
    if not isinstance(want, str):   # an older checkpoint that does not say
        return
    have = get_tokenizer(base_dir).fingerprint
    if want != have:
        raise CheckpointError(
            f"--source {cfg.source}: {cfg.source}/{tag} step {step} was trained with tokenizer {want[:16]}..., and "
            f"{tokenizer_dir(base_dir)} holds {have[:16]}...; accepted: a --source / --model-tag checkpoint trained "
            "with this tokenizer (or restore the tokenizer that one was trained with)")


def start_point(stage: str, cfg, base_dir, check_tokenizer: bool = True) -> tuple[str, Path, dict, str | None]:
    """(model tag, own checkpoint dir, source, resume point | None) of a chat stage (mid, SFT, RL):
    cfg's --source / --model-tag / --step name the checkpoint it starts from (`source` records it,
    with its model.pt's sha256, and the test problems it or its own sources trained on: chat_eval
    scores only held-out ones, even after those checkpoints are removed), and --resume auto
    continues only a run that started from it. `check_tokenizer` False: the caller ran
    check_source_tokenizer already (mid / SFT's check_rows: a second tokenizer load for nothing)."""
    from nanochat.chat_data import test_holdouts
    from nanochat.checkpoint import checkpoint_dir, model_digest, read_meta, resolve_step

    tag, src_dir = resolve_source(stage, cfg.source, cfg.model_tag, base_dir)
    ckpt_dir = checkpoint_dir(stage, tag, base_dir)
    check_named_steps(cfg, src_dir, ckpt_dir)
    if check_tokenizer:
        check_source_tokenizer(cfg, tag, src_dir, base_dir)
    src_step = resolve_step(src_dir, cfg.step if cfg.step == "latest" else int(cfg.step))
    source = {"phase": cfg.source, "model_tag": tag, "step": src_step, "dir": str(src_dir),
              "model_sha256": model_digest(src_dir, src_step)}
    held, complete = test_holdouts(read_meta(src_dir, src_step), lambda src: read_meta(
        checkpoint_dir(src["phase"], src.get("model_tag") or tag, base_dir), src["step"]), cfg.source)
    # recorded even when the chain is not known (chat_rl's eval cuts to it; chat_eval says what it cannot know)
    source["test_holdouts"] = {name: list(entry) for name, entry in held.items()}
    if not complete:
        source["test_holdouts_complete"] = False
    resume_at = _auto_resume(ckpt_dir, source) if cfg.resume == "auto" else cfg.resume
    if resume_at is not None and cfg.resume != "auto":
        _check_source_of_resumed_run(cfg, ckpt_dir, resume_at)
    return tag, ckpt_dir, source, resume_at


def _check_source_of_resumed_run(cfg, ckpt_dir, resume_at) -> None:
    """An explicit --resume keeps the weights its run started from: a --source of another phase
    (chat_eval then read the wrong lineage's held-out problems) or a --step of another source step
    (silently ignored) is a CheckpointError naming both."""
    from nanochat.checkpoint import CheckpointError, read_meta
    recorded = read_meta(ckpt_dir, resume_at).get("source") or {}
    if recorded.get("phase") not in (None, cfg.source):
        given = getattr(cfg, "given_flags", None)   # chat_rl records which flags were typed
        default = " (its default)" if given is not None and "source" not in given else ""
        raise CheckpointError(
            f"--source {cfg.source}{default}: the run --resume {resume_at} continues started from --source "
            f"{recorded['phase']} ({recorded['phase']}/{recorded.get('model_tag')} step {recorded.get('step')}); "
            f"accepted: --source {recorded['phase']} (to build on a {cfg.source} checkpoint instead, start afresh: "
            "drop --resume and add --overwrite)")
    if cfg.step != "latest" and recorded.get("step") is not None and int(cfg.step) != int(recorded["step"]):
        raise CheckpointError(
            f"--step {cfg.step}: the run --resume {resume_at} continues started from {recorded.get('phase')}/"
            f"{recorded.get('model_tag')} step {recorded['step']}, and a resume keeps its own weights; accepted: "
            f"--step {recorded['step']} or no --step (to build on step {cfg.step} instead, start afresh: drop --resume "
            "and add --overwrite)")
