"""Review 10 of the tokenizer as a user training their own: custom split patterns that leave text
unmatched (tiktoken keeps only the regex's matches, so that text vanished from training and from
every encode without a word)."""

import pytest

from nanochat.tokenizer import Tokenizer

# Covers every probe text of the pattern check but not "_" (in \w, so outside [^\w\s], and no
# letter, digit, mark or space): "snake_case" encoded as "snakecase".
NO_UNDERSCORE = r"[a-zA-Z]+|\p{L}+|\p{N}+|\p{M}+|\s+|[^\w\s]+|\u200d"


def test_a_pattern_dropping_underscores_is_refused_before_reading_text():
    def texts():
        raise AssertionError("the pattern must be refused before any text is read")
        yield  # pragma: no cover

    with pytest.raises(ValueError, match=r"^pattern: .*leaves part of '.*_.*' unmatched"):
        Tokenizer.train(texts(), 270, pattern=NO_UNDERSCORE)


def test_a_pattern_leaving_training_text_unmatched_is_refused():
    """No probe text holds "~": the training text itself must show the gap (rustbpe checks that the
    matches of a custom pattern cover every text it splits), not a tokenizer that drops it."""
    with pytest.raises(ValueError, match=r"^pattern: .*leaves \"~\" of the text unmatched"):
        Tokenizer.train(["a~b c d~e"] * 20, 270, pattern=r"[^~]+")


def test_a_covering_custom_pattern_round_trips_its_training_text():
    text = "snake_case_name = other_name + 1 ~ x\n"
    tok = Tokenizer.train([text] * 20, 275, pattern=NO_UNDERSCORE + r"|\w")
    assert tok.decode(tok.encode(text)) == text
