"""Audit of the arithmetic the benchmark scripts print, each figure recomputed by hand from the model
config (or counted from the model's own parameters and cache tensors) and compared with what the
script computes: decode bytes per step and bandwidth (bench_inference), FLOPs per token and MFU
(gpt.estimate_flops, bench_train), the roofline and its --predict figures (analyze_bandwidth),
GEMM % of peak (bench_gemm), traffic rows and non-CUDA timing (benchmark_kernels), the step split
(profile_training), MIG / GH200 bandwidth (device_table) and flags refused before any work."""

from __future__ import annotations

import contextlib
import json
import time
from types import SimpleNamespace as NS

import pytest
import torch

from nanochat.gpt import GPT, config_for_depth


def _meta_model(depth, vocab, seq, dtype=torch.float32, **kw):
    with torch.device("meta"):
        return GPT(config_for_depth(depth, vocab, seq, **kw)).to(dtype)


def _hand_matrix_params(depth, vocab, *, aspect=64, head_dim=128, kv_heads=None):
    """Matrix parameters a decode step streams, from the sizing rule alone (no model object):
    per layer q (C x C), k and v (C x kv each), attention out (C x C), MLP 4C x C twice; a 32 x kv
    gate on every value-embedding layer (alternate layers, the last included); lm_head (V padded to
    64) x C; two scalars per layer."""
    C = -(-depth * aspect // head_dim) * head_dim
    heads = C // head_dim
    kv = (kv_heads or heads) * head_dim
    n_ve = len(range(depth - 1, -1, -2))
    vpad = -(-vocab // 64) * 64
    return depth * (2 * C * C + 2 * C * kv + 8 * C * C) + n_ve * min(32, C) * (kv // head_dim) + vpad * C + 2 * depth


# ------------------------------------------------------------------ bench_inference: weight bytes

@pytest.mark.parametrize("depth,vocab,kv_heads", [(2, 4096, None), (4, 1000, 1), (20, 32768, None)])
def test_decode_weight_bytes_are_every_matrix_plus_the_gathered_rows(depth, vocab, kv_heads):
    """A decode step streams every matrix whole (lm_head included) and gathers one row of the token
    table and of each value-embedding table per batch row; the tables were not counted at all
    (d20 batch 32: 0.9 MB of 871 MB). d20's matrices in bf16: 2 x 435,162,280 bytes."""
    from scripts import bench_inference as BI

    kw = {} if kv_heads is None else {"n_kv_head": kv_heads}
    model = _meta_model(depth, vocab, 256, torch.bfloat16, **kw)
    C, kv = model.config.n_embd, model.config.n_kv_head * model.config.head_dim
    matrices = 2 * _hand_matrix_params(depth, vocab, kv_heads=kv_heads)
    if depth == 20:
        assert matrices == 2 * 435_162_280
    rows = 2 * (C + len(range(depth - 1, -1, -2)) * kv)
    for batch in (1, 32):
        assert BI.weight_bytes_per_step(model, batch) == matrices + batch * rows
    assert BI.weight_bytes_per_step(model) == matrices   # the header's figure: matrices alone


def test_decode_rows_print_bytes_and_bandwidth_a_hand_count_gives(capsys):
    """CPU eager decode, d2 (2 layers: a 32-key window, then full), fp32: the row's weight and KV
    bytes are the hand counts and its GB/s their sum over the step time."""
    from scripts import bench_inference as BI

    BI.main(["--device", "cpu", "--depth", "2", "--vocab-size", "256", "--seq-len", "128", "--prompt-len", "40",
             "--decode-tokens", "8", "--batch-sizes", "1,3", "--repeats", "1", "--decode", "eager"])
    rows = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith('{"bench": "decode"')]
    assert [r["batch"] for r in rows] == [1, 3]
    C, kv = 128, 128                                    # d2: one head of 128, fp32 below
    for r in rows:
        b = r["batch"]
        assert r["weight_bytes"] == 4 * _hand_matrix_params(2, 256) + 4 * b * (C + 1 * kv)
        keys = [min(p + 1, 32) + (p + 1) for p in range(40, 48)]   # positions 40..47, keys 0..p
        kv_mean = 2 * kv * 4 * b * sum(keys) / 8                     # k and v, fp32, mean over the steps
        assert r["kv_bytes"] == int(kv_mean)
        assert r["bytes_per_step"] == int(r["weight_bytes"] + kv_mean)
        assert r["achieved_gbs"] == pytest.approx(r["bytes_per_step"] / (r["step_ms"] / 1e3) / 1e9, rel=1e-6)
        assert r["tok_per_s"] == pytest.approx(b / (r["step_ms"] / 1e3))
        assert r["bandwidth_util"] is None               # a CPU has no table bandwidth: none, not 0%


def test_kv_bytes_per_key_match_the_engines_cache_tensors():
    """The per-key KV figure (2 x kv heads x head dim x itemsize, per layer and row) against the
    bytes of the cache tensors Engine allocates, GQA and bf16 included."""
    from nanochat.engine import Engine
    from scripts import bench_inference as BI

    torch.manual_seed(0)
    model = GPT(config_for_depth(4, 256, 64, n_kv_head=1, window_pattern="L"), compute_dtype=torch.bfloat16)
    model.init_weights()
    engine = Engine(model, None, decode="eager")
    cache = engine.new_cache(3, 64)
    cache_bytes = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    elem = BI.torch_itemsize(engine.cache_dtype)
    assert elem == 2
    # a full-attention model at the last position reads the whole cache of a row
    assert 3 * BI.visible_kv_bytes(model, 63, elem) == cache_bytes


# ------------------------------------------------------------------ FLOPs per token and MFU

@pytest.mark.parametrize("depth,vocab,seq,kv,pattern", [(2, 4096, 256, None, "SSSL"), (4, 1000, 512, 1, "SSSL"),
                                                       (20, 32768, 2048, None, "SSSL"), (6, 512, 128, None, "L")])
def test_flops_per_token_is_6n_plus_windowed_attention_by_hand(depth, vocab, seq, kv, pattern):
    """6 x (the matmul parameters, padded lm_head included; no embedding tables) + per layer
    12 x heads x head_dim x keys, keys = min(window, T), the window T/4 in S layers, the last layer
    full. d20: 2,610,973,440 + 275,251,200 = 2,886,224,640 FLOPs per token."""
    kw = {} if kv is None else {"n_kv_head": kv}
    model = _meta_model(depth, vocab, seq, window_pattern=pattern, **kw)
    n = _hand_matrix_params(depth, vocab, kv_heads=kv) - 2 * depth       # the scalars are no matmul
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert n == linear                                                    # hand count = the model's layers
    layers = [None if (pattern[i % len(pattern)] == "L" or i == depth - 1) else seq // 4 for i in range(depth)]
    C = model.config.n_embd
    attn = sum(12 * C * (seq if w is None else min(w, seq)) for w in layers)
    assert model.estimate_flops() == 6 * n + attn
    if depth == 20:
        assert (6 * n, attn, model.estimate_flops()) == (2_610_973_440, 275_251_200, 2_886_224_640)


def test_bench_train_mfu_is_flops_times_tokens_over_peak(capsys):
    """bench_train's MFU = FLOPs/token x tok/s / (peak x world size), tok/s = tokens per optimizer
    step / median step time; --peak-flops given on a CPU."""
    from scripts import bench_train

    (row,) = bench_train.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "2", "--seq", "32",
                               "--steps", "2", "--warmup", "0", "--vocab-size", "256", "--no-compile",
                               "--aspect-ratio", "32", "--head-dim", "32", "--total-batch-size", "128",
                               "--peak-flops", "1e12"])
    capsys.readouterr()
    model = _meta_model(1, 256, 32, aspect_ratio=32, head_dim=32)
    assert row["flops_per_token"] == model.estimate_flops()
    assert row["grad_accum_steps"] == 2 and row["total_batch_size"] == 128
    assert row["tok_per_sec"] == pytest.approx(128 / (row["median_step_ms"] / 1e3))
    assert row["mfu_pct"] == pytest.approx(100 * row["flops_per_token"] * row["tok_per_sec"] / 1e12)


# ------------------------------------------------------------------ analyze_bandwidth

def _pairs(seq, window):
    return sum(1 for i in range(seq) for j in range(i + 1) if window is None or i - j < window)


def test_roofline_rows_and_prediction_by_hand(monkeypatch, capsys):
    """The printed roofline of a d4 step at T = 64 (windows of 16 keys in 3 of 4 layers), with the
    measurements stubbed: attention FLOPs from the visible (query, key) pairs of each layer (it
    charged every layer T^2/2 pairs), attention bytes 3x the forward's q/k/v/o (+ log-sum-exp),
    not 3.5x; intensity, bound, floor and efficiency from them; --predict gb10 = gb10's floor x
    the measured efficiency, the residual scaled by the bandwidth ratio, labelled a prediction."""
    import nanochat.common
    from nanochat.platform import DEVICE_TABLE
    from scripts import analyze_bandwidth as A

    h100, gb10 = DEVICE_TABLE["h100-sxm"], DEVICE_TABLE["gb10"]
    measured = {"attn_proj_gemms": 2.0, "mlp_gemms": 3.0, "attention": 1.5, "lm_head_loss": 4.0, "optimizer": 5.0}
    monkeypatch.setattr(nanochat.common, "init_runtime", lambda *a: NS(device=NS(type="cuda")))
    monkeypatch.setattr(A, "detect_device", lambda device: h100)
    monkeypatch.setattr(A, "measure_ops", lambda *a: {k: v for k, v in measured.items() if k != "optimizer"})
    monkeypatch.setattr(A, "measure_step", lambda *a: (20.0, 5.0))
    A.main(["--depth", "4", "--seq", "64", "--device-batch-size", "2", "--vocab", "256", "--predict", "gb10"])
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    rows, summary = {r["op"]: r for r in lines[:-1]}, lines[-1]

    B, T, H, D, L = 2, 64, 2, 128, 4                    # d4: 256 wide, 2 heads of 128
    pairs = 3 * _pairs(T, 16) + _pairs(T, None)
    attn_flops = 3.5 * 4 * B * H * D * pairs
    attn_bytes = L * (3 * 2 * B * T * D * (2 * H + 2 * H) + 2 * 4 * B * T * H)
    att = rows["attention"]
    assert att["gflops"] == round(attn_flops / 1e9, 1) and att["gbytes"] == round(attn_bytes / 1e9, 2)
    assert att["intensity"] == round(attn_flops / attn_bytes, 1)
    C, N = 256, B * T                                    # the q/k/v/out GEMMs: 6 m n k each
    proj_flops = L * 6 * N * C * C * 4
    assert rows["attn_proj_gemms"]["gflops"] == round(proj_flops / 1e9, 1)
    ops = A.op_table(config_for_depth(4, 256, 64), B, T)
    assert ops["attention"]["flops"] == pytest.approx(attn_flops) and ops["attention"]["bytes"] == attn_bytes
    # the head's GEMMs (logits written once, their gradient read by dgrad and wgrad) + the compiled
    # softcap + CE: logits read in the forward, read and their gradient written in the backward
    V = 256
    head = 3 * 2 * (N * C + V * C + N * V)
    assert ops["lm_head_loss"]["bytes"] == head + N * V * (2 + 2 + 2)
    assert A.op_table(config_for_depth(4, 256, 64), B, T, "triton")["lm_head_loss"]["bytes"] == head + N * V * 4
    for name, op in ops.items():
        r = rows[name]
        t_c, t_b = op["flops"] / 989.4e12, op["bytes"] / 3350e9
        assert r["bound"] == ("compute" if t_c >= t_b else "bandwidth")
        assert r["roofline_ms"] == round(1e3 * max(t_c, t_b), 3)
        assert r["ridge"] == round(989.4e3 / 3350, 1)
        g_floor = 1e3 * max(op["flops"] / 125e12, op["bytes"] / 273e9)
        assert r["predicted_ms"] == round(g_floor * measured[name] / (1e3 * max(t_c, t_b)), 3)
        assert "PREDICTION, not a measurement" in r["label"] and "spec-derived" in r["label"]
    residual = 20.0 - sum(measured.values())
    assert rows["residual (norms, rope, act, glue)"]["measured_ms"] == round(residual, 3)
    predicted = sum(r.get("predicted_ms", 0.0) for r in lines[:-1]) + residual * 3350 / 273
    assert summary["predicted_step_ms"] == round(predicted, 1) and summary["label"].startswith("PREDICTION")
    assert summary["predicted_tok_per_sec"] == round(B * T / (predicted * 1e-3))
    assert gb10.peak_tflops["bf16"] == 125.0


def test_attention_is_timed_per_window_as_the_model_runs_it(monkeypatch):
    """The attention op was timed as full causal SDPA in every layer; now each distinct window of
    the model runs once through nanochat.attention (the backend the model resolves) and counts
    once per layer that has it: d4 at T = 64, three 16-key layers and one full."""
    from scripts import analyze_bandwidth as A

    seen = []

    def once(fn, reps=10):   # no CUDA events here: run the closure, charge 1 ms per window size
        fn()
        return {16: 1.0, None: 10.0}[seen[-1]]

    import nanochat.attention as NA
    real = NA.attention

    def recorded(q, k, v, *, window, backend):
        seen.append(window)
        return real(q, k, v, window=window, backend=backend)
    monkeypatch.setattr(NA, "attention", recorded)
    monkeypatch.setattr(A, "_median_ms", once)
    ms = A.attention_ms(config_for_depth(4, 256, 64), 2, 64, torch.device("cpu"))
    assert sorted(seen, key=str) == [16, None] and ms == 3 * 1.0 + 10.0


def test_the_loss_op_is_timed_as_the_training_step_runs_it(monkeypatch):
    """--kernel current timed build_loss_fn("current"), the reference chain (fp32 logits, separate
    softcap and cross-entropy), uncompiled: a step runs the model's cross_entropy_loss, compiled."""
    import nanochat.kernels as K
    from scripts import analyze_bandwidth as A

    calls = []
    for name in ("current_loss", "cross_entropy_loss"):
        real = getattr(K, name)
        monkeypatch.setattr(K, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (compiled.append(fn), fn)[1])
    monkeypatch.setattr(A, "_median_ms", lambda fn, reps=10: (fn(), 1.0)[1])
    ms = A.measure_ops(config_for_depth(1, 256, 32), 1, 32, torch.device("cpu"), "current")
    assert calls == ["cross_entropy_loss"] and compiled and ms["lm_head_loss"] == 1.0
    monkeypatch.undo()
    assert A.step_loss_fn("current", "cpu") is GPT(config_for_depth(1, 64, 16)).loss_fn   # the model's default


# ------------------------------------------------------------------ bench_gemm: % of peak

class _FakeEvent:
    """torch.cuda.Event on a scripted clock: record() takes the next timestamp (ms)."""
    clock: list = []
    log: list | None = None

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        self.t = _FakeEvent.clock.pop(0)
        if _FakeEvent.log is not None:
            _FakeEvent.log.append("mark")

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return other.t - self.t


def test_gemm_percent_of_peak_uses_the_unrounded_rate(monkeypatch, capsys):
    """2 x 256^3 FLOPs in 1 ms is 0.0336 TFLOP/s, printed as 0.0: the % of a 1e11 FLOP/s peak was
    taken from that rounded 0.0 (0%) instead of the rate (33.6%)."""
    from scripts import bench_gemm as BG

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    # the 1 ms probe sets 20 products per timed batch; 3 batches of 20 ms
    _FakeEvent.clock = [0.0, 1.0, 10.0, 30.0, 40.0, 60.0, 70.0, 90.0]
    rec = BG._timed_row({}, "bf16", (256, 256, 256), lambda: (lambda: None), 3, 1, 1e11, "cpu")
    capsys.readouterr()
    assert rec["ms"] == 1.0 and rec["tflops"] == 0.0
    assert rec["pct_of_peak"] == pytest.approx(100 * 2 * 256**3 / 1e-3 / 1e11, abs=0.05) == 33.6


# ------------------------------------------------------------------ benchmark_kernels

def test_non_cuda_timing_waits_for_queued_device_work(monkeypatch):
    """On MPS the work is queued: the clock read right after fn() timed the launch (~0 ms here)
    instead of the 20 ms the device spends, which the synchronize now waits for."""
    from scripts import benchmark_kernels as BK

    queued = []
    monkeypatch.setattr(torch.mps, "synchronize", lambda: (time.sleep(0.02 * len(queued)), queued.clear()))
    ms = BK._timed(lambda: queued.append(1), 3, torch.device("mps"))
    assert ms >= 19.0
    assert BK._timed(lambda: time.sleep(0.005), 3, torch.device("cpu")) >= 4.5


def test_loss_mode_current_is_the_loss_training_runs(monkeypatch, capsys):
    """The `current` row timed build_loss_fn("current"), the fp32 reference chain, not the model's
    cross_entropy_loss that --kernel current trains with (its time, and its peak memory: two fp32
    (N, V) tensors kept for backward against bf16 logits)."""
    import nanochat.kernels as K
    from scripts import benchmark_kernels as BK

    calls = []
    for name in ("current_loss", "cross_entropy_loss"):
        real = getattr(K, name)
        wrapped = lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1]   # noqa: E731
        monkeypatch.setattr(K, name, wrapped)
        monkeypatch.setattr(BK, name, wrapped, raising=False)
    args = BK.parse_args(["--device", "cpu", "--mode", "loss", "--rows", "64", "--n-embd", "32", "--vocab", "128",
                          "--reps", "1", "--kernels", "current", "--no-compile"])
    (row,) = BK.bench_loss(args, torch.device("cpu"))
    capsys.readouterr()
    assert "error" not in row and set(calls) == {"cross_entropy_loss"}
    assert row["tflops"] == round(6 * 64 * 32 * 128 / (row["ms"] * 1e-3) / 1e12, 1)


