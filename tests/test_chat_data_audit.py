"""Audit of the mid-training / SFT data path (nanochat/chat_data.py, nanochat/chat_train.py):
targets stay aligned with the loss mask when a row cuts a conversation; SFT skips conversations
whose reply a long prompt pushes out of the row (they made steps of no target: a logged loss of 0,
an evaluation with nothing to score) and refuses, before the model loads, a --max-seq-len at which
nothing (or nothing of an --extra-conversations file) would train; ranks deal every trainable
conversation exactly once; a resumed loader continues bit for bit, its row-fill figure included;
--seed is bounded by what torch takes; and chat_sft resumes end to end on the exact next batch.
Fixtures (tokenizer, base dir, env): tests/conftest.py."""

from __future__ import annotations

import collections
import json
import re

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat.chat_data import ChatLoader, check_replies_fit, estimate_epoch_rows, trainable_share
from nanochat.errors import RequestError


def conv(user: str, reply) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


SHORT = [conv(f"q{i}", f"answer number {i}.") for i in range(9)]
LONG_PROMPT = [conv("tell me " * 40 + str(i), f"no room {i}") for i in range(4)]   # ~80+ prompt tokens


def _targets_of(ids, mask):
    """What the loader must produce for one row: the next token where it is trained, else -1."""
    return [ids[t + 1] if mask[t + 1] else -1 for t in range(len(ids) - 1)]


# ------------------------------------------------------------------ mask alignment under truncation

def test_a_conversation_cut_by_the_row_keeps_targets_aligned_with_the_mask(tiny_tokenizer):
    """A reply straddling the row's end: every target is the next token exactly where the mask
    trains it (shifted by one), the tool output inside stays untrained, nothing past the row leaks."""
    c = conv("Compute this for me please.", [{"type": "text", "text": "Sure, let me run it: "},
                                            {"type": "python", "text": "12*12"},
                                            {"type": "python_output", "text": "144"},
                                            {"type": "text", "text": " so the answer is 144, a long reply."}])
    ids, mask = tiny_tokenizer.render_conversation(c, max_tokens=10**6)
    start, end = (ids.index(tiny_tokenizer.encode_special(f"<|output_{s}|>")) for s in ("start", "end"))
    seq_len = end + 3   # the row ends a few tokens into the reply that follows the tool output
    assert seq_len + 1 < len(ids)
    for mode in ("assistant", "all"):
        x, y = next(ChatLoader([c], tiny_tokenizer, 1, seq_len, mask=mode, fill="pad", buffer_size=1))
        m = mask if mode == "assistant" else [1] * len(ids)
        assert x[0].tolist() == ids[:seq_len]
        assert y[0].tolist() == _targets_of(ids[:seq_len + 1], m[:seq_len + 1])
    assert (y[0] >= 0).all()   # mask "all": every position of the cut row trains
    _, y = next(ChatLoader([c], tiny_tokenizer, 1, seq_len, mask="assistant", buffer_size=1))
    # the user turn and <|assistant_start|> never; the python call (up to <|python_end|>) yes; the
    # tool output (<|output_start|> .. <|output_end|>) never; the text after it yes, up to the cut
    first = next(k for k in range(1, len(mask)) if mask[k])
    assert (y[0, :first - 1] == -1).all() and (y[0, first - 1:start - 1] >= 0).all()
    assert (y[0, start - 1:end] == -1).all() and (y[0, end:] >= 0).all()


# ------------------------------------------------------------------ replies cut off by their prompt

def test_sft_rows_skip_conversations_whose_reply_is_cut_off(tiny_tokenizer):
    """Long-prompt conversations at a short row had no trained token: packed anyway they made rows
    (and whole micro-batches) of target -1 only, a step loss of exactly 0 in the log. Now they are
    skipped and counted; every row trains something; mid's mask "all" still packs them."""
    task = [c for pair in zip(SHORT, LONG_PROMPT + SHORT[:5]) for c in pair]   # interleaved, 18 conversations
    seq_len = 32
    cut = [i for i, c in enumerate(task) if not any(tiny_tokenizer.render_conversation(c, seq_len + 1)[1][1:])]
    assert len(cut) == len(LONG_PROMPT)
    loader = ChatLoader(task, tiny_tokenizer, 2, seq_len, mask="assistant", fill="pad", buffer_size=3, loop=False)
    batches = list(loader)
    assert all(((y >= 0).sum(dim=1) > 0).all() for x, y in batches[:-1])   # the last batch may pad whole rows
    assert loader.skipped == len(cut) and loader.conversations_used == len(task) - len(cut)
    assert loader.state_dict()["skipped"] == len(cut)
    # the epoch estimate follows the loader (rows of skipped conversations are not counted)
    rows = estimate_epoch_rows(task, tiny_tokenizer, seq_len, mask="assistant", fill="pad")
    assert rows == sum(1 for _, y in batches for r in y if (r >= 0).any())
    mid = ChatLoader(task, tiny_tokenizer, 2, seq_len, mask="all", fill="crop", loop=False)
    list(mid)
    assert mid.skipped == 0 and mid.conversations_used >= len(task)
    reach = trainable_share(task, tiny_tokenizer, seq_len)
    assert (reach.probed, reach.cut, reach.first_cut) == (len(task), len(cut), cut[0]) and reach.need <= seq_len


