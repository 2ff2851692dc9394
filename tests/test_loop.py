"""nanochat/loop.py: a step that runs out of GPU memory ends the recipe with one line that names the
flag to lower and keeps the total batch (RequestError, printed by common.script_main), not a
traceback from deep inside the compiled step."""

import os
import signal
import types

import pytest
import torch

from nanochat.errors import RequestError
from nanochat.loop import LoopSpec, run_training_loop
from nanochat.training import BatchPlan


class _OomTrainer:
    def __init__(self, plan, fail_at):
        self.plan, self.fail_at, self.steps = plan, fail_at, []

    def step(self, step):
        if step == self.fail_at:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB")
        self.steps.append(step)
        raise AssertionError("the test's loop should have stopped")


def _run(trainer):
    spec = LoopSpec("base", num_iterations=4, report=False)
    with pytest.raises(RequestError) as info:
        run_training_loop(trainer, meter=None, spec=spec, start_step=2)
    assert isinstance(info.value.__cause__, torch.cuda.OutOfMemoryError)
    return str(info.value)


def test_out_of_memory_names_the_device_batch_and_keeps_the_total():
    plan = BatchPlan(total_batch_size=524_288, device_batch_size=32, seq_len=2048, world_size=1,
                     grad_accum_steps=8)
    msg = _run(_OomTrainer(plan, fail_at=2))
    assert msg.startswith("--device-batch-size 32 x --max-seq-len 2048: out of GPU memory in step 2")
    assert "lower --device-batch-size (e.g. 16)" in msg and "524,288 tokens per step" in msg


def test_out_of_memory_under_setup_sh_names_setup_sh_s_flag(monkeypatch):
    """setup.sh runs the stage with its own flags: the hint named --device-batch-size, which setup.sh
    did not have; now it says how to rerun setup.sh."""
    from nanochat.loop import SETUP_STAGE_ENV

    monkeypatch.setenv(SETUP_STAGE_ENV, "base_train")
    plan = BatchPlan(total_batch_size=524_288, device_batch_size=16, seq_len=2048, world_size=1,
                     grad_accum_steps=16)
    msg = _run(_OomTrainer(plan, fail_at=2))
    assert "; rerun ./setup.sh with --device-batch-size 8 added to its flags (the stage resumes from its last " \
           "checkpoint): gradient accumulation keeps the total batch of 524,288 tokens per step" in msg
    one = BatchPlan(total_batch_size=2048, device_batch_size=1, seq_len=2048, world_size=1, grad_accum_steps=1)
    assert _run(_OomTrainer(one, fail_at=2)).endswith("; rerun ./setup.sh with a smaller --depth")


def test_out_of_memory_suggests_a_device_batch_that_keeps_the_total():
    """The hint said dbs // 2, which need not divide the total (5 -> 2 with a total of 5 x 2048 x 103
    tokens): the resume it advises could not keep the total. It now names the largest device batch
    up to half whose micro-batches divide the total."""
    plan = BatchPlan(total_batch_size=5 * 2048 * 103, device_batch_size=5, seq_len=2048, world_size=1,
                     grad_accum_steps=103)
    assert "lower --device-batch-size (e.g. 1)" in _run(_OomTrainer(plan, fail_at=2))
    plan = BatchPlan(total_batch_size=12 * 1024 * 2 * 4, device_batch_size=12, seq_len=1024, world_size=2,
                     grad_accum_steps=4)
    assert "lower --device-batch-size (e.g. 6)" in _run(_OomTrainer(plan, fail_at=2))
    plan = BatchPlan(total_batch_size=10 * 512 * 3, device_batch_size=10, seq_len=512, world_size=1,
                     grad_accum_steps=3)   # 30 rows per step: 5 divides it, and is half
    assert "lower --device-batch-size (e.g. 5)" in _run(_OomTrainer(plan, fail_at=2))


def test_out_of_memory_at_one_sequence_points_at_length_or_depth():
    plan = BatchPlan(total_batch_size=2048, device_batch_size=1, seq_len=2048, world_size=1, grad_accum_steps=1)
    msg = _run(_OomTrainer(plan, fail_at=2))
    assert msg.endswith("lower --max-seq-len (or base_train's --depth)") and "e.g." not in msg


def test_out_of_memory_without_a_batch_plan():
    msg = _run(_OomTrainer(None, fail_at=2))
    assert msg.startswith("out of GPU memory in step 2") and msg.endswith("lower the device batch size")



