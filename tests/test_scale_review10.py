"""Scale review 10: torchrun's variables as a user may set them by hand (CPU, no process group is
ever joined here: every case fails before the rendezvous, or the rendezvous is stubbed out).

* a malformed RANK / LOCAL_RANK / WORLD_SIZE said int()'s "invalid literal for int() with base 10: ''",
  naming neither the variable nor (for an empty one) that it was set;
* a MASTER_PORT that is not a port ("abc", 99999) ended in torch's bare ValueError traceback;
* a MASTER_ADDR that does not resolve made torch retry with a warning every few seconds until the
  group's timeout (30 minutes on gloo);
* RANK=0 alone said "RANK=0 WORLD_SIZE=None are set";
* `python -m nanochat.platform --nccl` under hand-set variables called init_process_group without
  init_runtime's checks: RANK=1 WORLD_SIZE=1 waited for a rank 0 that never comes, and a bad
  MASTER_PORT said only int()'s message;
* run_train.sh --fsdp with one process (no --nproc) passed on base_train's hint to launch torchrun
  by hand, where run_train.sh's own --nproc is the way.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from nanochat.common import init_runtime
from nanochat.distributed import selftest_main
from nanochat.errors import RequestError

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "NANOCHAT_DTYPE", "TORCHELASTIC_RUN_ID", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")   # the self-test sets it in os.environ: restored at teardown


@pytest.fixture
def no_rendezvous(monkeypatch):
    """init_process_group fails the test instead of waiting for ranks that never come."""
    def refuse(*args, **kwargs):
        raise AssertionError("init_process_group reached: it would wait for the other ranks")
    monkeypatch.setattr(dist, "init_process_group", refuse)


def _set(monkeypatch, **env) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("env, said", [
    ({"RANK": "0", "WORLD_SIZE": ""}, "WORLD_SIZE=''"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x'"),
    ({"RANK": "first", "WORLD_SIZE": "2"}, "RANK='first'"),
])
def test_a_malformed_torchrun_variable_is_named_with_its_value(monkeypatch, no_rendezvous, env, said):
    _set(monkeypatch, **env)
    with pytest.raises(RequestError, match=said) as e:
        init_runtime("cpu")
    assert "accepted: an integer" in str(e.value)


@pytest.mark.parametrize("port", ["abc", "99999", "-1", "29500x"])
def test_a_master_port_that_is_not_a_port_is_named(monkeypatch, no_rendezvous, port):
    _set(monkeypatch, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    with pytest.raises(RequestError, match=rf"MASTER_PORT: got '{port}'; accepted: a TCP port 0\.\.65535"):
        init_runtime("cpu")


def test_an_unresolvable_master_addr_is_named_before_the_rendezvous(monkeypatch, no_rendezvous):
    def unknown(host, *args, **kwargs):   # not the real resolver: a test machine's DNS may answer anything
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    _set(monkeypatch, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="node0:29500", MASTER_PORT="29500")
    with pytest.raises(RequestError, match=r"MASTER_ADDR: got 'node0:29500', which does not resolve"):
        init_runtime("cpu")


def test_rank_alone_does_not_say_world_size_none(monkeypatch, no_rendezvous):
    _set(monkeypatch, RANK="0")
    with pytest.raises(RequestError, match="RANK=0 is set but MASTER_ADDR and MASTER_PORT are not") as e:
        init_runtime("cpu")
    assert "None" not in str(e.value)


@pytest.mark.parametrize("env, said", [
    ({"RANK": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "RANK=1 WORLD_SIZE=1"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "abc"}, "MASTER_PORT: got 'abc'"),
])
def test_nccl_selftest_checks_the_torchrun_variables(monkeypatch, capsys, no_rendezvous, env, said):
    _set(monkeypatch, **env)
    assert selftest_main() == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and said in err, err


def test_run_train_fsdp_with_one_process_names_nproc(tmp_path):
    """run_train.sh --fsdp without --nproc: base_train's refusal said to launch torchrun by hand
    (torchrun --nproc_per_node=N ...); the way to torchrun from run_train.sh is its own --nproc."""
    repo = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    r = subprocess.run(["bash", str(repo / "run_train.sh"), "--base-dir", str(tmp_path), "--fsdp", "--device", "cpu",
                        "--depth", "2"], cwd=repo, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "--fsdp" in r.stderr and "with --nproc 2 or more" in r.stderr, r.stderr
    assert not (tmp_path / "runs" / "d2" / "pid").exists()
