"""Review 11 of the benchmark scripts as a DGX Spark (GB10) owner runs them, on CPU at tiny sizes with
the GB10 simulated (its device properties through nanochat.platform's SimpleProps; GPU clocks are
test doubles): figures checked by hand against GB10's table peaks (bench_gemm TFLOP/s and % of peak,
benchmark_kernels' MFU, analyze_bandwidth's roofline with --peak-flops / --bandwidth-gbs), a
--trace written whole or not at all (profile_training), an interrupted scratch pretokenize resumed
(profile_dataloader), the optimizer's queued work kept out of the first timed save
(bench_checkpoint), and flags refused before any work (--cores, --compare-python)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace as NS

import pytest
import torch

from nanochat.errors import RequestError
from nanochat.platform import SimpleProps, detect_device

GB10 = detect_device(props=SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9, is_integrated=True))


def _strict_json_lines(text: str) -> list[dict]:
    """Every `{...}` line parsed as strict JSON (NaN / Infinity literals refused)."""
    def refuse(literal):
        raise ValueError(f"non-JSON literal {literal}")
    return [json.loads(line, parse_constant=refuse) for line in text.splitlines() if line.startswith("{")]


def test_simulated_gb10_has_its_table_roofline():
    assert GB10.key == "gb10" and GB10.bandwidth_gbs == 273
    assert GB10.peak_tflops == {"bf16": 125.0, "fp8": 250.0, "nvfp4": 500.0, "fp32": 62.5}


# ------------------------------------------------------------------ bench_gemm on a GB10

class _ProductClock:
    """torch.cuda.Event on a clock that advances MS per product run: elapsed = products x MS."""
    MS = 20.0
    products = 0

    def __init__(self, enable_timing=True):
        self.n = None

    def record(self):
        self.n = _ProductClock.products

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return (other.n - self.n) * _ProductClock.MS


def _run_product():
    _ProductClock.products += 1


def test_gemm_tflops_and_percent_of_gb10_peak_by_hand(monkeypatch, capsys):
    """8192^3 products of 20 ms each: 2 x 8192^3 / 0.02 s = 54.98 TFLOP/s, i.e. 44.0% of GB10's bf16
    125, 22.0% of its fp8 250 (row-wise fp8 the same peak) and 11.0% of its nvfp4 500 TFLOP/s. The
    header names those peaks and their source (spec-derived on a GB10): the rows' % could not be
    checked against anything printed."""
    from scripts import bench_gemm as BG

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: NS(L2_cache_size=24 * 2**20))
    monkeypatch.setattr(torch.cuda, "Event", _ProductClock)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(BG, "detect_device", lambda d: GB10)
    monkeypatch.setattr(BG, "make_operands", lambda *a: _run_product)
    assert BG.main(["--shapes", "8192x8192x8192", "--reps", "3"]) == 0
    header, *rows = _strict_json_lines(capsys.readouterr().out)
    rate = 2 * 8192**3 / 20e-3
    assert round(rate / 1e12, 1) == 55.0
    want = {"bf16": 44.0, "fp8": 22.0, "fp8-rowwise": 22.0, "nvfp4": 11.0}
    assert {r["dtype"]: r["pct_of_peak"] for r in rows} == want
    for r in rows:
        assert r["ms"] == 20.0 and r["tflops"] == 55.0 and r["spread_pct"] == 0.0
        assert r["pct_of_peak"] == round(100 * rate / (GB10.peak_tflops[r["dtype"].split("-")[0]] * 1e12), 1)
    assert header["peak_tflops"] == {"bf16": 125.0, "fp8": 250.0, "fp8-rowwise": 250.0, "nvfp4": 500.0}
    assert "spec-derived" in header["peak_source"] and "triton" in header
    BG.main(["--shapes", "8192x8192x8192", "--reps", "3", "--dtypes", "bf16", "--peak-flops", "bf16=82e12"])
    header, row = _strict_json_lines(capsys.readouterr().out)
    assert header["peak_tflops"] == {"bf16": 82.0} and header["peak_source"].startswith("--peak-flops for bf16")
    assert row["pct_of_peak"] == round(100 * rate / 82e12, 1) == 67.0
    # a GPU the table lacks: the header stays the first line, then the note naming --peak-flops, never 0%
    mystery = detect_device(props=SimpleProps("NVIDIA Mystery 9000", 12, 0, 80, 48 * 10**9))
    monkeypatch.setattr(BG, "detect_device", lambda d: mystery)
    BG.main(["--shapes", "8192x8192x8192", "--reps", "3", "--dtypes", "bf16"])
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[0])["peak_tflops"] == {"bf16": None}
    assert out[1].startswith("% peak n/a for bf16") and "--peak-flops bf16=" in out[1]
    assert json.loads(out[2])["pct_of_peak"] is None and json.loads(out[2])["tflops"] == 55.0


# ------------------------------------------------------------------ benchmark_kernels: MFU on a GB10

def test_model_mode_mfu_is_against_gb10s_bf16_peak(monkeypatch, capsys):
    """Model mode's MFU = FLOPs/token x tok/s / the device's dense bf16 peak (GB10: 125 TFLOP/s), for
    every precision (the fp32 row too): with a step timed at the ms that makes 40% on a GB10."""
    from nanochat.common import destroy_runtime, init_runtime
    from nanochat.gpt import GPT, config_for_depth
    from scripts import benchmark_kernels as BK

    with torch.device("meta"):
        flops = GPT(config_for_depth(1, 256, 32)).estimate_flops()
    tokens = 2 * 32
    ms = 1e3 * flops * tokens / (0.40 * 125e12)
    monkeypatch.setattr(BK, "detect_device", lambda device: GB10)
    monkeypatch.setattr(BK, "_timed", lambda fn, reps, device, inner=1: ms)
    args = BK.parse_args(["--device", "cpu", "--mode", "model", "--kernels", "current", "--precisions", "fp32",
                          "--depth", "1", "--device-batch-size", "2", "--seq", "32", "--vocab", "256", "--reps", "3",
                          "--no-compile"])
    rt = init_runtime("cpu", "fp32")
    try:
        (row,) = BK.bench_model(args, rt)
    finally:
        destroy_runtime(rt)
    (printed,) = _strict_json_lines(capsys.readouterr().out)
    assert printed["mfu_pct"] == row["mfu_pct"] == 40.0
    assert row["tok_per_sec"] == round(tokens / (ms * 1e-3)) and row["device"] == GB10.name


# ------------------------------------------------------------------ analyze_bandwidth: --peak-flops / --bandwidth-gbs

def _stub_measurements(monkeypatch, A, spec):
    import nanochat.common

    monkeypatch.setattr(nanochat.common, "init_runtime", lambda *a: NS(device=NS(type="cuda")))
    monkeypatch.setattr(A, "detect_device", lambda device: spec)
    monkeypatch.setattr(A, "measure_ops", lambda *a: {"attn_proj_gemms": 2.0, "mlp_gemms": 3.0, "attention": 1.5,
                                                     "lm_head_loss": 4.0})
    monkeypatch.setattr(A, "measure_step", lambda *a: (20.0, 5.0))


ROOF = ["--depth", "2", "--seq", "32", "--device-batch-size", "2", "--vocab", "256"]


def test_roofline_of_a_gpu_the_table_lacks_takes_its_peak_and_bandwidth(monkeypatch, capsys):
    """A GPU not in the device table raised "not in the table" with nothing to pass instead: the
    script could not run there at all. It now names --peak-flops / --bandwidth-gbs, and with them
    each row is against that roofline: ridge = peak / bandwidth, floor = max(FLOPs / peak, bytes /
    bandwidth), efficiency = floor / measured."""
    from nanochat.gpt import config_for_depth
    from scripts import analyze_bandwidth as A

    unknown = detect_device(props=SimpleProps("NVIDIA Mystery 9000", 12, 0, 80, 48 * 10**9))
    assert not unknown.known
    _stub_measurements(monkeypatch, A, unknown)
    with pytest.raises(RequestError, match=r"--peak-flops and --bandwidth-gbs: 'NVIDIA Mystery 9000'"):
        A.main(ROOF)
    with pytest.raises(RequestError, match=r"^--bandwidth-gbs: .*accepted: pass this GPU's --bandwidth-gbs"):
        A.main(ROOF + ["--peak-flops", "200e12"])
    A.main(ROOF + ["--peak-flops", "200e12", "--bandwidth-gbs", "800"])
    lines = _strict_json_lines(capsys.readouterr().out)
    rows, summary = {r["op"]: r for r in lines[:-1]}, lines[-1]
    measured = {"attn_proj_gemms": 2.0, "mlp_gemms": 3.0, "attention": 1.5, "lm_head_loss": 4.0, "optimizer": 5.0}
    for name, op in A.op_table(config_for_depth(2, 256, 32), 2, 32).items():
        floor = 1e3 * max(op["flops"] / 200e12, op["bytes"] / 800e9)
        assert rows[name]["ridge"] == 250.0 and rows[name]["roofline_ms"] == round(floor, 3)
        assert rows[name]["efficiency_pct"] == round(100 * floor / measured[name], 1)
    assert summary["peak_bf16_tflops"] == 200.0 and summary["bandwidth_gbs"] == 800.0
    assert "--peak-flops and --bandwidth-gbs given" in summary["roofline_source"]


def test_roofline_on_a_gb10_uses_273_gbs_and_a_measured_peak_when_given(monkeypatch, capsys):
    from scripts import analyze_bandwidth as A

    _stub_measurements(monkeypatch, A, GB10)
    A.main(ROOF)
    summary = _strict_json_lines(capsys.readouterr().out)[-1]
    assert (summary["peak_bf16_tflops"], summary["bandwidth_gbs"]) == (125.0, 273)
    assert "spec-derived" in summary["roofline_source"]
    A.main(ROOF + ["--peak-flops", "82e12"])   # the bf16 GEMM rate measured on a Spark
    rows = _strict_json_lines(capsys.readouterr().out)
    assert rows[0]["ridge"] == round(82e3 / 273, 1) == 300.4 and rows[-1]["peak_bf16_tflops"] == 82.0


def test_ops_timed_alone_that_outsum_the_step_are_said_not_a_zero_residual(monkeypatch, capsys):
    """Measured on an H200 at d4, batch 8 x 1024: the ops timed alone summed to 12.03 ms against a
    11.98 ms step (attention and the optimizer launch-bound alone), and the residual row read a plain
    0.0 ms, as if norms, RoPE and the glue cost nothing."""
    from scripts import analyze_bandwidth as A

    _stub_measurements(monkeypatch, A, GB10)
    monkeypatch.setattr(A, "measure_step", lambda *a: (14.0, 5.0))   # the ops above sum to 15.5 ms
    A.main(ROOF)
    out = capsys.readouterr().out
    residual = _strict_json_lines(out)[-2]
    assert residual["measured_ms"] == 0.0 and residual["ops_sum_exceeds_step_ms"] == 1.5
    assert "residual unknown: the ops timed alone sum to 1.5 ms more than the step" in out
    monkeypatch.setattr(A, "measure_step", lambda *a: (20.0, 5.0))
    A.main(ROOF)
    out = capsys.readouterr().out
    assert "ops_sum_exceeds_step_ms" not in _strict_json_lines(out)[-2] and "residual unknown" not in out


@pytest.mark.parametrize("argv", [["--peak-flops", "989"], ["--peak-flops", "nan"], ["--bandwidth-gbs", "0"],
                                  ["--bandwidth-gbs", "inf"]])
def test_roofline_override_values_are_checked_with_the_flags(argv):
    from scripts import analyze_bandwidth as A

    with pytest.raises(ValueError, match=argv[0]):
        A.parse_args(argv)


# ------------------------------------------------------------------ profile_training --trace

class _Prof:
    """A finished profiler whose export writes `body` (None: writes nothing, as a failed export
    that only logs its error)."""

    def __init__(self, body):
        self.body, self.paths = body, []

    def export_chrome_trace(self, path):
        self.paths.append(path)
        if self.body is not None:
            with open(path, "w") as f:
                f.write(self.body)


def test_trace_is_written_whole_or_not_at_all(tmp_path):
    """The check that the profiler wrote the trace looked at --trace itself: the trace of an earlier
    run there passed it (exit 0, an old trace), and a run killed mid-export left a truncated file.
    The trace is now exported beside it and renamed over it once written."""
    from scripts.profile_training import write_trace

    target = tmp_path / "runs" / "trace.json"
    target.parent.mkdir()
    target.write_text('{"old": true}')
    with pytest.raises(RequestError, match="--trace: the profiler wrote no trace"):
        write_trace(_Prof(None), str(target))
    assert target.read_text() == '{"old": true}'
    write_trace(_Prof('{"traceEvents": []}'), str(target))
    assert json.loads(target.read_text()) == {"traceEvents": []}
    assert sorted(p.name for p in target.parent.iterdir()) == ["trace.json"]   # no temp file left
    prof = _Prof("x")
    write_trace(prof, str(tmp_path / "new" / "t.json.gz"))   # the profiler gzips a path ending in .gz
    assert prof.paths[0].endswith("t.json.gz") and (tmp_path / "new" / "t.json.gz").read_text() == "x"


def test_record_function_spans_are_neither_kernels_nor_busy_time():
    """torch.profiler gives each record_function label a GPU-side span (device type CUDA, flagged
    is_user_annotation). On an H200 (torch 2.11, d4) torch's own Optimizer.step#MuonAdamW.step span
    was the top "kernel" at 82% of the step, every real kernel's share shrunk by it, and the labels'
    spans, idle gaps included, counted as busy GPU time."""
    from scripts.profile_training import device_busy, top_kernels

    cuda = NS(name="CUDA")

    def avg(key, us, count=1, annotation=False):
        return NS(key=key, device_type=cuda, self_device_time_total=us, count=count, is_user_annotation=annotation)

    prof = NS(key_averages=lambda: [avg("Optimizer.step#MuonAdamW.step", 15000.0, annotation=True),
                                    avg("gemm", 3000.0, 10), avg("relu", 1000.0, 20)])
    rows = top_kernels(prof, steps=1, top=5)
    assert [(r["kernel"], r["share_pct"], r["calls_per_step"]) for r in rows] == [("gemm", 75.0, 10), ("relu", 25.0, 20)]

    def ev(start, end, name, annotation=False):
        return NS(device_type=cuda, time_range=NS(start=start, end=end), name=name, is_user_annotation=annotation)

    busy = device_busy([ev(0, 100, "optimizer", True), ev(0, 10, "gemm"), ev(50, 60, "relu")], steps=1)
    assert (busy["busy_ms_per_step"], busy["idle_ms_per_step"], busy["kernels_per_step"]) == (0.02, 0.04, 2)
    assert busy["largest_gaps"] == [{"us": 40, "after": "gemm", "before": "relu"}]


# ------------------------------------------------------------------ bench_checkpoint

def test_checkpoint_timing_starts_after_the_optimizers_queued_step(monkeypatch, tmp_path, capsys):
    """The state dicts come from an optimizer step that a GPU still has queued: the first timed plain
    save (torch.save waits for it) was charged with that step, and "the sums cost" with it."""
    from scripts import bench_checkpoint as BC

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    log = []
    real_state, real_sync, real_plain = BC.state_dicts, BC._sync, BC.plain_round
    monkeypatch.setattr(BC, "state_dicts", lambda *a: (log.append("step queued"), real_state(*a))[1])
    monkeypatch.setattr(BC, "_sync", lambda device: (log.append("sync"), real_sync(device))[1])
    monkeypatch.setattr(BC, "plain_round", lambda *a: (log.append("timed"), real_plain(*a))[1])
    BC.main(["--device", "cpu", "--depth", "1", "--vocab-size", "256", "--reps", "1", "--dir", str(tmp_path / "ck")])
    assert log[:3] == ["step queued", "sync", "timed"]
    assert len(_strict_json_lines(capsys.readouterr().out)) == 2


# ------------------------------------------------------------------ profile_dataloader

def _corpus(tmp_path, tiny_corpus, n_docs=40):
    """Two small text shards (train, val) of the Shakespeare corpus, and the train shard's texts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = pq.read_table(tiny_corpus / "shard_00000.parquet", columns=["text"]).column("text").to_pylist()
    data = tmp_path / "docs"
    data.mkdir()
    for i, docs in enumerate((texts[:n_docs], texts[n_docs:n_docs + 10])):
        pq.write_table(pa.table({"text": pa.array(docs, type=pa.string())}), data / f"shard_{i:05d}.parquet")
    return data, texts[:n_docs]


