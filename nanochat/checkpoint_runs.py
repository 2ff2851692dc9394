"""A fresh run in a checkpoint directory that holds an earlier run's checkpoints: refused, or (with
--overwrite, or --resume auto starting fresh) that run moved into earlier_runs/<N>/ at the new run's
first save, so two runs' steps never mix. It is kept there, never deleted: --overwrite in a command
rerun from the shell's history (or a Ctrl-C of the new run, whose stop saves) cost the earlier run,
days of pretraining at d20; the banner names the folder and its size, and the user deletes it.
checkpoint.py re-exports EarlierRun and fresh_start, and the checks of the flags that choose between
continuing the checkpoints there and starting afresh (check_resume_flags, resolve_resume).
Only the earlier run's step directories, latest.json and step_N.old-* leftovers move: anything else
in the directory (the running writer's .writer.lock, earlier_runs/ itself) stays where it is. A step
held only as the old copy of a re-save killed between its two renames (step_N.old-PID, which a read
of step N renames back) is that run's step N in every decision here (run_steps) and moves as step_N.
A move goes through earlier_runs/<N>.moving, renamed to <N> once complete (a move cut short is
finished by the next one: <N>.moving holds a record of the steps it is for, MOVE_RECORD).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable

from nanochat.checkpoint_io import (LATEST_NAME, CheckpointError, cut_short_saves, fsync_dir, list_steps,
                                    readable_step_dir, step_dirname, swapped_out_copy, sweep_superseded,
                                    write_json)
from nanochat.common import fmt_bytes, print0
from nanochat.distributed import rank_failures
from nanochat.errors import RequestError
from nanochat.flags import require

EARLIER_RUNS = "earlier_runs"             # runs a fresh start moved aside: earlier_runs/<N>/step_*
MOVE_RECORD = ".move.json"                # in earlier_runs/<N>.moving: {"steps": [...], "after": N|null}


class EarlierRun:
    """The checkpoints of an earlier run in the directory a fresh run saves to. Left as they are
    until the new run's first save (a run that fails before it, a bad flag found late or an OOM at
    the first step, touches nothing), then moved into earlier_runs/<N>/ and kept (`flag`: what
    started the fresh run, --overwrite or --resume auto over a run it cannot continue, for the
    messages). Never left to mix with the new run's saves: --keep-last's pruning, a later --resume
    STEP and a re-save at a step both wrote would each take the other run's checkpoints for this one's."""

    def __init__(self, ckpt_dir, steps: list[int], flag: str = "--resume auto", after: int | None = None):
        # after: a resume from that step, the steps past it being the run it branches from's (branch_start)
        self.ckpt_dir, self.steps, self.flag, self.after = Path(ckpt_dir), list(steps), flag, after

    def _what(self, steps: list[int], size: str = "", where: str = "") -> str:
        if self.after is None:
            return f"the earlier run's checkpoints (steps {steps}{size}){where}"
        return f"the checkpoints after step {self.after}{where} (steps {steps}{size}: the run this one branches from)"

    def describe(self) -> str:
        """The banner's words: which steps go where, and what they hold on the disk."""
        where = _earlier_run_dirs(self.ckpt_dir, self.steps, self.after)[1]
        size = f", {fmt_bytes(steps_bytes(self.ckpt_dir, self.steps))}"
        return (f"{self.flag}: {self._what(self.steps, size, f' in {self.ckpt_dir}')} are moved to {where} at this "
                "run's first save and kept there (delete that folder once you no longer need them)")

    def room_note(self) -> str:
        """For a disk short of room (disk_plan): the earlier run's checkpoints stay on it, moved and
        kept, so they free nothing; without this the first --overwrite on a full disk named no
        folder at all (earlier_runs/ does not exist yet). "" once they are moved (or none)."""
        if not self.steps:
            return ""
        where = _earlier_run_dirs(self.ckpt_dir, self.steps, self.after)[1]
        size = f", {fmt_bytes(steps_bytes(self.ckpt_dir, self.steps))}"
        return (f"; {self.flag} frees none of it: {self._what(self.steps, size, f' in {self.ckpt_dir}')} stay on "
                f"this disk, moved to {where} and kept (delete the ones you no longer need)")

    def settle(self, is_master: bool = True) -> Path | None:
        """Move the earlier run aside (collective; once). latest.json goes first, so an
        interruption midway never leaves it naming a step that is gone. Returns where they went."""
        if not self.steps:
            return None
        steps, self.steps, moved_to, error = self.steps, [], None, None
        if is_master:
            try:
                moved_to = self._settle_here(steps)
            except Exception as e:   # the other ranks waited at a barrier for it (a hang): they are told
                error = e
        failed = rank_failures(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"rank 0 could not move {self._what(steps, where=f' in {self.ckpt_dir}')} aside: "
                                  f"{failed[0]}")
        return moved_to

    def _settle_here(self, steps: list[int]) -> Path | None:
        """settle()'s work, on rank 0. A move that fails (a disk that refuses even a directory) is one
        CheckpointError, not a traceback: nothing is lost, and the next move finishes it."""
        latest = self.ckpt_dir / LATEST_NAME
        sweep_superseded(self.ckpt_dir)   # the earlier run's leftovers: restorable once its steps are gone
        # a step that a re-save cut between its two renames left only as step_N.old-PID moves as step_N
        # (what a read restores); other old copies of the run's steps (no meta.json: a deletion cut
        # short) go along as they are (else a later read of this run's step N could restore one)
        sources = {step: readable_step_dir(self.ckpt_dir, step) for step in steps}
        orphans = [p for p in sorted(self.ckpt_dir.glob("step_*.old-*"))
                   if self._moves(_step_of(p.name)) and p not in sources.values()]
        moving, moved_to = _earlier_run_dirs(self.ckpt_dir, steps, self.after)
        try:
            moving.mkdir(parents=True, exist_ok=True)
            _record_move(moving, steps, self.after)
            if latest.is_file() and self._moves(_latest_step(latest)):   # a branch's: only if it names a step moved
                self._move_latest(latest, moving)
            for step, source in sources.items():
                os.replace(source, moving / step_dirname(step))
            for path in orphans:   # restorable there, as here
                os.replace(path, moving / path.name)
            fsync_dir(moving)
            os.replace(moving, moved_to)   # earlier_runs/<N> appears whole, or not at all
        except OSError as e:
            raise CheckpointError(f"{self.flag}: could not move {self._what(steps)} to {moved_to} "
                                  f"({type(e).__name__}: {e}), so this run's checkpoint was not written; they are in "
                                  f"{self.ckpt_dir} or {moving}: make room (or make the disk writable) and rerun the "
                                  "same command, which finishes the move") from e
        with contextlib.suppress(OSError):   # done with (a kill just before leaves only this small file)
            (moved_to / MOVE_RECORD).unlink(missing_ok=True)
        fsync_dir(moved_to.parent)
        print0(f"{self.flag}: moved {self._what(steps)} to {moved_to}; delete it when you no longer need them")
        fsync_dir(self.ckpt_dir)
        return moved_to

    def _move_latest(self, latest: Path, moving: Path) -> None:
        """latest.json into the move. A branch's names a step past `after` (a --resume of an older
        step): the tag is left with a latest.json naming `after`, the step this run resumed from, so
        a first save that then fails (no room) leaves --resume latest|auto this run's start, not no
        record at all (auto: a fresh start). Written before any step moves; if it cannot be, the old
        one is still in place, naming steps that are all still here."""
        kept = moving / LATEST_NAME
        if self.after is None or not readable_step_dir(self.ckpt_dir, self.after).is_dir():
            os.replace(latest, kept)
            return
        # a copy goes with the moved steps, then write_json's atomic replace: the tag has a latest.json
        # at every instant (a kill between a move and the new write left none: --resume auto, what a
        # setup.sh rerun passes, then started the stage afresh)
        shutil.copy2(latest, kept)
        write_json(latest, {"step": self.after, "dir": step_dirname(self.after)})

    def _moves(self, step: int | None) -> bool:
        """Whether the step's files go with this run (every one, unless a branch's: those past `after`)."""
        return self.after is None or (step is not None and step > self.after)


