"""mid_train / chat_sft --extra-conversations, --identity NAME and --no-identity: the user's own
JSONL conversations join the training mixture (a file named twice, twice), the built-in identity
conversations name the model as asked or are left out, a bad file is a one-line error naming the
flag, file and line before any model is loaded, and a resumed run must continue the mixture its
checkpoint trained on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

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
    assert cfg.extra_conversations == [own, own] and cfg.identity == ""
    assert (mid_train.parse([]).extra_conversations, mid_train.parse([]).identity) == ([], "nanochat-spark")
    assert chat_sft.parse(["--identity", "Zorblax 2"]).identity == "Zorblax 2"
    with pytest.raises(ValueError, match="--extra-conversations: got '/nonexistent/own.jsonl'"):
        mid_train.parse(["--extra-conversations", "/nonexistent/own.jsonl"])
    for bad in ("x" * 65, " padded", "two\nlines"):
        with pytest.raises(ValueError, match="--identity: got"):
            chat_sft.parse(["--identity", bad])
    with pytest.raises(ValueError, match="--no-identity: not allowed with argument --identity"):
        mid_train.parse(["--identity", "Zorblax", "--no-identity"])


def test_identity_conversations_take_the_name():
    """--identity NAME: the "name" topic answers with NAME (the codebase stays nanochat-spark
    elsewhere), and the task's smoke check looks for NAME."""
    from nanochat.tasks import IdentityConversations
    named, plain = IdentityConversations(200, name="Zorblax"), IdentityConversations(200)
    asked = [i for i in range(200) if "name" in named[i]["topics"]]
    assert asked and all(named[i]["topics"] == plain[i]["topics"] for i in range(200))
    for i in asked:
        answers = " ".join(m["content"] for m in named[i]["messages"] if m["role"] == "assistant")
        assert "Zorblax" in answers and "Zorblax" not in json.dumps(plain[i])
        assert named.evaluate(named[i], "Hi, I am Zorblax.") and not named.evaluate(named[i], "I am nanochat-spark.")


@pytest.mark.parametrize("stage, identity_copies", [("sft", 1), ("mid", 2)])
def test_extra_conversations_join_the_training_mixture(shared_data, tmp_path, stage, identity_copies):
    """Named twice: mixed in twice, read once; --no-identity drops the 1000 built-in identity
    conversations (mid lists them twice); every other task is left as it was; the validation
    mixture is the same either way. The mixture is read back through its own index (what the
    loader walks) at the positions its file tasks own: rendering all 300K mid conversations to
    look for the mark took 15 s, and the other tasks are shown unchanged instead."""
    from nanochat import chat_data
    from nanochat.tasks import ConversationFile, IdentityConversations
    own = str(_write(tmp_path / "own.jsonl", OWN))
    kw = dict(data_dir=shared_data, test_holdout=100)
    plain = chat_data.build_mixture(stage, "train", **kw)
    mixed = chat_data.build_mixture(stage, "train", extra=[own, own], identity="", **kw)
    assert len(mixed) == len(plain) - identity_copies * 1000 + 2 * len(OWN)
    assert sum(isinstance(t, IdentityConversations) for t in plain.tasks) == identity_copies
    assert not any(isinstance(t, IdentityConversations) for t in mixed.tasks)
    files = [t for t in mixed.tasks if isinstance(t, ConversationFile)]
    assert len(files) == 2 and files[0] is files[1] and len(files[0].sha256) == 64
    assert not any(isinstance(t, ConversationFile) for t in plain.tasks)
    shape = lambda tasks, left_out: [(type(t), len(t)) for t in tasks if not isinstance(t, left_out)]  # noqa: E731
    assert shape(mixed.tasks, ConversationFile) == shape(plain.tasks, IdentityConversations)
    from_files = [mixed[i] for i in range(len(mixed)) if isinstance(mixed.task_of(i), ConversationFile)]
    assert _marked(from_files) == len(from_files) == 2 * len(OWN)
    assert sorted(json.dumps(c["messages"]) for c in from_files) == sorted(json.dumps(c["messages"]) for c in OWN * 2)
    val = chat_data.build_mixture(stage, "val", **kw)
    assert len(val) == len(chat_data.build_mixture(stage, "val", extra=[own], identity="", **kw))


