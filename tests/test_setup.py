"""setup.sh's machine-dependent install steps, with fake tools first on PATH: the choice of torch
wheels for the driver, shown by `--dry-run` with a fake nvidia-smi (and uname): a CUDA 12 driver cannot
run PyPI's CUDA 13 torch, so it gets PyTorch's cu126 / cu128 index, and a driver older than CUDA 12
stops the run before anything installs. scripts/ensure_uv.sh, which gets uv onto a fresh machine
(pip --user, a PEP 668 Python, no pip at all): tests/test_ensure_uv.py."""

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.setup_clone import make_clone

REPO = Path(__file__).resolve().parents[1]

FAKE_SMI = """#!/usr/bin/env bash
case "$*" in
  *--query-gpu=name*) echo "{name}" ;;
  *--query-gpu=compute_cap*) echo "{cc}" ;;
  *--query-gpu=driver_version*) echo "535.183.01" ;;
  *--query-gpu=memory.total*) echo "{mem_mib}" ;;
  "") echo "| NVIDIA-SMI 535.183.01   Driver Version: 535.183.01   {version} |" ;;
esac
"""


GB10_SMI = ("NVIDIA GB10", "12.1")   # its memory.total: "[N/A]" (unified), or a figure: either is the host's


def _dry_run(tmp_path, cuda: str | None, arch: str = "x86_64", index_url: str | None = None,
             mem_mib: int | str = 81559, args=("--only", "env", "--preset", "tiny"), mem_total_gib: int | None = None,
             gpu: tuple[str, str] = ("NVIDIA H100 80GB HBM3", "9.0"), repo: Path = REPO):
    """setup.sh --dry-run (default: --only env --preset tiny) on a fake GPU whose driver reports
    CUDA `cuda` (None: no version in nvidia-smi's banner) and `mem_mib` of memory -> (exit code,
    output). `gpu`: (name, compute capability). `repo`: where setup.sh lies (a clone without a .venv:
    the env stage's plan does not depend on this checkout's venv)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(version=f"CUDA Version: {cuda}" if cuda else "", mem_mib=mem_mib, name=gpu[0],
                                   cc=gpu[1]))
    uname = bin_dir / "uname"
    uname.write_text(f'#!/usr/bin/env bash\n[ "$1" = -m ] && echo {arch} || echo Linux\n')
    for f in (smi, uname):
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if index_url:
        env["TORCH_INDEX_URL"] = index_url
    if mem_total_gib is not None:  # the host's /proc/meminfo, as a GB10's unified memory shows it
        meminfo = tmp_path / "meminfo"
        meminfo.write_text(f"MemTotal: {mem_total_gib * 1048576} kB\nMemAvailable: {mem_total_gib * 900000} kB\n")
        env["SETUP_MEMINFO"] = str(meminfo)
    out = subprocess.run(["bash", str(repo / "setup.sh"), "--dry-run", *args, "--base-dir", str(tmp_path / "base")],
                         env=env, capture_output=True, text=True, timeout=60)
    return out.returncode, out.stdout + out.stderr


@pytest.mark.parametrize("cuda, arch, index", [
    ("12.2", "x86_64", "https://download.pytorch.org/whl/cu126"),
    ("12.4", "aarch64", "https://download.pytorch.org/whl/cu126"),
    ("12.8", "x86_64", "https://download.pytorch.org/whl/cu128"),
    ("12.9", "x86_64", "https://download.pytorch.org/whl/cu128"),
    ("13.0", "x86_64", "PyPI"),
    ("13.0", "aarch64", "https://download.pytorch.org/whl/cu130"),   # DGX Spark
    ("13.2", "x86_64", "PyPI"),
])
def test_torch_index_follows_the_drivers_cuda(tmp_path, cuda, arch, index):
    rc, out = _dry_run(tmp_path, cuda, arch, repo=make_clone(tmp_path))
    assert rc == 0, out
    assert f"install torch from {index}, the project" in out, out
    assert f"CUDA {cuda}" in out   # the machine line says what was read


def test_old_driver_stops_before_anything_installs(tmp_path):
    rc, out = _dry_run(tmp_path, "11.8")
    assert rc == 2
    assert "CUDA up to 11.8" in out and "TORCH_INDEX_URL" in out and "would create" not in out


def test_explicit_index_wins_and_unreadable_version_warns(tmp_path):
    clone = make_clone(tmp_path)
    rc, out = _dry_run(tmp_path, "11.8", index_url="https://example.org/whl/cu118", repo=clone)
    assert rc == 0 and "install torch from https://example.org/whl/cu118," in out, out
    rc, out = _dry_run(tmp_path, None, repo=clone)
    assert rc == 0 and "could not read the driver's CUDA version" in out and "from PyPI," in out, out


@pytest.mark.parametrize("mem_mib, dbs", [(81559, 32), (46068, 16), (40960, 16), (32607, 8), (24564, 4)])
def test_h100_preset_fits_the_device_batch_to_the_gpus_memory(tmp_path, mem_mib, dbs):
    """d20 bf16 needs ~14.5 GiB + ~1 GiB per sequence (H100 measurement in setup.sh): the preset
    keeps its total batch and lowers the device batch until the peak fits."""
    rc, out = _dry_run(tmp_path, "13.0", mem_mib=mem_mib, args=("--only", "base_train,mid_train", "--preset", "h100"))
    assert rc == 0, out
    assert out.count(f"--device-batch-size {dbs} ") == 2 and "--total-batch-size 524288" in out, out
    assert ("(not 32)" in out) == (dbs != 32)
    # periodic checkpoints, the newest two kept, and a rerun of an interrupted stage resumes
    assert out.count("--save-every 1000 --keep-last 2 --resume auto ") == 2, out   # base_train and mid_train


def test_device_batch_flag_overrides_the_fit_and_keeps_the_total(tmp_path):
    """An out-of-memory stop's hint says: rerun ./setup.sh with --device-batch-size N. It replaces the
    preset's fitted device batch in every stage that takes one, the total batches staying the same
    (so the stage's --resume auto can continue); one that does not split the total is refused."""
    rc, out = _dry_run(tmp_path, "13.0", args=("--only", "base_train,base_eval,mid_train,chat_sft",
                                               "--preset", "h100", "--device-batch-size", "8"))
    assert rc == 0, out
    assert "device batch 8 (--device-batch-size; the preset's is 32); the total batch stays 524288 tokens" in out
    assert out.count("--device-batch-size 8 ") == 3 and out.count("--device-batch-size 8\n") == 1, out
    assert "--total-batch-size 524288" in out and out.count("--total-batch-size -1") == 2
    rc, out = _dry_run(tmp_path, None, args=("--only", "mid_train", "--preset", "tiny", "--device-batch-size=1"))
    assert rc == 0 and "--device-batch-size 1 --total-batch-size 4096 " in out, out
    for bad, said in (("0", "got '0'; accepted: an integer 1-1024"), ("x8", "got 'x8'"), ("2000", "got '2000'"),
                      ("3", "got 3; accepted: a divisor of 256 (the total batch of 524288 tokens is 256 rows of "
                            "2048 tokens)")):
        rc, out = _dry_run(tmp_path, "13.0", args=("--preset", "h100", "--device-batch-size", bad))
        assert rc == 2 and f"--device-batch-size: {said}" in out and "[env]" not in out, out


def test_wandb_run_without_wandb_in_the_venv_is_said_before_the_first_stage(tmp_path, monkeypatch):
    """WANDB_RUN with --only / --from (no env stage to install wandb): a venv without wandb failed at
    base_train, after the data and tokenizer stages; now before any stage (a dry run warns)."""
    has_wandb = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", "import wandb"],
                               capture_output=True).returncode == 0
    monkeypatch.setenv("WANDB_RUN", "myrun")
    said = "WANDB_RUN=myrun: the wandb package is not in"
    rc, out = _dry_run(tmp_path, None, args=("--preset", "tiny", "--only", "data,base_train"))
    assert rc == 0 and (said in out) != has_wandb, out
    if not has_wandb:
        assert "which stage 'base_train' logs to; install it with WANDB_RUN=myrun ./setup.sh --only env" in out
    rc, out = _dry_run(tmp_path, None, args=("--preset", "tiny", "--only", "data,tokenizer"))
    assert rc == 0 and said not in out   # no training stage runs


