"""MuonAdamW: orthogonalisation band, Muon/AdamW steps vs plain references, groups, state round
trip, schedules, and the gloo 2-process path against the single-process step."""

import copy
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanochat.gpt import GPT, config_for_depth
from nanochat.optim import (MuonAdamW, build_optimizer, lr_multiplier, muon_momentum, muon_momentum_peaked,
                            weight_decay_cosine, weight_decay_multiplier)
from nanochat.optim_updates import (ORTHO_SV_BAND, POLAR_EXPRESS_COEFFS, muon_decay_step, normuon_rescale,
                                    normuon_shape, orthogonalize)


def tiny_model(vocab=256, seed=0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(config_for_depth(2, vocab, 32, aspect_ratio=32, head_dim=32))  # n_embd 64, 2 heads
    model.init_weights()
    return model


def fake_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


# ----------------------------------------------------------------------------------------------
def test_orthogonalize_singular_value_band():
    torch.manual_seed(0)
    lo, hi = ORTHO_SV_BAND
    for shape in [(3, 32, 96), (2, 96, 32), (1, 128, 512), (4, 10, 32)]:
        s = torch.linalg.svdvals(orthogonalize(torch.randn(shape)).double())
        assert lo <= s.min() and s.max() <= hi, (shape, s.min(), s.max())
    # controlled spectrum: condition number 100 at 64 x 64
    U, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(64, 64, dtype=torch.float64))
    G = (U * torch.logspace(0, -2, 64, dtype=torch.float64)) @ V.T
    out = orthogonalize(G.float())
    s = torch.linalg.svdvals(out.double())
    assert lo <= s.min() and s.max() <= hi
    # it approximates the polar factor U V^T (direction), not just any near-orthogonal matrix
    cos = (out.double() * (U @ V.T)).sum() / (out.double().norm() * 8.0)
    assert cos > 0.99
    assert orthogonalize(torch.randn(5, 7)).dtype == torch.float32  # fp32 on CPU
    # any number of leading dims (flattened into bmm's one), tall or wide; `scale` scales the result
    G = torch.randn(2, 3, 24, 8)
    out = orthogonalize(G)
    assert out.shape == G.shape
    torch.testing.assert_close(out[1, 2], orthogonalize(G[1, 2]), rtol=0, atol=1e-6)
    torch.testing.assert_close(orthogonalize(G, scale=3.0), 3.0 * out, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="ns_steps"):
        orthogonalize(torch.randn(4, 4), steps=0)


@pytest.mark.cuda
def test_orthogonalize_compiled_bf16_on_cuda():
    """What the CUDA step runs: compiled, bf16 products with their sums in the epilogue. Same band and
    direction as the float32 CPU result, and the scale applied."""
    torch.manual_seed(0)
    G = torch.randn(4, 256, 1024)
    fn = torch.compile(orthogonalize, dynamic=False, fullgraph=True)
    out = fn(G.cuda(), 5, 2.0)
    assert out.dtype == torch.bfloat16 and out.shape == G.shape
    out = out.double().cpu() / 2.0
    lo, hi = ORTHO_SV_BAND
    s = torch.linalg.svdvals(out)
    assert lo <= s.min() and s.max() <= hi
    ref = orthogonalize(G).double()
    cos = (out * ref).sum(dim=(-2, -1)) / (out.norm(dim=(-2, -1)) * ref.norm(dim=(-2, -1)))
    assert cos.min() > 0.999


