"""Regressions found by a user's review of the training recipes (base_train, mid_train, chat_sft,
chat_rl) on CPU: each test failed on the code before its fix."""

from __future__ import annotations

import pytest

from nanochat import checkpoint as ck

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "8", "--total-batch-size", "512", "--window-pattern", "SL",
        "--sample-every", "-1", "--eval-every", "-1", "--eval-tokens", "4096", "--no-compile"]


def _train(args):
    from scripts import base_train
    return base_train.main(args)


def test_overwrite_with_resume_says_why_not_got_true():
    """--overwrite --resume latest said '--overwrite: got True; accepted: only for a fresh run ...'."""
    from scripts.base_train import parse_config

    with pytest.raises(ValueError) as e:
        parse_config(["--overwrite", "--resume", "latest"])
    msg = str(e.value)
    assert "got True" not in msg
    assert msg.startswith("--overwrite cannot be combined with --resume latest: --overwrite starts a fresh run "
                          "(moving this model tag's checkpoints to earlier_runs/<N>/ in it), --resume latest "
                          "continues them")


def test_resume_with_a_lower_device_batch_size_reads_the_same_rows(env, base_dir):
    """The out-of-memory advice (README, setup.sh --help, the stop line under setup.sh) is to rerun
    with a lower --device-batch-size, and 'the stage resumes': base_train refused that resume
    ('the checkpoint's data loader had --device-batch-size 8, this run's has 4'). The loader's rows
    do not depend on its batch size, so the resumed steps see the same tokens: the losses match the
    uninterrupted run's up to float summation order."""
    args = TINY + env + ["--num-iterations", "4", "--save-every", "2", "--model-tag", "dbs"]
    full = _train(args)
    d = ck.checkpoint_dir("base", "dbs", base_dir)
    resumed = _train(args + ["--resume", "2", "--device-batch-size", "4"])
    assert sorted(resumed["losses"]) == [2, 3]
    for step in (2, 3):
        assert resumed["losses"][step] == pytest.approx(full["losses"][step], rel=1e-5, abs=1e-5), step
    # the checkpoint it saves records this run's batch size, so a later plain resume continues it
    assert ck.load_checkpoint(d, 4)["loader"]["batch_size"] == 4


def test_resume_at_a_lower_device_batch_keeps_the_auto_total(env, base_dir, monkeypatch):
    """With --total-batch-size auto (-1) the total is rounded up to whole micro-batches of the
    device batch, so a resume at another --device-batch-size computed another total and was refused
    ('the checkpoint has --total-batch-size X but this run has Y'; the user never passed it). A
    resume now keeps the checkpoint's total when the new micro-batches divide it, and says which
    device batches do when they do not. The auto rule's reference batch is scaled down (2^19 ->
    2^13 tokens, so depth 2 predicts 1,024 instead of 65,536): the rounding to whole micro-batches
    and the resume logic under test are the same, at 3 micro-batches a step instead of 171."""
    from nanochat import training
    monkeypatch.setattr(training, "REF_BATCH_TOKENS", 2**13)
    auto = [a for a in TINY if a not in ("--total-batch-size", "512")]
    assert len(auto) == len(TINY) - 2
    args = auto + env + ["--device-batch-size", "6", "--num-iterations", "3", "--save-every", "2",
                         "--model-tag", "autob"]
    full = _train(args)
    saved = ck.read_meta(ck.checkpoint_dir("base", "autob", base_dir), 2)["train"]["total_batch_size"]
    assert saved == 1152 and saved % (4 * 64) != 0   # the auto total 1,024 was rounded up to 3 x (6 x 64)
    resumed = _train(args + ["--resume", "2", "--device-batch-size", "3"])
    assert resumed["losses"][2] == pytest.approx(full["losses"][2], rel=1e-5, abs=1e-5)
    with pytest.raises(ValueError, match=r"^--device-batch-size 4: the checkpoint's total batch of .* resume "
                                         r"with a --device-batch-size that divides it: 1, 2, 3, "):
        _train(args + ["--resume", "2", "--device-batch-size", "4"])


def test_several_source_tags_ask_for_model_tag_not_for_training_one(tmp_path):
    """mid_train / chat_sft / chat_rl without --model-tag, with several source tags and no d<N>
    among them, said 'none was found (several base model tags ...; pass --model-tag); create it
    with `python -m scripts.base_train --model-tag <tag>`': checkpoints exist, the flag is missing."""
    from nanochat.chat_start import resolve_source

    for tag in ("alpha", "beta"):
        (tmp_path / "checkpoints" / "base" / tag).mkdir(parents=True)
    with pytest.raises(ck.CheckpointError) as e:
        resolve_source("mid", "base", None, tmp_path)
    assert "none was found" not in str(e.value) and "base_train" not in str(e.value)
    assert str(e.value).endswith("['alpha', 'beta']; pass --model-tag")
    # no tags at all (and a named tag without checkpoints): still how to make one
    with pytest.raises(ck.CheckpointError, match=r"none was found .* create it with `python -m scripts.base_train"):
        resolve_source("mid", "base", None, tmp_path / "empty")
    with pytest.raises(ck.CheckpointError, match=r"none was found .*--model-tag alpha`"):
        resolve_source("mid", "base", "alpha", tmp_path)


def test_fsdp_without_torchrun_says_what_it_needs(monkeypatch):
    """--fsdp outside torchrun said '--fsdp: got True; accepted: a torchrun launch (...)'."""
    from scripts.base_train import parse_config

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError) as e:
        parse_config(["--fsdp", "--sample-every", "-1"])
    assert "got True" not in str(e.value)
    assert str(e.value).startswith("--fsdp needs a torchrun launch (torchrun --nproc_per_node=N -m scripts.base_train")


def test_base_train_resume_help_matches_what_auto_does(capsys):
    """base_train's --help promised that --resume auto starts fresh when the tag's latest checkpoint
    cannot be continued (the chat stages' rule); base_train refuses such a resume instead."""
    from scripts.base_train import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "refused like latest when these flags cannot continue it" in text
    assert "else a fresh start that moves the earlier run's checkpoints" not in text
