"""scripts/compare_logs.py: parses the recipes' step/val lines and flags diverging runs."""

from scripts.compare_logs import main, parse_log

FULL = """banner
step 00009/00020 | loss 9.5000 | lrm 1.000 | dt    100.0ms | tok/s      10,000 | mfu   n/a | util(bf16)   n/a | mem   1.00GiB
step 00010 | val bpb 2.5000 (min 2.5000)
step 00010/00020 | loss 9.0000 | lrm 1.000 | dt    100.0ms | tok/s      10,000 | mfu   n/a | util(bf16)   n/a | mem   1.00GiB
step 00011/00020 | loss 8.5000 | lrm 1.000 | dt    100.0ms | tok/s      10,000 | mfu 40.00% | util(bf16) 40.00% | mem   1.00GiB
step 00020 | val bpb 2.0000 (min 2.0000)
"""


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_parse_reads_losses_and_val_bpb(tmp_path):
    got = parse_log(_write(tmp_path, "a.log", FULL))
    assert got["loss"] == {9: 9.5, 10: 9.0, 11: 8.5}
    assert got["val_bpb"] == {10: 2.5, 20: 2.0}


def test_identical_from_step_passes_and_divergence_fails(tmp_path, capsys):
    a = _write(tmp_path, "a.log", FULL)
    # the resumed run starts at step 11: earlier steps differ (they were never run) and are ignored
    resumed = FULL.replace("loss 9.5000", "loss 1.0000").replace("loss 9.0000", "loss 1.0000")
    b = _write(tmp_path, "b.log", resumed)
    assert main([str(a), str(b), "--from-step", "11"]) == 0
    assert "2 values compared, 2 identical" in capsys.readouterr().out
    assert main([str(a), str(b)]) == 1
    c = _write(tmp_path, "c.log", FULL.replace("val bpb 2.0000", "val bpb 2.0100"))
    assert main([str(a), str(c), "--from-step", "11"]) == 1
    assert main([str(a), str(c), "--from-step", "11", "--tol", "0.02"]) == 0


def test_no_common_step_fails(tmp_path):
    a = _write(tmp_path, "a.log", FULL)
    b = _write(tmp_path, "b.log", "nothing here\n")
    assert main([str(a), str(b)]) == 1


def test_a_non_finite_value_fails_and_odd_lines_are_skipped(tmp_path, capsys):
    """A NaN loss or val bpb in either log is a failure at any --tol (max() skipped NaNs: a diverged
    run passed), and a line whose number is not one ("loss -") is not a number: skipped, no crash."""
    a = _write(tmp_path, "a.log", FULL)
    for bad in (FULL.replace("loss 8.5000", "loss nan"), FULL.replace("val bpb 2.0000", "val bpb nan"),
                FULL.replace("loss 8.5000", "loss inf")):
        assert main([str(a), str(_write(tmp_path, "b.log", bad)), "--tol", "100"]) == 1
        assert "FAIL" in capsys.readouterr().out
    odd = _write(tmp_path, "odd.log", "step 00012/00020 | loss - | x\nstep 00013/00020 | loss e | x\n" + FULL)
    assert parse_log(odd)["loss"] == {9: 9.5, 10: 9.0, 11: 8.5}
