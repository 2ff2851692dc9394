"""Command-line flags shared by every script: `FlagParser` (argparse that raises instead of
exiting and accepts `--under_score` spellings) and the validation primitives `require`,
`require_int`, `require_float`, which raise RequestError('--flag: got X; accepted: ...'); and a
script's `__main__` (`script_main`, `run_cli`): a user error prints one line and exits 2, a Ctrl-C
one line too (exit 130, by SIGINT). Nothing here imports torch, so a bad flag is reported before
the seconds torch takes to import."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from nanochat.errors import RequestError


def normalize_flags(argv: Sequence[str]) -> list[str]:
    """Accept `--under_score` spellings of `--dash-names` (also `--a_b=value`) and `--run-name` for
    `--run` (torchrun on Python 3.11 claims `--run` as a prefix of its `--run-path`). Values and
    positional arguments are left alone."""
    out = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, sep, value = arg.partition("=")
            name = name.replace("_", "-")
            arg = ("--run" if name == "--run-name" else name) + sep + value
        out.append(arg)
    return out


class FlagParser(argparse.ArgumentParser):
    """argparse that raises ValueError (naming the flag) instead of exiting, so recipes validate
    flags as data; accepts `--under_score` spellings of every `--dash-name`."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # no silent prefix matching of flag names
        super().__init__(*args, **kwargs)

    def add_argument(self, *names, **kwargs):
        return super().add_argument(*_dashed(names), **kwargs)

    def add_argument_group(self, *args, **kwargs):
        return _dash_declarations(super().add_argument_group(*args, **kwargs))

    def add_mutually_exclusive_group(self, **kwargs):
        return _dash_declarations(super().add_mutually_exclusive_group(**kwargs))

    def error(self, message: str):
        raise ValueError(message + _accepted_hint(message))

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_args(normalize_flags(args), namespace)


def _dashed(names: tuple) -> tuple:
    """Declared long flags in their dash spelling: the command line reaches argparse with dashes
    (normalize_flags), so a flag declared with an underscore ("--" + field.name) could be given in
    neither spelling. argparse derives the same dest from either."""
    # dict.fromkeys: a flag declared in both spellings ("--seq-len", "--seq_len") is one name, not
    # two identical ones in --help and in argparse's messages
    return tuple(dict.fromkeys(n.replace("_", "-") if isinstance(n, str) and n.startswith("--") else n
                               for n in names))


def _dash_declarations(group):
    """An argument group whose add_argument (and nested groups) declare flags as FlagParser does."""
    add, nested = group.add_argument, group.add_mutually_exclusive_group
    group.add_argument = lambda *names, **kwargs: add(*_dashed(names), **kwargs)
    group.add_mutually_exclusive_group = lambda **kwargs: _dash_declarations(nested(**kwargs))
    return group


def _accepted_hint(message: str) -> str:
    """What argparse's own messages leave out: the accepted values. `--compile=1` (a flag that takes
    no value: store_true, or a BooleanOptionalAction pair) said only 'ignored explicit argument',
    `--steps ten` only 'invalid int value'; the flag's name is already in argparse's message."""
    m = re.match(r"argument (\S+): ignored explicit argument", message)
    if m:
        return f"; accepted: {' or '.join(m.group(1).split('/'))} alone, with no value"
    for kind, accepted in (("int", "an integer"), ("float", "a number")):
        if re.match(rf"argument \S+: invalid {kind} value", message):
            return f"; accepted: {accepted}"
    return ""


def require(ok: bool, flag: str, got: Any, accepted: str) -> None:
    """The one validation primitive: ValueError('--flag: got X; accepted: ...')."""
    if not ok:
        raise RequestError(f"{flag}: got {got!r}; accepted: {accepted}")


def check_model_tag(tag: str | None, flag: str = "--model-tag", new: bool = False) -> None:
    """A model tag names a directory under checkpoints/<phase>/: no path separators, no '.' or '..'.
    `new` (a run that writes under the tag): no leading '-' either, as every printed next / resume
    command passes it as `--model-tag TAG`, which argparse reads as a flag; a reader still opens such
    a tag made before the rule. None (the script's default) passes."""
    first = "[A-Za-z0-9_.]" if new else "[A-Za-z0-9_.\\-]"
    ok = tag is None or (isinstance(tag, str) and tag not in (".", "..") and re.fullmatch(first + r"[A-Za-z0-9_.\-]*", tag))
    require(bool(ok), flag, tag, "letters, digits, '_', '-', '.' (a directory name" + (" not starting with '-')" if new else ")"))


