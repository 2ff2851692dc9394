"""Flex kernel options (nanochat.attention.set_flex_kernel_options and friends) and the flag
validation of scripts/bench_attention.py. CPU: validation, plumbing into flex_attention (eager CPU
flex is forward-only and ignores tile options, so numerics are checked against the reference and
a spy on torch's flex_attention checks what reaches the call). CUDA: compiled flex under options."""

import math

import pytest
import torch

from nanochat import attention as A
from scripts import bench_attention as bench


@pytest.fixture(autouse=True)
def _reset_options():
    A.set_flex_kernel_options(None)
    yield
    A.set_flex_kernel_options(None)


def _qkv(B=2, Hq=4, Hkv=2, T=200, D=16, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda H: torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return mk(Hq), mk(Hkv), mk(Hkv)


# ----------------------------------------------------------------------------------------------
# Validation


def test_unknown_key_names_it_and_the_accepted_keys():
    with pytest.raises(ValueError, match="unknown key 'BLOCK_Q'") as info:
        A.set_flex_kernel_options({"BLOCK_Q": 64})
    assert "fwd_BLOCK_M" in str(info.value) and "bwd_BLOCK_N2" in str(info.value)
    assert A.FLEX_KERNEL_OPTIONS is None  # a rejected dict leaves the previous state
    with pytest.raises(ValueError, match="unknown key 'ROWS_GUARANTEED_SAFE'"):
        A.set_flex_kernel_options({"ROWS_GUARANTEED_SAFE": True})  # unsafe for windows: left out
    with pytest.raises(ValueError, match="unknown key 'BLOCK_M1'"):
        A.set_flex_kernel_options({"BLOCK_M1": 64})  # backward tiles only with the bwd_ prefix


@pytest.mark.parametrize("opts, match", [
    ({"fwd_BLOCK_M": 48}, "power of two"),
    ({"BLOCK_N": 8}, "power of two"),
    ({"num_warps": 3}, "num_warps"),
    ({"fwd_num_stages": 0}, "positive int"),
    ({"bwd_num_stages": True}, "positive int"),
    ({"USE_TMA": 1}, "True or False"),
    ({"BLOCK_N": 256}, "BLOCK_N=256 does not divide"),
    ({"BLOCK_SIZE": 64, "fwd_BLOCK_M": 128}, "BLOCK_M=128 does not divide the block mask's BLOCK_SIZE=64"),
    ({"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 32}, "bwd_BLOCK_N1=32 must be a multiple of bwd_BLOCK_M1=64"),
    ({"bwd_BLOCK_M2": 32, "bwd_BLOCK_N2": 64}, "bwd_BLOCK_M2=32 must be a multiple of bwd_BLOCK_N2=64"),
])
def test_bad_values_raise(opts, match):
    with pytest.raises(ValueError, match=match):
        A.set_flex_kernel_options(opts)


def test_not_a_dict_raises():
    with pytest.raises(ValueError, match="a dict or None"):
        A.set_flex_kernel_options([("BLOCK_M", 64)])


def test_set_copies_and_none_resets():
    opts = {"fwd_BLOCK_M": 64, "bwd_num_warps": 4, "BLOCK_SIZE": 64}
    A.set_flex_kernel_options(opts)
    opts["fwd_BLOCK_M"] = 32
    assert A.FLEX_KERNEL_OPTIONS == {"fwd_BLOCK_M": 64, "bwd_num_warps": 4, "BLOCK_SIZE": 64}
    assert A.flex_options_for("cpu") == A.FLEX_KERNEL_OPTIONS
    A.set_flex_kernel_options(None)
    assert A.FLEX_KERNEL_OPTIONS is None and A.flex_options_for("cpu") is None
    A.set_flex_kernel_options({})  # explicit torch heuristics
    assert A.FLEX_KERNEL_OPTIONS == {} and A.flex_options_for("cpu") is None


def test_fwd_prefix_wins_over_plain_key_in_divisibility():
    # fwd_BLOCK_M=64 is what the forward kernel uses (torch pops the prefix over the plain key).
    A.set_flex_kernel_options({"BLOCK_SIZE": 64, "BLOCK_M": 128, "fwd_BLOCK_M": 64})
    with pytest.raises(ValueError, match="BLOCK_M=128"):
        A.set_flex_kernel_options({"BLOCK_SIZE": 64, "BLOCK_M": 64, "fwd_BLOCK_M": 128})


def test_tuned_options_apply_only_when_unset_and_matching(monkeypatch):
    tuned = {"fwd_BLOCK_M": 64, "bwd_num_warps": 4}
    monkeypatch.setattr(A, "FLEX_TUNED_OPTIONS", {(9, 0): tuned})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    D = A.FLEX_TUNED_HEAD_DIM
    assert A.flex_options_for("cuda", D, torch.bfloat16) == tuned
    assert A.flex_options_for("cuda") == tuned  # prepare_masks: shape unknown, assume a match
    assert A.flex_options_for("cuda", D // 2, torch.bfloat16) is None
    assert A.flex_options_for("cuda", D, torch.float32) is None
    assert A.flex_options_for("cpu", D, torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert A.flex_options_for("cuda", D, torch.bfloat16) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    A.set_flex_kernel_options({"fwd_num_stages": 2})  # the user's choice wins
    assert A.flex_options_for("cuda", D, torch.bfloat16) == {"fwd_num_stages": 2}
    A.set_flex_kernel_options({})  # ... including "torch's heuristics"
    assert A.flex_options_for("cuda", D, torch.bfloat16) is None


def test_built_in_defaults_are_empty_and_valid():
    # No tuned entry until an H100 sweep shows a win; every entry must pass validation.
    for opts in A.FLEX_TUNED_OPTIONS.values():
        A.validate_flex_kernel_options(opts)


# ----------------------------------------------------------------------------------------------
# Plumbing (CPU)


@pytest.mark.parametrize("opts", [
    None, {},
    {"fwd_BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64},
    {"BLOCK_SIZE": 64, "fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64},
    {"BLOCK_SIZE": 32},
])
def test_flex_with_options_matches_reference(opts):
    A.set_flex_kernel_options(opts)
    q, k, v = _qkv()
    for window in (None, 7, 50, 130):
        out = A.attention(q, k, v, window=window, backend="flex")
        ref = A.reference_attention(q.double(), k.double(), v.double(), window=window)
        assert (out.double() - ref).abs().max() < 2e-5, (opts, window)


def test_options_reach_flex_attention(monkeypatch):
    import torch.nn.attention.flex_attention as fa

    real, seen = fa.flex_attention, []

    def spy(*args, **kwargs):
        seen.append((kwargs.get("kernel_options"), kwargs["block_mask"].BLOCK_SIZE))
        return real(*args, **kwargs)

    monkeypatch.setattr(fa, "flex_attention", spy)
    q, k, v = _qkv(T=96)
    A.attention(q, k, v, window=9, backend="flex")
    A.set_flex_kernel_options({"BLOCK_SIZE": 32, "fwd_BLOCK_M": 32, "USE_TMA": True})
    A.attention(q, k, v, window=9, backend="sdpa_flex")
    A.set_flex_kernel_options({})
    A.attention(q, k, v, window=9, backend="flex")
    assert seen == [(None, (128, 128)), ({"fwd_BLOCK_M": 32, "USE_TMA": True}, (32, 32)),
                    (None, (128, 128))]
    assert A.FLEX_KERNEL_OPTIONS == {}  # BLOCK_SIZE was stripped from a copy, not the stored dict


def test_prepare_masks_uses_the_block_size():
    A.set_flex_kernel_options({"BLOCK_SIZE": 32})
    A.prepare_masks(77, [None, 11], "cpu", "flex")
    assert A._BLOCK_MASKS[(77, 11, "cpu", 32)].BLOCK_SIZE == (32, 32)
    assert A._BLOCK_MASKS[(77, None, "cpu", 32)].BLOCK_SIZE == (32, 32)


# ----------------------------------------------------------------------------------------------
# bench_attention flags (no CUDA needed)


def test_bench_defaults_are_d20():
    cfg = bench.parse_args([])
    assert (cfg.batch, cfg.heads, cfg.kv_heads, cfg.seq, cfg.head_dim, cfg.window) == (32, 10, 10, 2048, 128, 512)
    assert cfg.device == "cuda" and list(cfg.sweep) == list(bench.SWEEP)
    assert 8 <= len(bench.SWEEP) <= 14
    assert bench.parse_args(["--no-sweep"]).sweep == {}
    assert list(bench.parse_args(["--only", "tma,bs64"]).sweep) == ["tma", "bs64"]


@pytest.mark.parametrize("argv, flag", [
    (["--window", "0"], "--window"),
    (["--window", "2048"], "--window"),
    (["--seq", "256", "--window", "300"], "--window"),
    (["--device", "cpu"], "--device"),
    (["--device", "mps"], "--device"),
    (["--device", "nonsense"], "--device"),
    (["--reps", "2"], "--reps"),
    (["--warmup", "0"], "--warmup"),
    (["--heads", "10", "--kv-heads", "3"], "--kv-heads"),
    (["--batch", "0"], "--batch"),
    (["--head-dim", "0"], "--head-dim"),
    (["--only", "nope"], "--only"),
    (["--configs", '[{"BLOCK_Q": 64}]'], "--configs"),
    (["--configs", '[{"fwd_BLOCK_M": 48}]'], "--configs"),
    (["--configs", "{not json"], "--configs"),
    (["--configs", "/nonexistent/sweep.json"], "--configs"),
    (["--configs", "[1]"], "--configs"),
    (["--configs", "[]", "--only", "tma"], "--configs"),
])
def test_bench_bad_flags_raise_naming_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        bench.parse_args(argv)


def test_bench_configs_inline_and_file(tmp_path):
    cfg = bench.parse_args(["--configs", '[{"name": "a", "fwd_BLOCK_M": 64}, {"USE_TMA": true}]'])
    assert cfg.sweep == {"a": {"fwd_BLOCK_M": 64}, "cfg1": {"USE_TMA": True}}
    path = tmp_path / "sweep.json"
    path.write_text('{"x": {"bwd_num_warps": 4}}')
    assert bench.parse_args(["--configs", str(path)]).sweep == {"x": {"bwd_num_warps": 4}}


@pytest.mark.parametrize("T, window", [(1, None), (10, None), (10, 1), (10, 3), (10, 9), (10, 10), (64, 16)])
def test_visible_pairs_counts_the_mask(T, window):
    pos = torch.arange(T)
    assert bench.visible_pairs(T, window) == int(A._visible(pos, pos, window).sum())


def test_flops_d20_window():
    cfg = bench.parse_args([])
    pairs = 512 * 513 // 2 + (2048 - 512) * 512
    assert bench.fwd_bwd_flops(cfg, 512) == 3.5 * 4 * 32 * 10 * 128 * pairs
    assert math.isclose(bench.fwd_bwd_flops(cfg, None) / bench.fwd_bwd_flops(cfg, 512),
                        (2048 * 2049 / 2) / pairs)


# ----------------------------------------------------------------------------------------------
# CUDA (run on the GPU box with `pytest -m cuda`)


@pytest.mark.cuda
@pytest.mark.parametrize("opts", [
    {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 2,
     "bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 32,
     "bwd_num_warps": 4, "bwd_num_stages": 2},
    # BLOCK_SIZE >= 128: some torch versions drop the default backward config (BLOCK_N1=128)
    # against a 64 block mask before applying user tiles, leaving no kernel to choose.
    {"BLOCK_SIZE": 256, "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64},
])
def test_cuda_compiled_flex_with_options_matches_reference(opts):
    torch._dynamo.reset()
    A.set_flex_kernel_options(opts)
    q, k, v = (t.requires_grad_() for t in _qkv(B=2, Hq=4, Hkv=2, T=1024, D=64, dtype=torch.bfloat16,
                                                   device="cuda"))
    out = A.attention(q, k, v, window=256, backend="sdpa_flex")
    g = torch.randn_like(out)
    out.backward(g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = A.reference_attention(q64, k64, v64, window=256)
    ref.backward(g.double())
    assert (out.double() - ref).abs().max() < 3e-2
    for got, t in zip((q.grad, k.grad, v.grad), (q64, k64, v64)):
        assert (got.double() - t.grad).abs().max() / t.grad.abs().max() < 3e-2


def test_bench_table_sorts_and_reports_errors(capsys):
    rows = [
        {"name": "window_default", "kind": "window", "config": {}, "ms": 2.0, "ms_fwd": 0.6,
         "ms_bwd": 1.4, "tflops": 300.0},
        {"name": "sdpa_causal", "kind": "causal", "config": {}, "ms": 2.9, "ms_fwd": 0.9,
         "ms_bwd": 2.0, "tflops": 400.0},
        {"name": "fast", "kind": "window", "config": {"USE_TMA": True}, "ms": 1.6, "ms_fwd": 0.5,
         "ms_bwd": 1.1, "tflops": 375.0, "max_err": 0.05, "err_flag": True},
        {"name": "broken", "kind": "window", "config": {"fwd_BLOCK_M": 128}, "error": "OutOfResources: x"},
    ]
    bench.print_table(rows)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert [ln.split()[0] for ln in lines[1:5]] == ["fast", "window_default", "sdpa_causal", "broken"]
    assert "1.250x" in lines[1] and "5.00e-02 !" in lines[1] and "OutOfResources" in lines[4]
