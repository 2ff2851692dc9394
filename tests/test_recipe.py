"""nanochat/recipe.py: what --recipe v1|v2 resolve to, how v2 scales with the batch and the horizon,
flag overrides, and which recipe a resumed run keeps."""

from __future__ import annotations

import math

import pytest

from nanochat import optim
from nanochat.errors import RequestError
from nanochat.recipe import (DEFAULT_RECIPE, RECIPE_FLAGS, RECIPES, recipe_for_resume, resolve_recipe,
                             small_batch_hint)

REF = 2 ** 19
NONE = {k: None for k in RECIPE_FLAGS}


def test_v1_is_the_recipe_before_recipes_existed():
    """v1 must reproduce the old base_train exactly: its flag defaults, no scaling, the old schedules."""
    for batch, target in [(REF, 1e9), (2 ** 20, 5e9), (4096, 1e6)]:
        r = resolve_recipe("v1", NONE, total_batch_size=batch, target_tokens=target, ref_tokens=2e9)
        assert r.optimizer_kwargs() == dict(matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.004, scalar_lr=0.5,
                                            weight_decay=0.0, normuon_beta2=0.0)
        sched = r.schedule(500)
        for step in range(0, 501, 7):
            lrm, mom, wdm = sched.multipliers(step)
            assert lrm == optim.lr_multiplier(step, 500, warmdown_ratio=0.4)
            assert mom == optim.muon_momentum(step) and wdm == optim.weight_decay_multiplier(step, 500)


def test_v2_scales_lr_and_weight_decay_with_batch_and_horizon():
    at_ref = resolve_recipe("v2", NONE, total_batch_size=REF, target_tokens=3e9, ref_tokens=3e9)
    assert at_ref.lr_scale == 1 and at_ref.weight_decay == pytest.approx(0.28)
    assert at_ref.optimizer_kwargs() == dict(matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.008, scalar_lr=0.5,
                                             weight_decay=pytest.approx(0.28), normuon_beta2=0.95)
    # a d20-like run: 2x the batch, 4x the horizon -> LRs x sqrt(2), wd x sqrt(2) / 4
    big = resolve_recipe("v2", NONE, total_batch_size=2 * REF, target_tokens=12e9, ref_tokens=3e9)
    assert big.lr_scale == pytest.approx(math.sqrt(2))
    assert big.matrix_lr == pytest.approx(0.02 * math.sqrt(2)) and big.unembedding_lr == pytest.approx(0.008 * math.sqrt(2))
    assert big.weight_decay == pytest.approx(0.28 * math.sqrt(2) / 4) and big.weight_decay_ref == 0.28
    sched = big.schedule(1000)
    assert sched.multipliers(0) == pytest.approx((1 / 40, 0.85, 1.0))
    assert sched.multipliers(200)[0] == 1.0 and sched.multipliers(1000) == pytest.approx((0.05, 0.90, 0.0), abs=1e-12)
    assert sched.multipliers(500)[2] == pytest.approx(0.5)   # cosine weight decay at mid-run
    line = big.describe(1000)
    assert "v2: LR scale 1.414" in line and "weight decay 0.09899 (ref 0.28, cosine to 0)" in line
    assert "warmup 40 steps, warmdown 0.65 to 0.05" in line and "NorMuon beta2 0.95" in line


