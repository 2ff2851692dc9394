"""Mid / SFT epochs past the first (nanochat/chat_data.py, nanochat/chat_train.py): a run longer
than one epoch read the mixture in the same order every epoch, so its batches repeated. Each epoch
after the first is now a fresh permutation drawn from --seed and the epoch number, the same on every
rank (the ranks still deal every conversation once per epoch); the first epoch reads what it always
did. A run stopped mid-epoch-2 and resumed continues bit for bit, and a checkpoint written before
the reshuffle (its loader state has no epoch_seed) continues in its old order, said in one line.
One tiny base checkpoint per module (tests/test_chat_stage_review.py's)."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from nanochat import checkpoint as ck
from nanochat.chat_data import ChatLoader, epoch_order
from nanochat.errors import RequestError
from tests.test_chat_stage_review import train_tiny_base

TAG = "ep73"


def conv(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


SAME_LENGTH = [conv(f"question {i:02d}", f"answer {i:02d}.") for i in range(12)]   # one conversation per row below
MIXED = [conv(f"q{i} " + "more words " * (i % 4), f"reply {i} " + "and so on " * (i % 3)) for i in range(14)]
# chat_sft's mixture below: larger than the loader's buffer of 32, so its first steps read epoch 0 alone
E2E = [conv(f"q{i} " + "more words " * (i % 4), f"reply {i} " + "and so on " * (i % 3)) for i in range(34)]


def _one_per_row(tok) -> tuple[int, list[list[int]]]:
    """A row length that holds exactly one SAME_LENGTH conversation, and their renderings."""
    ids = [tok.render_conversation(c)[0] for c in SAME_LENGTH]
    seq_len = max(map(len, ids))
    assert 2 * min(map(len, ids)) > seq_len + 1 and len({tuple(i) for i in ids}) == len(ids)
    return seq_len, ids


def _read_order(tok, rows: int, **kw) -> list[int]:
    """The SAME_LENGTH indices of the first `rows` rows of a looping loader (buffer 1, one per row)."""
    seq_len, ids = _one_per_row(tok)
    loader = ChatLoader(SAME_LENGTH, tok, 1, seq_len, mask="all", fill="pad", buffer_size=1, **kw)
    got = []
    for _ in range(rows):
        x, _ = next(loader)
        row = x[0].tolist()
        got.append(next(i for i, r in enumerate(ids) if row[:len(r) - 1] == r[:-1]))
    return got


def test_each_epoch_is_a_fresh_permutation_dealt_once_across_ranks(tiny_tokenizer):
    """Epoch 0 in the task's own order (as before), every later epoch another permutation drawn
    from (seed, epoch): epoch e of rank r reads epoch_order(n, seed, e) at r, r + W, ..., so the
    ranks together read each conversation exactly once per epoch, and no two epochs alike."""
    n = len(SAME_LENGTH)
    whole = _read_order(tiny_tokenizer, 4 * n)
    epochs = [whole[e * n:(e + 1) * n] for e in range(4)]
    assert epochs[0] == list(range(n))   # the first epoch is unchanged from before the reshuffle
    assert all(sorted(order) == list(range(n)) for order in epochs)
    assert len({tuple(order) for order in epochs}) == 4   # the batches no longer repeat epoch after epoch
    assert epochs == [epoch_order(n, 42, e) for e in range(4)]
    other = _read_order(tiny_tokenizer, 2 * n, seed=7)
    assert other[:n] == epochs[0] and other[n:] != epochs[1] and other[n:] == epoch_order(n, 7, 1)
    # three ranks: rank r's k-th row is position r + 3k; per epoch the ranks' rows are the epoch's order
    per_rank = [_read_order(tiny_tokenizer, n, rank=r, world_size=3) for r in range(3)]
    for e in range(3):
        dealt = collections.Counter(per_rank[r][k] for r in range(3) for k in range(e * n // 3, (e + 1) * n // 3))
        assert dealt == collections.Counter(range(n))   # disjoint and complete
        assert [per_rank[p % 3][p // 3] for p in range(e * n, (e + 1) * n)] == epochs[e]
    # the order is a pure function of (n, seed, epoch): another process draws the same one
    assert epoch_order(1000, 42, 3) == epoch_order(1000, 42, 3) != epoch_order(1000, 42, 2)
    assert epoch_order(5, 42, 0) == [0, 1, 2, 3, 4]


def test_a_state_anywhere_in_epoch_two_continues_bit_for_bit(tiny_tokenizer):
    """Packed rows (best fit from a buffer of 4, conversations of several lengths), states taken at
    every batch through epoch 3 (buffers that straddle two epochs included), JSON round-tripped:
    a loader loaded from one continues with exactly the batches the uninterrupted one made."""
    def loader(**kw):
        return ChatLoader(MIXED, tiny_tokenizer, 2, 48, mask="assistant", fill="pad", buffer_size=4, **kw)

    for rank, world in ((0, 1), (1, 2)):
        a = loader(rank=rank, world_size=world)
        states, batches = [], []
        while a.epoch < 4:
            states.append(json.loads(json.dumps(a.state_dict())))
            batches.append(next(a))
        epoch_of = [s["pos"] // len(MIXED) for s in states]   # the epoch it reads (its buffer may hold older ones)
        assert 2 in epoch_of and all(s["epoch_seed"] == 42 for s in states)
        straddling = [k for k, s in enumerate(states) if len({p // len(MIXED) for p in [s["pos"], *s["buffer"]]}) > 1]
        assert straddling
        for k in [k for k, e in enumerate(epoch_of) if e == 2] + straddling:
            b = loader(rank=rank, world_size=world)
            b.load_state_dict(states[k])
            for j in range(k, min(k + 4, len(batches))):
                x, y = next(b)
                assert torch.equal(x, batches[j][0]) and torch.equal(y, batches[j][1])
    with pytest.raises(ValueError, match=r"--seed: the loader state's epochs were shuffled with --seed 42; "
                                         r"this run's is 7"):
        loader(seed=7, rank=1, world_size=2).load_state_dict(states[3])


def test_a_state_from_before_the_reshuffle_keeps_its_runs_order(tiny_tokenizer):
    """A loader state as the code before the reshuffle wrote it (no epoch_seed): its run read every
    epoch in the task's order, and a resume continues that order bit for bit, not a reshuffled one
    (which would read some conversations twice in the epoch it is in and skip others); the state it
    saves says so (epoch_seed None), so a later resume keeps the order too."""
    n = len(SAME_LENGTH)
    assert _read_order(tiny_tokenizer, 3 * n, seed=None) == list(range(n)) * 3   # the old order: repeated

    def loader(**kw):
        return ChatLoader(MIXED, tiny_tokenizer, 2, 48, mask="assistant", fill="pad", buffer_size=4, **kw)

    old = loader(seed=None)
    while old.epoch < 1 or old.pos % len(MIXED) < len(MIXED) // 2:   # stopped in the middle of epoch 1
        next(old)
    state = old.state_dict()
    assert state.pop("epoch_seed") is None
    want = [next(old) for _ in range(12)]
    assert old.epoch >= 2
    resumed = loader()   # the new code's default: reshuffled epochs
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert resumed.seed is None
    got = [next(resumed) for _ in range(6)]
    again = loader()
    again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    got += [next(again) for _ in range(6)]
    assert all(torch.equal(x, wx) and torch.equal(y, wy) for (x, y), (wx, wy) in zip(got, want))
    assert again.state_dict() == {**old.state_dict()}


def test_reshuffled_epochs_stop_on_replies_cut_off_only_when_none_trains(tiny_tokenizer):
    """Mask "assistant": a loop that skipped `limit` conversations in a row (their prompt fills the
    row) raised, since with one order a rank then meets the same ones forever. Reshuffled epochs can
    put one trainable conversation first in an epoch and last in the next, more than `limit` skips
    apart: it raised though that one trains. Now it raises once every conversation was skipped."""
    long_prompt = [conv("tell me " * 40 + str(i), f"no room {i}") for i in range(3)]
    task = [conv("hi", "hello there.")] + long_prompt
    loader = ChatLoader(task, tiny_tokenizer, 1, 16, mask="assistant", fill="pad", buffer_size=1)
    rows = [next(loader) for _ in range(40)]   # 40 epochs, each trains its one row
    assert all((y >= 0).any() for _, y in rows) and loader.skipped >= 3 * 39
    gaps = [epoch_order(4, 42, e + 1).index(0) + 3 - epoch_order(4, 42, e).index(0) for e in range(39)]
    assert max(gaps) >= 4   # skips in a row between two trained rows: as many as the mixture holds
    with pytest.raises(RequestError, match=r"--max-seq-len 16: 3 conversations in a row had no assistant token .*"
                                           r"so none of the mixture's trains anything"):
        next(ChatLoader(long_prompt, tiny_tokenizer, 1, 16, mask="assistant", buffer_size=1, rank=1, world_size=2))


# ------------------------------------------------------------------ end to end: chat_sft on CPU

@pytest.fixture(scope="module")
def base_ckpt(base_dir, tiny_corpus):
    return train_tiny_base(base_dir, tiny_corpus, TAG)


@pytest.fixture
def tiny_mixture(env, base_ckpt, monkeypatch):
    """chat_sft trains on E2E alone (a mixture of 34 conversations: ~7 steps an epoch below), shuffled
    by --seed as build_mixture's; its validation mixture is the real one."""
    from nanochat import chat_data
    from nanochat.tasks.common import Task, TaskMixture

    class Mixed(Task):
        def num_examples(self):
            return len(E2E)

        def get_example(self, index):
            return E2E[index]

    real = chat_data.build_mixture

    def build(stage, split, **kw):
        return TaskMixture([Mixed()], seed=kw.get("seed", 42)) if split == "train" else real(stage, split, **kw)
    monkeypatch.setattr(chat_data, "build_mixture", build)
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "sft")   # no "next" lines
    return base_ckpt


