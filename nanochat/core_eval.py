"""CORE: the DCLM in-context-learning evaluation of base models (22 tasks, centered accuracy).

Three task types, all scored from one teacher-forced forward pass per sequence:
* multiple_choice: one context, several continuations; the choice with the lowest mean per-token
  negative log-likelihood (DCLM / llm-foundry rank by per-token perplexity) wins; scoring="sum"
  ranks by total NLL instead.
* schema: several contexts, one shared continuation (Winograd-style); lowest continuation NLL wins.
* language_modeling: correct when greedy decoding reproduces every continuation token exactly.

Few-shot examples are sampled per item with random.Random(seed + item index) from the whole
dataset minus the item itself. Accuracy is centered against the random baseline,
(acc - b) / (1 - b), and CORE is the mean of the centered accuracies.

Data: the DCLM bundle (core.yaml + eval_meta_data.csv + eval_data/**.jsonl; `download_eval_bundle`)
when present, else the offline equivalents in the eval data dir (../shared/data/eval), which
cover 20 of the 22 tasks (no winograd / wsc273, no agi_eval_lsat_ar) with prompts of our own,
so offline CORE is comparable only with other offline runs. The result says which tasks ran.
"""

from __future__ import annotations

import csv
import json
import os
import random
import shutil
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from nanochat.common import get_base_dir, print0
from nanochat.errors import DataError, MissingDataError
from nanochat.tasks.common import DataUnavailableError, local_dirs, read_jsonl

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")


@dataclass(frozen=True)
class CoreTask:
    label: str
    task_type: str                  # one of TASK_TYPES
    num_fewshot: int
    random_baseline: float          # fraction in [0, 1)
    continuation_delimiter: str = " "
    dataset_uri: str = ""           # path under the bundle's eval_data/
    preamble: str = ""              # task instructions printed once before the few-shot examples


def _t(label, kind, shots, baseline_pct, uri, delim=" "):
    return CoreTask(label, kind, shots, baseline_pct / 100, delim, uri)


_MC, _SC, _LM, _ANS = "multiple_choice", "schema", "language_modeling", "\nAnswer: "
# The 22 CORE tasks: shots, delimiters and random baselines as in the DCLM core.yaml / eval_meta_data.csv.
CORE_TASKS: tuple[CoreTask, ...] = (
    _t("hellaswag_zeroshot", _MC, 0, 25, "language_understanding/hellaswag.jsonl"),
    _t("jeopardy", _LM, 10, 0, "world_knowledge/jeopardy_all.jsonl", _ANS),
    _t("bigbench_qa_wikidata", _LM, 10, 0, "world_knowledge/bigbench_qa_wikidata.jsonl"),
    _t("arc_easy", _MC, 10, 25, "world_knowledge/arc_easy.jsonl", _ANS),
    _t("arc_challenge", _MC, 10, 25, "world_knowledge/arc_challenge.jsonl", _ANS),
    _t("copa", _MC, 0, 50, "commonsense_reasoning/copa.jsonl"),
    _t("commonsense_qa", _MC, 10, 20, "commonsense_reasoning/commonsense_qa.jsonl"),
    _t("piqa", _MC, 10, 50, "commonsense_reasoning/piqa.jsonl", _ANS),
    _t("openbook_qa", _MC, 0, 25, "commonsense_reasoning/openbook_qa.jsonl"),
    _t("lambada_openai", _LM, 0, 0, "language_understanding/lambada_openai.jsonl"),
    _t("hellaswag", _MC, 10, 25, "language_understanding/hellaswag.jsonl"),
    _t("winograd", _SC, 0, 50, "language_understanding/winograd_wsc.jsonl"),
    _t("winogrande", _SC, 0, 50, "language_understanding/winogrande.jsonl"),
    _t("bigbench_dyck_languages", _LM, 10, 0, "symbolic_problem_solving/bigbench_dyck_languages.jsonl"),
    _t("agi_eval_lsat_ar", _MC, 3, 20, "symbolic_problem_solving/agi_eval_lsat_ar.jsonl"),
    _t("bigbench_cs_algorithms", _LM, 10, 0, "symbolic_problem_solving/bigbench_cs_algorithms.jsonl"),
    _t("bigbench_operators", _LM, 10, 0, "symbolic_problem_solving/bigbench_operators.jsonl"),
    _t("bigbench_repeat_copy_logic", _LM, 10, 0, "symbolic_problem_solving/bigbench_repeat_copy_logic.jsonl"),
    _t("squad", _LM, 10, 0, "reading_comprehension/squad.jsonl", _ANS),
    _t("coqa", _LM, 0, 0, "reading_comprehension/coqa.jsonl", _ANS),
    _t("boolq", _MC, 10, 62, "reading_comprehension/boolq.jsonl", _ANS),
    _t("bigbench_language_identification", _MC, 10, 9.1, "language_understanding/bigbench_language_identification.jsonl"),
)
CORE_LABELS = tuple(t.label for t in CORE_TASKS)


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
# Offline tasks from ../shared/data/eval (schemas in ../shared/data/README.md)
# ---------------------------------------------------------------------------------------------