def test_flags_override_the_recipe_and_are_scaled_the_same_way():
    given = {**NONE, "weight_decay": 0.1, "matrix_lr": 0.04, "warmup_ratio": 0.1, "normuon_beta2": 0.0}
    r = resolve_recipe("v2", given, total_batch_size=REF // 4, target_tokens=1e9, ref_tokens=1e9)
    assert r.matrix_lr == pytest.approx(0.02) and r.weight_decay == pytest.approx(0.05)   # x sqrt(1/4)
    assert r.warmup_steps == 0 and r.warmup_ratio == 0.1   # an explicit ratio replaces v2's 40 steps
    assert r.normuon_beta2 == 0.0 and "plain Muon" in r.describe(100)
    assert r.overridden == ("matrix_lr", "weight_decay", "warmup_ratio", "normuon_beta2")
    assert "flags: --matrix-lr --weight-decay --warmup-ratio --normuon-beta2" in r.describe(100)
    assert r.schedule(100).multipliers(0)[0] == pytest.approx(0.1)   # 10 warmup steps
    with pytest.raises(RequestError, match="--recipe: got 'v3'; accepted: v1|v2"):
        resolve_recipe("v3", NONE, total_batch_size=REF, target_tokens=1, ref_tokens=1)



def test_a_warmup_that_overlaps_the_recipes_warmdown_names_the_recipes_value():
    """--warmup-ratio 0.5 under v2 (warmdown 0.65) sums past 1: it said "--warmup-ratio +
    --warmdown-ratio: got 1.15", naming a flag the user never gave, and only once the schedule was
    built (after the data loaders and the checkpoint). The schedule now says whose value is whose."""
    with pytest.raises(RequestError, match=r"--warmup-ratio 0\.5 \+ --warmdown-ratio 0\.65 \(recipe v2's\) = 1\.15; "
                                           r"accepted: a sum <= 1 \(e\.g\. --warmdown-ratio 0\.5"):
        resolve_recipe("v2", {**NONE, "warmup_ratio": 0.5}, total_batch_size=REF, target_tokens=1,
                       ref_tokens=1).schedule(9)
    with pytest.raises(RequestError, match=r"--warmup-ratio 0\.7 \+ --warmdown-ratio 0\.4 = 1\.1;"):
        resolve_recipe("v1", {**NONE, "warmup_ratio": 0.7, "warmdown_ratio": 0.4}, total_batch_size=REF,
                       target_tokens=1, ref_tokens=1).schedule(9)
    fits = resolve_recipe("v2", {**NONE, "warmup_ratio": 0.35}, total_batch_size=REF, target_tokens=1, ref_tokens=1)
    assert fits.schedule(100).multipliers(0)[0] == pytest.approx(1 / 35)


def test_short_runs_warm_up_and_still_warm_down():
    r = resolve_recipe("v2", NONE, total_batch_size=REF, target_tokens=1e9, ref_tokens=1e9)
    lrms = [r.schedule(20).multipliers(s)[0] for s in range(21)]
    assert "warmup 7 steps" in r.describe(20)           # 40 capped at 20 - round(0.65 x 20)
    assert lrms[6] == 1.0 and lrms[7] == 1.0 and lrms[20] == pytest.approx(0.05)
    assert all(a <= b for a, b in zip(lrms[:7], lrms[1:8]))


def test_recipe_for_resume():
    assert recipe_for_resume(None, None) == DEFAULT_RECIPE and DEFAULT_RECIPE in RECIPES
    assert recipe_for_resume("v1", None) == "v1"
    assert recipe_for_resume(None, {"recipe": "v2"}) == "v2"
    assert recipe_for_resume("v2", {"recipe": "v2"}) == "v2"
    assert recipe_for_resume(None, {"depth": 20}) == "v1"   # a checkpoint from before recipes: v1
    with pytest.raises(RequestError, match="--recipe: got 'v2' but the checkpoint was trained with 'v1'"):
        recipe_for_resume("v2", {})


def test_small_batch_hint():
    tiny = resolve_recipe("v2", NONE, total_batch_size=4096, target_tokens=1e7, ref_tokens=1e9)
    hint = small_batch_hint(tiny, 4096)
    assert "--recipe v2 scales the LRs by 0.0884 at 4,096 tokens" in hint and "--recipe v1" in hint
    assert small_batch_hint(resolve_recipe("v2", NONE, total_batch_size=2 ** 18, target_tokens=1, ref_tokens=1),
                            2 ** 18) is None
    assert small_batch_hint(resolve_recipe("v1", NONE, total_batch_size=512, target_tokens=1, ref_tokens=1),
                            512) is None


TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "8", "--total-batch-size", "512", "--window-pattern", "SL", "--eval-tokens", "4096",
        "--no-compile", "--num-iterations", "6"]


def test_compare_recipes_runs_each_entry_and_seed(env, capsys):
    from scripts import compare_recipes
    from nanochat.checkpoint import checkpoint_dir
    results = compare_recipes.main(["--runs", "v1", "v2 --normuon-beta2 0", "--seeds", "1", "2", "--", *TINY, *env])
    assert not list(checkpoint_dir("base", "cmp_0").parent.glob("cmp_*"))   # every entry's and seed's tag removed
    assert [(r["run"], r["seed"]) for r in results] == [("v1", 1), ("v1", 2), ("v2 --normuon-beta2 0", 1),
                                                        ("v2 --normuon-beta2 0", 2)]
    assert all(r["num_iterations"] == 6 and 0 < r["final_val_bpb"] < 20 for r in results)
    assert results[0]["final_val_bpb"] != results[1]["final_val_bpb"]          # the seed reached the run
    assert results[0]["final_val_bpb"] != results[2]["final_val_bpb"]          # and the recipe
    out = capsys.readouterr().out
    assert "recipe                       : v2: LR scale 0.03125" in out and "flags: --normuon-beta2" in out
    rows = [line for line in out.splitlines() if line.startswith(("v1 ", "v2 "))]
    mean_v1 = (results[0]["final_val_bpb"] + results[1]["final_val_bpb"]) / 2
    assert rows[0].split()[-1] == "+0.0000" and f"{mean_v1:.4f}" in rows[0]


@pytest.mark.parametrize("argv, message", [
    (["--runs", "v9"], "--runs: got 'v9'"),
    (["--runs", "v1", "--", "--seed", "3"], "--seed: set by compare_recipes itself"),
    (["--runs", "v2 --recipe v1"], "--recipe: set by compare_recipes itself"),
    (["--seeds", "-1"], "--seeds"),
])
def test_compare_recipes_flag_errors(argv, message):
    from scripts import compare_recipes
    with pytest.raises(RequestError, match=message):
        compare_recipes.parse_args(argv)
