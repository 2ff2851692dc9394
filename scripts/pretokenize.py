"""Pretokenize text shards into binary token shards for the dataloader's binary path.

    python -m scripts.pretokenize                      # base_data -> base_data_tokens
    python -m scripts.pretokenize --data-dir DIR --out OUT --workers 2
    python -m scripts.pretokenize --verify             # read every binary shard whole: damaged ones named

One text shard -> one `.bin` shard (format: nanochat/binshards.py; run record in meta.json:
nanochat/binshards_runs.py), written atomically by a pool of worker processes, every document
starting with BOS. The output directory is tied to one tokenizer (meta.json + every shard header
carry its fingerprint): pointing it at a directory made with another tokenizer is an error, before
any work, unless --force (which deletes that tokenizer's shards first, as the dataloader's advice
for them assumes). Shards already present
(same tokenizer, made from a text shard of the same name, size and mtime, offsets intact; or, when
only the mtime moved, of the same sha256, recorded as it was tokenized) are skipped, so an
interrupted run resumes and a rerun redoes just the text shards that changed, even at the same
size; `--force` rewrites them all. Before the first shard is written, meta.json
marks the directory unfinished and lists the text shards it is meant to hold (binary shards of
text shards no longer there are deleted; other `.bin` files in --out are refused up front); each
shard is recorded as it lands; only a run that wrote them all marks it complete. So the dataloader refuses a directory an interrupted run left
behind (its last shard would be a train shard read as validation) and binary shards made from
other text shards than those now in the data dir. Before any work, the shards still to write are
sized from the text shards' parquet footers (at 3 characters a token, fewer than the ~4 our
tokenizers reach, so the estimate errs high): a disk without room for them is a DiskFullError
naming both numbers. A split (train = all but the last text shard, val = the last) with no
non-empty document is a MissingDataError: before any work when the footers show it, else after
tokenizing, the directory then left unfinished.

One run per output directory at a time (a record lock, nanochat/binshards_runs.py: a second run is
refused naming the first). It says up front whether it resumes an unfinished run, tops up a
finished one or has nothing to do (then the directory stays finished throughout: a training run
opening it meanwhile is not refused). A failed write (a full disk) is one line naming the shard,
and no partial shard is left under a final name, nor as a temp file once the run has ended. Each
shard's sha256 is recorded as it lands; `--verify` checks every shard against it (a flipped bit
in a token passes every cheaper check).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat import dataset as ds
from nanochat.common import fmt_bytes
from nanochat.errors import DiskFullError, MissingDataError, RequestError
from nanochat.flags import FlagParser, check_out_dir, require_int, script_main

CHARS_PER_TOKEN_LOW = 3   # planning only: English text and code run ~4 characters a token at vocab 32K

_worker_tokenizer = None


def _init_worker(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _init_pool_worker(tokenizer) -> None:
    """A pool worker: Ctrl-C is the main process's to handle (it terminates the pool; each worker
    printed its own traceback). Pool.terminate's SIGTERM is left to kill: a Python handler runs
    only when the main thread wakes, and pyarrow's threads can take the signal while it sleeps
    on the pool's queue lock (the pool then hung at exit); the temp files of the workers it kills
    are deleted by the main process (pretokenize)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(tokenizer)


def _tokenize_one(job: tuple[str, str, int]) -> dict:
    text_path, out_path, threads = job
    t0 = time.perf_counter()
    st = os.stat(text_path)  # before reading: what the binary shard is made from
    sha = runs.file_sha256(text_path)
    h = bs.tokenize_text_shard(text_path, out_path, _worker_tokenizer, threads=threads)
    return {"shard": Path(out_path).name, "text": Path(text_path).name, "tokens": h.n_tokens,
            "docs": h.n_docs, "seconds": round(time.perf_counter() - t0, 3),
            "text_bytes": st.st_size, "text_mtime_ns": st.st_mtime_ns, "text_sha256": sha,
            "bin_sha256": runs.file_sha256(out_path)}  # just written: read back from the page cache


def _unchanged(shard: Path, meta: dict, log) -> tuple[int, int, str | None] | None:
    """(size, mtime_ns, sha256) of a text shard that is the one its recorded binary shard was made
    from (binshards_runs.text_shard_unchanged: the loader's rule), else None. A directory from before
    the mtime record gets the shard's stat and hash recorded from now on."""
    st = shard.stat()
    same, sha = runs.text_shard_unchanged(shard, meta)
    if not same:
        return None
    recorded = meta.get("text_sha256") if isinstance(meta.get("text_sha256"), dict) else {}
    if sha is not None:
        log(f"{shard.name}: modified time changed, content did not (same sha256): its binary shard is kept")
    elif isinstance(meta.get("text_mtime_ns"), dict) and shard.name in meta["text_mtime_ns"]:
        sha = recorded.get(shard.name)
    else:
        sha = runs.file_sha256(shard)
    return st.st_size, st.st_mtime_ns, sha


