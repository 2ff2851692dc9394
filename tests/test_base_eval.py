"""scripts/base_eval.py --eval bpb with --eval-tokens beyond the validation split: the loader makes one
finite pass, so every validation token is scored at most once (a cycling loader re-read the split
and counted its tokens two, ten, a hundred times), and the banner, the results JSON and the report
say how many tokens the figure actually covers."""

from __future__ import annotations

import json
from dataclasses import asdict

import pyarrow.parquet as pq
import pytest
import torch

SEQ_LEN, BATCH = 64, 4      # 256 tokens per step; the val shard's 85 documents fill ~85 rows of 64


@pytest.fixture(scope="module")
def checkpoint(base_dir, tiny_tokenizer):
    """A 1-layer GPT (random weights) saved as base/d1 step 1 in the module's base dir."""
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.gpt import GPT, GPTConfig

    config = GPTConfig(sequence_len=SEQ_LEN, vocab_size=tiny_tokenizer.vocab_size, n_layer=1, n_head=2,
                       n_kv_head=2, n_embd=32, window_pattern="L")
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_checkpoint(checkpoint_dir("base", "d1", base_dir), 1, model_state=model.state_dict(),
                    meta={"model_config": asdict(config), "tokenizer_fingerprint": tiny_tokenizer.fingerprint})
    return base_dir


def val_tokens(tiny_corpus, tokenizer) -> int:
    """The val shard's tokens one pass can score: each document (BOS + text) enters the loader
    cropped to one row (SEQ_LEN + 1 tokens) at most. An upper bound on the targets scored."""
    texts = pq.read_table(sorted(tiny_corpus.glob("*.parquet"))[-1], columns=["text"]).column("text").to_pylist()
    return sum(min(len(tokenizer.encode(t)) + 1, SEQ_LEN + 1) for t in texts)


def run_bpb(env, tmp_path, eval_tokens: int, name: str) -> dict:
    from scripts import base_eval

    out = tmp_path / f"{name}.json"
    results = base_eval.main([*env, "--eval", "bpb", "--device", "cpu", "--dtype", "float32",
                              "--device-batch-size", str(BATCH), "--eval-tokens", str(eval_tokens),
                              "--output", str(out)])
    assert json.loads(out.read_text())["bpb_tokens"] == results["bpb_tokens"]
    return results


def test_eval_tokens_beyond_the_split_score_each_token_once(checkpoint, env, tmp_path, capsys, tiny_corpus,
                                                           tiny_tokenizer):
    upper = val_tokens(tiny_corpus, tiny_tokenizer)
    ten = run_bpb(env, tmp_path, 10 * upper, "ten")
    banner_ten = capsys.readouterr().out
    hundred = run_bpb(env, tmp_path, 100 * upper, "hundred")
    banner_hundred = capsys.readouterr().out
    covered = ten["bpb_tokens"]
    # one pass: the same tokens and the same figure however much more is asked
    assert 0.5 * upper < covered <= upper
    assert hundred["bpb_tokens"] == covered and hundred["bpb_tokens_by_split"] == {"val": covered}
    assert hundred["bpb"]["val"] == pytest.approx(ten["bpb"]["val"], rel=1e-9)
    for banner, asked in ((banner_ten, 10 * upper), (banner_hundred, 100 * upper)):
        assert f"over {covered:,} tokens (the whole split" in banner, banner
        assert f"--eval-tokens {asked:,}" in banner, banner
    # the report section says what was covered and what was asked
    section = json.loads((checkpoint / "report" / "sections" / "base-model-evaluation.json").read_text())
    data = section["entries"][-1]["data"]
    assert data["bpb_tokens"] == covered and data["bpb_tokens_asked"] == 100 * upper


def test_eval_tokens_within_the_split_are_exact(checkpoint, env, tmp_path, capsys):
    """Below the split's size nothing changes: whole batches of --eval-tokens, no 'whole split' note,
    and the first 4 batches score the same as the first 4 of a longer run would."""
    small = run_bpb(env, tmp_path, 4 * BATCH * SEQ_LEN, "small")
    banner = capsys.readouterr().out
    assert small["bpb_tokens"] == 4 * BATCH * SEQ_LEN
    assert "whole split" not in banner and f"over {4 * BATCH * SEQ_LEN:,} tokens" in banner, banner
    # one step and a half asked: rounded down to one whole batch (the banner says so); the report
    # names what was asked only when the split ran out, not for this rounding
    half = run_bpb(env, tmp_path, BATCH * SEQ_LEN * 3 // 2, "half")
    assert half["bpb_tokens"] == BATCH * SEQ_LEN
    assert "in whole batches" in capsys.readouterr().out
    section = json.loads((checkpoint / "report" / "sections" / "base-model-evaluation.json").read_text())
    assert "bpb_tokens_asked" not in section["entries"][-1]["data"]
