"""Audit of the Rust BPE trainer (rustbpe/) and its wrapper (nanochat/tokenizer.py) as a demanding user
drives them: pickling, re-entrant and concurrent use, explicit thread counts, split patterns that
tiktoken would silently mangle, special tokens that collide with merges, parity with tiktoken on varied
text, determinism, and the tok_train / bench_tokenizer flag checks. Each regression test names the bug
it guards (the symptom on the code before the fix)."""

from __future__ import annotations

import copy
import os
import pickle
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import require_module

rustbpe = require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")
import tiktoken  # noqa: E402

from nanochat.tokenizer import SPLIT_PATTERN, Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# Text of every kind the tokenizer meets: prose, code, CJK, emoji (with ZWJ and flags), combining marks,
# digits, whitespace runs of all sorts, contractions in odd cases, NUL and other controls.
VARIED = [
    "The quick brown fox jumps over the lazy dog. It's 12:34 on 2024-06-01; don't panic.",
    "def f(x):\n\treturn {'a': [x ** 2, None]}  # code\r\n\n    if x != 0: pass\n",
    "東京都は日本の首都です。中文文本测试，你好世界！한국어 텍스트 ภาษาไทย",
    "😀😃 👨\u200d👩\u200d👧 🇫🇷🇩🇪 e\u0301 n\u0303 \ufeffbom",
    "1234567890 3.14159 -42 1e9 ٣٤٥ ½ ⅞ 10²",
    "   \n\n\t\t \u00a0\u2028\u3000  trailing   ",
    "'S 'LL 'Ve 'RE 'd 'ſ İstanbul ǅ ﬁ straße",
    "nul\x00byte and \x1c separators \x7f",
]
ALPHABET = list("aZé中ßſK1٣½ \t\n\r\u00a0\u2028\u3000\u0085'sSlLvVeErRtTdDmM.!-😀\u0301\u001c_\x00{}()<>|\\\"#")


@pytest.fixture(scope="module")
def corpus(tiny_corpus) -> list[str]:
    docs = pq.ParquetFile(tiny_corpus / "shard_00000.parquet").read_row_group(0, columns=["text"])
    return docs.column("text").to_pylist()[:120] + VARIED * 20


@pytest.fixture(scope="module")
def trainer(corpus):
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(corpus, 1024)
    return tok


def tiktoken_for(tok) -> tiktoken.Encoding:
    return tiktoken.Encoding("audit", pat_str=tok.get_pattern(), mergeable_ranks=dict(tok.get_mergeable_ranks()),
                             special_tokens={})


def random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(60)))
        if rng.random() < 0.5:
            base = rng.choice(VARIED)
            i = rng.randrange(len(base))
            text = base[i:i + rng.randrange(40)] + text
        out.append(text)
    return out


# ---------------------------------------------------------------- pickling (was: TypeError)

