"""nanochat/precision.py: validation against simulated devices, the nvfp4 quantiser, TE recipe
construction (with a fake TE), fp8 numerics and module swapping."""

import dataclasses
import enum
import types

import pytest
import torch
import torch.nn as nn

from nanochat import precision as PR
from nanochat.platform import SimpleProps, detect_device
from nanochat.precision_te import build_te_recipe

H100 = detect_device(props=SimpleProps("NVIDIA H100 80GB HBM3", 9, 0, 132, 80 * 10**9))
A100 = detect_device(props=SimpleProps("NVIDIA A100-SXM4-80GB", 8, 0, 108, 80 * 10**9))
GB10 = detect_device(props=SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9))
B200 = detect_device(props=SimpleProps("NVIDIA B200", 10, 0, 148, 180 * 10**9))
CPU = detect_device("cpu")


def test_requests_the_device_cannot_serve_raise():
    with pytest.raises(ValueError, match="--precision nvfp4.*Blackwell.*emulated"):
        PR.resolve("nvfp4", "auto", H100, te_available=True)
    with pytest.raises(ValueError, match="--precision fp8.*8.9"):
        PR.resolve("fp8", "auto", A100)
    with pytest.raises(ValueError, match="--precision fp8"):
        PR.resolve("fp8", "native", CPU)
    with pytest.raises(ValueError, match="Transformer Engine"):
        PR.resolve("nvfp4", "auto", GB10, te_available=False)
    with pytest.raises(ValueError, match="--precision-backend te"):
        PR.resolve("fp8", "te", H100, te_available=False)
    with pytest.raises(ValueError, match="--precision-backend"):
        PR.resolve("fp8", "magic", H100)
    with pytest.raises(ValueError, match="--precision:"):
        PR.resolve("fp6", "auto", H100)
    with pytest.raises(ValueError, match="accepted for nvfp4"):
        PR.resolve("nvfp4", "native", B200, te_available=True)


def test_resolution_of_valid_requests():
    assert PR.resolve("fp8", "auto", H100).backend == "native"
    assert PR.resolve("fp8", "auto", GB10).backend == "native"
    assert PR.resolve("nvfp4", "auto", GB10, te_available=True).backend == "te"
    plan = PR.resolve("nvfp4", "emulated", CPU)
    assert plan.backend == "emulated" and plan.peak_key == "bf16"
    assert PR.resolve("auto", "auto", CPU, compute_dtype="fp32").precision == "fp32"
    assert PR.resolve("bf16", "auto", H100).backend == "none"


def test_e2m1_rounding_grid_and_ties():
    y = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, -0.75, -5.0])
    want = torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, -1.0, -4.0])
    torch.testing.assert_close(PR.round_to_e2m1(y), want)


def test_nvfp4_quantiser_properties():
    x = torch.randn(8, 64) * torch.logspace(-3, 2, 64)   # wide dynamic range across blocks
    values, block_scale, tensor_scale = PR.quantize_nvfp4(x)
    grid = torch.tensor(PR.E2M1_GRID)
    assert torch.isin(values.abs(), grid).all()
    assert block_scale.shape == (8, 4)
    # block scales are representable in e4m3 and within its range
    assert (block_scale.to(torch.float8_e4m3fn).float() == block_scale).all() and block_scale.max() <= 448
    deq = (values * block_scale[..., None] * tensor_scale).reshape(x.shape)
    # each block's largest element is reproduced within e2m1/e4m3 rounding
    xb = x.reshape(8, 4, 16)
    big = xb.abs().amax(-1)
    dbig = deq.reshape(8, 4, 16).abs().amax(-1)
    assert ((dbig - big).abs() / big).max() < 0.2
    assert ((deq - x).norm() / x.norm()) < 0.15
    with pytest.raises(ValueError, match="divisible by 16"):
        PR.quantize_nvfp4(torch.randn(3, 20))


