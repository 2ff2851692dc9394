"""RL's loss at a temperature other than 1 (nanochat/rl.py policy_gradient_loss, GPT.forward's
`temperature`, every kernels.py backend). The loss is the cross-entropy of softmax(softcap(logits) / T),
what the sampler draws from. It used to be computed from model(inputs).float(): (B, T, V) float32
logits, several copies of them held for backward (gigabytes per micro-batch at a real vocabulary),
where temperature 1 ran the model's own fused loss. Now every backend takes T in its own pass:
checked against a float64 reference (loss and gradients) for each backend that runs on CPU (the
Triton kernels themselves under TRITON_INTERPRET=1), and the memory the tempered path holds is
measured op by op against temperature 1's. A bad temperature is refused by name before the forward."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanochat import kernels, rl
from nanochat.gpt import GPT
from nanochat.kernels import build_loss_fn, cross_entropy_loss, current_loss, triton_loss
from tests.test_gpt import randomize, tiny_config

BACKENDS = {   # the fn GPT.set_loss_fn installs for each --kernel that runs on CPU
    "default": cross_entropy_loss,                                   # the model's own loss
    "current": current_loss,                                         # the plain reference chain
    "triton": lambda *a, **k: triton_loss(*a, chunk_rows=7, **k),    # the chunked fused loss (torch rows on CPU)
}


def reference(hidden, weight, targets, softcap, vocab, reduction, temperature):
    """float64: logits, softcap, / temperature, F.cross_entropy (the sampler's distribution)."""
    z = (hidden.double() @ weight.double()[:vocab].t())
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return F.cross_entropy(z / temperature, targets, ignore_index=-1, reduction=reduction)


def loss_and_grads(fn, hidden, weight, targets, upstream, *args, **kw):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(h, w, targets, *args, **kw)
    return [t.double() for t in (loss.detach(), *torch.autograd.grad(loss, (h, w), upstream.to(loss.dtype)))]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("softcap", [0.0, 15.0, 2.0])
def test_every_backend_is_the_tempered_cross_entropy(backend, softcap):
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(29, 16, generator=g), torch.randn(64, 16, generator=g)   # 14 padding rows
    targets = torch.randint(0, 50, (29,), generator=g)
    targets[::4] = -1
    for temperature in (0.35, 1.0, 2.5, 1e-3, 1e4):
        for reduction in ("mean", "sum", "none"):
            up = torch.randn(29, generator=g) if reduction == "none" else torch.tensor(1.3)
            want = loss_and_grads(reference, hidden, weight, targets, up.double(), softcap, 50, reduction, temperature)
            got = loss_and_grads(BACKENDS[backend], hidden, weight, targets, up, softcap, 50, reduction,
                                 temperature=temperature)
            # float32 arithmetic against float64: z = softcap(x) / T carries float32's relative
            # error times |z|, so below T = 1 the tolerance widens with 1 / T
            tol = 2e-5 * max(1.0, 1.0 / temperature)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())),
                                           msg=lambda m, T=temperature, r=reduction: f"T={T} {r}: {m}")
            assert got[2][50:].abs().max() == 0   # padding rows of the head: no gradient


def test_liger_gets_the_hidden_states_and_softcap_over_the_temperature(tmp_path, monkeypatch):
    """Liger has no temperature: its wrapper hands it hidden / T and softcap c / T (softcap_c(x) / T
    == softcap_{c/T}(x / T)). Checked through a stand-in liger_kernel computing the plain
    softcapped cross-entropy (tests/test_kernels.py's: the real one needs CUDA; the GPU test
    below runs it)."""
    from tests.test_kernels import _fake_liger
    _fake_liger(tmp_path, monkeypatch)
    fn = kernels.make_liger_loss()
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(19, 8, generator=g, dtype=torch.float64), torch.randn(40, 8, generator=g)
    targets = torch.randint(0, 37, (19,), generator=g)
    targets[::3] = -1
    weight = weight.double()
    for softcap, temperature, reduction in ((15.0, 0.4, "mean"), (2.0, 3.0, "none"), (0.0, 0.7, "sum")):
        up = torch.randn(19, generator=g, dtype=torch.float64) if reduction == "none" else torch.tensor(0.9).double()
        want = loss_and_grads(reference, hidden, weight, targets, up, softcap, 37, reduction, temperature)
        got = loss_and_grads(fn, hidden, weight, targets, up, softcap, 37, reduction, temperature=temperature)
        for a, b in zip(got, want):   # the stand-in's cross-entropy runs in float32
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.abs().max())))


