"""Review 76 of the evaluations as a user meets them (chat_eval, base_eval, the multiple-choice tasks).
Each test failed before its fix:

* a multiple-choice row with a single choice (a damaged ARC / MMLU export) loaded, and its one letter
  always won: such rows scored 100% (a file of them gave ARC-Easy 1.0000) against a 0.25 baseline;
* 4 MMLU test questions list their answer's text twice (row 2178: "687" as A and B): the model naming
  the copy that is not the gold's letter scored wrong (CORE already counts such a twin);
* chat_eval took any --device / --dtype and refused a bad one only in init_runtime, after every task's
  data had loaded and the lineage warning was said; a --data-dir that does not exist was reported as
  six paths tried plus the hub's failure, not as the flag;
* a checkpoint whose model has fewer token ids than the tokenizer (trained with another one, meta.json
  without a tokenizer fingerprint) stopped chat_eval and base_eval at the first prompt, after the model
  had loaded, with torch's "IndexError: index out of range in self".
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from nanochat.errors import DataError, RequestError

Q = {"id": "q", "question": "Sky colour?", "choices": ["green", "blue", "red", "black"], "answer": 1}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ------------------------------------------------------------------ one choice is no question

@pytest.mark.parametrize("task, file", [("ARC-Easy", "arc_easy.jsonl"), ("MMLU", "mmlu.jsonl")])
def test_a_row_with_a_single_choice_is_refused_naming_file_and_line(tmp_path, task, file):
    from nanochat.tasks import get_task

    _write(tmp_path / file, [Q, {**Q, "id": "one", "choices": ["blue"], "answer": 0}])
    with pytest.raises(DataError, match=rf"{file}: row 2: 'choices' holds a single choice, 'blue'.*line 2"):
        get_task(task, data_dir=tmp_path)
    _write(tmp_path / file, [Q, {**Q, "choices": ["yes", "no"], "answer": 0}])   # two: a question
    assert len(get_task(task, data_dir=tmp_path)) == 2


@pytest.mark.parametrize("cls, kwargs, file", [("ARC", {"split": "train"}, "arc_easy_train.jsonl"),
                                                ("MMLU", {"split": "auxiliary_train"}, "mmlu_auxiliary_train.jsonl")])
def test_a_single_choice_row_in_a_training_split_does_not_stop_training(tmp_path, cls, kwargs, file):
    """Only scored rows are refused: a training split's odd row (the hub's ~100k MMLU auxiliary_train
    rows cannot be checked offline) would otherwise stop mid_train days into a GPU run (review of 76)."""
    from nanochat.tasks.arc import ARC
    from nanochat.tasks.mmlu import MMLU

    _write(tmp_path / file, [Q, {**Q, "id": "one", "choices": ["blue"], "answer": 0}])
    task = {"ARC": ARC, "MMLU": MMLU}[cls](data_dir=tmp_path, **kwargs)
    assert task.num_examples() == 2


# ------------------------------------------------------------------ the gold's text listed twice

class _LetterModel:
    """Logits that put one letter first at every position (the categorical eval reads the last)."""

    def __init__(self, letter: str, vocab: int = 128):
        self.letter, self.vocab = letter, vocab

    def __call__(self, x):
        logits = torch.zeros(*x.shape, self.vocab)
        logits[..., ord(self.letter)] = 5.0
        return logits


class _ByteTokenizer:
    bos_token_id = 0

    def render_for_completion(self, conv):
        return [0] + [min(ord(c), 127) for c in conv["messages"][0]["content"]][:50]

    def encode(self, text):
        return [ord(c) for c in text]


def test_naming_a_twin_of_the_gold_choice_scores_right(tmp_path):
    from nanochat.tasks import MMLU
    from nanochat.tasks.evaluate import run_categorical

    # MMLU's row 2178 as released: "687" is both A and B, the gold is A
    twin = {"question": "Subtract. 2,396 \u2013 1,709", "choices": ["687", "687", "1,493", "1,695"],
            "answer": 0, "subject": "elementary_mathematics"}
    _write(tmp_path / "mmlu.jsonl", [twin])
    task = MMLU(data_dir=tmp_path)
    conv = task[0]
    assert task.evaluate(conv, "B") and task.evaluate(conv, "The answer is A")
    assert not task.evaluate(conv, "C") and not task.evaluate(conv, "no letter")
    tok = _ByteTokenizer()
    scored = {letter: run_categorical(_LetterModel(letter), tok, task, "cpu").passed for letter in "ABCD"}
    assert scored == {"A": 1, "B": 1, "C": 0, "D": 0}


def test_the_released_mmlu_twins_are_scored_right(shared_data):
    from nanochat.tasks import MMLU

    task = MMLU(data_dir=shared_data / "eval")
    conv = task.file_example(2178)
    prompt = conv["messages"][0]["content"]
    assert "\nA. 687\nB. 687\n" in prompt and conv["messages"][-1]["content"] == "A"
    assert task.evaluate(conv, "B")


# ------------------------------------------------------------------ flags refused before any work

@pytest.mark.parametrize("argv, message", [
    (["--dtype", "fp16"], "--dtype: got 'fp16'; accepted: auto|bf16|fp32"),
    (["--device", "tpu"], "--device: got 'tpu'; accepted: auto|cpu|cuda|mps"),
    (["--data-dir", "/nonexistent/eval"], "--data-dir: got '/nonexistent/eval'; accepted: an existing directory"),
    (["--data-dir", ""], "--data-dir: got ''; accepted: an existing directory"),
])
def test_chat_eval_refuses_device_dtype_and_data_dir_when_parsing(argv, message):
    from scripts.chat_eval import parse_args

    with pytest.raises(RequestError, match=message.replace("|", r"\|")):
        parse_args(["-i", "sft", *argv])
    assert parse_args(["-i", "sft", "--dtype", "bfloat16", "--device", "cpu"]).dtype == "bfloat16"


# ------------------------------------------------------------------ a model of another tokenizer

def _checkpoint(base, vocab: int, phase: str):
    """A tokenizer of bytes alone (265 ids, the specials last) and a model of `vocab` ids, its meta.json
    without a tokenizer fingerprint (as older checkpoints)."""
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.tokenizer import SPLIT_PATTERN, Tokenizer, tokenizer_dir

    tok = Tokenizer(SPLIT_PATTERN, {bytes([i]): i for i in range(256)})
    tok.save(tokenizer_dir(base))
    config = GPTConfig(sequence_len=64, vocab_size=vocab, n_layer=1, n_head=2, n_kv_head=1, n_embd=32)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    save_checkpoint(checkpoint_dir(phase, "d1", base), 3, model_state=model.state_dict(),
                    meta={"model_config": asdict(config)})
    return tok


@pytest.fixture
def tmp_base(tmp_path, monkeypatch, shared_data):
    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE", "NANOCHAT_EVAL_BUNDLE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NANOCHAT_EVAL_DIR", str(shared_data / "eval"))
    return base


def test_chat_eval_refuses_a_model_without_the_tokenizers_ids_before_loading_it(tmp_base, monkeypatch):
    import nanochat.checkpoint as checkpoint
    from nanochat.checkpoint_io import CheckpointError
    from scripts import chat_eval

    _checkpoint(tmp_base, 200, "sft")
    loads = []
    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: loads.append(a) or pytest.fail("model loaded"))
    with pytest.raises(CheckpointError, match=r"sft/d1: the model reads token ids 0\.\.199 but the tokenizer at "
                                              r".* has 265 \(<\|bos\|>, .*<\|output_end\|> among those"):
        chat_eval.main(["-i", "sft", "-a", "ARC-Easy", "--max-problems", "2"])
    assert loads == []


def test_chat_eval_still_scores_a_model_of_its_tokenizer(tmp_base):
    from scripts import chat_eval

    tok = _checkpoint(tmp_base, 265, "sft")
    out = chat_eval.main(["-i", "sft", "-a", "ARC-Easy", "--max-problems", "2"])
    assert out["results"]["ARC-Easy"]["total"] == 2 and tok.vocab_size == 265


def test_base_eval_refuses_a_model_without_the_tokenizers_ids_before_loading_it(tmp_base):
    from nanochat.checkpoint_io import CheckpointError
    from scripts import base_eval

    _checkpoint(tmp_base, 200, "base")
    with pytest.raises(CheckpointError, match=r"base/d1: the model reads token ids 0\.\.199 .* has 265"):
        base_eval.main(["--eval", "sample", "--max-tokens", "2"])
    _checkpoint(tmp_base, 265, "base")   # the same model with every id: evaluated
    assert len(base_eval.main(["--eval", "sample", "--max-tokens", "2"])["samples"]) > 0
