"""scripts/base_train.py and scripts/base_eval.py on CPU: flag validation, exact resume (bit for
bit), the NaN guard through the real loop, and a tiny end-to-end run (tokenizer -> d2 model ->
val bpb below the unigram baseline -> base_eval JSON -> load_model). bench_train's CPU runs:
tests/test_bench_train.py."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from nanochat import checkpoint as ck
from nanochat.training import NonFiniteLossError

REPO = Path(__file__).resolve().parents[1]
VOCAB = 1024
TINY = ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
        "--device-batch-size", "8", "--total-batch-size", "512", "--window-pattern", "SL",
        "--sample-every", "-1", "--eval-tokens", "4096", "--no-compile"]


def _texts(path: Path) -> list[str]:
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def _train(args):
    from scripts import base_train
    return base_train.main(args)


# ------------------------------------------------------------------ flags

def test_parse_accepts_underscore_spellings():
    from scripts.base_train import parse_config
    cfg = parse_config(["--device_batch_size", "4", "--target_param_data_ratio", "10", "--save_every", "5",
                        "--sample_every", "3", "--run", "myrun", "--wandb", "off", "--model_tag", "t",
                        "--max_seq_len", "128", "--no-compile", "--peak_flops", "1e14"])
    assert (cfg.device_batch_size, cfg.target_param_data_ratio, cfg.save_every, cfg.sample_every) == (4, 10.0, 5, 3)
    assert (cfg.run, cfg.model_tag, cfg.max_seq_len, cfg.compile, cfg.peak_flops) == ("myrun", "t", 128, False, 1e14)


def test_lowercase_window_pattern_reaches_the_model():
    """validate() accepts --window-pattern case-insensitively, so the model must get it too (it
    raised in GPTConfig.validate after the data loaders were built)."""
    from nanochat.gpt import config_for_depth, layer_windows
    from scripts.base_train import parse_config
    cfg = parse_config(["--window-pattern", "sl", "--max-seq-len", "64"])
    assert cfg.window_pattern == "SL"
    model_cfg = config_for_depth(4, 1024, cfg.max_seq_len, aspect_ratio=32, head_dim=32,
                                 window_pattern=cfg.window_pattern)
    assert layer_windows(model_cfg) == [16, None, 16, None]


@pytest.mark.parametrize("argv, flag", [
    (["--depth", "0"], "--depth"),
    (["--depth", "two"], "--depth"),
    (["--device-batch-size", "-4"], "--device-batch-size"),
    (["--max-seq-len", "2"], "--max-seq-len"),
    (["--window-pattern", "SXL"], "--window-pattern"),
    (["--kernel", "cudnn"], "--kernel"),
    (["--precision", "fp16"], "--precision"),
    (["--precision-backend", "cutlass"], "--precision-backend"),
    (["--device", "tpu"], "--device"),
    (["--resume", "yesterday"], "--resume"),
    (["--num-iterations", "0"], "--num-iterations"),
    (["--target-param-data-ratio", "-1"], "--target-param-data-ratio"),
    (["--warmdown-ratio", "1.5"], "--warmdown-ratio"),
    (["--eval-tokens", "100", "--device-batch-size", "4", "--max-seq-len", "64"], "--eval-tokens"),
    (["--peak-flops", "0"], "--peak-flops"),
    (["--wandb", "maybe"], "--wandb"),
    (["--data-dir", "/nonexistent/shards"], "--data-dir"),
    (["--attn-backend", "fa3"], "--attn-backend"),
    (["--matrix-lr", "nan"], "--matrix-lr"),
    (["--fp8-wgrad", "fast"], "--fp8-wgrad"),
    (["--fp8-wgrad", "recompute"], "--fp8-wgrad"),   # bf16 run: the mode would do nothing
    (["--precision", "fp8", "--precision-backend", "te", "--fp8-wgrad", "plain"], "--fp8-wgrad"),
    (["--no-such-flag", "1"], "--no-such-flag"),
    (["--recipe", "v3"], "--recipe"),
    (["--warmup-steps", "5", "--warmup-ratio", "0.1"], "--warmup-steps"),
    (["--warmup-steps", "-1"], "--warmup-steps"),
    (["--normuon-beta2", "1"], "--normuon-beta2"),
    # fp8 GEMMs take rows in multiples of 16: a 1 x 100 micro-batch ran bf16 while labelled fp8
    (["--precision", "fp8", "--device-batch-size", "1", "--max-seq-len", "100"], "--max-seq-len"),
    # so does TE's nvfp4 quantiser (emulation quantises along K only: any row count)
    (["--precision", "nvfp4", "--precision-backend", "te", "--device-batch-size", "1", "--max-seq-len", "100"],
     "--max-seq-len"),
])
def test_bad_flags_name_the_flag(argv, flag):
    from scripts.base_train import parse_config
    with pytest.raises(ValueError, match=flag):
        parse_config(argv)


def test_emulated_nvfp4_takes_any_row_count():
    from scripts.base_train import parse_config
    cfg = parse_config(["--precision", "nvfp4", "--precision-backend", "emulated", "--device-batch-size", "1",
                        "--max-seq-len", "100"])
    assert cfg.max_seq_len == 100


def test_impossible_batch_arithmetic_raises_with_numbers():
    from scripts.base_train import parse_config
    with pytest.raises(ValueError) as e:
        parse_config(["--total-batch-size", "1000", "--device-batch-size", "8", "--max-seq-len", "64"])
    assert "--total-batch-size" in str(e.value) and "8 x 64 x 1 = 512" in str(e.value)


USER_ERRORS = [
    (["--depth=-3"], "base_train: error: --depth: got -3"),                          # a bad flag
    (["--device", "cpu", "--precision", "nvfp4"], "base_train: error: --precision nvfp4: needs a Blackwell"),
    (["--device", "cpu"], "base_train: error: tokenizer at "),                      # nothing set up yet
    # before the tokenizer, data and model (it was a traceback after the model was built / at step 0)
    (["--device", "cpu", "--kernel", "liger"], "base_train: error: --kernel liger needs a CUDA GPU"),
    (["--device", "cpu", "--attn-backend", "flex"], "base_train: error: --attn-backend flex has no backward on CPU"),
]


@pytest.fixture(scope="module")
def user_error_runs(tmp_path_factory):
    """Each case's subprocess (each imports torch, ~3 s on a CI core), two at a time, each with
    its own empty base dir: case index -> (CompletedProcess, base dir)."""
    def run(i):
        base = tmp_path_factory.mktemp(f"user_error{i}")
        env = {**os.environ, "NANOCHAT_BASE_DIR": str(base)}
        return subprocess.run([sys.executable, "-m", "scripts.base_train", *USER_ERRORS[i][0]], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120), base
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(run, range(len(USER_ERRORS))))


@pytest.mark.parametrize("case", range(len(USER_ERRORS)), ids=[" ".join(a) for a, _ in USER_ERRORS])
def test_user_errors_exit_2_with_one_line(user_error_runs, case):
    """Bad flags, requests the machine cannot meet and missing files: one line naming the flag or
    the path (and what to do), exit 2, no traceback (nanochat.common.script_main)."""
    (args, message), (r, base) = USER_ERRORS[case], user_error_runs[case]
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    if "--kernel" in args or "--precision" in args or "--attn-backend" in args:
        # refused before the checkpoint directory is made (it was left holding only its writer lock)
        assert not (base / "checkpoints").exists(), list(base.rglob("*"))


# ------------------------------------------------------------------ exact resume

def test_exact_resume_bit_for_bit(env, base_dir):
    args = TINY + env + ["--num-iterations", "8", "--save-every", "4", "--eval-every", "-1",
                         "--model-tag", "resume", "--weight-decay", "0.1", "--grad-clip", "1.0",
                         "--warmup-ratio", "0.25"]
    full = _train(args)
    d = ck.checkpoint_dir("base", "resume", base_dir)
    assert ck.list_steps(d) == [4, 8] and ck.read_latest(d) == 8
    final_a = ck.load_checkpoint(d, 8, load_optimizer=True)

    resumed = _train(args + ["--resume", "4"])
    assert sorted(resumed["losses"]) == [4, 5, 6, 7]
    for step in range(4, 8):
        assert resumed["losses"][step] == full["losses"][step], f"step {step} differs"  # exact, not approx
    final_b = ck.load_checkpoint(d, 8, load_optimizer=True)
    for k, v in final_a["model"].items():
        assert torch.equal(v, final_b["model"][k]), k
    assert final_a["loader"] == final_b["loader"]
    assert final_a["loop"]["meter"] == final_b["loop"]["meter"]
    # the default recipe (v2: NorMuon's buffers are in the optimizer state) is recorded, resolved;
    # a resume keeps it, and asking for another one is refused before anything is built
    from nanochat.recipe import DEFAULT_RECIPE
    assert final_b["meta"]["config"]["recipe"] == DEFAULT_RECIPE == "v2"
    assert any("second_moment" in st for st in final_b["optimizer"]["state"].values())
    with pytest.raises(ValueError, match="--recipe: got 'v1' but the checkpoint was trained with 'v2'"):
        _train(args + ["--resume", "4", "--recipe", "v1"])
    # resuming with a different batch layout is refused with the reason
    with pytest.raises(ValueError, match="--total-batch-size 512 but this run has 1024"):
        _train(TINY[:-1] + env + ["--total-batch-size", "1024", "--num-iterations", "8", "--eval-every", "-1",
                                  "--model-tag", "resume", "--resume", "4", "--no-compile"])
    # a checkpoint past --num-iterations cannot be continued (it used to loop forever)
    with pytest.raises(ValueError, match="at step 8, past --num-iterations 6"):
        _train(TINY[:-1] + env + ["--num-iterations", "6", "--eval-every", "-1", "--model-tag", "resume",
                                  "--resume", "latest", "--no-compile"])


# ------------------------------------------------------------------ NaN guard

def test_nan_guard_in_the_loop(env, base_dir, monkeypatch):
    from nanochat import gpt
    real_forward = gpt.GPT.forward
    calls = {"train": 0}

    def forward(self, idx, targets=None, *a, **kw):
        out = real_forward(self, idx, targets, *a, **kw)
        if targets is not None and torch.is_grad_enabled():
            calls["train"] += 1
            if calls["train"] > 5:       # steps 0..4 fine (1 micro-batch each), step 5 poisoned
                out = out * float("nan")
        return out
    monkeypatch.setattr(gpt.GPT, "forward", forward)
    with pytest.raises(NonFiniteLossError) as e:
        _train(TINY + env + ["--num-iterations", "10", "--save-every", "2", "--eval-every", "-1",
                             "--model-tag", "nan"])
    ckpt = ck.checkpoint_dir("base", "nan", base_dir) / "step_000004"
    assert e.value.step == 5 and e.value.last_checkpoint == str(ckpt)
    assert "at step 5" in str(e.value) and str(ckpt) in str(e.value) and "hint" in str(e.value)


def test_non_finite_weights_are_never_saved(env, base_dir):
    """Step 0's loss is finite, but its update (learning rates of 1e38) leaves non-finite weights:
    the save at step 1 refuses them (the NaN guard named that NaN checkpoint the last good one and
    latest.json pointed at it)."""
    with pytest.raises(NonFiniteLossError, match=r"non-finite weights \(nan\) at step 1; no checkpoint was saved"):
        _train(TINY + env + ["--num-iterations", "4", "--save-every", "1", "--eval-every", "-1", "--recipe", "v1",
                             "--embedding-lr", "1e38", "--unembedding-lr", "1e38", "--scalar-lr", "1e38",
                             "--model-tag", "blowup"])
    assert ck.list_steps(ck.checkpoint_dir("base", "blowup", base_dir)) == []


# ------------------------------------------------------------------ end to end

def unigram_bpb(tokenizer, train_texts, val_texts) -> float:
    """Bits per byte of the val split under a unigram model of the train split's token counts
    (add-one smoothed), with the same byte accounting as evaluate_bpb."""
    counts = np.ones(tokenizer.vocab_size)
    for ids in tokenizer.encode(train_texts, prepend="<|bos|>"):
        counts += np.bincount(ids, minlength=tokenizer.vocab_size)
    logp = np.log2(counts / counts.sum())
    tb = tokenizer.token_bytes().numpy()
    bits = nbytes = 0.0
    for ids in tokenizer.encode(val_texts, prepend="<|bos|>"):
        targets = np.asarray(ids[1:])
        text = tb[targets] > 0
        bits -= logp[targets][text].sum()
        nbytes += tb[targets].sum()
    return bits / nbytes


@pytest.mark.slow
def test_tiny_end_to_end(env, base_dir, tiny_corpus, tmp_path):
    from nanochat.tokenizer import get_tokenizer
    from scripts import base_eval
    # recipe v1, as setup.sh's tiny preset: v2 would scale the LRs by sqrt(512 / 2^19) here
    summary = _train(TINY + env + ["--num-iterations", "40", "--eval-every", "40", "--eval-tokens", "16384",
                                   "--model-tag", "e2e", "--sample-every", "40", "--matrix-lr", "0.04",
                                   "--recipe", "v1"])
    tok = get_tokenizer()
    baseline = unigram_bpb(tok, _texts(tiny_corpus / "shard_00000.parquet"), _texts(tiny_corpus / "shard_00001.parquet"))
    losses = summary["losses"]
    assert losses[39] < losses[0] - 1.0
    assert summary["final_val_bpb"] < baseline, (summary["final_val_bpb"], baseline)

    out = tmp_path / "eval.json"
    res = base_eval.main(["--model-tag", "e2e", "--eval", "bpb,sample", "--device", "cpu", "--eval-tokens",
                          "16384", "--device-batch-size", "8", "--max-tokens", "8", "--output", str(out)] + env)
    written = json.loads(out.read_text())
    assert written["step"] == 40 and written["bpb"]["val"] == pytest.approx(summary["final_val_bpb"], rel=1e-5)
    assert len(written["samples"]) == 5 and all(s["text"].startswith("<|bos|>") for s in written["samples"])
    assert res["bpb"]["val"] < baseline
    # the int8 weight-only model (chat_web --quantize int8) scores within a hair of it, and its
    # results go to a file of their own (default path: <name>_int8.json beside the first)
    res8 = base_eval.main(["--model-tag", "e2e", "--eval", "bpb", "--device", "cpu", "--eval-tokens", "16384",
                           "--device-batch-size", "8", "--quantize", "int8"] + env)
    assert res8["output"].endswith("_int8.json") and res8["config"]["quantize"] == "int8"
    assert res8["bpb"]["val"] != res["bpb"]["val"] and abs(res8["bpb"]["val"] - res["bpb"]["val"]) < 0.01

    model, tok2, meta = ck.load_model("base", "cpu", model_tag="e2e")
    assert not model.training and meta["tokenizer_fingerprint"] == tok2.fingerprint
    assert meta["train"]["num_iterations"] == 40 and meta["model_config"]["n_layer"] == 2
    assert meta["train"]["attention"] == "sdpa"   # what --attn-backend auto ran (probe-dependent on a GPU)


def test_load_model_refuses_other_tokenizer(env, base_dir, tmp_path):
    """A checkpoint is only loaded with the tokenizer it was trained with."""
    from nanochat.gpt import config_for_depth
    from nanochat.checkpoint import build_model
    from nanochat.tokenizer import get_tokenizer
    from dataclasses import asdict
    tok = get_tokenizer()
    cfg = config_for_depth(1, tok.vocab_size, 32, aspect_ratio=32, head_dim=32)
    model = build_model(cfg, "cpu")
    d = ck.checkpoint_dir("sft", "tiny", base_dir)
    ck.save_checkpoint(d, 3, model_state=model.state_dict(), meta={"model_config": asdict(cfg),
                                                                    "tokenizer_fingerprint": "0" * 64})
    with pytest.raises(ck.CheckpointError, match="trained with tokenizer 0000"):
        ck.load_model("sft", "cpu", model_tag="tiny")
    ck.save_checkpoint(d, 4, model_state=model.state_dict(), meta={"model_config": asdict(cfg),
                                                                    "tokenizer_fingerprint": tok.fingerprint})
    loaded, _, meta = ck.load_model("sft", "cpu", model_tag="tiny")
    assert meta["step"] == 4
    for k, v in model.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k])
    x = torch.randint(0, tok.vocab_size, (1, 8))
    torch.testing.assert_close(model(x), loaded(x))  # rotary buffers rebuilt after to_empty


def test_base_eval_core_requested_but_flags_checked_first():
    from scripts.base_eval import parse_config
    with pytest.raises(ValueError, match="--eval"):
        parse_config(["--eval", "bpb,mmlu"])
    with pytest.raises(ValueError, match="-i/--source"):
        parse_config(["-i", "pretrain"])
    assert parse_config(["-i", "mid", "--eval", "core", "--max_per_task", "5"]).max_per_task == 5


# a compiled d4 base_train on the GPU with --kernel triton, 20 steps (the CUDA tests below)
CUDA_TINY_RUN = ["--device", "cuda", "--depth", "4", "--max-seq-len", "256", "--device-batch-size", "8",
                 "--total-batch-size", "4096", "--window-pattern", "SL", "--eval-tokens", "16384",
                 "--sample-every", "-1", "--num-iterations", "20", "--eval-every", "20", "--compile",
                 "--kernel", "triton"]


@pytest.mark.cuda
def test_tiny_train_cuda_compiled(env, base_dir):
    """The GPU path: bf16, torch.compile, the triton loss kernel, MFU against the table's peak."""
    summary = _train(CUDA_TINY_RUN + ["--model-tag", "cuda"] + env)
    losses = summary["losses"]
    # 6.93 -> 5.93 on an H200 (session 69; the CPU path's losses are the same to 4 decimals before and
    # after that session's changes): a 1.0 margin failed by 0.001-0.002 of GPU run-to-run noise
    assert all(math.isfinite(v) for v in losses.values()) and losses[19] < losses[0] - 0.8
    assert summary["final_val_bpb"] < 4.0 and summary["peak_mem_gib"] > 0


