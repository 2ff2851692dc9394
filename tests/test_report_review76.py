"""Review 76 of report.md as a user reads it after ./setup.sh (each test failed before its fix): a stage
nothing was logged of, the code changing after `reset`, RL's policy loss drawn on the cross-entropy
axes and plot axes without units, which model tag's run the time table shows, and a '|' in a
summary value's note."""

import pytest
from test_report_audit import clock, stage_section, table, train, whole_pipeline  # noqa: F401  (fixtures)

from nanochat import report as report_mod
from nanochat import report_env, report_plots
from nanochat.report import get_report, log_metrics


def test_stages_nothing_was_logged_of_are_named_not_left_blank(clock):  # noqa: F811
    rep = get_report()
    rep.reset()
    train(clock, "base", 20)
    stage_section(clock, "Base model training", "base", 20, 40.0)
    rep.log("Base model evaluation", {"stage": "base", "model_tag": "d4", "step": 20, "seconds": 5.0, "val_bpb": 1.3})
    text = rep.generate().read_text()
    summary = table(text, "| Metric |")
    assert all(cells[1:] == ["-", "-", "-"] for cells in summary.values())   # blank columns ...
    # ... and a line that says why, between the summary and the time table
    line = next(ln for ln in text.splitlines() if "nothing logged" in ln.lower())
    assert line.startswith("- Nothing logged of MID, SFT (no section"), line   # RL: optional, not named
    assert text.index("| Metric |") < text.index(line) < text.index("## Time and cost")


def test_a_whole_pipeline_names_no_stage_as_missing(clock):  # noqa: F811
    text = whole_pipeline(clock).generate().read_text()
    assert "nothing logged" not in text.lower()


def _header(monkeypatch, **git):
    monkeypatch.setattr(report_mod, "system_info", lambda: {"device": "cpu", **git})
    get_report().reset()


def test_the_environment_says_when_the_commit_changed_after_reset(clock, monkeypatch):  # noqa: F811
    _header(monkeypatch, git_sha="a" * 40, git_dirty=False)
    monkeypatch.setattr(report_env, "git_sha", lambda repo=None: "b" * 40 + "+dirty")   # a `git pull` since
    text = get_report().generate().read_text()
    env = text[text.index("## Environment"):text.index("## Summary")]
    assert f"- git_sha: {'a' * 40}" in env   # what `reset` recorded stays
    line = next(ln for ln in env.splitlines() if "b" * 40 in ln)
    assert "not the commit" in line and "uncommitted changes" in line, line


def test_the_environment_says_when_files_were_modified_after_a_clean_reset(clock, monkeypatch):  # noqa: F811
    _header(monkeypatch, git_sha="a" * 40, git_dirty=False)
    monkeypatch.setattr(report_env, "git_sha", lambda repo=None: "a" * 40 + "+dirty")
    env = get_report().generate().read_text().split("## Summary")[0]
    assert "modified since `reset`" in env, env


@pytest.mark.parametrize("now", ["a" * 40, "a" * 40 + "+dirty", None])
def test_the_environment_adds_nothing_when_the_code_is_what_reset_recorded(clock, monkeypatch, now):  # noqa: F811
    # the same commit (dirty already at reset: its changes were recorded), or no git to ask
    _header(monkeypatch, git_sha="a" * 40, git_dirty=now is not None and now.endswith("+dirty"))
    monkeypatch.setattr(report_env, "git_sha", lambda repo=None: now)
    env = get_report().generate().read_text().split("## Summary")[0]
    assert "git now" not in env, env


class _Axes:
    def __init__(self, drawn):
        self.drawn = drawn

    def plot(self, xs, ys, label, marker=None):
        self.drawn["lines"].append(label)

    def set(self, **kw):
        self.drawn.update(kw)

    def grid(self, **kw):
        pass

    def legend(self):
        pass


