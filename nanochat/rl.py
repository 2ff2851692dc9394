"""Reinforcement learning on verifiable rewards (GSM8K-style): rollouts with the Engine, group
advantages, and a policy-gradient step with the Trainer's interface, so that scripts/chat_rl.py
runs it through the shared loop (nanochat/loop.py).

One step: each rank takes its share of `examples_per_step` problems; per problem it samples
`num_samples` completions (Engine, KV cache, calculator tool), scores them with `task.reward`,
sets advantage = reward - mean reward of the group (a group where every sample scores the same
teaches nothing and contributes exactly zero gradient), and maximises sum(advantage x log p(token))
over the tokens the policy sampled, the stop token a sample ended on included (ending the answer
is an action too); prompt tokens and tool outputs the Engine forced are target -1. p is the
distribution the rollouts drew from: the softmax of the model's softcapped logits / temperature
(at another temperature than 1 the untempered log p is not the sampling policy's score function),
over the whole vocabulary (top-k is the sampler's filter, not part of the trained distribution,
as upstream's). Sampling and the backward use the same weights (the optimizer steps once, after
every rollout of the step), so the gradient is on-policy and needs no importance ratio.
The objective is normalised per problem by its number of sampled tokens, then averaged over the
problems the step trains on all ranks (the optimizer averages gradients across ranks). A prompt
that leaves no room for `max_new_tokens` in the model's context is skipped (counted, as SFT skips
a conversation whose reply the row cuts off; `check_prompts_fit` says it before training) and left
out of that average: the ranks first agree on how many problems the step trains (decided from
prompt lengths, before any rollout), so a skip neither shrinks the step's effective learning rate
nor weighs one rank's problems more.
A group is sampled in one Engine call, or in chunks of at most `sample_batch_size` rows when that
is set (the KV cache of one call then holds a chunk, not all `num_samples`), chunk k with its own
seed derived from the problem's. `decode` is the Engine's decode mode: "graphs" replays CUDA graphs
of the plain model (graph step eager: no compile wait), which reads the weights in place, so the
optimizer's updates are seen by the next rollout without a new capture.
Out of memory in a step: one line naming the flag that cuts what ran out (--sample-batch-size for the
rollouts' KV cache, --device-batch-size for the backward, --max-new-tokens once either is at 1), a
value for it and the whole command that resumes the last checkpoint with it (`command`, chat_rl's).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from nanochat.loop import peak_memory_note
from nanochat.sampling import GREEDY_BELOW, MAX_SEED, MAX_TEMPERATURE
from nanochat.training import DEFAULT_HINT, NonFiniteLossError, StepResult, capture_rng_state

SEED_RANGE = MAX_SEED + 1   # a rollout's seed wraps into the Engine's seeds
# chunk k of a group samples with the problem's seed + k x this (a prime: chunk seeds of one
# problem never equal another problem's seed of the same step, index x 7919, in a task of fewer
# than this many problems); chunk 0 keeps the problem's seed, as the single-call group had
CHUNK_SEED_STRIDE = 104729


def rollout_seed(seed: int, index: int, pos: int, chunk: int = 0) -> int:
    """The Engine seed of chunk `chunk` of problem `index`'s group, `pos` problems into the run."""
    return (seed + index * 7919 + pos + chunk * CHUNK_SEED_STRIDE) % SEED_RANGE


@dataclass
class PromptFit:
    """What probe_prompts found: `too_long` of `probed` prompts leave no room for max_new_tokens
    (first_too_long: the task index of the first); `room`: the most new tokens the shortest probed
    prompt leaves (< 1: not even one)."""
    probed: int
    too_long: int
    first_too_long: int | None
    room: int


def probe_prompts(task, tokenizer, context: int, max_new_tokens: int, *, sample: int = 512) -> PromptFit:
    """Probe the first `sample` problems of `task`: how many prompts the trainer would skip."""
    probed = min(len(task), sample)
    too_long, first, shortest = 0, None, None
    for i in range(probed):
        n = len(tokenizer.render_for_completion(task[i]))
        shortest = n if shortest is None else min(shortest, n)
        if n + max_new_tokens > context:
            too_long += 1
            first = i if first is None else first
    return PromptFit(probed, too_long, first, context - (shortest or 0))