@pytest.mark.cuda
def test_traffic_rows_report_gbs_as_a_number_not_tflops():
    """The cast / rope rows printed a bandwidth string under "tflops" ("850GB/s")."""
    from scripts import benchmark_kernels as BK

    args = BK.parse_args(["--mode", "cast", "--rows", "1024", "--n-embd", "256", "--reps", "3",
                          "--device-batch-size", "1", "--seq", "256"])
    rows = BK.bench_cast(args, torch.device("cuda"))
    assert rows and all("tflops" not in r and isinstance(r["gbs"], float) for r in rows)
    r = rows[0]
    m, n = r["shape"]
    assert r["gbs"] == pytest.approx(4 * m * n / (r["ms"] * 1e-3) / 1e9, abs=0.06)
    rope = BK.bench_rope(args, torch.device("cuda"))
    B, T, H, D = rope[0]["shape"]
    assert rope[0]["gbs"] == pytest.approx(6 * B * T * H * D / (rope[0]["ms"] * 1e-3) / 1e9, abs=0.06)


# ------------------------------------------------------------------ profile_training: the step split

def _timed_split(monkeypatch, accum, dtype, clock, steps):
    from scripts import profile_training as PT

    log = []
    _FakeEvent.clock, _FakeEvent.log = list(clock), log
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)

    @contextlib.contextmanager
    def block(args, rt, model):
        log.append("cast")
        yield

    w = torch.zeros((), requires_grad=True)
    monkeypatch.setattr(PT, "step_block", block)
    monkeypatch.setattr(PT, "make_batch", lambda args, device, gen: (None, None))
    args = NS(warmup=0, steps=steps, accum=accum, cast_once=True)
    rt = NS(device=NS(type="cuda"), dtype=dtype)
    model = NS(zero_grad=lambda set_to_none: None)
    try:
        out = PT.timed_steps(args, rt, model, lambda x, y: w * 1.0, NS(step=lambda: None))
    finally:
        _FakeEvent.log = None
    return out, log


