"""Evaluate a checkpoint: python -m scripts.base_eval [-i base] [--model-tag d20] [--eval core,bpb,sample]

- bpb:    bits per byte on the validation split (and the train split with --splits train,val)
- sample: greedy continuations of a few prompts
- core:   the CORE metric via nanochat/core_eval.py
Results are written as JSON to --output (default <base_dir>/eval/<phase>_<tag>_step<N>.json;
`--quantize int8` evaluates the int8-weight model chat_web --quantize int8 serves, into
..._step<N>_int8.json).
Works under torchrun (rank 0 writes the file): CORE's batches, as one process forms them, and bpb's,
from the one stream a single process reads, are dealt whole to the ranks, so CORE's per-item
verdicts and scores and the bpb (over the same tokens) are the same figures on any number of ranks.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nanochat.common import get_base_dir, init_runtime, print0
from nanochat.distributed import group_left_on_success
from nanochat.eval_bpb import EvalBatches, eval_loader, evaluate_bpb
from nanochat.training import DEFAULT_PROMPTS, sample_prompts
from nanochat.flags import FlagParser, check_dir_flag, check_model_tag, check_output_file, require, require_int, script_main
from nanochat.quantize import QUANTIZE_MODES, check_quantize, quantize_model

EVALS = ("core", "bpb", "sample")
PHASES = ("base", "mid", "sft", "rl")


@dataclass
class BaseEvalConfig:
    source: str = "base"                  # checkpoint phase (-i)
    model_tag: str | None = None          # default: the only / deepest d<N> tag
    step: str = "latest"
    eval: str = "core,bpb,sample"
    splits: str = "val"
    device: str = "auto"
    dtype: str = "auto"
    device_batch_size: int = 8
    eval_tokens: int = 10 * 524288
    max_per_task: int = -1                # CORE examples per task (-1 = all)
    max_tokens: int = 32                  # sample length
    data_dir: str | None = None
    output: str | None = None
    seed: int = 42
    quantize: str = "none"                # int8: weight-only int8 matrices (nanochat/quantize.py)

    @property
    def evals(self) -> list[str]:
        return [e.strip() for e in self.eval.split(",") if e.strip()]

    def validate(self) -> "BaseEvalConfig":
        check_model_tag(self.model_tag)
        check_output_file(self.output, "--output")
        check_dir_flag(self.data_dir, "--data-dir", "an existing directory of *.parquet shards")
        require(self.source in PHASES, "-i/--source", self.source, "|".join(PHASES))
        require(bool(self.evals) and set(self.evals) <= set(EVALS), "--eval", self.eval,
                "a comma list of " + "|".join(EVALS))
        splits = self.splits.split(",")
        require(set(splits) <= {"train", "val"} and len(set(splits)) == len(splits), "--splits", self.splits,
                "val, train or train,val")
        require(self.step == "latest" or re.fullmatch("[0-9]+", self.step) is not None, "--step", self.step, "latest or a step number")
        require_int(self.device_batch_size, "--device-batch-size", 1)
        require_int(self.eval_tokens, "--eval-tokens", 1)
        require_int(self.max_per_task, "--max-per-task", 1, allow=(-1,))
        require_int(self.max_tokens, "--max-tokens", 1)
        require_int(self.seed, "--seed", 0)
        check_quantize(self.quantize)
        if "core" in self.evals:
            core_eval_module()  # raises now, before a model is loaded, if CORE is not available
        return self


def core_eval_module():
    try:
        import nanochat.core_eval as core_eval
    except ImportError as e:
        raise ValueError(f"--eval core: nanochat/core_eval.py is not available ({e}); "
                         "run with --eval bpb,sample") from None
    return core_eval


def parse_config(argv: list[str] | None = None) -> BaseEvalConfig:
    p = FlagParser(prog="python -m scripts.base_eval", description="Evaluate a base/mid/sft checkpoint.")
    d = BaseEvalConfig()
    p.add_argument("-i", "--source", default=d.source, help="|".join(PHASES))
    p.add_argument("--model-tag", default=None)
    p.add_argument("--step", default=d.step, help="latest or a step number")
    p.add_argument("--eval", default=d.eval, help="comma list of " + "|".join(EVALS))
    p.add_argument("--splits", default=d.splits)
    p.add_argument("--device", default=d.device)
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--device-batch-size", type=int, default=d.device_batch_size,
                   help="rows per forward pass: bpb's batches, and CORE's of up to this many x sequence_len "
                        "tokens; lower it when the eval runs out of memory")
    for name in ("eval_tokens", "max_per_task", "max_tokens", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--data-dir", default=None,
                   help="pretraining shards for bpb (default: the checkpoint's own --data-dir, else <base dir>/base_data); CORE reads the DCLM bundle "
                        "(NANOCHAT_EVAL_BUNDLE, default <base dir>/eval_bundle) or the offline files (NANOCHAT_EVAL_DIR)")
    p.add_argument("--output", default=None)
    p.add_argument("--quantize", default=d.quantize, help="|".join(QUANTIZE_MODES) + ": evaluate the model as "
                   "chat_web --quantize serves it (int8 weight-only matrices)")
    return BaseEvalConfig(**vars(p.parse_args(argv))).validate()


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)
    rt = init_runtime(cfg.device, cfg.dtype, cfg.seed)
    with group_left_on_success(rt):   # an error keeps it up: the rank that failed alone is heard
        return evaluate(cfg, rt)


def model_tag(cfg: BaseEvalConfig, base_dir) -> str:
    """The checkpoint folder evaluated: --model-tag, else the only / deepest d<N>. Results and their
    file are named after it, not after meta.json's "model_tag": a folder copied or renamed
    (d20 -> d20_old) still holds the old name there, and a checkpoint without one named None."""
    from nanochat.checkpoint import find_model_tag

    return cfg.model_tag or find_model_tag(cfg.source, base_dir)


def checkpoint_meta(cfg: BaseEvalConfig, base_dir, step) -> dict:
    """The checkpoint's meta.json, read first of all: a wrong --model-tag or --step stops the run
    (CheckpointError naming the folder and the steps on disk) before any eval data is read."""
    from nanochat.checkpoint import checkpoint_dir, read_meta

    return read_meta(checkpoint_dir(cfg.source, model_tag(cfg, base_dir), base_dir), step)


def check_vocab(cfg: BaseEvalConfig, base_dir, meta: dict) -> None:
    """The model reads every token id the tokenizer writes (tasks.evaluate.check_model_vocab): a
    model of another tokenizer stopped CORE's or bpb's first batch with an IndexError."""
    from nanochat.checkpoint import checkpoint_dir
    from nanochat.tasks.evaluate import check_model_vocab
    from nanochat.tokenizer import get_tokenizer, tokenizer_dir

    check_model_vocab(meta, get_tokenizer(base_dir), checkpoint_dir(cfg.source, model_tag(cfg, base_dir), base_dir),
                      tokenizer_dir(base_dir))


def bpb_loaders(cfg: BaseEvalConfig, rt, base_dir, meta: dict) -> dict:
    """{split: DataLoader} for --eval bpb, built BEFORE the model is loaded: constructing a loader
    opens and checks every shard of its split (DataError / MissingDataError name the file), so
    damaged data fails in seconds. The sequence length is read from the checkpoint's meta.json."""
    if "bpb" not in cfg.evals:
        return {}
    from nanochat.tokenizer import get_tokenizer

    model_config, tokenizer = meta.get("model_config"), get_tokenizer(base_dir)
    want = meta.get("tokenizer_fingerprint")
    if not isinstance(model_config, dict) or not isinstance(model_config.get("sequence_len"), int) \
            or (want is not None and want != tokenizer.fingerprint):
        return {}  # load_model reports the broken checkpoint / other tokenizer (loaders come after it)
    data_dir = bpb_data_dir(cfg, meta)
    return {split: bpb_loader(cfg, rt, tokenizer, model_config["sequence_len"], split, data_dir)
            for split in cfg.splits.split(",")}