def _earlier_run_dirs(ckpt_dir: Path, steps: list[int], after: int | None = None) -> tuple[Path, Path]:
    """(where the files move, then its final name earlier_runs/<N>). A move cut short (a kill, or a
    disk refusing a rename) left earlier_runs/<N>.moving with the run's first steps (and latest.json,
    moved first where it goes), and its other steps here: they are that run's, and join it (they are
    what the rerun moves next), instead of splitting it over two earlier_runs/<N>. Only then: a step
    the leftover already holds, or a run saved here since (e.g. after the steps here were deleted by
    hand), goes to a new <N>."""
    root = ckpt_dir / EARLIER_RUNS
    numbered = {p: int(m.group(1)) for p in root.glob("*") if (m := re.fullmatch(r"([0-9]+)(\.moving)?", p.name))}
    cut_short = sorted((n, p) for p, n in numbered.items() if p.name.endswith(".moving"))
    n = next((n for n, p in cut_short if _joins(p, ckpt_dir, steps, after)), max(numbered.values(), default=0) + 1)
    return root / f"{n}.moving", root / str(n)


def _joins(leftover: Path, ckpt_dir: Path, steps: list[int], after: int | None) -> bool:
    """Whether `steps` (past `after` for a branch) finish the move cut short in `leftover`. Its record
    lists the steps it was for: each still here must be one, and not in it yet. latest.json here must
    be gone (a fresh start's move takes it first) or, in a branch, name a step at or before `after`
    (one past it was moved, and replaced by one naming `after`; a run saved since names its own)."""
    if any((leftover / step_dirname(step)).exists() for step in steps):
        return False
    if _holds_nothing_moved(leftover):   # cut short before its first rename: nothing to mix with
        return True
    latest = ckpt_dir / LATEST_NAME
    try:
        record = json.loads((leftover / MOVE_RECORD).read_text())
        planned = set(record["steps"])
    except (OSError, ValueError, TypeError, KeyError):   # a move from before the record: latest.json decides
        return not latest.exists()
    if after is not None and record.get("after") == after and not _holds_steps(leftover):
        return set(steps) <= planned   # the same branch, cut short after copying latest.json: nothing else moved
    named = _latest_step(latest) if latest.exists() else None
    return set(steps) <= planned and (not latest.exists() or (after is not None and named is not None
                                                              and named <= after))


