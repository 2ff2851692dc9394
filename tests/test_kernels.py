"""nanochat/kernels.py: every loss backend against plain PyTorch cross-entropy (loss and grads),
with softcap, ignore_index=-1 and a padded lm_head."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanochat.errors import RequestError
from nanochat.kernels import build_loss_fn, ce_rows_torch, current_loss, default_chunk_rows, triton_loss

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
