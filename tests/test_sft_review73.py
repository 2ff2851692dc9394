"""Review 73 of mid-training / SFT (nanochat/chat_data.py, nanochat/chat_train.py): a resumed run
scores the validation rows its run scored before the stop, whatever --device-batch-size the resume
takes. --eval-tokens -1 meant 20 micro-batches of this process's --device-batch-size, so the
resume an out-of-memory stop names (half the device batch) scored half the rows from then on: its
val bpb (and min) was another set's. --eval-tokens N is N // --max-seq-len rows at any device
batch. One tiny base checkpoint per module (tests/test_chat_stage_review.py's)."""

from __future__ import annotations

import pytest
import torch

from nanochat.chat_data import first_rows
from nanochat.chat_train import ChatTrainConfig, eval_rows_of
from tests.test_chat_stage_review import train_tiny_base

TAG = "r73"


@pytest.fixture(scope="module")
def base_ckpt(base_dir, tiny_corpus):
    return train_tiny_base(base_dir, tiny_corpus, TAG)


def _spy_scored(monkeypatch) -> list:
    """Every evaluation's scored targets (y >= 0, in stream order), recorded as evaluate_bpb reads them."""
    from nanochat import eval_bpb
    real, seen = eval_bpb.evaluate_bpb, []

    def spy(model, batches, steps, token_bytes):
        kept = list(batches)
        seen.append(torch.cat([y[y >= 0] for _, y in kept]))
        return real(model, kept, steps, token_bytes)
    monkeypatch.setattr(eval_bpb, "evaluate_bpb", spy)
    return seen


def test_a_resume_at_another_device_batch_scores_the_runs_validation_rows(env, base_ckpt, monkeypatch):
    """SFT at --device-batch-size 4 saved at step 1, resumed at 2 (as an out-of-memory stop's
    command does; --total-batch-size -1 keeps its 32 rows): every evaluation of the resumed run
    scores the 80 rows the run's did (it scored 40, and its val bpb was another set's)."""
    from scripts import chat_sft
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "sft")   # no "next" lines
    args = ["--device", "cpu", "--source", "base", "--model-tag", TAG, "--max-seq-len", "64", "--test-holdout", "50",
            "--eval-every", "2", "--num-iterations", "2", "--save-every", "1", "--no-compile"]
    seen = _spy_scored(monkeypatch)
    whole = chat_sft.main(args + ["--device-batch-size", "4", "--overwrite"])
    run_scored = seen[0]
    assert all(torch.equal(s, run_scored) for s in seen)
    seen.clear()
    resumed = chat_sft.main(args + ["--device-batch-size", "2", "--resume", "1"])
    assert seen and all(torch.equal(s, run_scored) for s in seen)
    assert resumed["final_val_bpb"] == pytest.approx(whole["final_val_bpb"], rel=1e-4)


def test_eval_rows_are_the_runs_not_the_device_batchs():
    """-1: 20 micro-batches of the run's first device batch (a checkpoint's record, or its config's
    device batch for one saved before the record); N: N // --max-seq-len rows at any device batch."""
    cfg = ChatTrainConfig(device_batch_size=2)
    assert eval_rows_of(cfg, 64, None) == 40
    assert eval_rows_of(cfg, 64, {"config": {"eval_tokens": -1, "device_batch_size": 4}, "train": {"eval_rows": 80}}) == 80
    assert eval_rows_of(cfg, 64, {"config": {"eval_tokens": -1, "device_batch_size": 8}, "train": {}}) == 160
    assert eval_rows_of(cfg, 64, {"config": {"eval_tokens": 4096, "device_batch_size": 4}, "train": {}}) == 40
    cfg.eval_tokens = 1000
    assert eval_rows_of(cfg, 64, None) == 15
    assert eval_rows_of(cfg, 64, {"config": {"eval_tokens": -1, "device_batch_size": 4}, "train": {"eval_rows": 80}}) == 15
    # a checkpoint from before eval_rows with the same N: its run's rule, whole micro-batches of its
    # device batch (1000 // (4 x 64) = 3 batches of 4: 12 rows; the new rule's 15 was another set)
    assert eval_rows_of(cfg, 64, {"config": {"eval_tokens": 1000, "device_batch_size": 4}, "train": {}}) == 12
    assert eval_rows_of(cfg, 64, {"config": {"eval_tokens": 500, "device_batch_size": 4}, "train": {}}) == 15  # N changed
    assert eval_rows_of(cfg, 64, {"config": {"eval_tokens": 1000, "device_batch_size": 4},
                                  "train": {"eval_rows": 15}}) == 15


def test_first_rows_masks_the_surplus_rows_of_the_last_batch():
    batches = [(torch.full((3, 4), k), torch.arange(12).reshape(3, 4) + 100 * k) for k in range(4)]
    got = list(first_rows(iter(batches), 7))
    assert len(got) == 3 and torch.equal(got[0][1], batches[0][1]) and torch.equal(got[1][1], batches[1][1])
    assert torch.equal(got[2][0], batches[2][0]) and torch.equal(got[2][1][:1], batches[2][1][:1])
    assert (got[2][1][1:] == -1).all() and (batches[2][1] >= 0).all()   # the stream's own tensor untouched
