"""Evaluate a chat model on ARC-Easy/Challenge, MMLU (categorical), GSM8K, HumanEval, SpellingBee
(generative) and report ChatCORE = mean centered accuracy.

    python -m scripts.chat_eval -i sft
    python -m scripts.chat_eval -i mid -a "ARC-Easy|GSM8K" --max-problems 100
    torchrun --nproc_per_node 8 -m scripts.chat_eval -i sft          (problems split across ranks)

Recipe: flags -> runtime -> checkpoint (model + tokenizer) -> per task: categorical tasks read the
answer-letter logits after <|assistant_start|>, generative tasks sample through Engine and score
pass@num_samples (and pass@1..num_samples per generative task) -> table, JSON file, report
section "Chat evaluation <source>". A model trained with --test-holdout N (offline: on the local test
files of ARC / MMLU / GSM8K past their first N problems) is scored on those first N only.
"""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from nanochat.common import DEVICE_CHOICES, DTYPE_ALIASES, get_base_dir, init_runtime, print0
from nanochat.distributed import group_left_on_success
from nanochat.flags import (FlagParser, check_dir_flag, check_model_tag, check_output_file, require, require_float,
                            script_main)

SOURCES = ("base", "mid", "sft", "rl")


@dataclass
class ChatEvalConfig:
    source: str = ""
    model_tag: str | None = None
    step: str = "latest"
    task_name: str | None = None       # "A|B" or "A,B"; None = every task
    max_problems: int | None = None
    batch_size: int = 8
    temperature: float = 0.0
    num_samples: int = 1
    top_k: int = 50
    max_new_tokens: int = 512
    seed: int = 42
    device: str = "auto"
    dtype: str = "auto"
    decode: str = "auto"               # Engine decode mode: auto = CUDA graphs on CUDA, eager elsewhere
    quantize: str = "none"             # int8: score the int8-weight model chat_web --quantize int8 serves
    data_dir: str | None = None
    out: str | None = None

    def tasks(self) -> list[str]:
        from nanochat.tasks import EVAL_TASKS

        if self.task_name is None:   # not given; -a "" (an unset shell variable) names no task
            return list(EVAL_TASKS)
        names = [n.strip() for n in self.task_name.replace(",", "|").split("|") if n.strip()]
        bad = [n for n in names if n not in EVAL_TASKS]
        require(not bad and bool(names), "-a/--task-name", self.task_name, "|".join(EVAL_TASKS))
        return names

    def validate(self) -> "ChatEvalConfig":
        check_model_tag(self.model_tag)
        check_output_file(self.out, "--out")
        # a typo'd folder: one line naming the flag, not six paths tried and the hub's failure
        check_dir_flag(self.data_dir, "--data-dir", "an existing directory of eval files (arc_easy.jsonl, ...)")
        require(self.source in SOURCES, "-i/--source", self.source, "|".join(SOURCES))
        # checked here, not by init_runtime after every task's data had loaded and the lineage was said
        require(self.device in DEVICE_CHOICES, "--device", self.device, "|".join(DEVICE_CHOICES))
        require(self.dtype in DTYPE_ALIASES, "--dtype", self.dtype, "auto|bf16|fp32")
        require(self.step == "latest" or re.fullmatch("[0-9]+", self.step) is not None, "--step", self.step, "an integer >= 0 or latest")
        require(self.max_problems is None or self.max_problems >= 1 or self.max_problems == -1, "--max-problems",
                self.max_problems, ">= 1, or -1 for all")
        if self.max_problems == -1:  # setup.sh's full presets pass -1 = every problem
            self.max_problems = None
        require(self.batch_size >= 1, "--batch-size", self.batch_size, ">= 1")
        require_float(self.temperature, "--temperature", 0.0)   # inf / nan too, not only negatives
        require(self.num_samples >= 1, "--num-samples", self.num_samples, ">= 1")
        # greedy samples are identical: pass@k would equal pass@1 at k times the generation time
        require(self.num_samples == 1 or self.temperature > 0, "--num-samples", self.num_samples,
                "1 with --temperature 0 (greedy decoding draws the same answer every time; pass "
                "--temperature > 0, e.g. 0.8, for pass@k)")
        require(self.top_k >= 0, "--top-k", self.top_k, ">= 0 (0 = off)")
        require(self.max_new_tokens >= 1, "--max-new-tokens", self.max_new_tokens, ">= 1")
        from nanochat.sampling import MAX_SEED
        # the sampler's generator takes a uint64: -1 passed here and stopped the run at the first
        # generative task, after the model had loaded and the categorical tasks had run
        require(0 <= self.seed <= MAX_SEED, "--seed", self.seed, f"an integer in 0..{MAX_SEED}")
        from nanochat.engine import DECODE_MODES
        require(self.decode in DECODE_MODES, "--decode", self.decode, "|".join(DECODE_MODES))
        from nanochat.quantize import check_quantize
        check_quantize(self.quantize)
        from nanochat.tasks import EVAL_TASK_CLASSES
        names = self.tasks()
        generative = [n for n in EVAL_TASK_CLASSES if EVAL_TASK_CLASSES[n].eval_type == "generative"]
        # a categorical task scores the answer letter's logit once: samples would be ignored
        require(self.num_samples == 1 or any(n in generative for n in names), "--num-samples", self.num_samples,
                f"1 for categorical tasks only ({'|'.join(names)}); pass@k applies to {'|'.join(generative)}")
        return self