@pytest.mark.cuda
def test_tiny_train_cuda_compiled_fp8(env, base_dir):
    """The fp8 GPU path with every --kernel triton fusion (fp8 MLP, q/k with the gradient's
    abs-max, the mix-norm with the residual add and the x0 gradient sum inside) trains."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability >= 8.9")
    summary = _train(CUDA_TINY_RUN + ["--precision", "fp8", "--model-tag", "cudafp8"] + env)
    losses = summary["losses"]
    assert all(math.isfinite(v) for v in losses.values()) and losses[19] < losses[0] - 0.8   # (see above)


# ------------------------------------------------------------------ damaged data: before the model

def _no_model(*args, **kwargs):
    raise AssertionError("a model was built before the data was checked")


def _copy_corpus(tiny_corpus: Path, dest: Path) -> Path:
    import shutil
    dest.mkdir(parents=True)
    for p in sorted(tiny_corpus.glob("*.parquet")):
        shutil.copyfile(p, dest / p.name)
    return dest


def test_damaged_data_fails_before_the_model_is_built(env, base_dir, tiny_corpus, tmp_path, monkeypatch):
    from nanochat.errors import DataError, MissingDataError
    data = _copy_corpus(tiny_corpus, tmp_path / "data")
    val = data / "shard_00001.parquet"
    val.write_bytes(val.read_bytes()[:5000])  # only the val split is damaged: checked up front too
    monkeypatch.setattr(ck, "build_model", _no_model)
    args = TINY + ["--data-dir", str(data), "--num-iterations", "1", "--eval-every", "-1", "--model-tag", "bad"]
    with pytest.raises(DataError, match=f"{val}: not a readable parquet file"):
        _train(args)
    pq.write_table(pq.read_table(tiny_corpus / "shard_00001.parquet"), val)
    import pyarrow as pa
    pq.write_table(pa.table({"text": ["", ""]}), data / "shard_00000.parquet")
    with pytest.raises(MissingDataError, match="split 'train' .* has no non-empty documents"):
        _train(args)
    # base_eval --eval bpb: the loaders are built from the checkpoint's meta.json, before its weights
    from scripts import base_eval
    meta = {"model_config": {"sequence_len": 64}, "tokenizer_fingerprint": None}
    ck.save_checkpoint(ck.checkpoint_dir("base", "bad", base_dir), 1, model_state={}, meta=meta)
    monkeypatch.setattr(ck, "load_model", _no_model)
    with pytest.raises(MissingDataError, match="has no non-empty documents"):
        base_eval.main(["--device", "cpu", "--model-tag", "bad", "--eval", "bpb", "--splits", "train,val",
                        "--data-dir", str(data)])
    # --eval core: every CORE file is read before the weights; a record without its task's fields
    # or a file too short for its few-shot prompts is one DataError naming the file
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "copa.jsonl").write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n')
    monkeypatch.setenv("NANOCHAT_EVAL_DIR", str(evals))
    with pytest.raises(DataError, match=r"copa.jsonl: record 1 does not have the fields .*relation"):
        base_eval.main(["--device", "cpu", "--model-tag", "bad", "--eval", "core"])
    (evals / "copa.jsonl").unlink()   # an absent file: the task is reported missing, not an error
    (evals / "hellaswag.jsonl").write_text('{"ctx": "c", "activity_label": "a", "endings": ["x", "y"], "label": 0}\n')
    with pytest.raises(DataError, match=r"CORE task hellaswag \(.*/hellaswag.jsonl\): 1 records; its 10-shot"):
        base_eval.main(["--device", "cpu", "--model-tag", "bad", "--eval", "core"])
    (evals / "hellaswag.jsonl").unlink()
    (evals / "bigbench_operators.jsonl").write_text("")
    with pytest.raises(DataError, match=r"CORE task bigbench_operators \(.*/bigbench_operators.jsonl\): 0 records"):
        base_eval.main(["--device", "cpu", "--model-tag", "bad", "--eval", "core"])
    (evals / "bigbench_operators.jsonl").write_text("not json\n")
    with pytest.raises(DataError, match=r"bigbench_operators.jsonl:1: not a JSON object"):
        base_eval.main(["--device", "cpu", "--model-tag", "bad", "--eval", "core"])


def test_banner_names_the_data_it_reads(env, base_dir, tiny_corpus, tmp_path, capsys):
    from scripts.pretokenize import pretokenize
    from nanochat.binshards import default_bin_dir
    from nanochat.tokenizer import get_tokenizer
    data = _copy_corpus(tiny_corpus, tmp_path / "data")
    args = TINY + ["--data-dir", str(data), "--num-iterations", "1", "--eval-every", "-1", "--model-tag", "banner"]
    _train(args)
    assert f"data                         : text shards {data}\n" in capsys.readouterr().out
    pretokenize(sorted(data.glob("*.parquet")), default_bin_dir(data), get_tokenizer(base_dir), log=lambda *a: None)
    _train(args + ["--overwrite"])
    out = capsys.readouterr().out
    assert f": binary token shards {default_bin_dir(data)}\n" in out
    assert "--overwrite: moved the earlier run's checkpoints (steps [1]) to " in out


def test_disk_space_is_planned_before_the_model_is_built(env, base_dir, tiny_corpus, monkeypatch, capsys):
    """The banner gives a checkpoint's size (checkpoint_bytes of the meta model), the planned saves
    and the free space; a disk that cannot hold one checkpoint stops the run before any weights."""
    args = TINY + ["--data-dir", str(tiny_corpus), "--num-iterations", "4", "--save-every", "2",
                   "--eval-every", "-1", "--model-tag", "disk"]
    _train(args)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("checkpoints "))
    assert re.search(r"; ~\d MB each, 2 save\(s\) planned \(~\d MB\), [\d.]+ GB free$", line), line
    real_build = ck.build_model

    def meta_only(config, device, **kw):
        assert str(device) == "meta", "a model was built before the disk space was checked"
        return real_build(config, device, **kw)

    monkeypatch.setattr(ck, "build_model", meta_only)
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    with pytest.raises(ck.CheckpointError, match=r"checkpoints/base/disk2: 1 KB free on its disk, but one "
                                                 r"checkpoint of this run needs ~\d+ MB"):
        _train(args[:-1] + ["disk2"])


def test_resume_auto_and_keep_last(env, base_dir, tiny_corpus, capsys):
    """--resume auto starts fresh without a checkpoint and resumes the latest with one (what a rerun
    of setup.sh's interrupted base_train does); --keep-last 2 deletes this run's older saves and the
    one it resumed from, never checkpoints that were on disk before."""
    ckpt_dir = base_dir / "checkpoints" / "base" / "keep"
    args = TINY + ["--data-dir", str(tiny_corpus), "--eval-every", "-1", "--save-every", "2", "--keep-last", "2",
                   "--resume", "auto", "--model-tag", "keep"]
    _train(args + ["--num-iterations", "8"])
    out = capsys.readouterr().out
    assert f"--resume auto: no checkpoint yet, starting in {ckpt_dir}" in out
    assert "4 save(s) planned, at most 3 on disk at once (--keep-last 2)" in out
    assert f"removed checkpoint {ckpt_dir / 'step_000002'} (--keep-last 2)" in out
    assert ck.list_steps(ckpt_dir) == [6, 8]
    summary = _train(args + ["--num-iterations", "12"])
    out = capsys.readouterr().out
    assert f"--resume auto: resuming the latest checkpoint in {ckpt_dir}" in out
    assert sorted(summary["losses"]) == [8, 9, 10, 11]            # it continued at step 8
    assert ck.list_steps(ckpt_dir) == [6, 10, 12]                 # 8 (resumed from) pruned, 6 (before) kept
    with pytest.raises(ValueError, match="--keep-last: got -1"):
        _train(args + ["--keep-last", "-1"])
    with pytest.raises(ValueError, match="--resume: got 'newest'; accepted: latest, a step number, or auto"):
        _train(args + ["--resume", "newest"])


def test_a_fresh_run_does_not_overwrite_an_earlier_runs_checkpoints(env, base_dir, tiny_corpus):
    """Days of training must not vanish under a rerun of the same command without --resume: refused,
    naming the steps and the three ways on, before any model is built."""
    args = TINY + ["--data-dir", str(tiny_corpus), "--num-iterations", "2", "--eval-every", "-1",
                   "--model-tag", "mine"]
    _train(args)
    ckpt_dir = base_dir / "checkpoints" / "base" / "mine"
    before = (ckpt_dir / "step_000002" / "model.pt").read_bytes()
    with pytest.raises(ck.CheckpointError, match=r"holds checkpoints of an earlier run \(steps \[2\]\); a fresh run "
                                                 r"would overwrite them: pass --resume latest \(or auto\) .* --overwrite"):
        _train(args)
    assert (ckpt_dir / "step_000002" / "model.pt").read_bytes() == before
    # (a resume at another --device-batch-size reads the same rows: tests/test_train_review.py)


def test_overwrite_moves_the_earlier_run_aside_only_at_its_first_save(env, base_dir, tiny_corpus, monkeypatch,
                                                                       capsys):
    """--overwrite: a run that fails before its first save (here: building the model) leaves the
    earlier run's checkpoints and latest.json as they were; one that reaches a save moves them to
    earlier_runs/<N>/ (kept: a rerun of an --overwrite command by mistake cost the earlier run)."""
    args = TINY + ["--data-dir", str(tiny_corpus), "--num-iterations", "2", "--eval-every", "-1",
                   "--model-tag", "again"]
    _train(args)
    ckpt_dir = base_dir / "checkpoints" / "base" / "again"
    before = {p.relative_to(ckpt_dir): p.read_bytes() for p in sorted(ckpt_dir.rglob("*")) if p.is_file()}
    real_build = ck.build_model

    def fail_on_device(config, device, **kw):
        if str(device) != "meta":
            raise RuntimeError("the run failed while setting up")
        return real_build(config, device, **kw)

    monkeypatch.setattr(ck, "build_model", fail_on_device)
    with pytest.raises(RuntimeError, match="while setting up"):
        _train(args + ["--overwrite", "--num-iterations", "3"])
    assert {p.relative_to(ckpt_dir): p.read_bytes() for p in sorted(ckpt_dir.rglob("*")) if p.is_file()} == before
    monkeypatch.setattr(ck, "build_model", real_build)
    capsys.readouterr()
    _train(args + ["--overwrite", "--num-iterations", "3"])
    assert f"--overwrite: moved the earlier run's checkpoints (steps [2]) to {ckpt_dir / 'earlier_runs' / '1'}" \
        in capsys.readouterr().out
    assert ck.list_steps(ckpt_dir) == [3] and ck.read_latest(ckpt_dir) == 3
    assert {p.relative_to(ckpt_dir / "earlier_runs" / "1"): p.read_bytes()
            for p in sorted((ckpt_dir / "earlier_runs" / "1").rglob("*")) if p.is_file()} == \
        {k: v for k, v in before.items() if k.name != ".writer.lock"}   # the lock is this directory's


def test_emulated_nvfp4_utilisation_is_labelled_by_the_matmuls_it_runs(env, capsys):
    """Emulated nvfp4 runs bf16 matmuls and its util is taken against the bf16 peak; the log line
    said util(nvfp4) over that number."""
    _train(TINY + env + ["--precision", "nvfp4", "--precision-backend", "emulated", "--num-iterations", "2",
                         "--eval-every", "-1", "--model-tag", "emu"])
    steps = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step 0000") and "| loss" in ln]
    assert steps and all("util(bf16)" in ln for ln in steps), steps


def test_a_resume_back_onto_text_shards_evaluates_on_text_too(env, base_dir, tiny_corpus, tmp_path, monkeypatch):
    """A run started on text shards and pretokenized since resumes on the text shards (its exact
    stream); its val loader, built before the resume from the kind found then (binary), read the
    binary val shard: on several ranks each rank other documents than the run had evaluated on."""
    import shutil

    from nanochat.dataloader import DataLoader
    from nanochat.tokenizer import get_tokenizer
    from scripts import pretokenize as pt

    data = tmp_path / "data"
    shutil.copytree(tiny_corpus, data)
    flags = TINY + ["--data-dir", str(data), "--num-iterations", "2", "--save-every", "1", "--eval-every", "1",
                    "--eval-tokens", "512", "--model-tag", "kinds"]
    _train(flags)
    pt.pretokenize(sorted(data.glob("*.parquet")), data.parent / "data_tokens", get_tokenizer(base_dir),
                   log=lambda *a: None)
    kinds, start = [], DataLoader.__iter__   # every loader the run reads: train and the val pass
    monkeypatch.setattr(DataLoader, "__iter__", lambda self: (kinds.append((self.split, self.source_kind)),
                                                              start(self))[1])
    _train(flags[:flags.index("--num-iterations")] + ["--data-dir", str(data), "--num-iterations", "3",
                                                      "--save-every", "1", "--eval-every", "1",
                                                      "--eval-tokens", "512", "--model-tag", "kinds",
                                                      "--resume", "latest"])
    assert kinds and set(kinds) == {("train", "text"), ("val", "text")}, kinds