def test_h100_preset_on_a_16_gb_gpu_points_at_a_smaller_depth(tmp_path):
    rc, out = _dry_run(tmp_path, "13.0", mem_mib=16384, args=("--only", "base_train", "--preset", "h100"))
    assert rc == 2 and "d20 needs about 18 GiB at a device batch of 1" in out and "'s 16 GiB is not enough" in out
    assert "smaller --depth (e.g. 12)" in out and "[base_train]" not in out


@pytest.mark.parametrize("depth", [8, 12, 20, 26])
def test_depth_sets_the_model_its_tokens_and_its_data(tmp_path, depth):
    """--depth N: the summary's parameter and token counts are the model's own (nanochat/gpt.py,
    20 tokens per scaling parameter as base_train's default), and the shards scale with them."""
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth

    model = build_model(config_for_depth(depth, 32768, 2048), "meta")
    total, scaling = sum(p.numel() for p in model.parameters()), model.num_scaling_params()
    args = ("--only", "data,base_train,chat_eval", "--preset", "h100") + (() if depth == 20 else ("--depth", str(depth)))
    rc, out = _dry_run(tmp_path, "13.0", args=args)
    assert rc == 0, out
    assert f"d{depth}: {total / 1e6:.0f}M parameters, base_train on {20 * scaling / 1e9:.1f}B tokens" in out, out
    shards = max(8, math.ceil(170 * scaling / 435_162_240 - 1e-4))  # d20: 170 shards
    assert f"climbmix -n {shards}\n" in out and f"({shards} data shards)" in out
    assert f"--depth {depth} " in out and len(re.findall(rf"--model-tag d{depth}\b", out)) == 2


