"""CPU workarounds (the GPU ones are in nanochat/platform.py, which re-exports these and whose
preflight report lists them): today one, oneDNN's AMX kernels on VMs that advertise AMX without
enabling it. Kept apart so platform.py stays one screenful per concern; nothing runs at import."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, MutableMapping

import torch

log = logging.getLogger("nanochat.platform")
_LOGGED: set[str] = set()


def _log_once(name: str, message: str) -> None:
    if name not in _LOGGED:
        _LOGGED.add(name)
        log.warning("[platform] %s: %s", name, message)


ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
AMX_FALLBACK_ISA = "AVX512_CORE_BF16"  # the best ISA below AMX: bf16 dot products, no tiles


def _bf16_matmul_in_child(timeout_s: float = 20.0) -> int | None:
    """Fork, run one small bf16 matmul in the child; return the signal that killed it (0 = ran
    fine, None = could not tell: no fork, or it did not finish in time)."""
    import time
    if not hasattr(os, "fork"):
        return None
    pid = os.fork()
    if pid == 0:  # child: one thread (no OpenMP pool inherited across fork), then exit hard
        try:
            torch.set_num_threads(1)
            a = torch.ones(32, 64, dtype=torch.bfloat16)
            (a @ a.T).sum().item()
        finally:
            os._exit(0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


# the env mappings this process capped (os.environ in real runs): a later call, and apply_patches
# (whose list the training banner and checkpoint record), report the patch again. Before, the second
# call took the cap for a user's and said nothing, and a CPU run's banner listed no patch.
_CAPPED: list[MutableMapping[str, str]] = []


def cpu_amx_applied(env: MutableMapping[str, str] | None = None) -> bool:
    """Whether patch_cpu_amx capped oneDNN in `env` (default os.environ) in this process, and the
    cap is still its value."""
    env = os.environ if env is None else env
    return any(e is env for e in _CAPPED) and env.get(ONEDNN_ISA_ENV) == AMX_FALLBACK_ISA


def patch_cpu_amx(env: MutableMapping[str, str] | None = None, cpu_flags: str | None = None,
                  probe: Callable[[], int | None] = _bf16_matmul_in_child) -> str | None:
    """CPU bf16 matmuls die with SIGILL on VMs that advertise AMX (cpuinfo `amx_tile`) without
    enabling its register state: torch >= 2.12 CPU builds' oneDNN then picks AMX kernels (seen
    with torch 2.15.0 on Firecracker guests). Probe once in a forked child; if it dies, cap
    oneDNN at AVX512_CORE_BF16. Must run before this process's first oneDNN matmul (oneDNN
    reads the cap once); init_runtime and tests/conftest.py call it first. A user-set cap wins."""
    env = os.environ if env is None else env
    if ONEDNN_ISA_ENV in env:   # the user's cap, or this patch's from an earlier call (same report)
        return "cpu_amx" if cpu_amx_applied(env) else None
    if cpu_flags is None:
        try:
            cpu_flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    if "amx_tile" not in cpu_flags.split():
        return None
    if probe() != 4:  # 4 = SIGILL; anything else (fine, no fork, timeout): leave oneDNN alone
        return None
    env[ONEDNN_ISA_ENV] = AMX_FALLBACK_ISA
    _CAPPED.append(env)
    _log_once("cpu_amx", f"bf16 AMX kernels crash on this CPU (SIGILL in a probe; targets torch >= 2.12 CPU builds): "
                         f"{ONEDNN_ISA_ENV}={AMX_FALLBACK_ISA}")
    return "cpu_amx"
