"""Review 7 of the report and the distributed helpers, as a user meets them (CPU, no process group):
a section titled in a non-Latin script was refused ("accepted: a title with letters") and an accented
one lost its letters; a NaN or inf time / elapsed_s in a metrics row killed `generate` after the
plots; the header called a tree outside git "no commits, git_dirty: False", recorded "HEAD" as the
sha of a repository without commits and escaped non-ASCII file names; check_nccl_env let
WORLD_SIZE=0 through while its message says "an integer >= 1"."""

import math
import re
import shutil
import subprocess

import pytest

from nanochat.report import get_report, log_metrics
from nanochat.report_env import git_info


@pytest.fixture()
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("NANOCHAT_REPORT_DIR", raising=False)
    return tmp_path


def test_section_titles_in_any_script_get_their_own_file(base):
    rep = get_report()
    cjk = rep.log("基础评估", {"x": 1})
    accented = rep.log("Évaluation base", {"x": 2})
    plain = rep.log("valuation base", {"x": 3})
    assert cjk.name == "基础评估.json"
    assert accented.name == "évaluation-base.json" and plain.name == "valuation-base.json"   # not one section
    assert rep.log("Chat evaluation (sft)", {"x": 4}).name == "chat-evaluation-sft.json"   # ASCII as before
    with pytest.raises(ValueError, match="section: got '---'"):
        rep.log("---", {})
    text = rep.generate().read_text(encoding="utf-8")
    for title in ("## 基础评估", "## Évaluation base", "## valuation base"):
        assert text.count(title + "\n") == 1, title


@pytest.mark.parametrize("bad", [{"elapsed_s": math.nan}, {"elapsed_s": math.inf}, {"time": math.nan},
                                 {"time": math.inf}])
@pytest.mark.parametrize("reset", [False, True])
def test_a_non_finite_time_in_metrics_is_skipped_not_a_crash(base, monkeypatch, bad, reset):
    from nanochat import report as report_mod
    monkeypatch.setattr(report_mod, "make_plots", lambda metrics, out_dir: [])   # speed: plots are not the point
    monkeypatch.setattr(report_mod, "system_info", lambda: {"device": "cpu"})
    if reset:
        get_report().reset()
    log_metrics("base", {"step": 0, "loss": 2.0, "elapsed_s": 1.0, **bad})
    log_metrics("base", {"step": 1, "loss": 1.0, "elapsed_s": 62.0})
    text = get_report().generate().read_text()
    row = next(line for line in text.splitlines() if line.startswith("| base"))
    assert row == "| base (unfinished) | 2 | 0:01:02 |", row   # no section logged: the run counts as unfinished
    assert not re.search(r"\b(nan|inf)\b", text, re.IGNORECASE), text


def _git(*args, cwd):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                   cwd=cwd, check=True, capture_output=True)


def test_git_info_says_what_it_does_not_know(tmp_path, monkeypatch):
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))   # no enclosing repository counts
    outside = tmp_path / "plain"
    outside.mkdir()
    info = git_info(outside)
    assert info["git_sha"].startswith("unknown (not a git repository"), info
    assert "git_dirty" not in info   # was False: a claim about a tree git never saw
    repo = tmp_path / "fresh"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / "é.py").write_text("x = 1\n")
    info = git_info(repo)
    assert info["git_sha"] == "unknown (no commits)", info   # was "HEAD"
    assert info["git_dirty"] is True and info["git_changes"] == "1 file(s): ?? é.py", info
    _git("add", ".", cwd=repo)
    _git("commit", "-qm", "c", cwd=repo)
    info = git_info(repo)
    assert len(info["git_sha"]) == 40 and info["git_dirty"] is False


@pytest.mark.parametrize("env, var", [({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
                                      ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE"),
                                      ({"WORLD_SIZE": "²"}, "WORLD_SIZE")])
def test_check_nccl_env_refuses_a_world_size_below_one(env, var):
    from nanochat.distributed import check_nccl_env
    with pytest.raises(ValueError, match=f"^{var}={env[var]}: accepted: an integer >= 1"):
        check_nccl_env(env, sys_root="/nonexistent")
    assert check_nccl_env({"WORLD_SIZE": " 2 "}, sys_root="/nonexistent") == []   # torchrun's int() reads it too
