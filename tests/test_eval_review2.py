"""Evaluation review 2: defects found by running base_eval / chat_eval / report as a user would.

* chat_eval scored test problems the model was trained on: mid / SFT / RL with --test-holdout N
  (setup.sh's tiny preset, or any offline run: there are no train splits of ARC / MMLU / GSM8K) train
  on the local test files past their first N problems, yet `chat_eval -i sft` scored every problem
  and reported the contaminated accuracy as the model's complete score. Now only the unseen first N
  are scored (--max-problems is a maximum), said on the console and labelled partial; a holdout of 0 (no
  unseen problem) is refused naming -a.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch


def save(base, tokenizer, phase: str, step: int, **meta) -> dict:
    """A 1-layer GPT saved as <phase>/d1 <step>, with `meta` (config, source) as chat_train writes it."""
    from nanochat import gpt
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tokenizer import tokenizer_dir

    tokenizer.save(tokenizer_dir(base))
    cfg = gpt.GPTConfig(sequence_len=512, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=2,
                        n_embd=32, window_pattern="L")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    model.init_weights()
    save_checkpoint(checkpoint_dir(phase, "d1", base), step, model_state=model.state_dict(),
                    meta={"phase": phase, "model_tag": "d1", "model_config": asdict(cfg),
                          "tokenizer_fingerprint": tokenizer.fingerprint, **meta})
    return {"phase": phase, "model_tag": "d1", "step": step}


@pytest.fixture
def arc5(tmp_path, shared_data):
    """An eval dir whose ARC-Easy file holds 5 problems (and MMLU 5)."""
    d = tmp_path / "eval"
    d.mkdir()
    for name in ("arc_easy.jsonl", "mmlu.jsonl"):
        lines = (shared_data / "eval" / name).read_text().splitlines()[:5]
        (d / name).write_text("\n".join(lines) + "\n")
    return d


def chat_eval(arc5, tmp_path, *extra):
    from scripts import chat_eval as script

    return script.main(["-i", "sft", "--device", "cpu", "--data-dir", str(arc5), "--out", str(tmp_path / "r.json"),
                        *extra])


def test_chat_eval_scores_only_the_test_problems_training_held_out(base, tiny_tokenizer, arc5, tmp_path, capsys):
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": 2})
    out = chat_eval(arc5, tmp_path, "-a", "ARC-Easy")
    arc = out["results"]["ARC-Easy"]
    assert (arc["total"], arc["problems"]) == (2, 5), arc           # problems 2..4 were trained on
    assert out["all_problems"] is False                              # a partial score, labelled so
    printed = capsys.readouterr().out
    assert "--test-holdout 2" in printed and "| ARC-Easy (2 of 5 problems) |" in printed, printed
    assert json.loads((tmp_path / "r.json").read_text())["results"]["ARC-Easy"]["total"] == 2
    # fewer than the held-out problems: as asked
    assert chat_eval(arc5, tmp_path, "-a", "ARC-Easy", "-x", "1")["results"]["ARC-Easy"]["total"] == 1


def test_max_problems_past_the_holdout_scores_the_held_out_ones(base, tiny_tokenizer, arc5, tmp_path, capsys):
    """--max-problems is a maximum: past the holdout, the held-out problems (said), never the rest."""
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": 2})
    out = chat_eval(arc5, tmp_path, "-a", "ARC-Easy", "-x", "4")
    assert out["results"]["ARC-Easy"]["total"] == 2
    assert "ARC-Easy: scoring its first 2 problems only" in capsys.readouterr().out


def test_a_holdout_of_zero_names_the_tasks_it_trained_on_entirely(base, tiny_tokenizer, arc5, tmp_path):
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": 0})
    with pytest.raises(ValueError, match=r"-a/--task-name: .*ARC-Easy.*every one of its test problems"):
        chat_eval(arc5, tmp_path, "-a", "ARC-Easy")


def test_the_holdout_of_the_checkpoint_it_was_trained_from_counts(base, tiny_tokenizer, arc5, tmp_path):
    """SFT held out 4 problems, but the mid checkpoint it started from held out 1 (and mid trains on
    MMLU, which SFT does not): problem 1.. of ARC and MMLU were trained on by mid."""
    mid = save(base, tiny_tokenizer, "mid", 5, config={"test_holdout": 1})
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": 4}, source=mid)
    out = chat_eval(arc5, tmp_path, "-a", "ARC-Easy|MMLU")
    assert out["results"]["ARC-Easy"]["total"] == 1 and out["results"]["MMLU"]["total"] == 1


def test_no_holdout_scores_every_problem(base, tiny_tokenizer, arc5, tmp_path):
    """Trained on the train splits (--test-holdout -1, the default), or SFT's holdout leaving MMLU
    out of its mixture: every problem is unseen."""
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": -1})
    assert chat_eval(arc5, tmp_path, "-a", "ARC-Easy")["results"]["ARC-Easy"]["total"] == 5
    save(base, tiny_tokenizer, "sft", 4, config={"test_holdout": 2})
    assert chat_eval(arc5, tmp_path, "-a", "MMLU")["results"]["MMLU"]["total"] == 5


@pytest.mark.parametrize("value", ["", " ", "|", ", "])
def test_an_empty_task_list_is_refused_not_every_task(value):
    """-a "" (an unset shell variable: -a "$TASKS") ran all six tasks, hours of generation, where
    -a " " was refused: an empty list names no task."""
    from scripts.chat_eval import parse_args

    with pytest.raises(ValueError, match=r"-a/--task-name: got '.*'; accepted: ARC-Easy\|"):
        parse_args(["-i", "sft", "-a", value])
    assert parse_args(["-i", "sft"]).tasks()[0] == "ARC-Easy"   # not given: every task


def test_the_sources_holdouts_are_recorded_so_removing_the_source_loses_nothing(base, tiny_tokenizer, arc5,
                                                                                 tmp_path, capsys):
    """A chat stage records, when it starts, the test problems its source chain trained on: after the
    mid checkpoint is removed, chat_eval of the SFT model still scores only mid's held-out problem
    (it used to say it could not know and score the rest, which mid had trained on)."""
    import shutil
    from types import SimpleNamespace
    from nanochat.chat_start import start_point
    from nanochat.checkpoint import checkpoint_dir

    save(base, tiny_tokenizer, "base", 7)
    mid = save(base, tiny_tokenizer, "mid", 5, config={"test_holdout": 1}, source=save(base, tiny_tokenizer, "base", 7))
    cfg = SimpleNamespace(source="mid", model_tag="d1", step="latest", resume=None)
    _, _, source, _ = start_point("sft", cfg, base)
    assert source["test_holdouts"] == {"MMLU": [1, "mid"], "ARC-Easy": [1, "mid"], "ARC-Challenge": [1, "mid"],
                                       "GSM8K": [1, "mid"]}
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": 4}, source={**mid, **source})
    shutil.rmtree(checkpoint_dir("mid", "d1", base))
    out = chat_eval(arc5, tmp_path, "-a", "ARC-Easy|MMLU")
    assert out["results"]["ARC-Easy"]["total"] == 1 and out["results"]["MMLU"]["total"] == 1
    assert "not known" not in capsys.readouterr().out


def test_a_removed_source_without_a_record_is_said(base, tiny_tokenizer, arc5, tmp_path, capsys):
    """A checkpoint from before the record whose source is gone: what it trained on is unknown, said."""
    import shutil
    from nanochat.checkpoint import checkpoint_dir

    mid = save(base, tiny_tokenizer, "mid", 5, config={"test_holdout": 1})
    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": 4}, source=mid)
    shutil.rmtree(checkpoint_dir("mid", "d1", base))
    out = chat_eval(arc5, tmp_path, "-a", "ARC-Easy")
    assert out["results"]["ARC-Easy"]["total"] == 4              # its own holdout still counts
    assert "are not known" in capsys.readouterr().out


def test_results_are_named_after_the_folder_evaluated_not_meta(base, tiny_tokenizer, arc5, tmp_path):
    """A checkpoint whose meta.json has no model_tag (or another folder's, after a copy aside) was
    written as sft_default_step*.json / reported under that name: the folder evaluated names it."""
    import shutil
    from nanochat.checkpoint import checkpoint_dir
    from scripts import chat_eval as script

    save(base, tiny_tokenizer, "sft", 3, config={"test_holdout": -1})
    shutil.move(checkpoint_dir("sft", "d1", base), checkpoint_dir("sft", "d1_old", base))   # meta still says d1
    script.main(["-i", "sft", "--device", "cpu", "--data-dir", str(arc5), "-a", "ARC-Easy", "-x", "1"])
    names = sorted(p.name for p in (base / "chat_eval").iterdir())
    assert names == ["sft_d1_old_step000003.json"], names
