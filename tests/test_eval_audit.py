"""Tokenizer / evaluation commands under odd input (session 55's audit): task rows of the wrong
type, chat_eval / base_eval subsets and pass@k labelled in the report's summary, memory in GiB,
tok_train replacing a tokenizer, pretokenize --out outside the dataloader's view."""

import json
import shutil
from dataclasses import asdict

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat.errors import DataError, MissingDataError
from nanochat.tokenizer import SPECIAL_TOKENS


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path / "base"


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def text_shards(d, docs=("first words of a text", "more words here"), n=2):
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        pq.write_table(pa.table({"text": [f"{t} {i} " * 20 for t in docs]}), d / f"shard_{i:05d}.parquet")
    return d


# ------------------------------------------------------------------ task rows of the wrong type

MC = {"id": "x", "question": "Which?", "choices": ["a", "b"], "answer": 0}


@pytest.mark.parametrize("task, file, row, problem", [
    # a null question stopped chat_eval with an AttributeError after the model had loaded
    ("ARC-Easy", "arc_easy.jsonl", {**MC, "question": None}, "'question' must be a string"),
    ("MMLU", "mmlu.jsonl", {**MC, "choices": ["a", None]}, "'choices' must be a list of 1..26 strings"),
    # no '#### N': no gold answer, every completion silently scored wrong
    ("GSM8K", "gsm8k.jsonl", {"question": "1+1?", "answer": "It is 2."}, "'answer' must end in '#### N'"),
    # a numeric entry point: a TypeError mid-evaluation
    ("HumanEval", "humaneval.jsonl", {"task_id": "t", "prompt": "def f():\n", "canonical_solution": "  return 1\n",
                                      "test": "def check(c): pass", "entry_point": 5}, "'entry_point' must be text"),
    ("HumanEval", "humaneval.jsonl", {"task_id": "t", "prompt": "def f():\n", "canonical_solution": "  return 1\n",
                                      "test": "def check(c): pass", "entry_point": "f()"}, "'entry_point' must be a Python function name"),
])
def test_task_rows_of_the_wrong_type_are_data_errors_when_built(tmp_path, task, file, row, problem):
    from nanochat.tasks import get_task

    good = {"ARC-Easy": MC, "MMLU": MC, "GSM8K": {"question": "2+2?", "answer": "4\n#### 4"}}.get(task, {**row, "entry_point": "f"})
    write_jsonl(tmp_path / file, [good, row])
    with pytest.raises(DataError, match=f"{file}: row 2: {problem}"):
        get_task(task, data_dir=tmp_path)


def test_word_lists_without_usable_words_are_refused_when_built(tmp_path):
    from nanochat.tasks import SpellingBee

    (tmp_path / "words.txt").write_text("Apple\n123\n")   # rng.choice([]) raised IndexError mid-evaluation
    with pytest.raises(MissingDataError, match="no usable words"):
        SpellingBee(split="test", data_dir=tmp_path)
    (tmp_path / "words.txt").write_text("cat\n")   # crc32("cat") % 10 != 0: a train word only
    with pytest.raises(MissingDataError, match="falls in the test split"):
        SpellingBee(split="test", data_dir=tmp_path)


# ------------------------------------------------------------------ chat_eval

def test_chat_eval_refuses_identical_greedy_samples():
    from scripts.chat_eval import parse_args

    with pytest.raises(ValueError, match="--num-samples: got 3; accepted: 1 with --temperature 0"):
        parse_args(["-i", "sft", "-n", "3"])   # pass@3 of 3 identical answers was reported as pass@3
    assert parse_args(["-i", "sft", "-n", "3", "-t", "0.8"]).num_samples == 3


@pytest.fixture
def sft_d1(base, tiny_tokenizer):
    from nanochat import gpt
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tokenizer import tokenizer_dir

    tiny_tokenizer.save(tokenizer_dir(base))
    cfg = gpt.GPTConfig(sequence_len=512, vocab_size=tiny_tokenizer.vocab_size, n_layer=1, n_head=2, n_kv_head=2,
                        n_embd=32, window_pattern="L")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    model.init_weights()
    save_checkpoint(checkpoint_dir("sft", "d1", base), 3, model_state=model.state_dict(),
                    meta={"model_config": asdict(cfg), "tokenizer_fingerprint": tiny_tokenizer.fingerprint,
                          "model_tag": "d1"})
    return base