def _mc(query: str, choices, gold) -> dict:
    return {"query": query, "choices": list(choices), "gold": int(gold)}


def _lm(context: str, continuation: str) -> dict:
    return {"context": context, "continuation": continuation}


def _copa(r: dict) -> dict:
    joiner = " because" if r["relation"] == "cause" else " therefore"
    choices = [c[:1].lower() + c[1:] for c in r["choices"]]
    return _mc(r["question"].rstrip(".") + joiner, choices, r["answer"])


def _lambada(r: dict) -> dict:
    context, _, last = r["text"].rstrip().rpartition(" ")
    return _lm(context, last)


def _winogrande(r: dict) -> dict:
    before, _, after = r["question"].partition("_")
    return {"context_options": [before + c for c in r["choices"]], "continuation": after.strip(), "gold": int(r["answer"])}


def _coqa(r: dict) -> dict:
    turns = "".join(f"Question: {h['question']}{_ANS}{h['answer']}\n\n" for h in r.get("history", []))
    return _lm(f"{r['context']}\n\n{turns}Question: {r['question']}", r["answer"])


def _bigbench_query(r: dict) -> str:
    return (r.get("input_prefix", "").lstrip("\n") + r["input"] + r.get("output_prefix", "")).rstrip()


def _bigbench_lm(r: dict) -> dict:
    target = r["target"][0] if isinstance(r["target"], list) else r["target"]
    return _lm(_bigbench_query(r), target)


_HELLASWAG = ("hellaswag.jsonl", lambda r: _mc(f"{r['activity_label']}: {r['ctx']}", r["endings"], r["label"]))
_OFFLINE: dict[str, tuple[str, Callable[[dict], dict]]] = {
    "hellaswag_zeroshot": _HELLASWAG,
    "hellaswag": _HELLASWAG,
    "jeopardy": ("jeopardy.jsonl", lambda r: _lm(f"{r['category']}: {r['question']}", r["answer"])),
    "bigbench_qa_wikidata": ("bigbench_qa_wikidata.jsonl", _bigbench_lm),
    "arc_easy": ("arc_easy.jsonl", lambda r: _mc(f"Question: {r['question']}", r["choices"], r["answer"])),
    "arc_challenge": ("arc_challenge.jsonl", lambda r: _mc(f"Question: {r['question']}", r["choices"], r["answer"])),
    "copa": ("copa.jsonl", _copa),
    "commonsense_qa": ("commonsenseqa.jsonl", lambda r: _mc(r["question"], r["choices"], r["answer"])),
    "piqa": ("piqa.jsonl", lambda r: _mc(f"Question: {r['question']}", r["choices"], r["answer"])),
    "openbook_qa": ("openbookqa.jsonl", lambda r: _mc(r["question"], r["choices"], r["answer"])),
    "lambada_openai": ("lambada.jsonl", _lambada),
    "winogrande": ("winogrande.jsonl", _winogrande),
    "bigbench_dyck_languages": ("bigbench_dyck_languages.jsonl", _bigbench_lm),
    "bigbench_cs_algorithms": ("bigbench_cs_algorithms.jsonl", _bigbench_lm),
    "bigbench_operators": ("bigbench_operators.jsonl", _bigbench_lm),
    "bigbench_repeat_copy_logic": ("bigbench_repeat_copy_logic.jsonl", _bigbench_lm),
    "squad": ("squad.jsonl", lambda r: _lm(f"Context: {r['context']}\nQuestion: {r['question']}", r["answer"])),
    "coqa": ("coqa.jsonl", _coqa),
    "boolq": ("boolq.jsonl", lambda r: _mc(f"Passage: {r['context']}\nQuestion: {r['question']}?", r["choices"], r["answer"])),
    "bigbench_language_identification": ("bigbench_language_identification.jsonl",
                                         lambda r: _mc(_bigbench_query(r), r["choices"], r["answer"])),
}

