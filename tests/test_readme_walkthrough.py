"""The figures README.md quotes about what the code does by default match the code.

tests/test_docs_commands.py checks that the README's commands, flags, paths and environment
variables exist; this file checks the numbers the README states as the code's behaviour, read out
of the README text itself (so an edit on either side is caught): the tiny preset's run (depth,
sequence, steps x tokens, evaluation problems, checkpoint intervals), the h100 preset's device batch
per GPU memory size, the spark preset's device batch, the training tokens of d20 and d12, the
recipe v2 schedule, run_train.sh's stop timeout and torchrun shutdown timeout, and chat_web's
batch slots. setup.sh's figures come from `setup.sh --dry-run` on a fake nvidia-smi, as
tests/test_setup.py runs it (that file checks setup.sh's behaviour; this one its README figures).
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
README = " ".join((REPO / "README.md").read_text().split())   # sentences run over line breaks

FAKE_SMI = """#!/usr/bin/env bash
case "$*" in
  *query-gpu=name*) echo "NVIDIA Fake GPU" ;;
  *compute_cap*) echo "9.0" ;;
  *driver_version*) echo "580.65.06" ;;
  *memory.total*) echo "{mem_mib}" ;;
  "") echo "| NVIDIA-SMI 580.65.06   Driver Version: 580.65.06   CUDA Version: 13.0 |" ;;
esac
"""


def quoted(pattern: str) -> re.Match:
    """The README's match of `pattern` (whitespace-normalised text); fails naming it if gone."""
    m = re.search(pattern, README)
    assert m, f"README.md no longer says {pattern!r}: update this test with the README"
    return m


def number(text: str) -> int:
    return int(text.replace(",", ""))


