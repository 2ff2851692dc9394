"""RL rollouts on CPU (nanochat/rl.py, scripts/chat_rl.py): a group sampled in chunks of
--sample-batch-size rows (same count and shapes, deterministic, and with one chunk, the default, the
very samples of the former single Engine call), prompts with no room for --max-new-tokens skipped and counted
(said before the model loads, refused when none fits), and --eval-examples / --eval-samples named
in a notice when --eval-every turns the evaluation off."""

from __future__ import annotations

import pytest

from tests.test_engine import tiny_chat_model
from tests.test_rl import _LongTask, _Task, _len_reward, _trainer
from tests.test_rl_audit import RL_ARGS, _small_gsm8k


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's (never modified here)


class _GrowingTask(_Task):
    """Problem i asks to add 1 + 45 i ones: prompts of distinct lengths (problem 1: 235 tokens with
    the tiny tokenizer, leaving 21 of the tiny model's 256)."""

    def __getitem__(self, i):
        conv = super().__getitem__(i)
        conv["messages"][0]["content"] = "What is " + " plus ".join(["1"] * (1 + 45 * i)) + "?"
        return conv


def _group(trainer, index=1):
    prompt = trainer.tokenizer.render_for_completion(trainer.task[index])
    return trainer._sample_group(index, prompt, trainer.max_new_tokens)


def _single_call_group(trainer, index=1):
    """The group as rl.py sampled it before chunking: one Engine call of all num_samples rows with
    the problem's seed (written out here, not rollout_seed's)."""
    from nanochat.rl import SEED_RANGE
    prompt = trainer.tokenizer.render_for_completion(trainer.task[index])
    return trainer._sample_rows(prompt, trainer.max_new_tokens, trainer.num_samples,
                                (trainer.seed + index * 7919 + trainer.pos) % SEED_RANGE)


def test_a_group_is_sampled_in_chunks_of_sample_batch_size(chat_model, monkeypatch):
    """5 samples at --sample-batch-size 2: Engine calls of 2, 2 and 1 rows (the KV cache holds a
    chunk, not the group), each its own seed; 5 sequences of prompt + sampled tokens; the same
    samples on a second run; and the chunk seeds differ from the problem's other samples'."""
    trainer, _ = _trainer(chat_model, _len_reward, num_samples=5, sample_batch_size=2, max_new_tokens=12)
    calls, generate = [], trainer.engine.generate

    def recording(prompt, **kw):
        calls.append((kw["num_samples"], kw["seed"]))
        return generate(prompt, **kw)

    monkeypatch.setattr(trainer.engine, "generate", recording)
    seqs, masks, completions = _group(trainer)
    assert [n for n, _ in calls] == [2, 2, 1] and len({s for _, s in calls}) == 3
    assert calls[0][1] == 5 + 1 * 7919 + 0   # chunk 0 keeps the problem's seed
    prompt = trainer.tokenizer.render_for_completion(trainer.task[1])
    assert len(seqs) == len(masks) == len(completions) == 5
    for seq, mask, completion in zip(seqs, masks, completions):
        assert seq[:len(prompt)] == prompt and len(seq) == len(mask) and len(prompt) < len(seq) <= len(prompt) + 12
        assert mask[:len(prompt)] == [0] * len(prompt) and completion == seq[len(prompt):len(prompt) + len(completion)]
    again, _ = _trainer(chat_model, _len_reward, num_samples=5, sample_batch_size=2, max_new_tokens=12)
    assert _group(again) == (seqs, masks, completions)
    # the chunks are not the single call's rows (another RNG stream each): chunking is real, and seeded
    assert seqs != _single_call_group(again)[0]


@pytest.mark.parametrize("sample_batch_size", [0, 4, 9])
def test_one_chunk_is_the_former_single_call(chat_model, sample_batch_size):
    """num_samples <= --sample-batch-size (0, the default: all): one Engine call with the problem's
    seed, so the samples (and a resumed run's) are bit-identical to those before chunking; the
    training chunk (--device-batch-size 1) plays no part in it."""
    trainer, _ = _trainer(chat_model, _len_reward, num_samples=4, sample_batch_size=sample_batch_size,
                          device_batch_size=1, max_new_tokens=12)
    trainer.pos = 3
    assert _group(trainer, 2) == _single_call_group(trainer, 2)


