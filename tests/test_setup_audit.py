"""setup.sh defects found by the set-up / launch audit (session 52), each test failing on the code
before its fix: a base dir spelled another way ("dir/") reran every stage; a model stage that
started (then failed, was stopped, or ran under --only) left the later stages' done-markers saying
"done" on results of the model it replaced; the printed commands lost the quoting of a path with a
space; a malformed --conversations file or an identity name Python calls unprintable failed only
when mid_train started, after base training; an activated .venv passed for another interpreter and
redid the env stage; no C compiler surfaced as a Rust link error after the torch download; no
.venv made every stage fail with "python: command not found"."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.setup_clone import make_clone

from tests.test_setup import PIPELINE, _commands, _mark_done, _verdicts

REPO = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash") or "/bin/bash"   # by path: some tests run setup.sh with a bare PATH


def _setup(*args, base, cwd=None, env=None, repo=REPO, timeout=60):
    """setup.sh --preset tiny --base-dir base [args] -> (exit code, stdout + stderr)."""
    out = subprocess.run([BASH, str(repo / "setup.sh"), "--preset", "tiny", "--base-dir", str(base), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    return out.returncode, out.stdout + out.stderr


def _all_done(tmp_path) -> dict[str, list[str]]:
    """Done-markers for every pipeline stage in tmp_path/base, as a finished run writes them."""
    rc, out = _setup("--dry-run", "--from", "data", base=tmp_path / "base")
    assert rc == 0, out
    cmds = _commands(out)
    assert set(cmds) == set(PIPELINE), out
    _mark_done(tmp_path, cmds)
    return cmds


def test_another_spelling_of_the_base_dir_reruns_nothing(tmp_path):
    """A trailing slash, a doubled slash or a ./ is the same directory: every stage stays done."""
    _all_done(tmp_path)
    for spelling in (f"{tmp_path}/base/", f"{tmp_path}//base", f"{tmp_path}/./base"):
        rc, out = _setup("--dry-run", "--from", "data", base=spelling)
        assert rc == 0 and set(_verdicts(out).values()) == {"skip"}, (spelling, out)
    rc, out = _setup("--dry-run", "--from", "data", base="base/", cwd=tmp_path)   # relative, the caller's
    assert rc == 0 and set(_verdicts(out).values()) == {"skip"}, out


def test_a_model_stage_that_starts_forgets_the_later_stages(tmp_path):
    """base_train starts (here it fails at once: no tokenizer in the base dir) under --only: the
    stages after it must not stay "done" on the old model, next run or not; the ones before it do."""
    _all_done(tmp_path)
    state = tmp_path / "base" / "setup_state"
    rc, out = _setup("--only", "base_train", "--force", base=tmp_path / "base")
    assert rc == 1 and "stage 'base_train' failed" in out, out
    assert sorted(p.stem for p in state.glob("*.done")) == ["data", "tok_eval", "tokenizer"]
    rc, out = _setup("--dry-run", "--from", "data", base=tmp_path / "base")
    said = _verdicts(out)
    assert [said[s] for s in PIPELINE] == ["skip"] * 3 + ["new"] * 6, said


def test_printed_commands_keep_their_quoting(tmp_path):
    """The dry run's commands are what a shell would run: a conversations file and a name with
    spaces stay one argument each."""
    conv = tmp_path / "my files" / "own chats.jsonl"
    conv.parent.mkdir()
    conv.write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    rc, out = _setup("--dry-run", "--only", "chat_sft", "--conversations", str(conv), "--identity", "Ada Lovelace",
                     base=tmp_path / "base")
    assert rc == 0, out
    line = next(x for x in out.splitlines() if x.startswith("==> [chat_sft] "))
    argv = shlex.split(line.removeprefix("==> [chat_sft] "))
    assert argv[argv.index("--extra-conversations") + 1] == str(conv), line
    assert argv[argv.index("--identity") + 1] == "Ada Lovelace", line


BAD_INPUTS = ["conversations", "identity"]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """what -> (its tmp dir, exit code, output) of setup.sh with that bad input; each run starts a
    Python check (~2.5 s on a CI core), so the two run side by side."""
    from concurrent.futures import ThreadPoolExecutor

    def run(what):
        tmp = tmp_path_factory.mktemp(what)
        if what == "conversations":
            bad = tmp / "no reply.jsonl"
            bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
            args = ["--conversations", str(bad)]
        else:
            args = ["--identity", "Zorb\u200blax"]
        return (tmp, *_setup("--only", "data,mid_train", *args, base=tmp / "base", timeout=120))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(BAD_INPUTS, pool.map(run, BAD_INPUTS)))


@pytest.mark.parametrize("what", BAD_INPUTS)
def test_mid_and_sft_inputs_are_checked_before_data(bad_input_runs, what):
    """A --conversations row without an assistant reply, or a name with a zero-width space (the
    shell's own check passes it, chat_sft's refuses it), stops setup.sh before the first stage:
    it used to surface when mid_train started, after base training."""
    tmp_path, rc, out = bad_input_runs[what]
    if what == "conversations":
        said = f"error: --conversations {tmp_path / 'no reply.jsonl'}:1: no assistant message"
    else:
        said = "error: --identity: got 'Zorb\\u200blax'"
    assert rc == 2 and said in out, out
    assert "[data]" not in out and not (tmp_path / "base" / "base_data").exists(), out


def test_an_activated_venv_is_not_another_interpreter(tmp_path):
    """With the repo's .venv activated (setup.sh's closing lines say `source .venv/bin/activate`),
    setup.sh still takes the python3 it built the venv from: the env stage's marker names that
    interpreter, and taking the venv's for another one redid the stage on every switch."""
    venv_bin = REPO / ".venv" / "bin"
    if not (venv_bin / "python3").exists():
        pytest.skip("no .venv in the repo")
    env = dict(os.environ, PATH=f"{venv_bin}:{os.environ['PATH']}", VIRTUAL_ENV=str(REPO / ".venv"))
    rc, out = _setup("--dry-run", "--only", "data", base=tmp_path / "base", env=env)
    assert rc == 0, out
    line = next(x for x in out.splitlines() if "free disk" in x)
    assert f"({venv_bin}/python3)" not in line and "python3)" in line, line


