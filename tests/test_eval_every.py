"""--eval-every N in base_train, mid_train, chat_sft and chat_rl: one rule (nanochat/loop.py), and
each script's --help says it: N > 0 evaluates at step 0, every N steps and at the last step; -1 or
0 never evaluates, not even at the last step (the last step's checkpoint is saved either way)."""

import re

import pytest

from tests.test_loop import _CountingTrainer, _eval_spec

RULE = "N: evaluate {what} at step 0, every N steps and at the last step; -1 or 0: never, not even at the last step"


def _parsers():
    from scripts import base_train, chat_rl, chat_sft, mid_train
    return {"base_train": (base_train.parse_config, "val bpb"), "mid_train": (mid_train.parse, "val bpb"),
            "chat_sft": (chat_sft.parse, "val bpb"), "chat_rl": (chat_rl.parse_config, "GSM8K pass@1")}


@pytest.mark.parametrize("script", ["base_train", "mid_train", "chat_sft", "chat_rl"])
def test_every_script_says_and_accepts_the_same_rule(script, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    parse, what = _parsers()[script]
    with pytest.raises(SystemExit):
        parse(["--help"])
    text = " ".join(capsys.readouterr().out.split())   # argparse wraps the help: compare the words
    entry = re.search(r"--eval-every EVAL_EVERY (.*?) --", text).group(1)
    assert entry.startswith(RULE.format(what=what) + "; default: "), entry
    for value in (-1, 0, 5):
        assert parse(["--eval-every", str(value)]).eval_every == value
    with pytest.raises(ValueError, match=r"--eval-every: got -2; accepted: an integer >= 1 \(or -1/0\)"):
        parse(["--eval-every", "-2"])


@pytest.mark.parametrize("every, evaluated", [(3, [0, 3, 6, 7]), (7, [0, 7]), (0, []), (-1, [])])
def test_the_loop_follows_the_rule_and_always_saves_the_last_step(tmp_path, every, evaluated):
    evals, saves = [], {}
    run = _CountingTrainer()
    from nanochat.loop import run_training_loop
    run_training_loop(run, meter=run.meter, spec=_eval_spec(tmp_path, evals, saves, 7, eval_every=every))
    assert evals == evaluated and 7 in saves


def test_chat_rl_trains_without_held_out_problems_when_it_never_evaluates(monkeypatch, tmp_path):
    """--test-holdout 0 leaves the evaluation no problems: fine with --eval-every -1 or 0 (both
    mean never), refused with a positive --eval-every."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    from scripts.chat_rl import parse_config
    for every in ("-1", "0"):
        assert parse_config(["--test-holdout", "0", "--eval-every", every]).test_holdout == 0
    with pytest.raises(ValueError, match=r"--test-holdout: got 0; accepted: .*--eval-every -1 \(or 0\)"):
        parse_config(["--test-holdout", "0", "--eval-every", "5"])
