"""Benchmark the in-tree Rust BPE trainer (rustbpe/) against rustbpe 0.1.0 from PyPI.

Recipe:
  1. read --chars characters of training text from the docs corpus (all shards but the last);
  2. train --vocab-size with our rustbpe in a fresh subprocess (time, peak RSS);
  3. optionally train the same text with the same pattern under --compare-python (an
     interpreter with `rustbpe==0.1.0`) and check the merges are identical;
  4. build a tiktoken Encoding from our ranks and measure encode throughput on the
     validation shard, single-threaded and with encode_ordinary_batch(num_threads=--threads);
     then rustbpe's own (reference) encoder on the same text, checking it gives tiktoken's ids.

Each training runs in its own subprocess (`--worker`) so peak RSS is that run's alone; the
worker needs only the standard library and rustbpe, so a bare venv works for the reference:
  uv venv /tmp/rustbpe-ref && uv pip install -p /tmp/rustbpe-ref/bin/python rustbpe==0.1.0
  python -m scripts.bench_tokenizer --compare-python /tmp/rustbpe-ref/bin/python

Prints one JSON line per result, then a short table.
"""

import argparse
import hashlib
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = Path(os.environ.get("NANOCHAT_SHARED_DATA", REPO.parent / "shared" / "data"))


def parse_args(argv=None) -> argparse.Namespace:
    from nanochat.flags import FlagParser  # stdlib only: the worker's bare interpreter can import it

    p = FlagParser(prog="python -m scripts.bench_tokenizer", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)

    def add(name: str, **kw):  # FlagParser also accepts the --underscore_names spelling
        p.add_argument(f"--{name}", **kw)

    add("data-dir", type=Path, default=DEFAULT_DATA / "pretrain" / "docs",
        help="folder of parquet shards with a `text` column; the last shard is used for encoding")
    add("chars", type=int, default=50_000_000, help="training characters")
    add("vocab-size", type=int, default=32768)
    add("threads", type=int, default=2, help="RAYON_NUM_THREADS for training, num_threads for batch encode")
    add("buffer-size", type=int, default=8192)
    add("compare-python", type=str, default=None,
        help="python with rustbpe==0.1.0 installed, to train the same text for comparison")
    add("encode-chars", type=int, default=5_000_000, help="characters of validation text to encode")
    add("repeats", type=int, default=1, help="training runs per implementation (best time kept)")
    p.add_argument("--worker", nargs=4, metavar=("TEXTS", "VOCAB", "PATTERN_FILE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    for name in ("chars", "threads", "buffer_size", "encode_chars", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(args, name)}; accepted: an int >= 1")
    if not 256 <= args.vocab_size <= 2**32 - 1:   # rustbpe's range: refused here, not in the worker
        raise ValueError(f"--vocab-size: got {args.vocab_size}; accepted: an int from 256 to {2**32 - 1}")
    if args.threads > 1024:
        raise ValueError(f"--threads: got {args.threads}; accepted: an int from 1 to 1024")
    if not args.data_dir.is_dir() or not sorted(args.data_dir.glob("*.parquet")):
        raise ValueError(f"--data-dir: no *.parquet under {args.data_dir}; accepted: a folder of parquet shards")
    if args.compare_python:
        args.compare_python = check_compare_python(args.compare_python)
    return args


def check_compare_python(python: str) -> str:
    """The --compare-python interpreter's path, once it has shown it can import rustbpe. Only its
    existence was checked: a directory, a non-executable file or an interpreter without rustbpe
    failed with a traceback after our own training had run (minutes at the default --chars)."""
    import shutil

    found = shutil.which(python)   # a path or a name on PATH; None unless an executable file
    if found is None:
        raise ValueError(f"--compare-python: got {python!r}, which is not an executable file; accepted: a python "
                         "executable with rustbpe==0.1.0 installed")
    try:
        probe = subprocess.run([found, "-c", "import rustbpe"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--compare-python: {python!r} did not run ({exc}); accepted: a python executable") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        raise ValueError(f"--compare-python: {python!r} cannot import rustbpe ({last}); accepted: a python with "
                         f"rustbpe==0.1.0 installed (uv pip install -p {found} rustbpe==0.1.0)")
    return found


def read_texts(shards: list[Path], limit: int) -> list[str]:
    """Documents in shard order until `limit` characters (the last one truncated)."""
    import pyarrow.parquet as pq

    texts, n = [], 0
    for shard in shards:
        pf = pq.ParquetFile(shard)
        for i in range(pf.num_row_groups):
            for t in pf.read_row_group(i, columns=["text"]).column("text").to_pylist():
                t = t[: limit - n]
                texts.append(t)
                n += len(t)
                if n >= limit:
                    return texts
    return texts


def rss_mb() -> float:
    """Peak resident set size of this process in MB (1e6 bytes, as the other benchmarks' GB are
    1e9): ru_maxrss is KiB on Linux and bytes on macOS. KiB / 1024 was MiB printed as MB (-4.6%)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6


def worker(texts_path: str, vocab_size: str, pattern_path: str, out_path: str) -> None:
    """Runs in a subprocess: train once, write timing, RSS and ranks to `out_path`."""
    import rustbpe

    with open(texts_path, "rb") as f:
        texts = pickle.load(f)
    pattern = Path(pattern_path).read_text(encoding="utf-8")
    base_rss = rss_mb()
    tok = rustbpe.Tokenizer()
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    tok.train_from_iterator(iter(texts), int(vocab_size), pattern=pattern)
    seconds, cpu1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu_seconds = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    peak_rss = rss_mb()
    version = getattr(rustbpe, "__version__", None)
    if version is None:
        from importlib.metadata import version as dist_version

        version = dist_version("rustbpe")
    ranks = tok.get_mergeable_ranks()
    # the trainer's own state, to rebuild it for the encode benchmark (rustbpe 0.1.0 has none)
    state = tok.__getstate__() if "__setstate__" in type(tok).__dict__ else None
    with open(out_path, "wb") as f:
        pickle.dump({"seconds": seconds, "cpu_seconds": cpu_seconds, "base_rss_mb": base_rss, "peak_rss_mb": peak_rss,
                     "version": version, "ranks": ranks, "state": state}, f)


def train_in_subprocess(python: str, texts_path: Path, pattern_path: Path, args, out: Path) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    cmd = [python, "-m", "scripts.bench_tokenizer", "--worker", str(texts_path), str(args.vocab_size),
           str(pattern_path), str(out)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True)
    with open(out, "rb") as f:
        return pickle.load(f)


def encode_throughput(ranks: list, pattern: str, docs: list[str], threads: int) -> list[dict]:
    import tiktoken

    enc = tiktoken.Encoding("bench", pat_str=pattern, mergeable_ranks=dict(ranks), special_tokens={})
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    results = []
    t0 = time.perf_counter()
    n_tokens = sum(len(enc.encode_ordinary(d)) for d in docs)
    dt = time.perf_counter() - t0
    results.append({"mode": "single", "threads": 1, "seconds": dt, "mb_per_s": n_bytes / dt / 1e6,
                    "bytes": n_bytes, "tokens": n_tokens, "bytes_per_token": n_bytes / n_tokens})
    t0 = time.perf_counter()
    n_tokens = sum(len(ids) for ids in enc.encode_ordinary_batch(docs, num_threads=threads))
    dt = time.perf_counter() - t0
    results.append({"mode": "batch", "threads": threads, "seconds": dt, "mb_per_s": n_bytes / dt / 1e6,
                    "bytes": n_bytes, "tokens": n_tokens, "bytes_per_token": n_bytes / n_tokens})
    return results


def rustbpe_encode_throughput(state, enc_ranks: list, pattern: str, docs: list[str]) -> dict:
    """rustbpe's reference encoder (one thread, GIL released) on `docs`; checks it against tiktoken."""
    import rustbpe
    import tiktoken

    tok = rustbpe.Tokenizer()
    tok.__setstate__(state)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    t0 = time.perf_counter()
    rows = [tok.encode(d) for d in docs]
    dt = time.perf_counter() - t0
    enc = tiktoken.Encoding("bench", pat_str=pattern, mergeable_ranks=dict(enc_ranks), special_tokens={})
    n_tokens = sum(map(len, rows))
    return {"mode": "single", "threads": 1, "seconds": dt, "mb_per_s": n_bytes / dt / 1e6, "bytes": n_bytes,
            "tokens": n_tokens, "bytes_per_token": n_bytes / n_tokens,
            "same_ids_as_tiktoken": rows == [enc.encode_ordinary(d) for d in docs]}


def emit(rows: list, record: dict) -> None:
    print(json.dumps(record), flush=True)
    rows.append(record)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return
    import rustbpe

    pattern = rustbpe.Tokenizer().get_pattern()  # ours: GPT-4 with \p{N}{1,2}; passed to both
    shards = sorted(args.data_dir.glob("*.parquet"))
    train_shards = shards[:-1] or shards
    texts = read_texts(train_shards, args.chars)
    chars = sum(map(len, texts))
    rows: list[dict] = []
    common = {"chars": chars, "docs": len(texts), "vocab_size": args.vocab_size, "threads": args.threads}

    impls = [("ours", sys.executable)] + ([("pypi-0.1.0", args.compare_python)] if args.compare_python else [])
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_tokenizer_") as tmp:
        texts_path, pattern_path = Path(tmp) / "texts.pkl", Path(tmp) / "pattern.txt"
        with open(texts_path, "wb") as f:
            pickle.dump(texts, f)
        pattern_path.write_text(pattern, encoding="utf-8")
        for name, python in impls:
            runs = [train_in_subprocess(python, texts_path, pattern_path, args, Path(tmp) / f"{name}{i}.pkl")
                    for i in range(args.repeats)]
            best = min(runs, key=lambda r: r["seconds"])
            results[name] = best
            digest = hashlib.sha256(pickle.dumps(best["ranks"])).hexdigest()[:16]
            emit(rows, {"bench": "tokenizer_train", "impl": name, "version": best["version"], **common,
                        "seconds": round(best["seconds"], 3), "all_seconds": [round(r["seconds"], 3) for r in runs],
                        "cpu_seconds": round(best["cpu_seconds"], 3),
                        "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
                        "base_rss_mb": round(best["base_rss_mb"], 1), "merges": len(best["ranks"]) - 256,
                        "ranks_sha256": digest})
    if "pypi-0.1.0" in results:
        a, b = results["ours"]["ranks"], results["pypi-0.1.0"]["ranks"]
        # A shorter list that is a prefix of the other differs at its end (zip alone would say None).
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                          None if len(a) == len(b) else min(len(a), len(b)))
        emit(rows, {"bench": "tokenizer_merges_identical", "identical": a == b, "first_difference": first_diff,
                    "speedup": round(results["pypi-0.1.0"]["seconds"] / results["ours"]["seconds"], 2), **common})

    docs = read_texts(shards[-1:], args.encode_chars)
    for r in encode_throughput(results["ours"]["ranks"], pattern, docs, args.threads):
        emit(rows, {"bench": "tokenizer_encode", "impl": "tiktoken", **r, "vocab_size": args.vocab_size})
    if results["ours"].get("state") is not None:
        r = rustbpe_encode_throughput(results["ours"]["state"], results["ours"]["ranks"], pattern, docs)
        emit(rows, {"bench": "tokenizer_encode", "impl": "rustbpe", **r, "vocab_size": args.vocab_size})

    print(f"\n{'benchmark':<26}{'impl / mode':<14}{'seconds':>9}{'cpu s':>8}{'peak RSS MB':>13}{'MB/s':>8}  notes")
    for r in rows:
        if r["bench"] == "tokenizer_train":
            name = f"train {r['chars'] / 1e6:g}M chars v{r['vocab_size']}"
            print(f"{name:<26}{r['impl']:<14}{r['seconds']:>9.2f}{r['cpu_seconds']:>8.2f}{r['peak_rss_mb']:>13.0f}"
                  f"{'':>8}  {r['merges']} merges, {r['threads']} threads")
        elif r["bench"] == "tokenizer_merges_identical":
            print(f"{'merges identical':<26}{str(r['identical']):<14}{'':>38}  time 0.1.0 / ours = {r['speedup']}")
        else:
            same = "" if "same_ids_as_tiktoken" not in r else f", same ids as tiktoken: {r['same_ids_as_tiktoken']}"
            print(f"{'encode (' + r['impl'] + ')':<26}{r['mode'] + ' x' + str(r['threads']):<14}{r['seconds']:>9.2f}"
                  f"{'':>21}{r['mb_per_s']:>8.1f}  {r['bytes_per_token']:.2f} bytes/token{same}")

if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:   # a bare interpreter with rustbpe only (no torch): the worker's own exit path
        main()
    else:
        from nanochat.flags import script_main

        script_main("bench_tokenizer", lambda: parse_args(sys.argv[1:]), lambda: main(sys.argv[1:]))
