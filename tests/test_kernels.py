"""nanochat/kernels.py: every loss backend against plain PyTorch cross-entropy (loss and grads),
with softcap, ignore_index=-1 and a padded lm_head."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanochat.errors import RequestError
from nanochat import kernels
from nanochat.kernels import (build_loss_fn, ce_rows_torch, cross_entropy_loss, current_loss, default_chunk_rows,
                              triton_loss)

REPO = Path(__file__).resolve().parents[1]


def plain_ce(hidden, weight, targets, softcap, vocab_size, reduction):
    """Independent reference: full padded logits, padding columns sliced off afterwards."""
    logits = (hidden @ weight.t())[:, :vocab_size].double()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)


def make_case(n=67, c=24, vocab=50, vpad=64, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    weight = (0.5 * torch.randn(vpad, c, generator=g, dtype=torch.float64)).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[torch.randperm(n, generator=g)[: n // 4]] = -1
    return hidden, weight, targets.to(device)


def loss_and_grads(fn, hidden, weight, targets, softcap, vocab, reduction, upstream=None):
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w, targets, softcap, vocab, reduction)
    g = upstream if upstream is not None else torch.ones_like(loss)
    gh, gw = torch.autograd.grad(loss, (h, w), g.to(loss.dtype))
    return loss.detach().double(), gh.double(), gw.double()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [0.0, 15.0, 2.0])
def test_fused_matches_plain_ce(reduction, softcap):
    hidden, weight, targets = make_case()
    upstream = torch.randn(67, dtype=torch.float64) if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
    ref = loss_and_grads(plain_ce, hidden, weight, targets, softcap, 50, reduction, upstream)
    cur = loss_and_grads(current_loss, hidden, weight, targets, softcap, 50, reduction, upstream)
    for chunk in (0, 16, 7):   # default, even chunks, ragged last chunk
        fused = loss_and_grads(lambda *a: triton_loss(*a, chunk_rows=chunk), hidden, weight, targets,
                               softcap, 50, reduction, upstream)
        for got, want in zip(fused, ref):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert fused[2][50:].abs().max() == 0   # padding rows of the head get no gradient
    for got, want in zip(cur, ref):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_online_logsumexp_small_vocab_blocks():
    """The row kernel's online LSE across many vocab blocks equals logsumexp."""
    logits = 5 * torch.randn(9, 100, dtype=torch.float32)
    targets = torch.tensor([3, -1, 99, 0, 5, 6, 7, -1, 50])
    loss, lse = ce_rows_torch(logits.clone(), targets, 15.0, None, block_v=8)
    z = 15.0 * torch.tanh(logits / 15.0)
    torch.testing.assert_close(lse, torch.logsumexp(z, dim=1))
    want = F.cross_entropy(z, targets, ignore_index=-1, reduction="none")
    torch.testing.assert_close(loss, want)
    assert loss[1] == 0 and loss[7] == 0


def test_bf16_inputs_close_to_fp32_reference():
    hidden, weight, targets = make_case(n=128, c=64, vocab=300, vpad=320, dtype=torch.bfloat16)
    ref = loss_and_grads(plain_ce, hidden.double(), weight.double(), targets, 15.0, 300, "mean")
    fused = loss_and_grads(triton_loss, hidden, weight, targets, 15.0, 300, "mean")
    assert abs(fused[0] - ref[0]) / ref[0] < 1e-2
    for got, want in zip(fused[1:], ref[1:]):
        assert (got - want).norm() / want.norm() < 2e-2


def test_all_ignored_matches_pytorch_nan_and_no_grad_path():
    hidden, weight, targets = make_case(n=8)
    targets[:] = -1
    assert torch.isnan(triton_loss(hidden, weight, targets, 15.0, 50, "mean"))
    assert triton_loss(hidden, weight, targets, 15.0, 50, "sum") == 0
    with torch.no_grad():   # no gradient work, same loss
        hidden, weight, targets = make_case(n=8)
        torch.testing.assert_close(triton_loss(hidden, weight, targets, 15.0, 50, "mean").double(),
                                   plain_ce(hidden, weight, targets, 15.0, 50, "mean"))