def _holds_nothing_moved(moving: Path) -> bool:
    return not any(p.name == LATEST_NAME or p.name.startswith("step_") for p in moving.iterdir())


def _holds_steps(moving: Path) -> bool:
    return any(p.name.startswith("step_") for p in moving.iterdir())


def finish_cut_short_moves(ckpt_dir) -> list[Path]:
    """A move killed after its last step went in, before earlier_runs/<N>.moving became <N>, left
    nothing for a rerun to move (no later step, no earlier run): nothing renamed it, and the folder
    the banner named never appeared. Each such leftover whose record's steps are all in it gets its
    final name now (every start of a recipe; idempotent, and a rank that loses the race to another
    sees it done). Returns the folders named."""
    root = Path(ckpt_dir) / EARLIER_RUNS
    named = []
    for moving in sorted(root.glob("*.moving")) if root.is_dir() else ():
        final = root / moving.name.removesuffix(".moving")
        try:
            steps = json.loads((moving / MOVE_RECORD).read_text())["steps"]
            if final.exists() or not all((moving / step_dirname(int(s))).is_dir() for s in steps):
                continue
            os.replace(moving, final)
            (final / MOVE_RECORD).unlink(missing_ok=True)
        except (OSError, ValueError, TypeError, KeyError):   # no record, unreadable, or another rank's rename
            continue
        print0(f"finished moving an earlier run's checkpoints (steps {steps}) to {final}, cut short before")
        named.append(final)
    return named