TaskSource = tuple[CoreTask, Callable[[], list[dict]] | None]  # None: listed but its data is absent


def _offline_sources(data_dir=None) -> tuple[list[TaskSource], list[Path]]:
    dirs = local_dirs("eval", data_dir)
    sources = []
    for task in CORE_TASKS:
        if task.label not in _OFFLINE:
            continue
        filename, convert = _OFFLINE[task.label]
        path = next((d / filename for d in dirs if (d / filename).is_file()), None)
        if path is None:
            continue
        if task.label.startswith("bigbench"):  # the BIG-bench task instructions, once per prompt
            first = read_jsonl_head(path)
            pre = first.get("preamble", "").strip()
            task = replace(task, preamble=pre + "\n\n" if pre else "")
        sources.append((task, lambda p=path, c=convert, t=task: _enough(t, p, _convert(p, c))))
    return sources, dirs


def _enough(task: CoreTask, path: Path, records: list[dict]) -> list[dict]:
    if len(records) <= task.num_fewshot:
        raise DataError(f"CORE task {task.label} ({path}): {len(records)} records; its {task.num_fewshot}-shot "
                        "prompts need more (an empty or truncated file? restore it, or delete it to skip the task)")
    return records


def _convert(path: Path, convert) -> list[dict]:
    """The file's records in CORE's schema; DataError naming the file and record when one lacks a
    field its task needs (e.g. a hellaswag line without 'endings')."""
    out = []
    for i, r in enumerate(read_jsonl(path), 1):
        try:
            out.append(convert(r))
        except (KeyError, TypeError, IndexError, AttributeError) as e:
            raise DataError(f"{path}: record {i} does not have the fields this task needs "
                            f"({type(e).__name__}: {e}); fix or delete that line") from None
    return out


def read_jsonl_head(path: Path) -> dict:
    """The first record ({} for an empty file: its loader reports that); DataError if unreadable."""
    with open(path, "rb") as f:
        line = f.readline()
    try:
        head = json.loads(line) if line.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}:1: not a JSON object ({e}); fix or delete that line") from None
    if not isinstance(head, dict):
        raise DataError(f"{path}:1: not a JSON object; fix or delete that line")
    return head


# ---------------------------------------------------------------------------------------------
# The DCLM bundle
# ---------------------------------------------------------------------------------------------

def _bundle_sources(bundle: Path) -> list[TaskSource]:
    try:
        import yaml  # noqa: PLC0415 - only needed for the bundle
    except ImportError as e:
        raise ImportError("reading the DCLM bundle's core.yaml needs PyYAML: pip install pyyaml") from e
    config = yaml.safe_load((bundle / "core.yaml").read_text(encoding="utf-8"))
    with open(bundle / "eval_meta_data.csv", encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) / 100 for row in csv.DictReader(f)}
    sources = []
    for entry in config["icl_tasks"]:
        label = entry["label"]
        if label not in baselines:
            raise ValueError(f"{bundle}/eval_meta_data.csv has no 'Random baseline' for task {label!r}")
        shots = entry["num_fewshot"]
        task = CoreTask(label, entry["icl_task_type"], int(shots[0] if isinstance(shots, list) else shots),
                        baselines[label], entry.get("continuation_delimiter", " "), entry["dataset_uri"])
        if task.task_type not in TASK_TYPES:
            raise ValueError(f"{bundle}/core.yaml task {label!r}: icl_task_type {task.task_type!r}; "
                             f"accepted: {'|'.join(TASK_TYPES)}")
        path = bundle / "eval_data" / task.dataset_uri
        # a task whose file is absent gets no loader: reported as missing, not an error
        sources.append((task, (lambda p=path, t=task: _enough(t, p, read_jsonl(p))) if path.is_file() else None))
    return sources