@pytest.mark.parametrize("content, problem", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{oops\n',
     ":2: invalid JSON"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n", ":1: messages\\[0\\].role is 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "anyone?"}]}) + "\n", ":1: no assistant message"),
    ("\n\n", ": holds no conversations"),
])
def test_a_bad_file_names_flag_file_and_line_before_the_model_loads(env, tmp_path, monkeypatch, content, problem):
    from nanochat import chat_start
    from scripts import chat_sft

    def no_model(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the data was checked")

    monkeypatch.setattr(chat_start, "resolve_source", lambda *a, **k: ("d2", tmp_path / "ckpt"))
    monkeypatch.setattr(ck, "load_model", no_model)
    monkeypatch.setattr(ck, "load_checkpoint", no_model)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    with pytest.raises(DataError, match=f"--extra-conversations {bad}{problem}"):
        chat_sft.main(["--device", "cpu", "--extra-conversations", str(bad)])


BASE = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "128",
        "--device-batch-size", "4", "--total-batch-size", "512", "--window-pattern", "SL", "--sample-every", "-1",
        "--eval-every", "-1", "--no-compile", "--model-tag", "own", "--num-iterations", "1"]


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
    assert recorded["identity"] == "nanochat-spark" and [f["path"] for f in recorded["extra_conversations"]] == [own, own]
    assert recorded["extra_conversations"][0]["conversations"] == len(OWN)
    assert "--extra-conversations " + own + f": {len(OWN)} conversations, mixed in 2x" in capsys.readouterr().out

    assert sorted(chat_sft.main(args + ["--num-iterations", "2", "--resume", "latest"])["losses"]) == [1]
    # the loader's place is a place in this mixture, in this order, cut into rows of this length
    for flag, value, why in (("--test-holdout", "40", r"a mixture of [0-9,]+ conversations, this run's has [0-9,]+ "
                                                      r"\(set by --test-holdout"),
                             ("--seed", "7", "the mixture shuffled with --seed 42, this run's with 7"),
                             ("--max-seq-len", "64", "rows of --max-seq-len 128, this run's are 64")):
        with pytest.raises(ck.CheckpointError, match=why):
            chat_sft.main(args + ["--num-iterations", "3", "--resume", "latest", flag, value])
    _write(tmp_path / "own.jsonl", OWN[:2])                      # the file changed since
    with pytest.raises(ck.CheckpointError, match="another conversation mixture"):
        chat_sft.main(args + ["--num-iterations", "3", "--resume", "latest"])
    capsys.readouterr()
    fresh = chat_sft.main(args + ["--num-iterations", "1", "--resume", "auto", "--no-identity"])
    out = capsys.readouterr().out
    assert "cannot be continued (the checkpoint was trained on another conversation mixture" in out
    assert "identity nanochat-spark) than this run's (" in out and "identity off)" in out
    assert sorted(fresh["losses"]) == [0] and ck.read_meta(sft_dir)["train"]["mixture"]["identity"] == ""
    with pytest.raises(ck.CheckpointError, match="identity off\\) than this run's \\(--extra-conversations "
                       r"\[own.jsonl \(\w+\), own.jsonl \(\w+\)\], identity Zorblax\)"):
        chat_sft.main(args + ["--num-iterations", "2", "--resume", "latest", "--identity", "Zorblax"])
    # an extra file holding a validation conversation: trained on, and said so at the start
    from nanochat.chat_data import build_mixture
    held = build_mixture("sft", "val", test_holdout=50)[0]["messages"]
    leaky = str(_write(tmp_path / "leaky.jsonl", OWN + [{"messages": held}]))
    capsys.readouterr()
    chat_sft.main(args[:-4] + ["--extra-conversations", leaky, "--num-iterations", "1", "--resume", "auto"])
    assert (f"WARNING: --extra-conversations {leaky}: 1 of its conversations are validation conversations"
            in capsys.readouterr().out)


