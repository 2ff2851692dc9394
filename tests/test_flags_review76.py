"""Printed commands and dash-leading values (session 76; the chat stages' review found that their
next / resume commands broke on a value starting with "-", and that loop.py and check_model_tag had
the same fault for base_train and every stage).

* loop.as_flags, which every script's resume command uses, wrote `--run-name -x`: argparse reads
  "-x" as a flag, so the printed command failed with "expected one argument". A value starting
  with "-" that is not a number is now one word, `--run-name=-x`; numbers (`--eval-every -1`)
  stay as they were.
* check_model_tag accepted a new tag starting with "-", which every printed `--model-tag TAG` broke on;
  a reader still opens such a tag made before."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import asdict

import pytest

from nanochat.flags import check_model_tag
from nanochat.loop import as_flags, resume_command


@pytest.mark.parametrize("name, value, words", [
    ("run_name", "-x", ["--run-name=-x"]),
    ("eval_every", -1, ["--eval-every", "-1"]),
    ("init_lr_frac", -0.5, ["--init-lr-frac", "-0.5"]),
    ("lr", "-.5", ["--lr", "-.5"]),
    ("run_name", "-", ["--run-name=-"]),
    ("run_name", "-inf", ["--run-name=-inf"]),
    ("identity", "-5.", ["--identity=-5."]),   # argparse's number rule does not take "-5.": a flag to it
    ("identity", "-1e3", ["--identity=-1e3"]),
    ("extra", ["a", "-b"], ["--extra", "a", "--extra=-b"]),
    ("compile", True, ["--compile"]),
    ("compile", False, ["--no-compile"]),
])
def test_as_flags_keeps_dash_leading_values_with_their_flag(name, value, words):
    assert as_flags(name, value) == words


def test_base_trains_resume_command_parses_back_with_a_dash_leading_run_name():
    from scripts import base_train
    cfg = base_train.BaseTrainConfig(run="-night", eval_every=-1, wandb="off")
    line = resume_command("base_train", cfg, asdict(base_train.BaseTrainConfig()), "d2")
    argv = shlex.split(line)[3:]   # after "python -m scripts.base_train"
    assert "--run=-night" in argv and argv[argv.index("--eval-every") + 1] == "-1", line
    back = base_train.parse_config(argv)
    assert back.run == "-night" and back.eval_every == -1 and back.resume == "latest"


def test_a_new_model_tag_starting_with_a_dash_is_refused_but_an_old_one_still_opens(tmp_path, monkeypatch):
    for tag in ("-x", "--force", "-"):
        with pytest.raises((ValueError, argparse.ArgumentTypeError), match=r"--model-tag: .*not starting with '-'"):
            check_model_tag(tag, new=True)
        check_model_tag(tag)   # a reader (chat_cli, chat_eval, checkpoint_dir) of a tag made before the rule
    for tag in ("d20", "my-run", "v1.2", "_x", None):
        check_model_tag(tag, new=True)
    from scripts import base_train
    with pytest.raises(ValueError, match=r"--model-tag: got '-x'"):
        base_train.parse_config(["--model-tag=-x"])
    # a checkpoint directory of such a tag, made before the rule, is still found (review of session 76)
    from nanochat.checkpoint import checkpoint_dir
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    assert checkpoint_dir("base", "-x") == tmp_path / "checkpoints" / "base" / "-x"


def test_printed_commands_of_an_old_dash_leading_tag_parse_back():
    """A tag made before the rule (auto-picked by mid_train) came back as `--model-tag -old` in every
    printed next / resume command, which argparse cannot read (review of session 76)."""
    from nanochat.chat_flags import next_commands, parse_config
    from nanochat.chat_train import MID
    from nanochat.chat_flags import resume_command as chat_resume
    cfg = parse_config(MID, ["--device", "cpu"])
    line = chat_resume(MID, cfg, "-old")
    assert "--model-tag=-old" in shlex.split(line), line
    (_, sft_line), = next_commands(MID, cfg, "-old")
    assert "--model-tag=-old" in shlex.split(sft_line), sft_line
