"""The optional experiment tracker: wandb when asked for (offline by default for a named run),
otherwise a no-op that imports nothing. Shared by every training recipe. wandb.init refusing (no
API key for online, a full disk) is an error naming --wandb, before the first step; a log or finish
that raises hours in warns once and turns the tracker off: it never ends a training run.

A stopped and resumed run is one wandb run: the checkpoint's loop state keeps the run's id and mode
(`state_dict`, saved by nanochat/loop.py under "tracker"), and the resume passes that loop state
back (`resume_state`): wandb.init(id=..., resume="allow"). A fresh start (also --overwrite, or
--resume auto starting afresh) has no such state and starts a new wandb run; so does a resume from
an older step than the directory's latest (`branch`: the later steps belong to the run it left).
wandb does not resume offline runs itself: each offline segment is a directory of its own under
<dir>/wandb named with the shared id, synced into one run with `wandb sync`.

The charts' x-axis is the training step, logged as the metric "step" (STEP_METRIC), never wandb's
own step: that one only grows, and a resume restarts from its checkpoint, so the steps a stopped run
logged after its last checkpoint come again (_plot_against_the_training_step says why)."""

from __future__ import annotations

import contextlib

import sys

from nanochat.errors import RequestError
from nanochat.flags import require

WANDB_MODES = ("off", "offline", "online")
STATE_KEY = "tracker"   # the loop state's entry that holds state_dict() (nanochat/loop.py)
STEP_METRIC = "step"    # every logged row's training step: the x-axis of every chart


class WandbInitError(RequestError, RuntimeError):
    """wandb.init refused what --wandb asked for: the scripts print it as one line (script_main)."""


def resolve_wandb_mode(wandb_flag: str | None, run: str) -> str:
    """--wandb wins; without it a real --run name means offline logging and "dummy" means off."""
    if wandb_flag is not None:
        require(wandb_flag in WANDB_MODES, "--wandb", wandb_flag, "|".join(WANDB_MODES))
        return wandb_flag
    return "off" if run in ("dummy", "", None) else "offline"


def check_wandb_available(mode: str) -> None:
    """Fail before any expensive work when wandb logging is on but the package is missing."""
    if mode == "off":
        return
    import importlib.util
    if importlib.util.find_spec("wandb") is None:
        raise ValueError(f"--wandb {mode}: the wandb package is not installed; "
                         "`uv pip install wandb` (extra [wandb]) or use --wandb off")


def check_wandb_flags(wandb_flag: str | None, run: str) -> str:
    """The wandb mode of --wandb / --run, checked before any expensive work; the error names the
    flag the user gave (a --run name alone turns logging on, so the fault is not a --wandb flag)."""
    mode = resolve_wandb_mode(wandb_flag, run)
    try:
        check_wandb_available(mode)
    except ValueError:
        if wandb_flag is not None:
            raise
        raise ValueError(f"--run {run}: a run name turns on wandb logging ({mode}), and the wandb package is not "
                         "installed; `uv pip install wandb` (extra [wandb]), or add --wandb off to train "
                         "without it") from None
    return mode


def _saved_run(resume_state: dict | None) -> dict | None:
    """The wandb run a checkpoint's loop state names ({"id", "mode", ...}), None when it names none
    (a checkpoint saved with tracking off, or by an older version)."""
    saved = (resume_state or {}).get(STATE_KEY)
    return saved if isinstance(saved, dict) and isinstance(saved.get("id"), str) and saved["id"] else None


