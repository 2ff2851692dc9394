"""Evaluation review 4: defects found using base_eval, CORE's bundle and the report as a user would.

* A damaged or hand-edited DCLM bundle (core.yaml that is not YAML or lacks a task's fields, an
  eval_meta_data.csv without a task's baseline or with a non-number there) stopped base_eval with a
  traceback (a plain ValueError / KeyError / yaml error) instead of the one line naming the file
  and how to re-create it that the README promises for a malformed CORE file.
* `python -m nanochat.report generate --base-dir DIR` with a DIR that does not exist (a typo)
  created it and wrote an empty report there, exit 0, as if that were the run's report.
* base_eval's report section did not say what data its CORE came from: an offline CORE (20 of the
  22 tasks, prompts of our own, comparable only with other offline runs) read as the DCLM score.
"""

from __future__ import annotations

import pytest

from nanochat.errors import RequestError

YAML = """icl_tasks:
- label: tiny_mc
  dataset_uri: x/mc.jsonl
  num_fewshot: [0]
  icl_task_type: multiple_choice
"""
CSV = "Eval Task,Random baseline\ntiny_mc,50\n"


def bundle(tmp_path, core_yaml=YAML, meta=CSV):
    d = tmp_path / "bundle"
    (d / "eval_data" / "x").mkdir(parents=True)
    (d / "core.yaml").write_text(core_yaml)
    (d / "eval_meta_data.csv").write_text(meta)
    (d / "eval_data" / "x" / "mc.jsonl").write_text('{"query": "Q?", "choices": ["a", "b"], "gold": 0}\n' * 2)
    return d


@pytest.mark.parametrize("core_yaml, meta, names", [
    ("icl_tasks: [\n", CSV, "core.yaml"),                                   # not YAML (cut short)
    ("", CSV, "core.yaml"),                                                 # empty
    (YAML.replace("  dataset_uri: x/mc.jsonl\n", ""), CSV, "core.yaml"),     # a task without its file
    (YAML.replace("[0]", "ten"), CSV, "core.yaml"),                          # shots not a number
    (YAML.replace("multiple_choice", "essay"), CSV, "core.yaml"),            # unknown task type
    (YAML, "Eval Task,Random baseline\nother,50\n", "eval_meta_data.csv"),  # no baseline for the task
    (YAML, "Eval Task,Random baseline\ntiny_mc,n/a\n", "eval_meta_data.csv"),
    (YAML, "Eval Task,Random baseline\ntiny_mc,100\n", "eval_meta_data.csv"),   # centering divides by 0
    (YAML, "Eval Task,Random baseline\ntiny_mc,nan\n", "eval_meta_data.csv"),
    (YAML, "Task,Baseline\ntiny_mc,50\n", "eval_meta_data.csv"),            # other columns
])
def test_a_malformed_bundle_is_one_line_naming_the_file(tmp_path, core_yaml, meta, names):
    from nanochat.core_data import load_core_data

    d = bundle(tmp_path, core_yaml, meta)
    with pytest.raises(RequestError) as e:
        load_core_data(bundle_dir=d)
    assert str(d / names) in str(e.value) and "download_eval_bundle" in str(e.value)


def test_a_well_formed_bundle_still_loads(tmp_path):
    from nanochat.core_data import load_core_data

    data = load_core_data(bundle_dir=bundle(tmp_path), tasks=["tiny_mc"])
    assert [(t.label, t.random_baseline, len(r)) for t, r in data.tasks] == [("tiny_mc", 0.5, 2)]


def test_report_generate_refuses_a_base_dir_that_does_not_exist(tmp_path, capsys):
    from nanochat import report

    with pytest.raises(RequestError, match="--base-dir"):
        report.main(["generate", "--base-dir", str(tmp_path / "typo")])
    assert not (tmp_path / "typo").exists()
    report.main(["reset", "--base-dir", str(tmp_path / "new")])   # reset starts a report anywhere
    report.main(["generate", "--base-dir", str(tmp_path / "new")])
    assert (tmp_path / "new" / "report" / "report.md").is_file()


def test_report_base_dir_after_an_equals_sign_expands_the_home(tmp_path, monkeypatch):
    from nanochat import report

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    report.main(["reset", "--base-dir=~/nc"])   # the shell leaves this ~ alone
    assert (tmp_path / "nc" / "report" / "header.json").is_file() and not (tmp_path / "~").exists()


