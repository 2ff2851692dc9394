"""What a report's header says about the machine and the code: git sha and what makes the tree
dirty, Python / torch / CUDA versions, device, CPU and memory (nanochat/report.py calls it at
reset and generate, never at import), and report.md's environment list with a line when the code at
`generate` is not what `reset` recorded; and environment_meta, what every checkpoint records of them
(nanochat/checkpoint.py re-exports it)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path


def system_info() -> dict:
    """Git sha, versions, device, CPU and memory (called by reset/generate, never at import)."""
    info = {"python": platform.python_version(), "platform": platform.platform(),
            **git_info(Path(__file__).resolve().parents[1])}
    import torch

    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info.update(_gpu_info(torch))
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


def _gpu_info(torch) -> dict:
    """Each kind of GPU with its count and compute capability (GB10's pitfalls are sm_121's, not
    sm_120's: "1 x NVIDIA GB10" did not say which), the CUDA and Triton versions the GB10 workarounds
    depend on, and whether the GPU memory is the host's (unified: "gpu_memory_gib" next to
    "memory_gib" read as two pools, twice the memory there is)."""
    from importlib import metadata

    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    kinds = Counter(f"{p.name} (cc {p.major}.{p.minor})" for p in props)
    info = {"device": ", ".join(f"{n} x {kind}" for kind, n in kinds.items()), "cuda": torch.version.cuda}
    try:
        info["triton"] = metadata.version("triton")
    except metadata.PackageNotFoundError:
        pass
    info["gpu_memory_gib"] = round(props[0].total_memory / 2**30, 1)
    if getattr(props[0], "is_integrated", False):
        info["unified_memory"] = "yes: gpu_memory_gib is the host's memory, shared with the CPU"
    return info


def git_info(repo: Path) -> dict:
    """git_sha, git_dirty and what makes it dirty (git_changes: the first files' porcelain status;
    untracked files count): a bare `git_dirty: True` left the reader guessing whether it mattered.
    A git that fails says why in git_sha and gives no git_dirty: outside a repository (or one git
    refuses: "dubious ownership") the report said "unknown (no commits)" and "git_dirty: False",
    and a repository without commits recorded rev-parse's echo "HEAD" as the sha. File names are
    shown as they are (core.quotePath=false: "é.py", not "\\303\\251.py")."""
    git = ["git", "-c", "core.quotePath=false"]
    # names as bytes git does not quote now: one that is not UTF-8 is replaced, not a UnicodeDecodeError
    text = {"cwd": repo, "capture_output": True, "encoding": "utf-8", "errors": "replace", "timeout": 10}
    try:
        sha = subprocess.run([*git, "rev-parse", "--verify", "-q", "HEAD"], **text)
        dirty = subprocess.run([*git, "status", "--porcelain"], **text)
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": "unknown (git not available)"}
    if dirty.returncode != 0:   # not a repository, or one git will not read: nothing is known of it
        why = (dirty.stderr.strip().splitlines() or [f"git status exit {dirty.returncode}"])[0]
        return {"git_sha": f"unknown ({why.removeprefix('fatal: ')})"}
    changes = [line.strip() for line in dirty.stdout.splitlines() if line.strip()]
    more = f", and {len(changes) - 5} more" if len(changes) > 5 else ""
    return {"git_sha": sha.stdout.strip() if sha.returncode == 0 else "unknown (no commits)",
            "git_dirty": bool(changes),
            **({"git_changes": f"{len(changes)} file(s): {', '.join(changes[:5])}{more}"} if changes else {})}


def environment_lines(system: dict, recorded: bool) -> list[str]:
    """report.md's environment list: the header's system info and, when `recorded` (header.json, by
    `reset`), a line if the checkout changed since (code_drift)."""
    drift = code_drift(system) if recorded else None
    return [f"- {k}: {v}" for k, v in system.items()] + ([drift] if drift else [])


def code_drift(recorded: dict) -> str | None:
    """Why the commit `reset` recorded may not be the code the stages ran, or None: setup.sh resets only
    a fresh pipeline, so after a `git pull` (or an edit) and a rerun of some stages report.md still
    named the first commit, clean, as the run's code. Tracked files only (git_sha's "+dirty", as the
    checkpoints record it): files the run writes into an untracked base dir are not a change of code."""
    sha = recorded.get("git_sha")
    now = git_sha() if isinstance(sha, str) and len(sha) == 40 else None   # "unknown (...)": nothing to compare
    if now is None:
        return None
    head, dirty = now.removesuffix("+dirty"), now.endswith("+dirty")
    where = ("(each checkpoint's meta.json names the commit it was trained with, '+dirty' for modified files)")
    if head != sha:
        return (f"- git now (at `generate`): {head}{' with uncommitted changes' if dirty else ''}: not the commit "
                f"`reset` recorded above, so any stage run after the checkout changed ran other code {where}")
    if dirty and recorded.get("git_dirty") is False:
        return (f"- git now (at `generate`): {head} with tracked files modified since `reset` (clean then): any "
                f"stage run after the edit ran that code {where}")
    return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ------------------------------------------------------------------------------------ checkpoint metadata

def git_sha(repo: Path | None = None) -> str | None:
    """HEAD commit of the source tree (None outside a git checkout or before its first commit);
    '+dirty' if modified."""
    repo = repo or Path(__file__).resolve().parents[1]
    try:
        # --verify: in a repository without commits a bare `rev-parse HEAD` echoes "HEAD" (exit 128),
        # which checkpoints recorded as their sha ("HEAD+dirty" once a file was added)
        head = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=repo, capture_output=True,
                              text=True, timeout=10)
        sha = head.stdout.strip() if head.returncode == 0 else ""
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) if sha else None


def environment_meta(device=None) -> dict:
    """Versions and device name recorded in every checkpoint (nanochat/checkpoint.py)."""
    import torch   # here: the report's header needs no torch

    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    elif device is not None:
        device_name = f"{device.type} ({platform.processor() or platform.machine()})"
    else:
        device_name = None
    return {"git_sha": git_sha(), "torch_version": torch.__version__,
            "python_version": sys.version.split()[0], "cuda_version": torch.version.cuda,
            "device_name": device_name, "hostname": platform.node()}
