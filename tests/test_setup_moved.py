"""setup.sh's done-markers in a base dir that was moved or copied, each test failing on the code
before its fix. The stages are faked (a clone whose .venv/bin/python writes each stage's outputs
into the base dir), so the file runs in seconds.

- Each marker held `base_dir=<absolute path>`, so a base dir moved (to a bigger disk, or `mv` then
  another NANOCHAT_BASE_DIR) or copied reran every stage: the data and the tokenizer again, base /
  mid / SFT resumed at their last step and stopped there, base_eval and chat_eval in full, and every
  report section logged twice (a finished tiny pipeline, moved: 43 s on 2 CPU cores, now 0.5 s).
  The markers now hold the stage's settings and the files it left, relative to the base dir; the
  start says in one line that the base dir was elsewhere.
- A marker whose stage's outputs were gone (a deleted tokenizer, a checkpoint removed) still said
  "done already", and every later stage failed on what was not there; such a stage now reruns.
- Markers of the older format are honoured where the outputs they stand for are there, and rewritten.
"""

from __future__ import annotations

import shutil

from tests.setup_clone import make_clone
from tests.test_setup import PIPELINE, _verdicts
from tests.test_setup_review3 import _run

# a venv python: the chat-input check passes; each stage logs its module and leaves the files the
# real one leaves (checkpoints: latest.json naming the step, model.pt, meta.json, sums)
STAGE_PYTHON = """#!/usr/bin/env bash
if [[ "$1" == - ]]; then cat > /dev/null; exit 0; fi
[[ "$3" == reset || "$2" == nanochat.resume_point ]] && exit 0
echo "$2" >> "{log}"
b="$NANOCHAT_BASE_DIR"
ckpt() {{
  local d="$b/checkpoints/$1/d2"
  mkdir -p "$d/step_000040"
  echo "weights of $1" > "$d/step_000040/model.pt"
  echo '{{"step": 40}}' > "$d/step_000040/meta.json"
  echo '{{"model.pt": {{"bytes": 1}}}}' > "$d/step_000040/sums_rank0.json"
  printf '{{\\n  "dir": "step_000040",\\n  "step": 40\\n}}' > "$d/latest.json"
}}
case "$2" in
  nanochat.dataset) mkdir -p "$b/base_data"; echo 0 > "$b/base_data/shard_00000.parquet"
                    echo 1 > "$b/base_data/shard_00001.parquet" ;;
  scripts.tok_train) mkdir -p "$b/tokenizer"; echo merges > "$b/tokenizer/tokenizer.pkl"
                     echo bytes > "$b/tokenizer/token_bytes.pt" ;;
  scripts.base_train) ckpt base ;;
  scripts.mid_train) ckpt mid ;;
  scripts.chat_sft) ckpt sft ;;
  scripts.base_eval) mkdir -p "$b/eval"; echo '{{}}' > "$b/eval/base_d2_step000040.json" ;;
  scripts.chat_eval) mkdir -p "$b/chat_eval"; echo '{{}}' > "$b/chat_eval/sft_d2_step000040.json" ;;
  nanochat.report) mkdir -p "$b/report"; echo report > "$b/report/report.md" ;;
esac
exit 0
"""
CONV = '{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n'


def _pipeline(tmp_path):
    """A clone with the fake stages, and a base dir tmp_path/a where the whole pipeline has finished,
    with a --conversations file kept in the base dir -> (clone, log of the stages run)."""
    log = tmp_path / "stages.log"
    clone = make_clone(tmp_path, STAGE_PYTHON.format(log=log), home=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "own.jsonl").write_text(CONV)
    rc, out = _setup(clone, tmp_path / "a")
    assert rc == 0 and set(_verdicts(out).values()) == {"new"}, out
    assert len(log.read_text().split()) == len(PIPELINE), log.read_text()
    log.write_text("")
    return clone, log


def _setup(clone, base, *args):
    """./setup.sh --preset tiny --from data with NANOCHAT_BASE_DIR=base and base's conversations file."""
    return _run(clone, "./setup.sh", "--preset", "tiny", "--from", "data", "--conversations", base / "own.jsonl",
                *args, NANOCHAT_BASE_DIR=base)


def test_a_moved_or_copied_base_dir_keeps_its_finished_stages(tmp_path):
    clone, log = _pipeline(tmp_path)
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    a.rename(b)
    rc, out = _setup(clone, b)
    assert rc == 0 and set(_verdicts(out).values()) == {"skip"}, out
    assert log.read_text() == "", log.read_text()   # no stage ran
    moved = [line for line in out.splitlines() if "moved or copied" in line]
    assert moved == [f"==> base dir {b} was {a} when setup.sh last ran on it (moved or copied): its finished stages "
                     "stay done where their outputs are here"], out
    rc, out = _setup(clone, b)   # said once: the base dir's place is recorded
    assert rc == 0 and "moved or copied" not in out and set(_verdicts(out).values()) == {"skip"}, out

    shutil.copytree(b, c, symlinks=True)   # a copy: both keep their stages
    for base in (c, b):
        rc, out = _setup(clone, base)
        assert rc == 0 and set(_verdicts(out).values()) == {"skip"}, (base, out)
    a.symlink_to(c)   # the same directory by another name: nothing to say
    rc, out = _setup(clone, a, "--dry-run")
    assert rc == 0 and "moved or copied" not in out and set(_verdicts(out).values()) == {"skip"}, out
    assert log.read_text() == "", log.read_text()


