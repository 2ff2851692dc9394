"""Tokenizer review 15 (as a demanding user): a tokenizer that is loaded or constructed, not trained,
gets the same split-pattern check as a trained one."""

import pickle

import pytest
import tiktoken

from nanochat.tokenizer import (FORMAT_VERSION, PICKLE_NAME, SPECIAL_TOKENS, Tokenizer, TokenizerError,
                                _compute_fingerprint)

# Covers every character the probe texts hold, but an unassigned code point (U+0378) reaches
# `\p{Co}*` and matches it as "": tiktoken then drops that character (or panics at a text's start).
STAR_PATTERN = r"\p{L}+|\p{N}+|\s+|[\p{P}\p{S}\p{M}\p{Cc}\p{Cf}]+|\p{Co}*"
BYTE_RANKS = {bytes([b]): b for b in range(256)}


def test_constructing_a_tokenizer_with_a_pattern_that_can_match_empty_is_refused():
    """Only training ran rustbpe's structural check; the constructor ran the probe texts alone, which
    this pattern passes, and the tokenizer encoded "a\\u0378b" as "ab" (text lost without a word)."""
    raw = tiktoken.Encoding("t", pat_str=STAR_PATTERN, mergeable_ranks=BYTE_RANKS, special_tokens={})
    assert raw.decode(raw.encode_ordinary("a\u0378b")) == "ab"   # what the tokenizer did with it
    with pytest.raises(ValueError, match=r"^pattern: .* can match the empty string"):
        Tokenizer(STAR_PATTERN, BYTE_RANKS)


def test_loading_a_file_with_such_a_pattern_is_a_tokenizer_error_naming_it(tmp_path):
    """A tokenizer.pkl whose contents agree with its fingerprint (made by hand, or by code from before
    training checked the pattern's structure) loaded, and then dropped characters from user text."""
    payload = {"format_version": FORMAT_VERSION, "pattern": STAR_PATTERN, "mergeable_ranks": BYTE_RANKS,
               "special_tokens": list(SPECIAL_TOKENS),
               "fingerprint": _compute_fingerprint(STAR_PATTERN, BYTE_RANKS, SPECIAL_TOKENS)}
    (tmp_path / PICKLE_NAME).write_bytes(pickle.dumps(payload, protocol=4))
    with pytest.raises(TokenizerError, match="can match the empty string") as info:
        Tokenizer.load(tmp_path)
    assert str(tmp_path / PICKLE_NAME) in str(info.value)


def test_covering_custom_patterns_still_construct_and_load(tmp_path):
    for pattern in (r"\S+|\s+", r"(?=a)a+|[^a]+"):
        tok = Tokenizer(pattern, BYTE_RANKS)
        tok.save(tmp_path / "t")
        back = Tokenizer.load(tmp_path / "t")
        assert back.fingerprint == tok.fingerprint
        assert back.decode(back.encode("a\u0378b ok")) == "a\u0378b ok"


def _peak_bytes_while(call) -> tuple[int, str]:
    """(peak bytes Python allocated while `call` raised its ValueError, the message)."""
    import tracemalloc

    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as info:
            call()
        return tracemalloc.get_traced_memory()[1], str(info.value)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("case", ["encode bytes", "bytes item", "str corpus", "state"])
def test_rustbpe_errors_about_a_huge_argument_show_only_its_start(case):
    """rustbpe built the whole repr of a bad argument and then showed its first 60 characters: a
    20 MB bytes document (an iterator of file contents, or encode(data)) cost ~80 MB and a second of
    work for one error line (a 200 MB one 1 GB). Now only the part it shows is repr'd."""
    import rustbpe

    big, text, state = b"\xff" * 20_000_000, "x" * 20_000_000, (1, "x", [[1, 2]] * 2_000_000)
    trainer = rustbpe.Tokenizer()
    call = {"encode bytes": lambda: trainer.encode(big),
            "bytes item": lambda: trainer.train_from_iterator(iter(["ok", big]), 300),
            "str corpus": lambda: trainer.train_from_iterator(text, 300),
            "state": lambda: trainer.__setstate__(state)}[case]
    peak, message = _peak_bytes_while(call)
    assert peak < 2_000_000, f"{peak:,} bytes allocated for the error"
    shown = {"encode bytes": r"b'\xff\xff", "bytes item": r"b'\xff\xff", "str corpus": "'xxxx",
             "state": "(1, 'x', [[1, 2], [1, 2]"}[case]
    assert shown in message and len(message) < 400, message


def test_build_hints_work_in_the_projects_uv_venv():
    """setup.sh makes .venv with uv, which installs no pip, and `maturin develop` without `--uv`
    installs through pip: the README's dev-build command and the "not built" hint failed there with
    "Failed to find pip"."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for path in (repo / "rustbpe" / "README.md", repo / "nanochat" / "tokenizer.py"):
        for line in path.read_text().splitlines():
            if "maturin develop" in line:
                assert "--uv" in line, f"{path.name}: {line.strip()}"


def test_tok_eval_refuses_an_absurd_thread_count_before_reading_anything(tmp_path, monkeypatch):
    """--threads had no upper bound: tiktoken starts one thread per document up to it, so a typo such
    as --threads 100000 with --num-docs 100000 started 100,000 threads after the data was read."""
    from scripts import tok_eval

    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"^--threads: got 100000; accepted: 1\.\.1024$"):
        tok_eval.parse(["--threads", "100000"])
    assert tok_eval.parse(["--threads", "1024"]).threads == 1024
