"""Training mechanics on a toy model: batch arithmetic, schedules, the step (accumulation,
token weighting, prefetch/loader state), NaN guard, meter + log line, flags, bpb, RNG state."""

import math
import random
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanochat.common import init_runtime
from nanochat.errors import RequestError
from nanochat import training as tr

V, T = 11, 8


class ToyLM(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, 16)
        self.head = nn.Linear(16, V)
        self.poison_at_call = None
        self.calls = 0

    def forward(self, x, y=None, loss_reduction="mean"):
        self.calls += 1
        logits = self.head(self.emb(x)).float()
        if self.poison_at_call is not None and self.calls >= self.poison_at_call:
            logits = logits * float("nan")
        if y is None:
            return logits
        return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-1, reduction=loss_reduction)


class ToyLoader:
    """Deterministic infinite batches whose content depends only on the position (resumable)."""

    def __init__(self, batch_size, pos=0, mask_every=0):
        self.batch_size, self.pos, self.mask_every = batch_size, pos, mask_every

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(1000 + self.pos)
        x = torch.randint(0, V, (self.batch_size, T), generator=g)
        y = torch.randint(0, V, (self.batch_size, T), generator=g)
        if self.mask_every:
            y[:, : (self.pos % self.mask_every) + 1] = -1
        self.pos += 1
        return x, y

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, s):
        self.pos = s["pos"]


def _schedule(n=10):
    return tr.Schedule(n, warmdown_ratio=0.5, lr_fn=lambda step, n, **kw: 1.0 - step / (2 * n),
                       momentum_fn=lambda s: 0.9, wd_fn=lambda s, n: 0.5)


