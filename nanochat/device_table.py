"""The device table: what each accelerator this project targets can do, and the MFU peak lookup.

Owns:
- `DeviceSpec` + `DEVICE_TABLE`: peak dense TFLOP/s per precision, memory bandwidth, unified
  memory, SMs and compute capability for the GPUs this project targets (GB10 first), and
  `CPU_SPEC` / `MPS_SPEC` for the rest.
- `spec_from_props()`: CUDA device properties (real, simulated with `SimpleProps`, or parsed
  from nvidia-smi) -> the matching table entry, with the device's own SM count and memory.
- `peak_flops()`: the FLOP/s an MFU figure divides by (None = unknown, never 0; `--peak-flops`
  overrides it).

Split out of nanochat/platform.py, which re-exports every name here (callers import them from
`nanochat.platform`) and keeps the probing (`detect_device`) and the workarounds. Pure data and
arithmetic: no torch import, no CUDA call.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
from dataclasses import dataclass, field
from typing import Any, MutableMapping

from nanochat.errors import RequestError

PRECISIONS = ("bf16", "fp8", "nvfp4", "fp32")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator. `peak_tflops` holds dense (non-sparse) tensor-core peaks in TFLOP/s with
    fp32 accumulation, keys "bf16", "fp8", "nvfp4", "fp32" ("fp32" = the TF32 tensor-core rate,
    which is what fp32 matmuls run at with TF32 on). A missing key = the device has no such
    path (fp8 before Ada, nvfp4 before Blackwell)."""

    name: str
    cc: tuple[int, int] | None
    sms: int | None
    memory_gb: float | None
    bandwidth_gbs: float | None
    unified_memory: bool = False
    peak_tflops: dict[str, float] = field(default_factory=dict)
    key: str = "unknown"          # table key ("gb10", "h100-sxm", ...), "cpu", "mps" or "unknown"
    source: str = ""              # where the peak numbers come from

    @property
    def is_cuda(self) -> bool:
        return self.cc is not None

    @property
    def known(self) -> bool:
        return self.key not in ("unknown", "cpu", "mps")


def _spec(key, name, cc, sms, mem, bw, peaks, unified=False, source="vendor datasheet"):
    return DeviceSpec(name=name, cc=cc, sms=sms, memory_gb=mem, bandwidth_gbs=bw,
                      unified_memory=unified, peak_tflops=peaks, key=key, source=source)


# Dense peaks, fp32 accumulate. GB10 and RTX 5090 are spec-derived (sparse/2; GeForce-class
# half-rate fp32 accumulate for bf16 and fp8 on the 5090) and labelled as such; measured GEMM rates are lower
# (DESIGN.md s3). Memory is the datasheet's GB (the MIG profiles' unit), not the bytes CUDA reports.
# Bandwidth (GB/s, the decode and roofline figures), each from NVIDIA's own pages: GB10 273 (DGX Spark
# datasheet: 128 GB LPDDR5x, 256-bit at 8533 MT/s); H100 SXM 3350 / PCIe 2000 / NVL 3900 (H100
# datasheet); GH200 4000 (96 GB HBM3) / 4900 (144 GB HBM3e) (GH200 datasheet); H200 and H200 NVL 4800
# (H200 datasheet); B200 8000 (DGX B200: 64 TB/s for 8); GB200 8000 (GB200 NVL72: 576 TB/s for 72);
# RTX 5090 1792 (RTX Blackwell whitepaper: 28 Gbps x 512-bit); RTX PRO 6000 1792 (its datasheet);
# A100 80GB SXM 2039 / 40GB 1555 / 80GB PCIe 1935 (A100 datasheet); L40S 864 (L40S datasheet);
# RTX 4090 1008 (Ada whitepaper: 21 Gbps x 384-bit). Peak figures when spec-derived say so in `source`.
# GB10's peaks are NVIDIA's 1 PFLOP FP4 (sparse) halved and scaled by precision; the GEMM rates below
# them are others' (NVIDIA forum, community CUTLASS runs; DESIGN.md s3): no GB10 has run this code.
# This text is printed beside GB10 figures (base_train's banner, bench_gemm's header, analyze_bandwidth's
# --predict label); it said "measured ~82 bf16 / ~180 fp8 / ~356 nvfp4", read as this project's measurements
GB10_SOURCE = ("spec-derived (1 PFLOP FP4 sparse / 2, per precision), not measured here; community GEMM "
               "benchmarks (not this project's) reach ~82 bf16 / ~170-188 fp8 / ~356 nvfp4 TFLOP/s")
