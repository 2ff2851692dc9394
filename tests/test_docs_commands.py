"""The command lines a user copies from README.md and docs/*.md still work with today's flags.

Every `python -m scripts.NAME ...` (also under `torchrun ... -m` and `launch_multinode.sh ... --
-m`, and a span such as `chat_web -i sft ...` that starts with a script's bare name) found in a
code block or an inline code span goes through the script's own check: the `check` that its
`__main__` hands to `nanochat.flags.script_main`, run by executing the script as `__main__` with
script_main replaced by "run check, then stop" (nothing is trained, loaded or served). Every flag
must also be one of the option strings of the parsers that check ran, spelled in full (a plain
argparse parser would accept a prefix of a renamed flag). `a|b|c` outside quotes is a list of
alternatives: each is checked; `[--opt]` is included, `...` dropped, `N` and a few other
placeholders get a value. Also: the README's "main flags" table names only flags of its rows'
scripts; `./setup.sh` commands pass setup.sh's own validation and its flags are in its --help;
`./run_train.sh` options are in its usage and what it passes on passes base_train's check; the
README's first block is set-up + main job, then the test command .ci/run runs; its layout lists
files that exist; and the environment variables it names are read by the code.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import itertools
import re
import runpy
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import nanochat.flags

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPT_NAMES = {p.stem for p in (REPO / "scripts").glob("*.py") if p.stem != "__init__"}
MIN_COMMANDS = 40          # README.md held 48 script commands (a|b expanded) when this was written
MIN_SHELL_COMMANDS = 8     # ./setup.sh and ./run_train.sh commands and flag mentions
# a check may refuse for the machine, not the command (bench_int8 times CUDA kernels only)
MACHINE_ONLY = re.compile(r"no CUDA GPU")
PLACEHOLDERS = {"N": "2", "K": "2", "STEP": "10", "ORIGIN": "http://localhost:3000",
                "KEY": "an-api-key"}   # chat_web refuses keys under 8 characters


# ------------------------------------------------------------------------------ extraction

def code_texts(path: Path) -> list[tuple[str, str]]:
    """(where, text) of every code line of the fenced blocks (continuations joined, a # comment
    cut) and of every inline code span outside them (one may run over a line break), in order."""
    found, fenced, pending, start, prose = [], False, "", 0, []

    def flush_prose():
        text = "\n".join(line for _, line in prose)
        for m in re.finditer(r"`([^`]+)`", text):
            found.append((f"{path.name}:{prose[0][0] + text.count(chr(10), 0, m.start())}",
                          " ".join(m[1].split())))
        prose.clear()

    for no, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            flush_prose()
            fenced = not fenced
        elif fenced:
            start, pending = start or no, pending + line.rstrip()
            if pending.endswith("\\"):
                pending = pending[:-1] + " "
                continue
            found.append((f"{path.name}:{start}", re.sub(r"\s#\s.*$", "", pending).strip()))
            pending, start = "", 0
        elif line.strip():
            prose.append((no, line))
        else:
            flush_prose()
    flush_prose()
    return found


@dataclass(frozen=True)
class DocCommand:
    where: str                 # README.md:56
    module: str                # scripts.bench_train
    argv: tuple[str, ...]
    nproc: int | None          # ranks of a torchrun / launch_multinode launch, None for plain python

    def __str__(self):
        return f"{self.where}: {'torchrun ' if self.nproc else ''}-m {self.module} {shlex.join(self.argv)}"


LAUNCH_RE = re.compile(r"(?:\bpython3?|(?P<torchrun>\btorchrun\b.*?)|(?P<multinode>launch_multinode\.sh\b.*?\s--))"
                       r"\s+-m\s+(?P<module>scripts\.\w+)(?P<rest>.*)")
BARE_RE = re.compile(r"^(?P<name>[a-z][a-z0-9_]*)\s+(?P<rest>-.*)$")
ALTERNATIVES = re.compile(r"^[\w.,-]+(\|[\w.,-]+)+$")


def split_argv(rest: str) -> list[list[str]]:
    """The argv lists a documented rest-of-command stands for: `[--opt]` is included, `...` dropped,
    placeholders get a value, and each unquoted `a|b` alternative gives its own argv."""
    rest = re.split(r"\s(?:&&|;|\|\|?)\s", rest)[0].replace('"..."', '"a prompt"')
    try:
        tokens = [t.strip("[]") for t in shlex.split(rest)]
    except ValueError:   # an unbalanced quote: check the words as they stand
        tokens = [t.strip("[]") for t in rest.split()]
    choices = []
    for tok in tokens:
        if tok in ("", "...") or tok.endswith(",..."):
            continue
        if ALTERNATIVES.match(tok) and f'"{tok}"' not in rest and f"'{tok}'" not in rest:
            choices.append(tok.split("|"))
        else:
            choices.append([PLACEHOLDERS.get(tok, tok)])
    return [list(argv) for argv in itertools.product(*choices)]


def doc_commands(paths=DOCS) -> list[DocCommand]:
    found = []
    for path in paths:
        for where, text in code_texts(path):
            m, bare = LAUNCH_RE.search(text), BARE_RE.match(text.strip())
            if m:
                module, rest = m["module"], m["rest"]
                nproc = None
                if m["torchrun"]:
                    n = re.search(r"--nproc[_-]per[_-]node[= ](\w+)", m["torchrun"])
                    nproc = int(PLACEHOLDERS.get(n[1], n[1])) if n else 1
                elif m["multinode"]:
                    nproc = 2   # two nodes of one process each (its defaults)
            elif bare and bare["name"] in SCRIPT_NAMES:
                module, rest, nproc = f"scripts.{bare['name']}", bare["rest"], None
            else:
                continue
            if module.removeprefix("scripts.").isupper():   # `python -m scripts.NAME`: a pattern, not a command
                continue
            found += [DocCommand(where, module, tuple(argv), nproc) for argv in split_argv(rest)]
    return found


# ------------------------------------------------------------------------------ a script's check

class _Checked(Exception):
    def __init__(self, result):
        self.result = result


class _NoCheck(Exception):
    pass


def run_check(module: str, argv, monkeypatch, nproc=None):
    """Execute `module` as `__main__` with this argv, stopping after script_main's check. Returns
    (what check returned, the argparse parsers it ran, whether one of them parsed argv); raises
    what the check raised."""
    parsers, parsed = [], []
    real_parse = argparse.ArgumentParser.parse_known_args

    def recording_parse(self, args=None, namespace=None):
        parsers.append(self)
        result = real_parse(self, args, namespace)
        parsed.append(self)
        return result

    def check_only(name, check, run):
        raise _Checked(check())

    def no_check(main):
        raise _NoCheck(f"{module} builds its parser inside main() (nanochat.flags.run_cli): expose a check")

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", recording_parse)
        m.setattr(nanochat.flags, "script_main", check_only)
        m.setattr(nanochat.flags, "run_cli", no_check)
        m.setattr(sys, "argv", [module, *argv])
        for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            m.delenv(var, raising=False)
        if nproc:   # as torchrun sets them for rank 0
            m.setenv("RANK", "0")
            m.setenv("LOCAL_RANK", "0")
            m.setenv("WORLD_SIZE", str(nproc))
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                # by path: pytest's assertion rewriter claims scripts/load_test.py (*_test.py) on import
                runpy.run_path(str(REPO / (module.replace(".", "/") + ".py")), run_name="__main__")
        except _Checked as done:
            return done.result, parsers, bool(parsed)
        except Exception as e:
            e.parsers, e.parsed = parsers, bool(parsed)
            raise
    raise AssertionError(f"{module}: its __main__ did not call nanochat.flags.script_main")


def flag_names(argv) -> list[str]:
    """The option tokens of an argv, up to a bare `--` (what follows belongs to another command)."""
    names = []
    for tok in argv:
        if tok == "--":
            break
        if tok.startswith("-") and not re.match(r"^-\d", tok):
            names.append(tok.split("=")[0])
    return names


def unknown_flags(argv, parsers) -> list[str]:
    """Flags of argv that no parser knows by exactly that name (FlagParser's --under_score
    spellings count as their --dash-name)."""
    def known(name):
        for p in parsers:
            spelled = nanochat.flags.normalize_flags([name])[0] if isinstance(p, nanochat.flags.FlagParser) else name
            if spelled in p._option_string_actions:
                return True
        return False
    return [name for name in flag_names(argv) if not known(name)]


def check_command(module: str, argv, monkeypatch, nproc=None) -> str | None:
    """None if the command passes its script's check with every flag spelled in full; else why not."""
    if module.removeprefix("scripts.") not in SCRIPT_NAMES:
        return f"no such script: {module.replace('.', '/')}.py"
    try:
        result, parsers, _ = run_check(module, list(argv), monkeypatch, nproc)
    except _NoCheck as e:
        return str(e)
    except (Exception, SystemExit) as e:
        if getattr(e, "parsed", False) and MACHINE_ONLY.search(str(e)) and not unknown_flags(argv, e.parsers):
            return None
        return f"{type(e).__name__}: {e}"
    bad = unknown_flags(argv, parsers)
    if bad:
        return f"not an option of {module} (spelled in full): {' '.join(bad)}"
    if module == "scripts.compare_recipes":   # its runs' flags are base_train's: check them too
        for entry in result.entries:
            why = check_command("scripts.base_train", [*result.shared, "--recipe", entry[0], *entry[1:]], monkeypatch)
            if why:
                return f"base_train flags of the run {' '.join(entry)!r}: {why}"
    return None


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    return monkeypatch


