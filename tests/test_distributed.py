"""Multi-process training on CPU with gloo (2 processes): rank sharding of the data, loss
equivalence across world sizes (2 ranks x accum k == 1 rank x accum 2k on the same micro-batches),
FSDP2 == the distributed optimizer, exact resume of sharded optimizer state (FSDP in-process,
base_train under torchrun), refusal of a different world size, the timed barrier, the all-reduce
self-test, NCCL environment checks and scripts/launch_multinode.sh --dry-run.

Tolerances: fp32 on CPU. Cross-world-size losses differ only by summation order (gradients summed
across ranks vs across micro-batches): |diff| <= 1e-5 over 4 steps; final weights within 1e-3 relative (WEIGHT_TOL).
FSDP vs non-FSDP and every resume are compared exactly (same reductions in the same order)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from nanochat.distributed import free_port

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "scripts" / "launch_multinode.sh"
LOSS_TOL = 1e-5
# final weights, ||w1 - w2|| / ||w|| per tensor (measured 5e-5): not per element, because AdamW (eps
# 1e-10) turns summation-order noise in a near-zero gradient (|m| ~ 1e-12, rare tokens' embedding rows)
# into an update m / eps of ~1e-2 x lr on those few elements; a wrong reduction or shard moves O(1)
WEIGHT_TOL = 1e-3
STEPS, ACCUM_2RANK, B, T, VOCAB = 4, 2, 2, 32, 256
NORMUON = 0.95  # the equivalence runs use NorMuon (recipe v2's Muon): its buffers follow each layout too


def _torchrun_env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")


def _tiny_model():
    from nanochat.gpt import GPT, config_for_depth
    torch.manual_seed(0)
    model = GPT(config_for_depth(2, VOCAB, T, aspect_ratio=32, head_dim=32))  # n_embd 64, 2 heads
    model.init_weights()
    return model


def _micro_batches(n: int) -> list:
    g = torch.Generator().manual_seed(1)
    # learnable stream (next token = current + 1, random starts) so that the loss visibly falls
    rows = [(torch.randint(0, VOCAB, (B, 1), generator=g) + torch.arange(T + 1)) % VOCAB for _ in range(n)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def _run(model, rt, batches, start: int, steps: int, optimizer=None, world: int = 2, grad_clip: float | None = None,
         norms: list | None = None):
    """Train `steps` steps from index `start` with the shared Trainer; returns (losses, optimizer);
    each step's gradient norm is appended to `norms` when given (with grad_clip)."""
    from nanochat.distributed import StridedMicroBatches
    from nanochat.optim import build_optimizer
    from nanochat.training import Schedule, Trainer, plan_batch
    optimizer = optimizer or build_optimizer(model, normuon_beta2=NORMUON, world_size=world,
                                             rank=rt.rank if world > 1 else 0)
    plan = plan_batch(ACCUM_2RANK * 2 * B * T, B, T, world)
    loader = StridedMicroBatches(batches, rt.rank, world) if world > 1 else iter(batches)
    trainer = Trainer(model, optimizer, loader, plan, Schedule(STEPS, warmdown_ratio=0.5), rt, grad_clip=grad_clip)
    results = [trainer.step(s) for s in range(start, start + steps)]
    if norms is not None:
        norms += [r.grad_norm for r in results]
    return [r.loss for r in results], optimizer


def _clip_part(rt, world: int) -> dict:
    """--grad-clip on 2 ranks (no FSDP) vs one process with the same total batch: the same norms
    and losses only if the clip uses the global norm of the averaged gradient."""
    data = _micro_batches(STEPS * ACCUM_2RANK * world)
    result = {}

    def run(rt_, w):
        norms = []   # a clip of 0.05 is well below the norms: every step clips
        losses, _ = _run(_tiny_model(), rt_, data, 0, STEPS, world=w, grad_clip=0.05, norms=norms)
        return losses, norms
    if rt.rank == 0:
        result["single"] = run(dataclasses.replace(rt, rank=0, world_size=1, ddp=False, is_master=True), 1)
    result["ddp"] = run(rt, world)
    return result


