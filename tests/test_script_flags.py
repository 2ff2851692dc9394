"""The benchmark and profiling scripts reject a bad flag value before any work: run as
`python -m scripts.X`, they print ONE line `X: error: <message naming the flag>` on stderr, nothing
on stdout, and exit 2 (nanochat.common.script_main), within seconds (no model is built first).

A subprocess that imports torch costs ~3-5 s on a CI core, so the command lines of CASES and MOVED
run as `python -m` would (runpy) inside two probe processes, one per core, in one module fixture,
and the parametrized tests check each result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (script, bad argv, the flag its one line must name); a spread of the audit's cases plus
# argparse-level errors (a bad int, an unknown choice) and cross-flag checks
CASES = [
    ("bench_gemm", ["--dtypes", "foo"], "--dtypes"),
    ("bench_inference", ["--decode-kernel", "foo"], "--decode-kernel"),
    ("analyze_bandwidth", ["--predict", "foo"], "--predict"),
    ("bench_serving", ["--slots", "0"], "--slots"),
    ("benchmark_kernels", ["--kernels", "foo"], "--kernels"),
    ("bench_train_floor", ["--parts", "foo"], "--parts"),
    ("bench_optim", ["--depth", "0"], "--depth"),
    ("profile_training", ["--precision", "foo"], "--precision"),
    ("bench_sampler", ["--calls", "x"], "--calls"),
    ("profile_dataloader", ["--threads", "1,x"], "--threads"),
    ("compare_logs", ["a.log", "b.log", "--tol", "-1"], "--tol"),
    ("load_test", ["--source", "foo"], "--source"),
    ("bench_checkpoint", ["--reps", "0"], "--reps"),
    ("base_train", ["--model-tag", "a b"], "--model-tag"),
]
MAX_SECONDS = 20.0
# profile_training used to build the d20 model before rejecting --precision (21 s on a CPU)
BEFORE_THE_MODEL_SECONDS = 15.0
# The limits are for a quiet 2-core machine; under load (other jobs on the CI host) every process
# is slower alike, so each limit grows with a bare `import torch` timed in each probe process: a
# failure means this script did far more than a torch import, not that the host was busy.
LOAD_FACTOR = 3.0

# The entry points that were on plain argparse (a usage block above an unknown flag or a value of
# the wrong type) and now go through FlagParser + script_main like the rest: (module, the name on
# their error line, the argv they need anyway, a bad value and the flag it must name). Some bad
# values are --under_score spellings: the line names the --dash-name.
MOVED = [
    ("scripts.chat_web", "chat_web", [], ["--graph_step", "cuda"], "--graph-step"),
    ("scripts.chat_cli", "chat_cli", [], ["--top-k", "x"], "--top-k"),                 # argparse's type check
    ("scripts.tok_train", "tok_train", [], ["--vocab_size", "100"], "--vocab-size"),
    ("scripts.tok_eval", "tok_eval", [], ["--num-docs", "0"], "--num-docs"),
    ("scripts.compare_recipes", "compare_recipes", [], ["--seeds", "x"], "--seeds"),
    ("nanochat.dataset", "dataset", [], ["--source", "c4"], "--source"),
    ("nanochat.platform", "preflight", [], ["--precision", "bogus"], "--precision"),  # argparse's choices
    ("nanochat.report", "report", ["generate"], ["--hourly_cost", "x"], "--hourly-cost"),
]
UNKNOWN_FLAG = ["--no-such-flag", "1"]
# Every command line above runs as `python -m` does (runpy, run_name="__main__"), each with its own
# stderr/stdout, exit code and seconds, inside two probe processes (one per CI core): torch is
# imported once per probe instead of once per command line (~3 s each on a CI core). Whatever a
# script writes past the redirection (a handler holding the real stderr) lands on the probe's own
# stderr, which must stay empty. Each run's seconds include the probe's torch import, as a fresh
# `python -m` would, and the warning filters are reset before each run (a warning is otherwise said
# once per process, and a later script's same warning would vanish from its one-line check).
PROBE = ("import contextlib, io, json, runpy, sys, time, traceback, warnings\n"
         "warnings.filterwarnings('ignore', '.*found in sys.modules', RuntimeWarning)  # a re-import\n"
         "t0 = time.perf_counter()\n"
         "import torch  # noqa: F401\n"
         "results = {'import torch': time.perf_counter() - t0}\n"
         "for key, module, argv in json.loads(sys.argv[1]):\n"
         "    sys.argv, err, out, code = [module, *argv], io.StringIO(), io.StringIO(), 0\n"
         "    warnings.resetwarnings()\n"
         "    warnings.filterwarnings('ignore', '.*found in sys.modules', RuntimeWarning)\n"
         "    t0 = time.perf_counter()\n"
         "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):\n"
         "        try:\n"
         "            runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
         "        except SystemExit as e:\n"
         "            code = e.code\n"
         "        except BaseException:\n"
         "            code, _ = 'raised', traceback.print_exc()\n"
         "    results.setdefault(key, []).append([code, err.getvalue(), out.getvalue(),\n"
         "                                     time.perf_counter() - t0 + results['import torch']])\n"
         "sys.stdout = sys.__stdout__\n"
         "print(json.dumps(results))\n")


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """key (a CASES script or a MOVED module) -> [[exit code, stderr, stdout, seconds] per command
    line], plus 'import torch' -> the slowest bare torch import of the probes."""
    base = tmp_path_factory.mktemp("nanochat_base")
    runs = [(script, f"scripts.{script}", argv) for script, argv, _ in CASES]
    runs += [(module, module, [*needed, *argv]) for module, _, needed, bad, _ in MOVED
             for argv in (UNKNOWN_FLAG, bad)]

    def probe(chunk):
        proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(chunk)], cwd=REPO, capture_output=True,
                              text=True, timeout=300, env=dict(os.environ, NANOCHAT_BASE_DIR=str(base)))
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    merged = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        keys = list(dict.fromkeys(key for key, _, _ in runs))   # a MOVED module's two runs share a probe
        halves = ([r for r in runs if keys.index(r[0]) % 2 == i] for i in (0, 1))
        for part in pool.map(probe, halves):
            merged["import torch"] = max(merged.get("import torch", 0.0), part.pop("import torch"))
            merged.update(part)
    return merged


@pytest.fixture(scope="module")
def limit(probed):
    """seconds -> the limit on this host now: `seconds`, or LOAD_FACTOR bare torch imports if more."""
    return lambda seconds: max(seconds, LOAD_FACTOR * probed["import torch"])


@pytest.fixture(scope="module")
def results(probed):
    """script -> (exit code, stderr, stdout, seconds) of its bad command line in CASES."""
    return {script: probed[script][0] for script, _, _ in CASES}


@pytest.mark.parametrize("script, argv, flag", CASES, ids=[c[0] for c in CASES])
def test_bad_flag_is_one_line_and_exit_2(results, limit, script, argv, flag):
    code, err, out, seconds = results[script]
    lines = err.strip().splitlines()
    assert code == 2, (code, err[-2000:])
    assert len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"{script}: error: ") and flag in lines[0], lines[0]
    assert out == "", out[-2000:]   # nothing ran: no header, no result line
    assert seconds < limit(MAX_SECONDS), seconds


@pytest.mark.parametrize("module, name, needed, bad, flag", MOVED, ids=[m[1] for m in MOVED])
def test_formerly_plain_argparse_entry_points_say_one_line(probed, limit, module, name, needed, bad, flag):
    """An unknown flag and a bad value each: one line `NAME: error: ...` naming the flag, exit 2, no
    usage block, nothing on stdout (before: argparse's usage block above the error)."""
    runs = probed[module]
    assert len(runs) == 2, runs
    for (code, err, out, seconds), named in zip(runs, (UNKNOWN_FLAG[0], flag)):
        lines = err.strip().splitlines()
        assert code == 2, (module, named, code, err[-2000:])
        assert len(lines) == 1 and "usage:" not in err, err[-2000:]
        assert lines[0].startswith(f"{name}: error: ") and named in lines[0], lines[0]
        assert out == "", out[-2000:]
        assert seconds < limit(MAX_SECONDS), seconds


def test_profile_training_rejects_precision_before_building_the_model(results, limit):
    _, err, _, seconds = results["profile_training"]
    assert "accepted: auto|bf16|fp32|fp8|nvfp4" in err
    assert seconds < limit(BEFORE_THE_MODEL_SECONDS), seconds


def test_main_still_raises_for_programmatic_callers():
    """main(argv) keeps raising ValueError naming the flag (tests and other scripts call it)."""
    from scripts import bench_gemm, bench_optim, benchmark_kernels, profile_training

    for main, argv, flag in ((bench_gemm.main, ["--dtypes", "foo"], "--dtypes"),
                             (benchmark_kernels.parse_args, ["--peak-flops", "989"], "--peak-flops"),   # TFLOP/s
                             (benchmark_kernels.parse_args, ["--peak-flops", "nan"], "--peak-flops"),
                             (bench_optim.main, ["--depth", "0"], "--depth"),
                             (profile_training.main, ["--precision-backend", "x"], "--precision-backend")):
        with pytest.raises(ValueError, match=flag):
            main(argv)


def test_every_recipe_checks_the_model_tag_with_its_flags():
    """--model-tag names a directory: a path, '..' or a space is refused with the other flags,
    before any checkpoint is looked for (it was a traceback from checkpoint_dir after torch loaded)."""
    from scripts import base_eval, base_train, chat_cli, chat_eval, chat_rl, chat_sft, chat_web, mid_train

    for parse in (base_train.parse_config, base_eval.parse_config, chat_eval.parse_args, chat_rl.parse_config,
                  mid_train.parse, chat_sft.parse, chat_cli.parse_args,
                  lambda argv: chat_web.validate(chat_web.parse_args(argv))):
        required = ["-i", "sft"] if parse is chat_eval.parse_args else []
        for bad in ("a b", "..", "a/b", "/abs", ""):
            with pytest.raises(ValueError, match=f"--model-tag: got {bad!r}; accepted: letters, digits"):
                parse(required + ["--model-tag", bad])
    assert base_train.parse_config(["--model-tag", "d20.v2-x_1"]).model_tag == "d20.v2-x_1"


def test_result_files_and_sampling_are_checked_before_the_evals(tmp_path):
    """base_eval --output / chat_eval --out that cannot be written (a directory, a path under a file)
    are refused with the flags, not after the whole evaluation; chat_eval --temperature inf too."""
    from scripts import base_eval, chat_eval

    (tmp_path / "afile").write_text("")
    for bad in (str(tmp_path), str(tmp_path / "afile" / "out.json")):
        with pytest.raises(ValueError, match=f"--output: got '{bad}'; accepted: a "):
            base_eval.parse_config(["--output", bad])
        with pytest.raises(ValueError, match=f"--out: got '{bad}'; accepted: a "):
            chat_eval.parse_args(["-i", "sft", "--out", bad])
    fine = str(tmp_path / "new" / "dir" / "out.json")   # created when written
    assert base_eval.parse_config(["--output", fine]).output == fine
    assert chat_eval.parse_args(["-i", "sft", "--out", fine]).out == fine
    for bad in ("inf", "nan", "-1"):
        with pytest.raises(ValueError, match="--temperature: got"):
            chat_eval.parse_args(["-i", "sft", "--temperature", bad])
    with pytest.raises(ValueError, match="--splits: got 'val,val'"):   # it printed two different bpbs
        base_eval.parse_config(["--splits", "val,val"])


def test_torch_free_scripts_reject_a_flag_without_importing_torch():
    """script_main lives in the torch-free nanochat/flags.py: compare_logs and bench_tokenizer
    report a bad flag without paying torch's import (seconds on a CI core)."""
    probe = ("import runpy, sys\n"
             "sys.argv = [sys.argv[1], *sys.argv[2:]]\n"
             "try:\n    runpy.run_module(sys.argv[0], run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print('torch' in sys.modules, e.code)\n")
    for script, argv in (("scripts.compare_logs", ["a.log", "b.log", "--tol", "-1"]),
                         ("scripts.bench_tokenizer", ["--threads", "0"])):
        proc = subprocess.run([sys.executable, "-c", probe, script, *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        assert proc.stdout.split() == ["False", "2"], (script, proc.stdout, proc.stderr[-2000:])
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
