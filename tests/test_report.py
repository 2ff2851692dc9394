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
                                    "GSM8K": 0.02, "HumanEval": 0.0, "SpellingBee": 0.5, "ChatCORE metric": 0.05,
                                    "temperature": 0.0})
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
    assert list(rows) == ["val bpb", "val bpb (own data)", "CORE", "ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K",
                          "HumanEval", "SpellingBee", "ChatCORE", "tokens trained", "tok/s (average)",
                          "MFU % (bf16 peak)"]
    assert rows["val bpb"] == ["1.3000", "-", "-", "-"] and rows["val bpb (own data)"] == ["-"] * 4
    assert rows["CORE"] == ["0.1234", "-", "-", "-"]
    assert rows["ARC-Easy"] == ["-", "0.3000", "0.3100", "-"]  # arc_easy (a CORE subtask) is not ARC-Easy
    assert rows["ChatCORE"] == ["-", "-", "0.0500", "-"]
    timing = parse_table(text.splitlines(), "| Stage |")
    stages = {r[0]: r for r in timing[2:]}
    assert stages["base"][1] == "191" and stages["base"][2] == "0:06:20"
    assert "- estimated cost at $3.00/h: $0.35 for the table's total" in text   # 380 s of base + 35 of sft
    for key in ("git_sha", "torch", "device", "cpu", "memory_gib"):
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


def _rows_for(base, stage):
    return [json.loads(line) for line in (base / "report" / f"metrics_{stage}.jsonl").read_text().splitlines()]


