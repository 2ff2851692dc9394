"""The training loop skeleton every recipe shares (base, mid, SFT, RL): evaluate at intervals,
sample at intervals, save at intervals and at the end, one optimizer step, one log line, tracker
and report metrics. The step itself is a Trainer's (nanochat/training.py, or anything with the
same `step` / `loop_state` / `loader_state` / `note_checkpoint` methods, e.g. RL's trainer).

    spec = LoopSpec("mid", num_iterations, eval_every=100, save=lambda step, loop_state: path)
    result = run_training_loop(trainer, meter, spec, tracker)

Order within a step index s (kept stable: exact resume depends on it): evaluate -> sample ->
save -> trainer.step(s). At s == num_iterations only evaluate/sample/save run (eval and save
always run there when enabled / when a save callback exists). A resumed run passes the loop
state of its checkpoint and continues bit for bit.

SIGTERM (run_train.sh --stop, torchrun passing a stop on, a scheduler) or a first Ctrl-C stops the
run gracefully: the step in flight finishes, a checkpoint is saved at the next step index (as a
periodic save would be; every rank agrees on the step), and StopRequested ends the script with one
line (naming the whole command that continues the run, where the recipe gives LoopSpec.resume_command)
and exit code 128 + the signal's number, so that setup.sh does not mark the stage done. A stop
that arrives during an evaluation or a save stops at that step: no step more, and no second save
(the save in flight is the stop's checkpoint; a step more plus a save could outlast torchrun's
grace). A stop during the last step saves at num_iterations before the final evaluation and
sample, which the resume then runs (check_resume_step). A second Ctrl-C interrupts at once. Under
torchrun, which SIGKILLs its workers a fixed time after passing a stop on (30 s unless set), the
loop's first line says how long that is.

A hangup (SIGHUP: the ssh connection or terminal closed under a foreground run; torchrun passes it
on) stops the run the same way, exit 129. The terminal is gone by then (writes to it fail with EIO,
to a pipe whose reader died with EPIPE), so the process's stdout and stderr, where they are not a
file or /dev/null, move to <base dir>/hangup.log (appended, after a header line): everything after
(the stop line, the save, the script's last line) is there after reconnecting. A failed write to
the terminal without a SIGHUP moves the output so too; a run started with SIGHUP ignored keeps it so.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import re
import select
import shlex
import signal
import stat
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch

from nanochat.common import get_base_dir, print0
from nanochat.errors import RequestError
from nanochat.report import jsonable


# --help text of the flags every training recipe shares (base_train, mid_train, chat_sft, chat_rl);
# each script appends "; default: X"
TRAIN_FLAG_HELP = {
    "save_every": "N: save a checkpoint every N steps; -1 or 0: only the one at the last step (always saved)",
    "keep_last": "N > 0: keep this run's newest N checkpoints, deleting its older ones; 0: keep all",
    "resume": "continue this --model-tag's run: latest, a step number, or auto (latest when there is one it can "
              "continue, else a fresh start that moves the earlier run's checkpoints to earlier_runs/); not "
              "given: a fresh start",
    "overwrite": "let a fresh run start in this --model-tag although it holds checkpoints: they move to "
                 "earlier_runs/<N>/ in it at the new run's first save, and stay there",
    "device": "auto|cpu|cuda|mps (auto: CUDA, else MPS, else the CPU)",
    "dtype": "auto|bf16|fp32 (auto: $NANOCHAT_DTYPE, else bf16 on a GPU that has it, else fp32)",
    "kernel": "current|liger|triton: the loss (and, triton, fused ops) backend",
    "compile": "torch.compile the model",
    "run": "wandb run name: any name but 'dummy' turns wandb logging on (--wandb says how)",
    "wandb": "off|offline|online (not given: offline when --run names a run, else off)",
    "model_tag": "the checkpoint directory's name under checkpoints/<phase>/",
    "grad_clip": "clip the global gradient norm to this; 0: off",
    "num_iterations": "optimizer steps; -1: the stage's own horizon",
    "step": "the step of the checkpoint to start from: latest or a number"}


@dataclass
class LoopSpec:
    """What the loop does besides stepping; every callback is optional."""

    stage: str                                   # base|mid|sft|rl: metrics_<stage>.jsonl, log prefix
    num_iterations: int
    eval_every: int = -1                         # <= 0: off (else also at the last step)
    sample_every: int = -1                       # <= 0: off (else also at the last step)
    save_every: int = -1                         # <= 0: only the final save
    evaluate: Callable[[int], dict] | None = None        # step -> {"val_bpb": ..., ...}
    sample: Callable[[int], list[str]] | None = None     # step -> texts (rank 0 only)
    save: Callable[[int, dict], Path] | None = None      # (step, loop_state) -> checkpoint path
    is_master: bool = True
    report: bool = True                          # per-step rows in <base_dir>/report/metrics_<stage>.jsonl
    keep_last: int = 0                           # > 0: keep this run's newest N checkpoints, delete older ones
    resumed_from: Path | None = None             # the checkpoint a resumed run started from (pruned like its own)
    model_tag: str | None = None                 # in its metrics rows: the report keeps the latest run's tag's
    # (**flag overrides) -> the whole command that continues this run (resume_command below): a stop
    # names it (not "--resume latest" alone: the user's command may hold --overwrite), and so does
    # an out-of-memory stop (with the lower --device-batch-size); None: "--resume latest" alone
    resume_command: Callable[..., str] | None = None


@dataclass
class LoopResult:
    step: int                                    # the final step index (== num_iterations)
    losses: dict = field(default_factory=dict)   # step -> training loss (this process)
    val_bpb: float | None = None
    val_bpb_step: int | None = None              # the step val_bpb was measured at (older when evals are off)
    min_val_bpb: float = math.inf
    last_eval: dict = field(default_factory=dict)
    elapsed_s: float = 0.0                       # wall clock of the stage, resumed runs included
    last_checkpoint: str | None = None
    evaluated_at: int | None = None              # the step of the last evaluation / sample (saved with the
    sampled_at: int | None = None                # loop state: a resume at that step does not repeat them)
    report_error: str | None = None              # why metrics rows stopped (a full disk: the run goes on)


class StopRequested(RequestError):
    """The run was stopped by a signal; the message says where it saved. Exit 128 + signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