def dry_run(tmp_path: Path, *args: str, mem_mib: int | None = None, mem_total_gib: int | None = None,
            arch: str = "x86_64") -> str:
    """`setup.sh --dry-run ARGS` -> its output; with mem_mib, on a fake GPU of that much memory."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCH_INDEX_URL", "WANDB_RUN")}
    if mem_mib is not None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        (bin_dir / "nvidia-smi").write_text(FAKE_SMI.format(mem_mib=mem_mib))
        (bin_dir / "uname").write_text(f'#!/usr/bin/env bash\n[ "$1" = -m ] && echo {arch} || echo Linux\n')
        for name in ("nvidia-smi", "uname"):
            (bin_dir / name).chmod(0o755)
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
    if mem_total_gib is not None:   # a GB10's unified memory, as /proc/meminfo shows it
        meminfo = tmp_path / "meminfo"
        meminfo.write_text(f"MemTotal: {mem_total_gib * 1048576} kB\nMemAvailable: {mem_total_gib * 900000} kB\n")
        env["SETUP_MEMINFO"] = str(meminfo)
    proc = subprocess.run(["bash", str(REPO / "setup.sh"), "--dry-run", *args, "--base-dir", str(tmp_path / "base")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def stage_line(out: str, stage: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith(f"==> [{stage}] python")]
    assert len(lines) == 1, (stage, out)
    return lines[0] + " "


def test_the_tiny_preset_runs_what_the_readme_says(tmp_path):
    depth, seq = quoted(r"The tiny preset on a 2-core CPU: depth (\d+), sequence (\d+)").groups()
    steps, tokens = quoted(r"(\d+) steps of ([\d,]+) tokens, then evals on").groups()
    problems = quoted(r"then evals on (\d+) problems per task").group(1)
    base_every = quoted(r"saves every \d+ steps on a Spark \(\d+ on an H100, (\d+) for tiny\)").group(1)
    chat_every = quoted(r"so do mid_train, whose steps are as large, and chat_sft; tiny: every (\d+)\)").group(1)
    assert quoted(r"tiny keeps its (\d+) steps of ([\d,]+) tokens").groups() == (steps, tokens)
    assert quoted(r"a (\d+)-layer model, every stage in a few minutes").group(1) == depth

    out = dry_run(tmp_path, "--preset", "tiny")
    base = stage_line(out, "base_train")
    assert f"--depth {depth} --max-seq-len {seq} " in base
    assert f"--total-batch-size {number(tokens)} --num-iterations {steps} " in base
    assert f"--save-every {base_every} --keep-last 2 --resume auto " in base
    assert "--precision fp32 " in base and "--no-compile " in base   # "fp32, no compile"
    for stage in ("mid_train", "chat_sft"):
        assert f"--save-every {chat_every} --keep-last 2 --resume auto " in stage_line(out, stage)
    assert f"--max-per-task {problems} " in stage_line(out, "base_eval")
    assert f"--max-problems {problems} " in stage_line(out, "chat_eval")


def test_the_h100_preset_device_batch_per_gpu_memory_is_the_readmes(tmp_path):
    depth, full_dbs = quoted(r"\*\*Hopper \(H100/H200, `--preset h100`\)\*\*: depth (\d+), device batch (\d+)").groups()
    every = quoted(r"saves every \d+ steps on a Spark \((\d+) on an H100").group(1)
    fits = re.findall(r"(\d+) at (\d+)(?:-(\d+))? GB", quoted(r"it lowers the device batch to what d20 fits: ([^;]+);").group(1))
    assert len(fits) >= 3, fits
    cases = [(full_dbs, 81559)]   # an 80 GB H100 reports 81559 MiB
    for dbs, low, high in fits:
        cases += [(dbs, int(gb) * 1024 - 12) for gb in {low, high or low}]
    for dbs, mem_mib in cases:
        base = stage_line(dry_run(tmp_path, "--preset", "h100", "--only", "base_train", mem_mib=mem_mib), "base_train")
        assert f"--depth {depth} " in base and f"--device-batch-size {dbs} " in base, (mem_mib, base)
        assert "--kernel triton " in base and "--compile " in base
        assert f"--save-every {every} " in base


def test_the_spark_preset_and_the_token_counts_are_the_readmes(tmp_path):
    dbs = quoted(r"the preset keeps the device batch at (\d+)").group(1)
    every = quoted(r"saves every (\d+) steps on a Spark").group(1)
    d20_tokens = quoted(r"a full d20 run \(([\d.]+)B tokens\)").group(1)
    d12_tokens = quoted(r"`./setup.sh --depth 12` trains ([\d.]+)B tokens").group(1)
    out = dry_run(tmp_path, "--preset", "spark", "--only", "base_train", mem_mib=122000, mem_total_gib=122,
                  arch="aarch64")
    assert f"base_train on {d20_tokens}B tokens" in out, out
    base = stage_line(out, "base_train")
    assert f"--device-batch-size {dbs} " in base and f"--save-every {every} " in base
    out = dry_run(tmp_path, "--preset", "spark", "--depth", "12", "--only", "base_train", mem_mib=122000,
                  mem_total_gib=122, arch="aarch64")
    assert f"base_train on {d12_tokens}B tokens" in out, out


def test_recipe_v2_schedule_is_the_readmes():
    from nanochat.recipe import DEFAULT_RECIPE, RECIPES

    warmup, down, final = quoted(r"warmup (\d+) steps, warmdown (\d+)% to (\d+)%, NorMuon").groups()
    assert quoted(r"default (v\d), upstream nanochat's later recipe").group(1) == DEFAULT_RECIPE
    v2 = RECIPES[DEFAULT_RECIPE]
    assert v2["warmup_steps"] == int(warmup)
    assert round(v2["warmdown_ratio"] * 100) == int(down) and round(v2["final_lr_frac"] * 100) == int(final)
    assert v2["normuon_beta2"] > 0 and v2["scale_with_batch"]   # "NorMuon", "LRs x sqrt(batch / 2^19)"


def test_run_train_and_multinode_timeouts_are_the_readmes():
    stop_wait = quoted(r"SIGKILL after --timeout, default (\d+) s").group(1)
    shutdown = quoted(r"`run_train.sh --nproc N` and `launch_multinode.sh` set it to (\d+)").group(1)
    run_train = (REPO / "run_train.sh").read_text()
    assert re.search(rf"\bTIMEOUT={stop_wait}\b", run_train)
    for script in (run_train, (REPO / "scripts" / "launch_multinode.sh").read_text()):
        assert f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{shutdown}}}" in script


def test_chat_web_batch_slots_are_the_readmes():
    from scripts.chat_web import parse_args

    slots = quoted(r"its server uses chat_web's (\d+) batch slots").group(1)
    assert parse_args([]).batch_slots == int(slots)
    assert quoted(r"`chat_web -i sft --model-tag d20 --port (\d+)").group(1) == str(parse_args([]).port)
