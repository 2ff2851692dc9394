"""benchmark_kernels --compile-mode: validated before any work; the rows say which mode ran."""

import json

import pytest

from scripts import benchmark_kernels as bk


def test_compile_mode_is_checked_by_name():
    assert bk.parse_args(["--compile-mode", "reduce-overhead"]).compile_mode == "reduce-overhead"
    with pytest.raises(ValueError, match="--compile-mode.*--no-compile"):
        bk.parse_args(["--compile-mode", "reduce-overhead", "--no-compile"])
    with pytest.raises((ValueError, SystemExit)):
        bk.parse_args(["--compile-mode", "max-autotune"])


def test_reduce_overhead_on_a_cpu_is_refused_before_work():
    with pytest.raises(ValueError, match="--compile-mode: 'reduce-overhead' replays CUDA graphs, this run is on cpu"):
        bk.main(["--device", "cpu", "--mode", "model", "--compile-mode", "reduce-overhead"])


def test_model_rows_name_the_compile_mode(capsys):
    assert bk.main(["--device", "cpu", "--mode", "model", "--depth", "1", "--device-batch-size", "1", "--seq", "32",
                    "--precisions", "bf16", "--kernels", "current", "--reps", "1", "--no-compile", "--vocab", "256"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    model = [r for r in rows if r.get("mode") == "model"]
    assert model and model[0]["compile_mode"] == "default" and model[0]["ms"] > 0 and "error" not in model[0]