def test_every_documented_script_command_passes_its_scripts_check(isolated):
    commands = doc_commands()
    assert len(commands) >= MIN_COMMANDS, [str(c) for c in commands]
    failures = [f"{c}\n    -> {why}" for c in commands if (why := check_command(c.module, c.argv, isolated, c.nproc))]
    assert not failures, "stale commands in the docs:\n" + "\n".join(failures)


def test_a_stale_flag_in_the_readme_is_caught(tmp_path, isolated):
    """The check above can fail: a README whose command has a renamed flag, a bad value, or a
    prefix of a real flag (which plain argparse would take) is reported."""
    readme = tmp_path / "README.md"
    readme.write_text("Run `python -m scripts.base_train --depth 4 --no-such-flag 1`.\n\n```bash\n"
                      "torchrun --nproc_per_node=2 -m scripts.chat_sft --num-iterations 5 \\\n"
                      "    --devise-batch-size 4   # typo\n"
                      "python -m scripts.chat_web --batch-slot 4\n"
                      "python -m scripts.bench_train --depth 12 --kernel current|tritonn\n```\n")
    commands = doc_commands([readme])
    assert [(c.module, c.nproc) for c in commands] == [
        ("scripts.base_train", None), ("scripts.chat_sft", 2), ("scripts.chat_web", None),
        ("scripts.bench_train", None), ("scripts.bench_train", None)]
    whys = [check_command(c.module, c.argv, isolated, c.nproc) for c in commands]
    assert "--no-such-flag" in whys[0]
    assert "--devise-batch-size" in whys[1]
    assert "--batch-slot" in whys[2]          # chat_web's argparse would accept the prefix
    assert whys[3] is None and "--kernel" in whys[4]