@pytest.mark.cuda
@pytest.mark.parametrize("beta2", [0.0, 0.95])
def test_muon_step_compiled_on_cuda_matches_cpu(beta2):
    """The CUDA step (compiled, bf16 Polar Express, the decay as one compiled pass per weight)
    against the float32 CPU step on the same weights and gradients, plain Muon and NorMuon (the
    compiled graph then holds the rescale too). Plain decay here: the cautious
    mask flips wherever an update entry is within bf16 noise of 0, a 0.01 |p| step each."""
    torch.manual_seed(0)
    start = [torch.randn(shape) for shape in ((64, 192), (64, 192), (192, 64), (32, 32))]
    grads = [torch.randn(p.shape) for p in start]

    def run(device):
        params = [torch.nn.Parameter(p.clone().to(device)) for p in start]
        groups = [dict(kind="muon", params=[p for p in params if p.shape == shape], lr=0.05, momentum=0.9,
                       nesterov=True, ns_steps=5, weight_decay=0.2, cautious_wd=False, beta2=beta2)
                  for shape in ((64, 192), (192, 64), (32, 32))]
        opt = MuonAdamW(groups)
        for _ in range(2):
            for p, g in zip(params, grads):
                p.grad = g.to(device)
            opt.step()
        return [p.detach().cpu() for p in params]

    for p0, gpu, cpu in zip(start, run("cuda"), run("cpu")):
        moved = (cpu - p0).norm()
        assert moved > 0 and (gpu - cpu).norm() < 0.05 * moved  # bf16 orthogonalisation: a few % of the step


@pytest.mark.cuda
def test_compiled_decay_step_equals_eager():
    torch.manual_seed(0)
    p, u = torch.randn(256, 512, device="cuda"), torch.randn(256, 512, device="cuda").bfloat16()
    lr, wd = torch.tensor(0.05), torch.tensor(0.2)
    fn = torch.compile(muon_decay_step, dynamic=False, fullgraph=True)
    for cautious in (True, False):
        a, b = p.clone(), p.clone()
        fn(a, u, lr, wd, cautious)
        muon_decay_step(b, u, lr, wd, cautious)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert not torch.equal(a, p)


def _reference_muon(params, grads_per_step, lr, momentum, wd):
    """Per-matrix, loop-based Muon in float64: the textbook recipe."""
    params = [p.detach().double().clone() for p in params]
    bufs = [torch.zeros_like(p) for p in params]
    # entries where the update is ~0 can flip the cautious-decay sign test between fp32 and fp64
    ambiguous = [torch.zeros_like(p, dtype=torch.bool) for p in params]
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(params, grads)):
            g = g.double()
            bufs[i] = momentum * bufs[i] + (1 - momentum) * g
            x = (1 - momentum) * g + momentum * bufs[i]  # Nesterov
            tall = x.size(0) > x.size(1)
            x = x.T if tall else x
            x = x / (x.norm() * 1.02 + 1e-6)
            for a, b, c in POLAR_EXPRESS_COEFFS:
                A = x @ x.T
                x = a * x + (b * A + c * A @ A) @ x
            s = max(1.0, p.size(0) / p.size(1)) ** 0.5   # upstream's LR factor: on the decay too
            u = (x.T if tall else x) * s
            mask = ((u * p) >= 0).double()
            ambiguous[i] |= u.abs() < 1e-5
            params[i] = p - lr * (u + s * wd * p * mask)
    return params, ambiguous


def test_muon_step_matches_plain_reference():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(48, 16)) for _ in range(3)]  # tall: scale sqrt(3)
    opt = MuonAdamW([dict(kind="muon", params=params, lr=0.05, momentum=0.9, nesterov=True, ns_steps=5,
                          weight_decay=0.1, cautious_wd=True)])
    start = [p.detach().clone() for p in params]
    steps = [[torch.randn(48, 16) for _ in params] for _ in range(3)]
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
    ref, ambiguous = _reference_muon(start, steps, lr=0.05, momentum=0.9, wd=0.1)
    for p, r, skip in zip(params, ref, ambiguous):
        assert skip.float().mean() < 0.01
        assert (p.double() - r).abs()[~skip].max() < 1e-5
    assert opt.state[params[0]]["momentum_buffer"].shape == (3, 48, 16)  # one stacked buffer


def test_adamw_groups_match_torch_adamw():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(20, 8))
    b = copy.deepcopy(a)
    ours = MuonAdamW([dict(kind="adamw", params=[a], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)])
    ref = torch.optim.AdamW([b], lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1)
    for _ in range(4):
        g = torch.randn(20, 8)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert (a - b).abs().max() < 1e-6


