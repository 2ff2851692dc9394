"""Review 15 of the training mathematics: the optimizer-state size estimate (checkpoint disk
planning) against what 3 gloo ranks really hold, with and without FSDP: the ranks keep the whole
moments of every AdamW tensor they do not shard (with 3 ranks a padded vocab of 1024 rows is not
divisible, so the embedding, value embeddings and lm_head too) and pad each Muon stack to a multiple
of the world size, which an estimate "summed over ranks" counted once (a d20 run on 3 GPUs: 5.6 GB
planned, 13.7 GB saved)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanochat.gpt import GPT, config_for_depth
from nanochat.optim import adamw_sharded, build_optimizer, optimizer_state_bytes
from tests.test_optim import VOCAB, fake_grads, tiny_model

WORLD = 3   # not a divisor of the padded vocab (1024): the vocab tables stay whole on every rank


def _state_bytes(opt) -> int:
    """What this rank's optimizer state holds (as its optim_rank<R>.pt), less the 0-dim step counters."""
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _worker(rank, store_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        held = {}
        for fsdp in (False, True):
            for normuon in (0.0, 0.95):
                model = tiny_model(VOCAB)
                grads = fake_grads(model, 7)   # the same on every rank
                if fsdp:
                    from torch.distributed.tensor import distribute_tensor

                    from nanochat.distributed import apply_fsdp
                    apply_fsdp(model, SimpleNamespace(ddp=True, device_type="cpu", world_size=WORLD))
                    grads = [distribute_tensor(g, p.device_mesh, p.placements)
                             for p, g in zip(model.parameters(), grads)]
                opt = build_optimizer(model, weight_decay=0.1, normuon_beta2=normuon, world_size=WORLD, rank=rank)
                for p, g in zip(model.parameters(), grads):
                    p.grad = g
                opt.step()
                held[f"{fsdp}-{normuon}"] = _state_bytes(opt)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(held))
        dist.barrier()   # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def held_by_ranks(tmp_path_factory):
    """{"fsdp-normuon": optimizer-state bytes summed over the 3 ranks} after one step."""
    out = tmp_path_factory.mktemp("state_bytes")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    per_rank = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return {key: sum(r[key] for r in per_rank) for key in per_rank[0]}


@pytest.mark.parametrize("fsdp", [False, True])
@pytest.mark.parametrize("normuon", [0.0, 0.95])
def test_state_bytes_summed_over_three_gloo_ranks(held_by_ranks, fsdp, normuon):
    model = tiny_model(VOCAB)
    estimate = optimizer_state_bytes(model, normuon=normuon > 0, world_size=WORLD, fsdp=fsdp)
    assert estimate == held_by_ranks[f"{fsdp}-{normuon}"]
    # one rank's layout (the old count) is short by the copies the ranks hold, except under FSDP without NorMuon
    single = optimizer_state_bytes(model, normuon=normuon > 0)
    assert (estimate == single) == (fsdp and normuon == 0.0)


def test_state_bytes_by_hand_on_two_ranks():
    """The tiny model (n_embd 64, vocab 1024, 2 layers) by hand: with 2 ranks the 1024 x 64 tables
    are sharded (no copies), the 2 scalar vectors are whole on both ranks, and the one 2 x 32
    value-embedding gate is padded to a 2-slot stack; 8 attention matrices and 2 of each MLP shape
    divide evenly."""
    model = tiny_model(VOCAB)
    single = optimizer_state_bytes(model)
    scalars = 2 * (2 + 2) * 4                  # resid_lambdas + x0_lambdas (2 layers): 2 moments, fp32
    gate_pad = 2 * 32 * 4                      # one zero slot of the (2, 32) stack's momentum
    assert optimizer_state_bytes(model, world_size=2) == single + scalars + gate_pad
    assert optimizer_state_bytes(model, world_size=2, normuon=True) == \
        optimizer_state_bytes(model, normuon=True) + scalars + gate_pad + 32 * 4
    with pytest.raises(ValueError, match="world_size"):
        optimizer_state_bytes(model, world_size=0)


def test_a_d20_estimate_on_three_ranks_counts_the_vocab_tables_three_times():
    with torch.device("meta"):
        model = GPT(config_for_depth(20, 32768, 2048))
    tables = [model.wte.weight, model.lm_head.weight, *[e.weight for e in model.value_embeds.values()]]
    assert not any(adamw_sharded(p, 3) for p in tables) and all(adamw_sharded(p, 8) for p in tables)
    extra = 2 * 2 * 4 * sum(p.numel() for p in tables)   # two more ranks x two fp32 moments
    scalars = 2 * 2 * 4 * 2 * 20                         # resid + x0 lambdas, two more copies
    # Muon stacks at d20 (80 square, 20 + 20 MLP, 10 gates): 3 ranks pad 80 -> 81, 20 -> 21, 10 -> 12
    pad = 1280 * 1280 * 4 + 2 * 5120 * 1280 * 4 + 2 * 10 * 32 * 4
    assert optimizer_state_bytes(model, world_size=3) - optimizer_state_bytes(model) == extra + scalars + pad
    assert extra > 8e9
