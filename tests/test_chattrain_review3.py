"""Third review of conversation training (mid_train, chat_sft) on CPU: a missing local test file
under --test-holdout N is said as missing (not "pass --test-holdout N", already passed); a resume
with another --max-seq-len names --max-seq-len (not --total-batch-size, which follows it); the run
summary's row fill and skip count are those of the batches trained (not of one prefetched past the
last step); the banner says "eval off" for --eval-every -1.
Fixtures (tokenizer, base dir, env, offline data): tests/conftest.py."""

from __future__ import annotations

import json

import pytest

from nanochat import checkpoint as ck
from nanochat.checkpoint_io import CheckpointError
from nanochat.errors import MissingDataError


# ------------------------------------------------------------------ a missing test file under --test-holdout

def test_a_missing_test_file_under_test_holdout_is_named_missing_not_a_flag_to_pass(shared_data, tmp_path):
    """chat_sft --test-holdout 100 with no local gsm8k test file said "no train split is available;
    pass --test-holdout N to train on the local test files ..." -- the flag the user had passed."""
    from nanochat.chat_data import build_mixture
    root = tmp_path / "data"
    for sub in ("eval", "sft", "words"):
        (root / sub).mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
            for i in range(4)]
    (root / "sft" / "mine.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("arc_easy", "arc_challenge"):
        lines = (shared_data / "eval" / f"{name}.jsonl").read_text().splitlines(keepends=True)[:12]
        (root / "eval" / f"{name}.jsonl").write_text("".join(lines))
    (root / "words" / "words.txt").write_text("cat\ndog\nbird\n")
    with pytest.raises(MissingDataError) as info:
        build_mixture("sft", "train", data_dir=root, test_holdout=5)
    text = str(info.value)
    assert "gsm8k" in text and "--test-holdout 5: trains on this local test file" in text
    assert "pass --test-holdout N" not in text and "--data-dir" in text
    with pytest.raises(MissingDataError, match="pass --test-holdout N"):   # no holdout: the hint still says it
        build_mixture("sft", "train", data_dir=root)


# ------------------------------------------------------------------ chat_sft end to end

TINY_BASE = ["--device", "cpu", "--depth", "1", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
             "--device-batch-size", "2", "--total-batch-size", "128", "--window-pattern", "L", "--sample-every", "-1",
             "--eval-every", "-1", "--no-compile", "--model-tag", "rv3", "--num-iterations", "1"]


def test_sft_summary_counts_what_trained_and_a_resume_names_max_seq_len(env, capsys):
    """The summary's row fill and conversations_skipped counted the micro-batch the trainer
    prefetches past the last step (never trained): they now equal the last checkpoint's loader
    state. Resuming with another --max-seq-len failed with "the checkpoint has --total-batch-size
    2048 but this run has 1024" (the -1 step is 32 rows of --max-seq-len): it names --max-seq-len."""
    from scripts import base_train, chat_sft
    base_train.main(TINY_BASE + env)
    args = ["--device", "cpu", "--source", "base", "--model-tag", "rv3", "--device-batch-size", "8",
            "--test-holdout", "20", "--eval-every", "-1", "--no-compile", "--num-iterations", "1"]
    summary = chat_sft.main(args)
    assert "; eval off; device cpu" in capsys.readouterr().out
    ckpt_dir = ck.checkpoint_dir("sft", "rv3")
    state = ck.load_checkpoint(ckpt_dir, 1, device="cpu", rank=0, load_optimizer=False)["loader"]
    assert summary["conversations_skipped"] == state["skipped"] > 0
    assert summary["conversations_truncated"] == state["truncated"]
    assert summary["row_fill"] == round(state["tokens_real"] / state["tokens_total"], 4)
    assert state["tokens_total"] == 32 * 65   # 1 step of 32 rows of 64 + 1 tokens (4 micro-batches of 8)
    with pytest.raises(CheckpointError, match=r"rows of --max-seq-len 64, this run's are 32"):
        chat_sft.main(args[:-1] + ["2", "--resume", "latest", "--max-seq-len", "32"])


# ------------------------------------------------------------------ conversations longer than a row

def _conv(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def test_conversations_longer_than_a_row_are_counted_and_said(tiny_tokenizer, capsys):
    """A conversation longer than --max-seq-len + 1 tokens was cut at the row's end in silence (SFT
    trained the start of its reply and never its end): only the ones skipped were counted. Now the
    start says how many of the first conversations are that long and the loader counts them (its
    state, so a resume keeps the count; the summary's conversations_truncated)."""
    from nanochat.chat_data import ChatLoader, check_replies_fit
    from nanochat.tasks import TaskMixture
    from nanochat.tasks.common import Task

    class Listed(Task):
        def __init__(self, rows):
            super().__init__()
            self.rows = rows

        def num_examples(self):
            return len(self.rows)

        def get_example(self, i):
            return self.rows[i]

    seq_len = 32
    short = [_conv(f"q{i}", f"a{i}.") for i in range(6)]
    long = [_conv(f"q{i}", "and so it goes on " * 12) for i in range(3)]   # ~60+ tokens of reply
    task = [c for pair in zip(short, long + short[:3]) for c in pair]
    assert all(len(tiny_tokenizer.render_conversation(c, 10**6)[0]) > seq_len + 1 for c in long)
    assert all(len(tiny_tokenizer.render_conversation(c, 10**6)[0]) <= seq_len + 1 for c in short)
    for mask, fill in (("assistant", "pad"), ("all", "crop")):
        whole = ChatLoader(task, tiny_tokenizer, 2, seq_len, mask=mask, fill=fill, buffer_size=2, loop=False)
        list(whole)
        assert whole.truncated == len(long) and whole.state_dict()["truncated"] == len(long)
        first = ChatLoader(task, tiny_tokenizer, 2, seq_len, mask=mask, fill=fill, buffer_size=2, loop=False)
        next(first)
        rest = ChatLoader(task, tiny_tokenizer, 2, seq_len, mask=mask, fill=fill, buffer_size=2, loop=False)
        rest.load_state_dict(first.state_dict())
        list(rest)
        assert rest.truncated == len(long)
    mix = TaskMixture([Listed(task)], seed=1)
    said = check_replies_fit(mix, TaskMixture([Listed(short)], seed=1), tiny_tokenizer, seq_len)
    assert said == [f"WARNING: --max-seq-len {seq_len}: {len(long)} of the first {len(task)} training conversations "
                    f"are longer than a row of {seq_len + 1} tokens; they train up to the row's end (the rest of the "
                    "reply is not trained)"]
    assert said[0] in capsys.readouterr().out


# ------------------------------------------------------------------ no source checkpoint

def test_a_missing_source_offers_only_sources_the_stage_takes(tmp_path):
    """mid_train without a base checkpoint ended "..., or pick another --source", and mid_train
    takes --source base only; chat_sft's names the other source it takes."""
    from nanochat.chat_start import resolve_source
    with pytest.raises(CheckpointError) as e:
        resolve_source("mid", "base", None, tmp_path)
    assert str(e.value).endswith("create it with `python -m scripts.base_train --model-tag <tag>`")
    with pytest.raises(CheckpointError) as e:
        resolve_source("sft", "mid", None, tmp_path)
    assert str(e.value).endswith("create it with `python -m scripts.mid_train --model-tag <tag>`, or pick another "
                                 "--source (base)")
    with pytest.raises(CheckpointError, match=r", or pick another --source$"):   # chat_rl: its sources are its own
        resolve_source("rl", "sft", None, tmp_path)


def test_an_eval_folder_given_as_data_dir_is_not_read_as_conversations(tmp_path):
    """`--data-dir .../eval` (the help allows it, so that the sibling sft/ is found) read ARC's rows
    as conversations and failed on `arc_challenge.jsonl:1`; the sibling sft/ is what it means."""
    from nanochat.tasks.conversations import find_local_conversation_files

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "arc_challenge.jsonl").write_text('{"question": "q", "choices": []}\n')
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "mine.jsonl").write_text('{"messages": []}\n')
    assert find_local_conversation_files(data_dir=tmp_path / "eval") == [tmp_path / "sft" / "mine.jsonl"]
    assert find_local_conversation_files(data_dir=tmp_path) == [tmp_path / "sft" / "mine.jsonl"]
    assert find_local_conversation_files(data_dir=tmp_path / "sft") == [tmp_path / "sft" / "mine.jsonl"]
