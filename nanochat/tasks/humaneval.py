"""HumanEval: write a Python function from its signature + docstring; scored by running the tests.

The completion is executed with `nanochat.execution.execute_code` (separate process, time and
memory limits, no network, read-only filesystem where the OS allows it).
Local file: `humaneval.jsonl` (fields as released). Hub: openai/openai_humaneval. The rows are
shuffled once with a fixed seed (common.fixed_order, as MMLU's): the file's order runs
roughly from short solutions to long ones, so chat_eval --max-problems N scored the easiest.
"""

from __future__ import annotations

import ast
import itertools
import re
import textwrap
import warnings

from nanochat.execution import execute_code
from nanochat.sandbox_cgroup import validate
from nanochat.tasks.common import Task, check_rows, fixed_order, load_rows

# `if __name__ == "__main__":` (either order, any indentation, `elif` too): the condition only. The
# official harness (and upstream nanochat) exec()s the program in a fresh dict, where __name__ is
# "builtins", so a demo block a model appends never runs there; our sandbox runs the program as
# __main__ (pickle needs that), where such a block ran: unittest.main() / sys.exit() ended the run
# before the tests and input() failed on the closed stdin, scoring correct solutions as failures.
_MAIN_GUARD = re.compile(r"""^([ \t]*(?:el)?if[ \t(]+)(?:__name__[ \t]*==[ \t]*(['"])__main__\2"""
                         r"""|(['"])__main__\3[ \t]*==[ \t]*__name__)""", re.MULTILINE)
_FENCE = re.compile(r"[ \t]*(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*")  # opening line: indent, fence, info string
_PYTHON_LANGS = ("", "python", "py", "python3", "py3")


def _code_blocks(text: str) -> tuple[list[tuple[str, str]], str]:
    """(fenced blocks as (language, code), the text outside every block), markdown style: a block
    closes at a line holding only a fence of the same character at least as long; an unclosed
    block (a cut-off generation) runs to the end. An indented opening fence (a block inside a list
    item) strips that indent from the code, so the code does not start with an IndentationError.
    Fence lines belong to no side: they are markdown, never Python."""
    blocks, outside, lines, i = [], [], text.splitlines(keepends=True), 0
    while i < len(lines):
        m = _FENCE.fullmatch(lines[i].rstrip("\r\n"))
        i += 1
        if m is None:
            outside.append(lines[i - 1])
            continue
        fence, lang = m.group(1), m.group(2).lower()
        indent = len(lines[i - 1]) - len(lines[i - 1].lstrip(" \t"))
        body = []
        while i < len(lines):
            line = lines[i]
            i += 1
            stripped = line.strip()
            if stripped.startswith(fence) and stripped == fence[0] * len(stripped):
                break
            body.append(line[min(indent, len(line) - len(line.lstrip(" \t"))):])
        blocks.append((lang, "".join(body)))
    return blocks, "".join(outside)