def test_the_loss_backends_refuse_a_bad_temperature_by_name():
    h, w, t = torch.randn(3, 4), torch.randn(8, 4), torch.zeros(3, dtype=torch.long)
    for fn in BACKENDS.values():
        for bad in (0.0, -1.0, math.inf, math.nan, True, "0.5"):
            with pytest.raises(ValueError, match=r"^loss temperature: got .*; accepted: a finite number > 0$"):
                fn(h, w, t, 15.0, 8, "mean", temperature=bad)


# Triton kernels themselves (TRITON_INTERPRET=1, one subprocess): softcap 3 at T 0.6 takes the
# fixed-shift logsumexp (|z| <= 3 / 0.6), at T 0.05 the online one (3 / 0.05 = 60 > 40)
TRITON_SCRIPT = """
import torch, torch.nn.functional as F
from nanochat.kernels import _use_triton, triton_loss
torch.manual_seed(0)
h = torch.randn(12, 8, requires_grad=True); w = torch.randn(40, 8, requires_grad=True)
t = torch.randint(0, 37, (12,)); t[::3] = -1
assert _use_triton(h)
for red, cap, T in (("mean", 3.0, 0.6), ("none", 3.0, 0.05), ("sum", 0.0, 2.0)):
    up = torch.randn(12) if red == "none" else torch.tensor(0.7)
    l = triton_loss(h, w, t, cap, 37, red, chunk_rows=5, temperature=T)
    gh, gw = torch.autograd.grad(l, (h, w), up)
    z = (h @ w[:37].t()).double()
    z = cap * torch.tanh(z / cap) if cap else z
    r = F.cross_entropy(z / T, t, ignore_index=-1, reduction=red)
    rh, rw = torch.autograd.grad(r, (h, w), up.double())
    for a, b in ((l, r), (gh, rh), (gw, rw)):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4 * max(1.0, float(b.abs().max())))
print("OK")
"""


def test_the_triton_kernels_take_the_temperature(run_triton_interpreted):
    run_triton_interpreted(TRITON_SCRIPT)


# ------------------------------------------------------------------------------------ GPT.forward

def _model(vocab=100, n_embd=32, n_layer=2, seed=0):
    torch.manual_seed(seed)
    model = GPT(tiny_config(vocab_size=vocab, n_embd=n_embd, n_layer=n_layer, n_head=2, n_kv_head=1),
                compute_dtype=torch.float32)
    model.init_weights()
    return randomize(model)


def _model_and_batch(backend: str, *, seed: int, shape: tuple[int, int]):
    """A tiny model on `backend`'s loss (default, or the Triton one's CPU path) and random (inputs,
    targets) of `shape`."""
    model = _model()
    model.set_loss_fn(None if backend == "default" else build_loss_fn("triton", "cpu", chunk_rows=16))
    g = torch.Generator().manual_seed(seed)
    return model, torch.randint(0, 100, shape, generator=g), torch.randint(0, 100, shape, generator=g)


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_gpt_forward_takes_the_temperature_in_its_loss(backend):
    model, idx, targets = _model_and_batch(backend, seed=3, shape=(2, 20))
    targets[0, ::3] = -1
    got = model(idx, targets, loss_reduction="none", temperature=0.4)
    want = F.cross_entropy(model(idx).double().flatten(0, 1) / 0.4, targets.flatten(), ignore_index=-1,
                           reduction="none").view(2, 20)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # temperature 1 is the untempered loss, and a forward without the keyword the same
    torch.testing.assert_close(model(idx, targets, temperature=1.0), model(idx, targets), rtol=0, atol=0)


