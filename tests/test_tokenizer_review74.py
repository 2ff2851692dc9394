"""Review 74 of the tokenizer: split patterns that silently drop whole Unicode categories (the probe
texts hold one character per common category, so a pattern could pass them and still lose private-use,
unassigned or ZWNJ characters from every encode), error messages that built the whole repr of what
they were about (seconds and a GB for a 300 MB bytes item; RecursionError for nested junk in an edited
tokenizer.pkl, not the TokenizerError naming the file), and constructor pattern errors that named no
argument."""

import pickle
import tracemalloc

import pytest
import tiktoken

from nanochat.tokenizer import (PICKLE_NAME, SPLIT_PATTERN, DroppedTextWarning, Tokenizer, TokenizerError,
                                _compute_fingerprint)
from nanochat.tokenizer_pattern import _coverage_problem

# Every probe text round-trips through it; private-use (Co) and unassigned (Cn) code points do not.
NO_PRIVATE_USE = r"\p{L}+|\p{N}+|\s+|[\p{P}\p{S}\p{M}\p{Cc}\p{Cf}]+"
# Built on \w: covers "_" and U+200D, but not U+200C (ZWNJ, in \w), so Persian "می‌خواهم" lost it.
WORD_BASED = r"[a-zA-Z]+|\p{L}+|\p{N}+|\p{M}+|\s+|[^\w\s]+|\u200d|_"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(["the cat sat on the mat, the end.\n"] * 20 + ["snake_case x"], 256 + 9 + 12)


def _unread():
    raise AssertionError("the pattern must be refused before any text is read")
    yield  # pragma: no cover


@pytest.mark.parametrize("pattern, char", [(NO_PRIVATE_USE, r"\\u0378"), (WORD_BASED, r"\\u200c")])
def test_a_pattern_dropping_a_category_is_refused_for_new_tokenizers(tok, tmp_path, pattern, char):
    """Accepted before: `Tokenizer(NO_PRIVATE_USE, ...)` encoded "a\\ue000b" as "ab"."""
    match = rf'^pattern: .* leaves "{char}" of the text unmatched \(U\+'
    with pytest.raises(ValueError, match=match):
        Tokenizer(pattern, tok._ranks)
    with pytest.raises(ValueError, match=match):
        Tokenizer.train(_unread(), 300, pattern=pattern)
    # a file holding such a pattern (with a matching fingerprint) already exists: it loads, with a
    # warning (tests/test_tokenizer_review74b.py), not a "corrupt file" that stranded its checkpoints
    tok.save(tmp_path)
    payload = pickle.loads((tmp_path / PICKLE_NAME).read_bytes())
    payload["pattern"] = pattern
    payload["fingerprint"] = _compute_fingerprint(pattern, payload["mergeable_ranks"], payload["special_tokens"])
    (tmp_path / PICKLE_NAME).write_bytes(pickle.dumps(payload, protocol=4))
    with pytest.warns(DroppedTextWarning, match=rf"{PICKLE_NAME}: .* the first \"{char}\" \(U\+"):
        assert Tokenizer.load(tmp_path).pattern == pattern


def test_the_default_pattern_covers_every_code_point():
    """Tokenizers with SPLIT_PATTERN skip the every-code-point scan (~0.3 s at each start): this is why."""
    enc = tiktoken.Encoding(name="t", pat_str=SPLIT_PATTERN, mergeable_ranks={bytes([b]): b for b in range(256)},
                            special_tokens={})
    assert _coverage_problem(SPLIT_PATTERN, enc) is None


def test_covering_custom_patterns_still_construct(tok):
    for pattern in (r"\S+|\s+", WORD_BASED.replace("|_", r"|\w")):
        custom = Tokenizer(pattern, tok._ranks)
        text = "a\ue000b \U0010fffd می\u200cخواهم \u203f\u24b6 snake_case"
        assert custom.decode(custom.encode(text)) == text


@pytest.mark.parametrize("pattern", ["((", "\ud800|.", "[z-a]"])
def test_constructor_pattern_errors_name_the_pattern(tok, pattern):
    """tiktoken's own error ("Parsing error at position 2", a UnicodeEncodeError) named no argument."""
    with pytest.raises(ValueError, match=r"^pattern: invalid regex "):
        Tokenizer(pattern, tok._ranks)