def default_bundle_dir() -> Path:
    return Path(os.environ.get("NANOCHAT_EVAL_BUNDLE") or get_base_dir() / "eval_bundle")


def _safe_extract(zf: zipfile.ZipFile, dest: Path) -> None:
    root = dest.resolve()
    for member in zf.namelist():
        target = (dest / member).resolve()
        if target != root and root not in target.parents:
            raise ValueError(f"eval bundle zip: member {member!r} escapes the extraction dir")
    zf.extractall(dest)


def download_eval_bundle(url: str = EVAL_BUNDLE_URL, dest: str | Path | None = None, *,
                         timeout: float = 60.0, retries: int = 3) -> Path:
    """Download + unzip the DCLM eval bundle to dest (default <base_dir>/eval_bundle); atomic.

    Returns dest when it already holds core.yaml. Raises RuntimeError after `retries` failed
    downloads and ValueError for a zip that is not an eval bundle.
    """
    dest = Path(dest) if dest is not None else default_bundle_dir()
    if (dest / "core.yaml").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".eval_bundle_") as tmp:
        zpath = Path(tmp) / "bundle.zip"
        for attempt in range(1, retries + 1):
            try:
                with urllib.request.urlopen(url, timeout=timeout) as resp, open(zpath, "wb") as f:
                    shutil.copyfileobj(resp, f, length=1 << 20)
                break
            except OSError as e:  # URLError / HTTPError / timeouts are OSErrors
                print0(f"eval bundle download attempt {attempt}/{retries} from {url} failed: {e}")
                if attempt == retries:
                    raise RuntimeError(f"could not download the eval bundle from {url}: {e}") from e
                time.sleep(min(2 ** attempt, 10))
        try:
            with zipfile.ZipFile(zpath) as zf:
                _safe_extract(zf, Path(tmp) / "x")
        except zipfile.BadZipFile as e:
            raise ValueError(f"eval bundle from {url} is not a zip file: {e}") from e
        found = sorted(Path(tmp, "x").rglob("core.yaml"), key=lambda p: len(p.parts))
        if not found or not (found[0].parent / "eval_meta_data.csv").is_file():
            raise ValueError(f"eval bundle from {url} lacks core.yaml / eval_meta_data.csv")
        if dest.exists():  # a partial earlier attempt without core.yaml
            shutil.rmtree(dest)
        os.replace(found[0].parent, dest)
    print0(f"eval bundle ready at {dest}")
    return dest


# ---------------------------------------------------------------------------------------------
# Prompt rendering and tokenization
# ---------------------------------------------------------------------------------------------

def render_prompts(task: CoreTask, item: dict, fewshot: list[dict]) -> tuple[list[str], list[str]]:
    """(contexts, continuations), one pair per scored sequence; context + continuation = full text.

    The delimiter's trailing whitespace moves to the start of the continuation (" Paris", not
    "Paris"), matching how BPE tokenizers attach spaces to the following word.
    """
    delim = task.continuation_delimiter
    d_ctx, d_ws = delim.rstrip(), delim[len(delim.rstrip()):]
    if task.task_type == _MC:
        shots = [f"{ex['query']}{delim}{ex['choices'][ex['gold']]}" for ex in fewshot]
    elif task.task_type == _SC:
        shots = [f"{ex['context_options'][ex['gold']]}{delim}{ex['continuation']}" for ex in fewshot]
    else:
        shots = [f"{ex['context']}{delim}{ex['continuation']}" for ex in fewshot]
    prefix = task.preamble + "".join(s + "\n\n" for s in shots)
    if task.task_type == _MC:
        n = len(item["choices"])
        return [prefix + item["query"] + d_ctx] * n, [d_ws + c for c in item["choices"]]
    if task.task_type == _SC:
        n = len(item["context_options"])
        return [prefix + o + d_ctx for o in item["context_options"]], [d_ws + item["continuation"]] * n
    return [prefix + item["context"] + d_ctx], [d_ws + item["continuation"]]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _common_suffix(seqs: list[list[int]]) -> int:
    n = 0
    shortest = min(len(s) for s in seqs)
    while n < shortest and all(s[-1 - n] == seqs[0][-1 - n] for s in seqs):
        n += 1
    return n