def test_trainer_pickles_and_copies(trainer):
    """rustbpe.Tokenizer could not be pickled or deep-copied ("cannot pickle 'rustbpe.Tokenizer'
    object"), so it could not go to a multiprocessing worker."""
    clones = [pickle.loads(pickle.dumps(trainer, protocol=p)) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    for clone in clones + [copy.deepcopy(trainer), copy.copy(trainer)]:
        assert clone.get_merges() == trainer.get_merges()
        assert clone.get_pattern() == trainer.get_pattern()
        assert clone.get_mergeable_ranks() == trainer.get_mergeable_ranks()
        for text in VARIED:
            assert clone.encode(text) == trainer.encode(text)
    custom = rustbpe.Tokenizer()
    custom.train_from_iterator(["aa bb aa bb"], 260, pattern=r"\S+\s*")
    assert pickle.loads(pickle.dumps(custom)).get_pattern() == r"\S+\s*"
    assert pickle.loads(pickle.dumps(rustbpe.Tokenizer())).get_merges() == []


@pytest.mark.parametrize("state, match", [
    (None, "state: got None"),
    ((1, "x"), "state: got"),
    ((2, SPLIT_PATTERN, []), "version 2 is not supported"),
    ((1, "((", []), 'pattern: invalid regex "\\(\\("'),
    ((1, SPLIT_PATTERN, [(97, 256)]), r"merge 0 is \(97, 256\); accepted: token ids below 256"),
    ((1, SPLIT_PATTERN, [(97, 98), (300, 1)]), r"merge 1 is \(300, 1\)"),
    ((1, SPLIT_PATTERN, [(97, 98), (97, 98)]), "repeats an earlier merge"),
    ((1, SPLIT_PATTERN, [(-1, 98)]), "state: got"),
    ((1, SPLIT_PATTERN, "ab"), "state: got"),
])
def test_unpickling_bad_state_is_a_value_error(state, match):
    """A pickle is outside data: a merge naming a token that does not exist yet would index past the
    vocabulary in Rust (a panic); every bad state is a ValueError and the tokenizer is unchanged."""
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(["abab abab"], 257)
    with pytest.raises(ValueError, match=match):
        tok.__setstate__(state)
    assert tok.get_merges() == [(97, 98, 256)]


def test_nanochat_tokenizer_pickles(corpus):
    tok = Tokenizer.train(corpus[:40], 400)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.fingerprint == tok.fingerprint
    assert clone.encode(VARIED) == tok.encode(VARIED)


# ---------------------------------------------------------------- re-entrant and concurrent use

def test_training_iterator_may_use_the_trainer():
    """The iterator runs Python code while the trainer trains: calling the same trainer from it (say,
    to log progress) raised RuntimeError "Already mutably borrowed". It now sees the previous model."""
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(["hello hello"], 257)
    before = tok.get_merges()
    seen = []

    def texts():
        yield "abc abc"
        seen.append((tok.get_merges(), tok.encode("hello"), tok.get_pattern()))
        yield "abd abd"

    tok.train_from_iterator(texts(), 258, buffer_size=1)
    assert seen == [(before, tok_encode_with(before, "hello"), SPLIT_PATTERN)]
    assert tok.get_merges() == [(97, 98, 256), (32, 256, 257)]


def tok_encode_with(merges, text):
    state = (1, SPLIT_PATTERN, [(left, right) for left, right, _ in merges])
    tok = rustbpe.Tokenizer()
    tok.__setstate__(state)
    return tok.encode(text)


def test_other_threads_encode_while_training(trainer, corpus):
    """Encoding from another thread while the same object trains raised RuntimeError ("Already
    mutably borrowed"); now the other thread gets the previous model's ids."""
    tok = copy.deepcopy(trainer)
    want = trainer.encode(VARIED[0])
    results, errors = [], []

    def encode_elsewhere():
        try:
            results.append(tok.encode(VARIED[0]))
        except Exception as e:  # noqa: BLE001 - the test reports whatever the other thread raised
            errors.append(e)

    def texts():
        for i, doc in enumerate(corpus):
            if i == 3:
                t = threading.Thread(target=encode_elsewhere)
                t.start()
                t.join()
            yield doc

    tok.train_from_iterator(texts(), 1024, buffer_size=2)
    assert errors == [] and results == [want]
    assert tok.get_merges() == trainer.get_merges()


def test_concurrent_encode_is_identical_and_releases_the_gil(trainer, corpus):
    big = "\n".join(corpus) * 2
    want = trainer.encode(big)
    assert want == tiktoken_for(trainer).encode_ordinary(big)
    out = [None] * 4
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, trainer.encode(big))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o == want for o in out)
    # While one thread encodes (GIL released), another keeps running Python code.
    ticks, done = [0], threading.Event()

    def ticker():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.0005)

    t = threading.Thread(target=ticker)
    t.start()
    time.sleep(0.01)
    before = ticks[0]
    for _ in range(3):
        trainer.encode(big)
    during = ticks[0] - before
    done.set()
    t.join()
    assert during >= 3, f"the ticker thread ran {during} times during 3 encodes: the GIL was held"


