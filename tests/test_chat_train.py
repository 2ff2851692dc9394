"""Mid-training, SFT and RL on CPU: conversation packing (assistant-only targets, padding, exact
resume state), the token-weighted SFT loss against a hand-computed masked mean, flag validation,
missing-checkpoint errors, and a tiny pipeline base -> mid (with exact resume) -> sft -> rl ->
chat_eval -> report.md with plots. Fixtures (tokenizer, base dir, env): tests/conftest.py."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from nanochat import checkpoint as ck
from nanochat.chat_data import ChatLoader, estimate_epoch_rows

CONVS = [
    {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]},
    {"messages": [{"role": "user", "content": "What is 2+2?"},
                  {"role": "assistant", "content": [{"type": "text", "text": "Let me compute: "},
                                                    {"type": "python", "text": "2+2"},
                                                    {"type": "python_output", "text": "4"},
                                                    {"type": "text", "text": " so 4."}]}]},
    {"messages": [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue."},
                  {"role": "user", "content": "Another"}, {"role": "assistant", "content": "Green, then red."}]},
]


# ------------------------------------------------------------------ packing, masks, padding, resume

def test_single_conversation_row_targets_and_padding(tiny_tokenizer):
    ids, mask = tiny_tokenizer.render_conversation(CONVS[1])
    seq_len = len(ids) + 5  # one conversation per row, 6 padded positions
    loader = ChatLoader([CONVS[1]], tiny_tokenizer, 2, seq_len, mask="assistant", fill="pad", buffer_size=1)
    x, y = next(loader)
    row_ids = ids + [tiny_tokenizer.bos_token_id] * 6
    want_y = [ids[t + 1] if mask[t + 1] else -1 for t in range(len(ids) - 1)] + [-1] * 6
    assert x[0].tolist() == row_ids[:-1] and y[0].tolist() == want_y
    assert x[1].tolist() == x[0].tolist()  # the stream loops: the same conversation again
    # tool output tokens are inputs but never targets; user tokens neither
    out_start = tiny_tokenizer.encode_special("<|output_start|>")
    t = ids.index(out_start)
    assert y[0, t - 1] == -1 and y[0, t] == -1
    assert (y[0] >= 0).sum() == sum(mask[1:])


def test_pad_rows_pack_whole_conversations_and_mask_everything_else(tiny_tokenizer):
    rendered = [tiny_tokenizer.render_conversation(c) for c in CONVS]
    seq_len = max(len(r[0]) for r in rendered) * 2
    loader = ChatLoader(CONVS, tiny_tokenizer, 4, seq_len, mask="assistant", fill="pad", buffer_size=3)
    x, y = next(loader)
    bos = tiny_tokenizer.bos_token_id
    assert (x[:, 0] == bos).all()  # BOS-aligned rows
    assert loader.fill_fraction < 1.0  # whole conversations only: the rest is padding
    trained = {tuple(r[0][k] for k in range(len(r[0])) if r[1][k]) for r in rendered}
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        kept = [v for v in row_y if v >= 0]
        assert kept and all(v != bos for v in kept)
        assert any(tuple(kept[i:i + len(t)]) == t for t in trained for i in range(len(kept)))
    # "all" + "crop": full rows, every position a target
    crop = ChatLoader(CONVS, tiny_tokenizer, 4, 40, mask="all", fill="crop", buffer_size=3)
    for _ in range(3):
        x, y = next(crop)
        assert (y >= 0).all() and (x[:, 0] == bos).all()
    assert crop.fill_fraction == 1.0


def test_loader_resume_state_is_exact(tiny_tokenizer):
    task = CONVS * 7
    a = ChatLoader(task, tiny_tokenizer, 3, 48, mask="assistant", fill="pad", buffer_size=4)
    for _ in range(2):
        next(a)
    state = json.loads(json.dumps(a.state_dict()))  # plain python types
    want = [next(a) for _ in range(4)]
    b = ChatLoader(task, tiny_tokenizer, 3, 48, mask="assistant", fill="pad", buffer_size=4)
    b.load_state_dict(state)
    for (xa, ya), (xb, yb) in zip(want, [next(b) for _ in range(4)]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    with pytest.raises(ValueError, match="rank"):
        ChatLoader(task, tiny_tokenizer, 3, 48, rank=1, world_size=2).load_state_dict(state)


def test_finite_stream_and_epoch_estimate(tiny_tokenizer):
    loader = ChatLoader(CONVS * 4, tiny_tokenizer, 2, 64, mask="assistant", fill="pad", loop=False)
    batches = list(loader)
    assert batches and loader.conversations_used == 12
    rows = estimate_epoch_rows(CONVS * 4, tiny_tokenizer, 64, mask="assistant", fill="pad")
    assert 2 * (len(batches) - 1) < rows <= 2 * len(batches)
    with pytest.raises(ValueError, match="fill"):
        ChatLoader(CONVS, tiny_tokenizer, 2, 64, fill="spill")


# ------------------------------------------------------------------ the SFT loss

def test_sft_loss_is_masked_mean_over_the_accumulated_batch(tiny_tokenizer):
    """Token-weighted accumulation: sum of target losses / number of targets over both
    micro-batches (not the mean of per-micro-batch means, which differs when counts differ)."""
    from nanochat.checkpoint import build_model
    from nanochat.common import init_runtime
    from nanochat.gpt import config_for_depth
    from nanochat.optim import build_optimizer
    from nanochat.training import Schedule, Trainer, plan_batch
    torch.manual_seed(0)
    rt = init_runtime("cpu", "fp32", 0)
    model = build_model(config_for_depth(1, tiny_tokenizer.vocab_size, 64, aspect_ratio=32, head_dim=32), "cpu")
    loader = ChatLoader(CONVS * 3, tiny_tokenizer, 2, 48, mask="assistant", fill="pad", buffer_size=2)
    batches = [next(loader) for _ in range(2)]
    counts = [int((y >= 0).sum()) for _, y in batches]
    assert counts[0] != counts[1] and all(c > 0 for c in counts)
    with torch.no_grad():
        sums = [F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-1, reduction="sum")
                for x, y in batches]
    want = float(sum(sums)) / sum(counts)
    mean_of_means = sum(float(s) / c for s, c in zip(sums, counts)) / 2
    assert abs(want - mean_of_means) > 1e-4
    trainer = Trainer(model, build_optimizer(model), iter(batches), plan_batch(2 * 2 * 48, 2, 48, 1),
                      Schedule(1), rt, token_weighted=True)
    assert trainer.step(0).loss == pytest.approx(want, rel=1e-5)


def test_rl_schedule_holds_muon_momentum_and_decays_lr_linearly():
    from scripts.chat_rl import rl_schedule
    schedule = rl_schedule(10)
    assert [schedule.multipliers(s)[:2] for s in (0, 5, 9)] == [(1.0, 0.95), (0.5, 0.95), (0.1, 0.95)]


def test_rl_trains_only_sampled_tokens():
    # upstream chat_rl's contract: prompt, tool-forced (Engine mask 0) and padding positions are
    # never targets, so the policy gradient only reaches tokens the policy sampled
    from nanochat.rl import rollout_batch
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 7]]
    masks = [[0, 0, 1, 0, 0, 1], [0, 0, 1]]  # prompt [1, 2]; row 0's 4, 5 were forced by the tool
    inputs, targets, adv = rollout_batch(seqs, masks, [0.5, -0.5], pad_id=0, device="cpu")
    assert inputs.tolist() == [[1, 2, 3, 4, 5], [1, 2, 7, 0, 0]]
    assert targets.tolist() == [[-1, 3, -1, -1, 6], [-1, 7, -1, -1, -1]] and adv.tolist() == [0.5, -0.5]


# ------------------------------------------------------------------ flags and missing checkpoints

@pytest.mark.parametrize("script, argv, flag", [
    ("mid_train", ["--num-iterations", "0"], "--num-iterations"),
    ("mid_train", ["--device-batch-size", "0"], "--device-batch-size"),
    ("mid_train", ["--source", "sft"], "--source"),
    ("mid_train", ["--max-seq-len", "4"], "--max-seq-len"),
    ("mid_train", ["--test-holdout", "-5"], "--test-holdout"),
    ("mid_train", ["--data-dir", "/nonexistent/data"], "--data-dir"),
    ("mid_train", ["--total-batch-size", "1000", "--device-batch-size", "4", "--max-seq-len", "64"],
     "--total-batch-size"),
    ("chat_sft", ["--source", "rl"], "--source"),
    ("chat_sft", ["--init-lr-frac", "0"], "--init-lr-frac"),
    ("chat_sft", ["--warmdown-ratio", "2"], "--warmdown-ratio"),
    ("chat_sft", ["--resume", "soon"], "--resume"),
    ("chat_sft", ["--kernel", "fast"], "--kernel"),
    ("chat_sft", ["--bogus", "1"], "--bogus"),
    ("chat_rl", ["--num-samples", "1"], "--num-samples"),
    ("chat_rl", ["--eval-samples", "-2"], "--eval-samples"),
    ("chat_rl", ["--max-new-tokens", "0"], "--max-new-tokens"),
    ("chat_rl", ["--source", "base"], "--source"),
    ("chat_rl", ["--temperature", "0"], "--temperature"),
    ("chat_rl", ["--device", "tpu"], "--device"),
    ("chat_rl", ["--test-holdout", "0"], "--test-holdout"),   # no held-out problem left to score
])
def test_bad_flags_name_the_flag(script, argv, flag):
    import importlib
    mod = importlib.import_module(f"scripts.{script}")
    parse = mod.parse_config if script == "chat_rl" else mod.parse
    with pytest.raises(ValueError, match=flag):
        parse(argv)


def test_rl_holdout_bounds(shared_data):
    """--test-holdout past the GSM8K test split leaves nothing to train on: one line naming the
    flag and the range (it was an IndexError)."""
    from nanochat import chat_data
    from nanochat.errors import RequestError
    n = len(chat_data.build_mixture("rl", "train", data_dir=shared_data, test_holdout=0))
    assert len(chat_data.build_mixture("rl", "train", data_dir=shared_data, test_holdout=n - 1)) == 1
    with pytest.raises(RequestError, match=rf"--test-holdout: got {n}; accepted: -1 or 0\.\.{n - 1} "):
        chat_data.build_mixture("rl", "train", data_dir=shared_data, test_holdout=n)


@pytest.mark.parametrize("stage", ["mid", "sft"])
def test_holdout_of_a_whole_test_split_is_refused(shared_data, stage):
    """A holdout past ARC-Challenge's 1,172 test problems left it (and past 1,319, GSM8K) out of the
    mixture without a word; now it is refused, naming the largest holdout every split survives."""
    from nanochat import chat_data
    from nanochat.errors import RequestError
    chat_data.build_mixture(stage, "train", data_dir=shared_data, test_holdout=1171)
    with pytest.raises(RequestError, match=r"--test-holdout: got 1172; accepted: -1 or 0\.\.1171 .*"
                                           r"arc_challenge\.jsonl has 1172"):
        chat_data.build_mixture(stage, "train", data_dir=shared_data, test_holdout=1172)


@pytest.mark.parametrize("stage, dbs, seq, world, total", [
    ("mid", 32, 2048, 1, 524288), ("mid", 32, 2048, 8, 524288), ("mid", 16, 2048, 1, 524288),
    ("mid", 32, 2048, 16, 1048576),          # one micro-batch over 16 ranks is already 2^20: rounded up
    ("sft", 4, 2048, 1, 32 * 2048), ("sft", 4, 2048, 8, 32 * 2048),
    ("sft", 4, 2048, 3, 36 * 2048),          # 32 rows do not split over 3 ranks x 4: 36
])
def test_auto_batch_is_the_stages_step_on_any_number_of_gpus(stage, dbs, seq, world, total):
    """--total-batch-size -1: mid 524,288 tokens and SFT 32 rows per step (the 8-GPU step), by
    gradient accumulation: a lone GPU trains with the batch 8 GPUs use, not an 8x smaller one."""
    from nanochat.chat_train import MID, SFT
    from nanochat.training import plan_batch
    got = {"mid": MID, "sft": SFT}[stage].auto_batch(dbs, seq, world)
    assert got == total
    assert plan_batch(got, dbs, seq, world).grad_accum_steps == total // (dbs * seq * world)


def test_flag_defaults_and_spellings():
    from scripts import chat_sft, mid_train
    m = mid_train.parse(["--model_tag", "d2", "--num_iterations", "5", "--no-compile"])
    s = chat_sft.parse([])
    assert (m.source, m.model_tag, m.num_iterations, m.compile, m.init_lr_frac) == ("base", "d2", 5, False, 1.0)
    assert (s.source, s.init_lr_frac, s.warmdown_ratio) == ("mid", 0.02, 1.0)


def test_missing_previous_stage_names_flag_and_command(env, tmp_path, monkeypatch):
    from scripts import chat_rl, chat_sft, mid_train
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))  # nothing trained here
    cpu = ["--device", "cpu", "--model-tag", "nope"]
    with pytest.raises(ck.CheckpointError) as e:
        chat_sft.main(cpu)
    assert "--source mid" in str(e.value) and "python -m scripts.mid_train --model-tag nope" in str(e.value)
    with pytest.raises(ck.CheckpointError, match="scripts.base_train"):
        mid_train.main(cpu)
    with pytest.raises(ck.CheckpointError, match="scripts.chat_sft"):
        chat_rl.main(cpu)


# ------------------------------------------------------------------ the tiny pipeline

BASE = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "128",
        "--device-batch-size", "4", "--total-batch-size", "512", "--window-pattern", "SL", "--sample-every", "-1",
        "--eval-tokens", "2048", "--no-compile", "--model-tag", "pipe", "--matrix-lr", "0.04"]
CHAT = ["--device", "cpu", "--model-tag", "pipe", "--device-batch-size", "4", "--max-seq-len", "128",
        "--total-batch-size", "512", "--test-holdout", "50", "--eval-tokens", "2048", "--no-compile"]


@pytest.mark.slow
def test_tiny_pipeline_base_mid_sft_rl_eval_report(env, base_dir, capsys):
    from nanochat.report import Report, read_metrics, report_dir
    from scripts import base_train, chat_eval, chat_rl, chat_sft, mid_train

    base = base_train.main(BASE + env + ["--num-iterations", "20", "--eval-every", "10"])
    assert base["final_val_bpb"] < 4.5

    mid_args = CHAT + ["--num-iterations", "4", "--eval-every", "2", "--save-every", "2"]
    mid = mid_train.main(mid_args)
    resumed = mid_train.main(mid_args + ["--resume", "2"])
    assert [resumed["losses"][s] for s in (2, 3)] == [mid["losses"][s] for s in (2, 3)]  # exact resume
    assert mid["final_val_bpb"] < 10 and all(math.isfinite(v) for v in mid["losses"].values())
    meta = ck.read_meta(ck.checkpoint_dir("mid", "pipe"))
    assert meta["source"]["phase"] == "base" and meta["source"]["step"] == 20 and meta["train"]["mask"] == "all"

    sft = chat_sft.main(CHAT + ["--num-iterations", "4", "--eval-every", "4", "--init-lr-frac", "0.5"])
    assert math.isfinite(sft["final_val_bpb"]) and ck.read_meta(ck.checkpoint_dir("sft", "pipe"))["train"]["mask"] \
        == "assistant"

    rl_args = ["--device", "cpu", "--model-tag", "pipe", "--num-iterations", "1", "--examples-per-step", "1",
               "--num-samples", "2", "--max-new-tokens", "8", "--test-holdout", "1", "--eval-examples", "2",
               "--eval-every", "1", "--eval-samples", "3"]
    rl = chat_rl.main(rl_args)
    assert rl["final_gsm8k_pass@1"] is not None and ck.read_latest(ck.checkpoint_dir("rl", "pipe")) == 1
    # scored on held-out problems only: the first --test-holdout of the test split (training takes the rest)
    assert ck.read_meta(ck.checkpoint_dir("rl", "pipe"))["train"]["eval_problems"] == 1
    # its loader position counts problems of that task, in that order, that many a step: a resume
    # with other such flags is refused (it went on silently)
    with pytest.raises(ck.CheckpointError, match="had --examples-per-step 1, this run has 2"):
        chat_rl.main(rl_args + ["--resume", "latest", "--num-iterations", "2", "--examples-per-step", "2"])
    with pytest.raises(ck.CheckpointError, match="had --test-holdout 1, this run has 2"):
        chat_rl.main(rl_args + ["--resume", "latest", "--num-iterations", "2", "--test-holdout", "2"])
    capsys.readouterr()
    fresh = chat_rl.main(rl_args + ["--resume", "auto", "--seed", "7", "--eval-every", "-1"])   # auto: afresh
    assert "cannot be continued (the checkpoint's run had --seed 42, this run has 7): starting fresh" \
        in capsys.readouterr().out and sorted(fresh["losses"]) == [0]
    sampled = [rl[f"final_gsm8k_sampled_pass@{k}"] for k in (1, 2, 3)]   # upstream's figure, non-decreasing in k
    assert all(0 <= a <= b <= 1 for a, b in zip(sampled, sampled[1:]))

    for source in ("sft", "rl"):
        out = chat_eval.main(["-i", source, "--model-tag", "pipe", "--device", "cpu", "--max-problems", "2",
                              "--max-new-tokens", "8", "--batch-size", "2"])
        assert out["complete"] and all(0.0 <= r["accuracy"] <= 1.0 for r in out["results"].values())
        saved = base_dir / "chat_eval" / f"{source}_pipe_step{out['step']:06d}.json"   # one file per checkpoint
        assert json.loads(saved.read_text())["step"] == out["step"]
    sampled = chat_eval.main(["-i", "rl", "--model-tag", "pipe", "--device", "cpu", "--max-problems", "2",
                              "--max-new-tokens", "8", "-a", "GSM8K", "--num-samples", "3", "--temperature", "1.0"])
    curve = sampled["results"]["GSM8K"]["pass_at"]   # pass@1..3, the last one the task's accuracy
    assert list(curve) == ["1", "2", "3"] and curve["3"] == sampled["results"]["GSM8K"]["accuracy"]
    assert curve["1"] <= curve["2"] <= curve["3"]

    report = Report(report_dir(base_dir))
    path = report.generate()
    text = path.read_text()
    assert "## Summary" in text and "| ChatCORE |" in text and "Midtraining" in text and "Chat SFT" in text
    for name in ("loss_vs_step.png", "val_bpb_vs_step.png", "tok_per_sec.png", "loss_vs_time.png"):
        png = report.dir / "plots" / name
        assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG" and f"plots/{name}" in text
    summary = report.summary()
    for stage in ("sft", "rl"):
        assert 0.0 <= summary["ARC-Easy"][stage] <= 1.0 and -1.0 <= summary["ChatCORE"][stage] <= 1.0
    metrics = read_metrics(base_dir)
    assert {"base", "mid", "sft", "rl"} <= set(metrics)
    assert any("val_bpb" in r for r in metrics["mid"]) and any("reward" in r for r in metrics["rl"])
    assert all(math.isfinite(r["loss"]) for r in metrics["sft"] if "loss" in r)


@pytest.mark.slow
def test_resume_auto_continues_only_a_run_from_the_same_weights(env, base_dir, capsys):
    """mid --resume auto: an interrupted run from the same base checkpoint continues; once base has
    been retrained under the tag (other weights at the same step), the old mid run is not
    continued (it would hand on a model of the old base): a fresh start says so and records the
    new base's model.pt sha256."""
    from scripts import base_train, mid_train

    base_args = BASE + env + ["--model-tag", "again", "--num-iterations", "4", "--eval-every", "-1"]
    base_train.main(base_args)
    mid_args = [*CHAT, "--model-tag", "again", "--num-iterations", "4", "--eval-every", "-1", "--save-every", "2"]
    mid_dir = ck.checkpoint_dir("mid", "again")
    mid_train.main(mid_args + ["--num-iterations", "2"])         # stands for a run stopped at step 2
    digest = ck.model_digest(ck.checkpoint_dir("base", "again"), 4)
    assert len(digest) == 64 and ck.read_meta(mid_dir)["source"]["model_sha256"] == digest
    capsys.readouterr()
    resumed = mid_train.main(mid_args + ["--resume", "auto"])
    assert "resuming the latest checkpoint" in capsys.readouterr().out and sorted(resumed["losses"]) == [2, 3]

    base_train.main(base_args + ["--overwrite", "--seed", "7"])  # base retrained: same tag, same step
    fresh = mid_train.main(mid_args + ["--resume", "auto"])
    out = capsys.readouterr().out
    assert "that run started from base/again step 4, and base/again is now step 4 with other weights: " \
           "starting fresh instead" in out
    assert sorted(fresh["losses"]) == [0, 1, 2, 3]
    new_digest = ck.model_digest(ck.checkpoint_dir("base", "again"), 4)
    assert new_digest != digest and ck.read_meta(mid_dir)["source"]["model_sha256"] == new_digest
    # the old base's mid run (steps 2 and 4) is kept aside, not mixed with this one's saves
    assert f"moved the earlier run's checkpoints (steps [2, 4]) to {mid_dir / 'earlier_runs' / '1'}" in out
    assert ck.read_meta(mid_dir / "earlier_runs" / "1")["source"]["model_sha256"] == digest

    # another batch (setup.sh reruns a stage whose flags changed): auto starts fresh, an explicit
    # --resume still names what differs
    bigger = [*mid_args, "--total-batch-size", "1024", "--num-iterations", "2"]
    with pytest.raises(ck.CheckpointError, match="--total-batch-size 512 but this run has 1024"):
        mid_train.main(bigger + ["--resume", "latest"])
    capsys.readouterr()
    again = mid_train.main(bigger + ["--resume", "auto"])
    assert "latest checkpoint cannot be continued (the checkpoint has --total-batch-size 512 but this run has " \
           "1024): starting fresh" in capsys.readouterr().out
    assert sorted(again["losses"]) == [0, 1] and ck.read_meta(mid_dir)["train"]["total_batch_size"] == 1024
    # the 4-step run's step 4 no longer outlives it in the tag: a --resume 4 would have taken it
    assert ck.list_steps(mid_dir) == [2] and ck.list_steps(mid_dir / "earlier_runs" / "2") == [2, 4]

    # no --resume: a fresh run into the tag is refused before the model loads; --overwrite moves
    # the earlier run to earlier_runs/3 at its first save (the earlier ones are left alone)
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ck, "load_model", no_load)
        with pytest.raises(ck.CheckpointError, match=r"holds checkpoints of an earlier run \(steps \[2\]\); .* "
                                                     r"--overwrite to start afresh \(moving them to earlier_runs/"):
            mid_train.main(mid_args)
    capsys.readouterr()
    mid_train.main(mid_args + ["--num-iterations", "1", "--overwrite"])
    out = capsys.readouterr().out
    assert f"--overwrite: the earlier run's checkpoints (steps [2], " in out and f") in {mid_dir} are moved to " \
           f"{mid_dir / 'earlier_runs' / '3'} at this run's first save and kept there" in out
    assert f"--overwrite: moved the earlier run's checkpoints (steps [2]) to {mid_dir / 'earlier_runs' / '3'}" in out
    assert ck.list_steps(mid_dir) == [1] and ck.list_steps(mid_dir / "earlier_runs" / "3") == [2]
    assert sorted(p.name for p in (mid_dir / "earlier_runs").iterdir()) == ["1", "2", "3"]