def parse_args(argv=None) -> ChatEvalConfig:
    from nanochat.tasks import MAX_PROBLEMS_HELP

    p = FlagParser(prog="python -m scripts.chat_eval", description=__doc__.split("\n")[0])
    p.add_argument("-i", "--source", required=True, help="|".join(SOURCES))
    p.add_argument("--model-tag", default=None)
    p.add_argument("--step", default="latest")
    p.add_argument("-a", "--task-name", default=None, help="tasks separated by | or , (default: all)")
    p.add_argument("-x", "--max-problems", type=int, default=None, help=MAX_PROBLEMS_HELP)
    p.add_argument("-b", "--batch-size", type=int, default=8, help="categorical batch size")
    p.add_argument("-t", "--temperature", type=float, default=0.0)
    p.add_argument("-n", "--num-samples", type=int, default=1, help="samples per problem (pass@n)")
    p.add_argument("-k", "--top-k", type=int, default=50)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decode", default="auto", help="generative tasks' decode mode: auto|eager|compile|static|"
                   "graphs (auto: CUDA graphs on CUDA, ~30x eager there; eager elsewhere)")
    p.add_argument("--quantize", default="none", help="none|int8: evaluate with int8 weight-only matrices, as "
                   "chat_web --quantize int8 serves the model (nanochat/quantize.py)")
    p.add_argument("--data-dir", default=None, help="eval data dir (default: NANOCHAT_EVAL_DIR, then defaults)")
    p.add_argument("--out", default=None, help="JSON results path (default: <base_dir>/chat_eval/...)")
    return ChatEvalConfig(**vars(p.parse_args(argv))).validate()


def load_tasks(cfg: ChatEvalConfig) -> dict:
    """Every requested task's data, loaded before the model: a missing file fails in seconds, not
    after an hour of generation on the tasks before it."""
    from nanochat.tasks import get_task

    return {name: (get_task(name, data_dir=cfg.data_dir) if cfg.data_dir else get_task(name))
            for name in cfg.tasks()}


HOLDOUT_FLAG = {"mid": "mid_train --test-holdout", "sft": "chat_sft --test-holdout", "rl": "chat_rl --test-holdout"}


