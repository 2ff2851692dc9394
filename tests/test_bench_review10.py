"""Review 10 of the benchmark scripts, run on CPU at tiny sizes: bench_sampler's top-k cases at
small vocabularies and its silently dropped Triton cases, benchmark_kernels' cut-off error rows."""

import json

import pytest


def test_bench_sampler_refuses_a_vocab_no_larger_than_its_top_k():
    """--vocab-size 10 crashed mid-run in torch.topk ("selected index k out of range") after the
    first rows were printed; at 50 the "top-k 50" rows timed unmasked sampling."""
    from scripts.bench_sampler import parse_args

    for vocab in ("10", "50"):
        with pytest.raises(ValueError, match=r"--vocab-size: got \d+; accepted: an integer > 50"):
            parse_args(["--device", "cpu", "--vocab-size", vocab])
    with pytest.raises(ValueError, match=r"--vocab-size: got 100; accepted: an integer > 200 with --device cuda"):
        parse_args(["--device", "cuda", "--vocab-size", "100"])
    assert parse_args(["--device", "cpu", "--vocab-size", "51"]).vocab_size == 51


def test_bench_sampler_small_vocab_runs_every_case_on_cpu(capsys):
    from scripts.bench_sampler import main

    assert main(["--device", "cpu", "--vocab-size", "64", "--calls", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {r["case"] for r in rows} >= {"t1 top-k 50", "multinomial t1 top-k 50", "kth_largest (k 50)"}
    assert all("skipped" not in r for r in rows)   # Triton is CUDA-only: a CPU run never lists it


def test_bench_sampler_says_why_triton_cases_are_missing():
    """On CUDA above the Triton sampler's vocabulary limit its cases were left out without a word."""
    pytest.importorskip("triton")
    from nanochat.triton_sample import MAX_TRITON_VOCAB
    from scripts.bench_sampler import triton_skip_reason

    reason = triton_skip_reason("cuda", MAX_TRITON_VOCAB + 1)
    assert reason and "--vocab-size" in reason and str(MAX_TRITON_VOCAB) in reason
    assert triton_skip_reason("cuda", MAX_TRITON_VOCAB) is None
    assert triton_skip_reason("cpu", MAX_TRITON_VOCAB + 1) is None


def test_benchmark_kernels_error_rows_keep_what_is_accepted():
    """An error row was cut at 160 characters: precision.py's refusal ended at "accepted on this
    device: --precision auto|bf16|fp32, " and lost its alternative; an empty message raised IndexError."""
    from scripts.benchmark_kernels import error_text

    msg = "--precision fp8: " + "x" * 150 + "; accepted on this device: --precision auto|bf16|fp32, or nvfp4 emulated"
    assert error_text(RuntimeError(msg + "\nsecond line")) == f"RuntimeError: {msg}"
    assert error_text(ValueError("")) == "ValueError: "


def test_benchmark_kernels_cpu_fp8_row_names_every_alternative(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    from scripts.benchmark_kernels import main

    argv = ["--device", "cpu", "--mode", "model", "--kernels", "current", "--precisions", "fp8", "--depth", "1",
            "--device-batch-size", "1", "--seq", "16", "--vocab", "256", "--reps", "1", "--no-compile"]
    assert main(argv) == 1   # the one row failed
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"mode"')]
    assert len(rows) == 1 and "--precision-backend emulated" in rows[0]["error"]
