"""Review 12 of the chat stages' resume safety (mid_train / chat_sft / chat_rl), as base_train has it:
one resume command (loop.resume_command, chat's own spelling of --identity), which an out-of-memory
stop of mid / SFT now names too (at the lower --device-batch-size, with the run's total batch where
--total-batch-size -1 would round to another), and chat_rl's stop names; a resume names each flag
that differs from the checkpoint's run (a new --eval-tokens, --max-new-tokens, ... was taken
without a word); chat_rl's resume of an older step moves the later steps (the run it branches
from) to earlier_runs/ instead of replacing them one by one. One tiny base checkpoint per module."""

from __future__ import annotations

import os
import shlex
import signal

import pytest

from nanochat import checkpoint as ck
from nanochat.loop import CPU_OUT_OF_MEMORY, StopRequested
from tests.test_engine import tiny_chat_model
from tests.test_chat_stage_review import train_tiny_base

TAG = "r12"
MID = ["--device", "cpu", "--model-tag", TAG, "--device-batch-size", "2", "--max-seq-len", "64",
       "--total-batch-size", "128", "--test-holdout", "50", "--eval-every", "-1", "--no-compile",
       "--save-every", "1"]
DIFFER = "--resume: these flags differ from the checkpoint's run, and this run's apply: "


@pytest.fixture(scope="module")
def base_ckpt(base_dir, tiny_corpus):
    """base/r12 step 1 (a depth-1 model of 64-token rows) in the module's base dir."""
    return train_tiny_base(base_dir, tiny_corpus, TAG)


@pytest.fixture
def user(env, base_ckpt, monkeypatch):
    monkeypatch.delenv("NANOCHAT_SETUP_STAGE", raising=False)   # a user at a terminal, not setup.sh
    return base_ckpt


def _differ(out: str) -> list[str]:
    return [line.removeprefix(DIFFER) for line in out.splitlines() if line.startswith(DIFFER)]


def test_chat_resume_command_is_loops_with_its_own_identity_spelling(tmp_path):
    """chat_flags had its own copy of the flag spelling and the command; it now goes through
    loop.resume_command, so an out-of-memory stop's overrides reach it, and --identity "" still
    reads --no-identity, a False --compile --no-compile."""
    from nanochat.chat_flags import parse_config, resume_command
    from nanochat.chat_train import MID as STAGE
    own = tmp_path / "my chats.jsonl"
    own.write_text("")
    cfg = parse_config(STAGE, ["--no-compile", "--no-identity", "--extra-conversations", str(own), "--overwrite",
                               "--device-batch-size", "4", "--no-decontaminate"])
    argv = shlex.split(resume_command(STAGE, cfg, "d4", 1, device_batch_size=2, resume="7"))
    assert argv == ["python", "-m", "scripts.mid_train", "--model-tag", "d4", "--device-batch-size", "2",
                    "--no-compile", "--extra-conversations", str(own), "--no-identity", "--no-decontaminate",
                    "--resume", "7"]
    assert resume_command(STAGE, cfg, "d4", 2).startswith("torchrun <your launch options> -m scripts.mid_train ")


def test_a_mid_resume_names_the_flags_that_differ(user, capsys):
    """A resume with another --device-batch-size, --eval-tokens and --keep-last: one line names them,
    and not the --num-iterations the schedule's own line names."""
    from scripts import mid_train
    mid_train.main(MID + ["--num-iterations", "2", "--overwrite"])
    capsys.readouterr()
    mid_train.main(MID[:5] + ["1"] + MID[6:] + ["--num-iterations", "3", "--eval-tokens", "256", "--keep-last", "1",
                                                "--resume", "latest"])
    out = capsys.readouterr().out
    assert _differ(out) == ["--device-batch-size 2 -> 1, --eval-tokens -1 -> 256, --keep-last 0 -> 1"], out
    assert "--num-iterations 2 -> 3" in out