def held_out_problems(cfg: ChatEvalConfig, base_dir) -> tuple[dict[str, tuple[int, str]], bool]:
    """(task -> (N, stage), known): the evaluated checkpoint, or one it was trained from, trained on that
    task's test problems past the first N (nanochat/chat_data.py's test_holdouts); the smallest N wins.
    known=False: a checkpoint of the chain cannot be read (said here, and recorded in the results).
    Read from meta.json (seconds), before the model loads."""
    from nanochat.chat_data import test_holdouts
    from nanochat.checkpoint import checkpoint_dir, find_model_tag, read_meta

    tag = cfg.model_tag or find_model_tag(cfg.source, base_dir)
    meta = read_meta(checkpoint_dir(cfg.source, tag, base_dir), "latest" if cfg.step == "latest" else int(cfg.step))
    held, complete = test_holdouts(meta, lambda src: read_meta(
        checkpoint_dir(src["phase"], src.get("model_tag") or tag, base_dir), src["step"]), cfg.source)
    if not complete:   # a source removed since (and not recorded), or an SFT / RL checkpoint naming no source
        print0("chat_eval: cannot read a checkpoint the model was trained from (removed since, or not recorded in "
               "meta.json's \"source\"); the test problems it may have trained on (mid_train / chat_sft / chat_rl's "
               "test holdout) are not known: the scores may include problems it trained on")
    return held, complete


def check_vocab(cfg: ChatEvalConfig, tag: str, base_dir) -> None:
    """The model reads every token id the tokenizer writes (tasks.evaluate.check_model_vocab), from
    meta.json before the model loads."""
    from nanochat.checkpoint import checkpoint_dir, read_meta
    from nanochat.tasks.evaluate import check_model_vocab
    from nanochat.tokenizer import get_tokenizer, tokenizer_dir

    folder = checkpoint_dir(cfg.source, tag, base_dir)
    meta = read_meta(folder, "latest" if cfg.step == "latest" else int(cfg.step))
    check_model_vocab(meta, get_tokenizer(base_dir), folder, tokenizer_dir(base_dir))


def problem_limits(cfg: ChatEvalConfig, held: dict[str, tuple[int, str]],
                   sizes: dict[str, int] | None = None) -> dict[str, int]:
    """task -> the problems to score where training saw the rest: at most the held-out first N
    (--max-problems is a maximum; the cut is printed, and the score labelled partial), since a score
    over trained-on test problems reads as the model's own. A task with none held out is a ValueError.
    `sizes` (task -> its problems here): a task of at most N problems (--data-dir a smaller file) had
    no rest to train on, and is not said to be cut."""
    names = [n for n in cfg.tasks() if n in held]
    none_left = [n for n in names if held[n][0] == 0]
    require(not none_left, "-a/--task-name", cfg.task_name or "(all)",
            f"tasks other than {'|'.join(none_left)}: the model trained on every one of its test problems "
            f"({HOLDOUT_FLAG[held[none_left[0]][1]] if none_left else ''} 0)")
    limits = {}
    for name in names:
        n, stage = held[name]
        if sizes is not None and sizes.get(name, n + 1) <= n:
            continue
        if cfg.max_problems is None or cfg.max_problems > n:
            limits[name] = n
            print0(f"{name}: scoring its first {n} problems only: the {stage} model trained on the rest "
                   f"({HOLDOUT_FLAG[stage]} {n})")
    return limits


