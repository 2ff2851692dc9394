"""GPT: config dial, shapes, padded vocab, loss, FLOPs, param groups, meta init, KV decode, compile."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from nanochat.attention import KVCache
from nanochat.gpt import (GPT, GPTConfig, _ReluSquare, apply_rotary, config_for_depth, cross_entropy_loss,
                          has_value_embed, layer_windows, norm, rotary_norm, rotary_tables)


def tiny_config(**kw) -> GPTConfig:
    base = dict(sequence_len=32, vocab_size=100, n_layer=4, n_head=4, n_kv_head=2, n_embd=64,
                window_pattern="SSSL")
    base.update(kw)
    return GPTConfig(**base)


def tiny_model(seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    model = GPT(tiny_config(**{k: v for k, v in kw.items() if k != "attn_backend"}),
                attn_backend=kw.get("attn_backend", "auto"))
    model.init_weights()
    return model


def randomize(model, seed=1):
    """Trained-looking weights: the zero-init projections would hide bugs in the attention path."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.3)
    return model


def batch(B=2, T=32, V=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ----------------------------------------------------------------------------------------------
def test_config_for_depth():
    d20 = config_for_depth(20, 32768, 2048)
    assert (d20.n_embd, d20.n_head, d20.n_kv_head, d20.head_dim) == (1280, 10, 10, 128)
    d12 = config_for_depth(12, 32768, 2048)
    assert (d12.n_embd, d12.n_head) == (768, 6)
    d26 = config_for_depth(26, 32768, 2048)
    assert (d26.n_embd, d26.n_head) == (1664, 13)  # 26 * 64 = 1664 = 13 * 128
    assert config_for_depth(2, 65, 64).n_embd == 128  # rounded up to one head
    assert config_for_depth(20, 32768, 2048, n_kv_head=5).n_kv_head == 5
    with pytest.raises(ValueError, match="--depth"):
        config_for_depth(0, 100, 64)
    with pytest.raises(ValueError, match=r"GPTConfig\.n_kv_head: got 3"):
        config_for_depth(20, 100, 64, n_kv_head=3)
    with pytest.raises(ValueError, match="--window-pattern"):
        config_for_depth(4, 100, 64, window_pattern="SXL")


def test_windows_and_value_embed_layers():
    assert layer_windows(tiny_config(n_layer=6, sequence_len=64)) == [16, 16, 16, None, 16, None]
    assert layer_windows(tiny_config(n_layer=3, window_pattern="S")) == [8, 8, None]
    assert layer_windows(tiny_config(n_layer=3, window_pattern="L")) == [None] * 3
    assert [has_value_embed(i, 5) for i in range(5)] == [True, False, True, False, True]
    assert [has_value_embed(i, 4) for i in range(4)] == [False, True, False, True]


def test_shapes_and_padded_vocab():
    model = tiny_model()
    assert model.config.padded_vocab_size == 128
    assert model.wte.weight.shape == (128, 64) and model.lm_head.weight.shape == (128, 64)
    assert set(model.value_embeds.keys()) == {"1", "3"}
    assert model.value_embeds["1"].weight.shape == (128, 2 * 16)  # n_kv_head * head_dim
    idx, _ = batch()
    logits = model(idx)
    assert logits.shape == (2, 32, 100) and logits.dtype == torch.float32
    assert logits.abs().max() <= 15.0


def test_padding_columns_never_win():
    model = randomize(tiny_model())
    idx, targets = batch()
    before = model(idx, targets)
    with torch.no_grad():
        model.lm_head.weight[100:] = 1e4  # padding rows would dominate every logit
    logits = model(idx)
    assert logits.shape[-1] == 100
    assert torch.allclose(model(idx, targets), before)


def test_loss_matches_manual_cross_entropy_and_ignore_index():
    model = randomize(tiny_model())
    idx, targets = batch()
    logits = model(idx)
    manual = F.cross_entropy(logits.view(-1, 100), targets.view(-1))
    loss = model(idx, targets)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert torch.allclose(loss, manual, atol=1e-5)
    targets[:, :10] = -1
    keep = targets.view(-1) != -1
    manual = F.cross_entropy(logits.view(-1, 100)[keep], targets.view(-1)[keep])
    assert torch.allclose(model(idx, targets), manual, atol=1e-5)
    per_token = model(idx, targets, loss_reduction="none")
    assert per_token.shape == (2, 32) and torch.all(per_token[:, :10] == 0)
    assert torch.allclose(model(idx, targets, loss_reduction="sum"), per_token.sum(), atol=1e-4)
    with pytest.raises(ValueError, match="loss_reduction"):
        model(idx, targets, loss_reduction="avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_default_loss_fn_matches_plain_pytorch_chain(reduction):
    """The memory-lean autograd Function equals softcap -> float32 -> F.cross_entropy, grads too."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(64, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (40,), generator=g)
    targets[::7] = -1
    ours = cross_entropy_loss(hidden, weight, targets, 15.0, 50, reduction)
    ours.sum().backward()
    grads = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    logits = 15.0 * torch.tanh(F.linear(hidden, weight)[:, :50] / 15.0)
    ref = F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)
    ref.sum().backward()
    assert ours.shape == ref.shape and torch.allclose(ours, ref, rtol=1e-12, atol=1e-12)
    assert torch.allclose(grads[0], hidden.grad, atol=1e-12) and torch.allclose(grads[1], weight.grad, atol=1e-12)
    assert torch.all(grads[1][50:] == 0)  # padding rows of the head get no gradient
    all_ignored = torch.full((40,), -1)
    assert torch.isnan(cross_entropy_loss(hidden, weight, all_ignored, 15.0, 50, "mean"))


def test_relu_square_gradient():
    x = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_ReluSquare.apply, (x,))
    assert torch.equal(_ReluSquare.apply(x), F.relu(x).square())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 1e-4])
def test_norm_forward_is_exactly_rms_norm(dtype, scale):
    x = (torch.randn(3, 7, 64, generator=torch.Generator().manual_seed(0)) * scale).to(dtype)
    assert torch.equal(norm(x), F.rms_norm(x, (64,)))  # same eps (the math dtype's), same rounding


def test_norm_and_rotary_norm_gradients():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 16, dtype=torch.float64, generator=g, requires_grad=True)
    cos, sin = (t.double() for t in rotary_tables(5, 16))
    assert torch.autograd.gradcheck(norm, (x,))
    assert torch.autograd.gradcheck(lambda t: rotary_norm(t, cos, sin), (x,))
    assert torch.allclose(rotary_norm(x, cos, sin), F.rms_norm(apply_rotary(x, cos, sin), (16,)), atol=1e-12)
    # bf16: the rotation and the norm run in float32 without an intermediate rounding (<= 1 ulp)
    xb = x.detach().bfloat16()
    ref = F.rms_norm(apply_rotary(xb, cos.bfloat16(), sin.bfloat16()), (16,))
    assert (rotary_norm(xb, cos.bfloat16(), sin.bfloat16()).double() - ref.double()).abs().max() <= 2 ** -6


_VIEW_OPS = {"view", "_unsafe_view", "transpose", "t", "permute", "reshape", "expand", "slice", "select",
             "alias", "detach", "unsqueeze", "squeeze", "as_strided"}


def _saved_activation_widths(model, idx) -> float:
    """What the compile partitioner keeps for backward, in units of one (B, T, n_embd) tensor:
    the forward graph's saved outputs, views resolved to their base, token-shaped ones summed."""
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    bases = {}

    def base(node):
        while node.op == "call_function" and node.target.__name__.split(".")[0] in _VIEW_OPS:
            node = node.args[0]
        return node

    def forward_compiler(gm, _):
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for node in outputs:
            if hasattr(node, "meta"):
                b = base(node)
                bases[b.name] = b.meta["val"]
        return gm.forward

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm.forward,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(idx, idx)
    torch._dynamo.reset()
    tokens = idx.numel()
    return sum(v.numel() for v in bases.values()
               if v.dim() >= 2 and v.shape[0] in (idx.shape[0], tokens) and v.numel() % tokens == 0
               ) / (tokens * model.config.n_embd)


def test_compiled_training_saves_few_activations():
    """The norms save their outputs, not their inputs, and the value-embedding layer recomputes
    its lookup: at depth 2 (C=256, T=64) the partitioner keeps 25.1 (B, T, C)-widths (2 layers +
    the logits). Through F.rms_norm it kept 34.1, i.e. 4 more per layer (the rotated q and k
    before their norm, and each norm's input), and with the lookup saved 26.1."""
    torch.manual_seed(0)
    cfg = config_for_depth(2, 512, 64, aspect_ratio=128, head_dim=64)
    model = GPT(cfg, attn_backend="sdpa", compute_dtype=torch.float32)
    model.init_weights()
    widths = _saved_activation_widths(model, torch.randint(0, 512, (2, 64)))
    assert widths <= 25.5, widths


def test_fused_mix_norm_saves_one_width_less_per_layer():
    """--kernel triton's residual mix + norm (nanochat/fused_norm.py) keeps no block input r for
    resid_lambdas' gradient: n_layer - 1 widths less (layer 0's input is x0, kept anyway)."""
    from nanochat.kernels import build_mix_norm

    widths = []
    for kernel in ("current", "triton"):
        torch.manual_seed(0)   # depth 3: a per-layer saving (2 widths), not a constant one (1 at depth 2)
        cfg = config_for_depth(3, 512, 64, aspect_ratio=64, head_dim=64)
        model = GPT(cfg, attn_backend="sdpa", compute_dtype=torch.float32)
        model.init_weights()
        model.set_mix_norm(build_mix_norm(kernel))
        widths.append(_saved_activation_widths(model, torch.randint(0, 512, (2, 64))))
    assert widths[0] - widths[1] == pytest.approx(cfg.n_layer - 1), widths


def test_value_embed_mix_gradients_match_plain_autograd():
    """_ValueEmbedMix (lookup recomputed in backward) = v + gate * table[idx] through autograd."""
    from nanochat.gpt import _ValueEmbedMix
    g = torch.Generator().manual_seed(0)
    B, T, H, D, V = 2, 5, 3, 4, 11
    v = torch.randn(B, T, H, D, dtype=torch.float64, generator=g, requires_grad=True)
    gate = torch.rand(B, T, H, dtype=torch.float64, generator=g, requires_grad=True)
    table = torch.randn(V, H * D, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.tensor([[0, 3, 3, 10, 1], [3, 0, 7, 7, 7]])   # repeated ids: rows must accumulate
    assert torch.autograd.gradcheck(_ValueEmbedMix.apply, (v, gate, idx, table, None, None))
    up = torch.randn(B, T, H, D, dtype=torch.float64, generator=g)
    out = _ValueEmbedMix.apply(v, gate, idx, table, None, None)   # no cast copy, no sink
    ref = v + gate.unsqueeze(-1) * F.embedding(idx, table).view(B, T, H, D)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    got = torch.autograd.grad(out, (v, gate, table), up)
    want = torch.autograd.grad(ref, (v, gate, table), up)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    sink = torch.full_like(table, 0.5).detach()   # weight_cache's gradient sink: the rows add in place
    _ValueEmbedMix.apply(v, gate, idx, table, None, sink).backward(up)
    assert table.grad is None   # the sink took the table's gradient
    torch.testing.assert_close(sink, want[2] + 0.5)
    torch.testing.assert_close(v.grad, want[0])


def test_initial_loss_is_uniform():
    model = tiny_model()
    assert torch.count_nonzero(model.blocks[0].attn.c_proj.weight) == 0
    assert torch.count_nonzero(model.blocks[2].mlp.c_proj.weight) == 0
    assert 0.0005 < model.lm_head.weight.std().item() < 0.002
    idx, targets = batch()
    assert abs(model(idx, targets).item() - math.log(100)) < 0.05


def test_set_loss_fn_receives_contract_arguments():
    model = tiny_model()
    seen = {}

    def fn(hidden, weight, targets, softcap, vocab_size, reduction):
        seen.update(hidden=hidden.shape, weight=weight.shape, targets=targets.shape, softcap=softcap,
                    vocab_size=vocab_size, reduction=reduction, dtype=hidden.dtype)
        return hidden.float().sum() * 0
    model.set_loss_fn(fn)
    idx, targets = batch()
    model(idx, targets, loss_reduction="sum")
    assert seen == dict(hidden=(64, 64), weight=(128, 64), targets=(64,), softcap=15.0, vocab_size=100,
                        reduction="sum", dtype=torch.float32)
    model.set_loss_fn(None)
    assert model(idx, targets).item() > 1
    with pytest.raises(ValueError, match="callable"):
        model.set_loss_fn(3)


def test_flops_formula_hand_count():
    model = tiny_model(n_layer=4, n_head=2, n_kv_head=1, sequence_len=64)  # head_dim 32, windows 16,16,16,full
    C = 64
    per_layer = C * C + C * 32 + C * 32 + C * C + 8 * C * C  # q, k, v, proj, mlp
    matrices = 4 * per_layer + 2 * 32 * 1  # + ve_gate (32 -> 1 head) on layers 1 and 3
    lm_head = 128 * C
    attn = 12 * 2 * 32 * (16 + 16 + 16 + 64)
    assert model.num_scaling_params() == matrices + lm_head
    assert model.estimate_flops() == 6 * (matrices + lm_head) + attn
    # the config-derived count must agree with the modules actually built
    built = sum(p.numel() for b in model.blocks for p in b.parameters()) + model.lm_head.weight.numel()
    assert built == model.num_scaling_params()
    total = sum(model.param_counts().values())
    assert total == sum(p.numel() for p in model.parameters())
    # at a shorter T the windows clip: min(window, T)
    assert model.estimate_flops(seq_len=8) == 6 * (matrices + lm_head) + 12 * 2 * 32 * 8 * 4


def test_param_groups_cover_every_parameter_once():
    model = tiny_model()
    groups = model.param_groups()
    assert set(groups) == {"matrix", "embedding", "value_embeds", "lm_head", "scalars"}
    ids = [id(p) for ps in groups.values() for p in ps]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(p.dim() == 2 for p in groups["matrix"])
    assert all(p.dim() == 1 for p in groups["scalars"])


def test_meta_build_then_init_weights():
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(tiny_config())
    assert meta.wte.weight.is_meta
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.init_weights()
    ref = GPT(tiny_config())  # built on CPU (its constructor draws default inits first)
    torch.manual_seed(0)
    ref.init_weights()  # same seed, same draw order -> identical weights
    for (name, a), b in zip(meta.state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), name
    assert torch.equal(meta.cos, ref.cos) and torch.equal(meta.sin, ref.sin)
    idx, targets = batch()
    assert torch.equal(meta(idx, targets), ref(idx, targets))
    # load_state_dict into a to_empty model rebuilds the rotary tables (non-persistent buffers)
    with torch.device("meta"):
        other = GPT(tiny_config())
    other.to_empty(device="cpu")
    other.load_state_dict(ref.state_dict())
    assert torch.equal(other.cos, ref.cos)
    assert "cos" not in ref.state_dict()


def test_bf16_compute_keeps_fp32_params():
    torch.manual_seed(0)
    model = GPT(tiny_config(), compute_dtype=torch.bfloat16)
    model.init_weights()
    randomize(model)
    idx, targets = batch()
    loss = model(idx, targets)
    loss.backward()
    assert loss.dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    ref = copy.deepcopy(model)
    ref.compute_dtype = torch.float32
    assert abs(loss.item() - ref(idx, targets).item()) < 0.05 * loss.item()
    assert model(idx).dtype == torch.float32


@pytest.mark.parametrize("backend", ["sdpa", "reference", "flex"])
def test_kv_cache_decode_equals_full_forward(backend):
    # sequence_len 32 -> window 8 on S layers, so decode crosses the window; GQA 4/2
    model = randomize(tiny_model(n_layer=3, window_pattern="SL", attn_backend=backend)).eval()
    idx, _ = batch(B=2, T=20)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2, 2, 32, 16, 3, device="cpu", dtype=torch.float32)
        steps = [model(idx[:, :7], kv_cache=cache)]
        for t in range(7, 20):
            steps.append(model(idx[:, t:t + 1], kv_cache=cache))
    assert cache.pos == 20
    assert (torch.cat(steps, dim=1) - full).abs().max() < 1e-4


def test_rotary_range_and_bad_backend():
    model = tiny_model()
    with pytest.raises(ValueError, match="--attn-backend"):
        GPT(tiny_config(), attn_backend="flash")
    cache = KVCache(1, 2, 400, 16, 4, device="cpu", dtype=torch.float32)
    cache.pos = 319
    with pytest.raises(ValueError, match="rotary"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_cache=cache)


def test_compile_fullgraph_forward_backward():
    """No graph breaks (fullgraph=True) through dynamo + AOT autograd; inductor is slow-marked.
    Three layers (fewer to trace than tiny_config's four) hold every kind: windowed with and
    without value embeddings, and the full last layer."""
    model = randomize(tiny_model(attn_backend="sdpa", n_layer=3))
    idx, targets = batch()
    eager = model(idx, targets)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss = compiled(idx, targets)
    loss.backward()
    assert torch.allclose(loss, eager, atol=1e-5)
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_compile_inductor_cpu():
    model = randomize(tiny_model(attn_backend="sdpa", n_layer=3))   # every layer kind (above)
    model.prepare_attention()
    idx, targets = batch()
    eager = model(idx, targets)
    loss = torch.compile(model, fullgraph=True)(idx, targets)
    assert torch.allclose(loss, eager, atol=1e-4)


@pytest.mark.cuda
def test_cuda_compiled_bf16_training_step():
    torch.manual_seed(0)
    cfg = tiny_config(sequence_len=256, n_layer=4, n_embd=128, n_head=2, n_kv_head=1, vocab_size=1000)
    model = GPT(cfg).cuda()
    model.init_weights()
    randomize(model)
    model.prepare_attention()
    idx = torch.randint(0, 1000, (4, 256), device="cuda")
    eager = model(idx, idx)
    loss = torch.compile(model, fullgraph=True)(idx, idx)
    loss.backward()
    assert abs(loss.item() - eager.item()) < 0.02 * eager.item()
    ref = copy.deepcopy(model)
    ref.compute_dtype = torch.float32
    ref.attn_backend = "reference"
    assert abs(ref(idx, idx).item() - eager.item()) < 0.03 * eager.item()


@pytest.mark.cuda
@pytest.mark.parametrize("backend,kernel", [("sdpa_flex", "current"), ("cudnn", "current"), ("cudnn", "triton"),
                                            ("cudnn_fa4", "triton")])
def test_cuda_compiled_bf16_gradients_match_fp32(backend, kernel):
    """The compiled bf16 training graph (saved-output norms, fused kernels, cuDNN or flex windows;
    with --kernel triton its loss, residual mix + norm, epilogue-fused MLP and q/k projections too) gives the
    gradients of the plain float32 model: total relative L2 error at bf16 level."""
    from nanochat.kernels import build_loss_fn, build_mix_norm, build_mlp, build_qkv_projection, build_rotary_norm

    if backend in ("cudnn", "cudnn_fa4"):  # the optional `gpu` extra; installed, its probe must pass
        from nanochat.cudnn_attention import probe
        pytest.importorskip("cudnn", reason="nvidia-cudnn-frontend is not installed (pip install -e '.[gpu]')")
        assert probe(torch.device("cuda")) is None
    if backend == "cudnn_fa4":
        pytest.importorskip("flash_attn.cute", reason="flash-attn-4 is not installed (gpu_check.sh installs it)")
    torch.manual_seed(0)
    cfg = config_for_depth(4, 4096, 1024)  # windows of 256 in layers 0-2, head dim 128
    model = randomize(GPT(cfg, attn_backend=backend).cuda(), seed=3)
    with torch.no_grad():  # randomize() adds 0.3: too much for 256-wide matrices, rescale them
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(0.1)
    model.prepare_attention()
    ref = copy.deepcopy(model)
    ref.compute_dtype, ref.attn_backend = torch.float32, "sdpa"
    if kernel != "current":
        model.set_loss_fn(build_loss_fn(kernel, "cuda"))
        model.set_mix_norm(build_mix_norm(kernel, "cuda"))
        model.set_mlp_fn(build_mlp(kernel, "cuda", "bf16"))
        model.set_rotary_norm(build_rotary_norm(kernel, "cuda"))
        model.set_qkv_projection(build_qkv_projection(kernel, "cuda"))
    idx = torch.randint(0, 4096, (4, 1024), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    torch.compile(model)(idx, idx.roll(-1, 1)).backward()
    ref(idx, idx.roll(-1, 1)).backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    want = torch.cat([p.grad.flatten() for p in ref.parameters()])
    assert ((got - want).norm() / want.norm()).item() < 3e-2


def test_inference_weights_fused_qkv_matches_and_never_goes_stale():
    model = randomize(tiny_model())
    idx, _ = batch()
    with torch.no_grad():
        plain = model(idx)
        with model.inference_weights():
            assert model.blocks[0].attn.qkv_weight is not None
            fused = model(idx)
        assert model.blocks[0].attn.qkv_weight is None  # outside: the live weights again
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
        model.blocks[1].attn.c_k.weight.add_(0.5)  # e.g. an optimizer step between generations
        changed = model(idx)
        buffer = model.blocks[1].attn._qkv_buffer
        with torch.inference_mode(), model.inference_weights():
            assert model.blocks[1].attn._qkv_buffer is buffer  # same storage: captured graphs stay valid
            torch.testing.assert_close(model(idx), changed, rtol=1e-5, atol=1e-5)
    with model.inference_weights():  # grad enabled: the projections themselves, gradients flow
        model(idx, idx).backward()
    assert model.blocks[0].attn.c_q.weight.grad is not None
    # the fused copy is plain data: no autograd graph back to the weights (entered with grad on, it
    # had one: a CopyBackwards node, and copy.deepcopy of the model raised)
    buf = model.blocks[0].attn._qkv_buffer
    assert buf.is_leaf and not buf.requires_grad
    import copy
    copy.deepcopy(model)