def test_a_stream_of_nothing_but_cut_replies_stops_with_the_flag(tiny_tokenizer):
    """Every conversation cut: the looping loader raised nothing and served target-free batches
    forever; now it names --max-seq-len once it has read a whole cycle of them."""
    loader = ChatLoader(LONG_PROMPT, tiny_tokenizer, 2, 16, mask="assistant", fill="pad", rank=1, world_size=2)
    with pytest.raises(RequestError, match=r"--max-seq-len 16: 4 conversations in a row had no assistant token "
                                           r"within a row of 17 tokens"):
        next(loader)
    assert list(ChatLoader(LONG_PROMPT, tiny_tokenizer, 2, 16, loop=False)) == []   # finite: simply empty


def test_ranks_deal_each_trainable_conversation_once_and_resume_exactly(tiny_tokenizer):
    """3 ranks, 17 conversations (4 of them cut): every trainable one lands in exactly one rank's
    rows per epoch, whole; a state taken before any batch of a looping stream (epoch boundaries
    and skips included) continues bit for bit, with the run's row fill and skip count."""
    task = SHORT + LONG_PROMPT + SHORT[:4]
    seq_len, bos = 40, tiny_tokenizer.bos_token_id
    want = collections.Counter(tuple(tiny_tokenizer.render_conversation(c)[0]) for c in task
                               if any(tiny_tokenizer.render_conversation(c, seq_len + 1)[1][1:]))
    got = collections.Counter()
    for rank in range(3):
        for x, y in ChatLoader(task, tiny_tokenizer, 2, seq_len, rank=rank, world_size=3, buffer_size=3, loop=False):
            full = torch.cat([x, torch.full_like(x[:, :1], bos)], dim=1)   # the row's last token is never an input
            for row in full.tolist():
                starts = [k for k, t in enumerate(row) if t == bos] + [len(row)]
                got.update(tuple(row[a:b]) for a, b in zip(starts, starts[1:]) if b - a > 1)
    assert got == want

    a = ChatLoader(task, tiny_tokenizer, 2, seq_len, rank=2, world_size=3, buffer_size=3)
    states, batches = [], []
    for _ in range(24):   # rank 2 of 3 reads ~6 conversations an epoch: several epochs
        states.append(json.loads(json.dumps(a.state_dict())))
        batches.append(next(a))
    assert a.epoch >= 3 and a.skipped > 0
    for k in (0, 5, 11, 17):
        b = ChatLoader(task, tiny_tokenizer, 2, seq_len, rank=2, world_size=3, buffer_size=3)
        b.load_state_dict(states[k])
        for j in range(k, min(k + 6, len(batches))):
            x, y = next(b)
            assert torch.equal(x, batches[j][0]) and torch.equal(y, batches[j][1])
    b = ChatLoader(task, tiny_tokenizer, 2, seq_len, rank=2, world_size=3, buffer_size=3)
    b.load_state_dict(states[17])
    for _ in range(17, 24):
        next(b)
    assert b.fill_fraction == a.fill_fraction and b.skipped == a.skipped   # was the tail's fill alone


def _short_task():
    """SHORT as a Task (a mixture's member)."""
    from nanochat.tasks.common import Task

    class Short(Task):
        def num_examples(self):
            return len(SHORT)

        def get_example(self, i):
            return SHORT[i]
    return Short()


def _first_trained(tokenizer, c) -> int:
    _, mask = tokenizer.render_conversation(c, max_tokens=10**6)
    return next(k for k in range(1, len(mask)) if mask[k])


def test_replies_that_never_fit_are_refused_naming_flag_file_and_line(tiny_tokenizer, tmp_path, capsys):
    from nanochat.tasks import ConversationFile, TaskMixture
    own = tmp_path / "own.jsonl"
    own.write_text("\n".join(json.dumps(c) for c in LONG_PROMPT[:2]) + "\n\n" + json.dumps(SHORT[0]) + "\n")
    mix = TaskMixture([_short_task()], seed=1)
    with_file = TaskMixture([*mix.tasks, ConversationFile(own)], seed=1)
    said = check_replies_fit(with_file, mix, tiny_tokenizer, 32)   # 2 of the file's 3 rows are cut
    assert said == [f"WARNING: --max-seq-len 32: 2 of the first {len(with_file)} training conversations have their "
                    "reply cut off by the prompt; such conversations are skipped (they train nothing)",
                    f"WARNING: --extra-conversations {own}:1: its reply starts past a row of 33 tokens (--max-seq-len "
                    "32); it and 1 more of the first 3 conversations of the file are skipped (they would train "
                    "nothing)"]
    assert said[1] in capsys.readouterr().out
    own.write_text("\n\n" + "\n".join(json.dumps(c) for c in LONG_PROMPT) + "\n")   # every row cut; line 3 first
    need = min(_first_trained(tiny_tokenizer, c) for c in LONG_PROMPT)
    where = re.escape(f"--extra-conversations {own}:3")
    with pytest.raises(RequestError, match=rf"^{where}: no conversation of the file .* "
                                           rf"--max-seq-len: got 32; accepted: >= {need} for this file$"):
        check_replies_fit(TaskMixture([*mix.tasks, ConversationFile(own)], seed=1), mix, tiny_tokenizer, 32)
    cut_only = TaskMixture([ConversationFile(own)], seed=1)
    with pytest.raises(RequestError, match=rf"--max-seq-len: got 32; accepted: >= {need} for this mixture: none of "
                                           r"the first 4 validation conversations .* so SFT would score nothing"):
        check_replies_fit(mix, cut_only, tiny_tokenizer, 32)
    assert check_replies_fit(mix, mix, tiny_tokenizer, 32) == []


