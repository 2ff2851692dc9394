"""The optional experiment tracker: wandb when asked for (offline by default for a named run),
otherwise a no-op that imports nothing. Shared by every training recipe. wandb.init refusing (no
API key for online, a full disk) is an error naming --wandb, before the first step; a log or finish
that raises hours in warns once and turns the tracker off: it never ends a training run."""

from __future__ import annotations

import sys

from nanochat.errors import RequestError
from nanochat.flags import require

WANDB_MODES = ("off", "offline", "online")


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


class Tracker:
    """wandb when on (imported only then), otherwise a no-op; only rank 0 ever logs."""

    def __init__(self, mode: str = "off", *, run: str | None = None, project: str = "nanochat",
                 config: dict | None = None, is_master: bool = True, directory: str | None = None):
        self._run = None
        require(mode in WANDB_MODES, "--wandb", mode, "|".join(WANDB_MODES))
        if mode == "off" or not is_master:
            return
        check_wandb_available(mode)
        import wandb
        try:
            self._run = wandb.init(project=project, name=None if run in (None, "dummy") else run,
                                   config=config, mode=mode, dir=directory)
        except Exception as e:   # wandb's own errors (UsageError, CommError, ...) share no base class
            # asked for and not met, before the first step: said now (nothing is lost yet), not hours
            # later as a run without its tracking
            raise WandbInitError(f"--wandb {mode}: wandb.init failed ({type(e).__name__}: {e}); fix that (e.g. "
                               "`wandb login` for online), or pass --wandb off to train without it") from e

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def _give_up(self, what: str, error: Exception) -> None:
        """Tracking off for the rest of the run, said once: the training goes on without it."""
        self._run = None
        print(f"WARNING: {what}: {type(error).__name__}: {error}; training goes on without wandb logging "
              "(the log lines and report/metrics_<stage>.jsonl still record every step)", file=sys.stderr, flush=True)

    def log(self, data: dict, step: int) -> None:
        if self._run is not None:
            try:
                self._run.log({k: v for k, v in data.items() if v is not None}, step=step)
            except Exception as e:
                self._give_up(f"wandb log at step {step} failed", e)

    def finish(self) -> None:
        if self._run is not None:
            run, self._run = self._run, None
            try:
                run.finish()
            except Exception as e:
                self._give_up("wandb finish failed", e)
