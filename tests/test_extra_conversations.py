"""mid_train / chat_sft --extra-conversations and --no-identity: the user's own JSONL conversations
join the training mixture (a file named twice, twice), the built-in identity can be left out, a
bad file is a one-line error naming the flag, file and line before any model is loaded, and a
resumed run must continue the mixture its checkpoint trained on."""

from __future__ import annotations

import json

import pytest

from nanochat import checkpoint as ck
from nanochat.errors import DataError

MARK = "zorblax"   # a word no shared data file holds
OWN = [{"messages": [{"role": "user", "content": f"Who are you, {i}?"},
                     {"role": "assistant", "content": f"I am {MARK}, your own model number {i}."}]} for i in range(3)]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _marked(task) -> int:
    return sum(MARK in json.dumps(task[i]) for i in range(len(task)))


def test_flags_repeat_and_identity_switch(tmp_path):
    from scripts import chat_sft, mid_train
    own = str(_write(tmp_path / "own.jsonl", OWN))
    cfg = chat_sft.parse(["--extra-conversations", own, "--extra_conversations", own, "--no-identity"])
    assert cfg.extra_conversations == [own, own] and cfg.identity is False
    assert (mid_train.parse([]).extra_conversations, mid_train.parse([]).identity) == ([], True)
    with pytest.raises(ValueError, match="--extra-conversations: got '/nonexistent/own.jsonl'"):
        mid_train.parse(["--extra-conversations", "/nonexistent/own.jsonl"])


@pytest.mark.parametrize("stage, identity_copies", [("sft", 1), ("mid", 2)])
def test_extra_conversations_join_the_training_mixture(shared_data, tmp_path, stage, identity_copies):
    """Named twice: mixed in twice, read once; --no-identity drops the 1000 built-in identity
    conversations (mid lists them twice); the validation mixture is the same either way."""
    from nanochat import chat_data
    from nanochat.tasks import ConversationFile, IdentityConversations
    own = str(_write(tmp_path / "own.jsonl", OWN))
    kw = dict(data_dir=shared_data, test_holdout=100)
    plain = chat_data.build_mixture(stage, "train", **kw)
    mixed = chat_data.build_mixture(stage, "train", extra=[own, own], identity=False, **kw)
    assert _marked(plain) == 0 and _marked(mixed) == 2 * len(OWN)
    assert len(mixed) == len(plain) - identity_copies * 1000 + 2 * len(OWN)
    assert not any(isinstance(t, IdentityConversations) for t in mixed.tasks)
    files = [t for t in mixed.tasks if isinstance(t, ConversationFile)]
    assert len(files) == 2 and files[0] is files[1] and len(files[0].sha256) == 64
    assert len(chat_data.build_mixture(stage, "val", **kw)) == len(chat_data.build_mixture(stage, "val", **kw))


@pytest.mark.parametrize("content, problem", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n',
     ":2: invalid JSON"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n", ":1: messages\\[0\\].role is 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}) + "\n", ":1: no assistant message"),
    ("\n\n", ": holds no conversations"),
])
def test_a_bad_file_names_flag_file_and_line_before_the_model_loads(env, tmp_path, monkeypatch, content, problem):
    from nanochat import chat_train
    from scripts import chat_sft

    def no_model(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the data was checked")

    monkeypatch.setattr(chat_train, "resolve_source", lambda *a, **k: ("d2", tmp_path / "ckpt"))
    monkeypatch.setattr(ck, "load_model", no_model)
    monkeypatch.setattr(ck, "load_checkpoint", no_model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(DataError, match=f"--extra-conversations {bad}{problem}"):
        chat_sft.main(["--device", "cpu", "--extra-conversations", str(bad)])


BASE = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "128",
        "--device-batch-size", "4", "--total-batch-size", "512", "--window-pattern", "SL", "--sample-every", "-1",
        "--eval-every", "-1", "--no-compile", "--model-tag", "own", "--num-iterations", "4"]


@pytest.mark.slow
def test_checkpoint_records_the_mixture_and_resume_keeps_it(env, tmp_path, capsys):
    """The SFT checkpoint records identity and each file's sha256; --resume latest with the same
    files continues, with another file (or --no-identity) it names the mixture, and --resume auto
    starts afresh saying why."""
    from scripts import base_train, chat_sft
    base_train.main(BASE + env)
    own = str(_write(tmp_path / "own.jsonl", OWN))
    args = ["--device", "cpu", "--source", "base", "--model-tag", "own", "--device-batch-size", "4",
            "--max-seq-len", "128", "--total-batch-size", "512", "--test-holdout", "50", "--eval-every", "-1",
            "--no-compile", "--save-every", "1", "--extra-conversations", own, "--extra-conversations", own]
    chat_sft.main(args + ["--num-iterations", "1"])
    sft_dir = ck.checkpoint_dir("sft", "own")
    recorded = ck.read_meta(sft_dir)["train"]["mixture"]
    assert recorded["identity"] is True and [f["path"] for f in recorded["extra_conversations"]] == [own, own]
    assert recorded["extra_conversations"][0]["conversations"] == len(OWN)
    assert "--extra-conversations " + own + f": {len(OWN)} conversations, mixed in 2x" in capsys.readouterr().out

    assert sorted(chat_sft.main(args + ["--num-iterations", "2", "--resume", "latest"])["losses"]) == [1]
    _write(tmp_path / "own.jsonl", OWN[:2])                      # the file changed since
    with pytest.raises(ck.CheckpointError, match="another conversation mixture"):
        chat_sft.main(args + ["--num-iterations", "3", "--resume", "latest"])
    capsys.readouterr()
    fresh = chat_sft.main(args + ["--num-iterations", "1", "--resume", "auto", "--no-identity"])
    out = capsys.readouterr().out
    assert "cannot be continued (the checkpoint was trained on another conversation mixture" in out
    assert "identity on) than this run's (" in out and "identity off)" in out and sorted(fresh["losses"]) == [0]
    assert ck.read_meta(sft_dir)["train"]["mixture"]["identity"] is False
