"""The memory a run may plan to use (memory_budget_bytes, re-exported by nanochat.platform):
/proc/meminfo's MemAvailable on unified memory (GB10), bounded by the memory cgroup limit the
process runs under (a container's memory limit (docker run -m), a systemd `MemoryMax=`, a batch
scheduler's job limit); cudaMemGetInfo's free memory on a discrete GPU.

/proc/meminfo shows the host's memory even inside a container: on a 128 GB DGX Spark in a
32 GB container (docker run -m 32g) MemAvailable says ~120 GB while the kernel OOM-kills the container at
32 GB. nanochat.platform's budget (and so the allocator cap) and setup.sh's batch sizing take the
smaller of MemAvailable and what the tightest limit leaves. Stdlib only: setup.sh runs
`python3 -m nanochat.memory_limits` before any environment exists.

Where the limit is looked for: this process's cgroup (/proc/self/cgroup) and every ancestor up to
the mount point, under cgroup v2 (`memory.max`, "max" = none; `memory.current`) and v1
(`<root>/memory/.../memory.limit_in_bytes`, ~2^63 = none; `memory.usage_in_bytes`). A cgroup path
that does not exist under the mount (a v1 container sees its own cgroup as the mount point) is read
at the mount point alone. Usage counts the inactive file cache as free: the kernel reclaims it
before it OOM-kills (the same rule `docker stats` uses); counting it as used would repeat the
page-cache mistake cudaMemGetInfo makes on unified memory (DESIGN.md s4.3).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
_NO_LIMIT = 1 << 62   # v1 writes PAGE_COUNTER_MAX (9223372036854771712) for "no limit"


@dataclass(frozen=True)
class CgroupMemory:
    limit: int   # bytes
    usage: int   # bytes in use, less the reclaimable inactive file cache
    path: str    # the limit file that binds

    @property
    def free(self) -> int:
        return max(0, self.limit - self.usage)


# (controller line in /proc/self/cgroup, sub-mount, limit file, usage file, inactive-file key in memory.stat)
_LAYOUTS = (("v2", "", "memory.max", "memory.current", "inactive_file"),
            ("v1", "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))


def _own_paths(self_cgroup: str) -> dict[str, str]:
    """{"v2": path, "v1": path} of this process's cgroups, from /proc/self/cgroup's lines
    `0::/path` (v2) and `N:...memory...:/path` (v1); an unreadable file gives {}."""
    try:
        text = Path(self_cgroup).read_text()
    except OSError:
        return {}
    paths = {}
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return paths


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None   # "max" (v2's no limit) and garbage: None


def _inactive_file(stat: Path, key: str) -> int:
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _levels(mount: Path, own: str) -> list[Path]:
    """The cgroup's directory and its ancestors up to the mount point (the mount alone when the
    process's path is not under it: a container's cgroup namespace, where it may read "/../..",
    or a v1 bind mount)."""
    here = mount / own.strip("/") if own.strip("/") else mount
    if ".." in Path(own).parts or not here.is_dir():
        return [mount]
    return [here, *[p for p in here.parents if p == mount or mount in p.parents]]


def cgroup_levels(root: str = CGROUP_ROOT, self_cgroup: str = PROC_SELF_CGROUP) -> list[CgroupMemory]:
    """Every memory limit set on this process's cgroups (v2 and v1, its own and each ancestor's);
    [] when none is set (or no cgroup filesystem is there: macOS, a bare chroot)."""
    own = _own_paths(self_cgroup)
    found = []
    for version, sub, limit_file, usage_file, inactive_key in _LAYOUTS:
        mount = Path(root) / sub if sub else Path(root)
        if version not in own or not mount.is_dir():
            continue
        for level in _levels(mount, own[version]):
            limit = _read_int(level / limit_file)
            if limit is None or limit >= _NO_LIMIT:
                continue
            used = _read_int(level / usage_file) or 0
            usage = max(0, used - _inactive_file(level / "memory.stat", inactive_key))
            found.append(CgroupMemory(limit, usage, str(level / limit_file)))
    return found


def cgroup_memory(root: str = CGROUP_ROOT, self_cgroup: str = PROC_SELF_CGROUP) -> CgroupMemory | None:
    """The memory limit that leaves this process the least free memory, or None when none is set."""
    return min(cgroup_levels(root, self_cgroup), key=lambda c: c.free, default=None)


def bounded_by_cgroup(mem_available: int, root: str | None = CGROUP_ROOT,
                      self_cgroup: str = PROC_SELF_CGROUP) -> tuple[int, str]:
    """(bytes, what bounded them): the smaller of `mem_available` (/proc/meminfo's MemAvailable, in
    bytes) and what the binding cgroup limit leaves; `root` None: no cgroup is read."""
    cgroup = cgroup_memory(root, self_cgroup) if root is not None else None
    if cgroup is None or cgroup.free >= mem_available:
        return mem_available, "MemAvailable"
    return cgroup.free, (f"the cgroup memory limit less its use ({cgroup.path}: {cgroup.limit / 1e9:.1f} GB "
                         f"limit, {cgroup.usage / 1e9:.1f} GB in use), below MemAvailable")


MEMINFO = "/proc/meminfo"   # tests point it elsewhere


def memory_budget_bytes(spec, *, meminfo: str | None = None, headroom: float = 0.1,
                        cgroup_root: str | None = CGROUP_ROOT, self_cgroup: str = PROC_SELF_CGROUP) -> int | None:
    """Bytes a run may plan to use. Unified memory: unified_memory_budget (MemAvailable, bounded by
    a cgroup's memory limit); discrete GPU: cudaMemGetInfo free; both less `headroom` of it. CPU/MPS:
    None (Apple's MPS is unified too, but macOS has no /proc/meminfo)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom: got {headroom!r}; accepted: a fraction in [0, 1)")
    if spec.is_cuda and spec.unified_memory:
        return unified_memory_budget(meminfo=meminfo, headroom=headroom, cgroup_root=cgroup_root,
                                     self_cgroup=self_cgroup)[0]
    if spec.is_cuda:
        import torch   # here: setup.sh runs this module with a Python that has no torch
        free, _total = torch.cuda.mem_get_info()
        return int(free * (1 - headroom))
    return None


def unified_memory_budget(*, meminfo: str | None = None, headroom: float = 0.1, cgroup_root: str | None = CGROUP_ROOT,
                          self_cgroup: str = PROC_SELF_CGROUP) -> tuple[int, str]:
    """(bytes, what bounded them) on unified memory: the smaller of MemAvailable and what the
    tightest cgroup memory limit leaves (a container's memory limit: /proc/meminfo shows the host's),
    less `headroom` of it. `meminfo`: the text (None: read MEMINFO); `cgroup_root` None: no cgroup.
    An unreadable meminfo or one without MemAvailable is a RuntimeError naming the file
    (cudaMemGetInfo, counting the page cache as used, is no stand-in)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom: got {headroom!r}; accepted: a fraction in [0, 1)")
    try:
        text = meminfo if meminfo is not None else Path(MEMINFO).read_text()
    except OSError as exc:
        raise RuntimeError(f"{MEMINFO}: cannot be read ({exc.strerror or exc}); the unified-memory "
                           "budget comes from its MemAvailable line") from exc
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, flags=re.MULTILINE)
    if m is None:
        raise RuntimeError(f"{MEMINFO} has no 'MemAvailable: <n> kB' line (Linux >= 3.14 writes one)")
    free, source = bounded_by_cgroup(int(m.group(1)) * 1024, cgroup_root, self_cgroup)
    return int(free * (1 - headroom)), source


def main(argv: list[str]) -> int:
    """setup.sh's reader: `python3 -m nanochat.memory_limits [ROOT [SELF_CGROUP]]` prints
    "LIMIT_BYTES FREE_BYTES PATH": the smallest limit (the most memory a run here can ever have: a
    parent's looser limit with less free now bounds only the free part) with its file, and the least
    free memory any limit leaves; nothing when no limit is set."""
    levels = cgroup_levels(*argv[:2])
    if levels:
        tightest = min(levels, key=lambda c: c.limit)
        print(tightest.limit, min(c.free for c in levels), tightest.path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
