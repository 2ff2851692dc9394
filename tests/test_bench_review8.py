"""Review 8 of the benchmark scripts: what a row's util() divides by (bench_train), and bad
--vocab-size values refused before any model is built (bench_inference)."""

from __future__ import annotations

import pytest


def test_bench_train_row_names_the_blended_peak_its_util_divides_by(monkeypatch, capsys):
    """An fp8/nvfp4 row's util_pct is against a peak blended from bf16 and the active precision
    (step_meter.blended_peak): the row said neither that peak nor the share, and the docstring
    called it the active precision's peak. Simulated: a GPU of bf16 1e12 / fp8 2e12 FLOP/s on
    which a third of the FLOPs run in fp8; util = FLOPs x tok/s over the harmonic blend by hand."""
    import nanochat.training as T
    from scripts import bench_train

    real_setup = T.setup_precision_and_kernel
    shares = {}

    def fake_setup(model, *a, **kw):
        info = real_setup(model, *a, **kw)
        shares["low"] = model.estimate_flops() / 3
        return {**info, "peak_key": "fp8", "low_precision_flops": shares["low"]}

    monkeypatch.setattr(T, "setup_precision_and_kernel", fake_setup)
    monkeypatch.setattr(T, "resolve_peak_flops", lambda rt, key, override, warn=None: (1e12, 2e12, "Fake GPU"))
    (row,) = bench_train.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "2", "--seq", "32",
                               "--steps", "1", "--warmup", "0", "--vocab-size", "256", "--no-compile",
                               "--aspect-ratio", "32", "--head-dim", "32", "--total-batch-size", "64"])
    capsys.readouterr()
    F = row["flops_per_token"]
    blended = F / (shares["low"] / 2e12 + (F - shares["low"]) / 1e12)   # 1.2e12 for a third at 2x
    assert blended == pytest.approx(1.2e12)
    assert row["util_peak_flops"] == pytest.approx(blended)
    assert row["low_precision_share"] == pytest.approx(1 / 3)
    assert row["util_pct"] == pytest.approx(100 * F * row["tok_per_sec"] / blended)
    assert row["mfu_pct"] == pytest.approx(100 * F * row["tok_per_sec"] / 1e12)


@pytest.mark.parametrize("vocab", ["1", "0"])
def test_bench_inference_refuses_a_vocab_below_two_naming_the_flag(vocab):
    """--vocab-size 1 passed the checks, built the model and died in the --ttft-lengths prompts
    with ZeroDivisionError (tokens cycle through 1..vocab-1)."""
    from scripts import bench_inference

    with pytest.raises(ValueError, match=r"--vocab-size: got .*accepted: an integer >= 2"):
        bench_inference.parse_args(["--device", "cpu", "--depth", "1", "--vocab-size", vocab, "--seq-len", "16",
                                    "--prompt-len", "4", "--decode-tokens", "2", "--ttft-lengths", "3"])
