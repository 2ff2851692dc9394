"""Whether the sandbox (nanochat/execution.py) can run a root caller's program as nobody.

The parent decides before it starts the child: the switch needs root with CAP_CHOWN (to hand the
working dir to nobody, here) and CAP_SETUID / CAP_SETGID (used in the child), and an interpreter
and standard library that nobody can read. When any of these is missing the program keeps the
caller's uid (the other layers stay) instead of failing to start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_CAP_CHOWN, _CAP_SETGID, _CAP_SETUID = 0, 6, 7


def _world_readable(path: Path) -> bool:
    """True when 'other' can traverse every ancestor of path and read path itself."""
    try:
        path = path.resolve()
        for parent in list(path.parents)[::-1]:
            if not os.stat(parent).st_mode & 0o001:
                return False
        return bool(os.stat(path).st_mode & 0o004)
    except OSError:
        return False


def _has_capabilities(*caps: int) -> bool:
    """Whether this process's effective capability set holds all of `caps` (Linux; elsewhere a
    root process is assumed to hold them)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return True
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
            return all(effective >> cap & 1 for cap in caps)
    return True


def can_drop_to_nobody() -> bool:
    """Root with a world-readable interpreter and the capabilities the switch needs: chown (the
    working dir, here) and setuid / setgid (in the child). A root without them (a container started
    with those capabilities dropped) keeps its uid, as without a readable interpreter, instead of
    failing."""
    import sysconfig

    return (os.geteuid() == 0 and _has_capabilities(_CAP_CHOWN, _CAP_SETGID, _CAP_SETUID)
            and _world_readable(Path(sys.executable))
            and _world_readable(Path(sysconfig.get_paths()["stdlib"])))