def test_a_rerun_or_resumed_stage_replaces_the_old_runs_rows(base):
    """metrics_<stage>.jsonl is appended to by every run: a fresh rerun of a stage was drawn on top of
    the old curve (a line back from its last step to 0) and the time table showed the old run's last
    step and wall clock; a resume from an earlier checkpoint drew the steps it redid twice."""
    rep = get_report()
    rep.reset()
    for step in range(20):   # an old run of the stage, 2 s a step, evaluated every 10 steps
        if step % 10 == 0:
            log_metrics("sft", {"step": step, "val_bpb": 2.0, "elapsed_s": 2.0 * step})
        log_metrics("sft", {"step": step, "loss": 5.0, "elapsed_s": 2.0 * step})
    for step in range(6):    # a fresh rerun, 1 s a step, crashed after step 5 (checkpoint at step 3)
        if step % 3 == 0:
            log_metrics("sft", {"step": step, "val_bpb": 1.5, "elapsed_s": 1.0 * step})
        log_metrics("sft", {"step": step, "loss": 1.0, "elapsed_s": 1.0 * step})
    for step in range(3, 8):  # resumed from step 3 (evaluated there before the save): not evaluated again
        log_metrics("sft", {"step": step, "loss": 0.5, "elapsed_s": 1.0 * step})
    rows, dropped = report_mod.current_run(_rows_for(base, "sft"))
    assert dropped == 22 + 3
    assert report_mod._series(rows, "loss", "step") == ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
                                                       [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert report_mod._series(rows, "val_bpb", "step") == ([0.0, 3.0], [1.5, 1.5])   # step 3's eval kept
    text = rep.generate().read_text()
    stages = {r[0]: r for r in parse_table(text.splitlines(), "| Stage |")[2:]}
    # no "Chat SFT" section was logged after these rows: the run is named unfinished
    assert stages["sft (unfinished)"][1] == "8" and stages["sft (unfinished)"][2] == "0:00:07"
    assert "- sft: 25 metrics rows of an earlier run" in text


def _current_run_by_definition(rows):
    """current_run as its docstring defines it: every row with a step drops the kept rows past that
    step and the one of its kind (training / evaluation) at it (quadratic: small inputs only)."""
    kept = []
    for row in rows:
        step = report_mod._step_of(row)
        if step is not None:
            train = "loss" in row
            kept = [r for r in kept if "step" not in r or r["step"] < step
                    or (r["step"] == step and ("loss" in r) != train)]
        kept.append(row)
    return kept, len(rows) - len(kept)


def test_current_run_is_linear_and_keeps_its_definition(monkeypatch):
    """A run logs a metrics row every step: current_run filtered all kept rows at each new one, so a
    20k-step run's report took ~90 s to generate (22 s at 10k steps, quadratic)."""
    import random

    rnd = random.Random(0)
    for _ in range(300):   # runs, fresh reruns and resumes, eval rows, rows without a step, re-logged steps
        rows, step = [], 0
        for _ in range(rnd.randrange(40)):
            kind = rnd.random()
            step = rnd.randrange(step + 1) if kind < 0.1 else step + (kind < 0.8)
            rows.append({"note": 1} if kind > 0.95 else {"step": step, ("loss" if kind < 0.7 else "val_bpb"): 1.0})
        got, dropped = report_mod.current_run(rows)
        want, want_dropped = _current_run_by_definition(rows)
        assert dropped == want_dropped and [id(r) for r in got] == [id(r) for r in want], rows
    calls, step_of = [0], report_mod._step_of
    monkeypatch.setattr(report_mod, "_step_of", lambda row: calls.__setitem__(0, calls[0] + 1) or step_of(row))
    rows = []   # a 3000-step run evaluated every 100 steps, resumed from its step-2000 checkpoint
    for first, last in ((0, 3000), (2000, 3000)):
        for s in range(first, last):
            evaluated = s % 100 == 0 and (first == 0 or s > first)   # a resume does not re-evaluate its step
            rows += [{"step": s, "val_bpb": 1.0}] * evaluated + [{"step": s, "loss": 1.0}]
    assert report_mod.current_run(rows)[1] == 999 + 9 + 1 and calls[0] <= 2 * len(rows)   # it made 14.3M calls


def test_summary_marks_values_older_than_the_model_and_partial_scores(base):
    """A chat_eval logged before its stage (or an earlier one) was trained again describes the old
    model: it was shown as the current figure; a ChatCORE of one task was shown as the ChatCORE."""
    rep = get_report()
    rep.reset()
    rep.log("Chat SFT", {"stage": "sft", "final_step": 10})
    rep.log("Chat evaluation sft", {"stage": "sft", "temperature": 0.0, "GSM8K": 0.1, "ChatCORE metric": 0.2,
                                    "ChatCORE complete": True})
    rep.log("Chat RL", {"stage": "rl", "final_step": 5})
    rep.log("Chat evaluation rl", {"stage": "rl", "temperature": 0.0, "GSM8K": 0.3, "ChatCORE metric": 0.25,
                                   "ChatCORE complete": True})
    cells = rep.summary_cells()
    assert cells["GSM8K"] == {"sft": (0.1, []), "rl": (0.3, [])} and cells["ChatCORE"]["rl"] == (0.25, [])
    rep.log("Chat SFT", {"stage": "sft", "final_step": 20})     # SFT trained again, not re-evaluated
    rep.log("Chat evaluation rl", {"stage": "rl", "temperature": 0.0, "GSM8K": 0.4, "ChatCORE metric": 0.3,
                                   "ChatCORE complete": False})
    cells = rep.summary_cells()
    assert cells["GSM8K"] == {"sft": (0.1, ["stale"]), "rl": (0.4, [])}
    assert cells["ChatCORE"] == {"sft": (0.2, ["stale"]), "rl": (0.3, ["partial"])}
    assert rep.summary()["GSM8K"] == {"sft": 0.1, "rl": 0.4}
    text = rep.generate().read_text()
    rows = {r[0]: r[1:] for r in parse_table(text.splitlines(), "| Metric |")[2:]}
    assert rows["GSM8K"] == ["-", "-", "0.1000 (stale)", "0.4000"]
    assert rows["ChatCORE"] == ["-", "-", "0.2000 (stale)", "0.3000 (partial)"]
    assert "(stale): logged before the latest training run" in text and "(partial): computed from a subset" in text
    rep.log("Chat RL", {"stage": "rl", "final_step": 9})         # RL on the new SFT: its old figures too
    assert rep.summary_cells()["GSM8K"]["rl"] == (0.4, ["stale"])


def test_summary_latest_entry_wins_across_sections(base):
    rep = get_report()
    rep.reset()
    rep.log("Chat evaluation sft", {"stage": "sft", "MMLU": 0.1})
    rep.log("Custom sft evaluation", {"stage": "sft", "MMLU": 0.2})
    rep.log("Chat evaluation sft", {"stage": "sft", "MMLU": 0.3})   # the newest, in the older section
    assert rep.summary()["MMLU"] == {"sft": 0.3}


def test_multiline_strings_stay_inside_their_item(base):
    """Generated samples hold newlines: written raw, a line "# x" became a report heading, "---" a
    rule and "| a |" a table, and the sample's own lines were run together into one paragraph."""
    rep = get_report()
    rep.reset()
    sample = "The king said:\n# not a heading\n---\n| not | a table |\n\nuse ``` fences"
    rep.log("Base model evaluation", {"stage": "base", "samples": [sample, "one line"], "note": "a\nb"})
    lines = rep.generate().read_text().splitlines()
    start = lines.index("## Base model evaluation")
    body = lines[start + 1:]
    assert not any(ln.startswith(("#", "---", "|")) for ln in body)
    fence = "````"   # longer than any run of backticks in the text
    i = body.index(f"  - {fence}text")   # an item of the list under "- samples:"
    assert body[i - 1] == "- samples:" and body[i + 1:i + 8] == [
        "    The king said:", "    # not a heading", "    ---", "    | not | a table |", "", "    use ``` fences",
        f"    {fence}"]
    assert body[i + 8:i + 11] == ["  - ```text", "    one line", "    ```"]   # its list looks alike
    assert body[body.index("- note:") + 1:body.index("- note:") + 5] == \
        ["  ```text", "  a", "  b", "  ```"]


def test_non_finite_values_draw_no_empty_chart(base):
    rep = get_report()
    rep.reset()
    for step in range(3):
        log_metrics("base", {"step": step, "loss": [3.0, math.nan, 2.0][step], "val_bpb": math.nan})
    rep.generate()
    plots = base / "report" / "plots"
    assert (plots / "loss_vs_step.png").is_file() and not (plots / "val_bpb_vs_step.png").exists()
    assert report_mod._series(report_mod.read_metrics()["base"], "loss", "step") == ([0.0, 2.0], [3.0, 2.0])


PRECISION_BF16 = {"precision": "bf16", "backend": "none", "recipe": {}, "converted": 0, "kept_high_precision": [],
                  "peak_key": "bf16", "kernel": "triton", "kernel_fusions": "linear_ce,mix_norm", "patches": []}


def gpu_like_run(base, clock):
    """The sections and metrics the d12 GPU run logged (base 60 -> base_eval -> mid 30 -> SFT 30 ->
    chat_eval sft), as the scripts log them, on a fake clock (clock[0]: epoch seconds)."""
    rep = get_report()
    for stage, steps, dt, bpb in (("base", 60, 2.0, 1.7602), ("mid", 30, 3.5, 1.5682), ("sft", 30, 2.2, 1.5387)):
        for step in range(steps + 1):
            clock[0] += dt
            if step < steps:
                log_metrics(stage, {"step": step, "loss": 4.0 - step / 100, "elapsed_s": dt * (step + 1)})
        log_metrics(stage, {"step": steps, "val_bpb": bpb, "elapsed_s": dt * (steps + 1)})
        clock[0] += 7
        title = {"base": "Base model training", "mid": "Midtraining", "sft": "Chat SFT"}[stage]
        rep.log(title, {"stage": stage, "num_iterations": steps, **PRECISION_BF16, "final_val_bpb": bpb,
                        "val_bpb_step": steps, "min_val_bpb": bpb, "final_step": steps,
                        "total_time_s": round(dt * (steps + 1) + 7, 2), "final_loss": 3.6,
                        "config": {"recipe": "v2", "grad_clip": 0.0, "matrix_lr": 0.02, "num_iterations": steps,
                                   "target_param_data_ratio": 20.0, "resume": None}})
        if stage == "base":
            clock[0] += 20
            rep.log("Base model evaluation", {"stage": "base", "model_tag": "d12", "step": 60, "seconds": 15.0,
                                              "val_bpb": 1.7458})
    clock[0] += 54
    rep.log("Chat evaluation sft", {"stage": "sft", "step": 30, "temperature": 0.0, "ARC-Easy": 0.3, "GSM8K": 0.0,
                                    "ChatCORE metric": 0.0694, "ChatCORE complete": True})
    return rep


@pytest.fixture()
def clock(monkeypatch):
    """The report's clock (section entries' "t", metrics rows' "time"), moved by hand; and no plots
    (these tests read the text; matplotlib took most of their time)."""
    from types import SimpleNamespace
    now = [1_800_000_000.0]
    monkeypatch.setattr(report_mod, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(report_mod, "make_plots", lambda metrics, out_dir: [])
    return now


def section_body(text: str, title: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def test_precision_fields_are_grouped_and_an_empty_recipe_left_out(base, clock):
    """A training section showed the precision plan's `recipe: {}` (bf16 has none) next to config's
    `recipe: v2` (the optimizer recipe): a reader could not tell what `recipe: {}` meant."""
    rep = gpu_like_run(base, clock)
    rep.log("Base model training", {"stage": "base", "final_step": 10, "precision": "fp8", "backend": "te",
                                    "recipe": {"recipe": "Float8CurrentScaling", "fp8_format": "HYBRID"},
                                    "converted": 72, "kept_high_precision": ["lm_head"], "peak_key": "fp8",
                                    "startup_rel_err": 0.0123, "config": {"recipe": "v2"}})
    body = section_body(rep.generate().read_text(), "Base model training")
    first = body[:body.index("- final_val_bpb: 1.7602") + 1]
    assert "- precision: bf16 (backend none)" in first and "- kernel: triton" in first
    assert not any(ln.lstrip().startswith(("- recipe: {}", "- converted:", "- kept_high_precision:", "- backend:",
                                           "- peak_key:")) for ln in first)
    assert body.count("  - recipe: v2") == 2   # config's, in both runs
    fp8 = body[body.index("- precision: fp8 (backend te)"):]
    assert fp8[1:6] == ["  - recipe: recipe=Float8CurrentScaling, fp8_format=HYBRID", "  - converted: 72",
                        "  - kept_high_precision:", "    - lm_head", "  - startup_rel_err: 0.0123"]
    logged = rep.sections()[0]["entries"][0]["data"]   # the logged data keeps describe()'s flat keys
    assert logged["recipe"] == {} and logged["backend"] == "none" and logged["peak_key"] == "bf16"


def test_summary_has_val_bpb_rows_without_core(base, clock):
    """Without CORE (it needs the eval bundle) the summary's BASE column was all "-", though base_eval
    measured val bpb and every training stage logged its final val bpb."""
    text = gpu_like_run(base, clock).generate().read_text()
    rows = {r[0]: r[1:] for r in parse_table(text.splitlines(), "| Metric |")[2:]}
    assert rows["val bpb"] == ["1.7458", "-", "-", "-"]
    assert rows["val bpb (own data)"] == ["1.7602", "1.5682", "1.5387", "-"]
    assert rows["CORE"] == ["-"] * 4 and rows["ChatCORE"] == ["-", "-", "0.0694", "-"]
    assert "- val bpb (own data): each training stage's last validation, on its own data" in text
    assert "not comparable across stages or with the row above" in text


def test_numbers_are_formatted_for_reading(base, clock):
    """Every float had 4 decimals (`seconds: 15.0000`, `grad_clip: 0.0000`, a 3e-5 learning rate as
    0.0000), and a list of dicts ran their keys together into one list."""
    from nanochat.report_md import _fmt as fmt

    assert [fmt(v) for v in (15.0, 129.63, 0.0, 20.0, 0.02, 1.76018, 3e-5, 0.00412, -0.5, 627077.86)] == \
        ["15.0", "129.63", "0.0", "20.0", "0.02", "1.7602", "3e-05", "0.00412", "-0.5", "627,078"]
    assert [fmt(v) for v in (6844, 524288, True, None, math.nan)] == ["6844", "524,288", "True", "None", "nan"]
    rep = gpu_like_run(base, clock)
    rep.log("Midtraining", {"stage": "mid", "mixture": {"extra_conversations": [
        {"path": "a.jsonl", "conversations": 12}, {"path": "b.jsonl", "conversations": 30000}]}})
    text = rep.generate().read_text()
    for line in ("- seconds: 15.0", "- total_time_s: 129.0", "  - grad_clip: 0.0", "  - matrix_lr: 0.02",
                 "  - target_param_data_ratio: 20.0", "- temperature: 0.0", "- ChatCORE metric: 0.0694",
                 "    - path: a.jsonl, conversations: 12", "    - path: b.jsonl, conversations: 30,000"):
        assert line in text.splitlines(), line


def test_sections_are_in_pipeline_order(base, clock):
    """Sections came in logging order: a chat_eval of mid run after SFT, or a CORE evaluation run at
    the end, landed after the stages that follow them."""
    rep = get_report()
    for title, data in (("Chat SFT", {"stage": "sft", "final_step": 3}), ("Chat RL", {"stage": "rl", "final_step": 2}),
                        ("Chat evaluation mid", {"stage": "mid", "MMLU": 0.3}),
                        ("Midtraining", {"stage": "mid", "final_step": 5}),
                        ("Base model evaluation", {"stage": "base", "CORE metric": 0.2}),
                        ("Base model training", {"stage": "base", "final_step": 9}), ("Tokenizer", {"vocab": 10})):
        clock[0] += 1
        rep.log(title, data)
    heads = [ln[3:] for ln in rep.generate().read_text().splitlines() if ln.startswith("## ")]
    assert heads[heads.index("Time and cost") + 1:] == [
        "Tokenizer", "Base model training", "Base model evaluation", "Midtraining", "Chat evaluation mid",
        "Chat SFT", "Chat RL"]


def test_time_table_has_evaluations_rl_after_sft_and_the_whole_run(base, clock):
    """The time table left evaluations out (the cost fell short), listed rl before sft (file-name
    order, also the plots' legends), and measured "since reset" up to `generate`."""
    rep = gpu_like_run(base, clock)
    for step in range(5):
        clock[0] += 10
        log_metrics("rl", {"step": step, "loss": 0.1, "elapsed_s": 10.0 * (step + 1)})
    rep.log("Chat RL", {"stage": "rl", "final_step": 5, "final_val_bpb": None})
    rep.log("Chat evaluation rl", {"stage": "rl", "temperature": 0.0, "GSM8K": 0.05, "ChatCORE metric": 0.01})
    clock[0] += 86400   # generated a day later
    text = rep.generate(hourly_cost=3.6).read_text()
    rows = parse_table(text.splitlines(), "| Stage |")[2:]
    assert rows == [["base", "60", "0:02:02"], ["Base model evaluation", "", "0:00:15"], ["mid", "30", "0:01:48"],
                    ["sft", "30", "0:01:08"], ["Chat evaluation sft", "", "not logged"], ["rl", "5", "0:00:50"],
                    ["Chat evaluation rl", "", "not logged"], ["total", "", "0:06:04"]]
    assert "- not in the total (their time was not logged): Chat evaluation sft, Chat evaluation rl" in text
    # 129 + 20 + 115.5 + 75.2 + 54 + 50 s: from the first stage's start to the RL evaluation
    assert "from the first training stage's start to the last logged entry: 0:07:24" in text
    assert "- estimated cost at $3.60/h: $0.36 for the table's total, $0.44 for the whole run" in text
    summary = {r[0]: r[1:] for r in parse_table(text.splitlines(), "| Metric |")[2:]}
    assert summary["GSM8K"] == ["-", "-", "0.0000", "0.0500"] and summary["val bpb (own data)"][3] == "-"
    assert list(report_mod.read_metrics()) == ["base", "mid", "sft", "rl"]
    clock[0] = 1_700_000_000.0
    rep.reset()   # the whole run from `reset`: to its last entry, not to `generate` an hour later
    clock[0] += 100
    rep.log("Base model evaluation", {"stage": "base", "seconds": 40.0})
    clock[0] += 3600
    assert "from `reset` to the last logged entry: 0:01:40" in rep.generate().read_text()


def test_runs_of_a_stage_say_which_is_current_and_what_changed(base, clock):
    """A stage run twice (or resumed) showed two full entries alike: which one the summary, plots and
    time table describe, and what differed, was left to the reader."""
    rep = gpu_like_run(base, clock)
    clock[0] += 100
    rep.log("Midtraining", {"stage": "mid", "final_step": 60, "final_val_bpb": 1.5,
                            "config": {"recipe": "v2", "grad_clip": 0.0, "matrix_lr": 0.03, "num_iterations": 60,
                                       "target_param_data_ratio": 20.0, "resume": 30}})
    body = section_body(rep.generate().read_text(), "Midtraining")
    notes = [ln for ln in body if ln.startswith("Run ")]
    assert notes == ["Run 1 of 2 of this stage: superseded by the latest below (the summary, plots and time table "
                     "describe that one).",
                     "Run 2 of 2 of this stage (the latest); flags changed since run 1: `matrix_lr` 0.02 -> 0.03, "
                     "`num_iterations` 30 -> 60, `resume` None -> 30."]
    assert body.index(notes[0]) < body.index("- final_val_bpb: 1.5682") < body.index(notes[1])


def test_git_info_names_what_makes_the_tree_dirty(tmp_path):
    """`git_dirty: True` alone left the reader guessing what differed from the recorded sha."""
    import shutil
    import subprocess
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    for name in ("a.py", "b.py"):
        (tmp_path / name).write_text("x = 1\n")
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=tmp_path, check=True)
    clean = report_mod.git_info(tmp_path)
    assert clean["git_dirty"] is False and "git_changes" not in clean and len(clean["git_sha"]) == 40
    (tmp_path / "a.py").write_text("x = 2\n")
    for i in range(6):
        (tmp_path / f"new{i}.txt").write_text("")
    info = report_mod.git_info(tmp_path)
    assert info["git_dirty"] is True
    assert info["git_changes"] == "7 file(s): M a.py, ?? new0.txt, ?? new1.txt, ?? new2.txt, ?? new3.txt, and 2 more"


def test_a_partial_score_keeps_the_complete_current_one(base, clock):
    """chat_eval -a GSM8K after a full chat_eval of the same model replaced its ChatCORE with the
    one-task "ChatCORE (partial)" of the second run."""
    rep = gpu_like_run(base, clock)
    rep.log("Chat evaluation sft", {"stage": "sft", "temperature": 0.0, "GSM8K": 0.1, "ChatCORE metric": 0.0,
                                    "ChatCORE complete": False})
    cells = rep.summary_cells()
    assert cells["ChatCORE"]["sft"] == (0.0694, []) and cells["GSM8K"]["sft"] == (0.1, [])
    clock[0] += 1
    rep.log("Chat SFT", {"stage": "sft", "final_step": 30})   # retrained: the complete score is stale now
    rep.log("Chat evaluation sft", {"stage": "sft", "temperature": 0.0, "ChatCORE metric": 0.02,
                                    "ChatCORE complete": False})
    assert rep.summary_cells()["ChatCORE"]["sft"] == (0.02, ["partial"])