def test_fp32_master_weight_with_bf16_activations():
    hidden, weight, targets = make_case(n=32, c=32, dtype=torch.float32)
    h16 = hidden.detach().bfloat16().requires_grad_()
    loss = triton_loss(h16, weight, targets, 15.0, 50, "mean")
    loss.backward()
    assert h16.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


def test_compiles_without_graph_break():
    fn = build_loss_fn("triton", "cpu")
    hidden, weight, targets = make_case(n=64, dtype=torch.float32)

    def step(h, w, t):
        return fn(torch.tanh(h), w, t, 15.0, 50, "mean")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    h1, w1 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    compiled(h1, w1, targets).backward()
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    current_loss(torch.tanh(h2), w2, targets, 15.0, 50, "mean").backward()
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-6)


def test_build_loss_fn_validation():
    with pytest.raises(ValueError, match="--kernel"):
        build_loss_fn("cudnn", "cpu")
    with pytest.raises(RequestError, match="--kernel liger needs a CUDA GPU"):
        build_loss_fn("liger", "cpu")
    assert build_loss_fn("current", "cpu") is current_loss
    with pytest.raises(ValueError, match="reduction"):
        triton_loss(*make_case(n=4), 15.0, 50, "avg")
    assert default_chunk_rows(65536, 65536) == 4096
    assert default_chunk_rows(100, 65536) == 100


def _grad_scale_vs_float64(fn, upstream):
    """Least-squares scale of fn's bf16 hidden / head gradients against float64 ones, both with
    the same scalar upstream gradient (what the trainer's loss / count or loss / grad_accum gives)."""
    hidden, weight, targets = make_case(n=96, c=32, vocab=50, vpad=64, dtype=torch.bfloat16, seed=3)
    got = loss_and_grads(fn, hidden, weight, targets, 15.0, 50, "sum", torch.tensor(upstream))
    ref = loss_and_grads(plain_ce, hidden.double(), weight.double(), targets, 15.0, 50, "sum",
                         torch.tensor(upstream, dtype=torch.float64))
    return [((g * r).sum() / (r * r).sum()).item() for g, r in zip(got[1:], ref[1:])]


@pytest.mark.parametrize("fn", [triton_loss, current_loss, cross_entropy_loss], ids=lambda f: f.__name__)
def test_upstream_gradient_scale_is_not_rounded_to_bf16(fn):
    """An upstream gradient of 1/3 scales the bf16 hidden gradient by 1/3, not by bf16(1/3) =
    0.33398 (+0.2% on every hidden gradient, while the head's got the exact 1/3)."""
    for scale in _grad_scale_vs_float64(fn, 1.0 / 3.0):
        assert abs(scale - 1.0) < 5e-4, scale


@pytest.mark.parametrize("softcap", [15.0, 0.0, None])
def test_default_loss_all_ignored_and_no_softcap_match_pytorch(softcap):
    """The model's default loss: all targets ignored with mean gives a NaN loss and zero
    gradients, as F.cross_entropy does (not NaN gradients); softcap 0/None means no softcap, as
    in current_loss and triton_loss (not 0 * tanh(x / 0))."""
    hidden, weight, targets = make_case(n=12)
    for t in (targets, torch.full_like(targets, -1)):
        for reduction in ("mean", "sum", "none"):
            want = loss_and_grads(plain_ce, hidden, weight, t, softcap, 50, reduction)
            got = loss_and_grads(cross_entropy_loss, hidden, weight, t, softcap, 50, reduction)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, equal_nan=True)
            assert torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()