def test_build_optimizer_groups_and_lrs():
    model = tiny_model()
    opt = build_optimizer(model, matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.004, scalar_lr=0.5,
                          weight_decay=0.1)
    scale = (64 / 768) ** -0.5
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["lm_head"]["lr"] == pytest.approx(0.004 * scale)
    assert by_name["embedding"]["lr"] == pytest.approx(0.3 * scale)
    assert by_name["value_embeds"]["lr"] == pytest.approx(0.3 * scale)
    assert by_name["resid_lambdas"]["lr"] == pytest.approx(0.005)
    assert by_name["scalars"]["lr"] == 0.5 and by_name["scalars"]["betas"] == (0.96, 0.95)
    muon = [g for g in opt.param_groups if g["kind"] == "muon"]
    assert {g["name"] for g in muon} == {"muon_64x64", "muon_256x64", "muon_64x256", "muon_2x32"}
    assert all(len({p.shape for p in g["params"]}) == 1 and g["weight_decay"] == 0.1 for g in muon)
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert all(g["initial_lr"] == g["lr"] for g in opt.param_groups)
    with pytest.raises(ValueError, match="--matrix-lr"):
        build_optimizer(model, matrix_lr=-1)
    with pytest.raises(ValueError, match="adam_betas: got"):
        build_optimizer(model, adam_betas=(0.9, 1.0))


def test_training_steps_reduce_loss():
    model = tiny_model()
    opt = build_optimizer(model)
    idx = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss = model(idx, idx)
        loss.backward()
        opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_state_dict_round_trip_is_exact():
    model = tiny_model()
    opt = build_optimizer(model, weight_decay=0.1)
    for s in range(3):
        set_grads(model, fake_grads(model, s))
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = build_optimizer(model2, weight_decay=0.1)
    opt2.load_state_dict(saved)
    for a, b in zip(opt.param_groups, opt2.param_groups):
        assert {k: v for k, v in a.items() if k != "params"} == {k: v for k, v in b.items() if k != "params"}
    for s in range(3, 5):
        opt.set_hparams(lr_mult=0.5, momentum=0.9, wd_mult=0.5)
        opt2.set_hparams(lr_mult=0.5, momentum=0.9, wd_mult=0.5)
        set_grads(model, fake_grads(model, s))
        set_grads(model2, fake_grads(model2, s))
        opt.step()
        opt2.step()
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
    sd1, sd2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        for name in sd1[k]:
            assert torch.equal(sd1[k][name], sd2[k][name])


def test_a_resumed_run_takes_its_own_lr_flags(tmp_path, capsys):
    """torch's load_state_dict puts the checkpoint's group settings back, so a resume with a new
    --matrix-lr / --weight-decay / --adam-betas trained at the old ones, silently. The run's flags
    win now (and the start says which changed); with the same flags the state is unchanged."""
    import io

    model = tiny_model()
    opt = build_optimizer(model, weight_decay=0.1)
    set_grads(model, fake_grads(model, 0))
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)   # as a checkpoint round-trips it (weights_only load)
    same = build_optimizer(copy.deepcopy(model), weight_decay=0.1)
    same.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert "--resume" not in capsys.readouterr().out
    changed = build_optimizer(copy.deepcopy(model), matrix_lr=0.01, weight_decay=0.0, adam_betas=(0.9, 0.99))
    changed.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    muon = [g for g in changed.param_groups if g["kind"] == "muon"]
    adamw = [g for g in changed.param_groups if g["kind"] == "adamw" and g["name"] != "scalars"]
    assert muon and all(g["initial_lr"] == 0.01 and g["initial_weight_decay"] == 0.0 for g in muon)
    assert adamw and all(tuple(g["betas"]) == (0.9, 0.99) for g in adamw)
    out = capsys.readouterr().out
    assert "--resume: this run's optimizer flags replace the checkpoint's" in out and "initial_lr 0.02 -> 0.01" in out
    state = changed.state[muon[0]["params"][0]]   # the moments themselves still come from the checkpoint
    assert torch.equal(state["momentum_buffer"], opt.state[[g for g in opt.param_groups if g["kind"] == "muon"][0]
                                                           ["params"][0]]["momentum_buffer"])


