"""An explicit --resume of a mid / SFT run saved by another number of torchrun processes is refused
from meta.json, before the conversation mixture is read and the model loaded (it was refused only
after both: minutes for a real mixture at d20)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from nanochat.checkpoint import CheckpointError
from tests.test_engine import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))


def _save(phase, step, model, tok, base, **meta):
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    save_checkpoint(checkpoint_dir(phase, "d2", base), step, model_state=model.state_dict(),
                    meta={"phase": phase, "model_config": asdict(model.config),
                          "tokenizer_fingerprint": tok.fingerprint, **meta})


@pytest.mark.parametrize("script", ["mid_train", "chat_sft"])
def test_resume_of_another_world_size_is_refused_before_the_mixture(script, chat_model, tmp_path, monkeypatch):
    import importlib

    from nanochat import chat_data
    from nanochat.tokenizer import tokenizer_dir

    model, tok = chat_model
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tok.save(tokenizer_dir(tmp_path))
    source, own = ("base", "mid") if script == "mid_train" else ("mid", "sft")
    _save(source, 7, model, tok, tmp_path)
    _save(own, 3, model, tok, tmp_path, train={"world_size": 2, "total_batch_size": 1024})

    def never(*a, **kw):
        raise AssertionError("the mixture was read before the resume was checked")

    monkeypatch.setattr(chat_data, "build_mixture", never)
    main = importlib.import_module(f"scripts.{script}").main
    with pytest.raises(CheckpointError, match=r"--resume: the checkpoint has a world size \(torchrun processes\) "
                                              r"2 but this run has 1"):
        main(["--device", "cpu", "--model-tag", "d2", "--resume", "latest"])
