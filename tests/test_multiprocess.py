"""Multi-process behaviour on CPU with gloo (2 processes) that tests/test_distributed.py leaves open:

* the token-weighted step (SFT: loss summed over trained tokens, divided by the trained tokens of
  ALL ranks) equals one process with the same micro-batches, also when the ranks hold very
  different numbers of trained tokens (one micro-batch with none) and with --grad-clip;
* a non-finite loss on ONE rank stops every rank at the same step with NonFiniteLossError (no rank
  left waiting at a collective);
* validation bits per byte pools nats and bytes over ranks (not a mean of per-rank bpb), also when
  the ranks evaluate different numbers of batches;
* chat_eval's categorical and generative loops count every problem exactly once when the problem
  count does not divide by the world size;
* ChatLoader deals each conversation of an epoch to exactly one rank.

(`--resume auto` of a chat stage under another number of processes than its checkpoint starting
fresh on every rank is checked by tests/test_distributed.py's torchrun SFT launch.)

Workers set up their own process group with a short timeout, so a rank stuck at a collective
fails the test in seconds instead of hanging it."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nanochat.distributed import free_port

B, T, VOCAB = 2, 16, 128
WORLD = 2


def _group(rank: int, port: int):
    """torchrun's environment + a gloo group that times out in 60 s; returns the Runtime."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    from nanochat.common import init_runtime
    return init_runtime("cpu", "fp32", seed=0)   # joins the group above


def _finish_together() -> None:
    """A barrier before the group is torn down, as tests/test_distributed.py's workers do: without it a
    rank can destroy its gloo group while the other still finishes the last collective, and gloo's
    threads abort the slower process ("terminate called without an active exception", SIGABRT, seen
    once in CI)."""
    import torch.distributed as dist
    dist.barrier()


def _single(rt):
    return dataclasses.replace(rt, rank=0, world_size=1, ddp=False, is_master=True)


def _tiny_model():
    from nanochat.gpt import GPT, config_for_depth
    torch.manual_seed(0)
    model = GPT(config_for_depth(2, VOCAB, T, aspect_ratio=16, head_dim=16))   # n_embd 32
    model.init_weights()
    return model


def _masked_batches(n: int) -> list:
    """Learnable rows (next = current + 1) with SFT-like masks of very different sizes: micro-batch 1
    (rank 1's first at 2 ranks) trains no token at all, others 1..T tokens per row."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        rows = (torch.randint(0, VOCAB, (B, 1), generator=g) + torch.arange(T + 1)) % VOCAB
        x, y = rows[:, :-1].clone(), rows[:, 1:].clone()
        keep = torch.arange(T) >= torch.randint(0, T, (B, 1), generator=g)
        y[~keep] = -1
        if i % 4 == 1:
            y[:] = -1
        out.append((x, y))
    return out


def _train(model, rt, batches, steps: int, accum_world: int, grad_clip: float | None = None, poison=None):
    """Token-weighted Trainer steps; accum x world = `accum_world` micro-batches a step."""
    from nanochat.distributed import StridedMicroBatches
    from nanochat.optim import build_optimizer
    from nanochat.training import Schedule, Trainer, plan_batch
    world = rt.world_size
    opt = build_optimizer(model, world_size=world, rank=rt.rank)
    plan = plan_batch(accum_world * B * T, B, T, world)
    loader = StridedMicroBatches(batches, rt.rank, world) if world > 1 else iter(batches)
    trainer = Trainer(poison or model, opt, loader, plan, Schedule(steps, warmdown_ratio=0.5), rt,
                      grad_clip=grad_clip, token_weighted=True)
    return [trainer.step(s).loss for s in range(steps)]


class _PoisonOnRank:
    """The model, except that on `rank` the loss of step `step`'s first micro-batch is NaN."""

    def __init__(self, model, rank: int, poison_rank: int, step_calls: int):
        self.model, self.calls, self.at = model, 0, step_calls if rank == poison_rank else -1

    def __call__(self, x, y, **kw):
        loss = self.model(x, y, **kw)
        self.calls += 1
        return loss * float("nan") if self.calls == self.at else loss

    def __getattr__(self, name):
        return getattr(self.model, name)