def _profile(data, tok_dir, *extra):
    from scripts import profile_dataloader as PD

    return PD.main(["--data-dir", str(data), "--tokenizer-dir", str(tok_dir), "-B", "2", "-T", "16", "--batches",
                    "2", "--min-seconds", "0", "--warmup", "0", "--sources", "bin", "--threads", "1", *extra])


def test_an_interrupted_scratch_pretokenize_is_resumed(tmp_path, tiny_corpus, monkeypatch, capsys):
    """Stopped while pretokenizing into its scratch directory, every later run found "shards there"
    and failed in the loader with "incomplete: re-run pretokenize" (a command using the default
    tokenizer, not --tokenizer-dir's); the run now resumes it. A <data>_tokens directory made with
    another tokenizer is left alone (it failed with a tokenizer mismatch): the scratch one is used."""
    from nanochat import binshards as bs
    from nanochat import binshards_runs as runs
    from nanochat.tokenizer import Tokenizer

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    data, texts = _corpus(tmp_path, tiny_corpus)
    tok, other = Tokenizer.train(texts, 300), Tokenizer.train(texts, 280)
    tok.save(tmp_path / "tok")
    assert _profile(data, tmp_path / "tok") == 0
    scratch = tmp_path / "base" / "profile_tokens" / f"docs-{tok.fingerprint[:12]}"
    shards = sorted(data.glob("*.parquet"))
    runs.start_run(scratch, shards, data)              # as a run stopped after its first shard leaves it
    (scratch / "shard_00001.bin").unlink()
    capsys.readouterr()
    assert _profile(data, tmp_path / "tok") == 0
    pre, row = _strict_json_lines(capsys.readouterr().out)
    assert pre["bench"] == "pretokenize" and row["bench"] == "dataloader" and row["tok_per_s"] > 0
    runs.check_complete(scratch, shards)
    from scripts.pretokenize import pretokenize
    sibling = bs.default_bin_dir(data)
    pretokenize(shards, sibling, other, log=lambda *a: None)
    before = (sibling / bs.META_NAME).stat().st_mtime_ns
    assert _profile(data, tmp_path / "tok") == 0
    assert (sibling / bs.META_NAME).stat().st_mtime_ns == before
    assert [r["bench"] for r in _strict_json_lines(capsys.readouterr().out)] == ["dataloader"]