def tokenize_items(tokenizer, task: CoreTask, rendered: list[tuple[list[str], list[str]]],
                   max_len: int) -> list[list[tuple[list[int], int]]]:
    """Per item, (ids, start) per sequence: ids[start:] is the scored continuation; BOS first.

    The continuation starts where the context's tokens stop matching the full text's; for schema
    tasks the scored tokens are further cut to the suffix all options share, so they are identical.
    Too-long sequences lose tokens from the left (the continuation is kept). All texts of all
    items go through the tokenizer in two batched calls.
    """
    bos = tokenizer.bos_token_id
    flat_full = [c + k for contexts, conts in rendered for c, k in zip(contexts, conts)]
    unique = sorted({c for contexts, _ in rendered for c in contexts})
    ids_full = iter(tokenizer.encode(flat_full, prepend=bos))
    ctx_ids = dict(zip(unique, tokenizer.encode(unique, prepend=bos)))
    out = []
    for contexts, _ in rendered:
        fulls = [next(ids_full) for _ in contexts]
        starts = [_common_prefix(ctx_ids[c], f) for c, f in zip(contexts, fulls)]
        if task.task_type == _SC:  # shared suffix, but never reaching back into the contexts
            suffix = min(_common_suffix(fulls), min(len(f) - s for f, s in zip(fulls, starts)))
            starts = [len(f) - max(1, suffix) for f in fulls]
        seqs = []
        for ids, start in zip(fulls, starts):
            start = min(max(start, 1), len(ids) - 1)
            if len(ids) > max_len:
                cut = len(ids) - max_len
                ids, start = ids[cut:], max(1, start - cut)
            seqs.append((ids, start))
        out.append(seqs)
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


def _item_correct(task: CoreTask, gold: int, scores: list[tuple[float, float, bool]], scoring: str) -> bool:
    if task.task_type == _LM:
        return scores[0][2]
    key = 0 if scoring == "mean" else 1
    return min(range(len(scores)), key=lambda c: scores[c][key]) == gold


def evaluate_task(model, tokenizer, task: CoreTask, data: list[dict], device, *, num_items: int | None = None,
                  seed: int = 1234, max_seq_len: int = 2048, batch_tokens: int = 16384,
                  scoring: str = "mean", chunk_items: int = 256) -> float:
    """Accuracy on data[:num_items]; few-shot examples come from all of `data` minus the item.

    Items are rendered, tokenized and scored `chunk_items` at a time (bounded memory on tasks with
    tens of thousands of items). Under torch.distributed, items are split across ranks and the
    counts all-reduced.
    """
    import torch

    n = len(data) if num_items is None else min(num_items, len(data))
    if task.num_fewshot >= len(data):
        raise ValueError(f"task {task.label}: {task.num_fewshot}-shot needs more than {len(data)} examples")
    rank, world = _dist()
    mine = list(range(rank, n, world))
    correct = 0
    for c0 in range(0, len(mine), chunk_items):
        chunk = mine[c0: c0 + chunk_items]
        rendered = []
        for idx in chunk:
            pool = [j for j in random.Random(seed + idx).sample(range(len(data)), task.num_fewshot + 1) if j != idx]
            rendered.append(render_prompts(task, data[idx], [data[j] for j in pool[: task.num_fewshot]]))
        per_item = tokenize_items(tokenizer, task, rendered, max_seq_len)
        flat = [s for seqs in per_item for s in seqs]
        scores = iter(score_sequences(model, flat, device, pad_id=tokenizer.bos_token_id,
                                      batch_tokens=batch_tokens, max_len=max_seq_len))
        for idx, seqs in zip(chunk, per_item):
            correct += int(_item_correct(task, data[idx].get("gold", 0), [next(scores) for _ in seqs], scoring))
    counts = torch.tensor([correct, len(mine)], dtype=torch.float64, device=device)
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(counts)
    return (counts[0] / counts[1]).item() if counts[1] > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def resolve_sources(*, data_dir=None, bundle_dir=None) -> tuple[list[TaskSource], str]:
    """The bundle when bundle_dir (or the default bundle dir) holds core.yaml, else offline files."""
    bundle = Path(bundle_dir) if bundle_dir is not None else default_bundle_dir()
    if (bundle / "core.yaml").is_file():
        return _bundle_sources(bundle), f"bundle:{bundle}"
    if bundle_dir is not None:
        raise MissingDataError(f"--bundle-dir: {bundle} has no core.yaml (run download_eval_bundle())")
    sources, dirs = _offline_sources(data_dir)
    if not sources:
        raise DataUnavailableError(
            f"no CORE data: no DCLM bundle at {bundle} (nanochat.core_eval.download_eval_bundle() fetches "
            f"{EVAL_BUNDLE_URL}) and no offline eval files in {[str(d) for d in dirs]}")
    return sources, "offline:" + ",".join(str(d) for d in dirs)