def _training_worker(rank: int, port: int, out: str) -> None:
    from nanochat.common import destroy_runtime
    from nanochat.training import NonFiniteLossError
    rt = _group(rank, port)
    steps, accum_world = 3, 4
    data = _masked_batches(steps * accum_world)
    result = {}
    try:
        if rank == 0:
            result["single"] = _train(_tiny_model(), _single(rt), data, steps, accum_world)
            result["single_clip"] = _train(_tiny_model(), _single(rt), data, steps, accum_world, grad_clip=0.05)
        result["ddp"] = _train(_tiny_model(), rt, data, steps, accum_world)
        result["ddp_clip"] = _train(_tiny_model(), rt, data, steps, accum_world, grad_clip=0.05)
        model = _tiny_model()
        poison = _PoisonOnRank(model, rank, 1, step_calls=accum_world // WORLD + 1)   # step 1, rank 1 only
        try:
            _train(model, rt, data, steps, accum_world, poison=poison)
            result["nan"] = "no error"
        except NonFiniteLossError as e:
            result["nan"] = e.step
        _finish_together()
        Path(out, f"train{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_runtime(rt)
    # success (a failure raised above, for mp.spawn to report): skip the interpreter's teardown, where
    # a gloo thread still winding down aborted a finished rank now and then (SIGABRT, "terminate called
    # without an active exception": CI, sessions 49 and 60) after its result was written
    os._exit(0)


def test_token_weighted_step_and_nan_on_one_rank(tmp_path):
    mp.spawn(_training_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"train{r}.json").read_text()) for r in range(WORLD))
    assert r0["ddp"] == r1["ddp"] and r0["ddp_clip"] == r1["ddp_clip"]   # every rank logs the global loss
    for key in ("", "_clip"):
        single, ddp = r0["single" + key], r0["ddp" + key]
        assert max(abs(a - b) for a, b in zip(single, ddp)) <= 1e-5, (key, single, ddp)
    assert r0["single"][-1] < r0["single"][0]   # it trains
    assert r0["nan"] == 1 and r1["nan"] == 1    # both ranks stop at the step rank 1 went NaN


# ------------------------------------------------------------------ evaluation across ranks

class _Letters:
    """Categorical problems: gold "A" for i % 3 == 0, else "B"."""

    eval_type = "categorical"

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"id": i, "letters": ["A", "B"], "gold": "A" if i % 3 == 0 else "B"}

    def evaluate(self, conv, predicted):
        return predicted == conv["gold"]


class _Generative(_Letters):
    eval_type = "generative"

    def evaluate(self, conv, completion):
        return completion == "ok"


class _Tok:
    bos_token_id = 0

    def encode(self, text):
        return [ord(text)]

    def render_for_completion(self, conv):
        return [0, 1 + conv["id"]]


def _always_a(x):
    logits = torch.zeros(*x.shape, VOCAB)
    logits[..., ord("A")] = 1.0
    return logits


class _Engine:
    """Sample j of problem i passes when (i + j) is even: pass counts differ by problem."""

    max_seq_len = 64

    def generate_batch(self, prompt, num_samples, max_tokens, temperature, top_k, seed):
        i = prompt[1] - 1
        return [prompt + [100 + (i + j) % 2] for j in range(num_samples)], None


