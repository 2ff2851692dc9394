"""The compile warm-up before the training loop (nanochat/training.py's warm_up_compile) and
--peak-flops of the chat stages.

1. DESIGN.md pitfall 3 (GB10's unified memory): compile the evaluation graph up front, not lazily
   mid-run. A torch.compile'd single-process run resumed at a step that is not a multiple of
   --eval-every (or whose checkpoint had evaluated at its own step) first compiled the evaluation
   forward at its first evaluation, mid-run; only multi-rank runs warmed up (pitfall 9). Now every
   compiled run whose first evaluation is not at its first step warms the evaluation graph up before
   the loop and says so; a run that evaluates at its first step pays nothing extra, an uncompiled
   run does nothing. torch.compile stands in as the eager model (inductor on a CPU is too slow for
   CI): these test the decision and the call.
2. mid_train / chat_sft took no --peak-flops (chat_train passed None to resolve_peak_flops), so an
   unknown GPU could never get MFU there; now they take base_train's flag, checked alike.
"""
from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch

from nanochat import training
from nanochat.training import first_eval_step, warm_up_compile


# ------------------------------------------------------------------ the decision

@pytest.mark.parametrize("every, start, n, evaluated_at, first", [
    (10, 0, 100, None, 0),       # a fresh run evaluates at step 0
    (10, 25, 100, None, 30),     # a resume between evaluations: the next multiple
    (10, 20, 100, 20, 30),       # its checkpoint evaluated at its own step: not again
    (10, 20, 100, None, 20),     # a checkpoint from before evaluated_at was recorded
    (10, 95, 100, None, 100),    # the last step always evaluates
    (10, 100, 100, 100, None),   # resumed at the last step, evaluated there already: never
    (10, 100, 100, None, 100),
    (-1, 25, 100, None, None),   # --eval-every -1 / 0: never
    (0, 0, 100, None, None),
    (7, 3, 5, None, 5),          # the next multiple lies past the end: the last step
])
def test_first_eval_step_follows_the_loops_rule(every, start, n, evaluated_at, first):
    assert first_eval_step(every, start, n, evaluated_at) == first


# ------------------------------------------------------------------ the call, on a tiny CPU model

def _recorded_model():
    from nanochat.gpt import GPT, config_for_depth
    torch.manual_seed(0)
    model = GPT(config_for_depth(1, 97, 16, aspect_ratio=32, head_dim=16))
    model.init_weights()
    seen = []
    real_forward = model.forward

    def forward(idx, targets, loss_reduction="mean"):
        seen.append((tuple(idx.shape), loss_reduction, model.training, torch.is_grad_enabled()))
        return real_forward(idx, targets, loss_reduction=loss_reduction)
    model.forward = forward
    return model, seen


def _warm(model, *, compiled=True, world_size=1, every=10, n=100, loop_state=None):
    said = []
    rt = SimpleNamespace(world_size=world_size, device=torch.device("cpu"))
    took = warm_up_compile(model, 2, 16, 97, rt, compiled=compiled, eval_every=every, num_iterations=n,
                           loop_state=loop_state, say=said.append)
    return took, said


def test_a_resumed_compiled_single_process_run_warms_the_eval_graph_up():
    model, seen = _recorded_model()
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    took, said = _warm(model, loop_state={"step": 25})
    # evaluate_bpb's call: eval mode, no grad, per-token losses, at the loop's batch shape
    assert seen == [((2, 16), "none", False, False)] and took is not None and took >= 0
    assert len(said) == 1 and "evaluation graph" in said[0] and "step 30" in said[0], said
    # and no trace: train mode back, no gradient, no weight changed, no random number drawn
    assert model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    model, seen = _recorded_model()   # resumed at a multiple whose checkpoint evaluated there
    assert _warm(model, loop_state={"step": 20, "evaluated_at": 20})[0] is not None and len(seen) == 1


@pytest.mark.parametrize("compiled, every, loop_state", [
    (True, 10, None),                    # a fresh run evaluates at step 0: compiled there, not twice
    (True, 10, {"step": 20}),            # a resume that evaluates at its first step
    (True, -1, {"step": 25}),            # never evaluates
    (True, 10, {"step": 100, "evaluated_at": 100}),
    (False, 10, {"step": 25}),           # uncompiled: nothing to warm up
])
def test_no_warm_up_where_nothing_would_compile_mid_run(compiled, every, loop_state):
    model, seen = _recorded_model()
    assert _warm(model, compiled=compiled, every=every, loop_state=loop_state) == (None, [])
    assert seen == []


@pytest.mark.parametrize("loop_state, evaluates", [(None, True), ({"step": 25}, True),
                                                   ({"step": 100, "evaluated_at": 100}, False)])
def test_several_ranks_warm_up_the_step_and_the_eval_on_every_rank(monkeypatch, loop_state, evaluates):
    from nanochat import distributed
    calls = []
    monkeypatch.setattr(distributed, "warm_up_ranks", lambda *a, **kw: calls.append((a[1:4], kw)) or 1.5)
    took, said = _warm(object(), world_size=2, loop_state=loop_state)
    assert took == 1.5 and said == ["compile warm-up on 2 ranks: 1.5 s"]
    assert calls == [((2, 16, 97), {"loss_reduction": None, "around": None, "evaluates": evaluates})]
    assert _warm(object(), compiled=False, world_size=2) == (None, []) and len(calls) == 1


# ------------------------------------------------------------------ base_train and chat_sft, end to end

BASE = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "L", "--sample-every", "-1",
        "--eval-tokens", "128", "--wandb", "off", "--model-tag", "w"]