def test_step_time_is_the_median_step_not_the_sum_of_phase_medians(monkeypatch):
    """Three steps of 13, 13 and 4 ms, slow in different phases: every phase's median is 1 ms, so
    the step was printed as 4 ms (and tok/s 3.25x too high); the median step is 13 ms."""
    phases = [(1, 10, 1, 1), (1, 1, 10, 1), (1, 1, 1, 1)]   # data, forward, backward, optimizer
    clock = []
    t = 0.0
    for step in phases:
        clock.append(t)
        for d in step:
            t += d
            clock.append(t)
        t += 100.0                                        # idle between steps: in no phase
    out, _ = _timed_split(monkeypatch, 1, torch.float32, clock, 3)
    assert out["phases"] == {"data": 1, "forward": 1, "backward": 1, "optimizer": 1}
    assert out["step_ms"] == 13


def test_the_once_per_step_weight_cast_is_inside_the_timed_step(monkeypatch):
    """With --accum > 1 the block casting the master weights opens before the first micro-batch's
    mark: its GPU work sat between two steps, in no phase and not in the step."""
    clock = [float(i) for i in range(2 * 9)]              # weights, 2 x (data, fwd, bwd), optimizer, end
    out, log = _timed_split(monkeypatch, 2, torch.bfloat16, clock, 2)
    assert log[:2] == ["mark", "cast"] and log[10:12] == ["mark", "cast"]   # 9 marks and a cast per step
    assert list(out["phases"]) == ["weights", "data", "forward", "backward", "optimizer"]
    assert out["phases"]["weights"] == 1 and out["phases"]["data"] == 2 and out["step_ms"] == 8


