"""RL (nanochat/rl.py, scripts/chat_rl.py) on CPU: the policy-gradient step's gradient against a
hand-computed objective (group-relative advantages, sampled tokens only, per-problem token
normalisation, micro-batches), zero gradient for a group with equal rewards, and a tiny chat_rl
run: exact resume and a report section that names the checkpoint it describes.
(The rollout masks and flag checks are tested in tests/test_chat_train.py.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from tests.test_engine import tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's (never modified here)


class _Runtime:
    rank, world_size, device = 0, 1, "cpu"

    def synchronize(self):
        pass


class _Schedule:
    def apply(self, optimizer, step):
        return 1.0


class _RecordGrads:
    """An optimizer that keeps the gradients step() sees (the weights stay as they are)."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}


class _Task:
    def __init__(self, reward):
        self.reward_fn = reward

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                             {"role": "assistant", "content": str(2 * i)}]}

    def reward(self, conversation, completion):
        return self.reward_fn(completion)


class _LongTask(_Task):
    """`size` problems; those in `long` have prompts longer than the model's context (skipped)."""

    def __init__(self, reward, long, size):
        super().__init__(reward)
        self.long, self.size = set(long), size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        conv = super().__getitem__(i)
        if i in self.long:   # ~600 tokens; the tiny model's context is 256
            conv["messages"][0]["content"] = "What is " + " plus ".join(["1"] * 300) + "?"
        return conv


def _len_reward(text):
    return float(len(text) % 3)


def _trainer(chat_model, reward, task=None, rt=None, **kw):
    from nanochat.rl import PolicyGradientTrainer
    model, tokenizer = chat_model
    model = copy.deepcopy(model).train()
    opt = _RecordGrads(model)
    args = dict(examples_per_step=2, num_samples=4, max_new_tokens=6, device_batch_size=3, seed=5)
    return PolicyGradientTrainer(model, model, opt, task or _Task(reward), tokenizer, _Schedule(), rt or _Runtime(),
                                 **{**args, **kw}), opt