def test_broken_or_empty_sft_data_fails_before_the_model_is_loaded(env, tmp_path, monkeypatch):
    from nanochat import chat_start
    from nanochat.errors import DataError, MissingDataError
    from scripts import chat_sft

    def no_model(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the data was checked")

    monkeypatch.setattr(chat_start, "resolve_source", lambda *a, **k: ("d2", tmp_path / "ckpt"))
    monkeypatch.setattr(ck, "load_model", no_model)
    monkeypatch.setattr(ck, "load_checkpoint", no_model)
    sft = tmp_path / "root" / "sft"
    sft.mkdir(parents=True)
    chat = sft / "chat.jsonl"
    chat.write_text(json.dumps(CONVS[0]) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    args = ["--device", "cpu", "--data-dir", str(tmp_path / "root")]
    with pytest.raises(DataError, match=f"{chat}:2: messages\\[0\\].role is 'robot'"):
        chat_sft.main(args)
    chat.write_text("")  # an empty SFT file: not "0 conversations trained"
    with pytest.raises(MissingDataError, match=f"{chat}: empty"):
        chat_sft.main(args)


def test_sft_takes_a_slice_of_the_chat_conversations_mid_takes_all(shared_data, monkeypatch):
    """SFT's general chat is the first SFT_CONVERSATIONS (10K: upstream's SFT, where SmolTalk's 460K
    made it an hours-long second pass of mid-training's data); mid-training takes them all."""
    from nanochat import chat_data
    monkeypatch.setattr(chat_data, "SFT_CONVERSATIONS", 100)
    mid = chat_data.build_mixture("mid", "train", data_dir=shared_data, test_holdout=100)
    sft = chat_data.build_mixture("sft", "train", data_dir=shared_data, test_holdout=100)
    assert len(mid.tasks[0]) > 1000 and len(sft.tasks[0]) == 100
    assert [sft.tasks[0][i] for i in range(3)] == [mid.tasks[0][i] for i in range(3)]   # the first ones
    assert chat_data.SFT_CONVERSATIONS == 100 and len(sft) < len(mid)


def test_mfu_counts_the_rows_trained_not_the_models_context(env, base_dir, monkeypatch):
    """--max-seq-len below the model's context: the meter's FLOPs/token (hence MFU) is the model's
    estimate at the trained row length (its attention sees fewer keys per query). It used the
    model's full sequence length (128 here: 4x the attention FLOPs of 32-token rows)."""
    from nanochat import training
    from nanochat.gpt import GPTConfig
    from nanochat.checkpoint import build_model
    from scripts import base_train, mid_train

    base_train.main(BASE + env + ["--model-tag", "flops", "--num-iterations", "1", "--eval-every", "-1"])
    seen, real = [], training.StepMeter
    monkeypatch.setattr(training, "StepMeter", lambda fpt, *a, **kw: seen.append(fpt) or real(fpt, *a, **kw))
    from nanochat.gpt import GPT
    prepared, real_prepare = [], GPT.prepare_attention   # the rows' masks cached before compile, too
    monkeypatch.setattr(GPT, "prepare_attention", lambda self, seq_len=None, **kw:
                        prepared.append(seq_len) or real_prepare(self, seq_len, **kw))
    mid_train.main(CHAT + ["--model-tag", "flops", "--device-batch-size", "2", "--max-seq-len", "32",
                           "--total-batch-size", "64", "--num-iterations", "1", "--eval-every", "-1"])
    model = build_model(GPTConfig(**ck.read_meta(ck.checkpoint_dir("base", "flops"))["model_config"]), "meta")
    assert model.config.sequence_len == 128
    assert seen == [model.estimate_flops(32)] and model.estimate_flops(32) < model.estimate_flops()
    assert prepared[-1] == 32


def test_missing_train_split_is_one_line_naming_test_holdout(shared_data, monkeypatch):
    """No GSM8K train split here (no hub): a MissingDataError (one line from the scripts, exit 2)
    naming --test-holdout; it was a plain ValueError, a traceback."""
    from nanochat import chat_data
    from nanochat.errors import MissingDataError
    from nanochat.tasks import common as tasks_common

    def no_datasets():
        raise ImportError("No module named 'datasets'")
    monkeypatch.setattr(tasks_common, "_import_datasets", no_datasets)
    with pytest.raises(MissingDataError, match="pass --test-holdout N"):
        chat_data.build_mixture("rl", "train", data_dir=shared_data)
