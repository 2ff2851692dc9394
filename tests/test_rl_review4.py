"""RL review 4 (scripts/chat_rl.py, nanochat/rl.py): the in-training GSM8K evaluation never scores a
test problem the --source model (mid / SFT under --test-holdout M) trained on, and refuses to
evaluate, before the model loads, when that model trained on every one; sampled pass@k runs under
the top --seed the flags accept (problem i's seed was --seed + i, past the Engine's range)."""

from __future__ import annotations

import pytest

from nanochat.errors import RequestError
from nanochat.sampling import MAX_SEED
from tests.test_engine import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


def _plan(args, source):
    from scripts.chat_rl import eval_plan, parse_config
    return eval_plan(parse_config(args), 1319, source)


def test_the_eval_scores_only_what_the_source_held_out():
    sft100 = {"test_holdouts": {"GSM8K": [100, "sft"], "MMLU": [5, "mid"]}}
    # RL's own holdout 200 or the train split: the SFT model trained on test[100:]
    for args in (["--test-holdout", "200"], []):
        n, said = _plan(args + ["--eval-examples", "400"], sft100)
        assert n == 100 and "the sft model it starts from trained on the rest (chat_sft --test-holdout 100)" in said
    # the smaller of the two holdouts wins, each named
    n, said = _plan(["--test-holdout", "50", "--eval-examples", "400"], sft100)
    assert n == 50 and "--test-holdout 50" in said
    assert _plan(["--eval-examples", "80"], sft100) == (80, None)             # within both: nothing to say
    assert _plan(["--eval-examples", "400"], {}) == (400, None)                # nothing recorded: as before
    assert _plan(["--eval-examples", "400", "--eval-every", "-1"], sft100) == (100, None)   # no eval, no notice


def test_a_source_trained_on_every_test_problem_needs_the_eval_off():
    mid0 = {"test_holdouts": {"GSM8K": [0, "mid"]}}
    with pytest.raises(RequestError, match=r"--eval-every: got 60; accepted: -1 or 0 .*mid_train --test-holdout 0"):
        _plan(["--test-holdout", "10"], mid0)
    assert _plan(["--test-holdout", "10", "--eval-every", "0"], mid0)[0] == 0


def test_chat_rl_scores_the_sources_held_out_problems_under_the_top_seed(chat_model, tmp_path, monkeypatch, capsys):
    """End to end: an SFT checkpoint trained on GSM8K test[3:]; RL trains on test[10:] and evaluates
    (greedy and 2 samples, --seed at the top of its range) the first 3 problems only, and says so."""
    from dataclasses import asdict

    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tasks import evaluate as task_eval
    from nanochat.tokenizer import tokenizer_dir
    from scripts import chat_rl
    model, tokenizer = chat_model
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tokenizer.save(tokenizer_dir(tmp_path))
    save_checkpoint(checkpoint_dir("sft", "d2", tmp_path), 7, model_state=model.state_dict(),
                    meta={"phase": "sft", "config": {"test_holdout": 3}, "model_config": asdict(model.config),
                          "tokenizer_fingerprint": tokenizer.fingerprint})
    calls, real = [], task_eval.run_generative

    def recording(*a, **kw):
        calls.append((kw["max_problems"], kw["num_samples"], kw.get("seed", 42)))
        return real(*a, **kw)

    monkeypatch.setattr(task_eval, "run_generative", recording)
    out = chat_rl.main(["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
                        "--max-new-tokens", "2", "--test-holdout", "10", "--eval-examples", "8", "--eval-every", "1",
                        "--eval-samples", "2", "--num-iterations", "1", "--seed", str(MAX_SEED)])
    assert out["final_gsm8k_sampled_pass@2"] is not None
    assert {(n, k) for n, k, _ in calls} == {(3, 1), (3, 2)} and all(s + 2 <= MAX_SEED for *_, s in calls)
    assert ("--eval-examples 8: scoring the first 3 GSM8K test problems only: the sft model it starts from trained "
            "on the rest (chat_sft --test-holdout 3)") in capsys.readouterr().out