def _opt(model, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for g in opt.param_groups:
        g["initial_lr"] = lr
    return opt


@pytest.fixture
def rt():
    return init_runtime("cpu", seed=0)


# ------------------------------------------------------------------ batch arithmetic

def test_plan_batch_and_errors():
    plan = tr.plan_batch(4096, 4, 64, 2)
    assert plan.grad_accum_steps == 8 and plan.world_tokens_per_micro_batch == 512
    assert "4,096 tokens/step" in plan.describe()
    with pytest.raises(ValueError) as e:
        tr.plan_batch(1000, 4, 64, 2)
    msg = str(e.value)
    assert "--total-batch-size" in msg and "1,000" in msg and "4 x 64 x 2 = 512" in msg
    with pytest.raises(ValueError, match="--device-batch-size"):
        tr.plan_batch(512, 0, 64, 1)


def test_auto_total_batch_size_rule():
    assert tr.auto_total_batch_size(100.0, 100.0) == 2**19          # the d12 reference
    # 2x the horizon -> 2**0.383 = 1.30x the batch -> still rounds to 2**19; 8x -> 2.2x -> 2**20
    assert tr.auto_total_batch_size(200.0, 100.0) == 2**19
    assert tr.auto_total_batch_size(800.0, 100.0) == 2**20
    assert tr.auto_total_batch_size(1.0, 1e6) == 2**11             # tiny models, tiny batches
    assert tr.fit_auto_batch(2**11, 4, 64, 3) == 2304               # rounded up to 4*64*3 multiples


# ------------------------------------------------------------------ schedule

def test_schedule_applies_to_groups():
    w1, w2 = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([{"params": [w1], "lr": 0.5, "initial_lr": 0.5, "kind": "muon", "momentum": 0.0,
                            "weight_decay": 0.1, "initial_weight_decay": 0.2},
                           {"params": [w2], "lr": 2.0, "initial_lr": 2.0, "kind": "adamw"}])
    lrm = _schedule(10).apply(opt, 5)
    assert lrm == 0.75
    assert opt.param_groups[0]["lr"] == 0.375 and opt.param_groups[1]["lr"] == 1.5
    assert opt.param_groups[0]["momentum"] == 0.9 and opt.param_groups[0]["weight_decay"] == pytest.approx(0.1)
    assert opt.param_groups[1]["momentum"] == 0  # SGD default untouched: not a Muon group


def test_schedule_defaults_drive_muonadamw():
    from nanochat.optim import build_optimizer, lr_multiplier, muon_momentum, weight_decay_multiplier
    from nanochat.gpt import GPT, config_for_depth
    model = GPT(config_for_depth(1, 64, 16, aspect_ratio=32, head_dim=32))
    model.init_weights()
    opt = build_optimizer(model, weight_decay=0.2)
    sched = tr.Schedule(100, warmup_ratio=0.1, warmdown_ratio=0.5, final_lr_frac=0.1)
    for step in (0, 30, 80):
        lrm = sched.apply(opt, step)
        assert lrm == lr_multiplier(step, 100, warmup_ratio=0.1, warmdown_ratio=0.5, final_lr_frac=0.1)
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(g["initial_lr"] * lrm)
            if g["kind"] == "muon":
                assert g["momentum"] == muon_momentum(step)
                assert g["weight_decay"] == pytest.approx(0.2 * weight_decay_multiplier(step, 100))


def test_schedule_validate():
    with pytest.raises(ValueError, match="--warmdown-ratio"):
        tr.Schedule(10, warmdown_ratio=1.5).validate()
    with pytest.raises(ValueError, match="--num-iterations"):
        tr.Schedule(0).validate()


# ------------------------------------------------------------------ the step

def test_grad_accumulation_matches_one_big_batch(rt):
    """2 micro-batches of 2 = one batch of 4 (same data, same mean loss, same update)."""
    m1, m2 = ToyLM(), ToyLM()
    t1 = tr.Trainer(m1, _opt(m1), ToyLoader(2), tr.plan_batch(2 * 2 * T, 2, T, 1), _schedule(), rt)
    r1 = t1.step(0)
    assert t1.plan.grad_accum_steps == 2

    class Concat(ToyLoader):
        def __next__(self):
            a, b = ToyLoader(2, self.pos), ToyLoader(2, self.pos + 1)
            (xa, ya), (xb, yb) = next(a), next(b)
            self.pos += 2
            return torch.cat([xa, xb]), torch.cat([ya, yb])
    t2 = tr.Trainer(m2, _opt(m2), Concat(4), tr.plan_batch(4 * T, 4, T, 1), _schedule(), rt)
    r2 = t2.step(0)
    assert r1.loss == pytest.approx(r2.loss, rel=1e-6)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2)
        assert p1.grad is None  # zero_grad(set_to_none=True)
    assert r1.tokens == 4 * T and r1.lrm == 1.0 and r1.dt > 0


def test_token_weighted_normalises_by_valid_targets(rt):
    model = ToyLM()
    loader = ToyLoader(2, mask_every=3)
    trainer = tr.Trainer(model, _opt(model), loader, tr.plan_batch(4 * T, 2, T, 1), _schedule(), rt,
                         token_weighted=True)
    batches = [next(ToyLoader(2, 0, mask_every=3)), next(ToyLoader(2, 1, mask_every=3))]
    with torch.no_grad():
        total = sum(ToyLM()(x, y, loss_reduction="sum") for x, y in batches)
        count = sum((y >= 0).sum() for _, y in batches)
    r = trainer.step(0)
    assert r.loss == pytest.approx((total / count).item(), rel=1e-6)


def test_prefetch_keeps_loader_state_exact(rt):
    model = ToyLM()
    loader = ToyLoader(2)
    trainer = tr.Trainer(model, _opt(model), loader, tr.plan_batch(3 * 2 * T, 2, T, 1), _schedule(), rt)
    trainer.step(0)
    assert loader.pos == 4                     # 3 used + 1 prefetched
    assert trainer.loader_state() == {"pos": 3}  # resume point: the first unused batch


def test_nan_guard_names_step_and_checkpoint(rt):
    model = ToyLM()
    trainer = tr.Trainer(model, _opt(model), ToyLoader(2), tr.plan_batch(2 * T, 2, T, 1), _schedule(), rt)
    trainer.step(0)
    trainer.note_checkpoint("/ckpt/base/d2/step_000001")
    trainer.step(1)
    model.poison_at_call = model.calls + 1
    with pytest.raises(tr.NonFiniteLossError) as e:
        trainer.step(2)
    msg = str(e.value)
    assert "non-finite loss (nan) at step 2" in msg and "/ckpt/base/d2/step_000001" in msg and "hint:" in msg
    assert e.value.step == 2 and e.value.last_checkpoint == "/ckpt/base/d2/step_000001"


