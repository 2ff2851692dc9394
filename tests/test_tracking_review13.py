"""Review 13 of training UX across stops and resumes (nanochat/tracker.py, nanochat/step_meter.py,
nanochat/loop.py and their wiring in base_train, mid / SFT and chat_rl): a resumed run logs to the
same wandb run (its id rides in the checkpoint's loop state), a fresh run or a branch starts a new
one; --wandb offline without --run says what it does; the ETA is there (rough, '~') from the first
step, also after a resume; the average tok/s is defined for a run resumed every few steps. A fake
wandb module records the calls (no network). Each test failed on the code before its fix."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest

from nanochat import checkpoint as ck

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "SL", "--recipe", "v1",
        "--sample-every", "-1", "--eval-every", "-1", "--eval-tokens", "128", "--no-compile"]


@pytest.fixture()
def wandb_calls(monkeypatch):
    """A wandb whose init returns a run with the id asked for (resume) or a new one, recording every call."""
    calls = {"init": [], "log": [], "define_metric": []}

    class Run:
        def __init__(self, kw):
            self.id = kw.get("id") or f"run-{len(calls['init']) - 1}"
            self.name = kw.get("name")

        def define_metric(self, name, **kw):
            calls["define_metric"].append((self.id, name, kw))

        def log(self, data, step=None):   # the training step rides in the row ("step"), never step=
            assert step is None, "wandb's own step drops a resume's re-logged steps"
            calls["log"].append((self.id, data["step"], data))

        def finish(self):
            pass

    def init(**kw):
        calls["init"].append(kw)
        return Run(kw)

    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def _row(out: str, name: str) -> str:
    rows = [line.split(" : ", 1)[1] for line in out.splitlines() if line.split(" : ", 1)[0].strip() == name]
    assert len(rows) == 1, out
    return rows[0]


def _resumed(kw: dict) -> tuple:
    return kw.get("id"), kw.get("resume")


# ------------------------------------------------------------------ one wandb run across resumes

def test_base_train_resume_continues_its_wandb_run(env, base_dir, wandb_calls, monkeypatch, capsys):
    """Each resume with --run started a new wandb run (the id was nowhere in the checkpoint): a
    multi-day run stopped N times was N disconnected runs. Now the resume continues the checkpoint's
    run; a resume from an older step (a branch) and an --overwrite start afresh get new ones."""
    from scripts import base_train
    monkeypatch.delenv("NANOCHAT_SETUP_STAGE", raising=False)
    args = TINY + env + ["--model-tag", "wb", "--run", "r13", "--save-every", "2"]
    base_train.main(args + ["--num-iterations", "2"])
    d = ck.checkpoint_dir("base", "wb", base_dir)
    assert ck.load_checkpoint(d, 2)["loop"]["tracker"] == {"id": "run-0", "mode": "offline", "project": "nanochat"}
    assert _resumed(wandb_calls["init"][0]) == (None, None)
    capsys.readouterr()

    base_train.main(args + ["--num-iterations", "4", "--resume", "latest"])
    out = capsys.readouterr().out
    init = wandb_calls["init"][1]
    assert _resumed(init) == ("run-0", "allow") and init["allow_val_change"] and init["name"] == "r13"
    assert _row(out, "tracking") == "wandb offline, run r13 (id run-0), continuing the checkpoint's run"
    assert "wandb: continuing the checkpoint's wandb run run-0 (offline); each offline segment is a directory" in out
    assert sorted(step for rid, step, data in wandb_calls["log"] if "train/loss" in data and rid == "run-0") == \
        [0, 1, 2, 3]
    assert not any("train/rough_per_step" in data for _, _, data in wandb_calls["log"])   # the log line's alone
    assert [(name, kw) for rid, name, kw in wandb_calls["define_metric"] if rid == "run-0"] == \
        [("step", {}), ("*", {"step_metric": "step"})] * 2   # each segment plots against the training step
    assert ck.load_checkpoint(d, 4)["loop"]["tracker"]["id"] == "run-0"

    base_train.main(args + ["--num-iterations", "4", "--resume", "2"])   # step 4 on disk: a branch
    out = capsys.readouterr().out
    assert _resumed(wandb_calls["init"][2]) == (None, None)
    assert "new wandb run (id run-2); the checkpoint's run run-0 keeps the steps of the run it branches from" in out
    assert ck.load_checkpoint(d, 4)["loop"]["tracker"]["id"] == "run-2"

    base_train.main(args + ["--num-iterations", "2", "--overwrite"])
    assert _resumed(wandb_calls["init"][3]) == (None, None)
    assert ck.load_checkpoint(d, 2)["loop"]["tracker"]["id"] == "run-3"


def test_offline_without_a_run_name_says_so(env, wandb_calls, capsys):
    """--wandb offline without --run logged to a run wandb named while the banner said "run dummy";
    --wandb off with a --run name said nothing of the name either way. Both rows say what happens."""
    from scripts import base_train
    base_train.main(TINY + env + ["--model-tag", "anon", "--num-iterations", "1", "--wandb", "offline"])
    (init,) = wandb_calls["init"]
    assert init["name"] is None and init["mode"] == "offline"
    assert _row(capsys.readouterr().out, "tracking") == \
        "wandb offline, an unnamed run (no --run: wandb names it) (id run-0)"
    base_train.main(TINY + env + ["--model-tag", "anon", "--num-iterations", "1", "--overwrite", "--wandb", "off",
                                  "--run", "r13"])
    assert _row(capsys.readouterr().out, "tracking") == "wandb off" and len(wandb_calls["init"]) == 1


def test_tracker_keeps_the_run_through_a_segment_without_logging(wandb_calls, capsys):
    """A segment resumed without --run (wandb off) keeps the checkpoint's run for the next one and
    says how to continue it; a wandb that gave up mid-run still hands its id on; other ranks log
    nothing and describe themselves as such."""
    from nanochat.tracker import Tracker
    saved = {"tracker": {"id": "abc", "mode": "online", "project": "nanochat"}}
    off = Tracker("off", resume_state=saved)
    assert off.state_dict() == saved["tracker"] and not off.enabled and off.describe() == "wandb off"
    assert "the checkpoint's wandb run abc (online) gets no steps from this segment" in capsys.readouterr().out
    assert Tracker("off", resume_state=saved, branch=True).state_dict() is None   # a branch: not that run's
    on = Tracker("online", run="r", resume_state=saved)
    assert _resumed(wandb_calls["init"][0]) == ("abc", "allow") and "offline" not in capsys.readouterr().out
    on._give_up("wandb log at step 5 failed", OSError("disk full"))
    assert on.state_dict() == {"id": "abc", "mode": "online", "project": "nanochat"}
    rank1 = Tracker("online", run="r", is_master=False, resume_state=saved)
    assert rank1.describe() == "wandb online (rank 0 logs)" and len(wandb_calls["init"]) == 1
    assert Tracker("offline", resume_state={"tracker": None}).state_dict() == {"id": "run-1", "mode": "offline",
                                                                             "project": "nanochat"}


@pytest.fixture(scope="module")
def mid_base(base_dir, tiny_corpus):
    from tests.test_chat_stage_review import train_tiny_base
    return train_tiny_base(base_dir, tiny_corpus, "wbm")


def test_mid_resume_continues_its_wandb_run(env, mid_base, wandb_calls, monkeypatch):
    """mid_train / chat_sft (nanochat/chat_train.py) passed no checkpoint state to the tracker."""
    from scripts import mid_train
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "mid")   # no "next" lines
    args = ["--device", "cpu", "--model-tag", "wbm", "--device-batch-size", "2", "--max-seq-len", "64",
            "--total-batch-size", "128", "--test-holdout", "50", "--eval-every", "-1", "--no-compile",
            "--save-every", "1", "--run", "m13"]
    mid_train.main(args + ["--num-iterations", "1", "--overwrite"])
    mid_train.main(args + ["--num-iterations", "2", "--resume", "latest"])
    first, again = wandb_calls["init"]
    assert first["project"] == "nanochat-mid" and _resumed(first) == (None, None)
    assert _resumed(again) == ("run-0", "allow")


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from tests.test_engine import tiny_chat_model
    return tiny_chat_model(str(tiny_corpus))


def test_chat_rl_resume_continues_its_wandb_run(sft_checkpoint, chat_model, wandb_calls, monkeypatch):
    """chat_rl passed no checkpoint state to the tracker either."""
    from scripts import chat_rl
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "rl")
    args = ["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
            "--max-new-tokens", "4", "--test-holdout", "1", "--eval-every", "-1", "--save-every", "1",
            "--run", "rl13"]
    chat_rl.main(args + ["--num-iterations", "1"])
    chat_rl.main(args + ["--num-iterations", "2", "--resume", "latest"])
    first, again = wandb_calls["init"]
    assert first["project"] == "nanochat-rl" and _resumed(first) == (None, None)
    assert _resumed(again) == ("run-0", "allow")


# ------------------------------------------------------------------ the meter: ETA and average across resumes

def _meter(monkeypatch, warmup: int = 10):
    from nanochat import step_meter
    clock = [1000.0]
    monkeypatch.setattr(step_meter.time, "perf_counter", lambda: clock[0])
    return step_meter.StepMeter(1e6, 1, peak_bf16=1e12, warmup_steps=warmup), clock


def _step(meter, clock, step: int, dt: float, after: float = 0.0, tokens: int = 100):
    from nanochat.training import StepResult
    clock[0] += dt
    m = meter.update(StepResult(step, 1.0, 1.0, dt, tokens))
    clock[0] += after
    return m


def test_eta_is_rough_from_the_first_step_of_every_process(monkeypatch):
    """The first 10 steps of every process (a fresh start's and each resume's) said "eta -": hours
    of nothing on a CPU or at a big depth. Now a rough figure marked '~' from the second step: the
    wall time per step since the first step (whose own time is mostly the compilation: from it, a
    90 s compile at 20,000 steps read "eta ~20d19h"); the measured one, unmarked, after the warm-up."""
    meter, clock = _meter(monkeypatch, warmup=3)
    lines = [meter.log_line(_step(meter, clock, 0, 30.0, after=1.0), 100)]   # compiles: 30 s
    for s in range(1, 5):
        lines.append(meter.log_line(_step(meter, clock, s, 2.0, after=1.0), 100))
    assert lines[0].endswith("| eta      -")     # the first step (30 s, compiling) says nothing of the rest
    assert lines[1].endswith("| eta ~4m54s")     # (1 s after step 0 + 2 s) x 98
    assert lines[2].endswith("| eta ~4m51s")     # 6 s / 2 steps x 97
    assert lines[3].endswith("| eta  3m12s")     # measured, past the warm-up: step 3's 2 s x 96 (no '~')
    assert lines[4].endswith("| eta  3m58s")     # (2 + 1 + 2) s / 2 steps x 95
    assert len({len(line.split("|")) for line in lines}) == 1


def test_average_tok_per_sec_of_a_run_resumed_every_few_steps(monkeypatch):
    """A run resumed every <10 steps had no timed step: the average tok/s (report, done line, MFU)
    was None. It now averages the segment's steps past its first (the compiling one); the timed
    average, compile warm-up excluded, is unchanged where there is one."""
    meter, clock = _meter(monkeypatch)
    _step(meter, clock, 0, 5.0)                       # this process's first: compilation
    assert meter.average_tok_per_sec() is None and meter.average_mfu() == (None, None)
    for s in range(1, 4):
        _step(meter, clock, s, 0.5, tokens=100)
    assert meter.average_tok_per_sec() == pytest.approx(200.0)    # 300 tokens / 1.5 s
    assert meter.average_mfu()[0] == pytest.approx(100 * 200 * 1e6 / 1e12)
    saved = meter.state_dict()
    assert saved["total_time"] == 0 and "settled_time" not in saved   # checkpoints of a run and its resume alike

    resumed, clock = _meter(monkeypatch)
    resumed.load_state_dict(saved)
    for s in range(4, 16):
        _step(resumed, clock, s, 9.0 if s == 4 else 0.25)
    assert resumed.average_tok_per_sec() == pytest.approx(400.0)   # steps 14, 15: past its 10-step warm-up
