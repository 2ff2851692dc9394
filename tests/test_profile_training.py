"""scripts/profile_training: the GPU's busy and idle time from profiler events; --accum profiles whole steps."""

from types import SimpleNamespace as NS

from scripts.profile_training import device_busy

CUDA, CPU = NS(name="CUDA"), NS(name="CPU")


def _ev(kind, start, end, name):
    return NS(device_type=kind, time_range=NS(start=start, end=end), name=name)


def test_busy_is_the_union_of_kernel_intervals_and_gaps_name_their_neighbours():
    events = [_ev(CUDA, 0, 10, "gemm"), _ev(CUDA, 5, 12, "norm"),      # overlap: counted once
              _ev(CPU, 0, 1000, "aten::mm"),                             # host events are ignored
              _ev(CUDA, 42, 50, "attn"), _ev(CUDA, 44, 46, "inside"),    # nested in attn: no gap
              _ev(CUDA, 55, 60, "add")]
    out = device_busy(events, steps=1)
    assert out["span_ms_per_step"] == 0.06
    assert out["busy_ms_per_step"] == 0.025          # 12 + 8 + 5 us
    assert out["idle_ms_per_step"] == 0.035          # 30 + 5 us
    assert out["gaps_over_20us_per_step"] == 1
    assert out["largest_gaps"][0] == {"us": 30, "after": "norm", "before": "attn"}
    assert out["largest_gaps"][1] == {"us": 5, "after": "attn", "before": "add"}
    assert out["kernels_per_step"] == 5
    assert out["short_kernels"]["under_10us"] == {"per_step": 4, "ms_per_step": 0.022}   # 7 + 8 + 2 + 5 us
    assert out["short_kernels"]["under_50us"] == {"per_step": 5, "ms_per_step": 0.032}


def test_per_step_division_and_no_kernels():
    events = [_ev(CUDA, 0, 100, "a"), _ev(CUDA, 200, 300, "b")]
    assert device_busy(events, steps=2)["busy_ms_per_step"] == 0.1
    assert device_busy([_ev(CPU, 0, 5, "x")], steps=1) == {}


def test_accum_profiles_every_micro_batch_of_a_step(capsys):
    """--accum n profiles a step as base_train runs it: n forwards + backwards, then one optimizer step."""
    import json

    from scripts.profile_training import main

    calls = {}
    for accum in (1, 3):
        main(["--device", "cpu", "--depth", "1", "--device-batch-size", "1", "--seq", "16", "--vocab", "64",
              "--no-compile", "--steps", "1", "--warmup", "0", "--profile-steps", "1", "--top", "200",
              "--accum", str(accum)])
        rows = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith('{"kernel"')]
        calls[accum] = {r["kernel"]: r["calls_per_step"] for r in rows}
    assert calls[3]["aten::embedding"] == 3 * calls[1]["aten::embedding"]
    assert calls[3]["Optimizer.step#MuonAdamW.step"] == calls[1]["Optimizer.step#MuonAdamW.step"] == 1


def test_trace_path_and_precision_are_checked_before_any_model(tmp_path, monkeypatch):
    """--trace was written after the whole profile (a directory: a traceback at the end), and a
    --precision the device cannot run was found only after the model was built."""
    import pytest

    from scripts import profile_training as PT

    with pytest.raises(ValueError, match="--trace: got"):
        PT.parse_args(["--trace", str(tmp_path)])
    assert PT.parse_args(["--trace", str(tmp_path / "new" / "t.json")]).trace.endswith("t.json")

    def no_model(*a, **k):
        raise AssertionError("the model was built before the precision check")
    monkeypatch.setattr(PT, "build", no_model)
    with pytest.raises(ValueError, match="--precision fp8: needs an NVIDIA GPU"):
        PT.main(["--device", "cpu", "--precision", "fp8", "--depth", "1", "--no-compile"])


def test_explicit_precision_runs_in_its_own_dtype():
    """`--precision fp32` on a GPU ran the model in bf16 (the runtime's auto dtype) and labelled it fp32."""
    from nanochat.precision_request import runtime_dtype   # what profile_training starts in

    assert [runtime_dtype(p) for p in ("auto", "bf16", "fp32", "fp8", "nvfp4")] == ["auto", "bf16", "fp32", "bf16", "bf16"]
