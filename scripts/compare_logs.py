"""Compare two training logs step by step: python -m scripts.compare_logs A.log B.log [--from-step N] [--tol X]

Reads the fixed-field step lines ("step 00011/00020 | loss 9.1234 | ...") and the validation lines
("step 00020 | val bpb 1.2345 ...") that every recipe prints, keeps the steps both logs have (from
--from-step on), prints one row per step and the largest absolute difference, and exits 1 when a
difference exceeds --tol, the logs share no step, or a step (from --from-step on) is in one log
only: a run that stopped early (or a log of another length) is named, not passed on the steps both
happen to have. Used by the GPU resume check (an uninterrupted
run vs a run resumed from a checkpoint: their losses from the resume point on must agree).
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
VAL_RE = re.compile(r"^step (\d+) \| val bpb " + NUMBER + r"\b")


def parse_log(path: Path) -> dict[str, dict[int, float]]:
    """{"loss": {step: smoothed loss}, "val_bpb": {step: bpb}} from one log file."""
    if not path.is_file():
        raise RequestError(f"log: {path} does not exist")
    out: dict[str, dict[int, float]] = {"loss": {}, "val_bpb": {}}
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        for key, rx in (("loss", STEP_RE), ("val_bpb", VAL_RE)):
            m = rx.match(line)
            if m:
                out[key][int(m.group(1))] = float(m.group(2))
    return out


def compare(a: dict, b: dict, from_step: int) -> list[tuple[str, int, float, float, float]]:
    """Rows (metric, step, a, b, |a-b|) for every step both logs have, from from_step on. A value
    that is not finite (a diverged run) makes the difference inf: it never passes a tolerance."""
    rows = []
    for key in ("loss", "val_bpb"):
        for step in sorted(set(a[key]) & set(b[key])):
            if step >= from_step:
                x, y = a[key][step], b[key][step]
                rows.append((key, step, x, y, abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf))
    return rows


def unmatched(a: dict, b: dict, from_step: int) -> list[str]:
    """One line per metric and log with steps (from from_step on) the other log lacks."""
    out = []
    for key in ("loss", "val_bpb"):
        for name, mine, other in (("A", a[key], b[key]), ("B", b[key], a[key])):
            only = sorted(s for s in set(mine) - set(other) if s >= from_step)
            if only:
                shown = ", ".join(map(str, only[:5])) + (f", ... {only[-1]}" if len(only) > 5 else "")
                out.append(f"{key}: {len(only)} step(s) only in {name}: {shown}")
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
        if not any(log.values()):   # a wrong file (or a run that died before its first step)
            print(f"{path}: no step lines ('step N/M | loss X |' or 'step N | val bpb X') in it")
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
    ok = worst <= args.tol and not missing
    tail = f"; {len(missing)} metric(s) with steps in one log only (a run that stopped early?)" if missing else ""
    print(f"{'PASS' if ok else 'FAIL'}: {len(rows)} values compared, {exact} identical, max |diff| {worst:.4g} "
          f"(tol {args.tol:g}){tail}")
    return 0 if ok else 1


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("compare_logs", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