def bpb_data_dir(cfg: BaseEvalConfig, meta: dict) -> str | None:
    """--data-dir, else the shards a base checkpoint trained on (base_train's --data-dir, saved in
    its meta.json) while that folder exists, else None (<base dir>/base_data). Without this a model
    trained with --data-dir was evaluated against the default folder: "no text shards" or another corpus."""
    if cfg.data_dir is not None:
        return cfg.data_dir
    # a base checkpoint's only: mid/SFT/RL's --data-dir is the chat data's root, not text shards; and
    # absolute only (base_train saves it so now): a relative one was relative to base_train's own cwd
    saved = (meta.get("config") or {}).get("data_dir") if isinstance(meta.get("config"), dict) else None
    if cfg.source == "base" and isinstance(saved, str) and os.path.isabs(saved) and os.path.isdir(saved):
        print0(f"bpb on {saved} (the checkpoint's --data-dir; pass --data-dir to choose others)")
        return saved
    if cfg.source == "base" and isinstance(saved, str):   # relative (older runs) or gone: said, not silent
        print0(f"the checkpoint trained on --data-dir {saved}, which is {'gone' if os.path.isabs(saved) else 'relative'}"
               f": bpb on <base dir>/base_data; pass --data-dir to score that corpus")
    return None


def bpb_loader(cfg: BaseEvalConfig, rt, tokenizer, seq_len: int, split: str, data_dir: str | None = None):
    """One finite pass over `split`, read whole on every rank (eval_bpb.eval_loader): an
    --eval-tokens larger than the split stops at its end instead of counting tokens again, and
    evaluate_bpb_splits deals its batches to the ranks (eval_bpb.EvalBatches), so the bpb is over
    the same tokens, and the same float, on any number of ranks."""
    return eval_loader(tokenizer, cfg.device_batch_size, seq_len, split, device=rt.device, data_dir=data_dir)