def _fake_agg(figures):
    """matplotlib's Figure and canvas as report_plots uses them, recording what each plot drew."""
    class Figure:
        def __init__(self, **kw):
            self.drawn = {"lines": []}
            figures.append(self.drawn)

        def add_subplot(self, *a):
            return _Axes(self.drawn)

        def tight_layout(self):
            pass

        def savefig(self, f, format):
            f.write(b"png")

    return lambda: (Figure, lambda fig: None)


def test_rl_policy_loss_is_not_drawn_on_the_cross_entropy_axes_and_axes_carry_units(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(report_plots, "_agg", _fake_agg(figures))
    base = [{"step": s, "loss": 3.0 - s / 10, "val_bpb": 1.2, "tok_per_sec": 1e5, "peak_mem_gib": 4.0,
             "elapsed_s": 2.0 * s} for s in range(5)]
    rl = [{"step": s, "loss": -0.02 * s, "reward": 0.1 * s, "tok_per_sec": 2e3, "elapsed_s": 9.0 * s} for s in range(5)]
    made = report_plots.make_plots({"base": base, "rl": rl}, tmp_path)
    by_title = {title: drawn for (title, _), drawn in zip(made, figures)}
    loss = [d for t, d in by_title.items() if t.startswith("training loss")]
    assert len(loss) == 2 and all(d["lines"] == ["base"] for d in loss), loss   # rl's policy loss was a 2nd line
    reward = [d for t, d in by_title.items() if "reward" in t]
    assert len(reward) == 1 and reward[0]["lines"] == ["rl"] and reward[0]["xlabel"] == "step"
    ylabel = {title: d["ylabel"] for title, d in by_title.items()}
    assert "GiB" in ylabel["peak memory (GiB)"] and "tokens/s" in ylabel["throughput (tokens/s)"], ylabel
    assert all("bits per byte" in y for t, y in ylabel.items() if t.startswith("validation")), ylabel
    assert all(d["xlabel"] == "step" or "min" in d["xlabel"] for d in figures)


def test_the_note_on_left_out_rows_names_the_model_tag_shown(clock):  # noqa: F811
    rep = get_report()
    rep.reset()
    for tag, steps in (("d12", 6), ("d20", 4)):
        for s in range(steps):
            clock[0] += 1
            log_metrics("base", {"step": s, "loss": 2.0, "elapsed_s": float(s + 1), "model_tag": tag})
        stage_section(clock, "Base model training", "base", steps, float(steps), {"model_tag": tag})
    text = rep.generate().read_text()
    assert table(text, "| Stage |")["base"] == ["4", "0:00:04"]   # d20's run, as the summary's
    note = next(ln for ln in text.splitlines() if ln.startswith("- base: 6 metrics rows"))
    assert "model tag d20" in note, note


def test_a_pipe_in_a_summary_values_note_does_not_split_the_table(clock):  # noqa: F811
    rep = get_report()
    rep.reset()
    rep.log("Chat evaluation sft", {"stage": "sft", "model_tag": "d4", "step": 3, "temperature": 0.0,
                                    "GSM8K": 0.5, "GSM8K scored as": "pass@2|maj"})
    text = rep.generate().read_text()
    row = next(ln for ln in text.splitlines() if ln.startswith("| GSM8K |"))
    assert row.replace("\\|", "").count("|") == 6, row   # 5 cells, the note's "|" escaped


def test_a_setup_pipeline_without_rl_names_no_stage_as_missing(clock):  # noqa: F811
    """RL is optional (no setup.sh stage): every complete setup.sh report said "RL: nothing logged ...
    stopped before its first step", a failure that never happened (review of session 76)."""
    rep = get_report()
    rep.reset()
    for stage, title in (("base", "Base model training"), ("mid", "Midtraining"), ("sft", "Chat SFT")):
        train(clock, stage, 8)
        stage_section(clock, title, stage, 8, 30.0)
    text = rep.generate().read_text()
    assert "nothing logged" not in text.lower(), text
