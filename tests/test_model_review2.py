"""Review 2 of the model's numerics on CPU: the GPT checked against a naive float64 model written
here from gpt.py's docstring (explicit per-query key lists, no shared helpers), every attention
backend and the KV-cache decode against it, the FLOPs estimate against torch's FLOP counter, the
padded vocab rows, and bad input (configs, empty batches, targets outside -1..vocab-1) refused
with clear messages."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from nanochat import kernels as K
from nanochat.gpt import GPT, GPTConfig
from nanochat.kv_cache import KVCache

V = 70   # padded to 128 inside


def _naive_logits(model: GPT, idx: torch.Tensor, P: dict | None = None, pos0: int = 0) -> torch.Tensor:
    """float64 forward from the documented architecture (fp32 rotary angles, as the model's
    tables; every other step float64). Windows: S = sequence_len // 4 keys including the query
    itself, L and the last layer full; value embeddings on layers n_layer-1, n_layer-3, ...
    `P`: the parameters to use (default: the model's, detached; given ones keep autograd, for
    gradient references); `pos0`: the position of idx's first token (a KV cache's offset)."""
    cfg = model.config
    P = {k: v.detach().double() for k, v in model.state_dict().items()} if P is None else P
    B, T = idx.shape
    H, Hkv, D, C = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cfg.n_embd

    def rms(x):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(torch.float64).eps)

    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    ang = torch.arange(pos0, pos0 + T, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos().double()[None, :, None], ang.sin().double()[None, :, None]

    def rope(x):
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], -1)

    x = rms(P["wte.weight"][idx])
    x0 = x
    for i in range(cfg.n_layer):
        letter = cfg.window_pattern[i % len(cfg.window_pattern)]
        W = None if letter == "L" or i == cfg.n_layer - 1 else max(1, cfg.sequence_len // 4)
        x = P["resid_lambdas"][i] * x + P["x0_lambdas"][i] * x0
        h = rms(x)
        pre = f"blocks.{i}.attn."
        q = (h @ P[pre + "c_q.weight"].T).view(B, T, H, D)
        k = (h @ P[pre + "c_k.weight"].T).view(B, T, Hkv, D)
        v = (h @ P[pre + "c_v.weight"].T).view(B, T, Hkv, D)
        if (cfg.n_layer - 1 - i) % 2 == 0:
            gate = 2 * torch.sigmoid(h[..., :min(32, C)] @ P[pre + "ve_gate.weight"].T)
            v = v + gate[..., None] * P[f"value_embeds.{i}.weight"][idx].view(B, T, Hkv, D)
        q, k = rms(rope(q)), rms(rope(k))
        y = torch.zeros(B, T, H, D, dtype=torch.float64)
        for hq in range(H):
            hk = hq // (H // Hkv)
            for t in range(T):
                keys = [j for j in range(t + 1) if W is None or t - j < W]
                assert len(keys) == (t + 1 if W is None else min(W, t + 1))
                s = torch.stack([(q[:, t, hq] * k[:, j, hk]).sum(-1) for j in keys], -1) / math.sqrt(D)
                y[:, t, hq] = torch.einsum("bn,bnd->bd", s.softmax(-1), v[:, keys, hk])
        x = x + y.reshape(B, T, H * D) @ P[pre + "c_proj.weight"].T
        f = torch.relu(rms(x) @ P[f"blocks.{i}.mlp.c_fc.weight"].T) ** 2
        x = x + f @ P[f"blocks.{i}.mlp.c_proj.weight"].T
    logits = (rms(x) @ P["lm_head.weight"].T)[..., :cfg.vocab_size]
    return cfg.softcap * torch.tanh(logits / cfg.softcap)


def _model(pattern="SSL", backend="sdpa", dtype=torch.float64, n_embd=32, n_head=4, n_kv_head=2, T=12):
    cfg = GPTConfig(sequence_len=T, vocab_size=V, n_layer=4, n_head=n_head, n_kv_head=n_kv_head,
                    n_embd=n_embd, window_pattern=pattern)
    model = GPT(cfg, attn_backend=backend, compute_dtype=dtype).to(dtype)
    model.init_weights()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():   # away from init (zero projections / gates would hide terms)
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.5 if p.ndim > 1 else 0.3)
                    + (1.0 if "lambdas" in name else 0.0))
    return model


@pytest.mark.parametrize("pattern", ["SSL", "SL", "L"])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "reference"])
def test_model_matches_naive_float64_forward_and_decode(pattern, backend):
    model = _model(pattern, backend)
    torch.manual_seed(1)
    idx, targets = torch.randint(0, V, (2, 12)), torch.randint(0, V, (2, 12))
    targets[0, :4] = -1
    with torch.no_grad():
        ref = _naive_logits(model, idx)
        # logits come back float32 by contract; the loss keeps float64 end to end
        torch.testing.assert_close(model(idx), ref.float(), rtol=0, atol=2e-5)
        ref_loss = F.cross_entropy(ref.reshape(-1, V), targets.reshape(-1), ignore_index=-1)
        torch.testing.assert_close(model(idx, targets), ref_loss, rtol=1e-12, atol=1e-12)
        # prefill 5 (crosses the window of 3), then one token at a time through the cache
        cache = KVCache(2, 2, 12, 8, 4, "cpu", torch.float64)
        steps = [model(idx[:, :5], kv_cache=cache)] + [model(idx[:, t:t + 1], kv_cache=cache)
                                                        for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), ref.float(), rtol=0, atol=2e-5)


def test_narrow_model_value_embed_gate_reads_all_channels():
    """n_embd < 32: the gate reads every channel (min(32, C)); GQA to one kv head."""
    model = _model("SSSL", n_embd=16, n_head=2, n_kv_head=1, T=14)
    idx = torch.randint(0, V, (2, 14))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), _naive_logits(model, idx).float(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("kernel", ["default", "current", "triton"])
def test_padded_vocab_rows_get_no_gradient_and_no_mass(kernel):
    model = _model("SL", dtype=torch.float32)
    if kernel != "default":
        model.set_loss_fn(K.build_loss_fn(kernel, "cpu", chunk_rows=0) if kernel == "current"
                          else K.build_loss_fn(kernel, "cpu", chunk_rows=7))
    idx, targets = torch.randint(0, V, (2, 12)), torch.randint(0, V, (2, 12))
    model(idx, targets).backward()
    for table in (model.lm_head.weight, model.wte.weight, *(e.weight for e in model.value_embeds.values())):
        assert table.grad[V:].abs().max() == 0 and table.grad[:V].abs().max() > 0
    with torch.no_grad():
        model.lm_head.weight[V:] = 1e4   # a padding row that would win every softmax
        logits = model(idx)
    assert logits.shape[-1] == V and torch.isfinite(logits).all()


def test_flops_estimate_matches_the_flop_counter():
    """estimate_flops = 6 * (transformer matrices + padded lm_head) + attention, the attention
    term 12 * n_head * head_dim * min(window, T) per layer (QK^T and AV, 2 FLOPs per MAC, x3 for
    forward + backward, causal not halved). The matmul part must equal what torch's counter sees
    for one forward + backward (aten.mm over every Linear, the gates and the loss's head)."""
    model = _model("SL", dtype=torch.float32)
    cfg, B, T = model.config, 2, 12
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))).backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attn = sum(12 * cfg.n_head * cfg.head_dim * (T if w is None else min(w, T)) for w in model.windows)
    assert model.windows == [3, None, 3, None]
    assert model.estimate_flops() - attn == counts["aten.mm"] / (B * T)
    assert model.estimate_flops() == 6 * model.num_scaling_params() + attn