def evaluate(cfg: BaseEvalConfig, rt) -> dict:
    from nanochat.checkpoint import load_model
    from nanochat.checkpoint_io import atomic_write
    from nanochat.tasks.evaluate import out_of_memory_hint

    base_dir = get_base_dir()
    step = "latest" if cfg.step == "latest" else int(cfg.step)   # validate: digits 0-9 only
    meta = checkpoint_meta(cfg, base_dir, step)
    check_vocab(cfg, base_dir, meta)
    loaders = bpb_loaders(cfg, rt, base_dir, meta)
    # CORE's files are read now too: a malformed or empty one stops here, not after the model loads
    core_data = core_eval_module().load_core_data() if "core" in cfg.evals else None
    tag = model_tag(cfg, base_dir)
    model, tokenizer, meta = load_model(cfg.source, rt.device, model_tag=tag, step=step,
                                        base_dir=base_dir, compute_dtype=rt.dtype)
    quantize_model(model, cfg.quantize)
    seq_len = model.config.sequence_len
    weights = "" if cfg.quantize == "none" else f", {cfg.quantize} weights"
    print0(f"evaluating {cfg.source}/{tag} step {meta['step']} on {rt.device} "
           f"({rt.dtype_name}{weights}); evals: {','.join(cfg.evals)}")
    results: dict = {"phase": cfg.source, "model_tag": tag,
                     "step": meta["step"], "config": asdict(cfg), "model_config": meta.get("model_config"),
                     "device": str(rt.device), "world_size": rt.world_size}
    t0 = time.perf_counter()

    # out of memory in bpb or CORE: one line naming --device-batch-size, which sizes both, not a traceback
    with out_of_memory_hint("base_eval bpb", "--device-batch-size", cfg.device_batch_size):
        evaluate_bpb_splits(cfg, rt, model, tokenizer, loaders, results, base_dir)

    if "sample" in cfg.evals and rt.is_master:
        texts = sample_prompts(model, tokenizer, DEFAULT_PROMPTS, max_tokens=cfg.max_tokens, seed=cfg.seed)
        results["samples"] = [{"prompt": p, "text": t} for p, t in zip(DEFAULT_PROMPTS, texts)]
        for t in texts:
            print0(f"  sample: {t!r}")

    if "core" in cfg.evals:
        with out_of_memory_hint("base_eval CORE", "--device-batch-size", cfg.device_batch_size):
            # CORE's batches hold --device-batch-size full-length rows (upstream: 8 x 2048 tokens)
            results["core"] = core_eval_module().run_core_eval(
                model, tokenizer, rt.device, max_per_task=None if cfg.max_per_task == -1 else cfg.max_per_task,
                data=core_data, batch_tokens=cfg.device_batch_size * seq_len)

    results["seconds"] = time.perf_counter() - t0
    if rt.is_master:
        suffix = "" if cfg.quantize == "none" else f"_{cfg.quantize}"   # next to the unquantised results
        out = Path(cfg.output) if cfg.output else (
            base_dir / "eval" / f"{cfg.source}_{results['model_tag']}_step{meta['step']:06d}{suffix}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda f: f.write(json.dumps(results, indent=2, default=str).encode()))
        print0(f"results written to {out}")
        results["output"] = str(out)
        log_report(results)
    return results


def evaluate_bpb_splits(cfg: BaseEvalConfig, rt, model, tokenizer, loaders: dict, results: dict, base_dir) -> None:
    """--eval bpb: bits per byte of each --splits split into `results` (bpb, bpb_tokens_by_split, ...)."""
    if "bpb" not in cfg.evals:
        return
    from nanochat.tokenizer import get_token_bytes

    seq_len = model.config.sequence_len
    token_bytes = get_token_bytes(device=rt.device, base_dir=base_dir)
    per_batch = cfg.device_batch_size * seq_len
    # the batches of the one stream, dealt to ranks: the same tokens (and bpb) on any number of ranks
    batches_total = max(1, cfg.eval_tokens // per_batch)
    results["bpb"], results["bpb_tokens_by_split"] = {}, {}
    for split in cfg.splits.split(","):
        loader = loaders.get(split) or bpb_loader(cfg, rt, tokenizer, seq_len, split)
        batches = EvalBatches(loader, batches_total, rt)
        try:
            bpb = evaluate_bpb(model, batches, batches.steps, token_bytes)
        finally:   # out of memory mid-split too: its reader threads must not outlive the run
            loader.close()
        covered = batches.tokens()   # each token of the split at most once (a finite pass)
        results["bpb"][split] = bpb
        results["bpb_tokens_by_split"][split] = covered
        print0(f"{split} bpb: {bpb:.4f} over {covered:,} tokens{bpb_shortfall(covered, batches_total * per_batch, cfg)}")
    # what the bpb figures are over: the largest split's count (val alone by default; the report
    # names each split's when there are several)
    results["bpb_tokens"] = max(results["bpb_tokens_by_split"].values())
    results["bpb_tokens_planned"] = batches_total * per_batch


def bpb_shortfall(covered: int, planned: int, cfg: BaseEvalConfig) -> str:
    """The banner's note when the split ran out before the planned batches: it is smaller than asked."""
    if covered >= planned:
        return f" (--eval-tokens {cfg.eval_tokens:,} in whole batches)"
    return (f" (the whole split: it holds fewer than the {planned:,} asked with --eval-tokens "
            f"{cfg.eval_tokens:,}; each token counted once)")


def core_data_label(source: str) -> str:
    """What a CORE score was computed on, for the report: the DCLM bundle (upstream's score) or the
    offline files, whose prompts are our own (core_data.py): the two do not compare."""
    kind, _, where = source.partition(":")
    if kind == "bundle":
        return f"DCLM bundle ({where})"
    if kind == "offline":
        return f"offline files ({where}): prompts of our own, not comparable with a DCLM-bundle CORE"
    return source or "unknown"


def log_report(results: dict) -> None:
    """The report section of this evaluation (rank 0): bpb per split, CORE, timing."""
    from nanochat.report import get_report
    section = {"stage": results["phase"], "model_tag": results["model_tag"], "step": results["step"],
               "seconds": round(results["seconds"], 1)}
    section.update({f"{split}_bpb": v for split, v in results.get("bpb", {}).items()})
    if "bpb_tokens" in results:   # the tokens the bpb above is over: each counted once, a split may hold fewer
        section["bpb_tokens"] = results["bpb_tokens"]
        by_split = results.get("bpb_tokens_by_split", {})
        if len(by_split) > 1:
            section.update({f"{split}_bpb_tokens": n for split, n in by_split.items()})
        if results.get("bpb_tokens_planned", 0) > min(by_split.values(), default=0):
            section["bpb_tokens_asked"] = results["config"].get("eval_tokens")   # a split ran out first
    core = results.get("core")
    if core is not None:
        # complete: every CORE task and all of its items (a --max-per-task run is an estimate: the
        # report's summary labels it "(partial)" and keeps a complete score of the same model)
        section.update({"CORE metric": core.get("core_metric"),
                        "CORE complete": bool(core.get("complete")) and core.get("all_items", True),
                        "CORE max_per_task": results["config"].get("max_per_task", -1),
                        "CORE tasks": len(core.get("centered_results", {})),
                        "CORE data": core_data_label(core.get("source", "")),
                        "centered": core.get("centered_results")})
        if core.get("missing"):   # tasks without data, left out of the mean
            section["CORE missing"] = core["missing"]
    if results.get("samples"):
        section["samples"] = [s["text"] for s in results["samples"]]
    title = "Base model evaluation" if results["phase"] == "base" else f"Evaluation {results['phase']}"
    quantize = results["config"].get("quantize", "none")
    if quantize != "none":
        title += f" ({quantize} weights)"
        section["weights"] = quantize   # the report's summary keeps the model's own figures
    get_report().log(title, section)


if __name__ == "__main__":
    script_main("base_eval", lambda: parse_config(sys.argv[1:]), lambda: main(sys.argv[1:]))
