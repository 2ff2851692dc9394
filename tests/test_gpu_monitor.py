"""nanochat/gpu_monitor.py: parsing nvidia-smi samples, the summary, and the background process
(a stand-in nvidia-smi script that prints samples until it is terminated)."""

import stat
import sys
import time

import pytest
import torch

from nanochat import gpu_monitor as gm

LINE = "{clock}, 1980, {power}, 700.00, 61, {cap}, Not Active, Not Active"


def test_parse_sample_reads_numbers_flags_and_rejects_junk():
    s = gm.parse_sample(LINE.format(clock=1635, power=693.2, cap="Active"))
    assert s == {"clock": 1635.0, "clock_max": 1980.0, "power": 693.2, "limit": 700.0, "temp": 61.0,
                 "power_capped": True, "thermal": False}
    assert gm.parse_sample("1635, 1980, [N/A], 700.00, 61, Not Active, Not Active, Active")["power"] is None
    assert gm.parse_sample("1635, 1980, 693") is None                       # wrong field count
    assert gm.parse_sample("[N/A], 1980, 1, 700, 61, Active, Active, Active") is None  # no clock


def test_summarize_medians_and_shares():
    lines = [LINE.format(clock=c, power=p, cap=cap) for c, p, cap in
             ((1500, 700, "Active"), (1600, 698, "Active"), (1980, 400, "Not Active"), (1635, 699, "Active"))]
    out = gm.summarize([gm.parse_sample(line) for line in lines])
    assert out["samples"] == 4
    assert out["sm_clock_mhz_median"] == 1617.5
    assert out["power_w_median"] == 698.5
    assert out["power_capped_pct"] == 75.0
    assert out["thermal_slowdown_pct"] == 0.0
    assert out["temp_c_max"] == 61.0
    assert gm.summarize([]) == {"samples": 0}


def _fake_smi(tmp_path, body: str) -> str:
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_monitor_runs_the_tool_with_the_device_and_interval(tmp_path, monkeypatch):
    args_file = tmp_path / "args"
    smi = _fake_smi(tmp_path, f"""import sys, time
open({str(args_file)!r}, "w").write(" ".join(sys.argv[1:]))
print({LINE.format(clock=1700, power=650, cap="Active")!r}, flush=True)
print({LINE.format(clock=1900, power=500, cap="Not Active")!r}, flush=True)
time.sleep(60)
""")
    monkeypatch.setattr(gm, "device_selector", lambda device: "00000000:1B:00.0")
    mon = gm.GpuMonitor(torch.device("cuda"), interval_ms=100, smi=smi)
    with mon:
        deadline = time.time() + 20
        while not args_file.exists() and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
    out = mon.summary()
    assert out["samples"] == 2 and out["sm_clock_mhz_median"] == 1800.0 and out["power_capped_pct"] == 50.0
    assert "unavailable" not in out
    argv = args_file.read_text().split()
    assert "-i" in argv and argv[argv.index("-i") + 1] == "00000000:1B:00.0"
    assert argv[argv.index("-lms") + 1] == "100"
    assert any(a.startswith("--query-gpu=clocks.sm,") for a in argv)


def test_monitor_reports_why_it_has_nothing(tmp_path, monkeypatch):
    assert gm.GpuMonitor(torch.device("cpu")).start().stop() == {"samples": 0, "unavailable": "not a CUDA device"}
    monkeypatch.setattr(gm, "device_selector", lambda device: "00000000:1B:00.0")
    missing = gm.GpuMonitor(torch.device("cuda"), smi=str(tmp_path / "no-such-smi"))
    assert missing.start().stop()["unavailable"].endswith("not found")
    broken = gm.GpuMonitor(torch.device("cuda"), smi=_fake_smi(tmp_path, "print('Failed to initialize NVML')"))
    broken.start()
    time.sleep(0.5)
    assert broken.stop()["unavailable"].startswith("no readable samples (Failed to initialize NVML")
    not_exec = tmp_path / "smi-not-executable"
    not_exec.write_text("")
    monkeypatch.setattr(gm.shutil, "which", lambda name: str(not_exec))  # found, but cannot start
    assert "failed to start" in gm.GpuMonitor(torch.device("cuda")).start().stop()["unavailable"]
    with pytest.raises(ValueError, match="interval_ms"):
        gm.GpuMonitor(torch.device("cpu"), interval_ms=10)


def test_monitor_keeps_every_sample_of_a_long_run(tmp_path, monkeypatch):
    """~10 minutes of samples (3,000 lines, ~180 KB: more than a pipe holds) all arrive: the tool
    writes to a file, so it never blocks on output nobody reads until stop()."""
    done = tmp_path / "done"
    smi = _fake_smi(tmp_path, f"""import time
for i in range(3000):
    print({LINE.format(clock=1600, power=690, cap="Active")!r})
open({str(done)!r}, "w").close()
time.sleep(60)
""")
    monkeypatch.setattr(gm, "device_selector", lambda device: "00000000:1B:00.0")
    mon = gm.GpuMonitor(torch.device("cuda"), smi=smi).start()
    deadline = time.time() + 30
    while not done.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert done.exists(), "the stand-in nvidia-smi blocked on its output"
    assert mon.stop()["samples"] == 3000
