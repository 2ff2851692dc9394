"""DataLoader on damaged, mismatched or changing data: unreadable shards and row groups, empty
splits, stale or unfinished binary shards, bad UTF-8, open-file limits, shards replaced under a
running loader, resume across pretokenizing, CRLF text (split out of test_dataloader.py)."""

import hashlib
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import tests.test_dataloader as base
from nanochat.binshards import HEADER_SIZE, META_NAME, default_bin_dir
from nanochat.errors import DataError, MissingDataError, RequestError
from scripts.pretokenize import pretokenize
from tests.test_dataloader import ByteTokenizer, loader, make_docs, write_shards

corpus, binned = base.corpus, base.binned   # the shared fixtures


def corrupt_row_group(path, rg: int) -> None:
    """Zero the start of one row group's first page: the footer stays valid, the group does not
    decode (as with a disk error mid-file)."""
    meta = pq.ParquetFile(path).metadata.row_group(rg).column(0)
    start = meta.dictionary_page_offset or meta.data_page_offset
    raw = bytearray(path.read_bytes())
    raw[start:start + 32] = bytes(32)
    path.write_bytes(bytes(raw))


def test_damaged_text_shards_are_data_errors_at_construction(tmp_path, corpus):
    data_dir, _ = corpus
    truncated = data_dir / "shard_00001.parquet"
    truncated.write_bytes(truncated.read_bytes()[:300])
    with pytest.raises(DataError, match="shard_00001.parquet: not a readable parquet file"):
        loader(data_dir)
    nulls = write_shards(tmp_path / "nulls", [["a", None, "b"], ["c"]])
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 0 has null 'text'"):
        loader(nulls)


def test_null_texts_without_statistics_fail_when_read(tmp_path):
    d = tmp_path / "nostats"
    d.mkdir()
    pq.write_table(pa.table({"text": ["ab", None]}), d / "shard_00000.parquet", write_statistics=False)
    pq.write_table(pa.table({"text": ["cd"]}), d / "shard_00001.parquet")
    dl = loader(d, prefetch=1)
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 0 has null 'text'"):
        next(dl)


def test_row_group_that_does_not_decode_names_shard_and_group(tmp_path):
    docs = [hashlib.sha256(str(i).encode()).hexdigest() * 8 for i in range(64)]
    d = tmp_path / "mid"
    d.mkdir()
    pq.write_table(pa.table({"text": docs}), d / "shard_00000.parquet", row_group_size=16, compression="zstd")
    pq.write_table(pa.table({"text": docs[:4]}), d / "shard_00001.parquet")
    corrupt_row_group(d / "shard_00000.parquet", 2)
    dl = loader(d, B=1, prefetch=0, buffer_size=1)
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 2 is unreadable .*re-create") as e:
        for _ in range(200):
            next(dl)
    assert "\n" not in str(e.value)  # printed as one line


def test_split_of_empty_documents_is_an_error(tmp_path):
    empty = write_shards(tmp_path / "empty", [["", ""], ["x"]])
    with pytest.raises(MissingDataError, match=r"split 'train' .* has no non-empty documents"):
        loader(empty)  # proven by the parquet statistics: before any batch
    assert next(loader(empty, split="val"))[0].shape == (4, 64)  # the val split is fine
    d = tmp_path / "nostats"  # without statistics only reading shows it: the first batch fails
    d.mkdir()
    pq.write_table(pa.table({"text": ["", "", ""]}), d / "shard_00000.parquet", write_statistics=False)
    pq.write_table(pa.table({"text": ["x"]}), d / "shard_00001.parquet")
    with pytest.raises(MissingDataError, match="no non-empty documents"):
        next(loader(d, prefetch=1))


def test_damaged_binary_shards_are_data_errors(binned):
    data_dir, _ = binned
    bin_dir = default_bin_dir(data_dir)
    shard = bin_dir / "shard_00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(b"garbage!" + good[8:])
    with pytest.raises(DataError, match="shard_00000.bin: not a nanochat binary token shard"):
        loader(data_dir, "bin")
    shard.write_bytes(good[:-100])
    with pytest.raises(DataError, match="shard_00000.bin: truncated or corrupt"):
        loader(data_dir, "bin")
    raw = bytearray(good)
    raw[-16:-8] = (10**6).to_bytes(8, "little")  # an offset past the end
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match="shard_00000.bin: corrupt document offsets"):
        loader(data_dir, "bin")
    raw = bytearray(good)
    raw[HEADER_SIZE + 2:HEADER_SIZE + 4] = (300).to_bytes(2, "little")  # doc 0, token 1: >= vocab 257
    shard.write_bytes(bytes(raw))
    dl = loader(data_dir, "bin", prefetch=1)  # ids are checked as documents are read
    with pytest.raises(DataError, match="shard_00000.bin: document 0 has token id 300 >= the vocab size 257"):
        for _ in range(100):
            next(dl)
    shard.write_bytes(good)
    other_vocab = ByteTokenizer()
    other_vocab.vocab_size = 300
    with pytest.raises(DataError, match="made for vocab size 257, the tokenizer has 300"):
        loader(data_dir, "bin", tok=other_vocab)
    with pytest.raises(DataError, match="tokenizer mismatch"):
        loader(data_dir, "bin", tok=ByteTokenizer("other"))


