"""RL review 10 (nanochat/rl.py, scripts/chat_rl.py) on CPU: a resume past --num-iterations is refused
before any weights load, and a rollout through the real Engine's calculator state machine trains
only the tokens the policy sampled (the forced tool output is context, never a target) and earns
its reward from the answer text and the calculator's output, never from text hidden in the python
source."""

from __future__ import annotations

import pytest
import torch

from tests.test_engine import tiny_chat_model
from tests.test_rl import _trainer


@pytest.fixture(scope="module")
def chat_model(tiny_corpus):
    return tiny_chat_model(str(tiny_corpus))   # cached: the same model as test_engine's (never modified here)


def test_a_resume_past_num_iterations_is_refused_before_the_weights_load(sft_checkpoint, chat_model, monkeypatch):
    """check_resume_step says "before anything is built": chat_rl ran it after load_checkpoint read
    every rank's weights and optimizer state (GBs at d20) and model_from_meta built the model."""
    import nanochat.checkpoint as checkpoint
    from nanochat.checkpoint_io import CheckpointError
    from scripts import chat_rl
    args = ["--device", "cpu", "--model-tag", "d2", "--examples-per-step", "1", "--num-samples", "2",
            "--max-new-tokens", "4", "--test-holdout", "1", "--eval-every", "-1", "--save-every", "1",
            "--num-iterations", "2"]
    chat_rl.main(args)   # rl checkpoints at steps 1 and 2

    def no_load(*a, **k):
        raise AssertionError("the checkpoint's weights were loaded before the resume was refused")

    monkeypatch.setattr(checkpoint, "load_checkpoint", no_load)
    monkeypatch.setattr(checkpoint, "model_from_meta", no_load)
    for resume in ("latest", "auto"):
        with pytest.raises(CheckpointError, match=r"at step 2, past --num-iterations 1; .*earlier step \(\[1\]\)"):
            chat_rl.main(args[:-1] + ["1", "--resume", resume])


def _scripted_sampler(script: list[list[int]], prompt_len: int):
    """A stand-in for the Engine's Sampler: row i 'samples' script[i][position - prompt_len] (what a
    forced step draws is ignored by the Engine's tool state machine, so the script holds 0 there)."""

    class Scripted:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, logits, position):
            return torch.tensor([row[position - prompt_len] for row in script])

    return Scripted


class _GoldTask:
    """One problem whose gold answer is 18, rewarded by GSM8K's own reward."""

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return {"messages": [{"role": "user", "content": "What is 9 times 2?"},
                             {"role": "assistant", "content": "9*2 = 18\n#### 18"}], "answer": "18"}

    def reward(self, conversation, completion):
        from nanochat.tasks import GSM8K
        return GSM8K.reward(object.__new__(GSM8K), conversation, completion)   # its reward, no data file read


def test_forced_tool_output_is_context_not_a_target_and_the_python_source_earns_nothing(chat_model, monkeypatch):
    import nanochat.engine as engine_module
    from nanochat.calculator import REFUSED_OUTPUT
    model, tok = chat_model
    sp = tok.encode_special
    start, end, out_start, out_end, stop = (sp("<|python_start|>"), sp("<|python_end|>"), sp("<|output_start|>"),
                                            sp("<|output_end|>"), sp("<|assistant_end|>"))
    result = tok.encode("18")
    forced = [out_start, *result, out_end]
    refused = [out_start, *tok.encode(REFUSED_OUTPUT), out_end]   # calculator.REFUSED_OUTPUT (review 13)
    calls = [
        tok.encode("#### ") + [start, *tok.encode("9*2"), end] + [0] * len(forced) + [stop],   # the calculator answers
        [start, *tok.encode("#### 18"), end] + [0] * len(refused) + [stop],   # the answer inside the source: refused
        tok.encode("#### 17") + [stop],
        tok.encode("#### 18") + [stop],
    ]
    width = max(map(len, calls))
    script = [row + [stop] * (width - len(row)) for row in calls]
    trainer, _ = _trainer(chat_model, None, task=_GoldTask(), examples_per_step=1, max_new_tokens=width)
    prompt = tok.render_for_completion(trainer.task[0])
    monkeypatch.setattr(engine_module, "Sampler", _scripted_sampler(script, len(prompt)))
    seqs, masks, advantages, rewards = trainer._rollout(0, trainer.task[0], prompt, width)
    assert rewards == [1.0, 0.0, 0.0, 1.0] and advantages == [0.5, -0.5, -0.5, 0.5]
    # row 0: the Engine forced <|output_start|> 18 <|output_end|> (mask 0), the rest was sampled (mask 1)
    gen0 = seqs[0][len(prompt):]
    at = gen0.index(end) + 1
    assert gen0[at:at + len(forced)] == forced and gen0[-1] == stop
    assert masks[0][len(prompt):] == [1] * at + [0] * len(forced) + [1]
    # row 1: a refused call gets a forced block of REFUSED_OUTPUT; its "#### 18" was python source, not an answer
    n = len(refused) + 1
    assert seqs[1][len(prompt):][-n:] == refused + [stop] and masks[1][-n:] == [0] * len(refused) + [1]
    # the policy-gradient targets: exactly the sampled tokens (stop included), never prompt or forced ones
    from nanochat.rl import rollout_batch
    inputs, targets, _ = rollout_batch(seqs, masks, advantages, tok.bos_token_id, "cpu")
    for row, (seq, mask) in enumerate(zip(seqs, masks)):
        want = [t if m else -1 for t, m in zip(seq[1:], mask[1:])]
        assert targets[row, :len(want)].tolist() == want
        assert (targets[row, len(want):] == -1).all()
        assert inputs[row, :len(seq) - 1].tolist() == seq[:-1]
    assert not any(t in forced for t in targets[0].tolist() if t >= 0)