@dataclass
class CoreData:
    """The records of every CORE task that will run, read before any model work."""
    source: str                                   # "bundle:<dir>" or "offline:<dirs>"
    wanted: list[str]                             # the labels asked for (the 22, or `tasks`)
    tasks: list[tuple[CoreTask, list[dict]]]      # those with data, in CORE order


def load_core_data(*, tasks=None, data_dir=None, bundle_dir=None) -> CoreData:
    """Find and read the data of `tasks` (default: all 22) now, so that a missing, malformed or empty
    file stops a run with one line (MissingDataError / DataError naming it) before the model loads;
    a task whose file is absent is left out and reported as missing."""
    sources, source = resolve_sources(data_dir=data_dir, bundle_dir=bundle_dir)
    known = {t.label for t, _ in sources} | set(CORE_LABELS)
    wanted = list(CORE_LABELS) if tasks is None else list(tasks)
    bad = [t for t in wanted if t not in known]
    if bad:
        raise ValueError(f"--tasks: got {bad}; accepted: {'|'.join(sorted(known))}")
    loaded = []
    for task, load in sources:
        if task.label not in wanted or load is None:
            continue
        loaded.append((task, load()))   # load(): DataError for a malformed or too short file
    return CoreData(source, wanted, loaded)


def run_core_eval(model, tokenizer, device, *, max_per_task: int | None = None, tasks=None, data_dir=None,
                  bundle_dir=None, data: CoreData | None = None, seed: int = 1234, batch_tokens: int = 16384,
                  max_seq_len: int | None = None, scoring: str = "mean", log: Callable[..., None] = print0) -> dict:
    """Evaluate CORE; returns per-task accuracy + centered accuracy, the CORE mean and coverage.

    `data` is load_core_data()'s result when the caller read it first (then tasks / data_dir /
    bundle_dir are ignored). Keys: results, centered_results (label -> float), core_metric (mean
    over the tasks that ran), available / missing (of the 22 CORE tasks, or of `tasks`), complete
    (all 22 ran), num_examples, seconds, source ("bundle:<dir>" or "offline:<dirs>").
    """
    if max_per_task is not None and max_per_task < 1:
        raise ValueError(f"--max-per-task: got {max_per_task}; accepted: None or >= 1")
    if scoring not in ("mean", "sum"):
        raise ValueError(f"--scoring: got {scoring!r}; accepted: mean|sum")
    if data is None:
        data = load_core_data(tasks=tasks, data_dir=data_dir, bundle_dir=bundle_dir)
    source, wanted = data.source, data.wanted
    if max_seq_len is None:
        max_seq_len = getattr(getattr(model, "config", None), "sequence_len", 2048)
    out = {"source": source, "results": {}, "centered_results": {}, "num_examples": {}, "seconds": {}}
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
    log(f"CORE {out['core_metric']:.4f} over {len(ran)} tasks ({source}); missing: {out['missing'] or 'none'}")
    return out
