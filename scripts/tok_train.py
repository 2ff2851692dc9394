"""Train the project's BPE tokenizer on the training shards and save it.

    python -m scripts.tok_train                      # 32768 tokens on up to 2e9 chars
    python -m scripts.tok_train --vocab-size 4096 --max-chars 5e7 --data-dir DIR --output-dir DIR

Reads documents from the train split (nanochat.dataset), caps each at --doc-cap characters and
stops after --max-chars in total, trains with rustbpe, checks an encode/decode round trip and
writes tokenizer.pkl + token_bytes.pt to --output-dir (default: <base dir>/tokenizer). A different
tokenizer already there is kept in <output dir>/replaced/<its fingerprint>/ (checkpoints made with
it need it back).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from nanochat.dataset import path_flag
from nanochat.flags import FlagParser, script_main
from nanochat.errors import RequestError
from nanochat.tokenizer import (MAX_TRAIN_BATCH_SIZE, MAX_TRAIN_THREADS, MAX_VOCAB_SIZE, SPECIAL_TOKENS, Tokenizer,
                                VocabTooLargeError, tokenizer_dir)

# Text the sanity check round-trips: prose, code, digits, whitespace runs, non-ASCII, and a typed
# special-token string that must come back as plain text.
SANITY_TEXT = (
    "The quick brown fox jumps over the lazy dog; it's 2024-06-01, 12:34:56.\n"
    "def add(a, b):\n    return a + b  # tabs\tand  double  spaces\n\n"
    "Ünïcödé: café, naïve, 東京, Привет, 🙂. A user typed <|bos|> and <|assistant_end|> here."
)


def count(text: str) -> int:
    """argparse type for character counts: accepts 2000000, 2_000_000 and 2e9."""
    try:
        value = float(text.replace("_", "")) if any(c in text for c in ".eE") else int(text)
        if value != int(value):
            raise ValueError
        return int(value)
    except (ValueError, OverflowError):  # OverflowError: int(float("1e999"))
        raise argparse.ArgumentTypeError(f"got {text!r}; accepted: a whole number such as 2e9") from None


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(prog="python -m scripts.tok_train", description=__doc__.split("\n")[0])
    p.add_argument("--vocab-size", dest="vocab_size", type=int, default=32768,
                   help="total vocabulary including the special tokens (default 32768)")
    p.add_argument("--max-chars", dest="max_chars", type=count, default=2_000_000_000,
                   help="stop after this many characters of training text (default 2e9)")
    p.add_argument("--doc-cap", dest="doc_cap", type=count, default=10_000,
                   help="use at most this many characters of each document (default 10000)")
    p.add_argument("--tokenizer-threads", dest="tokenizer_threads", type=int, default=None,
                   help=f"rayon threads for training, 1..{MAX_TRAIN_THREADS} (default: RAYON_NUM_THREADS if set "
                        "and not 0, else all cores)")
    p.add_argument("--tokenizer-batch-size", dest="tokenizer_batch_size",
                   type=int, default=8192, help="documents handed to Rust per batch (default 8192)")
    p.add_argument("--data-dir", dest="data_dir", type=path_flag, default=None,
                   help="directory of parquet shards (default: <base dir>/base_data)")
    p.add_argument("--output-dir", dest="output_dir", type=path_flag, default=None,
                   help="where to write the tokenizer (default: <base dir>/tokenizer)")
    return p


def validate(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for any out-of-range value (before any data is read)."""
    min_vocab = 256 + len(SPECIAL_TOKENS)
    if not min_vocab <= args.vocab_size <= MAX_VOCAB_SIZE:
        raise ValueError(f"--vocab-size: got {args.vocab_size}; accepted: {min_vocab}..{MAX_VOCAB_SIZE}")
    for flag, value in (("--max-chars", args.max_chars), ("--doc-cap", args.doc_cap),
                        ("--tokenizer-batch-size", args.tokenizer_batch_size),
                        ("--tokenizer-threads", args.tokenizer_threads)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}: got {value}; accepted: a positive integer")
    if args.tokenizer_threads is not None and args.tokenizer_threads > MAX_TRAIN_THREADS:
        raise ValueError(f"--tokenizer-threads: got {args.tokenizer_threads}; accepted: 1..{MAX_TRAIN_THREADS}")
    if args.tokenizer_batch_size > MAX_TRAIN_BATCH_SIZE:   # else refused only once the data was opened
        raise ValueError(f"--tokenizer-batch-size: got {args.tokenizer_batch_size}; accepted: "
                         f"1..{MAX_TRAIN_BATCH_SIZE}")
    if args.output_dir is not None:   # a file, or a path under one: refused before training, not after
        from nanochat.flags import check_out_dir
        check_out_dir(args.output_dir, "--output-dir")