ARGS = ["--device", "cpu", "--source", "base", "--model-tag", TAG, "--max-seq-len", "64", "--device-batch-size", "2",
        "--total-batch-size", "128", "--test-holdout", "50", "--eval-every", "-1", "--num-iterations", "18",
        "--save-every", "16", "--no-compile"]
LATER = (16, 17)   # the steps a resume at step 16 runs


def test_sft_stopped_in_epoch_two_resumes_bit_for_bit(tiny_mixture):
    """18 steps of 2 rows over a mixture of ~14 rows (~2.6 epochs), saved at step 16 (in epoch 2) and
    resumed there: the resumed steps' losses and final weights are the uninterrupted run's."""
    from scripts import chat_sft
    whole = chat_sft.main(ARGS + ["--overwrite"])
    d = ck.checkpoint_dir("sft", TAG)
    assert ck.read_meta(d, 18)["train"]["epoch_order"] == "reshuffled" and 2.5 < whole["epochs"] < 3
    state = ck.load_checkpoint(d, 16)["loader"]
    assert state["epoch_seed"] == 42 and 2 * len(E2E) < state["conversations_used"] < 3 * len(E2E)
    final = ck.load_checkpoint(d, 18)["model"]
    resumed = chat_sft.main(ARGS + ["--resume", "16"])
    assert sorted(resumed["losses"]) == list(LATER)
    assert [resumed["losses"][s] for s in LATER] == [whole["losses"][s] for s in LATER]
    again = ck.load_checkpoint(d, 18)["model"]
    assert all(torch.equal(v, again[k]) for k, v in final.items())


