"""Review 8 of the loss kernels and attention backend selection (nanochat/kernels.py,
nanochat/attention.py) as a user of --kernel and --attn-backend: every loss backend against
the plain reference (values and gradients, ignored rows, all rows ignored, a padded head),
Liger's all-ignored mean, and CUDA refusals that name what the device still accepts."""

import pytest
import torch

from nanochat import attention as A
from nanochat import kernels
from nanochat.errors import RequestError
from tests.test_kernels import _fake_liger

V, VPAD = 11, 16   # real vocab rows and the padded head's rows


def _grads(fn, hidden, weight, targets, softcap, reduction):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets, softcap, V, reduction)
    up = torch.linspace(-1.5, 2.0, loss.numel(), dtype=loss.dtype).view(loss.shape)   # per-row upstream
    gh, gw = torch.autograd.grad((loss * up).sum(), (h, w))
    return loss.detach(), gh, gw


@pytest.mark.parametrize("ignored", ["some", "all"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [0.0, None, 3.0])
def test_every_loss_matches_the_reference_with_ignored_rows_and_a_padded_head(ignored, reduction, softcap):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(7, 5, generator=g), torch.randn(VPAD, 5, generator=g)
    targets = torch.randint(0, V, (7,), generator=g)
    targets[::3 if ignored == "some" else 1] = -1
    want = _grads(kernels.current_loss, hidden, weight, targets, softcap, reduction)
    if ignored == "all" and reduction == "mean":
        assert want[0].isnan() and not want[1].any()   # F.cross_entropy: NaN loss, zero gradients
    for fn in (kernels.cross_entropy_loss, kernels.triton_loss,
               lambda *a: kernels.triton_loss(*a, chunk_rows=2)):
        got = _grads(fn, hidden, weight, targets, softcap, reduction)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
        assert not got[2][V:].any()   # the padding rows of the head get no gradient


def _liger_like_release(tmp_path, monkeypatch):
    """The stand-in package, its loss computed as liger-kernel 0.8.5 does (checked under
    TRITON_INTERPRET=1): rows pre-divided by the kept count, then summed, so an all-ignored
    mean is 0.0, not F.cross_entropy's NaN."""
    _fake_liger(tmp_path, monkeypatch)
    (tmp_path / "liger_kernel" / "transformers" / "fused_linear_cross_entropy.py").write_text(
        "import torch\n"
        "class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):\n"
        "    def __init__(self, ignore_index=-100, reduction='mean', softcap=None, accum_dtype=None):\n"
        "        super().__init__()\n"
        "        self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap\n"
        "    def forward(self, lin_weight, _input, target, bias=None):\n"
        "        z = _input @ lin_weight.t()\n"
        "        z = self.softcap * torch.tanh(z / self.softcap) if self.softcap else z\n"
        "        rows = torch.nn.functional.cross_entropy(z.float(), target, ignore_index=self.ignore_index,\n"
        "                                                 reduction='none')\n"
        "        if self.reduction == 'none':\n"
        "            return rows\n"
        "        kept = max(int((target != self.ignore_index).sum()), 1)\n"
        "        return (rows / kept).sum() if self.reduction == 'mean' else rows.sum()\n")


def test_liger_all_ignored_mean_is_nan_like_the_other_kernels(tmp_path, monkeypatch):
    """--kernel liger returned 0.0 for an all-ignored mean where current and triton return NaN:
    the same batch passed the trainer's non-finite guard or stopped it depending on --kernel."""
    _liger_like_release(tmp_path, monkeypatch)
    fn = kernels.make_liger_loss()
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(6, 5, generator=g), torch.randn(VPAD, 5, generator=g)
    targets = torch.full((6,), -1)
    loss, gh, gw = _grads(fn, hidden, weight, targets, 3.0, "mean")
    assert loss.isnan() and not gh.any() and not gw.any()
    assert fn(hidden, weight, targets, 3.0, V, "sum") == 0
    targets[2] = 4   # one kept row: Liger's own value, untouched
    for reduction in ("mean", "sum"):
        got = _grads(fn, hidden, weight, targets, 3.0, reduction)
        for a, b in zip(got, _grads(kernels.current_loss, hidden, weight, targets, 3.0, reduction)):
            torch.testing.assert_close(a, b)


def test_cuda_refusals_name_what_the_gpu_still_accepts(monkeypatch):
    """--attn-backend cudnn / cudnn_fa4 refused on a GPU (frontend missing, FA4 missing, a probe
    launch failed) named the fix but no backend to run meanwhile; cudnn stays listed when only
    FA4 failed."""
    from nanochat import cudnn_attention, fa4_attention

    monkeypatch.setattr(cudnn_attention, "available", lambda: "nvidia-cudnn-frontend is not installed")
    for name in ("cudnn", "cudnn_fa4"):
        with pytest.raises(RequestError, match=rf"^--attn-backend {name}: nvidia-cudnn-frontend is not "
                                               r"installed; accepted here: auto\|sdpa\|flex\|reference$"):
            A.resolve_backend(name, "cuda:0")
    monkeypatch.setattr(cudnn_attention, "available", lambda: None)
    monkeypatch.setattr(fa4_attention, "available", lambda: "flash-attn-4 is not installed")
    with pytest.raises(RequestError, match=r"flash-attn-4 is not installed; accepted here: "
                                           r"auto\|sdpa\|flex\|cudnn\|reference$"):
        A.resolve_backend("cudnn_fa4", "cuda:0")
    monkeypatch.setattr(fa4_attention, "probe", lambda dev: "FA4 backward disagrees")
    monkeypatch.setattr(cudnn_attention, "probe", lambda dev: None)
    with pytest.raises(RequestError, match=r"^--attn-backend cudnn_fa4: FA4 backward disagrees; "
                                           r"accepted here: auto\|sdpa\|flex\|cudnn\|reference$"):
        A.prepare_masks(64, [None], "cuda", "cudnn_fa4")
    monkeypatch.setattr(cudnn_attention, "probe", lambda dev: "launch failed")
    with pytest.raises(RequestError, match=r"^--attn-backend cudnn: launch failed; accepted here: "
                                           r"auto\|sdpa\|flex\|reference$"):
        A.prepare_masks(64, [None], "cuda", "cudnn")
