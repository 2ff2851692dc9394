"""Review 4: command-line errors under torchrun, and README claims tied to the code.

A bad flag under torchrun is said once per node (LOCAL_RANK 0), not once per rank, and every rank
still exits 2; the other ranks wait before they exit, so torchrun's teardown (which follows the
first exit) cannot kill the speaker before its line. Tested in-process with torchrun's variables
set, not with a real torchrun (seconds per launch)."""
from __future__ import annotations

import pytest

import nanochat.flags as flags
from nanochat.errors import RequestError


class _TornDown(BaseException):
    """What torchrun's SIGTERM does to a rank that waits: it ends there."""


def _rank_env(monkeypatch, rank, local_rank, world):
    for var, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", world)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(value))


def _run_rank(monkeypatch, capsys, check, run=lambda: 0, sleep=None):
    """script_main on one rank: (exit code or 'torn down', stderr lines, seconds it waited)."""
    waited = []
    monkeypatch.setattr(flags.time, "sleep", sleep or waited.append)
    try:
        flags.script_main("base_train", check, run)
    except SystemExit as e:
        code = e.code
    except _TornDown:
        code = "torn down"
    return code, capsys.readouterr().err.splitlines(), sum(waited)


def _bad_flag():
    raise ValueError("--kernel: got 'nope'; accepted: current|liger|triton")


LINE = "base_train: error: --kernel: got 'nope'; accepted: current|liger|triton"


def test_a_bad_flag_under_torchrun_is_said_once_and_every_rank_exits_2(monkeypatch, capsys):
    said = []
    for rank in range(4):   # torchrun --nproc_per_node 4
        _rank_env(monkeypatch, rank, rank, 4)
        code, lines, waited = _run_rank(monkeypatch, capsys, _bad_flag)
        assert code == 2, (rank, code)
        said += lines
        # the speaker exits at once; the others give torchrun time to see its exit first
        assert (waited == 0) if rank == 0 else (waited >= 1.0), (rank, waited)
    assert said == [LINE]


def test_each_node_says_it_once(monkeypatch, capsys):
    """Two nodes of two processes: node 1's log (its own torchrun, its own terminal) gets the line
    from its LOCAL_RANK 0, although that process is RANK 2."""
    said = {}
    for rank, local in ((0, 0), (1, 1), (2, 0), (3, 1)):
        _rank_env(monkeypatch, rank, local, 4)
        code, lines, _ = _run_rank(monkeypatch, capsys, _bad_flag)
        assert code == 2
        said[rank] = lines
    assert said == {0: [LINE], 1: [], 2: [LINE], 3: []}


@pytest.mark.parametrize("env", [
    (None, None, None),    # no torchrun
    (1, None, 2),          # RANK set by hand, no LOCAL_RANK: not torchrun's layout
    (None, 1, 2),          # LOCAL_RANK without RANK (init_runtime refuses it)
    (3, 3, 2),             # inconsistent: init_runtime refuses it, maybe on this rank alone
    ("two", "x", 2),       # not integers
])
def test_a_process_outside_a_consistent_torchrun_always_says_it(monkeypatch, capsys, env):
    _rank_env(monkeypatch, *env)
    code, lines, waited = _run_rank(monkeypatch, capsys, _bad_flag)
    assert (code, lines, waited) == (2, [LINE], 0)


def test_a_shared_run_error_is_said_once_when_torchrun_tears_the_job_down(monkeypatch, capsys):
    """An error found in run() (--device cuda without a GPU): the speaker says it at once; another
    rank waits, and torchrun, seeing the speaker's exit, ends it there, unsaid."""
    def run():
        raise RequestError("--device cuda: no CUDA device is visible")

    _rank_env(monkeypatch, 0, 0, 2)
    assert _run_rank(monkeypatch, capsys, lambda: None, run)[:2] == (2, ["base_train: error: --device cuda: no CUDA device is visible"])

    def torn_down(seconds):
        assert seconds >= 1.0
        raise _TornDown

    _rank_env(monkeypatch, 1, 1, 2)
    assert _run_rank(monkeypatch, capsys, lambda: None, run, sleep=torn_down)[:2] == ("torn down", [])


def test_a_run_error_of_one_rank_alone_is_still_said(monkeypatch, capsys):
    """A damaged file that only rank 1 reads: nobody tears rank 1 down, so after the wait it says
    its error itself and exits 2 (rank 0 may be waiting for it in a collective)."""
    def run():
        raise RequestError("optimizer shard rank 1: sha256 mismatch")

    _rank_env(monkeypatch, 1, 1, 2)
    code, lines, waited = _run_rank(monkeypatch, capsys, lambda: None, run)
    assert (code, lines) == (2, ["base_train: error: optimizer shard rank 1: sha256 mismatch"]) and waited >= 1.0