def _fake_liger(tmp_path, monkeypatch, *, accum_dtype=True, per_token="0.8.2"):
    """A stand-in liger_kernel package on sys.path, shaped like the named release's API:
    '0.6.2' (per-token branch only a comment), '0.8.1' (per-token losses, scalar-only backward),
    '0.8.2' (token_grad_output)."""
    root = tmp_path / "liger_kernel"
    for sub in ("", "ops", "transformers"):
        (root / sub).mkdir(exist_ok=True)
        (root / sub / "__init__.py").write_text("")
    extra = ", accum_dtype=None" if accum_dtype else ""
    (root / "transformers" / "fused_linear_cross_entropy.py").write_text(
        "import torch\n"
        "class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):\n"
        f"    def __init__(self, ignore_index=-100, reduction='mean', softcap=None{extra}):\n"
        "        super().__init__()\n"
        "        self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap\n"
        "    def forward(self, lin_weight, _input, target, bias=None):\n"
        "        z = _input @ lin_weight.t()\n"
        "        z = self.softcap * torch.tanh(z / self.softcap) if self.softcap else z\n"
        "        return torch.nn.functional.cross_entropy(z.float(), target, ignore_index=self.ignore_index,\n"
        "                                                 reduction=self.reduction)\n")
    body = {"0.6.2": "    # if reduction == \"none\":\n    #     loss = loss_1d\n    return None\n",
            "0.8.1": "    if reduction == \"none\":\n        return None\n",
            "0.8.2": "    if reduction == \"none\":\n        return token_grad_output\n"}[per_token]
    args = "_input, weight, target, reduction='mean'" + (", token_grad_output=None" if per_token == "0.8.2" else "")
    (root / "ops" / "fused_linear_cross_entropy.py").write_text(
        f"def fused_linear_cross_entropy_forward({args}):\n{body}")
    for name in [m for m in list(__import__("sys").modules) if m.split(".")[0] == "liger_kernel"]:
        monkeypatch.delitem(__import__("sys").modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("release, forward_ok, backward_ok",
                         [("0.6.2", False, False), ("0.8.1", True, False), ("0.8.2", True, True)])
def test_liger_reduction_none_raises_where_the_installed_liger_is_wrong(tmp_path, monkeypatch, release,
                                                                        forward_ok, backward_ok):
    """Liger up to 0.8.1 multiplies every row's gradient by the first token's upstream gradient
    under reduction='none' (up to 0.6.2 it returned the summed loss): such a request raises
    instead of training on wrong gradients; a no-grad per-token forward (evaluate_bpb) still runs
    where its forward is right; mean/sum are unaffected."""
    _fake_liger(tmp_path, monkeypatch, per_token=release)
    assert kernels.liger_per_token_support() == (forward_ok, backward_ok)
    fn = kernels.make_liger_loss()
    hidden, weight, targets = make_case(n=8, dtype=torch.float32)
    assert fn(hidden, weight, targets, 15.0, 50, "mean").ndim == 0
    if backward_ok:
        assert fn(hidden, weight, targets, 15.0, 50, "none").shape == (8,)
    else:
        with pytest.raises(RequestError, match="reduction='none'.*0.8.2"):
            fn(hidden, weight, targets, 15.0, 50, "none")
    with torch.no_grad():
        if forward_ok:
            assert fn(hidden, weight, targets, 15.0, 50, "none").shape == (8,)
        else:
            with pytest.raises(RequestError, match="per-token losses"):
                fn(hidden, weight, targets, 15.0, 50, "none")


def test_liger_without_accum_dtype_raises_a_request_error(tmp_path, monkeypatch):
    """liger-kernel 0.6.0/0.6.1 have no accum_dtype: a RequestError naming the version needed,
    not a TypeError from inside the first loss call."""
    _fake_liger(tmp_path, monkeypatch, accum_dtype=False)
    with pytest.raises(RequestError, match="liger-kernel >= 0.6.2"):
        kernels._liger_module(15.0, "mean")


def test_triton_interpreter_runs_the_real_kernels(run_triton_interpreted):
    """The Triton kernels themselves, on CPU through TRITON_INTERPRET=1 (subprocess: the flag
    must be set before triton is imported)."""
    script = (
        "import torch, torch.nn.functional as F\n"
        "from nanochat.kernels import triton_loss, _use_triton\n"
        "torch.manual_seed(0)\n"
        "h = torch.randn(20, 16, requires_grad=True); w = torch.randn(40, 16, requires_grad=True)\n"
        "t = torch.randint(0, 37, (20,)); t[::4] = -1\n"
        "assert _use_triton(h)\n"
        # softcap 3: the fixed-shift logsumexp; 0: no softcap; 50: softcapped, online max
        "for red, cap in (('mean', 3.0), ('none', 3.0), ('mean', 0.0), ('none', 50.0)):\n"
        "    l = triton_loss(h, w, t, cap, 37, red, chunk_rows=8)\n"
        "    gh, gw = torch.autograd.grad(l.sum(), (h, w))\n"
        "    z = h @ w[:37].t()\n"
        "    z = cap * torch.tanh(z / cap) if cap else z\n"
        "    r = F.cross_entropy(z, t, ignore_index=-1, reduction=red)\n"
        "    rh, rw = torch.autograd.grad(r.sum(), (h, w))\n"
        "    for a, b in ((l, r), (gh, rh), (gw, rw)):\n"
        "        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


# ------------------------------------------------------------------------------------ GPU

def _gpu_case(n=4096, c=512, vocab=32000, vpad=32768, seed=0):
    hidden, weight, targets = make_case(n, c, vocab, vpad, torch.bfloat16, seed, "cuda")
    return hidden, weight, targets


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True])
def test_triton_matches_current_on_gpu(compiled):
    """Tolerances: loss rel 1e-3, grads rel 2e-2 (bf16 logits/grad storage on both sides)."""
    hidden, weight, targets = _gpu_case()
    fn = build_loss_fn("triton", "cuda")
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    ref = loss_and_grads(plain_ce, hidden.double(), weight.double(), targets, 15.0, 32000, "mean")
    cur = loss_and_grads(current_loss, hidden, weight, targets, 15.0, 32000, "mean")
    got = loss_and_grads(fn, hidden, weight, targets, 15.0, 32000, "mean")
    assert _rel(got[0], ref[0]) < 1e-3
    for i in (1, 2):
        assert _rel(got[i], ref[i]) < 2e-2
        assert _rel(got[i], ref[i]) < 2 * _rel(cur[i], ref[i]) + 1e-3


