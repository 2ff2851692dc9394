"""The benchmark scripts' command lines where they have no test file of their own (bench_train,
bench_scaling) and across the GPU-sized benchmarks: on a machine without CUDA `--device auto` says
so in one line instead of running d20-sized defaults on the CPU; bad flags fail before any model."""

from __future__ import annotations

import importlib

import pytest
import torch

from nanochat.errors import RequestError

GPU_SIZED = ["bench_train", "bench_train_floor", "bench_inference", "bench_serving", "bench_optim",
             "bench_checkpoint", "profile_training", "benchmark_kernels", "bench_scaling"]


def _no_work(*args, **kwargs):
    raise AssertionError("the benchmark started working instead of refusing --device auto")


@pytest.mark.parametrize("name", GPU_SIZED)
def test_auto_device_without_cuda_refuses_in_one_line_before_any_work(name, monkeypatch):
    """Each of these ran its GPU-sized defaults on the CPU for many minutes without a word (bench_scaling:
    five torchrun launches of d12/d20 workers), where the user wanted to hear that CUDA is missing."""
    import nanochat.common

    mod = importlib.import_module(f"scripts.{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(nanochat.common, "init_runtime", _no_work)
    for attr in ("init_runtime", "launch"):   # names bound at import; bench_scaling's torchrun launcher
        if hasattr(mod, attr):
            monkeypatch.setattr(mod, attr, _no_work)
    with pytest.raises(RequestError, match="^--device auto: no CUDA GPU is visible.*--device cpu") as err:
        mod.main([])
    assert mod.SMOKE_RUN in str(err.value) and "--device cpu" in mod.SMOKE_RUN


def test_an_explicit_device_or_a_visible_gpu_passes_the_check(monkeypatch):
    from nanochat.platform import check_benchmark_device

    check_benchmark_device("cpu", "x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_benchmark_device("auto", "x")


# ------------------------------------------------------------------ bench_train

@pytest.mark.parametrize("argv, flag", [
    (["--depth", ""], "--depth"),                        # ran nothing and exited 0
    (["--peak-flops", "nan"], "--peak-flops"),           # MFU nan%
    (["--peak-flops", "-1"], "--peak-flops"),            # negative MFU on a CPU, an error row per config on a GPU
    (["--peak-flops", "989"], "--peak-flops"),           # TFLOP/s where FLOP/s is meant
    (["--window-pattern", "SX"], "--window-pattern"),    # the rest: an error row per configuration
    (["--attn-backend", "flash"], "--attn-backend"),
    (["--device", "tpu"], "--device"),
    (["--aspect-ratio", "0"], "--aspect-ratio"),
    (["--head-dim", "3"], "--head-dim"),
    (["--total-batch-size", "1000"], "--total-batch-size"),
])
def test_bench_train_bad_flags_fail_before_any_model(argv, flag):
    from scripts import bench_train
    with pytest.raises(ValueError, match=f"^{flag}: got"):
        bench_train.parse_config(argv)


def test_bench_train_too_few_gpu_steps_is_a_one_line_error(monkeypatch):
    """It raised a plain ValueError from main(), which script_main reports with a traceback."""
    from types import SimpleNamespace

    from scripts import bench_train
    monkeypatch.setattr(bench_train, "init_runtime", lambda *a, **k: SimpleNamespace(device_type="cuda", ddp=False))
    with pytest.raises(RequestError, match="--steps: got 3"):
        bench_train.main(["--device", "cuda", "--steps", "3"])


def test_bench_train_rows_say_the_dtype_that_ran(capsys):
    """One runtime served every --precision: `fp32` ran in the runtime's bf16 on a GPU (and `bf16` in
    fp32 on a CPU) but its row said fp32, with utilisation against the TF32 peak."""
    from scripts import bench_train
    rt = bench_train.init_runtime("cpu", "fp32")
    assert bench_train.runtime_for(rt, "fp32") is rt and bench_train.runtime_for(rt, "auto") is rt
    assert bench_train.runtime_for(rt, "bf16").dtype == bench_train.runtime_for(rt, "fp8lean").dtype == torch.bfloat16
    rows = bench_train.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "2", "--seq", "32", "--steps", "1",
                             "--warmup", "0", "--vocab-size", "256", "--no-compile", "--aspect-ratio", "32",
                             "--head-dim", "32", "--total-batch-size", "64", "--precision", "auto,bf16"])
    assert [(r["precision"], r.get("error")) for r in rows] == [("fp32", None), ("bf16", None)]
    capsys.readouterr()


# ------------------------------------------------------------------ bench_scaling

def test_bench_scaling_refuses_an_empty_part_list_and_cuda_without_gpus(monkeypatch):
    """`--parts ""` launched nothing, checked nothing and exited 0 (a pass); `--device cuda` without a
    GPU launched every torchrun worker only to have each fail the same way."""
    from scripts import bench_scaling
    with pytest.raises(ValueError, match="^--parts: got ''"):
        bench_scaling.parse_args(["--parts", ""])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench_scaling, "launch", _no_work)
    with pytest.raises(RequestError, match="--device cuda: needs CUDA GPUs"):
        bench_scaling.main(["--device", "cuda"])


def test_profile_dataloader_refuses_cuda_batches_without_a_gpu(monkeypatch):
    """--device cuda on a machine without CUDA pretokenized, then failed in the loader's thread
    (pinned memory needs the driver)."""
    from scripts import profile_dataloader
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device: got 'cuda'; accepted: cpu \(no CUDA GPU is visible\)"):
        profile_dataloader.parse_args(["--device", "cuda"])
    assert profile_dataloader.parse_args(["--device", "cpu"]).device == "cpu"


def test_benchmark_kernels_patches_for_every_loss_backend_it_runs(monkeypatch, capsys):
    """Only 'liger' or 'current' reached apply_patches: `--kernels triton --no-compile` ran the
    Triton loss without the ptxas redirect that Triton <= 3.5 needs on a GB10."""
    from scripts import benchmark_kernels
    seen = []
    monkeypatch.setattr(benchmark_kernels, "apply_patches", lambda spec, kernel, compile: seen.append((kernel, compile)))
    assert benchmark_kernels.main(["--device", "cpu", "--mode", "rope", "--kernels", "triton@4096,liger",
                                   "--no-compile"]) == 1   # rope needs CUDA: nothing measured
    assert seen == [("triton", False), ("liger", False)]
    capsys.readouterr()