def test_set_hparams():
    model = tiny_model()
    opt = build_optimizer(model, weight_decay=0.2)
    opt.set_hparams(lr_mult=0.25, momentum=0.87, wd_mult=0.5)
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(g["initial_lr"] * 0.25)
        if g["kind"] == "muon":
            assert g["momentum"] == 0.87 and g["weight_decay"] == pytest.approx(0.1)


def test_schedules():
    assert lr_multiplier(0, 100) == 1.0
    assert lr_multiplier(60, 100) == 1.0
    assert lr_multiplier(80, 100) == pytest.approx(0.5)
    assert lr_multiplier(100, 100) == 0.0
    assert lr_multiplier(100, 100, final_lr_frac=0.1) == pytest.approx(0.1)
    assert lr_multiplier(0, 100, warmup_ratio=0.1) == pytest.approx(0.1)
    assert lr_multiplier(9, 100, warmup_ratio=0.1) == pytest.approx(1.0)
    assert lr_multiplier(50, 100, warmdown_ratio=0.0) == 1.0
    with pytest.raises(ValueError, match="--warmup-ratio"):
        lr_multiplier(0, 100, warmup_ratio=0.7, warmdown_ratio=0.5)
    with pytest.raises(ValueError, match="--num-iterations"):
        lr_multiplier(0, 0)
    assert muon_momentum(0) == pytest.approx(0.85)
    assert muon_momentum(150) == pytest.approx(0.90)
    assert muon_momentum(300) == pytest.approx(0.95) and muon_momentum(10_000) == pytest.approx(0.95)
    assert weight_decay_multiplier(0, 200) == 1.0
    assert weight_decay_multiplier(50, 200) == 0.75
    assert weight_decay_multiplier(200, 200) == 0.0


def test_compiled_steps_raise_the_recompile_limit():
    """A compiled optimizer raises dynamo's per-function limit, never lowers it. (torch's own
    config.patch restores the value: pytest's monkeypatch deletes-then-hides config entries.)"""
    import torch._dynamo.config as dynamo_config
    from nanochat.optim import STEP_RECOMPILE_LIMIT
    with dynamo_config.patch(recompile_limit=8):
        build_optimizer(tiny_model(), compile=True)._fn("decay", torch.device("cpu"))
        assert dynamo_config.recompile_limit == STEP_RECOMPILE_LIMIT
    with dynamo_config.patch(recompile_limit=1000):
        build_optimizer(tiny_model(), compile=True)._fn("ortho", torch.device("cpu"))
        assert dynamo_config.recompile_limit == 1000


def test_v2_schedules():
    # warmup in steps: 40 steps, capped where the warmdown starts (a short run still warms down)
    assert lr_multiplier(0, 1000, warmdown_ratio=0.65, warmup_steps=40) == pytest.approx(1 / 40)
    assert lr_multiplier(39, 1000, warmdown_ratio=0.65, warmup_steps=40) == 1.0
    assert lr_multiplier(1000, 1000, warmdown_ratio=0.65, final_lr_frac=0.05, warmup_steps=40) == pytest.approx(0.05)
    assert lr_multiplier(5, 20, warmdown_ratio=0.65, warmup_steps=40) == pytest.approx(6 / 7)  # 20 - 13 = 7 steps
    assert lr_multiplier(7, 20, warmdown_ratio=0.65, warmup_steps=40) == 1.0
    with pytest.raises(ValueError, match="--warmup-steps"):
        lr_multiplier(0, 10, warmup_steps=-1)
    # momentum: 0.85 -> 0.97 over 400 steps, then from the warmdown's start down to 0.90 at the end
    m = lambda step: muon_momentum_peaked(step, 1000, 0.5)  # noqa: E731
    assert m(0) == pytest.approx(0.85) and m(200) == pytest.approx(0.91) and m(400) == pytest.approx(0.97)
    assert m(500) == pytest.approx(0.97) and m(750) == pytest.approx(0.935) and m(1000) == pytest.approx(0.90)
    # warmdown begins before the ramp ends: continuous from where the ramp stands
    short = [muon_momentum_peaked(s, 300, 0.65) for s in range(301)]
    assert short[105] == pytest.approx(0.85 + 0.12 * 105 / 400) and short[-1] == pytest.approx(0.90)
    assert max(abs(a - b) for a, b in zip(short, short[1:])) < 0.002
    assert muon_momentum_peaked(50, 100, 0.0) == muon_momentum(50, end=0.97, ramp_steps=400)
    # weight decay: half cosine, 1 -> 0
    assert weight_decay_cosine(0, 200) == 1.0 and weight_decay_cosine(100, 200) == pytest.approx(0.5)
    assert weight_decay_cosine(200, 200) == pytest.approx(0.0, abs=1e-12) and weight_decay_cosine(300, 200) >= 0


