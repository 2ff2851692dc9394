"""A user's sixth review of base pretraining on CPU (scripts/base_train.py, nanochat/loop.py): the
banner's optimizer rows, the checkpoint's record of the resolved recipe and the --eval-tokens
message. Each test failed on the code before its fix."""

from __future__ import annotations

import re

import pytest

from nanochat import checkpoint as ck

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "SL", "--recipe", "v1",
        "--sample-every", "-1", "--eval-every", "-1", "--eval-tokens", "128", "--no-compile",
        "--num-iterations", "2", "--save-every", "1"]


def _muon_rows(out: str) -> list[str]:
    rows = [line for line in out.splitlines() if line.startswith("LR group") and "'muon'" in line]
    assert rows, out
    return rows


def test_banner_optimizer_rows_and_checkpoint_recipe_say_what_the_run_applies(env, base_dir, capsys):
    """The banner's LR-group rows printed the groups' own momentum and weight decay: a fresh run's
    build_optimizer default momentum 0.95, which no step applies (v1 starts at 0.85), and on a
    resume the checkpoint's last applied weight decay (0.0) where this run's --weight-decay 0.2
    replaced it. The checkpoint recorded the recipe's name and the flags given, not the LRs and
    weight decay it resolved them to."""
    from nanochat.optim import muon_momentum
    from scripts import base_train

    args = TINY + env + ["--model-tag", "banner"]
    base_train.main(args)
    fresh = _muon_rows(capsys.readouterr().out)
    assert all("'momentum': 0.85," in row for row in fresh), fresh

    base_train.main(args + ["--resume", "1", "--weight-decay", "0.2"])
    resumed = _muon_rows(capsys.readouterr().out)
    assert all(f"'momentum': {round(muon_momentum(1), 6)}," in row and "'weight_decay': 0.2," in row
               for row in resumed), resumed

    meta = ck.read_meta(ck.checkpoint_dir("base", "banner", base_dir), 2)
    rec = meta["train"]["optimizer_recipe"]
    assert rec["name"] == "v1" and rec["weight_decay"] == 0.2 and rec["matrix_lr"] == 0.02
    assert rec["warmdown_ratio"] == 0.4 and rec["overridden"] == ["weight_decay"]


def test_eval_tokens_below_one_micro_batch_names_the_product():
    """'--eval-tokens: got 100; accepted: an integer >= 65536' left the user to work out that 65536
    is --device-batch-size x --max-seq-len (x ranks)."""
    from scripts.base_train import parse_config

    with pytest.raises(ValueError) as e:
        parse_config(["--eval-tokens", "100", "--device-batch-size", "4", "--max-seq-len", "256"])
    assert re.search(r"^--eval-tokens: got 100; accepted: at least one micro-batch, "
                     r"--device-batch-size x --max-seq-len = 4 x 256 = 1,024$", str(e.value))


def test_eval_tokens_of_one_micro_batch_is_accepted_on_many_ranks(monkeypatch):
    """Eval batches are of all ranks together (eval_bpb.EvalBatches; a rank without one runs a
    stand-in forward): one micro-batch is enough on 8 ranks too, where it was refused (x world size)."""
    from scripts.base_train import parse_config

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    cfg = parse_config(["--eval-tokens", "1024", "--device-batch-size", "4", "--max-seq-len", "256",
                        "--total-batch-size", "8192"])
    assert cfg.eval_tokens == 1024


def test_hangup_fallback_survives_a_base_dir_that_cannot_be_made(tmp_path, monkeypatch):
    """move_output_off_terminal (run in the SIGHUP / broken-pipe handlers) falls back to /dev/null
    when <base dir>/hangup.log cannot be opened; get_base_dir now raises a RequestError for a
    directory that cannot be made, which the fallback did not catch: the handler crashed the run."""
    import os

    from nanochat.loop import move_output_off_terminal

    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(blocker / "base"))
    r, w = os.pipe()
    try:
        assert move_output_off_terminal("test", fds=(w,)) == __import__("pathlib").Path(os.devnull)
    finally:
        os.close(r)
        os.close(w)