def evaluate(cfg: ChatEvalConfig, tasks: dict, model, tokenizer, device, dtype=None,
             limits: dict[str, int] | None = None) -> dict[str, dict]:
    """Every task's result; `limits` (problem_limits) caps the problems of a task below --max-problems."""
    from nanochat.engine import Engine
    from nanochat.tasks import EVAL_TASKS
    from nanochat.tasks.evaluate import out_of_memory_hint, run_categorical, run_generative

    engine = Engine(model, tokenizer, cache_dtype=dtype, decode=cfg.decode)
    results = {}
    for name, task in tasks.items():
        t0 = time.time()
        max_problems = (limits or {}).get(name, cfg.max_problems)
        # out of memory: one line naming the flag that sizes the batch, not a traceback
        if task.eval_type == "categorical":
            with out_of_memory_hint(f"chat_eval {name}", "--batch-size", cfg.batch_size):
                res = run_categorical(model, tokenizer, task, device, batch_size=cfg.batch_size,
                                      max_problems=max_problems, name=name)
        else:   # a problem's samples decode as one batch, each with a cache of prompt + --max-new-tokens
            with out_of_memory_hint(f"chat_eval {name}", "--num-samples", cfg.num_samples,
                                    f"a smaller --max-new-tokens (now {cfg.max_new_tokens})"):
                res = run_generative(engine, tokenizer, task, device, num_samples=cfg.num_samples,
                                     max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                     top_k=cfg.top_k or None, seed=cfg.seed, max_problems=max_problems,
                                     name=name, log=print0)
        # "problems": the task's size; total < problems is a subset (--max-problems), not the score
        results[name] = {"accuracy": res.accuracy, "passed": res.passed, "total": res.total,
                         "problems": len(task), "baseline": EVAL_TASKS[name][1],
                         "seconds": round(time.time() - t0, 1)}
        curve = ""
        if len(res.passed_at) > 1:  # pass@k for every k up to --num-samples (accuracy is the last)
            results[name]["pass_at"] = {str(k): res.pass_at(k) for k in range(1, len(res.passed_at) + 1)}
            curve = "  pass@1..k " + " ".join(f"{v:.3f}" for v in results[name]["pass_at"].values())
        subset = f" of {len(task)}" if res.total < len(task) else ""
        print0(f"{name:14s} {res.accuracy:.4f}  ({res.passed}/{res.total}{subset}, "
               f"{results[name]['seconds']}s){curve}")
    return results


def subset_tasks(results: dict[str, dict]) -> list[str]:
    """The tasks scored on only some of their problems (--max-problems below the task's size)."""
    return [n for n, r in results.items() if r["total"] < r["problems"]]


def main(argv=None) -> dict:
    cfg = parse_args(argv)
    from nanochat.checkpoint import find_model_tag, load_model
    from nanochat.checkpoint_io import atomic_write
    from nanochat.quantize import quantize_model
    from nanochat.report import get_report
    from nanochat.tasks import EVAL_TASKS
    from nanochat.tasks.evaluate import chatcore

    tasks = load_tasks(cfg)   # every task's data checked first, before any checkpoint is looked for
    # the test problems training saw are never scored: read from meta.json before the model loads
    held, lineage_known = held_out_problems(cfg, get_base_dir())
    limits = problem_limits(cfg, held, {name: len(task) for name, task in tasks.items()})
    # the folder evaluated names the results (meta.json's "model_tag" may be missing, or another
    # folder's name when a run was copied aside: d1 -> d1_old would overwrite d1's results)
    tag = cfg.model_tag or find_model_tag(cfg.source, get_base_dir())
    check_vocab(cfg, tag, get_base_dir())
    rt = init_runtime(cfg.device, cfg.dtype, cfg.seed)
    with group_left_on_success(rt):   # an error keeps it up: the rank that failed alone is heard
        step = "latest" if cfg.step == "latest" else int(cfg.step)
        model, tokenizer, meta = load_model(cfg.source, rt.device, model_tag=tag, step=step)
        if hasattr(model, "compute_dtype"):  # honour --dtype (the model defaults to bf16 on CUDA)
            model.compute_dtype = rt.dtype
        quantize_model(model, cfg.quantize)
        weights = "" if cfg.quantize == "none" else f" ({cfg.quantize} weights)"
        print0(f"chat_eval: {cfg.source} model {tag} step "
               f"{meta.get('step', step)} on {rt.device}{weights}")
        results = evaluate(cfg, tasks, model, tokenizer, rt.device, rt.dtype, limits)
        accuracies = {n: r["accuracy"] for n, r in results.items()}
        score = chatcore(accuracies, {n: EVAL_TASKS[n][1] for n in accuracies})
        complete = set(accuracies) == set(EVAL_TASKS)   # every task (JSON "complete", as before)
        cut = subset_tasks(results)                      # ... and every problem of each
        # a generative score that is not one greedy answer says so (the report marks it the same way)
        scored = f"pass@{cfg.num_samples}" if cfg.num_samples > 1 else (
            f"sampled, T={cfg.temperature:g}" if cfg.temperature > 0 else "")
        print0("\n| Task | Accuracy |\n|---|---|")
        for n, a in accuracies.items():
            r = results[n]
            notes = ([f"{r['total']} of {r['problems']} problems"] if n in cut else []) + \
                ([scored] if scored and tasks[n].eval_type == "generative" else [])
            print0(f"| {n}{''.join(f' ({x})' for x in notes)} | {a:.4f} |")
        why = ([] if complete else ["a subset of the tasks"]) + (["a subset of the problems"] if cut else [])
        partial = f" (partial: {' and '.join(why)})" if why else ""
        if scored and any(tasks[n].eval_type == "generative" for n in accuracies):   # pass@k or sampled
            partial += f" ({scored})"
        print0(f"| ChatCORE{partial} | {score:.4f} |")
        out = {"source": cfg.source, "step": meta.get("step", step), "config": asdict(cfg), "results": results,
               "ChatCORE": score, "complete": complete, "all_problems": not cut,
               "training_problems_known": lineage_known}   # False: scores may include trained-on problems
        if rt.is_master:
            suffix = "" if cfg.quantize == "none" else f"_{cfg.quantize}"   # next to the unquantised results
            # one file per checkpoint (as base_eval's): evaluating another step keeps the earlier results
            at = f"_step{out['step']:06d}" if isinstance(out["step"], int) else ""
            path = cfg.out or (get_base_dir() / "chat_eval" / f"{cfg.source}_{tag}{at}{suffix}.json")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(Path(path), lambda f: f.write(json.dumps(out, indent=1).encode()))
            print0(f"results written to {path}")
            section = report_section(cfg, tag, out, tasks)
            get_report().log(f"Chat evaluation {cfg.source}" + (f" ({cfg.quantize} weights)" if suffix else ""), section)
        return out


