"""Benchmark the pretraining dataloader: tokens/s delivered, time per batch, fraction of tokens
dropped by packing, for the text path (tokenizing on the fly, 1..N encode threads) and the
binary path (shards read with pread). One JSON line per result, then a table.

    python -m scripts.profile_dataloader --data-dir ../shared/data/pretrain/docs \\
        --tokenizer-dir ~/.cache/nanochat/tokenizer -B 32 -T 2048 --threads 1,2

Binary shards are taken from --bin-dir (default: <data-dir>_tokens when it holds a finished run of
this tokenizer over the text shards as they are now, else a scratch directory under
$NANOCHAT_BASE_DIR/profile_tokens, so a shared read-only data folder is never written to) and
made with scripts/pretokenize first when they are not (an unfinished run is resumed). The consumer does nothing but take batches, so this measures the loader's own rate;
`cpu_cores_used` (process CPU time / wall time) shows how much of the machine it took, and the
load average before/after shows what else was running.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat import dataset as ds
from nanochat.common import get_base_dir
from nanochat.dataloader import DataLoader
from nanochat.errors import DataError
from nanochat.flags import FlagParser, require, require_float, require_int, script_main
from scripts.pretokenize import pretokenize


def parse_args(argv=None):
    """Parse and validate every flag before any data is read; a bad value raises ValueError naming
    the flag and the accepted values."""
    ap = FlagParser(prog="python -m scripts.profile_dataloader", description="dataloader throughput benchmark")
    # ds.path_flag: an empty value (`--bin-dir "$DIR"`, DIR unset) was Path("") = the current
    # directory, and binary shards were pretokenized into it (e.g. the repository)
    ap.add_argument("--data-dir", type=ds.path_flag, default=None)
    ap.add_argument("--bin-dir", type=ds.path_flag, default=None)
    ap.add_argument("--tokenizer-dir", type=ds.path_flag, default=None)
    ap.add_argument("-B", "--batch-size", type=int, default=32)
    ap.add_argument("-T", "--seq-len", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=40, help="timed batches per configuration (at least)")
    ap.add_argument("--min-seconds", type=float, default=3.0, help="keep timing until this much time has passed")
    ap.add_argument("--warmup", type=int, default=3, help="untimed batches first")
    ap.add_argument("--threads", default="1,2", help="encode threads to try on the text path")
    ap.add_argument("--sources", default="text,bin", help="text,bin or either")
    ap.add_argument("--prefetch", type=int, default=4)
    ap.add_argument("--buffer-size", type=int, default=1000)
    ap.add_argument("--cores", type=int, default=None, help="pin the process to this many CPUs")
    ap.add_argument("--device", default="cpu", help="where batches go: cpu | cuda (pinned, non_blocking)")
    args = ap.parse_args(argv)
    try:
        args.threads = [int(t) for t in args.threads.split(",")]
    except ValueError:
        raise ValueError(f"--threads: got {args.threads!r}; accepted: comma-separated integers >= 1") from None
    args.sources = args.sources.split(",")
    if any(s not in ("text", "bin") for s in args.sources):
        raise ValueError(f"--sources: got {args.sources}; accepted: text,bin or either")
    if min(args.threads) < 1:
        raise ValueError(f"--threads: got {args.threads}; accepted: comma-separated integers >= 1")
    for flag, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len), ("--batches", args.batches),
                        ("--prefetch", args.prefetch), ("--buffer-size", args.buffer_size)):
        require_int(value, flag, 1)
    require_int(args.warmup, "--warmup", 0)
    if args.cores is not None:   # more than it may run on was pinned to all of them, without a word
        allowed = len(os.sched_getaffinity(0))
        require_int(args.cores, "--cores", 1)
        require(args.cores <= allowed, "--cores", args.cores, f"1..{allowed} (the CPUs this process may run on)")
    require_float(args.min_seconds, "--min-seconds", 0.0)
    require(args.device in ("cpu", "cuda"), "--device", args.device, "cpu|cuda")
    # without a GPU the pinned buffers fail in the loader's thread, after any pretokenizing
    require(args.device == "cpu" or torch.cuda.is_available(), "--device", args.device,
            "cpu (no CUDA GPU is visible)")
    for flag, path in (("--data-dir", args.data_dir), ("--tokenizer-dir", args.tokenizer_dir)):
        require(path is None or path.is_dir(), flag, str(path), "an existing directory")
    # shards are read from (or pretokenized into) it: a file failed in pretokenize's mkdir, after the
    # tokenizer was loaded, with a traceback (it need not exist yet, nor be writable when it holds shards)
    require(args.bin_dir is None or not args.bin_dir.is_file(), "--bin-dir", str(args.bin_dir),
            "a directory (existing, or one to create)")
    return args


def bin_shards_ready(bin_dir: Path, data_dir: Path, fingerprint: str) -> bool:
    """Whether bin_dir holds a finished pretokenize run of data_dir's text shards as they are now,
    made with this tokenizer: what the loader needs to read it (binshards_runs' checks)."""
    if not bs.list_bin_shards(bin_dir):
        return False
    try:
        runs.check_tokenizer(bin_dir, fingerprint)
        runs.check_fresh(bin_dir, ds.list_shards(data_dir), data_dir)
    except DataError:
        return False
    return True


def ensure_bin_shards(data_dir: Path, bin_dir: Path | None, tokenizer, workers: int) -> Path:
    """The binary shards for data_dir, pretokenized now unless they are ready (bin_shards_ready), and
    a JSON line about it; pretokenize resumes (shards already written are kept). Any shard in the
    directory used to count as done: the scratch directory of a run stopped while pretokenizing
    then failed every later run ("incomplete: re-run pretokenize", with a command that used the
    default tokenizer, not --tokenizer-dir's). <data-dir>_tokens is read only when it is ready, else
    the scratch directory is used (nothing is written beside the data folder)."""
    if bin_dir is None:
        bin_dir = bs.default_bin_dir(data_dir)
        if not bin_shards_ready(bin_dir, data_dir, tokenizer.fingerprint):
            bin_dir = get_base_dir() / "profile_tokens" / f"{data_dir.name}-{tokenizer.fingerprint[:12]}"
    if not bin_shards_ready(bin_dir, data_dir, tokenizer.fingerprint):
        t0 = time.perf_counter()
        results = pretokenize(ds.list_shards(data_dir), bin_dir, tokenizer, workers=workers,
                              log=lambda *a: None)
        dt = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in results)
        print(json.dumps({"bench": "pretokenize", "workers": workers, "tokens": tokens,
                          "seconds": round(dt, 2), "tok_per_s": round(tokens / dt)}), flush=True)
    return bin_dir


