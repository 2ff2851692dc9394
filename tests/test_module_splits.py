"""Files stay under ~600 lines (TEAM_RULES): dataset.py's shard-set record (nanochat/shard_sets.py),
report.py's plots (nanochat/report_plots.py), gpt.py's config (nanochat/gpt_config.py), chat_data.py's
decontamination (nanochat/decontaminate.py) and setup.sh's device-batch fit (scripts/setup_batch.sh)
moved out. Every moved name still resolves from its old module (docs/INTERFACES.md, the tests'
monkeypatches), the new modules import none of the heavy modules they left, a GPTConfig pickled
under its old module path still loads, and the moved shell functions size the batch as setup.sh did."""

from __future__ import annotations

import pickle
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPLIT = ("nanochat/dataset.py", "nanochat/report.py", "nanochat/gpt.py", "nanochat/chat_data.py", "setup.sh")
MOVED = {   # old module -> (new module, names that moved)
    "nanochat.dataset": ("nanochat.shard_sets", ("SOURCE_FILE", "claim_data_dir", "mark_shard_set_complete",
                                                 "mark_shard_set_incomplete", "read_source_marker")),
    "nanochat.report": ("nanochat.report_plots", ("make_plots", "PLOTS", "METRIC_KEYS", "METRIC_SCALED",
                                                  "_series", "_get")),
    "nanochat.gpt": ("nanochat.gpt_config", ("GPTConfig", "config_for_depth", "check_window_pattern",
                                             "layer_windows", "has_value_embed")),
    "nanochat.chat_data": ("nanochat.decontaminate", ("EVAL_QUESTION_FILES", "drop_eval_questions", "problem_key",
                                                      "_drop_held_out_twins", "_eval_questions", "_question_text",
                                                      "_read_eval_questions")),
}


@pytest.mark.parametrize("path", SPLIT)
def test_split_files_are_under_the_size_rule(path):
    lines = (REPO / path).read_text().count("\n")
    assert lines <= 590, (path, lines)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_moved_names_resolve_from_their_old_module(old):
    import importlib

    new, names = MOVED[old]
    old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
    assert new_mod.__doc__
    for name in names:
        assert getattr(old_mod, name) is getattr(new_mod, name), name


def test_new_modules_import_without_the_modules_they_left():
    """shard_sets imports nothing of dataset.py (which imports it at the top), gpt_config no torch,
    report_plots no matplotlib until it draws, decontaminate neither chat_data (which imports it at
    the top: a cycle) nor torch nor the tasks (read only when a mixture is built)."""
    code = ("import sys; import nanochat.shard_sets, nanochat.gpt_config, nanochat.report_plots, nanochat.decontaminate; "
            "print(sorted(m for m in ('nanochat.dataset', 'nanochat.report', 'nanochat.chat_data', 'nanochat.tasks', "
            "'torch', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


def test_a_gpt_config_pickled_under_nanochat_gpt_still_loads():
    from nanochat.gpt import GPTConfig, config_for_depth

    cfg = config_for_depth(2, 1000, 64, aspect_ratio=32, head_dim=32)
    old = pickle.dumps(cfg, protocol=0).replace(b"nanochat.gpt_config", b"nanochat.gpt")
    assert b"nanochat.gpt\n" in old   # written as the class's path was before the move
    back = pickle.loads(old)
    assert type(back) is GPTConfig and back == cfg and GPTConfig(**asdict(cfg)) == cfg


def _choose(**env) -> subprocess.CompletedProcess:
    """scripts/setup_batch.sh's choose_device_batch with setup.sh's globals for d20 at vocab 32768."""
    width, depth, vocab = 1280, 20, 32768
    values = dict(PRESET="h100", DEPTH=depth, SEQ=2048, TBS=524288, DBS=32, DBS_GIVEN=0, DBS_FLAG="",
                  VOCAB=vocab, ALL_PARAMS=12 * width * width * depth + (2 + (depth + 1) // 2) * vocab * width,
                  GPU_NAME="NVIDIA H100 80GB HBM3", GPU_CC="9.0", GPU_MEM_MIB=81559, MEM_TOTAL_MIB=2**20,
                  MEM_AVAIL_MIB=2**20, HOST_MEM="the host's", CG_NOTE="") | env
    script = "".join(f"{k}={str(v)!r}\n" for k, v in values.items()) + (
        'say() { echo "==> $*"; }\ndie() { echo "setup.sh: error: $*" >&2; exit 2; }\n'
        f'source {REPO / "scripts" / "setup_batch.sh"}\nchoose_device_batch\necho "DBS=$DBS"\n')
    return subprocess.run(["bash", "-c", "set -euo pipefail\n" + script], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("mem_mib, dbs", [(81559, 32), (40960, 16), (24564, 4)])
def test_the_moved_fit_sizes_the_device_batch_as_setup_did(mem_mib, dbs):
    out = _choose(GPU_MEM_MIB=mem_mib)
    assert out.returncode == 0 and out.stdout.strip().endswith(f"DBS={dbs}"), (out.stdout, out.stderr)
    assert ("(not 32)" in out.stdout) == (dbs != 32), out.stdout


def test_the_moved_check_refuses_a_device_batch_that_does_not_split_the_total():
    out = _choose(DBS_GIVEN=1, DBS_FLAG="24")
    assert out.returncode == 2 and "--device-batch-size: got 24; accepted: a divisor of 256" in out.stderr, out.stderr
    given = _choose(DBS_GIVEN=1, DBS_FLAG="08", GPU_MEM_MIB=24564)
    assert given.stdout.strip().endswith("DBS=8") and "the preset's is 4 for d20 in" in given.stdout, given.stdout


def test_setup_sh_sources_the_helper_and_the_setup_tests_copy_it():
    from tests.setup_clone import SOURCED

    assert 'source "$REPO/scripts/setup_batch.sh"' in (REPO / "setup.sh").read_text()
    assert "setup_batch.sh" in SOURCED
    assert "sourced by" in "\n".join((REPO / "scripts" / "setup_batch.sh").read_text().splitlines()[:3]).lower()
