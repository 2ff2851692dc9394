"""The figures the benchmark scripts print, recomputed independently: decode KV bytes per kernel
(bench_inference), percentiles (bench_serving, load_test), the GPU monitor's window
(profile_training), checkpoint sizes per kind (bench_checkpoint), RSS units (bench_tokenizer)."""

from __future__ import annotations

import json
import statistics
from types import SimpleNamespace as NS

import pytest
import torch


# ------------------------------------------------------------------ bench_inference: decode KV bytes

def _d20_engine(decode_mode: str, graph_step: str = "compiled"):
    from nanochat.gpt import GPT, config_for_depth

    with torch.device("meta"):
        model = GPT(config_for_depth(20, 32768, 2048))
    return NS(model=model, cache_dtype=torch.bfloat16, decode_mode=decode_mode, graph_step=graph_step,
              max_seq_len=2048, decode_bucket=256, device=torch.device("cpu"))


def _visible_d20(first: int, n: int, batch: int) -> float:
    """d20, SSSL, seq 2048: 15 layers with a 512-key window, 5 full (every 4th and the last);
    a step at position p reads keys 0..p (p + 1 of them), at most 512 in a window layer."""
    per_key = 2 * 10 * 128 * 2   # k and v, 10 kv heads, head dim 128, bf16
    keys = [15 * min(p + 1, 512) + 5 * (p + 1) for p in range(first, first + n)]
    return per_key * batch * sum(keys) / n


def test_static_steps_count_the_bucket_only_where_sdpa_reads_it(monkeypatch):
    """On CUDA the static/graphs step's Triton decode kernel (the default triton_fused) loads only
    the visible keys, but every static row was charged the whole length bucket of every layer:
    d20, prompt 512 + 128 tokens, batch 32: 2.52 GB of KV per step counted against 1.73 GB read,
    i.e. bandwidth utilisation overstated ~30% at that batch."""
    from nanochat import attention
    from scripts import bench_inference as BI

    engine = _d20_engine("graphs")
    bucket = 2 * 10 * 128 * 2 * 32 * 20 * 768   # positions 512..639 -> bucket 768, all 20 layers
    # SDPA with a mask (--decode-kernel sdpa, CPU): the whole bucket
    assert BI.kv_bytes_per_step(engine, 32, 512, 128) == bucket
    # the Triton kernel (what _static_decode_attention picks on CUDA): the visible keys
    monkeypatch.setattr(attention, "_triton_decode_ok", lambda q: True)
    assert BI.kv_bytes_per_step(engine, 32, 512, 128) == pytest.approx(_visible_d20(512, 128, 32))
    assert _visible_d20(512, 128, 32) < 0.7 * bucket
    # eager reads the visible keys whatever the kernel; the persistent step too, at batch 1
    monkeypatch.setattr(attention, "_triton_decode_ok", lambda q: False)
    assert BI.kv_bytes_per_step(_d20_engine("eager"), 4, 512, 128) == pytest.approx(_visible_d20(512, 128, 4))
    persistent = _d20_engine("graphs", "persistent")
    assert BI.kv_bytes_per_step(persistent, 1, 512, 128) == pytest.approx(_visible_d20(512, 128, 1))
    assert BI.kv_bytes_per_step(persistent, 2, 512, 128) == 2 * 10 * 128 * 2 * 2 * 20 * 768


def test_the_probe_asks_the_kernel_choice_with_the_models_head_dim(monkeypatch):
    from nanochat import attention
    from scripts import bench_inference as BI

    seen = []
    monkeypatch.setattr(attention, "_triton_decode_ok", lambda q: seen.append((q.size(-1), q.device.type)) or True)
    assert BI.static_step_reads_bucket(_d20_engine("static"), 8) is False
    assert seen == [(128, "cpu")]


# ------------------------------------------------------------------ percentiles

