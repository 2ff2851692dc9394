"""Which flex_attention kernel options are accepted (scripts/bench_attention.py's sweeps,
attention.set_flex_kernel_options): the keys torch reads, their value checks and the tile
constraints, in validate_flex_kernel_options. nanochat/attention.py keeps the options in force
(set_flex_kernel_options, flex_options_for) and re-exports these names. Torch-free.
"""

from __future__ import annotations

# Keys as torch reads them (FlexKernelOptions in torch/nn/attention/flex_attention.py; the
# lowering in torch/_inductor/kernel/flex/flex_attention.py; read in torch 2.15 and in an older
# pytorch/pytorch main, commit 008d483, with the same key handling): a "fwd_"/"bwd_" prefix limits
# a key to that pass (and wins over the plain key there); plain num_warps/num_stages reach both
# passes; backward tiles are bwd_BLOCK_{M1,N1,M2,N2} (FlexKernelOptions: "Use as 'bwd_BLOCK_M1'").
# Constraints, checked here (torch 2.15 checks them too; the older lowering checks only the
# forward tiles): the block mask's BLOCK_SIZE (Q and KV) must be a multiple of every BLOCK_M/N/
# M1/N1/M2/N2; BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 == 0 (kernel static asserts). Shared memory
# (~(BLOCK_M + 2 * num_stages * BLOCK_N) * head_dim * 2 bytes forward; 227 KiB per block on
# H100) is only known at Triton compile time: a config that does not fit fails at first launch
# ("out of resource: shared memory"). Torch's H100 bf16 head-dim-128 defaults (inductor
# template heuristics): forward BLOCK_M=128 BLOCK_N=64 num_stages=3 num_warps=8; backward
# BLOCK_M1=64 BLOCK_N1=128 BLOCK_M2=128 BLOCK_N2=64 num_stages=3 num_warps=8. Left out on
# purpose: ROWS_GUARANTEED_SAFE and BLOCKS_ARE_CONTIGUOUS (wrong for sliding windows: a window
# row's first scheduled block can be empty, and the partial blocks of a query block are the
# window edge and the diagonal, not contiguous), BACKEND, ROCm-only keys.
# "BLOCK_SIZE" is ours: the block mask's block size (create_block_mask), never passed to flex.
# Below 128 it can fail to compile whatever the tiles: some torch versions filter the default
# backward config (H100: BLOCK_N1=128) against the mask before applying user tiles.

_FLEX_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "fwd_BLOCK_M", "fwd_BLOCK_N", "bwd_BLOCK_M1",
                   "bwd_BLOCK_N1", "bwd_BLOCK_M2", "bwd_BLOCK_N2", "BLOCK_SIZE")
_FLEX_LAUNCH_KEYS = ("num_warps", "num_stages", "fwd_num_warps", "fwd_num_stages",
                     "bwd_num_warps", "bwd_num_stages")
_FLEX_BOOL_KEYS = ("USE_TMA", "PRESCALE_QK")
FLEX_OPTION_KEYS = _FLEX_TILE_KEYS + _FLEX_LAUNCH_KEYS + _FLEX_BOOL_KEYS
DEFAULT_FLEX_BLOCK_SIZE = 128  # create_block_mask's default


def validate_flex_kernel_options(opts) -> dict:
    """Check a flex options dict (keys, value types, tile divisibility); return a copy."""
    if not isinstance(opts, dict):
        raise ValueError(f"flex kernel options: got {type(opts).__name__}; accepted: a dict or None")
    out = dict(opts)
    for key, value in out.items():
        if key not in FLEX_OPTION_KEYS:
            raise ValueError(f"flex kernel options: unknown key {key!r}; accepted keys: "
                             f"{', '.join(FLEX_OPTION_KEYS)}")
        if key in _FLEX_BOOL_KEYS:
            if not isinstance(value, bool):
                raise ValueError(f"flex kernel options: {key} must be True or False, got {value!r}")
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"flex kernel options: {key} must be a positive int, got {value!r}")
        if key in _FLEX_TILE_KEYS and (value < 16 or value & (value - 1)):
            raise ValueError(f"flex kernel options: {key} must be a power of two >= 16, got {value}")
        if key.endswith("num_warps") and value not in (1, 2, 4, 8, 16):
            raise ValueError(f"flex kernel options: {key} must be 1, 2, 4, 8 or 16, got {value}")
    block = out.get("BLOCK_SIZE", DEFAULT_FLEX_BLOCK_SIZE)
    fwd = {t: out.get(f"fwd_{t}", out.get(t)) for t in ("BLOCK_M", "BLOCK_N")}
    bwd = {t: out.get(f"bwd_{t}") for t in ("BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")}
    for tile, value in {**fwd, **bwd}.items():
        if value is not None and block % value:
            raise ValueError(f"flex kernel options: {tile}={value} does not divide the block "
                             f"mask's BLOCK_SIZE={block}")
    for big, small in (("BLOCK_N1", "BLOCK_M1"), ("BLOCK_M2", "BLOCK_N2")):
        if bwd[big] is not None and bwd[small] is not None and bwd[big] % bwd[small]:
            raise ValueError(f"flex kernel options: bwd_{big}={bwd[big]} must be a multiple of "
                             f"bwd_{small}={bwd[small]} (flex backward kernel constraint)")
    return out