def test_a_prompt_without_room_for_max_new_tokens_is_skipped_and_counted(chat_model):
    """The tiny model's context is 256: a prompt of p tokens with --max-new-tokens m and p + m > 256
    is skipped (it generated 256 - p tokens, silently fewer than m, before); the count goes on
    over steps and through the loader state a checkpoint saves."""
    from nanochat.rl import PolicyGradientTrainer
    task = _GrowingTask(_len_reward)
    trainer, _ = _trainer(chat_model, None, task=task, examples_per_step=2, num_samples=2, max_new_tokens=6)
    lengths = [len(trainer._prompt(i)[1]) for i in range(2)]
    room = 256 - max(lengths)   # the longer prompt of the two leaves this much
    assert min(lengths) < max(lengths) and room >= 2
    trainer.max_new_tokens = room + 1   # fits the shorter prompt only
    assert [trainer._prompt(i)[2] for i in range(2)] == [room + 1 if n == min(lengths) else 0 for n in lengths]
    res = trainer.step(0)
    assert res.extra["skipped"] == 1 and trainer.skipped == 1
    trainer.max_new_tokens, trainer.pos = room, 0   # the same two problems again: both fit
    assert trainer.step(1).extra["skipped"] == 0 and trainer.skipped == 1
    state = trainer.loader_state()
    assert state == {"pos": 2, "skipped": 1}
    fresh = PolicyGradientTrainer.__new__(PolicyGradientTrainer)
    fresh.load_loader_state({"pos": 2})   # a checkpoint from before the count
    assert fresh.skipped == 0
    fresh.load_loader_state(state)
    assert (fresh.pos, fresh.skipped) == (2, 1)


def test_check_prompts_fit_warns_or_names_max_new_tokens(chat_model):
    from nanochat.errors import RequestError
    from nanochat.rl import check_prompts_fit
    _, tokenizer = chat_model
    task = _LongTask(_len_reward, long={3}, size=10)   # problem 3: ~600 tokens, the others short
    lengths = [len(tokenizer.render_for_completion(task[i])) for i in range(10)]
    shortest = min(lengths)
    assert check_prompts_fit(task, tokenizer, max(lengths) + 16, 16) is None
    line = check_prompts_fit(task, tokenizer, 256, 16)
    assert line.startswith("WARNING: --max-new-tokens 16: 1 of the first 10 training prompts (the first: problem 3)")
    assert "skipped" in line and "prompts_skipped" in line
    assert check_prompts_fit(task, tokenizer, 256, 16, sample=3) is None   # the probe reads the first 3 only
    with pytest.raises(RequestError, match=rf"--max-new-tokens: got {257 - shortest}; accepted: 1\.\.{256 - shortest} "
                                           r"\(the room the shortest of them leaves\): none of the first 10 training"):
        check_prompts_fit(task, tokenizer, 256, 257 - shortest)
    with pytest.raises(RequestError, match=r"--max-new-tokens: got 1; accepted: none: even the shortest prompt fills"):
        check_prompts_fit(_LongTask(_len_reward, long=range(4), size=4), tokenizer, 256, 1)


def test_rollout_flags_are_checked_by_name():
    from scripts.chat_rl import parse_config
    with pytest.raises(ValueError, match=r"--sample-batch-size: got -1"):
        parse_config(["--sample-batch-size", "-1"])
    with pytest.raises(ValueError, match=r"--decode: got 'fast'; accepted: auto\|eager\|compile\|static\|graphs"):
        parse_config(["--decode", "fast"])
    cfg = parse_config([])
    assert (cfg.sample_batch_size, cfg.decode) == (0, "auto")