def test_nan_guard_without_checkpoint_and_grad_norm(rt):
    model = ToyLM()
    model.poison_at_call = 1
    trainer = tr.Trainer(model, _opt(model), ToyLoader(2), tr.plan_batch(2 * T, 2, T, 1), _schedule(), rt,
                         grad_clip=1.0)
    with pytest.raises(tr.NonFiniteLossError, match="gradient norm.*step 0.*no checkpoint was saved") as e:
        trainer.step(0)
    # this run already clipped: the hint says lower it, not "set --grad-clip 1.0"
    assert "lower --grad-clip (this run: 1)" in str(e.value) and "set --grad-clip" not in str(e.value)


def test_nan_hint_without_clipping_suggests_it(rt):
    model = ToyLM()
    trainer = tr.Trainer(model, _opt(model), ToyLoader(2), tr.plan_batch(2 * T, 2, T, 1), _schedule(), rt)
    assert "set --grad-clip 1.0" in trainer.hint and trainer.hint == tr.DEFAULT_HINT


def test_nan_stop_is_one_line_exit_3(capsys):
    """script_main prints a NaN stop as one line (rank 0 only) and exits 3, not a traceback per rank."""
    from nanochat.flags import script_main

    def run():
        raise tr.NonFiniteLossError(7, "loss", float("nan"), "/ckpt/step_000006", "lower the LR")
    with pytest.raises(SystemExit) as e:
        script_main("base_train", lambda: None, run)
    assert e.value.code == 3
    assert capsys.readouterr().err == ("base_train: error: non-finite loss (nan) at step 7; last good checkpoint: "
                                       "/ckpt/step_000006 (resume from it with --resume 6); hint: lower the LR\n")


def test_grad_clip_reports_norm(rt):
    model = ToyLM()
    trainer = tr.Trainer(model, _opt(model), ToyLoader(2), tr.plan_batch(2 * T, 2, T, 1), _schedule(), rt,
                         grad_clip=1e-3)
    r = trainer.step(0)
    assert r.grad_norm is not None and r.grad_norm > 1e-3


# ------------------------------------------------------------------ meter / log line

def test_meter_mfu_and_fixed_log_line():
    meter = tr.StepMeter(1e6, 2, peak_bf16=1e12, peak_active=2e12, precision="fp8", warmup_steps=1,
                         peak_memory=lambda: 3 * 2**30)
    m0 = meter.update(tr.StepResult(0, 4.0, 1.0, 0.5, 1000))
    m1 = meter.update(tr.StepResult(1, 2.0, 0.5, 0.25, 1000))
    assert m0["smooth_loss"] == pytest.approx(4.0)  # debiased EMA
    assert m1["smooth_loss"] == pytest.approx((0.09 * 4 + 0.1 * 2) / 0.19)
    assert m1["tok_per_sec"] == 4000 and m1["mfu"] == pytest.approx(100 * 4e9 / 2e12)
    assert m1["util"] == pytest.approx(m1["mfu"] / 2)
    line = meter.log_line(m1, 100)
    assert line.startswith("step 00001/00100 | loss ") and "| lrm 0.500 |" in line
    assert "tok/s       4,000" in line and "mfu  0.20%" in line and "util(fp8)  0.10%" in line
    assert line.endswith("mem   3.00GiB | eta    25s")  # 98 steps left x its 0.25 s
    assert meter.average_tok_per_sec() == 4000  # step 0 was warm-up
    unknown = tr.StepMeter(1e6, 1, peak_bf16=None)
    l2 = unknown.log_line(unknown.update(tr.StepResult(0, 1.0, 1.0, 1.0, 10)), 5)
    assert "mfu   n/a" in l2 and len(l2.split("|")) == len(line.split("|"))
    restored = tr.StepMeter(1e6, 2, peak_bf16=1e12)
    restored.load_state_dict(meter.state_dict())
    assert restored.state_dict() == meter.state_dict()