@pytest.mark.parametrize("module", ["bench_serving", "load_test"])
def test_percentiles_are_linear_between_order_statistics(module):
    """p50 rounded its rank to one sample: p50 of two latencies was the smaller one, of four the
    third (round-half-to-even), never the median."""
    import importlib

    import numpy as np

    pct = importlib.import_module(f"scripts.{module}").pct
    assert pct([2.0, 1.0], 0.5) == 1.5
    assert pct([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 5, 20, 32):
        xs = rng.random(n).tolist()
        assert pct(xs, 0.5) == pytest.approx(statistics.median(xs))
        assert pct(xs, 0.95) == pytest.approx(float(np.percentile(xs, 95)))
        assert pct(xs, 1.0) == max(xs) and pct(xs, 0.0) == min(xs)


def test_load_test_percentile_of_nothing_is_none():
    from scripts.load_test import pct

    assert pct([], 0.5) is None


# ------------------------------------------------------------------ profile_training: GPU monitor window

def test_profile_training_monitors_only_the_timed_steps():
    """The GpuMonitor wrapped the warm-up too: on a GPU its median SM clock and power-capped share
    were mostly the idle GPU of the compilation, not the timed steps they were printed with."""
    from nanochat.common import init_runtime
    from scripts import profile_training as PT

    args = PT.parse_args(["--device", "cpu", "--depth", "1", "--device-batch-size", "1", "--seq", "16", "--vocab", "64",
                          "--no-compile", "--steps", "2", "--warmup", "3"])
    rt = init_runtime("cpu", "fp32")
    model, run, optimizer, _ = PT.build(args, rt)
    steps, events = [0], []
    step = optimizer.step
    optimizer.step = lambda *a, **k: (steps.__setitem__(0, steps[0] + 1), step(*a, **k))[1]
    monitor = NS(start=lambda: events.append(("start", steps[0])), stop=lambda: events.append(("stop", steps[0])))
    PT.timed_steps(args, rt, model, run, optimizer, monitor)
    assert events == [("start", 3)] and steps[0] == 5


# ------------------------------------------------------------------ bench_checkpoint: bytes per kind

def test_checkpoint_rows_report_their_own_bytes(tmp_path, monkeypatch, capsys):
    """Both rows used the size of the last kind measured (checkpoint: model, optimizer and loop
    state files), so the plain row's GB and GB/s were another file set's."""
    import io

    from scripts import bench_checkpoint as BC

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    captured = {}
    real = BC.state_dicts

    def keep(args, device):
        captured["states"] = real(args, device)
        return captured["states"]
    monkeypatch.setattr(BC, "state_dicts", keep)
    plain, checkpoint = BC.main(["--device", "cpu", "--depth", "1", "--vocab-size", "256", "--reps", "1"])
    capsys.readouterr()

    def saved(obj) -> int:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getbuffer().nbytes
    model_state, optim_state = captured["states"]
    assert plain["bytes"] == saved(model_state) + saved(optim_state)
    assert checkpoint["bytes"] > plain["bytes"]   # + the loop state file


# ------------------------------------------------------------------ bench_tokenizer: RSS units

def test_tokenizer_rss_is_megabytes_not_mebibytes(monkeypatch):
    import resource

    from scripts import bench_tokenizer as BT

    monkeypatch.setattr(resource, "getrusage", lambda who: NS(ru_maxrss=1_000_000))
    monkeypatch.setattr(BT.sys, "platform", "linux")      # KiB
    assert BT.rss_mb() == 1024.0
    monkeypatch.setattr(BT.sys, "platform", "darwin")     # bytes
    assert BT.rss_mb() == 1.0


def test_model_step_bandwidth_uses_the_bytes_at_its_own_position(capsys):
    """The back-to-back model step runs at one position (prompt + n/2) but was charged the mean KV
    bytes of the whole generation: prompt 200 + 128 tokens crosses the 256 bucket boundary, so a
    static step at position 264 (bucket 512) was charged 56/128 of its steps at bucket 256."""
    from nanochat.gpt import config_for_depth
    from scripts import bench_inference as BI

    BI.main(["--device", "cpu", "--depth", "1", "--vocab-size", "256", "--seq-len", "512", "--prompt-len", "200",
             "--decode-tokens", "128", "--batch-sizes", "1", "--repeats", "1", "--decode", "static"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"bench": "decode"')]
    (row,) = rows
    cfg = config_for_depth(1, 256, 512)
    per_key_layer = 2 * cfg.n_kv_head * cfg.head_dim * 4   # fp32 on a CPU
    assert row["model_bytes_per_step"] == row["weight_bytes"] + per_key_layer * cfg.n_layer * 512
    generation_kv = per_key_layer * cfg.n_layer * (56 * 256 + 72 * 512) / 128
    assert row["kv_bytes"] == int(generation_kv)
    assert row["model_achieved_gbs"] == pytest.approx(row["model_bytes_per_step"] / (row["model_step_ms"] / 1e3) / 1e9)