def _record_move(moving: Path, steps: list[int], after: int | None) -> None:
    """What earlier_runs/<N>.moving is for, written before anything moves into it (a joined leftover
    keeps its own). A plain write, not write_json's rename: the folder is not in use yet, and an
    unreadable record reads as none."""
    record = moving / MOVE_RECORD
    if not _holds_nothing_moved(moving):
        return
    with open(record, "w") as f:
        f.write(json.dumps({"steps": list(steps), "after": after}))
        f.flush()
        os.fsync(f.fileno())


RESUME_HELP = "latest, a step number, or auto (latest when the model tag has a checkpoint, else a fresh start)"


def _is_step_number(text: str) -> bool:
    # not str.isdigit() alone: "²" is a digit that int() refuses with a message naming no flag
    return text.isascii() and text.isdigit()


def valid_resume(value: str | None) -> bool:
    return value is None or value in ("latest", "auto") or _is_step_number(value)


def check_resume_flags(resume: str | None, overwrite: bool) -> None:
    """--resume's value, and --overwrite only for a fresh start: --resume latest|N continues the
    run it would delete (every training recipe's flags)."""
    require(valid_resume(resume), "--resume", resume, RESUME_HELP)
    if overwrite and resume not in (None, "auto"):   # not require(): "got True" tells a user nothing
        raise RequestError(f"--overwrite cannot be combined with --resume {resume}: --overwrite starts a fresh run "
                           f"(moving this model tag's checkpoints to {EARLIER_RUNS}/<N>/ in it), --resume {resume} "
                           "continues them; drop one of the two (--overwrite is accepted with --resume auto, when it "
                           "starts fresh)")


def resolve_resume(value: str | None, ckpt_dir, log: Callable[[str], Any] = print0) -> str | None:
    """--resume: "auto" -> "latest" when ckpt_dir holds a checkpoint, else None (start fresh), and
    says which: what a rerun of an interrupted stage wants (setup.sh passes it). Other values are
    returned as given."""
    if value != "auto":
        return value
    found = (Path(ckpt_dir) / LATEST_NAME).is_file()
    steps = [] if found else run_steps(ckpt_dir)
    if steps:   # checkpoints, but no record of the newest (e.g. an --overwrite cut short): not guessed
        log(f"--resume auto: {ckpt_dir} holds steps {steps} but no {LATEST_NAME} naming the latest: starting "
            f"fresh; they are moved to {EARLIER_RUNS}/ at this run's first save (--resume STEP continues one of "
            "them instead)")
    elif found:
        log(f"--resume auto: resuming the latest checkpoint in {ckpt_dir}")
    else:   # a first save cut short (killed mid-save) left step_N.partial: no checkpoint, and said so
        cut = cut_short_saves(ckpt_dir)
        note = f"; {step_dirname(cut[-1])}.partial there is a save cut short (killed or crashed mid-save), " \
               "not a checkpoint" if cut else ""
        log(f"--resume auto: no checkpoint yet, starting in {ckpt_dir}{note}")
    return "latest" if found else None


def fresh_start(ckpt_dir, resume: str | None, overwrite: bool) -> EarlierRun | None:
    """A fresh run into a model tag that holds checkpoints would replace them step by step (and its
    final save the earlier run's model). --overwrite, or --resume auto (which chose to start fresh):
    they move to earlier_runs/<N>/ at this run's first save; otherwise refused, naming the ways on.
    None: the directory holds no checkpoints."""
    ckpt_dir = Path(ckpt_dir)
    finish_cut_short_moves(ckpt_dir)
    steps = run_steps(ckpt_dir)
    if not steps:
        return None
    if overwrite or resume == "auto":
        return EarlierRun(ckpt_dir, steps, "--overwrite" if overwrite else "--resume auto")
    how = ("--resume latest (or auto)" if (ckpt_dir / LATEST_NAME).is_file() else
           f"--resume STEP (one of them; no {LATEST_NAME} records the latest)")
    raise CheckpointError(f"{ckpt_dir} holds checkpoints of an earlier run (steps {steps}); a fresh run would "
                          f"overwrite them: pass {how} to continue it, another --model-tag "
                          f"to train a new one, or --overwrite to start afresh (moving them to {EARLIER_RUNS}/<N>/ in "
                          "that directory at its first save)")


