"""Sixth review of the tokenizer area (rustbpe/ and nanochat/tokenizer.py) as a demanding user:
corrupt or forged saved state must give a clear error, never a MemoryError, an OOM kill or a Rust
allocation abort, and Tokenizer.train's errors must name its own parameters. Tiny corpora only
(the whole file runs in about a second)."""

from __future__ import annotations

import pickle
import pickletools
import struct

import pytest
from conftest import require_module

from nanochat.tokenizer import PICKLE_NAME, SPLIT_PATTERN, Tokenizer, TokenizerError

rustbpe = require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")

DOCS = ["the cat sat on the mat; the hat sat on the cat", "hello world, hello there 1234", "été été"] * 3


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(DOCS, 280, threads=1)


# ---------------------------------------------------------------- rustbpe: forged pickle state


def _doubling_merges(n: int) -> list[tuple[int, int]]:
    """Merge 0 is "a" + "a"; merge i joins token 256 + i - 1 with itself: a 2^(i+1)-byte token."""
    return [(97, 97)] + [(256 + i, 256 + i) for i in range(n - 1)]


def test_unpickled_merges_describing_a_huge_token_are_refused():
    """__setstate__ checked ids and repeats but not sizes: 41 doubling merges (a few hundred bytes
    of pickle) were accepted, and get_mergeable_ranks then tried to build a 2^41-byte token, an
    allocation failure that aborted the whole Python process (SIGABRT, no exception)."""
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(["abab abab"], 257)
    with pytest.raises(ValueError, match=r"merges: merge 30 \(285, 285\) makes a 2147483648-byte token"):
        trainer.__setstate__((1, SPLIT_PATTERN, _doubling_merges(41)))
    assert trainer.get_merges() == [(97, 98, 256)], "a refused state must leave the model as it was"

    class Forged:   # what a tampered or corrupt pickle of a trainer amounts to
        def __reduce__(self):
            return rustbpe.Tokenizer, (), (1, SPLIT_PATTERN, _doubling_merges(41))

    with pytest.raises(ValueError, match="merges: merge 30"):
        pickle.loads(pickle.dumps(Forged()))
    trainer.__setstate__((1, SPLIT_PATTERN, _doubling_merges(20)))   # 2 MiB of tokens: fine
    ranks = trainer.get_mergeable_ranks()
    assert ranks[-1] == (b"a" * 2**20, 256 + 19)


# ---------------------------------------------------------------- Tokenizer.load: corrupt tokenizer.pkl


def _load_bytes(tmp_path, data: bytes):
    (tmp_path / PICKLE_NAME).write_bytes(data)
    return Tokenizer.load(tmp_path)


@pytest.mark.parametrize("data", [
    b"\x80\x04\x8e" + struct.pack("<Q", 2**62) + b"ab.",   # BINBYTES8 claiming 4 EiB
    b"\x80\x05\x96" + struct.pack("<Q", 2**62) + b"ab.",   # BYTEARRAY8 likewise
    b"\x80\x02}p100000000000000000\n.",                     # PUT: a memo table of 10^17 slots
    b"\x80\x04}r" + struct.pack("<I", 0xFFFFFFFF) + b".",   # LONG_BINPUT: 2^32 slots (up to 68 GB)
], ids=["binbytes8", "bytearray8", "put", "long_binput"])
def test_length_and_memo_fields_of_a_corrupt_file_are_checked_first(tmp_path, data):
    """The C unpickler allocates what a length or memo-index field says before it sees the file is
    short: these raised MemoryError (not the TokenizerError callers catch), and a flipped memo index
    of ~2^31 zero-filled 32 GB on this 24 GB machine, which got the process OOM-killed."""
    with pytest.raises(TokenizerError, match="corrupt file"):
        _load_bytes(tmp_path, data)


def test_one_flipped_byte_in_a_saved_tokenizer_is_a_tokenizer_error(tok, tmp_path):
    """The realistic form of the above: one byte of a real tokenizer.pkl turned a SHORT_BINBYTES
    opcode into BINBYTES8, so the next 8 bytes of token data became a length (MemoryError)."""
    tok.save(tmp_path)
    raw = (tmp_path / PICKLE_NAME).read_bytes()
    # the first token whose next 8 bytes, read as a length, ask for more memory than any machine has
    pos = next(p for op, _, p in pickletools.genops(raw)
               if op.name == "SHORT_BINBYTES" and struct.unpack("<Q", raw[p + 1:p + 9])[0] > 2**50)
    corrupt = raw[:pos] + b"\x8e" + raw[pos + 1:]
    with pytest.raises(TokenizerError, match="corrupt file"):
        _load_bytes(tmp_path, corrupt)
    assert _load_bytes(tmp_path, raw).fingerprint == tok.fingerprint   # and the intact file still loads


# ---------------------------------------------------------------- Tokenizer.train: errors name its parameters


@pytest.mark.parametrize("texts, match", [
    (["", ""], r"^texts: the training text is empty"),
    (["fine", "lone \ud800 surrogate"], r"^texts: item 1 is not encodable as UTF-8"),
])
def test_training_text_errors_name_texts(texts, match):
    """rustbpe's messages said "iterator: ...", a parameter Tokenizer.train does not have."""
    with pytest.raises(ValueError, match=match):
        Tokenizer.train(texts, 300, threads=1)


@pytest.mark.parametrize("threads", [0, -1, 2.0, "2"])
def test_threads_error_gives_the_accepted_range(threads):
    """threads=0 said "accepted: a positive integer", while 5000 (positive) was refused too."""
    with pytest.raises(ValueError, match=r"threads: got .*; accepted: 1\.\.1024 or None"):
        Tokenizer.train(["hello world"], 300, threads=threads)