def test_unused_eval_flags_are_named_when_the_eval_is_off():
    from scripts.chat_rl import ChatRLConfig, parse_config, unused_eval_flags
    off = ["--eval-every", "-1"]
    assert unused_eval_flags(parse_config(off)) is None   # defaults: nothing to say
    assert unused_eval_flags(parse_config(["--eval-examples", "50"])) is None   # the eval is on
    line = unused_eval_flags(parse_config(off + ["--eval-examples", "50", "--eval_samples=3"]))
    assert line == ("  --eval-examples 50, --eval-samples 3: no effect, --eval-every -1 never evaluates "
                    "(no GSM8K pass@k this run)")
    # given explicitly at its default value: still named; a config built in code: its non-defaults
    assert "--eval-examples 400:" in unused_eval_flags(parse_config(["--eval-every", "0", "--eval-examples", "400"]))
    assert unused_eval_flags(ChatRLConfig(eval_every=0, eval_samples=2)).startswith("  --eval-samples 2: no effect")
    assert "given_flags" not in __import__("dataclasses").asdict(parse_config(off))   # kept out of checkpoints


def test_chat_rl_says_skips_at_the_start_and_in_the_summary(sft_checkpoint, chat_model, shared_data, tmp_path,
                                                            capsys):
    """GSM8K test problems 1..4 have prompts of 65, 112, 78 and 257 tokens with the tiny tokenizer
    (context 256): --max-new-tokens 4 leaves room for three of them, 200 for none (refused before
    the model loads, naming the flag and the room the shortest prompt leaves)."""
    from nanochat.errors import RequestError
    from scripts import chat_rl
    args = RL_ARGS + ["--data-dir", _small_gsm8k(shared_data, tmp_path / "data", 5), "--test-holdout", "1",
                      "--examples-per-step", "4"]
    with pytest.raises(RequestError, match=r"--max-new-tokens: got 200; accepted: 1\.\.191 \(the room"):
        chat_rl.main([*args, "--max-new-tokens", "200"])
    assert "RL:" not in capsys.readouterr().out   # refused before the banner (and the model load)
    with pytest.raises(RequestError, match=r"--decode graphs: needs a CUDA device, this run's is cpu"):
        chat_rl.main([*args, "--decode", "graphs"])
    assert "RL:" not in capsys.readouterr().out
    out = chat_rl.main([*args, "--eval-examples", "3", "--sample-batch-size", "1"])
    said = capsys.readouterr().out
    # auto on a CPU: eager, said; two calls of one row for the group of two
    assert "  rollouts: decode eager (--decode auto), 2 sampling call(s) of up to 1 rows per problem" in said
    assert "WARNING: --max-new-tokens 4: 1 of the first 4 training prompts" in said
    assert "--eval-examples 3: no effect, --eval-every -1 never evaluates" in said
    assert out["prompts_skipped"] == 1 and '"prompts_skipped": 1' in said


def _rollouts_follow_the_weights(chat_model, decode):
    """A rollout Engine built once (static decoders, CUDA graphs under "graphs") decodes with the
    weights as the optimizer left them (its fused q/k/v copy refreshed): after an in-place update
    its greedy tokens equal a fresh eager Engine's on the new weights (and differ from before)."""
    import torch

    from nanochat.engine import Engine
    trainer, _ = _trainer(chat_model, _len_reward, num_samples=2, decode=decode)
    model, tok = trainer.model, trainer.tokenizer
    prompt = tok.render_for_completion(trainer.task[1])
    greedy = dict(num_samples=2, max_tokens=12, temperature=0.0, seed=1)
    before, _ = trainer.engine.generate_batch(prompt, **greedy)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():   # in place, as MuonAdamW updates parameters
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen).to(p.device, p.dtype)
            p.add_(noise * 0.5 * p.float().std().to(p.dtype))
    after, _ = trainer.engine.generate_batch(prompt, **greedy)
    # the reference reads the live c_q / c_k / c_v (no fused copy that could be stale)
    assert after == Engine(model, tok, fused_qkv=False).generate_batch(prompt, **greedy)[0]
    assert after != before


def test_static_rollouts_follow_in_place_weight_updates(chat_model):
    _rollouts_follow_the_weights(chat_model, "static")


@pytest.mark.cuda
def test_graph_rollouts_follow_in_place_weight_updates(chat_model):
    import copy
    model, tok = chat_model
    _rollouts_follow_the_weights((copy.deepcopy(model).cuda(), tok), "graphs")