def test_normuon_rescale_evens_neurons_and_keeps_the_norm():
    torch.manual_seed(0)
    assert normuon_shape((3, 64, 16)) == (3, 64, 1) and normuon_shape((3, 16, 64)) == (3, 1, 16 * 4)
    assert normuon_shape((2, 8, 8)) == (2, 8, 1)
    for shape in [(3, 48, 16), (3, 16, 48)]:
        # rows (tall) or columns (wide) of very different scales
        u = torch.randn(shape)
        neuron_dim = 1 if shape[1] >= shape[2] else 2
        scales = torch.logspace(-1, 1, shape[neuron_dim]).view((1, -1, 1) if neuron_dim == 1 else (1, 1, -1))
        u = u * scales
        v = torch.zeros(normuon_shape(shape))
        out = None
        for _ in range(200):  # steady state of the EMA: each neuron divided by its own RMS
            out = normuon_rescale(u, v, torch.tensor(0.9))
        torch.testing.assert_close(out.norm(dim=(-2, -1)), u.norm(dim=(-2, -1)), rtol=1e-5, atol=1e-6)
        rms = out.square().mean(dim=3 - neuron_dim).sqrt()
        assert (rms.max(dim=-1).values / rms.min(dim=-1).values).max() < 1.01, "neurons not evened out"
        assert (u.square().mean(dim=3 - neuron_dim).sqrt().amax(-1) / u.square().mean(dim=3 - neuron_dim)
                .sqrt().amin(-1)).min() > 10
    # a padding slot (all-zero update) stays exactly zero: no 0/0
    u = torch.randn(2, 8, 4)
    u[1] = 0
    out = normuon_rescale(u, torch.zeros(2, 8, 1), torch.tensor(0.95))
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert out.dtype == u.dtype and normuon_rescale(u.bfloat16(), torch.zeros(2, 8, 1), torch.tensor(0.95)).dtype \
        == torch.bfloat16


def test_normuon_in_the_optimizer_step():
    """beta2 > 0: the Muon step is orthogonalise -> NorMuon rescale -> decay, and the buffer is
    saved and restored with the optimizer state (exact resume)."""
    model, ref = tiny_model(), tiny_model()
    opt = build_optimizer(model, normuon_beta2=0.9)
    plain = build_optimizer(ref)
    assert all(g["beta2"] == 0.9 for g in opt.param_groups if g["kind"] == "muon")
    for s in range(3):
        grads = fake_grads(model, s)
        set_grads(model, grads)
        set_grads(ref, grads)
        opt.step()
        plain.step()
    buffers = [st["second_moment"] for st in opt.state.values() if "second_moment" in st]
    assert buffers and all(b.dtype == torch.float32 and (b > 0).all() for b in buffers)
    assert not any("second_moment" in st for st in plain.state.values())
    diffs = [(p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()) if p.ndim == 2]
    assert max(diffs) > 1e-4  # NorMuon changed the matrices' steps
    # exact resume: a copy restored from the state dict takes the same next step
    twin = copy.deepcopy(model)
    opt_twin = build_optimizer(twin, normuon_beta2=0.9)
    opt_twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    grads = fake_grads(model, 99)
    set_grads(model, grads)
    set_grads(twin, grads)
    opt.step()
    opt_twin.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="--normuon-beta2"):
        build_optimizer(model, normuon_beta2=1.0)


# ----------------------------------------------------------------------------------------------
# Distributed (gloo, 2 processes on CPU)

STEPS = 3
VOCAB = 1024  # 1024 x 64 tables reach the AdamW sharding threshold (sharded path exercised)