# ------------------------------------------------------------------ device table: bandwidth

def test_mig_slices_get_their_memory_share_of_the_bandwidth():
    """A MIG slice reads its own share of the memory controllers: 1g.10gb of an 80 GB H100 ~1/8 of
    3350 GB/s. The board's whole bandwidth made decode utilisation 8x too low there."""
    from nanochat.platform import SimpleProps, detect_device

    one = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3 MIG 1g.10gb", 9, 0, 16, 10 * 10**9))
    assert one.key == "h100-sxm" and one.bandwidth_gbs == pytest.approx(3350 / 8, abs=0.1)
    three = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 9, 0, 60, 40 * 10**9))
    assert three.bandwidth_gbs == pytest.approx(1675)
    whole = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3 MIG 7g.80gb", 9, 0, 132, 80 * 10**9))
    assert whole.bandwidth_gbs == 3350
    assert detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 85 * 10**9)).bandwidth_gbs == 3350


def test_gh200_hbm3e_has_its_own_bandwidth():
    """The 144 GB HBM3e GH200 (4.9 TB/s) matched the 96 GB HBM3 part's 4.0 TB/s."""
    from nanochat.platform import SimpleProps, detect_device, peak_flops

    e = detect_device(props=SimpleProps("NVIDIA GH200 144G HBM3e", 9, 0, 132, 150 * 10**9))
    hbm3 = detect_device(props=SimpleProps("NVIDIA GH200 480GB", 9, 0, 132, 100 * 10**9))
    assert (e.key, e.bandwidth_gbs, hbm3.key, hbm3.bandwidth_gbs) == ("gh200-hbm3e", 4900, "gh200", 4000)
    assert peak_flops(e, "bf16") == peak_flops(hbm3, "bf16") == pytest.approx(989.4e12)


