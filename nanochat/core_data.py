"""CORE's task table and data: the 22 DCLM tasks (type, shots, delimiter, random baseline), the DCLM
eval bundle (download, core.yaml + eval_meta_data.csv), and the offline equivalents of 20 tasks built
from the eval data dir (../shared/data/eval) with prompts of our own.

`load_core_data()` reads every file before any model work, so a missing, malformed or empty file, or
a record the scorer cannot use (an answer index out of range, no continuation), stops a run at once,
naming path and line. Scoring lives in nanochat/core_eval.py.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from nanochat.checkpoint_io import fsync_dir
from nanochat.common import get_base_dir, print0
from nanochat.errors import DataError, MissingDataError
from nanochat.tasks.common import DataUnavailableError, local_dirs, read_jsonl_numbered


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
    _t("squad", _LM, 10, 0, "reading_comprehension/squad.jsonl"),  # the bundle's contexts end in "Answer:"
    _t("coqa", _LM, 0, 0, "reading_comprehension/coqa.jsonl"),
    _t("boolq", _MC, 10, 62, "reading_comprehension/boolq.jsonl", _ANS),
    _t("bigbench_language_identification", _MC, 10, 9.1, "language_understanding/bigbench_language_identification.jsonl"),
)
CORE_LABELS = tuple(t.label for t in CORE_TASKS)


# ---------------------------------------------------------------------------------------------
# Offline tasks from ../shared/data/eval (schemas in ../shared/data/README.md)
# ---------------------------------------------------------------------------------------------

def _index(value) -> int:
    """An answer index from a record: an int or a string of digits (some exports store "0");
    ValueError for anything else (int() would truncate 1.7 and accept True)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    raise ValueError(f"answer index {value!r} is not an integer")


# Offline answers are stripped: the delimiter supplies the one space before them, and a stray edge
# space (10 Jeopardy answers, 118 PIQA choices) is an extra token to predict (exact match) or score.
def _strip(text):
    return text.strip() if isinstance(text, str) else text   # a non-string: _item_problem names it


def _mc(query: str, choices, gold) -> dict:
    return {"query": query, "choices": [_strip(c) for c in choices] if isinstance(choices, list) else choices,
            "gold": _index(gold)}


def _lm(context: str, continuation: str) -> dict:
    return {"context": context, "continuation": _strip(continuation)}


# the pronoun "I" ("I took deep breaths.", "I'm ..."): a choice continuing the premise keeps it upper case
_COPA_I = re.compile(r"I(?=[\s'\u2019])")


def _copa(r: dict) -> dict:
    """The premise + " because" / " therefore", each choice continuing it: its first letter lower
    case, except the pronoun I. Lowered ("i took deep breaths."), a word no text writes so made
    that choice alone less likely: in 4 of COPA's 100 items one choice starts with "I" and the
    other does not (2 of them gold), a bias for or against the answer that no model earned."""
    joiner = " because" if r["relation"] == "cause" else " therefore"
    choices = [c if _COPA_I.match(c) else c[:1].lower() + c[1:] for c in r["choices"]]
    return _mc(r["question"].rstrip(".") + joiner, choices, r["answer"])


def _lambada(r: dict) -> dict:
    context, _, last = r["text"].rstrip().rpartition(" ")
    return _lm(context, last)


def _winogrande(r: dict) -> dict:
    if r["question"].count("_") != 1:   # else one option alone (no blank) scored its last token, silently
        raise ValueError(f"'question' must hold one '_' (the blank the choices fill), got {r['question'][:80]!r}")
    before, _, after = r["question"].partition("_")
    return {"context_options": [before + c for c in r["choices"]], "continuation": after.strip(),
            "gold": _index(r["answer"])}


def _coqa(r: dict) -> dict:
    turns = "".join(f"Question: {h['question']}{_ANS}{h['answer']}\n\n" for h in r.get("history", []))
    return _lm(f"{r['context']}\n\n{turns}Question: {r['question']}{_ANS.rstrip()}", r["answer"])


def _bigbench_query(r: dict) -> str:
    return (r.get("input_prefix", "").lstrip("\n") + r["input"] + r.get("output_prefix", "")).rstrip()


def _bigbench_preamble(r: dict) -> str:
    """The task instructions, printed once before the shots. Per record, not per file:
    cs_algorithms mixes subtasks (lcs, valid_parentheses) whose instructions differ."""
    pre = r.get("preamble", "").strip()
    return pre + "\n\n" if pre else ""


