"""Compile every Triton kernel of the project for GPUs that need not be here (H100 sm_90, GB10 sm_121,
B200 sm_100, RTX 5090 sm_120) and print what each needs: shared memory, registers, spills, and
whether one program fits an SM of that GPU. Runs on a CPU (Triton's compiler and ptxas only).

    python -m scripts.triton_aot                         # h100-sxm and gb10, every kernel
    python -m scripts.triton_aot --targets gb10 --cases mlp_gemm,decode_step --json

One JSON line per launch with --json, then a table, then one summary line per kernel and target.
Exit 1 when a kernel launched without autotuning fails to compile or to fit, or when an autotuned
kernel has no config that fits (it could not run on that GPU at all); configs that do not fit are
otherwise normal (Triton's autotuner skips them there). Compiling is not running: speed and
numerics stay measurements on the GPU itself (nanochat/triton_aot.py says why this is still worth it).
"""

from __future__ import annotations

import json
from collections import defaultdict

from nanochat.flags import FlagParser, script_main
from nanochat.triton_aot import TARGETS, check, num_warps_of, resolve_cases, resolve_targets

ARGS = None


def parse_args(argv=None):
    from nanochat.triton_aot_cases import CASES

    p = FlagParser(prog="python -m scripts.triton_aot", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--targets", default="h100-sxm,gb10", help=f"all, or a comma list of {', '.join(TARGETS)}")
    p.add_argument("--cases", default="all", help=f"all, or a comma list of {', '.join(CASES)}")
    p.add_argument("--json", action="store_true", help="also print one JSON line per launch")
    a = p.parse_args(argv)
    a.targets = resolve_targets(a.targets)
    a.cases = resolve_cases(a.cases)
    return a


def summarize(results) -> list[tuple[str, str, str, int, int, bool]]:
    """(target, case, kernel, launches that fit, launches, verdict ok) per kernel: a plain launch
    must fit; an autotuned kernel needs at least one fitting config."""
    groups = defaultdict(list)
    for launch, res in results:
        groups[(res.target, res.case, res.kernel)].append((launch, res))
    rows = []
    for (target, case, kernel), items in groups.items():
        fit = [res.fits(TARGETS[target], num_warps_of(launch)) for launch, res in items]
        tuned = any(launch.config is not None for launch, _ in items)
        rows.append((target, case, kernel, sum(fit), len(fit), any(fit) if tuned else all(fit)))
    return rows


def main(args) -> int:
    results = check(args.targets, only=args.cases)
    if args.json:
        for launch, r in results:
            print(json.dumps({"target": r.target, "case": r.case, "kernel": r.kernel, "config": r.config,
                              "ok": r.ok, "shared_bytes": r.shared, "registers": r.registers,
                              "spill_bytes": r.spill_bytes, "num_warps": num_warps_of(launch),
                              "fits": r.fits(TARGETS[r.target], num_warps_of(launch)),
                              "compile_s": round(r.seconds, 2), "error": r.error}), flush=True)
    print(f"\n{'target':<9} {'case':<18} {'kernel':<26} {'config':<18} {'smem KB':>8} {'regs':>5} "
          f"{'spill B':>7} {'fits':>5}")
    for launch, r in results:
        fits = r.fits(TARGETS[r.target], num_warps_of(launch))
        smem = f"{r.shared / 1024:.1f}" if r.ok else "-"
        print(f"{r.target:<9} {r.case:<18} {r.kernel:<26} {r.config or '-':<18} {smem:>8} "
              f"{r.registers if r.ok else '-':>5} {r.spill_bytes if r.ok else '-':>7} {'yes' if fits else 'NO':>5}"
              + (f"  {r.error}" if r.error else ""))
    print()
    failed = 0
    for target, case, kernel, n_fit, n, ok in summarize(results):
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {target:<9} {kernel:<26} {n_fit} of {n} launches fit ({case})")
    return 1 if failed else 0


def _check():
    global ARGS
    ARGS = parse_args()


if __name__ == "__main__":
    script_main("triton_aot", _check, lambda: main(ARGS))