def test_a_checkpoint_from_before_the_reshuffle_continues_in_its_order(tiny_mixture, monkeypatch, capsys):
    """A run of the code before the reshuffle (every epoch in one order; no epoch_seed in its loader
    state) saved at step 9 (in epoch 1) and resumed by this code: the resumed steps are that run's
    own, bit for bit, and one line says why its epochs repeat. Its first step is the new code's too
    (later ones differ earlier than epoch 1: the loader's buffer of 32 reads ahead into it)."""
    from nanochat import chat_data
    from scripts import chat_sft

    class Before(ChatLoader):   # the loader as it was: epoch 0's order every epoch, a state without epoch_seed
        def __init__(self, *a, **kw):
            super().__init__(*a, **{**kw, "seed": None})

        def state_dict(self):
            state = super().state_dict()
            del state["epoch_seed"]
            return state

    args = [*ARGS, "--num-iterations", "11", "--save-every", "9"]   # the later flags win
    new = chat_sft.main(args + ["--overwrite"])
    with monkeypatch.context() as mp:
        mp.setattr(chat_data, "ChatLoader", Before)
        old = chat_sft.main(args + ["--overwrite"])
    d = ck.checkpoint_dir("sft", TAG)
    assert "epoch_seed" not in ck.load_checkpoint(d, 9)["loader"]
    assert old["losses"][0] == new["losses"][0]   # the first epoch's batches are as they were
    assert [old["losses"][s] for s in (9, 10)] != [new["losses"][s] for s in (9, 10)]
    capsys.readouterr()
    resumed = chat_sft.main(args + ["--resume", "9"])
    assert sorted(resumed["losses"]) == [9, 10]
    assert [resumed["losses"][s] for s in (9, 10)] == [old["losses"][s] for s in (9, 10)]
    assert f"note: {d / 'step_000009'} was saved before mid / SFT reshuffled each epoch: this run keeps its " \
           "order" in capsys.readouterr().out
    assert ck.load_checkpoint(d, 11)["loader"]["epoch_seed"] is None   # a later resume keeps the order too
    assert ck.read_meta(d, 11)["train"]["epoch_order"] == "repeated"