def test_concurrent_training_of_one_trainer(corpus):
    """Two threads training one object at the same time: the second raised RuntimeError ("Already
    mutably borrowed"). Now both finish and the object holds one whole model."""
    tok = rustbpe.Tokenizer()
    first_reading, second_started, errors = threading.Event(), threading.Event(), []

    def texts_1():
        yield from corpus[:30]
        first_reading.set()
        assert second_started.wait(30)
        yield from corpus[30:60]

    def texts_2():
        second_started.set()
        yield from corpus[:60]

    def train(texts, vocab, after=None):
        try:
            if after is not None:
                assert after.wait(30)
            tok.train_from_iterator(texts(), vocab, buffer_size=4)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            second_started.set()   # (if the second call failed early, the first must not wait)

    threads = [threading.Thread(target=train, args=(texts_1, 300)),
               threading.Thread(target=train, args=(texts_2, 400, first_reading))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(tok.get_merges()) in (44, 144)  # one whole model or the other, never a mix


# ---------------------------------------------------------------- threads (was: os.environ games)

@pytest.mark.parametrize("threads, match", [
    (0, "threads: got 0"), (1025, "threads: got 1025"), (-2, "threads: got -2"),
    (True, r"threads: got True \(bool\)"), ("4", r"threads: got '4' \(str\)"), (2**70, "threads: got 1180"),
])
def test_threads_argument_checked_before_reading(threads, match):
    """rustbpe had no threads argument: callers set RAYON_NUM_THREADS around the call (process-global),
    and any count was accepted: 5,000 threads took ~50 s on this machine for a 100-document corpus."""
    pulled = []

    def texts():
        pulled.append(1)
        yield "hello"

    with pytest.raises(ValueError, match=match + r".*accepted: an int from 1 to 1024, or None"):
        rustbpe.Tokenizer().train_from_iterator(texts(), 300, threads=threads)
    assert pulled == []


def test_rayon_num_threads_over_the_limit_is_named(monkeypatch):
    monkeypatch.setenv("RAYON_NUM_THREADS", "5000")
    with pytest.raises(ValueError, match=r'RAYON_NUM_THREADS: got "5000"; accepted: an int from 0 to 1024'):
        rustbpe.Tokenizer().train_from_iterator(["hello"], 300)


def test_merges_do_not_depend_on_threads_or_runs(corpus, monkeypatch):
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    runs = []
    for threads, buffer_size in ((None, 8192), (1, 8192), (2, 3), (3, 1), (None, 8192)):
        tok = rustbpe.Tokenizer()
        tok.train_from_iterator(iter(corpus), 1024, buffer_size=buffer_size, threads=threads)
        runs.append(tok.get_merges())
    assert all(r == runs[0] for r in runs) and len(runs[0]) == 768


def test_tokenizer_train_leaves_the_environment_alone(monkeypatch, corpus):
    """Tokenizer.train(threads=N) set RAYON_NUM_THREADS for the call and restored it afterwards: other
    threads saw it meanwhile, and two concurrent calls ending in the wrong order left it set for good."""
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    b_started, a_done, seen, errors = threading.Event(), threading.Event(), [], []

    def texts_a():
        yield corpus[0]
        seen.append(os.environ.get("RAYON_NUM_THREADS"))
        assert b_started.wait(30)
        yield corpus[1]

    def texts_b():
        yield corpus[2]
        b_started.set()
        seen.append(os.environ.get("RAYON_NUM_THREADS"))
        assert a_done.wait(30)
        yield corpus[3]

    def run(texts, threads, done=None):
        try:
            Tokenizer.train(texts(), 300, threads=threads, batch_size=1)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
        finally:
            if done is not None:
                done.set()

    a = threading.Thread(target=run, args=(texts_a, 1, a_done))
    a.start()
    deadline = time.monotonic() + 30
    while not seen and a.is_alive() and time.monotonic() < deadline:   # until A is inside its call
        time.sleep(0.001)
    b = threading.Thread(target=run, args=(texts_b, 2))
    b.start()
    a.join(60)
    b.join(60)
    assert errors == []
    assert seen == [None, None]
    assert "RAYON_NUM_THREADS" not in os.environ


def test_tokenizer_train_threads_limit():
    with pytest.raises(ValueError, match="threads: got 5000; accepted: 1..1024"):
        Tokenizer.train(["hello world"], 300, threads=5000)


# ---------------------------------------------------------------- split patterns tiktoken would mangle

@pytest.mark.parametrize("pattern, match", [
    (r"\S+\s*", "leaves part of ' ' unmatched"),           # leading whitespace would vanish
    (r"\w+|\s+", "leaves part of"),                         # punctuation would vanish
    (r"\p{L}+", "leaves part of"),
    (r"\s*|\S+", "can match the empty string"),             # empty matches: tiktoken panics (refused
    ("a*", "can match the empty string"),                   # by their structure, before it runs them)
    ("((", "invalid regex"),
    ("", "non-empty regex"),
])
def test_training_refuses_a_pattern_tiktoken_cannot_use(pattern, match):
    """tiktoken keeps only the regex's matches: a pattern leaving characters unmatched trained fine and
    then encoded text with those characters silently dropped (decode(encode(x)) != x), and one that
    matches the empty string made tiktoken panic (PanicException, not an Exception) on ordinary text.
    Both are refused, naming the pattern, before any text is read."""
    pulled = []

    def texts():
        pulled.append(1)
        yield "some text  here"

    with pytest.raises(ValueError, match="^pattern: .*" + match):
        Tokenizer.train(texts(), 300, pattern=pattern)
    assert pulled == []


def test_a_covering_custom_pattern_still_trains():
    tok = Tokenizer.train(["  aa bb, aa bb!\n"] * 50, 256 + 9 + 3, pattern=r"\S+|\s+")
    for text in VARIED:
        assert tok.decode(tok.encode(text)) == text


def test_special_token_strings_that_are_also_merges():
    """A custom pattern can learn "<|bos|>" as an ordinary merged token: typed text must keep that
    ordinary id, the special id stays distinct, and both decode to the same string."""
    tok = Tokenizer.train(["<|bos|>"] * 300 + ["ab"], 256 + 9 + 7, pattern=r"\S+|\s+")
    ids = tok.encode("<|bos|>")
    assert len(ids) == 1 and ids[0] != tok.bos_token_id and ids[0] < 256 + 7
    assert tok.decode(ids) == tok.decode([tok.bos_token_id]) == "<|bos|>"
    assert tok.token_bytes()[ids[0]] == 7 and tok.token_bytes()[tok.bos_token_id] == 0
    rendered, mask = tok.render_conversation({"messages": [{"role": "user", "content": "<|bos|>"},
                                                           {"role": "assistant", "content": "<|bos|>"}]})
    assert rendered.count(tok.bos_token_id) == 1 and rendered.count(ids[0]) == 2


# ---------------------------------------------------------------- parity with tiktoken, round trips

def test_rust_encode_tiktoken_and_nanochat_agree(trainer, corpus):
    enc = tiktoken_for(trainer)
    tok = Tokenizer(trainer.get_pattern(), dict(trainer.get_mergeable_ranks()))
    texts = VARIED + random_texts(1500)
    batch = tok.encode(texts, num_threads=2)
    for text, ids in zip(texts, batch):
        assert trainer.encode(text) == enc.encode_ordinary(text) == ids, repr(text)
        assert tok.decode(ids) == text


def test_lone_surrogates_are_value_errors_everywhere(trainer):
    for call in (lambda: trainer.encode("a\ud800b"),
                 lambda: rustbpe.Tokenizer().train_from_iterator(["ok", "x\udfff"], 300, buffer_size=1)):
        with pytest.raises(ValueError, match="not encodable as UTF-8"):
            call()


def test_an_enormous_single_word_trains_and_round_trips():
    """A 300k-character letter run is one regex chunk: training and both encoders cope, and agree
    (rustbpe.encode merges chunks of 64+ bytes with a heap: it took ~5 s for a 400k-letter chunk)."""
    rng = random.Random(3)
    word = "".join(rng.choice("abcdefghij") for _ in range(300_000))
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator([word, "x y"], 512)
    enc = tiktoken_for(tok)
    ids = enc.encode_ordinary(word)
    assert enc.decode(ids) == word and tok.encode(word) == ids
    for n in (1, 2, 63, 64, 65, 200):   # either side of the heap's threshold
        assert tok.encode(word[:n]) == enc.encode_ordinary(word[:n])


def test_vocab_size_limits_are_value_errors():
    for vocab in (255, -1, 2**32, 2**70, None, 3.5):
        with pytest.raises(ValueError, match="vocab_size: got .*accepted: an int from 256 .*to 4294967295"):
            rustbpe.Tokenizer().train_from_iterator(["abc"], vocab)


# ---------------------------------------------------------------- scripts

def test_tok_train_checks_every_shard_before_training(tiny_corpus, tmp_path, monkeypatch):
    """A truncated train shard after a good one was found only when training reached it: with 2e9
    characters to read, minutes of work before the error."""
    from nanochat.errors import DataError
    from scripts import tok_train

    data = tmp_path / "data"
    data.mkdir()
    good = (tiny_corpus / "shard_00000.parquet").read_bytes()
    (data / "shard_00000.parquet").write_bytes(good)
    (data / "shard_00001.parquet").write_bytes(good[: len(good) // 3])   # cut short, as by a full disk
    (data / "shard_00002.parquet").write_bytes((tiny_corpus / "shard_00001.parquet").read_bytes())
    trained = []
    monkeypatch.setattr(tok_train.Tokenizer, "train", lambda *a, **k: trained.append(1))
    with pytest.raises(DataError, match="shard_00001.parquet: not a readable parquet file"):
        tok_train.main(["--vocab-size", "300", "--data-dir", str(data), "--output-dir", str(tmp_path / "out")])
    assert trained == [] and not (tmp_path / "out" / "tokenizer.pkl").exists()


def test_tok_train_refuses_absurd_thread_counts(tmp_path):
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "scripts.tok_train", "--tokenizer-threads", "5000",
                          "--data-dir", str(tmp_path / "missing")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "--tokenizer-threads: got 5000; accepted: 1..1024" in res.stderr, res.stderr
    assert "missing" not in res.stderr


@pytest.mark.parametrize("args, match", [
    (["--vocab-size", str(2**32)], "--vocab-size: got 4294967296; accepted: an int from 256 to 4294967295"),
    (["--threads", "5000"], "--threads: got 5000; accepted: an int from 1 to 1024"),
])
def test_bench_tokenizer_flags(args, match, shared_data):
    """An out-of-range vocab size passed the flag check and failed inside the training subprocess
    (a CalledProcessError traceback) after the 50M characters had been read and pickled."""
    from scripts import bench_tokenizer

    with pytest.raises(ValueError, match=match):
        bench_tokenizer.parse_args([*args, "--data-dir", str(shared_data / "pretrain" / "tiny")])
