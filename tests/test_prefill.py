"""The prompt prefill: GPT.forward's `logits_at` (logits at chosen positions only) and the Engine's
prefill, which uses it for the prompt's last position."""

import pytest
import torch

from nanochat.engine import Engine
from tests.test_engine import random_model


def test_logits_at_selects_positions_and_validates():
    model = random_model("cpu")
    ids = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        full = model(ids)
        got = model(ids, logits_at=torch.tensor([19, 3]))
    assert got.shape == (2, 2, full.size(-1))
    torch.testing.assert_close(got, full[:, [19, 3]], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="logits_at"):
        model(ids, targets=ids, logits_at=torch.tensor([1]))
    with pytest.raises(ValueError, match="logits_at"):
        model(ids, logits_at=torch.tensor([[1]]))


@pytest.mark.parametrize("n", [1, 17, 40])
def test_engine_prefill_equals_the_full_forward(n):
    """Inside and past the model's 32-token window: the last position's logits of a full forward,
    and a cache that holds the prompt's k/v (decoding from it = full recomputation is
    test_engine's test_kv_cache_matches_full_recompute)."""
    model = random_model("cpu")
    engine = Engine(model, None)
    tokens = [(7 * i + 3) % 300 for i in range(n)]
    with torch.inference_mode():
        got, cache = engine.prefill(tokens)
        want = model(torch.tensor([tokens]))[:, -1, :]
    assert got.shape == want.shape == (1, 300) and cache.pos == n
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert all(t.abs().sum() > 0 for t in cache.k + cache.v)
    with pytest.raises(ValueError, match="tokens"):
        engine.prefill([])