def test_out_of_cpu_memory_gets_the_same_hint_and_other_errors_pass_through():
    """On the CPU an allocation that cannot be met is a plain RuntimeError from torch's allocator:
    it ended the run with a traceback from deep inside the model instead of the one-line hint a GPU
    run gets. Any other RuntimeError (a NaN stop included) still passes through unchanged."""
    from nanochat.training import NonFiniteLossError

    plan = BatchPlan(total_batch_size=16_384, device_batch_size=8, seq_len=1024, world_size=1, grad_accum_steps=2)

    class CpuOom(_OomTrainer):
        def step(self, step):
            raise self.error

    spec = LoopSpec("base", num_iterations=4, report=False)
    trainer = CpuOom(plan, fail_at=2)
    trainer.error = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                 "memory: you tried to allocate 68719476736 bytes. Error code 12")
    with pytest.raises(RequestError) as info:
        run_training_loop(trainer, meter=None, spec=spec, start_step=2)
    assert str(info.value).startswith("--device-batch-size 8 x --max-seq-len 1024: out of CPU memory in step 2; ")
    assert "lower --device-batch-size (e.g. 4)" in str(info.value) and info.value.__cause__ is trainer.error
    for other in (RuntimeError("shape mismatch"), NonFiniteLossError(2, "loss", float("nan"), None, "hint")):
        trainer.error = other
        with pytest.raises(type(other)) as info:
            run_training_loop(trainer, meter=None, spec=spec, start_step=2)
        assert info.value is other

def test_resume_past_the_last_step_is_refused_before_anything_runs(tmp_path):
    """A checkpoint at step 6 with --num-iterations 4 used to loop forever (step 310/4...): now a
    one-line error naming the steps that can be resumed; at exactly the last step it is allowed."""
    from nanochat import checkpoint as ck
    from nanochat.resume_checks import check_resume_step
    for step in (2, 6):
        ck.save_checkpoint(tmp_path, step, model_state={"w": torch.zeros(1)}, meta={})
    with pytest.raises(RequestError, match="at step 6, past --num-iterations 4.*> 6.*\\[2\\]"):
        check_resume_step(6, 4, tmp_path)
    check_resume_step(4, 4, tmp_path)
    check_resume_step(2, 4, tmp_path)


def test_the_loop_never_runs_past_its_last_step():
    class Trainer:
        def step(self, step):
            raise AssertionError("no step should run")
    res = run_training_loop(Trainer(), meter=None, spec=LoopSpec("base", num_iterations=4, report=False), start_step=6)
    assert res.step == 6 and not res.losses


def test_resume_mismatch_names_the_field_and_its_flag():
    from nanochat.resume_checks import check_resume_compatible
    plan = BatchPlan(total_batch_size=4096, device_batch_size=2, seq_len=1024, world_size=1, grad_accum_steps=2)
    meta = {"model_config": {"n_layer": 2, "n_embd": 128}, "train": {"total_batch_size": 4096, "world_size": 1}}
    with pytest.raises(RequestError, match="n_layer \\(set by base_train --depth\\) 2 but this run has 3"):
        check_resume_compatible(meta, {"n_layer": 3, "n_embd": 128}, plan, 1, "fp")
    with pytest.raises(RequestError, match="--total-batch-size 4096 but this run has 8192"):
        check_resume_compatible(meta, meta["model_config"], BatchPlan(8192, 4, 1024, 1, 2), 1, "fp")
    # 2 -> 3 ranks: the world size is named, not the batch it changes
    with pytest.raises(RequestError, match=r"world size \(torchrun processes\) 1 but this run has 3"):
        check_resume_compatible(meta, meta["model_config"], BatchPlan(6144, 2, 1024, 3, 1), 3, "fp")
    # sharded optimizer state (--fsdp) and whole state do not load into each other: said before the model
    sharded = {**meta, "config": {"fsdp": True}}
    with pytest.raises(RequestError, match=r"--fsdp \(sharded optimizer state\) True but this run has False"):
        check_resume_compatible(sharded, meta["model_config"], plan, 1, "fp", fsdp=False)
    with pytest.raises(RequestError, match=r"no --fsdp \(whole optimizer state\) False but this run has True"):
        check_resume_compatible({**meta, "config": {"fsdp": False}}, meta["model_config"], plan, 1, "fp", fsdp=True)
    check_resume_compatible(sharded, meta["model_config"], plan, 1, "fp", fsdp=True)


