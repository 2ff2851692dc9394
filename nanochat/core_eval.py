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

Under torchrun the per-item verdicts and the scores are those of one process, to the last bit: the
ranks tokenize a share of the items each and gather the sequences, every rank plans one process's
batches of them (plan_batches), the batches are dealt whole to the ranks (dealt_batches: the task's
batch g to rank g % world), and every rank's per-sequence scores are gathered before any item is
decided, as eval_bpb deals the batches of the one stream every rank reads.

Data (nanochat/core_data.py): the DCLM bundle when present, else offline equivalents of 20 of the
22 tasks with prompts of our own, comparable only with other offline runs.
"""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Iterable

# the task table and data loading moved to core_data.py; re-exported for existing callers
from nanochat.core_data import (CORE_LABELS, CORE_TASKS, EVAL_BUNDLE_URL, TASK_TYPES, CoreData, CoreTask,
                                default_bundle_dir, download_eval_bundle, load_core_data, resolve_sources)
from nanochat.common import print0

__all__ = ["CORE_LABELS", "CORE_TASKS", "EVAL_BUNDLE_URL", "TASK_TYPES", "CoreData", "CoreTask",
           "centered_accuracy", "core_metric", "dealt_batches", "default_bundle_dir", "download_eval_bundle",
           "evaluate_task", "fewshot_indices", "load_core_data", "plan_batches", "render_prompts",
           "resolve_sources", "run_core_eval", "score_sequences", "tokenize_item", "tokenize_items"]
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


def _fixed_shapes(device, fixed_shapes: bool | None) -> bool:
    import torch

    return torch.device(device).type == "cuda" if fixed_shapes is None else fixed_shapes


def plan_batches(lengths: list[int], *, batch_tokens: int = 16384, max_len: int = 2048,
                 fixed_shapes: bool = False) -> list[tuple[int, int, list[int]]]:
    """The batches one process scores sequences of these lengths in: (T, B, the sequences' indices)
    per batch, B rows of T tokens (right-padded). Sequences are sorted by length (longest first;
    equal lengths keep their order) and packed into batches of at most batch_tokens padded tokens.
    fixed_shapes pads T to a power of two (_bucket) and every batch to the full row count of its T,
    so compiled kernels see a handful of shapes. Depends on nothing but its arguments: every rank
    makes the same plan from the same sequences (evaluate_task deals its batches)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    plan, i = [], 0
    while i < len(order):
        T = lengths[order[i]]
        if fixed_shapes:
            T = _bucket(T, max_len)
        rows = max(1, batch_tokens // T)
        chunk = order[i: i + rows]
        i += len(chunk)
        plan.append((T, rows if fixed_shapes else len(chunk), chunk))
    return plan


def dealt_batches(num_batches: int, rank: int, world: int, first: int = 0) -> range:
    """The batches of a plan that rank `rank` of `world` scores, when the plan's batch j is batch
    first + j of the task (its batches numbered across chunks): batch g goes to rank g % world, as
    distributed.StridedMicroBatches deals a stream. Every batch goes to exactly one rank."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank/world: got {rank}/{world}; accepted: 0 <= rank < world")
    if num_batches < 0 or first < 0:
        raise ValueError(f"num_batches/first: got {num_batches}/{first}; accepted: >= 0")
    return range((rank - first) % world, num_batches, world)


def _score_batches(model, seqs: list[tuple[list[int], int]], plan, which: Iterable[int], device, *,
                   pad_id: int) -> list[tuple[float, float, bool] | None]:
    """(mean NLL, total NLL, greedy exact match) of ids[start:] for the sequences of the plan's
    batches `which`; None for the others. Causal attention makes the right padding invisible to
    real tokens."""
    import torch
    import torch.nn.functional as F

    results: list[tuple[float, float, bool] | None] = [None] * len(seqs)
    for j in which:
        T, B, chunk = plan[j]
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
    return results


def score_sequences(model, seqs: list[tuple[list[int], int]], device, *, pad_id: int,
                    batch_tokens: int = 16384, max_len: int = 2048, fixed_shapes: bool | None = None,
                    batches: Iterable[int] | None = None) -> list[tuple[float, float, bool] | None]:
    """(mean NLL, total NLL, greedy exact match) of ids[start:] for every (ids, start), in the
    batches of plan_batches (fixed_shapes by default on CUDA). `batches`: score only these of the
    plan's batches (a rank's share, dealt_batches); the other sequences get None."""
    plan = plan_batches([len(ids) for ids, _ in seqs], batch_tokens=batch_tokens, max_len=max_len,
                        fixed_shapes=_fixed_shapes(device, fixed_shapes))
    which = range(len(plan)) if batches is None else batches
    return _score_batches(model, seqs, plan, which, device, pad_id=pad_id)


def _score_dealt(model, seqs: list[tuple[list[int], int]], first: int, device, *, pad_id: int, batch_tokens: int,
                 max_len: int, label: str) -> tuple[list[tuple[float, float, bool]], int]:
    """Every sequence's scores, alike on every rank, and the number of batches they took. This rank
    scores its batches of one process's plan (dealt_batches; the plan's first batch is the task's
    batch `first`), and one all_gather (tasks.evaluate.gather_ranks) brings every rank's rows. The floats
    travel pickled, so each is the one its batch computed, bit for bit. A rank whose part raised
    (its own out of memory) makes every rank raise there, the others naming it, instead of leaving
    them at the gather."""
    sizes = dict(batch_tokens=batch_tokens, max_len=max_len, fixed_shapes=_fixed_shapes(device, None))
    num_batches = len(plan_batches([len(ids) for ids, _ in seqs], **sizes))
    rank, world = _dist()
    mine = dealt_batches(num_batches, rank, world, first)
    if world == 1:
        return score_sequences(model, seqs, device, pad_id=pad_id, **sizes), num_batches  # type: ignore[return-value]
    from nanochat.tasks.evaluate import gather_ranks

    scored, error = [], None
    try:
        got = score_sequences(model, seqs, device, pad_id=pad_id, batches=mine, **sizes)
        scored = [(k, s) for k, s in enumerate(got) if s is not None]
    except Exception as e:   # said together with the other ranks (gather_ranks), not left at a collective
        error = e
    gathered = gather_ranks(f"CORE {label}", scored, error)
    assert [k for k, _ in gathered] == list(range(len(seqs))), "a sequence scored by no rank, or by two"
    return [s for _, s in gathered], num_batches


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


def _tokenized_chunk(tokenizer, task: CoreTask, data: list[dict], chunk: range, pool: int, seed: int,
                     max_len: int) -> tuple[list[list[tuple[list[int], int]]], list[bool]]:
    """tokenize_items of the chunk's items, each rendered with its shots from data[:pool], and their
    answer_cut flags: the same lists on every rank. Under torch.distributed each rank renders and
    tokenizes the items i with i % world == rank and one all_gather (tasks.evaluate.gather_ranks) brings
    the others': tokenizing is most of CORE's host work (the offline files on 2 CPU cores: 100 s of
    tokenizing against 1.5 s of rendering), and an item's tokens do not depend on the items
    tokenized with it, so each rank need not do it all."""
    rank, world = _dist()
    mine = range(chunk.start + (rank - chunk.start) % world, chunk.stop, world)
    per_seq, answer_cut, error = [], [], None
    try:
        rendered = [render_prompts(task, data[i], [data[j] for j in fewshot_indices(i, pool, task.num_fewshot, seed)])
                    for i in mine]
        per_seq = tokenize_items(tokenizer, task, rendered, max_len, answer_cut)
    except Exception as e:   # said together with the other ranks (gather_ranks), not left at a collective
        if world == 1:
            raise
        error = e
    if world == 1:
        return per_seq, answer_cut
    from nanochat.tasks.evaluate import gather_ranks

    rows = gather_ranks(f"CORE {task.label}", list(zip(mine, per_seq, answer_cut)), error)
    assert [i for i, _, _ in rows] == list(chunk), "an item tokenized by no rank, or by two"
    return [seqs for _, seqs, _ in rows], [lost for _, _, lost in rows]


def evaluate_task(model, tokenizer, task: CoreTask, data: list[dict], device, *, num_items: int | None = None,
                  seed: int = 1234, max_seq_len: int = 2048, batch_tokens: int = 16384,
                  scoring: str = "mean", chunk_items: int = 256, per_item: list[bool] | None = None) -> float:
    """Accuracy on data[:num_items]. Few-shot examples come from those same items minus the one
    scored (upstream cuts a task to max_per_task before drawing shots); when they are too few for
    the task's shots, from all of `data` instead (where upstream would fail).

    Items are rendered, tokenized and scored `chunk_items` at a time (bounded memory on tasks with
    tens of thousands of items). Under torch.distributed the ranks share a chunk's rendering and
    tokenizing and gather its sequences (_tokenized_chunk), each rank makes one process's batches of
    them (plan_batches), the task's batches, numbered across chunks, are dealt whole to the ranks
    (batch g: rank g % world), and the chunk's scores are gathered (_score_dealt). So every sequence
    is scored in the batch, and row, it has on one process (a batch's shape and padding pick its
    kernels on a GPU: per-rank batches of per-rank items broke near-ties differently on 2 ranks
    than on 1), each item is decided once, alike on every rank, and the count is exact.
    `per_item`, when given, gets each item's verdict (True: correct), in item order, on every rank.

    An item whose answer tokens alone do not fit in max_seq_len (see tokenize_items) is scored on
    the tokens that fit for multiple choice / schema, and counted wrong for language modeling (an
    exact match of part of the answer is not an exact match); a warning says how many there were.
    """
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
    correct = cut = dealt = 0
    for c0 in range(0, n, chunk_items):
        chunk = range(c0, min(c0 + chunk_items, n))   # the same chunks on every rank
        per_seq, answer_cut = _tokenized_chunk(tokenizer, task, data, chunk, pool, seed, max_seq_len)
        flat = [s for seqs in per_seq for s in seqs]
        scores, batches = _score_dealt(model, flat, dealt, device, pad_id=tokenizer.bos_token_id,
                                       batch_tokens=batch_tokens, max_len=max_seq_len, label=task.label)
        scores, dealt = iter(scores), dealt + batches
        for idx, seqs, lost in zip(chunk, per_seq, answer_cut):
            ok = _item_correct(task, data[idx], [next(scores) for _ in seqs], scoring)
            ok = ok and not (lost and task.task_type == _LM)
            correct += int(ok)
            cut += int(lost)
            if per_item is not None:
                per_item.append(ok)
    if cut:
        how = "counted wrong" if task.task_type == _LM else "scored on the tokens that fit"
        print0(f"warning: task {task.label}: {cut} of {n} items have answers longer than the model's "
               f"{max_seq_len}-token window ({how})")
    return correct / n if n > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def run_core_eval(model, tokenizer, device, *, max_per_task: int | None = None, tasks=None, data_dir=None,
                  bundle_dir=None, data: CoreData | None = None, seed: int = 1234, batch_tokens: int = 16384,
                  max_seq_len: int | None = None, scoring: str = "mean", log: Callable[..., None] = print0,
                  per_item: bool = False) -> dict:
    """Evaluate CORE; returns per-task accuracy + centered accuracy, the CORE mean and coverage.

    `data` is load_core_data()'s result when the caller read it first (then tasks / data_dir /
    bundle_dir are ignored). Keys: results, centered_results (label -> float), core_metric (mean
    over the tasks that ran), available / missing (of the 22 CORE tasks, or of `tasks`), complete
    (all 22 ran), all_items (no task cut by max_per_task: a CORE of 8 items a task is a noisy
    estimate, not the score), num_examples, seconds, source ("bundle:<dir>" or "offline:<dirs>"), and
    with `per_item` per_item (label -> each scored item's verdict, in the order scored). Under
    torch.distributed every rank returns the same result (evaluate_task).
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
    if per_item:
        out["per_item"] = {}
    was_training = getattr(model, "training", False)
    model.eval()
    try:
        for task, records in data.tasks:
            t0 = time.time()
            items = list(records)
            random.Random(1337).shuffle(items)  # a fixed subset when max_per_task truncates
            verdicts: list[bool] = []
            acc = evaluate_task(model, tokenizer, task, items, device, num_items=max_per_task, seed=seed,
                                max_seq_len=max_seq_len, batch_tokens=batch_tokens, scoring=scoring,
                                per_item=verdicts)
            label = task.label
            if per_item:
                out["per_item"][label] = verdicts
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
