"""Review 76 of the pretraining data path, as a user hands it data: parquet written by other tools
(Polars' string_view, a pandas category column) is read, not refused as "wrong schema"; a local
import follows symlinked folders (each real folder once), names folders it could not list, and does
not read an earlier import of the same folder (an `--out` inside it) as new documents; the
profiler's path flags refuse an empty value instead of pretokenizing into the current directory;
text that spells a special token ("<|bos|>") stays ordinary tokens on both loader paths."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanochat import dataset as ds
from nanochat.binshards import default_bin_dir
from nanochat.dataloader import DataLoader
from nanochat.local_data import import_local_dir, local_files
from scripts.pretokenize import pretokenize


def shard_texts(path) -> list[str]:
    return pq.read_table(path).column("text").to_pylist()


def imported_docs(out) -> list[str]:
    return [t for p in ds.list_shards(out) for t in shard_texts(p)]


@pytest.fixture
def base_env(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def first_batches(tok, data_dir, source: str, n: int = 3):
    out = []
    for split in ("train", "val"):
        dl = DataLoader(tok, 2, 64, split, data_dir=data_dir, source=source, prefetch=0, buffer_size=4)
        out += [torch.cat(next(dl)) for _ in range(n)]
        dl.close()
    return out


# ---------------------------------------------------------------- parquet of other writers

@pytest.mark.skipif(not hasattr(pa, "string_view"), reason="pyarrow without string_view")
def test_parquet_with_string_view_or_dictionary_text_is_read(tmp_path, base_env, tiny_tokenizer):
    """Polars >= 1.38 stores its text as string_view, pandas a category column as a dictionary:
    both are strings, and were refused ("wrong schema: expected a string column 'text'") by the
    loader, pretokenize and the local import alike."""
    docs = [f"document {i}: " + "to be or not to be " * (i % 7) for i in range(90)]
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"text": pa.array(docs[:60], pa.string_view())}), data / "shard_00000.parquet",
                   row_group_size=16)
    pq.write_table(pa.table({"text": pa.array(docs[60:]).dictionary_encode()}), data / "shard_00001.parquet",
                   row_group_size=16)
    assert [f.type for f in (pq.ParquetFile(p).schema_arrow.field("text") for p in ds.list_shards(data))] \
        == [pa.string_view(), pa.dictionary(pa.int32(), pa.string())]

    text = first_batches(tiny_tokenizer, data, "text")
    pretokenize(ds.list_shards(data), default_bin_dir(data), tiny_tokenizer, log=lambda *a: None)
    assert all(torch.equal(a, b) for a, b in zip(text, first_batches(tiny_tokenizer, data, "bin")))
    # the estimate of a pass reads text with pyarrow kernels (binary_length) too
    assert DataLoader(tiny_tokenizer, 2, 64, "train", data_dir=data, source="text").pass_size().rank_tokens[0] > 0

    out = tmp_path / "imported"
    import_local_dir(data, out, log=lambda *a: None)
    assert imported_docs(out) == docs


# ---------------------------------------------------------------- the local import's file walk

def test_symlinked_folders_are_read_once_and_loops_end(tmp_path):
    """rglob does not descend into a symlinked folder, and local_files skipped it without a word:
    a corpus assembled from links was imported without those documents."""
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    (src / "own").mkdir(parents=True)
    elsewhere.mkdir()
    (src / "own" / "a.txt").write_text("a document of its own")
    (elsewhere / "b.txt").write_text("a document behind a link")
    (src / "wiki").symlink_to(elsewhere, target_is_directory=True)
    (src / "wiki_again").symlink_to(elsewhere, target_is_directory=True)   # the same folder twice
    (src / "own" / "loop").symlink_to(src, target_is_directory=True)        # a link loop
    out = tmp_path / "out"
    import_local_dir(src, out, val_fraction=0.4, log=lambda *a: None)
    assert sorted(imported_docs(out)) == ["a document behind a link", "a document of its own"]
    found = local_files(src)
    assert [p.relative_to(src).as_posix() for p in found.read] == ["own/a.txt", "wiki/b.txt"]


def test_a_folder_that_cannot_be_listed_is_named(tmp_path, monkeypatch):
    """An unreadable folder (another user's, lost+found at a mount's root) was skipped silently;
    its files are not read, and the import's line says so."""
    src = tmp_path / "src"
    for name in ("a", "locked"):
        (src / name).mkdir(parents=True)
        for i in range(2):
            (src / name / f"{i}.txt").write_text(f"{name} document {i}")
    real = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("locked"):   # as root (CI containers), chmod 000 still reads
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    found = local_files(src)
    assert found.unreadable == [src / "locked"] and all("locked" not in str(p) for p in found.read)
    lines = []
    import_local_dir(src, tmp_path / "out", val_fraction=0.5, log=lines.append)
    assert "1 folder that could not be listed (permissions?): locked" in lines[0]


