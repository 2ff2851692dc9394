"""Tests of the in-tree Rust BPE trainer `rustbpe` (built from rustbpe/ by maturin).

Parity against a small pure-Python BPE (same regex via the `regex` package, same tie-break),
encode/decode round trips through tiktoken built from the trained ranks, agreement of
rustbpe.encode with tiktoken, and ValueError for every kind of bad input.
"""

import collections

import pytest
from conftest import require_module

rustbpe = require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")

# nanochat's split pattern: GPT-4's with numbers grouped by at most two digits.
PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s+"""
)


def read_docs(path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


@pytest.fixture(scope="module")
def tiny_docs(tiny_corpus) -> list[str]:
    """Every document of the tiny corpus (train + validation shards)."""
    shards = sorted(tiny_corpus.glob("*.parquet"))
    assert shards, f"no parquet shards in {tiny_corpus}"
    return [doc for shard in shards for doc in read_docs(shard)]


@pytest.fixture(scope="module")
def parity_docs(tiny_docs) -> list[str]:
    """About 1.5 MB of Shakespeare for the Python-reference parity check."""
    docs, n = [], 0
    for doc in tiny_docs:
        docs.append(doc)
        n += len(doc)
        if n >= 1_500_000:
            break
    return docs


def train(texts, vocab_size, **kw) -> "rustbpe.Tokenizer":
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(iter(texts), vocab_size, **kw)
    return tok


def reference_bpe(texts: list[str], num_merges: int, pattern: str = PATTERN) -> list[tuple[int, int]]:
    """Plain-Python BPE. Counts are adjacent occurrences weighted by chunk frequency; the
    next merge is the highest count, ties going to the smallest (left id, right id)."""
    import regex

    compiled = regex.compile(pattern)
    chunks = collections.Counter(c for t in texts for c in compiled.findall(t))
    words = [list(c.encode("utf-8")) for c in chunks]
    weights = list(chunks.values())
    pair_counts: collections.Counter = collections.Counter()
    where = collections.defaultdict(set)  # pair -> indexes of words that contain it

    def account(i: int, sign: int) -> None:
        for pair in zip(words[i], words[i][1:]):
            pair_counts[pair] += sign * weights[i]
            if sign > 0:
                where[pair].add(i)
            elif pair_counts[pair] == 0:
                del pair_counts[pair]

    for i in range(len(words)):
        account(i, +1)
    merges = []
    for new_id in range(256, 256 + num_merges):
        if not pair_counts:
            break
        top = max(pair_counts.values())
        best = min(pair for pair, count in pair_counts.items() if count == top)
        merges.append(best)
        for i in sorted(where.pop(best)):
            account(i, -1)
            word, merged, j = words[i], [], 0
            while j < len(word):
                if j + 1 < len(word) and (word[j], word[j + 1]) == best:
                    merged.append(new_id)
                    j += 2
                else:
                    merged.append(word[j])
                    j += 1
            words[i] = merged
            account(i, +1)
    return merges


def tiktoken_for(tok):
    import tiktoken

    return tiktoken.Encoding(
        "rustbpe-test", pat_str=tok.get_pattern(), mergeable_ranks=dict(tok.get_mergeable_ranks()), special_tokens={}
    )


@pytest.fixture(scope="module")
def trained(tiny_docs):
    """A 2048-token vocabulary trained on the whole tiny corpus."""
    return train(tiny_docs, 2048)


# ---------------------------------------------------------------- training behaviour


def test_merges_match_python_reference(parity_docs):
    num_merges = 300
    tok = train(parity_docs, 256 + num_merges)
    want = reference_bpe(parity_docs, num_merges)
    assert len(want) == num_merges
    got = [(left, right) for left, right, _ in tok.get_merges()]
    assert got == want
    assert [new for _, _, new in tok.get_merges()] == list(range(256, 256 + num_merges))


def test_crafted_ties_and_overlaps_match_reference():
    cases = [
        (["ab cd"], 3),
        (["cd ab"], 3),
        (["ca", "ba"], 2),
        (["zzz", "zzz", "bc", "bc", "bc"], 1),  # ("z","z") counts 4 (overlapping), ("b","c") 3
        (["zzzz", "bc", "bc", "bc"], 2),  # 3 vs 3: the smaller pair ("b","c") first
        (["abab", "yz yz", "aaaa", "été été"], 8),
    ]
    for texts, n in cases:
        got = [(left, right) for left, right, _ in train(texts, 256 + n).get_merges()]
        assert got == reference_bpe(texts, n), texts


def test_mergeable_ranks_layout(trained):
    ranks = trained.get_mergeable_ranks()
    assert len(ranks) == 2048
    assert [r for _, r in ranks] == list(range(2048))
    assert ranks[:256] == [(bytes([b]), b) for b in range(256)]
    token = [b for b, _ in ranks]
    for left, right, new in trained.get_merges():
        assert token[new] == token[left] + token[right]
    assert len(set(token)) == len(token)


def test_default_and_custom_pattern():
    tok = rustbpe.Tokenizer()
    assert tok.get_pattern() == PATTERN
    tok.train_from_iterator(["aa bb aa bb"], 260, pattern=r"\S+\s*")
    assert tok.get_pattern() == r"\S+\s*"
    token = [b for b, _ in tok.get_mergeable_ranks()]
    assert b"aa " in token or b"bb " in token  # the space joined a word: the pattern was used


def test_batching_and_threads_do_not_change_merges(parity_docs, monkeypatch):
    docs = parity_docs[:200]
    want = train(docs, 400).get_merges()
    assert train(docs, 400, buffer_size=7).get_merges() == want
    assert train(docs, 400, buffer_size=1).get_merges() == want
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    assert train(docs, 400).get_merges() == want
    monkeypatch.setenv("RAYON_NUM_THREADS", "3")
    assert train(docs, 400).get_merges() == want


def test_small_vocab_and_early_stop():
    assert train(["hello"], 256).get_merges() == []
    # "aaaa" allows exactly two merges (aa, aaaa); asking for more stops early.
    tok = train(["aaaa"], 300)
    assert [b for b, _ in tok.get_mergeable_ranks()[256:]] == [b"aa", b"aaaa"]


def test_retraining_replaces_and_failures_keep_state():
    tok = train(["abab"], 257)
    assert tok.get_merges() == [(97, 98, 256)]
    tok.train_from_iterator(["cdcd"], 257)
    assert tok.get_merges() == [(99, 100, 256)]
    with pytest.raises(ValueError):
        tok.train_from_iterator(["x", 1], 300)
    assert tok.get_merges() == [(99, 100, 256)]


# ---------------------------------------------------------------- encoding


def test_round_trip_every_tiny_document(trained, tiny_docs):
    enc = tiktoken_for(trained)
    for i, doc in enumerate(tiny_docs):
        assert enc.decode_bytes(enc.encode_ordinary(doc)) == doc.encode("utf-8"), f"document {i}"


def test_rust_encode_equals_tiktoken(trained, tiny_docs):
    enc = tiktoken_for(trained)
    for i, doc in enumerate(tiny_docs):
        assert trained.encode(doc) == enc.encode_ordinary(doc), f"document {i}"
    extra = "Ünïcödé, émoji 😀, digits 1234567, tabs\t\tand\r\nnewlines\n\n  trailing  "
    assert trained.encode(extra) == enc.encode_ordinary(extra)
    assert enc.decode(trained.encode(extra)) == extra
    assert trained.encode("") == []


def test_untrained_encode_is_bytes():
    assert rustbpe.Tokenizer().encode("hé") == list("hé".encode("utf-8"))


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"vocab_size": 255}, "vocab_size: got 255"),
        ({"vocab_size": -1}, "vocab_size: got -1"),
        ({"vocab_size": 2**40}, "vocab_size: got 1099511627776"),
        ({"vocab_size": "300"}, "vocab_size: got '300' (str)"),
        ({"vocab_size": 300.0}, "vocab_size: got 300.0 (float)"),
        ({"vocab_size": True}, "vocab_size: got True (bool)"),
        ({"vocab_size": 300, "pattern": "(("}, 'pattern: invalid regex "(("'),
        ({"vocab_size": 300, "pattern": 5}, "pattern: got 5 (int)"),
        ({"vocab_size": 300, "pattern": "\ud800"}, "pattern: not encodable as UTF-8"),
        ({"vocab_size": 300, "buffer_size": 0}, "buffer_size: got 0"),
        ({"vocab_size": 300, "buffer_size": -3}, "buffer_size: got -3"),
        ({"vocab_size": 300, "buffer_size": "8"}, "buffer_size: got '8' (str)"),
    ],
)
def test_bad_arguments_raise_before_reading(kwargs, message):
    pulled = []

    def texts():
        pulled.append(1)
        yield "hello world"

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rustbpe.Tokenizer().train_from_iterator(texts(), **kwargs)
    assert pulled == [], "arguments must be validated before the iterator is consumed"


@pytest.mark.parametrize(
    "texts, message",
    [
        ([], "the training text is empty"),
        (["", ""], "the training text is empty"),
        (["fine", 3], "item 1 is 3 (int)"),
        ([b"bytes"], "item 0 is b'bytes' (bytes)"),
        (["ok", None], "item 1 is None (NoneType)"),
        (["lone \ud800 surrogate"], "item 0 is not encodable as UTF-8"),
    ],
)
def test_bad_training_text(texts, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rustbpe.Tokenizer().train_from_iterator(iter(texts), 300, buffer_size=1)


def test_not_an_iterable():
    with pytest.raises(ValueError, match=r"iterator: got 5 \(int\); accepted: an iterable of str"):
        rustbpe.Tokenizer().train_from_iterator(5, 300)


def test_a_bare_str_is_not_a_corpus():
    """A str iterates as single characters: it must be refused, not trained on as one document
    per character (which "succeeds" on non-ASCII text by merging UTF-8 byte pairs)."""
    tok = rustbpe.Tokenizer()
    for corpus in ("ééé ééé", b"abab"):
        with pytest.raises(ValueError, match=r"iterator: got .* \((str|bytes)\); accepted: an iterable of str"):
            tok.train_from_iterator(corpus, 258)
    assert tok.get_merges() == []


def test_pattern_matching_nothing_is_named():
    with pytest.raises(ValueError, match='^pattern: "x\\+" leaves "abc def" of the text unmatched'):
        rustbpe.Tokenizer().train_from_iterator(["abc def"], 300, pattern="x+")


def test_iterator_exception_propagates():
    def texts():
        yield "some text"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        rustbpe.Tokenizer().train_from_iterator(texts(), 300, buffer_size=1)


def test_bad_thread_count(monkeypatch):
    monkeypatch.setenv("RAYON_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="RAYON_NUM_THREADS: got \"many\""):
        rustbpe.Tokenizer().train_from_iterator(["hello"], 300)


def test_encode_rejects_non_text():
    with pytest.raises(ValueError, match=r"text: got b'bytes' \(bytes\); accepted: str"):
        rustbpe.Tokenizer().encode(b"bytes")
    with pytest.raises(ValueError, match="text: not encodable as UTF-8"):
        rustbpe.Tokenizer().encode("\ud800")
