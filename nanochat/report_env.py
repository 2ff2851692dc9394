"""What a report's header says about the machine and the code: git sha and what makes the tree
dirty, Python / torch / CUDA versions, device, CPU and memory (nanochat/report.py calls it at
reset and generate, never at import)."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def system_info() -> dict:
    """Git sha, versions, device, CPU and memory (called by reset/generate, never at import)."""
    info = {"python": platform.python_version(), "platform": platform.platform(),
            **git_info(Path(__file__).resolve().parents[1])}
    import torch

    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        info["device"] = f"{n} x {torch.cuda.get_device_name(0)}"
        info["cuda"] = torch.version.cuda
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        info["device"] = "cpu"
    info["cpu"] = _cpu_name()
    info["cpu_count"] = os.cpu_count()
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def git_info(repo: Path) -> dict:
    """git_sha, git_dirty and what makes it dirty (git_changes: the first files' porcelain status;
    untracked files count): a bare `git_dirty: True` left the reader guessing whether it mattered."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": "unknown (git not available)"}
    changes = [line.strip() for line in dirty.stdout.splitlines() if line.strip()]
    more = f", and {len(changes) - 5} more" if len(changes) > 5 else ""
    return {"git_sha": sha.stdout.strip() or "unknown (no commits)", "git_dirty": bool(changes),
            **({"git_changes": f"{len(changes)} file(s): {', '.join(changes[:5])}{more}"} if changes else {})}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