def test_fake_quant_is_straight_through():
    x = torch.randn(4, 32, requires_grad=True)
    y = PR.fake_quant_nvfp4(x)
    assert not torch.equal(y, x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList([nn.ModuleDict({"c_q": nn.Linear(64, 64, bias=False),
                                               "c_fc": nn.Linear(64, 256, bias=False),
                                               "gate": nn.Linear(12, 4, bias=False)}) for _ in range(2)])
        self.lm_head = nn.Linear(64, 96, bias=False)

    def forward(self, x):
        for blk in self.h:
            x = x + blk["c_q"](x) + blk["c_fc"](x)[..., :64]
        return self.lm_head(x)


def test_module_swap_keeps_parameters_and_rules():
    model = TinyGPT()
    params_before = {n: p for n, p in model.named_parameters()}
    keys_before = set(model.state_dict())
    plan = PR.convert_model(model, PR.resolve("nvfp4", "emulated", CPU), CPU)
    assert sorted(plan.converted) == ["h.0.c_fc", "h.0.c_q", "h.1.c_fc", "h.1.c_q"]
    assert any(k.startswith("lm_head") for k in plan.kept_high_precision)
    assert any("h.0.gate" in k and "not multiples of 32" in k for k in plan.kept_high_precision)
    assert isinstance(model.h[0]["c_q"], PR.EmulatedNVFP4Linear) and type(model.lm_head) is nn.Linear
    assert set(model.state_dict()) == keys_before
    for n, p in model.named_parameters():
        assert p is params_before[n]
    x = torch.randn(3, 64)
    y = model(x)
    y.square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "gate" not in n)
    with torch.no_grad():   # eval path is the plain matmul: differs from the quantised training one
        assert not torch.allclose(model(x), y.detach())


def test_startup_check_emulated_on_cpu():
    rel = PR.startup_check(PR.resolve("nvfp4", "emulated", CPU), CPU, torch.device("cpu"), torch.float32)
    assert 0 < rel < 0.25


def test_fp8_linear_numerics_on_cpu():
    if not _has_cpu_scaled_mm():
        pytest.skip("this torch has no CPU _scaled_mm")
    _check_fp8_linear("cpu", torch.float32)