def check_prompts_fit(task, tokenizer, context: int, max_new_tokens: int, *, sample: int = 512) -> str | None:
    """Before the model loads (chat_rl): a RequestError naming --max-new-tokens when none of the
    first `sample` prompts leaves room for it in the model's `context` (RL would train nothing);
    else the line to print when some are skipped (None: none)."""
    from nanochat.errors import RequestError
    fit = probe_prompts(task, tokenizer, context, max_new_tokens, sample=sample)
    if fit.probed and fit.too_long == fit.probed:
        accepted = (f"1..{fit.room} (the room the shortest of them leaves)" if fit.room >= 1 else
                    "none: even the shortest prompt fills the context")
        raise RequestError(f"--max-new-tokens: got {max_new_tokens}; accepted: {accepted}: none of the first "
                           f"{fit.probed} training prompts plus {max_new_tokens} new tokens fits the model's context "
                           f"of {context} tokens, so RL would train nothing")
    if not fit.too_long:
        return None
    return (("WARNING: " if fit.too_long * 10 >= fit.probed else "") +
            f"--max-new-tokens {max_new_tokens}: {fit.too_long} of the first {fit.probed} training prompts (the first: "
            f"problem {fit.first_too_long}) leave no room for it in the model's context of {context} tokens; such "
            "prompts are skipped (they train nothing; counted in the summary's prompts_skipped)")


@dataclass
class RLStepResult(StepResult):
    extra: dict = field(default_factory=dict)   # reward, sequence length: logged by the loop


def rollout_batch(sequences: list[list[int]], masks: list[list[int]], advantages: list[float], pad_id: int,
                  device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, advantages) for the policy-gradient forward: targets keep only sampled
    tokens (mask 1), everything else (prompt, tool-forced tokens, padding) is -1."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    keep = torch.zeros((len(sequences), length), dtype=torch.bool)
    for i, (seq, mask) in enumerate(zip(sequences, masks)):
        assert len(seq) == len(mask)
        ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        keep[i, :len(mask)] = torch.tensor(mask, dtype=torch.bool)
    targets = torch.where(keep[:, 1:], ids[:, 1:], torch.full_like(ids[:, 1:], -1))
    adv = torch.tensor(advantages, dtype=torch.float32)
    return ids[:, :-1].to(device), targets.to(device), adv.to(device)


def group_advantages(rewards: list[float]) -> list[float]:
    """reward - the group's mean reward; exactly 0 when every reward is the same (the rounded mean
    of e.g. three rewards of 0.1 differs from 0.1 by ~1e-17, an advantage that Adam's
    normalisation turns into a real update)."""
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def check_temperature(temperature) -> float:
    """The rollouts' (and the loss's) temperature: a finite number >= GREEDY_BELOW, as chat_rl's
    --temperature (a bool is refused, not read as 1); a ValueError naming `temperature` otherwise.
    Greedy rollouts draw every sample of a group alike (nothing to train) and the loss's
    logits / temperature would be inf."""
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and math.isfinite(temperature) and temperature >= GREEDY_BELOW):
        raise ValueError(f"temperature: got {temperature!r}; accepted: a finite number >= {GREEDY_BELOW}")
    return float(temperature)


