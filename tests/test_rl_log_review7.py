"""RL's per-step log values: a step whose every problem was skipped reports no reward or length
(a 0 there read as a step that earned nothing), and the skipped count prints as a count."""

import pytest

from nanochat.loop import format_extra
from tests.test_engine import tiny_chat_model
from tests.test_rl import _len_reward, _LongTask, _trainer


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: test_rl's model (never modified)


def test_a_step_with_every_problem_skipped_reports_no_reward(chat_model):
    task = _LongTask(_len_reward, long={0, 1}, size=4)
    trainer, _ = _trainer(chat_model, None, task=task, examples_per_step=2)
    res = trainer.step(0)
    assert res.extra == {"skipped": 2} and isinstance(res.extra["skipped"], int)
    res = trainer.step(1)   # problems 2 and 3 fit
    assert res.extra["skipped"] == 0 and "reward" in res.extra and "seq_len" in res.extra


def test_the_log_tail_prints_counts_as_counts():
    assert format_extra({"reward": 0.5, "seq_len": 12.0, "skipped": 2}) == " | reward 0.5000 | seq_len 12.0000 | skipped 2"
    assert format_extra({}) == ""
