"""The checkpoint disk plan of a multi-rank run counts every rank's optimizer file (each rank writes
its own optim_rank<R>.pt, with the state MuonAdamW replicates across ranks): base_train planned
with one rank's layout, ~8 GB short for a 3-GPU d20 run (optim.optimizer_state_bytes)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.test_base_train import TINY


class _Planned(Exception):
    pass


def test_base_train_plans_the_disk_for_its_world_size(env, monkeypatch):
    """base_train hands its runtime's world size and --fsdp to the checkpoint size estimate. The
    runtime is made to report 2 ranks; the run is stopped at the disk plan, before anything
    collective, and the estimate is larger than one rank's (the replicated AdamW moments)."""
    from nanochat import optim
    from scripts import base_train

    real_init, real_bytes = base_train.init_runtime, optim.optimizer_state_bytes
    monkeypatch.setattr(base_train, "init_runtime",
                        lambda *a, **kw: dataclasses.replace(real_init(*a, **kw), world_size=2))
    seen = {}

    def planned(model, **kw):
        seen.update(kw, total=real_bytes(model, **kw), one_rank=real_bytes(model, normuon=kw.get("normuon", False)))
        raise _Planned

    monkeypatch.setattr(optim, "optimizer_state_bytes", planned)
    with pytest.raises(_Planned):
        base_train.main(TINY + env + ["--total-batch-size", "1024", "--num-iterations", "2", "--eval-every", "-1",
                                      "--model-tag", "ranks"])
    assert seen["world_size"] == 2 and seen["fsdp"] is False
    assert seen["total"] > seen["one_rank"] > 0


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from tests.test_engine import tiny_chat_model
    return tiny_chat_model(str(tiny_corpus))


def _stop_at_the_plan(monkeypatch, seen: dict):
    from nanochat import optim
    real_bytes = optim.optimizer_state_bytes

    def planned(model, **kw):
        seen.update(kw, total=real_bytes(model, **kw), one_rank=real_bytes(model))
        raise _Planned

    monkeypatch.setattr(optim, "optimizer_state_bytes", planned)


def _two_ranks(module, monkeypatch):
    real_init = module.init_runtime
    monkeypatch.setattr(module, "init_runtime", lambda *a, **kw: dataclasses.replace(real_init(*a, **kw), world_size=2))


def test_chat_rl_plans_the_disk_for_its_world_size(sft_checkpoint, monkeypatch):
    from scripts import chat_rl
    _two_ranks(chat_rl, monkeypatch)
    seen = {}
    _stop_at_the_plan(monkeypatch, seen)
    with pytest.raises(_Planned):
        chat_rl.main(["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "2", "--num-samples", "2",
                      "--max-new-tokens", "4", "--test-holdout", "1", "--eval-every", "-1", "--num-iterations", "1"])
    assert seen["world_size"] == 2 and seen["total"] > seen["one_rank"] > 0


def test_mid_train_plans_the_disk_for_its_world_size(chat_model, tmp_path, monkeypatch):
    from dataclasses import asdict

    from nanochat import common
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tokenizer import tokenizer_dir
    from scripts import mid_train

    model, tok = chat_model
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tok.save(tokenizer_dir(tmp_path))
    save_checkpoint(checkpoint_dir("base", "d2", tmp_path), 7, model_state=model.state_dict(),
                    meta={"phase": "base", "model_config": asdict(model.config), "tokenizer_fingerprint": tok.fingerprint})
    _two_ranks(common, monkeypatch)
    seen = {}
    _stop_at_the_plan(monkeypatch, seen)
    with pytest.raises(_Planned):
        mid_train.main(["--device", "cpu", "--model-tag", "d2", "--num-iterations", "1", "--device-batch-size", "4",
                        "--max-seq-len", "128", "--total-batch-size", "1024", "--test-holdout", "50", "--no-compile"])
    assert seen["world_size"] == 2 and seen["total"] > seen["one_rank"] > 0