# ------------------------------------------------ rows checked when the file is read (file:line)

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def _conversation_files(tmp_path, content: str):
    """The same text as an --extra-conversations file and as a local SFT data file."""
    from nanochat.tasks import ConversationFile, LocalConversations
    own = tmp_path / "own.jsonl"
    sft = tmp_path / "sft"
    sft.mkdir(exist_ok=True)
    own.write_text(content, encoding="utf-8")
    (sft / "chat.jsonl").write_text(content, encoding="utf-8")
    return [(lambda: ConversationFile(own), f"--extra-conversations {own}"),
            (lambda: LocalConversations("train", data_dir=sft), str(sft / "chat.jsonl"))]


def test_errors_name_the_line_in_the_file_past_blank_lines(tmp_path):
    """Blank lines are skipped, so the bad row is row 2 but line 4 (was reported as line 2)."""
    bad = {"messages": [{"role": "robot", "content": "x"}]}
    for build, name in _conversation_files(tmp_path, f"{json.dumps(GOOD)}\n\n  \n{json.dumps(bad)}\n"):
        with pytest.raises(DataError, match=f"^{name}:4: messages\\[0\\]\\.role is 'robot'"):
            build()


@pytest.mark.parametrize("messages, problem", [
    # the format check let these through; render_conversation refused them hours into training
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}],
     r"messages\[0\]\.content: got list; accepted: str"),
    ([{"role": "system", "content": ["be terse"]}, {"role": "user", "content": "hi"},
      {"role": "assistant", "content": "yo"}], r"messages\[0\]\.content: got list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "image", "text": "x"}]}],
     r"messages\[1\]\.content\[0\]: got \{'type': 'image'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text"}]}],
     r"messages\[1\]\.content\[0\]"),
    # accepted by the renderer, but silently trains the wrong thing
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " \n"}],
     r"messages\[1\] is an empty assistant reply"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": ""}]}],
     r"messages\[1\] is an empty assistant reply"),
    ([{"role": "user", "content": "hi"},     # the tool's output is not written by the assistant: trains nothing
      {"role": "assistant", "content": [{"type": "python_output", "text": "42"}]}],
     r"messages\[1\] is an empty assistant reply"),
    ([{"role": "user", "content": "bad \ud800 escape"}, {"role": "assistant", "content": "yo"}],
     r"messages\[0\]\.content holds a lone surrogate '\\ud800'"),
])
def test_rows_the_renderer_would_refuse_or_mistrain_fail_when_the_file_is_read(tmp_path, tiny_tokenizer,
                                                                                messages, problem):
    row = {"messages": messages}
    line = json.dumps(row)   # ensure_ascii: the surrogate is written as the escape \ud800
    for build, name in _conversation_files(tmp_path, f"{json.dumps(GOOD)}\n{line}\n"):
        with pytest.raises(DataError, match=f"^{name}:2: {problem}"):
            build()
    try:   # the first four would have stopped training when the loader reached them
        tiny_tokenizer.render_conversation(row)
    except ValueError as e:
        assert re.search(problem, str(e))


def test_smoltalk_rows_the_renderer_refuses_fail_when_the_task_is_built(tmp_path):
    from nanochat.tasks import SmolTalk
    bad = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}
    (tmp_path / "smoltalk_train.jsonl").write_text(f"{json.dumps(GOOD)}\n{json.dumps(bad)}\n")
    with pytest.raises(DataError, match=r"smoltalk_train.jsonl: row 2: messages\[1\]\.role"):
        SmolTalk("train", data_dir=tmp_path)
    (tmp_path / "smoltalk_train.jsonl").write_text(json.dumps(GOOD) + "\n")
    assert len(SmolTalk("train", data_dir=tmp_path)) == 1


# ------------------------------------------------ mixtures: what val scores, what each rank trains on

