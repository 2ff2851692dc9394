"""Review 15 of the report and the log-comparison tools, read as a demanding user: sections that
writers logged at the same time lost entries; a repository without commits gave checkpoints the sha
"HEAD"; a "|" or a line break in a section title broke the time table and the headings, a backtick in
a changed flag's value the "flags changed" line; compare_logs skipped a cut step line without naming
it; compare_recipes ended the comparison (no table) at a diverged run, and with several seeds each
seed's run overwrote the last one's checkpoint under --keep-checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading

import pytest

from nanochat.report import Report, report_dir
from nanochat.report_env import git_sha
from tests import test_report_review10


# the same fixture (assigned, not imported: linters would read the tests' arguments as redefinitions)
base = test_report_review10.base


# ------------------------------------------------------------------ report: concurrent writers

def test_writers_logging_one_section_at_once_lose_no_entry(base):
    """Report.log read the section, appended and replaced the file: of two writers at once, the one
    that replaced it last dropped the other's entry (three processes logging 30 each kept 39 of 90)."""
    report = Report(report_dir(base))
    start = threading.Barrier(4)

    def writer(i):
        start.wait()
        for j in range(25):
            report.log("Chat evaluation sft", {"stage": "sft", "writer": i, "n": j})

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    doc = json.loads((base / "report" / "sections" / "chat-evaluation-sft.json").read_text())
    assert sorted((e["data"]["writer"], e["data"]["n"]) for e in doc["entries"]) == \
        [(i, j) for i in range(4) for j in range(25)]
    assert [p.name for p in (base / "report" / "sections").iterdir()] == ["chat-evaluation-sft.json"]  # no lock left


# ------------------------------------------------------------------ report: markdown of titles and values

def test_a_pipe_or_line_break_in_a_section_title_keeps_the_table_and_heading_whole(base):
    report = Report(report_dir(base))
    report.log("Evaluation a|b\nsecond line", {"stage": "base", "seconds": 5.0, "model_tag": "d2", "step": 3,
                                               "val_bpb": 1.25})
    md = (report.generate()).read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| Evaluation")]
    assert rows == ["| Evaluation a\\|b second line |  | 0:00:05 |"]   # three cells, as the header
    assert "## Evaluation a|b second line" in md.splitlines()
    assert "from Evaluation a|b second line, d2 step 3" in md           # the summary's source, one line


def test_a_backtick_or_line_break_in_a_changed_flag_keeps_the_changes_line(base):
    report = Report(report_dir(base))
    for run, lr in (("a`b\nc", 0.02), ("plain", 0.04)):
        report.log("Base model training", {"stage": "base", "final_step": 2, "config": {"run": run, "lr": lr}})
    md = report.generate().read_text()
    line = next(ln for ln in md.splitlines() if "flags changed since run 1" in ln)
    # the value's backtick escaped (it opened a code span up to "`lr"), its line break a space
    assert line.endswith("flags changed since run 1: `run` a\\`b c -> plain, `lr` 0.02 -> 0.04.")


# ------------------------------------------------------------------ report_env