def _bigbench_lm(r: dict) -> dict:
    target = r["target"][0] if isinstance(r["target"], list) else r["target"]
    return {**_lm(_bigbench_query(r), target), "preamble": _bigbench_preamble(r)}


def _bigbench_mc(r: dict) -> dict:
    return {**_mc(_bigbench_query(r), r["choices"], r["answer"]), "preamble": _bigbench_preamble(r)}


# HellaSwag's WikiHow items (2/3 of them) carry the source's markup: "[header] How to cook [title] Prepare
# it. [step] Mix", endings starting "[substeps]" or "[title]". Scored raw, every such choice's mean NLL
# includes tokens no prose holds; the DCLM bundle (and lm-eval's HellaSwag) clean it: a "[title]" ends
# a sentence ("How to cook. Prepare it."), every other bracketed tag goes.
_HS_TITLE_AFTER_STOP = re.compile(r"(?<=[.!?])\s*\[title\]")
_HS_TITLE = re.compile(r"(?<=\S)\s*\[title\]")
_HS_TAG = re.compile(r"\[[^\[\]]*\]")


def _hellaswag_text(text: str) -> str:
    if "[" not in text:   # every pattern needs a "[": half the texts (ActivityNet's) skip three regex passes
        return " ".join(text.split())
    text = _HS_TITLE.sub(". ", _HS_TITLE_AFTER_STOP.sub(" ", text))
    return " ".join(_HS_TAG.sub(" ", text).split())


# ActivityNet's items (a third of HellaSwag) end in the first words of the sentence the endings finish,
# lower-cased in the data ("A man is sitting on a roof. he": the dataset's ctx_b); lm-eval and the DCLM
# bundle capitalise them ("... roof. He starts ..."), as prose starts a sentence. Left as they were,
# every choice was scored after a sentence start no text writes.
_HS_OPEN_SENTENCE = re.compile(r"(?:^|(?<=[.!?])\s+)([a-z])(?=[^.!?]*$)")


def _hellaswag_context(ctx: str) -> str:
    text = _hellaswag_text(ctx)
    m = _HS_OPEN_SENTENCE.search(text)
    return text if m is None else text[:m.start(1)] + m.group(1).upper() + text[m.end(1):]


def _hellaswag(r: dict) -> dict:
    endings = [_hellaswag_text(e) for e in r["endings"]] if isinstance(r["endings"], list) else r["endings"]
    return _mc(f"{r['activity_label']}: {_hellaswag_context(r['ctx'])}", endings, r["label"])


_HELLASWAG = ("hellaswag.jsonl", _hellaswag)
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
    "squad": ("squad.jsonl",
              lambda r: _lm(f"Context: {r['context']}\nQuestion: {r['question']}{_ANS.rstrip()}", r["answer"])),
    "coqa": ("coqa.jsonl", _coqa),
    "boolq": ("boolq.jsonl", lambda r: _mc(f"Passage: {r['context']}\nQuestion: {r['question']}?", r["choices"], r["answer"])),
    "bigbench_language_identification": ("bigbench_language_identification.jsonl", _bigbench_mc),
}

TaskSource = tuple[CoreTask, Callable[[], list[dict]] | None]  # None: listed but its data is absent


def _offline_sources(data_dir=None) -> tuple[list[TaskSource], list[Path]]:
    dirs = local_dirs("eval", data_dir)
    sources = []
    # hellaswag and hellaswag_zeroshot read one file with one conversion (half of all offline
    # loading time): the loaders of these sources convert such a file once between them
    converted: dict[tuple, list[dict]] = {}
    for task in CORE_TASKS:
        if task.label not in _OFFLINE:
            continue
        filename, convert = _OFFLINE[task.label]
        path = next((d / filename for d in dirs if (d / filename).is_file()), None)
        if path is None:
            continue
        if task.label.startswith("bigbench"):  # the first record's instructions; items carry their own
            first = read_jsonl_head(path)
            pre = first.get("preamble", "").strip()
            task = replace(task, preamble=pre + "\n\n" if pre else "")
        sources.append((task, lambda p=path, c=convert, t=task: _enough(t, p, _convert_once(converted, t, p, c))))
    return sources, dirs