def test_compare_recipes_runs_are_checked_with_base_trains_flags(isolated):
    assert check_command("scripts.compare_recipes", ["--runs", "v1", "v2 --weight-decay 0", "--", "--depth", "4"],
                         isolated) is None
    why = check_command("scripts.compare_recipes", ["--runs", "v1", "v2 --weight-decai 0"], isolated)
    assert why and "--weight-decai" in why


# ------------------------------------------------------------------------------ the main-flags table

TABLE_ROWS = {   # the README's "Stages and their main flags" row -> the scripts whose flags it lists
    "tokenizer": ["tok_train", "tok_eval"], "base_train": ["base_train"], "base_eval": ["base_eval"],
    "mid_train / chat_sft": ["mid_train", "chat_sft"], "chat_eval": ["chat_eval"],
    "chat": ["chat_web", "chat_cli", "chat_eval", "base_eval"],   # it says chat_eval and base_eval take --quantize
}


def test_the_main_flags_table_names_only_real_flags(isolated):
    text = (REPO / "README.md").read_text()
    table = text.split("| stage | main flags |", 1)[1].split("\n\n", 1)[0]
    rows = dict(re.findall(r"^\| ([a-z_ /]+) \| (.*) \|$", table, re.M))
    assert set(TABLE_ROWS) <= set(rows), sorted(rows)
    for row, scripts in TABLE_ROWS.items():
        parsers = []
        for name in scripts:
            _, ps, _ = run_check(f"scripts.{name}", ["-i", "sft"] if name == "chat_eval" else [], isolated)
            parsers += ps
        spans = " ".join(re.findall(r"`([^`]+)`", rows[row]))
        mentioned = re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", spans)
        assert len(mentioned) >= 2, (row, spans)
        missing = unknown_flags(mentioned, parsers)
        assert not missing, f"README main-flags row {row!r} names flags no {scripts} parser has: {missing}"


# ------------------------------------------------------------------------------ setup.sh / run_train.sh

def shell_commands(script: str, paths=DOCS) -> list[tuple[str, list[str]]]:
    """(where, argv) of every `./script ...` / `script ...` code line or span; the `setup.sh
    itself:` paragraph's spans count as setup.sh flags."""
    found = []
    for path in paths:
        for where, text in code_texts(path):
            # a command: the name alone or followed by flags (not a file list's "setup.sh   set-up ...")
            m = re.search(rf"(?:^|\s|\./){re.escape(script)}(?P<rest>(?:\s+-.*)?)$", text)
            if m:
                found += [(where, argv) for argv in split_argv(m["rest"])]
    if script == "setup.sh":
        for path in paths:
            para = path.read_text().split("setup.sh itself:", 1)
            if len(para) == 2:
                spans = re.findall(r"`([^`]+)`", para[1].split("\n\n", 1)[0].split("WANDB_RUN")[0])
                found += [(f"{path.name}: setup.sh itself", [f]) for span in spans
                          for f in flag_names(shlex.split(span))]
    return found


