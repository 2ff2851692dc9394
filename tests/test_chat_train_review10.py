"""Review 10 of mid_train / chat_sft: a resume past --num-iterations, or one whose flags cannot
continue the checkpoint (another --max-seq-len), is refused from meta.json before any weights load
(it read the checkpoint's weights and optimizer state first: GBs at d20), as is a disk without room
for one checkpoint; a --resume auto that starts
fresh reads only the source's weights, not also the earlier run's; a resume of an older step moves
the later ones (the run it branches from) aside; and the SFT summary's
conversations_skipped counts only the skips the rows trained have passed, not those the loader read
ahead of the last row. One tiny base checkpoint per module."""

from __future__ import annotations

import json

import pytest

from nanochat import checkpoint as ck
from nanochat.chat_data import ChatLoader
from tests.test_chat_stage_review import train_tiny_base

TAG = "r10"
MID = ["--device", "cpu", "--model-tag", TAG, "--device-batch-size", "2", "--max-seq-len", "64",
       "--total-batch-size", "128", "--test-holdout", "50", "--eval-every", "-1", "--no-compile",
       "--save-every", "1"]


@pytest.fixture(scope="module")
def base_ckpt(base_dir, tiny_corpus):
    """base/r10 step 1 (a depth-1 model of 64-token rows) in the module's base dir."""
    return train_tiny_base(base_dir, tiny_corpus, TAG)


@pytest.fixture
def mid_run(env, base_ckpt, monkeypatch):
    """mid/r10 steps 1 and 2 of a fresh 2-step run (any earlier run's moved aside by --overwrite)."""
    from scripts import mid_train
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "mid")   # no "next" lines
    mid_train.main(MID + ["--num-iterations", "2", "--overwrite"])
    return ck.checkpoint_dir("mid", TAG)


def _no_weights(monkeypatch, loaded: list | None = None):
    """Every way chat_train reads weights: refused (loaded is None) or recorded (the dirs read)."""
    real = ck.load_checkpoint

    def refuse(*a, **k):
        raise AssertionError("weights were loaded before the refusal")

    def record(ckpt_dir, *a, **k):
        loaded.append(ck.Path(ckpt_dir))
        return real(ckpt_dir, *a, **k)

    monkeypatch.setattr(ck, "load_checkpoint", refuse if loaded is None else record)
    if loaded is None:
        monkeypatch.setattr(ck, "model_from_meta", refuse)
        monkeypatch.setattr(ck, "load_model", refuse)


def test_a_resume_past_num_iterations_is_refused_before_the_weights_load(mid_run, monkeypatch):
    """check_resume_step ran after load_checkpoint read the step's weights and optimizer state and
    the model was built: the iteration count is known from meta.json (the rows' length) and flags.
    (After the data checks: a resume that cannot continue at all says that first.)"""
    from scripts import mid_train
    _no_weights(monkeypatch)
    for resume in ("latest", "2", "auto"):
        with pytest.raises(ck.CheckpointError, match=r"at step 2, past --num-iterations 1; .*earlier step \(\[1\]\)"):
            mid_train.main(MID + ["--num-iterations", "1", "--resume", resume])


def test_a_resume_with_other_rows_is_refused_before_the_weights_load(mid_run, monkeypatch):
    """Another --max-seq-len changes the rows the loader's place in the mixture points into: named
    from meta.json, not after the GBs of the checkpoint were read."""
    from scripts import mid_train
    _no_weights(monkeypatch)
    with pytest.raises(ck.CheckpointError, match=r"rows of --max-seq-len 64, this run's are 32"):
        mid_train.main(MID + ["--num-iterations", "3", "--resume", "latest", "--max-seq-len", "32"])


def test_a_disk_without_room_is_refused_before_the_weights_load(env, base_ckpt, monkeypatch):
    """The checkpoint size was taken from the loaded model: a disk too small for one checkpoint was
    said after the weights loaded. A shapes-only model of meta.json's config sizes it alike."""
    from nanochat.checkpoint_io import checkpoint_bytes
    from scripts import mid_train
    model = ck.load_model("base", "cpu", model_tag=TAG)[0]
    assert checkpoint_bytes(ck.build_model(model.config, "meta")) == checkpoint_bytes(model) > 0
    _no_weights(monkeypatch)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    with pytest.raises(ck.CheckpointError, match=r"free on its disk, but one checkpoint of this run needs"):
        mid_train.main(MID + ["--num-iterations", "1", "--overwrite"])


