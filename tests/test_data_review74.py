"""Review 74 of the pretraining data path: a binary shard truncated in place while a run reads it
is a DataError naming the file (its memory map's SIGBUS killed the process naming nothing), and a
local import leaves out of train the copies of its validation documents."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from nanochat import dataset as ds

REPO = Path(__file__).resolve().parents[1]

# Builds 3 text shards of traceable documents, pretokenizes them, reads a few batches from each
# kind of source, truncates shard_00000 in place (what `cp` over the directory does first) and
# reads on: prints the error the loader raised, or "NO ERROR".
_TRUNCATE_MID_RUN = r"""
import os, sys
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
sys.path.insert(0, sys.argv[2])
from test_dataloader import ByteTokenizer
from nanochat.binshards import default_bin_dir
from nanochat.dataloader import DataLoader
from scripts.pretokenize import pretokenize

root = Path(sys.argv[1])
for source in ("bin", "text"):
    d = root / source / "data"
    d.mkdir(parents=True)
    for i in range(3):
        docs = [f"{i}-{j} " + "y" * 3000 for j in range(300)]
        pq.write_table(pa.table({"text": docs}), d / f"shard_{i:05d}.parquet", row_group_size=64)
    pretokenize(sorted(d.glob("*.parquet")), default_bin_dir(d), ByteTokenizer(), log=lambda *a: None)
    dl = DataLoader(ByteTokenizer(), 2, 64, "train", data_dir=d, source=source, prefetch=2, buffer_size=4)
    next(dl)
    shard = (default_bin_dir(d) / "shard_00000.bin") if source == "bin" else d / "shard_00000.parquet"
    os.truncate(shard, 16384)
    try:
        for _ in range(20000):
            next(dl)
        print(source, "NO ERROR")
    except Exception as e:
        print(source, type(e).__name__, str(e).splitlines()[0])
    dl.close()
"""


def test_a_binary_shard_truncated_in_place_mid_run_is_a_data_error_naming_it(tmp_path):
    """Binary tokens were read through a memory map: a shard truncated while a run read it (a `cp`
    of other shards over the directory truncates each file before writing it) made the next read
    past its new end SIGBUS: "Fatal Python error: Bus error", exit 135, no file named, no
    checkpoint saved. Now tokens are read with pread: a short read is a DataError naming the shard,
    which reaches the trainer from the prefetch thread, as a damaged text shard's does."""
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(tmp_path / "base"), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _TRUNCATE_MID_RUN, str(tmp_path), str(REPO / "tests")],
                         env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    bin_shard = tmp_path / "bin" / "data_tokens" / "shard_00000.bin"
    assert lines["bin"].startswith(f"DataError {bin_shard}: truncated since the data loader opened it"), lines
    assert "pretokenize" in lines["bin"], lines
    text_shard = tmp_path / "text" / "data" / "shard_00000.parquet"
    assert lines["text"].startswith(f"DataError {text_shard}: "), lines


def _read(path) -> list[str]:
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def test_a_local_import_leaves_copies_of_validation_documents_out_of_train(tmp_path):
    """The last --val-fraction of the documents is the validation shard; a document that was also
    in the corpus earlier (a page saved twice, re-wrapped) stayed in train, so the run trained on
    validation text and its val bpb read better than it was. Those copies are now left out of
    train (whitespace aside) and the import says how many; distinct documents are untouched."""
    src = tmp_path / "src"
    src.mkdir()
    docs = [f"document {i}: " + "word " * (i % 7 + 3) for i in range(20)]
    wrapped = "\n  ".join(docs[18].split())    # the same words, other line breaks and indents
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                         [docs[0], docs[19], wrapped, *docs[1:]]))
    lines = []
    paths = ds.import_local_dir(src, tmp_path / "out", val_fraction=0.1, log=lines.append)
    train, val = [t for p in paths[:-1] for t in _read(p)], _read(paths[-1])
    assert val == docs[18:]                       # the last 10% of 22 documents: 2
    assert train == docs[:18], train              # without docs[19] and the re-wrapped docs[18]
    assert any("left out 2 training document(s) that copy a held-out (validation) document" in line
               for line in lines), lines
    assert ds.split_shards(ds.list_shards(tmp_path / "out"), "val") == paths[-1:]
    # nothing left to train on: said, naming the flag
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in ["same text"] * 10))
    with pytest.raises(ValueError, match="--data-dir: every training document .* is a copy of a held-out"):
        ds.import_local_dir(src, tmp_path / "out2", val_fraction=0.1, log=lambda *a: None)