HANGUP_LOG = "hangup.log"   # in the base dir: this process's output once its terminal is gone
SETUP_STAGE_ENV = "NANOCHAT_SETUP_STAGE"   # set by setup.sh for the stage it runs: its rerun continues it


def _keeps_output(fd: int) -> bool:
    """A file or /dev/null outlives the terminal: output sent there stays there."""
    try:
        st = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) or (stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev)


def _gone(fd: int) -> bool:
    """Whether writes to fd fail now: a hung-up terminal or a pipe whose reader died (poll reports
    an error or a hangup on it)."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, ev in poller.poll(0))


def move_output_off_terminal(why: str, fds: tuple[int, ...] = (1, 2)) -> Path | None:
    """Point `fds` (default 1 and 2), where they are a terminal or a pipe, at <base dir>/hangup.log
    (appending; /dev/null where it cannot be opened) and write a header line there; returns the
    path, or None when there was nothing to move (already moved, or a file). os calls only on the
    streams: this runs in a signal handler, which may have interrupted a print (Python's streams
    write to the fds, so they follow)."""
    fds = [fd for fd in fds if not _keeps_output(fd)]
    if not fds:
        return None
    try:
        path = get_base_dir() / HANGUP_LOG
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except (OSError, RequestError):   # get_base_dir: a directory that cannot be made is a RequestError
        path, target = Path(os.devnull), os.open(os.devnull, os.O_WRONLY)
    for fd in fds:
        os.dup2(target, fd)
    os.close(target)
    rank = f" rank {os.environ['RANK']}" if "RANK" in os.environ else ""
    with contextlib.suppress(OSError):   # a full disk: the run goes on without the header
        os.write(fds[0], f"==> {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}{rank}: {why}; its output "
                         "continues here\n".encode())
    return path


def _say(text: str) -> None:
    """print0, except that a terminal gone (hung up: EIO; a pipe whose reader died: EPIPE) moves the
    output to the hangup log instead of ending the run with the line unsaid; a SIGHUP, if one
    comes, then stops it."""
    try:
        print0(text)
    except OSError as e:
        if e.errno not in (errno.EIO, errno.EPIPE):
            raise
        # stdout failed; stderr follows only when it is gone too (the same hung-up terminal), not
        # when it is a live terminal and stdout a pipe whose reader quit (`| head`, a killed `| tee`)
        move_output_off_terminal(f"writing to the terminal failed ({errno.errorcode[e.errno]})",
                                 fds=(1, 2) if _gone(2) else (1,))
        if isinstance(getattr(sys.stdout, "buffer", None), io.BufferedIOBase):
            sys.stdout.flush()   # the text that failed is still in the buffer: to the log now
        else:
            print0(text)         # unbuffered (python -u, PYTHONUNBUFFERED): that write's text was dropped


@contextlib.contextmanager
def _stop_signals():
    """While the loop runs: SIGTERM, a first SIGINT and SIGHUP set the returned list to [signum]
    instead of killing the process (SIGHUP also moves the output off the terminal, which is gone);
    the handlers in place before come back afterwards, except that after a hangup SIGHUP stays
    ignored (a second one, e.g. the kernel's when the session leader exits, must not cut the
    stop's last lines). SIGHUP is left alone where it is ignored (nohup). A no-op outside the main
    thread (signal handlers can only be set there)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def handler(signum, frame):
        if got and signum == signal.SIGINT:   # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        if signum == signal.SIGHUP:
            move_output_off_terminal("the terminal hung up (SIGHUP)")
        if signum in got:   # e.g. a hangup both from the shell and passed on by setup.sh
            return
        got.append(signum)
        if os.environ.get("RANK", "0") == "0":  # os.write, not print: this may interrupt a print
            how = "" if signum == signal.SIGHUP else " (Ctrl-C again to interrupt at once)"
            try:
                os.write(2, f"received {signal.Signals(signum).name}: the step in flight finishes, then a "
                            f"checkpoint is saved{how}\n".encode())
            except OSError:   # a terminal gone without a SIGHUP: the stop goes on without this line
                pass

    sigs = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        sigs.append(signal.SIGHUP)
    previous = {sig: signal.signal(sig, handler) for sig in sigs}
    try:
        yield got
    finally:
        for sig, old in previous.items():
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGHUP and sig in got else old)


