"""Review of mid_train / chat_sft as a user runs them: the start-up banner names the source
checkpoint's sha256, the mixture by source, the steps in epochs and what each `auto` became; a
Ctrl-C names the exact command that resumes (without the --overwrite a resume refuses) and that
command continues bit for bit; the end names the next stage's command for the tag trained (mid ->
chat_sft with the user's data flags, SFT -> chat_eval / chat_web), and that command runs; an SFT run
with no mid checkpoint names the base tag there is. One tiny base checkpoint per module."""

from __future__ import annotations

import os
import shlex
import signal

import pytest
import torch

from nanochat import checkpoint as ck

TAG = "rv"
MID = ["--device", "cpu", "--model-tag", TAG, "--device-batch-size", "2", "--max-seq-len", "64",
       "--total-batch-size", "128", "--test-holdout", "50", "--eval-tokens", "128", "--no-compile"]


def train_tiny_base(base_dir, tiny_corpus, tag: str):
    """base/<tag> step 1 (a depth-1 model of 64-token rows) in base_dir: the chat-stage tests' start."""
    from scripts import base_train
    argv = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
            "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "L", "--sample-every", "-1",
            "--eval-every", "-1", "--no-compile", "--model-tag", tag, "--num-iterations", "1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(base_dir))
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE", "NANOCHAT_SETUP_STAGE"):
            mp.delenv(var, raising=False)
        base_train.main(argv + ["--data-dir", str(tiny_corpus)])
    return base_dir


@pytest.fixture(scope="module")
def base_ckpt(base_dir, tiny_corpus):
    """base/rv step 1 (a depth-1 model of 64-token rows) in the module's base dir."""
    return train_tiny_base(base_dir, tiny_corpus, TAG)


@pytest.fixture
def user(env, base_ckpt, monkeypatch):
    monkeypatch.delenv("NANOCHAT_SETUP_STAGE", raising=False)   # a user at a terminal, not setup.sh
    return base_ckpt


def test_sft_without_a_mid_checkpoint_names_the_base_tag_there_is(user):
    """chat_sft's default --source mid with only a base model: the error said `mid_train --model-tag
    <tag>` and "(base)"; it names the base model's tag and that base/<tag> is there to start from."""
    from scripts import chat_sft
    with pytest.raises(ck.CheckpointError) as e:
        chat_sft.main(["--device", "cpu", "--test-holdout", "50"])
    assert str(e.value).endswith(f"create it with `python -m scripts.mid_train --model-tag {TAG}`, or pick another "
                                 f"--source (base: base/{TAG} is there)")


def test_a_stop_names_the_resume_command_and_it_continues_bit_for_bit(user, monkeypatch, capsys):
    """Ctrl-C in step 1 of a run started with --overwrite: the stop said "continue with --resume
    latest", and the same flags plus --resume latest are refused with --overwrite. It now names the
    whole command; run as given, it ends on the weights, optimizer state and val bpb of a run
    never stopped. The stopped checkpoint's meta says which step its val bpb is from. (The resume
    runs as setup.sh's would: no `next` line, setup.sh runs the next stage.)"""
    from nanochat import training
    from nanochat.loop import StopRequested
    from scripts import mid_train

    args = MID + ["--num-iterations", "3", "--eval-every", "2", "--identity", "Zed Q"]
    whole = mid_train.main(args + ["--overwrite"])
    d = ck.checkpoint_dir("mid", TAG)
    a = ck.load_checkpoint(d, 3, load_optimizer=True)
    real = training.Trainer.step

    def step(self, s):
        if s == 1:
            os.kill(os.getpid(), signal.SIGINT)   # a Ctrl-C while step 1 runs
        return real(self, s)
    monkeypatch.setattr(training.Trainer, "step", step)
    with pytest.raises(StopRequested) as e:
        mid_train.main(args + ["--overwrite"])
    monkeypatch.setattr(training.Trainer, "step", real)
    assert e.value.exit_code == 130
    head, command = str(e.value).split("; continue with --resume latest: ")
    assert head.startswith("stopped by SIGINT at step 2 of 3")
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "scripts.mid_train"] and "--overwrite" not in argv
    assert argv[-2:] == ["--resume", "latest"] and argv[argv.index("--identity") + 1] == "Zed Q"
    assert ck.read_meta(d, 2)["val_bpb_step"] == 0   # measured at step 0, saved at step 2
    capsys.readouterr()
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "mid")   # as setup.sh's rerun: it runs chat_sft itself
    resumed = mid_train.main(argv[3:])
    out = capsys.readouterr().out
    assert f"resuming from {d / 'step_000002'}: continues at step 2" in out and "\nnext" not in out
    assert sorted(resumed["losses"]) == [2] and resumed["losses"][2] == whole["losses"][2]
    assert resumed["final_val_bpb"] == whole["final_val_bpb"]
    b = ck.load_checkpoint(d, 3, load_optimizer=True)
    assert a["model"].keys() == b["model"].keys() and all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    assert a["loader"] == b["loader"] and ck.read_meta(d, 3)["val_bpb_step"] == 3


