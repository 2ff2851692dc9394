"""Review 74 of base pretraining on CPU (scripts/base_train.py, nanochat/training.py): the
warmup + warmdown check names the sum the run would really train with, a resume says that --seed is
unused, the banner's evaluation size is an upper bound, --help says when --compile's auto is off on
CUDA and what --fsdp does; and the numerical checks behind the review: one optimizer step with
accumulation 1 vs 4 micro-batches of the real model (also with masked targets of different counts
per micro-batch); a resume's bad schedule or recipe is refused before the checkpoint loads. The tests
of fixes failed on the code before them."""

from __future__ import annotations

import copy

import pytest
import torch

TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "SL", "--sample-every", "-1",
        "--eval-every", "-1", "--eval-tokens", "128", "--no-compile"]


# ------------------------------------------------------------------ flags

@pytest.mark.parametrize("argv, said", [
    # the recipe's warmdown (v2 0.65, v1 0.4) is the one the run would use: the check said
    # "--warmup-ratio + --warmdown-ratio: got 1.1" (Schedule's own default of 0.4) for both
    (["--warmup-ratio", "0.7"], "--warmup-ratio 0.7 + --warmdown-ratio 0.65 (recipe v2's) = 1.35"),
    (["--warmup-ratio", "0.7", "--recipe", "v1"], "--warmup-ratio 0.7 + --warmdown-ratio 0.4 (recipe v1's) = 1.1"),
    # both flags given: their own sum
    (["--warmup-ratio", "0.5", "--warmdown-ratio", "0.6"], "--warmup-ratio + --warmdown-ratio: got 1.1"),
])
def test_warmup_plus_warmdown_is_refused_naming_the_sum_the_run_would_use(argv, said):
    from scripts.base_train import parse_config
    with pytest.raises(ValueError) as e:
        parse_config(argv)
    assert said in str(e.value), str(e.value)


def test_help_says_when_compile_auto_is_off_and_what_fsdp_does(capsys):
    """--compile's help said "on for CUDA" where resolve_compile turns it off on a GPU Triton cannot
    build kernels for; --fsdp's said only its default."""
    from scripts.base_train import parse_config
    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "torch.compile the model; default: on for CUDA (off where Triton cannot build kernels" in text, text
    assert "--fsdp, --no-fsdp shard weights, gradients and optimizer state over the ranks" in text, text


def test_resume_names_the_checkpoints_schedule_sum_and_calls_seed_unused(env, base_dir, capsys):
    """A resume's warmup + warmdown sum is the checkpoint recipe's: refused at parse time with
    Schedule's 0.4 ("got 1.1" for a v2 run, whose warmdown is 0.65), it is now refused after the
    checkpoint's recipe is known, before the model is built. --seed on a resume changes nothing
    (the weights and the RNG state come from the checkpoint), but the resume said "these flags ...
    this run's apply: --seed 7 -> 8" and the banner printed seed 8. The banner's eval row stated
    --eval-tokens as the tokens evaluated, also where the val split holds fewer (all of it is used)."""
    from nanochat.errors import RequestError
    from scripts import base_train

    args = TINY + env + ["--model-tag", "seed74", "--num-iterations", "1"]
    base_train.main(args + ["--seed", "7"])
    capsys.readouterr()
    with pytest.raises(RequestError, match=r"--warmdown-ratio 0\.65 \(recipe v2's\) = 1\.35"):
        base_train.main(args + ["--resume", "latest", "--warmup-ratio", "0.7", "--num-iterations", "2"])
    capsys.readouterr()

    base_train.main(args[:-1] + ["2", "--resume", "latest", "--seed", "8", "--eval-every", "1"])
    out = capsys.readouterr().out
    assert "--seed 7 -> 8" not in out, out
    rows = {line.split(" : ")[0].strip(): line.split(" : ", 1)[1] for line in out.splitlines() if " : " in line}
    assert rows["seed"] == "8 (unused: a resume loads the weights and RNG state)", out
    # the banner's evaluation size is an upper bound: a val split of fewer tokens is evaluated whole
    assert rows["eval"] == "every 1 steps, 1 x 128 tokens (or the whole val split, if it holds fewer)", out


@pytest.mark.parametrize("bad, said", [
    (["--warmup-ratio", "0.7"], r"--warmdown-ratio 0\.65 \(recipe v2's\) = 1\.35"),
    (["--recipe", "v1"], r"--recipe: got 'v1' but the checkpoint was trained with 'v2'"),
])
def test_resume_refuses_a_bad_recipe_before_the_checkpoint_loads(env, base_dir, monkeypatch, bad, said):
    """The checkpoint's recipe comes from its meta.json (read_meta), so a resume whose schedule it
    makes invalid, or that asks for another recipe, is refused before load_checkpoint reads the
    weights and optimizer state (gigabytes at d20): the check ran after the load."""
    from nanochat import checkpoint
    from nanochat.errors import RequestError
    from scripts import base_train

    args = TINY + env + ["--model-tag", "early74-" + bad[0].strip("-"), "--num-iterations", "1"]
    base_train.main(args)
    loads = []
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: loads.append(a) or pytest.fail("loaded"))
    with pytest.raises(RequestError, match=said):
        base_train.main(args[:-1] + ["2", "--resume", "latest", *bad])
    assert loads == []


# ------------------------------------------------------------------ gradient accumulation (numerical checks)

V, T = 256, 32


def _model():
    from nanochat.gpt import GPT, config_for_depth
    torch.manual_seed(0)
    model = GPT(config_for_depth(2, V, T, aspect_ratio=32, head_dim=32))
    model.init_weights()
    return model


def _step_grads(model, batches, micro: int, token_weighted: bool) -> tuple[float, list]:
    """One Trainer step over `batches` (4 rows) as `micro` micro-batches: (loss, the gradients the
    optimizer saw)."""
    from nanochat.common import init_runtime
    from nanochat.training import Schedule, Trainer, plan_batch

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            self.grads = [p.grad.clone() for p in model.parameters()]

    opt = Capture(model.parameters(), lr=0.0)
    for group in opt.param_groups:
        group["initial_lr"] = 0.0
    x, y = batches
    rows = 4 // micro
    loader = iter([(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows]) for i in range(micro)])
    trainer = Trainer(model, opt, loader, plan_batch(4 * T, rows, T, 1), Schedule(1, warmdown_ratio=0.0),
                      init_runtime("cpu", seed=0), token_weighted=token_weighted)
    return trainer.step(0).loss, opt.grads


@pytest.mark.parametrize("masked", [False, True])
def test_accumulation_of_four_micro_batches_is_the_one_big_batch(masked):
    """The real model: loss and every gradient of one step with 4 micro-batches of 1 row equal one
    micro-batch of 4 rows. Masked: each row has another number of ignored targets (-1), so the
    micro-batches' token counts differ; the token-weighted step (SFT) normalises by all of them."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, V, (4, T + 1), generator=g)
    x, y = rows[:, :-1], rows[:, 1:].clone()
    if masked:
        for i, k in enumerate((0, 5, 17, 30)):
            y[i, :k] = -1
    model = _model()
    loss1, grads1 = _step_grads(copy.deepcopy(model), (x, y), 1, masked)
    loss4, grads4 = _step_grads(copy.deepcopy(model), (x, y), 4, masked)
    assert loss4 == pytest.approx(loss1, rel=1e-6)
    scale = max(float(g.abs().max()) for g in grads1)
    for (name, _), g1, g4 in zip(model.named_parameters(), grads1, grads4, strict=True):
        assert float((g1 - g4).abs().max()) <= 1e-5 * scale, name