def test_no_c_compiler_is_named_before_any_download(tmp_path):
    """Rust links through `cc`: without one the env stage says what to install (dry run: a warning)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    for tool in ("dirname", "uname", "df", "awk", "realpath", "sed", "head", "cut", "cat"):
        if shutil.which(tool):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    home = tmp_path / "home"
    (home / ".cargo" / "bin").mkdir(parents=True)
    (home / ".cargo" / "bin" / "cargo").write_text("#!/bin/sh\nexit 0\n")
    (home / ".cargo" / "bin" / "cargo").chmod(0o755)
    env = {"HOME": str(home), "PATH": str(bin_dir)}
    rc, out = _setup("--dry-run", "--only", "env", "--force", base=tmp_path / "base", env=env)
    assert rc == 0 and "cc (a C compiler" in out and "build-essential" in out, out
    (bin_dir / "cc").symlink_to(shutil.which("true"))
    rc, out = _setup("--dry-run", "--only", "env", "--force", base=tmp_path / "base", env=env)
    assert rc == 0 and "C compiler" not in out, out


def test_stages_without_a_venv_say_to_build_it(tmp_path):
    """--only / --from without the env stage on a clone with no .venv: one line naming
    `./setup.sh --only env`, not each stage failing with "python: command not found"."""
    repo = make_clone(tmp_path)
    rc, out = _setup("--only", "data", base=tmp_path / "base", repo=repo)
    assert rc == 2 and "error: stage 'data' runs in" in out and "./setup.sh --only env" in out, out
    assert "failed" not in out
