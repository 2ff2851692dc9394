"""Review of the benchmark and profiling scripts (second pass): figures, refusals and CPU runs a
user of a DGX Spark (or of a machine without a GPU) meets. All in-process and CPU-only."""

from __future__ import annotations

import json

import pytest


def _json_rows(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_kernels_model_mode_runs_each_precision_in_its_own_dtype(capsys):
    """--precisions bf16,fp32 on a CPU: bf16 failed ("start the run in bf16", which no flag does)
    because every row ran in the process's one dtype."""
    from scripts import benchmark_kernels as bk
    bk.main(["--device", "cpu", "--mode", "model", "--depth", "1", "--seq", "16", "--device-batch-size", "2",
             "--vocab", "64", "--no-compile", "--reps", "3", "--precisions", "bf16,fp32", "--kernels", "current"])
    rows = [r for r in _json_rows(capsys.readouterr().out) if r.get("mode") == "model"]
    assert [r["precision"] for r in rows] == ["bf16", "fp32"]
    assert all("error" not in r and r["tok_per_sec"] > 0 for r in rows), rows
    assert rows[1]["loss_rel_err"] > 0   # fp32 against the bf16 reference: really another dtype


def test_checkpoint_dir_that_is_a_file_is_refused_naming_the_flag(tmp_path):
    from scripts import bench_checkpoint as bc
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(ValueError, match="--dir: got"):
        bc.parse_args(["--device", "cpu", "--dir", str(f)])


def test_checkpoint_cost_line_uses_unrounded_medians(monkeypatch, tmp_path, capsys):
    """Rounds under 0.5 ms rounded to 0.000 s in the rows: the summary divided by them (ZeroDivisionError
    after the whole run) and, for few-ms rounds, printed a share tens of percent off."""
    from scripts import bench_checkpoint as bc
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    monkeypatch.setattr(bc, "state_dicts", lambda args, device: ({}, {}))

    def fake(save, load):
        def round_(root, *_):
            root.mkdir()
            return save, load
        return round_
    monkeypatch.setattr(bc, "plain_round", fake(0.0004, 0.0004))
    monkeypatch.setattr(bc, "checkpoint_round", fake(0.0006, 0.0010))
    bc.main(["--device", "cpu", "--depth", "1", "--vocab-size", "256", "--reps", "1", "--dir", str(tmp_path / "ck")])
    assert "the sums cost +50% on save and +150% on load" in capsys.readouterr().out


def test_train_error_rows_name_their_precision_backend(capsys):
    from scripts import bench_train
    rows = bench_train.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "2", "--seq", "32", "--steps", "1",
                             "--warmup", "0", "--vocab-size", "256", "--no-compile", "--aspect-ratio", "32",
                             "--head-dim", "32", "--total-batch-size", "64", "--precision", "fp8",
                             "--precision-backend", "te,native"])
    assert [(r["precision_backend"], "error" in r) for r in rows] == [("te", True), ("native", True)]
    table = capsys.readouterr().out.split("-----")[-1]
    assert "fp8/te" in table


def test_gpu_monitor_unreported_throttle_reasons_are_unknown_not_zero():
    """A board that answers [N/A] for the power-cap reason printed "capped 0%" (read as inactive)."""
    from nanochat import gpu_monitor as gm
    s = gm.parse_sample("2400, 3000, 30.5, [N/A], 55, [N/A], Not Active, [N/A]")
    assert s["power_capped"] is None and s["thermal"] is None
    assert gm.parse_sample("2400, 3000, 30, 100, 55, Not Active, [N/A], Active")["thermal"] is True
    out = gm.summarize([s, gm.parse_sample("2400, 3000, 31, 100, 55, Active, Not Active, Not Active")])
    assert out["power_capped_pct"] is None and out["thermal_slowdown_pct"] is None
    assert out["sm_clock_mhz_median"] == 2400.0