class Tracker:
    """wandb when on (imported only then), otherwise a no-op; only rank 0 ever logs.

    `resume_state`: the loop state of the checkpoint a resumed run continues (None: a fresh run);
    `branch`: that checkpoint is older than the directory's latest, so the resume starts a new wandb
    run. Without --run (name None or "dummy") wandb names the run itself; describe() says which."""

    def __init__(self, mode: str = "off", *, run: str | None = None, project: str = "nanochat",
                 config: dict | None = None, is_master: bool = True, directory: str | None = None,
                 resume_state: dict | None = None, branch: bool = False):
        self._run = None
        require(mode in WANDB_MODES, "--wandb", mode, "|".join(WANDB_MODES))
        self.mode, self.name = mode, None if run in (None, "", "dummy") else run
        saved = _saved_run(resume_state)
        # what the next checkpoint keeps: the checkpoint's run, carried through a segment that logs
        # nothing (a later resume with logging on continues it), never a branch's (the run it left)
        self._state = None if branch else saved
        self._continued: str | None = None   # the id of the checkpoint's run this process logs to
        self._is_master = is_master
        if not is_master:
            return
        if mode == "off":
            if saved is not None and not branch:
                _note(f"the checkpoint's wandb run {saved['id']} ({saved.get('mode')}) gets no steps from this "
                      "segment (--wandb off, or no --run): resume with its --run / --wandb to continue it")
            return
        check_wandb_available(mode)
        import wandb
        kwargs = dict(project=project, name=self.name, config=config, mode=mode, dir=directory)
        if saved is not None and not branch:
            # the same run: allow_val_change, as a resume may change flags (the resume flag itself)
            kwargs.update(id=saved["id"], resume="allow", allow_val_change=True)
        try:
            self._run = wandb.init(**kwargs)
        except Exception as e:   # wandb's own errors (UsageError, CommError, ...) share no base class
            # asked for and not met, before the first step: said now (nothing is lost yet), not hours
            # later as a run without its tracking
            raise WandbInitError(f"--wandb {mode}: wandb.init failed ({type(e).__name__}: {e}); fix that (e.g. "
                               "`wandb login` for online), or pass --wandb off to train without it") from e
        try:
            _plot_against_the_training_step(self._run)
        except Exception as e:   # the run is open: closed as failed, not left running empty online
            run, self._run = self._run, None
            with contextlib.suppress(Exception):
                run.finish(exit_code=1)
            raise WandbInitError(f"--wandb {mode}: wandb.define_metric failed ({type(e).__name__}: {e}), "
                                 "so resumed steps could not be kept; update wandb (>= 0.17.2), or pass --wandb "
                                 "off to train without it") from e
        run_id = getattr(self._run, "id", None)
        self._state = {"id": run_id, "mode": mode, "project": project} if isinstance(run_id, str) and run_id else None
        self.name = self.name or getattr(self._run, "name", None) or None
        if saved is not None and not branch:
            self._continued = saved["id"]
            _note(self._continue_note(saved, directory))
        elif saved is not None:
            _note(f"a resume from an older step than the latest starts a new wandb run{self._id_text()}; the "
                  f"checkpoint's run {saved['id']} keeps the steps of the run it branches from")

    def _id_text(self) -> str:
        return f" (id {self._state['id']})" if self._state else ""

    def _continue_note(self, saved: dict, directory: str | None) -> str:
        text = f"continuing the checkpoint's wandb run {saved['id']} ({self.mode})"
        if saved.get("mode") != self.mode:
            text += f"; its earlier segments logged {saved.get('mode')}"
        if "offline" in (self.mode, saved.get("mode")):
            where = f"{directory}/wandb" if directory else "./wandb"
            text += (f"; each offline segment is a directory of its own (offline-run-*-{saved['id']} under "
                     f"{where}): `wandb sync` them oldest first to see the whole run")
        return text

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def describe(self) -> str:
        """The banner's tracking row: the mode, the run's name (or that wandb names it: no --run) and
        id, and whether it continues the checkpoint's run."""
        if self.mode == "off":
            return "wandb off"
        if not self._is_master:
            return f"wandb {self.mode} (rank 0 logs)"
        name = f"run {self.name}" if self.name else "an unnamed run (no --run: wandb names it)"
        cont = ", continuing the checkpoint's run" if self._continued else ""
        return f"wandb {self.mode}, {name}{self._id_text()}{cont}"

    def state_dict(self) -> dict | None:
        """What a checkpoint keeps so that its resume logs to the same wandb run (None: no run)."""
        return dict(self._state) if self._state else None

    def _give_up(self, what: str, error: Exception) -> None:
        """Tracking off for the rest of the run, said once: the training goes on without it."""
        self._run = None
        print(f"WARNING: {what}: {type(error).__name__}: {error}; training goes on without wandb logging "
              "(the log lines and report/metrics_<stage>.jsonl still record every step)", file=sys.stderr, flush=True)

    def log(self, data: dict, step: int) -> None:
        """One row at training step `step`, carried as the x-axis metric (not wandb's step=: a resume
        logs again the steps after its checkpoint, and wandb drops a step= below its current one)."""
        if self._run is not None:
            try:
                self._run.log({**{k: v for k, v in data.items() if v is not None}, STEP_METRIC: step})
            except Exception as e:
                self._give_up(f"wandb log at step {step} failed", e)

    def finish(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            try:
                run.finish()
            except Exception as e:
                self._give_up("wandb finish failed", e)


def _plot_against_the_training_step(run) -> None:
    """Every metric of the run plotted against STEP_METRIC, a value of the row, not wandb's own step.

    wandb keeps a row only if its step= is at least the run's current step, and a resumed online run
    starts at the last step it logged + 1. A run stopped after its checkpoint at step N had logged up
    to M; the resume trains N+1..M again, and with step= wandb dropped those M-N rows ("Tried to log
    to step N+1 that is less than the current step M+1 ... this data will be ignored"). Offline,
    `wandb sync` keeps a later segment's rows but numbers them on from the run's last step, so its
    charts are shifted by M-N. (Seen with wandb 0.31.0, online against a local stand-in server.)
    A custom x-axis (define_metric with step_metric, wandb's documented way to log out of order) keeps
    every row, online and offline, with any wandb >= 0.17.2 (pyproject's floor: 0.17.0-0.17.1 fail to
    import with NumPy 2; checked with 0.17.2 and 0.31.0). wandb's rewind (resume_from="<id>?_step=N") would drop the stale steps instead, but it
    is not in 0.17.0, is beta in 0.31 and is the server's work (a RewindRun call, made at `wandb sync`
    for an offline run) that a server may refuse. The re-trained steps' earlier rows stay in the
    history, so a chart shows both values at steps N+1..M."""
    run.define_metric(STEP_METRIC)
    run.define_metric("*", step_metric=STEP_METRIC)


def _note(text: str) -> None:
    """One line (rank 0 only: only the master's Tracker gets here)."""
    print(f"wandb: {text}", flush=True)
