"""nanochat.resume_point: where setup.sh's rerun of a training stage continues when its latest checkpoint
cannot be resumed (keep | resume N | fresh, with the reason setup.sh prints). The checkpoints are real
saves (save_checkpoint, with their sums) of tiny states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanochat.checkpoint import checkpoint_dir, model_digest, save_checkpoint
from nanochat.resume_point import ResumePoint, main, resume_point


def _save(ckpt: Path, step: int, source: dict | None = None, weight: float = 0.0) -> None:
    save_checkpoint(ckpt, step, model_state={"w": torch.full((4,), weight + step)},
                    optimizer_state={"state": {}, "param_groups": [{"lr": 0.1}]},
                    loader_state={"pos": step}, loop_state={"step": step}, meta={"source": source})


def _source_of(src: Path, step: int) -> dict:
    """The source record a mid / SFT run keeps: the step it started from and its weights' sha256."""
    return {"phase": src.parent.name, "model_tag": src.name, "step": step, "model_sha256": model_digest(src, step)}


@pytest.fixture
def base(tmp_path) -> Path:
    """A base run with whole steps 20 and 40 (latest)."""
    ckpt = checkpoint_dir("base", "d2", tmp_path)
    for step in (20, 40):
        _save(ckpt, step)
    return ckpt


def _step(ckpt: Path, step: int) -> Path:
    return ckpt / f"step_{step:06d}"


def test_a_whole_latest_step_is_kept(base):
    assert resume_point(base) == ResumePoint("keep")


def test_a_deleted_model_resumes_the_newest_whole_earlier_step(base):
    _save(base, 60)
    (_step(base, 60) / "model.pt").unlink()
    assert resume_point(base) == ResumePoint("resume", 40, "step 60", "model.pt is gone")


def test_an_optimizer_file_edited_in_place_resumes_the_step_before(base):
    optim = _step(base, 40) / "optim_rank0.pt"
    data = bytearray(optim.read_bytes())
    data[-1] ^= 0xFF   # same size, other bytes: only the sha256 tells
    optim.write_bytes(bytes(data))
    assert resume_point(base) == ResumePoint(
        "resume", 20, "step 40", "optim_rank0.pt is not the file saved (sums_rank0.json recorded another size or sha256)")


def test_damage_in_earlier_steps_is_passed_over(base):
    _save(base, 60)
    (_step(base, 60) / "meta.json").unlink()
    (_step(base, 40) / "sums_rank0.json").write_text("{not json")
    assert resume_point(base) == ResumePoint("resume", 20, "step 60", "meta.json is gone")


def test_without_a_whole_earlier_step_the_stage_starts_afresh(base):
    (_step(base, 40) / "state_rank0.pt").unlink()
    (_step(base, 20) / "model.pt").write_bytes(b"")   # another size
    assert resume_point(base) == ResumePoint("fresh", None, "step 40", "state_rank0.pt is gone",
                                             "no earlier step is whole")


def test_a_latest_json_naming_no_step_resumes_the_newest_whole_step(base):
    (base / "latest.json").write_text('{"step": true}')
    assert resume_point(base) == ResumePoint("resume", 40, "latest.json", "it names no step")


@pytest.mark.parametrize("same_source", [True, False])
def test_mid_resumes_only_a_step_that_started_from_the_source_now(base, tmp_path, same_source):
    """A mid step that started from other base weights than base's latest now (base retrained since):
    its --resume auto would start afresh, and an explicit --resume N would continue it on the old
    weights (it checks only --source's phase and --step), so the stage starts afresh."""
    mid = checkpoint_dir("mid", "d2", tmp_path)
    started = _source_of(base, 40)
    if not same_source:
        started = _source_of(base, 20)
    _save(mid, 20, started)
    _save(mid, 40, _source_of(base, 40))
    (_step(mid, 40) / "model.pt").unlink()
    got = resume_point(mid, base)
    if same_source:
        assert got == ResumePoint("resume", 20, "step 40", "model.pt is gone")
    else:
        assert got == ResumePoint("fresh", None, "step 40", "model.pt is gone",
                                  "step 20, the newest whole one, started from other base weights")
        assert resume_point(mid) == ResumePoint("resume", 20, "step 40", "model.pt is gone")   # (no source: base)


def test_mid_with_the_source_weights_replaced_under_the_same_step_starts_afresh(base, tmp_path):
    mid = checkpoint_dir("mid", "d2", tmp_path)
    _save(mid, 20, _source_of(base, 40))
    _save(mid, 40, _source_of(base, 40))
    (_step(mid, 40) / "optim_rank0.pt").unlink()
    _save(base, 40, weight=1.0)   # base retrained to the same step: other weights
    assert resume_point(mid, base).how == "fresh"


def test_the_command_prints_one_field_a_line(base, tmp_path, capsys):
    (_step(base, 40) / "model.pt").unlink()
    assert main([str(base)]) == 0
    assert capsys.readouterr().out.splitlines() == ["resume", "20", "step 40", "model.pt is gone"]
    sft = checkpoint_dir("sft", "d2", tmp_path)
    _save(sft, 5, {"step": 0, "model_sha256": "0" * 64})
    (sft / "latest.json").write_text(json.dumps({"step": 9}))
    assert main([str(sft), str(base)]) == 0
    assert capsys.readouterr().out.splitlines() == ["fresh", "-", "step 9", "meta.json is gone",
                                                    "step 5, the newest whole one, started from other base weights"]
    _save(sft, 10)
    assert main([str(sft), ""]) == 0 and capsys.readouterr().out == "keep\n"
