"""A DGX Spark owner's thirteenth review of base pretraining on CPU (scripts/base_train.py,
nanochat/recipe.py's Horizon): the run's horizon as a compute budget (--target-flops) and how the
banner explains the steps it trains, the done line's totals of the whole run (a resume's earlier
part included), the banner's auto labels and the wandb config's --recipe. Each test failed on the
code before its fix."""

from __future__ import annotations

import importlib.machinery
import json
import re
import sys
import types

import pytest

from nanochat import checkpoint as ck

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "2", "--window-pattern", "SL", "--recipe", "v1", "--sample-every", "-1",
        "--eval-every", "-1", "--eval-tokens", "128"]
BATCH = 128   # --device-batch-size 2 x --max-seq-len 64


def _row(out: str, name: str) -> str:
    rows = [line.split(" : ", 1)[1] for line in out.splitlines() if line.split(" : ", 1)[0].strip() == name]
    assert len(rows) == 1, out
    return rows[0]


def _done(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("done: ")]
    assert len(lines) == 1, out
    return json.loads(lines[0].removeprefix("done: "))


# ------------------------------------------------------------------ the horizon, without a run

def _horizon(**kw):
    from nanochat.recipe import Horizon
    args = dict(num_iterations=-1, target_flops=-1.0, ratio=20.0, flops_per_token=1e6, scaling_params=1000,
                ref_scaling_params=4000)
    return Horizon(**{**args, **kw})


def test_horizon_precedence_and_its_banner_row():
    """--target-flops did not exist (upstream nanochat's compute budget: "unrecognized arguments"),
    and the iterations row said "(ratio 0.05 x scaling params)" for a run that, its horizon shorter
    than one step, trained a whole step of 8x its tokens."""
    ratio = _horizon()
    assert ratio.steps(4096) == 4 and ratio.target_tokens == 20_000 and ratio.ref_tokens == 80_000
    assert ratio.describe(4096) == ("4 (--target-param-data-ratio 20 x 1,000 scaling params = 20,000 tokens "
                                    "/ 4,096 tokens a step)")
    budget = _horizon(target_flops=3e10, ratio=8.0, ratio_given=True)
    assert budget.target_tokens == 30_000 and budget.steps(4096) == 7
    assert budget.ref_tokens == 120_000   # d12's horizon at the same tokens : params ratio (auto batch, v2 wd)
    assert budget.describe(4096) == ("7 (--target-flops 3e+10 / 1.0000e+06 FLOPs per token = 30,000 tokens "
                                     "/ 4,096 tokens a step; --target-param-data-ratio 8 unused)")
    short = _horizon(ratio=0.05)
    assert short.steps(4096) == 1
    assert short.describe(4096) == ("1 (--target-param-data-ratio 0.05 x 1,000 scaling params = 50 tokens, "
                                    "less than one step: trained as 1 step of 4,096 tokens)")
    fixed = _horizon(num_iterations=30, ratio=8.0, ratio_given=True)
    assert fixed.steps(4096) == 30
    assert fixed.describe(4096) == "30 (from --num-iterations; --target-param-data-ratio 8 unused)"


@pytest.mark.parametrize("argv, message", [
    (["--target-flops", "1e18", "--num-iterations", "100"],
     "--num-iterations and --target-flops: got '100 and 1e+18'; accepted: one of the two (the other -1)"),
    (["--target-flops", "0"], "--target-flops: got 0.0; accepted: a finite number > 0, or -1: off"),
    (["--target-flops", "nan"], "--target-flops: got nan; accepted: a finite number > 0, or -1: off"),
])
def test_target_flops_flag_is_checked(argv, message):
    from scripts.base_train import parse_config
    with pytest.raises(ValueError) as e:
        parse_config(argv)
    assert str(e.value) == message
    assert parse_config(["--target_flops", "2.5e17"]).target_flops == 2.5e17   # both spellings
    assert parse_config([]).target_flops == -1


# ------------------------------------------------------------------ runs

@pytest.fixture()
def fake_wandb(monkeypatch):
    """A wandb that records what base_train asks of it (the real one is not installed here, and
    tests never reach a network)."""
    calls = {"init": [], "log": []}

    class Run:
        def define_metric(self, name, **kw):   # the tracker plots every metric against the row's "step"
            pass

        def log(self, data, step=None):
            calls["log"].append((data["step"], data))

        def finish(self):
            calls["finished"] = True

    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    mod.init = lambda **kw: calls["init"].append(kw) or Run()
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return calls