def _convert_once(converted: dict, task: CoreTask, path: Path, convert) -> list[dict]:
    """_convert, remembered in `converted` (one _offline_sources call's) by file, conversion and
    task type (what _checked checks): a fresh list each time, its items shared (scoring only reads
    them)."""
    key = (path, convert, task.task_type)
    if key not in converted:   # a DataError is not remembered: the next task reading the file raises it too
        converted[key] = _convert(task, path, convert)
    return list(converted[key])


def _enough(task: CoreTask, path: Path, records: list[dict]) -> list[dict]:
    if len(records) <= task.num_fewshot:
        raise DataError(f"CORE task {task.label} ({path}): {len(records)} records; its {task.num_fewshot}-shot "
                        "prompts need more (an empty or truncated file? restore it, or delete it to skip the task)")
    return records


def _convert(task: CoreTask, path: Path, convert) -> list[dict]:
    """The file's records in CORE's schema; DataError naming path:line when one lacks a field its
    task needs (e.g. a hellaswag line without 'endings') or converts to an unscorable item."""
    out = []
    for i, (lineno, r) in enumerate(read_jsonl_numbered(path), 1):
        try:
            item = convert(r)
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            raise DataError(f"{path}: record {i} does not have the fields this task needs "
                            f"({type(e).__name__}: {e}); fix or delete line {lineno}") from None
        out.append(_checked(task, path, lineno, item))
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


def _item_problem(task_type: str, item) -> str | None:
    """What makes a CORE item unscorable, or None. An answer index out of range loads silently
    otherwise: the item can never be correct (or, negative, a shot shows the wrong choice)."""
    if not isinstance(item, dict):
        return f"a JSON {type(item).__name__}, expected an object"
    if task_type == "language_modeling":
        for key in ("context", "continuation"):
            if not isinstance(item.get(key), str):
                return f"'{key}' must be a string, got {item.get(key)!r}"
        return None if item["continuation"].strip() else "'continuation' is empty: nothing to predict"
    options = "choices" if task_type == "multiple_choice" else "context_options"
    values = item.get(options)
    if not isinstance(values, list) or len(values) < 2 or not all(isinstance(v, str) for v in values):
        return f"'{options}' must be a list of at least 2 strings, got {values!r}"[:200]
    text = "query" if task_type == "multiple_choice" else "continuation"
    if not isinstance(item.get(text), str):
        return f"'{text}' must be a string, got {item.get(text)!r}"[:200]
    # an empty answer leaves only the delimiter's space (or a context token) to score: the item
    # would be decided by text that is no answer at all
    if task_type == "schema" and not item["continuation"].strip():
        return "'continuation' is empty: nothing to score under each context option"
    if task_type == "multiple_choice" and not all(v.strip() for v in values):
        return f"'choices' holds an empty choice: nothing to score for it, got {values!r}"[:200]
    gold = item.get("gold")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(values):
        return f"'gold' (the answer) must be an index 0..{len(values) - 1} into '{options}', got {gold!r}"
    return None


def _checked(task: CoreTask, path: Path, lineno: int, item):
    problem = _item_problem(task.task_type, item)
    if problem:
        raise DataError(f"{path}:{lineno}: {problem} (CORE task {task.label}); fix or delete that line")
    return item


# ---------------------------------------------------------------------------------------------
# The DCLM bundle
# ---------------------------------------------------------------------------------------------

def _bundle_sources(bundle: Path) -> list[TaskSource]:
    meta = bundle / "eval_meta_data.csv"
    if not meta.is_file():   # a hand-copied or half-extracted bundle: without it nothing can be centered
        raise MissingDataError(f"{meta} is missing (the random baselines CORE centers against); {_REFETCH}")
    baselines = _bundle_baselines(meta)
    sources = []
    for task in _bundle_tasks(bundle / "core.yaml"):
        if task.label not in baselines:
            raise DataError(f"{meta} has no 'Random baseline' for task {task.label!r}; {_REFETCH}")
        if not 0.0 <= baselines[task.label] < 1.0:   # else centering raised after the whole evaluation
            raise DataError(f"{meta}: task {task.label!r} has 'Random baseline' {baselines[task.label] * 100:g}; "
                            f"accepted: a percentage 0 <= b < 100; {_REFETCH}")
        task = replace(task, random_baseline=baselines[task.label])
        path = bundle / "eval_data" / task.dataset_uri
        # a task whose file is absent gets no loader: reported as missing, not an error
        sources.append((task, (lambda p=path, t=task: _enough(t, p, _read_bundle_file(t, p))) if path.is_file() else None))
    return sources