def test_log_line_eta_is_wall_time_per_step_since_warm_up(monkeypatch):
    """The ETA counts wall time between steps too (evals, checkpoints): steps of 1 s with 2 s of
    other work after each are 3 s per step; warm-up steps are left out; the last step says 0s."""
    clock = [100.0]
    monkeypatch.setattr(tr.time, "perf_counter", lambda: clock[0])
    meter = tr.StepMeter(1e6, 1, peak_bf16=None, warmup_steps=2)
    lines = []
    for step in range(6):
        clock[0] += 50.0 if step < 2 else 1.0  # warm-up steps are slow (compile)
        lines.append(meter.log_line(meter.update(tr.StepResult(step, 1.0, 1.0, 1.0, 10)), 6))
        clock[0] += 2.0
    assert lines[0].endswith("| eta      -") and lines[1].endswith("| eta ~3m28s")   # rough, marked, from step 2
    assert lines[2].endswith("| eta     3s")  # 1 s for step 2 x 3 steps left (its 2 s of other work come after)
    assert lines[3].endswith("| eta     4s")  # (1 + 2 + 1) s / 2 steps x 2 steps left
    assert lines[4].endswith("| eta     2s")  # 7 s / 3 steps x 1 step left
    assert lines[5].endswith("| eta     0s")
    assert len({len(line.split("|")) for line in lines}) == 1


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (59.4, "59s"), (61, "1m01s"), (3600 * 13 + 5 * 60, "13h05m"),
                                           (86400 * 6 + 3 * 3600 + 1800, "6d03h"), (86400 * 250, "250d")])
def test_format_eta(seconds, text):
    assert tr.format_eta(seconds) == text


def test_unknown_gpu_warns_once_and_cpu_has_no_peak(rt):
    bf16, act, name = tr.resolve_peak_flops(rt, "bf16")
    assert bf16 is None and act is None and name == "CPU"
    assert tr.resolve_peak_flops(rt, "bf16", override=2e12)[0] == 2e12
    for bad in (0.0, -1e12, float("nan")):   # 0 used to become "no peak" and nan passed through
        with pytest.raises(RequestError, match="--peak-flops"):
            tr.resolve_peak_flops(rt, "bf16", override=bad)


def test_peak_flops_override_carries_to_the_active_precision():
    """--peak-flops is the bf16 dense peak; the fp8 / nvfp4 peak (util) used to stay the datasheet's
    on a known GPU (util and MFU then against two bases) and n/a on an unknown one."""
    from nanochat import platform as pf
    h100, gb10 = pf.DEVICE_TABLE["h100-sxm"], pf.DEVICE_TABLE["gb10"]
    unknown = pf.DeviceSpec(name="Some GPU", cc=(9, 0), sms=100, memory_gb=80, bandwidth_gbs=3000)
    assert pf.peaks(h100, "fp8") == (989.4e12, 1978.9e12)
    assert pf.peaks(h100, "fp8", 790e12) == (790e12, pytest.approx(790e12 * 1978.9 / 989.4))
    assert pf.peaks(gb10, "nvfp4", 82e12) == (82e12, pytest.approx(328e12))
    assert pf.peaks(gb10, "nvfp4-emulated", 82e12) == (82e12, 82e12)   # computes in bf16
    assert pf.peaks(unknown, "fp8") == (None, None)
    assert pf.peaks(unknown, "fp8", 500e12) == (500e12, 1000e12)
    assert pf.peaks(unknown, "bf16", 500e12) == (500e12, 500e12)
    with pytest.raises(RequestError, match="--precision: got 'fp6'"):
        pf.peaks(h100, "fp6")


