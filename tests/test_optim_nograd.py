"""MuonAdamW and parameters without a gradient (nanochat/optim.py): such a parameter is skipped as
torch's optimizers skip `.grad is None` (no momentum / moment step, no weight decay; in a Muon
stack only the slots with a gradient advance), and 2 gloo processes agree with one process:
a parameter with no gradient on every rank is skipped, one with a gradient on some rank is
averaged with zeros from the others (DistributedDataParallel's find_unused_parameters rule)."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanochat.optim import build_optimizer, muon_momentum
from tests.test_optim import VOCAB, tiny_model

WORLD = 2
# step -> {param name: the ranks that have no gradient for it}; step 0 and 3: every gradient
NO_GRAD = {
    1: {"blocks.0.attn.c_k.weight": {0, 1},     # one slot of a Muon stack (rank 0's chunk)
        "blocks.1.mlp.c_fc.weight": {0, 1},     # rank 1's whole chunk of its stack
        "blocks.1.attn.ve_gate.weight": {0, 1},  # a whole Muon group
        "wte.weight": {0, 1},                   # a sharded AdamW tensor with moments
        "x0_lambdas": {0, 1}},                  # a small (all-reduced) AdamW tensor
    2: {"blocks.1.attn.c_v.weight": {1},        # on one rank only: averaged with zeros
        "lm_head.weight": {0},
        "resid_lambdas": {0}},
}
STEPS = 4
SKIPPED = sorted(NO_GRAD[1])


def _grads(model, step: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _set(model, grads: dict) -> None:
    for n, p in model.named_parameters():
        p.grad = None if grads.get(n) is None else grads[n].clone()


def _rank_grads(model, step: int, rank: int) -> dict:
    none = NO_GRAD.get(step, {})
    return {n: None if rank in none.get(n, ()) else g for n, g in _grads(model, step, rank).items()}


def _averaged(model, step: int) -> dict:
    """What one process sees of the 2 ranks' gradients: None where no rank has one, else the
    mean with zeros for a rank without."""
    per_rank = [_rank_grads(model, step, r) for r in range(WORLD)]
    out = {}
    for n, _ in model.named_parameters():
        got = [g[n] for g in per_rank if g[n] is not None]
        out[n] = sum(got) / WORLD if got else None
    return out


def _params(model) -> dict:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def _run(grads_of, normuon: float, world_size: int = 1, rank: int = 0, fsdp: bool = False):
    """STEPS steps; returns (the parameters after step 1, after the last step). fsdp: the model
    FSDP2-sharded, each gradient given as the DTensor FSDP's reduce-scatter would leave."""
    model = tiny_model(VOCAB)
    if fsdp:
        from types import SimpleNamespace

        from torch.distributed.tensor import distribute_tensor

        from nanochat.distributed import apply_fsdp
        apply_fsdp(model, SimpleNamespace(ddp=True, device_type="cpu", world_size=world_size))
    opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=normuon, world_size=world_size, rank=rank)
    after_1 = None
    for s in range(STEPS):
        grads = grads_of(model, s)
        if fsdp:
            grads = {n: None if grads[n] is None else distribute_tensor(grads[n], p.device_mesh, p.placements)
                     for n, p in model.named_parameters()}
        _set(model, grads)
        opt.set_hparams(momentum=muon_momentum(s))
        opt.step()
        if s == 1:
            after_1 = _params(model)
    return after_1, _params(model)