@pytest.mark.parametrize("bad", ["0", "65", "twelve", "-3", ""])
def test_bad_depth_stops_before_anything(tmp_path, bad):
    rc, out = _dry_run(tmp_path, "13.0", args=("--preset", "h100", f"--depth={bad}"))
    assert rc == 2 and f"--depth: got '{bad}'; accepted: an integer 1-64" in out and "==>" not in out


@pytest.mark.parametrize("total_gib, depth, dbs, days_note", [
    (122, 20, 16, True), (40, 20, 8, True), (122, 12, 16, False), (122, 32, 8, True), (60, 32, None, True)])
def test_spark_preset_budgets_the_unified_memory(tmp_path, total_gib, depth, dbs, days_note):
    """On a GB10 the GPU's memory is the host's: the device batch fits 3/4 of MemTotal (a stable
    figure, so a rerun's commands match), and a d16+ run says it takes days there (and what
    --depth 12 costs)."""
    rc, out = _dry_run(tmp_path, "13.0", arch="aarch64", mem_total_gib=total_gib, mem_mib="[N/A]", gpu=GB10_SMI,
                       args=("--only", "base_train", "--preset", "spark", "--depth", str(depth)))
    if dbs is None:
        assert rc == 2 and f"3/4 of the {total_gib} GiB of unified memory is not enough" in out, out
        return
    assert rc == 0 and f"--device-batch-size {dbs} " in out, out
    assert ("(not 16)" in out) == (dbs != 16)
    assert ("~6-7 days" in out) == days_note and ("--depth 12 trains 2.2B tokens" in out) == days_note


def test_no_gpu_takes_pypi(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_INDEX_URL"}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/usr/bin/env bash\nexit 9\n")   # installed, no GPU
    (bin_dir / "nvidia-smi").chmod(0o755)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    out = subprocess.run(["bash", str(make_clone(tmp_path) / "setup.sh"), "--dry-run", "--only", "env", "--preset",
                          "tiny", "--force"], env=env, capture_output=True, text=True, timeout=60)   # no .venv to reuse
    assert out.returncode == 0 and "GPU: none" in out.stdout and "from PyPI," in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("with_cargo, flag", [(False, ()), (False, ("--install-rust",)), (True, ())])
