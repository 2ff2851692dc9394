"""Markdown rendering of the report's section entries (nanochat/report.py owns the files, the
summary and the time table): values formatted for reading, nested data as lists, multi-line samples
fenced, the precision plan's fields grouped under `precision`, the runs of a stage labelled, and the
notes a summary value carries ("(partial)", "(pass@k)", "(sampled, T=t)", "(temperature unknown)") with
what they mean, the section entry it comes from and which of a checkpoint's greedy and sampled scores
it shows; and what a section and a metrics run belong to (stage, entry time, a run left without its
section or older than an earlier stage's latest training run, RL's rewards, a stage nothing was logged of)."""

from __future__ import annotations

import math
import re
from collections import namedtuple
from datetime import datetime


def _fmt(value) -> str:
    """A value as shown: floats to 4 decimals less trailing zeros (15.0, 0.02, 1.7602: "15.0000" and,
    for a small learning rate, "0.0000" said nothing), 3 digits below 0.01, separators from 10,000."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return str(value)
    if abs(value) >= 1e4:
        return f"{value:,.0f}" if isinstance(value, float) else f"{value:,}"
    if isinstance(value, int) or value == 0:
        return str(value)
    if abs(value) < 0.01:
        return f"{value:.3g}"
    text = f"{value:.4f}".rstrip("0")
    return text + "0" if text.endswith(".") else text


def _md_line(text) -> str:
    """A title on one line: a heading or a list item ended at its first line break (a title "a", line
    break, "b": the "b" became a paragraph of the section above)."""
    return " ".join(str(text).split())


def _md_cell(text) -> str:
    """A table cell: one line, its "|" escaped ("Eval a|b" split the time table's row into four cells)."""
    return _md_line(text).replace("|", "\\|")


def _inline(value) -> str:
    """A value inside a sentence: one line, its backticks escaped (a run name "a`b" opened a code span
    that swallowed the next changed flag's name)."""
    return _md_line(_fmt(value)).replace("`", "\\`")


def _multiline(value) -> bool:
    return isinstance(value, str) and ("\n" in value or "\r" in value)


_Head = namedtuple("_Head", "value items")   # an item with a value and items under it: `- precision: bf16`


def _md_item(pad: str, head: str, value, fence: bool = False) -> list[str]:
    """One list item `- head value`. A multi-line string (a generated sample; or any string with
    fence=True: a list of samples looks alike) becomes a fenced block inside the item: its lines as
    written, where raw they would be joined into one paragraph or end the list ("# ..." a heading,
    "---" a rule, "| a |" a table)."""
    if not (_multiline(value) or (fence and isinstance(value, str))):
        return [f"{pad}- {head}{_fmt(value)}"]
    fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", value)), default=0))
    inner = pad + "  "
    lines = value.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    opening = [f"{pad}- {head.rstrip()}", f"{inner}{fence}text"] if head else [f"{pad}- {fence}text"]
    return opening + [f"{inner}{line}" if line else "" for line in lines] + [f"{inner}{fence}"]


def _md_data(data, indent: int = 0) -> list[str]:
    pad, lines = "  " * indent, []
    if isinstance(data, dict):
        for k, v in data.items():
            if isinstance(v, _Head):
                lines += _md_item(pad, f"{k}: ", v.value) + _md_data(v.items, indent + 1)
            elif isinstance(v, (dict, list)) and v:
                lines += [f"{pad}- {k}:", *_md_data(v, indent + 1)]
            else:
                lines += _md_item(pad, f"{k}: ", v)
        return lines
    if not isinstance(data, list):   # a text entry: raw, its "# ..." line was a heading of report.md
        # fenced when it could read as markdown ("- # x" is still a heading inside the list item)
        return _md_item(pad, "", data, fence=isinstance(data, str) and bool(re.match(r"\s*[#>|=*+-]|\s*\d+[.)]", data)))
    fence = any(_multiline(v) for v in data)   # one sample fenced, the next one not, looked broken
    for i, v in enumerate(data):
        if isinstance(v, dict) and v and not any(isinstance(x, (dict, list)) or _multiline(x) for x in v.values()):
            lines.append(f"{pad}- " + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()))   # keys ran together
        elif isinstance(v, (dict, list)) and v:
            lines += [f"{pad}- [{i}]:", *_md_data(v, indent + 1)]
        else:
            lines += _md_item(pad, "", v, fence)
    return lines


