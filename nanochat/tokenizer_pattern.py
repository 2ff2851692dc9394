"""The split pattern, for nanochat/tokenizer.py: SPLIT_PATTERN (the default) and `_check_pattern`,
what any pattern must pass before tiktoken encodes with it (before training, and whenever a
Tokenizer is built or loaded), and `_rustbpe` (the Rust extension, or ImportError saying how to build it).

tiktoken's encode_ordinary keeps only the regex's matches: text that no match covers vanishes from
the ids without a word, and a pattern that can match the empty string makes it panic (pyo3's
PanicException, a BaseException) or skip a character. So a pattern must compile, can never match
the empty string nor use \\K (rustbpe's structural checks), round-trips the probe texts (common contexts:
contractions, \\r\\n, runs, start and end of a text) and covers every code point (each one tried in a
run of its neighbours). The verdict depends on the pattern alone and is kept per process.

A new tokenizer (training, or one constructed from a pattern and ranks) must pass all of it. One
that already exists (tokenizer.pkl, and every checkpoint built on it) is only refused when its
pattern cannot work at all (invalid, can match the empty string, panics tiktoken): one that merely
leaves some characters unmatched dropped them when it was trained too, so it loads, with one
DroppedTextWarning per file and process (`warn_dropped_text`) saying what is lost and how to avoid it.
"""

from __future__ import annotations

import array
import functools
import json
import sys
import unicodedata
import warnings
from pathlib import Path

import tiktoken

# GPT-4's (cl100k) split pattern, except that numbers split into runs of at most two digits
# (GPT-4 uses three), which spends fewer vocabulary entries on numbers in a small vocab.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# Each category alone, at the start and end of a text, and mixed.
_PATTERN_PROBES = (
    "a", "Z", "\u00e9", "\u4e2d", "7", "\u0663", "\u00bd", " ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u3000",
    "\u2028", ".", "'", "'s", "'LL", "\U0001f600", "\x00", "\x1c", "\u0301", "\u200d", "\ufeff", "  lead", "trail  ",
    "_", "snake_case", " a", "a ", "a b", "ab  cd", "x\n\n\ty", "1234567", "-1.5e9", "Hello, world! It's 2024-06-01.\n\n"
    "  def f(x):\n\treturn {'a': [x ** 2]}  # ok\r\n\u6771\u4eac \u041f\u0440\u0438 \U0001f642\u200d \u3000 ?!",
)
_COVERAGE_BLOCK = 1024   # code points per text of the every-character check (short: no backtracking limit)
_ACCEPTED = "accepted: a regex whose matches cover every character, e.g. ending in |\\s+|."


def _rustbpe():
    """The rustbpe extension (rustbpe/), or ImportError saying how to build or rebuild it."""
    import rustbpe  # the in-tree Rust extension, built with maturin

    if not hasattr(rustbpe, "Tokenizer"):  # the bare rustbpe/ source dir imported as a namespace
        raise ImportError("the rustbpe extension is not built/installed: build it from rustbpe/ "
                          "(e.g. `uv pip install -p .venv/bin/python ./rustbpe`, as setup.sh does)")
    if "threads" not in (rustbpe.Tokenizer.train_from_iterator.__text_signature__ or "") \
            or not hasattr(rustbpe, "check_pattern"):
        raise ImportError("the installed rustbpe extension is older than rustbpe/ (no `threads` argument or "
                          "no check_pattern): rebuild it (e.g. `uv pip install -p .venv/bin/python ./rustbpe`)")
    return rustbpe


class DroppedTextWarning(UserWarning):
    """An existing tokenizer's split pattern leaves some characters unmatched: text holding them
    loses them from its token ids (it loaded anyway; see warn_dropped_text)."""


_warned: set[tuple[str, str]] = set()   # (file, pattern) already warned about in this process


def _check_pattern(pattern: str, *, existing: bool = False) -> str | None:
    """ValueError naming `pattern` unless tiktoken can encode all text with it (see the module docs).
    `existing`: the pattern of a tokenizer that already exists; one whose only fault is leaving
    characters unmatched is then returned as the first such character (for warn_dropped_text), not
    refused. Returns None when the pattern covers everything."""
    problem = _pattern_problem(pattern)
    if problem is None:
        return None
    message, dropped = problem
    if existing and dropped is not None:
        return dropped
    raise ValueError(message)


def warn_dropped_text(path: str | Path, pattern: str, dropped: str) -> None:
    """One DroppedTextWarning per (file, pattern) and process: the tokenizer at `path` loads, but its
    pattern leaves `dropped` (the first such character) and others unmatched."""
    key = (str(Path(path).resolve()), pattern)
    if key in _warned:
        return
    _warned.add(key)
    shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
    warnings.warn(
        f"tokenizer at {path}: its split pattern {shown!r} leaves some characters unmatched, the first "
        f"{json.dumps(dropped)} (U+{ord(dropped):04X}, Unicode category {unicodedata.category(dropped)}): "
        "text containing them loses them from its token ids, as it did when this tokenizer was trained; "
        "loaded anyway. To avoid it, retrain the tokenizer with a pattern whose matches cover every "
        "character (the default, used by `python -m scripts.tok_train`, does), then the models built on it.",
        DroppedTextWarning, stacklevel=3)