class _SignalTrainer:
    """A trainer whose step `at` makes the process signal itself mid-step."""

    def __init__(self, at, signum):
        self.at, self.signum, self.steps = at, signum, []
        self.meter = types.SimpleNamespace(update=lambda result: {}, log_line=lambda metrics, n: "step")

    def step(self, step):
        if step == self.at:
            os.kill(os.getpid(), self.signum)
        self.steps.append(step)
        return types.SimpleNamespace(loss=1.0, extra=None, lrm=1.0)

    def loop_state(self, step, meter, **kw):
        return {"step": step, **kw}

    def note_checkpoint(self, path):
        pass


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_finishes_the_step_saves_and_stops(tmp_path, signame, monkeypatch):
    """SIGTERM (run_train.sh --stop) or a first Ctrl-C: the step in flight completes, a checkpoint
    is saved at the next step index, and StopRequested carries exit code 128 + signal; the
    handlers in place before the loop are back afterwards."""
    from nanochat.loop import SETUP_STAGE_ENV, StopRequested

    monkeypatch.delenv(SETUP_STAGE_ENV, raising=False)   # not started by setup.sh: no "rerun ./setup.sh"
    signum = getattr(signal, signame)
    before = signal.getsignal(signum)
    trainer = _SignalTrainer(at=3, signum=signum)
    saves = []
    spec = LoopSpec("base", num_iterations=10, report=False, save_every=100,
                    save=lambda step, state: saves.append((step, state["step"])) or tmp_path / f"step_{step:06d}")
    with pytest.raises(StopRequested) as info:
        run_training_loop(trainer, meter=trainer.meter, spec=spec)
    assert trainer.steps == [0, 1, 2, 3] and saves == [(4, 4)]
    assert info.value.exit_code == 128 + signum
    assert str(info.value) == (f"stopped by {signame} at step 4 of 10: checkpoint {tmp_path / 'step_000004'} saved; "
                               "continue with --resume latest")
    assert signal.getsignal(signum) == before


def test_the_stop_line_names_setup_sh_only_for_a_stage_setup_sh_runs(tmp_path, monkeypatch):
    """setup.sh exports NANOCHAT_SETUP_STAGE to the stage it runs (its run_child): then a rerun of
    setup.sh is a way to continue; a run started by hand or by run_train.sh is not told about it."""
    from nanochat.loop import SETUP_STAGE_ENV, StopRequested

    def stop_line():
        trainer = _SignalTrainer(at=1, signum=signal.SIGTERM)
        spec = LoopSpec("base", num_iterations=5, report=False, save=lambda step, state: tmp_path / f"step_{step:06d}")
        with pytest.raises(StopRequested) as info:
            run_training_loop(trainer, meter=trainer.meter, spec=spec)
        return str(info.value)

    monkeypatch.setenv(SETUP_STAGE_ENV, "base_train")
    assert stop_line().endswith("saved; continue with --resume latest (or rerun ./setup.sh)")
    monkeypatch.setenv(SETUP_STAGE_ENV, "")
    assert stop_line().endswith("saved; continue with --resume latest")
    monkeypatch.delenv(SETUP_STAGE_ENV)
    assert "setup.sh" not in stop_line()