def policy_gradient_loss(model, inputs: torch.Tensor, targets: torch.Tensor, advantages: torch.Tensor,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(-sum over sampled tokens of advantage x log p, number of sampled tokens); p: softmax of the
    model's softcapped logits / `temperature`, the sampler's distribution (before its top-k cut).
    Any temperature runs the model's own loss backend (GPT.forward's `temperature`), so T != 1
    holds no (B, T, V) float32 logits beyond what T = 1 holds. `temperature` is checked before
    the forward (check_temperature)."""
    temperature = check_temperature(temperature)
    valid = targets >= 0
    if temperature == 1.0:   # the keyword left out: the plain forward's call, as before
        nll = model(inputs, targets, loss_reduction="none")
    else:   # the sampler's cap: tempered logits past it are uniform already
        nll = model(inputs, targets, loss_reduction="none", temperature=min(temperature, MAX_TEMPERATURE))
    nll = nll.view_as(targets).float()
    logp = torch.where(valid, -nll, torch.zeros_like(nll))
    return -(logp * advantages[:, None]).sum(), valid.sum()


# (smallest accepted value, why) of the trainer's integer arguments; top_k may also be None (off)
TRAINER_COUNTS = {
    "examples_per_step": (1, ""), "max_new_tokens": (1, ""), "device_batch_size": (1, ""), "pos": (0, ""),
    "sample_batch_size": (0, " (0: a problem's whole group in one call)"),
    "num_samples": (2, " (a group of one has advantage 0: nothing trained)"),
    "top_k": (2, ", or None (top-k 1 samples greedily: every sample of a group alike, nothing trained)"),
    "seed": (0, f" and <= {MAX_SEED} (the Engine's seeds)"),
}


def check_trainer_counts(**values) -> None:
    """A ValueError naming the first of the trainer's integer arguments out of TRAINER_COUNTS'
    range, at construction: a device_batch_size of 0 failed after the first problem's rollouts
    (range() arg 3 must not be zero), a negative sample_batch_size drew no samples, num_samples
    1 or top_k 1 trained nothing, silently (chat_rl checks its flags alike)."""
    for name, value in values.items():
        low, why = TRAINER_COUNTS[name]
        if name == "top_k" and value is None:
            continue
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        if not ok or (name == "seed" and value > MAX_SEED):
            raise ValueError(f"{name}: got {value!r}; accepted: an integer >= {low}{why}")


class PolicyGradientTrainer:
    """Trainer-compatible (step / loop_state / loader_state / note_checkpoint) RL step."""

    def __init__(self, model, train_model, optimizer, task, tokenizer, schedule, rt, *, examples_per_step: int,
                 num_samples: int, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = 50,
                 device_batch_size: int = 8, seed: int = 42, pos: int = 0, sample_batch_size: int = 0,
                 decode: str = "eager", command: Callable[..., str] | None = None):
        from nanochat.engine import Engine
        temperature = check_temperature(temperature)
        check_trainer_counts(examples_per_step=examples_per_step, num_samples=num_samples,
                             max_new_tokens=max_new_tokens, top_k=top_k, device_batch_size=device_batch_size,
                             sample_batch_size=sample_batch_size, seed=seed, pos=pos)
        self.model, self.train_model, self.optimizer, self.task = model, train_model, optimizer, task
        self.tokenizer, self.schedule, self.rt = tokenizer, schedule, rt
        self.engine = Engine(model, tokenizer, decode=decode, graph_step="eager")
        self.examples_per_step, self.num_samples = examples_per_step, num_samples
        self.sample_batch_size = sample_batch_size              # the flag (0: the whole group in one call)
        self.sample_rows = sample_batch_size or num_samples   # rows per sampling call
        self.max_new_tokens, self.temperature, self.top_k = max_new_tokens, temperature, top_k
        self.device_batch_size, self.seed = device_batch_size, seed
        self.pos = pos                     # problems consumed so far (all ranks)
        self.skipped = 0                   # prompts skipped so far (all ranks): the summary's count
        self.last_checkpoint: str | None = None
        # (**flag overrides, resume=STEP) -> the command that continues the run from STEP (no resume:
        # the run's own command, before its first save): what an out-of-memory stop says to run
        self.command = command

    def loader_state(self) -> dict:
        return {"pos": self.pos, "skipped": self.skipped}

    def load_loader_state(self, state: dict) -> None:
        self.pos = int(state["pos"])
        self.skipped = int(state.get("skipped", 0))   # checkpoints written before the count have none

    def note_checkpoint(self, path) -> None:
        self.last_checkpoint = str(path)

    def loop_state(self, step: int, meter=None, **extra) -> dict:
        return {"step": step, "rng": capture_rng_state(),
                "meter": meter.state_dict() if meter is not None else None, **extra}

    def _my_problems(self) -> list[int]:
        idx = [(self.pos + k) % len(self.task) for k in range(self.examples_per_step)]
        return idx[self.rt.rank::self.rt.world_size]

    def _prompt(self, index: int) -> tuple[dict, list[int], int]:
        """(conversation, prompt tokens, generation budget) of a problem; budget 0: the prompt
        leaves no room for max_new_tokens in the model's context, and the problem is skipped
        (generating fewer would make --max-new-tokens a promise kept to some prompts only)."""
        conv = self.task[index]
        prompt = self.tokenizer.render_for_completion(conv)
        fits = len(prompt) + self.max_new_tokens <= self.engine.max_seq_len
        return conv, prompt, self.max_new_tokens if fits else 0

    def _sample_group(self, index: int, prompt: list[int], budget: int):
        """(sequences, masks, completions) of `num_samples` samples of a prompt, drawn in chunks of
        at most sample_rows rows (rollout_seed's chunk seeds; one chunk, the default: the same call,
        seed and samples as one batch of them all). Unlike Engine.generate_batch, a sequence keeps the
        stop token its sample drew (mask 1): stopping is the policy's choice and is trained with
        the sample's advantage (without it a rewarded answer never reinforced ending there, and
        only the tokens of longer answers were trained). A completion (the text scored) leaves the
        stop token out."""
        seqs, masks, completions = [], [], []
        for chunk, start in enumerate(range(0, self.num_samples, self.sample_rows)):
            n = min(self.sample_rows, self.num_samples - start)
            part = self._sample_rows(prompt, budget, n, rollout_seed(self.seed, index, self.pos, chunk))
            for whole, piece in zip((seqs, masks, completions), part):
                whole += piece
        return seqs, masks, completions

    def _sample_rows(self, prompt: list[int], budget: int, n: int, seed: int):
        """_sample_group's (sequences, masks, completions) of one Engine call of `n` rows."""
        stops = frozenset(self.engine.default_stop_tokens)
        seqs, masks, done = [list(prompt) for _ in range(n)], [[0] * len(prompt) for _ in range(n)], [False] * n
        for column, mask_column in self.engine.generate(prompt, num_samples=n, max_tokens=budget,
                                                        temperature=self.temperature, top_k=self.top_k, seed=seed):
            for i, (token, mask) in enumerate(zip(column, mask_column)):
                if not done[i]:
                    seqs[i].append(token)
                    masks[i].append(mask)
                    done[i] = token in stops
        return seqs, masks, [s[len(prompt):len(s) - int(d)] for s, d in zip(seqs, done)]

    def _rollout(self, index: int, conv: dict, prompt: list[int], budget: int):
        """(sequences, masks, advantages, rewards) of one problem's group."""
        from nanochat.tasks.evaluate import completion_text
        self.model.eval()
        seqs, masks, completions = self._sample_group(index, prompt, budget)
        self.model.train()
        # scored like chat_eval: text and calculator outputs, python source dropped
        rewards = [float(self.task.reward(conv, completion_text(self.tokenizer, c))) for c in completions]
        bad = [r for r in rewards if not math.isfinite(r)]
        if bad:   # a task's bug, not a training instability: NonFiniteLossError's hint would mislead
            raise ValueError(f"{type(self.task).__name__}.reward returned {bad[0]} for problem {index}; "
                             "rewards must be finite numbers")
        return seqs, masks, group_advantages(rewards), rewards

    def _sum_over_ranks(self, value: int) -> int:
        """`value` summed over the ranks (a collective: every rank calls it at the same point)."""
        if self.rt.world_size == 1:
            return value
        import torch.distributed as dist
        total = torch.tensor([float(value)], dtype=torch.float64, device=self.rt.device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return int(total.item())

    def step(self, step: int) -> RLStepResult:
        rt = self.rt
        rt.synchronize()
        t0 = time.perf_counter()
        problems = self._my_problems()
        prompts = [self._prompt(index) for index in problems]
        skipped = sum(1 for *_, budget in prompts if budget < 1)
        # the step's mean runs over the problems trained on every rank, known before any backward
        trained_all = self._sum_over_ranks(len(problems) - skipped)
        total_loss, rewards, tokens, lengths = 0.0, [], 0, []
        for index, (conv, prompt, budget) in zip(problems, prompts):
            if budget < 1:
                continue
            with self._memory_stop(step, "sampling", len(prompt) + budget):
                seqs, masks, advantages, rs = self._rollout(index, conv, prompt, budget)
            rewards += rs
            lengths += [len(s) for s in seqs]
            inputs, targets, adv = rollout_batch(seqs, masks, advantages, self.tokenizer.bos_token_id, rt.device)
            count = (targets >= 0).sum().clamp(min=1)
            with self._memory_stop(step, "training", inputs.size(1)):
                for b in range(0, inputs.size(0), self.device_batch_size):
                    sl = slice(b, b + self.device_batch_size)
                    loss_sum, _ = policy_gradient_loss(self.train_model, inputs[sl], targets[sl], adv[sl],
                                                       self.temperature)
                    loss = loss_sum / count / trained_all * rt.world_size  # the optimizer averages ranks
                    loss.backward()
                    total_loss += float(loss.detach())
            tokens += inputs.numel()
        # tokens too: ranks roll out different lengths (and skip different prompts), so a rank's own
        # count x world size is not the step's, and each rank's tok/s would say another figure
        stats = torch.tensor([total_loss, sum(rewards), len(rewards), sum(lengths), skipped, tokens],
                             dtype=torch.float64, device=rt.device)
        if rt.world_size > 1:
            import torch.distributed as dist
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
        loss_f, reward_sum, n, len_sum, skipped_all, tokens_all = (float(v) for v in stats)
        self.skipped += int(skipped_all)
        loss_f /= rt.world_size
        if not math.isfinite(loss_f):
            raise NonFiniteLossError(step, "policy-gradient loss", loss_f, self.last_checkpoint, DEFAULT_HINT)
        lrm = self.schedule.apply(self.optimizer, step)
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        self.pos += self.examples_per_step
        rt.synchronize()
        # no rollout (every problem of the step skipped): no reward or length to report, not a 0 that
        # reads as a step that earned nothing
        extra = {"reward": reward_sum / n, "seq_len": len_sum / n} if n else {}
        extra["skipped"] = int(skipped_all)
        return RLStepResult(step, loss_f, lrm, time.perf_counter() - t0, int(tokens_all), None, extra)

    @contextmanager
    def _memory_stop(self, step: int, phase: str, tokens: int):
        """Out of memory inside the block: a RequestError (one line, exit 2) saying what to lower
        (out_of_memory_hint), in place of torch's traceback or the loop's generic device-batch hint."""
        from nanochat.errors import RequestError
        from nanochat.tasks.evaluate import out_of_memory_kind
        try:
            yield
        except RuntimeError as e:
            memory = out_of_memory_kind(e)
            if memory is None:
                raise
            raise RequestError(self.out_of_memory_hint(step, phase, tokens, memory)) from e

    def out_of_memory_hint(self, step: int, phase: str, tokens: int, memory: str) -> str:
        """The flag that cuts what ran out, a value for it and the command to run. "sampling": the
        KV cache of one Engine call, --sample-batch-size rows (0: a problem's whole group) of up to
        `tokens`; "training": a forward/backward of --device-batch-size sequences (at most a group:
        chunks never span problems). At one row, --max-new-tokens. The command resumes the last
        checkpoint at the lower value, or before the first save runs the run's own command with it."""
        if phase == "sampling":
            rows, flag, name = min(self.sample_rows, self.num_samples), "--sample-batch-size", "sample_batch_size"
            # a divisor of the group: every call the same size (one cache, and graph, under --decode graphs)
            lower = max(d for d in range(1, max(1, rows // 2) + 1) if self.num_samples % d == 0)
            given = self.sample_batch_size
            what = (f"while sampling rollouts: a KV cache of {rows} rows x up to {tokens} tokens ({flag} {given}"
                    + (f": a problem's {self.num_samples} samples in one call)" if given == 0 else ")"))
            effect = f"a problem's {self.num_samples} samples drawn {lower} at a time"
        else:
            rows, flag, name = min(self.device_batch_size, self.num_samples), "--device-batch-size", "device_batch_size"
            lower = max(1, rows // 2)
            what = (f"in the policy-gradient forward/backward: {rows} sequences x up to {tokens} tokens ({flag} "
                    f"{self.device_batch_size})")
            effect = "the same gradient, summed over more chunks"
        head = f"out of {memory} in step {step} {what}{peak_memory_note(memory)}"
        if rows > 1:
            advice, overrides = f"lower {flag} (e.g. {lower}: {effect})", {name: lower}
        elif self.max_new_tokens > 1:
            shorter = self.max_new_tokens // 2
            advice = f"{flag} is at 1: lower --max-new-tokens (now {self.max_new_tokens}, e.g. {shorter}: shorter rollouts)"
            overrides = {"max_new_tokens": shorter}
        else:
            return f"{head}; every flag is at its smallest: the model leaves too little memory on this device"
        if self.command is None:
            return f"{head}; {advice}"
        # its step, not latest: a run resumed from an older step has not moved latest.json yet
        last = Path(self.last_checkpoint or "").name.removeprefix("step_")
        if last.isdigit():
            return f"{head}; {advice}; resume with: {self.command(**overrides, resume=str(int(last)))}"
        return f"{head}; {advice}; run again with: {self.command(**overrides)}"
