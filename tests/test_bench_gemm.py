"""scripts/bench_gemm.py: argument checking and the training-Linear pass shapes (CPU; the
timings themselves need a GPU and are a benchmark, not a test)."""

import pytest
import torch

from scripts import bench_gemm as BG


def test_parse_linears_and_pass_shapes():
    assert BG.parse_linears("65536:1280x5120,8:16x32") == [(65536, 1280, 5120), (8, 16, 32)]
    # (rows, cols, reduction) of C = A @ B for y = x @ W.T with x (M, K), W (N, K)
    assert BG.linear_pass_shape("fwd", 65536, 1280, 5120) == (65536, 5120, 1280)
    assert BG.linear_pass_shape("dgrad", 65536, 1280, 5120) == (65536, 1280, 5120)
    assert BG.linear_pass_shape("wgrad", 65536, 1280, 5120) == (5120, 1280, 65536)


@pytest.mark.parametrize("bad", ["1:2", "65536x1280x5120", "0:16x16", "a:16x16", "8:16x"])
def test_bad_linears_raise_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--linears"):
        BG.main(["--linears", bad])


def test_layout_passes_compute_the_same_products():
    """--layouts times each bf16 product in another operand layout: same values, same shape."""
    for base, alt in (("fwd", "fwd_wt"), ("dgrad", "dgrad_wt"), ("wgrad", "wgrad_xg")):
        torch.manual_seed(0)
        ref = BG.make_linear_pass("bf16", base, 32, 16, 48, "cpu")()
        torch.manual_seed(0)
        out = BG.make_linear_pass("bf16", alt, 32, 16, 48, "cpu")()
        assert out.shape == ref.shape == BG.linear_pass_shape(alt, 32, 16, 48)[:2]
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_layouts_need_linears():
    with pytest.raises(ValueError, match="--layouts"):
        BG.main(["--layouts"])


def test_linears_accept_only_bf16_and_fp8():
    with pytest.raises(ValueError, match=r"--dtypes \(with --linears\).*bf16\|fp8"):
        BG.main(["--linears", "64:16x16", "--dtypes", "nvfp4"])



def test_parse_mlp():
    assert BG.parse_mlp("65536:1280") == (65536, 1280)


@pytest.mark.parametrize("bad", ["65536", "65536:1281", "0:1280", "a:8", "8:8:8"])
def test_bad_mlp_raises_naming_the_flag(bad):
    with pytest.raises(ValueError, match="--mlp"):
        BG.main(["--mlp", bad])


def test_mlp_dtypes_are_bf16_and_fp8():
    with pytest.raises(ValueError, match=r"--dtypes \(with --mlp\): got 'nvfp4'; accepted: bf16\|fp8"):
        BG.main(["--mlp", "64:16", "--dtypes", "nvfp4"])
    with pytest.raises(ValueError, match=r"--dtypes: got 'fp16'"):
        BG.main(["--dtypes", "fp16"])


def test_parse_qk():
    assert BG.parse_qk("65536:1280") == (65536, 1280)
    for bad in ("65536", "65536:1000", "1000:1280", "0:1280", "a:128"):
        with pytest.raises(ValueError, match="--qk"):
            BG.parse_qk(bad)


def test_qk_variants_compute_the_same_rotary_norm_on_cpu():
    """cublas+rope (plain order) and fused (interleaved heads, triton_qk's torch math on CPU) are
    the same values up to that order."""
    from nanochat import triton_qk
    torch.manual_seed(0)
    plain = BG.make_qk_pass("cublas+rope", 2048, 128, "cpu")()[0].float().reshape(-1, 128)
    torch.manual_seed(0)
    fused = BG.make_qk_pass("fused", 2048, 128, "cpu")()[0].float()
    torch.testing.assert_close(fused, triton_qk.interleave(plain.t(), 128).t(), rtol=2e-2, atol=2e-2)


def test_an_empty_dtype_list_is_refused():
    """`--dtypes ""` used to mean every dtype."""
    with pytest.raises(ValueError, match="--dtypes: got ''"):
        BG.parse_args(["--dtypes", ""])


