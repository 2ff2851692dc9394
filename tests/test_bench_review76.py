"""Review 76 of the benchmark and analysis scripts, run as a user of a DGX Spark would run them at
their smallest CPU settings (GB10 device properties simulated): what the printed figures say they
are (measured, spec-derived, compared with what), their units, and what --help says. CPU only."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
import torch

from nanochat.platform import DEVICE_TABLE, SimpleProps, detect_device

GB10 = detect_device(props=SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9, is_integrated=True))


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


# ------------------------------------------------------------------ GB10's figures: spec-derived, not measured

def test_gb10_source_does_not_present_others_gemm_rates_as_measured_here():
    """The table's GB10 source read "spec-derived from 1 PFLOP FP4 sparse; measured ~82 bf16 / ~180
    fp8 / ~356 nvfp4": printed beside GB10 figures (bench_gemm's peak_source, analyze_bandwidth's
    --predict label, base_train's banner) as if this project had measured them. No GB10 has run this
    code; the rates are community benchmarks (DESIGN.md s3: ~82 bf16, ~170-188 fp8, ~356 nvfp4)."""
    from scripts.analyze_bandwidth import prediction_label

    for spec in (DEVICE_TABLE["gb10"], GB10):
        assert "spec-derived" in spec.source and "not measured here" in spec.source
        assert "community" in spec.source and "~170-188 fp8" in spec.source
        assert "; measured" not in spec.source
    # the table's numbers against DESIGN.md's hardware facts
    assert GB10.peak_tflops == {"bf16": 125.0, "fp8": 250.0, "nvfp4": 500.0, "fp32": 62.5}
    assert (GB10.bandwidth_gbs, GB10.sms, GB10.cc, GB10.unified_memory) == (273, 48, (12, 1), True)
    label = prediction_label(DEVICE_TABLE["gb10"])
    assert label.startswith("PREDICTION, not a measurement") and "not measured here" in label


# ------------------------------------------------------------------ benchmark_kernels: agreement reference

def _model_args(*extra):
    from scripts import benchmark_kernels as BK
    return BK.parse_args(["--device", "cpu", "--mode", "model", "--depth", "1", "--device-batch-size", "2",
                          "--seq", "16", "--vocab", "64", "--reps", "3", "--no-compile", *extra])


def _bench_model(monkeypatch, args, ms=1.0):
    from nanochat.common import destroy_runtime, init_runtime
    from scripts import benchmark_kernels as BK

    monkeypatch.setattr(BK, "_timed", lambda fn, reps, device, inner=1: ms)   # no timing loop: not what this checks
    rt = init_runtime("cpu", "fp32")
    try:
        return BK.bench_model(args, rt)
    finally:
        destroy_runtime(rt)


def test_model_mode_rows_are_compared_with_current_bf16_whatever_the_flag_order(base, monkeypatch, capsys):
    """The docstring promises agreement with current+bf16; the reference was whichever row ran first:
    with --kernels triton,current --precisions fp32,bf16 every row was compared with triton/fp32
    (current/bf16 itself showed an error of 7e-7), and no row said what it was compared with."""
    rows = _bench_model(monkeypatch, _model_args("--kernels", "triton,current", "--precisions", "fp32,bf16"))
    printed = _json_lines(capsys.readouterr().out)
    assert [(r["kernel"], r["precision"]) for r in printed] == [
        ("current", "bf16"), ("triton", "fp32"), ("current", "fp32"), ("triton", "bf16")]
    assert all("error" not in r for r in rows), rows
    assert {r["ref"] for r in printed} == {"current/bf16"}
    assert printed[0]["loss_rel_err"] == 0.0 and printed[0]["head_grad_rel_err"] == 0.0
    assert printed[2]["loss_rel_err"] > 0   # current in fp32 against bf16: another dtype, really compared


def test_model_mode_without_the_reference_names_the_row_it_compares_with(base, monkeypatch, capsys):
    _bench_model(monkeypatch, _model_args("--kernels", "triton", "--precisions", "fp32"))
    (row,) = _json_lines(capsys.readouterr().out)
    assert row["ref"] == "triton/fp32" and row["loss_rel_err"] == 0.0


def test_loss_mode_runs_current_first_so_every_row_is_compared(monkeypatch, capsys):
    """--kernels triton,current: the triton row ran before `current` and printed no agreement at all."""
    from scripts import benchmark_kernels as BK

    args = NS(rows=64, n_embd=16, vocab=128, kernels=["triton", "current"], compile=False, softcap=15.0, reps=3)
    BK.bench_loss(args, torch.device("cpu"))
    rows = _json_lines(capsys.readouterr().out)
    assert [r["kernel"] for r in rows] == ["current", "triton"]
    assert rows[1]["loss_rel_err"] is not None and rows[1]["loss_rel_err"] < 1e-4


# ------------------------------------------------------------------ benchmark_kernels: units and MFU's peak

def test_table_speed_column_carries_each_rows_unit(capsys):
    """One column held tok/s (model), TFLOP/s (loss) and GB/s (cast) as bare numbers."""
    from scripts import benchmark_kernels as BK

    BK.print_table([{"mode": "loss", "kernel": "current", "ms": 1.0, "tflops": 412.3},
                    {"mode": "model", "kernel": "current", "precision": "bf16", "ms": 2.0, "tok_per_sec": 150000},
                    {"mode": "cast", "kernel": "64x64w4m", "ms": 0.1, "gbs": 850.5}])
    lines = capsys.readouterr().out.splitlines()
    assert "412.3 TFLOP/s" in lines[2] and "150,000 tok/s" in lines[3] and "850.5 GB/s" in lines[4]


def test_model_rows_say_what_their_mfu_divides_by_on_a_gb10(base, monkeypatch, capsys):
    """A GB10 row's MFU is against the table's spec-derived 125 TFLOP/s; the row said only "mfu_pct".
    With --peak-flops (a measured GEMM peak) the row says so."""
    from nanochat.gpt import GPT, config_for_depth
    from scripts import benchmark_kernels as BK

    with torch.device("meta"):
        flops = GPT(config_for_depth(1, 64, 16)).estimate_flops()
    ms = 1e3 * flops * 2 * 16 / (0.5 * 125e12)   # a step time that is 50% of GB10's table peak
    monkeypatch.setattr(BK, "detect_device", lambda device: GB10)
    (row,) = _bench_model(monkeypatch, _model_args("--kernels", "current", "--precisions", "fp32"), ms)
    assert row["mfu_pct"] == 50.0 and row["mfu_peak_tflops"] == 125.0
    assert "spec-derived" in row["peak_source"] and "not measured here" in row["peak_source"]
    (row,) = _bench_model(monkeypatch, _model_args("--kernels", "current", "--precisions", "fp32",
                                                   "--peak-flops", "82e12"), ms)
    assert row["mfu_peak_tflops"] == 82.0 and row["peak_source"] == "--peak-flops"
    assert row["mfu_pct"] == round(50.0 * 125 / 82, 1)
    capsys.readouterr()


# ------------------------------------------------------------------ bench_train: the peaks in the row

def test_bench_train_rows_say_the_peaks_mfu_divides_by(base, capsys):
    from scripts import bench_train

    argv = ["--device", "cpu", "--depth", "1", "--device-batch-size", "2", "--seq", "16", "--steps", "1",
            "--warmup", "0", "--vocab-size", "64", "--no-compile", "--aspect-ratio", "32", "--head-dim", "32",
            "--total-batch-size", "32"]
    (row,) = bench_train.main(argv + ["--peak-flops", "82e12"])
    assert row["peaks"] == "bf16 8.2000e+13 (--peak-flops)" and row["mfu_pct"] is not None
    (row,) = bench_train.main(argv)
    assert row["mfu_pct"] is None and row["peaks"].startswith("n/a")
    assert [r["peaks"] for r in _json_lines(capsys.readouterr().out)][-1] == row["peaks"]


# ------------------------------------------------------------------ bench_serving: the table's units

def test_serving_table_names_its_units(capsys):
    """Latency and TTFT columns are seconds; the header named no unit (load_test prints ms)."""
    from scripts import bench_serving as BS

    BS.print_table([{"slots": 8, "tok_per_s": 1281.8, "latency_p50_s": 0.023, "latency_p95_s": 0.5,
                     "ttft_p50_s": 0.0097, "ttft_p95_s": 0.01, "mean_batch": 2.43}])
    header, row = capsys.readouterr().out.strip().splitlines()
    for col in ("lat p50 s", "lat p95 s", "ttft p50 s", "ttft p95 s", "tok/s", "mean batch"):
        assert col in header
    assert row.split() == ["8", "1281.8", "0.02", "0.50", "0.010", "0.010", "2.43"]


# ------------------------------------------------------------------ --help says what each flag does

def _help(parse, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(["--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())   # argparse's line wrapping undone


def test_help_texts_name_units_modes_and_accepted_values(capsys):
    """bench_train's --peak-flops had no help (its unit, FLOP/s, unsaid; a table's 989 is TFLOP/s);
    benchmark_kernels' --rows said "loss mode" (cast mode sizes by it too) and --softcap nothing of
    model mode; bench_serving's --graph-step and --decode listed no values; bench_gemm's --dtypes
    left out that --qk takes bf16 only."""
    from nanochat.engine import DECODE_MODES, GRAPH_STEPS
    from scripts import bench_gemm, bench_serving, bench_train, benchmark_kernels

    text = _help(bench_train.parse_config, capsys)
    assert "dense bf16 FLOP/s per GPU that MFU divides by (e.g. 989e12)" in text
    assert "--attn-backend ATTN_BACKEND auto|" in text and "--device DEVICE auto|cpu" in text
    text = _help(benchmark_kernels.parse_args, capsys)
    assert "--rows ROWS loss and cast modes" in text and "(model mode: the model's own)" in text
    assert "--depth DEPTH model mode" in text and "--seq SEQ model and rope modes" in text
    text = _help(bench_serving.parse_args, capsys)
    assert "|".join(DECODE_MODES) in text and "|".join(GRAPH_STEPS) in text
    text = _help(bench_gemm.parse_args, capsys)
    assert "with --qk: bf16" in text