def test_dense_peaks_not_sparse_for_the_target_gpus():
    """H100 SXM / H200: 989.4 bf16, 1978.9 fp8 dense (the datasheet's 1979 / 3958 are with
    sparsity); GB10: 1 PFLOP FP4 is sparse, so 500 nvfp4 / 250 fp8 / 125 bf16 dense."""
    from nanochat.platform import DEVICE_TABLE

    for key in ("h100-sxm", "h200"):
        assert DEVICE_TABLE[key].peak_tflops == {"bf16": 989.4, "fp8": 1978.9, "fp32": 494.7}
    assert DEVICE_TABLE["gb10"].peak_tflops == {"bf16": 125.0, "fp8": 250.0, "nvfp4": 500.0, "fp32": 62.5}
    assert (DEVICE_TABLE["h100-sxm"].bandwidth_gbs, DEVICE_TABLE["h200"].bandwidth_gbs,
            DEVICE_TABLE["gb10"].bandwidth_gbs) == (3350, 4800, 273)


def test_rtx_5090_fp4_peak_is_its_ai_tops_halved_not_quartered():
    """3352 AI TOPS (fp4, sparse) -> 1676 dense: 170 SMs x 4096 fp4 ops per clock x 2.41 GHz, the per-SM
    rate of the RTX PRO 6000's 2015 (188 SMs, 2.62 GHz). The table also halved it for GeForce's fp32
    accumulate, which halves bf16 (209.5) and fp8 (419) only: nvfp4 % of peak printed twice too high."""
    from nanochat.platform import DEVICE_TABLE

    rtx, pro = DEVICE_TABLE["rtx-5090"].peak_tflops, DEVICE_TABLE["rtx-pro-6000"].peak_tflops
    assert rtx["nvfp4"] == 3352 / 2 == pytest.approx(170 * 4096 * 2.407e9 / 1e12, rel=1e-3)
    assert pro["nvfp4"] == pytest.approx(188 * 4096 * 2.617e9 / 1e12, rel=1e-3)
    assert (rtx["bf16"], rtx["fp8"]) == (209.5, 419.0)
    assert pro["bf16"] == pytest.approx(188 * 1024 * 2.617e9 / 1e12, rel=1e-3)


# ------------------------------------------------------------------ flags refused before any work

@pytest.mark.parametrize("module,fn,argv,flag", [
    ("bench_inference", "parse_args", ["--decode", "eager", "--graph-step", "persistent", "--fused-qkv", "off"],
     "--graph-step persistent"),
    ("bench_inference", "parse_args", ["--device", "cpu", "--decode", "eager,graphs"], "--decode graphs"),
    ("bench_gemm", "parse_args", ["--qk", "2048:128", "--dtypes", "fp8"], r"--dtypes \(with --qk\)"),
    ("bench_gemm", "parse_args", ["--mlp", "64:16", "--burn-in", "5"], "--burn-in"),
    ("benchmark_kernels", "parse_args", ["--kernels", "current@8192"], "--kernels"),
])
def test_flag_combinations_that_failed_late_fail_at_parse(module, fn, argv, flag):
    """Each was accepted, then failed after the model was built (or mid-run), or was ignored."""
    import importlib

    with pytest.raises(ValueError, match=f"^{flag}"):
        getattr(importlib.import_module(f"scripts.{module}"), fn)(argv)