@pytest.mark.cuda
def test_liger_matches_current_under_compile_with_ignored_targets():
    pytest.importorskip("liger_kernel")
    hidden, weight, targets = _gpu_case(n=2048)
    ref = loss_and_grads(current_loss, hidden, weight, targets, 15.0, 32000, "mean")
    fn = build_loss_fn("liger", "cuda")   # eager island: Liger PR #1338 cannot bite
    for f in (fn, torch.compile(fn)):
        got = loss_and_grads(f, hidden, weight, targets, 15.0, 32000, "mean")
        assert _rel(got[0], ref[0]) < 1e-3
        assert _rel(got[1], ref[1]) < 2e-2 and _rel(got[2], ref[2]) < 2e-2


def test_check_kernel_refuses_triton_where_it_cannot_run(monkeypatch):
    """--kernel triton on MPS, or on CUDA without the triton package, passed the recipes' early check
    and failed later in build_loss_fn with a plain RuntimeError (after the model was built)."""
    import importlib.util

    from nanochat.errors import RequestError
    from nanochat.kernels import check_kernel

    with pytest.raises(RequestError, match="^--kernel triton runs on cuda and cpu, not mps; use --kernel current"):
        check_kernel("triton", "mps")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(RequestError, match="^--kernel triton needs the triton package on CUDA"):
        check_kernel("triton", "cuda")
    check_kernel("triton", "cpu")   # the CPU path needs no triton
