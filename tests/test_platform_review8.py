"""Review 8 of the hardware layer as a demanding GB10 (DGX Spark) user, on simulated device
properties (no GPU): an unreadable /proc/meminfo, a user's TRITON_PTXAS_PATH that cannot serve
sm_121, and the preflight report on a machine with GPUs of different kinds. Each test failed before
its fix."""

import json
import stat
import types

import pytest
import torch

from nanochat import memory_limits
from nanochat import platform as P
from nanochat import preflight
from nanochat.platform import PatchContext, PtxasMissing, SimpleProps, apply_patches, detect_device

GB = 10**9
GB10 = SimpleProps("NVIDIA GB10", 12, 1, 48, 128 * GB, is_integrated=True)
RTX5090 = SimpleProps("NVIDIA GeForce RTX 5090", 12, 0, 170, 32 * GB)
PRO6000 = SimpleProps("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", 12, 0, 188, 96 * GB)
CUDA13 = [("/usr/local/cuda-13.0/bin/ptxas", (13, 0))]


def ctx(env, triton="3.5.1", bundled=(12, 8), candidates=CUDA13, probe=None):
    checked = {} if probe is None else {"ptxas_version_of": probe}
    return PatchContext(env=env, dynamo_config=types.SimpleNamespace(capture_scalar_outputs=False),
                        inductor_config=types.SimpleNamespace(max_autotune_gemm=False),
                        inductor_modules=[types.SimpleNamespace(is_big_gpu=lambda *_: False)],
                        triton_version=triton, bundled_ptxas_version=bundled, ptxas_candidates=list(candidates),
                        torch_version="2.10.0", **checked)


@pytest.fixture
def simulated(monkeypatch):
    """preflight_report as on a simulated GPU (CUDA calls answered; the real memory budget)."""
    def use(props, gpus=(), triton="3.6.0", bundled=(13, 0)):
        device = detect_device(props=props)
        monkeypatch.setattr(preflight, "configure_env_before_cuda", lambda: None)
        monkeypatch.setattr(preflight, "detect_device", lambda: device)
        monkeypatch.setattr(preflight, "apply_patches",
                            lambda s, **kw: apply_patches(s, ctx=ctx({}, triton, bundled), **kw))
        monkeypatch.setattr(preflight, "probe_attention_backends", lambda: {"sdpa-cudnn": "ok"})
        monkeypatch.setattr(preflight, "triton_ptxas_in_use", lambda s: "simulated")
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_120"])
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus) or 1)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpus[i])
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (64 * GB, 96 * GB))
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
        return device
    return use


# ------------------------------------------------------------------ memory budget: /proc/meminfo

def test_unreadable_meminfo_is_named_and_the_report_still_prints(simulated, monkeypatch, tmp_path, capsys):
    """On unified memory the budget reads /proc/meminfo; a missing one (a sandbox without /proc) was
    a bare FileNotFoundError, and it and a meminfo without MemAvailable ended the preflight report
    with a traceback. Now a RuntimeError names the file, and the report shows it in its row."""
    gb10 = detect_device(props=GB10)
    monkeypatch.setattr(memory_limits, "MEMINFO", str(tmp_path / "meminfo"))   # where the budget reads it
    with pytest.raises(RuntimeError, match=r"meminfo: cannot be read .*MemAvailable"):
        P.memory_budget_bytes(gb10)
    simulated(GB10)
    assert preflight.main(["--json"]) == 0      # a report row, not a verdict on the run's flags
    row = json.loads(capsys.readouterr().out)["memory_budget_gb"]
    assert row.startswith("unavailable: ") and "meminfo: cannot be read" in row
    (tmp_path / "meminfo").write_text("MemTotal:  131072000 kB\nMemFree:  1000 kB\n")
    assert preflight.main(["--json"]) == 0
    row = json.loads(capsys.readouterr().out)["memory_budget_gb"]
    assert row.startswith("unavailable: ") and "no 'MemAvailable: <n> kB' line" in row
    (tmp_path / "meminfo").write_text("MemTotal:  131072000 kB\nMemAvailable:  100000000 kB\n")
    assert preflight.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["memory_budget_gb"] == round(100000000 * 1024 * 0.9 / 1e9, 1)


# ------------------------------------------------------------------ a user's ptxas (DESIGN s4.1)

