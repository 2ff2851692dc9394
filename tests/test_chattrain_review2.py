"""Second review of conversation training (mid_train, chat_sft, chat_rl) on CPU: the validation
mixture does not move with --seed (val bpb of two seeds scores the same conversations); a --step
of the source checkpoint or a --resume step that is not on disk is named with its flag before the
mixture is read; RL's per-step token count is the same on every rank (the sum over ranks).
Fixtures (tokenizer, base dir, env, offline data): tests/conftest.py."""

from __future__ import annotations

import pytest

from nanochat import checkpoint as ck
from nanochat.checkpoint_io import CheckpointError


# ------------------------------------------------------------------ the validation mixture

def test_the_validation_mixture_is_the_same_whatever_the_seed(shared_data):
    """build_mixture(..., "val") shuffled its conversations with --seed: chat_sft --seed 1 and
    --seed 2 scored val bpb on different conversations (the first --eval-tokens' worth of rows, and
    mid's cropping depends on the order), so their val bpb could not be compared. Training still
    shuffles with --seed."""
    from nanochat.chat_data import build_mixture
    kw = dict(data_dir=shared_data, test_holdout=20)
    a, b = (build_mixture("sft", "val", seed=s, **kw) for s in (1, 2))
    assert [a[i]["messages"] for i in range(len(a))] == [b[i]["messages"] for i in range(len(b))]
    ta, tb = (build_mixture("sft", "train", seed=s, **kw) for s in (1, 2))
    assert [ta[i]["messages"] for i in range(20)] != [tb[i]["messages"] for i in range(20)]


# ------------------------------------------------------------------ --step / --resume named early

TINY_BASE = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
             "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "L", "--sample-every", "-1",
             "--eval-every", "-1", "--no-compile", "--model-tag", "rv2", "--num-iterations", "1"]


@pytest.fixture
def no_data_no_model(monkeypatch):
    """Fails the test if the mixture is read or a model is loaded."""
    import nanochat.chat_data as chat_data

    def too_late(*args, **kwargs):
        raise AssertionError("the mixture was read (or the model loaded) before the flags were checked")
    monkeypatch.setattr(chat_data, "build_mixture", too_late)
    monkeypatch.setattr(ck, "load_model", too_late)
    monkeypatch.setattr(ck, "load_checkpoint", too_late)


@pytest.mark.parametrize("extra, match", [
    (["--step", "5"], r"--step 5: no checkpoint for step 5 in .*base/rv2; steps on disk: \[1\]"),
    (["--resume", "3"], r"--resume 3: no checkpoint for step 3 in .*mid/rv2; steps on disk: none"),
    (["--resume", "latest"], r"--resume latest: no checkpoint recorded in .*mid/rv2"),
])
def test_a_step_that_is_not_on_disk_is_named_with_its_flag_before_the_data(env, extra, match, no_data_no_model):
    """mid_train --step 5 (of a base run saved at step 1) read the whole mixture, then failed with
    "no checkpoint for step 5 in ..." naming no flag; --resume 3 / latest of a run that never saved
    did the same. Now said first, naming the flag."""
    from scripts import base_train, mid_train
    if not ck.list_steps(ck.checkpoint_dir("base", "rv2")):
        import nanochat.chat_data as chat_data   # base_train does not read the chat mixture
        base_train.main(TINY_BASE + env)
        assert chat_data.build_mixture.__name__ == "too_late"
    args = ["--device", "cpu", "--model-tag", "rv2", "--max-seq-len", "64", "--device-batch-size", "2",
            "--test-holdout", "20", "--no-compile", "--num-iterations", "1"]
    with pytest.raises(CheckpointError, match=match):
        mid_train.main(args + extra)


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from tests.test_engine import tiny_chat_model
    return tiny_chat_model(str(tiny_corpus))


@pytest.mark.parametrize("extra, match", [
    (["--step", "9"], r"--step 9: no checkpoint for step 9 in .*sft/d2; steps on disk: \[7\]"),
    (["--resume", "2"], r"--resume 2: no checkpoint for step 2 in .*rl/d2; steps on disk: none"),
])
def test_chat_rl_names_a_missing_step_before_the_data(sft_checkpoint, extra, match, no_data_no_model):
    """chat_rl --step 9 failed at the model load (after the problems were read and the prompt-fit
    check was skipped for want of the step's meta.json), naming no flag."""
    from scripts import chat_rl
    with pytest.raises(CheckpointError, match=match):
        chat_rl.main(["--device", "cpu", "--model-tag", "d2", "--test-holdout", "1", "--eval-every", "-1"] + extra)


# ------------------------------------------------------------------ --identity ""

@pytest.mark.parametrize("script", ["mid_train", "chat_sft"])
def test_an_empty_identity_is_refused_not_taken_for_no_identity(script):
    """--identity "" (e.g. --identity "$NAME" with NAME unset) parsed as --no-identity: the run left
    the identity conversations out, where the user meant to name the model. --no-identity says that."""
    import importlib
    parse = importlib.import_module(f"scripts.{script}").parse
    with pytest.raises(ValueError, match=r"--identity: got ''; accepted: a name of 1-64 printable characters"):
        parse(["--identity", ""])
    assert parse(["--no-identity"]).identity == "" and parse(["--identity=Ada"]).identity == "Ada"


# ------------------------------------------------------------------ what "-1 iterations" means

def test_help_says_what_one_epoch_does_with_the_last_partial_step(capsys):
    """-1 iterations: chat_rl takes whole steps of --examples-per-step problems (len // N: the last
    len % N problems are not trained), mid / SFT round up (the last step continues into the next
    epoch of the looping mixture). The help said "one pass" / "one epoch" and neither."""
    import re
    from scripts import chat_rl, chat_sft
    for parse, want in ((chat_rl.parse_config, r"-1: one pass over the training problems in whole steps "
                                               r"\(the last problems that do not fill a step are left out\)"),
                        (chat_sft.parse, r"-1: one epoch of the conversation mixture, rounded up to a whole step "
                                         r"\(the last one continues into the next epoch\)")):
        with pytest.raises(SystemExit):
            parse(["--help"])
        assert re.search(want, " ".join(capsys.readouterr().out.split()))
    from nanochat.chat_data import epoch_iterations
    assert epoch_iterations(8.0, 4 * 64, 64) == 2 and epoch_iterations(8.5, 4 * 64, 64) == 3   # rounded up
    assert epoch_iterations(0.0, 4 * 64, 64) == 1