DEVICE_TABLE: dict[str, DeviceSpec] = {s.key: s for s in [
    _spec("gb10", "NVIDIA GB10 (DGX Spark)", (12, 1), 48, 128, 273,
          {"bf16": 125.0, "fp8": 250.0, "nvfp4": 500.0, "fp32": 62.5}, unified=True,
          source=GB10_SOURCE),
    _spec("h100-sxm", "NVIDIA H100 SXM", (9, 0), 132, 80, 3350,
          {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    _spec("h100-pcie", "NVIDIA H100 PCIe", (9, 0), 114, 80, 2000,
          {"bf16": 756.0, "fp8": 1513.0, "fp32": 378.0}),
    _spec("h100-nvl", "NVIDIA H100 NVL", (9, 0), 132, 94, 3900,
          {"bf16": 835.0, "fp8": 1670.0, "fp32": 417.5}),
    _spec("gh200", "NVIDIA GH200", (9, 0), 132, 96, 4000,
          {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    # the HBM3e part ("NVIDIA GH200 144G HBM3e"): same H100 die and peaks, 144 GB at 4.9 TB/s; it
    # matched the 96 GB HBM3 entry and its decode/roofline bandwidth was 4.0 TB/s (utilisation 22% high)
    _spec("gh200-hbm3e", "NVIDIA GH200 144G HBM3e", (9, 0), 132, 144, 4900,
          {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    _spec("h200", "NVIDIA H200", (9, 0), 132, 141, 4800,
          {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    # the NVL (PCIe, 600 W) part: same die and 4.8 TB/s, the H100 NVL's lower clocks and peaks
    _spec("h200-nvl", "NVIDIA H200 NVL", (9, 0), 132, 141, 4800,
          {"bf16": 835.0, "fp8": 1670.0, "fp32": 417.5}),
    # 180 GB, not the 192 of the GTC 2024 announcement: the HGX/DGX B200 datasheets give 1,440 GB for 8
    # GPUs ("180GB HBM3E" per GPU); peaks = their 4.5 / 9 / 18 PFLOPS (sparse) halved
    _spec("b200", "NVIDIA B200", (10, 0), 148, 180, 8000,
          {"bf16": 2250.0, "fp8": 4500.0, "nvfp4": 9000.0, "fp32": 1100.0}),
    _spec("gb200", "NVIDIA GB200", (10, 0), 152, 186, 8000,
          {"bf16": 2500.0, "fp8": 5000.0, "nvfp4": 10000.0, "fp32": 1250.0}),
    # GeForce halves bf16 and fp8 with fp32 accumulate (NVIDIA's RTX Blackwell whitepaper: 209.5 /
    # 419 dense), not fp4 (block-scaled, always fp32 accumulate): NVIDIA's 3352 "AI TOPS" are fp4 with
    # sparsity, 1676 dense = 170 SMs x 4096 fp4 ops per clock at 2.41 GHz, the per-SM rate of the RTX
    # PRO 6000's 2015 and GB10's 500 (DESIGN.md's 838 halves it twice). fp8 stays the datasheet's 419
    # (measured plain fp8 -> fp32 GEMMs on a 5090: ~370, main-horse.github.io/posts/5090-mm-perf); only
    # the block-scaled MXFP8 MMA runs at twice that (~737 there; triton-lang/triton#11320), and
    # torch._scaled_mm's tensor-wise fp8 is not block-scaled. A community CUDA 13 cuBLASLt run on an
    # RTX 5060 Ti reported 3.9x its bf16 (github QuantumDrizzy/BLACKWALL): unconfirmed here; if a 5090
    # shows fp8 util above 100%, that is why
    _spec("rtx-5090", "NVIDIA GeForce RTX 5090", (12, 0), 170, 32, 1792,
          {"bf16": 209.5, "fp8": 419.0, "nvfp4": 1676.0, "fp32": 104.8},
          source="spec-derived (GeForce half-rate fp32 accumulate for bf16/fp8; fp4 = 3352 AI TOPS sparse / 2)"),
    _spec("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell", (12, 0), 188, 96, 1792,
          {"bf16": 503.8, "fp8": 1007.6, "nvfp4": 2015.0, "fp32": 251.9}),
    # the 300 W Max-Q: the same 188 SMs at lower clocks. NVIDIA's datasheet: 3511 AI TOPS (fp4, sparse)
    # -> 1755.5 dense = 188 x 4096 x 2.28 GHz, and bf16 / fp8 / tf32 at 1/4, 1/2, 1/8 of it as on the
    # Workstation Edition. The old 2015 x 3511/4000 scaled by the Workstation card's rounded 4000 (it is
    # 4031 = 2 x 2015): every peak 0.8% high
    _spec("rtx-pro-6000-maxq", "NVIDIA RTX PRO 6000 Blackwell Max-Q", (12, 0), 188, 96, 1792,
          {"bf16": 438.9, "fp8": 877.8, "nvfp4": 1755.5, "fp32": 219.4},
          source="spec-derived (3511 AI TOPS fp4 sparse / 2; bf16 = fp4 / 4)"),
    _spec("a100", "NVIDIA A100", (8, 0), 108, 80, 2039,
          {"bf16": 312.0, "fp32": 156.0}),
    # same peaks, slower memory: the 40 GB parts (HBM2, SXM4 and PCIe) and the 80 GB PCIe card
    _spec("a100-40gb", "NVIDIA A100 40GB", (8, 0), 108, 40, 1555,
          {"bf16": 312.0, "fp32": 156.0}),
    _spec("a100-pcie", "NVIDIA A100 80GB PCIe", (8, 0), 108, 80, 1935,
          {"bf16": 312.0, "fp32": 156.0}),
    _spec("l40s", "NVIDIA L40S", (8, 9), 142, 48, 864,
          {"bf16": 362.1, "fp8": 733.0, "fp32": 183.0}),
    _spec("rtx-4090", "NVIDIA GeForce RTX 4090", (8, 9), 128, 24, 1008,
          {"bf16": 165.2, "fp8": 330.3, "fp32": 82.6}),
]}

# (cc major, name regex) -> table key; first match wins, so specific names come first.
# In a VM with an NVIDIA AI Enterprise vGPU, torch reports the vGPU type ("NVIDIA H100L-94C"), whose
# prefix names the board (NVIDIA's vGPU user guide, boards x types): H100XM/XL/XS = SXM5, H100 = PCIe
# 80GB, H100L = NVL, H200X = SXM5, H200 = NVL, A100DX = HGX 80GB, A100D = PCIe 80GB, A100 / A100X =
# PCIe / HGX 40GB; "-<mem>C" is time-sliced, "-<slices>-<mem>C" MIG-backed. The plain "H100" / "H200"
# / "A100" rules gave the PCIe and NVL boards the SXM rows: a PCIe H100 (114 SMs) 854 TFLOP/s
# (989 scaled by SMs, not its 756) and 3350 GB/s (not 2000), an H100 / H200 NVL 989 (not 835).
_NAME_RULES: list[tuple[int | None, str, str]] = [
    (12, r"\bGB10\b", "gb10"),
    (9, r"H100.*NVL|H100L-\d", "h100-nvl"),
    (9, r"H100.*PCIe|H100-\d", "h100-pcie"),
    (9, r"GH200.*HBM3e", "gh200-hbm3e"),
    (9, r"GH200", "gh200"),
    (9, r"H100", "h100-sxm"),
    (9, r"H200.*NVL|H200-\d", "h200-nvl"),
    (9, r"H200", "h200"),
    (10, r"GB200", "gb200"),
    (10, r"\bB200\b", "b200"),
    # a laptop GPU of the same name is another, smaller chip at laptop clocks and bandwidth: not
    # in the table (MFU n/a + --peak-flops), rather than the desktop card's numbers scaled by SMs
    # nor the China-market RTX 5090 D (2375 AI TOPS against 3352: capped tensor rates) or its 24 GB
    # "D v2" (384-bit, 1344 GB/s): the 5090's peaks and bandwidth were printed for them. The RTX 4090 D
    # stays: the 4090's clocks with 114 SMs, which _scaled_to_sms accounts for
    (12, r"RTX 5090\b(?!\s*D\b)(?!.*Laptop)", "rtx-5090"),
    (12, r"RTX PRO 6000.*Max-Q", "rtx-pro-6000-maxq"),
    (12, r"RTX PRO 6000(?!.*Laptop)", "rtx-pro-6000"),
    (8, r"A100.*40GB|A100X?-\d", "a100-40gb"),
    (8, r"A100.*PCIe|A100D-\d", "a100-pcie"),
    (8, r"A100", "a100"),
    (8, r"L40S", "l40s"),
    (8, r"RTX 4090(?!.*Laptop)", "rtx-4090"),
]

CPU_SPEC = DeviceSpec(name="CPU", cc=None, sms=None, memory_gb=None, bandwidth_gbs=None, key="cpu")
MPS_SPEC = DeviceSpec(name="Apple MPS", cc=None, sms=None, memory_gb=None, bandwidth_gbs=None,
                      unified_memory=True, key="mps")


@dataclass
class SimpleProps:
    """Stand-in for torch.cuda device properties (tests and nvidia-smi parsing)."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int
    is_integrated: bool = False


def _scaled_to_sms(entry: DeviceSpec, sms: int) -> tuple[dict[str, float], str]:
    """The entry's peaks for a device that has only `sms` of its SMs: a MIG slice (the device
    properties then report the slice's SMs, e.g. 16 of an H100's 132) or a cut-down part. Peak
    FLOP/s is SMs x per-SM rate x clock, so it scales with the SM count; left unscaled, a MIG slice
    would report a fraction of its real MFU. Counts of 0 (nvidia-smi parsing) or at/above the
    table's leave the entry as it is."""
    if not sms or not entry.sms or sms >= entry.sms:
        return entry.peak_tflops, entry.source
    f = sms / entry.sms
    peaks = {k: round(v * f, 1) for k, v in entry.peak_tflops.items()}
    return peaks, f"{entry.source}; scaled to this device's {sms} of {entry.sms} SMs (MIG slice or cut-down part)"


# "... MIG 2g.20gb", or a compute instance smaller than its GPU instance: "... MIG 1c.3g.40gb" (the
# GPU instance's memory, so its bandwidth, is the share; that name kept the whole board's)
_MIG_PROFILE = re.compile(r"\bMIG (?:\d+c\.)?\d+g\.(\d+)gb\b", flags=re.IGNORECASE)
_MIG_VGPU = re.compile(r"\b[A-Z]+\d+[A-Z]*-\d+-(\d+)C\b")   # a MIG-backed vGPU type: "NVIDIA H100XM-2-20C"


def _mig_bandwidth(entry: DeviceSpec, name: str) -> tuple[float | None, str]:
    """(bandwidth GB/s, note) of a MIG slice, whose name ends in its profile ("... MIG 2g.20gb"): a
    GPU instance owns a share of the memory controllers, so its bandwidth is the board's times its
    memory share (1g.10gb of an 80 GB H100: 1/8, ~419 GB/s). The board's full 3350 GB/s made decode
    and roofline bandwidth utilisation up to 8x too low there. A MIG-backed vGPU's type names its
    slice's memory too ("H100XM-2-20C": 20 GB); a time-sliced one ("H100XM-40C") shares the whole
    board's bandwidth in turns. A name with no profile: as is."""
    m = _MIG_PROFILE.search(name) or _MIG_VGPU.search(name)
    if m is None or not entry.bandwidth_gbs or not entry.memory_gb:
        return entry.bandwidth_gbs, ""
    share = min(1.0, int(m.group(1)) / entry.memory_gb)
    if share >= 1.0:
        return entry.bandwidth_gbs, ""
    return (round(entry.bandwidth_gbs * share, 1),
            f"; bandwidth scaled to the MIG profile's {m.group(1)} of {entry.memory_gb:g} GB")


def spec_from_props(props: Any) -> DeviceSpec:
    """Match CUDA device properties (real or simulated) against the table."""
    name = str(props.name)
    cc = (int(props.major), int(props.minor))
    sms = int(props.multi_processor_count)
    mem_gb = round(int(props.total_memory) / 1e9, 1)
    # The board's name without a MIG slice's profile: "NVIDIA A100-SXM4-80GB MIG 3g.40gb" matched the
    # "A100.*40GB" rule (the 40 GB board: 1555 GB/s, not 2039 x 40/80 = 1019.5) by its profile's "40gb"
    board = re.split(r"\s+MIG\b", name, maxsplit=1, flags=re.IGNORECASE)[0]
    for major, pattern, key in _NAME_RULES:
        if (major is None or major == cc[0]) and re.search(pattern, board, flags=re.IGNORECASE):
            # The real SM count and memory win over the table (cut-down SKUs, MIG slices).
            entry = DEVICE_TABLE[key]
            peaks, source = _scaled_to_sms(entry, sms)
            bandwidth, note = _mig_bandwidth(entry, name)
            return dataclasses.replace(entry, name=name, cc=cc, sms=sms, memory_gb=mem_gb, bandwidth_gbs=bandwidth,
                                       peak_tflops=peaks, source=source + note)
    unified = bool(getattr(props, "is_integrated", False))
    return DeviceSpec(name=name, cc=cc, sms=sms, memory_gb=mem_gb, bandwidth_gbs=None,
                      unified_memory=unified, peak_tflops={}, key="unknown", source="not in table")


def peak_flops(spec: DeviceSpec, precision: str = "bf16", override: float | None = None) -> float | None:
    """Peak dense FLOP/s (not TFLOP/s) for `precision` on `spec`; `override` (FLOP/s, from
    --peak-flops) wins. None for CPU/MPS/unknown GPUs and for precisions the device lacks:
    the caller warns and asks for --peak-flops instead of printing 0% MFU."""
    if override is not None:
        # nan passes a plain `<= 0` test and inf divides every figure to 0%: both refused here; so
        # are non-numbers (math.isfinite's TypeError) and figures below 1e9, surely TFLOP/s (989
        # taken as FLOP/s printed MFU ~1e13 %), as the scripts' own --peak-flops checks refuse them
        if (isinstance(override, bool) or not isinstance(override, numbers.Real)
                or not math.isfinite(override) or override < 1e9):
            raise RequestError(f"--peak-flops: got {override!r}; accepted: a finite number > 0 of FLOP/s "
                               "per device, >= 1e9 (e.g. 989e12; 989 would be TFLOP/s)")
        return float(override)
    tflops = spec.peak_tflops.get(peak_key(precision))
    return None if tflops is None else tflops * 1e12


def peak_key(precision: str) -> str:
    """The table key whose peak a precision runs at (emulated nvfp4 computes in bf16, tf32 is the
    fp32 row)."""
    key = {"tf32": "fp32", "nvfp4-emulated": "bf16", "auto": "bf16"}.get(precision, precision)
    if key not in PRECISIONS:
        raise RequestError(f"--precision: got {precision!r}; accepted: {'|'.join(PRECISIONS)}")
    return key


# Dense tensor-core rate of a precision relative to bf16, as on the GPUs in the table that have it
# (Hopper, Blackwell, GB10; GeForce cards, with their half-rate bf16/fp8 fp32 accumulate, have an
# fp4 ratio of 8): how --peak-flops, a bf16 peak, carries over to a GPU the table lacks.
DENSE_RATIO = {"bf16": 1.0, "fp8": 2.0, "nvfp4": 4.0, "fp32": 0.5}


def peaks(spec: DeviceSpec, precision: str, override: float | None = None) -> tuple[float | None, float | None]:
    """(bf16 peak, `precision`'s peak) in FLOP/s. --peak-flops (`override`) is the bf16 dense peak,
    and the active precision's peak follows it: by this GPU's own ratio in the table (a measured
    bf16 figure moves the fp8 one alike; fp8 util against the datasheet while MFU is against a
    measured bf16 peak mixed two bases), or by DENSE_RATIO for a GPU the table lacks."""
    key = peak_key(precision)
    bf16 = peak_flops(spec, "bf16", override)
    if override is None:
        return bf16, peak_flops(spec, key)
    table_bf16, table_act = peak_flops(spec, "bf16"), peak_flops(spec, key)
    if table_bf16 and table_act:
        return bf16, bf16 * table_act / table_bf16
    return bf16, bf16 * DENSE_RATIO[key]


def usable_sms(sm_count: int, env: MutableMapping[str, str] | None = None) -> int:
    """SMs this process can hold at once: all of them, or under CUDA MPS with
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE that share, rounded down to whole TPCs (pairs of SMs).
    A grid whose programs wait for each other (the persistent decode kernel's grid barrier) must
    not be larger, or it waits forever; device properties still report every SM under MPS."""
    value = (os.environ if env is None else env).get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
    if value is None or not value.strip():
        return sm_count
    try:
        pct = float(value)
    except ValueError:
        pct = -1.0
    if not 0 < pct <= 100:
        raise ValueError(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: got {value!r}; accepted: a number in (0, 100]")
    return min(sm_count, max(1, int(sm_count * pct / 100) // 2 * 2))