def _announce_stop_grace() -> None:
    """Under torchrun: one line with the time torchrun gives a stop before SIGKILL, and what to
    set where that is torchrun's 30 s (a step plus a save can outlast it)."""
    from nanochat.distributed import STOP_GRACE_S, TORCHRUN_DEFAULT_GRACE_S, torchrun_stop_grace

    grace = torchrun_stop_grace()
    if grace is None:
        return
    seconds, source = grace
    line = f"stop signals: torchrun SIGKILLs the workers {seconds} s after passing one on ({source})"
    if seconds <= TORCHRUN_DEFAULT_GRACE_S:
        way = ("`./run_train.sh --stop` signals the workers themselves and is not bound by it"
               if source.startswith("fixed") else
               f"launch with TORCH_ELASTIC_SHUTDOWN_TIMEOUT={STOP_GRACE_S} (run_train.sh and launch_multinode.sh do)")
        line += f"; the stop's save may be cut short (the last periodic checkpoint stays): {way}"
    _say(line)


def _agreed_stop(got: list[int]) -> int:
    """The signal number every rank acts on (0: none): the largest any rank received, so all ranks
    stop at the same step index (one small all-reduce per step under torch.distributed)."""
    import torch.distributed as dist

    mine = got[0] if got else 0
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([mine], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def _prune(spec: LoopSpec, kept: list[Path]) -> list[Path]:
    """--keep-last: delete (rank 0) all but the newest keep_last of this run's checkpoints and the
    one it resumed from; checkpoints that were on disk before are never touched. A delete that fails
    warns and the run goes on (rank 0 dying there left the other ranks waiting at the next step's
    collective); anything else is raised on every rank together (rank_failures)."""
    if spec.keep_last <= 0 or len(kept) <= spec.keep_last:
        return kept
    from nanochat.checkpoint_runs import remove_old_step
    from nanochat.distributed import rank_failures

    error = None
    try:
        for old in kept[:-spec.keep_last] if spec.is_master else []:
            remove_old_step(old, kept[-1], spec.keep_last, _say)
    except Exception as e:   # a bug, not the disk: every rank stops, none waits for rank 0
        error = e
    failed = rank_failures(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"--keep-last's pruning failed on rank 0: {failed[min(failed)]}")
    return kept[-spec.keep_last:]


def _due(every: int, step: int, last: bool) -> bool:
    return every > 0 and (last or step % every == 0)


def _evaluate_and_sample(spec: LoopSpec, res: LoopResult, step: int, last: bool, tracker, report: bool,
                         t_start: float) -> bool:
    """Evaluate and sample where due, except what the checkpoint a run resumed from did at this very
    step before it was saved (evaluated_at / sampled_at restored from its loop state): a resumed
    run neither spends another evaluation on it nor writes a second metrics row for the step.
    Returns whether either ran (alike on every rank)."""
    ran = False
    if spec.evaluate is not None and _due(spec.eval_every, step, last) and res.evaluated_at != step:
        ran = True
        _evaluate(spec, res, step, tracker)
        res.evaluated_at = step
        if report:
            _report_row(res, spec.stage, {"step": step, **res.last_eval,
                                          "elapsed_s": time.perf_counter() - t_start, "model_tag": spec.model_tag})
    if spec.sample is not None and _due(spec.sample_every, step, last) and (last or step > 0) \
            and res.sampled_at != step:
        res.sampled_at = step   # on every rank: each saves it in its loop state
        ran = True
        if spec.is_master:
            for text in spec.sample(step):
                _say(f"  sample: {text!r}")
    return ran


def _train_step(trainer, meter, spec: LoopSpec, res: LoopResult, step: int, tracker, report: bool,
                t_start: float) -> None:
    """One optimizer step, its log line, tracker and report rows."""
    try:
        result = trainer.step(step)
    except torch.cuda.OutOfMemoryError as e:
        raise RequestError(out_of_memory_hint(trainer, step, resume=spec.resume_command)) from e
    except RuntimeError as e:   # the CPU allocator's failure is a plain RuntimeError: the same hint, not a traceback
        if CPU_OUT_OF_MEMORY not in str(e):
            raise
        raise RequestError(out_of_memory_hint(trainer, step, memory="CPU memory", resume=spec.resume_command)) from e
    res.losses[step] = result.loss
    metrics = meter.update(result)
    extra = getattr(result, "extra", None) or {}  # stage-specific per-step values (e.g. RL reward)
    _say(meter.log_line(metrics, spec.num_iterations) + format_extra(extra))
    if tracker is not None:
        tracker.log({f"train/{k}": v for k, v in {**metrics, **extra}.items() if k not in ("step", "rough_per_step")},
                    step)
    if report:
        _report_row(res, spec.stage, {"step": step, "loss": result.loss, "smooth_loss": metrics["smooth_loss"],
                                      "lrm": result.lrm, "tok_per_sec": metrics["tok_per_sec"],
                                      "mfu": metrics["mfu"], "peak_mem_gib": metrics["peak_mem_gib"],
                                      "elapsed_s": time.perf_counter() - t_start, "model_tag": spec.model_tag,
                                      **extra})


def _report_row(res: LoopResult, stage: str, row: dict) -> None:
    """One metrics row (rank 0). A disk filling mid-run ended rank 0 alone here with a bare OSError (the
    other ranks waiting at the next collective): now one warning and no more rows; the next save stops
    the run on every rank, naming the checkpoint kept, unless room was made by then."""
    from nanochat.report import log_metrics

    if res.report_error is None:
        try:
            log_metrics(stage, row)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise
            res.report_error = f"{e.strerror}: {e.filename or 'metrics_' + stage + '.jsonl'}"
            _say(f"warning: step {row.get('step')}: the report's metrics rows stop ({res.report_error}); training "
                 "goes on (its next checkpoint save needs room on that disk)")


def format_extra(extra: dict) -> str:
    """A step's stage-specific values as the log line's tail: " | reward 0.5000 | skipped 2". A count
    (an int: RL's skipped prompts) as a count; "skipped 0.0000" read as a rate."""
    return "".join(f" | {k} {v}" if isinstance(v, int) and not isinstance(v, bool) else f" | {k} {v:.4f}"
                   for k, v in extra.items())


def as_flags(name: str, value) -> list[str]:
    """A config value back as the flags that set it: True -> the flag, False -> its "no-" form (asked for only
    where the value differs from the default), a list -> the flag once per item; a value starting with "-",
    not a number, as one word (--run-name=-x: argparse reads `--run-name -x` as a flag missing its value)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag if value else flag[:2] + "no-" + flag[2:]]
    words = [str(item) for item in (value if isinstance(value, list) else [value])]
    return [w for v in words for w in ([flag, v] if v[:1] != "-" or _NEGATIVE_NUMBER.fullmatch(v) else [f"{flag}={v}"])]


_NEGATIVE_NUMBER = re.compile(r"-\d+|-\d*\.\d+")   # argparse's own rule for a value that starts with "-"


def launcher(script: str, world_size: int) -> str:
    """How a command is started: python -m, or under torchrun the user's own launch."""
    if world_size > 1:
        return f"torchrun <your launch options> -m scripts.{script}"
    return f"python -m scripts.{script}"


def resume_command(script: str, cfg, defaults: dict, tag: str, world_size: int = 1, spell=as_flags,
                   **overrides) -> str:
    """The command that continues a stopped run of scripts.<script>: the config's flags that differ
    from `defaults` (a dict per dataclass field; `overrides` replace values), its model tag as
    resolved, and --resume latest (or overrides["resume"]). --overwrite is left out: a resume
    refuses it. `spell(name, value)`: a script's own spelling of a value as flags."""
    args = as_flags("model_tag", tag)   # a tag made before dash-leading ones were refused: --model-tag=-x
    for f in fields(cfg):
        value = overrides.get(f.name, getattr(cfg, f.name))
        if f.name not in ("model_tag", "resume", "overwrite") and value != defaults[f.name]:
            args += spell(f.name, value)
    return f"{launcher(script, world_size)} {shlex.join(args + ['--resume', overrides.get('resume', 'latest')])}"


def run_training_loop(trainer, meter, spec: LoopSpec, tracker=None, *, start_step: int = 0,
                      resume_state: dict | None = None) -> LoopResult:
    """Run steps start_step..num_iterations-1 with evals/samples/saves; returns the LoopResult.
    `resume_state` is the checkpoint's loop state (min/last val bpb, elapsed time)."""
    res = LoopResult(step=start_step)
    if resume_state is not None:
        res.val_bpb = resume_state.get("val_bpb")
        res.val_bpb_step = resume_state.get("val_bpb_step")
        res.min_val_bpb = resume_state.get("min_val_bpb", math.inf)
        res.elapsed_s = float(resume_state.get("elapsed_s", 0.0))
        res.last_eval = dict(resume_state.get("last_eval") or {})
        res.evaluated_at = resume_state.get("evaluated_at")
        res.sampled_at = resume_state.get("sampled_at")
    t_start = time.perf_counter() - res.elapsed_s
    report = spec.report and spec.is_master
    kept = [Path(spec.resumed_from)] if spec.resumed_from is not None else []   # candidates for --keep-last
    step = start_step
    if spec.is_master:
        _announce_stop_grace()
    with _stop_signals() as signals:
        while True:
            last = step >= spec.num_iterations  # >=: never loop past the end (check_resume_step)
            # a stop in the last step saves before the final evaluation too: that evaluation (minutes at
            # d20) outlasted torchrun's grace and the SIGKILL took the only save of a --save-every -1 run;
            # the resume evaluates there (check_resume_step). A stage that saves nothing just finishes.
            stop = _agreed_stop(signals) if not last or spec.save is not None else 0
            if stop:
                how = "" if stop == signal.SIGHUP else " (Ctrl-C again interrupts at once)"
                _say(f"received {signal.Signals(stop).name}: saving a checkpoint at step {step} and stopping{how}")
            if not stop:
                ran = _evaluate_and_sample(spec, res, step, last, tracker, report, t_start)
                if ran:   # a NaN evaluation stops the run now, not at a save (with --save-every -1, the end)
                    _check_finite_val_bpb(trainer, res, step)
                if ran and not last and (stop := _agreed_stop(signals)):   # it came during the eval: save here
                    _say(f"received {signal.Signals(stop).name} during the evaluation: saving a checkpoint at "
                         f"step {step} and stopping")
            periodic = spec.save_every > 0 and step % spec.save_every == 0 and step != start_step
            if spec.save is not None and (last or periodic or stop):
                _check_finite_before_save(trainer, res, step)   # never a NaN checkpoint as `latest`
                res.elapsed_s = time.perf_counter() - t_start
                loop_state = trainer.loop_state(step, meter, min_val_bpb=res.min_val_bpb, val_bpb=res.val_bpb,
                                                elapsed_s=res.elapsed_s, val_bpb_step=res.val_bpb_step,
                                                last_eval=jsonable(res.last_eval), evaluated_at=res.evaluated_at,
                                                sampled_at=res.sampled_at,   # the wandb run a resume continues:
                                                **({} if tracker is None else {"tracker": tracker.state_dict()}))
                path = spec.save(step, loop_state)
                trainer.note_checkpoint(path)
                res.last_checkpoint = str(path)
                _say(f"step {step:05d} | saved checkpoint {path}")
                kept = _prune(spec, [k for k in kept if k != Path(path)] + [Path(path)])  # a re-saved step once
                if not (last or stop) and (stop := _agreed_stop(signals)):
                    # it came during this save: that checkpoint is the stop's (no step more, no second save)
                    _say(f"received {signal.Signals(stop).name} during the save: stopping at step {step}")
            if stop:
                saved = f"checkpoint {res.last_checkpoint} saved; continue with --resume latest" \
                    if spec.save is not None else "this stage saves no checkpoint"
                rerun = " (or rerun ./setup.sh)" if os.environ.get(SETUP_STAGE_ENV) else ""
                if spec.save is not None and spec.resume_command is not None and not rerun:
                    saved += f": {spec.resume_command()}"   # under setup.sh its rerun continues, with its flags
                raise StopRequested(f"stopped by {signal.Signals(stop).name} at step {step} of "
                                    f"{spec.num_iterations}: {saved}{rerun}", stop)
            if last:
                break
            _train_step(trainer, meter, spec, res, step, tracker, report, t_start)
            step += 1
    res.step = step
    res.elapsed_s = time.perf_counter() - t_start
    return res


def _check_finite_before_save(trainer, res: LoopResult, step: int) -> None:
    """A step's loss is checked before its update, so an update can leave non-finite weights behind a
    finite loss (a learning rate far too high): the next save would record them as `latest` and the
    NaN guard would then name that checkpoint the last good one. Raised instead, on every rank."""
    from nanochat.training import DEFAULT_HINT, NonFiniteLossError

    hint = getattr(trainer, "hint", DEFAULT_HINT)
    _check_finite_val_bpb(trainer, res, step)
    model = getattr(trainer, "model", None)
    if model is None:
        return
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(_local(p)).all())]
    flag = torch.tensor(float(len(bad)), device=next(model.parameters()).device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag)   # a rank with bad shards (FSDP) stops them all
    if flag.item():
        raise NonFiniteLossError(step, "weights", float("nan"), trainer.last_checkpoint,
                                 f"{', '.join(bad[:3]) or 'another rank'} after step {step - 1}'s update; {hint}")