def _reference_grads(trainer, problems):
    """-(1/P) sum_problems (1/tokens_p) sum_samples (r - mean r) sum_sampled_tokens log p, by hand;
    a sample's sampled tokens run up to and including the stop token it drew (not scored as text)."""
    from nanochat.tasks.evaluate import completion_text
    model, tok = trainer.model, trainer.tokenizer
    stops = set(trainer.engine.default_stop_tokens)
    model.zero_grad(set_to_none=True)
    objective = 0.0
    for index in problems:
        conv = trainer.task[index]
        prompt = tok.render_for_completion(conv)
        # the group in chunks of sample_rows rows, chunk k seeded seed + index x 7919 + pos + k x 104729
        chunks, b = [], trainer.sample_rows
        for k, start in enumerate(range(0, trainer.num_samples, b)):
            steps = list(trainer.engine.generate(prompt, num_samples=min(b, trainer.num_samples - start), max_tokens=6,
                                                 temperature=1.0, top_k=50,
                                                 seed=5 + index * 7919 + trainer.pos + k * 104729))
            chunks += [([col[i] for col, _ in steps], [m[i] for _, m in steps]) for i in range(len(steps[0][0]))]
        model.train()
        seqs, masks, rewards = [], [], []
        for drawn, drawn_masks in chunks:
            end = next((t + 1 for t, token in enumerate(drawn) if token in stops), len(drawn))
            stopped = drawn[end - 1] in stops
            seqs.append(prompt + drawn[:end])
            masks.append([0] * len(prompt) + drawn_masks[:end])
            rewards.append(trainer.task.reward(conv, completion_text(tok, drawn[:end - stopped])))
        mean = sum(rewards) / len(rewards)
        tokens = sum(sum(m[1:]) for m in masks)
        for seq, mask, r in zip(seqs, masks, rewards):
            logits = model(torch.tensor([seq[:-1]]))[0].float()
            logp = F.log_softmax(logits, -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
            objective = objective + (r - mean) * (logp * torch.tensor(mask[1:], dtype=torch.float32)).sum() / tokens
    loss = -objective / len(problems)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_step_is_the_reference(trainer, opt, res, problems: list[int]) -> None:
    """The step's loss and gradients equal the hand-computed mean objective over `problems`."""
    trainer.pos = 0
    loss, grads = _reference_grads(trainer, problems)
    assert res.loss == pytest.approx(loss, abs=1e-6)
    assert set(grads) == set(opt.grads) and any(g.abs().max() > 0 for g in grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(opt.grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_policy_gradient_step_matches_the_hand_computed_objective(chat_model):
    trainer, opt = _trainer(chat_model, lambda text: float(len(text) % 3))
    res = trainer.step(0)
    assert trainer.pos == 2 and res.extra["skipped"] == 0 and 0 < res.extra["reward"] < 2
    _assert_step_is_the_reference(trainer, opt, res, [0, 1])


def test_a_group_with_equal_rewards_gives_zero_gradient(chat_model):
    trainer, opt = _trainer(chat_model, lambda text: 1.0)
    res = trainer.step(0)
    assert res.loss == 0.0 and res.extra["reward"] == 1.0
    assert all(bool((g == 0).all()) and math.isfinite(float(g.sum())) for g in opt.grads.values())


def test_a_skipped_prompt_is_left_out_of_the_steps_mean(chat_model):
    """A prompt too long for the context is skipped and not counted: the step's gradient and loss
    are the mean over the problems it trained (2 of 3 here), not a sum divided by 3."""
    task = _LongTask(_len_reward, long={1}, size=5)
    trainer, opt = _trainer(chat_model, None, task=task, examples_per_step=3)
    res = trainer.step(0)
    assert res.extra["skipped"] == 1 and trainer.pos == 3
    _assert_step_is_the_reference(trainer, opt, res, [0, 2])


class _RankRuntime(_Runtime):
    def __init__(self, rank, world_size):
        self.rank, self.world_size = rank, world_size


# 8 problems, 4 a step over 2 ranks (rank 0: 0, 2 | 4, 6; rank 1: 1, 3 | 5, 7); long prompts: step 0
# rank 1 trains one problem of its two, step 1 none (no backward at all on that rank)
RL_LONG, RL_STEPS = {1, 5, 7}, 2


def _rl_rank_worker(rank: int, store: str, corpus: str, out: str) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model, tokenizer = tiny_chat_model(corpus)
        model.load_state_dict(torch.load(f"{out}/model.pt"))   # the parent's weights, to the bit
        trainer, opt = _trainer((model, tokenizer), None, task=_LongTask(_len_reward, RL_LONG, 8),
                                rt=_RankRuntime(rank, 2), examples_per_step=4)
        steps = []
        for step in range(RL_STEPS):
            res = trainer.step(step)
            steps.append({"loss": res.loss, "skipped": res.extra["skipped"], "grads": opt.grads, "tokens": res.tokens})
        torch.save(steps, f"{out}/rank{rank}.pt")
        dist.barrier()   # no rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()


def test_two_ranks_skipping_different_prompts_match_one_process(chat_model, tiny_corpus, tmp_path):
    """The ranks agree on how many problems the step trains: the gradient the optimizer averages
    over 2 ranks (a rank with no gradient counts zero) equals one process running the same
    problems, and both equal the hand-computed mean over the trained problems, when one rank
    skips some of its prompts and when one skips all of them; the step's token count is the same."""
    import torch.multiprocessing as mp
    torch.save(chat_model[0].state_dict(), tmp_path / "model.pt")
    mp.spawn(_rl_rank_worker, args=(str(tmp_path / "store"), str(tiny_corpus), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer, opt = _trainer(chat_model, None, task=_LongTask(_len_reward, RL_LONG, 8), examples_per_step=4)
        for step, trained in enumerate([[0, 2, 3], [4, 6]]):
            res = trainer.step(step)
            trainer.pos = 4 * step
            loss, want = _reference_grads(trainer, trained)
            trainer.pos = 4 * (step + 1)
            trainer.model.zero_grad(set_to_none=True)   # the next step starts without the reference's
            assert [r[step]["skipped"] for r in ranks] == [res.extra["skipped"]] * 2 == [[1, 2][step]] * 2
            assert ranks[0][step]["loss"] == ranks[1][step]["loss"] == pytest.approx(res.loss, abs=1e-6)
            # tokens (tok/s in the log line) are the step's over all ranks, alike on each: rank 0 logged
            # its own count x 2 (step 1: twice rank 0's, rank 1 having trained nothing)
            assert ranks[0][step]["tokens"] == ranks[1][step]["tokens"] == res.tokens > 0
            assert res.loss == pytest.approx(loss, abs=1e-6)
            assert (ranks[1][step]["grads"] == {}) == (step == 1)   # step 1: rank 1 ran no backward
            assert set(want) == set(opt.grads)
            for name, g in want.items():
                averaged = sum(r[step]["grads"].get(name, torch.zeros_like(g)) for r in ranks) / 2
                torch.testing.assert_close(opt.grads[name], g, rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
                torch.testing.assert_close(averaged, g, rtol=1e-4, atol=1e-6, msg=f"step {step} {name}")
    finally:
        torch.set_num_threads(threads)


def test_chat_rl_resumes_exactly_and_reports_its_checkpoint(sft_checkpoint, chat_model, monkeypatch):
    from nanochat.report import Report, report_dir
    from nanochat.tasks import GSM8K
    from scripts import chat_rl
    # a random model never solves GSM8K (every advantage 0, no update): a reward it can earn
    # (any function of the text that tells the two samples apart: a parity of the length did until
    # the torch sampler gave each sample its own noise, and then both samples of step 1 tied)
    monkeypatch.setattr(GSM8K, "reward", lambda self, conv, text: float(sum(map(ord, text)) % 7))
    args = ["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
            "--max-new-tokens", "4", "--test-holdout", "1", "--eval-every", "-1", "--save-every", "1",
            "--num-iterations", "2", "--matrix-lr", "0.5", "--init-lr-frac", "1"]
    full = chat_rl.main(args)
    resumed = chat_rl.main(args + ["--resume", "1"])
    assert sorted(full["losses"]) == [0, 1] and sorted(resumed["losses"]) == [1]
    assert resumed["losses"][1] == full["losses"][1] and all(v != 0 for v in full["losses"].values())
    doc = next(d for d in Report(report_dir(sft_checkpoint)).sections() if d["section"] == "Chat RL")
    data = doc["entries"][-1]["data"]
    assert data["model_tag"] == "d2" and data["checkpoint_dir"].endswith("d2") and data["final_step"] == 2


def test_rl_resume_names_another_world_size_before_loading():
    """Checked from meta.json before any rank opens its own files: a rank the checkpoint has no files
    for failed alone (auto should start afresh on every rank; an explicit resume names the sizes)."""
    from scripts.chat_rl import parse_config, resume_mismatch
    cfg = parse_config([])
    meta = {"world_size": 1, "config": {"seed": cfg.seed}}
    assert resume_mismatch(meta, cfg, 1) is None
    assert resume_mismatch(meta, cfg, 2) == "it was saved by 1 rank(s), this run has 2"
    assert resume_mismatch({"world_size": 2, "config": {"seed": cfg.seed + 1}}, cfg, 2).startswith(
        "the checkpoint's run had --seed")