def _nested_payload(tok, tmp_path, key: str, depth: int = 100_000) -> bytes:
    """tokenizer.pkl's bytes with `key`'s value (or, for mergeable_ranks, one rank) a list nested `depth`
    deep: the unpickler builds it without recursion, and only a repr or a comparison recursed."""
    tok.save(tmp_path)
    payload = pickle.loads((tmp_path / PICKLE_NAME).read_bytes())
    marker = "NESTED_LIST_HERE"
    if key == "special_tokens":
        payload[key] = [marker] + payload[key][1:]
    elif key == "mergeable_ranks":
        payload[key] = {**payload[key], b"zz-extra": marker}
    else:
        payload[key] = marker
    raw = pickle.dumps(payload, protocol=4)
    encoded = b"\x8c" + bytes([len(marker)]) + marker.encode()   # SHORT_BINUNICODE
    assert raw.count(encoded) == 1
    return raw.replace(encoded, b"]" * depth + b"a" * (depth - 1))   # EMPTY_LIST x depth, APPEND x depth-1


@pytest.mark.parametrize("key", ["special_tokens", "format_version", "mergeable_ranks"])
def test_nested_junk_in_an_edited_file_is_a_tokenizer_error(tok, tmp_path, key):
    """RecursionError escaped load (the repr of the value in its error message); a rank's value is now
    refused by type before the ranks are sorted."""
    (tmp_path / PICKLE_NAME).write_bytes(_nested_payload(tok, tmp_path, key))
    with pytest.raises(TokenizerError, match=PICKLE_NAME) as info:
        Tokenizer.load(tmp_path)
    assert len(str(info.value)) < 600


def test_bool_ranks_are_refused(tok):
    ranks = dict(tok._ranks)
    ranks[b"\x00"], ranks[b"\x01"] = False, True   # == 0 and 1: passed the rank checks
    with pytest.raises(ValueError, match=r"^mergeable ranks: got b'\\x00' \(bytes\) -> False \(bool\)"):
        Tokenizer(SPLIT_PATTERN, ranks)


def test_errors_about_huge_arguments_do_not_build_their_whole_repr(tok):
    """encode(["a", <300 MB bytes>]) took 1.3 s and a GB to say "got bytes b'xxx...'"; a huge str given
    as a special-token name the same."""
    blob, name = b"x" * 50_000_000, "<|" + "y" * 50_000_000
    tracemalloc.start()
    try:
        with pytest.raises(TypeError, match=r"^text\[1\]: got bytes b'xxx"):
            tok.encode(["a", blob])
        with pytest.raises(ValueError, match=r"^prepend: got '<\|yyy"):
            tok.encode("a", prepend=name)
        with pytest.raises(ValueError, match=r"^special token: got '<\|yyy"):
            tok.encode_special(name)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 5_000_000, peak


def test_an_enormous_int_argument_is_named():
    """repr() of a 5,001-digit int raises ValueError("Exceeds the limit ... for integer string conversion"),
    which came out of Tokenizer.train instead of the vocab_size error."""
    with pytest.raises(ValueError, match=r"^vocab_size: got <int>; accepted: 265\.\."):
        Tokenizer.train(["a b"], 10**5000)
    with pytest.raises(ValueError, match=r"^vocab_size: got 10+\.\.\.0+; accepted"):
        Tokenizer.train(["a b"], 10**100)


# ---------------------------------------------------------------- rustbpe: fancy-regex panics

CONDITION_ON_NO_GROUP = r"a(?(1))b|.|\s"   # (?(1)...) tests a capture group the pattern does not have


def test_a_condition_on_a_missing_group_is_refused_by_rustbpe():
    """fancy-regex compiles it and panics indexing its capture slots while matching: training said
    "internal error: the counting thread panicked" (the panic killed a rayon worker), and a trainer
    unpickled with it raised PanicException (a BaseException) from encode."""
    import rustbpe

    match = r"^pattern: invalid regex .*tests capture group 1, which the pattern does not have"
    with pytest.raises(ValueError, match=match):
        rustbpe.check_pattern(CONDITION_ON_NO_GROUP)
    with pytest.raises(ValueError, match=match):
        rustbpe.Tokenizer().train_from_iterator(["ab ba aab"] * 3, 260, pattern=CONDITION_ON_NO_GROUP, threads=1)
    with pytest.raises(ValueError, match=match):
        rustbpe.Tokenizer().__setstate__((1, CONDITION_ON_NO_GROUP, []))
    with pytest.raises(ValueError, match=match):
        Tokenizer.train(_unread(), 300, pattern=CONDITION_ON_NO_GROUP)
    trainer = rustbpe.Tokenizer()   # a condition on a group that exists still works
    trainer.train_from_iterator(["ab ba aab c"] * 3, 257, pattern=r"(a)(?(1)b|c)|.|\s", threads=1)
    assert trainer.get_merges() == [(97, 98, 256)] and trainer.encode("aab") == [97, 256]