def extract_program(completion: str, prompt: str, entry_point: str) -> str:
    """The code to run: the prompt, then the completion's code.

    The code is the first Python (or unlabelled) fenced block that defines `entry_point`, else the
    first Python block, else the completion's text outside any block (a body continuing the
    prompt; a stray fence line, such as a closing fence after a body, dropped). A block with no
    code in it is no block: a body followed by a lone closing fence read as an unclosed, empty
    block and was chosen over the body, running the prompt's stub alone. Blocks labelled with
    another language (```text, ```bash, an example's output) are never run.
    The prompt always comes first (as in the official HumanEval harness): it carries the imports
    and any helper functions the entry point uses (HumanEval/10, 32, 38, 50). A completion that
    defines `entry_point` itself simply redefines the prompt's docstring-only stub. The code's
    `if __name__ == "__main__":` conditions become False, as that harness evaluates them.
    Of these choices the first that compiles (with the prompt) wins: text after a stray closing
    fence (`    return x\n```\nThis returns x.`) is prose, not the code to run. So is prose after
    (or before) code written without any fence (`def f(x):\n    return x\n\nThis returns x.`):
    where the text outside the blocks does not compile, its code is the longest run of its lines
    that does (_code_among_prose). That text's own `def entry_point` is preferred to a block that
    defines nothing (a usage example such as ```print(f(1))```, which ran the prompt's stub), but
    not to a block holding a body (indented), which the text's repeated signature and docstring
    would otherwise leave as an empty stub.
    """
    defines = re.compile(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
    blocks, outside = _code_blocks(completion)
    python = [code for lang, code in blocks if lang in _PYTHON_LANGS and code.strip()]
    own = defines.search(outside) is not None

    def is_body(code: str) -> bool:   # the function's body alone: its first code line is indented
        first = next((line for line in code.split("\n") if line.strip()), "")
        return first[:1] in (" ", "\t")

    # a body block continues the prompt; it goes before the text's own function when that is only
    # the signature and docstring repeated (a stub returning None), after it when that has a body
    # (the block is then an excerpt of it, e.g. one line explained)
    bodies = [c for c in python if not defines.search(c) and is_body(c)]
    bodies_first = own and _is_stub(outside, entry_point)

    def candidates():   # in that order of preference, lazily (the prose search only when needed)
        yield from (c for c in python if defines.search(c))
        if bodies_first:
            yield from bodies
        if own:   # the text's own function: before a block that defines nothing, as a usage example
            yield outside
            yield _code_among_prose(outside, prompt, defines)
        yield from python
        if not own:
            yield outside
            yield _code_among_prose(outside, prompt, defines)

    # the first that compiles: a body (or a function) followed by a stray closing fence or plain
    # prose, read whole as code, failed to compile and scored 0
    programs = (_join(prompt, _MAIN_GUARD.sub(r"\1False", c), defines) for c in candidates() if c is not None)
    first = next(programs)
    return next((p for p in itertools.chain([first], programs) if _compiles(p)), first)


def _is_stub(text: str, entry_point: str) -> bool:
    """Whether `text`'s `def entry_point` has no body but a docstring / `pass` / `...` (or cannot be
    read as a function at all): its lines from the def to the next line back at its indentation."""
    lines = text.split("\n")
    at = next((i for i, line in enumerate(lines) if re.match(rf"\s*def\s+{re.escape(entry_point)}\s*\(", line)), None)
    if at is None:
        return True
    indent = len(lines[at]) - len(lines[at].lstrip())
    end = next((j for j in range(at + 1, len(lines)) if lines[j].strip()
                and len(lines[j]) - len(lines[j].lstrip()) <= indent), len(lines))
    try:
        tree = ast.parse(textwrap.dedent("\n".join(lines[at:end])))
    except SyntaxError:
        return True
    fn = tree.body[0] if tree.body else None
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return True
    return all(isinstance(st, ast.Pass) or (isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant))
               for st in fn.body)


# a line that starts Python code at the top level: where code written without a fence may begin
_CODE_LINE = re.compile(r"(?:def|class|import|from|async[ \t]+def)[ \t]+\S|@[A-Za-z_]")


def _code_among_prose(text: str, prompt: str, defines: re.Pattern) -> str | None:
    """The longest run of whole lines of `text` that compiles after the prompt; None when no run
    holding code does. With a `def entry_point` line the run holds it, and starts at the first
    top-level `def` / `class` / `import` / `from` / decorator line before it (its helpers and
    imports), else at that line; without one it starts at the first line (a body continuing the
    prompt). Tried only after `text` failed to compile whole: code that compiles is never cut."""
    lines = [line + "\n" for line in text.split("\n")]   # "\n" alone ends a line, as in count() below
    lines[-1] = lines[-1][:-1]
    m = defines.search(text)
    entry = None if m is None else text.count("\n", 0, m.end())   # the line of `def entry_point`
    if entry is None:
        starts = [0]
    else:
        starts = [i for i, line in enumerate(lines[:entry]) if _CODE_LINE.match(line)][:1] + [entry]
    for start in starts:
        for end in range(len(lines), max(start, -1 if entry is None else entry), -1):
            code = "".join(lines[start:end])
            if code.strip() and _compiles(_join(prompt, _MAIN_GUARD.sub(r"\1False", code), defines)):
                return code
    return None


def _join(prompt: str, code: str, defines: re.Pattern) -> str:
    if defines.search(code) is None:
        return prompt + code  # a function body continues the prompt's signature
    return prompt.rstrip("\n") + "\n\n\n" + code


