"""nanochat.resume_point imports no torch: setup.sh runs it before every training stage, and each run paid
torch's import (2-4 s; tests/test_setup_review74.py went from ~13 s to 40-50 s). Its checkpoint reads
(latest.json, meta.json, the sums and sha256s) live in nanochat/checkpoint_io.py, which imports torch only
inside the functions that read, write or measure tensors; nanochat.checkpoint re-exports them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from nanochat import checkpoint as ck
from nanochat import checkpoint_io as cio

REPO = Path(__file__).resolve().parents[1]


def _python(code: str, *args: str) -> list[str]:
    """Run `code` in a fresh interpreter of this venv at the repository root; its stdout lines."""
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_importing_resume_point_leaves_torch_unimported():
    out = _python("import sys, nanochat.resume_point\nprint('torch' in sys.modules)")
    assert out == ["False"]


def test_a_verdict_with_a_source_reads_every_file_without_torch(tmp_path):
    """The whole check (latest.json, meta.json, each file's size and sha256, the source's model digest),
    in a fresh interpreter: a verdict, and still no torch (no lazy import on the way)."""
    base, mid = ck.checkpoint_dir("base", "d2", tmp_path), ck.checkpoint_dir("mid", "d2", tmp_path)
    for step in (20, 40):
        ck.save_checkpoint(base, step, model_state={"w": torch.full((4,), float(step))},
                           optimizer_state={"state": {}}, loader_state={}, loop_state={"step": step}, meta={})
    source = {"phase": "base", "model_tag": "d2", "step": 40, "model_sha256": ck.model_digest(base, 40)}
    for step in (20, 40):
        ck.save_checkpoint(mid, step, model_state={"w": torch.zeros(4)}, optimizer_state={"state": {}},
                           loader_state={}, loop_state={"step": step}, meta={"source": source})
    (mid / "step_000040" / "state_rank0.pt").write_bytes(b"damaged")   # another size than its sums say
    code = ("import sys\nfrom nanochat.resume_point import main\nmain(sys.argv[1:])\n"
            "print('torch' in sys.modules)")
    assert _python(code, str(mid), str(base)) == [
        "resume", "20", "step 40", "state_rank0.pt is not the file saved (sums_rank0.json recorded another size or "
        "sha256)", "False"]


def test_checkpoint_keeps_the_moved_names():
    """Every `from nanochat.checkpoint import ...` of the moved names keeps working, as the same objects."""
    for name in ("read_latest", "model_digest", "saved_sum", "MODEL_NAME", "META_NAME", "PHASES", "LATEST_NAME",
                 "_other_tags", "_model_tags", "_has_checkpoint"):
        assert getattr(ck, name) is getattr(cio, name), name
    assert (ck.MODEL_NAME, ck.META_NAME, ck.PHASES) == ("model.pt", "meta.json", ("base", "mid", "sft", "rl"))
