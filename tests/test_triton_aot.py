"""nanochat/triton_aot.py: every Triton kernel of the project compiled on this CPU for the H100
(sm_90) and GB10 (sm_121) with the installed Triton, and checked against those GPUs' limits;
the resource arithmetic; launch capture; the command line."""

import functools
import runpy
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nanochat import triton_aot as ta
from nanochat.triton_aot_cases import CASES

REPO = Path(__file__).resolve().parents[1]
H100, GB10 = ta.TARGETS["h100-sxm"], ta.TARGETS["gb10"]


@pytest.fixture(autouse=True, scope="module")
def _triton_cache_in_tmp(tmp_path_factory):
    """Triton writes every compiled kernel to its cache: keep it under pytest's tmp dir."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton_cache")))
        yield


@functools.cache
def _results(case):
    """Both targets' results of one case, compiled once per test session."""
    return ta.check([H100, GB10], only=[case])


def _summary(results):
    sys.path.insert(0, str(REPO))
    from scripts.triton_aot import summarize
    return summarize(results)


@pytest.mark.parametrize("case", [c for c in CASES if c != "decode_step"])
def test_every_kernel_compiles_and_can_run_on_h100_and_gb10(case):
    """A plain launch must compile and fit an SM; an autotuned kernel needs at least one config
    that fits (the autotuner skips the others on that GPU)."""
    results = _results(case)
    assert results, case
    for launch, res in results:
        assert res.ok or launch.config is not None, (res.target, res.kernel, res.error)
        if res.ok:
            assert res.shared is not None and 0 < res.registers <= 255, res
    for target, _, kernel, n_fit, n, ok in _summary(results):
        assert ok, f"{kernel} on {target}: {n_fit} of {n} launches fit"


def test_gemm_tile_sets_fit_their_gpus():
    """The persistent GEMMs take their tile set from the GPU's shared memory per block: the 227 KB
    GPUs the large one, GB10 and the RTX 50 parts (99 KB) the small one. On GB10 every small tile
    fits with the forward epilogue, and with relu^2's gradient (which also stages its aux tile)
    all but the two triton_mlp's list names; every q/k tile fits. On the H100 the three-stage
    128x256 tile fits and the four-stage one does not (the autotuner skips it there)."""
    from nanochat import triton_mlp as tm

    assert [tm.tile_set(t) for t in ta.TARGETS.values()] == ["large", "small", "large", "small"]
    assert tm.tile_set(tm.GemmGpu(132, 232_448)) == "large" and tm.tile_set(tm.GemmGpu(48, 101_376)) == "small"
    fit = {}
    for launch, res in _results("mlp_gemm"):
        fp8 = launch.kwargs["a_desc"].base.dtype != torch.bfloat16
        key = (res.target, fp8, launch.kwargs["EPILOGUE"], launch.label)
        fit[key] = res.fits(ta.TARGETS[res.target], ta.num_warps_of(launch))
        assert fit[key] == (res.shared <= ta.TARGETS[res.target].smem_per_block), key
    for fp8 in (False, True):
        small = [f"{bm}x{bn}x{bk}/s{st}/w{w}" for bm, bn, bk, st, w in tm._TILES[fp8, "small"]]
        gb10 = {(epi, label): ok for (t, f, epi, label), ok in fit.items() if t == "gb10" and f == fp8}
        assert sorted(label for epi, label in gb10 if epi == 1) == sorted(small)   # the small set, nothing else
        assert all(gb10[1, label] for label in small), gb10
        dropped = {label for label in small if not gb10[2, label]}
        assert dropped == (set() if fp8 else {"128x128x32/s4/w8", "128x256x32/s2/w8"}), dropped
    assert fit["h100-sxm", False, 1, "128x256x64/s3/w8"] and not fit["h100-sxm", False, 1, "128x256x64/s4/w8"]
    for launch, res in _results("qk_gemm"):
        assert res.fits(ta.TARGETS[res.target], ta.num_warps_of(launch)), (res.target, launch.label)


@pytest.mark.slow
def test_persistent_decode_kernel_is_resident_on_every_sm():
    """The grid-barrier kernel hangs unless all its programs (one per SM) are resident at once."""
    for launch, res in _results("decode_step"):
        target = ta.TARGETS[res.target]
        assert res.ok, res.error
        assert launch.kwargs["P_P2"] >= target.sms and launch.kwargs["PHASE"] == -1
        assert ta.programs_per_sm(target, res.registers, res.shared, ta.num_warps_of(launch)) >= 1


