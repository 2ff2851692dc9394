"""Review 6 of the platform / configuration area (CPU only, simulated devices): the order of CUDA's
start-up in init_runtime, the base directory, FlagParser's declarations and messages, and the
torch releases the is_big_gpu patch is applied on."""

import argparse
import types

import pytest
import torch

from nanochat import common
from nanochat import platform as P
from nanochat.errors import RequestError
from nanochat.flags import FlagParser
from nanochat.platform import PatchContext, SimpleProps, apply_patches, detect_device

GB10 = SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * 10**9, is_integrated=True)


class _Stop(Exception):
    """Ends init_runtime at set_device: the order of what came before is the point."""


def test_init_runtime_configures_the_env_before_cuda_initialises(monkeypatch):
    """_resolve_dtype's bf16 check (torch.cuda.is_bf16_supported -> current_device) initialised CUDA
    before configure_env_before_cuda ran: torch had read PYTORCH_ALLOC_CONF (no expandable segments on
    a GB10's unified memory) and printed its sm_121 warning before the filter was in place."""
    events = []
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: events.append("cuda_init") or 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(major=12, minor=1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (_ for _ in ()).throw(_Stop()))
    monkeypatch.setattr(P, "configure_env_before_cuda", lambda *a, **k: events.append("env") or [])
    with pytest.raises(_Stop):
        common.init_runtime("cuda")
    assert events and events[0] == "env", events


def test_base_dir_expands_a_quoted_tilde_and_refuses_a_file(tmp_path, monkeypatch):
    """NANOCHAT_BASE_DIR="~/runs" (quoted, or from a .env file) made a folder named '~' under the
    current directory; a file in the way was a FileExistsError traceback."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", "~/runs")
    assert common.get_base_dir() == home / "runs" and (home / "runs").is_dir()
    assert not (cwd / "~").exists()
    (tmp_path / "afile").write_text("x")
    for bad in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        monkeypatch.setenv("NANOCHAT_BASE_DIR", str(bad))
        with pytest.raises(RequestError, match=r"NANOCHAT_BASE_DIR: got .*afile.*accepted: a directory"):
            common.get_base_dir()


def test_flag_declared_with_an_underscore_is_reachable_in_both_spellings():
    """The command line reaches argparse with dashes, so `add_argument("--" + field.name)` (as
    chat_rl declares its bool fields) with an underscore in the name could be given in neither
    spelling; in an argument group too."""
    p = FlagParser(prog="x")
    p.add_argument("--max_seq_len", type=int, default=3)
    p.add_argument_group("g").add_argument("--dry_run", action="store_true")
    p.add_mutually_exclusive_group().add_argument("--no_save", action="store_true")
    for argv in (["--max_seq_len", "5", "--dry_run", "--no_save"], ["--max-seq-len", "5", "--dry-run", "--no-save"]):
        assert vars(p.parse_args(argv)) == {"max_seq_len": 5, "dry_run": True, "no_save": True}


def test_flag_errors_name_the_accepted_values():
    """`--compile=1` said only 'ignored explicit argument' and `--steps ten` 'invalid int value'."""
    p = FlagParser(prog="x")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--lr", type=float, default=1.0)
    cases = {"--compile=1": r"--compile/--no-compile.*accepted: --compile or --no-compile alone, with no value",
             "--json=yes": r"--json: .*accepted: --json alone, with no value",
             "--steps=ten": r"--steps: invalid int value: 'ten'; accepted: an integer",
             "--lr=fast": r"--lr: invalid float value: 'fast'; accepted: a number"}
    for arg, message in cases.items():
        with pytest.raises(ValueError, match=message):
            p.parse_args([arg])


def _ctx(torch_version):
    return PatchContext(env={}, dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
                        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
                        inductor_modules=[types.SimpleNamespace(is_big_gpu=lambda *_: False)],
                        triton_version="3.6.0", bundled_ptxas_version=(13, 0),
                        filter_warning=lambda *a, **k: None, torch_version=torch_version)


@pytest.mark.parametrize("version, applied", [("2.9.1", True), ("2.15.0+cu132", True),
                                              ("2.16.0.dev20270101", False), ("2.8.0", False)])
def test_is_big_gpu_patch_only_on_the_torch_releases_it_targets(version, applied):
    """Its docstring names torch 2.9-2.15 (the inductor source it was checked against), but it replaced
    inductor's is_big_gpu on any torch and logged that it did."""
    ctx = _ctx(version)
    names = apply_patches(detect_device(props=GB10), compile=True, max_autotune=True, ctx=ctx)
    assert ("is_big_gpu" in names) == applied
    assert ctx.inductor_modules[0].is_big_gpu(0) is applied
    assert ctx.inductor_config.max_autotune_gemm is applied


def test_preflight_names_the_cpu_amx_patch_a_run_gets(monkeypatch, capsys):
    """init_runtime caps oneDNN below AMX on a CPU whose AMX kernels crash (every device type), but
    the report built its patch list from the GPU patches only: "patches: []" on such a machine."""
    import json

    from nanochat import preflight
    monkeypatch.setattr(preflight, "detect_device", lambda: P.CPU_SPEC)
    monkeypatch.setattr(preflight, "configure_env_before_cuda", lambda: [])
    monkeypatch.setattr(preflight, "patch_cpu_amx", lambda: "cpu_amx")
    assert preflight.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["patches"] == ["cpu_amx"]


def test_a_flag_declared_in_both_spellings_is_named_once():
    """("--seq-len", "--seq_len") dashed to two identical names: --help showed `--seq-len SEQ_LEN,
    --seq-len SEQ_LEN` and errors said `argument --seq-len/--seq-len`."""
    p = FlagParser(prog="x")
    p.add_argument("--seq-len", "--seq_len", type=int, default=1)
    p.add_argument("--dry-run", "--dry_run", action="store_true")
    assert p.format_help().count("--seq-len") == 2   # usage line + options line, not 4
    assert p.parse_args(["--seq_len", "5"]).seq_len == 5
    with pytest.raises(ValueError) as e:
        p.parse_args(["--seq-len", "ten"])
    assert "--seq-len/--seq-len" not in str(e.value) and "accepted: an integer" in str(e.value)
    with pytest.raises(ValueError) as e:
        p.parse_args(["--dry-run=1"])
    assert str(e.value).count("--dry-run") == 2, str(e.value)   # "argument --dry-run: ...; accepted: --dry-run alone"