def training_text(data_dir: Path, max_chars: int, doc_cap: int, stats: dict) -> Iterator[str]:
    """Train-split documents, each cut to doc_cap chars, until max_chars have been yielded."""
    from nanochat.dataset import iter_documents

    for text, _cursor in iter_documents(data_dir, "train"):
        stats["capped"] += len(text) > doc_cap
        text = text[: min(doc_cap, max_chars - stats["chars"])]
        stats["docs"] += 1
        stats["chars"] += len(text)
        yield text
        if stats["chars"] >= max_chars:
            return


def check_shards(shards: list[Path]) -> None:
    """Open every train shard (its footer only: milliseconds each), so a truncated or foreign file
    raises DataError naming it now, not after training has read every shard before it."""
    from nanochat.dataset import open_text_shard

    for shard in shards:
        open_text_shard(shard)


def sanity_check(tok: Tokenizer) -> None:
    ids = tok.encode(SANITY_TEXT)
    if tok.decode(ids) != SANITY_TEXT:
        sys.exit("tok_train: sanity check FAILED: decode(encode(text)) != text")
    if set(ids) & {tok.encode_special(name) for name in SPECIAL_TOKENS}:
        sys.exit("tok_train: sanity check FAILED: plain text produced a special token")
    nbytes = len(SANITY_TEXT.encode("utf-8"))
    print(f"sanity check: round trip OK, {nbytes} bytes -> {len(ids)} tokens "
          f"({nbytes / len(ids):.2f} bytes/token), no special tokens from typed text")


def previous_fingerprint(output_dir: Path) -> str | None:
    """The fingerprint of the tokenizer already in output_dir, None when there is none (or it is
    unreadable: then nothing that depends on it loads either)."""
    from nanochat.tokenizer import TokenizerError

    try:
        return Tokenizer.load(output_dir).fingerprint
    except TokenizerError:
        return None


def threads_label(threads: int | None) -> str:
    """What the training threads will be: --tokenizer-threads, else RAYON_NUM_THREADS (rustbpe
    reads it; 0 or empty = all cores), else all cores."""
    env = os.environ.get("RAYON_NUM_THREADS", "").strip()
    return str(threads) if threads else f"RAYON_NUM_THREADS={env}" if env not in ("", "0") else "all"


def too_little_text(args: argparse.Namespace, stats: dict, data_dir: Path, supported: int) -> RequestError:
    """The error for a --vocab-size the text read cannot reach, naming the flag(s) that limited it."""
    raise_flags = (["--max-chars"] if stats["chars"] >= args.max_chars else []) + \
        (["--doc-cap"] if stats["capped"] else [])
    more = f"raise {' / '.join(raise_flags)}" if raise_flags else \
        "more documents (the whole train split was read)"
    return RequestError(
        f"--vocab-size: got {args.vocab_size}, but the {stats['docs']:,} documents ({stats['chars']:,} chars) read "
        f"from the train split of {data_dir} support at most {supported} (then no pair is left to merge); "
        f"accepted: --vocab-size {supported} or less, or more text: {more}")