def _equivalence_part(rt, world: int) -> dict:
    import torch.distributed as dist
    from nanochat.distributed import apply_fsdp
    assert dist.get_backend() == "gloo"
    rank = rt.rank
    data = _micro_batches(STEPS * ACCUM_2RANK * world)
    result = {}
    ddp_model = _tiny_model()
    if rank == 0:  # reference: one process, accumulation 2k, no process group involved
        single = dataclasses.replace(rt, rank=0, world_size=1, ddp=False, is_master=True)
        single_model = _tiny_model()
        result["single"], _ = _run(single_model, single, data, 0, STEPS, world=1)
    result["ddp"], _ = _run(ddp_model, rt, data, 0, STEPS)
    if rank == 0:   # the final weights too, not only the losses (the last step's update shows in no loss)
        result["weight_diff"] = max(float((a - b).norm() / a.norm()) for a, b in
                                    zip(single_model.parameters(), ddp_model.parameters(), strict=True))
    fsdp_model = apply_fsdp(_tiny_model(), rt)
    result["fsdp"], opt = _run(fsdp_model, rt, data, 0, STEPS)
    # exact resume of FSDP-sharded optimizer state: 2 steps, snapshot, 2 more; rebuild, reload, 2 more
    half = STEPS // 2
    model_a = apply_fsdp(_tiny_model(), rt)
    _, opt_a = _run(model_a, rt, data, 0, half)
    weights, opt_state = model_a.state_dict(), copy.deepcopy(opt_a.state_dict())
    result["full_weights"] = all(not hasattr(v, "placements") for v in weights.values())
    rest = data[half * ACCUM_2RANK * world:]
    result["continued"], _ = _run(model_a, rt, rest, half, half, optimizer=opt_a)
    model_b = _tiny_model()
    model_b.load_state_dict(weights)
    apply_fsdp(model_b, rt)
    from nanochat.optim import build_optimizer
    opt_b = build_optimizer(model_b, normuon_beta2=NORMUON, world_size=world, rank=rank)
    opt_b.load_state_dict(opt_state)
    result["resumed"], _ = _run(model_b, rt, rest, half, half, optimizer=opt_b)
    plain = build_optimizer(_tiny_model(), normuon_beta2=NORMUON, world_size=world, rank=rank)
    try:
        plain.load_state_dict(opt_state)
        result["refused"] = ""
    except ValueError as e:
        result["refused"] = str(e)
    return result


def _barrier_part(rank: int) -> dict:
    import time
    from nanochat.distributed import BarrierTimeout, allreduce_bandwidth, timed_barrier
    result = {"ok_wait": timed_barrier(30, name="first")}
    if rank == 1:
        time.sleep(2.5)  # late: rank 0 gives up first, then this rank completes the same barrier
    try:
        timed_barrier(1.0, name="late")
        result["late"] = "passed"
    except BarrierTimeout as e:
        result["late"] = str(e)
    rows = allreduce_bandwidth([1 << 12, 1 << 16], iters=2, warmup=1)
    result["busbw"] = [r["busbw_gbs"] for r in rows]
    result["ratio"] = [r["busbw_gbs"] / r["algbw_gbs"] for r in rows]
    return result