def test_chat_sft_refuses_an_extra_file_that_would_train_nothing_before_the_model_loads(env, base_dir, tmp_path,
                                                                                         monkeypatch):
    """The user's own conversations whose prompts fill --max-seq-len trained on nothing, silently:
    now one line naming the file, its line and the flag, before the model loads."""
    from scripts import chat_sft
    ck.save_checkpoint(ck.checkpoint_dir("base", "reach", base_dir), 1, model_state={},
                       meta={"model_config": {"sequence_len": 64}})

    def too_late(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")
    monkeypatch.setattr(ck, "load_model", too_late)
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps(conv("tell me " * 80 + str(i), "ok")) + "\n" for i in range(3)))
    with pytest.raises(RequestError, match=re.escape(f"--extra-conversations {own}:1: no conversation of the file")):
        chat_sft.main(["--device", "cpu", "--source", "base", "--model-tag", "reach", "--no-compile",
                       "--test-holdout", "50", "--extra-conversations", str(own)])


# ------------------------------------------------------------------ the user's own files

@pytest.mark.parametrize("row, problem", [
    ({"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]},
     r"messages\[0\]\.content must be a string or a list of parts"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
     r"messages\[1\]\.content must be a string"),
    ({"messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]}, r"messages\[0\]\.role is None"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
     r"messages\[1\] is an empty assistant reply"),
    ([{"role": "user", "content": "hi"}], r"'messages' must be a non-empty list"),
])
def test_a_bad_row_of_the_users_file_names_file_and_line(tmp_path, row, problem):
    from nanochat.errors import DataError
    from nanochat.tasks import ConversationFile
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps(SHORT[0]) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=rf"^--extra-conversations {re.escape(str(own))}:3: {problem}"):
        ConversationFile(own)


# ------------------------------------------------------------------ flags

@pytest.mark.parametrize("script", ["mid_train", "chat_sft"])
def test_a_seed_torch_cannot_take_is_refused_at_parse(script):
    """--seed 2**64 passed validation and died in torch.manual_seed with a traceback."""
    import importlib
    parse = importlib.import_module(f"scripts.{script}").parse
    assert parse(["--seed", str(2**64 - 1)]).seed == 2**64 - 1
    with pytest.raises(ValueError, match=r"^--seed: got 18446744073709551616; accepted: an integer >= 0 and < 2\*\*64"):
        parse(["--seed", str(2**64)])


# ------------------------------------------------------------------ chat_sft end to end

TINY_BASE = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
             "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "L", "--sample-every", "-1",
             "--eval-every", "-1", "--no-compile", "--model-tag", "audit", "--num-iterations", "1"]


def test_chat_sft_resumes_on_the_exact_next_batch(env, capsys):
    """SFT (token-weighted loss over 11 accumulated micro-batches, padded rows, skipped cut replies)
    stopped at step 1 and resumed: the same losses, val bpb and summary figures (row fill, skips)
    as one run. --total-batch-size -1 with 3-row micro-batches: the banner said "32 rows" while
    the step trained 33."""
    from scripts import base_train, chat_sft
    base_train.main(TINY_BASE + env)
    args = ["--device", "cpu", "--source", "base", "--model-tag", "audit", "--device-batch-size", "3",
            "--max-seq-len", "48", "--test-holdout", "20", "--eval-every", "2", "--eval-tokens", "288",
            "--no-compile", "--num-iterations", "2", "--save-every", "1"]
    whole = chat_sft.main(args)
    out = capsys.readouterr().out
    assert "training conversations have their reply cut off by the prompt" in out and whole["conversations_skipped"] > 0
    assert ("--total-batch-size -1: the sft step of 32 rows, rounded up to 33 rows (whole micro-batches on every "
            "rank) on any number of GPUs") in out and "x 11 micro-batch(es)" in out
    resumed = chat_sft.main(args + ["--resume", "1"])
    assert resumed["losses"] == {1: whole["losses"][1]} and resumed["final_val_bpb"] == whole["final_val_bpb"]
    assert [resumed[k] for k in ("row_fill", "conversations_skipped")] == [whole[k] for k in ("row_fill",
                                                                                          "conversations_skipped")]
    assert all(v > 0 for v in whole["losses"].values())