def _check_finite_val_bpb(trainer, res: LoopResult, step: int) -> None:
    """NonFiniteLossError for a nan/inf val bpb (alike on every rank: it is all-reduced). Checked
    where it is measured: checked only before saves, a NaN evaluation went unnoticed when the save's
    own evaluation came out finite, and with --save-every -1 the run trained on to its end."""
    from nanochat.training import DEFAULT_HINT, NonFiniteLossError

    if res.val_bpb is not None and not math.isfinite(res.val_bpb):
        raise NonFiniteLossError(step, "val bpb", res.val_bpb, getattr(trainer, "last_checkpoint", None),
                                 getattr(trainer, "hint", DEFAULT_HINT))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p   # an FSDP shard (DTensor): this rank's part


CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"   # in the RuntimeError torch raises


def peak_memory_note(memory: str) -> str:
    """" (N GiB allocated at the peak of M)" after an out-of-GPU-memory error (M: the device's memory,
    or platform's unified-memory cap with the variable that sets it); "" for CPU memory."""
    if memory != "GPU memory" or not torch.cuda.is_available():
        return ""
    from nanochat.platform import MEMORY_CAP_ENV, memory_cap_bytes
    dev, cap = torch.cuda.current_device(), memory_cap_bytes()
    # the cap in GB too: the unit MEMORY_CAP_ENV takes and platform's start-up line prints
    limit = (f"the unified-memory cap of {cap / 2**30:.1f} GiB = {cap / 1e9:.1f} GB ({MEMORY_CAP_ENV}=<GB> "
             "sets it)" if cap is not None else
             f"{torch.cuda.get_device_properties(dev).total_memory / 2**30:.1f} GiB")
    return f" ({torch.cuda.max_memory_allocated(dev) / 2**30:.1f} GiB allocated at the peak of {limit})"