def test_resume_auto_that_starts_fresh_reads_only_the_source_weights(mid_run, monkeypatch, capsys):
    """--resume auto over a run these flags cannot continue (other rows): it loaded that run's
    checkpoint (weights and optimizer state), then dropped it and loaded the source's."""
    from scripts import mid_train
    loaded: list = []
    _no_weights(monkeypatch, loaded)
    capsys.readouterr()
    mid_train.main(MID + ["--num-iterations", "1", "--resume", "auto", "--max-seq-len", "32"])
    assert "cannot be continued (the checkpoint was trained on rows of --max-seq-len 64" in capsys.readouterr().out
    assert loaded == [ck.checkpoint_dir("base", TAG)]
    assert ck.list_steps(mid_run) == [1] and ck.read_meta(mid_run)["train"]["seq_len"] == 32


def test_a_resume_continues_as_before(mid_run, monkeypatch):
    """The checks moved ahead of the load still let a resume that fits continue (step 2 -> 3)."""
    from scripts import mid_train
    loaded: list = []
    _no_weights(monkeypatch, loaded)
    out = mid_train.main(MID + ["--num-iterations", "3", "--resume", "latest"])
    assert sorted(out["losses"]) == [2] and loaded == [mid_run]


def test_a_resume_of_an_older_step_moves_the_later_ones_aside(mid_run, capsys):
    """--resume 1 with step 2 of the same tag on disk: this run's save at 2 replaced that run's in
    place (and with other --save-every values left its steps beside this one's, for a later --resume N
    to take). The steps past the one resumed are the run it branches from: moved aside at the first save."""
    from scripts import mid_train
    capsys.readouterr()
    mid_train.main(MID + ["--num-iterations", "2", "--resume", "1"])
    assert "--resume 1: the checkpoints after step 1 in " in capsys.readouterr().out
    aside = max((mid_run / "earlier_runs").iterdir(), key=lambda p: int(p.name))
    assert ck.list_steps(aside) == [2] and ck.list_steps(mid_run) == [1, 2] and ck.read_latest(mid_run) == 2


# ------------------------------------------------------------------ skips counted as passed

def _conv(user: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]}


def test_skips_read_ahead_of_the_last_row_are_not_counted_yet(tiny_tokenizer):
    """S0, four conversations whose prompt pushes the reply out of the row, S1, S2; rows of one
    conversation each. The refill after S0's row read the four (and S1) ahead: skipped said 4 while
    only S0 had trained; the four count once S1 (read after them) is packed. Exact across a resume,
    and a finite stream read to its end counts every skip."""
    short = [_conv(f"q{i}", f"answer number {i} is here.") for i in range(3)]
    long_prompt = [_conv("tell me " * 40 + str(i), "no room") for i in range(4)]
    task = short[:1] + long_prompt + short[1:]
    seq_len = max(len(tiny_tokenizer.render_conversation(c)[0]) for c in short) + 2   # one short per row
    assert all(2 * len(tiny_tokenizer.render_conversation(c)[0]) > seq_len + 1 for c in short)

    def loader(**kw):
        return ChatLoader(task, tiny_tokenizer, 1, seq_len, mask="assistant", fill="pad", buffer_size=1, **kw)

    a = loader()
    next(a)
    assert (a.conversations_used, a.skipped) == (1, 0)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["skipped"] == 0 and len(state["skipped_pending"]) == 4
    next(a)
    assert (a.conversations_used, a.skipped) == (2, 4)
    b = loader()
    b.load_state_dict(state)
    next(b)
    assert b.skipped == 4 and b.state_dict() == a.state_dict()
    finite = loader(loop=False)
    assert len(list(finite)) == 3 and finite.skipped == 4


def test_sft_summary_says_what_its_skips_are_out_of(env, base_ckpt, monkeypatch):
    """The summary said conversations_skipped (and truncated) with nothing to hold them against: it
    now says how many conversations the rows trained, and every figure is the loader's as of the last
    step (the skips read ahead of it wait in the checkpoint's loader state)."""
    from scripts import chat_sft
    monkeypatch.setenv("NANOCHAT_SETUP_STAGE", "sft")
    summary = chat_sft.main(["--device", "cpu", "--source", "base", "--model-tag", TAG, "--device-batch-size", "8",
                             "--max-seq-len", "48", "--test-holdout", "50", "--eval-every", "-1", "--no-compile",
                             "--num-iterations", "1", "--overwrite"])
    state = ck.load_checkpoint(ck.checkpoint_dir("sft", TAG), 1)["loader"]
    assert summary["conversations_trained"] == state["conversations_used"] > 0
    assert summary["conversations_skipped"] == state["skipped"] > 0
    assert summary["conversations_truncated"] == state["truncated"]