@pytest.mark.parametrize("holdout", [0, 3])
def test_val_never_scores_a_problem_training_sees(shared_data, holdout):
    """--test-holdout N trains on test[N:]; val bpb scored test[:max(N, 1)], so with N = 0 the
    first MMLU and GSM8K test problems were both trained on and scored."""
    from nanochat import chat_data
    from nanochat.tasks import GSM8K, MMLU
    kw = dict(data_dir=shared_data, test_holdout=holdout)
    val = chat_data.build_mixture("mid", "val", **kw)
    trained = {json.dumps(t[i]["messages"]) for t in chat_data.build_mixture("mid", "train", **kw).tasks
               if isinstance(t, (MMLU, GSM8K)) for i in range(len(t))}
    scored = [json.dumps(val[i]["messages"]) for i in range(len(val)) if isinstance(val.task_of(i), (MMLU, GSM8K))]
    assert len(scored) == 2 * holdout and not set(scored) & trained


def test_ranks_take_disjoint_conversations_when_the_world_size_does_not_divide(tiny_tokenizer):
    """11 conversations over 3 ranks (4, 4 and 3): every conversation trained exactly once."""
    from nanochat.chat_data import ChatLoader
    convs = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(11)]
    start, end = (tiny_tokenizer.encode_special(f"<|user_{s}|>") for s in ("start", "end"))
    seen = []
    for rank in range(3):
        for x, _ in ChatLoader(convs, tiny_tokenizer, 2, 24, rank=rank, world_size=3, buffer_size=2, loop=False):
            ids = x.flatten().tolist()
            seen += [tiny_tokenizer.decode(ids[k + 1:ids.index(end, k)]) for k, t in enumerate(ids) if t == start]
    assert sorted(seen) == sorted(f"q{i}" for i in range(11))


def test_every_rank_builds_the_same_mixture(shared_data):
    """Ranks build the mixture each in its own process and take positions r, r + W, ... of it, so
    it must not depend on anything per-process (str hashing: PYTHONHASHSEED) or they would
    silently train on overlapping and missing conversations. One other process, whose str hashes
    are shown to differ from this one's, builds it as this process does."""
    import hashlib
    from nanochat import chat_data
    script = ("import hashlib, json\nfrom nanochat import chat_data\n"
              f"mix = chat_data.build_mixture('sft', 'train', data_dir={str(shared_data)!r}, test_holdout=100)\n"
              "print(hash('nanochat-spark'), len(mix), "
              "hashlib.sha256(json.dumps([mix[i] for i in range(len(mix))]).encode()).hexdigest())")
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "PYTHONHASHSEED": seed})
    other_hash, other = res.stdout.splitlines()[-1].split(" ", 1)
    assert int(other_hash) != hash("nanochat-spark")   # the two processes hash str differently
    mix = chat_data.build_mixture("sft", "train", data_dir=shared_data, test_holdout=100)
    here = f"{len(mix)} {hashlib.sha256(json.dumps([mix[i] for i in range(len(mix))]).encode()).hexdigest()}"
    assert other == here


def test_extra_rows_that_are_validation_conversations_are_counted(shared_data, tmp_path):
    """Adding the local sft/*.jsonl itself as an extra file trains on its test split, which is what
    val bpb scores: the overlap is counted per file (roles and contents; other keys do not matter)."""
    from nanochat.chat_data import build_mixture, validation_overlap
    val = build_mixture("sft", "val", data_dir=shared_data, test_holdout=50)
    # general-chat validation rows: a copied GSM8K one is left out of training as an eval question
    held = [val.tasks[0][i]["messages"] for i in range(3)]
    leaky = _write(tmp_path / "leaky.jsonl", OWN + [{"messages": m, "source": "copied"} for m in held])
    own = _write(tmp_path / "own.jsonl", OWN)
    train = build_mixture("sft", "train", data_dir=shared_data, test_holdout=50, extra=[str(own), str(leaky)])
    assert validation_overlap(train, val) == {str(leaky): 3}
    whole = str(shared_data / "sft" / "chatterbot.jsonl")
    train = build_mixture("sft", "train", data_dir=shared_data, test_holdout=50, extra=[whole])
    assert validation_overlap(train, val)[whole] > 0