def fake_ptxas(path, release):
    path.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_user_ptxas_that_cannot_serve_sm121_is_refused_not_logged_as_used(tmp_path):
    """GB10 + Triton 3.5: a TRITON_PTXAS_PATH with a typo, or at the CUDA 12.8 toolkit, was logged
    'using TRITON_PTXAS_PATH=... as set' while Triton skipped it (or ran it) and met the same
    'sm_121a is not defined' error in ptxas. The user's value is still never replaced, but now a
    value that does not run or is too old stops the run naming the variable (a warning in
    apply_runtime_patches); a good one is kept as before."""
    probe = P.ptxas_version   # the real `ptxas --version` reader, on scripts that print like ptxas
    env = {"TRITON_PTXAS_PATH": str(tmp_path / "no-such-ptxas")}
    with pytest.raises(PtxasMissing, match=r"^TRITON_PTXAS_PATH=.*no-such-ptxas does not run"):
        P.patch_ptxas(detect_device(props=GB10), ctx(env, probe=probe), uses_triton=True)
    assert env == {"TRITON_PTXAS_PATH": str(tmp_path / "no-such-ptxas")}     # kept, not clobbered
    old = fake_ptxas(tmp_path / "ptxas-12.8", "12.8")
    env = {"TRITON_PTXAS_BLACKWELL_PATH": old}
    with pytest.raises(PtxasMissing, match=r"BLACKWELL_PATH=.* is CUDA 12\.8's ptxas, older than the 12\.9"):
        P.patch_ptxas(detect_device(props=GB10), ctx(env, probe=probe), uses_triton=True)
    assert env == {"TRITON_PTXAS_BLACKWELL_PATH": old}
    # the runtime set (every CUDA process): a warning, the other patches still apply
    names = P.apply_runtime_patches(detect_device(props=GB10), ctx=ctx(dict(env), probe=probe))
    assert "ptxas" not in " ".join(names) and "is_big_gpu" in names
    good = fake_ptxas(tmp_path / "ptxas-13.0", "13.0")
    env = {"TRITON_PTXAS_PATH": good}
    assert P.patch_ptxas(detect_device(props=GB10), ctx(env, probe=probe), uses_triton=True) == "ptxas(user)"
    assert env["TRITON_PTXAS_PATH"] == env["TRITON_PTXAS_BLACKWELL_PATH"] == good
    # sm_120 (RTX 5090) with Triton 3.2 needs only 12.8: that user ptxas is fine there
    env = {"TRITON_PTXAS_PATH": old}
    assert P.patch_ptxas(detect_device(props=RTX5090), ctx(env, triton="3.2.0", bundled=(12, 4), probe=probe),
                         uses_triton=True) == "ptxas(user)"


def test_the_real_patch_context_checks_a_user_ptxas():
    """The check runs in real processes (the contexts above inject it)."""
    spec = detect_device(props=GB10)
    real = PatchContext.real(spec)
    assert (real.ptxas_version_of is P.ptxas_version) == (real.triton_version is not None)


# ------------------------------------------------------------------ several GPUs of different kinds

def test_preflight_lists_every_gpu_and_says_when_their_kinds_differ(simulated, capsys):
    """A workstation with an RTX 5090 and an RTX PRO 6000: the report described GPU 0 alone, while a
    torchrun launch over both trains on the second too (other SMs and peaks; MFU then divides by the
    sum of both). Now a `gpus` row lists each; one GPU gets no such row, and equal ones no note."""
    simulated(RTX5090, gpus=[RTX5090, PRO6000])
    assert preflight.main(["--json"]) == 0
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert gpus[0] == "0: NVIDIA GeForce RTX 5090 (cc 12.0, 170 SMs, rtx-5090)"
    assert gpus[1] == "1: NVIDIA RTX PRO 6000 Blackwell Workstation Edition (cc 12.0, 188 SMs, rtx-pro-6000)"
    assert gpus[2].startswith("GPUs of different kinds")
    simulated(PRO6000, gpus=[PRO6000, PRO6000])
    assert preflight.main(["--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["gpus"]) == 2
    simulated(GB10)
    assert preflight.main(["--json"]) == 0
    assert "gpus" not in json.loads(capsys.readouterr().out)


def test_only_the_ptxas_name_this_triton_reads_is_checked(tmp_path):
    """Triton 3.6+ reads TRITON_PTXAS_BLACKWELL_PATH on sm_121: a stale TRITON_PTXAS_PATH next to a
    good Blackwell one stopped a run that would have worked; a ptxas that runs but prints no
    release is a warning, not a refusal."""
    probe = P.ptxas_version
    good = fake_ptxas(tmp_path / "ptxas-13.0", "13.0")
    env = {"TRITON_PTXAS_PATH": str(tmp_path / "stale"), "TRITON_PTXAS_BLACKWELL_PATH": good}
    assert P.patch_ptxas(detect_device(props=GB10), ctx(env, triton="3.6.0", probe=probe),
                         uses_triton=True) == "ptxas(user)"
    odd = tmp_path / "wrapper"
    odd.write_text("#!/bin/sh\necho 'a wrapper'\n")
    odd.chmod(0o755)
    env = {"TRITON_PTXAS_BLACKWELL_PATH": str(odd)}
    assert P.patch_ptxas(detect_device(props=GB10), ctx(env, triton="3.6.0", probe=probe),
                         uses_triton=True) == "ptxas(user)"