def test_more_cores_than_this_process_may_use_are_refused():
    """--cores 64 on a 20-core machine pinned the process to its 20 without a word."""
    from scripts.profile_dataloader import parse_args

    allowed = len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=rf"--cores: got {allowed + 1}; accepted: 1\.\.{allowed}"):
        parse_args(["--cores", str(allowed + 1)])
    assert parse_args(["--cores", str(allowed)]).cores == allowed


# ------------------------------------------------------------------ bench_tokenizer --compare-python

def test_compare_python_must_run_and_import_rustbpe_before_any_training(tmp_path, shared_data):
    """Only its existence was checked: a directory, or an interpreter without rustbpe, failed with a
    traceback after our own training (minutes at the default --chars)."""
    from scripts.bench_tokenizer import parse_args

    base = ["--data-dir", str(shared_data / "pretrain" / "tiny")]
    with pytest.raises(ValueError, match="--compare-python: got .*not an executable file"):
        parse_args(base + ["--compare-python", str(tmp_path)])
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ModuleNotFoundError: No module named rustbpe' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ValueError, match=r"--compare-python: .* cannot import rustbpe \(ModuleNotFoundError"):
        parse_args(base + ["--compare-python", str(fake)])
    assert parse_args(base + ["--compare-python", sys.executable]).compare_python == sys.executable