def test_banner_and_next_commands_of_mid_then_sft(user, capsys, monkeypatch):
    """The banner names the source's sha256, the mixture by source, the steps in epochs, the auto
    choices; the end of mid names chat_sft for its tag with the user's flags (that command runs:
    its SFT has the identity name mid had), the end of SFT chat_eval and chat_web."""
    from scripts import chat_eval, chat_sft, chat_web, mid_train

    mid = mid_train.main(MID[2:] + ["--num-iterations", "2", "--eval-every", "-1", "--identity", "Zed Q",
                                    "--overwrite"])   # --device left to auto
    out = capsys.readouterr().out
    sha = ck.model_digest(ck.checkpoint_dir("base", TAG), 1)
    assert f"Midtraining: base/{TAG} step 1 (model.pt sha256 {sha[:12]}) -> " in out
    assert "conversations (mask all, fill crop): chat " in out and "Identity 1,000 x2, MMLU " in out
    assert "SimpleSpelling 200,000, SpellingBee 80,000\n" in out
    assert "2 iterations = " in out and " epochs of the mixture (one is ~" in out
    assert 0 < mid["epochs"] < 0.01
    assert "  auto: --device cpu; --dtype fp32\n" in out   # --no-compile was given
    nxt = [line for line in out.splitlines() if line.startswith("next")]
    assert nxt == [f"next, fine-tune it for chat: python -m scripts.chat_sft --model-tag {TAG} --no-compile "
                   "--test-holdout 50 --max-seq-len 64 --identity 'Zed Q'"]

    monkeypatch.setattr("nanochat.chat_data.SFT_CONVERSATIONS", 200)   # a smaller SFT mixture: a faster epoch estimate
    sft_argv = shlex.split(nxt[0].split(": ", 1)[1])[3:]
    sft = chat_sft.main(sft_argv + ["--num-iterations", "1", "--eval-every", "-1", "--device-batch-size", "8"])
    out = capsys.readouterr().out
    assert f"Chat SFT: mid/{TAG} step 2 (model.pt sha256 " in out and "--identity Zed Q: the identity" in out
    assert ck.read_meta(ck.checkpoint_dir("sft", TAG))["train"]["mixture"]["identity"] == "Zed Q"
    assert sft["model_tag"] == TAG
    nxt = [line for line in out.splitlines() if line.startswith("next")]
    assert nxt == [f"next, evaluate it: python -m scripts.chat_eval -i sft --model-tag {TAG}",
                   f"next, talk to it: python -m scripts.chat_web -i sft --model-tag {TAG}"]
    ev = chat_eval.parse_args(shlex.split(nxt[0].split(": ", 1)[1])[3:])
    web = chat_web.parse_args(shlex.split(nxt[1].split(": ", 1)[1])[3:])
    assert (ev.source, ev.model_tag, web.source, web.model_tag) == ("sft", TAG, "sft", TAG)


def test_epochs_are_said_when_the_mixture_repeats():
    """More steps than the mixture holds: the loader loops over it again, which the banner says;
    -1 with a mixture smaller than one step trains it several times over in that step."""
    from nanochat.chat_flags import describe_epochs, epochs_of
    assert epochs_of(30, 4, 40.0) == 3.0
    assert describe_epochs(30, 30, 10, 3.0) == ("30 iterations = 3 epochs of the mixture (one is ~10 steps; its "
                                                "conversations repeat, each epoch in a new order)")
    assert describe_epochs(5, 5, 10, 0.5) == "5 iterations = 0.5 epochs of the mixture (one is ~10 steps)"
    assert describe_epochs(10, -1, 10, 1.02) == "10 iterations (-1: one epoch of the mixture)"
    assert describe_epochs(1, -1, 1, 4.0) == "1 iteration (-1: one epoch of the mixture; a step holds 4 epochs of it)"


def test_next_commands_carry_the_data_flags_only(tmp_path):
    """Flags the next stage needs for the same data go with it (--data-dir to chat_eval too);
    others (batch, lr, seed, --overwrite) do not."""
    from nanochat.chat_flags import next_commands, parse_config
    from nanochat.chat_train import MID, SFT
    own = tmp_path / "my chats.jsonl"
    own.write_text("")
    argv = ["--model-tag", "d4", "--device", "cuda", "--data-dir", str(tmp_path), "--extra-conversations", str(own),
            "--no-identity", "--seed", "3", "--device-batch-size", "8", "--matrix-lr", "0.01", "--overwrite"]
    (cmd,) = [c for _, c in next_commands(MID, parse_config(MID, argv), "d4")]
    assert shlex.split(cmd) == ["python", "-m", "scripts.chat_sft", "--model-tag", "d4", "--device", "cuda",
                                "--data-dir", str(tmp_path), "--extra-conversations", str(own), "--no-identity"]
    ev, web = [shlex.split(c) for _, c in next_commands(SFT, parse_config(SFT, argv), "d4")]
    assert ev[3:] == ["-i", "sft", "--model-tag", "d4", "--device", "cuda", "--data-dir", str(tmp_path)]
    assert web[3:] == ["-i", "sft", "--model-tag", "d4", "--device", "cuda"]
