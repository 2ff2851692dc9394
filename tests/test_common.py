"""init_runtime / destroy_runtime: device and dtype resolution, errors naming the flag, torchrun
detection with a real gloo process group, seeding."""

import pytest
import torch

from nanochat.common import destroy_runtime, get_base_dir, init_runtime, print0
from nanochat.distributed import free_port

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NANOCHAT_DTYPE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)


def test_cpu_runtime_fields():
    rt = init_runtime("cpu")
    assert rt.device == torch.device("cpu") and rt.device_type == "cpu"
    assert rt.dtype == torch.float32  # auto on CPU
    assert (rt.rank, rt.local_rank, rt.world_size, rt.ddp, rt.is_master) == (0, 0, 1, False, True)
    assert 10 * 2**20 < rt.peak_memory_bytes() < 64 * 2**30  # peak RSS of this process on CPU
    destroy_runtime(rt)


@pytest.mark.parametrize("device", ["gpu", "CUDA", "", "tpu"])
def test_bad_device_names_the_flag(device):
    with pytest.raises(ValueError, match=r"--device.*accepted: auto\|cpu\|cuda\|mps"):
        init_runtime(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_unavailable_cuda_raises():
    with pytest.raises(ValueError, match="--device cuda: no CUDA device"):
        init_runtime("cuda")


@pytest.mark.parametrize("dtype", ["fp16", "float16", "int8", "BF16x"])
def test_bad_dtype_names_the_flag(dtype):
    with pytest.raises(ValueError, match=r"--dtype.*auto\|bf16\|fp32"):
        init_runtime("cpu", dtype)


def test_explicit_and_env_dtype(monkeypatch):
    assert init_runtime("cpu", "bf16").dtype == torch.bfloat16
    monkeypatch.setenv("NANOCHAT_DTYPE", "bf16")
    assert init_runtime("cpu", "auto").dtype == torch.bfloat16   # env replaces auto
    assert init_runtime("cpu", "bf16").dtype == torch.bfloat16   # agreeing values are fine
    with pytest.raises(ValueError, match="conflicts with NANOCHAT_DTYPE"):
        init_runtime("cpu", "fp32")
    monkeypatch.setenv("NANOCHAT_DTYPE", "half")
    with pytest.raises(ValueError, match="NANOCHAT_DTYPE.*'half'"):
        init_runtime("cpu")


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True, 2**64])   # 2**64: torch.manual_seed's traceback before
def test_bad_seed(seed):
    with pytest.raises(ValueError, match="--seed"):
        init_runtime("cpu", seed=seed)


def test_seeding_is_deterministic():
    init_runtime("cpu", seed=123)
    a = torch.randn(4)
    init_runtime("cpu", seed=123)
    assert torch.equal(a, torch.randn(4))
    init_runtime("cpu", seed=124)
    assert not torch.equal(a, torch.randn(4))


def test_malformed_torchrun_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(ValueError, match="RANK=5 WORLD_SIZE=2"):
        init_runtime("cpu")
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="must be integers"):
        init_runtime("cpu")




def test_torchrun_single_process_group(monkeypatch):
    """RANK set -> ddp: a real gloo process group is created on CPU and destroyed again."""
    import torch.distributed as dist
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    rt = init_runtime("cpu")
    try:
        assert rt.ddp and rt.is_master and rt.world_size == 1
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 1.0
    finally:
        destroy_runtime(rt)
    assert not dist.is_initialized()
    destroy_runtime(rt)  # idempotent


def test_base_dir_and_print0(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "nc"))
    assert get_base_dir() == tmp_path / "nc" and (tmp_path / "nc").is_dir()
    print0("hello")
    monkeypatch.setenv("RANK", "1")
    print0("hidden")
    assert capsys.readouterr().out == "hello\n"


def test_require_module_skips_where_missing_and_fails_under_strict_tests(monkeypatch):
    from conftest import require_module

    monkeypatch.delenv("NANOCHAT_STRICT_TESTS", raising=False)
    assert require_module("json", "stdlib").dumps([1]) == "[1]"
    with pytest.raises(pytest.skip.Exception, match="no_such_module_xyz is not installed .install it."):
        require_module("no_such_module_xyz", "install it")
    monkeypatch.setenv("NANOCHAT_STRICT_TESTS", "1")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_xyz is not installed .install it. .NANOCHAT_STRI"):
        require_module("no_such_module_xyz", "install it")


# ------------------------------------------------------------------ script_main (one-line errors)

def _exit(capsys, check, run):
    from nanochat.flags import script_main
    with pytest.raises(SystemExit) as e:
        script_main("demo", check, run)
    return e.value.code, capsys.readouterr().err


def test_script_main_prints_user_errors_as_one_line(capsys):
    from nanochat.errors import MissingDataError, RequestError

    def bad_flag():
        raise ValueError("--depth: got -1; accepted: an integer >= 1")

    def unmeetable():
        raise RequestError("--precision nvfp4: needs a Blackwell GPU")

    def no_data():
        raise MissingDataError("no text shards (*.parquet) in /x")

    assert _exit(capsys, bad_flag, lambda: 0) == (2, "demo: error: --depth: got -1; accepted: an integer >= 1\n")
    assert _exit(capsys, lambda: None, unmeetable) == (2, "demo: error: --precision nvfp4: needs a Blackwell GPU\n")
    assert _exit(capsys, lambda: None, no_data) == (2, "demo: error: no text shards (*.parquet) in /x\n")
    assert _exit(capsys, lambda: None, lambda: 3) == (3, "")
    assert _exit(capsys, lambda: None, lambda: {"summary": 1}) == (0, "")   # a recipe's dict -> 0


def test_script_main_keeps_the_traceback_of_a_bug():
    """A plain ValueError from the work itself is not the user's: it propagates (traceback)."""
    from nanochat.flags import script_main

    def bug():
        raise ValueError("shapes do not match")

    with pytest.raises(ValueError, match="shapes do not match"):
        script_main("demo", lambda: None, bug)


def test_library_request_errors_are_request_errors(tmp_path):
    """What the scripts print as one line: the device, precision and attention requests, a missing
    tokenizer, checkpoint or data (each still the ValueError / FileNotFoundError callers expect)."""
    from nanochat import checkpoint, dataset
    from nanochat.attention import resolve_backend
    from nanochat.errors import RequestError
    from nanochat.precision import resolve
    from nanochat.platform import detect_device
    from nanochat.tokenizer import Tokenizer

    cases = [lambda: init_runtime("cuda") if not torch.cuda.is_available() else init_runtime("tpu"),
             lambda: resolve("nvfp4", "auto", detect_device(torch.device("cpu"))),
             lambda: resolve_backend("cudnn", "cpu"),
             lambda: Tokenizer.load(tmp_path),
             lambda: checkpoint.find_model_tag("base", tmp_path),
             lambda: dataset.list_shards(tmp_path)]
    for case in cases:
        with pytest.raises(RequestError):
            case()
    with pytest.raises(FileNotFoundError):
        dataset.list_shards(tmp_path)


def test_fmt_bytes_for_people():
    from nanochat.common import fmt_bytes
    assert [fmt_bytes(n) for n in (0, 999, 1000, 3_400_000, 9_186_000_000, 75.84e9)] == \
        ["0 B", "999 B", "1 KB", "3 MB", "9.2 GB", "75.8 GB"]