def _bundle_tasks(path: Path) -> list[CoreTask]:
    """core.yaml's icl_tasks (random baselines still 0); DataError naming the file when it is not
    the bundle's YAML (damaged, or hand-edited to drop tasks with a slip): a traceback before."""
    try:
        import yaml  # noqa: PLC0415 - only needed for the bundle
    except ImportError as e:
        raise ImportError("reading the DCLM bundle's core.yaml needs PyYAML: pip install pyyaml") from e
    try:
        entries = yaml.safe_load(path.read_text(encoding="utf-8"))["icl_tasks"]
        tasks = []
        for entry in entries:
            shots = entry["num_fewshot"]
            tasks.append(CoreTask(str(entry["label"]), entry["icl_task_type"],
                                  int(shots[0] if isinstance(shots, list) else shots), 0.0,
                                  str(entry.get("continuation_delimiter", " ")), str(entry["dataset_uri"])))
    except (yaml.YAMLError, UnicodeDecodeError, KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
        raise DataError(f"{path}: not the eval bundle's task list ({type(e).__name__}: {str(e)[:200]}); "
                        f"{_REFETCH}") from None
    bad = [t for t in tasks if t.task_type not in TASK_TYPES]
    if bad:
        raise DataError(f"{path}: task {bad[0].label!r} has icl_task_type {bad[0].task_type!r}; accepted: "
                        f"{'|'.join(TASK_TYPES)}; {_REFETCH}")
    return tasks


def _bundle_baselines(path: Path) -> dict[str, float]:
    """eval_meta_data.csv's random baselines as fractions (the file holds percentages)."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return {row["Eval Task"]: float(row["Random baseline"]) / 100 for row in csv.DictReader(f)}
    except (KeyError, TypeError, ValueError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: not the eval bundle's task table (columns 'Eval Task', 'Random baseline'; "
                        f"{type(e).__name__}: {str(e)[:200]}); {_REFETCH}") from None


def _read_bundle_file(task: CoreTask, path: Path) -> list[dict]:
    return [_checked(task, path, lineno, r) for lineno, r in read_jsonl_numbered(path)]


_REFETCH = (f"delete the folder and run nanochat.core_eval.download_eval_bundle() (fetches {EVAL_BUNDLE_URL}), "
            "or unset NANOCHAT_EVAL_BUNDLE to use the offline eval files")


def default_bundle_dir() -> Path:
    return Path(os.environ.get("NANOCHAT_EVAL_BUNDLE") or get_base_dir() / "eval_bundle")


def _safe_extract(zf: zipfile.ZipFile, dest: Path) -> None:
    root = dest.resolve()
    for member in zf.namelist():
        target = (dest / member).resolve()
        if target != root and root not in target.parents:
            raise ValueError(f"eval bundle zip: member {member!r} escapes the extraction dir")
    zf.extractall(dest)


class _NotAZip(ValueError):
    """What the server sent is not a zip file (after every attempt: the URL names something else)."""


def _verify_bundle_zip(path: Path, *, size: int | None = None, sha256: str | None = None) -> None:
    """download_file's check before the zip takes its final name: the size / sha256 the server
    states, then every member's CRC, so a body cut short (a close without a Content-Length) or
    damaged is fetched again and never unpacked as if complete."""
    from nanochat.dataset_download import check_size_sha

    check_size_sha(path, size=size, sha256=sha256)
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
    except zipfile.BadZipFile as e:
        raise _NotAZip(f"not a zip file: {e}") from e
    if bad is not None:
        raise ValueError(f"zip member {bad!r} fails its CRC check")


def download_eval_bundle(url: str = EVAL_BUNDLE_URL, dest: str | Path | None = None, *,
                         timeout: float = 60.0, retries: int = 3, backoff: float = 2.0,
                         stall_window: float | None = None, progress: bool = True) -> Path:
    """Download + unzip the DCLM eval bundle to dest (default <base_dir>/eval_bundle); atomic.

    Returns dest when it already holds core.yaml. The zip is fetched by dataset_download.download_file
    (resume from a .partial, up to `retries` tries in a row that get nowhere, with exponential
    backoff from `backoff` s, the stall rule with `stall_window`, size and CRC checks, fsync +
    rename) into a hidden sibling of dest named after the URL, then unpacked, synced and moved into
    place, then the zip deleted; a lock on dest makes a second process (another rank) wait and keep
    the first one's bundle. Raises RuntimeError (a DownloadError) after `retries` failed downloads
    and ValueError for a zip that is not an eval bundle, or (before any download) for a dest that
    holds something else (_check_bundle_dest).
    """
    from nanochat.file_lock import file_lock

    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
        raise ValueError(f"retries: got {retries!r}; accepted: an integer >= 1 (tries in a row that get nowhere; 1: one try only)")
    dest = Path(dest) if dest is not None else default_bundle_dir()
    if (dest / "core.yaml").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    said = False

    def on_wait():   # called every 0.1 s while another process holds the lock: say it once
        nonlocal said
        if not said:
            said = True
            print0(f"waiting for another process downloading the eval bundle to {dest}")

    with file_lock(dest, on_wait=on_wait):
        if (dest / "core.yaml").is_file():  # the process we waited for finished it
            return dest
        _check_bundle_dest(dest)   # under the lock: a bundle another process just moved in is not "the user's"
        digest = hashlib.sha256(url.encode()).hexdigest()[:12]  # another URL's zip is never reused
        zpath = dest.with_name(f".{dest.name}-{digest}.zip")
        _fetch_bundle_zip(url, zpath, timeout=timeout, retries=retries, backoff=backoff,
                          stall_window=stall_window, progress=progress)
        try:
            _unpack_bundle(zpath, dest, url)
        except ValueError:   # not a bundle: a rerun must download again, not reuse it
            zpath.unlink(missing_ok=True)
            raise
        zpath.unlink()
    print0(f"eval bundle ready at {dest}")
    return dest


def _check_bundle_dest(dest: Path) -> None:
    """ValueError (before any download) for a dest that is neither absent nor an empty directory:
    the bundle replaces dest as a whole, and this module never leaves a dest without core.yaml (it
    is unpacked aside and moved in at once), so what is there is the user's (NANOCHAT_EVAL_BUNDLE
    set to a folder of their own): deleting it, as an earlier version did, lost their files."""
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        what = "a directory holding files but no core.yaml" if dest.is_dir() else "a file"
        raise ValueError(f"eval bundle dest (NANOCHAT_EVAL_BUNDLE or dest=): {dest} is {what}; accepted: a "
                         "path that does not exist yet or an empty directory (move it away, or pick another)")


def _fetch_bundle_zip(url: str, zpath: Path, *, timeout, retries, backoff, stall_window, progress) -> None:
    from tqdm import tqdm

    from nanochat.dataset_download import DownloadError, download_file

    if zpath.exists():   # verified and renamed by a run that stopped before unpacking it
        try:
            _verify_bundle_zip(zpath)
            return
        except ValueError:
            zpath.unlink()
    partial = zpath.with_name(zpath.name + ".partial")
    print0(f"downloading the eval bundle from {url}")
    bar = tqdm(unit="B", unit_scale=True, initial=partial.stat().st_size if partial.exists() else 0,
               disable=not progress or os.environ.get("RANK", "0") != "0", dynamic_ncols=True)
    try:
        with bar:
            download_file(url, zpath, retries=retries - 1, backoff=backoff, timeout=timeout,
                          stall_window=stall_window, on_bytes=bar.update, verify=_verify_bundle_zip)
    except DownloadError as e:
        if isinstance(e.__cause__, _NotAZip):
            raise ValueError(f"eval bundle from {url} is {e.__cause__}") from e
        raise DownloadError(f"could not download the eval bundle: {e}") from e


def _unpack_bundle(zpath: Path, dest: Path, url: str) -> None:
    """Unzip into a temporary dir next to dest, check it is a bundle, move its root to dest."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".eval_bundle_") as tmp:
        try:
            with zipfile.ZipFile(zpath) as zf:
                _safe_extract(zf, Path(tmp) / "x")
        except zipfile.BadZipFile as e:
            raise ValueError(f"eval bundle from {url} is not a zip file: {e}") from e
        found = sorted(Path(tmp, "x").rglob("core.yaml"), key=lambda p: len(p.parts))
        if not found or not (found[0].parent / "eval_meta_data.csv").is_file():
            raise ValueError(f"eval bundle from {url} lacks core.yaml / eval_meta_data.csv")
        # synced before the move names it, the move before the zip (the one synced copy) goes: after
        # a power cut, a dest with core.yaml counts as done, over files a crash left empty or cut
        _sync_tree(found[0].parent)
        if dest.exists():  # an empty directory (_check_bundle_dest refused anything else)
            dest.rmdir()
        os.replace(found[0].parent, dest)
        fsync_dir(dest.parent)


