"""NCCL's environment checked against this machine, before a process group starts (torch-free).

* `nccl_env_defaults` sets the defaults this project relies on where they are unset: NVLink
  multicast off (NCCL_NVLS_ENABLE=0). nanochat/common.py applies it before an NCCL process group.
* `check_nccl_env` validates NCCL_* variables against the machine: the interfaces named by
  NCCL_SOCKET_IFNAME must exist in /sys/class/net (and carry jumbo frames between nodes), the HCAs
  named by NCCL_IB_HCA in /sys/class/infiniband (both halves of a DGX Spark's ConnectX-7 port for
  full bandwidth), and NCCL_NVLS_ENABLE != 0 is refused. A setting that cannot work raises
  ValueError naming the variable; one that only costs bandwidth is returned as a warning.
  nanochat/distributed.py's self-test (`python -m nanochat.platform --nccl`) runs both first;
  `sys_root` points the /sys lookups at another tree (the tests' fake machines).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, MutableMapping

JUMBO_MTU = 9000


def nccl_env_defaults(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Defaults this project relies on, set only where unset: NVLink multicast (NVLS) off.
    Returns the variables it set (e.g. ["NCCL_NVLS_ENABLE=0"])."""
    env = os.environ if env is None else env
    set_now = []
    if "NCCL_NVLS_ENABLE" not in env:
        env["NCCL_NVLS_ENABLE"] = "0"
        set_now.append("NCCL_NVLS_ENABLE=0")
    return set_now


def _split_list(value: str) -> tuple[str, list[str]]:
    """NCCL list syntax: optional leading '^' (exclude) or '=' (exact), comma-separated names."""
    mode = ""
    if value[:1] in ("^", "="):
        mode, value = value[0], value[1:]
    return mode, [v.strip() for v in value.split(",") if v.strip()]


def list_net_interfaces(sys_root: str | Path = "/") -> list[str]:
    path = Path(sys_root) / "sys" / "class" / "net"
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def list_ib_devices(sys_root: str | Path = "/") -> list[str]:
    path = Path(sys_root) / "sys" / "class" / "infiniband"
    return sorted(p.name for p in path.iterdir()) if path.is_dir() else []


def interface_mtu(name: str, sys_root: str | Path = "/") -> int | None:
    path = Path(sys_root) / "sys" / "class" / "net" / name / "mtu"
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _match(names: list[str], mode: str, available: list[str]) -> list[str]:
    if mode == "^":
        return [a for a in available if not any(a.startswith(n) for n in names)]
    if mode == "=":
        return [a for a in available if a in names]
    return [a for a in available if any(a.startswith(n) for n in names)]  # NCCL: prefix match


def check_nccl_env(env: Mapping[str, str] | None = None, *, sys_root: str | Path = "/",
                   multi_node: bool | None = None) -> list[str]:
    """Validate NCCL_* variables against this machine; returns warnings, raises ValueError for
    settings that are wrong (NVLS on, interface or HCA that does not exist)."""
    env = os.environ if env is None else env
    warnings: list[str] = []
    nvls = env.get("NCCL_NVLS_ENABLE")
    if nvls not in (None, "0"):
        raise ValueError(f"NCCL_NVLS_ENABLE={nvls}: NVLink multicast must stay off in this project; "
                         "unset it or set NCCL_NVLS_ENABLE=0")
    if multi_node is None:
        sizes = {}
        for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):   # torchrun sets both; int()'s message names neither
            raw = env.get(var, env.get("WORLD_SIZE", "1"))
            try:   # "0" passed an isdigit() check the message says it refuses; "²" passed it to int()'s error
                sizes[var] = int(raw)
            except ValueError:
                sizes[var] = 0
            if sizes[var] < 1:
                raise ValueError(f"{var}={raw}: accepted: an integer >= 1 (torchrun sets it; unset it without torchrun)")
        multi_node = sizes["WORLD_SIZE"] > sizes["LOCAL_WORLD_SIZE"]
    ifaces = list_net_interfaces(sys_root)
    if env.get("NCCL_SOCKET_IFNAME"):
        mode, names = _split_list(env["NCCL_SOCKET_IFNAME"])
        chosen = _match(names, mode, ifaces)
        if not chosen:
            raise ValueError(f"NCCL_SOCKET_IFNAME={env['NCCL_SOCKET_IFNAME']}: matches no interface on this "
                             f"machine; available: {', '.join(ifaces) or 'none'}")
        for name in chosen if mode != "^" else []:
            mtu = interface_mtu(name, sys_root)
            if multi_node and mtu is not None and mtu < JUMBO_MTU:
                warnings.append(f"{name}: MTU {mtu} < {JUMBO_MTU}; RoCE/TCP traffic between nodes uses smaller "
                                "frames (more packets per byte, lower bandwidth): set MTU 9000 on both ends")
    elif multi_node:
        warnings.append("NCCL_SOCKET_IFNAME unset on a multi-node run: NCCL may bootstrap over the wrong "
                        "interface (docker0, wlan); scripts/launch_multinode.sh sets it")
    hcas = list_ib_devices(sys_root)
    if env.get("NCCL_IB_HCA"):
        mode, names = _split_list(env["NCCL_IB_HCA"])
        bare = [n.split(":")[0] for n in names]
        if mode != "^" and not _match(bare, mode, hcas):
            raise ValueError(f"NCCL_IB_HCA={env['NCCL_IB_HCA']}: names no HCA on this machine; available: "
                             f"{', '.join(hcas) or 'none (/sys/class/infiniband is empty)'}")
        if multi_node and mode != "^" and len(_match(bare, mode, hcas)) == 1 and len(hcas) > 1:
            warnings.append(f"NCCL_IB_HCA={env['NCCL_IB_HCA']} selects one of {len(hcas)} HCAs ({', '.join(hcas)}); "
                            "a ConnectX-7 port on a DGX Spark appears as two halves: name both for full bandwidth")
    elif multi_node and hcas:
        warnings.append(f"NCCL_IB_HCA unset with HCAs {', '.join(hcas)}: name the RoCE HCAs explicitly "
                        "(both halves of the port on a DGX Spark)")
    if multi_node and env.get("NCCL_IB_DISABLE") == "1" and hcas:
        warnings.append("NCCL_IB_DISABLE=1 with RDMA HCAs present: NCCL falls back to TCP sockets (much slower)")
    if env.get("NCCL_P2P_DISABLE") == "1":
        warnings.append("NCCL_P2P_DISABLE=1: GPU peer-to-peer (NVLink/PCIe) is off; intra-node bandwidth drops")
    return warnings

