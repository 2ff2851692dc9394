"""A second new-user walk through README.md on a CPU machine: what it found untrue, kept true.

* The README's list of what goes into the base dir ("Artefacts go to `$NANOCHAT_BASE_DIR` ...")
  names every directory the code makes there: those the Python code joins onto the base dir
  (`get_base_dir() / "NAME"`, `Path(base_dir) / "NAME"`), pretokenize's default output (the
  `<data dir>_tokens` sibling of base_data, which training then reads) and the shell scripts'
  `$BASE_DIR/NAME` directories. The walk found `base_data_tokens/`, `profile_tokens/` and
  `compare_recipes/` made there and not listed.
* Offline, mid_train, chat_sft and chat_rl all stop without `--test-holdout N` (no train split of
  MMLU / ARC / GSM8K on disk): the "What you get" table said so on the mid row alone. Each row
  whose script takes `--test-holdout` now names it.
"""
from __future__ import annotations

import re
from pathlib import Path

from tests.test_docs_commands import isolated  # noqa: F401  (the fixture, used by name)
from test_docs_review6 import parsers_of

REPO = Path(__file__).resolve().parents[1]
README_TEXT = (REPO / "README.md").read_text()
README = " ".join(README_TEXT.split())   # sentences run over line breaks
# the Python spellings of "a directory directly in the base dir"
BASE_CHILD = re.compile(r"(?:get_base_dir\(\)\)?|\bbase_dir\)?|\bbase)\s*/\s*\"([a-z_]+)\"")
SHELL_CHILD = re.compile(r"\$\{?BASE_DIR\}?/([a-z_]+)(?![\w.])")


def artefact_dirs(text: str = README) -> set[str]:
    """The first path part of each `NAME/...` the README's base-dir sentence lists."""
    m = re.search(r"Artefacts go to `\$NANOCHAT_BASE_DIR` (.*?)\(done-markers[^)]*\)\.", text)
    assert m, "README.md no longer has its 'Artefacts go to `$NANOCHAT_BASE_DIR` ...' sentence"
    return {span.split("/", 1)[0] for span in re.findall(r"`([a-z_]+/[^`]*)`", m.group(1))}


def code_base_dirs(tmp_path, monkeypatch) -> set[str]:
    """The directories the code makes directly in the base dir."""
    names = set()
    for path in [*REPO.glob("nanochat/**/*.py"), *REPO.glob("scripts/*.py")]:
        names |= set(BASE_CHILD.findall(path.read_text()))
    for script in ("setup.sh", "run_train.sh", *[p.relative_to(REPO) for p in REPO.glob("scripts/*.sh")]):
        names |= set(SHELL_CHILD.findall((REPO / script).read_text()))
    from nanochat import binshards, dataset
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    bin_dir = binshards.default_bin_dir(dataset.default_data_dir())   # pretokenize's and the loader's
    assert bin_dir.parent == tmp_path, bin_dir
    names.add(bin_dir.name)
    return names


def test_the_readme_lists_every_directory_the_code_makes_in_the_base_dir(tmp_path, monkeypatch):
    made = code_base_dirs(tmp_path, monkeypatch)
    # the scan sees what the walk saw being made (and the list's long-standing entries)
    assert {"base_data", "tokenizer", "checkpoints", "eval", "chat_eval", "report", "runs", "setup_state",
            "base_data_tokens", "profile_tokens", "compare_recipes"} <= made, sorted(made)
    missing = made - artefact_dirs()
    assert not missing, f"directories the code makes in the base dir that README's list leaves out: {sorted(missing)}"


def test_a_directory_left_out_of_the_artefact_list_is_caught():
    text = README.replace("`profile_tokens/`", "`profile/`", 1)
    assert text != README
    assert "profile_tokens" in artefact_dirs() and "profile_tokens" not in artefact_dirs(text)


def what_you_get_rows(text: str = README_TEXT) -> list[tuple[str, str, str]]:
    table = text.split("| stage | command | what it does |", 1)[1].split("\n\n", 1)[0]
    return [re.match(r"^\| (.*?) \| (.*?) \| (.*) \|$", row).groups() for row in table.splitlines()[2:]]


def test_each_stage_that_needs_test_holdout_offline_says_so(isolated):  # noqa: F811
    needing = []
    for stage, command, text in what_you_get_rows():
        scripts = re.findall(r"python -m scripts\.(\w+)", command)
        if any(p for name in scripts for p in parsers_of(f"scripts.{name}", isolated)
               if "--test-holdout" in p._option_string_actions):
            needing.append(stage)
            assert "(offline: `--test-holdout 100`)" in text, f"the {stage} row does not say it needs --test-holdout offline"
    assert needing == ["mid", "SFT", "RL (optional)"], needing