def test_programs_per_sm_arithmetic():
    # 255 registers x 8 warps = 65,280 -> one program of 256 threads per SM
    assert ta.programs_per_sm(H100, 255, 2048, 8) == 1
    assert ta.programs_per_sm(H100, 32, 0, 4) == 16            # threads: 2048 / 128
    assert ta.programs_per_sm(GB10, 32, 0, 4) == 12            # GB10: 1536 threads per SM
    assert ta.programs_per_sm(GB10, 64, 101_376, 4) == 1
    assert ta.programs_per_sm(GB10, 64, 101_377, 4) == 0       # over the per-block limit
    assert ta.programs_per_sm(H100, 64, 100_000, 4) == 2       # shared memory per SM
    real = SimpleNamespace(regs_per_sm=65536, threads_per_sm=2048, smem_per_sm=233_472, smem_per_block=232_448)
    assert ta.programs_per_sm(real, 128, 0, 8) == 2            # what triton_decode reads off a GPU


def test_capture_records_instead_of_running_and_restores():
    from triton.runtime.jit import JITFunction

    from nanochat import triton_kernels as tk

    before = JITFunction.run
    with pytest.raises(RuntimeError, match="boom"):
        with ta.captured("x") as launches:
            tk.mix_norm_fwd_triton(torch.ones(4, 64), torch.ones(4, 64), torch.ones(2), 1e-6)
            raise RuntimeError("boom")
    assert JITFunction.run is before
    assert len(launches) == 1 and launches[0].fn.__name__ == "_mix_norm_fwd_kernel"
    assert launches[0].kwargs["BLOCK_C"] == 64 and launches[0].args[0].shape == (4, 64)


def test_compile_error_is_a_result_not_an_exception():
    import triton
    import triton.language as tl

    @triton.jit
    def bad(x, BLOCK: tl.constexpr):
        tl.store(x + tl.arange(0, BLOCK), 1.0)   # BLOCK not a power of two: arange rejects it

    res = ta.compile_launch(ta.Launch("t", bad, (torch.empty(3),), {"BLOCK": 3}), GB10)
    assert not res.ok and res.error and res.registers is None and not res.fits(GB10, 4)


def test_cpython_ast_race_is_retried_other_system_errors_are_results(monkeypatch):
    """CPython 3.11's spurious 'AST constructor recursion depth mismatch' SystemError (a race of
    compile threads) is retried; any other SystemError is the launch's failed result."""
    import triton
    import triton.compiler
    import triton.language as tl

    @triton.jit
    def fill(x, BLOCK: tl.constexpr):
        tl.store(x + tl.arange(0, BLOCK), 1.0)

    real, calls = triton.compiler.compile, []

    def flaky(message):
        def compile_(*args, **kwargs):
            calls.append(message)
            if len(calls) == 1:
                raise SystemError(message)
            return real(*args, **kwargs)
        return compile_

    monkeypatch.setattr(triton.compiler, "compile", flaky(ta.AST_RACE + " (before=135, after=90)"))
    res = ta.compile_launch(ta.Launch("t", fill, (torch.empty(4),), {"BLOCK": 4}), H100)
    assert res.ok and res.registers and len(calls) == 2
    calls.clear()
    monkeypatch.setattr(triton.compiler, "compile", flaky("something else"))
    res = ta.compile_launch(ta.Launch("t", fill, (torch.empty(4),), {"BLOCK": 4}), H100)
    assert not res.ok and res.error == "SystemError: something else" and len(calls) == 1


def test_ast_race_wrapped_in_a_compilation_error_is_retried_and_errors_name_their_cause(monkeypatch):
    """The race hit inside a callee's parse reaches us wrapped in Triton's CompilationError, whose
    message is the caller's source and a caret line (CI failed on `CompilationError: ^` once)."""
    import ast

    import triton
    import triton.compiler
    import triton.language as tl
    from triton.compiler.errors import CompilationError

    @triton.jit
    def fill(x, BLOCK: tl.constexpr):
        tl.store(x + tl.arange(0, BLOCK), 1.0)

    src = "def k():\n    helper()\n"
    node = ast.parse(src).body[0].body[0]
    real, calls = triton.compiler.compile, []

    def wrapped(message, fail_times):
        def compile_(*args, **kwargs):
            calls.append(message)
            if len(calls) <= fail_times:
                try:
                    raise SystemError(message)
                except SystemError as exc:
                    raise CompilationError(src, node, None) from exc
            return real(*args, **kwargs)
        return compile_

    launch = ta.Launch("t", fill, (torch.empty(4),), {"BLOCK": 4})
    monkeypatch.setattr(triton.compiler, "compile", wrapped(ta.AST_RACE + " (before=1, after=2)", 2))
    res = ta.compile_launch(launch, H100)
    assert res.ok and res.registers and len(calls) == 3
    calls.clear()
    monkeypatch.setattr(triton.compiler, "compile", wrapped("an unsupported op", 1))
    res = ta.compile_launch(launch, H100)
    assert not res.ok and len(calls) == 1
    assert res.error == "CompilationError: helper() <- SystemError: an unsupported op", res.error