NORMUONS = (0.0, 0.95)


def _worker(rank, world_size, store_path, out_dir):
    """Both NORMUONS settings in one spawn (two spawns of two processes cost seconds each)."""
    # a FileStore, not tcp://: with a TCPStore hosted by rank 0, rank 1 was once killed by SIGABRT
    # ("terminate called without an active exception") while the two tore gloo down after the
    # final barrier (CI, 1 run in 3); a file has no host process to go away first, nor a port to race for
    torch.set_num_threads(1)   # as the reference below: see test_gloo_two_process_step_matches_single_process
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        for normuon in NORMUONS:
            model = tiny_model(VOCAB)
            opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=normuon, world_size=world_size, rank=rank)
            for s in range(STEPS):
                set_grads(model, fake_grads(model, 100 * s + rank))
                opt.set_hparams(momentum=muon_momentum(s))
                opt.step()
            if rank == 0:
                torch.save([p.detach() for p in model.parameters()], Path(out_dir) / f"params_{normuon}.pt")
        dist.barrier()  # no rank tears gloo down while the other still talks to it (SIGABRT otherwise)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_params(tmp_path_factory):
    """{normuon: rank 0's parameters after STEPS distributed steps}, one spawn for both settings."""
    out = tmp_path_factory.mktemp("gloo_optim")
    mp.spawn(_worker, args=(2, str(out / "store"), str(out)), nprocs=2, join=True)
    return {normuon: torch.load(out / f"params_{normuon}.pt") for normuon in NORMUONS}


@pytest.mark.parametrize("normuon", NORMUONS)
def test_gloo_two_process_step_matches_single_process(gloo_params, normuon):
    # Both sides run single-threaded: Polar Express's first iterations multiply a matrix's small
    # singular directions by ~8 each, so a BLAS that splits a batch-1 product across threads (a
    # rank's shard) and a batch-2 one by matrix (the reference) differed by 3e-4 on one CPU model
    # (2026-11-28, torch 2.15) from rounding alone; with one thread each they agree to the bit there.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = tiny_model(VOCAB)
        opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=normuon)
        for s in range(STEPS):
            per_rank = [fake_grads(model, 100 * s + r) for r in range(2)]
            set_grads(model, [(a + b) / 2 for a, b in zip(*per_rank)])  # the averaged gradient
            opt.set_hparams(momentum=muon_momentum(s))
            opt.step()
    finally:
        torch.set_num_threads(threads)
    dist_params = gloo_params[normuon]
    moved = 0.0
    for (name, p), q in zip(model.named_parameters(), dist_params):
        assert (p - q).abs().max() < 1e-5, name
        moved = max(moved, (p - tiny_model(VOCAB).get_parameter(name)).abs().max().item())
    assert moved > 1e-2  # the steps really changed the parameters


def test_bench_optim_runs_and_validates_flags():
    from scripts import bench_optim
    row = bench_optim.main(["--device", "cpu", "--depth", "1", "--vocab-size", "64", "--steps", "2",
                            "--warmup", "1", "--top", "3"])
    model, optimizer = bench_optim.build(bench_optim.parse_args(["--depth", "1", "--vocab-size", "64"]),
                                         torch.device("cpu"))
    assert row["muon_params"] + row["adamw_params"] == sum(p.numel() for p in model.parameters())
    assert row["ms_median"] >= row["ms_min"] > 0 and len(row["top"]) == 3
    times = [k["device_ms_per_step"] for k in row["top"]]
    assert times == sorted(times, reverse=True)
    # the profile covers the whole step, Polar Express's products included. (Asserting a bmm among
    # the top 3 failed now and then: at depth 1 on 2 busy CPU cores, sqrt/mul/add can outrank them.)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), synchronize=lambda: None)
    every = bench_optim.profiled(cpu, optimizer, 1000)["top"]
    assert any(k["kernel"] == "aten::bmm" for k in every) and any(k["kernel"] == "aten::baddbmm" for k in every)
    with pytest.raises(ValueError, match="--steps"):
        bench_optim.parse_args(["--steps", "0"])