def out_of_memory_hint(trainer, step: int, memory: str = "GPU memory",
                       resume: Callable[..., str] | None = None) -> str:
    """What to change when a step runs out of GPU (or CPU) memory: the device batch (gradient
    accumulation keeps the total batch), or at one sequence per micro-batch the sequence length or
    depth. The last checkpoint stays as it was; `resume` (LoopSpec.resume_command): once there is
    one, the command that continues from it at the lower device batch (the user's own command with
    a lower --device-batch-size is refused without --resume, and with --overwrite starts afresh)."""
    plan, peak = getattr(trainer, "plan", None), peak_memory_note(memory)
    if plan is None:
        return f"out of {memory} in step {step}{peak}: lower the device batch size"
    head = (f"--device-batch-size {plan.device_batch_size} x --max-seq-len {plan.seq_len}: out of {memory} in "
            f"step {step}{peak}")
    # under setup.sh the stage's flags are setup.sh's to set: say its own flag and that a rerun resumes
    setup = bool(os.environ.get(SETUP_STAGE_ENV))
    if plan.device_batch_size > 1:
        # a device batch whose micro-batches divide the total (it must, to keep it): about half
        fits = [d for d in range(plan.device_batch_size - 1, 0, -1)
                if plan.total_batch_size % (d * plan.seq_len * plan.world_size) == 0]
        half = next(d for d in fits if d <= max(1, plan.device_batch_size // 2))
        lower = (f"rerun ./setup.sh with --device-batch-size {half} added to its flags "
                 "(the stage resumes from its last checkpoint)" if setup else
                 f"lower --device-batch-size (e.g. {half})")
        # its step, not latest: a run resumed from an older step has not moved latest.json yet
        last = Path(getattr(trainer, "last_checkpoint", None) or "").name.removeprefix("step_")
        again = (f"; resume with: {resume(device_batch_size=half, resume=str(int(last)))}"
                 if resume is not None and not setup and last.isdigit() else "")
        return (f"{head}; {lower}: gradient accumulation keeps the total batch of {plan.total_batch_size:,} "
                f"tokens per step{again}")
    return f"{head}; " + ("rerun ./setup.sh with a smaller --depth" if setup else
                          "lower --max-seq-len (or base_train's --depth)")


def _evaluate(spec: LoopSpec, res: LoopResult, step: int, tracker) -> None:
    metrics = dict(spec.evaluate(step))
    res.last_eval = metrics
    if "val_bpb" in metrics:
        res.val_bpb, res.val_bpb_step = metrics["val_bpb"], step
        res.min_val_bpb = min(res.min_val_bpb, res.val_bpb)
        _say(f"step {step:05d} | val bpb {res.val_bpb:.4f} (min {res.min_val_bpb:.4f})")
    others = {k: v for k, v in metrics.items() if k != "val_bpb"}
    if others:
        _say(f"step {step:05d} | " + " | ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in others.items()))
    if tracker is not None:
        tracker.log({f"val/{k.removeprefix('val_')}": v for k, v in metrics.items()}, step)


def log_stage_report(section: str, stage: str, *, config: dict, result: LoopResult, meter=None,
                     extra: dict | None = None, is_master: bool = True) -> None:
    """The stage's report section (config, timing, final metrics) via nanochat.report (rank 0)."""
    if not is_master:
        return
    from nanochat.report import get_report

    data = {"stage": stage, **(extra or {}), "final_step": result.step, "total_time_s": round(result.elapsed_s, 2),
            "final_val_bpb": result.val_bpb, "val_bpb_step": result.val_bpb_step,
            "min_val_bpb": result.min_val_bpb if result.min_val_bpb < math.inf else None,
            "final_loss": result.losses[max(result.losses)] if result.losses else None,
            **{k: v for k, v in result.last_eval.items() if k != "val_bpb"}}
    if meter is not None:   # the run's average rate and its MFU: report.md's summary shows them
        data["avg_tok_per_sec"] = meter.average_tok_per_sec()
        data["avg_mfu"], data[f"avg_util_{meter.precision}"] = meter.average_mfu()
    if isinstance(data.get("total_batch_size"), int) and result.step:   # steps x tokens per step
        data["tokens_trained"] = result.step * data["total_batch_size"]
    data["config"] = config
    get_report().log(section, data)


def resume_loop_state(resume: dict | None, meter, trainer, ckpt_dir) -> tuple[int, dict | None]:
    """(start step, loop state) from a loaded checkpoint (or (0, None) for a fresh run): restores
    the meter and tells the trainer which checkpoint is the last good one. The RNG state in
    loop["rng"] is restored by the caller, last, after everything that draws random numbers."""
    if resume is None:
        return 0, None
    loop = resume["loop"]
    meter.load_state_dict(loop["meter"])
    trainer.note_checkpoint(Path(ckpt_dir) / f"step_{loop['step']:06d}")
    return loop["step"], loop
