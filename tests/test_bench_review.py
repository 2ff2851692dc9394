"""Review of the benchmark scripts as a DGX Spark user runs them: non-finite results (a kernel
config or precision computing NaN) stay valid JSON and are flagged, the loss benchmark's memory
baseline, the versions and config a result line carries, and what a CUDA-only script says on a
machine without a GPU. Everything runs on the CPU; the GPU timing calls are test doubles."""

from __future__ import annotations

import json
from types import SimpleNamespace as NS

import pytest
import torch

from nanochat.errors import RequestError


def _strict_json_lines(text: str) -> list[dict]:
    """Every `{...}` line parsed as strict JSON (NaN / Infinity literals refused)."""
    def refuse(literal):
        raise ValueError(f"non-JSON literal {literal}")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines() if line.startswith("{")]


# ------------------------------------------------------------------ bench_attention

@pytest.mark.parametrize("nan_in", ["out", "dk"])
def test_attention_nan_errors_are_flagged_and_valid_json(monkeypatch, capsys, nan_in):
    """A sweep config whose output or gradient holds NaN: `NaN > 2e-2` is False and max() kept the
    NaN only when it came first, so the row was not flagged (or flagged by a finite error only), and
    its JSON line carried a NaN literal."""
    from scripts import bench_attention as BA

    shape = (1, 2, 8, 4)
    ref = tuple(torch.zeros(shape) for _ in range(4))
    bad = {"out": 0, "dq": 1, "dk": 2, "dv": 3}[nan_in]
    got = [torch.zeros(shape) for _ in range(4)]
    got[bad][0, 0, 0, 0] = float("nan")
    monkeypatch.setattr(BA, "time_layer", lambda *a: (2.0, 1.0, got[0], got[1:]))
    cfg = BA.BenchConfig(batch=1, heads=2, kv_heads=2, seq=8, head_dim=4, window=4, reps=3, warmup=1)
    tensors = tuple(torch.zeros(shape) for _ in range(4))
    rec, _ = BA.run_row(cfg, "cfg0", "window", {}, 4, "sdpa_flex", tensors, ref)
    assert rec["err_flag"] is True and rec["max_err"] is None and rec["errs"][nan_in] is None
    print(json.dumps(rec))
    assert _strict_json_lines(capsys.readouterr().out) == [json.loads(json.dumps(rec))]
    BA.print_table([{**rec, "config": {}}])   # the table shows it instead of failing on None
    assert "non-finite !" in capsys.readouterr().out


def test_attention_finite_errors_keep_their_value_and_flag(monkeypatch):
    from scripts import bench_attention as BA

    shape = (1, 2, 8, 4)
    ref = tuple(torch.zeros(shape) for _ in range(4))
    got = [torch.full(shape, v) for v in (0.001, 0.05, 0.0, 0.0)]
    monkeypatch.setattr(BA, "time_layer", lambda *a: (2.0, 1.0, got[0], got[1:]))
    cfg = BA.BenchConfig(batch=1, heads=2, kv_heads=2, seq=8, head_dim=4, window=4, reps=3, warmup=1)
    rec, _ = BA.run_row(cfg, "cfg0", "window", {}, 4, "sdpa_flex", tuple(torch.zeros(shape) for _ in range(4)), ref)
    assert rec["max_err"] == pytest.approx(0.05) and rec["err_flag"] is True
    got[1] = torch.full(shape, 0.01)
    rec, _ = BA.run_row(cfg, "cfg0", "window", {}, 4, "sdpa_flex", tuple(torch.zeros(shape) for _ in range(4)), ref)
    assert rec["max_err"] == pytest.approx(0.01) and rec["err_flag"] is False


# ------------------------------------------------------------------ benchmark_kernels

def _loss_args(**kw):
    base = dict(rows=64, n_embd=16, vocab=128, kernels=["current", "triton"], compile=False, softcap=15.0, reps=3)
    return NS(**{**base, **kw})


def test_kernel_rows_with_a_nan_loss_are_valid_json_and_an_error(monkeypatch, capsys):
    """A loss backend returning NaN printed `"loss": NaN` and NaN relative errors: not JSON."""
    from scripts import benchmark_kernels as BK

    def nan_loss(*a, **kw):
        def fn(h, w, t, softcap, vocab, reduction):
            return (h @ w.t()).sum() * float("nan")
        return fn
    monkeypatch.setattr(BK, "build_loss_fn", nan_loss)
    rows = BK.bench_loss(_loss_args(), torch.device("cpu"))
    lines = _strict_json_lines(capsys.readouterr().out)
    assert [r["kernel"] for r in lines] == ["current", "triton"]
    assert "error" not in lines[0] and lines[0]["loss"] > 0
    bad = lines[1]
    assert bad["loss"] is None and bad["loss_rel_err"] is None and "non-finite" in bad["error"]
    assert "loss" in bad["error"] and rows[1]["error"] == bad["error"]