def test_chat_eval_refuses_samples_for_categorical_tasks_only():
    """-n 4 with only ARC / MMLU was accepted and ignored: a categorical task scores one logit."""
    from scripts.chat_eval import parse_args

    with pytest.raises(ValueError, match=r"--num-samples: got 4; accepted: 1 for categorical tasks only "
                                         r"\(ARC-Easy\|MMLU\); pass@k applies to GSM8K\|HumanEval\|SpellingBee"):
        parse_args(["-i", "sft", "-a", "ARC-Easy|MMLU", "-n", "4", "-t", "0.8"])
    assert parse_args(["-i", "sft", "-a", "ARC-Easy|GSM8K", "-n", "4", "-t", "0.8"]).num_samples == 4


def test_chat_eval_max_problems_is_a_labelled_partial_score(sft_d1, tmp_path, shared_data, capsys):
    """chat_eval -x N logged its scores (and "ChatCORE complete": true) as the tasks' own: the
    report's summary showed setup.sh's 8-problem figures, or a quick run after a full one, as the score."""
    from nanochat.report import get_report
    from scripts import chat_eval

    data = tmp_path / "eval"
    data.mkdir()
    rows = [json.loads(line) for line in (shared_data / "eval" / "arc_easy.jsonl").read_text().splitlines()[:3]]
    write_jsonl(data / "arc_easy.jsonl", rows)
    argv = ["-i", "sft", "-a", "ARC-Easy", "--device", "cpu", "--data-dir", str(data), "--out", str(tmp_path / "r.json")]
    sub = chat_eval.main(argv + ["-x", "2"])
    assert sub["results"]["ARC-Easy"]["problems"] == 3 and sub["all_problems"] is False
    assert "| ARC-Easy (2 of 3 problems) |" in capsys.readouterr().out
    cells = get_report().summary_cells()
    assert cells["ARC-Easy"]["sft"][1] == ["partial"] and cells["ChatCORE"]["sft"][1] == ["partial"]

    full = chat_eval.main(argv)   # every problem: the score itself
    assert full["all_problems"] is True
    assert get_report().summary_cells()["ARC-Easy"]["sft"] == (full["results"]["ARC-Easy"]["accuracy"], [])
    chat_eval.main(argv + ["-x", "1"])   # a quick run after it keeps the complete score
    assert get_report().summary_cells()["ARC-Easy"]["sft"] == (full["results"]["ARC-Easy"]["accuracy"], [])
    assert get_report().summary_cells()["ChatCORE"]["sft"][1] == ["partial"]   # one task of six, every run


# ------------------------------------------------------------------ the report

def test_report_labels_pass_at_k_and_older_subset_entries(base):
    from nanochat.report import get_report

    rep = get_report()
    rep.reset()
    # as chat_eval logged them before: max_problems / num_samples (and temperature) only
    rep.log("Chat evaluation sft", {"stage": "sft", "max_problems": 8, "num_samples": 1, "ARC-Easy": 0.3,
                                    "GSM8K": 0.1, "ChatCORE metric": 0.1, "ChatCORE complete": True,
                                    "temperature": 0.0})
    cells = rep.summary_cells()
    assert cells["ARC-Easy"]["sft"] == (0.3, ["partial"]) and cells["ChatCORE"]["sft"] == (0.1, ["partial"])
    rep.log("Chat evaluation mid", {"stage": "mid", "max_problems": None, "num_samples": 4, "temperature": 0.8,
                                    "MMLU": 0.25, "GSM8K": 0.2, "ChatCORE metric": 0.05, "ChatCORE complete": True})
    cells = rep.summary_cells()
    assert cells["GSM8K"]["mid"] == (0.2, ["pass@4"]) and cells["MMLU"]["mid"] == (0.25, [])
    rep.log("Chat evaluation rl", {"stage": "rl", "num_samples": 8, "GSM8K": 0.4, "GSM8K complete": True,
                                   "GSM8K scored as": "pass@8", "ChatCORE metric": 0.4, "ChatCORE complete": False,
                                   "ChatCORE scored as": "pass@8"})
    assert rep.summary_cells()["ChatCORE"]["rl"] == (0.4, ["partial", "pass@8"])
    text = rep.generate().read_text()
    assert "| GSM8K | - | 0.2000 (pass@4) | 0.1000 (partial) | 0.4000 (pass@8) |" in text
    assert "- (pass@k): a generative task counted as solved when any of k" in text
    assert "or of their problems (chat_eval --max-problems, base_eval --max-per-task)" in text


