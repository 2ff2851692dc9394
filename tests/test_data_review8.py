"""Review 8 of pretraining data as a user meets it (pretokenize, binshards, local_data, base_train's
--data-dir): a binary shard written by a run that died before recording it is not kept for a text
shard changed since; a .txt file whose paragraphs are single lines is split, not cropped to one
row; a damaged shard's advice names the directories to re-create it in; `--data-dir ""` is not
read as the current directory."""

import pytest

from nanochat import binshards as bs
from nanochat import binshards_runs as runs
from nanochat.dataloader import DataLoader
from nanochat.errors import DataError
from scripts import pretokenize as pt
from tests.test_dataloader import ByteTokenizer, make_docs, write_shards


def quiet(*_):
    pass


class _Died(Exception):
    pass


def test_a_shard_written_but_not_recorded_is_redone_when_its_text_changed(tmp_path, monkeypatch):
    """A run killed between a worker's os.replace and the main process's record_shard leaves a
    binary shard nothing ties to its text. It was kept as 'done' (no record = unchanged) even for
    a text shard edited before the rerun, which then recorded the NEW text's size and hash for it:
    the loader trained on the old text, certified fresh."""
    tok = ByteTokenizer()
    data = write_shards(tmp_path / "data", [make_docs(10), make_docs(10, seed=1), make_docs(5, seed=2)])
    out = tmp_path / "data_tokens"
    shards = sorted(data.glob("*.parquet"))
    record, calls = runs.record_shard, []

    def dies_at_the_second(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise _Died
        return record(*args, **kwargs)

    monkeypatch.setattr(runs, "record_shard", dies_at_the_second)
    with pytest.raises(_Died):
        pt.pretokenize(shards, out, tok, log=quiet)
    monkeypatch.setattr(runs, "record_shard", record)
    assert (out / "shard_00001.bin").exists() and "shard_00001.parquet" not in bs.read_meta(out)["text_shards"]

    new_text = make_docs(10, seed=99)
    write_shards(data, [make_docs(10), new_text, make_docs(5, seed=2)])
    written = pt.pretokenize(shards, out, tok, log=quiet)
    assert "shard_00001.bin" in {r["shard"] for r in written}
    doc0 = bs.BinShard(out / "shard_00001.bin").doc(0)
    assert tok.decode(doc0[1:].tolist()) == new_text[0]
    assert DataLoader(tok, 4, 64, "train", data_dir=data, prefetch=0).source_kind == "bin"  # taken as fresh


def test_a_txt_file_without_blank_lines_is_split_not_cropped_to_a_row(tmp_path):
    """Blank lines were the only split: a book whose paragraphs are single lines (or a file with no
    line break) stayed one document, of which the loader trains on one row and drops the rest."""
    from nanochat.local_data import read_local_documents
    src = tmp_path / "src"
    src.mkdir()
    lines = [f"paragraph {i:04d} " + " ".join(["word"] * 40) for i in range(2000)]   # ~500k characters
    (src / "book.txt").write_text("\n".join(lines))
    docs = read_local_documents(src, max_doc_chars=20_000)
    assert len(docs) >= 20 and max(map(len, docs)) <= 21_000
    assert "\n".join(docs) == "\n".join(lines)   # nothing lost, nothing doubled
    (src / "book.txt").unlink()
    (src / "one_line.txt").write_text(" ".join(lines))   # no line break at all: cut at spaces
    docs = read_local_documents(src, max_doc_chars=20_000)
    assert len(docs) >= 20 and max(map(len, docs)) <= 20_000
    assert "".join(docs) == " ".join(lines) and all(d.endswith(" ") for d in docs[:-1])


def test_a_damaged_shards_advice_names_the_directories_to_recreate_it_in(tmp_path):
    """The advice was a bare `pretokenize --force`, which tokenizes $NANOCHAT_BASE_DIR/base_data into
    base_data_tokens: for shards of a --data-dir it re-created nothing that was damaged."""
    tok = ByteTokenizer()
    data = write_shards(tmp_path / "mydata", [make_docs(10), make_docs(5, seed=1)])
    out = bs.default_bin_dir(data)
    pt.pretokenize(sorted(data.glob("*.parquet")), out, tok, log=quiet)
    path = out / "shard_00000.bin"
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(DataError, match="truncated or corrupt") as e:
        DataLoader(tok, 2, 16, "train", data_dir=data, source="bin")
    command = f"python -m scripts.pretokenize --data-dir {data} --out {out}"
    assert f"delete it, then re-create it with `{command}`" in str(e.value)
    # the advice, followed: only the damaged shard is tokenized again (--force re-made every one)
    other = (out / "shard_00001.bin").stat().st_mtime_ns
    path.unlink()
    assert pt.main(command.split()[3:] + ["--workers", "1"], tokenizer=tok) == 0
    assert (out / "shard_00001.bin").stat().st_mtime_ns == other
    assert DataLoader(tok, 2, 16, "train", data_dir=data, source="bin").source_kind == "bin"


@pytest.mark.parametrize("value", ["", "  "])
def test_base_train_refuses_an_empty_data_dir(value):
    """Path("") is "." (an existing directory): `--data-dir "$DATA"` with DATA unset read the
    current directory, as pretokenize and nanochat.dataset already refuse to."""
    from scripts.base_train import parse_config
    with pytest.raises(ValueError, match="--data-dir: got .*an empty value.*is not the current directory"):
        parse_config(["--data-dir", value])
