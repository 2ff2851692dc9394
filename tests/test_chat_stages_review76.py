"""Review 76 of the chat stages (mid_train, chat_sft, chat_rl) as a user who fine-tunes their own
model runs them on a CPU:

* a value starting with "-" (--identity=-Bob, --extra-conversations=-mine.jsonl, chat_rl's
  --data-dir=-d) came back in the next stage's / the resume's command as `--flag -Bob`, which
  argparse refuses ("expected one argument"); it is spelled `--flag=-Bob` now;
* chat_rl took any --data-dir: a typo was a "dataset not found" list of paths naming no flag (after
  the checkpoint was resolved), an empty one read ./eval or the hub in silence;
* a --source checkpoint trained with another tokenizer than the base dir's was refused only by the
  weights' load, after the whole mixture had been read, naming neither --source nor --model-tag;
* SFT cut an --extra-conversations file's replies longer than a row at the row's end in silence
  (a per-file line said only the replies a prompt cuts off);
* chat_rl ended on its summary alone: it names chat_eval / chat_web of the rl checkpoint now, as
  chat_sft does, and the commands run.
* the banner said the validation rows --eval-tokens asks for (-1: 20 micro-batches: 640 rows of
  2,048 tokens at d20's defaults), while each evaluation scored the fewer rows the validation
  mixture packs into (~90 there with the tests' tokenizer); it says those now, and what was asked.

One tiny base checkpoint per module (tests/test_chat_stage_review.py's), copied as an sft one for RL.
"""

from __future__ import annotations

import json
import shlex
import shutil

import pytest

from nanochat import checkpoint as ck
from tests.test_chat_stage_review import train_tiny_base

TAG = "r76"
MID = ["--device", "cpu", "--model-tag", TAG, "--device-batch-size", "2", "--max-seq-len", "64",
       "--total-batch-size", "128", "--test-holdout", "50", "--eval-every", "-1", "--no-compile",
       "--num-iterations", "1"]
RL = ["--device", "cpu", "--model-tag", TAG, "--examples-per-step", "2", "--num-samples", "2",
      "--max-new-tokens", "4", "--test-holdout", "50", "--eval-every", "-1", "--num-iterations", "1"]


@pytest.fixture(scope="module")
def chain(base_dir, tiny_corpus):
    """base/<TAG> step 1, and the same checkpoint as sft/<TAG> (what chat_rl starts from)."""
    train_tiny_base(base_dir, tiny_corpus, TAG)
    shutil.copytree(base_dir / "checkpoints" / "base" / TAG, base_dir / "checkpoints" / "sft" / TAG)
    return base_dir


@pytest.fixture
def user(env, chain, monkeypatch):
    monkeypatch.delenv("NANOCHAT_SETUP_STAGE", raising=False)   # a user at a terminal, not setup.sh
    return chain


def test_dash_leading_values_come_back_as_commands_that_parse(tmp_path, monkeypatch):
    """mid_train --identity=-Bob --extra-conversations=-mine.jsonl: its next command (chat_sft) and
    its resume command said `--identity -Bob`, refused by argparse; chat_rl's resume alike."""
    from nanochat.chat_flags import next_commands, parse_config, resume_command
    from nanochat.chat_train import MID as MID_STAGE, SFT
    from scripts import chat_rl
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-mine.jsonl").write_text("")
    (tmp_path / "-d").mkdir()
    cfg = parse_config(MID_STAGE, ["--identity=-Bob", "--extra-conversations=-mine.jsonl", "--eval-every", "-1"])
    (sft_cmd,) = [c for _, c in next_commands(MID_STAGE, cfg, "d4")]
    words = shlex.split(sft_cmd)
    assert "--identity=-Bob" in words and "--extra-conversations=-mine.jsonl" in words
    again = parse_config(SFT, words[3:])
    assert (again.identity, again.extra_conversations) == ("-Bob", ["-mine.jsonl"])
    resumed = parse_config(MID_STAGE, shlex.split(resume_command(MID_STAGE, cfg, "d4"))[3:])
    assert (resumed.identity, resumed.extra_conversations, resumed.resume) == ("-Bob", ["-mine.jsonl"], "latest")
    assert resumed.eval_every == -1   # a negative number stays a word of its own (argparse reads it as a value)
    rl_cfg = chat_rl.parse_config(["--data-dir=-d", "--test-holdout", "5"])
    back = chat_rl.parse_config(shlex.split(chat_rl.rerun_command(rl_cfg, "d4", 1, resume="latest"))[3:])
    assert (back.data_dir, back.resume) == ("-d", "latest")


@pytest.mark.parametrize("value", ["no-such-dir", ""])
def test_chat_rl_refuses_a_data_dir_that_is_not_one_first(value, tmp_path, monkeypatch):
    """Named before the checkpoint is looked for (this base dir holds none): the flag and what it takes."""
    from nanochat.errors import RequestError
    from scripts import chat_rl
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RequestError, match=r"^--data-dir: got '[a-z-]*'; accepted: an existing directory"):
        chat_rl.main(["--device", "cpu", "--data-dir", value])


