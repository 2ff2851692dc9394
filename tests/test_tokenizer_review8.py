"""Eighth review of the tokenizer area as a demanding user: integer arguments that come from numpy
or torch (an id read from an array, a vocab size computed with numpy) were refused with messages
that contradict themselves ("got 1000; accepted: 265..4294967296"); a batch size beyond what rustbpe
reads was refused after the data was opened, under rustbpe's parameter name; malformed messages were
described as a bad role; non-str special token names got tiktoken's TypeError. Tiny corpora only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import require_module

from nanochat.tokenizer import SPECIAL_TOKENS, Tokenizer, check_conversation

require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")

DOCS = ["the cat sat on the mat; the hat sat on the cat", "hello world, hello there 1234", "été été"] * 3
CONV = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat"}]}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(DOCS, 280, threads=1)


# ---------------------------------------------------------------- integers from numpy / torch


@pytest.mark.parametrize("make", [np.int64, np.int32, torch.tensor], ids=["np.int64", "np.int32", "torch"])
def test_integer_scalars_from_arrays_are_integers(tok, make):
    """decode took numpy / torch integers (operator.index) but every other integer argument refused
    them with a self-contradicting message, e.g. prepend=np.int64(5): "prepend: got 5; accepted: a
    token id in 0..279", train(vocab_size=np.int64(280)): "vocab_size: got 280; accepted: 265..."."""
    bos = tok.bos_token_id
    assert tok.encode("hello", prepend=make(bos), append=make(5)) == [bos] + tok.encode("hello") + [5]
    assert tok.encode(["a", "b"], num_threads=make(2)) == tok.encode(["a", "b"])
    assert tok.render_conversation(CONV, max_tokens=make(3)) == tuple(x[:3] for x in tok.render_conversation(CONV))
    again = Tokenizer.train(DOCS, make(280), threads=make(1), batch_size=make(2))
    assert again.fingerprint == tok.fingerprint


@pytest.mark.parametrize("call, match", [
    (lambda tok: Tokenizer.train(DOCS, 300.0), r"vocab_size: got 300\.0 \(float\); accepted: 265\.\."),
    (lambda tok: Tokenizer.train(DOCS, 300, threads=2.0), r"threads: got 2\.0 \(float\); accepted: 1\.\.1024"),
    (lambda tok: Tokenizer.train(DOCS, 300, batch_size="8"), r"batch_size: got '8' \(str\); accepted: 1\.\."),
    (lambda tok: tok.encode("a", prepend=5.0), r"prepend: got 5\.0 \(float\); accepted: a token id"),
    (lambda tok: tok.encode(["a"], num_threads=True), r"num_threads: got True \(bool\); accepted"),
    (lambda tok: tok.render_conversation(CONV, max_tokens=np.float64(3)), r"max_tokens: got .*float64\)"),
])
def test_non_integers_are_refused_with_their_type(tok, call, match):
    """A refused value that prints like an accepted one (300.0, True, "8") must say its type."""
    with pytest.raises(ValueError, match=match):
        call(tok)


# ---------------------------------------------------------------- batch size beyond rustbpe's int


def test_batch_size_beyond_rustbpe_is_named_and_ranged():
    """Tokenizer.train passed any positive batch_size on: 2**63 came back as rustbpe's "buffer_size:
    got 9223372036854775808 (int); accepted: an int >= 1", naming a parameter train does not have
    and claiming the value was acceptable."""
    with pytest.raises(ValueError, match=r"^batch_size: got 9223372036854775808; accepted: 1\.\.9223372036854775807"):
        Tokenizer.train(DOCS, 300, batch_size=2**63)


def test_tok_train_checks_the_batch_size_range_before_reading_data(tmp_path):
    """--tokenizer-batch-size 2**63 passed validation, then failed after the shards were opened and the
    first document read, with "cannot train ...: buffer_size: ... accepted: an int >= 1"."""
    from scripts import tok_train

    with pytest.raises(ValueError, match=r"--tokenizer-batch-size: got 9223372036854775808; accepted: "
                                         r"1\.\.9223372036854775807"):
        tok_train.parse(["--tokenizer-batch-size", str(2**63), "--data-dir", str(tmp_path / "none")])
    assert tok_train.parse(["--tokenizer-batch-size", str(2**63 - 1)]).tokenizer_batch_size == 2**63 - 1


# ---------------------------------------------------------------- malformed conversations


@pytest.mark.parametrize("messages, match", [
    (["hi"], r"^messages\[0\]: got str 'hi'; accepted: a dict with 'role' and 'content'"),
    ([{"role": "user", "content": "a"}, None], r"^messages\[1\]: got NoneType None; accepted: a dict"),
    ([{"role": "system", "content": "s"}], r"^messages: got only a system message; accepted: a user message after it"),
])
def test_malformed_messages_are_named_as_such(tok, messages, match):
    """A message that is not a dict was reported as "messages[0].role: got 'str'" (its type name shown
    as if it were the role), and a lone system message as a problem with messages[1], which does not
    exist."""
    for check in (lambda c: tok.render_conversation(c), check_conversation, tok.render_for_completion):
        with pytest.raises(ValueError, match=match):
            check({"messages": messages})


@pytest.mark.parametrize("conversation, match", [
    ([{"role": "user", "content": "a"}], r"^conversation: got list; accepted: a dict with a 'messages' list"),
    ({"messages": ({"role": "user", "content": "a"},)}, r"^conversation\['messages'\]: got tuple; accepted: a list"),
    ({"message": []}, r"^conversation\['messages'\]: got NoneType; accepted: a list"),
])
def test_conversation_shape_errors_say_what_they_got(tok, conversation, match):
    """"conversation: expected a dict with a 'messages' list" did not say which part was wrong."""
    with pytest.raises(ValueError, match=match):
        tok.render_conversation(conversation)


# ---------------------------------------------------------------- special token names


@pytest.mark.parametrize("extra", [5, b"<|x|>", None, ""])
def test_special_token_names_must_be_non_empty_str(tok, extra):
    """A non-str name reached tiktoken: TypeError "'int' object is not an instance of 'str'", naming
    no argument; an empty name was accepted and decoded as nothing at all."""
    with pytest.raises(ValueError, match=r"special_tokens\[9\]: got .*; accepted: a non-empty str"):
        Tokenizer(tok.pattern, dict(tok._ranks), SPECIAL_TOKENS + [extra])
    extended = Tokenizer(tok.pattern, dict(tok._ranks), SPECIAL_TOKENS + ["<|extra|>"])
    assert extended.decode([extended.encode_special("<|extra|>")]) == "<|extra|>"
