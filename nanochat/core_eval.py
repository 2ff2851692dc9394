"""CORE: the DCLM in-context-learning evaluation of base models (22 tasks, centered accuracy),
computed as upstream nanochat computes it (nanochat/core_eval.py + scripts/base_eval.py there), so
the numbers compare with its published CORE scores.

Three task types, all scored from one teacher-forced forward pass per sequence:
* multiple_choice: one context, several continuations; the choice with the lowest mean per-token
  negative log-likelihood wins (scoring="sum": lowest total). Scored tokens are those after the
  longest token prefix all choices share (upstream's rule: a first word every choice starts with
  is not scored).
* schema: several contexts, one shared continuation (Winograd-style); scored tokens are the longest
  token suffix all options share; lowest mean NLL wins.
  Two departures from upstream, both only where it mis-scores: a non-finite score never wins (a
  diverged model scored every gold-0 item), and a winning choice whose text equals the gold's
  counts (CommonsenseQA lists some choices twice; exact ties went to the first copy).
* language_modeling: correct when greedy decoding reproduces every continuation token exactly.
  Contexts are whitespace-trimmed before the delimiter (the bundle's squad/coqa contexts end in
  "Answer: ", their delimiter is " ").

Few-shot examples for item i are random.Random(seed + i).sample(<the evaluated items but i>, k),
seed 1234; the task's items are shuffled with random.Random(1337) and cut to max_per_task first.
Sequences longer than the model's sequence_len keep their BOS and lose the tokens after it (an
answer that does not fit on its own is scored on the part that does; a language-modeling one counts
wrong). Upstream's crop never runs for its GPT (it reads a `max_seq_len` that model lacks, and
scores such sequences past sequence_len), so tasks this cuts (10-shot squad at 2048 tokens) differ
from upstream's. Accuracy is centered against the random baseline, (acc - b) / (1 - b), and CORE is
the mean of the centered accuracies.

Data (nanochat/core_data.py): the DCLM bundle when present, else offline equivalents of 20 of the
22 tasks with prompts of our own, comparable only with other offline runs.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable

# the task table and data loading moved to core_data.py; re-exported for existing callers
from nanochat.core_data import (CORE_LABELS, CORE_TASKS, EVAL_BUNDLE_URL, TASK_TYPES, CoreData, CoreTask,
                                default_bundle_dir, download_eval_bundle, load_core_data, resolve_sources)
from nanochat.common import print0

__all__ = ["CORE_LABELS", "CORE_TASKS", "EVAL_BUNDLE_URL", "TASK_TYPES", "CoreData", "CoreTask",
           "centered_accuracy", "core_metric", "default_bundle_dir", "download_eval_bundle", "evaluate_task",
           "fewshot_indices", "load_core_data", "render_prompts", "resolve_sources", "run_core_eval",
           "score_sequences", "tokenize_item", "tokenize_items"]
_MC, _SC, _LM = TASK_TYPES

# ---------------------------------------------------------------------------------------------
# Metric math
# ---------------------------------------------------------------------------------------------

def centered_accuracy(accuracy: float, random_baseline: float) -> float:
    """Rescale so that random guessing scores 0 and a perfect score 1 (can go below 0)."""
    if not 0.0 <= random_baseline < 1.0:
        raise ValueError(f"random_baseline: got {random_baseline}; accepted: 0 <= b < 1 (a fraction)")
    return (accuracy - random_baseline) / (1.0 - random_baseline)


def core_metric(centered: dict[str, float]) -> float:
    if not centered:
        raise ValueError("core_metric: got no task results; accepted: at least one centered accuracy")
    return sum(centered.values()) / len(centered)


# ---------------------------------------------------------------------------------------------
# Prompt rendering and tokenization
# ---------------------------------------------------------------------------------------------

def render_prompts(task: CoreTask, item: dict, fewshot: list[dict]) -> tuple[list[str], list[str]]:
    """(contexts, continuations), one pair per scored sequence; context + continuation = full text,
    the text upstream nanochat renders (shots joined by blank lines, then the item).

    The delimiter's trailing whitespace moves to the start of the continuation (" Paris", not
    "Paris"), matching how BPE tokenizers attach spaces to the following word.
    """
    delim = task.continuation_delimiter
    d_ctx, d_ws = delim.rstrip(), delim[len(delim.rstrip()):]
    if task.task_type == _MC:
        shots = [f"{ex['query']}{delim}{ex['choices'][ex['gold']]}" for ex in fewshot]
    elif task.task_type == _SC:
        shots = [f"{ex['context_options'][ex['gold']]}{delim}{ex['continuation']}" for ex in fewshot]
    else:  # LM contexts are trimmed (as upstream): the bundle's squad/coqa ones end in "Answer: " + delim " "
        shots = [f"{ex['context'].strip()}{delim}{ex['continuation']}" for ex in fewshot]
    # the item's own instructions where its records carry them (offline BIG-bench), else the task's
    prefix = item.get("preamble", task.preamble) + "".join(s + "\n\n" for s in shots)
    if task.task_type == _MC:
        n = len(item["choices"])
        return [prefix + item["query"] + d_ctx] * n, [d_ws + c for c in item["choices"]]
    if task.task_type == _SC:
        n = len(item["context_options"])
        return [prefix + o + d_ctx for o in item["context_options"]], [d_ws + item["continuation"]] * n
    return [prefix + item["context"].strip() + d_ctx], [d_ws + item["continuation"]]


def _common_prefix(seqs: list[list[int]]) -> int:
    n, shortest = 0, min(len(s) for s in seqs)
    while n < shortest and all(s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


def _common_suffix(seqs: list[list[int]]) -> int:
    n, shortest = 0, min(len(s) for s in seqs)
    while n < shortest and all(s[-1 - n] == seqs[0][-1 - n] for s in seqs):
        n += 1
    return n


def _scored_starts(task: CoreTask, fulls: list[list[int]], context_ids: list[int] | None) -> list[int]:
    """Where the scored tokens of each of an item's sequences begin, by upstream nanochat's rules:
    multiple choice after the longest token prefix all choices share (so a first word that every
    choice starts with is not scored), schema the longest token suffix all options share, language
    modeling after the context's tokens. Every sequence keeps at least one scored token (upstream
    would average an empty span, NaN, when one choice's tokens are a prefix of another's)."""
    shortest = min(len(f) for f in fulls)
    if task.task_type == _MC:
        return [min(_common_prefix(fulls), shortest - 1)] * len(fulls)
    if task.task_type == _SC:
        suffix = max(1, min(_common_suffix(fulls), shortest - 1))
        return [len(f) - suffix for f in fulls]
    assert context_ids is not None and len(fulls) == 1
    return [_common_prefix([context_ids, fulls[0]])]


def _crop(ids: list[int], start: int, max_len: int) -> tuple[list[int], int, bool]:
    """ids[0] (the BOS) and the newest max_len - 1 tokens of ids, where the scored ones start among
    them, and whether some scored tokens were lost (a scored span of max_len tokens or more cannot
    fit whole). The BOS stays because every training row starts with one (BOS-aligned packing):
    cropped to its newest max_len tokens, a sequence began mid-text with no BOS, a start the model
    never saw, on most offline 10-shot squad items at 2048 tokens (chat_eval's prompts keep it too)."""
    if len(ids) <= max_len:
        return ids, start, False
    cut = len(ids) - max_len   # ids[1: cut + 1] go
    return ids[:1] + ids[cut + 1:], max(1, start - cut), start - cut < 1


def tokenize_items(tokenizer, task: CoreTask, rendered: list[tuple[list[str], list[str]]],
                   max_len: int, answer_cut: list[bool] | None = None) -> list[list[tuple[list[int], int]]]:
    """Per item, (ids, start) per sequence: ids[start:] is scored (see _scored_starts); BOS first.

    Too-long sequences keep their BOS and lose the tokens after it: the context's first, then, only
    where the scored tokens alone exceed max_len - 1, the scored span's own first tokens (only the
    rest is scored).
    `answer_cut`, when given, gets one bool per item: True where that happened to any of its
    sequences. All texts of all items go through the tokenizer in at most two batched calls.
    """
    bos = tokenizer.bos_token_id
    flat_full = [c + k for contexts, conts in rendered for c, k in zip(contexts, conts)]
    ids_full = iter(tokenizer.encode(flat_full, prepend=bos))
    ctx_ids = {}
    if task.task_type == _LM:  # only language modeling needs the context's own tokens
        unique = sorted({c for contexts, _ in rendered for c in contexts})
        ctx_ids = dict(zip(unique, tokenizer.encode(unique, prepend=bos)))
    out = []
    for contexts, _ in rendered:
        fulls = [next(ids_full) for _ in contexts]
        starts = _scored_starts(task, fulls, ctx_ids.get(contexts[0]))
        seqs, lost = [], False
        for ids, start in zip(fulls, starts):
            ids, start, cut = _crop(ids, min(max(start, 1), len(ids) - 1), max_len)
            seqs.append((ids, start))
            lost |= cut
        out.append(seqs)
        if answer_cut is not None:
            answer_cut.append(lost)
    return out


def tokenize_item(tokenizer, task: CoreTask, contexts: list[str], continuations: list[str],
                  max_len: int) -> list[tuple[list[int], int]]:
    """tokenize_items for a single item."""
    return tokenize_items(tokenizer, task, [(contexts, continuations)], max_len)[0]


# ---------------------------------------------------------------------------------------------
# Batched scoring
# ---------------------------------------------------------------------------------------------

def _bucket(length: int, cap: int) -> int:
    """Round a batch length up to a power of two (>= 32), never past max(length, cap)."""
    b = 32
    while b < length:
        b *= 2
    return min(b, max(length, cap))


def score_sequences(model, seqs: list[tuple[list[int], int]], device, *, pad_id: int,
                    batch_tokens: int = 16384, max_len: int = 2048,
                    fixed_shapes: bool | None = None) -> list[tuple[float, float, bool]]:
    """(mean NLL, total NLL, greedy exact match) of ids[start:] for every (ids, start).

    Sequences are sorted by length and packed into right-padded batches of at most batch_tokens
    (padded) tokens; causal attention makes the right padding invisible to real tokens.
    fixed_shapes (default: on CUDA) pads lengths to powers of two and every batch to the same row
    count per length, so compiled attention kernels (flex_attention) see a handful of shapes
    instead of recompiling for each batch.
    """
    import torch
    import torch.nn.functional as F

    if fixed_shapes is None:
        fixed_shapes = torch.device(device).type == "cuda"
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    results: list[tuple[float, float, bool] | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        T = len(seqs[order[i]][0])
        if fixed_shapes:
            T = _bucket(T, max_len)
        rows = max(1, batch_tokens // T)
        chunk = order[i: i + rows]
        i += len(chunk)
        B = rows if fixed_shapes else len(chunk)
        x = torch.full((B, T), pad_id, dtype=torch.long)
        y = torch.full((B, T), -1, dtype=torch.long)
        for b, k in enumerate(chunk):
            ids, start = seqs[k]
            x[b, : len(ids)] = torch.tensor(ids)
            y[b, start - 1: len(ids) - 1] = torch.tensor(ids[start:])  # position p predicts token p+1
        x, y = x.to(device), y.to(device)
        with torch.no_grad():
            logits = model(x).float()
        nll = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1,
                              reduction="none").view_as(y)
        mask = y >= 0
        total = (nll * mask).sum(1)
        mean = total / mask.sum(1)
        exact = ((logits.argmax(-1) == y) | ~mask).all(1)
        for k, m, t, e in zip(chunk, mean.tolist(), total.tolist(), exact.tolist()):  # one device sync
            results[k] = (m, t, e)
    return results  # type: ignore[return-value]


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _item_correct(task: CoreTask, item: dict, scores: list[tuple[float, float, bool]], scoring: str) -> bool:
    """LM: greedy exact match. MC / schema: the lowest NLL wins; a non-finite score (a diverged
    model) never wins, and a winner whose text equals the gold's counts (some items list the same
    choice twice: identical texts tie exactly, and the first copy is not more wrong than the
    second)."""
    if task.task_type == _LM:
        return scores[0][2]
    key = 0 if scoring == "mean" else 1
    finite = [c for c in range(len(scores)) if math.isfinite(scores[c][key])]
    if not finite:
        return False
    pred, gold = min(finite, key=lambda c: scores[c][key]), item["gold"]
    options = item["choices"] if task.task_type == _MC else item["context_options"]
    return pred == gold or options[pred] == options[gold]


def fewshot_indices(idx: int, pool_size: int, k: int, seed: int = 1234) -> list[int]:
    """The k shots of item idx, drawn as upstream nanochat does:
    random.Random(seed + idx).sample(<range(pool_size) without idx>, k). sample() only indexes its
    population, so drawing positions from range(pool_size - 1) and shifting those at or past idx by
    one gives the same indices without building an O(pool_size) list per item."""
    assert 0 <= idx < pool_size and k < pool_size, (idx, pool_size, k)
    if k == 0:
        return []
    return [j + (j >= idx) for j in random.Random(seed + idx).sample(range(pool_size - 1), k)]


def evaluate_task(model, tokenizer, task: CoreTask, data: list[dict], device, *, num_items: int | None = None,
                  seed: int = 1234, max_seq_len: int = 2048, batch_tokens: int = 16384,
                  scoring: str = "mean", chunk_items: int = 256) -> float:
    """Accuracy on data[:num_items]. Few-shot examples come from those same items minus the one
    scored (upstream cuts a task to max_per_task before drawing shots); when they are too few for
    the task's shots, from all of `data` instead (where upstream would fail).

    Items are rendered, tokenized and scored `chunk_items` at a time (bounded memory on tasks with
    tens of thousands of items). Under torch.distributed, items are split across ranks and the
    counts all-reduced.

    An item whose answer tokens alone do not fit in max_seq_len (see tokenize_items) is scored on
    the tokens that fit for multiple choice / schema, and counted wrong for language modeling (an
    exact match of part of the answer is not an exact match); a warning says how many there were.
    """
    import torch

    # checked here too (run_core_eval checks its own): -1, base_eval's "all", or 0 returned an
    # accuracy of 0.0 over no items, and any scoring but "mean" silently ranked by the sum
    if num_items is not None and (isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1):
        raise ValueError(f"evaluate_task num_items: got {num_items!r}; accepted: None (all) or an integer >= 1")
    if scoring not in ("mean", "sum"):
        raise ValueError(f"evaluate_task scoring: got {scoring!r}; accepted: mean|sum")
    n = len(data) if num_items is None else min(num_items, len(data))
    if task.num_fewshot >= len(data):
        raise ValueError(f"task {task.label}: {task.num_fewshot}-shot needs more than {len(data)} examples")
    pool = n if n > task.num_fewshot else len(data)
    rank, world = _dist()
    mine = list(range(rank, n, world))
    correct = cut = 0
    for c0 in range(0, len(mine), chunk_items):
        chunk = mine[c0: c0 + chunk_items]
        rendered = []
        for idx in chunk:
            shots = [data[j] for j in fewshot_indices(idx, pool, task.num_fewshot, seed)]
            rendered.append(render_prompts(task, data[idx], shots))
        answer_cut: list[bool] = []
        per_item = tokenize_items(tokenizer, task, rendered, max_seq_len, answer_cut)
        flat = [s for seqs in per_item for s in seqs]
        scores = iter(score_sequences(model, flat, device, pad_id=tokenizer.bos_token_id,
                                      batch_tokens=batch_tokens, max_len=max_seq_len))
        for idx, seqs, lost in zip(chunk, per_item, answer_cut):
            ok = _item_correct(task, data[idx], [next(scores) for _ in seqs], scoring)
            correct += int(ok and not (lost and task.task_type == _LM))
            cut += int(lost)
    total = len(mine)
    if world > 1:
        import torch.distributed as dist

        # integer counts: exact, and a dtype every backend has (MPS has no float64 tensors)
        counts = torch.tensor([correct, total, cut], dtype=torch.long, device=device)
        dist.all_reduce(counts)
        correct, total, cut = counts.tolist()
    if cut:
        how = "counted wrong" if task.task_type == _LM else "scored on the tokens that fit"
        print0(f"warning: task {task.label}: {cut} of {total} items have answers longer than the model's "
               f"{max_seq_len}-token window ({how})")
    return correct / total if total > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def run_core_eval(model, tokenizer, device, *, max_per_task: int | None = None, tasks=None, data_dir=None,
                  bundle_dir=None, data: CoreData | None = None, seed: int = 1234, batch_tokens: int = 16384,
                  max_seq_len: int | None = None, scoring: str = "mean", log: Callable[..., None] = print0) -> dict:
    """Evaluate CORE; returns per-task accuracy + centered accuracy, the CORE mean and coverage.

    `data` is load_core_data()'s result when the caller read it first (then tasks / data_dir /
    bundle_dir are ignored). Keys: results, centered_results (label -> float), core_metric (mean
    over the tasks that ran), available / missing (of the 22 CORE tasks, or of `tasks`), complete
    (all 22 ran), all_items (no task cut by max_per_task: a CORE of 8 items a task is a noisy
    estimate, not the score), num_examples, seconds, source ("bundle:<dir>" or "offline:<dirs>").
    """
    if max_per_task is not None and max_per_task < 1:
        raise ValueError(f"--max-per-task: got {max_per_task}; accepted: None or >= 1")
    if scoring not in ("mean", "sum"):
        raise ValueError(f"run_core_eval scoring: got {scoring!r}; accepted: mean|sum")
    if data is None:
        data = load_core_data(tasks=tasks, data_dir=data_dir, bundle_dir=bundle_dir)
    source, wanted = data.source, data.wanted
    if max_seq_len is None:
        max_seq_len = getattr(getattr(model, "config", None), "sequence_len", 2048)
    out = {"source": source, "results": {}, "centered_results": {}, "num_examples": {}, "seconds": {},
           "all_items": True}
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        for task, records in data.tasks:
            t0 = time.time()
            items = list(records)
            random.Random(1337).shuffle(items)  # a fixed subset when max_per_task truncates
            acc = evaluate_task(model, tokenizer, task, items, device, num_items=max_per_task, seed=seed,
                                max_seq_len=max_seq_len, batch_tokens=batch_tokens, scoring=scoring)
            label = task.label
            out["results"][label] = acc
            out["centered_results"][label] = centered_accuracy(acc, task.random_baseline)
            out["num_examples"][label] = min(len(items), max_per_task or len(items))
            out["all_items"] &= out["num_examples"][label] == len(items)
            out["seconds"][label] = time.time() - t0
            log(f"{label:34s} acc {acc:.4f}  centered {out['centered_results'][label]:+.4f}  "
                f"({out['num_examples'][label]} items, {task.num_fewshot}-shot, {out['seconds'][label]:.1f}s)")
    finally:
        model.train(was_training)
    ran = set(out["results"])
    out["available"] = [t for t in wanted if t in ran]
    out["missing"] = [t for t in wanted if t not in ran]
    out["complete"] = all(label in ran for label in CORE_LABELS)
    out["core_metric"] = core_metric(out["centered_results"]) if ran else float("nan")
    cut = "" if out["all_items"] else f", at most {max_per_task} items a task (--max-per-task)"
    log(f"CORE {out['core_metric']:.4f} over {len(ran)} tasks ({source}{cut}); missing: {out['missing'] or 'none'}")
    return out