def usage_flags(script: str) -> set[str]:
    text = subprocess.run(["bash", str(REPO / script), "--help"], capture_output=True, text=True, timeout=30).stdout
    assert "Usage:" in text, text
    return set(re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", text))


def test_setup_sh_commands_in_the_docs_pass_its_validation(tmp_path):
    usage = usage_flags("setup.sh")
    commands = shell_commands("setup.sh")
    assert len(commands) >= MIN_SHELL_COMMANDS, commands
    bad = [(where, argv) for where, argv in commands for f in flag_names(argv) if f not in usage]
    assert not bad, f"setup.sh flags that its --help does not list: {bad}"
    # a whole documented command (not a lone flag from prose) must get past setup.sh's own checks:
    # --list-stages exits after validating every flag and value, before any machine check or work
    for where, argv in commands:
        if len(argv) < 2 or "itself" in where or "--help" in argv:
            continue
        proc = subprocess.run(["bash", str(REPO / "setup.sh"), *argv, "--list-stages"], capture_output=True,
                              text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                          "NANOCHAT_BASE_DIR": str(tmp_path / "base")})
        assert proc.returncode == 0 and "base_train" in proc.stdout, (where, argv, proc.stderr)


RUN_TRAIN_OPTIONS = {"--nproc": 1, "--base-dir": 1, "--timeout": 1, "--lines": 1, "--status": 0, "--stop": 0}


def test_run_train_sh_commands_in_the_docs_exist(isolated):
    """run_train.sh's own options must be in its usage; the rest go to base_train, so a documented
    start must pass base_train's check (what run_train.sh runs before it starts anything)."""
    usage = usage_flags("run_train.sh")
    assert set(RUN_TRAIN_OPTIONS) <= usage, sorted(usage)
    commands = shell_commands("run_train.sh")
    assert len(commands) >= 4, commands
    for where, argv in commands:
        passed_on, nproc, i = [], 1, 0
        while i < len(argv):
            if argv[i] in RUN_TRAIN_OPTIONS:
                nproc = int(argv[i + 1]) if argv[i] == "--nproc" else nproc
                i += 1 + RUN_TRAIN_OPTIONS[argv[i]]
            else:
                passed_on.append(argv[i])
                i += 1
        if "--status" in argv or "--stop" in argv:
            assert set(flag_names(passed_on)) <= {"--model-tag"}, (where, argv)   # all they take besides
            continue
        why = check_command("scripts.base_train", passed_on, isolated, nproc if nproc > 1 else None)
        assert why is None, f"{where}: run_train.sh {shlex.join(argv)}: {why}"


# ------------------------------------------------------------------------------ the README's first commands

def test_readme_starts_with_set_up_then_the_ci_test_command():
    text = (REPO / "README.md").read_text()
    first_block = text.split("```", 2)[1].splitlines()[1:]
    commands = [re.sub(r"\s+#.*$", "", line).strip() for line in first_block if line.strip()]
    assert commands[0] == "./setup.sh", commands
    assert commands[1] == ".venv/bin/python -m pytest tests -q -n 2 --dist loadfile", commands
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert commands[1] in [line.strip() for line in ci], "the README's test command is not what .ci/run runs"


# ------------------------------------------------------------------------------ paths and environment

def test_the_readme_layout_names_files_that_exist():
    block = (REPO / "README.md").read_text().split("\n## Layout", 1)[1].split("```")[1]
    paths = [line.split()[0] for line in block.splitlines() if line.strip()]
    assert len(paths) >= 50, paths
    assert not [p for p in paths if not (REPO / p).exists()], "the README's layout lists files that are gone"


def read_env_names() -> set[str]:
    """Environment variables the code reads: exact string constants in nanochat/ and scripts/
    (os.environ.get("X"), ENV = "X", a table of names), and $X / ${X in the shell scripts."""
    names = set()
    for path in [*REPO.glob("nanochat/**/*.py"), *REPO.glob("scripts/*.py")]:
        names |= {node.value for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and re.fullmatch(r"[A-Z][A-Z0-9_]+", node.value)}
    for path in [REPO / "setup.sh", REPO / "run_train.sh", *REPO.glob("scripts/*.sh")]:
        names |= set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", path.read_text()))
    return names


def test_every_environment_variable_the_readme_names_is_read():
    text = (REPO / "README.md").read_text()
    documented = set(re.findall(r"`\$?(NANOCHAT_[A-Z_]+|TORCH_INDEX_URL|WANDB_RUN)\b", text))
    assert len(documented) >= 10, documented
    assert not documented - read_env_names(), "README names environment variables no code reads"
