"""Review 74b of the tokenizer: the every-code-point pattern check (review 74) ran on every load, so an
existing tokenizer.pkl whose custom pattern skips unassigned code points was refused as a "corrupt file"
with the advice to retrain it, stranding every checkpoint built on it. Now a new tokenizer (training,
the constructor) is still refused, an existing one loads with one DroppedTextWarning per file and
process, and a pattern that cannot work at all (panics tiktoken, matches the empty string) is still
refused on load."""

import pickle
import warnings

import pytest

from nanochat import tokenizer_pattern
from nanochat.tokenizer import (PICKLE_NAME, DroppedTextWarning, Tokenizer, TokenizerError,
                                _compute_fingerprint, get_token_bytes, get_tokenizer)

# The reviewer's pattern: every probe text round-trips, private-use and unassigned code points do not.
NO_PRIVATE_USE = r"\p{L}+|\p{N}+|\s+|[\p{P}\p{S}\p{M}\p{Cc}\p{Cf}]+"
# Leaves "_" unmatched, which a probe text ("snake_case") holds.
NO_UNDERSCORE = r"[a-zA-Z]+|\p{L}+|\p{N}+|\p{M}+|\s+|[^\w\s]+|\u200d"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(["the cat sat on the mat, the end.\n"] * 20, 256 + 9 + 8)


def _write_with_pattern(tok, directory, pattern):
    """tok saved in `directory` with its pattern replaced by `pattern`, fingerprint to match."""
    tok.save(directory)
    payload = pickle.loads((directory / PICKLE_NAME).read_bytes())
    payload["pattern"] = pattern
    payload["fingerprint"] = _compute_fingerprint(pattern, payload["mergeable_ranks"], payload["special_tokens"])
    (directory / PICKLE_NAME).write_bytes(pickle.dumps(payload, protocol=4))
    return payload["fingerprint"]


def _unread():
    raise AssertionError("the pattern must be refused before any text is read")
    yield  # pragma: no cover


def test_an_existing_tokenizer_dropping_unassigned_code_points_loads_with_one_warning(tok, tmp_path):
    """The reviewer's repro: refused before as "corrupt file (ValueError: pattern ... leaves '\\u0378'
    unmatched ...); create it with python -m scripts.tok_train"."""
    directory = tmp_path / "tokenizer"
    fingerprint = _write_with_pattern(tok, directory, NO_PRIVATE_USE)
    with pytest.warns(DroppedTextWarning) as caught:
        loaded = Tokenizer.load(directory)
    assert len(caught) == 1 and caught[0].filename == __file__   # points at the caller of load
    message = str(caught[0].message)
    assert str(directory / PICKLE_NAME) in message
    for part in ('the first "\\u0378" (U+0378, Unicode category Cn)', "loses them from its token ids",
                 "as it did when this tokenizer was trained",
                 "retrain the tokenizer with a pattern whose matches cover every character", "scripts.tok_train"):
        assert part in message, part
    assert loaded.fingerprint == fingerprint and loaded.pattern == NO_PRIVATE_USE
    assert loaded.decode(loaded.encode("the cat\ue000 sat")) == "the cat sat"   # what the warning says
    # once per file and process: get_tokenizer (checkpoints load through it), get_token_bytes, a copy
    # sent to a worker process (pickled) all stay quiet
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert get_tokenizer(tmp_path).fingerprint == fingerprint
        assert get_token_bytes(base_dir=tmp_path).tolist() == loaded.token_bytes().tolist()
        copy = pickle.loads(pickle.dumps(loaded))
    assert copy.fingerprint == fingerprint and copy.encode("a\ue000b") == loaded.encode("ab")


def test_an_existing_tokenizer_dropping_a_probe_character_loads_with_a_warning(tok, tmp_path):
    _write_with_pattern(tok, tmp_path, NO_UNDERSCORE)
    with pytest.warns(DroppedTextWarning, match=r'the first "_" \(U\+005F, Unicode category Pc\)'):
        loaded = Tokenizer.load(tmp_path)
    assert loaded.decode(loaded.encode("snake_case")) == "snakecase"


@pytest.mark.parametrize("pattern, char", [(NO_PRIVATE_USE, r"\\u0378"), (NO_UNDERSCORE, "_")])
def test_new_tokenizers_with_such_a_pattern_are_still_refused(tok, pattern, char):
    match = rf'^pattern: .* leaves (part of .*{char}.* unmatched|"{char}" of the text unmatched)'
    with pytest.raises(ValueError, match=match):
        Tokenizer.train(_unread(), 300, pattern=pattern)
    with pytest.raises(ValueError, match=match):
        Tokenizer(pattern, tok._ranks)


@pytest.mark.parametrize("pattern, match", [
    (r"a(?(1))b|.|\s", "tests capture group 1, which the pattern does not have"),   # panics fancy-regex
    (r"\p{L}+|\p{N}+|\s+|[\p{P}\p{S}\p{M}\p{Cc}\p{Cf}]+|\p{Co}*", "can match the empty string"),  # drops too
    (r"\s*|\S+", "can match the empty string"),
])
def test_a_pattern_that_cannot_work_is_still_refused_on_load(tok, tmp_path, pattern, match):
    _write_with_pattern(tok, tmp_path, pattern)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DroppedTextWarning)
        with pytest.raises(TokenizerError, match=rf"{PICKLE_NAME}: its split pattern is refused .*{match}"):
            Tokenizer.load(tmp_path)


def test_a_code_point_run_that_panics_tiktoken_is_fatal_even_after_a_dropped_character(monkeypatch):
    """The scan goes on past the first dropped character: a later run that breaks tiktoken must refuse
    an existing tokenizer's pattern too (simulated: no known pattern passes rustbpe's check and panics)."""
    pattern = NO_PRIVATE_USE + r"|\x00"   # a pattern of its own: the verdicts are cached per pattern
    real = tokenizer_pattern._round_trip

    def round_trip(enc, text):
        return (b"", "PanicException: simulated") if "\U0010ffff" in text else real(enc, text)

    monkeypatch.setattr(tokenizer_pattern, "_round_trip", round_trip)
    with pytest.raises(ValueError, match=r"breaks tiktoken on the code points U\+10FC00\.\.U\+10FFFF"):
        tokenizer_pattern._check_pattern(pattern, existing=True)
    monkeypatch.undo()
    tokenizer_pattern._pattern_problem.cache_clear()   # the simulated verdict was cached
    assert tokenizer_pattern._check_pattern(pattern, existing=True) == "\u0378"   # without the panic: loads