def _sync_tree(root: Path) -> None:
    """fsync every file and folder under root, and root."""
    for path in [*root.rglob("*"), root]:
        if path.is_dir():
            fsync_dir(path)
        else:
            with open(path, "rb") as f:
                os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Finding and reading the data
# ---------------------------------------------------------------------------------------------

def resolve_sources(*, data_dir=None, bundle_dir=None) -> tuple[list[TaskSource], str]:
    """The bundle when bundle_dir (or the default bundle dir) holds core.yaml, else offline files."""
    bundle = Path(bundle_dir) if bundle_dir is not None else default_bundle_dir()
    if (bundle / "core.yaml").is_file():
        return _bundle_sources(bundle), f"bundle:{bundle}"
    if bundle_dir is not None:
        raise MissingDataError(f"bundle_dir: {bundle} has no core.yaml (run download_eval_bundle())")
    if os.environ.get("NANOCHAT_EVAL_BUNDLE"):   # asked for by name: never fall back to other data silently
        raise MissingDataError(f"NANOCHAT_EVAL_BUNDLE={bundle} has no core.yaml; {_REFETCH}")
    _check_default_bundle_dir(bundle)
    sources, dirs = _offline_sources(data_dir)
    if not sources:
        raise DataUnavailableError(
            f"no CORE data: no DCLM bundle at {bundle} (nanochat.core_eval.download_eval_bundle() fetches "
            f"{EVAL_BUNDLE_URL}) and no offline eval files in {[str(d) for d in dirs]}")
    return sources, "offline:" + ",".join(str(d) for d in dirs)