def test_missing_cargo_is_named_before_any_download(tmp_path, with_cargo, flag):
    """Without Rust the env stage stops before installing uv or torch (the dry run says so);
    --install-rust or a cargo in rustup's ~/.cargo/bin (a shell started before the install) is enough."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").symlink_to(sys.executable)
    if with_cargo:
        (home / ".cargo" / "bin").mkdir(parents=True)
        (home / ".cargo" / "bin" / "cargo").write_text("#!/bin/sh\nexit 0\n")
        (home / ".cargo" / "bin" / "cargo").chmod(0o755)
    env = {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin"}
    out = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--only", "env", "--preset", "tiny", "--force",
                          *flag], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("cargo not found" in out.stderr and "--install-rust" in out.stderr) == (not with_cargo and not flag)


# ------------------------------------------------------------------ the pipeline's done-markers

PIPELINE = ("data", "tokenizer", "tok_eval", "base_train", "base_eval", "mid_train", "chat_sft", "chat_eval", "report")


def _tiny(tmp_path, *args, cwd=None, base=None):
    """setup.sh --dry-run --preset tiny [args] (--base-dir `base`, default tmp_path/base) -> (exit code,
    output)."""
    out = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", "--preset", "tiny", "--base-dir",
                          str(base or tmp_path / "base"), *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    return out.returncode, out.stdout + out.stderr


def _commands(output: str) -> dict[str, list[str]]:
    """stage -> the command the dry run would run (a stage that is skipped has none)."""
    cmds = {}
    for line in output.splitlines():
        for stage in PIPELINE:
            if line.startswith(f"==> [{stage}] python "):
                cmds[stage] = line.removeprefix(f"==> [{stage}] ").split(" ")
    return cmds


MARKER_HEAD = "done-marker v2 (paths relative to the base dir)"   # scripts/setup_stages.sh's


def _mark_done(tmp_path, cmds, extra=None, base="base"):
    """Done-markers as a finished run writes them (setup.sh's marker_text + stage_inputs), for stages
    that left no output files (a finished run adds one "output SIZE SHA256 PATH" line per file)."""
    state = tmp_path / base / "setup_state"
    state.mkdir(parents=True, exist_ok=True)
    for stage, cmd in cmds.items():
        lines = [MARKER_HEAD, "preset=tiny", *cmd, *(extra or {}).get(stage, [])]
        (state / f"{stage}.done").write_text("\n".join(lines) + "\n")


def _verdicts(output: str) -> dict[str, str]:
    said = {}
    for stage in PIPELINE:
        if f"==> [{stage}] done already" in output:
            said[stage] = "skip"
        elif f"==> [{stage}] rerunning: " in output:
            said[stage] = "cascade"
        elif f"==> [{stage}] config changed" in output:
            said[stage] = "changed"
        else:
            said[stage] = "new"
    return said


def test_own_conversations_reach_mid_and_sft(tmp_path):
    """--conversations (relative to the caller's directory, kept absolute), --identity and
    --no-identity go to mid_train and chat_sft only; a missing file or a name chat_sft would refuse
    stops setup.sh before anything, naming the flag."""
    (tmp_path / "own.jsonl").write_text('{"messages": []}\n')
    rc, out = _tiny(tmp_path, "--conversations", "own.jsonl", "--no-identity", cwd=tmp_path)
    assert rc == 0, out
    cmds = _commands(out)
    for stage in PIPELINE:
        has = "--extra-conversations" in cmds[stage]
        assert has == (stage in ("mid_train", "chat_sft")), (stage, cmds[stage])
    own = cmds["chat_sft"]
    assert own[own.index("--extra-conversations") + 1] == str(tmp_path / "own.jsonl") and "--no-identity" in own
    rc, out = _tiny(tmp_path, "--conversations", "missing.jsonl", cwd=tmp_path)
    assert rc == 2 and "--conversations: got 'missing.jsonl'" in out and "[data]" not in out
    rc, out = _tiny(tmp_path, "--identity", "Zorblax")
    assert rc == 0 and _commands(out)["mid_train"][-2:] == ["--identity", "Zorblax"], out
    assert "--identity" not in _commands(out)["base_train"]
    for bad in (["--identity", "x" * 65], ["--identity", " x"], ["--identity", "x", "--no-identity"]):
        rc, out = _tiny(tmp_path, *bad)
        assert rc == 2 and "--identity: got" in out and "[data]" not in out, (bad, out)


def test_a_rerun_model_stage_reruns_every_later_one(tmp_path):
    """All markers current: every stage is skipped. base_train's config changed: it and every later
    stage run (their own commands are unchanged), data and the tokenizer do not; the tokenizer's:
    every stage after it; base_eval's: only the report follows it. An edited --conversations file retrains from mid_train on."""
    own = tmp_path / "own.jsonl"
    own.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    args = ("--conversations", str(own))
    cmds = _commands(_tiny(tmp_path, *args)[1])
    assert set(cmds) == set(PIPELINE)
    digest = subprocess.run(["sha256sum", str(own)], capture_output=True, text=True).stdout.strip()
    inputs = {"mid_train": [digest], "chat_sft": [digest]}
    _mark_done(tmp_path, cmds, inputs)
    assert set(_verdicts(_tiny(tmp_path, *args)[1]).values()) == {"skip"}

    _mark_done(tmp_path, {"base_train": cmds["base_train"] + ["--seed", "1"]})   # an older config
    said = _verdicts(_tiny(tmp_path, *args)[1])
    assert [said[s] for s in PIPELINE] == ["skip"] * 3 + ["changed"] + ["cascade"] * 5

    _mark_done(tmp_path, cmds, inputs)      # a new tokenizer: every model after it
    _mark_done(tmp_path, {"tokenizer": cmds["tokenizer"] + ["--max-chars", "1"]})
    said = _verdicts(_tiny(tmp_path, *args)[1])
    assert [said[s] for s in PIPELINE] == ["skip", "changed"] + ["cascade"] * 7

    _mark_done(tmp_path, cmds, inputs)      # an eval that reruns makes no model: only the report follows
    _mark_done(tmp_path, {"base_eval": cmds["base_eval"] + ["--seed", "1"]})
    said = _verdicts(_tiny(tmp_path, *args)[1])
    assert [said[s] for s in PIPELINE] == ["skip"] * 4 + ["changed"] + ["skip"] * 3 + ["cascade"]
    rc, out = _tiny(tmp_path, *args, "--force", "--only", "chat_sft,chat_eval")
    assert rc == 0 and "[chat_eval] rerunning: chat_sft ran before it" in out and "[chat_sft] python" in out

    _mark_done(tmp_path, cmds, inputs)
    own.write_text(own.read_text() * 2)                                         # the file was edited
    said = _verdicts(_tiny(tmp_path, *args)[1])
    assert [said[s] for s in PIPELINE] == ["skip"] * 5 + ["changed", "changed", "cascade", "cascade"]


def test_a_relative_base_dir_is_the_callers(tmp_path):
    """--base-dir rel, given in tmp_path: the done-markers are read from tmp_path/rel (the stages run
    in the repo, where a relative path would have pointed before)."""
    cmds = _commands(_tiny(tmp_path, base=tmp_path / "rel")[1])
    _mark_done(tmp_path, cmds, base="rel")
    rc, out = _tiny(tmp_path, base="rel", cwd=tmp_path)
    assert rc == 0 and set(_verdicts(out).values()) == {"skip"}, out


# ------------------------------------------------------------------ flag checks (before any work)

STAGE_NAMES = "env data tokenizer tok_eval base_train base_eval mid_train chat_sft chat_eval report"


def test_base_dir_must_name_a_directory(tmp_path):
    """An empty --base-dir (which would have been the caller's directory) and a path that is, or lies
    under, an existing file stop setup.sh before anything, naming the flag."""
    (tmp_path / "afile").write_text("not a directory\n")
    for bad in (["--base-dir", ""], ["--base-dir="], ["--base-dir", str(tmp_path / "afile")],
                ["--base-dir", "afile"], ["--base-dir", "afile/sub"]):
        rc, out = _tiny(tmp_path, *bad, cwd=tmp_path)
        assert rc == 2 and "--base-dir: got '" in out and "accepted: a directory" in out, (bad, out)
        assert "==>" not in out and len(out.strip().splitlines()) == 1, (bad, out)
    rc, out = _tiny(tmp_path, "--only", "data", base=tmp_path / "new" / "dir")   # one still to be made is fine
    assert rc == 0 and "[data]" in out, out


def test_empty_identity_is_a_bad_name(tmp_path):
    for bad in (["--identity", ""], ["--identity="], ["--identity", "", "--no-identity"]):
        rc, out = _tiny(tmp_path, *bad)
        assert rc == 2 and "--identity: got ''; accepted: a name of 1-64 printable characters" in out, (bad, out)
        assert "==>" not in out


def test_only_and_from_conflict_and_empty_stage_names(tmp_path):
    """--only with --from names both flags; an empty --only / --from (or an empty name in the list)
    lists the stages instead of silently running every one."""
    for args in (["--only", "base_train", "--from", "data"], ["--from=data", "--only=base_train"]):
        rc, out = _tiny(tmp_path, *args)
        assert rc == 2 and "--only" in out and "--from" in out and "accepted: one of the two" in out, (args, out)
        assert "==>" not in out
    for flag, value in (("--only", ""), ("--only", "data,"), ("--only", "data,,tokenizer"), ("--from", "")):
        rc, out = _tiny(tmp_path, f"{flag}={value}")
        assert rc == 2 and f"{flag}: got '{value}'" in out and STAGE_NAMES in out, (flag, value, out)
        assert "==>" not in out


def test_from_needs_the_earlier_stages_done(tmp_path):
    """--from STAGE skips the stages before it, so each must have its done-marker: the first missing
    one is named with the way to run it; a dry run says so and still lists what would run, a real
    run stops before the machine checks (here: before it finds no python3 on PATH)."""
    rc, out = _tiny(tmp_path, "--from", "data")   # only env is before data, and its marker lives in .venv
    assert rc == 0 and "--from: got" not in out and set(_commands(out)) == set(PIPELINE), out
    cmds = _commands(out)
    rc, out = _tiny(tmp_path, "--from", "base_train")
    assert rc == 0 and "--from: got 'base_train'" in out and "stage 'data'" in out and "--from data" in out, out
    assert set(_commands(out)) == set(PIPELINE[3:])
    _mark_done(tmp_path, {s: cmds[s] for s in ("data", "tokenizer")})
    rc, out = _tiny(tmp_path, "--from", "base_train")
    assert rc == 0 and "stage 'tok_eval'" in out and "--from tok_eval" in out and "stage 'data'" not in out, out

    bin_dir = tmp_path / "bin"   # no python3: before the check existed, the run stopped there
    bin_dir.mkdir()
    for tool in ("dirname", "uname", "df", "awk"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    run = subprocess.run([shutil.which("bash"), str(REPO / "setup.sh"), "--preset", "tiny", "--from", "base_train",
                          "--base-dir", str(tmp_path / "base")], env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "error: --from: got 'base_train'" in run.stderr, run.stdout + run.stderr
    assert "stage 'tok_eval'" in run.stderr and "==>" not in run.stdout, run.stdout + run.stderr

    _mark_done(tmp_path, {"tok_eval": cmds["tok_eval"]})
    rc, out = _tiny(tmp_path, "--from", "base_train")
    assert rc == 0 and "--from: got" not in out and set(_commands(out)) == set(PIPELINE[3:]), out
    rc, out = _tiny(tmp_path, "--from", "env", base=tmp_path / "empty")
    assert rc == 0 and "--from: got" not in out and set(_commands(out)) == set(PIPELINE), out


def test_list_stages_checks_the_other_flags_first(tmp_path):
    rc, out = _tiny(tmp_path, "--list-stages")
    assert rc == 0 and out.split() == STAGE_NAMES.split(), out
    rc, out = _tiny(tmp_path, "--list-stages", "--from", "report")   # listing reads no done-markers
    assert rc == 0 and out.split() == STAGE_NAMES.split(), out
    for bad, said in ((["--bogus"], "unknown option '--bogus'"), (["--depth", "0"], "--depth: got '0'"),
                      (["--only", "nope"], "--only: unknown stage 'nope'")):
        rc, out = _tiny(tmp_path, "--list-stages", *bad)
        assert rc == 2 and said in out and len(out.strip().splitlines()) == 1, (bad, out)


# ------------------------------------------------------------------ real runs: markers, Ctrl-C, the end

def _run_setup(base, *args, timeout=120):
    """setup.sh --preset tiny --base-dir base [args], for real (no --dry-run) -> CompletedProcess."""
    return subprocess.run(["bash", str(REPO / "setup.sh"), "--preset", "tiny", "--base-dir", str(base), *args],
                          capture_output=True, text=True, timeout=timeout)


def prepared_base(tmp_path_factory, base: Path) -> Path:
    """`base` holding what `setup.sh --preset tiny --only data,tokenizer` makes (the Shakespeare shards,
    the tokenizer, their done-markers), for a test that runs base_train through setup.sh: the real
    stages run once per session (into the session's temp dir, shared with tests/test_hangup.py) and
    are copied (the markers name no absolute path: a copied base dir keeps its finished stages), as
    they are the same for every tiny run."""
    cache = tmp_path_factory.getbasetemp() / "setup_tiny_data_tokenizer"
    if not (cache / "setup_state" / "tokenizer.done").exists():
        shutil.rmtree(cache, ignore_errors=True)
        prep = _run_setup(cache, "--only", "data,tokenizer", timeout=150)
        assert prep.returncode == 0, prep.stdout + prep.stderr
    shutil.copytree(cache, base, ignore=shutil.ignore_patterns("lock", "hangup.log", "location"))
    return base


def _kill_group(proc: subprocess.Popen) -> None:
    """A test's setup.sh (the leader of its own process group) and everything it started, gone."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_rerun_stage_that_fails_loses_its_done_marker(tmp_path):
    """The marker says the stage's latest run finished. A finished stage that runs again (--force,
    a changed config, or a model stage before it that ran) and fails or is interrupted must not
    keep its old marker: the next plain rerun would say "done already" and skip it, and every
    later stage, on half-made results (e.g. a mid_train cut short while retraining on a new base)."""
    cmds = _commands(_tiny(tmp_path)[1])
    _mark_done(tmp_path, {s: cmds[s] for s in ("data", "tokenizer", "tok_eval")})
    assert _verdicts(_tiny(tmp_path)[1])["tok_eval"] == "skip"
    run = _run_setup(tmp_path / "base", "--only", "tok_eval", "--force")   # no tokenizer there: it fails
    assert run.returncode == 1 and "stage 'tok_eval' failed (exit 2)" in run.stderr, run.stdout + run.stderr
    assert not (tmp_path / "base" / "setup_state" / "tok_eval.done").exists()
    said = _verdicts(_tiny(tmp_path)[1])
    assert said["tok_eval"] == "new" and said["tokenizer"] == "skip", said


def test_the_end_names_what_finished_and_a_venv_that_works_from_anywhere(tmp_path):
    """The closing lines: `source` names the repo's .venv by its absolute path (setup.sh may be run
    from another directory) and the base dir quoted; a report made before the other stages
    finished (--only report) says which have not, not "All stages done", and offers no chat
    with a checkpoint that does not exist."""
    base = tmp_path / "my base"
    run = _run_setup(base, "--only", "report")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "All stages done" not in run.stdout and "Chat with your model" not in run.stdout, run.stdout
    assert f"stages not finished in {base}: data tokenizer tok_eval base_train" in run.stdout
    (base / "checkpoints" / "mid" / "d2").mkdir(parents=True)   # as a finished mid_train leaves it
    cmds = _commands(_tiny(tmp_path, base=base)[1])
    _mark_done(tmp_path, {s: c for s, c in cmds.items() if s != "report"}, base="my base")
    run = _run_setup(base, "--only", "report")
    assert run.returncode == 0 and "All stages done." in run.stdout, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert f"  source {REPO}/.venv/bin/activate" in lines, run.stdout
    assert f"  export NANOCHAT_BASE_DIR={str(base).replace(' ', chr(92) + ' ')}" in lines, run.stdout
    assert "Chat with your model (mid checkpoint, tag d2):" in lines


@pytest.mark.parametrize("depth", [None, 4])
def test_tiny_start_says_what_base_train_trains(tmp_path, depth):
    """The tiny preset trains a fixed 250 steps of 4,096 tokens at any depth (not 20 tokens per
    parameter): the start line says so, with the model's parameter count (nanochat/gpt.py)."""
    from nanochat.checkpoint import build_model
    from nanochat.gpt import config_for_depth

    total = sum(p.numel() for p in build_model(config_for_depth(depth or 2, 2048, 2048), "meta").parameters())
    rc, out = _tiny(tmp_path, "--only", "base_train", *(("--depth", str(depth)) if depth else ()))
    assert rc == 0, out
    assert f"==> d{depth or 2}: {total / 1e6:.1f}M parameters, base_train on 1.0M tokens (250 steps of 4096," in out, out


STOPS = {"ctrl_c": (signal.SIGINT, 130, "Ctrl-C"), "sigterm_to_setup": (signal.SIGTERM, 143, "SIGTERM")}
STOPPED_ARGS = ("--only", "base_train,base_eval", "--depth", "1")   # d1: the smallest model setup.sh trains


@pytest.fixture(scope="module")
def stopped_setups(tmp_path_factory):
    """Both stops of test_ctrl_c_in_base_train_saves_and_stops_setup, run side by side (each is mostly
    a python start-up and base_train's first eval, one core's work): how -> (exit code, output, base
    dir). Each setup.sh leads its own process group, killed at teardown if it is still there."""
    runs = {}
    try:
        for how in STOPS:
            tmp = tmp_path_factory.mktemp(how)
            base = prepared_base(tmp_path_factory, tmp / "base")
            with open(tmp / "setup.log", "wb") as f:
                proc = subprocess.Popen(["bash", str(REPO / "setup.sh"), "--preset", "tiny", *STOPPED_ARGS,
                                         "--base-dir", str(base)], stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True,   # its own group: the signal reaches setup.sh and python
                                        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            runs[how] = (proc, tmp / "setup.log", base)
        deadline = time.time() + 150
        for how, (proc, log, _) in runs.items():
            sig = STOPS[how][0]
            # the first step's line: base_train is training (the signal lands in a later step)
            while not re.search(r"^step 00000/00250", log.read_text(errors="replace"), re.M):
                assert proc.poll() is None and time.time() < deadline, log.read_text(errors="replace")
                time.sleep(0.05)
            if sig == signal.SIGINT:
                os.killpg(proc.pid, sig)
            else:
                os.kill(proc.pid, sig)   # setup.sh only
        yield {how: (proc.wait(timeout=60), log.read_text(errors="replace"), base)
               for how, (proc, log, base) in runs.items()}
    finally:
        for proc, _, _ in runs.values():
            _kill_group(proc)


@pytest.mark.slow
@pytest.mark.parametrize("how", list(STOPS))
def test_ctrl_c_in_base_train_saves_and_stops_setup(stopped_setups, how):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) during base_train: the
    step finishes, a checkpoint is saved, and setup.sh stops at once with exit 130 and one line
    saying how to continue (not "failed ... fix the problem", not carrying on), with no marker.
    A SIGTERM sent to setup.sh alone (a scheduler, `timeout`, `kill PID`) does the same, exit 143:
    setup.sh passes it on to the stage and waits for its save (it used to die at once and leave
    the stage training on its own)."""
    sig, code, name = STOPS[how]
    rc, text, base = stopped_setups[how]
    assert rc == code, text[-2000:]
    assert (f"setup.sh: stopped by {name} in stage 'base_train' (exit {code}). Rerun {REPO}/setup.sh --preset tiny "
            f"{' '.join(STOPPED_ARGS)} --base-dir {base} to continue") in text, text[-2000:]
    assert "failed" not in text and "[base_eval]" not in text, text[-2000:]
    m = re.search(rf"^base_train: error: stopped by {sig.name} at step (\d+) of 250: checkpoint (\S+) saved", text, re.M)
    assert m and (Path(m.group(2)) / "model.pt").is_file(), text[-2000:]
    assert not (base / "setup_state" / "base_train.done").exists()