def _compiles(program: str) -> bool:
    """Whether `program` is valid Python (compiled only, never run; its SyntaxWarnings stay quiet)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(program, "program.py", "exec", dont_inherit=True)
        except Exception:  # noqa: BLE001 - SyntaxError, ValueError (NUL), RecursionError, MemoryError
            return False
    return True


_KEYS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


def _check_row(row: dict) -> str | None:
    """Every field is text and entry_point a Python name: a null or numeric one stopped the run
    with a TypeError after the model had loaded, or ran a program that could never pass."""
    bad = [k for k in _KEYS if not isinstance(row[k], str)]
    if bad:
        return f"{', '.join(map(repr, bad))} must be text (a JSON string)"
    if not row["entry_point"].isidentifier():
        return f"'entry_point' must be a Python function name, got {row['entry_point']!r}"
    return _reference_problem(row)


def _reference_problem(row: dict) -> str | None:
    """What keeps the row's own solution from ever passing, found without running anything: the
    program evaluate() builds around the canonical solution must compile, the prompt and solution
    must define entry_point, and the test must define the check() that program calls. A test
    written as bare asserts (an MBPP-style export), a test or solution whose indentation an export
    lost, or a misspelt entry_point loaded silently before and scored every answer 0 (NameError or
    SyntaxError in the sandbox): the task measured nothing, and the score read as the model's."""
    entry = row["entry_point"]
    if not re.search(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(entry)}[ \t]*\(",
                     row["prompt"] + row["canonical_solution"], re.MULTILINE):
        return f"'prompt' + 'canonical_solution' define no function {entry!r} (the 'entry_point' the test checks)"
    try:
        with warnings.catch_warnings():   # an invalid escape in a test's string: its SyntaxWarning stays quiet
            warnings.simplefilter("ignore")
            tree = ast.parse(row["test"])
    except (SyntaxError, ValueError) as e:
        return f"'test' is not valid Python ({type(e).__name__}: {e})"
    if not any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "check" for n in tree.body):
        return "'test' defines no top-level check(candidate), which every program calls"
    if not _compiles(f"{row['prompt']}{row['canonical_solution']}\n\n{row['test']}\n\ncheck({entry})\n"):
        return "'prompt' + 'canonical_solution' + 'test' do not compile (lost indentation?)"
    return None


class HumanEval(Task):
    eval_type = "generative"
    name = "HumanEval"

    def __init__(self, *, data_dir=None, timeout_s: float = 10.0, memory_mb: int = 1024, **kw):
        super().__init__(**kw)
        # the sandbox's own checks, here: not at the first evaluate(), after the model has loaded
        validate("HumanEval", 64, None, timeout_s=timeout_s, memory_mb=memory_mb)
        self.rows, self.source = load_rows("eval", ["humaneval.jsonl"], data_dir=data_dir,
                                           hub=("openai/openai_humaneval", None, "test"))
        check_rows(self.rows, self.source, _KEYS, _check_row)
        # a fixed shuffle: every prefix a spread of the set; each problem keeps its sampling seed
        # (Task.seed_index: its file position), so a full run's score is the one it was
        self.order = fixed_order(len(self.rows))
        self.rows = [self.rows[i] for i in self.order]
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    def num_examples(self) -> int:
        return len(self.rows)

    def get_example(self, index: int) -> dict:
        r = self.rows[index]
        return {"messages": [{"role": "user", "content": r["prompt"]},
                             {"role": "assistant", "content": r["prompt"] + r["canonical_solution"]}],
                "task_id": r["task_id"], "prompt": r["prompt"], "test": r["test"],
                "entry_point": r["entry_point"]}

    def program(self, conversation: dict, completion: str) -> str:
        code = extract_program(completion, conversation["prompt"], conversation["entry_point"])
        return f"{code}\n\n{conversation['test']}\n\ncheck({conversation['entry_point']})\n"

    def evaluate(self, conversation: dict, completion: str) -> bool:
        result = execute_code(self.program(conversation, completion), timeout_s=self.timeout_s,
                              memory_mb=self.memory_mb)
        return result.passed

    def reward(self, conversation: dict, completion: str) -> float:
        return float(self.evaluate(conversation, completion))