def test_train_floor_table_prints_figures_the_board_lacks(monkeypatch, capsys):
    """None in the GPU summary (power [N/A]) raised TypeError in the table after the whole run."""
    from scripts import bench_train_floor as bf
    gpu = {"samples": 5, "sm_clock_mhz_median": 2400.0, "power_w_median": None, "power_capped_pct": None}
    monkeypatch.setattr(bf, "measure", lambda floor, part, *a: {"part": part, "micro_batches": 3, "ms_median": 2.0,
                                                                "ms_min": 1.5, "tok_per_s_floor": 32000, "gpu": gpu})
    rows = bf.main(["--device", "cpu", "--depth", "1", "--device-batch-size", "1", "--seq", "64",
                    "--vocab-size", "256", "--seconds", "0", "--warmup", "0"])
    line = capsys.readouterr().out.splitlines()[-1].split()
    assert rows[0]["gpu"]["power_w_median"] is None
    assert line[0] == "both" and line[-3:] == ["2400.0", "-", "-"]


def test_profile_training_cpu_run_times_its_phase_split_and_step():
    """Off CUDA timed_steps returned {}: the CPU run printed no phase, no step time, no tok/s."""
    from nanochat.common import init_runtime
    from scripts import profile_training as PT
    args = PT.parse_args(["--device", "cpu", "--depth", "1", "--device-batch-size", "1", "--seq", "16", "--vocab", "64",
                          "--no-compile", "--steps", "2", "--warmup", "0"])
    rt = init_runtime("cpu", "fp32")
    model, run, optimizer, _ = PT.build(args, rt)
    out = PT.timed_steps(args, rt, model, run, optimizer)
    assert list(out["phases"]) == ["data", "forward", "backward", "optimizer"]
    assert all(ms > 0 for ms in out["phases"].values())
    assert out["step_ms"] >= max(out["phases"].values())


@pytest.mark.parametrize("argv", [["--", "--eval-every", "50"], ["--", "--wandb=online"],
                                  ["--runs", "v1", "v2 --save_every 10"], ["--", "--sample-every", "5"]])
def test_compare_recipes_refuses_flags_it_overrides(argv):
    """run_argv appends --eval-every/--sample-every/--save-every/--wandb after the user's flags: the
    user's value was silently replaced."""
    from scripts import compare_recipes
    with pytest.raises(ValueError, match="set by compare_recipes itself"):
        compare_recipes.parse_args(argv)


def test_dataloader_bin_dir_that_is_a_file_is_refused(tmp_path):
    from scripts import profile_dataloader as P
    f = tmp_path / "shards"
    f.write_text("x")
    with pytest.raises(ValueError, match="--bin-dir: got"):
        P.parse_args(["--bin-dir", str(f)])
    assert P.parse_args(["--bin-dir", str(tmp_path / "new")]).bin_dir == tmp_path / "new"


def test_attention_configs_with_one_name_twice_are_refused():
    """Two --configs entries of the same "name": the first was silently dropped from the sweep."""
    from scripts import bench_attention as BA
    with pytest.raises(ValueError, match="--configs: got the name 'x' twice"):
        BA.parse_args(["--configs", '[{"name": "x", "fwd_BLOCK_M": 64}, {"name": "x", "fwd_BLOCK_M": 128}]'])
    assert list(BA.parse_args(["--configs", '[{"fwd_BLOCK_M": 64}, {"fwd_BLOCK_M": 128}]']).sweep) == ["cfg0", "cfg1"]


def test_optim_and_floor_wall_clocks_wait_for_queued_mps_work(monkeypatch):
    """--device mps: the wall clock around optimizer.step() / a floor micro-batch was read without a
    synchronisation, so it timed the launches (benchmark_kernels and profile_training wait)."""
    from types import SimpleNamespace as NS

    import torch

    from scripts import bench_optim, bench_train_floor
    log = []
    rt = NS(device=NS(type="mps"), synchronize=lambda: log.append("sync"))
    assert len(bench_optim.timed(rt, NS(step=lambda: log.append("step")), 2)) == 2
    assert log == ["sync", "step", "sync"] * 2
    log.clear()
    monkeypatch.setattr(torch.mps, "synchronize", lambda: log.append("sync"))
    row = bench_train_floor.measure(NS(run=lambda part: log.append(part), M=64), "gemm", 0, 0.0, torch.device("mps"))
    assert log == ["sync", "gemm", "sync"] and row["micro_batches"] == 1