def test_an_earlier_import_inside_the_folder_is_not_read_again(tmp_path):
    """`--out src/v1`, then `--out src/v2`: v2 read v1's shards as new documents, so it held every
    document twice (and v1's validation documents in its training shard)."""
    src = tmp_path / "src"
    src.mkdir()
    docs = [f"document number {i} " + "lorem ipsum " * i for i in range(40)]
    (src / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    import_local_dir(src, src / "v1", log=lambda *a: None)
    lines = []
    import_local_dir(src, src / "v2", log=lines.append)
    assert imported_docs(src / "v2") == docs
    assert "earlier import of this folder" in lines[0] and lines[0].endswith(": v1")
    # a set imported from elsewhere is the user's data to combine: it is read
    other = tmp_path / "other"
    other.mkdir()
    (other / "b.txt").write_text("a document from another folder")
    (other / "c.txt").write_text("another document from another folder")
    import_local_dir(other, src / "ext", val_fraction=0.5, log=lambda *a: None)
    assert len(local_files(src).read) == 1 + 2   # a.jsonl + ext's two shards; v1, v2 skipped
    assert [p.name for p in local_files(src).derived] == ["v1", "v2"]


# ---------------------------------------------------------------- profile_dataloader's flags

@pytest.mark.parametrize("flag", ["--bin-dir", "--data-dir", "--tokenizer-dir"])
def test_profile_dataloader_refuses_an_empty_path(flag):
    """`--bin-dir "$DIR"` with DIR unset was Path("") = the current directory: binary shards,
    meta.json and a lock file were pretokenized into it (e.g. the repository)."""
    from scripts.profile_dataloader import parse_args

    with pytest.raises(ValueError, match=f"{flag}: got ''"):
        parse_args([flag, ""])


# ---------------------------------------------------------------- special-token text

def test_text_spelling_special_tokens_never_becomes_their_ids(tmp_path, base_env, tiny_tokenizer):
    """Documents of nothing but "<|bos|>" (and other special names): BOS appears in a packed row
    only where a document starts, on the text and the binary path, at two ranks."""
    tok = tiny_tokenizer
    specials = ["<|bos|>", "<|bos|><|bos|>", "<|user_start|>hi<|user_end|>", "<|assistant_end|>", ""]
    docs = [f"{i:03d}{specials[i % len(specials)]}" for i in range(120)]
    data = tmp_path / "data"
    data.mkdir()
    for i, part in enumerate((docs[:90], docs[90:])):
        pq.write_table(pa.table({"text": part}), data / f"shard_{i:05d}.parquet", row_group_size=7)
    starts = {tuple([tok.bos_token_id] + tok.encode(d)) for d in docs}
    pretokenize(ds.list_shards(data), default_bin_dir(data), tok, log=lambda *a: None)
    for source in ("text", "bin"):
        for rank in range(2):
            dl = DataLoader(tok, 2, 40, "train", data_dir=data, source=source, rank=rank, world_size=2,
                            prefetch=0, buffer_size=5)
            for _ in range(6):
                x, y = next(dl)
                for row in torch.cat([x, y[:, -1:]], 1).tolist():
                    assert row[0] == tok.bos_token_id
                    cuts = [i for i, t in enumerate(row) if t == tok.bos_token_id] + [len(row)]
                    for a, b in zip(cuts, cuts[1:]):   # each piece is (a prefix of) one whole document
                        assert any(s[:b - a] == tuple(row[a:b]) for s in starts), (source, row[a:b])
            dl.close()
