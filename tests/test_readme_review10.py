"""README claims a new CPU user meets, checked against setup.sh (review 10).

The README said `./setup.sh` checks a `--conversations` file's rows and the `--identity` name "before
the first stage"; the full check (mid_train / chat_sft's own code) needs the venv, so it runs right
after the env stage, and only a missing file or a plainly bad name is refused before any stage. These
tests read the README's wording and hold setup.sh to it: a bad row stops the run before the data
stage, a missing file before any output of a stage.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = " ".join((REPO / "README.md").read_text().split())   # sentences run over line breaks


def setup_sh(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "WANDB_RUN", "NANOCHAT_BASE_DIR")}
    return subprocess.run(["bash", str(REPO / "setup.sh"), "--preset", "tiny", *args,
                           "--base-dir", str(tmp_path / "base")],
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_readme_says_when_the_chat_inputs_are_checked():
    assert "A missing `--conversations` file or a plainly bad `--identity` name is refused before any stage" in README
    assert re.search(r"checked by mid_train / chat_sft's own code right after the env stage .{0,60}before the "
                     r"data stage", README), "README no longer says when the rows are checked: update this test"
    assert "checked before the first stage" not in README   # the old claim: the env stage runs first
    # setup.sh's order: the env stage, then the check, then the stages that follow env
    text = (REPO / "setup.sh").read_text()
    env_at = text.index("if should_run env; then")
    check_at = text.index("\ncheck_chat_inputs\n")
    loop_at = text.index('for stage in "${STAGES[@]:1}"; do')
    assert env_at < check_at < loop_at


def test_a_missing_conversations_file_is_refused_before_any_stage(tmp_path):
    proc = setup_sh(tmp_path, "--dry-run", "--conversations", str(tmp_path / "nope.jsonl"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--conversations" in proc.stderr and "accepted" in proc.stderr
    assert "==>" not in proc.stdout   # not even the machine line: refused while parsing
    proc = setup_sh(tmp_path, "--dry-run", "--identity", " padded")
    assert proc.returncode == 2 and "--identity" in proc.stderr and "==>" not in proc.stdout


@pytest.mark.skipif(not (REPO / ".venv" / "bin" / "python").is_file(), reason="needs the env stage's .venv")
def test_a_bad_conversation_row_stops_setup_before_the_data_stage(tmp_path):
    bad = tmp_path / "mine.jsonl"   # a user turn and no assistant reply: the shell's check lets it through
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    # --only data,mid_train: the check runs (mid_train is selected) and, were it skipped, data would run
    # and mid_train fail at once for want of a base model, so a regression costs seconds, not a pipeline
    proc = setup_sh(tmp_path, "--only", "data,mid_train", "--conversations", str(bad))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "--conversations" in proc.stderr and str(bad) in proc.stderr, out
    assert "[data]" not in out and not (tmp_path / "base" / "base_data").exists(), out