def test_a_stopped_script_exits_128_plus_the_signal(capsys, monkeypatch):
    """Exit 128 + signal; the line is said by rank 0 only (every rank stops at the same step),
    while other errors are printed by whichever rank meets them."""
    from nanochat.errors import RequestError
    from nanochat.flags import script_main
    from nanochat.loop import StopRequested

    def run():
        raise StopRequested("stopped by SIGTERM at step 4 of 10: ...", signal.SIGTERM)

    for rank, said in (("0", "base_train: error: stopped by SIGTERM at step 4 of 10: ...\n"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as info:
            script_main("base_train", lambda: None, run)
        assert info.value.code == 143
        assert capsys.readouterr().err == said

    def bad():
        raise RequestError("--device cuda: no GPU")
    with pytest.raises(SystemExit) as info:
        script_main("base_train", lambda: None, bad)
    assert info.value.code == 2 and capsys.readouterr().err == "base_train: error: --device cuda: no GPU\n"


@pytest.mark.parametrize("grace, said", [
    (None, ""),
    ((3600, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"), "torchrun SIGKILLs the workers 3600 s after passing one on "
                                              "(TORCH_ELASTIC_SHUTDOWN_TIMEOUT)\n"),
    ((30, "torchrun's default"), "launch with TORCH_ELASTIC_SHUTDOWN_TIMEOUT=3600"),
    ((30, "fixed in torch 2.11.0's torchrun"), "`./run_train.sh --stop` signals the workers themselves"),
])
def test_the_loop_says_how_long_torchrun_lets_a_stop_run(monkeypatch, capsys, grace, said):
    """Under torchrun the loop's first line gives torchrun's SIGTERM -> SIGKILL wait, and where it is
    torchrun's 30 s, the way around it; outside torchrun nothing."""
    from nanochat import distributed, loop
    monkeypatch.setattr(distributed, "torchrun_stop_grace", lambda: grace)
    loop._announce_stop_grace()
    out = capsys.readouterr().out
    assert (said in out) and (bool(out) == (grace is not None))
    assert ("may be cut short" in out) == (grace is not None and grace[0] == 30)


class _CountingTrainer(_SignalTrainer):
    def __init__(self):
        super().__init__(at=-1, signum=0)
        self.model = None   # no weights to check before a save


def _eval_spec(tmp_path, evals, saves, num_iterations, eval_every):
    def evaluate(step):
        evals.append(step)
        return {"val_bpb": 1.0 / (step + 1), "core": __import__("numpy").float64(0.25)}

    def save(step, state):
        saves[step] = state
        return tmp_path / f"step_{step:06d}"
    return LoopSpec("base", num_iterations=num_iterations, report=False, eval_every=eval_every, save_every=4,
                    evaluate=evaluate, save=save)


def test_a_resumed_run_does_not_repeat_the_evaluation_its_checkpoint_saw(tmp_path):
    """The checkpoint at step 4 was saved after step 4's evaluation: resuming there goes on with the
    step, without a second evaluation (time, and a second metrics row for step 4), and keeps what
    that evaluation measured; the loop state holds plain numbers (weights_only loads refuse numpy)."""
    evals, saves = [], {}
    run_training_loop(_CountingTrainer(), meter=_CountingTrainer().meter,
                      spec=_eval_spec(tmp_path, evals, saves, 6, eval_every=2))
    assert evals == [0, 2, 4, 6] and saves[4]["evaluated_at"] == 4 and type(saves[4]["last_eval"]["core"]) is float
    state = torch.load(_roundtrip(tmp_path, saves[4]), weights_only=True)
    evals2, saves2 = [], {}
    res = run_training_loop(_CountingTrainer(), meter=_CountingTrainer().meter,
                            spec=_eval_spec(tmp_path, evals2, saves2, 6, eval_every=2),
                            start_step=4, resume_state=state)
    assert evals2 == [6] and res.val_bpb == 1 / 7 and res.val_bpb_step == 6


def test_a_checkpoint_saved_by_a_stop_is_evaluated_on_resume_and_old_figures_say_their_step(tmp_path):
    """A stop saves at a step without evaluating there: the resumed run evaluates it. A resumed run
    with evaluations off reports the checkpoint's val bpb with the step it was measured at."""
    evals, saves = [], {}
    state = {"step": 4, "val_bpb": 0.5, "val_bpb_step": 2, "min_val_bpb": 0.5, "evaluated_at": 2}
    run_training_loop(_CountingTrainer(), meter=_CountingTrainer().meter,
                      spec=_eval_spec(tmp_path, evals, saves, 6, eval_every=2), start_step=4, resume_state=state)
    assert evals == [4, 6]
    evals = []
    res = run_training_loop(_CountingTrainer(), meter=_CountingTrainer().meter,
                            spec=_eval_spec(tmp_path, evals, saves, 6, eval_every=-1), start_step=4,
                            resume_state=state)
    assert evals == [] and (res.val_bpb, res.val_bpb_step) == (0.5, 2) and saves[6]["val_bpb_step"] == 2


def _roundtrip(tmp_path, state):
    path = tmp_path / "loop.pt"
    torch.save(state, path)
    return path


def test_a_hangup_stops_like_sigterm_and_moves_the_output(tmp_path, monkeypatch, capsys):
    """SIGHUP (the terminal hung up; here twice, as from the login shell and again from setup.sh):
    the output moves off the gone terminal once, the step finishes, a checkpoint is saved at the
    next step index, and the script exits 129 with the stop line. Afterwards SIGHUP stays ignored
    (the process is about to exit and has no terminal). Before: SIGHUP was not the loop's, so the
    test's own handler got it and the run went on to the end."""
    from nanochat import loop
    from nanochat.flags import script_main

    moved, outside = [], []
    monkeypatch.setattr(loop, "move_output_off_terminal", lambda why: moved.append(why), raising=False)
    monkeypatch.setenv(loop.SETUP_STAGE_ENV, "base_train")   # a stage run by setup.sh, as its docstring says
    before = signal.signal(signal.SIGHUP, lambda signum, frame: outside.append(signum))

    class Trainer(_SignalTrainer):
        def step(self, step):
            if step == self.at:
                os.kill(os.getpid(), signal.SIGHUP)
            return super().step(step)

    trainer = Trainer(at=3, signum=signal.SIGHUP)
    saves = []
    spec = LoopSpec("base", num_iterations=10, report=False,
                    save=lambda step, state: saves.append(step) or tmp_path / f"step_{step:06d}")
    try:
        with pytest.raises(SystemExit) as info:
            script_main("base_train", lambda: None, lambda: run_training_loop(trainer, meter=trainer.meter, spec=spec))
        after = signal.getsignal(signal.SIGHUP)
    finally:
        signal.signal(signal.SIGHUP, before)
    assert info.value.code == 129 and trainer.steps == [0, 1, 2, 3] and saves == [4] and not outside
    assert moved == ["the terminal hung up (SIGHUP)"] * 2 and after is signal.SIG_IGN
    assert capsys.readouterr().err.endswith(
        f"base_train: error: stopped by SIGHUP at step 4 of 10: checkpoint {tmp_path / 'step_000004'} saved; "
        "continue with --resume latest (or rerun ./setup.sh)\n")


@pytest.mark.parametrize("during", ["save", "evaluation"])
def test_a_stop_during_a_save_or_an_evaluation_stops_at_that_step(tmp_path, during, monkeypatch):
    """A SIGTERM that lands while step 4's periodic save (or its evaluation) runs: that step's
    checkpoint is the stop's. The loop used to train step 4 as well and save step 5 a second time:
    on a d20 a step plus a ~9 GB save, which torchrun's 30 s grace can cut short."""
    from nanochat.loop import SETUP_STAGE_ENV, StopRequested

    monkeypatch.delenv(SETUP_STAGE_ENV, raising=False)
    trainer = _SignalTrainer(at=-1, signum=signal.SIGTERM)   # no signal from a step
    saves = []

    def save(step, state):
        saves.append(step)
        if during == "save" and step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return tmp_path / f"step_{step:06d}"

    def evaluate(step):
        if during == "evaluation" and step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
        return {"val_bpb": 1.0}

    spec = LoopSpec("base", num_iterations=10, report=False, save_every=4, eval_every=2, save=save,
                    evaluate=evaluate)
    with pytest.raises(StopRequested) as info:
        run_training_loop(trainer, meter=trainer.meter, spec=spec)
    assert trainer.steps == [0, 1, 2, 3] and saves == [4]
    assert str(info.value).startswith(f"stopped by SIGTERM at step 4 of 10: checkpoint {tmp_path / 'step_000004'}")


@pytest.mark.parametrize("save_every", [-1, 3])
def test_a_non_finite_val_bpb_stops_the_run_at_its_evaluation(tmp_path, save_every):
    """NonFiniteLossError guards val bpb too, but it was only looked at before a save: with the
    default --save-every -1 a NaN evaluation at step 2 let the run train on to its end (where a
    finite last evaluation then saved as if nothing had happened), and with saves it stopped at the
    next save naming that step. It stops at the evaluation, naming its step and the last save."""
    from nanochat.training import NonFiniteLossError

    trainer, saves = _CountingTrainer(), []
    trainer.last_checkpoint = None

    def save(step, state):
        saves.append(step)
        trainer.last_checkpoint = str(tmp_path / f"step_{step:06d}")
        return tmp_path / f"step_{step:06d}"

    spec = LoopSpec("base", num_iterations=8, report=False, eval_every=2, save_every=save_every, save=save,
                    evaluate=lambda step: {"val_bpb": float("nan") if step == 4 else 1.0})
    with pytest.raises(NonFiniteLossError) as info:
        run_training_loop(trainer, meter=trainer.meter, spec=spec)
    assert trainer.steps == [0, 1, 2, 3] and info.value.step == 4
    assert saves == ([3] if save_every == 3 else [])
    assert info.value.last_checkpoint == (str(tmp_path / "step_000003") if save_every == 3 else None)
    assert "non-finite val bpb (nan) at step 4" in str(info.value)
