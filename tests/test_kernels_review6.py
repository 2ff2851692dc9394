"""Review 6 of the training kernels (nanochat/kernels.py, nanochat/triton_kernels.py): bad input
named with the accepted values instead of a silent wrong loss, the row kernels' strided inputs."""

import pytest
import torch

from nanochat import kernels
from nanochat.kernels import build_loss_fn, cross_entropy_loss, current_loss, triton_loss
from tests.test_kernels import _fake_liger, make_case


@pytest.mark.parametrize("fn", [cross_entropy_loss, current_loss, triton_loss], ids=lambda f: f.__name__)
def test_unknown_reduction_is_refused_by_every_loss(fn):
    """cross_entropy_loss (the model's default loss) returned the summed loss for any reduction
    name other than mean/none ("avg", "Mean"), a silently wrong scale."""
    hidden, weight, targets = make_case(n=6)
    for bad in ("avg", "Mean"):
        with pytest.raises(ValueError, match=r"reduction: got .*accepted: mean\|sum\|none"):
            fn(hidden, weight, targets, 15.0, 50, bad)


def test_triton_loss_refuses_targets_that_do_not_match_the_rows():
    """12 targets for 10 rows gave a finite loss (the extra targets also counted in the mean's
    denominator); on CUDA the kernel read targets past the rows."""
    hidden, weight, targets = make_case(n=10)
    longer = torch.cat([targets, torch.tensor([3, 4])])
    with pytest.raises(ValueError, match=r"loss shapes: accepted hidden \(N, C\), weight \(V, C\), targets \(N,\)"):
        triton_loss(hidden, weight, longer, 15.0, 50, "mean")
    with pytest.raises(ValueError, match="loss shapes"):
        triton_loss(hidden.view(2, 5, -1), weight, targets.view(2, 5), 15.0, 50, "mean")


def test_triton_loss_refuses_a_vocab_size_above_the_head_rows():
    """vocab_size 70 with a 64-row head: target ids 64..69 passed the target check and were read
    past the logits (CPU: a resize warning and a loss over 64 columns)."""
    hidden, weight, targets = make_case(n=8)
    for vocab in (70, 0):
        with pytest.raises(ValueError, match=r"vocab_size: got -?\d+; accepted: 1\.\.64"):
            triton_loss(hidden, weight, targets, 15.0, vocab, "mean")


def test_negative_chunk_rows_named_at_build_time():
    """build_loss_fn('triton', chunk_rows=-4) (benchmark_kernels' triton@-4) built a loss that
    failed at its first call with 'Trying to create tensor with negative dimension'."""
    with pytest.raises(ValueError, match="chunk_rows: got -4; accepted: 0"):
        build_loss_fn("triton", "cpu", chunk_rows=-4)
    with pytest.raises(ValueError, match="chunk_rows: got -1"):
        triton_loss(*make_case(n=4), 15.0, 50, "mean", chunk_rows=-1)


def test_liger_checks_targets_like_the_other_backends(tmp_path, monkeypatch):
    """Liger's kernel reads logits[row, target] unchecked: a target of -100 (another library's
    ignore_index) or >= vocab_size reached it; now the same ValueError as --kernel triton."""
    _fake_liger(tmp_path, monkeypatch)
    fn = kernels.make_liger_loss()
    hidden, weight, targets = make_case(n=8, dtype=torch.float32)
    for bad in (-100, 50):
        t = targets.clone()
        t[2] = bad
        with pytest.raises(ValueError, match=r"loss targets: accepted -1 \(ignored\) or a token id in 0\.\.49"):
            fn(hidden, weight, t, 15.0, 50, "mean")
    with pytest.raises(ValueError, match="reduction: got 'avg'"):
        fn(hidden, weight, targets, 15.0, 50, "avg")
    assert torch.isfinite(fn(hidden, weight, targets, 15.0, 50, "mean"))


def test_row_kernels_interpreted_with_strided_targets_and_odd_shapes(run_triton_interpreted):
    """ce_rows_triton / ce_grad_rows_triton (TRITON_INTERPRET=1) against ce_rows_torch: strided
    targets and lse (the kernel indexed them by row, so a strided view gave other rows' targets:
    a loss 1.9 off), a vocab past one 8192 block, bf16 logits, softcaps for both logsumexps,
    ignored rows."""
    script = (
        "import torch\n"
        "from nanochat import triton_kernels as tk\n"
        "from nanochat.kernels import ce_rows_torch, ce_grad_rows_torch\n"
        "torch.manual_seed(0)\n"
        "for rows, V, dt, cap in ((3, 8197, torch.float32, None), (5, 37, torch.bfloat16, 15.0),\n"
        "                         (4, 37, torch.float32, 60.0)):\n"
        "    x = (5 * torch.randn(rows, V)).to(dt)\n"
        "    t = torch.randint(0, V, (2 * rows,))[::2]\n"
        "    t[1] = -1\n"
        "    assert not t.is_contiguous()\n"
        "    a, b = x.clone(), x.clone()\n"
        "    la, sa = tk.ce_rows_triton(a, t, cap, torch.tensor([0.5]))\n"
        "    lb, sb = ce_rows_torch(b, t, cap, torch.tensor([0.5]))\n"
        "    torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5)\n"
        "    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 if dt != torch.float32 else 1e-6)\n"
        "    assert la[1] == 0 and a[1].abs().max() == 0\n"
        "    lse = torch.stack([sb, sb], 1).reshape(-1)[::2]\n"
        "    scale = torch.randn(rows)\n"
        "    a, b = x.clone(), x.clone()\n"
        "    tk.ce_grad_rows_triton(a, t, lse, scale, cap)\n"
        "    ce_grad_rows_torch(b, t, sb, scale, cap)\n"
        "    torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 if dt != torch.float32 else 1e-6)\n"
        "print('OK')\n"
    )
    run_triton_interpreted(script)


@pytest.mark.cuda
def test_cuda_triton_kernel_trains_a_width_whose_rows_tma_cannot_take(capsys):
    """--kernel triton on a model of width 12 (bf16 rows of 24 bytes): the fused relu^2 MLP's TMA
    descriptors need 16-byte multiples, and Triton asserted at the first step. The MLP now stays on
    the Linear path, says why, and a forward + backward gives finite gradients."""
    from nanochat.common import init_runtime
    from nanochat.gpt import config_for_depth
    from nanochat.training import build_model, setup_precision_and_kernel

    rt = init_runtime("cuda", "bf16")
    config = config_for_depth(1, 256, 32, aspect_ratio=12, head_dim=12, window_pattern="L")
    assert config.n_embd == 12
    model = build_model(config, rt.device, compute_dtype=torch.bfloat16)
    info = setup_precision_and_kernel(model, "bf16", "triton", rt, compile=False, precision_backend="auto")
    assert "TMA needs rows of a multiple of 16 bytes" in capsys.readouterr().out
    assert model.blocks[0].mlp.fused is None, info
    x = torch.randint(0, 256, (2, 32), device="cuda")
    loss = model(x, x)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fused_mlp_alignment_reason_names_the_width():
    """The check build_mlp makes before the fused MLP's probe (its TMA rows: 16-byte multiples)."""
    from nanochat.gpt import Linear
    assert "width 12 / hidden 48" in kernels._unaligned_mlp(Linear(12, 48), 2)
    assert kernels._unaligned_mlp(Linear(16, 64), 1) is None and kernels._unaligned_mlp(Linear(8, 32), 2) is None
    assert "1 byte(s)" in kernels._unaligned_mlp(Linear(8, 32), 1)