def planned_bytes(text_shard: Path, itemsize: int) -> int:
    """An upper estimate of the binary shard of `text_shard`: its text (the footer's uncompressed
    size) at CHARS_PER_TOKEN_LOW characters a token, plus a BOS and an offset per document."""
    meta = ds.open_text_shard(text_shard).metadata
    text = [meta.schema.column(c).path for c in range(meta.num_columns)].index("text")  # not always column 0
    chars = sum(meta.row_group(i).column(text).total_uncompressed_size for i in range(meta.num_row_groups))
    return bs.HEADER_SIZE + (chars // CHARS_PER_TOKEN_LOW + meta.num_rows) * itemsize + 8 * (meta.num_rows + 2)


def check_disk(out_dir: Path, shards: list[Path], itemsize: int, free: int | None = None, *,
               workers: int = 1) -> int:
    """DiskFullError when out_dir's disk has no room for the binary shards of `shards`; returns the
    bytes planned. A shard rewritten in place (--force, a changed text shard) frees its old file as
    its new one lands, so it needs only what it grows by, plus, while being written, its old size
    (at most `workers` of them at once): --force on a nearly full disk was refused for the whole set."""
    import shutil
    old = [(out_dir / bs.bin_name_for(s)).stat().st_size if (out_dir / bs.bin_name_for(s)).is_file() else 0
           for s in shards]
    need = sum(max(planned_bytes(shard, itemsize) - was, 0) for shard, was in zip(shards, old))
    need += sum(sorted(old)[-max(1, min(workers, len(shards))):]) if shards else 0
    free = shutil.disk_usage(out_dir).free if free is None else free
    if need > free:
        raise DiskFullError(f"{out_dir}: {len(shards)} binary shards need up to ~{fmt_bytes(need)}, "
                            f"{fmt_bytes(free)} free; free space or pass --out on a disk with room "
                            "(shards already written are kept and skipped by a rerun)")
    return need


def check_has_text(shards: list[Path], empty, when: str) -> None:
    """MissingDataError when the train split (all shards but the last) or the val split (the last)
    has no non-empty document, by `empty(shard) -> bool`: the dataloader would refuse it anyway,
    and 0-token shards are no use to anyone."""
    splits = [("train", shards[:-1]), ("val", shards[-1:])] if len(shards) > 1 else [("all", shards)]
    for split, part in splits:
        if all(empty(p) for p in part):
            raise MissingDataError(
                f"no text to tokenize: every document of the {split} split ({', '.join(p.name for p in part)}) "
                f"in {part[0].parent} is empty ({when}); re-create the text shards with documents "
                "(`python -m nanochat.dataset ...`)")


def _bin_empty(out_dir: Path):
    def empty(shard: Path) -> bool:   # BOS only: every document had no text
        h = bs.read_header(out_dir / bs.bin_name_for(shard))
        return h.n_tokens <= h.n_docs
    return empty


def pretokenize(shards: list[Path], out_dir: Path, tokenizer, *, workers: int = 1, threads: int = 1,
                force: bool = False, log=print) -> list[dict]:
    """Tokenize `shards` into out_dir; returns one result dict per shard written."""
    if not shards:
        raise MissingDataError(f"no text shards to pretokenize into {out_dir}")
    check_has_text(shards, lambda p: ds.all_texts_empty(ds.open_text_shard(p)), "its parquet footers say so")
    foreign = runs.foreign_bin_files(out_dir, shards)  # a run deletes stray .bin files: only ours
    if foreign:
        raise RequestError(f"--out: {out_dir} holds {', '.join(p.name for p in foreign[:3])}, which "
                           f"{'is' if len(foreign) == 1 else 'are'} not binary token shards; accepted: a new or "
                           "empty directory, or one pretokenize wrote (pass another --out)")
    with runs.run_lock(out_dir):  # a second run into out_dir is refused, naming this one
        return _pretokenize_locked(shards, out_dir, tokenizer, workers, threads, force, log)


def _pretokenize_locked(shards, out_dir: Path, tokenizer, workers: int, threads: int, force: bool, log) -> list[dict]:
    before = bs.read_meta(out_dir) or {}
    # refuses a directory of another tokenizer, unless --force: then its shards are deleted first
    replaced = runs.write_meta(out_dir, fingerprint=tokenizer.fingerprint, vocab_size=tokenizer.vocab_size,
                               bos_token_id=tokenizer.bos_token_id, replace=force)
    if replaced:
        log(f"removed {len(replaced)} binary shards made with another tokenizer (--force)")
    meta = bs.read_meta(out_dir) or {}
    jobs, kept = _plan(shards, out_dir, tokenizer, meta, force, threads, log)
    log(_summary(before, out_dir, len(shards), len(jobs), force))
    runs._remove_dead_temps(out_dir)  # a killed run's partial shards: before their space is counted
    check_disk(out_dir, [Path(job[0]) for job in jobs], bs.dtype_for_vocab(tokenizer.vocab_size).itemsize,
               workers=workers)
    # nothing to write into a finished directory: it stays finished throughout (a run reading it,
    # e.g. base_train opening its val loader at an evaluation, would refuse it as unfinished)
    untouched = not jobs and _finished_as_planned(out_dir, meta, shards)
    if not untouched:
        for stray in runs.start_run(out_dir, shards, shards[0].parent):  # unfinished from here on
            log(f"removed {stray.name} (no text shard {stray.stem}.parquet any more)")
    for name, (size, mtime_ns, sha) in kept.items():  # a moved mtime / an older record: refreshed
        if (meta.get("text_mtime_ns") or {}).get(name) != mtime_ns:
            runs.record_shard(out_dir, name, size, mtime_ns, sha)
    results, landed = [], _run_jobs(jobs, tokenizer, workers)
    try:
        for r in landed:  # recorded as it lands: a rerun skips it even if this run dies
            runs.record_shard(out_dir, r["text"], r["text_bytes"], r["text_mtime_ns"], r["text_sha256"],
                              bin_sha256=r["bin_sha256"])
            log(f"wrote {r['shard']}: {r['docs']:,} docs, {r['tokens']:,} tokens in {r['seconds']} s")
            results.append(r)
    finally:  # a failure or Ctrl-C killed the other workers mid-shard: their partial shards go now
        landed.close()  # the pool, terminated (its workers killed) if it is still running
        runs._remove_dead_temps(out_dir)
    if not untouched:
        check_has_text(shards, _bin_empty(out_dir), "only BOS after tokenizing")  # footers without statistics
        runs.record_text_shards(out_dir, shards)  # every shard is done: the directory is complete
    return sorted(results, key=lambda r: r["shard"])


def _plan(shards, out_dir: Path, tokenizer, meta: dict, force: bool, threads: int, log):
    """(jobs, kept): the text shards to tokenize, and those whose binary shard is done and kept."""
    jobs, kept = [], {}
    for shard in shards:
        out = out_dir / bs.bin_name_for(shard)
        same_text = _unchanged(shard, meta, log) if out.exists() and not force else None
        if same_text is not None:
            try:  # header, size and offsets, as a reader checks them (the BOS check reads the whole file)
                if bs.BinShard(out, check_bos=False).header.fingerprint == tokenizer.fingerprint:
                    log(f"skip {out.name} (done)")
                    kept[shard.name] = same_text
                    continue
            except ValueError:  # a corrupt leftover is simply rewritten
                pass
        ds.open_text_shard(shard)  # schema errors before any work
        jobs.append((str(shard), str(out), threads))
    return jobs, kept


def _summary(before: dict, out_dir: Path, n: int, todo: int, force: bool) -> str:
    """One line saying what this run does: resumes an unfinished run, starts over, or tops up."""
    if force:
        return f"--force: writing all {n} binary shards into {out_dir}"
    if before.get("complete") is False:
        return (f"resuming the unfinished run in {out_dir}: {n - todo} of {n} binary shards kept, "
                f"{todo} to write")
    if not todo:
        return f"{out_dir} is up to date: all {n} binary shards kept"
    return f"{todo} of {n} binary shards to write into {out_dir}, {n - todo} kept"


def _finished_as_planned(out_dir: Path, meta: dict, shards: list[Path]) -> bool:
    """Whether out_dir is a finished run of exactly `shards` (from their directory): no record to
    change but refreshed mtimes, no stray binary shard to delete."""
    names = {p.name for p in shards}
    return (meta.get("complete") is True and set(meta.get("text_shards") or {}) == names
            and meta.get("data_dir") == str(shards[0].parent.resolve())
            and {p.stem for p in bs.list_bin_shards(out_dir)} == {Path(n).stem for n in names})


def _run_jobs(jobs: list[tuple[str, str, int]], tokenizer, workers: int):
    """Yield each job's result as it finishes (in this process, or a pool of `workers`)."""
    if workers == 1 or len(jobs) <= 1:
        _init_worker(tokenizer)
        for job in jobs:
            yield _tokenize_one(job)
        return
    with mp.get_context().Pool(min(workers, len(jobs)), initializer=_init_pool_worker,
                               initargs=(tokenizer,)) as pool:
        yield from pool.imap_unordered(_tokenize_one, jobs)


def build_parser() -> FlagParser:
    ap = FlagParser(prog="python -m scripts.pretokenize", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=ds.path_flag, default=None,
                    help="text shard directory (default $NANOCHAT_BASE_DIR/base_data)")
    ap.add_argument("--out", type=ds.path_flag, default=None,
                    help="output directory (default <data-dir>_tokens, the only place the dataloader looks: "
                         "shards written elsewhere are not used by training until moved there)")
    ap.add_argument("--tokenizer-dir", type=ds.path_flag, default=None,
                    help="directory holding tokenizer.pkl (default $NANOCHAT_BASE_DIR/tokenizer)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                    help="processes, one text shard each (default: this machine's CPU count, %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="encode threads inside each worker (default 1)")
    ap.add_argument("--force", action="store_true",
                    help="rewrite shards that already exist (those of another tokenizer: deleted first)")
    ap.add_argument("--verify", action="store_true",
                    help="write nothing: read every binary shard in --out whole and check it (header, offsets, "
                         "token ids, the sha256 recorded when it was written); exit 2 naming the damaged ones")
    ap.epilog = ("An interrupted run (Ctrl-C, kill, a full disk) leaves the directory marked unfinished, which "
                 "training refuses; the same command again resumes it, keeping the shards already written. "
                 "One run per --out at a time (a second is refused).")
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, validated (ValueError naming the flag) before any shard is read."""
    args = build_parser().parse_args(argv)
    for flag, value in (("--workers", args.workers), ("--threads", args.threads)):
        require_int(value, flag)
    if args.verify and args.force:
        raise ValueError("--verify: got it with --force; accepted: --verify alone (it writes nothing), "
                         "or --force without --verify")
    return args


def main(argv: list[str] | None = None, tokenizer=None) -> int:
    args = parse(argv)
    data_dir = args.data_dir or ds.default_data_dir()
    out_dir = args.out or bs.default_bin_dir(data_dir)
    if args.verify:   # it writes nothing: shards on a read-only mount can be verified (no writable --out check)
        n = runs.verify(Path(out_dir), data_dir)
        print(f"{out_dir}: all {n} binary shards verified")
        return 0
    out_dir = check_out_dir(out_dir)
    if os.path.realpath(out_dir) == os.path.realpath(data_dir):   # the .bin files among the text shards
        raise RequestError(f"--out: got {out_dir}, the text shard directory (--data-dir) itself; accepted: "
                           f"another directory (default: {bs.default_bin_dir(data_dir)}, where training looks)")
    shards = ds.list_shards(data_dir)
    ds.split_shards(shards, "val")   # one shard: training would refuse the result (no train + val split)
    if tokenizer is None:
        from nanochat.tokenizer import Tokenizer, get_tokenizer

        tokenizer = Tokenizer.load(args.tokenizer_dir) if args.tokenizer_dir else get_tokenizer()
    print(f"pretokenizing {len(shards)} shards from {data_dir} into {out_dir} "
          f"(vocab {tokenizer.vocab_size}, {bs.dtype_for_vocab(tokenizer.vocab_size).name}, "
          f"tokenizer {tokenizer.fingerprint[:12]}, {args.workers} workers)")
    if out_dir.resolve() != bs.default_bin_dir(data_dir).resolve():   # --out was accepted, then unused
        print(f"note: training reads binary shards only from {bs.default_bin_dir(data_dir)} (<data-dir>_tokens); "
              f"move {out_dir} there for base_train to use them, or it tokenizes {data_dir} on the fly")
    t0 = time.perf_counter()
    results = pretokenize(shards, out_dir, tokenizer, workers=args.workers, threads=args.threads,
                          force=args.force)
    dt = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    print(json.dumps({"shards_written": len(results), "tokens": tokens, "seconds": round(dt, 2),
                      "tokens_per_s": round(tokens / dt) if dt > 0 else None}))
    return 0


if __name__ == "__main__":
    import sys

    script_main("pretokenize", lambda: parse(sys.argv[1:]), lambda: main(sys.argv[1:]))