def test_a_stage_whose_outputs_are_gone_or_changed_reruns(tmp_path):
    """In a moved base dir: a stage whose output file is gone, or changed since it finished, reruns
    (and the stages after a model stage with it); a changed setting still reruns its stage."""
    clone, _ = _pipeline(tmp_path)
    b = tmp_path / "b"
    (tmp_path / "a").rename(b)
    pkl = b / "tokenizer" / "tokenizer.pkl"
    pkl.rename(tmp_path / "kept.pkl")
    rc, out = _setup(clone, b, "--dry-run")
    assert rc == 0 and "==> [tokenizer] finished before, but its output tokenizer/tokenizer.pkl is gone: rerunning" in out
    said = _verdicts(out)
    assert [said[s] for s in PIPELINE] == ["skip"] + ["new"] + ["cascade"] * 7, out
    (tmp_path / "kept.pkl").rename(pkl)

    latest = b / "checkpoints" / "mid" / "d2" / "latest.json"
    latest.write_text(latest.read_text().replace("40", "41"))   # same size, another step
    rc, out = _setup(clone, b, "--dry-run")
    assert rc == 0 and ("==> [mid_train] finished before, but its output checkpoints/mid/d2/latest.json has changed "
                        "since it finished: rerunning") in out, out
    said = _verdicts(out)
    assert [said[s] for s in PIPELINE] == ["skip"] * 5 + ["new"] + ["cascade"] * 3, out
    latest.write_text(latest.read_text().replace("41", "40"))

    (b / "chat_eval" / "sft_d2_step000040.json").unlink()   # an eval's result: only the report follows
    rc, out = _setup(clone, b, "--dry-run")
    said = _verdicts(out)
    assert rc == 0 and [said[s] for s in PIPELINE] == ["skip"] * 7 + ["new", "cascade"], out
    rc, out = _setup(clone, b, "--dry-run", "--depth", "3")   # another setting: base_train on
    said = _verdicts(out)
    assert rc == 0 and [said[s] for s in PIPELINE] == ["skip"] * 3 + ["changed"] * 5 + ["cascade"], out


def _older_marker(marker, was):
    """A done-marker as setup.sh wrote it before: preset, base_dir=<absolute>, command, inputs."""
    lines = marker.read_text().splitlines()[1:]   # the format line
    lines = [x.replace("<base dir>/", f"{was}/") for x in lines if not x.startswith("output ")]
    return "\n".join([lines[0], f"base_dir={was}", *lines[1:]]) + "\n"


def test_older_markers_are_honoured_where_their_outputs_are(tmp_path):
    clone, log = _pipeline(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    state = a / "setup_state"
    for marker in state.glob("*.done"):
        marker.write_text(_older_marker(marker, a))
    (state / "location").unlink()
    a.rename(b)
    (b / "checkpoints" / "sft" / "d2" / "step_000040" / "model.pt").unlink()
    rc, out = _setup(clone, b, "--dry-run")
    assert rc == 0 and f"==> base dir {b} was {a} when setup.sh last ran on it (moved or copied)" in out, out
    said = _verdicts(out)
    assert [said[s] for s in PIPELINE] == ["skip"] * 6 + ["new"] + ["cascade"] * 2, out
    assert "==> [mid_train] done already (same config, by an older setup.sh's marker): skipping" in out
    assert ("==> [chat_sft] finished before, but its output checkpoints/sft/d2/step_000040/model.pt is gone: "
            "rerunning") in out, out

    rc, out = _setup(clone, b)   # the stages run from chat_sft; the older markers before it are rewritten
    assert rc == 0 and log.read_text().split() == ["scripts.chat_sft", "scripts.chat_eval", "nanochat.report"], out
    assert "by an older setup.sh's marker, now rewritten with the outputs found): skipping" in out
    assert all("\nbase_dir=" not in m.read_text() for m in (b / "setup_state").glob("*.done"))
    rc, out = _setup(clone, b)
    assert rc == 0 and set(_verdicts(out).values()) == {"skip"} and "older setup.sh" not in out, out


def test_a_training_stage_trained_on_after_setup_stays_done(tmp_path):
    """base_train trained further after setup.sh's run (run_train.sh --resume latest, --keep-last 1):
    its recorded checkpoint files are gone, a later whole one is there. Rerunning it resumed past
    setup's step count and failed, after deleting every later stage's marker (review); it is kept,
    and said so. A latest.json naming a step that is not there still reruns it (the test above)."""
    clone, log = _pipeline(tmp_path)
    d = tmp_path / "a" / "checkpoints" / "base" / "d2"
    shutil.copytree(d / "step_000040", d / "step_000080")
    (d / "step_000080" / "model.pt").write_text("weights trained further\n")
    shutil.rmtree(d / "step_000040")
    (d / "latest.json").write_text('{\n  "dir": "step_000080",\n  "step": 80\n}')
    rc, out = _setup(clone, tmp_path / "a")
    assert rc == 0 and set(_verdicts(out).values()) == {"skip"}, out
    assert ("==> [base_train] done already (same config; its checkpoints moved on since setup.sh's run (a later "
            "step is there): kept; --force redoes it): skipping") in out, out
    assert log.read_text() == "", log.read_text()
    (d / "step_000080" / "model.pt").unlink()   # the latest step incomplete: the stage runs again
    rc, out = _setup(clone, tmp_path / "a", "--dry-run")
    said = _verdicts(out)
    assert rc == 0 and [said[s] for s in PIPELINE] == ["skip"] * 3 + ["new"] + ["cascade"] * 5, out
