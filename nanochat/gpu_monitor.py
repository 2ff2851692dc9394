"""What the GPU's clocks and power did while a benchmark ran (nvidia-smi sampling in the background).

Why: a d20 training step on an H100 SXM runs at the board's 700 W limit. Measured (2026-11-24,
bench_train d20 bf16, nvidia-smi every 250 ms): the software power cap was active in 206 of 211
busy samples, at a median SM clock of 1635 MHz against 1980 MHz unthrottled. So tok/s tracks energy
per step as much as kernel time, and two boxes of the same model differ by a few percent. Each
benchmark row now says how throttled its GPU was, so figures from different machines can be read
side by side.

    with GpuMonitor(torch.device("cuda")) as mon:
        ...timed work...
    mon.summary()  # {"samples", "sm_clock_mhz_median", "sm_clock_max_mhz", "power_w_median",
                   #  "power_limit_w", "power_capped_pct", "thermal_slowdown_pct", "temp_c_max"}

Without nvidia-smi (CPU runs, containers without the driver tools) the monitor records nothing
and summary() says why; it never fails the benchmark it watches.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile

FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "power.limit", "temperature.gpu",
          "clocks_throttle_reasons.sw_power_cap", "clocks_throttle_reasons.sw_thermal_slowdown",
          "clocks_throttle_reasons.hw_thermal_slowdown")


def device_selector(device) -> str | None:
    """The nvidia-smi `-i` value for a torch CUDA device: its PCI address, which (unlike the index)
    does not depend on CUDA_VISIBLE_DEVICES. None off CUDA."""
    import torch

    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    return f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"


def parse_sample(line: str) -> dict | None:
    """One CSV line of FIELDS (noheader, nounits) -> numbers, or None for a line it cannot read
    (nvidia-smi prints "[N/A]" or "[Not Supported]" for fields a board lacks)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None

    def num(text):
        try:
            return float(text)
        except ValueError:
            return None

    clock, clock_max, power, limit, temp = (num(p) for p in parts[:5])
    if clock is None:
        return None
    # a reason the board does not report ("[N/A]", "[Not Supported]") is unknown, not inactive: read
    # as inactive, such a GPU printed "capped 0%" for a cap nobody could see
    flags = [{"active": True, "not active": False}.get(p.lower()) for p in parts[5:]]
    thermal = True if True in flags[1:] else None if None in flags[1:] else False
    return {"clock": clock, "clock_max": clock_max, "power": power, "limit": limit, "temp": temp,
            "power_capped": flags[0], "thermal": thermal}


def summarize(samples: list[dict]) -> dict:
    """Medians and shares over the samples (see the module docstring for the keys)."""
    if not samples:
        return {"samples": 0}

    def med(key):
        values = [s[key] for s in samples if s[key] is not None]
        return round(statistics.median(values), 1) if values else None

    def pct(key):   # None when a sample could not tell (the field is not reported on this board)
        if any(s[key] is None for s in samples):
            return None
        return round(100.0 * sum(s[key] for s in samples) / len(samples), 1)

    temps = [s["temp"] for s in samples if s["temp"] is not None]
    return {"samples": len(samples), "sm_clock_mhz_median": med("clock"), "sm_clock_max_mhz": med("clock_max"),
            "power_w_median": med("power"), "power_limit_w": med("limit"),
            "power_capped_pct": pct("power_capped"), "thermal_slowdown_pct": pct("thermal"),
            "temp_c_max": max(temps) if temps else None}


class GpuMonitor:
    """Samples FIELDS every `interval_ms` from start() (or `with`) to stop(). `device`: a torch
    device (CPU: records nothing); `smi`: the nvidia-smi executable (tests pass a stand-in)."""

    def __init__(self, device, interval_ms: int = 200, smi: str = "nvidia-smi"):
        if interval_ms < 50:
            raise ValueError(f"GpuMonitor interval_ms: got {interval_ms}; accepted: >= 50")
        self.interval_ms = interval_ms
        self.selector = device_selector(device)
        self.smi = shutil.which(smi)
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.samples: list[dict] = []
        self.reason = None if self.selector and self.smi else (
            "not a CUDA device" if not self.selector else f"{smi} not found")

    def start(self) -> "GpuMonitor":
        if self.reason is None:
            cmd = [self.smi, f"--query-gpu={','.join(FIELDS)}", "--format=csv,noheader,nounits",
                   "-i", self.selector, "-lms", str(self.interval_ms)]
            # A file, not a pipe: nobody reads while the benchmark runs, and a full pipe (64 KB, ~10
            # minutes of samples) would stall nvidia-smi and lose the rest of the run.
            self.log = tempfile.TemporaryFile(mode="w+")
            try:
                self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
            except OSError as e:  # e.g. not executable: the benchmark runs on without samples
                self.log.close()
                self.log, self.reason = None, f"{self.smi} failed to start ({e.strerror or e})"
        return self

    def stop(self) -> dict:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.seek(0)
            out = self.log.read()
            self.log.close()
            self.samples = [s for s in map(parse_sample, out.splitlines()) if s is not None]
            if not self.samples:
                self.reason = f"no readable samples ({out.strip()[:120] or 'empty output'})"
            self.proc = self.log = None
        return self.summary()

    def summary(self) -> dict:
        out = summarize(self.samples)
        return out if self.reason is None else {**out, "unavailable": self.reason}

    def __enter__(self) -> "GpuMonitor":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
