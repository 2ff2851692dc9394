"""What a resumed mid-training / SFT run may continue beyond what every stage checks
(nanochat/resume_checks.py): the conversation mixture the checkpoint's loader state points into
(identity name, --extra-conversations by sha256, decontamination counts, size, --seed: its order and
each later epoch's, rows of --max-seq-len) and, under --total-batch-size -1, the step
--device-batch-size rounds it to. Each refusal is a CheckpointError naming the flag;
nanochat/chat_train.py checks them from meta.json before any weights load (and re-exports them),
and names every other flag a resume changed (say_config_changes, all but SAID_ON_RESUME's)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from nanochat.tasks.identity import NAME as IDENTITY_NAME

if TYPE_CHECKING:   # chat_train imports this module
    from nanochat.chat_train import ChatStage

# config fields a resume's say_config_changes leaves out: another line names a change of theirs (the
# schedule's, the optimizer's LRs and weight decay), a refusal checks them (the mixture, the rows, the
# batch, the source it started from), or they name the run itself (--resume, --overwrite, --model-tag)
SAID_ON_RESUME = ("resume", "overwrite", "model_tag", "source", "step", "num_iterations", "warmup_ratio",
                  "warmdown_ratio", "final_lr_frac", "matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr",
                  "init_lr_frac", "weight_decay", "seed", "max_seq_len", "total_batch_size", "test_holdout",
                  "extra_conversations", "identity", "no_decontaminate")


def _counts_by_name(counts: dict) -> dict[str, int]:
    """{source: n} keyed by its files' names ("/a/x.jsonl, /a/y.jsonl" -> "x.jsonl, y.jsonl")."""
    out: dict[str, int] = {}
    for source, n in counts.items():
        name = ", ".join(Path(p).name for p in str(source).split(", "))
        out[name] = out.get(name, 0) + int(n)
    return out


def _check_same_data(meta: dict, mixture: dict, conversations: int, seed: int, seq_len: int) -> None:
    """A resumed run continues the loader's place in its shuffled mixture, so the mixture (its
    conversations, their order, the rows they are cut into) must be the one the checkpoint trained
    on. A checkpoint from before --identity / --extra-conversations: identity on, no extra files."""
    from nanochat.checkpoint import CheckpointError
    train, config = meta.get("train") or {}, meta.get("config") or {}
    saved = train.get("mixture") or {"identity": IDENTITY_NAME, "extra_conversations": []}

    def refuse(what: str):
        raise CheckpointError(f"--resume: the checkpoint was trained on {what}; use the flags of the "
                              "original run (or start a new --model-tag)")

    def describe(m):
        files = ", ".join(f"{Path(f['path']).name} ({f['sha256'][:12]})" for f in m["extra_conversations"])
        return f"--extra-conversations [{files}], identity {m['identity'] or 'off'}"
    key = lambda m: (m["identity"], [f["sha256"] for f in m["extra_conversations"]])   # noqa: E731
    if key(saved) != key(mixture):
        refuse(f"another conversation mixture ({describe(saved)}) than this run's ({describe(mixture)})")
    was = saved.get("decontaminated")   # None: a run from before decontamination (it kept every row)
    # by file name: the files are matched by content (sha256 above), so data moved elsewhere (another
    # --data-dir, base dir or disk) is the same mixture; compared by path it was refused as "decontaminated
    # of 3 conversations, this run's of 3"
    was_n, now_n = _counts_by_name(was or {}), _counts_by_name(mixture.get("decontaminated", {}))
    if was_n != now_n:
        now = sum(now_n.values())
        changed = ", ".join(f"{k}: {was_n.get(k, 0)} -> {now_n.get(k, 0)}" for k in sorted(was_n.keys() | now_n.keys())
                            if was_n.get(k, 0) != now_n.get(k, 0))
        refuse(f"a mixture from before decontamination, which this run applies (it leaves out {now:,} conversations "
               "asking a chat_eval test question); pass --no-decontaminate to continue it as it was" if was is None
               else f"a mixture decontaminated of {sum(was_n.values()):,} conversations, this run's of {now:,} "
                    f"({changed})")
    if train.get("mixture_conversations", conversations) != conversations:
        refuse(f"a mixture of {train['mixture_conversations']:,} conversations, this run's has {conversations:,} "
               "(set by --test-holdout, --data-dir and the task files)")
    if config.get("seed", seed) != seed:
        refuse(f"the mixture shuffled with --seed {config['seed']}, this run's with {seed}")
    if train.get("seq_len", seq_len) != seq_len:
        refuse(f"rows of --max-seq-len {train['seq_len']}, this run's are {seq_len}")


def check_auto_batch_resume(meta: dict, cfg, plan, world_size: int, stage: ChatStage) -> None:
    """--total-batch-size -1 rounds the stage's step up to whole micro-batches of --device-batch-size:
    a resume with another --device-batch-size can step another number of tokens. Named here as that
    flag (check_resume_compatible named --total-batch-size, which the user never passed)."""
    from nanochat.checkpoint import CheckpointError
    train = meta.get("train") or {}
    saved = train.get("total_batch_size")
    # another world size is check_resume_compatible's to name (it changes this arithmetic too)
    if cfg.total_batch_size != -1 or saved in (None, plan.total_batch_size) or \
            train.get("world_size", 1) != world_size:
        return
    was = (meta.get("config") or {}).get("device_batch_size")
    original = f"--device-batch-size {was} (the original run's) or " if was is not None else ""
    raise CheckpointError(
        f"--resume: the checkpoint's steps were {saved:,} tokens, and this run's --device-batch-size "
        f"{cfg.device_batch_size} makes them {plan.total_batch_size:,} (--total-batch-size -1: the {stage.name} step "
        f"of {stage.step_text()} rounded up to whole micro-batches); accepted: {original}--total-batch-size {saved} "
        "(with a --device-batch-size whose micro-batches divide it); use the flags of the original run")