def test_exactly_sequence_len_tokens_run_and_empty_batches_are_refused():
    model = _model(dtype=torch.float32)
    assert model(torch.zeros(1, 12, dtype=torch.long)).shape == (1, 12, V)
    for shape in ((2, 0), (0, 5), (12,)):
        with pytest.raises(ValueError, match=r"GPT.forward idx: expected \(B, T\)"):
            model(torch.zeros(shape, dtype=torch.long))


@pytest.mark.parametrize("field,value", [("n_layer", 2.5), ("n_head", True), ("sequence_len", "64"),
                                         ("softcap", float("inf")), ("softcap", float("nan")),
                                         ("softcap", "15"), ("window_pattern", 4)])
def test_config_refuses_wrong_types_and_non_finite_softcap(field, value):
    """A meta.json's model_config goes straight into GPTConfig: a softcap of inf made every logit
    NaN (inf * tanh(0)), a float layer count failed deep inside nn.ModuleList."""
    cfg = GPTConfig(sequence_len=64, vocab_size=V, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    setattr(cfg, field, value)
    flag = "--window-pattern" if field == "window_pattern" else f"GPTConfig.{field}"
    with pytest.raises(ValueError, match=flag):
        cfg.validate()


@pytest.mark.parametrize("kernel", ["default", "current", "triton"])
@pytest.mark.parametrize("bad", [-100, V, 127])
def test_targets_outside_ignore_and_vocab_are_refused(kernel, bad):
    """-100 (another library's ignore_index) was read as token 0 by the default loss: a finite,
    wrong loss. F.cross_entropy (current) refuses it; every backend must."""
    fn = {"default": None, "current": K.build_loss_fn("current"), "triton": K.build_loss_fn("triton")}[kernel]
    model = _model(dtype=torch.float32)
    model.set_loss_fn(fn)
    targets = torch.randint(0, V, (2, 12))
    targets[1, 3] = bad
    with pytest.raises((ValueError, RuntimeError, IndexError), match=str(bad)):
        model(torch.randint(0, V, (2, 12)), targets)


def test_triton_loss_checks_targets_before_its_row_kernels():
    """The Triton row kernels (what --kernel triton runs on CUDA) read logits[row, target]
    unchecked: under TRITON_INTERPRET=1 a target of -100, 37 or 50 (vocab 37) returned a finite
    loss. The fused op now checks first (CPU: this ValueError; CUDA: an async device assert); on
    CPU it used to fail only later, in the pure-torch twin's gather ("index -100 is out of bounds")."""
    h, w = torch.randn(6, 16), torch.randn(64, 16)
    for bad in (-100, 37, 50):
        t = torch.randint(0, 37, (6,))
        t[2] = bad
        match = rf"loss targets: accepted -1 \(ignored\) or a token id in 0..36; got \[{bad}\]"
        with pytest.raises(ValueError, match=match):
            K.triton_loss(h, w, t, 3.0, 37, "mean", chunk_rows=4)