def test_gpt_forward_refuses_a_temperature_it_cannot_apply():
    model = _model()
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature: accepted only with targets"):
        model(idx, temperature=0.5)   # logits come untempered: a silently ignored T would mislead
    with pytest.raises(ValueError, match="^loss temperature: got 0"):
        model(idx, idx, temperature=0.0)

    def six_arguments(hidden, weight, targets, softcap, vocab_size, reduction):   # the older contract
        return hidden.sum() * 0
    model.set_loss_fn(six_arguments)
    assert float(model(idx, idx).detach()) == 0.0   # still serves every untempered forward
    with pytest.raises(ValueError, match="a loss fn that takes `temperature`"):
        model(idx, idx, temperature=0.5)


# ------------------------------------------------------------------------------------ policy_gradient_loss

class _NoForward(torch.nn.Module):
    def forward(self, *args, **kwargs):
        raise AssertionError("the forward ran before the temperature was checked")


@pytest.mark.parametrize("bad", [0.0, 1e-6, -0.5, math.nan, math.inf, -math.inf, True, "0.7", None])
def test_policy_gradient_loss_checks_the_temperature_before_the_forward(bad):
    x = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^temperature: got .*; accepted: a finite number >= 1e-05$"):
        rl.policy_gradient_loss(_NoForward(), x, x, torch.ones(1), bad)