def _check_default_bundle_dir(bundle: Path) -> None:
    """MissingDataError for a default bundle dir that holds files but no core.yaml: the bundle
    unzipped one level too deep (eval_bundle/eval_bundle/core.yaml) or copied in part. It is the
    user's (download_eval_bundle moves a whole bundle in at once), and falling back to the offline
    files scored a CORE that does not compare with the bundle's with nothing but its label to say so."""
    if not bundle.is_dir() or not any(bundle.iterdir()):
        return
    nested = sorted(bundle.rglob("core.yaml"), key=lambda p: len(p.parts))
    where = f"; its core.yaml is at {nested[0]}: move that folder's contents up to {bundle}" if nested else ""
    raise MissingDataError(f"eval bundle dir {bundle} holds files but no core.yaml{where}; or move the folder "
                           f"aside: then nanochat.core_eval.download_eval_bundle() fetches {EVAL_BUNDLE_URL} into "
                           "it, and without it base_eval scores the offline eval files")


@dataclass
class CoreData:
    """The records of every CORE task that will run, read before any model work."""
    source: str                                   # "bundle:<dir>" or "offline:<dirs>"
    wanted: list[str]                             # the labels asked for (the 22, or `tasks`)
    tasks: list[tuple[CoreTask, list[dict]]]      # those with data, in CORE order


def load_core_data(*, tasks=None, data_dir=None, bundle_dir=None) -> CoreData:
    """Find and read the data of `tasks` (default: all 22) now, so that a missing, malformed or empty
    file stops a run with one line (MissingDataError / DataError naming it) before the model loads;
    a task whose file is absent is left out and reported as missing, but none present at all (a bundle
    without eval_data/) is a MissingDataError: a CORE over zero tasks is NaN, not a score."""
    sources, source = resolve_sources(data_dir=data_dir, bundle_dir=bundle_dir)
    known = {t.label for t, _ in sources} | set(CORE_LABELS)
    wanted = list(CORE_LABELS) if tasks is None else list(tasks)
    bad = [t for t in wanted if t not in known]
    if bad:
        raise ValueError(f"CORE tasks: got {bad}; accepted: {'|'.join(sorted(known))}")
    loaded = []
    for task, load in sources:
        if task.label not in wanted or load is None:
            continue
        loaded.append((task, load()))   # load(): DataError for a malformed or too short file
    if not loaded:   # CORE over zero tasks is NaN, not a score: a bundle without its eval_data/, say
        where = f"{source[len('bundle:'):]}/eval_data" if source.startswith("bundle:") else source
        hint = _REFETCH if source.startswith("bundle:") else "choose tasks that have data"
        raise MissingDataError(f"CORE: none of the tasks {wanted} has a data file in {where}; {hint}")
    return CoreData(source, wanted, loaded)
