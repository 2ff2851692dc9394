"""An explicit cuDNN attention backend in an fp32 training run is refused (attention() would run
flex for its window layers), and what a run reports as its attention is what runs for its dtype;
Engine refuses stop ids its model can never sample."""

import pytest
import torch

from nanochat.attention import check_training_backend, effective_backend
from nanochat.errors import RequestError


@pytest.mark.parametrize("name", ["cudnn", "cudnn_fa4"])
def test_explicit_cudnn_backend_in_an_fp32_run_is_refused_by_flag(name):
    """--attn-backend cudnn --precision fp32 trained with flex window layers under a banner saying
    sdpa_cudnn: an explicit request that cannot be met must raise before the model is built."""
    with pytest.raises(RequestError, match=rf"^--attn-backend {name}: cuDNN's attention takes bf16/fp16, "
                                            r"this run computes in float32 \(--precision\); "
                                            r"accepted with it: auto\|sdpa\|flex\|reference"):
        check_training_backend(name, "cuda", torch.float32)


def test_cpu_refusal_still_comes_first_and_plain_backends_pass():
    with pytest.raises(RequestError, match="needs a CUDA device"):
        check_training_backend("cudnn", "cpu", torch.float32)
    assert check_training_backend("sdpa", "cpu", torch.float32) == "sdpa"
    assert check_training_backend("auto", "cpu", torch.float32) == "sdpa"


@pytest.mark.parametrize("resolved, dtype, runs", [
    ("sdpa_cudnn", torch.float32, "sdpa_flex"), ("cudnn_fa4", torch.float32, "sdpa_flex"),
    ("sdpa_cudnn", torch.bfloat16, "sdpa_cudnn"), ("cudnn_fa4", torch.float16, "cudnn_fa4"),
    ("sdpa", torch.float32, "sdpa"), ("flex", torch.float32, "flex")])
def test_effective_backend_names_what_attention_runs(resolved, dtype, runs):
    assert effective_backend(resolved, dtype) == runs


def test_effective_backend_matches_attention_dispatch(monkeypatch):
    """The label follows attention()'s own dispatch: an fp32 window layer of sdpa_cudnn runs _flex."""
    from nanochat import attention as A

    ran = []
    monkeypatch.setattr(A, "_flex", lambda q, k, v, window: ran.append(("flex", window)) or q)
    q = torch.randn(1, 2, 8, 4)
    A.attention(q, q, q, window=4, backend="sdpa_cudnn")
    assert ran == [("flex", 4)] and effective_backend("sdpa_cudnn", q.dtype) == "sdpa_flex"


# ------------------------------------------------------------------ engine stop ids

@pytest.mark.parametrize("stops", [[-1], [10**6], [3, 64]])
def test_stop_ids_outside_the_vocabulary_are_refused(stops):
    """A stop id the model can never sample (a typo, another tokenizer's id) was accepted and the
    generation ran to max_tokens without a word."""
    from nanochat.engine import Engine
    from tests.test_engine import random_model

    engine = Engine(random_model("cpu"), None)
    vocab = engine.model.config.vocab_size
    stops = [vocab if s == 64 else s for s in stops]
    with pytest.raises(ValueError, match=rf"^stop_tokens: got .*; accepted: token ids in 0\.\.{vocab - 1}$"):
        engine.generate_batch([1, 2], max_tokens=2, stop_tokens=stops)
    assert len(engine.generate_batch([1, 2], max_tokens=2, stop_tokens=[vocab - 1])[0][0]) <= 4