def _nearest_existing(path: str) -> str:
    """The longest prefix of `path` (absolute) that exists: what creating the rest depends on."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


# Path("") is ".": `--out "$DIR"` with DIR unset wrote into (or read) the current directory
_NOT_EMPTY = "a path; an empty value (an unset shell variable?) is not the current directory"


def check_dir_flag(path: str | os.PathLike | None, flag: str, accepted: str) -> None:
    """An input directory flag: None passes; an empty value or anything but an existing directory
    is a RequestError naming `flag` and `accepted`."""
    if path is not None:
        require(bool(str(path).strip()), flag, str(path), f"{accepted} ({_NOT_EMPTY})")
        require(Path(path).is_dir(), flag, str(path), accepted)


def check_output_file(path: str | None, flag: str) -> None:
    """A file a script writes when its work is done: checked before the work. Not a directory, and
    its nearest existing parent is a writable directory (the rest is created). None passes."""
    if path is None:
        return
    require(bool(str(path).strip()), flag, path, _NOT_EMPTY)
    target = os.path.abspath(path)
    require(not os.path.isdir(target), flag, path, "a file path (this is a directory)")
    parent = _nearest_existing(os.path.dirname(target))
    require(_writable_dir(parent), flag, path, f"a path in a writable directory ({parent} is not one)")


def check_out_dir(out: str | os.PathLike, flag: str = "--out") -> Path:
    """`out` as a Path if it is a directory or can be made one (RequestError naming the flag
    otherwise), so that a command refuses a file given as --out before any work, not with a
    traceback after it."""
    require(bool(str(out).strip()), flag, str(out), f"a directory ({_NOT_EMPTY})")
    target = os.path.abspath(out)
    parent = _nearest_existing(target)
    if not os.path.isdir(parent):
        what = "is a file" if parent == target else f"cannot be created: {parent} is a file"
        raise RequestError(f"{flag}: got {str(out)!r}, which {what}; accepted: a directory (existing "
                           "or one that can be created)")
    if not _writable_dir(parent):
        raise RequestError(f"{flag}: got {str(out)!r}, but {parent} is not writable; accepted: a "
                           "directory you can write to")
    return Path(out)


def require_int(value: Any, flag: str, low: int = 1, allow: Sequence[int] = ()) -> None:
    ok = (isinstance(value, int) and not isinstance(value, bool) and (value >= low or value in allow))
    extra = f" (or {'/'.join(map(str, allow))})" if allow else ""
    require(ok, flag, value, f"an integer >= {low}{extra}")


def require_float(value: Any, flag: str, low: float = 0.0, high: float = math.inf,
                  low_inclusive: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value >= low if low_inclusive else value > low) and value <= high
    bound = ">=" if low_inclusive else ">"
    require(ok, flag, value, f"a finite number {bound} {low}" + (f" and <= {high}" if high < math.inf else ""))


# ------------------------------------------------------------------------------------ __main__

def script_main(name: str, check, run) -> None:
    """The `if __name__ == "__main__"` of a recipe script: check() parses and validates the command
    line (any ValueError there is a bad flag), then run() does the work (a RequestError there is a
    request that this machine or its files cannot meet: nanochat/errors.py). Either prints
    `<name>: error: <message>` and exits 2, with no traceback; run()'s int return value is the
    exit code (anything else: 0). Under torchrun every rank exits so, and the line is said once
    per node, not once per rank (_exit_with_error).

    Ctrl-C (a KeyboardInterrupt reaching here: any script's first one, or a training run's second,
    nanochat/loop.py) prints `<name>: interrupted` instead of a traceback, and the process then
    ends as Python ends it on an uncaught Ctrl-C: after its normal shutdown (buffered output
    flushed, atexit handlers run), killed by SIGINT, which a shell reports as exit code 130. Not
    sys.exit(130): bash carries on with the next command of a script or `a; b` after a child
    that exited, even with 130, but stops after one that died of SIGINT.

    A closed stdout (`... | head`) ends run() quietly with exit code 141, as SIGPIPE would."""
    try:
        try:
            check()
        except ValueError as e:
            _exit_with_error(name, e, same_on_every_rank=True)
        try:
            code = run()
            sys.stdout.flush()   # here, not at exit, where a closed pipe is an "Exception ignored" message
        except RequestError as e:
            _exit_with_error(name, e)
        except BrokenPipeError:   # stdout's reader went away (`... | head`): stop quietly, as `git log | head`
            if not _stdout_gone():
                raise   # another pipe (a worker's, a subprocess's): a real error, with its traceback
            _silence_stdout()
            code = 141            # what a shell reports for a writer ended by SIGPIPE
        sys.exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)
    except KeyboardInterrupt as interrupt:
        _say_interrupted(name, interrupt)
        raise   # no traceback (_say_interrupted's hook); Python exits by SIGINT


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports POLLERR on its write end): only
    then is a BrokenPipeError the closed-stdout case; elsewhere poll is missing and it counts as gone."""
    import select
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # a test's capture: no descriptor to ask
        return False
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def _silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null: the flush at exit then has nowhere broken to
    write, and raises no second BrokenPipeError. A stream without one (a test's capture) is left."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):   # io.UnsupportedOperation is both of the latter
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


_SAID = "_nanochat_said"   # set on an error once _exit_with_error has printed it
# How long a torchrun rank that is not its node's speaker waits before its error exit: torchrun
# tears the job down (SIGTERM) within its 0.1 s monitor interval of the speaker's exit, so the
# speaker's line is the one said. A rank that exited at once could instead get the speaker
# killed before it printed, and the user would see no line at all.
SPEAKER_GRACE_S = 3.0


def _speaks_for_its_node() -> bool:
    """Whether this process says an error that every rank may share: every process outside
    torchrun, and under it LOCAL_RANK 0 (so each node's own log gets the line). The variables are
    read as nanochat.common's _torchrun_position reads them, without importing torch; where they
    are malformed or inconsistent (which that function refuses, maybe on this rank alone) this
    process speaks, so that no error goes unsaid."""
    env = os.environ
    if "LOCAL_RANK" not in env:
        return True
    try:
        world, rank, local = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0")), int(env["LOCAL_RANK"])
    except ValueError:
        return True
    consistent = "RANK" in env and 0 <= rank < world and 0 <= local < world
    return local == 0 or not consistent


def _exit_with_error(name: str, error: Exception, same_on_every_rank: bool = False) -> None:
    """Print `<name>: error: <message>` and exit 2 (or the stop's exit_code). Under torchrun a stop
    (exit_code set) is said by rank 0; a bad flag (`same_on_every_rank`: every rank checks the same
    command line) by each node's speaker, the others waiting SPEAKER_GRACE_S and exiting 2 unsaid;
    any other error by the speaker at once and by the other ranks after that wait, if torchrun has
    not ended them by then (the error was theirs alone, e.g. a damaged shard of theirs)."""
    # marked first: a Ctrl-C that lands during the print is handled once it returns (_say_interrupted)
    setattr(error, _SAID, True)
    _post_before_the_group(name, error)
    if hasattr(error, "exit_code"):
        say = os.environ.get("RANK", "0") == "0"
    elif _speaks_for_its_node():
        say = True
    else:
        time.sleep(SPEAKER_GRACE_S)
        say = not same_on_every_rank
    if say:
        print(f"{name}: error: {error}", file=sys.stderr)
    sys.exit(getattr(error, "exit_code", 2))   # 2, or e.g. 143 for a run stopped by SIGTERM


def _post_before_the_group(name: str, error: Exception) -> None:
    """Under torchrun, an error before the process group formed (a flag or --data-dir refused on
    this node only) is left on the launch's store: the other nodes' start-up roll call raises it at
    once instead of waiting NANOCHAT_DIST_TIMEOUT for this rank (nanochat/roll_call.py)."""
    if "RANK" not in os.environ or hasattr(error, "exit_code") or getattr(error, "start_failure_posted", False):
        return
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():   # past the roll call: the group's own errors tell
        return
    from nanochat.roll_call import post_start_failure
    post_start_failure(f"{name}: error: {error}")


def _say_interrupted(name: str, interrupt: KeyboardInterrupt) -> None:
    """One line for a Ctrl-C, from rank 0 (the terminal sends it to every rank), after what the
    script printed; and a sys.excepthook that prints nothing for this interrupt, so that it can
    still end the process the way Python ends an uncaught one (by SIGINT, after the shutdown).

    A training run ends with a stop, a RequestError with an exit_code: StopRequested (a first
    Ctrl-C or a SIGTERM, raised after the checkpoint is saved) or NonFiniteLossError. A second
    Ctrl-C that arrives before the stop's line is said (nanochat/loop.py restoring its handlers, or
    _exit_with_error printing) has the stop as its context, and the line (where it saved, how to
    continue) is said here instead."""
    stop = interrupt.__context__
    while stop is not None and not (isinstance(stop, RequestError) and hasattr(stop, "exit_code")):
        stop = stop.__context__
    try:
        sys.stdout.flush()   # stdout first: in a log that holds both, the line comes last
    except (OSError, ValueError):   # a terminal gone (EIO, EPIPE) or a closed stream: say it anyway
        pass
    if os.environ.get("RANK", "0") == "0":
        try:
            if stop is not None and not getattr(stop, _SAID, False):
                print(f"{name}: error: {stop}", file=sys.stderr)
            print(f"{name}: interrupted", file=sys.stderr)
        except (OSError, ValueError):
            pass
    previous = sys.excepthook

    def quiet(kind, value, tb):
        if value is not interrupt:
            previous(kind, value, tb)
    sys.excepthook = quiet


def run_cli(main) -> None:
    """Run a command-line `main()` and exit with its code; user errors print one line, exit 2."""
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