def keep_replaced(output_dir: Path, fingerprint: str) -> Path:
    """Copy the tokenizer about to be replaced into output_dir/replaced/<fingerprint[:16]>/: checkpoints
    made with it load only beside it ("restore the original tokenizer"), and retraining it needs the
    same text and flags. Copied, not moved: output_dir holds a whole tokenizer throughout."""
    import shutil

    from nanochat.tokenizer import PICKLE_NAME, TOKEN_BYTES_NAME

    kept = Path(output_dir) / "replaced" / fingerprint[:16]
    kept.mkdir(parents=True, exist_ok=True)
    for name in (TOKEN_BYTES_NAME, PICKLE_NAME):   # the pickle last: it names what the folder holds
        if (Path(output_dir) / name).is_file():
            shutil.copy2(Path(output_dir) / name, kept / name)
    return kept


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags, validated before any data is read: a bad one raises ValueError naming it (under
    script_main one line, exit 2)."""
    args = build_parser().parse_args(argv)
    validate(args)
    return args


def main(argv: list[str] | None = None) -> None:
    """Missing or damaged data raises MissingDataError / DataError (RequestErrors: under
    script_main one line, exit 2)."""
    args = parse(argv)
    from nanochat.dataset import default_data_dir, list_shards, split_shards

    data_dir = args.data_dir if args.data_dir is not None else default_data_dir()
    output_dir = args.output_dir if args.output_dir is not None else tokenizer_dir()
    if args.output_dir is None:   # validate checked an explicit one; the default can be a file too
        from nanochat.flags import check_out_dir
        check_out_dir(output_dir, "--output-dir (default <base dir>/tokenizer)")
    shards = split_shards(list_shards(data_dir), "train")
    check_shards(shards)

    print("tok_train config:")
    for key, value in (("vocab_size", args.vocab_size), ("max_chars", f"{args.max_chars:,}"),
                       ("doc_cap", f"{args.doc_cap:,}"), ("tokenizer_threads", threads_label(args.tokenizer_threads)),
                       ("tokenizer_batch_size", args.tokenizer_batch_size), ("data_dir", data_dir),
                       ("train_shards", len(shards)), ("output_dir", output_dir)):
        print(f"  {key:<22} {value}")

    stats = {"docs": 0, "chars": 0, "capped": 0}
    t0 = time.perf_counter()
    try:
        tok = Tokenizer.train(training_text(data_dir, args.max_chars, args.doc_cap, stats), args.vocab_size,
                              threads=args.tokenizer_threads, batch_size=args.tokenizer_batch_size)
    except RequestError:  # a damaged shard (DataError): already names the file
        raise
    except VocabTooLargeError as e:
        raise too_little_text(args, stats, data_dir, e.supported) from e
    except ValueError as e:  # e.g. no text in the train split
        raise RequestError(f"cannot train a tokenizer on the train split of {data_dir}: {e}") from e
    elapsed = time.perf_counter() - t0
    print(f"trained on {stats['docs']:,} documents ({stats['chars']:,} chars) in {elapsed:.2f} s: "
          f"vocab_size {tok.vocab_size} ({tok.vocab_size - 256 - len(SPECIAL_TOKENS)} merges + 256 bytes "
          f"+ {len(SPECIAL_TOKENS)} special)")

    sanity_check(tok)
    replaced = previous_fingerprint(output_dir)
    kept = keep_replaced(output_dir, replaced) if replaced not in (None, tok.fingerprint) else None
    tok.save(output_dir)
    if kept is not None:   # silently, checkpoints of the old one stopped loading
        print(f"replaced the tokenizer {replaced[:12]} that was in {output_dir}: checkpoints and binary token "
              f"shards made with it no longer match (retrain / re-run pretokenize); it is kept in {kept}: copy "
              f"its two files back into {output_dir} to restore it")
    print(f"saved {output_dir / 'tokenizer.pkl'} and {output_dir / 'token_bytes.pt'}")
    print(f"fingerprint {tok.fingerprint}")
    if Path(output_dir).resolve() != tokenizer_dir().resolve():
        return   # not the base dir's tokenizer: its report is not about this one
    from nanochat.report import get_report   # report.md's tokenizer section (it had none)
    get_report().log("Tokenizer training", {
        "vocab_size": tok.vocab_size, "merges": tok.vocab_size - 256 - len(SPECIAL_TOKENS),
        "documents": stats["docs"], "characters": stats["chars"], "train_time_s": round(elapsed, 2),
        "max_chars": args.max_chars, "doc_cap": args.doc_cap, "data_dir": str(data_dir),
        "output_dir": str(output_dir), "fingerprint": tok.fingerprint[:16],
        **({"replaced": replaced[:16]} if replaced not in (None, tok.fingerprint) else {})})


if __name__ == "__main__":
    script_main("tok_train", lambda: parse(sys.argv[1:]), lambda: main(sys.argv[1:]))
