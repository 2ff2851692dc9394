"""The training report: stages log sections and per-step metrics; `generate` writes report.md.

Writers (rank 0 only; other ranks get a no-op report):
    get_report().log("Base model training", {"depth": 20, "total_time_s": 3600.0, ...})
    log_metrics("base", {"step": 100, "loss": 3.21, "val_bpb": 0.98, "tok_per_sec": 1.5e5,
                         "peak_mem_gib": 38.4, "elapsed_s": 812.0})

Files under <base_dir>/report/: header.json (system info + start time, by `reset`),
sections/<slug>.json (a section's entries in logging order, {"time", "t", "data"} each; appended
under a lock on sections/<slug>.json.lock: writers at once lose no entry),
metrics_<stage>.jsonl (one JSON object per line; "time" added when absent), plots/*.png and
report.md (by `generate`). `python -m nanochat.report reset` clears the report and starts a new one.

`python -m nanochat.report generate [--hourly-cost USD]` writes: environment (and the commit now, when it
is not the one `reset` recorded); a summary table per stage base/mid/sft/rl (val bpb, each stage's own
final val bpb, CORE, ARC, MMLU, GSM8K, HumanEval, SpellingBee, ChatCORE; tokens trained, average tok/s
and MFU), the stages nothing was logged of named under it; time and cost (tokenizer, training stages and
evaluations); plots (loss and val bpb vs step and wall clock, tok/s, RL's reward, memory); every section
in pipeline order (stage, training before its evaluations, then time), the precision plan's fields
grouped under `precision`.

Summary values are read from section data: a "stage" key (else the stage named in the section title)
and metric keys named as in SUMMARY_ROWS (e.g. "CORE metric" or "core_metric", "ARC-Easy"); the
latest entry wins (a training run's own rows, tokens to MFU and own val bpb: its latest run's entry
only, "-" where that run has none). A value logged before the latest training run of its stage (or
of an earlier stage: a section with "final_step") is marked "(stale)"; one of a subset of the tasks
or of their problems ("<row> complete": false: a CORE/ChatCORE without every task, a chat_eval
--max-problems or base_eval --max-per-task run) "(partial)", and it does not replace a complete,
current one; a generative task scored as pass@k over k samples ("<row> scored as": "pass@k")
"(pass@k)", from one answer sampled at --temperature t "(sampled, T=t)", from an entry naming no
temperature "(temperature unknown)" (not taken for greedy); none of these replaces a current greedy
score of the same checkpoint (model tag and step), and the one kept out is named under the table
(report_md._keeps_greedy says why greedy first). Under the table, each stage's values name the section entry (model tag, step, time) they
come from. Memory is shown in GiB (2^30 bytes) throughout, as the training log line prints it. Plots
and the time table show each stage's current run (of the latest row's model tag): rows of an earlier
run of the stage, of another tag, or of steps a resumed run redid, are left out (and counted); a
stage's run or an evaluation logged before the latest training run of an earlier stage (an
evaluation: or of its own) is "(stale)" there, as in the summary, and left out of the total.
A stage whose latest metrics run logged no training section after it is marked "(unfinished)";
RL's mean reward per step is summarised (a run rewarded 0 at every step said nothing of it).
A section or header file that is not the JSON we write is a RequestError naming it (the CLI prints
one line, exit 2); metrics lines that are not JSON objects (a torn write) are skipped and counted in
report.md. Without matplotlib report.md is written without plots and says why. The plots, and the
metric keys they read, are nanochat/report_plots.py's (their names resolve here too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
import unicodedata
from datetime import datetime
from pathlib import Path

from nanochat.common import get_base_dir
from nanochat.errors import RequestError
from nanochat.file_lock import file_lock
from nanochat.flags import FlagParser
from nanochat.report_env import environment_lines, git_info, system_info  # noqa: F401 (git_info: report's interface)
from nanochat.report_md import (NOTES, STAGES, _aside_lines, _entries_md, _entry_time, _hms, _is_stale, _keeps_greedy,
                                _md_cell, _md_line, _missing_stage_lines, _note_key, _num, _run_notes, _source,
                                _source_lines, _stage_of, _stage_rank, _stale_runs, _trained_at, _unfinished_runs,
                                _value_notes)
from nanochat.report_plots import (METRIC_KEYS, METRIC_SCALED, PLOTS, _get, _series,  # noqa: F401 (re-exported)
                                   make_plots)

SUMMARY_ROWS: dict[str, tuple[str, ...]] = {
    # base_eval's bpb on the pretraining val split (of any stage's checkpoint: comparable); training
    # sections' own last val bpb (mid/SFT on their conversation mixtures: not comparable)
    "val bpb": ("val_bpb",), "val bpb (own data)": ("final_val_bpb",),
    "CORE": ("CORE", "CORE metric", "core_metric"),
    "ARC-Easy": ("ARC-Easy",), "ARC-Challenge": ("ARC-Challenge",), "MMLU": ("MMLU",),
    "GSM8K": ("GSM8K",), "HumanEval": ("HumanEval",), "SpellingBee": ("SpellingBee",),
    "ChatCORE": ("ChatCORE", "ChatCORE metric", "chatcore_metric"),
    # the training run (log_stage_report): what it cost, next to what it scored
    "tokens trained": ("tokens_trained",), "tok/s (average)": ("avg_tok_per_sec",),
    "MFU % (bf16 peak)": ("avg_mfu",),
}
# the rows a training run's own section gives (log_stage_report): of no other run than the stage's latest
RUN_ROWS = ("val bpb (own data)", "tokens trained", "tok/s (average)", "MFU % (bf16 peak)")
MFU_ROW = "MFU % (bf16 peak)"
MFU_NA_NOTE = ("- MFU n/a: the run's device had no peak FLOP/s to divide by (a CPU, or a GPU the device table "
               "lacks: base_train's --peak-flops gives one)")
# how a summary row's values print (default: 4 decimals, the scores')
ROW_FORMATS = {"tokens trained": "{:,.0f}", "tok/s (average)": "{:,.0f}", "MFU % (bf16 peak)": "{:.1f}"}
_STAGE_RE = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


def report_dir(base_dir=None) -> Path:
    """<base_dir>/report; without base_dir $NANOCHAT_REPORT_DIR when set (scripts.compare_recipes: its
    A/B runs of base_train must not become the pipeline's base stage in report.md)."""
    if base_dir is None and os.environ.get("NANOCHAT_REPORT_DIR"):
        return Path(os.environ["NANOCHAT_REPORT_DIR"])
    return Path(base_dir or get_base_dir()) / "report"


def _is_master() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def jsonable(value):
    """Plain Python / JSON types (tensors and numpy scalars via .item(), paths and the rest via
    str): also what a checkpoint's loop state may hold (weights_only loads refuse numpy)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or type(value) in (bool, int, float, str):   # type(): numpy's float64 is a float
        return value
    if hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, RuntimeError):
            pass
    return str(value)


def log_metrics(stage: str, metrics: dict, *, base_dir=None) -> None:
    """Append one line to <base_dir>/report/metrics_<stage>.jsonl (rank 0 only; cheap: one write).

    Keys the plots read: step, loss, val_bpb, tok_per_sec, peak_mem_gib (GiB; memory_gb in GB is
    converted), elapsed_s (wall-clock seconds since the stage started; "time" is the epoch time,
    added when absent). Other keys are kept.
    """
    if not isinstance(stage, str) or not _STAGE_RE.match(stage):
        raise ValueError(f"stage: got {stage!r}; accepted: lowercase letters/digits/_/- (e.g. base|mid|sft|rl)")
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics: got {type(metrics).__name__}; accepted: a dict")
    if not _is_master():
        return
    row = jsonable(metrics)
    row.setdefault("time", time.time())
    path = report_dir(base_dir) / f"metrics_{stage}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_metrics(base_dir=None, bad: dict[str, int] | None = None, *, directory=None) -> dict[str, list[dict]]:
    """stage -> rows of every metrics_<stage>.jsonl, in pipeline order (by file name, rl came before
    sft in the time table and the plots' legends); lines that are not JSON objects (a torn write)
    skipped and counted in `bad` (file name -> lines), which report.md names: they were dropped silently."""
    out = {}
    paths = Path(directory or report_dir(base_dir)).glob("metrics_*.jsonl")
    for path in sorted(paths, key=lambda p: (_stage_rank(p.stem[len("metrics_"):]), p.name)):
        rows, skipped = [], 0
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                skipped += bool(line.strip())
        out[path.stem[len("metrics_"):]] = rows
        if skipped and bad is not None:
            bad[path.name] = skipped
    return out


def _step_of(row: dict) -> float | None:
    step = row.get("step")
    return float(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def current_run(rows: list[dict]) -> tuple[list[dict], int]:
    """(the rows of a stage's latest run, how many earlier rows were left out). metrics_<stage>.jsonl
    is appended to by every run of the stage: a row whose step is below an earlier row's starts a
    new run (a fresh rerun, or a resume from an earlier checkpoint), which supersedes the rows past
    its first step, and a row re-logged for a step (training or evaluation) replaces the older one.
    Otherwise a rerun's curve is drawn on top of the old one and the time table takes the old
    run's last step and wall clock. Linear in the rows (a run logs one per step: filtering every
    kept row at each new one took ~90 s for a 20k-step run).

    Every --model-tag of a stage appends to the same file: the latest run is of the last row's
    "model_tag" (rows of older files have none: kept), and rows of other tags are left out. By steps
    alone, a resume of tag a after a run of tag b drew b's first steps joined to a's later ones."""
    tag = next((r["model_tag"] for r in reversed(rows) if r.get("model_tag") is not None), None)
    keep = [tag is None or row.get("model_tag") in (None, tag) for row in rows]
    # (step, train row?, index) of the kept rows that have a step, in file order: their steps never
    # decrease (each row drops the kept ones past its step), so those are on top, and at most one
    # training and one evaluation row share the top step
    stack: list[tuple[float, bool, int]] = []
    for i, row in enumerate(rows):
        step = _step_of(row)
        if step is None or not keep[i]:
            continue
        train = _get(row, "loss") is not None
        while stack and stack[-1][0] > step:
            keep[stack.pop()[2]] = False
        for j in range(len(stack) - 1, max(len(stack) - 3, -1), -1):
            if stack[j][0] == step and stack[j][1] == train:
                keep[stack.pop(j)[2]] = False
                break
        stack.append((step, train, i))
    kept = [row for row, k in zip(rows, keep) if k]
    return kept, len(rows) - len(kept)


def _slug(section: str) -> str:
    """The section's file name: its letters and digits, lowercased, runs of anything else one "-".
    Any script's letters count ([\\W_]: ASCII titles slug as before): "[^a-z0-9]" refused a Chinese
    title ("accepted: a title with letters") and cut "Évaluation" to "valuation"."""
    slug = re.sub(r"[\W_]+", "-", unicodedata.normalize("NFC", section).lower()).strip("-")
    if not slug:
        raise ValueError(f"section: got {section!r}; accepted: a title with letters or digits")
    return slug


def _write_bytes(path: Path, data: bytes) -> None:
    """Atomic (temp file + os.replace, a per-process temp name): a crash or a concurrent writer
    never leaves a torn file, which the next `generate` would refuse as corrupt."""
    from nanochat.checkpoint_io import atomic_write
    atomic_write(path, lambda f: f.write(data))


def _write_text(path: Path, text: str) -> None:
    _write_bytes(path, text.encode("utf-8"))


def _read_json(path: Path, what: str, valid) -> dict:
    """A report file we wrote, parsed; RequestError naming it when it is not (valid(doc) is False)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        doc, why = None, f"not valid JSON ({e})"
    else:
        why = f"not a report {what}"
    if doc is None or not valid(doc):
        raise RequestError(f"{path}: corrupt report {what} ({why}); delete it or run "
                           "`python -m nanochat.report reset`")
    return doc


def _valid_section(doc) -> bool:
    return (isinstance(doc, dict) and isinstance(doc.get("section"), str) and isinstance(doc.get("entries"), list)
            and all(isinstance(e, dict) and "data" in e and "time" in e for e in doc["entries"]))


def _valid_header(doc) -> bool:
    return isinstance(doc, dict) and isinstance(doc.get("system"), dict)


class Report:
    """Sections + metrics in <base_dir>/report; see the module docstring."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)

    def log(self, section: str, data) -> Path:
        """Append an entry (dict, list of dicts or text) to a section; returns the section file."""
        path = self.dir / "sections" / f"{_slug(section)}.json"
        self._mkdir(path.parent)
        entry = {"time": datetime.now().isoformat(timespec="seconds"), "t": time.time(), "data": jsonable(data)}
        # read, append, replace under the section's lock: two processes logging to one section at
        # once (evaluations run side by side) each replaced the file with their own entry added to
        # what they had read, and one entry was lost (51 of 90 from three writers)
        with file_lock(path):
            doc = _read_json(path, "section", _valid_section) if path.is_file() else {"section": section, "entries": []}
            doc["entries"].append(entry)
            _write_text(path, json.dumps(doc, indent=1))
        return path

    @staticmethod
    def _mkdir(path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise RequestError(f"{path}: exists and is not a directory; move it away (the report lives "
                               "there) or point NANOCHAT_BASE_DIR (python -m nanochat.report: --base-dir) "
                               "elsewhere") from None

    def reset(self) -> None:
        """Delete sections, metrics, plots and report.md; record system info and the start time."""
        for sub in ("sections", "plots"):
            shutil.rmtree(self.dir / sub, ignore_errors=True)
        for path in [*self.dir.glob("metrics_*.jsonl"), self.dir / "report.md"]:
            path.unlink(missing_ok=True)
        self._mkdir(self.dir)
        header = {"start_time": time.time(), "start": datetime.now().isoformat(timespec="seconds"),
                  "system": system_info()}
        _write_text(self.dir / "header.json", json.dumps(header, indent=1))

    def is_empty(self) -> bool:
        """Nothing logged: no section and no metrics file (a mistyped base dir, which get_base_dir creates)."""
        return not any((self.dir / "sections").glob("*.json")) and not any(self.dir.glob("metrics_*.jsonl"))

    def sections(self) -> list[dict]:
        """Every section in pipeline order (see _section_key)."""
        docs = [_read_json(p, "section", _valid_section) for p in sorted((self.dir / "sections").glob("*.json"))]
        return sorted(docs, key=_section_key)

    def summary(self) -> dict[str, dict[str, float]]:
        """metric -> stage -> value (the latest entry wins). Evaluations of quantised weights
        (`weights` in their data: base_eval / chat_eval --quantize) are the model served, not the
        model trained: they keep their sections and stay out of the summary."""
        return {row: {stage: value for stage, (value, _) in cells.items()}
                for row, cells in self.summary_cells().items()}

    def summary_cells(self) -> dict[str, dict[str, tuple[float, list[str]]]]:
        """metric -> stage -> (value, notes): the summary with what the reader must know about each
        value: "stale" (logged before the latest training run of its stage or an earlier one: it
        may describe an older model), "partial" (of a subset of the tasks or of their problems),
        "pass@k" (the best of k sampled answers), "sampled, T=t" (one answer sampled at temperature
        t) and "temperature unknown" (greedy or sampled: not said), see _value_notes."""
        return {row: {stage: cell[:2] for stage, cell in cells.items()}
                for row, cells in self._summary_table().items()}

    def _summary_table(self, aside: dict | None = None, sections: list[dict] | None = None,
                       used: set[int] | None = None) -> dict[str, dict[str, tuple[float, list[str], tuple]]]:
        """summary_cells with each value's source (section, checkpoint: model tag and step, entry time); `aside` gets
        (row, stage) -> the sampled values a greedy one of their checkpoint kept out; `used` the shown values' entries' id()."""
        entries = []   # (time, order, stage, data): every entry of every section, oldest first
        for doc in self.sections() if sections is None else sections:
            for entry in doc["entries"]:
                data = entry["data"]
                stage = _stage_of(doc["section"], data) if isinstance(data, dict) else None
                if stage is not None:
                    entries.append((_entry_time(entry), len(entries), stage, data, _source(doc["section"], entry), id(entry)))
        entries.sort(key=lambda e: e[:2])
        trained, latest = {}, {}   # stage -> time / order of its latest training entry (log_stage_report's)
        for t, order, stage, data, *_ in entries:
            if "final_step" in data:
                trained[stage], latest[stage] = t, order
        table: dict[str, dict[str, tuple[float, list[str], tuple]]] = {row: {} for row in SUMMARY_ROWS}
        shown_from: dict[tuple[str, str], int] = {}   # (row, stage) -> id() of the entry its value is from
        for t, order, stage, data, source, entry_id in entries:
            if data.get("weights", "none") != "none":
                continue
            upstream = [trained[s] for s in STAGES[:STAGES.index(stage) + 1] if s in trained]
            for row, keys in SUMMARY_ROWS.items():
                # a run's own figures come from the stage's latest run only: a rerun that timed no step
                # (< 11 steps in a process) showed the old run's tok/s "(stale)" next to its own tokens
                if row in RUN_ROWS and "final_step" in data and order != latest[stage]:
                    continue
                for key in keys:
                    if isinstance(data.get(key), (int, float)) and not isinstance(data.get(key), bool):
                        notes = (["stale"] if any(t < tt for tt in upstream) else []) + _value_notes(row, data)
                        # a partial score (one task, or a few problems, evaluated again) keeps a
                        # complete, current one
                        old = table[row].get(stage)
                        if "stale" not in notes and old is not None and "stale" not in old[1]:
                            if "partial" in notes and "partial" not in old[1]:
                                continue
                            # a sampled score keeps a greedy, current one of its checkpoint (named under the table)
                            if _keeps_greedy(notes, source, old):
                                if aside is not None:
                                    aside.setdefault((row, stage), []).append((float(data[key]), notes, source))
                                continue
                        if aside is not None:   # the notes were of the value replaced
                            aside.pop((row, stage), None)
                        table[row][stage] = (float(data[key]), notes, source)
                        shown_from[(row, stage)] = entry_id
        (used if used is not None else set()).update(shown_from.values())
        return table

    def generate(self, *, hourly_cost: float | None = None) -> Path:
        """Write plots and report.md; returns the report path."""
        if hourly_cost is not None and not (_num(hourly_cost) and hourly_cost >= 0):   # a NaN printed "$nan/h"
            raise ValueError(f"--hourly-cost: got {hourly_cost}; accepted: a number >= 0 (USD per hour)")
        self._mkdir(self.dir)
        header_path = self.dir / "header.json"
        header = _read_json(header_path, "header", _valid_header) if header_path.is_file() else {"system": system_info()}
        bad: dict[str, int] = {}
        runs = {stage: current_run(rows) for stage, rows in read_metrics(bad=bad, directory=self.dir).items()}
        metrics = {stage: rows for stage, (rows, _) in runs.items()}
        superseded = {stage: n for stage, (_, n) in runs.items() if n}
        sections = self.sections()
        stale = _stale_runs(metrics, sections)   # drawn, but not as the stage's current model
        try:
            plots = make_plots({f"{k} (stale)" if k in stale else k: v for k, v in metrics.items()},
                               self.dir / "plots") if metrics else []
        except ImportError as e:   # a report without plots, not a traceback after the whole pipeline
            plots = f"_No plots: matplotlib could not be imported ({e}); `uv pip install matplotlib`, then rerun " \
                    "`python -m nanochat.report generate`._"
        lines = ["# nanochat-spark report", "", f"Generated {datetime.now().isoformat(timespec='seconds')}"
                 + (f"; run started {header['start']}" if "start" in header else ""), "", "## Environment", ""]
        if self.is_empty():
            lines += [f"_Nothing has been logged in {self.dir}: no stage wrote a section or metrics there. If "
                      "the stages ran, they wrote to another base dir: rerun with its --base-dir "
                      "(or NANOCHAT_BASE_DIR)._", ""]
        if "start" not in header:
            lines += ["_Recorded by `generate`: no `python -m nanochat.report reset` started this run._", ""]
        lines += environment_lines(header["system"], recorded="start" in header)
        unfinished = _unfinished_runs(metrics, sections)
        used: set[int] = set()   # the entries the summary's values come from: the time table counts them too
        lines += self._summary_lines(sections, used) + _missing_stage_lines(metrics, sections)
        lines += _time_and_cost(metrics, sections, header, hourly_cost, unfinished, used)
        lines += _run_notes(metrics, superseded, unfinished, bad)
        if isinstance(plots, str):
            lines += ["## Plots", "", plots, ""]
        elif plots:
            lines += ["## Plots", ""] + [f"![{title}](plots/{path.name})" for title, path in plots] + [""]
        for doc in sections:
            lines += [f"## {_md_line(doc['section'])}", "", *_entries_md(doc["entries"])]
        path = self.dir / "report.md"
        _write_text(path, "\n".join(lines) + "\n")
        return path

    def _summary_lines(self, sections: list[dict] | None = None, used: set[int] | None = None) -> list[str]:
        """The summary table, each value with its notes ("0.3100 (stale)"), and what they mean."""
        lines = ["", "## Summary", "", "| Metric | " + " | ".join(s.upper() for s in STAGES) + " |",
                 "|---|" + "---|" * len(STAGES)]
        noted = set()   # what the notes under the table explain: a row (its data) or a value's note
        aside: dict[tuple[str, str], list[tuple]] = {}
        table = self._summary_table(aside, sections, used)
        no_peak = self._runs_without_mfu()
        for row, cells in table.items():
            fmt = ROW_FORMATS.get(row, "{:.4f}")
            # _md_cell: a note is the entry's own text ("<row> scored as"), a "|" in it split the row
            shown = ["-" if s not in cells else _md_cell(" ".join([fmt.format(cells[s][0]),
                                                                   *(f"({n})" for n in cells[s][1])])) for s in STAGES]
            if row == MFU_ROW and no_peak:   # a CPU run's MFU read "-", as if the stage had not run
                shown = ["n/a" if s in no_peak and s not in cells else cell for s, cell in zip(STAGES, shown)]
                noted.add("mfu n/a")
            noted.update([_note_key(n) for _, notes, _ in cells.values() for n in notes]
                         + ([row] if cells and row in NOTES else []))
            lines.append(f"| {row} | " + " | ".join(shown) + " |")
        noted.update(_note_key(n) for values in aside.values() for _, notes, _ in values for n in notes)
        return lines + [""] + _source_lines(table) + _aside_lines(aside) + [NOTES[n] for n in NOTES if n in noted] + \
            ([MFU_NA_NOTE] if "mfu n/a" in noted else []) + ([""] if noted else [])

    def _runs_without_mfu(self) -> set[str]:
        """Stages whose latest training run logged its MFU as None: the device had no peak FLOP/s (a
        CPU, or a GPU the device table lacks and no --peak-flops)."""
        latest: dict[str, tuple[float, dict]] = {}
        for doc in self.sections():
            for entry in doc["entries"]:
                data = entry["data"]
                if isinstance(data, dict) and "final_step" in data:
                    stage = _stage_of(doc["section"], data)
                    if stage is not None and _entry_time(entry) >= latest.get(stage, (-math.inf, None))[0]:
                        latest[stage] = (_entry_time(entry), data)
        return {stage for stage, (_, data) in latest.items() if "avg_mfu" in data and data["avg_mfu"] is None}


def _section_key(doc: dict) -> tuple:
    """Pipeline order: stage (sections of none first: tokenizer), a stage's training before its
    evaluations, then first-entry time (time alone put a chat_eval of mid run late after SFT)."""
    entries = doc["entries"]
    first = entries[0]["data"] if entries and isinstance(entries[0]["data"], dict) else {}
    stage = _stage_of(doc["section"], first)
    trained = any(isinstance(e["data"], dict) and "final_step" in e["data"] for e in entries)
    return (-1 if stage is None else _stage_rank(stage), not trained,
            _entry_time(entries[0]) if entries else 0.0, doc["section"])


def _time_rows(metrics: dict[str, list[dict]], sections: list[dict],
               used: set[int] | None = None) -> list[tuple[str, str, float | None, bool]]:
    """(label, steps, seconds or None: not logged, stale): the tokenizer's training, then each stage's
    current run and its evaluations (_eval_time; base_eval logs "seconds"): without them the cost fell short."""
    rows, trained, stale = [], _trained_at(sections), _stale_runs(metrics, sections)
    for stage, stage_rows in metrics.items():
        xs, _ = _series(stage_rows, "step", "elapsed_s")
        # steps done: a training row's step is the one it trained (0-based), an evaluation's the count
        steps = max((r["step"] + (_get(r, "loss") is not None) for r in stage_rows if _num(r.get("step"))), default=0)
        rows.append(((_stage_rank(stage), 0), stage, str(steps), max(xs) if xs else 0.0, stage in stale))
    for doc in sections:
        data = doc["entries"][-1]["data"] if doc["entries"] else None
        stage = _stage_of(doc["section"], data) if isinstance(data, dict) else None
        if stage is None and isinstance(data, dict) and _num(data.get("train_time_s")):
            # tok_train's section (no stage, before them all): its time was shown there but left out
            # of this table's total and the cost estimate
            rows.append(((-1, 0), doc["section"], "", float(data["train_time_s"]), False))
        elif stage is not None and "final_step" not in data \
                and ("seconds" in data or "evaluation" in doc["section"].lower()):
            seconds, runs, is_stale = _eval_time(doc, stage, trained, used or set())
            rows.append(((_stage_rank(stage), 1), doc["section"] + f" ({runs} runs)" * (runs > 1), "", seconds, is_stale))
    return [r[1:] for r in sorted(rows, key=lambda r: r[0])]   # stable: sections are in pipeline order


def _eval_time(doc: dict, stage: str, trained: dict[str, float], used: set[int]) -> tuple[float | None, int, bool]:
    """(seconds or None: not logged, entries counted, stale) of an evaluation section: its latest entry's and each
    earlier one's a summary value comes from (`used`; a rerun's replaced the values: not counted twice). The latest
    alone hid chat_eval run a task at a time (-a ARC-Easy, then -a GSM8K) from the total and the cost."""
    stale = _is_stale(_entry_time(doc["entries"][-1]), stage, trained, own=True)
    counted = [e for e in doc["entries"][:-1] if id(e) in used and "final_step" not in e["data"]
               and _is_stale(_entry_time(e), stage, trained, own=True) == stale] + doc["entries"][-1:]
    times = [float(e["data"]["seconds"]) for e in counted if _num(e["data"].get("seconds"))]   # NaN/inf: not a time
    return (sum(times) if times else None), len(counted), stale


def _run_span(metrics: dict[str, list[dict]], sections: list[dict], header: dict) -> tuple[float, str] | None:
    """(seconds, since what): from `reset` (else the first stage's start: its first metrics row's time
    less elapsed_s) to the last logged entry (not to `generate`: that grew while nobody ran it)."""
    ends = [t for d in sections for t in map(_entry_time, d["entries"]) if t > 0]
    ends += [r["time"] for rows in metrics.values() for r in rows if _num(r.get("time"))]
    starts = [r["time"] - (elapsed if _num(elapsed := _get(r, "elapsed_s")) else 0.0)
              for rows in metrics.values() for r in rows[:1] if _num(r.get("time"))]
    if _num(header.get("start_time")):
        return (max(ends) - header["start_time"], "`reset`") if ends else None
    return (max(ends) - min(starts), "the first training stage's start") if ends and starts else None


def _time_and_cost(metrics: dict[str, list[dict]], sections: list[dict], header: dict,
                   hourly_cost: float | None, unfinished: dict[str, str] | None = None,
                   used: set[int] | None = None) -> list[str]:
    rows, span = _time_rows(metrics, sections, used), _run_span(metrics, sections, header)
    total = sum(seconds for _, _, seconds, stale in rows if seconds is not None and not stale)
    mark = {stage: f"{stage} (unfinished)" for stage in unfinished or {}}
    label_of = {label: _md_cell(mark.get(label, label)) + (" (stale)" if stale else "")
                for label, _, _, stale in rows}
    lines = ["## Time and cost", "", "| Stage | steps | wall clock |", "|---|---|---|",
             *(f"| {label_of[label]} | {steps} | {'not logged' if s is None else _hms(s)} |"
               for label, steps, s, _ in rows),
             f"| total | | {_hms(total)} |", ""]
    untimed = [label_of[label] for label, _, seconds, stale in rows if seconds is None and not stale]
    if untimed:
        lines.append(f"- not in the total (their time was not logged): {', '.join(untimed)}")
    stale = [label_of[label] for label, _, _, stale in rows if stale]
    if stale:
        lines.append(f"- not in the total: {', '.join(stale)}: run before the latest training run of an earlier "
                     "stage (an evaluation: or of its own), so of an older model; rerun them")
    if span is not None:
        lines.append(f"- wall clock of the whole run, from {span[1]} to the last logged entry: {_hms(span[0])} "
                     "(with start-up, compilation and the gaps between stages)")
    if hourly_cost is not None:
        whole = f", ${span[0] / 3600 * hourly_cost:.2f} for the whole run" if span is not None else ""
        lines.append(f"- estimated cost at ${hourly_cost:.2f}/h: ${total / 3600 * hourly_cost:.2f} for the "
                     f"table's total{whole}")
    else:   # the heading promised a cost and the table gave none, without saying how to get one
        lines.append("- cost: not estimated; `python -m nanochat.report generate --hourly-cost USD` (or "
                     "NANOCHAT_HOURLY_COST=USD) prices the table's total and the whole run")
    return lines + [""]


class DummyReport:
    """What non-master ranks get: log, reset and generate are no-ops."""

    def log(self, *args, **kwargs):
        return None

    reset = generate = log


def get_report(base_dir=None) -> Report | DummyReport:
    return Report(report_dir(base_dir)) if _is_master() else DummyReport()


def parse_args(argv=None) -> argparse.Namespace:
    parser = FlagParser(prog="python -m nanochat.report", description="training report")
    parser.add_argument("command", choices=("generate", "reset"))
    parser.add_argument("--base-dir", default=None, help="default: $NANOCHAT_BASE_DIR")
    parser.add_argument("--hourly-cost", default=None,
                        help="USD per hour of the machine, for the cost estimate (default: $NANOCHAT_HOURLY_COST)")
    args = parser.parse_args(argv)
    if args.base_dir is not None:   # `--base-dir=~/nc`: no shell expands a ~ after "="
        args.base_dir = os.path.expanduser(args.base_dir)
        # generate reads what the stages logged there: a typo wrote an empty report into a new folder
        if args.command == "generate" and not Path(args.base_dir).is_dir():
            raise RequestError(f"--base-dir: {args.base_dir} does not exist; accepted: the base dir the stages "
                               "wrote to (their NANOCHAT_BASE_DIR)")
    flag, value = ("--hourly-cost", args.hourly_cost) if args.hourly_cost is not None else \
        ("NANOCHAT_HOURLY_COST", os.environ.get("NANOCHAT_HOURLY_COST") or None)
    if value is not None:   # checked with the flags: a traceback after the plots, or "$nan/h", otherwise
        try:
            args.hourly_cost = float(value)
        except ValueError:
            args.hourly_cost = math.nan
        if not (math.isfinite(args.hourly_cost) and args.hourly_cost >= 0):
            raise RequestError(f"{flag}: got {value!r}; accepted: a number >= 0 (USD per hour)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    report = Report(report_dir(args.base_dir))
    if args.command == "reset":
        report.reset()
        print(f"report reset: {report.dir}")
    else:
        print(f"report written: {report.generate(hourly_cost=args.hourly_cost)}")
        if report.is_empty():   # "report written" alone read as a finished, empty run
            print(f"WARNING: nothing has been logged in {report.dir}: if the stages ran, they wrote to another "
                  "base dir; pass it as --base-dir (or set NANOCHAT_BASE_DIR)", file=sys.stderr)


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("report", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