def report_section(cfg: ChatEvalConfig, tag: str, out: dict, tasks: dict) -> dict:
    """The report entry. The summary table shows the latest entry of a stage, so what makes a score
    not comparable with a full greedy run is said per value: "<task> complete" (False for a task
    scored on a subset of its problems) (a --max-problems run's score was shown as the task's),
    "ChatCORE complete" only for every problem of every task, and "<task> scored as": "pass@k"
    for a generative task scored over --num-samples k (the best of k answers, not one). With a
    generative task, the settings its answers were sampled with (--max-new-tokens; sampled: --top-k, --seed)."""
    results = out["results"]
    cut = subset_tasks(results)
    section = {"stage": cfg.source, "model_tag": tag, "step": out["step"],   # resolved, as base_eval's
               "temperature": cfg.temperature, "num_samples": cfg.num_samples, "max_problems": cfg.max_problems,
               **{n: r["accuracy"] for n, r in results.items()},
               **{f"{n} complete": n not in cut for n in results},
               "ChatCORE metric": out["ChatCORE"], "ChatCORE complete": out["complete"] and not cut,
               "seconds": round(sum(r["seconds"] for r in results.values()), 1)}
    generative = [n for n, task in tasks.items() if task.eval_type == "generative"]
    if generative:   # what cuts and shapes the answers: two entries of one stage differed in nothing shown
        section["max_new_tokens"] = cfg.max_new_tokens
        if cfg.temperature > 0:
            section.update(top_k=cfg.top_k, seed=cfg.seed)
    if cfg.num_samples > 1:
        section.update({f"{n} scored as": f"pass@{cfg.num_samples}" for n in generative})
        if generative:
            section["ChatCORE scored as"] = f"pass@{cfg.num_samples}"
    if out.get("training_problems_known") is False:   # the console's warning, kept with the scores
        section["test problems trained on"] = "unknown (a source checkpoint is missing)"
    if cfg.quantize != "none":
        section["weights"] = cfg.quantize
    return section


if __name__ == "__main__":
    script_main("chat_eval", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
