"""RL review 7 (scripts/chat_rl.py): an explicit --resume refuses a --source naming another phase
than the one its run started from (the flag was silently ignored, and recorded in the new
checkpoint's config as if it applied), and compares the training file --data-dir resolves to, not
the flag's text (--data-dir naming the default data refused a resume of the very same problems)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from tests.test_engine import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: test_engine's model (sft_checkpoint saves it)


ARGS = ["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
        "--max-new-tokens", "4", "--test-holdout", "5", "--eval-every", "-1", "--num-iterations", "2",
        "--save-every", "1"]


def test_a_resume_refuses_another_source_and_reads_data_dir_as_the_file(sft_checkpoint, chat_model, shared_data,
                                                                         monkeypatch):
    from nanochat.checkpoint import CheckpointError, checkpoint_dir, read_meta, save_checkpoint
    from scripts import chat_rl
    monkeypatch.delenv("NANOCHAT_EVAL_DIR", raising=False)   # the default data: ../shared/data/eval
    model, tokenizer = chat_model
    chat_rl.main(ARGS + ["--num-iterations", "1"])   # a run from sft/d2 (the default --data-dir)
    rl_dir = checkpoint_dir("rl", "d2", sft_checkpoint)
    # a mid checkpoint under the same tag: --source mid resolves, and the resume must not take it as its start
    save_checkpoint(checkpoint_dir("mid", "d2", sft_checkpoint), 3, model_state=model.state_dict(),
                    meta={"model_config": asdict(model.config), "tokenizer_fingerprint": tokenizer.fingerprint})
    with pytest.raises(CheckpointError, match="--source mid: the run --resume latest continues started from --source sft"):
        chat_rl.main(ARGS + ["--resume", "latest", "--source", "mid"])
    # the same problems named explicitly: continued (was refused: "had --data-dir None, this run has ...")
    done = chat_rl.main(ARGS + ["--resume", "latest", "--data-dir", str(shared_data)])
    assert sorted(done["losses"]) == [1]
    assert read_meta(rl_dir, 2)["source"]["phase"] == "sft"


def test_resume_mismatch_compares_sources_and_files():
    from scripts.chat_rl import parse_config, resume_mismatch
    meta = {"source": {"phase": "sft"}, "config": {"data_dir": None, "seed": 42},
            "train": {"data_source": "/data/eval/gsm8k.jsonl"}}
    assert resume_mismatch(meta, parse_config([])) is None
    assert resume_mismatch(meta, parse_config(["--source", "sft"])) is None
    assert "--source mid" in resume_mismatch(meta, parse_config(["--source", "mid"]))
    assert "--source mid" in resume_mismatch({**meta, "source": {"phase": "sft"}}, parse_config(["--source=mid"]))
    # the file decides when both sides know it; a checkpoint without one falls back to the flag's text
    cfg = parse_config(["--data-dir", "/data"])
    assert resume_mismatch(meta, cfg, data_source="/data/eval/gsm8k.jsonl") is None
    assert "trained on /data/eval/gsm8k.jsonl" in resume_mismatch(meta, cfg, data_source="/other/gsm8k.jsonl")
    old = {**meta, "train": {}}
    assert "--data-dir None" in resume_mismatch(old, cfg, data_source="/data/eval/gsm8k.jsonl")
    # not named on the command line: the default --source sft of a run started from mid is no mismatch
    assert resume_mismatch({**meta, "source": {"phase": "mid"}}, parse_config([])) is None