def test_a_parameter_without_gradient_is_skipped_single_process():
    """torch's rule on one process: no gradient -> the parameter and its state stay as they are,
    also inside a Muon stack whose other slots step (weight decay on: it would move them)."""
    model = tiny_model(VOCAB)
    opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=0.95)
    _set(model, _grads(model, 0, 0))
    opt.step()
    params = dict(model.named_parameters())
    skip = params["blocks.0.attn.c_k.weight"]
    stack = next(g for g in opt.param_groups if any(p is skip for p in g["params"]))
    slot = next(i for i, p in enumerate(stack["params"]) if p is skip)
    state = opt.state[stack["params"][0]]
    before = {n: p.detach().clone() for n, p in params.items()}
    momentum, second = state["momentum_buffer"].clone(), state["second_moment"].clone()
    adam_step = float(opt.state[params["wte.weight"]]["step"])
    _set(model, _rank_grads(model, 1, 0))
    opt.step()
    for n, p in params.items():
        assert torch.equal(p, before[n]) == (n in NO_GRAD[1]), n
    others = [i for i in range(len(stack["params"])) if i != slot]
    assert torch.equal(state["momentum_buffer"][slot], momentum[slot])
    assert torch.equal(state["second_moment"][slot], second[slot])
    assert not torch.equal(state["momentum_buffer"][others], momentum[others])
    assert float(opt.state[params["wte.weight"]]["step"]) == adam_step


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)   # as the reference: see test_optim.test_gloo_two_process_step_matches_single_process
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        result = {}
        for normuon in (0.0, 0.95):
            result[normuon] = _run(lambda m, s: _rank_grads(m, s, rank), normuon, WORLD, rank)
            # FSDP: a gradient is None on every rank or on none (FSDP reduces what it produces)
            result[normuon, "fsdp"] = _run(lambda m, s: _averaged(m, s), normuon, WORLD, rank, fsdp=True)
        try:   # FSDP parameters sharded over WORLD ranks with the default world_size=1
            fsdp_model = tiny_model(VOCAB)
            from types import SimpleNamespace

            from nanochat.distributed import apply_fsdp
            apply_fsdp(fsdp_model, SimpleNamespace(ddp=True, device_type="cpu", world_size=WORLD))
            build_optimizer(fsdp_model, weight_decay=0.1)
            result["mesh_error"] = None
        except ValueError as e:
            result["mesh_error"] = str(e)
        if rank == 0:
            torch.save(result, out)
        dist.barrier()   # no rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_match_one_process_with_missing_gradients(tmp_path):
    out = tmp_path / "params.pt"
    mp.spawn(_worker, args=(str(tmp_path / "store"), str(out)), nprocs=WORLD, join=True)
    dist_result = torch.load(out)
    assert dist_result.pop("mesh_error") == (f"MuonAdamW: the FSDP parameters are sharded over {WORLD} ranks but "
                                             f"world_size=1; pass world_size={WORLD}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for normuon in (0.0, 0.95):
            after_0 = _run(lambda m, s: _averaged(m, s) if s == 0 else {}, normuon)[1]   # step 0, then no grads
            after_1, final = _run(_averaged, normuon)
            for kind in ("ddp", "fsdp"):
                d_after_1, d_final = dist_result[normuon] if kind == "ddp" else dist_result[normuon, "fsdp"]
                for n, p in final.items():   # the two agree...
                    assert (p - d_final[n]).abs().max() < 1e-5, (kind, normuon, n)
                for n in SKIPPED:   # ...on torch's rule: skipped at step 1, on both sides
                    assert torch.equal(after_1[n], after_0[n]) and torch.equal(d_after_1[n], after_0[n]), \
                        (kind, normuon, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("normuon", [0.0, 0.95])
def test_the_slots_that_step_get_what_a_stack_without_the_skipped_one_gives(normuon, device):
    """Momentum, orthogonalisation and NorMuon are per matrix: skipping a slot leaves the other
    slots' updates exactly those of a stack that never held the skipped parameter (on CUDA: the
    compiled bf16 step, run on the slots that step)."""
    from nanochat.optim import MuonAdamW

    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(48, 32, device=device)) for _ in range(3))
    a2, c2 = (torch.nn.Parameter(p.detach().clone()) for p in (a, c))
    hp = dict(kind="muon", lr=0.02, momentum=0.95, weight_decay=0.1, beta2=normuon)
    opt, ref = MuonAdamW([dict(params=[a, b, c], **hp)]), MuonAdamW([dict(params=[a2, c2], **hp)])
    b0 = b.detach().clone()
    for step in range(2):
        a.grad, c.grad = torch.randn(48, 32, device=device), torch.randn(48, 32, device=device)
        a2.grad, c2.grad, b.grad = a.grad.clone(), c.grad.clone(), None
        opt.step()
        ref.step()
        assert torch.equal(b, b0) and torch.equal(a, a2) and torch.equal(c, c2), step
    state = opt.state[a]
    assert not state["momentum_buffer"][1].any() and torch.equal(state["momentum_buffer"][[0, 2]],
                                                                 ref.state[a2]["momentum_buffer"])
