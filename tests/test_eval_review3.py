"""Evaluation review 3: defects found using base_eval, CORE and the task loaders as a user would.

* base_eval named its results after meta.json's "model_tag", not the checkpoint folder it loaded:
  a checkpoint without that key printed "evaluating base/None", wrote base_None_step....json and
  logged model_tag None to the report; a folder renamed to keep an older run (d1 -> d1_old) was
  written over the current run's d1 results file and reported as d1.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch


@pytest.fixture
def base(tmp_path, monkeypatch, tiny_tokenizer):
    from nanochat.tokenizer import tokenizer_dir

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    tiny_tokenizer.save(tokenizer_dir(base))
    return base


def save(base, tokenizer, tag: str, step: int = 1, **meta) -> None:
    """A 1-layer GPT (random weights) saved as base/<tag> <step> with `meta`."""
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.gpt import GPT, GPTConfig

    config = GPTConfig(sequence_len=64, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=2,
                       n_embd=32, window_pattern="L")
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_checkpoint(checkpoint_dir("base", tag, base), step, model_state=model.state_dict(),
                    meta={"model_config": asdict(config), "tokenizer_fingerprint": tokenizer.fingerprint, **meta})


def sample_eval(*argv) -> dict:
    from scripts import base_eval

    return base_eval.main(["--eval", "sample", "--max-tokens", "1", "--device", "cpu", "--dtype", "float32", *argv])


def test_results_are_named_after_the_checkpoint_folder_evaluated(base, tiny_tokenizer, capsys):
    save(base, tiny_tokenizer, "d1")                            # meta.json without a model_tag
    out = sample_eval()
    assert out["model_tag"] == "d1" and out["output"].endswith("base_d1_step000001.json"), out["output"]
    assert "evaluating base/d1 step 1" in capsys.readouterr().out
    # a renamed copy of an older run: its meta still says d1, its results must not replace d1's
    save(base, tiny_tokenizer, "d1_old", model_tag="d1")
    old = sample_eval("--model-tag", "d1_old")
    assert old["model_tag"] == "d1_old" and old["output"].endswith("base_d1_old_step000001.json")
    assert json.loads((base / "eval" / "base_d1_step000001.json").read_text())["model_tag"] == "d1"
    section = json.loads((base / "report" / "sections" / "base-model-evaluation.json").read_text())
    assert [e["data"]["model_tag"] for e in section["entries"]] == ["d1", "d1_old"]


def test_offline_hellaswag_loses_the_wikihow_markup(tmp_path, shared_data):
    """Two thirds of HellaSwag items hold "[header] ... [title] ... [step]" markup (the data README:
    "text not preprocessed"); CORE scored every choice's NLL with those tokens in it. The DCLM bundle's
    text is clean: a [title] ends a sentence, the other tags go."""
    from nanochat import core_data

    row = {"activity_label": "Personal Care and Style", "ctx": "[header] How to cook [title] Prepare it. [step] Mix.",
           "endings": ["[title] Earn a degree.", "[substeps] Stir it. [title] Serve", "Wait [www.x.com] now."], "label": 1}
    (tmp_path / "hellaswag.jsonl").write_text(json.dumps(row) + "\n")
    data = core_data.load_core_data(tasks=["hellaswag_zeroshot"], data_dir=tmp_path)
    item = data.tasks[0][1][0]
    assert item == {"query": "Personal Care and Style: How to cook. Prepare it. Mix.",
                    "choices": ["Earn a degree.", "Stir it. Serve", "Wait now."], "gold": 1}
    # the shipped file: all but a handful of odd brackets gone, no item left without text
    data = core_data.load_core_data(tasks=["hellaswag"], data_dir=shared_data / "eval")
    items = data.tasks[0][1]
    tagged = [i for i in items if any(t in i["query"] + "".join(i["choices"]) for t in ("[title]", "[step]",
                                                                                        "[header]", "[substeps]"))]
    assert not tagged and all(c.strip() for i in items for c in i["choices"])


@pytest.mark.parametrize("question", ["Sarah was a better surgeon than Maria.", "_ told _ the news."])
def test_offline_winogrande_needs_one_blank(tmp_path, question):
    """A WinoGrande sentence without its '_' loaded as an item with nothing after the options: CORE
    then scored each option's last token (the names) and counted it, where the loader refuses
    every other record it cannot score."""
    from nanochat import core_data
    from nanochat.errors import DataError

    good = {"question": "Sarah was a better surgeon than Maria so _ got the hard cases.", "choices": ["Sarah", "Maria"],
            "answer": 0}
    lines = [json.dumps(good), "", json.dumps({**good, "question": question})]
    (tmp_path / "winogrande.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"winogrande.jsonl: record 2 .*one '_'.*fix or delete line 3"):
        core_data.load_core_data(tasks=["winogrande"], data_dir=tmp_path)
