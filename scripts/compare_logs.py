"""Compare two training logs step by step: python -m scripts.compare_logs A.log B.log [--from-step N] [--tol X]

Reads the fixed-field step lines ("step 00011/00020 | loss 9.1234 | ...") and the validation lines
("step 00020 | val bpb 1.2345 ...") that every recipe prints, keeps the steps both logs have (from
--from-step on), prints one row per step and the largest absolute difference, and exits 1 when a
difference exceeds --tol, the logs share no step, or a step (from --from-step on) is in one log
only: a run that stopped early (or a log of another length) is named, not passed on the steps both
happen to have. A run the NaN guard stopped ("non-finite loss (nan) at step N", its last line,
when stderr went to the log) fails too: it diverged, even where the steps both logs have agree. A
step logged more than once (a resumed run appended to its log) is compared at its last line, and
said so. Used by the GPU resume check (an uninterrupted run vs a run resumed from a checkpoint:
their losses from the resume point on must agree).
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

from nanochat.errors import RequestError
from nanochat.flags import FlagParser, require, require_float

NUMBER = r"(-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|-?nan|-?inf)"   # what float() reads, no more
STEP_RE = re.compile(r"^step (\d+)/\d+ \| loss " + NUMBER + r" \|")
# the "(min" that follows the value is required, as the " |" after a loss is: a line cut inside its
# number (a truncated log, "val bpb 3.16") read as a value it never had
VAL_RE = re.compile(r"^step (\d+) \| val bpb " + NUMBER + r" \(min ")
# the start of a step or validation line: one that starts so and is not read above was cut short or
# holds no number (a killed run's last line); it is named, file and line, not skipped unsaid
STEP_START_RE = re.compile(r"^step \d+(?:/| \| val\b)")
# the NaN guard's stop (nanochat.training.NonFiniteLossError), after the script's "NAME: error: "
STOP_RE = re.compile(r"non-finite (.+?) \(([^)]*)\) at step (\d+);")
METRICS = ("loss", "val_bpb")


def parse_log(path: Path) -> dict:
    """{"loss": {step: smoothed loss}, "val_bpb": {step: bpb}, "repeated": {metric: steps logged
    more than once}, "stopped": the NaN guard's stop line or None, "unreadable": [(line number,
    line)] of step lines not read} from one log file. A repeated step keeps its last value (a resumed
    run's), and a stop followed by a step line past the stop's step belonged to an earlier attempt
    that was resumed: it is dropped. (Step lines up to that step
    after it are the same run's: without PYTHONUNBUFFERED, stdout's buffered lines reach a shared
    log after the error stderr wrote first.)"""
    if not path.is_file():
        raise RequestError(f"log: {path} does not exist")
    out: dict = {"loss": {}, "val_bpb": {}, "repeated": {"loss": set(), "val_bpb": set()}, "stopped": None,
                 "unreadable": []}
    stopped_at = None
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = line.strip()
        if STEP_START_RE.match(line) and not (STEP_RE.match(line) or VAL_RE.match(line)):
            out["unreadable"].append((number, line))
        for key, rx in (("loss", STEP_RE), ("val_bpb", VAL_RE)):
            m = rx.match(line)
            if m:
                step = int(m.group(1))
                if step in out[key]:
                    out["repeated"][key].add(step)
                out[key][step] = float(m.group(2))
                if stopped_at is not None and step > stopped_at:
                    out["stopped"], stopped_at = None, None
        stop = STOP_RE.search(line)
        if stop:
            stopped_at = int(stop.group(3))
            out["stopped"] = f"non-finite {stop.group(1)} ({stop.group(2)}) at step {stopped_at}"
    return out


def notes(path: Path, log: dict) -> list[str]:
    """What the table does not show about one log: repeated steps, unreadable step lines (file:line),
    a NaN-guard stop, no lines."""
    out = []
    if not any(log[k] for k in METRICS):   # a wrong file (or a run that died before its first step)
        out.append(f"{path}: no step lines ('step N/M | loss X |' or 'step N | val bpb X (min') in it")
    for key in METRICS:
        steps = sorted(log["repeated"][key])
        if steps:
            out.append(f"{path}: {len(steps)} {key} step(s) logged more than once ({_shown(steps)}; a resumed "
                       "run appended to the log?): the last line of each is compared")
    for number, line in log["unreadable"][:5]:   # a step only in the other log was then this one's
        out.append(f"{path}:{number}: a step line that could not be read (cut short, or no number), "
                   f"skipped: {line[:100]!r}")
    if len(log["unreadable"]) > 5:
        out.append(f"{path}: {len(log['unreadable']) - 5} more unreadable step line(s)")
    if log["stopped"]:
        out.append(f"{path}: the run stopped on {log['stopped']} (the NaN guard): it diverged")
    return out


def _shown(steps: list[int]) -> str:
    return ", ".join(map(str, steps[:5])) + (f", ... {steps[-1]}" if len(steps) > 5 else "")


def compare(a: dict, b: dict, from_step: int) -> list[tuple[str, int, float, float, float]]:
    """Rows (metric, step, a, b, |a-b|) for every step both logs have, from from_step on. A value
    that is not finite (a diverged run) makes the difference inf: it never passes a tolerance."""
    rows = []
    for key in METRICS:
        for step in sorted(set(a[key]) & set(b[key])):
            if step >= from_step:
                x, y = a[key][step], b[key][step]
                rows.append((key, step, x, y, abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf))
    return rows


def unmatched(a: dict, b: dict, from_step: int) -> list[str]:
    """One line per metric and log with steps (from from_step on) the other log lacks."""
    out = []
    for key in METRICS:
        for name, mine, other in (("A", a[key], b[key]), ("B", b[key], a[key])):
            only = sorted(s for s in set(mine) - set(other) if s >= from_step)
            if only:
                out.append(f"{key}: {len(only)} step(s) only in {name}: {_shown(only)}")
    return out


def parse_args(argv: list[str] | None = None):
    """Parse and validate the command line; a bad value raises ValueError naming the flag."""
    p = FlagParser(prog="python -m scripts.compare_logs", description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--from-step", type=int, default=0, help="first step compared")
    p.add_argument("--tol", type=float, default=2e-3, help="max |difference| allowed (logs print 4 decimals)")
    args = p.parse_args(argv)
    require_float(args.tol, "--tol", 0.0)
    require(args.from_step >= 0, "--from-step", args.from_step, "an integer >= 0")
    for path in (args.a, args.b):
        require(path.is_file(), "log", str(path), "an existing log file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    a, b = parse_log(args.a), parse_log(args.b)
    for path, log in ((args.a, a), (args.b, b)):
        for line in notes(path, log):
            print(line)
    rows = compare(a, b, args.from_step)
    if not rows:
        print(f"no common step >= {args.from_step} in {args.a} and {args.b}")
        return 1
    print(f"{'metric':>8} {'step':>6} {'A':>10} {'B':>10} {'|A-B|':>9} {'rel %':>7}")
    for key, step, x, y, d in rows:
        rel = f"{100 * d / abs(x):7.3f}" if x and math.isfinite(d) else "    n/a"
        print(f"{key:>8} {step:>6} {x:>10.4f} {y:>10.4f} {d:>9.4f} {rel}")
    worst = max(r[4] for r in rows)
    exact = sum(r[4] == 0 for r in rows)
    missing = unmatched(a, b, args.from_step)
    for line in missing:
        print(line)
    stopped = [name for name, log in (("A", a), ("B", b)) if log["stopped"]]
    ok = worst <= args.tol and not missing and not stopped
    tail = f"; {len(missing)} metric(s) with steps in one log only (a run that stopped early?)" if missing else ""
    tail += f"; {' and '.join(stopped)} stopped on a non-finite value" if stopped else ""
    print(f"{'PASS' if ok else 'FAIL'}: {len(rows)} values compared, {exact} identical, max |diff| {worst:.4g} "
          f"(tol {args.tol:g}){tail}")
    return 0 if ok else 1


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("compare_logs", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
