"""Model and attention, review 75: masks cached by a forward under torch.inference_mode() (an eval)
must still serve a training forward at that length (flex's autograd saves the BlockMask's tensors
for backward, which refuses inference tensors); the FLOPs-per-token estimate against torch's own
count of the matmuls the model runs; the flex options check re-exported from its new module."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanochat import attention as A
from nanochat import attention_flex_options
from nanochat.gpt import GPT, GPTConfig


class _SaveForBackward(torch.autograd.Function):
    """What FlexAttentionAutogradOp.forward does with every tensor of the block mask it is given
    (torch/_higher_order_ops/flex_attention.py: save_values_for_backward(..., *block_mask[:-1]))."""

    @staticmethod
    def forward(ctx, x, *tensors):
        ctx.save_for_backward(*tensors)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + (None,) * len(ctx.saved_tensors)


def _eval_then_cached_mask(backend: str, T: int, window: int):
    """An eval's window layer at length T under inference_mode, then the mask it left cached."""
    q = torch.randn(1, 2, T, 8)
    with torch.inference_mode():
        A.attention(q, q[:, :1], q[:, :1], window=window, backend=backend)
    if backend == "flex":
        return [t for t in A._BLOCK_MASKS[(T, window, "cpu")].as_tuple() if isinstance(t, torch.Tensor)]
    return [A._DENSE_MASKS[(T, window, "cpu")]]


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_a_mask_an_inference_mode_eval_cached_can_be_saved_for_backward(monkeypatch, backend):
    """The mask caches are shared by every forward at a length. Built first under inference_mode,
    the block mask was an inference tensor, and the next training forward at that length (CUDA:
    sdpa_flex's window layers) failed in flex's autograd with "Inference tensors cannot be saved
    for backward". flex has no CPU backward, so its save is done here as flex does it."""
    monkeypatch.setattr(A, "_BLOCK_MASKS", {})   # fresh caches: no mask another test built
    monkeypatch.setattr(A, "_DENSE_MASKS", {})
    tensors = _eval_then_cached_mask(backend, 40, 7)
    assert tensors and not any(t.is_inference() for t in tensors)
    x = torch.ones(1, requires_grad=True)
    _SaveForBackward.apply(x, *tensors).sum().backward()
    assert x.grad.item() == 1.0


def test_masks_built_in_normal_mode_are_unchanged_and_still_cached(monkeypatch):
    """The build outside inference mode changes nothing else: same values, cached, grad mode kept."""
    monkeypatch.setattr(A, "_DENSE_MASKS", {})
    with torch.no_grad():
        mask = A._dense_mask(9, 3, torch.device("cpu"))
        assert not torch.is_grad_enabled()
    pos = torch.arange(9)
    assert torch.equal(mask, (pos[:, None] >= pos) & (pos[:, None] - pos < 3))
    assert A._dense_mask(9, 3, torch.device("cpu")) is mask


@pytest.mark.cuda
def test_cuda_training_after_an_inference_mode_eval_at_the_same_length(monkeypatch):
    """The real failure: an eval's sdpa_flex window layer under inference_mode, then a training
    forward + backward at the same length reusing the cached BlockMask."""
    monkeypatch.setattr(A, "_BLOCK_MASKS", {})
    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.inference_mode():
        A.attention(q, k, v, window=64, backend="sdpa_flex")
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    A.attention(q, k, v, window=64, backend="sdpa_flex").float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("pattern,T,n_kv_head", [("L", 32, 4), ("SL", 32, 2), ("SSSL", 48, 1)])
def test_flops_estimate_matches_the_counted_matmuls(pattern, T, n_kv_head):
    """estimate_flops = 6 x the matmul parameters + 12 H D min(window, T) per layer. Counted by
    torch's FlopCounterMode over one forward + backward with the reference backend, whose
    attention is the dense (T, T) product the convention charges (causal not halved): the
    matmuls must agree exactly, full layers exactly, window layers by the window's share."""
    cfg = GPTConfig(sequence_len=T, vocab_size=100, n_layer=4, n_head=4, n_kv_head=n_kv_head, n_embd=32,
                    window_pattern=pattern)
    model = GPT(cfg, attn_backend="reference")
    model.init_weights()
    idx = torch.randint(0, cfg.vocab_size, (1, T))
    with FlopCounterMode(display=False) as counter:
        model(idx, targets=idx).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    H, D = cfg.n_head, cfg.head_dim
    dense_attention = 12 * H * D * T * cfg.n_layer   # per token, every layer charged T keys
    assert counts["aten.bmm"] == dense_attention * T
    window_share = sum(12 * H * D * (T - (T if w is None else min(w, T))) for w in model.windows)
    assert model.estimate_flops() * T == counts["aten.mm"] + counts["aten.bmm"] - window_share * T


def test_flex_options_check_is_re_exported_unchanged(monkeypatch):
    """validate_flex_kernel_options moved to nanochat/attention_flex_options.py; callers keep
    importing it (and its constants) from nanochat.attention."""
    assert A.validate_flex_kernel_options is attention_flex_options.validate_flex_kernel_options
    assert A.DEFAULT_FLEX_BLOCK_SIZE == 128 and "BLOCK_SIZE" in A.FLEX_OPTION_KEYS
    monkeypatch.setattr(A, "FLEX_KERNEL_OPTIONS", None)
    with pytest.raises(ValueError, match="does not divide"):
        A.set_flex_kernel_options({"BLOCK_SIZE": 32, "BLOCK_M": 64})
    assert A.FLEX_KERNEL_OPTIONS is None