def test_targets_resolve_and_reject_unknown():
    assert [t.key for t in ta.resolve_targets("gb10,h100-sxm")] == ["gb10", "h100-sxm"]
    assert len(ta.resolve_targets("all")) == len(ta.TARGETS)
    with pytest.raises(ValueError, match="--targets: got 'gb11'; accepted: all or a comma list of h100-sxm"):
        ta.resolve_targets("gb11")
    with pytest.raises(ValueError, match="--cases: got 'nope'; accepted: all or a comma list of ce_rows"):
        ta.check([GB10], only=["nope"])
    assert ta.resolve_cases("all") is None and ta.resolve_cases(" mix_norm,ce_rows ") == ["mix_norm", "ce_rows"]
    with pytest.raises(ValueError, match="--cases"):
        ta.resolve_cases(",")


def _cli(capsys, monkeypatch, *args):
    """`python -m scripts.triton_aot ARGS`, its __main__ block run in this process (a new python
    would spend seconds importing torch and triton): (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["scripts/triton_aot.py", *args])
    capsys.readouterr()
    with warnings.catch_warnings(), pytest.raises(SystemExit) as stop:
        warnings.simplefilter("ignore", RuntimeWarning)   # runpy: the module is imported already
        runpy.run_module("scripts.triton_aot", run_name="__main__")
    out = capsys.readouterr()
    return stop.value.code, out.out, out.err


def test_cli_prints_table_json_and_verdicts(capsys, monkeypatch):
    code, stdout, stderr = _cli(capsys, monkeypatch, "--targets", "gb10", "--cases", "mix_norm,ce_rows", "--json")
    assert code == 0, stderr[-2000:]
    lines = stdout.splitlines()
    rows = [line for line in lines if line.startswith("{")]
    assert len(rows) == 6 and '"target": "gb10"' in rows[0]
    assert any(line.startswith("ok   gb10      _mix_norm_bwd_kernel       2 of 2 launches fit") for line in lines)


def test_cli_bad_flags_name_the_flag(capsys, monkeypatch):
    """Exit 2 with one line naming the flag (script_main), no traceback: any other exception
    would propagate out of _cli instead of SystemExit(2)."""
    for args, flag in ((["--targets", "gb11"], "--targets"), (["--cases", "nope"], "--cases")):
        code, _, stderr = _cli(capsys, monkeypatch, *args)
        assert code == 2 and flag in stderr and "Traceback" not in stderr, stderr


@pytest.mark.cuda
def test_prediction_matches_the_real_compile_on_this_gpu():
    """On a GPU: the cubin the ahead-of-time path builds for this GPU's arch needs the same shared
    memory and registers as the kernel Triton compiles and loads here for the same launch (the
    persistent decode kernel, at d20's width, and a row-wise kernel)."""
    from nanochat.attention import KVCache
    from nanochat.gpt import GPT, GPTConfig
    from nanochat.triton_decode import PersistentDecodeStep
    from nanochat.triton_decode_kernels import decode_step_kernel
    from nanochat.triton_kernels import _mix_norm_fwd_kernel, mix_norm_fwd_triton

    props = torch.cuda.get_device_properties(0)
    here = ta.AotTarget("here", props.major * 10 + props.minor, props.multi_processor_count,
                        props.shared_memory_per_block_optin, props.shared_memory_per_multiprocessor,
                        props.regs_per_multiprocessor, props.max_threads_per_multi_processor)
    cfg = GPTConfig(sequence_len=2048, vocab_size=256, n_layer=2, n_head=10, n_kv_head=10, n_embd=1280)
    model = GPT(cfg, compute_dtype=torch.bfloat16).cuda()
    model.init_weights()
    model = model.to(torch.bfloat16).eval()
    cache = KVCache(1, 10, 2048, 128, 2, torch.device("cuda"), torch.bfloat16)
    ids, pos = torch.zeros(1, 1, dtype=torch.long, device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    with torch.no_grad(), model.inference_weights():
        step = PersistentDecodeStep(model, cache)
        grid, args, kwargs = step.launch_args(ids, pos)
        step.launch(ids, pos)           # compiles, loads and checks residency: step.registers
        torch.cuda.synchronize()
    real = ta.compile_launch(ta.Launch("decode_step", decode_step_kernel, args, kwargs), here)
    loaded = decode_step_kernel.warmup(*args, grid=grid, **kwargs)
    assert real.ok and real.registers == step.registers and real.shared == loaded.metadata.shared, (real, step.registers)

    r = torch.randn(64, 1280, device="cuda", dtype=torch.bfloat16)
    with ta.captured("mix") as launches:
        mix_norm_fwd_triton(r, r, torch.ones(2, device="cuda"), 1e-6)
    got = ta.compile_launch(launches[0], here)
    kernel = _mix_norm_fwd_kernel.warmup(*launches[0].args, grid=(64,), **launches[0].kwargs)
    kernel._init_handles()
    assert got.ok and (got.registers, got.shared) == (kernel.n_regs, kernel.metadata.shared)
