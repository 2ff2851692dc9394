"""Which trained model a chat script serves, and how it decodes, checked against the disk and the
device before the model loads: `check_checkpoint` (the -i/--source, -g/--model-tag and -s/--step
flags against the checkpoints there are) and `check_decode_device` (--decode / --graph-step against
the runtime's device). Shared by scripts/chat_cli.py and scripts/chat_web.py, so both refuse a
missing model the same way: one line naming the flag and the values on disk (the loader says "no
checkpoint for step 99 in ..." or "no rl checkpoints under ...", naming no flag; chat_web checked only
-g/--model-tag, and its --decode graphs on a CPU was a traceback after loading). Imports torch only
through nanochat/checkpoint.py, when called."""

from __future__ import annotations

from nanochat.errors import RequestError

SOURCES = ("sft", "rl", "mid", "base")   # the phases a chat model comes from (-i/--source)


def _no_model(source: str):
    """What find_model_tag says when phase `source` has no model (a CheckpointError), else None
    (one tag, or several: there are models)."""
    from nanochat.checkpoint import AmbiguousModelTag, CheckpointError, find_model_tag

    try:
        find_model_tag(source)
    except AmbiguousModelTag:
        return None
    except CheckpointError as e:
        return e
    return None


def check_checkpoint(source: str, model_tag: str | None, step: str, sources=SOURCES) -> None:
    """The checkpoint -i `source`, -g `model_tag` (None: the one load_model picks) and -s `step`
    ("latest" or digits, already syntax-checked) name is on disk; if not, a RequestError naming the
    flag and what there is instead. A phase with no model names the phases of `sources` that have
    one; on a machine with none at all load_model's own message stands (where it looked, how to
    train one). A step that is on disk but broken is left to load_model, whose message says how."""
    from nanochat.checkpoint import (CheckpointError, check_model_tag_exists, checkpoint_dir, find_model_tag,
                                     list_steps, read_meta, step_dirname)

    missing = _no_model(source)
    if missing is not None:
        others = "|".join(s for s in sources if s != source and _no_model(s) is None)
        if others:
            raise RequestError(f"{missing}, or pick another -i/--source: {others}")
        return
    check_model_tag_exists(source, model_tag)
    ckpt_dir = checkpoint_dir(source, model_tag or find_model_tag(source))
    steps = "|".join(map(str, list_steps(ckpt_dir))) or "none"
    number = _step_number(ckpt_dir, step, steps)
    try:   # the meta alone (a small JSON), read as load_model reads it (which restores a step a re-save moved)
        read_meta(ckpt_dir, number)
    except CheckpointError:
        if (ckpt_dir / step_dirname(number)).is_dir():   # there, but broken: its own message says how
            raise
        got, other = (step, "latest or ") if step != "latest" else \
            (f"latest (step {number}, which latest.json names)", "")
        raise RequestError(f"-s/--step: got {got}; accepted: {other}a step on disk: {steps} "
                           f"(in {ckpt_dir})") from None


def _step_number(ckpt_dir, step: str, steps: str) -> int:
    """-s `step` as a number: latest is what the directory's latest.json records. Missing or corrupt,
    the loader said "(pass one explicitly)" or "--step N ..., --resume N ...", a training script's
    flags: here -s/--step and the steps on disk `steps` are named. A directory with no step at all
    keeps the loader's message (it names the model tags that have one)."""
    from nanochat.checkpoint import LATEST_NAME, CheckpointError, read_latest

    if step != "latest":
        return int(step)
    try:
        return read_latest(ckpt_dir)
    except CheckpointError:
        if steps == "none":
            raise
        state = "corrupt" if (ckpt_dir / LATEST_NAME).is_file() else "missing"
        raise RequestError(f"-s/--step: got latest, but {ckpt_dir / LATEST_NAME} (the latest step's record) is "
                           f"{state}; accepted: a step on disk: {steps}") from None


def check_decode_device(decode: str, graph_step: str, device) -> None:
    """--decode graphs and --graph-step persistent with --decode static need a CUDA device: said
    once the runtime has its device, before the model loads (the Engine says it after loading).
    `device`: a torch.device."""
    if device.type == "cuda":
        return
    if decode == "graphs":
        raise RequestError(f"--decode: 'graphs' needs a CUDA device, this run is on {device.type}; "
                           "accepted here: auto|eager|compile|static")
    if graph_step == "persistent" and decode == "static":
        raise RequestError(f"--graph-step: 'persistent' needs a CUDA device, this run is on {device.type}; "
                           "accepted here: auto|compiled|eager")
