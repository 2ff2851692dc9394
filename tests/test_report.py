"""The report: sections, per-stage metrics, plots, summary table, reset, CLI and rank-0 gating."""

import json
import math

import pytest

from nanochat import report as report_mod
from nanochat.report import DummyReport, Report, get_report, log_metrics


@pytest.fixture()
def base(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


def synthetic_run(base):
    rep = get_report()
    rep.reset()
    for step in range(0, 200, 10):  # base: loss decays, val bpb every 50 steps
        row = {"step": step, "loss": 4.0 * math.exp(-step / 100) + 1.0, "tok_per_sec": 1000.0 + step,
               "memory_gb": 1.5, "elapsed_s": step * 2.0, "lr": 0.02}
        if step % 50 == 0:
            row["val_bpb"] = 1.5 - step / 1000
        log_metrics("base", row)
    for step in range(0, 40, 5):
        log_metrics("sft", {"step": step, "loss": 1.2 - step / 100, "elapsed_s": step * 1.0})
    rep.log("Base model training", {"depth": 2, "num_params": 123456, "total_time_s": 398.0})
    rep.log("Base model evaluation", {"CORE metric": 0.1234, "arc_easy": 0.5, "val_bpb": 1.3})
    rep.log("Chat evaluation sft", {"stage": "sft", "ARC-Easy": 0.31, "ARC-Challenge": 0.27, "MMLU": 0.26,
                                    "GSM8K": 0.02, "HumanEval": 0.0, "SpellingBee": 0.5, "ChatCORE metric": 0.05})
    rep.log("Chat evaluation mid", {"ARC-Easy": 0.29})
    rep.log("Chat evaluation mid", {"ARC-Easy": 0.30, "note": "a rerun: latest entry wins"})
    # the served int8 model's evaluations, logged after: their sections only, not the summary
    rep.log("Base model evaluation (int8 weights)", {"stage": "base", "CORE metric": 0.1111, "weights": "int8"})
    rep.log("Chat evaluation sft (int8 weights)", {"stage": "sft", "ARC-Easy": 0.11, "ChatCORE metric": 0.01,
                                                   "weights": "int8"})
    return rep


def parse_table(lines: list[str], header_prefix: str) -> list[list[str]]:
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_prefix))
    rows = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def test_generate_with_plots_and_summary(base):
    rep = synthetic_run(base)
    path = rep.generate(hourly_cost=3.0)
    assert path == base / "report" / "report.md"
    text = path.read_text()
    plots = base / "report" / "plots"
    for name in ("loss_vs_step.png", "loss_vs_time.png", "val_bpb_vs_step.png", "val_bpb_vs_time.png",
                 "tok_per_sec.png", "memory.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, name
        assert f"(plots/{name})" in text
    table = parse_table(text.splitlines(), "| Metric |")
    assert table[0] == ["Metric", "BASE", "MID", "SFT", "RL"]
    assert set(table[1]) == {"---"}
    assert all(len(r) == 5 for r in table)
    rows = {r[0]: r[1:] for r in table[2:]}
    assert list(rows) == ["CORE", "ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee", "ChatCORE"]
    assert rows["CORE"] == ["0.1234", "-", "-", "-"]
    assert rows["ARC-Easy"] == ["-", "0.3000", "0.3100", "-"]  # arc_easy (a CORE subtask) is not ARC-Easy
    assert rows["ChatCORE"] == ["-", "-", "0.0500", "-"]
    timing = parse_table(text.splitlines(), "| Stage |")
    stages = {r[0]: r for r in timing[2:]}
    assert stages["base"][1] == "190" and float(stages["base"][2]) == pytest.approx(380 / 3600, abs=1e-3)
    assert "estimated cost: $" in text
    for key in ("git_sha", "torch", "device", "cpu", "memory_gb"):
        assert f"- {key}: " in text
    assert "## Base model training" in text and "- num_params: 123,456" in text


def test_reset_clears_and_cli(base, capsys):
    rep = synthetic_run(base)
    rep.generate()
    report_mod.main(["reset", "--base-dir", str(base)])
    rdir = base / "report"
    assert not list(rdir.glob("metrics_*.jsonl")) and not (rdir / "sections").exists()
    assert not (rdir / "report.md").exists() and json.loads((rdir / "header.json").read_text())["system"]
    report_mod.main(["generate", "--base_dir", str(base)])  # empty report still generates
    text = (rdir / "report.md").read_text()
    assert "| CORE | - | - | - | - |" in text and "## Plots" not in text
    assert "report written" in capsys.readouterr().out


def test_log_metrics_validation_and_serialization(base):
    torch = pytest.importorskip("torch")
    log_metrics("base", {"step": torch.tensor(3), "loss": torch.tensor(2.5), "path": base})
    row = json.loads((base / "report" / "metrics_base.jsonl").read_text())
    assert row["step"] == 3 and row["loss"] == 2.5 and row["path"] == str(base) and "time" in row
    with pytest.raises(ValueError, match="stage"):
        log_metrics("Base Stage", {"step": 1})
    with pytest.raises(ValueError, match="metrics"):
        log_metrics("base", [1, 2])
    with pytest.raises(ValueError, match="section"):
        get_report().log("!!!", {})
    with pytest.raises(ValueError, match="--hourly-cost"):
        get_report().generate(hourly_cost=-1)


def test_hourly_cost_is_checked_with_the_flags(base, monkeypatch):
    """--hourly-cost (or NANOCHAT_HOURLY_COST) that is not a number >= 0 is refused when the command
    line is read, naming where it came from ("$nan/h" was printed, -1 a traceback after the plots)."""
    from nanochat.errors import RequestError
    for bad in ("-1", "nan", "inf", "abc"):
        with pytest.raises(RequestError, match=f"--hourly-cost: got '{bad}'; accepted: a number >= 0"):
            report_mod.parse_args(["generate", "--hourly-cost", bad])
    monkeypatch.setenv("NANOCHAT_HOURLY_COST", "abc")
    with pytest.raises(RequestError, match="NANOCHAT_HOURLY_COST: got 'abc'"):
        report_mod.parse_args(["generate"])
    assert report_mod.parse_args(["generate", "--hourly-cost", "2.5"]).hourly_cost == 2.5   # the flag wins
    monkeypatch.setenv("NANOCHAT_HOURLY_COST", "3")
    assert report_mod.parse_args(["generate"]).hourly_cost == 3.0


def test_non_master_ranks_write_nothing(base, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert isinstance(get_report(), DummyReport)
    get_report().log("Base model training", {"x": 1})
    log_metrics("base", {"step": 1, "loss": 1.0})
    assert not (base / "report").exists()


def test_torn_metrics_line_is_skipped(base):
    log_metrics("mid", {"step": 1, "loss": 2.0})
    with open(base / "report" / "metrics_mid.jsonl", "a") as f:
        f.write('{"step": 2, "loss"')  # a crash mid-write
    assert report_mod.read_metrics()["mid"] == [json.loads((base / "report" / "metrics_mid.jsonl").read_text().splitlines()[0])]
    Report(base / "report").generate()
    assert (base / "report" / "plots" / "loss_vs_step.png").is_file()


def test_corrupt_report_files_name_the_file(base):
    from nanochat.errors import RequestError
    rep = synthetic_run(base)
    rdir = base / "report"
    with open(rdir / "metrics_base.jsonl", "a") as f:
        f.write("[1, 2]\n7\n")  # not objects: skipped
    assert all(isinstance(r, dict) for r in report_mod.read_metrics(base)["base"])
    rep.generate()
    section = next((rdir / "sections").glob("*.json"))
    for garbage in ("{nope", "[1, 2]", '{"section": "x", "entries": [1]}'):
        section.write_text(garbage)
        with pytest.raises(RequestError, match=f"{section}: corrupt report section .*nanochat.report reset"):
            rep.generate()
    section.unlink()
    rep.reset()
    (rdir / "header.json").write_text("{nope")
    with pytest.raises(RequestError, match=f"{rdir / 'header.json'}: corrupt report header"):
        rep.generate()


def test_cli_errors_are_one_line_exit_2(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path
    rdir = tmp_path / "report"
    rdir.mkdir()
    (rdir / "header.json").write_text("{nope")
    r = subprocess.run([sys.executable, "-m", "nanochat.report", "generate", "--base-dir", str(tmp_path)],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.startswith("report: error: ") and "Traceback" not in r.stderr, r.stderr
    assert str(rdir / "header.json") in r.stderr and len(r.stderr.strip().splitlines()) == 1