def test_base_eval_report_section_names_the_core_data(tmp_path, monkeypatch):
    from nanochat.report import Report
    from scripts import base_eval

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    results = {"phase": "base", "model_tag": "d1", "step": 5, "seconds": 1.0, "config": {"max_per_task": -1},
               "core": {"core_metric": 0.1, "complete": False, "all_items": True, "source": "offline:/a,/b",
                        "centered_results": {"copa": 0.1}, "missing": ["winograd", "agi_eval_lsat_ar"]}}
    base_eval.log_report(results)
    data = Report(tmp_path / "report").sections()[0]["entries"][0]["data"]
    assert data["CORE data"].startswith("offline files (/a,/b)") and "not comparable" in data["CORE data"]
    assert data["CORE missing"] == ["winograd", "agi_eval_lsat_ar"]
    results["core"].update(source="bundle:/x", complete=True, missing=[])
    base_eval.log_report(results)
    data = Report(tmp_path / "report").sections()[0]["entries"][1]["data"]
    assert data["CORE data"] == "DCLM bundle (/x)" and "CORE missing" not in data


def test_the_summary_names_the_checkpoint_each_stage_value_comes_from(tmp_path):
    """Every summary value is the latest entry of its key: a base_eval of another model tag (or an
    older step) that logged only CORE sat in the BASE column next to the val bpb of another model,
    and nothing in the summary said so."""
    from nanochat.report import Report

    rep = Report(tmp_path / "report")
    rep.log("Base model evaluation", {"stage": "base", "model_tag": "d1", "step": 5, "val_bpb": 1.5})
    rep.log("Base model evaluation", {"stage": "base", "model_tag": "d2", "step": 7, "CORE metric": 0.2,
                                      "CORE complete": True})
    rep.log("Chat evaluation sft", {"stage": "sft", "model_tag": "d1", "step": 10, "ARC-Easy": 0.5})
    text = rep.generate().read_text()
    summary = text[text.index("## Summary"):text.index("## Time and cost")]
    base = next(line for line in summary.splitlines() if line.startswith("- BASE: "))
    assert "d1 step 5" in base and "val bpb" in base and "d2 step 7" in base and "CORE" in base
    assert "2 checkpoints" in base
    sft = next(line for line in summary.splitlines() if line.startswith("- SFT: "))
    assert "Chat evaluation sft" in sft and "d1 step 10" in sft and "checkpoints" not in sft
    assert "- MID" not in summary and "- RL" not in summary   # no values, no source invented


@pytest.mark.parametrize("n,t,mark", [("2", "0.8", " (pass@2)"), ("1", "0.8", " (sampled, T=0.8)"), ("1", "0", "")])
def test_chat_eval_console_chatcore_says_pass_at_k(tmp_path, monkeypatch, shared_data, capsys, n, t, mark):
    """The console table marked GSM8K "(pass@2)" but not the ChatCORE averaged from it; a single
    answer sampled at T > 0 had no mark at all (the report marks it "(sampled, T=...)")."""
    from dataclasses import asdict

    import pyarrow.parquet as pq
    import torch

    from nanochat import gpt
    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tokenizer import Tokenizer, tokenizer_dir
    from scripts import chat_eval

    base = tmp_path / "base"
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    texts = pq.read_table(shared_data / "pretrain/tiny/shard_00000.parquet", columns=["text"]).column("text")
    tok = Tokenizer.train(texts.to_pylist()[:100], 512)
    tok.save(tokenizer_dir(base))
    cfg = gpt.GPTConfig(sequence_len=512, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32,
                        window_pattern="L")
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    model.init_weights()
    save_checkpoint(checkpoint_dir("sft", "d1", base), 3, model_state=model.state_dict(),
                    meta={"phase": "sft", "model_tag": "d1", "model_config": asdict(cfg),
                          "tokenizer_fingerprint": tok.fingerprint})
    (tmp_path / "eval").mkdir()
    lines = (shared_data / "eval" / "gsm8k.jsonl").read_text().splitlines()[:2]
    (tmp_path / "eval" / "gsm8k.jsonl").write_text("\n".join(lines) + "\n")
    chat_eval.main(["-i", "sft", "--device", "cpu", "--data-dir", str(tmp_path / "eval"), "-a", "GSM8K",
                    "-n", n, "-t", t, "--max-new-tokens", "2"])
    out = capsys.readouterr().out
    assert f"| GSM8K{mark} |" in out
    assert f"| ChatCORE (partial: a subset of the tasks){mark} |" in out
    assert (base / "chat_eval" / "sft_d1_step000003.json").is_file()
