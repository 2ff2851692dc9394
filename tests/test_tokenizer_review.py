"""Review regressions for nanochat/tokenizer.py: a save that fails part-way keeps the previous
tokenizer directory consistent, and bad training input is a ValueError naming `texts`.
Tiny in-memory corpora only (CPU, well under a second each)."""

from __future__ import annotations

import os
import errno
import pickle

import pytest
import torch

from nanochat.tokenizer import Tokenizer, get_token_bytes, tokenizer_dir

TEXT_A = ["the cat sat on the mat, the cat ran. " * 30, "hello world, hello there " * 20]
TEXT_B = ["zebra quartz jumps, zebra quartz vexed " * 30, "0123 4567 89 " * 20]


@pytest.fixture(scope="module")
def pair() -> tuple[Tokenizer, Tokenizer]:
    a, b = Tokenizer.train(TEXT_A, 285), Tokenizer.train(TEXT_B, 285)
    assert a.fingerprint != b.fingerprint
    return a, b


def _failing(exc):
    def fail(*_args, **_kwargs):
        raise exc
    return fail


@pytest.mark.parametrize("target, exc", [
    ("torch.save", OSError(errno.ENOSPC, "No space left on device")),  # token_bytes.pt
    ("torch.save", KeyboardInterrupt()),
    ("pickle.dump", OSError(errno.ENOSPC, "No space left on device")),  # tokenizer.pkl
])
def test_failed_save_leaves_the_previous_tokenizer_usable(pair, tmp_path, monkeypatch, target, exc):
    """Saving used to replace tokenizer.pkl before token_bytes.pt was written: a full disk or a
    Ctrl-C there left the new tokenizer.pkl beside the old token_bytes.pt, so the previous tokenizer
    was gone and bits-per-byte evaluation refused the directory ("does not match")."""
    old, new = pair
    directory = tokenizer_dir(tmp_path)
    old.save(directory)
    module, name = target.split(".")
    monkeypatch.setattr({"torch": torch, "pickle": pickle}[module], name, _failing(exc))
    with pytest.raises(type(exc)):
        new.save(directory)
    monkeypatch.undo()
    assert Tokenizer.load(directory).fingerprint == old.fingerprint
    assert torch.equal(get_token_bytes(base_dir=tmp_path), old.token_bytes())
    assert sorted(p.name for p in directory.iterdir()) == ["token_bytes.pt", "tokenizer.pkl"]  # no temp files
    new.save(directory)  # and a later save goes through
    assert Tokenizer.load(directory).fingerprint == new.fingerprint
    assert torch.equal(get_token_bytes(base_dir=tmp_path), new.token_bytes())


def test_failed_replace_cleans_up_its_temp_files(pair, tmp_path, monkeypatch):
    directory = tmp_path / "tok"
    real_replace = os.replace
    calls = []

    def replace_once_then_fail(src, dst):
        calls.append(dst)
        if len(calls) > 1:
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", replace_once_then_fail)
    with pytest.raises(OSError, match="I/O error"):
        pair[0].save(directory)
    monkeypatch.undo()
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("texts", [None, 5, 3.5])
def test_train_rejects_a_non_iterable_naming_texts(texts):
    with pytest.raises(ValueError, match=r"texts: got (NoneType|int|float); accepted: an iterable of str"):
        Tokenizer.train(texts, 300)
