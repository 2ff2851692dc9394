"""`python -m nanochat.dataset` when the server does not have a shard: the closing hint says a
rerun cannot fetch it (it used to suggest rerunning the same command, which only asks again)."""

import pytest

from nanochat import dataset as ds
from tests.test_dataset_download import shard_server


@pytest.fixture
def server():
    srv = shard_server()   # shards 0, 1, 2 and ClimbMix's validation shard
    yield srv
    srv.close()


def _main(srv, out, *extra):
    return ds.main(["--base-url", srv.url, "--out", str(out), "--retries", "2", "--backoff", "0", "--timeout", "10",
                    "--no-progress", *extra])


def test_a_missing_shard_is_not_called_worth_a_rerun(server, tmp_path, capsys):
    assert _main(server, tmp_path, "-n", "5") == 1   # shards 3 and 4 are not on the server
    err = capsys.readouterr().err
    assert "2 of 6 shards FAILED" in err and "HTTP 404" in err
    assert "a rerun will not fetch them" in err and "--base-url" in err
    assert f"{ds.shard_name(3)}..{ds.shard_name(4)}" in err
    assert "rerun the same command" not in err
    assert [n for n, _ in server.requests].count(ds.shard_name(3)) == 1   # and not retried


def test_a_mix_names_both_remedies(server, tmp_path, capsys):
    server.modes[ds.shard_name(1)] = "500"   # may succeed later
    assert _main(server, tmp_path, "-n", "4") == 1
    err = capsys.readouterr().err
    assert "1 of them the server refused" in err and "rerun the same command to retry the others" in err


def test_a_transient_failure_still_says_rerun(server, tmp_path, capsys):
    server.modes[ds.shard_name(1)] = "500"
    assert _main(server, tmp_path, "-n", "2") == 1
    err = capsys.readouterr().err
    assert "rerun the same command to retry (finished" in err and "refused" not in err


def test_download_error_permanence():
    assert ds.DownloadError("x", permanent=True).permanent and not ds.DownloadError("x").permanent
