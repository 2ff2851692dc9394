"""Review 74 of the precision / platform / MFU layer, on simulated device properties (no GPU).

Fixed here (each test failed before its fix):
- In a VM with an NVIDIA AI Enterprise vGPU, torch names the device by its vGPU type, whose prefix
  names the board: "NVIDIA H100-80C" is a PCIe H100, "NVIDIA H100L-94C" an H100 NVL, "NVIDIA
  H200-141C" an H200 NVL, "NVIDIA A100-40C" / "A100D-80C" the 40 GB / 80 GB PCIe A100s. They took the
  SXM rows by their plain "H100" / "H200" / "A100": the PCIe H100 854 TFLOP/s bf16 (the SXM's 989
  scaled to 114 SMs; its datasheet says 756) and 3350 GB/s (2000), the NVL parts 989 (835); and a
  MIG-backed vGPU ("H100XM-1-10C") kept the whole board's bandwidth.
Guards for what this review checked and found right: gpt.py's FLOPs per token against
torch.utils.flop_counter on a tiny model, and the import-time rule (no CUDA call, no heavy import).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanochat.device_table import DEVICE_TABLE, SimpleProps, spec_from_props

GB = 10**9
REPO = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ vGPU types name their board

# (torch's name, cc, SMs, GB reported, the row of the board it runs on): the boards x types table of
# NVIDIA's vGPU user guide; time-sliced types report the board's SMs and their share of its memory
VGPUS = [
    ("NVIDIA H100-80C", (9, 0), 114, 85, "h100-pcie"),
    ("NVIDIA H100-40C", (9, 0), 114, 42, "h100-pcie"),
    ("NVIDIA H100L-94C", (9, 0), 132, 100, "h100-nvl"),
    ("NVIDIA H200-141C", (9, 0), 132, 150, "h200-nvl"),
    ("NVIDIA A100-40C", (8, 0), 108, 42, "a100-40gb"),
    ("NVIDIA A100X-40C", (8, 0), 108, 42, "a100-40gb"),
    ("NVIDIA A100D-80C", (8, 0), 108, 85, "a100-pcie"),
    # these matched their rows before too: SXM / HGX boards, the plain names' rows
    ("NVIDIA H100XM-80C", (9, 0), 132, 85, "h100-sxm"),
    ("NVIDIA H200X-141C", (9, 0), 132, 150, "h200"),
    ("NVIDIA A100DX-80C", (8, 0), 108, 85, "a100"),
]


@pytest.mark.parametrize("name,cc,sms,mem,key", VGPUS)
def test_a_vgpu_type_takes_its_boards_row(name, cc, sms, mem, key):
    spec = spec_from_props(SimpleProps(name, cc[0], cc[1], sms, mem * GB))
    row = DEVICE_TABLE[key]
    assert (spec.key, spec.peak_tflops, spec.bandwidth_gbs) == (key, row.peak_tflops, row.bandwidth_gbs)


def test_pcie_h100_vgpu_mfu_peak_is_its_datasheets_not_the_sxm_scaled():
    spec = spec_from_props(SimpleProps("NVIDIA H100-80C", 9, 0, 114, 85 * GB))
    assert spec.peak_tflops["bf16"] == 756.0 and spec.peak_tflops["fp8"] == 1513.0   # was 854.5 / 1709.1
    assert "scaled" not in spec.source


@pytest.mark.parametrize("name,cc,sms,key,bandwidth", [
    ("NVIDIA H100XM-1-10C", (9, 0), 16, "h100-sxm", 3350 * 10 / 80),
    ("NVIDIA H100-3-40C", (9, 0), 60, "h100-pcie", 2000 * 40 / 80),
    ("NVIDIA A100-3-20C", (8, 0), 42, "a100-40gb", 1555 * 20 / 40),
    ("NVIDIA A100DX-7-80C", (8, 0), 98, "a100", 2039),   # the whole board's memory: unscaled
])
def test_a_mig_backed_vgpu_gets_its_slices_bandwidth(name, cc, sms, key, bandwidth):
    """A MIG-backed vGPU type ("-<slices>-<GB>C") owns its slice's memory controllers, as a bare-metal
    "MIG 1g.10gb" does: its bandwidth is the board's times its memory share (it was the whole board's)."""
    spec = spec_from_props(SimpleProps(name, cc[0], cc[1], sms, 10 * GB))
    assert spec.key == key and spec.bandwidth_gbs == pytest.approx(bandwidth, abs=0.1)
    assert spec.peak_tflops["bf16"] == pytest.approx(DEVICE_TABLE[key].peak_tflops["bf16"] * sms
                                                      / DEVICE_TABLE[key].sms, abs=0.1)


def test_bare_metal_names_keep_their_rows():
    """The vGPU rules must not catch the names torch reports on bare metal."""
    for name, cc, sms, mem, key in [("NVIDIA H100 80GB HBM3", (9, 0), 132, 85, "h100-sxm"),
                                    ("NVIDIA H100 PCIe", (9, 0), 114, 85, "h100-pcie"),
                                    ("NVIDIA H200", (9, 0), 132, 150, "h200"),
                                    ("NVIDIA A100-SXM4-80GB", (8, 0), 108, 85, "a100"),
                                    ("NVIDIA A100-SXM4-40GB", (8, 0), 108, 42, "a100-40gb"),
                                    ("NVIDIA A100 80GB PCIe", (8, 0), 108, 85, "a100-pcie"),
                                    ("NVIDIA GH200 480GB", (9, 0), 132, 102, "gh200"),
                                    ("NVIDIA H800XM-80C", (9, 0), 132, 85, "unknown")]:
        assert spec_from_props(SimpleProps(name, cc[0], cc[1], sms, mem * GB)).key == key, name


# ------------------------------------------------------------------ guards: FLOPs, import time

def test_flops_per_token_is_what_flop_counter_counts():
    """gpt.estimate_flops against torch's own count of a training step on a tiny model (GQA, value
    embeddings and their gates, a padded lm_head): every matmul FLOP (aten.mm) is 6 x the scaling
    params per token, and the attention term is 3 x SDPA's forward count (forward + a backward of
    twice its matmuls; flop_counter's backward also charges the recomputed scores, which a
    6N-style MFU does not). Full-attention layers: SDPA with a window mask would count every key."""
    from nanochat.gpt import GPT, GPTConfig

    cfg = GPTConfig(sequence_len=16, vocab_size=70, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                    window_pattern="L")
    torch.manual_seed(0)
    model = GPT(cfg, attn_backend="sdpa", compute_dtype=torch.float32)
    model.init_weights()
    idx = torch.randint(0, 70, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    sdpa_fwd = sum(n for op, n in counts.items() if "scaled_dot_product" in op and "backward" not in op)
    assert sdpa_fwd > 0 and counts["aten.mm"] == 6 * model.num_scaling_params() * idx.numel()
    assert model.estimate_flops(16) * idx.numel() == counts["aten.mm"] + 3 * sdpa_fwd


def test_importing_platform_precision_and_gpt_does_no_cuda_work():
    """No GPU probing and no heavy optional import at import time (TEAM_RULES): every torch.cuda
    query is recorded in a child process before the imports."""
    code = """
import sys, torch
calls = []
for name in ("is_available", "device_count", "get_device_properties", "current_device",
             "get_device_capability", "get_device_name", "_lazy_init", "init"):
    real = getattr(torch.cuda, name)
    setattr(torch.cuda, name, lambda *a, _n=name, _r=real, **k: (calls.append(_n), _r(*a, **k))[1])
before = set(sys.modules)
import nanochat.platform, nanochat.precision, nanochat.precision_request, nanochat.gpt, nanochat.step_meter
heavy = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in
               ("triton", "transformer_engine", "torchao", "liger_kernel")
               or m.startswith(("torch._dynamo", "torch._inductor")))
print(calls, torch.cuda.is_initialized(), heavy)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] False []", out.stdout