def _with_other_tokenizer(src, dst, phase: str):
    """A copy of base dir `src` whose <phase>/<TAG> checkpoint says it was trained with another tokenizer."""
    shutil.copytree(src / "tokenizer", dst / "tokenizer")
    shutil.copytree(src / "checkpoints" / phase / TAG, dst / "checkpoints" / phase / TAG)
    meta_path = dst / "checkpoints" / phase / TAG / ck.step_dirname(1) / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["tokenizer_fingerprint"] = "f" * 64
    meta_path.write_text(json.dumps(meta))
    return dst


def test_a_source_of_another_tokenizer_is_refused_before_the_mixture(user, tmp_path, monkeypatch):
    """mid_train and chat_rl name --source and both tokenizers before any data is read (the load
    refused it after the mixture, naming neither flag)."""
    from nanochat import chat_data
    from scripts import chat_rl, mid_train

    def no_data(*a, **k):
        raise AssertionError("the mixture was read before the tokenizer was checked")
    monkeypatch.setattr(chat_data, "build_mixture", no_data)
    for phase, run, argv in (("base", mid_train.main, MID), ("sft", chat_rl.main, RL)):
        other = _with_other_tokenizer(user, tmp_path / phase, phase)
        monkeypatch.setenv("NANOCHAT_BASE_DIR", str(other))
        with pytest.raises(ck.CheckpointError) as e:
            run(argv)
        assert str(e.value).startswith(f"--source {phase}: {phase}/{TAG} step 1 was trained with tokenizer "
                                       "ffffffffffffffff..., and ")
        assert "accepted: a --source / --model-tag checkpoint trained with this tokenizer" in str(e.value)


def test_sft_says_which_of_your_replies_a_row_cuts_short(tiny_tokenizer, tmp_path, capsys):
    """A reply longer than --max-seq-len in the user's own file: a WARNING naming the file's line
    and how many of its conversations train only up to the row's end."""
    from nanochat.chat_data import check_replies_fit
    from nanochat.tasks import ConversationFile
    from nanochat.tasks.common import TaskMixture
    from nanochat.tasks.identity import IdentityConversations
    own = tmp_path / "mine.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "fine, thanks"}]},
            {"messages": [{"role": "user", "content": "tell me"}, {"role": "assistant", "content": "word " * 200}]}]
    own.write_text("\n" + "\n".join(json.dumps(r) for r in rows) + "\n")   # the long one is on line 3
    mix = TaskMixture([IdentityConversations(20), ConversationFile(own)])
    said = check_replies_fit(mix, TaskMixture([IdentityConversations(5)]), tiny_tokenizer, 64)
    mine = [line for line in said if str(own) in line]
    assert mine == [f"WARNING: --extra-conversations {own}:3: longer than a row of 65 tokens (--max-seq-len 64); it "
                    "and 0 more of the first 2 conversations of the file train up to the row's end (the rest of the "
                    "reply is not trained)"]
    assert mine[0] in capsys.readouterr().out


def test_chat_rl_ends_naming_chat_eval_and_chat_web_and_they_run(user, capsys):
    """The end of an RL run names the commands that evaluate and serve the rl checkpoint; chat_eval's
    runs as given (one GSM8K problem added to keep it short), chat_web's parses and validates."""
    from scripts import chat_eval, chat_rl, chat_web
    chat_rl.main(RL + ["--overwrite"])
    nxt = dict(line.removeprefix("next, ").split(": ", 1) for line in capsys.readouterr().out.splitlines()
               if line.startswith("next, "))
    assert nxt == {"evaluate it": f"python -m scripts.chat_eval -i rl --model-tag {TAG} --device cpu",
                   "talk to it": f"python -m scripts.chat_web -i rl --model-tag {TAG} --device cpu"}
    out = chat_eval.main(shlex.split(nxt["evaluate it"])[3:] + ["-a", "GSM8K", "-x", "1"])
    assert "GSM8K" in json.dumps(out)
    chat_web.validate(chat_web.parse_args(shlex.split(nxt["talk to it"])[3:]))


def test_the_banner_says_the_validation_rows_each_evaluation_scores(user, monkeypatch, capsys):
    """--eval-tokens asking for more rows than the validation mixture packs into (as -1's 20 micro-batches
    of 32 x 2,048 do at d20): the banner said the rows asked for (here 15,625), each evaluation scored
    the few hundred there are. It says those, and what was asked."""
    import re

    from nanochat import eval_bpb
    from scripts import mid_train
    real, scored = eval_bpb.evaluate_bpb, []

    def spy(model, batches, steps, token_bytes):
        kept = list(batches)
        scored.append(sum(int((y >= 0).any(dim=1).sum()) for _, y in kept))
        return real(model, kept, steps, token_bytes)
    monkeypatch.setattr(eval_bpb, "evaluate_bpb", spy)
    mid_train.main(MID + ["--eval-every", "1", "--eval-tokens", "1000000", "--overwrite"])
    said = re.search(r"eval every 1 \((\d+) rows, (\d+) batches: all the validation mixture packs into, of the "
                     r"15625 rows --eval-tokens 1000000 asks for\)", capsys.readouterr().out)
    assert said, "the banner's evaluation line"
    assert scored == [int(said[1])] * 2 and int(said[2]) == -(-int(said[1]) // 2) and int(said[1]) < 15625
