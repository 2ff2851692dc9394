"""chat_rl's sampled evaluation (--eval-samples K) draws a problem's K samples --sample-batch-size rows
at a time, as rollouts are drawn (one call of K rows ignored the flag a user lowered to fit the KV
cache in memory): nanochat/tasks/evaluate.run_generative(rows_per_call=N)."""

from __future__ import annotations

import pytest

from tests.test_engine import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


class _Recording:
    """An engine answering '#### <seed mod 7>' in every row, recording (rows, seed) per call."""
    max_seq_len = 4096

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate_batch(self, prompt, num_samples, seed, **kw):
        self.calls.append((num_samples, seed))
        return [prompt + self.tok.encode(f"#### {seed % 7}") for _ in range(num_samples)], None


def test_run_generative_draws_in_chunks_with_distinct_seeds(chat_model, shared_data):
    from nanochat.tasks.evaluate import run_generative
    from nanochat.tasks.gsm8k import GSM8K

    _, tok = chat_model
    gsm = GSM8K(data_dir=shared_data)
    whole, chunked = _Recording(tok), _Recording(tok)
    one = run_generative(whole, tok, gsm, "cpu", num_samples=5, max_problems=2, seed=11)
    res = run_generative(chunked, tok, gsm, "cpu", num_samples=5, max_problems=2, seed=11, rows_per_call=2)
    assert whole.calls == [(5, 11), (5, 12)]   # 0: one call, problem i's seed + i, as it always was
    assert [n for n, _ in chunked.calls] == [2, 2, 1, 2, 2, 1]
    seeds = [s for _, s in chunked.calls]
    assert seeds[0] == 11 and seeds[3] == 12 and len(set(seeds)) == 6   # chunk 0 keeps the seed; others differ
    assert len(res.passed_at) == len(one.passed_at) == 5 and res.total == 2
    with pytest.raises(ValueError, match="rows_per_call: got -1"):
        run_generative(whole, tok, gsm, "cpu", num_samples=2, max_problems=1, rows_per_call=-1)


def test_chat_rl_eval_samples_follow_sample_batch_size(chat_model, tmp_path, monkeypatch):
    from dataclasses import asdict

    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.engine import Engine
    from nanochat.tokenizer import tokenizer_dir
    from scripts import chat_rl

    model, tokenizer = chat_model
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tokenizer.save(tokenizer_dir(tmp_path))
    save_checkpoint(checkpoint_dir("sft", "d2", tmp_path), 7, model_state=model.state_dict(),
                    meta={"phase": "sft", "config": {}, "model_config": asdict(model.config),
                          "tokenizer_fingerprint": tokenizer.fingerprint})
    rows, real = [], Engine.generate_batch

    def recording(self, tokens, **kw):   # the evaluation's calls (rollouts go through generate)
        rows.append(kw.get("num_samples", 1))
        return real(self, tokens, **kw)

    monkeypatch.setattr(Engine, "generate_batch", recording)
    out = chat_rl.main(["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
                        "--max-new-tokens", "2", "--test-holdout", "10", "--eval-examples", "2", "--eval-every", "1",
                        "--eval-samples", "3", "--sample-batch-size", "2", "--num-iterations", "1"])
    assert out["final_gsm8k_sampled_pass@3"] is not None
    # each evaluation: greedy over the 2 problems (1 row each), then each problem's 3 samples as 2 + 1 rows
    per_eval = [1, 1, 2, 1, 2, 1]
    assert rows and rows == per_eval * (len(rows) // len(per_eval)), rows
