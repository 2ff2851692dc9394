"""Second review of the distributed runtime as a user meets it (CPU, gloo):

* torchrun's variables set by hand without torchrun: RANK / WORLD_SIZE without MASTER_ADDR and
  MASTER_PORT ended in torch's traceback from deep inside init_process_group; WORLD_SIZE=2 without
  RANK ran as rank 0 and waited (silently, for half an hour) for a rank 1 nobody started;
* a MASTER_PORT already in use ended in a DistNetworkError traceback (now a RequestError naming
  MASTER_ADDR:MASTER_PORT and what to do);
* a negative LOCAL_RANK (or one past the GPU count) is refused with the numbers;
* (slow) SIGTERM to torchrun itself mid-run: every rank saves its shard of one checkpoint (the
  workers exit 128 + 15, torchrun itself 1, as run_train.sh knows), and --resume latest continues bit for bit (losses and final weights).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nanochat.common import init_runtime
from nanochat.distributed import free_port
from nanochat.errors import RequestError

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "NANOCHAT_DTYPE", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------------ torchrun variables by hand

@pytest.mark.parametrize("env, said", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"RANK": "0"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}, "MASTER_PORT"),
    # WORLD_SIZE alone: it used to run as rank 0 and wait for a rank 1 (no MASTER_* here, so the
    # old code failed in torch instead of hanging the test)
    ({"WORLD_SIZE": "2"}, "RANK"),
])
def test_torchrun_variables_without_torchrun_are_a_clear_error(monkeypatch, env, said):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RequestError, match=said) as e:
        init_runtime("cpu")
    assert "torchrun" in str(e.value)


def test_busy_master_port_is_a_clear_error(monkeypatch):
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(RequestError, match=f"127.0.0.1:{port}.*(in use|MASTER_PORT)"):
            init_runtime("cpu")
    assert not dist.is_initialized()


def test_local_rank_is_checked(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(RequestError, match="LOCAL_RANK=-1"):
        init_runtime("cpu")


def test_local_rank_past_the_gpu_count(monkeypatch):
    """--nproc_per_node 2 on a one-GPU box: rank 1 is refused naming the count, before any CUDA call."""
    import nanochat.platform as platform
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(platform, "configure_env_before_cuda", lambda *a, **k: None)
    for k, v in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RequestError, match=r"LOCAL_RANK=1 but only 1 GPU\(s\).*--nproc_per_node <= 1"):
        init_runtime("cuda")


# ------------------------------------------------------------------ base_train under torchrun

# base_dir: tests/conftest.py's (a fresh dir per module holding the session's tiny tokenizer)


def _args(corpus: Path, tag: str, *extra: str) -> list[str]:
    return ["--device", "cpu", "--depth", "2", "--aspect-ratio", "32", "--head-dim", "32", "--max-seq-len", "64",
            "--device-batch-size", "8", "--window-pattern", "SL", "--sample-every", "-1", "--eval-tokens", "4096",
            "--no-compile", "--data-dir", str(corpus), "--wandb", "off", "--model-tag", tag, *extra]


def _env(base_dir: Path) -> dict:
    env = {**os.environ, "NANOCHAT_BASE_DIR": str(base_dir), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for var in TORCHRUN_VARS:
        env.pop(var, None)
    return env


def _torchrun_cmd(script: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port",
            str(free_port()), *script]


# base_train once per command line (argv split at "--then") in one torchrun launch: every run but
# the last keeps the process group for the next (a second init_process_group under torchrun's agent
# store hangs), and each run's init_runtime reseeds, so each starts as in a launch of its own. Run
# i's losses go to losses<i>_<rank>.json.
RUNNER = """import json, os, sys
from nanochat.flags import script_main
from scripts import base_train
runs = [[]]
for a in sys.argv[2:]:
    runs.append([]) if a == "--then" else runs[-1].append(a)
def run():
    destroy = base_train.destroy_runtime
    for i, args in enumerate(runs):
        base_train.destroy_runtime = destroy if i == len(runs) - 1 else (lambda rt: None)
        summary = base_train.main(args)
        with open(os.path.join(sys.argv[1], f"losses{i}_{os.environ['RANK']}.json"), "w") as f:
            json.dump({str(k): v for k, v in summary["losses"].items()}, f)
script_main("base_train", lambda: base_train.parse_config(runs[0]), run)
"""


def _worker_pids(torchrun_pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(torchrun_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_once_per_rank_and_resumes_exactly(tmp_path, base_dir, tiny_corpus):
    """Two launches: one stopped by SIGTERM; one that resumes it to the end and then (in the same
    processes, reseeded) makes the uninterrupted reference run the resumed steps are compared with."""
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    env = _env(base_dir)
    train = ["--total-batch-size", "2048", "--num-iterations", "16", "--eval-every", "8"]
    for name in ("part", "resumed"):
        (tmp_path / name).mkdir()
    log = tmp_path / "part.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(_torchrun_cmd([str(runner), str(tmp_path / "part"), *_args(tiny_corpus, "part", *train)]),
                                stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        deadline = time.monotonic() + 200
        while "step 00004/00016" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        workers = _worker_pids(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    text = log.read_text()
    assert len(workers) == 2
    assert text.count("base_train: error: stopped by SIGTERM at step") == 1, text[-3000:]   # said once
    assert proc.returncode != 0   # torchrun ends with 1 (its own SignalException); the workers exit 143
    stopped = int(text.split("base_train: error: stopped by SIGTERM at step ")[1].split()[0])
    assert 4 < stopped < 16
    ckpt = base_dir / "checkpoints" / "base" / "part"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step_")) == [f"step_{stopped:06d}"]
    shards = {p.name for p in (ckpt / f"step_{stopped:06d}").iterdir()}
    assert {"optim_rank0.pt", "optim_rank1.pt", "state_rank0.pt", "state_rank1.pt"} <= shards

    r = subprocess.run(_torchrun_cmd([str(runner), str(tmp_path / "resumed"),
                                      *_args(tiny_corpus, "part", *train, "--resume", "latest"), "--then",
                                      *_args(tiny_corpus, "full", *train)]),
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads((tmp_path / "resumed" / "losses0_0.json").read_text())
    full = json.loads((tmp_path / "resumed" / "losses1_0.json").read_text())
    assert sorted(map(int, full)) == list(range(16))
    assert sorted(map(int, resumed)) == list(range(stopped, 16))
    assert all(resumed[k] == full[k] for k in resumed)   # bit for bit: same reductions in the same order
    a = torch.load(base_dir / "checkpoints" / "base" / "full" / "step_000016" / "model.pt", weights_only=True)
    b = torch.load(ckpt / "step_000016" / "model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
