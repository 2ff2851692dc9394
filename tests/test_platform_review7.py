"""platform._spec_from_nvidia_smi names the GPU CUDA will call device 0: the first entry of
CUDA_VISIBLE_DEVICES, not nvidia-smi's GPU 0 (a stand-in nvidia-smi on PATH answers per -i)."""

import os

import pytest

from nanochat import platform as P

FAKE_SMI = """#!/bin/sh
# a two-GPU box: index 0 an H100, index 1 (uuid GPU-b1) a GB10
while [ $# -gt 0 ]; do
  case "$1" in -i) shift; id="$1";; esac
  shift
done
case "$id" in
  0|GPU-a0) echo "NVIDIA H100 80GB HBM3, 9.0";;
  1|GPU-b1) echo "NVIDIA GB10, 12.1";;
  *) echo "No devices were found" >&2; exit 6;;
esac
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    path = tmp_path / "nvidia-smi"
    path.write_text(FAKE_SMI)
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("visible, key", [(None, "h100-sxm"), ("1", "gb10"), ("1,0", "gb10"), ("GPU-b1", "gb10"),
                                          ("0,1", "h100-sxm"), (" 1 ", "gb10")])
def test_visible_devices_pick_the_gpu(fake_smi, visible, key):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    spec = P._spec_from_nvidia_smi(env)
    assert spec is not None and spec.key == key


@pytest.mark.parametrize("visible", ["", "-1", "none", "7"])
def test_no_visible_gpu_gives_none(fake_smi, visible):
    # "" / "-1" / an invalid first entry hide every GPU; "7" names one the box does not have
    assert P._spec_from_nvidia_smi({"CUDA_VISIBLE_DEVICES": visible}) is None


def test_env_before_cuda_follows_visible_devices(fake_smi, monkeypatch):
    # the sm_121 warning filter is GB10's: set for a run on GPU 1, not for one on GPU 0
    def filters(visible):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        calls = []
        P.configure_env_before_cuda(env={}, filter_warning=lambda *a, **k: calls.append(a), torch_version="2.9.0")
        return len(calls)

    assert filters("0") == 0 and filters("1") == 1
