"""Review 13, end to end on a CPU laptop as a new user who follows README.md: the README gave no
stage-by-stage commands for a CPU (its table's bare commands are sized for a GPU: base_train alone
planned d20 on 8.7B tokens), tok_eval's compression never reached report.md (tok_train's section
did), the summary's MFU row read "-" for every stage of a CPU run (as if no stage had run), and
"Time and cost" showed no cost without saying how to get one."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import require_module

from nanochat.report import MFU_NA_NOTE, get_report

REPO = Path(__file__).resolve().parents[1]


def readme_cpu_commands() -> list[str]:
    """The `python -m ...` lines of the README's "Step by step on a CPU" code block."""
    text = (REPO / "README.md").read_text()
    m = re.search(r"^## Step by step on a CPU\n(.*?)^## ", text, re.DOTALL | re.MULTILINE)
    assert m, "README.md has no '## Step by step on a CPU' section"
    block = m[1].split("```")[1]
    return [line.strip() for line in block.splitlines() if line.strip().startswith("python -m ")]


def test_the_readme_cpu_walkthrough_is_what_setup_sh_runs_for_tiny(tmp_path):
    """Every stage command of the README's CPU block, in order, is the tiny preset's own (so an edit
    of setup.sh's tiny flags that the README misses fails here)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "WANDB_RUN")}
    proc = subprocess.run(["bash", str(REPO / "setup.sh"), "--preset", "tiny", "--dry-run",
                           "--base-dir", str(tmp_path / "base")], env=env, capture_output=True, text=True, check=False,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    planned = [m[1] for m in re.finditer(r"^==> \[\w+\] (python -m .*)$", proc.stdout, re.MULTILINE)]
    assert len(planned) >= 9, proc.stdout   # data .. report
    assert readme_cpu_commands() == planned


@pytest.fixture
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_REPORT_DIR"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "base"


def _tokenizer_in(directory: Path):
    require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")
    from nanochat.tokenizer import Tokenizer

    tok = Tokenizer.train(["the cat sat on the mat, the hat sat on the cat"] * 4, 270, threads=1)
    tok.save(directory)
    return tok


def test_tok_eval_writes_its_compression_into_the_report(base, tiny_corpus, capsys):
    from nanochat.tokenizer import tokenizer_dir
    from scripts import tok_eval

    tok = _tokenizer_in(tokenizer_dir())
    tok_eval.main(["--data-dir", str(tiny_corpus), "--num-docs", "3", "--threads", "1"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    printed = {(r["split"], r["tokenizer"]): r for r in lines}
    sections = {doc["section"]: doc for doc in get_report().sections()}
    assert "Tokenizer evaluation" in sections, sorted(sections)
    data = sections["Tokenizer evaluation"]["entries"][-1]["data"]
    assert data["vocab_size"] == tok.vocab_size and data["fingerprint"] == tok.fingerprint[:16]
    for split in ("train", "val"):
        assert data[split]["ours bytes/token"] == printed[(split, "ours")]["bytes_per_token"] > 0
        assert data[split]["docs"] == 3
    assert "## Tokenizer evaluation" in get_report().generate().read_text()


def test_tok_eval_of_another_tokenizer_stays_out_of_the_report(base, tiny_corpus, tmp_path):
    from scripts import tok_eval

    _tokenizer_in(tmp_path / "other_tok")
    tok_eval.main(["--data-dir", str(tiny_corpus), "--num-docs", "2", "--threads", "1",
                   "--tokenizer-dir", str(tmp_path / "other_tok")])
    assert not get_report().sections()


def _log_base_run(avg_mfu):
    get_report().log("Base model training", {"stage": "base", "final_step": 250, "total_time_s": 280.0,
                                             "final_val_bpb": 2.3, "avg_tok_per_sec": 3832.0, "avg_mfu": avg_mfu,
                                             "tokens_trained": 1_024_000, "config": {}})


def _summary_row(text: str, row: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {row} |"))
    return [c.strip() for c in line.strip().strip("|").split("|")][1:]


def test_a_cpu_run_s_mfu_reads_n_a_with_why_and_the_cost_says_how(base):
    _log_base_run(None)   # what log_stage_report logs without a peak FLOP/s (a CPU)
    text = get_report().generate().read_text()
    assert _summary_row(text, "MFU % (bf16 peak)") == ["n/a", "-", "-", "-"]   # mid/sft/rl did not run
    assert MFU_NA_NOTE in text
    assert "- cost: not estimated; `python -m nanochat.report generate --hourly-cost USD`" in text
    priced = get_report().generate(hourly_cost=2.0).read_text()
    assert "cost: not estimated" not in priced and "- estimated cost at $2.00/h" in priced


def test_a_gpu_run_s_mfu_is_its_number_and_no_n_a_note(base):
    _log_base_run(41.25)
    text = get_report().generate().read_text()
    assert _summary_row(text, "MFU % (bf16 peak)") == ["41.2", "-", "-", "-"]
    assert MFU_NA_NOTE not in text


def test_a_later_cpu_run_is_n_a_not_the_earlier_gpu_run_s_mfu(base, monkeypatch):
    """The summary's run rows describe the stage's latest run: after a GPU run, a CPU rerun is n/a."""
    import nanochat.report as report_mod

    clock = [1_900_000_000.0]
    monkeypatch.setattr(report_mod, "time", SimpleNamespace(time=lambda: clock[0]))
    _log_base_run(41.25)
    clock[0] += 60
    _log_base_run(None)
    assert _summary_row(get_report().generate().read_text(), "MFU % (bf16 peak)")[0] == "n/a"


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    from tests.test_engine import tiny_chat_model

    return tiny_chat_model(str(tiny_corpus))


def test_chat_cli_s_banner_names_the_model_tag_it_loaded(sft_checkpoint, chat_model, monkeypatch, capsys):
    """"nanochat (sft, step 7)" left out which of several model tags (d2, d12, ...) answered."""
    from dataclasses import asdict

    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from scripts import chat_cli

    model, tokenizer = chat_model
    save_checkpoint(checkpoint_dir("sft", "d1", sft_checkpoint), 3, model_state=model.state_dict(),
                    meta={"model_config": asdict(model.config), "tokenizer_fingerprint": tokenizer.fingerprint})

    def no_input(prompt=""):
        raise EOFError
    monkeypatch.setattr("builtins.input", no_input)
    for tag, step in (("d2", 7), ("d1", 3)):
        assert chat_cli.main(["--model-tag", tag, "--device", "cpu"]) == 0
        assert f"nanochat (sft/{tag}, step {step}) on cpu" in capsys.readouterr().out
    assert chat_cli.main(["-s", "7", "--device", "cpu"]) == 0   # no tag: the one load_model picks
    assert "nanochat (sft/d2, step 7) on cpu" in capsys.readouterr().out
