"""Review 76 of the tokenizer (a user training and using their own): a custom split pattern with `\\K`
passed every check (rustbpe's structural one, the probe texts, every code point in a run of its
neighbours), trained, saved and loaded, and then `encode` panicked tiktoken (PanicException, a
BaseException) on the text before the `\\K` ("qz" below) or dropped text from the ids (`(?:\\Ka)+`
kept one "a" of "aa"); errors about a token id with more than 4,300 digits said "Exceeds the limit
(4300 digits)" instead of naming `ids`; a special-token name with a lone surrogate was a bare
UnicodeEncodeError naming no argument."""

import pickle

import pytest

from nanochat.tokenizer import (PICKLE_NAME, SPECIAL_TOKENS, Tokenizer, TokenizerError, _compute_fingerprint)
from nanochat.tokenizer_pattern import _rustbpe

# Covers every character and never matches empty, but `qz\K` reports an empty match on "qz".
KEEP_OUT = r"qz\K|\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"
BYTES = {bytes([b]): b for b in range(256)}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(["the cat sat on the mat, the end.\n"] * 20, 256 + len(SPECIAL_TOKENS) + 8)


def _unread():
    raise AssertionError("the pattern must be refused before any text is read")
    yield  # pragma: no cover


@pytest.mark.parametrize("pattern", [KEEP_OUT, r"(?:\Ka)+|.|\s", r"(?<=q\K)z|.|\s"])
def test_a_keep_out_pattern_is_refused_before_any_text_is_read(pattern):
    with pytest.raises(ValueError, match=r"pattern: .*\\K \(keep out\)"):
        _rustbpe().check_pattern(pattern)
    with pytest.raises(ValueError, match=r"\\K \(keep out\)"):
        Tokenizer.train(_unread(), 300, pattern=pattern)
    with pytest.raises(ValueError, match=r"\\K \(keep out\)"):
        Tokenizer(pattern, BYTES)


def test_a_saved_keep_out_pattern_is_refused_on_load(tok, tmp_path):
    # it cannot work at all (tiktoken panics on "qz"), so an existing file is refused too, naming it
    tok.save(tmp_path)
    payload = pickle.loads((tmp_path / PICKLE_NAME).read_bytes())
    payload["pattern"] = KEEP_OUT
    payload["fingerprint"] = _compute_fingerprint(KEEP_OUT, payload["mergeable_ranks"], payload["special_tokens"])
    (tmp_path / PICKLE_NAME).write_bytes(pickle.dumps(payload, protocol=4))
    # intact, so not "corrupt file" (review of session 76): the pattern is named as what is refused
    with pytest.raises(TokenizerError, match=r"tokenizer.pkl: its split pattern is refused \(pattern: .*\\K "
                                             r"\(keep out\).*retrain it \(tok_train's default pattern"):
        Tokenizer.load(tmp_path)
    for damaged in ({"fingerprint": "0" * 64}, {"fingerprint": None, "pattern": None}):
        # a damaged record whose pattern is refused stays "corrupt file" (no fingerprint: not judged intact)
        (tmp_path / PICKLE_NAME).write_bytes(pickle.dumps({**payload, **damaged}, protocol=4))
        with pytest.raises(TokenizerError, match=r"tokenizer.pkl: corrupt file"):
            Tokenizer.load(tmp_path)


def test_a_look_behind_instead_still_trains_and_round_trips():
    pattern = r"(?<=q)z|\p{L}+|\p{N}+|\s+|[^\s\p{L}\p{N}]+"
    tok = Tokenizer.train(["a quiz, qz qz the end"] * 10, 256 + len(SPECIAL_TOKENS) + 5, pattern=pattern)
    for text in ["qz", "a qz b", "quiz qqzz"]:
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("call", [
    lambda t, i: t.decode([1, i]),
    lambda t, i: t.decode_bytes([i]),
    lambda t, i: t.id_to_token(i),
    lambda t, i: t.visualize([i]),
])
@pytest.mark.parametrize("sign", [1, -1])
def test_an_id_of_thousands_of_digits_is_named(tok, call, sign):
    with pytest.raises(ValueError, match=r"^ids: got token id <int>; accepted: 0\.\.") as err:
        call(tok, sign * 10**5000)
    assert "4300" not in str(err.value)


def test_a_special_token_name_with_a_lone_surrogate_is_named():
    with pytest.raises(ValueError, match=r"^special_tokens\[9\]: got '\\ud800x' \(str\); accepted: a non-empty str "
                                         r"without lone surrogates") as err:
        Tokenizer(r"\S+|\s+", BYTES, SPECIAL_TOKENS + ["\ud800x"])
    assert not isinstance(err.value, UnicodeError)
