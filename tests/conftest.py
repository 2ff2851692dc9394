"""Shared pytest setup: CUDA tests skip cleanly without a GPU; paths to the offline data; a base dir
with a tokenizer trained on the tiny corpus and the env pointing the code at it; a failed test's
leftover child processes are killed (so one failure cannot slow or break the tests after it)."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("NANOCHAT_SHARED_DATA", REPO.parent / "shared" / "data"))


def missing(what: str):
    """An optional test dependency is absent: skip (the module, or the test) saying `what`, e.g. on a bare
    GPU box running `pytest -m cuda tests/` without the dev extra. Under NANOCHAT_STRICT_TESTS=1 (.ci/run
    sets it: CI installs every extra) fail instead, so a broken install cannot pass as skips."""
    if os.environ.get("NANOCHAT_STRICT_TESTS") == "1":
        pytest.fail(f"{what} (NANOCHAT_STRICT_TESTS=1)", pytrace=False)
    pytest.skip(what, allow_module_level=True)


def require_module(name: str, hint: str):
    """Import an optional test dependency, or `missing` with the install hint."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"{name} is not installed ({hint})")


def pytest_configure(config):
    os.environ.setdefault(SESSION_VAR, f"{os.getpid()}-{time.time_ns()}")   # see leftover_processes
    # Before any test runs a CPU bf16 matmul: the AMX workaround (nanochat/platform.py).
    from nanochat.platform import patch_cpu_amx

    patch_cpu_amx()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m cuda` on the GPU box)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_triton_interpreted(tmp_path):
    """run(script): the script in a subprocess under TRITON_INTERPRET=1 (the flag must be set
    before triton is imported), asserting it exits 0 having printed OK."""
    pytest.importorskip("triton")

    def run(script: str, timeout: int = 240) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             timeout=timeout, cwd=tmp_path)
        assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
    return run


_INTERPRETED_RUNNER = r"""
import json, sys, traceback
results = {}
for name, src in json.load(open(sys.argv[1])).items():
    try:
        exec(compile(src, name, "exec"), {"__name__": "__main__"})
        results[name] = None
    except BaseException:
        results[name] = traceback.format_exc()[-3000:]
print("\nRESULTS " + json.dumps(results))
"""


def run_scripts_interpreted(scripts: dict[str, str], tmp_path_factory) -> dict[str, str | None]:
    """{name: None, or the traceback} of each script, all run in ONE subprocess under
    TRITON_INTERPRET=1 (set before triton is imported): a python importing torch + triton costs
    seconds on a CI core, so a module's interpreter scripts share one (a module-scoped fixture
    calls this) rather than one run_triton_interpreted each."""
    pytest.importorskip("triton")
    d = tmp_path_factory.mktemp("interpreted")
    (d / "scripts.json").write_text(json.dumps(scripts))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", _INTERPRETED_RUNNER, str(d / "scripts.json")], env=env,
                         capture_output=True, text=True, timeout=600, cwd=d)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert out.returncode == 0 and line, out.stderr[-3000:]
    return json.loads(line[len("RESULTS "):])


@pytest.fixture(scope="module")
def interpreted(request, tmp_path_factory):
    """{name: None, or the traceback} of each script in the requesting module's SCRIPTS dict, all
    run in one TRITON_INTERPRET=1 subprocess (run_scripts_interpreted)."""
    return run_scripts_interpreted(request.module.SCRIPTS, tmp_path_factory)


@pytest.fixture
def each_tile_on_gpu():
    """run(calls, gpu): record the persistent-GEMM launches `calls()` makes for `gpu`
    (triton_mlp.GemmGpu: its SM count and tile set) as nanochat/triton_aot does, one per autotune
    config, then launch each on this GPU itself; yields (launch, ran), ran False for a config out
    of this GPU's resources (the autotuner skips those too). So every tile of a set is checked,
    not only the one the autotuner picks."""
    import triton
    from triton.runtime.errors import OutOfResources

    from nanochat import triton_aot

    def run(calls, gpu):
        with triton_aot.captured("tiles") as launches:
            calls()
        for launch in launches:
            kw = launch.kwargs
            tiles = triton.cdiv(kw["M"], kw["BLOCK_M"]) * triton.cdiv(kw["N"], kw["BLOCK_N"])
            try:
                launch.fn[(min(gpu.sms, tiles),)](*launch.args, **kw)
            except OutOfResources:
                yield launch, False
                continue
            yield launch, True
    return run


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"offline data not found at {SHARED_DATA}; set NANOCHAT_SHARED_DATA")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_corpus(shared_data) -> Path:
    """Directory holding the Shakespeare train/val parquet shards."""
    return shared_data / "pretrain" / "tiny"


TINY_VOCAB = 1024


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_corpus):
    """A tokenizer (vocab 1024) trained on the tiny corpus's train shard, once per session."""
    import pyarrow.parquet as pq

    from nanochat.tokenizer import Tokenizer
    texts = pq.read_table(tiny_corpus / "shard_00000.parquet", columns=["text"]).column("text").to_pylist()
    return Tokenizer.train(texts, TINY_VOCAB)


@pytest.fixture
def base(tmp_path, monkeypatch):
    """NANOCHAT_BASE_DIR -> tmp_path/base (not created), single-process env (some files define their own)."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "base"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_tokenizer):
    """A fresh base dir (per test module) holding the tiny tokenizer."""
    from nanochat.tokenizer import tokenizer_dir
    d = tmp_path_factory.mktemp("nanochat_base")
    tiny_tokenizer.save(tokenizer_dir(d))
    return d


@pytest.fixture
def env(base_dir, tiny_corpus, monkeypatch):
    """NANOCHAT_BASE_DIR -> base_dir, single-process env; returns the --data-dir flags for pretraining."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(base_dir))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NANOCHAT_DTYPE"):
        monkeypatch.delenv(var, raising=False)
    return ["--data-dir", str(tiny_corpus)]


@pytest.fixture
def sft_checkpoint(chat_model, tmp_path, monkeypatch):
    """The tiny model (the requesting module's `chat_model` fixture: test_chat_cli, test_chat_web,
    test_chat_web_recipe, test_chat_failures) saved as an SFT checkpoint, with its tokenizer, under a temp base dir."""
    from dataclasses import asdict

    from nanochat.checkpoint import checkpoint_dir, save_checkpoint
    from nanochat.tokenizer import tokenizer_dir

    model, tokenizer = chat_model
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    tokenizer.save(tokenizer_dir(tmp_path))
    save_checkpoint(checkpoint_dir("sft", "d2", tmp_path), 7, model_state=model.state_dict(),
                    meta={"model_config": asdict(model.config), "tokenizer_fingerprint": tokenizer.fingerprint})
    return tmp_path


@pytest.fixture(autouse=True)
def _release_writer_locks():
    """In-process training runs hold their checkpoint directory's writer lock for the process's
    life (nanochat/writer_lock.py): a test's run must not keep its tmp dir's lock (and fd) open."""
    yield
    from nanochat import writer_lock
    writer_lock.release_all()


SESSION_VAR = "NANOCHAT_TEST_SESSION"   # set in pytest_configure: tells this run's children from another's


def _parent(pid: int) -> int:
    """The parent pid from /proc/<pid>/stat (its comm field may hold spaces and parentheses)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        pid = _parent(pid)
    return False


def leftover_processes(nodeid: str, session: str | None = None) -> list[int]:
    """Pids of live processes that test `nodeid` started in its call phase and left orphaned: pytest
    sets PYTEST_CURRENT_TEST to "<nodeid> (call)" while the test body runs, and a child started with
    os.environ inherits it and this session's SESSION_VAR, even after it is orphaned (a torchrun
    worker, run_train.sh's nohup'd run). Processes still below this one are left alone: a fixture's
    (chromedriver) or torch's own (inductor's compile workers) that later tests use. Linux (/proc)."""
    marker = f"PYTEST_CURRENT_TEST={nodeid} (call)".encode()
    token = f"{SESSION_VAR}={session or os.environ.get(SESSION_VAR, '')}".encode()
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc/self/environ").exists() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = set((entry / "environ").read_bytes().split(b"\0"))
            if marker in env and token in env and not _descends_from(int(entry.name), os.getpid()):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):   # gone already, or another user's
            continue
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After a test body fails, kill what it left running: a failed signal test once left three
    base_train processes burning both CI cores for 20 minutes, failing the timing-sensitive tests
    after it. Passing tests are not scanned (the scan reads every /proc/*/environ)."""
    outcome = yield
    report = outcome.get_result()
    if not (report.failed and call.when == "call"):
        return
    pids = leftover_processes(item.nodeid)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if pids:
        report.sections.append(("leftover processes", f"killed {len(pids)} process(es) this test left running: {pids}"))