# PrecisionPlan.describe() keys (+ apply_precision's), logged flat in a training section
PRECISION_KEYS = ("backend", "recipe", "converted", "kept_high_precision", "peak_key", "startup_rel_err",
                  "fp8_wgrad", "chosen")


def _present(data):
    """A training entry as shown: the precision plan's fields (flat in the data: checkpoints and tests
    read them there) under `precision: <p> (backend <b>)`, so its recipe is not taken for config's
    optimizer recipe ("recipe: {}" sat next to "recipe: v2"); empty ones, nothing converted with no
    backend, and a peak_key that is the precision itself are left out."""
    if not (isinstance(data, dict) and "final_step" in data and isinstance(data.get("precision"), str)
            and "backend" in data and "peak_key" in data):
        return data
    details = {k: data[k] for k in PRECISION_KEYS[1:] if k in data and data[k] not in ({}, [], None, "")}
    if isinstance(details.get("recipe"), dict):
        details["recipe"] = ", ".join(f"{k}={_fmt(v)}" for k, v in details["recipe"].items())
    if data["backend"] == "none" and data.get("converted") == 0:
        details.pop("converted")
    if data["peak_key"] == data["precision"]:
        details.pop("peak_key")
    return {k: _Head(f"{v} (backend {data['backend']})", details) if k == "precision" else v
            for k, v in data.items() if k not in PRECISION_KEYS}


def _entries_md(entries: list[dict]) -> list[str]:
    """A section's entries, oldest first; runs of a training stage say which one the summary, plots
    and time table describe (the latest) and what flags changed (two full entries looked alike)."""
    runs = [i for i, e in enumerate(entries) if isinstance(e["data"], dict) and "final_step" in e["data"]]
    lines = []
    for i, entry in enumerate(entries):
        lines += [f"_{entry['time']}_", ""]
        if len(runs) > 1 and i in runs[:-1]:
            lines += [f"Run {runs.index(i) + 1} of {len(runs)} of this stage: superseded by the latest below "
                      "(the summary, plots and time table describe that one).", ""]
        elif len(runs) > 1 and i == runs[-1]:
            old, new = entries[runs[-2]]["data"].get("config"), entry["data"].get("config")
            changes = "unknown (no config logged)" if not (isinstance(old, dict) and isinstance(new, dict)) else \
                ", ".join(f"`{k}` {_inline(old.get(k, 'unset'))} -> {_inline(new.get(k, 'unset'))}"
                          for k in {**old, **new} if old.get(k, "unset") != new.get(k, "unset")) or "none"
            lines += [f"Run {len(runs)} of {len(runs)} of this stage (the latest); flags changed since run "
                      f"{len(runs) - 1}: {changes}.", ""]
        lines += [*_md_data(_present(entry["data"])), ""]
    return lines


