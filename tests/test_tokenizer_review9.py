"""Ninth review of the tokenizer area as a demanding user: a custom split pattern (e.g. GPT-4's own
`\\p{N}{1,3}`) could not train on a document with a ~1M-character whitespace run ("pattern: matching
failed", blaming a good pattern) although encode() handles that document by cutting the run;
encode(prepend="bos") was refused without naming `prepend`; tok_eval took `--tokenizer-dir ""` as
the current directory. Tiny corpora only."""

from __future__ import annotations

import pytest
from conftest import require_module

from nanochat.tokenizer import MAX_WHITESPACE_RUN, SPLIT_PATTERN, Tokenizer, whitespace_pieces

require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")

DOCS = ["the cat sat on the mat; the hat sat on the cat", "hello world, hello there 1234", "été été"] * 3
GPT4_DIGITS = SPLIT_PATTERN.replace(r"\p{N}{1,2}", r"\p{N}{1,3}")   # cl100k's grouping: no rustbpe fast path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(DOCS, 280, threads=1)


def test_custom_pattern_trains_on_a_document_with_a_huge_whitespace_run():
    """rustbpe splits with fancy-regex for any pattern but its own default; `\\s+(?!\\S)` on a run of
    ~1M spaces exceeded its backtracking limit and training failed, naming the pattern. encode() has
    always cut such runs (MAX_WHITESPACE_RUN); training now sees the same pieces, so it learns the
    chunks encoding produces and equals training on the pieces as separate documents."""
    assert GPT4_DIGITS != SPLIT_PATTERN
    doc = "hello world " * 20 + " " * 1_000_000 + "x 12345"
    tok = Tokenizer.train([doc] + DOCS, 290, pattern=GPT4_DIGITS, threads=1)
    assert tok.decode(tok.encode(doc)) == doc
    pieces = whitespace_pieces(doc)
    assert len(pieces) == 11 and "".join(pieces) == doc   # a run of 1,000,001 spaces
    assert tok.fingerprint == Tokenizer.train(pieces + DOCS, 290, pattern=GPT4_DIGITS, threads=1).fingerprint


def test_errors_after_a_cut_document_still_count_documents():
    """The pieces of a cut document are not separate documents in what train reports."""
    long_doc = "a" + " " * (3 * MAX_WHITESPACE_RUN) + "b"
    with pytest.raises(ValueError, match=r"^texts: item 1 is not encodable as UTF-8"):
        Tokenizer.train([long_doc, "bad \ud800"], 280)
    with pytest.raises(ValueError, match=r"requested 400 but 2 documents"):
        Tokenizer.train([long_doc, "abc abd"], 400)


@pytest.mark.parametrize("arg", ["prepend", "append"])
def test_a_bad_special_name_in_encode_names_the_argument(tok, arg):
    """encode(prepend=5_000_000) named `prepend`, but encode(prepend="bos") said only "special token:
    got 'bos'", leaving the caller to guess which argument."""
    with pytest.raises(ValueError, match=rf"^{arg}: got 'bos'; accepted: a token id in 0\.\.279 or a "
                                         r"special-token name \(<\|bos\|>, "):
        tok.encode("hi", **{arg: "bos"})
    assert tok.encode("hi", **{arg: "<|bos|>"}) == tok.encode("hi", **{arg: tok.bos_token_id})


def test_tok_eval_refuses_an_empty_tokenizer_dir(capsys):
    """`--tokenizer-dir "$TOK"` with TOK unset was Path("") == the current directory."""
    from scripts import tok_eval

    with pytest.raises((SystemExit, ValueError)) as e:
        tok_eval.parse(["--tokenizer-dir", ""])
    said = str(e.value) + capsys.readouterr().err
    assert "--tokenizer-dir" in said and "empty value" in said, said
