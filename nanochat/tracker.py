"""The optional experiment tracker: wandb when asked for (offline by default for a named run),
otherwise a no-op that imports nothing. Shared by every training recipe."""

from __future__ import annotations

from nanochat.flags import require

WANDB_MODES = ("off", "offline", "online")


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
        if mode == "off" or not is_master:
            return
        check_wandb_available(mode)
        import wandb
        self._run = wandb.init(project=project, name=None if run in (None, "dummy") else run,
                               config=config, mode=mode, dir=directory)

    @property
    def enabled(self) -> bool:
        return self._run is not None

    def log(self, data: dict, step: int) -> None:
        if self._run is not None:
            self._run.log({k: v for k, v in data.items() if v is not None}, step=step)

    def finish(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
