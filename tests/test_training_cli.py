"""The training commands as their users meet them (base_train, mid_train / chat_sft, chat_rl):
--help that says what each flag accepts, flag combinations refused naming the flag, errors said
before the data and the model load, a banner and resume lines that say what the run will do, and
a checkpoint directory that lost its latest.json. (Stops during a save: tests/test_loop.py; a save
cut short: tests/test_checkpoint.py.)"""

from __future__ import annotations

import importlib.util

import pytest

from nanochat import checkpoint as ck
from nanochat.errors import RequestError

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "8", "--total-batch-size", "512", "--window-pattern", "SL",
        "--sample-every", "-1", "--eval-every", "-1", "--eval-tokens", "4096", "--no-compile"]


def _help(parse, capsys) -> str:
    with pytest.raises(SystemExit):
        parse(["--help"])
    return " ".join(capsys.readouterr().out.split())   # argparse's line wrapping undone


def test_help_says_what_each_choice_flag_accepts(capsys):
    """`--resume RESUME default: None` told nobody it takes latest|STEP|auto; --precision, --kernel,
    --device, --wandb ... listed no values either."""
    from nanochat.chat_flags import parse_config as chat_parse
    from nanochat.chat_train import SFT
    from scripts import base_train, chat_rl

    text = _help(base_train.parse_config, capsys)
    for piece in ["--resume RESUME continue this --model-tag's run: latest, a step number, or auto",
                  "--precision PRECISION auto|bf16|fp32|fp8|nvfp4", "--kernel KERNEL current|liger|triton",
                  "--device DEVICE auto|cpu|cuda|mps", "--wandb WANDB off|offline|online",
                  "--attn-backend ATTN_BACKEND auto|sdpa|flex|cudnn|cudnn_fa4|reference",
                  "--fp8-wgrad FP8_WGRAD save|recompute|plain", "--save-every SAVE_EVERY N: save a checkpoint",
                  "-1: --target-param-data-ratio x scaling params", "whatever --num-iterations says"]:
        assert piece in text, piece
    text = _help(lambda argv: chat_parse(SFT, argv), capsys)
    for piece in ["--source SOURCE mid|base: the checkpoint phase to start from; default: mid",
                  "-1: one epoch of the conversation mixture", "-1: the model's sequence length",
                  "--resume RESUME continue this --model-tag's run: latest", "--dtype DTYPE auto|bf16|fp32"]:
        assert piece in text, piece
    text = _help(chat_rl.parse_config, capsys)
    assert "--source SOURCE sft|mid" in text and "--resume RESUME continue this --model-tag's run" in text


@pytest.mark.parametrize("resume, refused", [("latest", True), ("12", True), ("auto", False), (None, False)])
def test_overwrite_with_a_resume_is_refused(resume, refused):
    """--overwrite (move the tag's checkpoints aside for a fresh start) with --resume latest|N (continue
    them) was accepted and silently ignored."""
    from scripts.base_train import parse_config

    argv = ["--overwrite"] + (["--resume", resume] if resume else [])
    if refused:
        with pytest.raises(ValueError, match=f"^--overwrite cannot be combined with --resume {resume}: --overwrite "
                                             "starts a fresh run .*earlier_runs/<N>/"):
            parse_config(argv)
    else:
        assert parse_config(argv).overwrite


def test_a_run_name_without_wandb_names_the_run_flag(monkeypatch):
    """`--run foo` without the wandb package said '--wandb offline: ...', a flag never typed."""
    from nanochat import tracker
    from scripts.base_train import parse_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"^--run foo: a run name turns on wandb logging \(offline\), .* add "
                                         r"--wandb off"):
        parse_config(["--run", "foo"])
    with pytest.raises(ValueError, match=r"^--wandb online: the wandb package is not installed"):
        tracker.check_wandb_flags("online", "dummy")
    assert parse_config(["--run", "foo", "--wandb", "off"]).run == "foo"


