"""Regression tests from a review of data, tokenizer, eval and setup: each one failed before its fix."""

import concurrent.futures

import pytest

from nanochat import dataset as ds
from nanochat import dataset_download as dl


def test_full_disk_reported_when_a_skipped_shard_completes_first(tmp_path, monkeypatch):
    """A full disk on one shard sets the stop, and a worker that picks up the next shard then
    returns at once without a file. When that skipped shard's future came out of as_completed
    before the failing one (thread scheduling decides), download_shards stat()ed the missing file
    and raised FileNotFoundError instead of the DiskFullError that says what to do."""

    def fake_download(url, dest, **kw):
        if dest.name == ds.shard_name(0):
            raise dl.DiskFullError(f"{dest.parent}: the disk filled while downloading {dest.name}")
        dest.write_bytes(b"x")  # any other shard: "downloaded"

    def as_completed_reversed(futures):   # every future done, then the last submitted first
        futures = list(futures)
        concurrent.futures.wait(futures)
        yield from reversed(futures)

    monkeypatch.setattr(dl, "download_file", fake_download)
    monkeypatch.setattr(dl, "as_completed", as_completed_reversed)
    with pytest.raises(dl.DiskFullError, match="the disk filled"):
        dl.download_shards([0, 1], tmp_path, "http://127.0.0.1:9", workers=1, progress=False)
    assert not (tmp_path / ds.shard_name(1)).exists()   # the skipped shard was never fetched


BOM = b"\xef\xbb\xbf"   # what Notepad / Windows PowerShell put before UTF-8 text


def test_local_import_reads_files_that_start_with_a_byte_order_mark(tmp_path):
    """`python -m nanochat.dataset --data-dir` refused a BOM-prefixed JSONL file ("not valid JSON
    (Unexpected UTF-8 BOM)") and trained a BOM-prefixed .txt file's first document with a U+FEFF
    character at its start."""
    from nanochat.local_data import read_local_documents

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(BOM + b'{"text": "first doc"}\n{"text": "second doc"}\n')
    (src / "b.txt").write_bytes(BOM + b"A text file\r\n\r\nwith paragraphs")
    docs = read_local_documents(src)
    assert docs == ["first doc", "second doc", "A text file\n\nwith paragraphs"]
    assert not any("\ufeff" in d for d in docs)


def test_conversation_file_with_a_byte_order_mark(tmp_path):
    """--extra-conversations (and the eval / SFT JSONL readers) refused a file saved with a BOM at
    line 1 as invalid JSON."""
    from nanochat.tasks.conversations import ConversationFile

    path = tmp_path / "mine.jsonl"
    path.write_bytes(BOM + b'{"messages": [{"role": "user", "content": "hi"}, '
                           b'{"role": "assistant", "content": "hello"}]}\n')
    task = ConversationFile(path)
    assert task[0]["messages"][0]["content"] == "hi"