def test_target_flops_run_and_the_totals_of_a_resumed_run(env, base_dir, capsys, fake_wandb):
    """The done line gave no time, tokens or FLOPs of the run (only the average tok/s); they are the
    whole run's, a resume's earlier part included. The wandb config's "recipe" was precision.py's
    (an empty dict on this CPU), which had replaced --recipe's name."""
    from scripts import base_train

    fpt = 1044864.0   # this TINY's FLOPs per token (checked against the checkpoint below)
    budget = 4.5 * BATCH * fpt
    args = TINY + env + ["--total-batch-size", str(BATCH), "--no-compile", "--target-flops", f"{budget!r}",
                         "--model-tag", "flops", "--save-every", "2"]
    base_train.main(args + ["--wandb", "offline", "--run", "r13"])
    out = capsys.readouterr().out
    ckpt_dir = ck.checkpoint_dir("base", "flops", base_dir)
    meta = ck.read_meta(ckpt_dir, 4)
    assert meta["train"]["flops_per_token"] == fpt and meta["train"]["num_iterations"] == 4
    assert _row(out, "iterations") == (f"4 (--target-flops {budget:.4g} / 1.0449e+06 FLOPs per token = 576 tokens "
                                       f"/ 128 tokens a step)")
    done = _done(out)
    assert (done["num_iterations"], done["tokens_trained"], done["resumed_from_step"]) == (4, 4 * BATCH, None)
    # what to run next, as mid_train and chat_sft say it (base_train ended on the done line alone)
    assert "next, evaluate it: python -m scripts.base_eval --model-tag flops\n" in out
    assert "next, mid-train it for chat: python -m scripts.mid_train --model-tag flops\n" in out
    assert done["training_flops"] == fpt * 4 * BATCH and done["total_time_s"] > 0
    (init,) = fake_wandb["init"]
    assert init["mode"] == "offline" and init["name"] == "r13" and init["dir"] == str(base_dir)
    assert init["config"]["recipe"] == "v1" and init["config"]["precision_recipe"] == {}
    assert init["config"]["target_flops"] == budget and init["config"]["num_iterations"] == 4
    assert sorted(step for step, data in fake_wandb["log"] if "train/loss" in data) == [0, 1, 2, 3]

    earlier = ck.load_checkpoint(ckpt_dir, 2)["loop"]["elapsed_s"]
    summary = base_train.main(args + ["--resume", "2"])
    done = _done(capsys.readouterr().out)
    assert (done["num_iterations"], done["tokens_trained"], done["resumed_from_step"]) == (4, 4 * BATCH, 2)
    assert done["training_flops"] == fpt * 4 * BATCH and done["total_time_s"] > earlier
    assert sorted(summary["losses"]) == [2, 3]   # this process trained steps 2 and 3 only
    section = json.loads((base_dir / "report" / "sections" / "base-model-training.json").read_text())
    data = section["entries"][-1]["data"]
    assert (data["tokens_trained"], data["training_flops"], data["final_step"]) == (4 * BATCH, fpt * 4 * BATCH, 4)


def test_banner_labels_the_auto_batch_and_compile(env, capsys, monkeypatch):
    """The batch row printed the auto --total-batch-size's result without saying it was chosen for
    the user (a Spark owner who never gave a batch saw a number from nowhere), and the compile
    column a bare False on the CPU where compile defaults to off."""
    from scripts import base_train

    # the auto rule's 65,536 tokens (512 micro-batches here) made this a minutes-long CPU test: one
    # step of 128 tokens, with the auto path kept (resumed_total / the banner see --total-batch-size -1)
    monkeypatch.setattr(base_train, "resolve_total_batch_size",
                        lambda requested, *a: BATCH if requested == -1 else requested)
    base_train.main(TINY + env + ["--num-iterations", "1", "--model-tag", "auto"])
    out = capsys.readouterr().out
    assert _row(out, "batch").endswith("x 1 micro-batch(es) (auto: --total-batch-size -1)")
    assert re.match(r"current / False \(auto\) / auto -> \w+$", _row(out, "kernel / compile / attention"))
    assert _row(out, "iterations") == "1 (from --num-iterations)"


def test_cpu_plan_hint_warns_of_a_gpu_sized_plan():
    """Bare `base_train` on a CPU planned d20 on 8.7B tokens (~3e19 FLOPs) without a word: the first
    step line never came (review 13, the CPU walkthrough)."""
    from nanochat.recipe import cpu_plan_hint

    hint = cpu_plan_hint("cpu", 3e19)
    assert hint is not None and "Step by step on a CPU" in hint and "--preset tiny" in hint and "3e+19" in hint
    assert cpu_plan_hint("cuda", 3e19) is None
    assert cpu_plan_hint("cpu", 4096 * 250 * 1e7) is None   # setup.sh's tiny preset: ~1e13 FLOPs, minutes


def test_a_horizon_of_absurd_length_is_refused_by_its_flag():
    """--target-flops 1e40 (a typo for 1e20) got past the checks and crashed with an OverflowError
    traceback where the save plan counts the steps; --num-iterations 10**12 the same."""
    from nanochat.errors import RequestError

    with pytest.raises(RequestError, match=r"^--target-flops: makes 2\.44e\+30 steps of 4,096 tokens; accepted: at most"):
        _horizon(target_flops=1e40).steps(4096)
    with pytest.raises(RequestError, match=r"^--num-iterations: makes 1e\+12 steps"):
        _horizon(num_iterations=10**12).steps(4096)
    with pytest.raises(RequestError, match=r"^--target-param-data-ratio: "):
        _horizon(ratio=1e30).steps(4096)
    assert _horizon(num_iterations=10**9).steps(4096) == 10**9
