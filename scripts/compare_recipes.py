"""A/B the pretraining recipes: the same base_train run under each recipe (and seed), final val bpb.

    python -m scripts.compare_recipes --runs v1 v2 "v2 --normuon-beta2 0" --seeds 1 2 -- \
        --depth 4 --target-param-data-ratio 12 --eval-tokens 1048576

Each --runs entry is a recipe name, optionally followed by base_train flags that override it. The
flags after `--` are shared by every run. Runs go one after another in this process
(scripts/base_train.py's `main`), each under its own model tag (cmp_<n>, with several --seeds
cmp_<n>_s<seed>; overwritten), evaluated at the first and last step, never sampled; its final
checkpoint is deleted once read (--keep-checkpoints keeps it). A run the NaN guard stops is
recorded as diverged (its line says where) and the comparison goes on; the exit code is then 1.
Their report rows and sections go to <base dir>/compare_recipes/report (reset at the start), not to
the pipeline's report: a comparison run is not the pipeline's base model (report.md took it for
one, and every later stage for stale). Prints one JSON line per run, then a table: per entry, the
final val bpb of each seed ("diverged" for a stopped run), their mean (of an entry none of whose
runs diverged), and the difference to the first entry's mean.
Lower bpb is better; a difference smaller than the spread between seeds is noise.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time

from nanochat.flags import FlagParser, RequestError, check_model_tag, script_main
from nanochat.recipe import RECIPES


def parse_args(argv: list[str] | None = None):
    p = FlagParser(prog="python -m scripts.compare_recipes", description=__doc__.split("\n")[0])
    p.add_argument("--runs", nargs="+", default=["v1", "v2"], help="recipe [flags...] per entry (default: v1 v2)")
    p.add_argument("--seeds", nargs="+", type=int, default=[42], help="seeds, each run once per entry")
    p.add_argument("--tag-prefix", default="cmp", help="model tags are <prefix>_<n> (overwritten)")
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep each run's final checkpoint (default: deleted once its val bpb is read)")
    p.add_argument("shared", nargs=argparse.REMAINDER, help="-- then base_train flags for every run")
    args = p.parse_args(argv)
    args.shared = args.shared[1:] if args.shared[:1] == ["--"] else args.shared
    # checked here, by its own name: base_train's check of the tag it becomes named --model-tag,
    # a flag this script sets itself and refuses from the user
    check_model_tag(args.tag_prefix, "--tag-prefix", new=True)
    args.entries = [shlex.split(r) for r in args.runs]
    for entry in args.entries:
        if not entry or entry[0] not in RECIPES:
            raise RequestError(f"--runs: got {' '.join(entry)!r}; accepted: a recipe ({'|'.join(RECIPES)}) "
                               "then optional base_train flags")
    # run_argv appends these after the user's flags, so a value given here was silently overridden
    # (an --eval-every or --wandb online asked for and never done)
    for flag in ("--recipe", "--seed", "--model-tag", "--resume", "--eval-every", "--sample-every", "--save-every",
                 "--wandb"):
        if any(a.split("=")[0].replace("_", "-") == flag for a in args.shared + sum(args.entries, [])):
            raise RequestError(f"{flag}: set by compare_recipes itself; leave it out of the base_train flags")
    if any(s < 0 for s in args.seeds) or len(set(args.seeds)) < len(args.seeds):
        raise RequestError(f"--seeds: got {args.seeds}; accepted: distinct integers >= 0")
    if len({" ".join(e) for e in args.entries}) < len(args.entries):   # the table merged their results
        raise RequestError(f"--runs: got {args.runs}; accepted: distinct entries (repeat a run with --seeds)")
    from scripts import base_train   # every run's base_train flags, before the first run trains (a
    for i, entry in enumerate(args.entries):   # typo in the last entry stopped the comparison hours in)
        base_train.parse_config(run_argv(entry, args.seeds[0], run_tag(args.tag_prefix, i, args.seeds[0], args.seeds),
                                         args.shared))
    return args


def run_tag(prefix: str, entry: int, seed: int, seeds: list[int]) -> str:
    """The model tag of one run: <prefix>_<entry>, and _s<seed> with several seeds (one tag per entry
    had each seed's run overwrite the previous seed's checkpoint: --keep-checkpoints kept the last)."""
    return f"{prefix}_{entry}" + (f"_s{seed}" if len(seeds) > 1 else "")


def run_argv(entry: list[str], seed: int, tag: str, shared: list[str]) -> list[str]:
    """The base_train command line of one run."""
    return [*shared, "--recipe", entry[0], *entry[1:], "--seed", str(seed), "--model-tag", tag, "--overwrite",
            "--eval-every", str(10 ** 9), "--sample-every", "-1", "--save-every", "-1", "--wandb", "off"]


def run_one(entry: list[str], seed: int, tag: str, shared: list[str], keep: bool = False) -> dict:
    import shutil

    from nanochat.checkpoint import checkpoint_dir
    from scripts import base_train
    from nanochat.training import NonFiniteLossError
    argv = run_argv(entry, seed, tag, shared)
    t0 = time.perf_counter()
    out = {"run": " ".join(entry), "seed": seed, "model_tag": tag}
    try:
        summary = base_train.main(argv)
        out.update({"final_val_bpb": summary["final_val_bpb"], "num_iterations": summary["num_iterations"],
                    "avg_tok_per_sec": summary["avg_tok_per_sec"]})
    except NonFiniteLossError as e:   # a recipe that diverges is a result: it ended the comparison, no table
        out.update({"final_val_bpb": None, "diverged": str(e).split(";")[0]})
    finally:
        import torch
        torch._dynamo.reset()  # each run compiles a new model: do not let them fill dynamo's recompile cache
        if not keep:  # a d12 checkpoint with its optimizer state is GBs: scratch once the bpb is read
            shutil.rmtree(checkpoint_dir("base", tag), ignore_errors=True)
    return {**out, "seconds": round(time.perf_counter() - t0, 1), "argv": argv}


def table(results: list[dict], labels: list[str]) -> str:
    """Per entry: each seed's final val bpb ("diverged" for a run the NaN guard stopped), their mean
    ("-" when a seed diverged: the mean of the others is not the entry's) and its difference to the
    first entry's."""
    by = {label: [r["final_val_bpb"] for r in results if r["run"] == label] for label in labels}
    means = {label: statistics.fmean(vals) if vals and None not in vals else None for label, vals in by.items()}
    ref = means[labels[0]]
    width = max(len(label) for label in labels)
    lines = [f"{'run':<{width}}  {'val bpb per seed':<28}  {'mean':>8}  {'vs first':>9}"]
    for label in labels:
        seeds = " ".join("diverged" if v is None else f"{v:.4f}" for v in by[label])
        mean = means[label]
        diff = "-" if mean is None or ref is None else f"{mean - ref:+.4f}"
        lines.append(f"{label:<{width}}  {seeds:<28}  {'-' if mean is None else f'{mean:.4f}':>8}  {diff:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    import os
    import shutil

    from nanochat.common import get_base_dir
    args = parse_args(argv)
    results = []
    report = get_base_dir() / "compare_recipes" / "report"
    old = os.environ.get("NANOCHAT_REPORT_DIR")
    os.environ["NANOCHAT_REPORT_DIR"] = str(report)   # base_train's report rows and sections go there
    try:
        if int(os.environ.get("RANK", "0")) == 0:   # cleared, no header: reset's system_info would start
            shutil.rmtree(report, ignore_errors=True)   # CUDA before base_train's init_runtime set it up
        for i, entry in enumerate(args.entries):
            for seed in args.seeds:
                result = run_one(entry, seed, run_tag(args.tag_prefix, i, seed, args.seeds), args.shared,
                                 args.keep_checkpoints)
                print("RESULT " + json.dumps(result), flush=True)
                results.append(result)
    finally:
        if old is None:
            os.environ.pop("NANOCHAT_REPORT_DIR")
        else:
            os.environ["NANOCHAT_REPORT_DIR"] = old
    print(table(results, [" ".join(e) for e in args.entries]))
    return results


if __name__ == "__main__":
    import sys
    script_main("compare_recipes", lambda: parse_args(sys.argv[1:]),
                lambda: int(any("diverged" in r for r in main(sys.argv[1:]))))
