"""Review 74 of setup.sh / run_train.sh as a user rerunning them hits them; each test failed before its fix.

- A training stage whose latest checkpoint lost a file (a model.pt deleted) was said to rerun ("its
  output ... is gone: rerunning"), but its --resume auto stopped on that step at every rerun ("file
  missing from the checkpoint; use another step ([20])"), a step setup.sh's command line cannot name.
  It now resumes the newest whole earlier step (--resume N), or starts afresh (--overwrite) when there
  is none or, for mid / SFT, when that step started from other weights than its source's now.
- The same step's files changed in place (damaged, same step number) read as "its checkpoints moved on
  since setup.sh's run (a later step is there): kept" and the stage was skipped.
- run_train.sh --stop --timeout 10000000000 overflowed bash's arithmetic: SIGKILL at once, no save.

The stages are faked (a clone whose .venv/bin/python writes what each real stage leaves, checkpoints in
their real layout with sha256 sums; the check before a training stage, nanochat.resume_point, is the
real one, run by the real interpreter; it imports no torch), so the file runs in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.setup_clone import REPO, make_clone
from tests.test_setup import PIPELINE, _verdicts
from tests.test_setup_review3 import _run

STAGE_PYTHON = """#!{exe}
import hashlib, json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args[:1] == ["-"]:
    sys.stdin.read()
    sys.exit(0)
if args[:1] != ["-m"] or args[2:3] == ["reset"]:
    sys.exit(0)
if args[1:2] == ["nanochat.resume_point"]:   # setup.sh's check before a training stage: the real one
    with open({checks!r}, "a") as f:
        f.write(" ".join(args[2:]) + "\\n")
    os.execve(sys.executable, [sys.executable, *args], {{**os.environ, "PYTHONPATH": {repo!r}}})
b = Path(os.environ["NANOCHAT_BASE_DIR"])
with open({log!r}, "a") as f:
    f.write(" ".join(args[1:]) + "\\n")
def write(rel, text):
    (b / rel).parent.mkdir(parents=True, exist_ok=True)
    (b / rel).write_text(text)
def sums_of(d):
    return json.loads((d / "sums_rank0.json").read_text())
def ckpt(phase, source):
    d = b / "checkpoints" / phase / "d2"
    src = None
    if source:
        sd = b / "checkpoints" / source / "d2"
        step = json.loads((sd / "latest.json").read_text())["step"]
        src = {{"phase": source, "model_tag": "d2", "step": step,
               "model_sha256": sums_of(sd / f"step_{{step:06d}}")["model.pt"]["sha256"]}}
    for step in (20, 40):
        s = d / f"step_{{step:06d}}"
        s.mkdir(parents=True, exist_ok=True)
        sums = {{}}
        for name in ("model.pt", "optim_rank0.pt", "state_rank0.pt"):
            (s / name).write_text(f"{{phase}} {{name}} at step {{step}}\\n")
            sums[name] = {{"bytes": (s / name).stat().st_size, "sha256": hashlib.sha256((s / name).read_bytes()).hexdigest()}}
        (s / "meta.json").write_text(json.dumps({{"step": step, "has_optimizer": True, "source": src}}))
        (s / "sums_rank0.json").write_text(json.dumps(sums))
    (d / "latest.json").write_text(json.dumps({{"dir": "step_000040", "step": 40}}, indent=2))
mod = args[1]
if mod == "nanochat.dataset":
    write("base_data/shard_00000.parquet", "0")
    write("base_data/shard_00001.parquet", "1")
elif mod == "scripts.tok_train":
    write("tokenizer/tokenizer.pkl", "merges")
    write("tokenizer/token_bytes.pt", "bytes")
elif mod == "scripts.base_train":
    ckpt("base", None)
elif mod == "scripts.mid_train":
    ckpt("mid", "base")
elif mod == "scripts.chat_sft":
    ckpt("sft", "mid")
elif mod == "scripts.base_eval":
    write("eval/base_d2_step000040.json", "{{}}")
elif mod == "scripts.chat_eval":
    write("chat_eval/sft_d2_step000040.json", "{{}}")
elif mod == "nanochat.report":
    write("report/report.md", "report")
