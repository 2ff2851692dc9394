"""Review 8 of getting pretraining data (nanochat/dataset_download.py, nanochat/core_data.py's eval
bundle, nanochat/tasks/common.py's hub fallback), against a local HTTP server on 127.0.0.1:

* a shard that another process finished after download_shards listed the directory was fetched a
  second time (two shells / torchrun ranks downloading into one directory: every shard twice);
* download_eval_bundle deleted (rmtree) a dest that held the user's files but no core.yaml;
* a hub row that convert_hub could not read was a bare KeyError naming neither dataset nor row.
"""

import sys
import types

import pytest

from nanochat import dataset as ds
from nanochat import dataset_download as dl
from tests.test_dataset_download import FixtureServer, shard_server
from tests.test_download_stall import bundle_zip


@pytest.fixture
def server():
    srv = shard_server()   # shards 0, 1, 2 and ClimbMix's validation shard 6542
    yield srv
    srv.close()


def test_a_shard_finished_by_another_process_after_the_listing_is_kept(server, tmp_path, monkeypatch):
    """What two `python -m nanochat.dataset` into one --out did (measured: 9 requests for 5
    shards): the second listed the directory, the first then finished shards, and the second got
    their locks without waiting, so it fetched each again and replaced it."""
    name = ds.shard_name(1)
    (tmp_path / name).write_bytes(server.files[name])   # finished by the other process ...
    monkeypatch.setattr(dl, "_to_fetch", lambda indices, out_dir: list(indices))   # ... after our listing
    assert dl.download_shards([0, 1], tmp_path, server.url, retries=0, progress=False) == []
    assert sorted(n for n, _ in server.requests) == [ds.shard_name(0)]
    assert (tmp_path / name).read_bytes() == server.files[name]


def test_a_damaged_dest_is_still_fetched_again(server, tmp_path):
    name = ds.shard_name(2)
    (tmp_path / name).write_bytes(server.files[name][:1000])   # not a shard: must not be kept
    dl.download_file(f"{server.url}/{name}", tmp_path / name, retries=0)
    assert (tmp_path / name).read_bytes() == server.files[name] and len(server.requests) == 1


@pytest.fixture
def bundle_server():
    srv = FixtureServer({"eval_bundle.zip": bundle_zip()})
    yield srv
    srv.close()


def test_the_eval_bundle_never_deletes_a_folder_of_the_users(bundle_server, tmp_path):
    """NANOCHAT_EVAL_BUNDLE pointed at a folder of one's own (or a typo'd parent) and then
    download_eval_bundle(), as the "no core.yaml" error advises: the folder was rmtree'd."""
    from nanochat.core_data import download_eval_bundle   # not at the top: nanochat.common imports torch

    mine = tmp_path / "my_evals"
    mine.mkdir()
    (mine / "notes.txt").write_text("months of work")
    with pytest.raises(ValueError, match=r"my_evals is a directory holding files but no core\.yaml"):
        download_eval_bundle(f"{bundle_server.url}/eval_bundle.zip", mine, retries=1, progress=False)
    assert (mine / "notes.txt").read_text() == "months of work"
    assert bundle_server.requests == []   # refused before any download
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match="a_file is a file; accepted: a path that does not exist"):
        download_eval_bundle(f"{bundle_server.url}/eval_bundle.zip", tmp_path / "a_file", retries=1, progress=False)
    empty = tmp_path / "empty"   # an empty directory (made ahead, e.g. by a launcher) is still fine
    empty.mkdir()
    assert (download_eval_bundle(f"{bundle_server.url}/eval_bundle.zip", empty, retries=1,
                                 progress=False) / "core.yaml").is_file()


def test_a_hub_row_the_task_cannot_read_names_the_dataset_and_row(tmp_path, monkeypatch):
    from nanochat.errors import DataError
    from nanochat.tasks import common

    fake = types.SimpleNamespace(load_dataset=lambda *a, **k: [{"question": "q", "answer": 1}, {"question": "q"}])
    monkeypatch.setattr(common, "_import_datasets", lambda: fake)
    monkeypatch.setitem(sys.modules, "datasets", fake)

    def convert(r):
        return {"question": r["question"], "answer": int(r["answer"])}

    with pytest.raises(DataError, match=r"hub:org/ds/main:test: row 2 does not have the fields.*KeyError: 'answer'"
                                        r".*put x\.jsonl \(one JSON object per line\) in"):
        common.load_rows("eval", ["x.jsonl"], data_dir=tmp_path, hub=("org/ds", "main", "test"), convert_hub=convert)
    rows, source = common.load_rows("eval", ["x.jsonl"], data_dir=tmp_path, hub=("org/ds", "main", "test"))
    assert source == "hub:org/ds/main:test" and len(rows) == 2   # no convert: rows as the hub gave them