def test_stale_binary_shards_are_refused_when_picked_automatically(binned):
    data_dir, shards = binned
    bin_dir = default_bin_dir(data_dir)
    assert loader(data_dir, "auto").describe_source() == f"binary token shards {bin_dir}"
    write_shards(data_dir, [shards[0], shards[1][:-3]] + shards[2:])  # shard 1 changed since
    with pytest.raises(DataError) as e:
        loader(data_dir, "auto")
    msg = str(e.value)
    assert f"{bin_dir} was made from other text shards than {data_dir}" in msg
    assert "changed: shard_00001.parquet" in msg and "pretokenize" in msg and "--force" in msg
    loader(data_dir, "bin")  # asked for explicitly: read as they are
    meta = json.loads((bin_dir / META_NAME).read_text())
    del meta["text_shards"]  # a directory made before the record existed: accepted
    (bin_dir / META_NAME).write_text(json.dumps(meta))
    loader(data_dir, "auto")
    pretokenize(sorted(data_dir.glob("*.parquet")), bin_dir, ByteTokenizer(), log=lambda *a: None)
    assert loader(data_dir, "auto").describe_source().startswith("binary token shards")
    (data_dir / "shard_00004.parquet").write_bytes((data_dir / "shard_00003.parquet").read_bytes())
    with pytest.raises(DataError, match="new: shard_00004.parquet"):
        loader(data_dir, "auto")
    assert loader(data_dir, "text").describe_source() == f"text shards {data_dir}"


def test_unfinished_binary_shard_directories_are_refused(binned):
    """An interrupted pretokenize leaves some shards: read as a whole, its last one (a train shard)
    would be the validation split. Refused, picked automatically or asked for, until a rerun."""
    from nanochat import binshards_runs as runs
    data_dir, _ = binned
    bin_dir = default_bin_dir(data_dir)
    text = sorted(data_dir.glob("*.parquet"))
    runs.start_run(bin_dir, text, data_dir)  # what a run records before its first shard
    (bin_dir / "shard_00003.bin").unlink()
    for source in ("auto", "bin"):
        with pytest.raises(DataError) as e:
            loader(data_dir, source)
        msg = str(e.value)
        assert f"{bin_dir} is incomplete" in msg and "3 of 4 binary shards written; missing: shard_00003.bin" in msg
        assert f"python -m scripts.pretokenize --data-dir {data_dir}" in msg
    with pytest.raises(DataError, match="is incomplete"):
        loader(data_dir, "auto", split="val")
    pretokenize(text, bin_dir, ByteTokenizer(), log=lambda *a: None)  # the rerun finishes it
    assert loader(data_dir, "auto").describe_source() == f"binary token shards {bin_dir}"
    meta = json.loads((bin_dir / META_NAME).read_text())
    del meta["complete"]  # a finished directory from before `complete` existed: still read
    (bin_dir / META_NAME).write_text(json.dumps(meta))
    assert loader(data_dir, "auto").describe_source() == f"binary token shards {bin_dir}"
    loader(data_dir, "bin", split="val")
    # ... and one of those left by an interrupted run: no record at all
    del meta["text_shards"]
    (bin_dir / META_NAME).write_text(json.dumps(meta))
    (bin_dir / "shard_00003.bin").unlink()
    with pytest.raises(DataError, match=r"holds 3 binary shards, not one for each of the 4 text shards in .*"
                                        r"\(missing: shard_00003.bin\); re-run `python -m scripts.pretokenize"):
        loader(data_dir, "auto")


