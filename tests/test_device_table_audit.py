"""Audit of nanochat/device_table.py: every entry's datasheet figures, and which table row the names
torch really reports pick (a wrong row prints a wrong MFU / bandwidth utilisation without a word).

Sources of the figures are in device_table.py's comments; the fixes checked here: a MIG slice of an
80 GB A100 took the 40 GB board's row by its profile's "40gb", the RTX 5090 D (capped tensor rates)
and its 24 GB "D v2" took the 5090's, and the Max-Q's peaks were scaled by a rounded figure. The 5090's
fp8 peak stays the datasheet's half rate (419): a measured plain fp8 GEMM stays under it.
"""

import types

import pytest

from nanochat import platform as P
from nanochat.device_table import (DEVICE_TABLE, SimpleProps, peak_flops, peaks,
                                   spec_from_props)

GB = 10**9


def spec(name, cc, sms, mem_gb):
    return spec_from_props(SimpleProps(name, cc[0], cc[1], sms, int(mem_gb * GB)))


# key: (cc, SMs, datasheet GB, GB/s, {precision: dense TFLOP/s, fp32 accumulate})
DATASHEET = {
    "gb10": ((12, 1), 48, 128, 273, {"bf16": 125.0, "fp8": 250.0, "nvfp4": 500.0, "fp32": 62.5}),
    "h100-sxm": ((9, 0), 132, 80, 3350, {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    "h100-pcie": ((9, 0), 114, 80, 2000, {"bf16": 756.0, "fp8": 1513.0, "fp32": 378.0}),
    "h100-nvl": ((9, 0), 132, 94, 3900, {"bf16": 835.0, "fp8": 1670.0, "fp32": 417.5}),
    "gh200": ((9, 0), 132, 96, 4000, {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    "gh200-hbm3e": ((9, 0), 132, 144, 4900, {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    "h200": ((9, 0), 132, 141, 4800, {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}),
    "h200-nvl": ((9, 0), 132, 141, 4800, {"bf16": 835.0, "fp8": 1670.0, "fp32": 417.5}),
    "b200": ((10, 0), 148, 180, 8000, {"bf16": 2250.0, "fp8": 4500.0, "nvfp4": 9000.0, "fp32": 1100.0}),
    "gb200": ((10, 0), 152, 186, 8000, {"bf16": 2500.0, "fp8": 5000.0, "nvfp4": 10000.0, "fp32": 1250.0}),
    "rtx-5090": ((12, 0), 170, 32, 1792, {"bf16": 209.5, "fp8": 419.0, "nvfp4": 1676.0, "fp32": 104.8}),
    "rtx-pro-6000": ((12, 0), 188, 96, 1792, {"bf16": 503.8, "fp8": 1007.6, "nvfp4": 2015.0, "fp32": 251.9}),
    "rtx-pro-6000-maxq": ((12, 0), 188, 96, 1792, {"bf16": 438.9, "fp8": 877.8, "nvfp4": 1755.5, "fp32": 219.4}),
    "a100": ((8, 0), 108, 80, 2039, {"bf16": 312.0, "fp32": 156.0}),
    "a100-40gb": ((8, 0), 108, 40, 1555, {"bf16": 312.0, "fp32": 156.0}),
    "a100-pcie": ((8, 0), 108, 80, 1935, {"bf16": 312.0, "fp32": 156.0}),
    "l40s": ((8, 9), 142, 48, 864, {"bf16": 362.1, "fp8": 733.0, "fp32": 183.0}),
    "rtx-4090": ((8, 9), 128, 24, 1008, {"bf16": 165.2, "fp8": 330.3, "fp32": 82.6}),
}


def test_every_entry_matches_its_datasheet():
    assert set(DEVICE_TABLE) == set(DATASHEET)
    for key, (cc, sms, mem, bw, tflops) in DATASHEET.items():
        e = DEVICE_TABLE[key]
        assert (e.cc, e.sms, e.memory_gb, e.bandwidth_gbs, e.peak_tflops) == (cc, sms, mem, bw, tflops), key


# names as torch.cuda.get_device_properties(i).name reports them
NAMES = [
    ("NVIDIA GB10", (12, 1), 48, 128, "gb10"),
    ("NVIDIA H100 80GB HBM3", (9, 0), 132, 85, "h100-sxm"),
    ("NVIDIA H100 PCIe", (9, 0), 114, 85, "h100-pcie"),
    ("NVIDIA H100 NVL", (9, 0), 132, 100, "h100-nvl"),
    ("NVIDIA GH200 480GB", (9, 0), 132, 102, "gh200"),
    ("NVIDIA GH200 144G HBM3e", (9, 0), 132, 154, "gh200-hbm3e"),
    ("NVIDIA H200", (9, 0), 132, 150, "h200"),
    ("NVIDIA H200 NVL", (9, 0), 132, 150, "h200-nvl"),
    ("NVIDIA B200", (10, 0), 148, 192, "b200"),
    ("NVIDIA GB200", (10, 0), 152, 199, "gb200"),
    ("NVIDIA GeForce RTX 5090", (12, 0), 170, 34, "rtx-5090"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", (12, 0), 188, 102, "rtx-pro-6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", (12, 0), 188, 102, "rtx-pro-6000"),
    ("NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", (12, 0), 188, 102, "rtx-pro-6000-maxq"),
    ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85, "a100"),
    ("NVIDIA A100-SXM4-40GB", (8, 0), 108, 42, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", (8, 0), 108, 42, "a100-40gb"),
    ("NVIDIA A100 80GB PCIe", (8, 0), 108, 85, "a100-pcie"),
    ("NVIDIA L40S", (8, 9), 142, 48, "l40s"),
    ("NVIDIA GeForce RTX 4090", (8, 9), 128, 25, "rtx-4090"),
    # not in the table: MFU n/a and a warning asking for --peak-flops, never another GPU's row
    ("NVIDIA H800", (9, 0), 132, 85, "unknown"),
    ("NVIDIA H20", (9, 0), 78, 102, "unknown"),
    ("NVIDIA L4", (8, 9), 58, 24, "unknown"),
    ("NVIDIA L40", (8, 9), 142, 48, "unknown"),
    ("NVIDIA A10", (8, 6), 72, 24, "unknown"),
    ("NVIDIA RTX 6000 Ada Generation", (8, 9), 142, 51, "unknown"),
    ("NVIDIA B300 SXM6 AC", (10, 3), 148, 288, "unknown"),
    ("NVIDIA GB300", (10, 3), 152, 288, "unknown"),
    ("NVIDIA GeForce RTX 5090 D", (12, 0), 170, 34, "unknown"),
    ("NVIDIA GeForce RTX 5090 D v2", (12, 0), 170, 25, "unknown"),
]


@pytest.mark.parametrize("name,cc,sms,mem,key", NAMES)
def test_torch_device_names_pick_their_own_row(name, cc, sms, mem, key):
    s = spec(name, cc, sms, mem)
    assert s.key == key
    if key == "unknown":
        assert s.peak_tflops == {} and s.bandwidth_gbs is None and peak_flops(s, "bf16") is None
    else:   # the datasheet's own SM count: no scaling
        assert s.peak_tflops == DEVICE_TABLE[key].peak_tflops
        assert s.bandwidth_gbs == DEVICE_TABLE[key].bandwidth_gbs


@pytest.mark.parametrize("name,mem,key,bandwidth", [
    ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40, "a100", 2039 * 40 / 80),
    ("NVIDIA A100-SXM4-80GB MIG 4g.40gb", 40, "a100", 2039 * 40 / 80),
    ("NVIDIA A100 80GB PCIe MIG 3g.40gb", 40, "a100-pcie", 1935 * 40 / 80),
    ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 20, "a100-40gb", 1555 * 20 / 40),
    ("NVIDIA A100-SXM4-80GB MIG 7g.80gb", 80, "a100", 2039),
])
def test_mig_slice_is_matched_by_its_board_not_its_profile(name, mem, key, bandwidth):
    """The 3g.40gb slice of an 80 GB A100 matched "A100.*40GB" by the profile's "40gb": the 40 GB
    board's 1555 GB/s as the slice's whole bandwidth (half the board's 2039 is 1019.5): decode and
    roofline bandwidth utilisation 34% low."""
    s = spec(name, (8, 0), 42 if mem == 40 else (28 if mem == 20 else 98), mem)
    assert s.key == key and s.bandwidth_gbs == pytest.approx(bandwidth, abs=0.1)


def test_rtx_5090_d_warns_and_asks_for_peak_flops_instead_of_the_5090s_mfu(monkeypatch):
    """The 5090 D (2375 AI TOPS, not 3352) got the 5090's peaks: MFU / util printed against rates it
    does not have. It is now a GPU the table lacks: n/a and a warning naming --peak-flops, never 0%."""
    from nanochat.step_meter import resolve_peak_flops

    d = spec("NVIDIA GeForce RTX 5090 D", (12, 0), 170, 34)
    monkeypatch.setattr(P, "detect_device", lambda *a, **k: d)
    rt = types.SimpleNamespace(device="cuda:0", device_type="cuda", world_size=1)
    warned = []
    assert resolve_peak_flops(rt, "bf16", warn=warned.append) == (None, None, d.name)
    assert len(warned) == 1 and "RTX 5090 D" in warned[0] and "--peak-flops" in warned[0]
    bf16, act, _ = resolve_peak_flops(rt, "fp8", 300e12, warn=pytest.fail)
    assert (bf16, act) == (300e12, 600e12)


def test_rtx_5090_peaks_are_the_datasheet_rates():
    """GeForce Blackwell: bf16 and fp8 with fp32 accumulate at half rate (170 SMs x 512 / 1024 per clock
    x 2.407 GHz = 209.5 / 419; a measured plain fp8 -> fp32 GEMM on a 5090 reached ~370, under 419),
    fp4 at the full rate (1676). The RTX 4090 keeps its whitepaper's half-rate fp8 330.3."""
    rtx = DEVICE_TABLE["rtx-5090"].peak_tflops
    assert rtx["fp8"] == pytest.approx(170 * 1024 * 2.407e9 / 1e12, rel=1e-3)
    assert rtx["bf16"] == pytest.approx(170 * 512 * 2.407e9 / 1e12, rel=1e-3)
    assert rtx["nvfp4"] == 4 * rtx["fp8"] == 8 * rtx["bf16"]
    s = spec("NVIDIA GeForce RTX 5090", (12, 0), 170, 34)
    assert peaks(s, "fp8") == (209.5e12, 419e12)
    assert peaks(s, "fp8", override=200e12) == (200e12, pytest.approx(400e12))   # this GPU's own ratio
    ada = DEVICE_TABLE["rtx-4090"].peak_tflops
    assert ada["fp8"] == 330.3 and ada["fp8"] == pytest.approx(2 * ada["bf16"], abs=0.2)


def test_max_q_peaks_come_from_its_own_ai_tops():
    """3511 AI TOPS (fp4, sparse) -> 1755.5 dense; scaling the Workstation card's 2015 by 3511/4000
    used its rounded 4000 (2 x 2015 = 4030): 1768.8, every Max-Q peak 0.8% high."""
    maxq, ws = DEVICE_TABLE["rtx-pro-6000-maxq"].peak_tflops, DEVICE_TABLE["rtx-pro-6000"].peak_tflops
    assert maxq["nvfp4"] == 3511 / 2
    assert maxq["nvfp4"] == pytest.approx(188 * 4096 * 2.28e9 / 1e12, rel=1e-3)
    for key in ("bf16", "fp8", "fp32"):
        assert maxq[key] / maxq["nvfp4"] == pytest.approx(ws[key] / ws["nvfp4"], rel=1e-3), key


def test_rtx_4090_d_is_the_4090_scaled_to_its_114_sms():
    """Same clocks as the 4090 with 114 of its 128 SMs: the 4090's row, its peaks scaled by SM count."""
    d = spec("NVIDIA GeForce RTX 4090 D", (8, 9), 114, 25)
    assert d.key == "rtx-4090" and d.bandwidth_gbs == 1008
    assert d.peak_tflops["bf16"] == pytest.approx(165.2 * 114 / 128, abs=0.1)
