"""Review 8 of `--quantize int8` serving and the inference load path: chat_cli / chat_web quantise
the float32 weights (the int8 model chat_eval / base_eval score), a mistyped --model-tag in the
eval scripts names the tags there are, and a model.pt that is no nanochat model file (another
object, not a torch file at all, an int8 state_dict) is named instead of a bare TypeError /
KeyError or a list of missing keys."""

from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch

from nanochat.checkpoint import CheckpointError, checkpoint_dir, load_model, save_checkpoint
from nanochat.quantize import Int8Linear, quantize_model
from tests.test_engine import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's


def _int8_rows(model) -> dict:
    return {name: (m.qweight, m.scale) for name, m in model.named_modules()
            if isinstance(m, Int8Linear) and m._rows is None}


def test_served_int8_model_is_the_one_the_evals_score(sft_checkpoint, monkeypatch):
    """chat_cli and chat_web cast the model to the compute dtype and then quantised it: the int8
    values came from bf16 copies (~6% of them, and the row scales, differ from those quantised
    from the float32 weights), so chat_eval / base_eval --quantize int8, which quantise the
    float32 weights, scored another model than the one served."""
    from nanochat import engine as engine_mod
    from scripts import chat_cli, chat_web

    want = _int8_rows(quantize_model(load_model("sft", "cpu")[0], "int8"))
    seen = []
    real = engine_mod.Engine

    class Recording(real):
        def __init__(self, model, *args, **kwargs):
            seen.append(model)
            super().__init__(model, *args, **kwargs)

    monkeypatch.setattr(engine_mod, "Engine", Recording)
    flags = ["--device", "cpu", "--dtype", "bf16", "--quantize", "int8"]
    assert chat_cli.main(["-p", "Hi", "-t", "0", "-m", "2", *flags]) == 0
    chat_web.load_replicas(chat_web.parse_args(flags))
    assert len(seen) == 2
    for model in seen:
        assert model.wte.weight.dtype == torch.bfloat16   # the cast still happened
        got = _int8_rows(model)
        assert got.keys() == want.keys()
        for name, (q, s) in want.items():
            assert torch.equal(got[name][0], q) and torch.equal(got[name][1], s), name


def test_eval_scripts_name_the_model_tags_there_are(sft_checkpoint, tiny_corpus):
    """base_eval / chat_eval --model-tag d9 (chat_cli and chat_web check the tag themselves) said
    only "no checkpoint recorded in .../d9 (latest.json missing)"."""
    from scripts import base_eval

    base = sft_checkpoint
    save_checkpoint(checkpoint_dir("base", "d2", base), 3, model_state={"w": torch.zeros(1)}, meta={})
    with pytest.raises(CheckpointError, match=r"base/d9 \(latest.json missing\); there is no model tag 'd9': "
                                              r"the base model tags are d2 \(--model-tag\)"):
        base_eval.main(["--data-dir", str(tiny_corpus), "--eval", "bpb", "--device", "cpu", "--model-tag", "d9",
                        "--quantize", "int8"])
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 7 in .*sft/d9; steps on disk: none; there "
                                              r"is no model tag 'd9': the sft model tags are d2"):
        load_model("sft", "cpu", model_tag="d9", step=7)
    # an existing tag without that step: no tag hint (the tag is right)
    with pytest.raises(CheckpointError, match=r"steps on disk: \[7\]$"):
        load_model("sft", "cpu", model_tag="d2", step=5)


def _replace_model_file(base, write) -> None:
    step_dir = checkpoint_dir("sft", "d2", base) / "step_000007"
    write(step_dir / "model.pt")
    (step_dir / "sums_rank0.json").unlink(missing_ok=True)   # a hand-made or older checkpoint: no sums to catch it


def test_a_foreign_model_file_is_named(sft_checkpoint, chat_model):
    """model.pt holding another object was load_state_dict's bare TypeError, a file that is no
    torch file at all a bare `KeyError: 101`, and an int8 state_dict (quantize.py's) a list of
    missing keys that never said why."""
    base = sft_checkpoint
    _replace_model_file(base, lambda p: torch.save([1, 2, 3], p))
    with pytest.raises(CheckpointError, match=r"step_000007: model.pt holds a list, not a model state_dict"):
        load_model("sft", "cpu")
    _replace_model_file(base, lambda p: p.write_bytes(b"hello world, not a checkpoint\n"))
    with pytest.raises(CheckpointError, match=r"step_000007/model.pt: not a file torch.load can read \(KeyError"):
        load_model("sft", "cpu")
    model, tokenizer = chat_model
    quantised = quantize_model(copy.deepcopy(model), "int8")   # the session's model stays float
    save_checkpoint(checkpoint_dir("sft", "d2", base), 8, model_state=quantised.state_dict(),
                    meta={"model_config": asdict(model.config), "tokenizer_fingerprint": tokenizer.fingerprint})
    with pytest.raises(CheckpointError, match=r"model.pt holds int8-quantised weights .* load the float checkpoint "
                                              r"and pass --quantize int8"):
        load_model("sft", "cpu")
