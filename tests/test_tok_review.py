"""Tokenizer review (correctness and security, as a demanding user): split patterns that can match
the empty string, and the durability of a saved tokenizer."""

import os
import stat

import pytest
import rustbpe
import tiktoken

from nanochat.tokenizer import PICKLE_NAME, SPLIT_PATTERN, TOKEN_BYTES_NAME, Tokenizer, _check_pattern

# Every character class real text holds, except that the last alternative says `*` where `+` was
# meant: a character in none of the classes (an unassigned code point such as U+0378, or a new
# emoji the regex's Unicode tables do not know yet) reaches `\p{Co}*`, which matches it as "".
STAR_PATTERN = r"\p{L}+|\p{N}+|\s+|[\p{P}\p{S}\p{M}\p{Cc}\p{Cf}]+|\p{Co}*"
EMPTY_PATTERNS = [STAR_PATTERN, r"[^~]+|(?=~)|~"]


def _unread():
    raise AssertionError("the pattern must be refused before any text is read")
    yield  # pragma: no cover


@pytest.mark.parametrize("pattern", EMPTY_PATTERNS)
def test_a_pattern_that_can_match_empty_is_refused_before_reading_text(pattern):
    """Such a pattern passed every check (the probe texts and the training text are covered by the
    other alternatives) and trained; then tiktoken panicked (a BaseException `except Exception`
    misses: a chat server's request) on a message that starts with such a character, and dropped it
    silently from the middle of one ("a\\u0378b" encoded as "ab")."""
    with pytest.raises(ValueError, match="can match the empty string"):
        _check_pattern(pattern)   # the probe texts alone do not show it: rustbpe's structural check does
    bytes_only = tiktoken.Encoding("t", pat_str=pattern, mergeable_ranks={bytes([b]): b for b in range(256)},
                                   special_tokens={})
    lost = "a\u0378b~c"
    assert bytes_only.decode(bytes_only.encode_ordinary(lost)) != lost   # what a trained one did
    with pytest.raises(ValueError, match=r"^pattern: .* can match the empty string .*accepted: a regex whose "
                                         r"every match is at least one character"):
        Tokenizer.train(_unread(), 300, pattern=pattern)


@pytest.mark.parametrize("pattern", EMPTY_PATTERNS + [r"b|a*", r"\b"])
def test_rustbpe_refuses_it_for_training_and_for_a_pickled_state(pattern):
    with pytest.raises(ValueError, match="can match the empty string"):
        rustbpe.check_pattern(pattern)
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(["abab abab"], 257)
    with pytest.raises(ValueError, match="can match the empty string"):
        trainer.train_from_iterator(_unread(), 300, pattern=pattern)
    with pytest.raises(ValueError, match="can match the empty string"):
        trainer.__setstate__((1, pattern, []))
    assert trainer.get_merges() == [(97, 98, 256)] and trainer.get_pattern() == SPLIT_PATTERN


def test_patterns_whose_matches_are_never_empty_still_train():
    """Look-arounds and optional parts are fine inside an alternative that always takes a character."""
    for pattern in (SPLIT_PATTERN, r"\S+|\s+", r"(?=a)a+|[^a]+", r"'(?:s|ll)?|[^']+"):
        rustbpe.check_pattern(pattern)
        tok = Tokenizer.train(["it's all a test, isn't it?\n"] * 5, 270, pattern=pattern)
        assert tok.decode(tok.encode("it'll be\u0378 fine")) == "it'll be\u0378 fine"


def test_save_syncs_the_directory_after_putting_the_files_in_place(tmp_path, monkeypatch):
    """Each file was fsynced, then renamed into place, but the directory never was: after a power
    cut the renames could be lost (the previous tokenizer back, or one new file of the pair beside
    an old one) though tok_train had said "saved"."""
    tok = Tokenizer(SPLIT_PATTERN, {bytes([b]): b for b in range(256)})
    out = tmp_path / "tok"
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):   # what the directory held when it was synced
            synced.append((st.st_ino, sorted(p.name for p in out.iterdir())))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    tok.save(out)
    assert (out.stat().st_ino, sorted([PICKLE_NAME, TOKEN_BYTES_NAME])) in synced
    assert Tokenizer.load(out).fingerprint == tok.fingerprint