def _hms(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


# ---------------------------------------------------------------- the summary's value notes

NOTES = {
    "val bpb": "- val bpb: base_eval's bits per byte on the pretraining validation text, comparable across stages",
    "val bpb (own data)": "- val bpb (own data): each training stage's last validation, on its own data (base: "
                         "pretraining text; mid: held-out conversations of its mixture; SFT: the assistant tokens of "
                         "held-out conversations), so not comparable across stages or with the row above",
    "tokens trained": "- tokens trained: optimizer steps x tokens per step (mid/SFT: row positions, padding "
                      "included); tok/s and MFU: the average over the timed steps (the first 10 of each process "
                      "left out), MFU against the GPU's dense bf16 peak",
    "stale": "- (stale): logged before the latest training run of this stage or an earlier one, so it may "
             "describe an older model: rerun the evaluation",
    "partial": "- (partial): computed from a subset of the tasks or of their problems (chat_eval --max-problems, "
               "base_eval --max-per-task), not comparable with a complete score",
    "pass@k": "- (pass@k): a generative task counted as solved when any of k sampled answers is right (chat_eval "
              "--num-samples k), higher than the one-answer score",
    "sampled": "- (sampled, T=t): one answer per problem sampled at temperature t (chat_eval --temperature t "
               "--num-samples 1), not the greedy answer: it varies with --seed and is not comparable with a greedy "
               "score; where a current greedy score of the same checkpoint exists, that one is shown instead",
    "temperature unknown": "- (temperature unknown): the entry names no temperature (chat_eval always logs one), "
                           "so whether its answers were greedy or sampled is not known; a current greedy score of "
                           "the same checkpoint, where one exists, is shown instead",
}
# summary rows of chat_eval's tasks, and those of its generative ones (pass@k with --num-samples k)
CHAT_ROWS = ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval", "SpellingBee", "ChatCORE")
GENERATIVE_ROWS = ("GSM8K", "HumanEval", "SpellingBee", "ChatCORE")


def _value_notes(row: str, data: dict) -> list[str]:
    """"partial", "pass@k" and the decoding (_decoding_note) for a summary row's value in a section
    entry (see summary_cells). chat_eval entries logged before it wrote "<task> complete" / "<task>
    scored as" name only their max_problems / num_samples: a cap then marks every chat row partial,
    k > 1 the generative rows."""
    legacy = isinstance(data.get("max_problems"), int) or data.get("num_samples", 1) != 1
    legacy = legacy and not any(f"{r} complete" in data for r in CHAT_ROWS[:-1])
    partial = data.get(f"{row} complete") is False or (legacy and row in CHAT_ROWS and isinstance(
        data.get("max_problems"), int) and data["max_problems"] > 0)
    scored = data.get(f"{row} scored as")
    if legacy and row in GENERATIVE_ROWS and isinstance(data.get("num_samples"), int) and data["num_samples"] > 1:
        scored = f"pass@{data['num_samples']}"
    pass_at_k = isinstance(scored, str) and scored != "pass@1"
    return (["partial"] if partial else []) + ([scored] if pass_at_k else _decoding_note(row, data))


def _decoding_note(row: str, data: dict) -> list[str]:
    """["sampled, T=<t>"] for a value scored from one answer sampled at temperature t > 0, ["temperature
    unknown"] when the entry names no temperature (a hand-written one: chat_eval has logged it from the
    start), [] for greedy answers or a value no answer was generated for: a categorical task (the answer
    letter's logit) or a ChatCORE of categorical tasks only. (pass@k says it sampled: not called.)"""
    if row not in GENERATIVE_ROWS:
        return []
    # a ChatCORE whose entry names no task: whether a generative one was in it is not known either
    tasks = [r for r in CHAT_ROWS[:-1] if r in data]
    if row == "ChatCORE" and tasks and not any(r in GENERATIVE_ROWS for r in tasks):
        return []
    t = data.get("temperature")
    if not (_num(t) and t >= 0):
        return ["temperature unknown"]
    return [f"sampled, T={t:g}"] if t > 0 else []


def _not_greedy(notes: list[str]) -> bool:
    """A value whose answers were sampled (one at T > 0, or pass@k) or may have been (temperature unknown)."""
    return any(n.startswith(("sampled", "pass@")) or n == "temperature unknown" for n in notes)


def _keeps_greedy(notes: list[str], source: tuple, old: tuple) -> bool:
    """Whether the summary's current cell `old` (value, notes, source), a greedy score, stays over a new
    current value (notes, source) that is not greedy, of the same checkpoint (model tag and step; an
    entry naming neither is taken for the same) and no more complete. The rule is "greedy first", not
    "newest first": a greedy score is the one every stage and run is compared on, and a sampled one of
    the same model only differs by its draw (it would replace the comparable figure with a noisier
    one). The newest wins otherwise: of another checkpoint (a later step is the newer model's figure,
    marked), or over a stale or partial greedy one; both scores stay in the section, and the one set
    aside is named under the table (_aside_lines)."""
    return (_not_greedy(notes) and not _not_greedy(old[1]) and source[1] == old[2][1]
            and not ("partial" in old[1] and "partial" not in notes))


def _note_key(note: str) -> str:
    """The NOTES entry explaining a value's note ("pass@4": "pass@k", "sampled, T=0.8": "sampled")."""
    return "pass@k" if note.startswith("pass@") else "sampled" if note.startswith("sampled") else note


def _aside_lines(aside: dict[tuple[str, str], list[tuple]]) -> list[str]:
    """(row, stage) -> the sampled values of the shown greedy one's checkpoint that _keeps_greedy set
    aside: one line each, so the summary never drops a result without saying so."""
    lines = []
    for (row, stage), values in aside.items():
        for value, notes, (section, model, when) in values:
            shown = " ".join([f"{value:.4f}", *(f"({n})" for n in notes)])
            lines.append(f"- {stage.upper()} {row}: {shown} from {', '.join(filter(None, (section, model, when)))} "
                         "set aside: the greedy score of the same checkpoint is shown")
    return lines + ([""] if lines else [])


def _source(section: str, entry: dict) -> tuple[str, str, str]:
    """Where a summary value was logged: section, checkpoint (model tag, step) when it names them, time."""
    data = entry["data"]
    step = data.get("step", data.get("final_step"))
    model = " ".join(([str(data["model_tag"])] if data.get("model_tag") is not None else [])
                     + ([f"step {step}"] if _num(step) else []))
    return _md_line(section), model, str(entry.get("time"))


def _source_lines(table: dict[str, dict[str, tuple[float, list[str], tuple[str, str, str]]]]) -> list[str]:
    """Per stage, the section entries its summary values come from (each value is the latest of its
    key, so one column can hold the figures of two checkpoints: a later eval of another tag or step)."""
    lines = []
    for stage in STAGES:
        rows: dict[tuple[str, str, str], list[str]] = {}   # source -> the rows it gave, in table order
        for row, cells in table.items():
            if stage in cells:
                rows.setdefault(cells[stage][2], []).append(row)
        if not rows:
            continue
        models = {model for _, model, _ in rows if model}
        several = f" (values of {len(models)} checkpoints)" if len(models) > 1 else ""
        lines.append(f"- {stage.upper()}: " + "; ".join(f"{', '.join(r)} from " + ", ".join(filter(None, src))
                                                         for src, r in rows.items()) + several)
    return lines + ([""] if lines else [])


# ---------------------------------------------------------------- sections, stages and runs

STAGES = ("base", "mid", "sft", "rl")


def _stage_rank(stage: str | None) -> int:
    """Pipeline position (base < mid < sft < rl), other stages after them."""
    return STAGES.index(stage) if stage in STAGES else len(STAGES)


def _stage_of(section: str, data: dict) -> str | None:
    if isinstance(data.get("stage"), str) and data["stage"] in STAGES:
        return data["stage"]
    words = re.findall(r"[a-z]+", section.lower())
    for stage, names in (("base", ("base",)), ("mid", ("mid", "midtraining")), ("sft", ("sft",)), ("rl", ("rl",))):
        if any(w in names for w in words):
            return stage
    return None


def _entry_time(entry: dict) -> float:
    """When a section entry was logged (epoch seconds): "t", else its ISO "time" (older files)."""
    if isinstance(entry.get("t"), (int, float)):
        return float(entry["t"])
    try:
        return datetime.fromisoformat(str(entry.get("time"))).timestamp()
    except ValueError:
        return 0.0


def _num(v) -> bool:
    """A finite number (not a bool): a NaN or inf time, step or elapsed_s in a metrics row (a stage's own
    log_metrics call) made the time table's wall clock NaN, and `generate` died in _hms after the plots."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _unfinished_runs(metrics: dict[str, list[dict]], sections: list[dict]) -> dict[str, str]:
    """stage -> why its current metrics run has no training section: log_stage_report writes one
    after a run's last metrics row, so a run without one after it was interrupted, failed or is still
    running. The time table showed such a run's steps under the stage's name with nothing to say so,
    next to the section (and summary) of the earlier run that finished."""
    done = {}   # stage -> time of its latest training section entry
    for doc in sections:
        for entry in doc["entries"]:
            data = entry["data"]
            # total_time_s: a training section of an older format (log_stage_report writes both)
            if isinstance(data, dict) and ("final_step" in data or "total_time_s" in data) \
                    and _stage_of(doc["section"], data) is not None:
                stage = _stage_of(doc["section"], data)
                done[stage] = max(done.get(stage, 0.0), _entry_time(entry))
    out = {}
    for stage, rows in metrics.items():
        times = [r["time"] for r in rows if _num(r.get("time"))]
        if stage not in STAGES or not times or (stage in done and done[stage] >= max(times)):
            continue
        out[stage] = "logged no training section after its metrics" + ("" if stage in done else
                                                                       " (no run of the stage logged one)")
    return out


def _trained_at(sections: list[dict]) -> dict[str, float]:
    """stage -> time of its latest training section entry (log_stage_report's, "final_step")."""
    trained: dict[str, float] = {}
    for doc in sections:
        for entry in doc["entries"]:
            data = entry["data"]
            stage = _stage_of(doc["section"], data) if isinstance(data, dict) and "final_step" in data else None
            if stage is not None:
                trained[stage] = max(trained.get(stage, 0.0), _entry_time(entry))
    return trained


def _is_stale(t: float, stage: str, trained: dict[str, float], own: bool) -> bool:
    """Logged (ended) before the latest training run of an earlier stage (own: or of its stage), as
    the summary's "(stale)": it describes an older model."""
    if stage not in STAGES:
        return False
    upstream = STAGES[:STAGES.index(stage) + own]
    return any(t < trained[s] for s in upstream if s in trained)


def _stale_runs(metrics: dict[str, list[dict]], sections: list[dict]) -> set[str]:
    """Stages whose current metrics run ended before an earlier stage was trained again (base retrained
    after a config change, mid not yet): the time table summed it with the new runs, unmarked, and
    the plots drew its curve as the stage's. Not one whose own training section came after that
    retraining: a rerun that resumed its finished checkpoint (the source's weights unchanged, e.g.
    mid resumed bit-exact after a Ctrl-C; setup.sh reruns every later stage) trains no step and logs
    no metrics row, only its section, and its model is current, as the summary says: the time table
    called it "(stale)", "of an older model; rerun them", and left its training out of the total."""
    trained = _trained_at(sections)
    return {stage for stage, rows in metrics.items()
            if (times := [r["time"] for r in rows if _num(r.get("time"))])
            and _is_stale(max(times), stage, trained, own=False)
            and (stage not in trained or _is_stale(trained[stage], stage, trained, own=False))}


def _missing_stage_lines(metrics: dict[str, list[dict]], sections: list[dict]) -> list[str]:
    """The pipeline stages nothing was logged of (no section, no metrics row): their summary column was
    all "-" and the time table had no row, which read the same as a stage that ran and scored nothing."""
    seen = {stage for stage, rows in metrics.items() if rows}
    seen |= {_stage_of(doc["section"], e["data"]) for doc in sections for e in doc["entries"]
             if isinstance(e["data"], dict)}
    # RL is optional (python -m scripts.chat_rl, no setup.sh stage): a report without it is complete
    missing = [stage.upper() for stage in STAGES if stage not in seen and stage != "rl"]
    line = (f"- Nothing logged of {', '.join(missing)} (no section, no metrics row): not run here yet, stopped "
            "before its first step, or run with another base dir")
    return [line, ""] if missing else []


def _run_notes(metrics: dict[str, list[dict]], superseded: dict[str, int], unfinished: dict[str, str],
               bad: dict[str, int]) -> list[str]:
    """The notes under the time table: each stage's left-out rows (naming the model tag of the run shown:
    rows of another tag were left out unnamed), unfinished runs, RL's rewards, torn metrics lines."""
    def shown(stage: str) -> str:
        tag = next((r["model_tag"] for r in reversed(metrics.get(stage, [])) if r.get("model_tag") is not None), None)
        return "" if tag is None else f"; the run shown is of model tag {_md_line(tag)}"
    notes = [f"- {stage}: {n} metrics rows of an earlier run of the stage (of another --model-tag, or of steps "
             f"a resumed run redid) left out of the plots and this table{shown(stage)}"
             for stage, n in superseded.items()]
    notes += [f"- {stage} (unfinished): its latest run {why}: it was interrupted, failed or is still running; the "
              "plots and this table show that run, the stage's section and summary values an earlier one, if any"
              for stage, why in unfinished.items()]
    notes += _reward_notes(metrics)
    notes += [f"- {name}: {n} line(s) that are not JSON objects (a torn write) skipped" for name, n in bad.items()]
    return notes + ([""] if notes else [])


def _reward_notes(metrics: dict[str, list[dict]]) -> list[str]:
    """RL's per-step mean reward (the loop's "reward" rows), which no section shows: a run whose
    reward was 0 at every step learned nothing (every advantage 0, loss 0) yet read as a normal run."""
    notes = []
    for stage, rows in metrics.items():
        rewards = [float(r["reward"]) for r in rows if _num(r.get("reward"))]
        if not rewards:
            continue
        if not any(rewards):
            notes.append(f"- {stage}: the mean reward was 0 at every one of its {len(rewards)} logged steps: no "
                         "sampled answer was rewarded, so every advantage was 0: the policy got no learning signal")
        else:
            notes.append(f"- {stage}: mean reward per step: first {_fmt(rewards[0])}, last {_fmt(rewards[-1])}, "
                         f"mean {_fmt(sum(rewards) / len(rewards))} over {len(rewards)} logged steps")
    return notes
