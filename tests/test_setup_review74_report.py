"""Review 74 of report.md against the logs of an interrupted, rerun pipeline (each test failed before its fix).

Seen in a real tiny run: mid_train stopped by Ctrl-C at step 27, rerun by setup.sh, resumed bit-exact
to its step 40; setup.sh then reran chat_sft (mid had run), whose --resume auto found its finished step
40 of the same mid weights: no step trained, no metrics row, only its section. The summary took that
section as current, but the time table said "sft (stale) ... of an older model; rerun them" and left
SFT's 43 s out of the total.
"""

from test_report_audit import clock, stage_section, table, train, whole_pipeline  # noqa: F401  (fixtures)


def test_a_resumed_run_that_trained_no_step_after_its_source_retrained_is_current(clock):  # noqa: F811
    rep = whole_pipeline(clock)
    clock[0] += 100
    train(clock, "mid", 20, dt=3.0, stop=14)                   # interrupted ...
    train(clock, "mid", 20, dt=3.0, start=10, elapsed0=30.0)   # ... resumed from its step-10 checkpoint
    stage_section(clock, "Midtraining", "mid", 20, 63.0)
    stage_section(clock, "Chat SFT", "sft", 12, 13.0)          # resumed at its last step: a section only
    text = rep.generate().read_text()
    times = table(text, "| Stage |")
    assert "sft" in times and "sft (stale)" not in times, times
    assert times["sft"] == ["12", "0:00:13"]
    assert "rl (stale)" in times   # RL, run on the mid before, stays stale (its own section is older)
    # the total: tokenizer 62.3 + base 102 + base eval 25 + mid 63 + SFT 13 s (the chat evaluation, logged
    # before mid's rerun, stays out: setup.sh reruns it after SFT)
    assert times["total"] == ["", "0:04:25"], times
    assert "| sft (stale) |" not in text and "(stale)" not in table(text, "| Metric |")["tokens trained"][2]