"""


@pytest.fixture
def done(tmp_path):
    """A clone with the fake stages and a base dir where the tiny pipeline has finished ->
    (clone, base dir, log of the stage commands run since)."""
    log = tmp_path / "stages.log"
    fake = STAGE_PYTHON.format(exe=sys.executable, log=str(log), checks=str(tmp_path / "checks.log"), repo=str(REPO))
    clone = make_clone(tmp_path, fake, home=True)
    base = tmp_path / "base"
    rc, out = _setup(clone, base)
    assert rc == 0 and set(_verdicts(out).values()) == {"new"}, out
    log.write_text("")
    return clone, base, log


def _setup(clone, base, *args):
    return _run(clone, "./setup.sh", "--preset", "tiny", "--from", "data", "--base-dir", base, *args)


def _ran(log: Path) -> dict[str, list[str]]:
    """stage module -> the arguments it was run with."""
    return {line.split()[0]: line.split()[1:] for line in log.read_text().splitlines()}


def test_a_latest_checkpoint_missing_a_file_resumes_the_whole_step_before_it(done):
    clone, base, log = done
    (base / "checkpoints" / "sft" / "d2" / "step_000040" / "model.pt").unlink()
    rc, out = _setup(clone, base)
    assert rc == 0, out
    assert ("==> [chat_sft] its latest checkpoint (step 40) cannot be resumed: model.pt is gone; resuming step 20, "
            "the newest whole one before it (the later steps move to checkpoints/sft/d2/earlier_runs/ at its "
            "first save)") in out, out
    ran = _ran(log)
    assert list(ran) == ["scripts.chat_sft", "scripts.chat_eval", "nanochat.report"], out
    assert "--resume 20" in " ".join(ran["scripts.chat_sft"]) and "auto" not in ran["scripts.chat_sft"]
    # the marker records the command setup.sh means (--resume auto): the next run skips every stage
    assert "\n--resume\nauto\n" in (base / "setup_state" / "chat_sft.done").read_text()
    log.write_text("")
    rc, out = _setup(clone, base)
    assert rc == 0 and set(_verdicts(out).values()) == {"skip"} and log.read_text() == "", out


def test_a_checkpoint_changed_in_place_is_damaged_not_trained_further(done):
    clone, base, log = done
    weights = base / "checkpoints" / "base" / "d2" / "step_000040" / "model.pt"
    weights.write_text(weights.read_text().replace("base", "BASE"))   # same size, other bytes
    rc, out = _setup(clone, base, "--dry-run")
    said = _verdicts(out)
    assert rc == 0 and [said[s] for s in PIPELINE] == ["skip"] * 3 + ["new"] + ["cascade"] * 5, out
    assert "moved on" not in out
    assert ("==> [base_train] finished before, but its output checkpoints/base/d2/step_000040/model.pt has changed "
            "since it finished: rerunning") in out, out
    assert ("its latest checkpoint (step 40) cannot be resumed: model.pt is not the file saved (sums_rank0.json "
            "recorded another size or sha256); resuming step 20") in out, out
    rc, out = _setup(clone, base)
    ran = _ran(log)
    assert rc == 0 and "--resume 20" in " ".join(ran["scripts.base_train"]), out
    # mid's own latest checkpoint is whole: it keeps --resume auto (and the stage's own source check)
    assert "--resume auto" in " ".join(ran["scripts.mid_train"]), out


@pytest.mark.parametrize("case", ["other source", "no whole step"])
def test_without_a_step_to_resume_the_stage_starts_afresh(done, case):
    clone, base, log = done
    mid = base / "checkpoints" / "mid" / "d2"
    (mid / "step_000040" / "meta.json").unlink()
    if case == "other source":   # step 20's run started from other base weights than base's latest now
        meta = json.loads((mid / "step_000020" / "meta.json").read_text())
        meta["source"]["model_sha256"] = "0" * 64
        (mid / "step_000020" / "meta.json").write_text(json.dumps(meta))
        why = "step 20, the newest whole one, started from other base weights"
    else:
        (mid / "step_000020" / "optim_rank0.pt").unlink()
        why = "no earlier step is whole"
    rc, out = _setup(clone, base)
    assert rc == 0, out
    assert (f"==> [mid_train] its latest checkpoint (step 40) cannot be resumed: meta.json is gone; {why}: starting "
            "afresh (--overwrite; the earlier run moves to checkpoints/mid/d2/earlier_runs/ at its first save)") in out
    args = _ran(log)["scripts.mid_train"]
    assert "--overwrite" in args and "--resume" not in args, args
    assert "--resume" in _ran(log)["scripts.chat_sft"]   # (its own checkpoint is whole)


def test_the_check_runs_under_the_venvs_python(done, tmp_path):
    """The decision runs under the venv's python, the stages' own interpreter, not setup.sh's $PY (the
    system python3, possibly one nanochat does not support, whose failure would be silent: the command
    is then left as it is); the tests' PATH hides that ($PY is the test venv's python3)."""
    clone, base, log = done
    (base / "checkpoints" / "sft" / "d2" / "step_000040" / "model.pt").unlink()
    rc, out = _setup(clone, base, "--dry-run")
    assert rc == 0 and "resuming step 20" in out, out
    checks = (tmp_path / "checks.log").read_text().splitlines()
    assert checks == [f"{base}/checkpoints/sft/d2 {base}/checkpoints/mid/d2"], checks


# ---------------------------------------------------------------- run_train.sh

def _call(base: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "run_train.sh"), "--base-dir", str(base), *args],
                          capture_output=True, text=True, timeout=30)


def test_stop_with_a_huge_timeout_is_refused_not_a_sigkill(tmp_path):
    """--timeout 10000000000 ("however long the save takes"): now + timeout x 1e9 ns wrapped negative, so
    --stop sent SIGTERM and, at once, SIGKILL: the run died before its checkpoint."""
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    # a stand-in run: its command line names scripts.base_train (run_alive's test), TERM ends it a second later
    # (args within 80 columns: this test is not the one below)
    proc = subprocess.Popen(["bash", "-c", 'trap "sleep 1;exit 143" TERM;while :;do sleep .1;done', "scripts.base_train"],
                            start_new_session=True)
    try:
        (run_dir / "pid").write_text(f"{proc.pid}\n")
        time.sleep(0.3)
        r = _call(tmp_path, "--stop", "--model-tag", "t", "--timeout", "10000000000")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "--timeout: got '10000000000'; accepted: an integer 1-999999999 (seconds)" in r.stderr
        assert proc.poll() is None, "the run was signalled"
        r = _call(tmp_path, "--stop", "--model-tag", "t", "--timeout", "000000005")   # leading zeros: 5 s
        assert r.returncode == 0 and "stopped" in r.stdout and "SIGKILL" not in r.stdout, r.stdout + r.stderr
        assert proc.wait(timeout=5) == 143
    finally:
        if proc.poll() is None:
            proc.kill()


def test_status_sees_a_run_whose_command_line_is_wider_than_columns(tmp_path):
    """ps cuts its args column at $COLUMNS when that is in the environment (pytest exports 80; some CI
    runners and shells do too): a run started from a long venv path (or under torchrun) had its
    scripts.base_train cut off, so --status said "not running" and removed the live run's pid file, and
    --stop left it training."""
    run_dir = tmp_path / "runs" / "t"
    run_dir.mkdir(parents=True)
    proc = subprocess.Popen(["bash", "-c", "while :; do sleep 0.05; done", "scripts.base_train"],
                            start_new_session=True)
    try:
        (run_dir / "pid").write_text(f"{proc.pid}\n")
        time.sleep(0.3)
        r = subprocess.run(["bash", str(REPO / "run_train.sh"), "--base-dir", str(tmp_path), "--status"],
                           capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "30"})
        assert r.returncode == 0 and f"[t] running (pid {proc.pid})" in r.stdout, r.stdout + r.stderr
        assert (run_dir / "pid").is_file()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("args, said", [
    (["--nproc", "18446744073709551617", "--depth", "2"], "--nproc: got '18446744073709551617'; accepted: an integer 1-9999"),
    (["--status", "--lines", "99999999999999999999"], "--lines: got '99999999999999999999'; accepted: an integer 0-999999999"),
])
def test_numbers_too_long_for_bash_are_refused_not_wrapped(tmp_path, args, said):
    """2^64 + 1 processes read as 1 (a plain python run started), a huge --lines as a negative count."""
    r = _call(tmp_path, *args)
    assert r.returncode == 2 and said in r.stderr, r.stdout + r.stderr