@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_sha_of_a_repository_without_commits_is_none(tmp_path):
    """`git rev-parse HEAD` echoes "HEAD" there (exit 128): checkpoints recorded "HEAD" as their sha,
    and "HEAD+dirty" once a file was added."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert git_sha(tmp_path) is None
    (tmp_path / "f.py").write_text("x = 1\n")
    subprocess.run(["git", "add", "f.py"], cwd=tmp_path, check=True)
    assert git_sha(tmp_path) is None
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m"], cwd=tmp_path,
                   check=True)
    sha = git_sha(tmp_path)
    assert len(sha) == 40 and int(sha, 16) >= 0
    (tmp_path / "f.py").write_text("x = 2\n")
    assert git_sha(tmp_path) == sha + "+dirty"


# ------------------------------------------------------------------ compare_logs

_TAIL = "| lrm 1.000 | dt    100.0ms | tok/s      10,000 | mfu   n/a | util(bf16)   n/a | mem   1.00GiB | eta      -"
LOG = [f"step {s:05d}/00004 | loss {v} {_TAIL}" for s, v in enumerate(["9.0000", "8.0000", "7.0000", "6.0000"])] \
    + ["step 00004 | val bpb 2.0000 (min 2.0000)", "step 00004 | core_metric 0.1000",
       "step 00004 | saved checkpoint /x/step_000004"]


def test_a_step_line_that_cannot_be_read_is_named_by_file_and_line(tmp_path, capsys):
    """A run killed mid-line left "step 00003/00004 | loss 6.0": it was skipped unsaid, and the
    comparison said step 3 was "only in A", as if B had never run it."""
    from scripts import compare_logs

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("\n".join(LOG) + "\n")
    b.write_text("\n".join(LOG[:3] + ["step 00003/00004 | loss 6.0", "step 00004 | val bpb -"] + LOG[5:]) + "\n")
    assert compare_logs.main([str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert f"{b}:4: a step line that could not be read (cut short, or no number), skipped: " \
           "'step 00003/00004 | loss 6.0'" in out
    assert f"{b}:5: a step line that could not be read" in out
    assert f"{a}:" not in out   # evaluation lines of other metrics and save lines are not step lines
    assert compare_logs.main([str(a), str(a)]) == 0


# ------------------------------------------------------------------ compare_recipes

FLAGS = ["--device", "cpu", "--depth", "2", "--max-seq-len", "64", "--device-batch-size", "8",
         "--total-batch-size", "512", "--no-compile", "--num-iterations", "2"]


def test_a_diverged_run_is_recorded_and_the_comparison_goes_on(tmp_path, monkeypatch, capsys):
    """A run the NaN guard stopped raised out of main: the runs after it never ran and no table was
    printed. With two seeds, both runs of an entry shared one tag: the second overwrote the first's
    checkpoint, which --keep-checkpoints promised to keep."""
    from nanochat.training import NonFiniteLossError
    from scripts import base_train, compare_recipes

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("NANOCHAT_REPORT_DIR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    tags = []

    def fake_main(argv):
        tags.append(argv[argv.index("--model-tag") + 1])
        if "--matrix-lr" in argv and argv[argv.index("--seed") + 1] == "2":
            raise NonFiniteLossError(5, "loss", float("nan"), None, "lower the learning rates")
        return {"final_val_bpb": 2.0 + int(argv[argv.index("--seed") + 1]) / 100, "num_iterations": 2,
                "avg_tok_per_sec": 1.0}
    monkeypatch.setattr(base_train, "main", fake_main)
    results = compare_recipes.main(["--runs", "v1", "v2 --matrix-lr 9", "v2", "--seeds", "1", "2", "--", *FLAGS])
    assert tags == ["cmp_0_s1", "cmp_0_s2", "cmp_1_s1", "cmp_1_s2", "cmp_2_s1", "cmp_2_s2"]
    assert [r.get("diverged") for r in results] == [None] * 3 + ["non-finite loss (nan) at step 5", None, None]
    out = capsys.readouterr().out
    table = out[out.index("run "):].splitlines()
    assert table[1].split() == ["v1", "2.0100", "2.0200", "2.0150", "+0.0000"]
    assert table[2].split() == ["v2", "--matrix-lr", "9", "2.0100", "diverged", "-", "-"]
    assert table[3].split() == ["v2", "2.0100", "2.0200", "2.0150", "+0.0000"]
    tags.clear()   # one seed: the tag is the entry's alone, as before
    compare_recipes.main(["--runs", "v1", "v2", "--", *FLAGS])
    assert tags == ["cmp_0", "cmp_1"]


def test_a_filesystem_refusing_flock_with_einval_still_gets_its_report(tmp_path, monkeypatch, capsys):
    """Report sections are written under file_lock: a filesystem whose flock says EINVAL (some FUSE
    mounts) made every report write raise; it now warns once, about writers, and writes."""
    import errno
    import fcntl

    from nanochat import file_lock as FL
    from nanochat.file_lock import file_lock

    def no_flock(fd, op):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(FL, "_warned_no_locks", set())
    dest = tmp_path / "section.json"
    with file_lock(dest) as waited:
        dest.write_text("{}")
    assert waited is False and dest.read_text() == "{}" and not (tmp_path / "section.json.lock").exists()
    err = capsys.readouterr().err
    assert "has no file locks (Invalid argument); two writers of one file in it at once" in err, err