def _has_cpu_scaled_mm() -> bool:
    try:
        torch._scaled_mm(torch.zeros(16, 16, dtype=torch.float8_e4m3fn),
                         torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t(),
                         scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_fp8_cast_transpose_layouts():
    x = torch.randn(48, 80) * 3
    x[5, 7] = -5000.0  # x * scale beyond both formats' range: must clamp, never inf/nan
    scale = torch.tensor(20.0)
    for e5m2, fmax in ((False, PR.E4M3_MAX), (True, PR.E5M2_MAX)):
        q, qt = PR.fp8_cast_transpose(x, scale, e5m2)
        assert q.dtype == (torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn) and qt.shape == (80, 48)
        assert qt.is_contiguous() and torch.equal(qt.float(), q.float().t())
        assert torch.equal(q.float(), (x * scale).clamp(-fmax, fmax).to(q.dtype).float())
        assert q[5, 7].float() == -fmax and qt[7, 5].float() == -fmax
    fq, fqt = PR.fp8_cast_transpose(torch.empty(32, 16, device="meta"), scale, False)
    assert fq.shape == (32, 16) and fqt.shape == (16, 32)


def test_fp8_cast_transpose_triton_kernel_in_interpreter(run_triton_interpreted):
    """The Triton kernel itself (TRITON_INTERPRET=1, in a subprocess: the flag must be set before
    triton is imported), on a shape with partial tiles: tiling, masks, the transposed store and
    the clamp, in both block orders. The values are exact in both fp8 formats, because the interpreter's own fp8
    rounding is wrong near powers of two (-7.98 -> -4.0 in Triton 3.6); the GPU test checks
    rounding against torch on the real hardware conversion."""
    script = (
        "import torch\n"
        "from nanochat import precision as PR\n"
        "from nanochat.triton_kernels import fp8_cast_transpose_triton\n"
        "grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32])\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for n in (130, 4100):  # the narrow (64 x 64) and the wide (128 x 128) tile\n"
        "  x = (grid[torch.randint(0, 13, (70, n), generator=g)] * (torch.randint(0, 2, (70, n), generator=g) * 2 - 1))\n"
        "  x = x.bfloat16(); x[3, n - 1] = 1e6  # saturates both formats\n"
        "  for e5m2, dt, fmax in ((False, torch.float8_e4m3fn, 448.0), (True, torch.float8_e5m2, 57344.0)):\n"
        "    ref = (x.float() * 0.5).clamp(-fmax, fmax)\n"
        "    q, qt = PR.fp8_cast_transpose(x, torch.tensor(0.5), e5m2)\n"
        "    assert q.dtype == dt and qt.shape == (n, 70) and qt.is_contiguous()\n"
        "    assert torch.equal(q.float(), ref) and torch.equal(qt.float(), ref.t())\n"
        "    # both block orders, several blocks each way; on the narrow input only (the wide one adds\n"
        "    # nothing but ~900 more interpreted programs: same kernel, same masks, a longer grid)\n"
        "    for tile in ((32, 64, 4, True), (64, 32, 4, False)) if n == 130 else ():\n"
        "      q, qt = fp8_cast_transpose_triton(x, torch.tensor([0.5]), dt, fmax, tile)\n"
        "      assert torch.equal(q.float(), ref) and torch.equal(qt.float(), ref.t())\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


def _emulated_scaled_mm(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum=False):
    """torch._scaled_mm's math in float64, with its layout contract (a row-major, b column-major,
    fp8 operands, float32 scalar scales) asserted: the GPU kernel refuses anything else."""
    assert a.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and b.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    assert a.stride(1) == 1 and b.stride(0) == 1, (a.stride(), b.stride())
    assert scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dtype == torch.float32
    out = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
    return out.to(out_dtype)


def test_fp8_fused_transpose_matmul_equals_plain(monkeypatch):
    """Same scales and rounding: the fused-transpose autograd function reproduces _Fp8Matmul
    (output and both gradients), and every GEMM gets the layouts _scaled_mm accepts. On CPU the
    GEMM is emulated (torch has no CPU _scaled_mm); the CUDA test below runs the real one."""
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm)
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(64, 96, generator=g), torch.randn(48, 96, generator=g), torch.randn(64, 48, generator=g)
    results = []
    for fn in (PR._Fp8Matmul, PR._Fp8MatmulFusedTranspose, PR._Fp8MatmulFusedTransposeLean):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn.apply(xl, wl, torch.float8_e5m2)
        y.backward(dy)
        results.append((y, xl.grad, wl.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_fp8_lean_fused_transpose_saves_the_input_not_an_fp8_copy(monkeypatch):
    """The lean fused-transpose matmul keeps the bf16 input (already saved by the norms, or
    recomputable) rather than a transposed fp8 copy, which the compile partitioner cannot drop:
    that copy costs 10 GiB at d20 dbs 32 on the H100 (56.7 vs 46.6 GiB)."""
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm)
    x = torch.randn(64, 96, requires_grad=True)
    w = torch.randn(48, 96, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = PR._Fp8MatmulFusedTransposeLean.apply(x, w, torch.float8_e5m2)
    big = [t for t in saved if t.numel() > 1]
    assert any(t is x for t in big)
    assert not any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and t.shape == (96, 64) for t in big)
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def _check_fp8_linear(device, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(256, 128, bias=False).to(device)
    fp8 = PR._rebuild(PR.Fp8Linear, nn.Linear(256, 128, bias=False).to(device))
    fp8.weight = nn.Parameter(lin.weight.detach().clone())
    x = torch.randn(64, 256, device=device, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(64, 128, device=device, dtype=dtype)
    y_ref = nn.functional.linear(x1.float(), lin.weight.float())
    y_ref.backward(g.float())
    y = fp8(x2)
    y.backward(g)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(y, y_ref) < 0.06           # e4m3: 3 mantissa bits, per-tensor scales
    assert rel(x2.grad, x1.grad) < 0.12   # e5m2 gradients: 2 mantissa bits
    assert rel(fp8.weight.grad, lin.weight.grad) < 0.12
    assert fp8.weight.grad.dtype == fp8.weight.dtype


@pytest.mark.cuda
def test_fp8_linear_numerics_on_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs cc >= 8.9")
    _check_fp8_linear("cuda", torch.bfloat16)
    layer = PR._rebuild(PR.Fp8Linear, nn.Linear(256, 256, bias=False).cuda())
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled(x).float().square().mean().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0


@pytest.mark.cuda
def test_fp8_fused_transpose_on_gpu_matches_plain():
    """The Triton cast + transpose against the compiled `.t().contiguous()` path: same fp8 values
    (both round to nearest even), so outputs and gradients agree to the last bit or nearly."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs cc >= 8.9")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 1024, device="cuda", generator=g).bfloat16()
    q, qt = PR.fp8_cast_transpose(x, torch.tensor(30.0, device="cuda"), False)
    ref = (x.float() * 30.0).clamp(-PR.E4M3_MAX, PR.E4M3_MAX).to(torch.float8_e4m3fn)
    assert torch.equal(q.float(), ref.float()) and torch.equal(qt.float(), ref.float().t())
    w = torch.randn(768, 1024, device="cuda", generator=g)
    dy = torch.randn(4096, 768, device="cuda", generator=g).bfloat16()
    results = []
    for fn in (PR._Fp8Matmul, PR._Fp8MatmulFusedTranspose, PR._Fp8MatmulFusedTransposeLean):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        torch.compile(lambda a, b: fn.apply(a, b, torch.float8_e5m2))(xl, wl).backward(dy)
        results.append((xl.grad.float(), wl.grad.float()))
    for other in results[1:]:
        for a, b in zip(other, results[0]):
            assert ((a - b).norm() / b.norm()).item() < 1e-3


# ------------------------------------------------------------------------------------ fake TE

class Format(enum.Enum):
    E4M3 = 0
    HYBRID = 1


@dataclasses.dataclass
class Float8CurrentScaling:
    fp8_format: Format = Format.E4M3


@dataclasses.dataclass
class DelayedScaling:
    fp8_format: Format = Format.E4M3


def fake_te(with_override: bool):
    fields = {"disable_rht": False, "disable_stochastic_rounding": False}
    if with_override:
        fields["backward_override"] = None
    nvfp4 = dataclasses.make_dataclass("NVFP4BlockScaling",
                                       [(k, object, dataclasses.field(default=v)) for k, v in fields.items()])
    return types.SimpleNamespace(Format=Format, Float8CurrentScaling=Float8CurrentScaling,
                                 DelayedScaling=DelayedScaling, NVFP4BlockScaling=nvfp4)


def test_te_recipes_built_from_real_fields():
    recipe, desc = build_te_recipe("nvfp4", GB10, fake_te(True))
    assert recipe.disable_rht is True and recipe.disable_stochastic_rounding is True
    assert recipe.backward_override == "high_precision"
    assert desc["recipe"] == "NVFP4BlockScaling"
    recipe, _ = build_te_recipe("nvfp4", B200, fake_te(False))   # Blackwell DC: RHT/SR fine
    assert recipe.disable_rht is False
    recipe, _ = build_te_recipe("fp8", H100, fake_te(True))
    assert isinstance(recipe, Float8CurrentScaling) and recipe.fp8_format is Format.HYBRID
    with pytest.raises(ValueError, match="DelayedScaling"):
        build_te_recipe("fp8", H100, fake_te(True), compile=True, fp8_recipe="delayed")
    assert isinstance(build_te_recipe("fp8", H100, fake_te(True), compile=False,
                                         fp8_recipe="delayed")[0], DelayedScaling)


def test_te_recipe_that_drops_fields_is_caught():
    class Dropping:   # declares its fields (pydantic-style) but ignores the keywords given
        model_fields = {"disable_rht": None, "disable_stochastic_rounding": None}
        disable_rht = False
        disable_stochastic_rounding = False

        def __init__(self, **kwargs):
            pass

    te = fake_te(False)
    te.NVFP4BlockScaling = Dropping
    with pytest.raises(RuntimeError, match="after construction"):
        build_te_recipe("nvfp4", GB10, te)


def test_fp8_wgrad_mode_choices():
    """Each mode is set on every Fp8Linear of the model and picks its autograd function; an unknown
    one raises naming the flag and the accepted values; base_train offers the same names."""
    from scripts.base_train import FP8_WGRAD
    model = nn.Sequential(PR._rebuild(PR.Fp8Linear, nn.Linear(32, 32, bias=False)),
                          PR._rebuild(PR.Fp8Linear, nn.Linear(32, 16, bias=False)), nn.Linear(16, 8))
    assert tuple(PR.FP8_WGRAD_MODES) == FP8_WGRAD
    for mode in PR.FP8_WGRAD_MODES:
        assert PR.set_fp8_wgrad_mode(model, mode) == 2
        assert model[0].wgrad_mode == model[1].wgrad_mode == mode
    with pytest.raises(ValueError, match="--fp8-wgrad.*save|recompute|plain"):
        PR.set_fp8_wgrad_mode(model, "fast")


# ------------------------------------------------------------------ audit: every device x every request

DEVICES = {"gb10": GB10, "h100": H100, "b200": B200,
           "h200": detect_device(props=SimpleProps("NVIDIA H200", 9, 0, 132, 141 * 10**9)),
           "rtx5090": detect_device(props=SimpleProps("NVIDIA GeForce RTX 5090", 12, 0, 170, 32 * 10**9)),
           "unknown-8.6": detect_device(props=SimpleProps("NVIDIA GeForce RTX 3090", 8, 6, 82, 24 * 10**9)),
           "unknown-10.3": detect_device(props=SimpleProps("NVIDIA B300 SXM6 AC", 10, 3, 148, 288 * 10**9)),
           "cpu": CPU}
# what each request resolves to (precision/backend) with TE installed, or the flag its error names
EXPECTED = {
    "gb10": ("bf16/none", "bf16/none", "fp8/native", "nvfp4/te"),
    "h100": ("bf16/none", "bf16/none", "fp8/native", "--precision nvfp4"),
    "h200": ("bf16/none", "bf16/none", "fp8/native", "--precision nvfp4"),
    "b200": ("bf16/none", "bf16/none", "fp8/native", "nvfp4/te"),
    "rtx5090": ("bf16/none", "bf16/none", "fp8/native", "nvfp4/te"),
    "unknown-8.6": ("bf16/none", "bf16/none", "--precision fp8", "--precision nvfp4"),
    "unknown-10.3": ("bf16/none", "bf16/none", "fp8/native", "nvfp4/te"),
    "cpu": ("fp32/none", "--precision bf16", "--precision fp8", "--precision nvfp4"),
}


@pytest.mark.parametrize("name", list(DEVICES))
def test_every_request_on_every_device_resolves_or_names_the_flag(name):
    spec, dtype = DEVICES[name], "fp32" if name == "cpu" else "bf16"
    for request, want in zip(("auto", "bf16", "fp8", "nvfp4"), EXPECTED[name]):
        if want.startswith("--"):
            with pytest.raises(ValueError, match=f"^{want}: .*(accepted|[Uu]se) "):
                PR.resolve(request, "auto", spec, compute_dtype=dtype, te_available=True)
        else:
            plan = PR.resolve(request, "auto", spec, compute_dtype=dtype, te_available=True)
            assert f"{plan.precision}/{plan.backend}" == want, (name, request)


def test_explicit_bf16_or_fp32_that_is_not_the_compute_dtype_raises():
    """bench_train / profile_training ran `--precision fp32` on a GPU in bf16 (their runtime dtype)
    and reported fp32, with utilisation against the TF32 peak; `--precision bf16` on a CPU ran fp32."""
    with pytest.raises(ValueError, match=r"--precision fp32: this run computes in bf16.*accepted here: auto\|bf16"):
        PR.resolve("fp32", "auto", H100, compute_dtype="bf16")
    with pytest.raises(ValueError, match="--precision bf16: this run computes in fp32"):
        PR.resolve("bf16", "auto", CPU, compute_dtype="fp32")
    assert PR.resolve("fp32", "auto", H100, compute_dtype="fp32").peak_key == "fp32"
    assert PR.resolve("auto", "auto", H100, compute_dtype="fp32").precision == "fp32"