def test_the_banner_names_both_peaks_and_their_source(rt, monkeypatch):
    from nanochat import platform as pf
    monkeypatch.setattr(pf, "detect_device", lambda device: pf.DEVICE_TABLE["gb10"])
    bf16, act = pf.peaks(pf.DEVICE_TABLE["gb10"], "fp8")
    text = tr.describe_peaks(rt, "fp8", bf16, act, None)
    assert text.startswith("bf16 1.2500e+14, fp8 2.5000e+14 (spec-derived (1 PFLOP FP4 sparse / 2, per precision), "
                           "not measured here")
    assert tr.describe_peaks(rt, "fp8", 82e12, 164e12, 82e12) == \
        "bf16 8.2000e+13, fp8 1.6400e+14 (--peak-flops; fp8 = 2x bf16, the dense ratio)"
    assert tr.describe_peaks(rt, "bf16", 82e12, 82e12, 82e12) == "bf16 8.2000e+13 (--peak-flops)"
    assert tr.describe_peaks(rt, "bf16", None, None, None) == "n/a (MFU not computed; --peak-flops)"
    # fp32 on a CPU has no peak of its own (util n/a): no ratio is claimed for it
    assert tr.describe_peaks(rt, "fp32", 1e12, None, 1e12) == "bf16 1.0000e+12 (--peak-flops)"


# ------------------------------------------------------------------ flags, tracker

def test_flag_parser_accepts_underscores_and_raises_valueerror():
    from nanochat.flags import FlagParser
    p = FlagParser(prog="x")
    p.add_argument("--device-batch-size", type=int, default=1)
    p.add_argument("--run", default="dummy")
    a = p.parse_args(["--device_batch_size", "8", "--run=my_run_name"])
    assert a.device_batch_size == 8 and a.run == "my_run_name"
    assert p.parse_args(["--run-name", "d20"]).run == "d20"  # the torchrun-safe spelling
    assert p.parse_args(["--run_name=x"]).run == "x"
    with pytest.raises(ValueError, match="--device-batch-size.*invalid int value"):
        p.parse_args(["--device-batch-size", "eight"])
    with pytest.raises(ValueError, match="unrecognized arguments: --nope"):
        p.parse_args(["--nope", "1"])
    with pytest.raises(ValueError):  # no silent abbreviations
        p.parse_args(["--device-batch", "2"])


def test_wandb_modes_and_off_tracker_imports_nothing():
    from nanochat import tracker as tk
    assert tk.resolve_wandb_mode(None, "dummy") == "off"
    assert tk.resolve_wandb_mode(None, "myrun") == "offline"
    assert tk.resolve_wandb_mode("online", "dummy") == "online"
    with pytest.raises(ValueError, match="--wandb.*off\\|offline\\|online"):
        tk.resolve_wandb_mode("yes", "x")
    t = tk.Tracker("off", run="x")
    t.log({"a": 1}, 0)
    t.finish()
    assert not t.enabled and "wandb" not in sys.modules


# ------------------------------------------------------------------ eval, RNG

def test_evaluate_bpb_matches_hand_computation():
    from nanochat.eval_bpb import evaluate_bpb
    class Uniform(nn.Module):
        def forward(self, x, y, loss_reduction="mean"):
            logits = torch.zeros(*x.shape, V)
            return F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-1, reduction=loss_reduction)
    token_bytes = torch.tensor([0] + [2] * (V - 1), dtype=torch.int32)   # token 0 is "special"
    x = torch.zeros(1, 4, dtype=torch.long)
    y = torch.tensor([[0, 3, 5, -1]])
    bpb = evaluate_bpb(Uniform(), [(x, y)], 5, token_bytes)
    # two text targets, 2 bytes each, ln(V) nats each
    assert bpb == pytest.approx(2 * math.log(V) / (math.log(2) * 4))
    with pytest.raises(ValueError, match="no text bytes"):
        evaluate_bpb(Uniform(), [(x, torch.tensor([[0, 0, -1, -1]]))], 1, token_bytes)


def test_rng_state_round_trip(tmp_path):
    import numpy as np
    state = tr.capture_rng_state()
    path = tmp_path / "rng.pt"
    torch.save(state, path)
    a = (torch.rand(3), random.random(), np.random.rand())
    tr.restore_rng_state(torch.load(path, weights_only=True))
    b = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]
