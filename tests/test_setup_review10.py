"""setup.sh defects found by the tenth first-user review (session 71), each test failing on the code
before its fix. The env stage runs in a clone with fake uv, cargo, cc and venv python (seconds).

- `./setup.sh --dry-run` on a machine whose .venv exists said "[env] would create .venv, install
  torch from PyPI, the project and rustbpe" when the env stage would keep that .venv and its torch
  and only reinstall the project and rustbpe (a Rust source had changed): a user read it as a torch
  download and a venv thrown away, with no word of why the stage was not "done already". It now says
  what it would keep, what it would install, and what changed since .venv was set up; the real env
  stage says the same as it starts.
- A --conversations file moved or deleted while the stages before mid_train ran (hours on a GPU)
  ended setup.sh with sha256sum's "No such file or directory" and exit 1, naming neither the flag nor
  the stage; it is now a setup.sh error naming both, exit 2, before mid_train starts.
- NANOCHAT_DTYPE with a typo (fp16), or one the preset's base_train --precision does not compute in
  (bf16 under the tiny preset's fp32), stopped base_train only after the data and tokenizer stages
  (on a GPU preset, a download of hours), and base_train's advice named a --precision flag setup.sh
  does not have. setup.sh refuses it before the data stage, naming what the preset accepts.
"""

from __future__ import annotations

import sys

from tests.setup_clone import fake_env_tools, make_clone
from tests.test_setup_review3 import _run

# a venv python that imports torch once the fake uv has installed it (.venv/torch)
VENV_PYTHON = """#!/usr/bin/env bash
case "$*" in
  *sysconfig*) echo /nonexistent ;;
  *torch*) [[ -f "$(dirname "$0")/../torch" ]] || exit 1 ;;
esac
exit 0
"""
UV = """case "$*" in
  venv*) mkdir -p .venv/bin && cp {venv_python} .venv/bin/python ;;
  *torch\\>=2.9*) touch .venv/torch ;;
esac
exit 0
"""


def test_env_plan_names_what_is_kept_installed_and_why(tmp_path):
    clone = make_clone(tmp_path, home=True)
    (clone / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (clone / "rustbpe" / "src").mkdir(parents=True)
    (clone / "rustbpe" / "src" / "lib.rs").write_text("// v1\n")
    bin_dir = fake_env_tools(tmp_path, VENV_PYTHON, {"uv": UV.format(venv_python=tmp_path / "venv_python")})
    env_only = ("./setup.sh", "--preset", "tiny", "--only", "env", "--base-dir", tmp_path / "base")

    rc, out = _run(clone, *env_only, bin_dir=bin_dir)
    assert rc == 0, out
    assert "==> [env] create .venv, install torch from PyPI, the project and rustbpe (no .venv yet)" in out, out
    assert (clone / ".venv" / ".setup-env.done").is_file() and (clone / ".venv" / ".setup-torch").is_file()
    rc, out = _run(clone, *env_only, "--dry-run", bin_dir=bin_dir)
    assert rc == 0 and "[env] done already (same config): skipping" in out, out

    (clone / "rustbpe" / "src" / "lib.rs").write_text("// v2\n")
    rc, out = _run(clone, *env_only, "--dry-run", bin_dir=bin_dir)
    assert rc == 0, out
    assert ("[env] would keep .venv's torch (from PyPI), reinstall the project and rustbpe (changed since .venv "
            "was set up: rustbpe/src/lib.rs)") in out, out
    assert "would create .venv" not in out

    rc, out = _run(clone, *env_only, "--dry-run", bin_dir=bin_dir, TORCH_INDEX_URL="https://example.org/whl/cu999")
    assert rc == 0, out
    assert ("[env] would reinstall torch from https://example.org/whl/cu999, the project and rustbpe in .venv "
            "(changed since .venv was set up: rustbpe/src/lib.rs, torch_args)") in out, out


# a venv python: the chat-input check passes, tok_train deletes the conversations file (a user moving
# it during the hours before mid_train), every stage's module is logged
STAGE_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == - ]]; then cat > /dev/null; exit 0; fi
echo "$2" >> "{log}"
[[ "$2" == scripts.tok_train ]] && rm -f "{conv}"
exit 0
"""


def test_a_conversations_file_gone_before_mid_train_is_named(tmp_path):
    conv, log = tmp_path / "conv.jsonl", tmp_path / "stages.log"
    conv.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    clone = make_clone(tmp_path, STAGE_PYTHON.format(log=log, conv=conv), home=True)
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--only", "tokenizer,mid_train", "--conversations", conv,
                   "--base-dir", tmp_path / "base")
    assert rc == 2, out
    assert (f"setup.sh: error: --conversations: '{conv}' is gone since setup.sh started (stage 'mid_train' trains "
            "on it); accepted: an existing JSONL file") in out, out
    assert log.read_text().split() == ["scripts.tok_train"]   # mid_train never started


def test_a_bad_nanochat_dtype_is_refused_before_the_data_stage(tmp_path):
    clone = make_clone(tmp_path, f"#!/bin/sh\nexec {sys.executable} \"$@\"\n", home=True)   # the project's python
    base = tmp_path / "base"
    for value, said in (("fp16", "NANOCHAT_DTYPE: got 'fp16'; accepted: auto|bf16|fp32 (or unset)"),
                        ("bf16", "NANOCHAT_DTYPE: got 'bf16', but the tiny preset's base_train runs --precision fp32, "
                                 "which computes in fp32; accepted: NANOCHAT_DTYPE unset, auto or fp32")):
        rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--from", "data", "--base-dir", base,
                       NANOCHAT_DTYPE=value)
        assert rc == 2 and f"setup.sh: error: {said}\n" in out, out
        assert "[data]" not in out and not (base / "base_data").exists(), out
    # a finished base_train is skipped by a rerun: its dtype no longer matters
    (base / "setup_state").mkdir(parents=True, exist_ok=True)
    (base / "setup_state" / "base_train.done").write_text("")
    rc, out = _run(clone, "./setup.sh", "--preset", "tiny", "--from", "data", "--dry-run", "--base-dir", base,
                   NANOCHAT_DTYPE="bf16")
    assert rc == 0 and "NANOCHAT_DTYPE" not in out, out
