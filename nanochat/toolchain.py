"""Version probes of the compile toolchain, read-only: the installed Triton, the ptxas binaries
(Triton's bundled ones, CUDA toolkits on disk) and the oldest ptxas an arch needs. nanochat/platform.py
decides from them (patch_ptxas) and re-exports them; nothing here changes the environment."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def triton_version() -> str | None:
    """The installed Triton's version, None without Triton (the benchmarks' JSON lines carry it)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def ptxas_version(path: str) -> tuple[int, int] | None:
    """`ptxas --version` -> (major, minor), None if it does not run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def bundled_ptxas_version(cc: tuple[int, int]) -> tuple[int, int] | None:
    """Version of the ptxas Triton ships for this arch (Triton >= 3.6 ships a second
    `ptxas-blackwell` used for newer archs)."""
    try:
        import triton
    except ImportError:
        return None
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in (["ptxas-blackwell", "ptxas"] if cc[0] >= 10 else ["ptxas"]):
        if (bin_dir / name).exists():
            return ptxas_version(str(bin_dir / name))
    return None


def find_system_ptxas() -> list[tuple[str, tuple[int, int]]]:
    """ptxas binaries on disk (CUDA toolkits, PATH), newest first."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    paths = [os.path.join(home, "bin", "ptxas") for home in homes if home]
    paths += sorted(str(p) for p in Path("/usr/local").glob("cuda*/bin/ptxas"))
    if shutil.which("ptxas"):
        paths.append(shutil.which("ptxas"))
    found = {}
    for p in paths:
        real = os.path.realpath(p)
        if real not in found and os.path.exists(real) and (v := ptxas_version(real)):
            found[real] = v
    return sorted(found.items(), key=lambda kv: kv[1], reverse=True)


def required_ptxas(cc: tuple[int, int]) -> tuple[int, int]:
    """Oldest CUDA ptxas that can target this arch (sm_120: 12.8; sm_121/sm_103: 12.9; sm_110,
    Thor's arch since CUDA 13.0 renamed sm_101: 13.0)."""
    if cc[0] == 11:
        return (13, 0)
    if cc >= (12, 1) or cc == (10, 3):
        return (12, 9)
    if cc[0] >= 10:
        return (12, 8)
    return (11, 8)


def _bundled_ptxas_by_triton(version: str) -> tuple[int, int]:
    """The CUDA release of the ptxas a Triton release bundles for sm_100+, when the binary cannot be
    probed: 3.3-3.5 ship 12.8 only (no sm_121, DESIGN s4.1); 3.6 adds `ptxas-blackwell` 12.9 (sm_121
    yes, Thor's sm_110 no: that needs 13.0); 3.7+ a 13.x one (3.7.0: 13.1); older ones < 12.8.
    (The PyPI wheels' binaries, as listed in triton-lang/triton issue #10331.)"""
    v = _version_tuple(version)
    return (13, 1) if v >= (3, 7) else (12, 9) if v >= (3, 6) else (12, 8) if v >= (3, 3) else (12, 4)
