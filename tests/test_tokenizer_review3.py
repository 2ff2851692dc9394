"""Third review of the tokenizer area as a user who trains on their own text and reads tok_eval's
table: a tiktoken cache entry that cannot be read makes tok_eval skip that reference (it crashed
with a traceback), and tok_train's "too little text for --vocab-size" error and start-up banner
name the flags and settings that are really in play. In-process, tiny corpora (well under a second
each)."""

from __future__ import annotations

import hashlib

import pytest

from nanochat.errors import RequestError


def _tiny_data(tmp_path, train_docs):
    from nanochat.dataset import write_text_shards

    data = tmp_path / "data"
    data.mkdir()
    write_text_shards(data, train_docs, ["held-out validation text"])
    return data


def test_an_unreadable_tiktoken_cache_entry_skips_the_reference(tmp_path, monkeypatch):
    """tiktoken opens a cached file it finds without catching OSError: an entry another user's
    umask left unreadable (a shared /tmp/data-gym-cache), or a directory in its place, made
    load_reference raise and tok_eval die with a traceback instead of skipping the comparison."""
    from nanochat.tiktoken_offline import load_reference

    url = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
    (tmp_path / hashlib.sha1(url.encode()).hexdigest()).mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    enc, why = load_reference("cl100k_base")
    assert enc is None and str(tmp_path) in why and "cannot read" in why, why


def test_too_little_text_for_the_vocab_names_the_flags_that_cut_it(tmp_path):
    """The error said "vocab_size: ... accepted: a smaller vocab_size or more training text" when
    --max-chars had stopped the reading: it named no flag of tok_train and not the one to raise."""
    from scripts import tok_train

    data = _tiny_data(tmp_path, ["the cat sat on the mat and the dog sat on the log. " * 40] * 3)
    with pytest.raises(RequestError) as info:
        tok_train.main(["--vocab-size", "2000", "--max-chars", "300", "--data-dir", str(data),
                        "--output-dir", str(tmp_path / "tok")])
    msg = str(info.value)
    assert "--vocab-size: got 2000" in msg and "--max-chars" in msg and "300 chars" in msg, msg
    supported = int(msg.split("support at most ")[1].split()[0])
    assert 265 <= supported < 2000
    assert not (tmp_path / "tok" / "tokenizer.pkl").exists()

    # the whole (short) split was read: raising --max-chars would not help, so it is not suggested
    with pytest.raises(RequestError) as info:
        tok_train.main(["--vocab-size", "2000", "--data-dir", str(data), "--output-dir", str(tmp_path / "tok")])
    msg = str(info.value)
    assert "--vocab-size: got 2000" in msg and "--max-chars" not in msg and "--doc-cap" not in msg, msg
    assert "whole train split" in msg

    # documents cut by --doc-cap: that is the flag to raise
    with pytest.raises(RequestError, match="--doc-cap"):
        tok_train.main(["--vocab-size", "2000", "--doc-cap", "50", "--data-dir", str(data),
                        "--output-dir", str(tmp_path / "tok")])


def test_banner_reports_rayon_num_threads_when_it_sets_the_threads(tmp_path, monkeypatch, capsys):
    """Without --tokenizer-threads rustbpe uses RAYON_NUM_THREADS when it is set, but the banner
    said `tokenizer_threads all` (and the help "default: all cores")."""
    from scripts import tok_train

    data = _tiny_data(tmp_path, ["a b"])
    monkeypatch.setenv("RAYON_NUM_THREADS", "1")
    with pytest.raises(RequestError):   # too little text: the banner is printed before training
        tok_train.main(["--vocab-size", "2000", "--data-dir", str(data), "--output-dir", str(tmp_path / "t")])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "tokenizer_threads" in ln)
    assert line.split()[-1] == "RAYON_NUM_THREADS=1", line
    monkeypatch.setenv("RAYON_NUM_THREADS", "0")   # 0 = all cores, as unset
    with pytest.raises(RequestError):
        tok_train.main(["--vocab-size", "2000", "--data-dir", str(data), "--output-dir", str(tmp_path / "t")])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "tokenizer_threads" in ln)
    assert line.split()[-1] == "all", line
    assert "RAYON_NUM_THREADS" in tok_train.build_parser().format_help()


def test_batch_encode_names_the_item_that_is_not_a_str():
    """A batch with one bad item (a NaN or None from a dataframe column) raised "text: got list;
    accepted: str or list[str]": it was a list, and the message did not say which item was wrong."""
    from nanochat.tokenizer import Tokenizer

    tok = Tokenizer.train(["hello world, hello there " * 4], 270)
    assert tok.encode(["hello", "world"]) == [tok.encode("hello"), tok.encode("world")]
    with pytest.raises(TypeError, match=r"text\[2\]: got NoneType None; accepted: str or list\[str\]"):
        tok.encode(["hello", "world", None])
    with pytest.raises(TypeError, match=r"text\[0\]: got float nan"):
        tok.encode((float("nan"),))


def test_retraining_keeps_the_replaced_tokenizer(tmp_path, capsys):
    """tok_train over a different tokenizer overwrote it and only then said that its checkpoints no
    longer match; load_model then says "restore the original tokenizer", which was gone. The old
    pair is now kept in <output dir>/replaced/<fingerprint>/, loadable as it was."""
    from nanochat.tokenizer import Tokenizer
    from scripts import tok_train

    data = _tiny_data(tmp_path, ["the cat sat on the mat and the dog sat on the log. " * 40] * 3)
    out = tmp_path / "tok"
    tok_train.main(["--vocab-size", "280", "--data-dir", str(data), "--output-dir", str(out)])
    first = Tokenizer.load(out).fingerprint
    tok_train.main(["--vocab-size", "280", "--data-dir", str(data), "--output-dir", str(out)])
    assert "replaced the tokenizer" not in capsys.readouterr().out   # the same one: nothing kept
    assert not (out / "replaced").exists()
    tok_train.main(["--vocab-size", "284", "--data-dir", str(data), "--output-dir", str(out)])
    printed = capsys.readouterr().out
    kept = out / "replaced" / first[:16]
    assert f"replaced the tokenizer {first[:12]}" in printed and str(kept) in printed, printed
    assert Tokenizer.load(kept).fingerprint == first and Tokenizer.load(out).vocab_size == 284
    assert (kept / "token_bytes.pt").read_bytes() != (out / "token_bytes.pt").read_bytes()
