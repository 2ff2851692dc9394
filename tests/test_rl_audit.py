"""RL audit (nanochat/rl.py, scripts/chat_rl.py) on CPU: the stop token a sample drew is trained,
a group with equal fractional rewards gives exactly zero gradient, a non-finite reward names the
task, rollout seeds wrap at the top of the seed range, --examples-per-step beyond the training
problems and a resume under another tokenizer are refused before any training."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from tests.test_engine import tiny_chat_model
from tests.test_rl import _assert_step_is_the_reference, _trainer


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's (never modified here)


@pytest.fixture(scope="module")
def stopping_model(chat_model):
    """The tiny model with an <|assistant_end|> row in its head that makes some samples stop
    within 6 tokens and others not (seeded: checked by the test that uses it)."""
    model, tokenizer = chat_model
    model = copy.deepcopy(model)
    stop = tokenizer.encode_special("<|assistant_end|>")
    width = model.lm_head.weight.shape[1]
    with torch.no_grad():
        row = torch.randn(width, generator=torch.Generator().manual_seed(1))
        model.lm_head.weight[stop] = 16 * row / width ** 0.5
    return model, tokenizer


def test_a_sample_that_stops_trains_the_stop_token_it_drew(stopping_model):
    """Stopping is the policy's action: a stopped sample's sequence ends with the stop token as a
    target (mask 1), and the step's gradient is the hand-computed objective including its log p.
    (Engine.generate_batch drops the stop token: RL never trained where a rewarded answer ended.)"""
    model, tokenizer = stopping_model
    stop = tokenizer.encode_special("<|assistant_end|>")
    trainer, opt = _trainer(stopping_model, lambda text: float(len(text) % 3))
    prompt = tokenizer.render_for_completion(trainer.task[0])
    seqs, masks, advantages, rewards = trainer._rollout(0, trainer.task[0], prompt, 6)
    ended = [s[-1] == stop for s in seqs]
    assert any(ended) and not all(ended), [len(s) - len(prompt) for s in seqs]
    for seq, mask, stopped in zip(seqs, masks, ended):
        assert len(seq) == len(mask) and (mask[-1] == 1 if stopped else stop not in seq[len(prompt):])
    res = trainer.step(0)
    _assert_step_is_the_reference(trainer, opt, res, [0, 1])


def test_equal_fractional_rewards_give_exactly_zero_gradient():
    from nanochat.rl import group_advantages
    assert group_advantages([0.1] * 3) == [0.0] * 3   # the float mean of three 0.1 is not 0.1
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([0.25]) == [0.0]


def test_a_group_scoring_0_1_everywhere_changes_nothing(chat_model):
    trainer, opt = _trainer(chat_model, lambda text: 0.1, num_samples=3)
    res = trainer.step(0)
    assert res.loss == 0.0 and res.extra["reward"] == pytest.approx(0.1)
    assert opt.grads and all(bool((g == 0).all()) for g in opt.grads.values())


def test_a_non_finite_reward_names_the_task_not_the_learning_rate(chat_model):
    trainer, _ = _trainer(chat_model, lambda text: math.nan)
    with pytest.raises(ValueError, match=r"_Task\.reward returned nan for problem 0; rewards must be finite"):
        trainer.step(0)


def test_rollout_seeds_wrap_at_the_top_of_the_seed_range(chat_model):
    """--seed 2**64-1 is a valid torch seed; the per-problem rollout seed derived from it went past
    the Engine's range mid-run (a traceback after the model loaded). --seed past the range is a
    flag error."""
    from scripts.chat_rl import parse_config
    trainer, opt = _trainer(chat_model, lambda text: float(len(text) % 3), seed=2**64 - 1)
    res = trainer.step(0)
    assert math.isfinite(res.loss) and opt.grads
    assert parse_config(["--seed", str(2**64 - 1)]).seed == 2**64 - 1
    with pytest.raises(ValueError, match=r"--seed: got 18446744073709551616; accepted: an integer in 0\.\."):
        parse_config(["--seed", str(2**64)])


def _small_gsm8k(shared_data, root, n):
    (root / "eval").mkdir(parents=True, exist_ok=True)
    lines = (shared_data / "eval" / "gsm8k.jsonl").read_text().splitlines()[:n]
    (root / "eval" / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
    return str(root)


RL_ARGS = ["--device", "cpu", "--model-tag", "d2", "--num-samples", "2", "--max-new-tokens", "4",
           "--eval-every", "-1", "--num-iterations", "1"]


def test_more_problems_a_step_than_there_are_is_refused(sft_checkpoint, shared_data, tmp_path):
    """A step drew a problem twice with the same seed (identical samples) once --examples-per-step
    passed the training problems, and a huge value rendered that many prompts (all the memory)."""
    from nanochat.errors import RequestError
    from scripts import chat_rl
    data = _small_gsm8k(shared_data, tmp_path / "data", 5)
    args = RL_ARGS + ["--data-dir", data, "--test-holdout", "1"]
    with pytest.raises(RequestError, match=r"--examples-per-step: got 5; accepted: 1\.\.4 \(the training problems "
                                           r"left by --test-holdout 1\)"):
        chat_rl.main(args + ["--examples-per-step", "5"])
    with pytest.raises(RequestError, match="--examples-per-step: got 1000000000000"):
        chat_rl.main(args + ["--examples-per-step", str(10**12)])
    assert chat_rl.main(args + ["--examples-per-step", "4"])["num_iterations"] == 1


def test_resume_under_another_tokenizer_is_refused(sft_checkpoint, chat_model, shared_data, tmp_path, tiny_corpus):
    """The fresh start checks the tokenizer's fingerprint (load_model); a resume rebuilt the model
    from the rl checkpoint and went on with whatever tokenizer the base dir held."""
    import pyarrow.parquet as pq

    from nanochat.checkpoint_io import CheckpointError
    from nanochat.tokenizer import Tokenizer, tokenizer_dir
    from scripts import chat_rl
    args = RL_ARGS + ["--data-dir", _small_gsm8k(shared_data, tmp_path / "data", 5), "--test-holdout", "1",
                      "--examples-per-step", "2", "--num-iterations", "2", "--save-every", "1"]
    chat_rl.main(args)
    shard = sorted(tiny_corpus.glob("*.parquet"))[0]
    texts = pq.read_table(shard, columns=["text"]).column("text").to_pylist()[150:300]
    other = Tokenizer.train(texts, vocab_size=chat_model[1].vocab_size)   # same size, other merges
    assert other.fingerprint != chat_model[1].fingerprint
    other.save(tokenizer_dir(sft_checkpoint))
    with pytest.raises(CheckpointError, match=r"--resume: it was trained with tokenizer [0-9a-f]{16}\.\.\., the base "
                                              r"dir's tokenizer is"):
        chat_rl.main(args + ["--resume", "1"])