class _Gathering(torch.nn.Module):
    """A model whose forward runs a collective first (FSDP all-gathers each block): ranks must
    take the same number of forwards, or the collectives pair up wrongly."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *args, **kwargs):
        import torch.distributed as dist
        self.calls += 1
        dist.all_reduce(torch.ones(1))
        return self.inner(*args, **kwargs)


def _eval_worker(rank: int, port: int, out: str, n_problems: int) -> None:
    import nanochat.tasks.evaluate as ev
    from nanochat.common import destroy_runtime
    from nanochat.eval_bpb import evaluate_bpb
    rt = _group(rank, port)
    ev.completion_text = lambda tok, ids: "ok" if ids[-1] == 100 else "no"
    try:
        cat = ev.run_categorical(_always_a, _Tok(), _Letters(n_problems), "cpu", batch_size=2)
        gen = ev.run_generative(_Engine(), _Tok(), _Generative(n_problems), "cpu", num_samples=2)
        # bpb: rank 0 evaluates 1 batch, rank 1 three; text bytes per token differ by token id
        model = _tiny_model().eval()
        token_bytes = (torch.arange(VOCAB) % 4).to(torch.long)   # some tokens have 0 bytes (specials)
        batches = _masked_batches(4)
        mine = batches[:1] if rank == 0 else batches[1:]
        gathering = _Gathering(model)   # a collective in every forward, as FSDP's all-gathers
        bpb = evaluate_bpb(gathering, iter(mine), 10, token_bytes)
        nats = nbytes = 0.0
        per_rank = []
        with torch.no_grad():
            for part in (batches[:1], batches[1:]):
                n_r = b_r = 0.0
                for x, y in part:
                    loss = model(x, y, loss_reduction="none").reshape(-1).double()
                    tb = torch.where(y >= 0, token_bytes[y.clamp(min=0)], 0).reshape(-1).double()
                    n_r += float((loss * (tb > 0)).sum())
                    b_r += float(tb.sum())
                nats, nbytes = nats + n_r, nbytes + b_r
                per_rank.append(n_r / (math.log(2) * b_r))
        _finish_together()
        Path(out, f"eval{rank}.json").write_text(json.dumps({
            "cat": [cat.passed, cat.total], "gen": [gen.passed, gen.total, list(gen.passed_at)],
            "bpb": bpb, "pooled": nats / (math.log(2) * nbytes), "mean_of_ranks": sum(per_rank) / 2,
            "forwards": gathering.calls}))
    finally:
        destroy_runtime(rt)


def test_eval_sharding_counts_every_problem_once_and_pools_bpb(tmp_path):
    n = 7   # not a multiple of 2 ranks
    mp.spawn(_eval_worker, args=(free_port(), str(tmp_path), n), nprocs=WORLD, join=True)
    r0, r1 = (json.loads((tmp_path / f"eval{r}.json").read_text()) for r in range(WORLD))
    assert r0 == r1
    assert r0["cat"] == [len([i for i in range(n) if i % 3 == 0]), n]
    # 2 samples, one passing each: pass@1 = 1/2 a problem, pass@2 = 1
    passed, total, passed_at = r0["gen"]
    assert total == n and passed == n and passed_at == pytest.approx([n / 2, n])
    assert r0["bpb"] == pytest.approx(r0["pooled"], rel=1e-9)
    assert r0["forwards"] == 3   # rank 0 (one batch) re-ran it unscored while rank 1 had more (r0 == r1)
    assert abs(r0["pooled"] - r0["mean_of_ranks"]) > 1e-6   # the check can tell the two apart


def test_chat_loader_deals_each_conversation_to_one_rank():
    from nanochat.chat_data import ChatLoader

    class Convs:
        def __len__(self):
            return 11

        def __getitem__(self, i):
            return {"id": i}

    class Tok:
        bos_token_id = 0

        def render_conversation(self, conv, max_tokens):
            return [0, 100 + conv["id"], 100 + conv["id"]], [0, 1, 1]

    def seen(rank: int, world: int) -> list[int]:
        loader = ChatLoader(Convs(), Tok(), 2, 8, rank=rank, world_size=world, mask="all", loop=False)
        ids = []
        for x, y in loader:
            rows = torch.cat([x[:, :1], y.clamp(min=0)], dim=1)   # every token of a row, once
            ids += [int(t) - 100 for t in rows.flatten() if t >= 100]
        return sorted(set(ids))
    shards = [seen(r, 3) for r in range(3)]
    assert sorted(sum(shards, [])) == list(range(11)) == seen(0, 1)   # disjoint, and nothing missing
    assert shards[1] == [1, 4, 7, 10]