def test_report_memory_is_gib_everywhere(base):
    """The header said gpu_memory_gb / memory_gb (1e9 bytes) and the memory plot drew loop.py's
    memory_gb under "GB", while the training sections and log line said peak_mem_gib."""
    from nanochat import report as report_mod

    rows = [{"step": 0, "loss": 1.0, "memory_gb": 4 * 2**30 / 1e9}, {"step": 1, "loss": 1.0, "peak_mem_gib": 5.0}]
    assert report_mod._series(rows, "memory_gib", "step") == ([0.0, 1.0], [pytest.approx(4.0), 5.0])
    info = report_mod.system_info()
    assert "memory_gib" in info and not any(k.endswith("_gb") for k in info)
    assert ("memory_gib", "step", "memory.png", "peak memory (GiB)") in report_mod.PLOTS
    for s in range(3):
        report_mod.log_metrics("base", {"step": s, "loss": 2.0, "memory_gb": 1.0})
    report_mod.get_report().generate()
    plots = base / "report" / "plots"
    assert (plots / "memory.png").read_bytes()[:4] == b"\x89PNG" and not list(plots.glob(".*"))


# ------------------------------------------------------------------ CORE subsets

class ZeroLM(torch.nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab

    def forward(self, x):
        return torch.zeros(*x.shape, self.vocab)


def test_core_with_max_per_task_is_not_complete(base, tiny_tokenizer, shared_data):
    from nanochat.core_eval import run_core_eval
    from scripts.base_eval import log_report

    model = ZeroLM(tiny_tokenizer.vocab_size)
    cut = run_core_eval(model, tiny_tokenizer, "cpu", tasks=["copa"], data_dir=shared_data / "eval",
                        max_per_task=5, log=lambda *a: None)
    whole = run_core_eval(model, tiny_tokenizer, "cpu", tasks=["copa"], data_dir=shared_data / "eval",
                          log=lambda *a: None)
    assert cut["all_items"] is False and whole["all_items"] is True
    cut["complete"] = True   # as if every CORE task had run: 5 items each is still an estimate
    log_report({"phase": "base", "model_tag": "d2", "step": 1, "seconds": 1.0, "bpb": {"val": 1.2},
                "bpb_tokens": 4096, "config": {"quantize": "none", "max_per_task": 5}, "core": cut})
    section = json.loads((base / "report" / "sections" / "base-model-evaluation.json").read_text())
    data = section["entries"][-1]["data"]
    assert data["CORE complete"] is False and data["CORE max_per_task"] == 5 and data["bpb_tokens"] == 4096


# ------------------------------------------------------------------ tok_train / pretokenize

def test_tok_train_says_when_it_replaces_another_tokenizer(tmp_path, capsys):
    from scripts import tok_train

    data = text_shards(tmp_path / "data")
    argv = ["--data-dir", str(data), "--output-dir", str(tmp_path / "tok")]
    tok_train.main(argv + ["--vocab-size", "280"])
    tok_train.main(argv + ["--vocab-size", "280"])   # the same tokenizer again: nothing to say
    assert "replaced the tokenizer" not in capsys.readouterr().out
    tok_train.main(argv + ["--vocab-size", "275"])
    assert "replaced the tokenizer" in capsys.readouterr().out


def test_tok_train_logs_the_report_section_of_the_base_dirs_tokenizer(tmp_path, monkeypatch):
    """report.md had no tokenizer section; a tokenizer written elsewhere (--output-dir) stays out."""
    from nanochat.report import Report
    from scripts import tok_train

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    data = text_shards(tmp_path / "data")
    tok_train.main(["--data-dir", str(data), "--output-dir", str(tmp_path / "elsewhere"), "--vocab-size", "280"])
    assert not (tmp_path / "base" / "report" / "sections").exists()
    tok_train.main(["--data-dir", str(data), "--vocab-size", "280"])
    section = json.loads((tmp_path / "base" / "report" / "sections" / "tokenizer-training.json").read_text())
    entry = section["entries"][-1]["data"]
    assert entry["vocab_size"] == 280 and entry["merges"] == 280 - 256 - len(SPECIAL_TOKENS) and entry["documents"] > 0
    text = Report(tmp_path / "base" / "report").generate().read_text()
    assert "Tokenizer training" in text and "vocab_size" in text


def test_pretokenize_out_elsewhere_says_training_will_not_read_it(tmp_path, tiny_tokenizer, capsys):
    from scripts import pretokenize

    data = text_shards(tmp_path / "data")
    pretokenize.main(["--data-dir", str(data), "--workers", "1"], tokenizer=tiny_tokenizer)
    assert "note: training reads" not in capsys.readouterr().out   # the default place
    shutil.rmtree(tmp_path / "data_tokens")
    pretokenize.main(["--data-dir", str(data), "--out", str(tmp_path / "fast"), "--workers", "1"],
                     tokenizer=tiny_tokenizer)
    out = capsys.readouterr().out
    assert f"note: training reads binary shards only from {tmp_path / 'data_tokens'}" in out