def test_invalid_utf8_text_fails_the_first_batch_naming_the_shard(tmp_path):
    d = write_shards(tmp_path / "d", [make_docs(20), make_docs(5, seed=1)])
    texts = pa.array([t.encode() for t in make_docs(20)[:19]] + [b"bad \xff"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": texts}), d / "shard_00000.parquet", row_group_size=16)
    dl = loader(d, prefetch=1)  # construction reads footers only (their max is not UTF-8 either)
    with pytest.raises(DataError, match=r"shard_00000.parquet: row group 1 holds text that is not valid UTF-8 "
                                        r"\(row 3, byte 4: invalid start byte\)"):
        for _ in range(20):
            next(dl)


# ------------------------------------------------------------------ audit regressions

def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
@pytest.mark.parametrize("source", ["text", "bin"])
def test_many_shards_do_not_hold_a_file_each(tmp_path, source):
    """Every shard was kept open (a parquet reader or a memmap each): a split of more shards than
    the open-file limit (1024 by default) failed, text shards with 'not a readable parquet file
    ... Too many open files; delete it and re-create'."""
    d = write_shards(tmp_path / "d", [make_docs(3, seed=i) for i in range(60)])
    if source == "bin":
        pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), ByteTokenizer(), log=lambda *a: None)
    import gc
    gc.collect()  # earlier tests' loaders: closed now, not while counting
    before = open_fds()
    dl = loader(d, source, B=2, T=400, prefetch=0, buffer_size=40)
    assert open_fds() - before <= 3
    for _ in range(6):  # ~2 passes over all 59 train shards
        next(dl)
    assert open_fds() - before <= 12  # the shard being read (binary: a few, for the buffer)
    dl.close()


@pytest.mark.parametrize("source", ["text", "bin"])
def test_shard_replaced_after_construction_is_a_data_error(binned, source):
    """Shards are reopened as they are read: one that changed since is named, not misread."""
    from nanochat.binshards import write_shard
    data_dir, shards = binned
    dl = loader(data_dir, source, prefetch=0)
    if source == "text":
        write_shards(data_dir, [shards[0][:-5]])
    else:
        write_shard(default_bin_dir(data_dir) / "shard_00000.bin", [[256, 97]], vocab_size=257,
                    bos_token_id=256, fingerprint=ByteTokenizer().fingerprint)
    with pytest.raises(DataError, match=r"shard_00000\.(parquet|bin): changed since the data loader opened it"):
        next(dl)


def test_resume_of_a_text_run_after_pretokenizing(corpus):
    """A run started on text shards, then pretokenized: the resumed loader (source auto) picked
    the binary shards and refused the checkpoint's state; there is no flag to pick the source."""
    data_dir, _ = corpus
    ref = loader(data_dir, "auto", prefetch=2)
    batches, states = [], []
    for _ in range(10):
        batches.append(next(ref))
        states.append(ref.state_dict())
    ref.close()
    state3, state = states[2], states[-1]
    pretokenize(sorted(data_dir.glob("*.parquet")), default_bin_dir(data_dir), ByteTokenizer(), log=lambda *a: None)
    dl = loader(data_dir, "auto", prefetch=2)
    assert dl.describe_source().startswith("binary token shards")
    dl.load_state_dict(state3)  # continues exactly, on the text shards the checkpoint read
    assert dl.describe_source() == f"text shards {data_dir}"
    for j in range(3, 10):
        x, y = next(dl)
        assert torch.equal(x, batches[j][0]) and torch.equal(y, batches[j][1])
    assert dl.state_dict() == state
    dl.close()
    with pytest.raises(RequestError, match="--max-seq-len"):  # other settings: still refused
        loader(data_dir, "auto", T=48).load_state_dict(state)
    bin_state = loader(data_dir, "bin").state_dict()
    for p in default_bin_dir(data_dir).iterdir():
        p.unlink()
    with pytest.raises(RequestError, match=r"read binary token shards, .*python -m scripts.pretokenize"):
        loader(data_dir, "auto").load_state_dict(bin_state)


def test_local_txt_with_windows_line_endings_is_split_at_blank_lines(tmp_path):
    """A long CRLF .txt file (Project Gutenberg's format) was never split (the blank-line pattern
    wanted \\n\\n), so it became one document, cropped by the loader to a single row."""
    from nanochat.local_data import read_local_documents
    src = tmp_path / "src"
    src.mkdir()
    paras = [f"paragraph {i:03d} " + " ".join(["word"] * 60) for i in range(300)]  # ~93k characters
    (src / "book.txt").write_bytes("\r\n\r\n".join(p.replace(" word", "\r\nword", 1) for p in paras).encode())
    docs = read_local_documents(src, max_doc_chars=20_000)
    assert len(docs) >= 4 and max(map(len, docs)) <= 21_000
    assert "\r" not in "".join(docs)  # read like Python's text mode: \r\n -> \n
    assert "\n\n".join(docs) == "\n\n".join(p.replace(" word", "\nword", 1) for p in paras)
