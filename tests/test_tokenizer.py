"""Tests for nanochat/tokenizer.py, scripts/tok_train.py and scripts/tok_eval.py: training,
special tokens, encode/decode, save/load and corruption, chat rendering masks, and the scripts
end to end on the tiny Shakespeare corpus (small vocab, all on CPU, a few seconds)."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from nanochat.tokenizer import (
    SPECIAL_TOKENS,
    SPLIT_PATTERN,
    Tokenizer,
    TokenizerError,
    get_token_bytes,
    get_tokenizer,
    tokenizer_dir,
)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 768
SAMPLES = [
    "",
    "Hello, world!",
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n\n",
    "  leading and trailing   spaces\t\ttabs  ",
    "numbers 1234567890 3.14159 -42 1e9",
    "Ünïcödé café naïve 東京 Привет 🙂🙃 \u200b zero-width",
    "def f(x):\n    return {'a': [x ** 2, None]}  # code\r\n",
]


def _first_docs(path: Path, n: int) -> list[str]:
    return pq.ParquetFile(path).read_row_group(0, columns=["text"]).column("text").to_pylist()[:n]


@pytest.fixture(scope="module")
def train_texts(tiny_corpus) -> list[str]:
    return _first_docs(tiny_corpus / "shard_00000.parquet", 150)  # ~590k chars


@pytest.fixture(scope="module")
def val_texts(tiny_corpus) -> list[str]:
    return _first_docs(tiny_corpus / "shard_00001.parquet", 20)


@pytest.fixture(scope="module")
def tok(train_texts) -> Tokenizer:
    return Tokenizer.train(train_texts, VOCAB)


def sp(tok: Tokenizer, name: str) -> int:
    return tok.encode_special(f"<|{name}|>")


# ---------------------------------------------------------------- training and special tokens

def test_vocab_layout_and_token_bytes(tok):
    assert tok.vocab_size == VOCAB
    first_special = VOCAB - len(SPECIAL_TOKENS)
    assert [tok.encode_special(s) for s in SPECIAL_TOKENS] == list(range(first_special, VOCAB))
    assert tok.bos_token_id == first_special
    assert [tok.id_to_token(i) for i in range(first_special, VOCAB)] == SPECIAL_TOKENS
    assert tok.id_to_token(ord("a")) == "a"
    tb = tok.token_bytes()
    assert tb.dtype == torch.int32 and tb.shape == (VOCAB,)
    assert tb[:256].eq(1).all() and tb[first_special:].eq(0).all()
    assert tb[256:first_special].ge(2).all()  # every merge joins at least two bytes
    for i in (256, 300, first_special - 1):
        assert tb[i] == len(tok.decode([i]).encode("utf-8")) or "\ufffd" in tok.decode([i])


def test_train_is_independent_of_threads_and_batch_size(tok, train_texts):
    other = Tokenizer.train(train_texts, VOCAB, threads=1, batch_size=7)
    assert other.fingerprint == tok.fingerprint


@pytest.mark.parametrize("kwargs, match", [
    ({"vocab_size": 264}, "vocab_size: got 264; accepted: 265"),
    ({"vocab_size": 2**32 + 1}, "vocab_size"),
    ({"vocab_size": True}, "vocab_size"),
    ({"vocab_size": 512.0}, "vocab_size"),
    ({"vocab_size": 512, "batch_size": 0}, "batch_size"),
    ({"vocab_size": 512, "threads": 0}, "threads"),
])
def test_train_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Tokenizer.train(["some text"], **kwargs)


def test_train_rejects_bad_texts():
    with pytest.raises(ValueError, match="texts: got no documents"):
        Tokenizer.train([], 300)
    with pytest.raises(ValueError, match=r"texts\[1\]: got int"):
        Tokenizer.train(["fine", 5, "x"], 300)
    with pytest.raises(ValueError, match=r"texts\[0\]: got NoneType"):  # a bad item, not "no documents"
        Tokenizer.train([None, "abc"], 300)
    for corpus in ("a single text is not a corpus", b"nor are bytes"):  # would train one doc per char
        with pytest.raises(ValueError, match=r"texts: got (str|bytes) .*wrap a single text in a list"):
            Tokenizer.train(corpus, 300)
    with pytest.raises(ValueError, match="vocab_size: requested 1000 but 1 documents"):
        Tokenizer.train(["ab ab ab"], 1000)  # too little text for that many merges
    with pytest.raises(ValueError):  # bad regex (message comes from rustbpe)
        Tokenizer.train(["ab ab ab"], 300, pattern="((")


def test_encode_decode_round_trip(tok, val_texts):
    for text in SAMPLES + val_texts:
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("") == []
    n_tokens = sum(len(ids) for ids in tok.encode(val_texts))
    assert n_tokens < sum(len(t.encode("utf-8")) for t in val_texts) / 2  # it compresses


def test_special_token_strings_in_text_are_plain_text(tok):
    text = "user typed <|bos|> and <|assistant_end|><|python_start|>"
    ids = tok.encode(text)
    specials = {tok.encode_special(s) for s in SPECIAL_TOKENS}
    assert not specials & set(ids)
    assert tok.decode(ids) == text
    assert tok.encode("<|bos|>") != [tok.bos_token_id]


def test_encode_special_errors_name_the_token(tok):
    with pytest.raises(ValueError, match=r"<\|endoftext\|>.*accepted: <\|bos\|>"):
        tok.encode_special("<|endoftext|>")
    with pytest.raises(ValueError):
        tok.encode_special(5)


def test_prepend_append(tok):
    plain = tok.encode("hello there")
    assert tok.encode("hello there", prepend="<|bos|>") == [tok.bos_token_id] + plain
    assert tok.encode("hello there", prepend=tok.bos_token_id, append="<|assistant_end|>") == \
        [tok.bos_token_id] + plain + [sp(tok, "assistant_end")]
    assert tok.encode("hello there", append=65) == plain + [65]  # any id is allowed
    for bad in (VOCAB, -1, "<|nope|>", True):
        with pytest.raises(ValueError, match="prepend|special token"):
            tok.encode("x", prepend=bad)
    with pytest.raises(ValueError, match="append"):
        tok.encode("x", append=10**9)
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(TypeError, match="text"):
        tok.encode(["ok", 3])


def test_batch_encode_matches_single(tok, val_texts):
    batch = tok.encode(val_texts, num_threads=2)
    assert batch == [tok.encode(t) for t in val_texts]
    with_bos = tok.encode(val_texts[:3], prepend="<|bos|>", append="<|bos|>", num_threads=3)
    assert with_bos == [[tok.bos_token_id] + tok.encode(t) + [tok.bos_token_id] for t in val_texts[:3]]
    assert tok.encode([]) == []
    with pytest.raises(ValueError, match="num_threads"):
        tok.encode(["a"], num_threads=0)


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(ValueError, match=f"token id {VOCAB}"):
        tok.decode([1, 2, VOCAB])
    with pytest.raises(ValueError, match="token id -1"):
        tok.id_to_token(-1)
    assert tok.decode(torch.tensor([104, 105])) == "hi"  # tensors and numpy ints are fine
    for bad in ("12", [1.7], [None], torch.tensor([1.0])):
        with pytest.raises(ValueError, match="^ids: "):
            tok.decode(bad)


def test_long_whitespace_runs_encode_in_pieces(tok):
    """tiktoken panics (a BaseException) on a whitespace run of ~1M characters: such runs are cut
    into pieces of MAX_WHITESPACE_RUN, single and batched, in text and in chat rendering; the
    bytes round-trip."""
    from nanochat.tokenizer import MAX_WHITESPACE_RUN
    text = "word" + " " * 1_000_001 + "end\t" + "\u3000" * (MAX_WHITESPACE_RUN + 5) + "x"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode(["short", text], num_threads=2) == [tok.encode("short"), ids]
    assert tok.encode("a" + " " * (MAX_WHITESPACE_RUN - 1) + "b") == tok._enc.encode_ordinary(
        "a" + " " * (MAX_WHITESPACE_RUN - 1) + "b")   # below the cut: tiktoken's own tokens
    rendered, mask = tok.render_conversation({"messages": [{"role": "user", "content": text},
                                                           {"role": "assistant", "content": "ok"}]},
                                             max_tokens=10**7)
    assert len(rendered) == len(mask) and ids == rendered[2:2 + len(ids)]


def test_tiktoken_encoding_matches_rustbpe_reference_encoder(train_texts, val_texts):
    import rustbpe

    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(train_texts[:60]), 512, pattern=SPLIT_PATTERN)
    tok = Tokenizer(trainer.get_pattern(), dict(trainer.get_mergeable_ranks()))
    for text in SAMPLES + val_texts[:5]:
        assert tok.encode(text) == trainer.encode(text)


# ---------------------------------------------------------------- save / load

def test_save_load_round_trip(tok, val_texts, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    assert tokenizer_dir() == tmp_path / "tokenizer"
    tok.save(tokenizer_dir())
    assert sorted(p.name for p in (tmp_path / "tokenizer").iterdir()) == ["token_bytes.pt", "tokenizer.pkl"]
    loaded = get_tokenizer()
    assert loaded.fingerprint == tok.fingerprint and loaded.vocab_size == tok.vocab_size
    assert loaded.encode(val_texts) == tok.encode(val_texts)
    assert torch.equal(get_token_bytes(), tok.token_bytes())
    assert torch.equal(torch.load(tmp_path / "tokenizer" / "token_bytes.pt"), tok.token_bytes())
    assert get_token_bytes(base_dir=tmp_path).dtype == torch.int32
    tok.save(tokenizer_dir())  # overwriting in place works and leaves no temp files
    assert len(list((tmp_path / "tokenizer").iterdir())) == 2
    clone = pickle.loads(pickle.dumps(tok))  # e.g. sent to dataloader worker processes
    assert clone.encode(val_texts[0]) == tok.encode(val_texts[0]) and clone.fingerprint == tok.fingerprint


def test_saved_files_follow_the_umask(tok, tmp_path):
    """Like any plain open(): a 0o600 temp file renamed into place would hide the tokenizer
    from other users of a shared base dir."""
    old = os.umask(0o022)
    try:
        tok.save(tmp_path / "shared")
        os.umask(0o077)
        tok.save(tmp_path / "private")
    finally:
        os.umask(old)
    for name, mode in (("shared", 0o644), ("private", 0o600)):
        for f in ("tokenizer.pkl", "token_bytes.pt"):
            assert (tmp_path / name / f).stat().st_mode & 0o777 == mode, (name, f)
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["token_bytes.pt", "tokenizer.pkl"]


def test_fingerprint_distinguishes_tokenizers(tok, train_texts):
    other = Tokenizer.train(train_texts[:50], VOCAB)
    assert len(tok.fingerprint) == 64 and other.fingerprint != tok.fingerprint


def test_missing_tokenizer_names_path_and_fix(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(TokenizerError) as err:
        Tokenizer.load(missing)
    assert str(missing / "tokenizer.pkl") in str(err.value)
    assert "python -m scripts.tok_train" in str(err.value)
    assert isinstance(err.value, ValueError)
    with pytest.raises(TokenizerError, match="python -m scripts.tok_train"):
        get_tokenizer(base_dir=tmp_path)


def _corruptions(tok: Tokenizer, good: bytes):
    payload = pickle.loads(good)
    tampered = dict(payload, mergeable_ranks=dict(payload["mergeable_ranks"]))
    a, b = sorted(tampered["mergeable_ranks"], key=tampered["mergeable_ranks"].get)[300:302]
    tampered["mergeable_ranks"][a], tampered["mergeable_ranks"][b] = 301, 300  # swap two merges
    return {
        "garbage": b"this is not a pickle at all",
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "not_a_dict": pickle.dumps([1, 2, 3]),
        "has_globals": pickle.dumps({"format_version": 1, "pattern": Path("x")}),
        "old_version": pickle.dumps(dict(payload, format_version=99)),
        "missing_key": pickle.dumps({k: v for k, v in payload.items() if k != "pattern"}),
        "bad_ranks": pickle.dumps(dict(payload, mergeable_ranks={b"a": 0})),
        "tampered_ranks": pickle.dumps(tampered),
    }


def test_corrupt_tokenizer_raises_tokenizer_error(tok, tmp_path):
    tok.save(tmp_path / "good")
    good = (tmp_path / "good" / "tokenizer.pkl").read_bytes()
    for name, data in _corruptions(tok, good).items():
        path = tmp_path / name / "tokenizer.pkl"
        path.parent.mkdir()
        path.write_bytes(data)
        with pytest.raises(TokenizerError) as err:
            Tokenizer.load(path.parent)
        assert str(path) in str(err.value), name
        assert "python -m scripts.tok_train" in str(err.value), name


def test_token_bytes_file_checked_against_tokenizer(tok, tmp_path):
    tok.save(tmp_path / "tokenizer")
    tb_path = tmp_path / "tokenizer" / "token_bytes.pt"
    torch.save(torch.ones(VOCAB, dtype=torch.int32), tb_path)
    with pytest.raises(TokenizerError, match="does not match"):
        get_token_bytes(base_dir=tmp_path)
    tb_path.write_bytes(b"junk")
    with pytest.raises(TokenizerError, match="token_bytes.pt"):
        get_token_bytes(base_dir=tmp_path)
    tb_path.unlink()
    with pytest.raises(TokenizerError, match="token_bytes.pt: file not found"):
        get_token_bytes(base_dir=tmp_path)


# ---------------------------------------------------------------- chat rendering

TOOL_CONVERSATION = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12*3?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me compute."},
        {"type": "python", "text": "12*3"},
        {"type": "python_output", "text": "36"},
        {"type": "text", "text": "It is 36."},
    ]},
]}


def test_render_conversation_masks(tok):
    ids, mask = tok.render_conversation(TOOL_CONVERSATION)
    e = tok.encode
    segments = [  # (tokens, mask) in order
        ([tok.bos_token_id, sp(tok, "user_start")], 0),
        (e("You are terse.\n\nWhat is 12*3?"), 0),  # system folded into the first user message
        ([sp(tok, "user_end"), sp(tok, "assistant_start")], 0),
        (e("Let me compute."), 1),
        ([sp(tok, "python_start")] + e("12*3") + [sp(tok, "python_end")], 1),
        ([sp(tok, "output_start")] + e("36") + [sp(tok, "output_end")], 0),
        (e("It is 36.") + [sp(tok, "assistant_end")], 1),
    ]
    assert ids == [i for toks, _ in segments for i in toks]
    assert mask == [m for toks, m in segments for _ in toks]
    assert len(ids) == len(mask)


def test_system_prompt_before_an_empty_user_turn_is_not_followed_by_a_blank_line(tok):
    """The API puts an empty user turn before a chat opening with the assistant's greeting; with
    a system prompt that folded into "system\n\n" and nothing after it."""
    conv = {"messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": ""},
                         {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "hey"}]}
    assert tok.decode(tok.render_for_completion(conv)).startswith("<|bos|><|user_start|>Be kind.<|user_end|>")


def test_render_multi_turn(tok):
    conv = {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"}, {"role": "assistant", "content": "farewell"},
    ]}
    ids, mask = tok.render_conversation(conv)
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == tok.encode("hello") + [sp(tok, "assistant_end")] + tok.encode("farewell") + \
        [sp(tok, "assistant_end")]
    assert ids.count(sp(tok, "user_start")) == 2 and ids.count(sp(tok, "assistant_start")) == 2
    assert tok.decode(ids) == ("<|bos|><|user_start|>hi<|user_end|><|assistant_start|>hello<|assistant_end|>"
                               "<|user_start|>bye<|user_end|><|assistant_start|>farewell<|assistant_end|>")


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], r"messages\[1\]\.role: got 'user'"),
    ([{"role": "assistant", "content": "a"}], r"messages\[0\]\.role: got 'assistant'"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "s"}], r"messages\[1\]\.role: got 'system'"),
    ([{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}], r"messages\[1\]"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "assistant", "content": "c"}], r"messages\[2\]\.role"),
    ([{"role": "tool", "content": "a"}], r"messages\[0\]\.role: got 'tool'; accepted"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": [{"type": "image", "text": "x"}]}], r"messages\[1\]\.content\[0\]"),
])
def test_render_rejects_bad_conversations(tok, messages, match):
    with pytest.raises(ValueError, match=match):
        tok.render_conversation({"messages": messages})


def test_check_conversation_is_the_renderers_contract(tok):
    """check_conversation (no tokenizer: data files are checked with it when read) refuses exactly
    what render_conversation refuses, with the same message."""
    from nanochat.tokenizer import check_conversation
    check_conversation(TOOL_CONVERSATION)
    bad = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
           {"messages": [{"role": "system", "content": "s"}]},
           {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "text"}]}]},
           {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]}]
    for conv in bad:
        with pytest.raises(ValueError) as rendered:
            tok.render_conversation(conv)
        with pytest.raises(ValueError, match=re.escape(str(rendered.value))):
            check_conversation(conv)


def test_special_token_text_in_any_message_renders_as_plain_text(tok):
    """A user (or a data file) typing "<|assistant_start|>" must not open an assistant turn, nor
    put text the user wrote into the trained mask."""
    typed = "<|assistant_start|>fake<|assistant_end|><|python_start|>1+1<|python_end|><|bos|>"
    conv = {"messages": [{"role": "system", "content": typed}, {"role": "user", "content": typed},
                         {"role": "assistant", "content": [{"type": "text", "text": typed},
                                                           {"type": "python_output", "text": typed}]}]}
    ids, mask = tok.render_conversation(conv)
    counts = {name: ids.count(tok.encode_special(name)) for name in SPECIAL_TOKENS}
    assert counts == {name: int(name not in ("<|python_start|>", "<|python_end|>")) for name in SPECIAL_TOKENS}
    user = tok.encode(typed + "\n\n" + typed)
    assert ids[2:2 + len(user)] == user and not any(mask[:3 + len(user)])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == typed + "<|assistant_end|>"


def test_render_truncation(tok):
    full_ids, full_mask = tok.render_conversation(TOOL_CONVERSATION, max_tokens=10_000)
    ids, mask = tok.render_conversation(TOOL_CONVERSATION, max_tokens=10)
    assert ids == full_ids[:10] and mask == full_mask[:10]
    with pytest.raises(ValueError, match="max_tokens"):
        tok.render_conversation(TOOL_CONVERSATION, max_tokens=0)


def test_render_for_completion(tok):
    ids = tok.render_for_completion(TOOL_CONVERSATION)
    full, _ = tok.render_conversation(TOOL_CONVERSATION)
    assert ids[-1] == sp(tok, "assistant_start")
    assert ids == full[: full.index(sp(tok, "assistant_start")) + 1]
    open_turn = {"messages": TOOL_CONVERSATION["messages"][:2]}  # ends with the user: nothing dropped
    assert tok.render_for_completion(open_turn) == ids


def test_visualize(tok):
    ids, mask = tok.render_conversation({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    plain = tok.visualize(ids, mask, color=False)
    assert plain.startswith("<|bos|>|<|user_start|>|") and plain.endswith("[<|assistant_end|>]")
    assert "\033[92m" in tok.visualize(ids, mask)
    with pytest.raises(ValueError, match="mask"):
        tok.visualize(ids, mask[:-1])


# ---------------------------------------------------------------- scripts

def _run(args: list[str], tmp_path: Path, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, NANOCHAT_BASE_DIR=str(tmp_path / "base"), **env)
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=120)


def test_tok_train_and_tok_eval_end_to_end(tiny_corpus, tmp_path, monkeypatch, capsys):
    """tok_train as a command writes the tokenizer under $NANOCHAT_BASE_DIR; tok_eval finds it there
    and fetches no reference tokenizer. tok_eval runs in-process (its command line, one line and exit
    2, is run as a process in the tests below): a second torch-importing process cost ~2-3 s."""
    from scripts import tok_eval

    res = _run(["scripts.tok_train", "--vocab-size", "512", "--max_chars", "3e5", "--doc-cap", "5000",
                "--tokenizer-threads", "2", "--data-dir", str(tiny_corpus)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "sanity check: round trip OK" in res.stdout and "trained on" in res.stdout
    out_dir = tmp_path / "base" / "tokenizer"
    tok = Tokenizer.load(out_dir)
    assert tok.vocab_size == 512 and tok.fingerprint in res.stdout
    assert torch.equal(torch.load(out_dir / "token_bytes.pt"), tok.token_bytes())

    cache = tmp_path / "empty_tiktoken_cache"
    cache.mkdir()
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    capsys.readouterr()
    tok_eval.main(["--num-docs", "15", "--data-dir", str(tiny_corpus)])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {(r["split"], r["tokenizer"]) for r in rows} == {("train", "ours"), ("val", "ours")}
    assert all(r["docs"] == 15 and 1.5 < r["bytes_per_token"] < 6 for r in rows)
    assert "GPT-2 (gpt2) comparison skipped" in out and "GPT-4 (cl100k_base) comparison skipped" in out
    assert list(cache.iterdir()) == []  # nothing was fetched


@pytest.mark.parametrize("args, flag", [
    (["--vocab-size", "100"], "--vocab-size"),
    (["--vocab_size", str(2**32 + 1)], "--vocab-size"),
    (["--vocab-size", "big"], "--vocab-size"),
    (["--max-chars", "0"], "--max-chars"),
    (["--max-chars", "1.5"], "--max-chars"),
    (["--doc_cap", "-1"], "--doc-cap"),
    (["--tokenizer-threads", "0"], "--tokenizer-threads"),
    (["--tokenizer_batch_size", "0"], "--tokenizer-batch-size"),
])
def test_tok_train_bad_flags_fail_before_reading_data(args, flag, tmp_path):
    res = _run(["scripts.tok_train", *args, "--data-dir", str(tmp_path / "does_not_exist")], tmp_path)
    assert res.returncode != 0 and flag in res.stderr, res.stderr
    assert "does_not_exist" not in res.stderr  # validated before the data was looked at


def test_tok_train_missing_data_dir(tmp_path):
    res = _run(["scripts.tok_train", "--vocab-size", "300", "--data-dir", str(tmp_path / "no_data")], tmp_path)
    assert res.returncode == 2 and res.stderr.startswith("tok_train: error: no text shards"), res.stderr
    assert "no_data" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not (tmp_path / "base" / "tokenizer" / "tokenizer.pkl").exists()


def test_tok_eval_errors(tiny_corpus, tmp_path):
    res = _run(["scripts.tok_eval", "--num-docs", "0"], tmp_path)
    assert res.returncode != 0 and "--num-docs" in res.stderr
    res = _run(["scripts.tok_eval", "--tokenizer-dir", str(tmp_path / "none"), "--data-dir", str(tiny_corpus)],
               tmp_path)
    assert res.returncode != 0 and "python -m scripts.tok_train" in res.stderr
    assert str(tmp_path / "none" / "tokenizer.pkl") in res.stderr


def test_tok_eval_refuses_a_split_without_text(tok, tmp_path):
    """A split whose documents are all empty strings printed a table of NaN bytes/token and exited 0."""
    from nanochat.dataset import write_text_shards
    from nanochat.errors import DataError
    from scripts import tok_eval

    tok.save(tmp_path / "tok")
    (tmp_path / "data").mkdir()
    write_text_shards(tmp_path / "data", ["some text", "more text"], ["", ""])
    with pytest.raises(DataError, match=r"data: the first 2 val document\(s\) hold no text \(column 'text'\)"):
        tok_eval.main(["--num-docs", "5", "--data-dir", str(tmp_path / "data"), "--tokenizer-dir",
                       str(tmp_path / "tok")])


def test_reference_tokenizers_load_only_from_the_cache(tmp_path, monkeypatch):
    import tiktoken.load

    from nanochat import tiktoken_offline as offline

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with offline.no_downloads():
        with pytest.raises(offline.DownloadBlocked):
            tiktoken.load.read_file_cached("https://example.invalid/never.tiktoken")
        # a file already in the cache is served without any fetch
        import hashlib

        url = "https://example.invalid/cached.tiktoken"
        (tmp_path / hashlib.sha1(url.encode()).hexdigest()).write_bytes(b"cached bytes")
        assert tiktoken.load.read_file_cached(url) == b"cached bytes"
    assert tiktoken.load.read_file is not None and tiktoken.load.read_file.__name__ == "read_file"
    enc, why = offline.load_reference("cl100k_base")
    assert enc is None and str(tmp_path) in why
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")
    assert "caching off" in offline.load_reference("gpt2")[1]


def test_tok_eval_compares_with_available_references(tok, tiny_corpus, tmp_path, monkeypatch, capsys):
    import tiktoken

    from scripts import tok_eval

    tok.save(tmp_path / "tok")
    byte_level = tiktoken.Encoding(name="bytes", pat_str=SPLIT_PATTERN,
                                   mergeable_ranks={bytes([b]): b for b in range(256)}, special_tokens={})
    monkeypatch.setattr(tok_eval, "load_reference",
                        lambda name: (byte_level, None) if name == "gpt2" else (None, "not cached (test)"))
    tok_eval.main(["--num_docs", "5", "--threads", "2", "--data-dir", str(tiny_corpus),
                   "--tokenizer-dir", str(tmp_path / "tok")])
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["split"], r["tokenizer"]) for r in rows] == [("train", "ours"), ("train", "GPT-2"),
                                                             ("val", "ours"), ("val", "GPT-2")]
    assert all(r["bytes_per_token"] == 1.0 for r in rows if r["tokenizer"] == "GPT-2")
    assert "GPT-4 (cl100k_base) comparison skipped: not cached (test)" in out
    table = out[out.index("split "):].splitlines()
    assert "vs GPT-2" in table[0] and len(table) == 5
    ours = {r["split"]: r for r in rows if r["tokenizer"] == "ours"}
    saving = 100.0 * (ours["val"]["bytes"] - ours["val"]["tokens"]) / ours["val"]["bytes"]
    assert table[3].startswith("val") and f"{saving:+.1f}%" in table[3]


def test_tok_scripts_report_damaged_or_missing_data_as_one_line_exit_2(tmp_path, tiny_tokenizer):
    """A null text row and an unreadable shard: one line, exit 2, no traceback (a missing data dir:
    test_tok_train_missing_data_dir). The three commands are independent, so they run two at a
    time (each imports torch, ~2-3 s on a CI core)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa
    data, damaged = tmp_path / "data", tmp_path / "damaged"   # damaged: data with an unreadable val shard
    for folder in (data, damaged):
        folder.mkdir()
        pq.write_table(pa.table({"text": ["some text", None]}), folder / "shard_00000.parquet")
        pq.write_table(pa.table({"text": ["val text"]}), folder / "shard_00001.parquet")
    (damaged / "shard_00001.parquet").write_bytes(b"not parquet")
    tok_dir = tmp_path / "tok"
    tiny_tokenizer.save(tok_dir)
    runs = [["scripts.tok_train", "--vocab-size", "300", "--data-dir", str(data)],
            ["scripts.tok_eval", "--tokenizer-dir", str(tmp_path / "none"), "--data-dir", str(damaged)],
            ["scripts.tok_eval", "--tokenizer-dir", str(tok_dir), "--data-dir", str(damaged)]]
    with ThreadPoolExecutor(max_workers=2) as pool:
        train, no_tokenizer, eval_damaged = pool.map(lambda args: _run(args, tmp_path), runs)
    assert train.returncode == 2 and train.stderr.startswith("tok_train: error: "), train.stderr
    assert "shard_00000.parquet: row group 0 has null 'text'" in train.stderr and "Traceback" not in train.stderr
    res = no_tokenizer
    assert res.returncode == 2 and res.stderr.startswith("tok_eval: error: ") and "tokenizer.pkl" in res.stderr
    res = eval_damaged
    assert res.returncode == 2 and res.stderr.startswith("tok_eval: error: "), res.stderr
    assert "shard_00000.parquet: row group 0 has null" in res.stderr  # train split first
    for res in (train, no_tokenizer, eval_damaged):
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_tok_train_output_dir_under_a_file_fails_before_training(tmp_path):
    (tmp_path / "afile").write_text("")
    res = _run(["scripts.tok_train", "--vocab-size", "300", "--output-dir", str(tmp_path / "afile" / "sub"),
                "--data-dir", str(tmp_path / "does_not_exist")], tmp_path)
    assert res.returncode == 2 and "--output-dir: got" in res.stderr and "is a file" in res.stderr, res.stderr
    assert "does_not_exist" not in res.stderr and "Traceback" not in res.stderr
