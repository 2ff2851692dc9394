"""The report's plots (nanochat/report.py writes report.md around them): which keys of a
metrics_<stage>.jsonl row a metric reads (memory logged in GB converted to GiB), a stage's (x, y)
series of finite points (wall clock from the rows' "time" when elapsed_s was not logged), and one
PNG per plot spec, a line per stage, its axes labelled with their units, drawn on matplotlib's Agg
canvas without pyplot (so the shell's MPLBACKEND plays no part) and written atomically. RL's rows (they
carry "reward") draw its mean reward, not its policy-gradient loss on the cross-entropy axes.
report.py re-exports these names."""

from __future__ import annotations

import io
import math
import os
import sys
from pathlib import Path

from nanochat.report_md import _num

# metric name -> accepted keys in metrics_<stage>.jsonl
METRIC_KEYS: dict[str, tuple[str, ...]] = {
    "loss": ("loss", "train_loss"), "val_bpb": ("val_bpb",), "tok_per_sec": ("tok_per_sec", "tokens_per_sec"),
    "memory_gib": ("peak_mem_gib", "memory_gib"), "elapsed_s": ("elapsed_s", "wall_s"), "reward": ("reward",),
}
# keys in another unit: (key, factor to the metric's unit). loop.py logged memory_gb in GB (1e9 bytes):
# drawn as GB under a "GB" label while the log line and the sections said GiB, 7% apart at 40 GiB
METRIC_SCALED: dict[str, tuple[tuple[str, float], ...]] = {
    "memory_gib": tuple((k, 1e9 / 2**30) for k in ("memory_gb", "peak_memory_gb", "mem_gb")),
}
PLOTS = (  # (y metric, x metric, file name, title)
    ("loss", "step", "loss_vs_step.png", "training loss vs step"),
    ("loss", "elapsed_s", "loss_vs_time.png", "training loss vs wall clock"),
    ("val_bpb", "step", "val_bpb_vs_step.png", "validation bits per byte vs step"),
    ("val_bpb", "elapsed_s", "val_bpb_vs_time.png", "validation bits per byte vs wall clock"),
    ("tok_per_sec", "step", "tok_per_sec.png", "throughput (tokens/s)"),
    ("reward", "step", "reward.png", "RL mean reward per step"),
    ("memory_gib", "step", "memory.png", "peak memory (GiB)"),
)
# axis labels with their units (the metric's key, "memory_gib" or "tok_per_sec", named no unit)
AXIS_LABELS = {"loss": "cross-entropy loss (nats/token)", "val_bpb": "bits per byte", "tok_per_sec": "tokens/s",
               "memory_gib": "peak memory (GiB)", "reward": "mean reward", "step": "step",
               "elapsed_s": "wall clock since the stage's start (min)"}


def _is_rl(rows: list[dict]) -> bool:
    """Rows of an RL run (the loop logs its "reward"): their "loss" is a policy-gradient loss, near 0 or
    negative, which drawn on the cross-entropy axes squashed the other stages' curves and read as one of them."""
    return any("reward" in r for r in rows)


def _get(row: dict, metric: str):
    """A metric of one metrics row as a float in the metric's unit (None when the row has none)."""
    for key, factor in [(k, 1.0) for k in METRIC_KEYS.get(metric, (metric,))] + list(METRIC_SCALED.get(metric, ())):
        if isinstance(row.get(key), (int, float)):
            return float(row[key]) * factor
    return None


def _series(rows: list[dict], y: str, x: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of the rows that have both metrics (elapsed_s from "time" when not logged)."""
    t0 = next((r["time"] for r in rows if _num(r.get("time"))), None)
    xs, ys = [], []
    for r in rows:
        xv = _get(r, x)
        if xv is None and x == "elapsed_s" and t0 is not None and _num(r.get("time")):
            xv = r["time"] - t0
        yv = _get(r, y)
        # a NaN/inf point draws nothing: an all-NaN series would give an empty chart
        if xv is not None and yv is not None and math.isfinite(xv) and math.isfinite(yv):
            xs.append(xv)
            ys.append(yv)
    return xs, ys


def make_plots(metrics: dict[str, list[dict]], out_dir: Path) -> list[tuple[str, Path]]:
    """One PNG per plot spec that has data; lines per stage. Returns (title, path) pairs."""
    from nanochat.checkpoint_io import atomic_write   # temp file + os.replace, as report.py writes

    Figure, FigureCanvasAgg = _agg()
    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    for y, x, name, title in PLOTS:
        series = {stage: _series(rows, y, x) for stage, rows in metrics.items() if not (y == "loss" and _is_rl(rows))}
        series = {s: v for s, v in series.items() if v[0]}
        if not series:
            continue
        fig = Figure(figsize=(7, 4), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        for stage, (xs, ys) in series.items():
            xs_plot = [v / 60 for v in xs] if x == "elapsed_s" else xs
            ax.plot(xs_plot, ys, label=stage, marker="." if len(xs) < 50 else None)
        ax.set(xlabel=AXIS_LABELS[x], ylabel=AXIS_LABELS[y], title=title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        png = io.BytesIO()   # then an atomic write: a crash mid-save left a torn PNG that report.md showed
        fig.savefig(png, format="png")
        atomic_write(out_dir / name, lambda f: f.write(png.getvalue()))
        made.append((title, out_dir / name))
    return made


def _agg():
    """matplotlib's Figure and Agg canvas, used directly (no pyplot state, no display). So the shell's
    MPLBACKEND plays no part, yet matplotlib checks it on its first import: a value it does not know
    (a typo, one meant for another install) was a ValueError, and `generate` died without report.md."""
    saved = os.environ.pop("MPLBACKEND", None) if "matplotlib" not in sys.modules else None
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    finally:
        if saved is not None:
            os.environ["MPLBACKEND"] = saved
    return Figure, FigureCanvasAgg