def _gloo_worker(rank: int, world: int, port: int, out: str) -> None:
    """One 2-process gloo group for the three tests below (each spawn of 2 processes that import
    torch and build an optimizer costs seconds): the equivalence runs, the clip runs, then the
    barrier (whose late rank would only delay the others). The group times out in 120 s, so a rank
    that fails leaves the other waiting that long at most."""
    from datetime import timedelta
    _torchrun_env(rank, world, port)
    import torch.distributed as dist
    from nanochat.common import destroy_runtime, init_runtime
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    rt = init_runtime("cpu", "fp32", seed=0)   # joins the group above
    try:
        result = {"equivalence": _equivalence_part(rt, world), "clip": _clip_part(rt, world),
                  "barrier": _barrier_part(rank)}
        dist.barrier()  # no rank tears the group down while the other is still in a collective
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        destroy_runtime(rt)
    # success: skip the interpreter's teardown, where a gloo thread still winding down aborted a
    # finished rank (SIGABRT, "terminate called without an active exception": CI, session 69), as
    # test_multiprocess's workers do since session 50
    os._exit(0)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    """Rank 0's and rank 1's results of _gloo_worker."""
    out = tmp_path_factory.mktemp("gloo")
    mp.spawn(_gloo_worker, args=(2, free_port(), str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_grad_clip_uses_the_global_norm_across_ranks(gloo_results):
    r0, r1 = (r["clip"] for r in gloo_results)
    assert r0["ddp"] == r1["ddp"]   # every rank logs the same loss and norm
    (single_loss, single_norm), (ddp_loss, ddp_norm) = r0["single"], r0["ddp"]
    assert all(n > 0.05 for n in single_norm), single_norm   # the clip was active
    assert max(abs(a - b) / a for a, b in zip(single_norm, ddp_norm)) < 1e-4, (single_norm, ddp_norm)
    assert max(abs(a - b) for a, b in zip(single_loss, ddp_loss)) <= LOSS_TOL, (single_loss, ddp_loss)


def test_loss_equivalence_fsdp_and_sharded_resume(gloo_results):
    r0, r1 = (r["equivalence"] for r in gloo_results)
    assert r0["ddp"] == r1["ddp"] and r0["fsdp"] == r1["fsdp"]  # the logged loss is the all-rank mean
    diff = max(abs(a - b) for a, b in zip(r0["single"], r0["ddp"]))
    print(f"max |loss(1 rank x accum 4) - loss(2 ranks x accum 2)| = {diff:.3g}", r0["single"])
    assert diff <= LOSS_TOL, (r0["single"], r0["ddp"])
    print(f"max ||w(1 rank) - w(2 ranks)|| / ||w|| after {STEPS} steps = {r0['weight_diff']:.3g}")
    assert r0["weight_diff"] <= WEIGHT_TOL
    assert r0["single"][-1] < r0["single"][0]  # it trains
    # FSDP2 + Muon on DTensors: equal up to fp32 summation order. FSDP2 reduce-scatters each
    # micro-batch's gradient ((g1a + g1b) + (g2a + g2b)); the sharded optimizer sums the micro-batches
    # locally first ((g1a + g2a) + (g1b + g2b)). Step 0 is exact; later steps may differ in the last bits.
    assert r0["fsdp"][0] == r0["ddp"][0]
    assert max(abs(a - b) for a, b in zip(r0["fsdp"], r0["ddp"])) <= 1e-5, (r0["fsdp"], r0["ddp"])
    assert r0["full_weights"]
    assert r0["resumed"] == r0["continued"] and r1["resumed"] == r1["continued"]
    assert "fsdp=True" in r0["refused"] and "--fsdp" in r0["refused"]


def test_barrier_timeout_names_missing_rank_and_bandwidth(gloo_results):
    r0, r1 = (r["barrier"] for r in gloo_results)
    assert "rank(s) [1] of 2 did not arrive within 1s" in r0["late"] and "compil" in r0["late"]
    assert r1["late"] == "passed"
    assert all(b > 0 for b in r0["busbw"]) and r0["ratio"] == pytest.approx([1.0, 1.0])  # 2(n-1)/n at n=2


def test_timed_barrier_and_strided_batches_single_process():
    from nanochat.distributed import StridedMicroBatches, bus_bandwidth, timed_barrier
    assert timed_barrier(1.0) == 0.0  # no process group: no-op
    with pytest.raises(ValueError, match="timed_barrier timeout_s: got 0"):
        timed_barrier(0)
    stream = list(range(12))
    assert list(StridedMicroBatches(stream, 1, 3)) == [1, 4, 7, 10]
    assert sorted(list(StridedMicroBatches(stream, 0, 2)) + list(StridedMicroBatches(stream, 1, 2))) == stream
    with pytest.raises(ValueError, match="rank"):
        StridedMicroBatches(stream, 2, 2)
    assert bus_bandwidth(10.0, 8) == pytest.approx(17.5) and bus_bandwidth(10.0, 1) == 0.0


def test_warm_up_ranks_leaves_no_trace():
    """The compile warm-up runs a real forward+backward but changes no weight, leaves no gradient
    and draws no random numbers (exact resume depends on all three)."""
    from nanochat.distributed import warm_up_ranks
    from nanochat.gpt import GPT, config_for_depth
    torch.manual_seed(0)
    model = GPT(config_for_depth(1, 97, 16, aspect_ratio=32, head_dim=16))
    model.init_weights()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    calls = []
    def counting(idx, targets):
        calls.append(idx.shape)
        return model(idx, targets)
    counting.parameters = model.parameters
    took = warm_up_ranks(counting, 2, 16, 97, "cpu")
    assert calls == [(2, 16)] and took >= 0
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())


def test_warm_up_ranks_compiles_the_loops_graphs():
    """The warm-up ran the step's forward outside the Trainer's step context (whose once-per-step weight
    casts change the traced graph) and never the evaluation's no-grad eval-mode forward: both came
    first inside collectives of the loop. Now: the step inside `around()`, then the eval forward."""
    import contextlib

    from nanochat.distributed import warm_up_ranks
    from nanochat.gpt import GPT, config_for_depth
    torch.manual_seed(0)
    model = GPT(config_for_depth(1, 97, 16, aspect_ratio=32, head_dim=16))
    model.init_weights()
    seen, inside = [], []
    real_forward = model.forward

    def forward(idx, targets, loss_reduction="mean"):
        seen.append((loss_reduction, model.training, torch.is_grad_enabled(), bool(inside)))
        return real_forward(idx, targets, loss_reduction=loss_reduction)
    model.forward = forward

    @contextlib.contextmanager
    def around():
        inside.append(1)
        yield
        inside.clear()
    warm_up_ranks(model, 2, 16, 97, "cpu", loss_reduction="sum", around=around, evaluates=True)
    assert seen == [("sum", True, True, True), ("none", False, False, False)], seen
    assert model.training and all(p.grad is None for p in model.parameters())


def test_data_sharding_has_no_overlap(tiny_corpus):
    """Documents (identified by their (shard, row group, row) cursor) are dealt to exactly one rank,
    and a rank's packed batches differ from the other rank's."""
    from nanochat.dataset import iter_documents
    everything = {c for _, c in iter_documents(tiny_corpus, "train")}
    shards = [{c for _, c in iter_documents(tiny_corpus, "train", rank=r, world_size=2)} for r in (0, 1)]
    assert shards[0].isdisjoint(shards[1]) and shards[0] | shards[1] == everything
    assert abs(len(shards[0]) - len(shards[1])) <= len({(s, g) for s, g, _ in everything})


def test_optimizer_refuses_other_world_size():
    from nanochat.optim import build_optimizer
    model = _tiny_model()
    opt = build_optimizer(model)
    state = opt.state_dict()
    assert state["layout"] == {"world_size": 1, "fsdp": False}
    opt.load_state_dict(copy.deepcopy(state))  # same layout: fine
    state["layout"] = {"world_size": 2, "fsdp": False}
    with pytest.raises(ValueError, match="world_size=2.*--nproc_per_node"):
        opt.load_state_dict(state)


# ------------------------------------------------------------------ NCCL env checks + launcher

def _fake_sysfs(root: Path, mtu: int = 9000) -> Path:
    pairs = {"rocep1s0f1": "enp1s0f1np1", "roceP2p1s0f1": "enP2p1s0f1np1", "rocep1s0f0": "enp1s0f0np0"}
    for hca, nd in pairs.items():
        (root / "sys/class/infiniband" / hca / "device/net" / nd).mkdir(parents=True)
        (root / "sys/class/net" / nd).mkdir(parents=True)
        (root / "sys/class/net" / nd / "mtu").write_text(f"{mtu}\n")
        (root / "sys/class/net" / nd / "operstate").write_text("down\n" if nd == "enp1s0f0np0" else "up\n")
    (root / "sys/class/net/lo").mkdir()
    return root


def test_check_nccl_env(tmp_path):
    from nanochat.distributed import check_nccl_env, nccl_env_defaults
    root = _fake_sysfs(tmp_path, mtu=1500)
    env = {"NCCL_SOCKET_IFNAME": "enp1s0f1np1", "NCCL_IB_HCA": "rocep1s0f1:1,roceP2p1s0f1:1"}
    warnings = check_nccl_env(env, sys_root=root, multi_node=True)
    assert any("MTU 1500 < 9000" in w for w in warnings) and not any("HCA" in w for w in warnings)
    assert any("two halves" in w for w in check_nccl_env({**env, "NCCL_IB_HCA": "=rocep1s0f1"}, sys_root=root,
                                                         multi_node=True))
    assert check_nccl_env({"NCCL_SOCKET_IFNAME": "^docker,lo"}, sys_root=root, multi_node=False) == []
    with pytest.raises(ValueError, match="NCCL_SOCKET_IFNAME=eth9.*enp1s0f1np1"):
        check_nccl_env({"NCCL_SOCKET_IFNAME": "eth9"}, sys_root=root)
    with pytest.raises(ValueError, match="NCCL_IB_HCA=mlx5_0"):
        check_nccl_env({"NCCL_IB_HCA": "mlx5_0"}, sys_root=root)
    with pytest.raises(ValueError, match="NVLink multicast must stay off"):
        check_nccl_env({"NCCL_NVLS_ENABLE": "1"}, sys_root=root)
    assert any("NCCL_IB_HCA unset" in w for w in check_nccl_env({}, sys_root=root, multi_node=True))
    env2 = {}
    assert nccl_env_defaults(env2) == ["NCCL_NVLS_ENABLE=0"] and env2 == {"NCCL_NVLS_ENABLE": "0"}
    assert nccl_env_defaults({"NCCL_NVLS_ENABLE": "0"}) == []


def _launch(args, root: Path, ibdev: str = "/nonexistent", python: str | None = "python3", cwd: Path = REPO):
    env = {**os.environ, "NANOCHAT_SYSFS_ROOT": str(root), "IBDEV2NETDEV": ibdev}
    for var in ("PYTHONPATH", "NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"):   # the last two stand for --hca / --iface
        env.pop(var, None)
    if python is not None:
        env["PYTHON"] = python
    else:
        env.pop("PYTHON", None)
    return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def test_launch_multinode_dry_run(tmp_path):
    root = _fake_sysfs(tmp_path / "fs", mtu=1500)
    r = _launch(["--node-rank", "1", "--master-addr", "10.0.0.1", "--iface", "enp1s0f1np1", "--dry-run",
                 "--", "-m", "scripts.base_train", "--depth", "20"], root)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "export NCCL_SOCKET_IFNAME=enp1s0f1np1" in lines and "export NCCL_NVLS_ENABLE=0" in lines
    assert "export NCCL_IB_HCA=roceP2p1s0f1,rocep1s0f1" in lines  # both halves; the down port left out
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=3600" in lines   # the stop's save outlasts torchrun's 30 s
    assert lines[-1].split() == ["python3", "-m", "torch.distributed.run", "--nnodes=2", "--node_rank=1",
                                 "--nproc_per_node=1", "--master_addr=10.0.0.1", "--master_port=29500",
                                 "-m", "scripts.base_train", "--depth", "20"]
    assert "MTU 1500 < 9000" in r.stderr
    # an explicit --hca naming this node's HCAs (ports, prefixes, '^' exclusions) goes through as given
    for hca in ("rocep1s0f1:1,roceP2p1s0f1:1", "rocep1", "^mlx5_9"):
        r = _launch(["--node-rank", "0", "--master-addr", "h", "--iface", "enp1s0f1np1", "--hca", hca, "--dry-run"], root)
        assert r.returncode == 0 and f"export NCCL_IB_HCA={hca}" in r.stdout.splitlines(), r.stderr
    # ibdev2netdev path (a fake tool), auto-detected interface, no MTU warning at 9000
    tool = tmp_path / "ibdev2netdev"
    tool.write_text("#!/bin/sh\necho 'rocep1s0f1 port 1 ==> enp1s0f1np1 (Up)'\n"
                    "echo 'roceP2p1s0f1 port 1 ==> enP2p1s0f1np1 (Up)'\n")
    tool.chmod(0o755)
    root9 = _fake_sysfs(tmp_path / "fs9", mtu=9000)
    r = _launch(["--node-rank", "0", "--master-addr", "10.0.0.1", "--nproc", "2", "--dry-run"], root9, str(tool))
    assert r.returncode == 0 and "MTU" not in r.stderr, r.stderr
    assert "export NCCL_IB_HCA=" in r.stdout and "--nproc_per_node=2" in r.stdout and "scripts.base_train" in r.stdout
    # from another directory, --flag=value spellings: the repo's venv and the repo on the import path
    r = _launch(["--node-rank=0", "--master-addr=10.0.0.1", "--iface=enp1s0f1np1", "--dry-run"], root9,
                python=None, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"export PYTHONPATH={REPO}" in r.stdout.splitlines()
    venv = REPO / ".venv" / "bin" / "python"
    assert r.stdout.splitlines()[-1].split()[0] == (str(venv) if venv.exists() else "python3")


@pytest.mark.parametrize("args, message", [
    (["--master-addr", "h"], "--node-rank: required"),
    (["--node-rank", "2", "--master-addr", "h"], "--node-rank: got '2'"),
    (["--node-rank", "0"], "--master-addr: required"),
    (["--node-rank", "0", "--master-addr", "h", "--master-port", "70000"], "--master-port"),
    (["--node-rank", "0", "--master-addr", "h", "--nproc", "0"], "--nproc"),
    (["--node-rank", "0", "--master-addr", "h", "--iface", "eth9"], "--iface: 'eth9' does not exist"),
    (["--bogus"], "unknown option '--bogus'"),
    (["--node-rank", "0", "--master-addr", "h", "--iface", "enp1s0f1np1", "--hca", "rocep1s0f1,mlx5_0"],
     "--hca: 'mlx5_0' names no HCA on this node; available: roceP2p1s0f1 rocep1s0f0 rocep1s0f1"),
    (["--node-rank", "0", "--master-addr", "h", "--iface", "enp1s0f1np1", "--hca", "=rocep1"],
     "--hca: 'rocep1' names no HCA"),   # '=': exact names, not prefixes
])
def test_launch_multinode_argument_errors(tmp_path, args, message):
    r = _launch([*args, "--dry-run"], _fake_sysfs(tmp_path))
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_torchrun_stop_grace(monkeypatch):
    """How long torchrun lets a stop run before SIGKILL: its flag (seen in the parent's command
    line) before the environment before its 30 s default; None outside torchrun."""
    from torch.distributed.launcher import api as launcher_api

    from nanochat.distributed import torchrun_stop_grace
    run = {"TORCHELASTIC_RUN_ID": "x"}
    argv = ["python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "scripts.base_train"]
    assert torchrun_stop_grace({}, argv) is None

    @dataclasses.dataclass
    class NewLaunchConfig:        # torch >= the one with --shutdown-timeout (pytorch#172596)
        shutdown_timeout: int | None = None
    monkeypatch.setattr(launcher_api, "LaunchConfig", NewLaunchConfig)
    assert torchrun_stop_grace(run, argv) == (30, "torchrun's default")
    assert torchrun_stop_grace({**run, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900"}, argv) == \
        (900, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
    assert torchrun_stop_grace({**run, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, argv) == (30, "torchrun's default")
    for flag in (["--shutdown-timeout", "120"], ["--shutdown_timeout=120"]):
        assert torchrun_stop_grace({**run, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900"}, argv[:3] + flag + argv[3:]) == \
            (120, "torchrun --shutdown-timeout")

    @dataclasses.dataclass
    class OldLaunchConfig:        # a torch whose torchrun has no shutdown timeout
        min_nodes: int = 1
    monkeypatch.setattr(launcher_api, "LaunchConfig", OldLaunchConfig)
    seconds, source = torchrun_stop_grace({**run, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900"}, argv)
    assert seconds == 30 and source.startswith("fixed in torch")


# ------------------------------------------------------------------ CLIs under torchrun / spawn

def test_selftest_refuses_nvls(monkeypatch, capsys):
    from nanochat.distributed import selftest_main
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    assert selftest_main() == 2 and "NVLink multicast must stay off" in capsys.readouterr().err


def test_platform_nccl_selftest_cli():
    r = subprocess.run([sys.executable, "-m", "nanochat.platform", "--nccl", "--json"], capture_output=True,
                       text=True, cwd=REPO, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["backend"] == "gloo" and report["world_size"] == 2 and report["launcher"] == "spawn"
    assert all(row["busbw_gbs"] > 0 for row in report["allreduce"])


# Runs base_train once per command line (argv split at "--then") in ONE torchrun launch: every run
# but the last keeps the process group for the next (a second init_process_group under torchrun's
# agent store hangs), and each run's init_runtime reseeds, so a run starts as in a fresh launch.
# Each run's losses go to losses<run>_<rank>.json.
RUNNER = """import json, os, sys
from scripts import base_train
out, argv = sys.argv[1], sys.argv[2:]
runs = [[]]
for a in argv:
    runs.append([]) if a == "--then" else runs[-1].append(a)
destroy = base_train.destroy_runtime
for i, args in enumerate(runs):
    base_train.destroy_runtime = destroy if i == len(runs) - 1 else (lambda rt: None)
    summary = base_train.main(args)
    with open(os.path.join(out, f"losses{i}_{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({str(k): v for k, v in summary["losses"].items()}, f)
"""


# base_dir: tests/conftest.py's (a fresh dir per module holding the session's tiny tokenizer)


def _base_train_args(corpus: Path) -> list[str]:
    return ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
            "--device-batch-size", "8", "--total-batch-size", "2048", "--window-pattern", "SL", "--sample-every",
            "-1", "--eval-every", "-1", "--eval-tokens", "4096", "--no-compile", "--num-iterations", "4",
            "--save-every", "2", "--model-tag", "ddp", "--data-dir", str(corpus), "--wandb", "off"]


def _torchrun(out: Path, runs: list[list[str]], base_dir: Path, nproc: int = 2):
    """One torchrun launch of RUNNER doing `runs` in turn; returns each run's per-rank losses and the log."""
    runner = out / "runner.py"
    runner.write_text(RUNNER)
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE"):
        env.pop(var, None)
    argv = [a for i, run in enumerate(runs) for a in ([] if i == 0 else ["--then"]) + run]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
           str(free_port()), str(runner), str(out), *argv]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [[json.loads((out / f"losses{i}_{k}.json").read_text()) for k in range(nproc)]
            for i in range(len(runs))], r.stdout


def test_torchrun_base_train_resume_and_world_size_refusal(tmp_path, base_dir, tiny_corpus, monkeypatch):
    """Under torchrun: a 4-step run, then (same launch) the same 2 steps with --fsdp; a second
    launch resumes the first run at step 2 from its sharded checkpoint (a new process: nothing
    but the files carries over); one process refuses that resume."""
    args = _base_train_args(tiny_corpus)
    # --fsdp through the recipe: same losses as the run above, and a full (unsharded) model.pt
    fsdp_args = args[:args.index("--num-iterations")] + ["--num-iterations", "2", "--model-tag", "fsdp", "--fsdp",
                                                         "--data-dir", str(tiny_corpus), "--wandb", "off"]
    (tmp_path / "a").mkdir()
    ((full0, full1), (f0, _)), log = _torchrun(tmp_path / "a", [args, fsdp_args], base_dir)
    assert full0 == full1 and sorted(full0) == ["0", "1", "2", "3"]
    assert "2 rank(s) x 2 micro-batch(es)" in log  # accumulation halves with two ranks (1 rank: 4)
    step_dir = base_dir / "checkpoints" / "base" / "ddp" / "step_000002"
    assert {"optim_rank0.pt", "optim_rank1.pt", "state_rank0.pt", "state_rank1.pt"} <= {p.name for p in step_dir.iterdir()}
    assert sorted(f0) == ["0", "1"] and max(abs(f0[k] - full0[k]) for k in f0) <= LOSS_TOL, (f0, full0)
    ck_root = base_dir / "checkpoints" / "base"
    plain = torch.load(ck_root / "ddp" / "step_000002" / "model.pt", weights_only=True)
    sharded = torch.load(ck_root / "fsdp" / "step_000002" / "model.pt", weights_only=True)
    assert {k: v.shape for k, v in plain.items()} == {k: v.shape for k, v in sharded.items()}
    (tmp_path / "b").mkdir()
    (((res0, _),), _) = _torchrun(tmp_path / "b", [args + ["--resume", "2"]], base_dir)
    assert res0 == {"2": full0["2"], "3": full0["3"]}  # exact continuation of the sharded state
    # a different world size is refused before anything is built
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    from scripts import base_train
    with pytest.raises(ValueError, match="world size \\(torchrun processes\\) 2 but this run has 1"):
        base_train.main(args + ["--resume", "2"])


def test_torchrun_chat_sft_two_ranks(tmp_path, base_dir, tiny_corpus, monkeypatch, capsys):
    """The chat recipes run on the same distributed stack: a 1-process base checkpoint, then SFT
    under torchrun with 2 ranks (batch split across ranks, one checkpoint, --run-name accepted).

    And setup.sh reruns mid_train / chat_sft with --resume auto: the SFT checkpoint a 1-process run
    left (one optimizer shard) cannot be continued by 2 processes, so every rank starts fresh, as
    for any checkpoint --resume auto cannot continue. Before the fix, rank 1 failed alone in
    load_checkpoint ("saved by 1 rank(s) but loading as rank 1") while rank 0 started fresh.
    (Was tests/test_multiprocess.py's own torchrun launch; one launch now checks both.)"""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    from scripts import base_train, chat_sft
    args = _base_train_args(tiny_corpus)
    args[args.index("--model-tag") + 1] = "sftsrc"
    args[args.index("--num-iterations") + 1] = "2"
    base_train.main(args)
    sft = ["--source", "base", "--model-tag", "sftsrc", "--device", "cpu", "--device-batch-size", "2",
           "--max-seq-len", "64", "--test-holdout", "100", "--no-compile", "--eval-every", "-1", "--wandb", "off",
           "--resume", "auto"]
    chat_sft.main(sft + ["--num-iterations", "1"])   # one process: the step's 16 micro-batches on one rank
    from nanochat import writer_lock
    writer_lock.release_all()   # that run is over: its process's exit would drop the tag's writer lock
    capsys.readouterr()
    ckpt = base_dir / "checkpoints" / "sft" / "sftsrc"
    assert json.loads((ckpt / "step_000001" / "meta.json").read_text())["world_size"] == 1
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(free_port()),
           "-m", "scripts.chat_sft", *sft, "--num-iterations", "2", "--run-name", "dummy"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "cannot be continued" in out and "starting fresh" in out, out[-3000:]
    assert "step 00000/00002" in out and "step 00001/00002 | loss" in out   # from step 0, not resumed at 1
    assert "2 rank(s)" in out
    # the default step is SFT's 32 rows on any number of ranks: 2 rows x 2 ranks x 8 micro-batches
    assert "2,048 tokens/step = 2 seqs x 64 tokens x 2 rank(s) x 8 micro-batch(es)" in out
    assert (ckpt / "step_000002" / "model.pt").is_file()
    assert json.loads((ckpt / "step_000002" / "meta.json").read_text())["world_size"] == 2


def test_fsdp_flag_validation(monkeypatch):
    from scripts.base_train import parse_config
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="--fsdp"):
        parse_config(["--fsdp", "--device", "cpu"])
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="--sample-every"):
        parse_config(["--fsdp", "--device", "cpu"])
    assert parse_config(["--fsdp", "--device", "cpu", "--sample-every", "-1"]).fsdp
    assert parse_config(["--device", "cpu"]).fsdp is False


def test_bench_scaling_worker_and_flags(monkeypatch):
    """The worker in one process (world 1: accumulation = gpus x loss-accum), the synthetic stream's
    determinism, and flag errors. The torchrun driver itself is a GPU-box benchmark (see README)."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    from nanochat.common import init_runtime
    from scripts.bench_scaling import SyntheticStream, parse_args, run_worker
    a = parse_args(["--worker", "losses", "--device", "cpu", "--loss-depth", "1", "--seq", "32", "--steps", "2",
                    "--loss-device-batch-size", "2", "--vocab-size", "256", "--no-compile", "--gpus", "2"])
    row = run_worker(a, init_runtime("cpu", "fp32", seed=0))
    assert row["grad_accum_steps"] == 4 and len(row["losses"]) == 2 and row["tok_per_sec"] > 0
    s1, s2 = SyntheticStream(2, 16, 256, "cpu"), SyntheticStream(2, 16, 256, "cpu")
    x1, y1 = next(s1)
    assert torch.equal(x1, next(s2)[0]) and torch.equal(x1[:, 1:], y1[:, :-1])
    for argv, flag in [(["--gpus", "1"], "--gpus"), (["--parts", "speed"], "--parts"), (["--data", "x"], "--data")]:
        with pytest.raises(ValueError, match=flag):
            parse_args(argv)
