"""Review 6: README.md and docs/INTERFACES.md against the code, where the other doc tests do not look.

tests/test_docs_commands.py runs the README's commands through their scripts' checks and checks its
main-flags table, its layout's paths and its environment variables; test_readme_review3/4 and
test_readme_walkthrough check figures and value lists. This file adds:
- the layout names every file of nanochat/ and scripts/ exactly once (not only files that exist),
  each .py one with the module docstring its line summarises;
- every `--flag` anywhere in the README is an option of a command this repository ships (or of
  the named outside tool), and the "What you get" table's flags belong to their row's scripts;
- the server and environment defaults the README quotes in prose are the code's;
- every signature docs/INTERFACES.md gives exists with those parameter names, in that positional
  order, with those default values (a documented `a|b|c` choice: the default first).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import re
import shlex
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from test_docs_commands import SCRIPT_NAMES, check_command, run_check, split_argv, unknown_flags

REPO = Path(__file__).resolve().parents[1]
README_TEXT = (REPO / "README.md").read_text()
README = " ".join(README_TEXT.split())   # sentences run over line breaks
FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")
# flags the README names that belong to other programs: torchrun's, pip's, pytest-xdist's (--dist) and flags.py's
# `--under_score` (a spelling, not a flag)
OUTSIDE_FLAGS = {"--dist", "--nproc_per_node", "--run-path", "--shutdown-timeout", "--user", "--under_score"}


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    return monkeypatch


def quoted(pattern: str) -> re.Match:
    m = re.search(pattern, README)
    assert m, f"README.md no longer says {pattern!r}: update this test with the README"
    return m


# ------------------------------------------------------------------------------ the layout

def layout_entries(text: str = README_TEXT) -> list[list[str]]:
    block = text.split("\n## Layout", 1)[1].split("```")[1]
    return [line.split(None, 1) for line in block.splitlines() if line.strip()]


def shipped_files() -> set[str]:
    """The files of nanochat/ and scripts/ (tracked or new, not git-ignored), a package folder
    such as nanochat/tasks/ as one entry, as the layout lists them."""
    try:
        names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "nanochat", "scripts"],
                               cwd=REPO, capture_output=True, text=True, check=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):   # not a git checkout: what is on disk
        names = [str(p.relative_to(REPO)) for d in ("nanochat", "scripts") for p in (REPO / d).rglob("*")]
    files = set()
    for name in names:
        parts = name.split("/")
        if not (REPO / name).is_file() or "__pycache__" in parts or parts[-1] == "__init__.py" \
                or name.endswith((".pyc", ".so")):
            continue
        files.add("/".join(parts[:2]) + "/" if len(parts) > 2 else name)
    return files


def test_the_layout_lists_every_file_of_nanochat_and_scripts_once():
    entries = layout_entries()
    listed = Counter(entry[0] for entry in entries)
    assert not [p for p, n in listed.items() if n > 1], "README layout lists a path twice"
    assert not [e[0] for e in entries if len(e) < 2], "README layout lines without a description"
    shipped = shipped_files()
    assert len(shipped) >= 100, sorted(shipped)
    missing = sorted(shipped - set(listed))
    assert not missing, f"files of nanochat/ and scripts/ that README's layout does not list: {missing}"


def test_every_python_file_in_the_layout_has_the_docstring_its_line_summarises():
    undocumented = [path for path, *_ in layout_entries() if path.endswith(".py")
                    and not ast.get_docstring(ast.parse((REPO / path).read_text()))]
    assert not undocumented, f"no module docstring: {undocumented}"


def test_a_file_left_out_of_the_layout_is_caught():
    text = README_TEXT.replace("nanochat/packing.py ", "nanochat/packing_gone.py ", 1)
    listed = {e[0] for e in layout_entries(text)}
    assert "nanochat/packing.py" in shipped_files() - listed


# ------------------------------------------------------------------------------ flags in prose

def help_flags(script: str) -> set[str]:
    """The flags a shell script's --help names (setup.sh, run_train.sh, launch_multinode.sh)."""
    proc = subprocess.run(["bash", str(REPO / script), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower(), (script, proc.stdout, proc.stderr)
    return set(FLAG_RE.findall(proc.stdout))


def parsers_of(module: str, monkeypatch) -> list:
    argv = ["-i", "sft"] if module == "scripts.chat_eval" else []
    try:
        return run_check(module, argv, monkeypatch)[1]
    except Exception as e:   # a check refusing this machine (no CUDA) still ran its parsers
        assert getattr(e, "parsers", None), f"{module}: {e}"
        return e.parsers


def test_every_flag_in_the_readme_is_an_option_of_a_shipped_command(isolated):
    """A flag named only in prose ("`--precision-backend native` is faster there") is real: an
    option of a script, of `python -m nanochat.platform|dataset|report`, or of a shell script."""
    parsers = [p for name in sorted(SCRIPT_NAMES) for p in parsers_of(f"scripts.{name}", isolated)]
    parsers += [p for name in ("platform", "dataset", "report") for p in parsers_of(f"nanochat.{name}", isolated)]
    shell = set().union(*(help_flags(s) for s in ("setup.sh", "run_train.sh", "scripts/launch_multinode.sh")))
    named = set(FLAG_RE.findall(README_TEXT)) - OUTSIDE_FLAGS - {"--help"}
    assert len(named) >= 100, sorted(named)
    assert unknown_flags(["--no-such-flag"], parsers)   # the check can fail
    unknown = unknown_flags(sorted(named - shell), parsers)
    assert not unknown, f"README names flags that no command of this repository accepts: {unknown}"


def test_the_what_you_get_tables_flags_belong_to_their_rows_scripts(isolated):
    table = README_TEXT.split("| stage | command | what it does |", 1)[1].split("\n\n", 1)[0]
    checked = 0
    for row in table.splitlines()[2:]:
        _, command, text = re.match(r"^\| (.*?) \| (.*?) \| (.*) \|$", row).groups()
        scripts = re.findall(r"python -m scripts\.(\w+)", command)
        spans = [s for s in re.findall(r"`([^`]+)`", text) if s.startswith("--")]
        if not scripts or not spans:
            continue
        parsers = [p for name in scripts for p in parsers_of(f"scripts.{name}", isolated)]
        for span in spans:
            assert not unknown_flags(FLAG_RE.findall(span), parsers), (command, span)
            for argv in split_argv(span) if len(span.split()) > 1 else []:   # a flag with its value:
                whys = [check_command(f"scripts.{name}", argv, isolated) for name in scripts]   # a row script
                assert None in whys, (command, span, whys)                                      # takes it
            checked += 1
    assert checked >= 8, checked


# ------------------------------------------------------------------------------ defaults quoted in prose

def test_the_servers_quoted_limits_are_the_codes():
    from nanochat.chat_api import ServerSettings, default_per_client
    from nanochat.http_guard import BODY_TIMEOUT_S
    from nanochat.serve_lifecycle import GRACE_S, STOP_EARLY_S

    assert float(quoted(r"A request body must arrive within (\d+) s \(else a 408\)").group(1)) == BODY_TIMEOUT_S
    assert float(quoted(r"answers in progress get (\d+) s to finish").group(1)) == GRACE_S - STOP_EARLY_S
    assert default_per_client(1) == int(quoted(r"batch slots x replicas, at least (\d+)\)").group(1))
    key_len = int(quoted(r"`NANOCHAT_API_KEY` \(chat_web's `--api-key`, (\d+) characters or more\)").group(1))
    ServerSettings(api_key="k" * key_len).validate()
    with pytest.raises(ValueError, match="--api-key"):
        ServerSettings(api_key="k" * (key_len - 1)).validate()


def test_the_base_dir_default_is_the_readmes(tmp_path, monkeypatch):
    from nanochat.common import get_base_dir

    default = quoted(r"Artefacts go to `\$NANOCHAT_BASE_DIR` \(default `~/([^`]+)`\)").group(1)
    monkeypatch.delenv("NANOCHAT_BASE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert get_base_dir() == tmp_path / default
    for script in ("setup.sh", "run_train.sh"):
        assert f"${{NANOCHAT_BASE_DIR:-$HOME/{default}}}" in (REPO / script).read_text(), script


def test_run_trains_interpreter_default_is_the_readmes():
    first, then = quoted(r"`NANOCHAT_PYTHON` \(run_train.sh's interpreter, default `([^`]+)`, "
                         r"else `([^`]+)`\)").groups()
    text = (REPO / "run_train.sh").read_text()
    assert f'"$REPO/{first}"' in text and f"command -v {then}" in text


# ------------------------------------------------------------------------------ docs/INTERFACES.md

def code_lines(text: str):
    """(line number, line, candidate modules) of each line of the python blocks. The modules: the
    block's `# x.py` comment, else the section's (its heading's or paragraph's `nanochat/x.py`),
    after any module the line's own comment names (`# writer_lock: ...`); rustbpe's part: `rustbpe`."""
    section, current, in_code, rust = [], None, False, False
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            named = re.findall(r"`nanochat/(\w+)\.py`", line)
            if named:
                section, current = [f"nanochat.{m}" for m in named], None
            rust = line.startswith("Python module `rustbpe`") or (rust and not named)
            continue
        m = re.match(r"#\s*(?:nanochat/)?(\w+)\.py", line)
        current = f"nanochat.{m[1]}" if m else current
        comment = line.split("#", 1)[1] if "#" in line else ""
        own = [f"nanochat.{x}" for x in re.findall(r"(?:nanochat/)?\b(\w+)(?:\.py)?:", comment)
               if (REPO / "nanochat" / f"{x}.py").exists()]
        yield no, line, own + (["rustbpe"] if rust else []) + ([current] if current else []) + section


def _params(text: str) -> list[tuple[str, str | None]]:
    """(name, default text or None) of a documented parameter list; `*`, `/`, `...` dropped."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    out = []
    for part in [*parts, cur]:
        m = re.match(r"\s*(\*{0,2}[A-Za-z_]\w*)\s*(?::[^=]*)?(?:=\s*(.*?))?\s*$", part)
        if m and m[1] not in ("self", "cls"):
            out.append((m[1], m[2]))
    return out


def interface_signatures(text: str) -> list[tuple[int, list[str], str | None, str, list]]:
    """(line, candidate modules, class or None, name, params) of each `def f(...)` line (a method
    when indented under `class C`) and each bare `f(...)` line of the python blocks."""
    found, lines, cls = [], text.splitlines(), None
    for no, line, mods in code_lines(text):
        if line.startswith("class "):
            cls = re.match(r"class (\w+)", line)[1]
        elif line[:1].isalpha() and not line.startswith("def "):
            cls = None
        m = re.match(r"(\s*)(?:def )?([a-z_]\w*)\((.*)", line)
        if not m or (m[1] and not line.lstrip().startswith("def ")):
            continue
        rest, j = m[3], no   # the parameter list may run over lines
        while rest.count("(") + 1 > rest.count(")") and j < len(lines):
            rest, j = rest + " " + lines[j].split("#")[0], j + 1
        depth, end = 1, len(rest)
        for k, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = k
                break
        found.append((no, mods, cls if m[1] else None, m[2], _params(rest[:end])))
    return found


def _find(mods: list[str], cls: str | None, name: str):
    for mod in mods:
        try:
            module = importlib.import_module(mod)
        except ImportError:
            continue
        owner = getattr(module, cls, None) if cls else module
        if owner is not None and hasattr(owner, name):
            return getattr(owner, name)
    return None


def _default_problem(name: str, pname: str, doc_default: str, param) -> str | None:
    first = doc_default.split("|")[0]   # `decode="eager"|"compile"`: the first choice is the default
    try:
        value = ast.literal_eval(first)
    except (ValueError, SyntaxError):   # not a literal (a name, a call): nothing to compare
        return None
    if param.default is inspect.Parameter.empty or param.default != value:
        return f"{name}: {pname} defaults to {param.default!r}, not {first}"
    return None


def signature_problems(text: str) -> list[str]:
    problems = []
    for line, mods, cls, name, params in interface_signatures(text):
        obj = _find(mods, cls, name)
        if obj is None:
            problems.append(f"line {line}: {cls + '.' if cls else ''}{name} not in {mods}")
            continue
        real = {("*" if p.kind == p.VAR_POSITIONAL else "**" if p.kind == p.VAR_KEYWORD else "") + n: p
                for n, p in inspect.signature(obj).parameters.items() if n not in ("self", "cls")}
        positional = [n for n, p in real.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        doc_positional = [n for n, _ in params if n in positional]
        if doc_positional != positional[:len(doc_positional)]:
            problems.append(f"line {line}: {name}: positional order {doc_positional}, the code's {positional}")
        for pname, default in params:
            if pname not in real:
                problems.append(f"line {line}: {name}: no parameter {pname!r} (the code's: {list(real)})")
            elif default is not None and (why := _default_problem(name, pname, default, real[pname])):
                problems.append(f"line {line}: {why}")
    return problems


def test_interfaces_signatures_are_the_codes():
    text = (REPO / "docs" / "INTERFACES.md").read_text()
    assert len(interface_signatures(text)) >= 100
    problems = signature_problems(text)
    assert not problems, "docs/INTERFACES.md signatures the code does not have:\n" + "\n".join(problems)


def test_a_stale_interface_signature_is_caught():
    doc = ("## Optimizer: `nanochat/optim.py`\n\n```python\n"
           "def lr_multiplier(step, num_iterations, *, warmdown_ratio=0.5, cooldown=0) -> float\n"
           "def muon_momentum(step, extra) -> float\n"
           "def no_such_function(x)\n```\n\n"
           "## Triton: `nanochat/triton_aot.py`\n\n```python\n"
           "def programs_per_sm(limits, registers: int, shared: int, num_warps: int) -> int\n"
           "def check(cases, targets) -> list\n```\n")
    problems = "\n".join(signature_problems(doc))
    assert "warmdown_ratio defaults to 0.4, not 0.5" in problems
    assert "no parameter 'cooldown'" in problems and "no parameter 'extra'" in problems
    assert "no_such_function not in" in problems
    assert "no parameter 'limits'" in problems      # the parameter's old name
    assert "positional order ['cases', 'targets']" in problems


def test_interfaces_module_level_names_exist():
    """`class C`, `NAME = ...` and `NAME: type` lines of the blocks name things their modules have."""
    text = (REPO / "docs" / "INTERFACES.md").read_text()
    names = [(no, m[1] or m[2], mods) for no, line, mods in code_lines(text)
             if (m := re.match(r"class (\w+)|([A-Z][A-Z0-9_]+)\s*[:=]", line))]
    missing = [f"line {no}: {name} not in {mods}" for no, name, mods in names if _find(mods, None, name) is None]
    assert len(names) >= 25 and not missing, missing


def test_readme_main_flags_of_nanochat_modules_parse(isolated):
    """`python -m nanochat.X ...` lines of the README (platform, report, dataset) pass the module's
    own flag check, as test_docs_commands does for scripts/."""
    found = []
    for line in README_TEXT.splitlines():
        for m in re.finditer(r"-m (nanochat\.(\w+))((?: [\w-]+)*)", line):
            if (REPO / "nanochat" / f"{m[2]}.py").exists() and "|" not in m[3]:
                found.append((m[1], shlex.split(m[3])))
    assert {mod for mod, _ in found} >= {"nanochat.platform", "nanochat.report", "nanochat.dataset"}, found
    for module, argv in found:
        _, parsers, parsed = run_check(module, argv, isolated)
        assert parsed and not unknown_flags(argv, parsers), (module, argv)
