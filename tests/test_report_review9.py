"""Review 9 of the report, as a user reads report.md at the end of ./setup.sh: an MPLBACKEND that
matplotlib does not know killed `generate` before report.md was written (the plots use Agg directly,
so that setting never mattered); a report of a base dir where nothing was logged (a typo in
NANOCHAT_BASE_DIR, which get_base_dir creates) read as a finished, empty run; the tokenizer's
training time was logged but left out of the time table and its total (and the cost estimate); a
text entry was pasted raw (a "# ..." line became a heading of report.md)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from nanochat import report as report_mod
from nanochat.report import get_report, log_metrics

REPO = Path(__file__).resolve().parents[1]
HEADER = {"start_time": 1_800_000_000.0, "start": "2027-01-15T08:00:00", "system": {"device": "cpu"}}


@pytest.fixture()
def base(tmp_path, monkeypatch):
    """A base dir, a fixed clock and a header (no system probe), no plots unless a test draws them."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("NANOCHAT_REPORT_DIR", raising=False)
    now = [HEADER["start_time"]]
    monkeypatch.setattr(report_mod, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(report_mod, "make_plots", lambda metrics, out_dir: [])
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "header.json").write_text(json.dumps(HEADER))
    return tmp_path, now


def _times(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    start = lines.index("| Stage | steps | wall clock |") + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_an_unknown_mplbackend_still_draws_the_plots(tmp_path):
    """MPLBACKEND=TkAgg-typo (or a value meant for another install): matplotlib refuses it on import
    with a ValueError, which `generate` did not catch: a traceback and no report.md after the whole
    pipeline. A subprocess: matplotlib reads the variable only on its first import."""
    rep = tmp_path / "report"
    rep.mkdir()
    (rep / "header.json").write_text(json.dumps(HEADER))
    (rep / "metrics_base.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0 - s / 10, "elapsed_s": s,
                                                                "time": 1.8e9 + s}) + "\n" for s in range(5)))
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path), "MPLBACKEND": "no-such-backend"}
    env.pop("NANOCHAT_REPORT_DIR", None)
    code = ("import os; from nanochat.report import Report; p = Report(os.environ['NANOCHAT_BASE_DIR'] + "
            "'/report').generate(); print(os.environ['MPLBACKEND'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "no-such-backend"   # the caller's environment is left as it was
    text = (rep / "report.md").read_text()
    assert "(plots/loss_vs_step.png)" in text
    assert (rep / "plots" / "loss_vs_step.png").read_bytes()[:4] == b"\x89PNG"


def test_a_report_of_nothing_says_so(base, capsys):
    """A typo in NANOCHAT_BASE_DIR: get_base_dir creates the folder, and `generate` wrote a report of
    dashes and a 0:00:00 total with "report written", as if the run had been empty."""
    tmp, _ = base
    report_mod.main(["generate"])
    text = (tmp / "report" / "report.md").read_text()
    assert f"_Nothing has been logged in {tmp / 'report'}" in text
    err = capsys.readouterr().err
    assert "WARNING: nothing has been logged in" in err and "NANOCHAT_BASE_DIR" in err
    # once a stage has logged, neither
    log_metrics("base", {"step": 0, "loss": 3.0, "elapsed_s": 1.0})
    report_mod.main(["generate"])
    assert "Nothing has been logged" not in (tmp / "report" / "report.md").read_text()
    assert "WARNING" not in capsys.readouterr().err


def test_the_tokenizer_training_time_is_in_the_time_table(base):
    """tok_train logs train_time_s; the table (and the cost, "for the table's total") left it out."""
    tmp, now = base
    rep = get_report()
    now[0] += 90
    rep.log("Tokenizer training", {"vocab_size": 65536, "train_time_s": 90.4})
    for s in range(3):
        now[0] += 10
        log_metrics("base", {"step": s, "loss": 3.0, "elapsed_s": 10.0 * (s + 1)})
    rep.log("Base model training", {"stage": "base", "final_step": 3, "total_time_s": 30.0})
    text = rep.generate(hourly_cost=36.0).read_text()
    times = _times(text)
    assert list(times) == ["Tokenizer training", "base", "total"]
    assert times["Tokenizer training"] == ["", "0:01:30"]
    assert times["total"] == ["", "0:02:00"]
    assert "- estimated cost at $36.00/h: $1.20 for the table's total" in text


def test_a_text_entry_stays_inside_its_section(base):
    """Report.log takes text too: it was pasted raw, so a "# ..." line became a heading of report.md
    and the lines of a multi-line note ran into one paragraph."""
    tmp, _ = base
    get_report().log("Notes", "first line\n# not a heading\n| a | b |")
    lines = get_report().generate().read_text().splitlines()
    assert "# not a heading" not in lines and "| a | b |" not in lines
    assert "  # not a heading" in lines and "  first line" in lines


@pytest.mark.parametrize("cost", [math.nan, math.inf, -1.0])
def test_generate_refuses_a_cost_that_is_not_a_price(base, cost):
    """Report.generate checked only < 0: a NaN printed "$nan/h" (the CLI checks its flag, callers did not)."""
    with pytest.raises(ValueError, match="--hourly-cost: got .*; accepted: a number >= 0"):
        get_report().generate(hourly_cost=cost)


def test_the_summary_shows_each_training_run_s_tokens_rate_and_mfu(base):
    """report.md named no MFU and no token count (only metrics_*.jsonl's per-step rows had them):
    log_stage_report now logs the run's average MFU and steps x tokens per step, and the summary
    prints them in their own units."""
    from nanochat.loop import LoopResult, log_stage_report
    from nanochat.step_meter import StepMeter
    from nanochat.training import StepResult

    meter = StepMeter(6e9, 1, peak_bf16=989e12, warmup_steps=1)
    for step in range(3):   # 100k tokens a second after the warm-up step
        meter.update(StepResult(step=step, loss=3.0, dt=5.24288, tokens=524288, lrm=1.0, grad_norm=1.0))
    log_stage_report("Base model training", "base", config={}, result=LoopResult(step=400), meter=meter,
                     extra={"total_batch_size": 524288})
    text = get_report().generate().read_text()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in text.splitlines() if line.startswith("| ") and "|" in line[2:]}
    assert rows["tokens trained"][0] == "209,715,200"   # 400 x 524,288
    assert rows["tok/s (average)"][0] == "100,000"
    assert rows["MFU % (bf16 peak)"][0] == f"{100 * 6e9 * 1e5 / 989e12:.1f}" == "60.7"
    assert rows["tokens trained"][1:] == ["-"] * (len(rows["tokens trained"]) - 1)
    assert "tokens trained: optimizer steps x tokens per step" in text


def test_a_one_line_text_entry_that_reads_as_markdown_is_fenced():
    """"- # x" is still a heading (inside the list item) in CommonMark: a one-line text entry that
    markdown would read as a heading, quote, table, rule or list is fenced; plain text stays a line."""
    from nanochat.report_md import _md_data

    for text in ("# not a heading", "> quoted", "| a | b |", "--- rule", "1. item"):
        assert _md_data(text) == ["- ```text", f"  {text}", "  ```"], text
    assert _md_data("plain text") == ["- plain text"]