def test_loss_memory_baseline_holds_no_warmup_gradients(monkeypatch, capsys):
    """The memory baseline was read with the last warm-up step's gradients of h and w alive; the
    first timed step frees them, so the peak "above the inputs" came out short by their size."""
    from scripts import benchmark_kernels as BK

    seen = []

    def timed(fn, reps, device, inner=1):
        cells = [c.cell_contents for c in fn.__closure__ or ()]
        leaves = [t for t in cells if isinstance(t, torch.Tensor) and t.requires_grad]
        assert len(leaves) == 2   # h and w
        seen.append([t.grad is None for t in leaves])
        return 1.0
    monkeypatch.setattr(BK, "_timed", timed)
    BK.bench_loss(_loss_args(kernels=["current"]), torch.device("cpu"))
    capsys.readouterr()
    assert seen == [[True, True]]


def test_kernel_header_names_the_triton_version(monkeypatch, capsys):
    from scripts import benchmark_kernels as BK

    monkeypatch.setattr(BK, "bench_loss", lambda args, device: [])
    BK.main(["--device", "cpu", "--mode", "loss", "--rows", "8", "--n-embd", "8", "--vocab", "16", "--reps", "3",
             "--no-compile"])
    header = _strict_json_lines(capsys.readouterr().out)[0]
    assert header["header"] and header["torch"] == torch.__version__
    assert "triton" in header and header["triton"] == BK.triton_version()


# ------------------------------------------------------------------ analyze_bandwidth

def test_roofline_summary_carries_versions_and_config(monkeypatch, capsys):
    """The roofline's JSON lines named the device only: not the torch / triton it ran under, nor the
    depth, batch, sequence, vocab and loss kernel the figures are for."""
    import nanochat.common
    from nanochat.platform import DEVICE_TABLE
    from scripts import analyze_bandwidth as A

    monkeypatch.setattr(nanochat.common, "init_runtime", lambda *a: NS(device=NS(type="cuda")))
    monkeypatch.setattr(A, "detect_device", lambda device: DEVICE_TABLE["gb10"])
    monkeypatch.setattr(A, "measure_ops", lambda *a: {"attn_proj_gemms": 1.0, "mlp_gemms": 1.0, "attention": 1.0,
                                                     "lm_head_loss": 1.0})
    monkeypatch.setattr(A, "measure_step", lambda *a: (10.0, 1.0))
    A.main(["--depth", "2", "--seq", "32", "--device-batch-size", "2", "--vocab", "256", "--kernel", "triton"])
    summary = _strict_json_lines(capsys.readouterr().out)[-1]
    assert summary["device"] == "NVIDIA GB10 (DGX Spark)" and summary["torch"] == torch.__version__
    assert "triton" in summary
    assert {k: summary[k] for k in ("depth", "device_batch_size", "seq", "vocab", "kernel")} == \
        {"depth": 2, "device_batch_size": 2, "seq": 32, "vocab": 256, "kernel": "triton"}


# ------------------------------------------------------------------ CUDA-only scripts without a GPU

@pytest.mark.parametrize("name, argv", [("analyze_bandwidth", []), ("bench_gemm", ["--dtypes", "bf16"]),
                                        ("bench_attention", ["--no-sweep"])])
def test_cuda_only_scripts_say_what_to_run_instead(name, argv, monkeypatch):
    """Each said only that no GPU is visible; now: that there is no CPU variant and the command to run
    on the GPU machine (before any work: init_runtime is the first thing analyze_bandwidth builds)."""
    import importlib

    import nanochat.common

    mod = importlib.import_module(f"scripts.{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(nanochat.common, "init_runtime", lambda *a: NS(device=NS(type="cpu")))
    with pytest.raises(RequestError, match="no CPU variant") as err:
        mod.main(argv)
    assert f"python -m scripts.{name}" in str(err.value)


# ------------------------------------------------------------------ bench_checkpoint

def test_checkpoint_rows_name_the_device_not_its_type(monkeypatch, tmp_path, capsys):
    """Its rows said "cuda" on every GPU (str(rt.device)); the other benchmarks print the device's name."""
    from nanochat.platform import DEVICE_TABLE
    from scripts import bench_checkpoint as BC

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setattr(BC, "detect_device", lambda device: DEVICE_TABLE["gb10"])
    rows = BC.main(["--device", "cpu", "--depth", "1", "--vocab-size", "64", "--reps", "1", "--dir", str(tmp_path)])
    lines = _strict_json_lines(capsys.readouterr().out)
    assert [r["device"] for r in rows] == [r["device"] for r in lines] == ["NVIDIA GB10 (DGX Spark)"] * 2