def test_banner_resume_schedule_and_a_lost_latest_pointer(env, base_dir, capsys):
    """The banner said 'every -1 steps (+ final)' for saves (and samples) that are off; a resume that
    changes the LR schedule (a longer --num-iterations, a recipe flag of the first run left off) said
    nothing of it; and a tag whose latest.json is gone (an --overwrite cut short) made --resume auto
    say 'no checkpoint yet' and then advise --resume latest (or auto), which cannot work."""
    from scripts import base_train

    ckpt_dir = base_dir / "checkpoints" / "base" / "sched"
    args = TINY + env + ["--model-tag", "sched"]
    base_train.main(args + ["--num-iterations", "3", "--warmdown-ratio", "0.5"])
    assert "samples / saves : off / at the last step only" in " ".join(capsys.readouterr().out.split())
    base_train.main(args + ["--num-iterations", "5", "--resume", "latest", "--save-every", "2"])
    out = capsys.readouterr().out
    assert ("--resume: the optimizer's schedules (LR, weight decay; v2: momentum too) follow this run's flags, not the checkpoint's: --num-iterations 3 -> 5, "
            "--warmdown-ratio 0.5 -> 0.65") in out
    assert "samples / saves : off / every 2 steps (+ last)" in " ".join(out.split())
    (ckpt_dir / "latest.json").unlink()
    with pytest.raises(ck.CheckpointError, match=r"pass --resume STEP \(one of them; no latest.json records the "
                                                 r"latest\) to continue it"):
        base_train.main(args + ["--num-iterations", "6"])
    # --resume auto (setup.sh's reruns) starts fresh and moves those steps aside, not mixed with its own
    base_train.main(args + ["--num-iterations", "2", "--resume", "auto"])
    out = capsys.readouterr().out
    assert (f"--resume auto: {ckpt_dir} holds steps [3, 4, 5] but no latest.json naming the latest: starting fresh; "
            "they are moved to earlier_runs/ at this run's first save") in out
    assert f"moved the earlier run's checkpoints (steps [3, 4, 5]) to {ckpt_dir / 'earlier_runs' / '1'}" in out
    assert ck.list_steps(ckpt_dir) == [2] and ck.read_latest(ckpt_dir) == 2
    assert ck.list_steps(ckpt_dir / "earlier_runs" / "1") == [3, 4, 5]


def test_chat_rows_that_cannot_fit_the_model_fail_before_the_mixture_and_the_model(env, base_dir, monkeypatch):
    """mid_train / chat_sft read the whole conversation mixture and loaded the model before they
    compared --max-seq-len (and a --total-batch-size that --device-batch-size x the model's length
    does not divide) with the model: now from the source checkpoint's meta.json, first."""
    import nanochat.chat_data as chat_data
    from scripts import chat_sft

    ck.save_checkpoint(ck.checkpoint_dir("base", "rows", base_dir), 1, model_state={},
                       meta={"model_config": {"sequence_len": 64}})

    def too_late(*args, **kwargs):
        raise AssertionError("the mixture was read before the flags were checked")
    monkeypatch.setattr(chat_data, "build_mixture", too_late)
    monkeypatch.setattr(ck, "load_model", too_late)
    sft = ["--device", "cpu", "--source", "base", "--model-tag", "rows", "--no-compile"]
    with pytest.raises(RequestError, match=r"--max-seq-len: got 128; accepted: <= the model's sequence length 64"):
        chat_sft.main(sft + ["--max-seq-len", "128"])
    with pytest.raises(RequestError, match=r"--total-batch-size: got 1,000 tokens, which is not a multiple of "
                                           r"--device-batch-size x --max-seq-len x world size = 2 x 64 x 1"):
        chat_sft.main(sft + ["--device-batch-size", "2", "--total-batch-size", "1000"])
    # below one micro-batch: it was rounded up to one, silently (base_train refuses it)
    with pytest.raises(RequestError, match=r"^--eval-tokens: got 100; accepted: -1 or at least one micro-batch, "
                                           r"--device-batch-size x --max-seq-len = 128$"):
        chat_sft.main(sft + ["--device-batch-size", "2", "--eval-tokens", "100"])


def test_a_warmup_overlapping_the_recipes_warmdown_is_refused_at_parse():
    """--warmup-ratio 0.5 under v2 (warmdown 0.65) was refused only after the tokenizer, the data
    loaders and a resume's checkpoint had loaded: now by the flags' validation, for a fresh run."""
    from scripts.base_train import parse_config

    with pytest.raises(RequestError, match=r"--warmup-ratio 0\.5 \+ --warmdown-ratio 0\.65 \(recipe v2's\)"):
        parse_config(["--warmup-ratio", "0.5"])
    assert parse_config(["--warmup-ratio", "0.5", "--recipe", "v1"]).warmup_ratio == 0.5   # v1 warms down 0.2
    assert parse_config(["--warmup-ratio", "0.5", "--resume", "latest"]).resume == "latest"   # its checkpoint's recipe