def branch_start(ckpt_dir, step: int, flag: str) -> EarlierRun | None:
    """A resume from `step` of a directory that holds later steps (an older step resumed on purpose,
    or a latest.json that a failed update left behind): they are the run this one branches from, and
    its saves replaced them one by one (days of training of that branch gone, the rest mixed with
    this run's: a later --resume N took either). They move to earlier_runs/<N>/ at this run's
    first save, with latest.json where it names one of them. None: no later step."""
    finish_cut_short_moves(ckpt_dir)
    later = [s for s in run_steps(ckpt_dir) if s > step]
    return EarlierRun(ckpt_dir, later, flag, after=step) if later else None


def run_steps(ckpt_dir) -> list[int]:
    """The steps of the run in ckpt_dir, ascending: its complete step_N directories, and each step N
    a re-save killed between its two renames left only as step_N.old-PID (the copy a read of N
    renames back: checkpoint_io.swapped_out_copy). list_steps alone missed that one: a fresh start or
    a branch left it out of the abandoned run, and the new run's save of step N then deleted it."""
    ckpt_dir = Path(ckpt_dir)
    swapped = {s for p in ckpt_dir.glob("step_*.old-*")
               if (s := _step_of(p.name)) is not None and swapped_out_copy(ckpt_dir, s) is not None}
    return sorted(set(list_steps(ckpt_dir)) | swapped)


def _step_of(name: str) -> int | None:
    match = re.match(r"step_(\d+)", name)
    return int(match.group(1)) if match else None


def _latest_step(path: Path) -> int | None:
    """The step a latest.json names (None: unreadable)."""
    try:
        step = json.loads(path.read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if type(step) is int else None


def kept_runs_note(ckpt_dir) -> str:
    """For a disk short of room: ", e.g. by deleting what you no longer need of <dir>/earlier_runs (N GB
    of earlier runs' checkpoints)", where the directory holds one ("" otherwise)."""
    root = Path(ckpt_dir) / EARLIER_RUNS
    if not root.is_dir():
        return ""
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    return f", e.g. by deleting what you no longer need of {root} ({fmt_bytes(size)} of earlier runs' checkpoints)"


def steps_bytes(ckpt_dir, steps: list[int]) -> int:
    """Bytes the given steps' directories hold on disk (a step held as its old copy: the copy's)."""
    return sum(f.stat().st_size for step in steps for f in readable_step_dir(ckpt_dir, step).rglob("*")
               if f.is_file())


def remove_old_step(old: Path, newest: Path, keep_last: int, say=print0) -> None:
    """Delete (rank 0) one old step_N directory beside the newest save (never earlier_runs/<N>/step_N
    or a step_N.partial), unless it is the newest or latest.json names it; a failure is a warning
    (a permission error, a busy NFS file: the old checkpoint is only disk space). loop.py's
    --keep-last; `say` prints (the loop's survives a hung-up terminal)."""
    from nanochat.checkpoint import read_latest, remove_checkpoint   # here: checkpoint imports this module
    from nanochat.errors import RequestError

    match = re.fullmatch(r"step_(\d+)", old.name)
    if old == newest or match is None or old.parent != newest.parent or not old.is_dir():
        return   # not this run's step directory, or gone already (deleted by hand)
    try:
        if read_latest(old.parent) == int(match.group(1)):   # a resume takes it, whatever `kept` says
            say(f"warning: not removing checkpoint {old}: {old.parent / 'latest.json'} names it (--keep-last)")
            return
        remove_checkpoint(old.parent, int(match.group(1)))
    except (OSError, RequestError) as e:   # RequestError: a latest.json that cannot be read
        say(f"warning: could not remove old checkpoint {old} (--keep-last {keep_last}): {type(e).__name__}: "
            f"{e}; training goes on (delete it by hand)")
        return
    say(f"removed checkpoint {old} (--keep-last {keep_last})")