def test_an_sft_out_of_memory_stop_names_the_command_that_resumes_it(user, monkeypatch, capsys):
    """--device-batch-size 3 under --total-batch-size -1 (SFT's 32 rows, rounded up to 33) runs out of
    memory in step 1, after step 1's save: the hint names the command that resumes step 1 at device
    batch 1 with the run's --total-batch-size (at device batch 1, -1 makes 32 rows, which the resume
    refuses); that command continues it, naming only the device batch as changed. (mid / SFT said
    no command at all.)"""
    from nanochat import training
    from scripts import chat_sft
    monkeypatch.setattr("nanochat.chat_data.SFT_CONVERSATIONS", 200)   # a faster epoch estimate
    args = ["--device", "cpu", "--source", "base", "--model-tag", TAG, "--device-batch-size", "3", "--max-seq-len",
            "64", "--test-holdout", "50", "--eval-every", "-1", "--no-compile", "--num-iterations", "2",
            "--save-every", "1", "--overwrite"]
    real = training.Trainer.step

    def step(self, s):
        if s == 1:
            raise RuntimeError(f"{CPU_OUT_OF_MEMORY} 123 bytes")
        return real(self, s)
    monkeypatch.setattr(training.Trainer, "step", step)
    with pytest.raises(ValueError, match="out of CPU memory in step 1") as err:
        chat_sft.main(args)
    monkeypatch.setattr(training.Trainer, "step", real)
    argv = shlex.split(str(err.value).split("; resume with: ")[1])
    assert argv[:5] == ["python", "-m", "scripts.chat_sft", "--model-tag", TAG] and "--overwrite" not in argv
    assert argv[argv.index("--device-batch-size") + 1] == "1"
    assert argv[argv.index("--total-batch-size") + 1] == str(33 * 64) and argv[-2:] == ["--resume", "1"]
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "sft")   # no "next" lines
    capsys.readouterr()
    assert sorted(chat_sft.main(argv[3:])["losses"]) == [1]
    assert _differ(capsys.readouterr().out) == ["--device-batch-size 3 -> 1"]


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's (never modified here)


RL = ["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
      "--max-new-tokens", "4", "--test-holdout", "1", "--eval-every", "-1", "--save-every", "1"]


def test_chat_rl_resume_of_an_older_step_moves_the_later_ones_aside(sft_checkpoint, chat_model, capsys):
    """--resume 1 in a tag holding steps 1 and 2: the new run's step 2 replaced the old one in place,
    mixing two runs' steps in the tag; the old step 2 now goes to earlier_runs/ at the first save
    (whole, as it was). The resume names the flag it changed."""
    from scripts import chat_rl
    chat_rl.main(RL + ["--num-iterations", "2"])
    d = ck.checkpoint_dir("rl", "d2")
    old = ck.model_digest(d, 2)
    capsys.readouterr()
    chat_rl.main(RL[:9] + ["5"] + RL[10:] + ["--num-iterations", "2", "--resume", "1"])
    out = capsys.readouterr().out
    assert "--resume 1: the checkpoints after step 1 in " in out and _differ(out) == ["--max-new-tokens 4 -> 5"]
    aside = d / "earlier_runs" / "1"
    assert ck.list_steps(aside) == [2] and ck.model_digest(aside, 2) == old
    assert ck.list_steps(d) == [1, 2] and ck.read_latest(d) == 2
    ck.load_checkpoint(aside, 2)   # still whole and verifiable where it went


def test_chat_rl_stop_names_the_resume_command(sft_checkpoint, chat_model, monkeypatch, capsys):
    """Ctrl-C in step 0 of an --overwrite run: the stop said "continue with --resume latest" (the same
    flags plus that are refused with --overwrite); it names the whole command, which continues the
    run without naming any flag as changed."""
    from nanochat.rl import PolicyGradientTrainer
    from scripts import chat_rl
    monkeypatch.delenv("NANOCHAT_SETUP_STAGE", raising=False)
    args = RL + ["--num-iterations", "2", "--seed", "3"]
    chat_rl.main(args)
    real = PolicyGradientTrainer.step

    def step(self, s):
        if s == 0:
            os.kill(os.getpid(), signal.SIGINT)   # a Ctrl-C while step 0 runs
        return real(self, s)
    monkeypatch.setattr(PolicyGradientTrainer, "step", step)
    with pytest.raises(StopRequested) as e:
        chat_rl.main(args + ["--overwrite"])
    monkeypatch.setattr(PolicyGradientTrainer, "step", real)
    head, command = str(e.value).split("; continue with --resume latest: ")
    assert head.startswith("stopped by SIGINT at step 1 of 2") and e.value.exit_code == 130
    argv = shlex.split(command)
    assert argv[:5] == ["python", "-m", "scripts.chat_rl", "--model-tag", "d2"] and "--overwrite" not in argv
    assert argv[argv.index("--seed") + 1] == "3" and argv[-2:] == ["--resume", "latest"]
    capsys.readouterr()
    assert sorted(chat_rl.main(argv[3:])["losses"]) == [1]
    assert _differ(capsys.readouterr().out) == []