def _events(monkeypatch, *eval_owners) -> list[str]:
    """Records, in order: torch.compile calls, the warm-up's eval forward, training steps, evaluations.
    torch.compile returns the model itself (eager)."""
    events: list[str] = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: events.append("compile") or model)
    real_warm, real_step = training.compile_eval_forward, training.Trainer.step
    monkeypatch.setattr(training, "compile_eval_forward", lambda *a: events.append("warm") or real_warm(*a))
    monkeypatch.setattr(training.Trainer, "step", lambda self, s: events.append("step") or real_step(self, s))
    for owner in eval_owners:
        real_eval = owner.evaluate_bpb
        monkeypatch.setattr(owner, "evaluate_bpb",
                            lambda *a, _real=real_eval, **kw: events.append("eval") or _real(*a, **kw))
    return events


def test_base_train_resumed_compiled_warms_the_eval_graph_up(env, monkeypatch, capsys):
    """Resumed at step 2 with --eval-every 3: the evaluation graph compiled before the first step,
    said in one line; the fresh compiled run evaluated at step 0 and had no warm-up (not twice)."""
    from nanochat import writer_lock
    from scripts import base_train
    events = _events(monkeypatch, base_train)
    base_train.main(BASE + env + ["--num-iterations", "3", "--eval-every", "3", "--save-every", "2", "--compile"])
    writer_lock.release_all()
    assert events == ["compile", "eval", "step", "step", "step", "eval"], events
    assert "compile warm-up" not in capsys.readouterr().out
    events.clear()
    base_train.main(BASE + env + ["--num-iterations", "3", "--eval-every", "3", "--resume", "2", "--compile"])
    writer_lock.release_all()
    assert events == ["compile", "warm", "step", "eval"], events
    out = capsys.readouterr().out
    assert len(re.findall(r"^compile warm-up: the evaluation graph compiled before the loop .*step 3\b", out,
                          re.M)) == 1, out
    events.clear()   # uncompiled: nothing extra
    base_train.main(BASE + env + ["--num-iterations", "3", "--eval-every", "3", "--resume", "2", "--no-compile"])
    writer_lock.release_all()
    assert events == ["step", "eval"] and "compile warm-up" not in capsys.readouterr().out


def test_chat_sft_resumed_compiled_warms_up_and_takes_peak_flops(env, monkeypatch, capsys):
    """chat_sft (chat_train, mid_train's recipe too) resumed at step 1 with --eval-every 2 warms the
    eval graph up; --peak-flops gives its log line an MFU (it was always n/a on a CPU or unknown GPU)."""
    from nanochat import eval_bpb, writer_lock
    from scripts import base_train, chat_sft
    base_train.main(BASE + env + ["--num-iterations", "1", "--eval-every", "-1", "--no-compile", "--model-tag", "c"])
    writer_lock.release_all()
    sft = ["--source", "base", "--model-tag", "c", "--device", "cpu", "--device-batch-size", "2", "--max-seq-len",
           "64", "--test-holdout", "100", "--eval-tokens", "128", "--total-batch-size", "128", "--wandb", "off",
           "--num-iterations", "2", "--eval-every", "2"]
    chat_sft.main(sft + ["--save-every", "1", "--no-compile"])
    writer_lock.release_all()
    assert re.search(r"\| mfu +n/a \|", capsys.readouterr().out)
    events = _events(monkeypatch, eval_bpb)
    chat_sft.main(sft + ["--resume", "1", "--compile", "--peak_flops", "1e12"])
    writer_lock.release_all()
    assert events == ["compile", "warm", "step", "eval"], events
    out = capsys.readouterr().out
    assert len(re.findall(r"^compile warm-up: the evaluation graph .*step 2\b", out, re.M)) == 1, out
    assert re.search(r"\| mfu +\d+\.\d\d% \|", out) and not re.search(r"\| mfu +n/a", out), out


# ------------------------------------------------------------------ --peak-flops of the chat stages

@pytest.mark.parametrize("script", ["mid_train", "chat_sft"])
def test_chat_stages_take_peak_flops_as_base_train_does(script):
    import importlib

    from nanochat.chat_flags import CHAT_FLAG_HELP
    from scripts import base_train
    parse = importlib.import_module(f"scripts.{script}").parse
    assert parse([]).peak_flops is None
    assert parse(["--peak-flops", "1e14"]).peak_flops == parse(["--peak_flops", "1e14"]).peak_flops == 1e14
    for bad in ("0", "989", "nan", "inf", "-1e14"):   # 989: TFLOP/s, not FLOP/s
        with pytest.raises(ValueError, match="--peak-flops"):
            parse(["--peak-flops", bad])
        with pytest.raises(ValueError, match="--peak-flops"):
            base_train.parse_config(["--peak-flops", bad])
    assert CHAT_FLAG_HELP["peak_flops"] == base_train.BASE_FLAG_HELP["peak_flops"] == training.PEAK_FLOPS_HELP


def test_mid_train_hands_peak_flops_on_to_chat_sft():
    """The next stage's command carries the device the user picked, and now its peak."""
    from nanochat.chat_flags import next_commands
    from nanochat.chat_train import MID
    from scripts import mid_train
    (what, command), = next_commands(MID, mid_train.parse(["--peak-flops", "2e14"]), "d4")
    assert "chat_sft" in command and "--peak-flops 2" in command
    from scripts import chat_sft
    assert chat_sft.parse(command.split("chat_sft", 1)[1].split()).peak_flops == 2e14