@functools.lru_cache(maxsize=32)
def _pattern_problem(pattern: str) -> tuple[str, str | None] | None:
    """None when `pattern` passes, else (the whole ValueError message, the first character it leaves
    unmatched when that is all that is wrong, else None: it cannot work at all). Cached: a DataLoader
    worker or a test builds many Tokenizers with the same pattern."""
    try:
        enc = tiktoken.Encoding(name="pattern-check", pat_str=pattern,
                                mergeable_ranks={bytes([b]): b for b in range(256)}, special_tokens={})
    except ValueError as e:  # tiktoken's compile error (or lone surrogates), without the argument's name
        return (f"pattern: invalid regex {pattern!r} ({e}); accepted: a regex tiktoken compiles "
                "(default: SPLIT_PATTERN)"), None
    if pattern != SPLIT_PATTERN:
        # The probes only see the characters they hold: `...|\p{Co}*` passed them all, and then
        # dropped every unassigned code point from encoded text (an empty match skips it) or
        # panicked tiktoken on one at the start. Judged from the regex's structure, whatever the text.
        try:
            _rustbpe().check_pattern(pattern)
        except ValueError as e:   # rustbpe's message names `pattern` already
            return str(e), None
    dropped = None   # the first probe a pattern leaves partly unmatched: (message, character)
    for probe in _PATTERN_PROBES:
        got, failure = _round_trip(enc, probe)
        if failure is not None:
            return (f"pattern: {pattern!r} breaks tiktoken on {probe!r} ({failure}); accepted: a regex that "
                    "never matches the empty string"), None
        if got != probe.encode("utf-8") and dropped is None:
            message = (f"pattern: {pattern!r} leaves part of {probe!r} unmatched (tiktoken keeps "
                       f"{got.decode('utf-8', 'replace')!r}, dropping the rest); {_ACCEPTED}")
            dropped = message, _first_dropped(probe, got)
    # SPLIT_PATTERN covers every code point (tested): spared the ~0.3 s every script would pay at start
    if pattern == SPLIT_PATTERN:
        return dropped
    # scanned even after a probe dropped text: a code point that panics tiktoken must still refuse
    # an existing tokenizer's pattern, which one that only drops text does not
    problem = _coverage_problem(pattern, enc)
    if problem is not None and problem[1] is None:
        return problem
    return dropped or problem


def _first_dropped(text: str, got: bytes) -> str:
    """The first character of `text` missing from `got` (the bytes tiktoken kept of it, its matches in
    order): the first byte that differs lies in it (UTF-8 is prefix-free)."""
    want = text.encode("utf-8")
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
    return text[len(want[:first].decode("utf-8", "ignore"))]


def _round_trip(enc: tiktoken.Encoding, text: str) -> tuple[bytes, str | None]:
    """The bytes tiktoken keeps of `text`, or (b"", what it raised): PanicException derives from
    BaseException only."""
    try:
        return enc.decode_bytes(enc.encode_ordinary(text)), None
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        return b"", f"{type(e).__name__}: {e}"


def _coverage_problem(pattern: str, enc: tiktoken.Encoding) -> tuple[str, str | None] | None:
    """_pattern_problem's verdict on every code point, in runs of _COVERAGE_BLOCK consecutive ones
    (surrogates aside: tiktoken encodes a lone one as U+FFFD): the first one no match covers, unless
    some run panics tiktoken (every run is tried). The probe texts missed whole Unicode categories:
    `\\p{L}+|\\p{N}+|\\s+|[\\p{P}\\p{S}\\p{M}\\p{Cc}\\p{Cf}]+` passed them, then dropped every
    private-use and unassigned character from what it encoded; a pattern built on `\\w` lost U+200C
    (ZWNJ, common in Persian) and U+203F."""
    code_points = _all_code_points()
    dropped = None
    for start in range(0, len(code_points), _COVERAGE_BLOCK):
        block = code_points[start:start + _COVERAGE_BLOCK]
        got, failure = _round_trip(enc, block)
        if failure is not None:
            return (f"pattern: {pattern!r} breaks tiktoken on the code points U+{ord(block[0]):04X}.."
                    f"U+{ord(block[-1]):04X} ({failure}); accepted: a regex tiktoken can run on any text"), None
        if dropped is None and got != block.encode("utf-8"):
            ch = _first_dropped(block, got)   # each character occurs once in the block
            message = (f"pattern: {pattern!r} leaves {json.dumps(ch)} of the text unmatched (U+{ord(ch):04X}, "
                       f"Unicode category {unicodedata.category(ch)}: no match covers it, so tiktoken drops "
                       f"it from the ids, silently); {_ACCEPTED}")
            dropped = message, ch
    return dropped


def _all_code_points() -> str:
    """Every code point but the surrogates, in order (decoded from UTF-32: joining 1.1M chr() took ~0.3 s)."""
    codes = array.array("I", range(0xD800))
    codes.extend(range(0xE000, 0x110000))
    if codes.itemsize != 4:  # pragma: no cover  (4 wherever CPython runs)
        return "".join(map(chr, codes))
    return codes.tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")
