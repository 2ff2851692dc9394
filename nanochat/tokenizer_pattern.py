"""The split pattern, for nanochat/tokenizer.py: SPLIT_PATTERN (the default) and `_check_pattern`,
what any pattern must pass before tiktoken encodes with it (before training, and whenever a
Tokenizer is built or loaded), and `_rustbpe` (the Rust extension, or ImportError saying how to build it).

tiktoken's encode_ordinary keeps only the regex's matches: text that no match covers vanishes from
the ids without a word, and a pattern that can match the empty string makes it panic (pyo3's
PanicException, a BaseException) or skip a character. So a pattern must compile, can never match
the empty string (rustbpe's structural check), round-trips the probe texts (common contexts:
contractions, \\r\\n, runs, start and end of a text) and covers every code point (each one tried in a
run of its neighbours). The verdict depends on the pattern alone and is kept per process.
"""

from __future__ import annotations

import array
import functools
import json
import sys
import unicodedata

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


def _check_pattern(pattern: str) -> None:
    """ValueError naming `pattern` unless tiktoken can encode all text with it (see the module docs)."""
    problem = _pattern_problem(pattern)
    if problem is not None:
        raise ValueError(problem)


@functools.lru_cache(maxsize=32)
def _pattern_problem(pattern: str) -> str | None:
    """What is wrong with `pattern` (the whole ValueError message), or None. Cached: a DataLoader
    worker or a test builds many Tokenizers with the same pattern."""
    try:
        enc = tiktoken.Encoding(name="pattern-check", pat_str=pattern,
                                mergeable_ranks={bytes([b]): b for b in range(256)}, special_tokens={})
    except ValueError as e:  # tiktoken's compile error (or lone surrogates), without the argument's name
        return (f"pattern: invalid regex {pattern!r} ({e}); accepted: a regex tiktoken compiles "
                "(default: SPLIT_PATTERN)")
    if pattern != SPLIT_PATTERN:
        # The probes only see the characters they hold: `...|\p{Co}*` passed them all, and then
        # dropped every unassigned code point from encoded text (an empty match skips it) or
        # panicked tiktoken on one at the start. Judged from the regex's structure, whatever the text.
        try:
            _rustbpe().check_pattern(pattern)
        except ValueError as e:   # rustbpe's message names `pattern` already
            return str(e)
    for probe in _PATTERN_PROBES:
        got, failure = _round_trip(enc, probe)
        if failure is not None:
            return (f"pattern: {pattern!r} breaks tiktoken on {probe!r} ({failure}); accepted: a regex that "
                    "never matches the empty string")
        if got != probe.encode("utf-8"):
            return (f"pattern: {pattern!r} leaves part of {probe!r} unmatched (tiktoken keeps "
                    f"{got.decode('utf-8', 'replace')!r}, dropping the rest); {_ACCEPTED}")
    # SPLIT_PATTERN covers every code point (tested): spared the ~0.3 s every script would pay at start
    return None if pattern == SPLIT_PATTERN else _coverage_problem(pattern, enc)


def _round_trip(enc: tiktoken.Encoding, text: str) -> tuple[bytes, str | None]:
    """The bytes tiktoken keeps of `text`, or (b"", what it raised): PanicException derives from
    BaseException only."""
    try:
        return enc.decode_bytes(enc.encode_ordinary(text)), None
    except BaseException as e:
        if isinstance(e, (KeyboardInterrupt, SystemExit, GeneratorExit)):
            raise
        return b"", f"{type(e).__name__}: {e}"


def _coverage_problem(pattern: str, enc: tiktoken.Encoding) -> str | None:
    """The first code point no match covers, in runs of _COVERAGE_BLOCK consecutive code points
    (surrogates aside: tiktoken encodes a lone one as U+FFFD). The probe texts missed whole Unicode
    categories: `\\p{L}+|\\p{N}+|\\s+|[\\p{P}\\p{S}\\p{M}\\p{Cc}\\p{Cf}]+` passed them, then dropped
    every private-use and unassigned character from what it encoded; a pattern built on `\\w` lost
    U+200C (ZWNJ, common in Persian) and U+203F."""
    code_points = _all_code_points()
    for start in range(0, len(code_points), _COVERAGE_BLOCK):
        block = code_points[start:start + _COVERAGE_BLOCK]
        got, failure = _round_trip(enc, block)
        want = block.encode("utf-8")
        if failure is not None:
            return (f"pattern: {pattern!r} breaks tiktoken on the code points U+{ord(block[0]):04X}.."
                    f"U+{ord(block[-1]):04X} ({failure}); accepted: a regex tiktoken can run on any text")
        if got != want:
            # the first byte that differs lies in the first dropped character (UTF-8 is prefix-free,
            # and each character occurs once in the block)
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(got))
            ch = block[len(want[:first].decode("utf-8", "ignore"))]
            return (f"pattern: {pattern!r} leaves {json.dumps(ch)} of the text unmatched (U+{ord(ch):04X}, "
                    f"Unicode category {unicodedata.category(ch)}: no match covers it, so tiktoken drops it "
                    f"from the ids, silently); {_ACCEPTED}")
    return None


def _all_code_points() -> str:
    """Every code point but the surrogates, in order (decoded from UTF-32: joining 1.1M chr() took ~0.3 s)."""
    codes = array.array("I", range(0xD800))
    codes.extend(range(0xE000, 0x110000))
    if codes.itemsize != 4:  # pragma: no cover  (4 wherever CPython runs)
        return "".join(map(chr, codes))
    return codes.tobytes().decode("utf-32-le" if sys.byteorder == "little" else "utf-32-be")