@pytest.mark.parametrize("value", [1e-5, 0.5, 1, 2.0, 1e40, 0.0, 9e-6, -1.0, math.nan, math.inf, True])
def test_the_loss_accepts_what_the_trainer_and_chat_rl_accept(value):
    """One accepted set: chat_rl's --temperature check, the trainer's and policy_gradient_loss's
    (the trainer used to take True, which chat_rl refuses)."""
    from scripts.chat_rl import ChatRLConfig

    def accepted(check) -> bool:
        try:
            check()
        except ValueError:
            return False
        return True
    flag = accepted(lambda: ChatRLConfig(temperature=value).validate())
    assert accepted(lambda: rl.check_temperature(value)) == flag
    x = torch.zeros(1, 3, dtype=torch.long)
    model = _model()
    assert accepted(lambda: rl.policy_gradient_loss(model, x, x, torch.ones(1), value)) == flag


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_policy_gradient_loss_is_the_tempered_objective(backend):
    """-sum advantage x log softmax(logits / T)[sampled token], and its gradients, against float64."""
    model, inputs, targets = _model_and_batch(backend, seed=1, shape=(3, 12))
    targets[:, :4] = -1   # the prompt
    targets[2, 9:] = -1   # padding
    adv = torch.tensor([0.5, -1.0, 0.25])
    loss, count = rl.policy_gradient_loss(model, inputs, targets, adv, 0.6)
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    logp = torch.log_softmax(model(inputs).double() / 0.6, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    want = -(adv.double()[:, None] * logp * (targets >= 0)).sum()
    want.backward()
    assert int(count) == int((targets >= 0).sum())
    assert float(loss.detach()) == pytest.approx(float(want.detach()), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name].double(), p.grad.double(), rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------ memory

class PeakBytes(TorchDispatchMode):
    """The most bytes of tensor storage alive at once among storages that ops create inside the
    mode (every aten op runs through it: forward, autograd's saved tensors, backward). A storage
    counts from the op that returns it until it is freed (weakref.finalize on the storage, which
    torch keeps as one Python object per storage). A custom op's internal temporaries (the
    triton backend's chunk buffer, bounded by design) are not seen; its outputs are."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self.live and storage.nbytes():
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


def _loss_peak(model, inputs, targets, adv, temperature) -> int:
    model.zero_grad(set_to_none=True)
    with PeakBytes() as mode:
        loss, _ = rl.policy_gradient_loss(model, inputs, targets, adv, temperature)
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return mode.peak


@pytest.mark.parametrize("backend", ["default", "triton"])
def test_the_tempered_loss_holds_no_more_memory_than_temperature_one(backend):
    """A vocabulary large beside the model (V 8192, width 32): one (B, T, V) float32 tensor is 4 MiB,
    more than the parameters' gradients (~1.6 MiB). The peak of live tensor bytes over forward +
    backward at T 0.7 is temperature 1's (the old path's model(inputs).float() logits, softcap
    intermediates and log_softmax added several (B, T, V) float32 tensors); the chunked triton
    loss never holds even one."""
    V = 8192
    model = _model(vocab=V, n_layer=1)
    model.set_loss_fn(None if backend == "default" else build_loss_fn("triton", "cpu", chunk_rows=16))
    g = torch.Generator().manual_seed(2)
    inputs, targets = torch.randint(0, V, (4, 64), generator=g), torch.randint(0, V, (4, 64), generator=g)
    targets[:, :8] = -1
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    logits_bytes = inputs.numel() * V * 4
    base = _loss_peak(model, inputs, targets, adv, 1.0)
    tempered = _loss_peak(model, inputs, targets, adv, 0.7)
    assert tempered <= base * 1.01 + 4096, (tempered, base, logits_bytes)
    if backend == "triton":
        assert tempered < logits_bytes / 2, (tempered, logits_bytes)
    else:   # the model's own loss keeps its compute-dtype logits (float32 on CPU) and little more
        assert tempered < 3.5 * logits_bytes, (tempered, logits_bytes)


# ------------------------------------------------------------------------------------ GPU

@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["default", "triton", "liger"])
def test_tempered_loss_on_gpu_matches_and_takes_temperature_ones_memory(backend):
    """bf16 on CUDA, vocabulary 32768: loss and gradients of the tempered policy-gradient loss
    against a float64 reference, and its peak memory (torch.cuda.max_memory_allocated) within 2%
    of temperature 1's for every --kernel backend."""
    if backend == "liger":
        pytest.importorskip("liger_kernel")
        if not all(kernels.liger_per_token_support()):   # RL's reduction="none" needs liger-kernel >= 0.8.2
            pytest.skip("the installed liger-kernel gets reduction='none' wrong")
    V = 32768
    torch.manual_seed(0)
    model = GPT(tiny_config(vocab_size=V, n_embd=128, n_layer=2, n_head=2, n_kv_head=1, sequence_len=512)).cuda()
    model.init_weights()
    randomize(model)
    if backend != "default":
        model.set_loss_fn(build_loss_fn(backend, "cuda"))
    g = torch.Generator().manual_seed(4)
    inputs, targets = (torch.randint(0, V, (8, 512), generator=g).cuda() for _ in range(2))
    targets[:, :64] = -1
    adv = torch.linspace(-1, 1, 8, device="cuda")

    def run(temperature):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss, _ = rl.policy_gradient_loss(model, inputs, targets, adv, temperature)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        return float(loss), {n: p.grad.float().clone() for n, p in model.named_parameters()}, peak

    run(1.0)   # warm-up: kernels, workspaces
    _, grads1, base = run(1.0)
    loss, grads, tempered = run(0.7)
    # liger's tempered path adds one (N, C) copy of the hidden states (hidden / T)
    assert tempered <= base * 1.02 + inputs.numel() * 128 * 4, (tempered, base)

    def reference(temperature):   # float64 log-softmax over the model's float32 softcapped logits
        model.zero_grad(set_to_none=True)
        logp = torch.log_softmax(model(inputs).double() / temperature, -1)
        terms = adv.double()[:, None] * logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets >= 0)
        (-terms.sum()).backward()
        return terms, {n: p.grad.float().clone() for n, p in model.named_parameters()}

    terms, ref = reference(0.7)
    assert abs(loss - float(-terms.sum())) <= 2e-3 * float(terms.abs().sum())   # terms of both signs
    _, ref1 = reference(1.0)
    for name in ref:
        # bf16 roundings of dL/dlogits differ per backend; a scalar's gradient (x0_lambdas) is a sum
        # of many terms of both signs, so its relative error is that backend's own at T = 1 (measured
        # on the same inputs), not a fixed bound: T must not make it worse
        rel = ((grads[name] - ref[name]).norm() / (ref[name].norm() + 1e-12)).item()
        rel1 = ((grads1[name] - ref1[name]).norm() / (ref1[name].norm() + 1e-12)).item()
        assert rel <= max(3e-2, 2 * rel1), (name, rel, rel1)