def test_a_stop_is_still_said_by_rank_0_alone_without_waiting(monkeypatch, capsys):
    class Stop(RequestError):
        exit_code = 143

    def run():
        raise Stop("stopped by SIGTERM at step 5")

    said = []
    for rank in range(2):
        _rank_env(monkeypatch, rank, rank, 2)
        code, lines, waited = _run_rank(monkeypatch, capsys, lambda: None, run)
        assert (code, waited) == (143, 0)
        said += lines
    assert said == ["base_train: error: stopped by SIGTERM at step 5"]


# ------------------------------------------------------------------------------ README <-> code

import re   # noqa: E402
from pathlib import Path   # noqa: E402

from test_docs_commands import check_command, run_check, split_argv, unknown_flags   # noqa: E402

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
# a span in a benchmark's row that names another command's flag, not the benchmark's own
OTHER_COMMANDS_FLAG = {("bench_int8", "--quantize int8")}   # "`--quantize int8`'s decode products"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOCHAT_BASE_DIR", str(tmp_path / "base"))
    return monkeypatch


def _benchmark_rows() -> list[tuple[str, str]]:
    table = README.split("| script | read it as |", 1)[1].split("\n\n", 1)[0]
    rows = [re.match(r"^\| `python -m scripts\.(\w+)[^`]*` \| (.*) \|$", line) for line in table.splitlines()[2:]]
    assert all(rows), "a benchmarks-table row that does not start with `python -m scripts.NAME`"
    return [m.groups() for m in rows]


def test_the_benchmark_tables_flags_are_their_scripts(isolated):
    """A flag a benchmark's row names in prose (`--burn-in 120`, `--x live,const,none`) exists in
    that script's parser, and where the span gives a whole value, the script's check accepts it;
    test_docs_commands checks only spans that start with a command."""
    rows = _benchmark_rows()
    assert len(rows) >= 20, rows
    checked, failures = 0, []
    for name, text in rows:
        for span in re.findall(r"`([^`]+)`", text):
            if not span.startswith("-") or (name, span) in OTHER_COMMANDS_FLAG:
                continue
            flags = re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", span)
            whole = len(span.split()) > 1 and "..." not in span   # a flag with its value(s)
            try:
                _, parsers, _ = run_check(f"scripts.{name}", [], isolated)
            except Exception as e:   # a check refusing this machine (no CUDA) still ran its parsers
                parsers = e.parsers
            missing = unknown_flags(flags, parsers)
            why = (f"no such flag: {missing}" if missing else
                   whole and next(filter(None, (check_command(f"scripts.{name}", argv, isolated)
                                                for argv in split_argv(span))), None))
            failures += [f"{name}: `{span}`: {why}"] if why else []
            checked += 1
    assert checked >= 25, checked
    assert not failures, "README benchmark rows name flags or values their scripts refuse:\n" + "\n".join(failures)


MAIN_FLAG_LISTS = [   # (the main-flags table row, its script, the flag whose `a|b|c` list it gives)
    ("base_train", "base_train", "--precision"), ("base_train", "base_train", "--fp8-wgrad"),
    ("base_train", "base_train", "--kernel"), ("base_train", "base_train", "--recipe"),
    ("base_eval", "base_eval", "-i"), ("chat_eval", "chat_eval", "--decode"),
    ("chat", "chat_web", "--graph-step"), ("data", "dataset", "--source"),
]


@pytest.mark.parametrize("row, script, flag", MAIN_FLAG_LISTS)
def test_the_main_flags_tables_value_lists_are_the_codes(isolated, row, script, flag):
    """`--kernel current|liger|triton` in the README is exactly what the script accepts: a value
    the code added or dropped makes the README's list stale."""
    table = README.split("| stage | main flags |", 1)[1].split("\n\n", 1)[0]
    cells = dict(re.findall(r"^\| ([a-z_ /]+) \| (.*) \|$", table, re.M))
    listed = re.search(rf"(?<![\w-]){re.escape(flag)} ([\w-]+(?:\|[\w-]+)+)", cells[row])
    assert listed, (row, flag)
    argv = (["-i", "sft"] if script == "chat_eval" else []) + [flag, "nope"]
    with pytest.raises(ValueError) as refused:
        if script == "dataset":   # python -m nanochat.dataset: its check is parse_args
            from nanochat.dataset import parse_args
            parse_args(argv)
        else:
            run_check(f"scripts.{script}", argv, isolated)
    accepted = re.search(r"accepted: ([\w|-]+)", str(refused.value))
    assert accepted and accepted[1] == listed[1], (str(refused.value), listed[1])
