"""Evaluate the trained tokenizer's compression (UTF-8 bytes per token) on train and val text.

    python -m scripts.tok_eval [--num-docs 1000] [--data-dir DIR] [--tokenizer-dir DIR]

Encodes the first --num-docs documents of each split and prints one JSON line per (split,
tokenizer) and a table. GPT-2 and GPT-4 (cl100k_base) are compared only when tiktoken has their
files in its local cache: they are loaded with downloads blocked, and skipped (with the reason)
otherwise, so this script never touches the network.
"""

from __future__ import annotations

import argparse
import json
import sys
from itertools import islice
from pathlib import Path

from nanochat.dataset import path_flag
from nanochat.flags import FlagParser
from nanochat.tiktoken_offline import REFERENCES, load_reference
from nanochat.tokenizer import Tokenizer, encode_ordinary_batch, tokenizer_dir

# Encoding threads accepted (as rustbpe's training threads): more is a typo, and tiktoken would start
# one thread per document up to it (--threads 100000 --num-docs 100000: 100,000 threads per split).
MAX_ENCODE_THREADS = 1024


def first_docs(data_dir: Path, split: str, n: int) -> list[str]:
    from nanochat.dataset import iter_documents

    return [text for text, _cursor in islice(iter_documents(data_dir, split), n)]


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m scripts.tok_eval", description=__doc__.split("\n")[0])
    p.add_argument("--num-docs", dest="num_docs", type=int, default=1000,
                   help="documents per split to encode (default 1000)")
    p.add_argument("--data-dir", dest="data_dir", type=path_flag, default=None,
                   help="directory of parquet shards (default: <base dir>/base_data)")
    p.add_argument("--tokenizer-dir", dest="tokenizer_dir", type=path_flag, default=None,
                   help="directory holding tokenizer.pkl (default: <base dir>/tokenizer)")
    p.add_argument("--threads", type=int, default=8, help=f"encoding threads, 1..{MAX_ENCODE_THREADS} (default 8)")
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for flag, value in (("--num-docs", args.num_docs), ("--threads", args.threads)):
        if value < 1:
            raise ValueError(f"{flag}: got {value}; accepted: a positive integer")
    if args.threads > MAX_ENCODE_THREADS:   # tiktoken starts one thread per document up to it
        raise ValueError(f"--threads: got {args.threads}; accepted: 1..{MAX_ENCODE_THREADS}")
    return args


def main(argv: list[str] | None = None) -> None:
    """A missing tokenizer (TokenizerError) or missing / damaged shards (MissingDataError /
    DataError) raise RequestErrors: under script_main one line, exit 2."""
    args = parse(argv)
    ours = Tokenizer.load(args.tokenizer_dir if args.tokenizer_dir is not None else tokenizer_dir())
    from nanochat.dataset import default_data_dir

    data_dir = args.data_dir if args.data_dir is not None else default_data_dir()
    texts = {split: first_docs(data_dir, split, args.num_docs) for split in ("train", "val")}
    for split, docs in texts.items():   # bytes per token of no bytes: a table of NaNs, not a measurement
        if not any(docs):
            from nanochat.errors import DataError
            what = f"the first {len(docs)} {split} document(s) hold no text" if docs else f"no {split} documents"
            raise DataError(f"{data_dir}: {what} (column 'text'), so there is nothing to measure; check the "
                            "shards (e.g. re-download them)")

    # Each encoder as (label, vocab size, batch encode function).
    encoders = [("ours", ours.vocab_size, lambda docs: ours.encode(docs, num_threads=args.threads))]
    skipped: dict[str, str] = {}   # reference label -> why it was not compared
    for name, label in REFERENCES:
        enc, why = load_reference(name)
        if enc is None:
            print(f"{label} ({name}) comparison skipped: {why}")
            skipped[label] = why
            continue
        encoders.append((label, enc.n_vocab,
                         lambda docs, enc=enc: encode_ordinary_batch(enc, docs, args.threads)))

    rows = []
    for split, docs in texts.items():
        nbytes = sum(len(d.encode("utf-8")) for d in docs)
        for label, vocab, encode in encoders:
            ntokens = sum(len(ids) for ids in encode(docs)) if docs else 0
            row = {"split": split, "tokenizer": label, "vocab_size": vocab, "docs": len(docs),
                   "bytes": nbytes, "tokens": ntokens,
                   "bytes_per_token": round(nbytes / ntokens, 4) if ntokens else None}
            rows.append(row)
            print(json.dumps(row))

    print_table(rows, [label for label, _, _ in encoders])
    log_report(ours, args, data_dir, rows, skipped)


def log_report(ours: Tokenizer, args: argparse.Namespace, data_dir: Path, rows: list[dict],
               skipped: dict[str, str]) -> None:
    """report.md's "Tokenizer evaluation" section (report.md had tok_train's section and none of
    this stage's): bytes per token per split and tokenizer, for the base dir's tokenizer only."""
    if args.tokenizer_dir is not None and Path(args.tokenizer_dir).resolve() != tokenizer_dir().resolve():
        return   # another tokenizer than the pipeline's: the report is not about it
    from nanochat.report import get_report

    per_split: dict[str, dict] = {}
    for row in rows:
        per_split.setdefault(row["split"], {"docs": row["docs"], "bytes": row["bytes"]})[
            f"{row['tokenizer']} bytes/token"] = row["bytes_per_token"]
    get_report().log("Tokenizer evaluation", {
        "vocab_size": ours.vocab_size, "fingerprint": ours.fingerprint[:16], "num_docs": args.num_docs,
        "data_dir": str(data_dir), **per_split, **({"skipped": skipped} if skipped else {})})


def print_table(rows: list[dict], labels: list[str]) -> None:
    """One line per split: bytes/token of each tokenizer, and ours relative to each reference
    (positive = ours compresses better)."""
    header = f"{'split':<6} {'docs':>6} {'bytes':>12}" + "".join(f" {lab + ' B/tok':>14}" for lab in labels)
    header += "".join(f" {'vs ' + lab:>10}" for lab in labels[1:])
    print(header)
    print("-" * len(header))
    for split in dict.fromkeys(r["split"] for r in rows):
        by = {r["tokenizer"]: r for r in rows if r["split"] == split}
        first = by[labels[0]]
        line = f"{split:<6} {first['docs']:>6} {first['bytes']:>12,}"
        line += "".join(f" {by[lab]['bytes_per_token'] or float('nan'):>14.3f}" for lab in labels)
        for lab in labels[1:]:
            ref, own = by[lab]["tokens"], first["tokens"]
            line += f" {100.0 * (ref - own) / ref:>+9.1f}%" if ref else f" {'n/a':>10}"
        print(line)
    if len(labels) > 1:
        print("vs X: tokens ours saves relative to X on the same text (positive = ours is shorter)")


if __name__ == "__main__":
    from nanochat.flags import script_main

    script_main("tok_eval", lambda: parse(sys.argv[1:]), lambda: main(sys.argv[1:]))
