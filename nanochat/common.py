"""Process-wide basics: the base directory, rank-0 printing and (via init_runtime) the Runtime.

Nothing here runs at import time; `init_runtime()` is the one explicit entry point that touches
devices, seeds and the process group.
"""

from __future__ import annotations

import os
from pathlib import Path


def get_base_dir() -> Path:
    """Where artefacts live: $NANOCHAT_BASE_DIR or ~/.cache/nanochat (created on demand)."""
    base = os.environ.get("NANOCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nanochat")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only; safe before the process group exists (reads RANK)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs)