@pytest.mark.parametrize("argv, flag", [
    (["--shapes", "4096x4096x4100"], "--shapes"),                          # K % 16: fp8 (default dtypes)
    (["--shapes", "4096x4104x4096", "--dtypes", "fp8"], "--shapes"),       # N % 16
    (["--shapes", "4096x4096x4112", "--dtypes", "nvfp4"], "--shapes"),     # K % 32 (two fp4 per byte)
    (["--linears", "65536:1280x1288", "--dtypes", "fp8"], "--linears"),   # OUT % 16
    (["--linears", "1000:1280x1280"], "--linears"),                        # M % 16 (the wgrad reduction)
    (["--mlp", "65536:1288"], "--mlp"),                                    # C % 16 with fp8 in the defaults
])
def test_sizes_the_fp8_or_fp4_gemm_cannot_take_fail_with_the_flags(argv, flag):
    """These raised inside torch._scaled_mm on the GPU: an 'unsupported' row for --shapes, a traceback
    after the bf16 rows for --linears / --mlp."""
    with pytest.raises(ValueError, match=f"^{flag}: got .*multiple"):
        BG.parse_args(argv)


def test_aligned_or_bf16_only_sizes_pass():
    assert BG.parse_args(["--shapes", "1000x4096x4096", "--dtypes", "fp8"]).shapes == [(1000, 4096, 4096)]
    assert BG.parse_args(["--shapes", "100x100x100", "--dtypes", "bf16"]).dtypes == ["bf16"]
    assert BG.parse_args(["--mlp", "65536:1288", "--dtypes", "bf16"]).mlp == (65536, 1288)
    assert BG.parse_args(["--linears", "1000:1280x1280", "--dtypes", "bf16"]).linears == [(1000, 1280, 1280)]
    assert len(BG.parse_args([]).shapes) == 5   # the default shapes suit every dtype


def test_triton_modes_get_the_platform_workarounds(monkeypatch):
    """--mlp / --qk compile and launch Triton kernels, but bench_gemm never applied the platform
    patches: on a GB10 with Triton <= 3.5 (torch 2.9's) the bundled ptxas fails on sm_121a."""
    from types import SimpleNamespace

    from nanochat.platform import SimpleProps, detect_device
    gb10 = detect_device(props=SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9, is_integrated=True))
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(L2_cache_size=24 * 2**20))
    monkeypatch.setattr(BG, "detect_device", lambda d: gb10)
    monkeypatch.setattr(BG, "apply_patches", lambda spec, kernel, compile: seen.append((spec.key, kernel, compile)))
    monkeypatch.setattr(BG, "_run_mlp", lambda *a: 0)
    monkeypatch.setattr(BG, "_run_linears", lambda *a: 0)
    assert BG.main(["--mlp", "64:16"]) == 0 and seen == [("gb10", "triton", True)]
    assert BG.main(["--linears", "64:16x16"]) == 0 and len(seen) == 1   # cuBLAS only: nothing to patch


def test_peak_flops_flag_gives_unknown_gpus_a_percentage(capsys):
    from nanochat.device_table import DeviceSpec

    assert BG.parse_peaks("bf16=989e12,fp8=1979e12") == {"bf16": 989e12, "fp8": 1979e12}
    for bad in ("bf16", "fp16=1e14", "bf16=fast", "bf16=989", "bf16=nan"):
        with pytest.raises(ValueError, match="--peak-flops"):
            BG.main(["--peak-flops", bad])   # before any CUDA work
    unknown = DeviceSpec("Mystery GPU", (9, 0), 100, 80, 3000)
    peaks = BG.resolve_peaks(unknown, ["bf16", "fp8-rowwise", "nvfp4"], {"bf16": 5e14, "fp8-rowwise": 1e15})
    assert peaks == {"bf16": 5e14, "fp8-rowwise": 1e15, "nvfp4": None}
    assert "n/a for nvfp4" in capsys.readouterr().out   # the one without a peak is named, with the fix
    known = DeviceSpec("H100", (9, 0), 132, 80, 3350, peak_tflops={"bf16": 989.0, "fp8": 1979.0})
    assert BG.resolve_peaks(known, ["bf16", "fp8-rowwise"], {}) == {"bf16": 989e12, "fp8-rowwise": 1979e12}
    assert capsys.readouterr().out == ""
    # fp8=X also covers the fp8-rowwise row (the table maps it to fp8 the same way)
    assert BG.resolve_peaks(unknown, ["fp8", "fp8-rowwise"], {"fp8": 2e15}) == {"fp8": 2e15, "fp8-rowwise": 2e15}