def measure(tokenizer, args, source: str, threads: int, data_dir: Path, bin_dir: Path) -> dict:
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    dl = DataLoader(tokenizer, args.batch_size, args.seq_len, "train", data_dir=data_dir,
                    bin_dir=bin_dir, source=source, tokenizer_threads=threads, device=args.device,
                    prefetch=args.prefetch, buffer_size=args.buffer_size)
    for _ in range(max(args.warmup, 1)):
        next(dl)
    first = time.perf_counter() - t0
    c0, w0, n = time.process_time(), time.perf_counter(), 0
    while n < args.batches or time.perf_counter() - w0 < args.min_seconds:
        x, y = next(dl)
        n += 1
    if x.is_cuda:
        torch.cuda.synchronize()  # the clock must include the last host->device copy
    wall = time.perf_counter() - w0
    cpu = time.process_time() - c0
    dl.close()
    tokens = n * args.batch_size * args.seq_len
    return {"bench": "dataloader", "source": source, "threads": threads if source == "text" else 1,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "batches": n,
            "tok_per_s": round(tokens / wall), "ms_per_batch": round(1000 * wall / n, 2),
            "warmup_s": round(first, 2), "dropped_fraction": round(dl.dropped_fraction, 4),
            "cpu_cores_used": round(cpu / wall, 2), "cores_allowed": len(os.sched_getaffinity(0)),
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()],
            "vocab_size": tokenizer.vocab_size, "data_dir": str(data_dir), "device": args.device,
            "torch": torch.__version__, "python": platform.python_version()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cores:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:args.cores])
    from nanochat.tokenizer import Tokenizer, get_tokenizer

    tokenizer = Tokenizer.load(args.tokenizer_dir) if args.tokenizer_dir else get_tokenizer()
    data_dir = args.data_dir or ds.default_data_dir()
    bin_dir = None
    if "bin" in args.sources:
        bin_dir = ensure_bin_shards(data_dir, args.bin_dir, tokenizer, max(args.threads))
    results = []
    for source in args.sources:
        for threads in (args.threads if source == "text" else [1]):
            r = measure(tokenizer, args, source, threads, data_dir, bin_dir or bs.default_bin_dir(data_dir))
            results.append(r)
            print(json.dumps(r), flush=True)
    print(f"\n{'source':<7}{'threads':>8}{'tok/s':>14}{'ms/batch':>10}{'dropped':>9}{'cores used':>12}"
          f"{'load1 before/after':>20}")
    for r in results:
        print(f"{r['source']:<7}{r['threads']:>8}{r['tok_per_s']:>14,}{r['ms_per_batch']:>10}"
              f"{r['dropped_fraction']:>9.2%}{r['cpu_cores_used']:>12}"
              f"{r['loadavg_before'][0]:>11} / {r['loadavg_after'][0]:<6}")
    return 0


if __name__ == "__main__":
    script_main("profile_dataloader", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
