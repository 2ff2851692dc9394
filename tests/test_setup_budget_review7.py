"""setup.sh's device-batch budget by what the GPU is, not only by --preset: a discrete GPU under
--preset spark is held to its own memory (3/4 of the host's sized a 24 GB card's batch), and a GPU
whose memory nvidia-smi cannot report (a unified-memory part) under --preset h100 is budgeted from
the host's memory (it kept the preset's batch of 32)."""

import pytest

from tests.test_setup import GB10_SMI, _dry_run

RTX = ("NVIDIA GeForce RTX 4090", "8.9")


def _base_train(tmp_path, **kw):
    return _dry_run(tmp_path, "13.0", args=kw.pop("args"), **kw)


def test_spark_preset_on_a_24gb_card_fits_the_card(tmp_path):
    rc, out = _base_train(tmp_path, gpu=RTX, mem_mib=24564, mem_total_gib=128,
                          args=("--only", "base_train", "--preset", "spark", "--depth", "20"))
    assert rc == 0, out
    assert "in the NVIDIA GeForce RTX 4090's 23 GiB" in out and "--device-batch-size 4 " in out, out


def test_spark_preset_on_a_big_card_with_little_host_memory_fits_the_host(tmp_path):
    rc, out = _base_train(tmp_path, gpu=("NVIDIA H100 80GB HBM3", "9.0"), mem_mib=81559, mem_total_gib=32,
                          args=("--only", "base_train", "--preset", "spark", "--depth", "20"))
    assert rc == 0 and "3/4 of the host's 32 GiB" in out and "--device-batch-size 4 " in out, out


def test_h100_preset_without_a_memory_figure_budgets_the_host(tmp_path):
    rc, out = _base_train(tmp_path, gpu=("NVIDIA Thor", "11.0"), mem_mib="[N/A]", mem_total_gib=40,
                          args=("--only", "base_train", "--preset", "h100", "--depth", "20"))
    assert rc == 0 and "3/4 of the 40 GiB of unified memory" in out and "(not 32)" in out, out


@pytest.mark.parametrize("mem_mib", ["[N/A]", "131072"])
def test_a_gb10_is_unified_whatever_nvidia_smi_says(tmp_path, mem_mib):
    rc, out = _base_train(tmp_path, gpu=GB10_SMI, mem_mib=mem_mib, mem_total_gib=122,
                          args=("--only", "base_train", "--preset", "spark", "--depth", "20"))
    assert rc == 0 and "--device-batch-size 16 " in out and "'s 128 GiB" not in out, out
