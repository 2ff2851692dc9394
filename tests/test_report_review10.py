"""Review 10 of the report, read as a user after several runs in one base dir: every --model-tag of a
stage appends to the same metrics_<stage>.jsonl, so a resume of tag a after a run of tag b drew b's
first steps joined to a's later ones (and the time table took their mix); a rerun that timed no step
showed the previous run's tok/s "(stale)" next to its own tokens; the environment said
"1 x NVIDIA GB10" without the compute capability, Triton version or that its memory is the host's."""

import json
import types

import pytest
import torch

from nanochat import report as report_mod
from nanochat.loop import LoopSpec, run_training_loop
from nanochat.report import Report, current_run, read_metrics, report_dir


@pytest.fixture()
def base(tmp_path, monkeypatch):
    """A base dir with a header (no system probe) and no plots; single process."""
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path))
    for var in ("RANK", "NANOCHAT_REPORT_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(report_mod, "make_plots", lambda metrics, out_dir: [])
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "header.json").write_text(json.dumps({"system": {"device": "cpu"}}))
    return tmp_path


class _Trainer:
    """Steps with a loss of step + 100 (tag b: + 200), so each row says which run logged it."""

    model = None   # no weights to check before a save

    def __init__(self, offset):
        self.offset = offset

    def step(self, step):
        return types.SimpleNamespace(loss=float(step + self.offset), extra=None, lrm=1.0)

    def loop_state(self, step, meter, **kw):
        return {"step": step, **kw}

    def note_checkpoint(self, path):
        pass


_METER = types.SimpleNamespace(update=lambda r: {"smooth_loss": r.loss, "tok_per_sec": 1.0, "mfu": None,
                                                 "peak_mem_gib": 0.5},
                               log_line=lambda metrics, n: "step")


def _run(tmp_path, tag, offset, n, saves, **resume):
    def save(step, state):
        saves[(tag, step)] = state
        return tmp_path / f"{tag}_{step:06d}"
    spec = LoopSpec("base", num_iterations=n, eval_every=3, save_every=3, evaluate=lambda s: {"val_bpb": 1.0},
                    save=save, model_tag=tag)
    run_training_loop(_Trainer(offset), _METER, spec, **resume)


def test_a_resume_of_one_tag_after_another_tags_run_shows_only_its_own_rows(base, tmp_path, capsys):
    saves = {}
    _run(tmp_path, "a", 100, 6, saves)                  # stands for a run stopped after its save at step 3
    _run(tmp_path, "b", 200, 4, saves)                  # another tag, trained in the same base dir
    _run(tmp_path, "a", 100, 6, saves, start_step=3, resume_state=saves[("a", 3)])   # a resumed at step 3
    rows = read_metrics(base)["base"]
    assert {r.get("model_tag") for r in rows} == {"a", "b"}   # each row says its tag
    kept, left_out = current_run(rows)
    assert all(r["model_tag"] == "a" for r in kept) and left_out == 4 + 7   # a's redone steps 3-6, b's 7 rows
    # a's steps 0-2 from its first process, 3-5 from the resumed one; none of b's (loss 200+)
    assert [r["loss"] for r in kept if "loss" in r] == [100.0 + s for s in range(6)]
    assert [r["step"] for r in kept if "val_bpb" in r] == [0, 3, 6]
    text = Report(report_dir(base)).generate().read_text()
    assert "| base (unfinished) | 6 |" in text   # no training section logged by this fake run
    assert "11 metrics rows of an earlier run of the stage (of another --model-tag" in text


def test_the_current_run_is_the_last_rows_tag_and_untagged_rows_go_by_steps():
    a = [{"step": s, "loss": 1.0, "model_tag": "a"} for s in range(4)]
    b = [{"step": s, "loss": 2.0, "model_tag": "b"} for s in range(2)]
    resumed = [{"step": s, "loss": 3.0, "model_tag": "a"} for s in (2, 3)]
    kept, left_out = current_run(a + b + resumed)
    assert kept == a[:2] + resumed and left_out == 4   # by steps alone: b's two rows, then a's resumed ones
    # files written before the rows carried a tag: as before, by steps alone
    rows = [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 1.0}, {"step": 0, "loss": 2.0, "model_tag": "x"}]
    kept, left_out = current_run(rows)
    assert kept == [rows[2]] and left_out == 2


def _train(report, tag, tok_s, tokens):
    report.log("Base model training", {"stage": "base", "model_tag": tag, "final_step": tokens // 512,
                                       "final_val_bpb": 1.5, "avg_tok_per_sec": tok_s, "avg_mfu": None,
                                       "tokens_trained": tokens})


def test_a_rerun_that_timed_no_step_does_not_show_the_old_runs_throughput(base, monkeypatch):
    now = [1_800_000_000.0]
    monkeypatch.setattr(report_mod, "time", types.SimpleNamespace(time=lambda: now[0]))
    report = Report(report_dir(base))
    _train(report, "a", 287.0, 6144)
    now[0] += 60
    _train(report, "b", None, 4096)   # 8 steps: the first 10 of a process are not timed
    cells = report.summary_cells()
    assert cells["tokens trained"]["base"] == (4096.0, [])
    assert "base" not in cells["tok/s (average)"]   # was (287.0, ["stale"]): run a's, not b's
    text = report.generate().read_text()
    assert "| tok/s (average) | - |" in text and "(values of 2 checkpoints)" not in text
    # an evaluation's value of an older model is still shown, marked stale (rerun the evaluation)
    report.log("Base model evaluation", {"stage": "base", "model_tag": "a", "step": 12, "val_bpb": 1.2})
    now[0] += 60
    _train(report, "b", 300.0, 4096)
    cells = report.summary_cells()
    assert cells["val bpb"]["base"] == (1.2, ["stale"]) and cells["tok/s (average)"]["base"] == (300.0, [])


def test_the_environment_of_a_simulated_gb10_names_capability_and_unified_memory(monkeypatch):
    from nanochat import report_env

    gb10 = types.SimpleNamespace(name="NVIDIA GB10", major=12, minor=1, total_memory=128 * 10**9, is_integrated=True)
    h100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85 * 10**9,
                                 is_integrated=False)
    gpus = [gb10]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i].name)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    info = report_env.system_info()
    assert info["device"] == "1 x NVIDIA GB10 (cc 12.1)" and info["cuda"] == "13.0"
    assert info["gpu_memory_gib"] == 119.2 and info["unified_memory"].startswith("yes")
    assert info["git_sha"] and info["torch"] == torch.__version__
    gpus[:] = [h100, h100, gb10]   # a mixed box: "3 x" the first GPU's name was wrong for one of them
    info = report_env.system_info()
    assert info["device"] == "2 x NVIDIA H100 80GB HBM3 (cc 9.0), 1 x NVIDIA GB10 (cc 12.1)"
    assert "unified_memory" not in info
