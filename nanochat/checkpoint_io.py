"""The files of a checkpoint: step directory names, atomic writes (temp file + fsync +
os.replace), size + sha256 sums hashed alongside the IO, torch.load(weights_only=True) that
returns only what matches its sums, the sizes of states (the disk plans), which failed writes a user
can act on (no room, a disk refusing writes), the saves cut short (step_N.partial), the identity of
a step directory (a reader overtaken by --keep-last), latest.json's step and a model.pt's recorded sum.
checkpoint.py builds saves, loads and resumes on these.

Imported without torch (it is imported inside the few functions that read, write or measure tensors):
nanochat.resume_point, setup.sh's check before each training stage, reads latest.json and the sums in
a fraction of a second instead of torch's 2-4 s import.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import pickle
import re
import shutil
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from nanochat.errors import RequestError

if TYPE_CHECKING:   # torch is imported inside the functions that use it: see the module docstring
    import torch

_STEP_RE = re.compile(r"^step_(\d+)$")
LATEST_NAME = "latest.json"   # {"step": N, "dir": "step_00000N"}, written after the step is complete
META_NAME = "meta.json"
MODEL_NAME = "model.pt"
PHASES = ("base", "mid", "sft", "rl")


class CheckpointError(RequestError):
    """A checkpoint is missing, incomplete or incompatible; the message names the path: a
    RequestError, so the scripts print it as one line."""


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def list_steps(ckpt_dir: str | Path) -> list[int]:
    """Complete checkpoint steps in ckpt_dir, ascending (partial directories are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    steps = [int(m.group(1)) for p in ckpt_dir.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()]
    return sorted(steps)


def read_latest(ckpt_dir: str | Path) -> int:
    """The step recorded in latest.json (never guessed from file times)."""
    path = Path(ckpt_dir) / LATEST_NAME
    if not path.is_file():
        have = list_steps(ckpt_dir)
        extra = f"; steps on disk: {have} (pass one explicitly)" if have else _other_tags(ckpt_dir)
        raise CheckpointError(f"no checkpoint recorded in {ckpt_dir} ({LATEST_NAME} missing){extra}")
    try:
        record = json.loads(path.read_text())
        step = record["step"]
        if type(step) is not int or step < 0:   # int() took 1.5 and true as step 1
            raise ValueError(f"step {step!r} is not a whole number >= 0")
        return step
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: corrupt latest pointer ({e}); steps on disk: "
                              f"{list_steps(ckpt_dir) or 'none'} (name one: --step N to load it, --resume N to continue "
                              "training from it)") from e


def _other_tags(ckpt_dir) -> str:
    """For a <phase>/<tag> checkpoint directory that does not exist or holds no checkpoint (a mistyped
    --model-tag; a training run has claimed it, .writer.lock, before it reads --resume's step): the
    tags that phase does have. base_eval and chat_eval said only "latest.json missing"."""
    ckpt_dir = Path(ckpt_dir)
    root = ckpt_dir.parent
    if root.name not in PHASES or root.parent.name != "checkpoints" or _has_checkpoint(ckpt_dir):
        return ""
    if ckpt_dir.is_dir():
        others = "|".join(t for t in _model_tags(root) if t != ckpt_dir.name and _has_checkpoint(root / t))
        return f"; model tag {ckpt_dir.name!r} holds no checkpoint: the {root.name} model tags that do are " \
               f"{others or 'none'} (--model-tag)"
    return (f"; there is no model tag {ckpt_dir.name!r}: the {root.name} model tags are "
            f"{'|'.join(_model_tags(root)) or 'none'} (--model-tag)")


def _has_checkpoint(tag_dir: Path) -> bool:
    return (tag_dir / LATEST_NAME).is_file() or bool(list_steps(tag_dir))


def _model_tags(root: Path) -> list[str]:
    """The tag directories under `root`: those holding a checkpoint, or all when none does."""
    tags = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    return [t for t in tags if _has_checkpoint(root / t)] or tags


def cut_short_saves(ckpt_dir: str | Path) -> list[int]:
    """Steps whose save was cut short (a kill or crash mid-save left step_N.partial, never renamed to
    step_N): no checkpoint, ignored by every read and deleted by the next save, but said at a resume
    (a resume at step 200 after step 300's save died said nothing of step 300)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(int(m.group(1)) for p in ckpt_dir.iterdir() if (m := re.fullmatch(r"step_(\d+)\.partial", p.name)))


def leftover_bytes(ckpt_dir: str | Path) -> int:
    """Bytes of the leftovers a save deletes before it writes (save_checkpoint's sweep): saves cut short
    (step_N.partial, up to a whole checkpoint each) and removals cut short (step_N.del-*). The disk
    plan counts them as room: a rerun after a kill mid-save on a full disk was refused, naming no
    leftover, though its first save frees them."""
    ckpt_dir = Path(ckpt_dir)
    leftovers = [*ckpt_dir.glob("step_*.partial"), *ckpt_dir.glob("step_*.del-*")] if ckpt_dir.is_dir() else []
    return sum(f.stat().st_size for d in leftovers for f in d.rglob("*") if f.is_file())


# a directory's fsync failing with these means its entries (a rename, a new file) may not be on disk:
# raised, never passed over (the save was then reported done and --keep-last pruned the step before it)
_DIR_SYNC_FAILED = (errno.EIO, errno.ENOSPC, errno.EDQUOT)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # some filesystems do not allow opening directories; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError as e:   # EINVAL and the like: a filesystem that cannot sync a directory
        if e.errno in _DIR_SYNC_FAILED:
            raise OSError(e.errno, e.strerror, str(path)) from e
    finally:
        os.close(fd)


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO)


def _write_error(e: BaseException) -> OSError | None:
    """The OSError of a failed write behind `e`, when it is one a user can act on (no room, not
    writable): `e` itself, or the one torch.save met: its zip writer turns the file's ENOSPC into a
    RuntimeError ("unexpected pos ...") that carries the OSError only as its __context__."""
    if isinstance(e, RuntimeError):
        e = e.__cause__ or e.__context__
    return e if isinstance(e, OSError) and e.errno in _NO_ROOM + _NOT_WRITABLE else None


def dir_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of a directory (None: absent): a step renamed away, or swapped for a new copy
    by a re-save, shows as another identity whatever the name says (load_checkpoint's reread)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def make_dirs(path: Path) -> None:
    """mkdir -p whose new directories survive a power cut: each one made is fsynced into its parent
    (the step directories and files were, the model-tag directory holding them not: a first save on
    a fresh disk could vanish whole on filesystems that do not order metadata for you)."""
    path = Path(path)
    made, p = [], path.absolute()
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for p in reversed(made):
        fsync_dir(p.parent)


def atomic_write(path: Path, write: Callable[[Any], None], *, written: Callable[[Path], Any] | None = None) -> None:
    """Write `path` via a same-directory temp file, fsync, os.replace; the temp is removed on error.
    `written(tmp)` is called once the bytes are in the file, before the fsync (e.g. to hash them)."""
    path = Path(path)
    # process and thread in the name: two threads of one process writing one path (report sections)
    # shared a temp file, and the first replace left the second without its file
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if written is not None:
                written(tmp)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, obj: dict) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True, default=str).encode()))


# The sums are hashed on helper threads next to the IO that dominates a checkpoint: a save hashes
# each file (from the page cache, through a read-only mmap: one hashlib call, which releases the
# GIL for all of it) while fsync flushes it and the next file is written; a load hashes while
# torch.load reads. Hashing after the IO, as before, added ~45% to a d20 save (9.2 GB) and ~130%
# to its load on an H200 box (scripts/bench_checkpoint.py).


_POOL: tuple[int, ThreadPoolExecutor] | None = None


def _hash_pool() -> ThreadPoolExecutor:
    """The helper threads, made on first use; a forked child makes its own (its copy of the
    parent's executor has no threads, and would queue work that never runs)."""
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-sha256"))
    return _POOL[1]


def _file_sum(f) -> dict:
    """{"bytes", "sha256"} of an open binary file (closed after); the path may have moved since."""
    with f:
        size = os.fstat(f.fileno()).st_size
        sha = hashlib.sha256()
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                sha.update(view)
        return {"bytes": size, "sha256": sha.hexdigest()}


def sha256_file(path: Path) -> str:
    return _file_sum(open(path, "rb"))["sha256"]


def save_hashed(path: Path, obj) -> Future:
    """Write `obj` atomically; returns a future of its {"bytes", "sha256"}, hashed during the fsync."""
    import torch

    hashing = []
    atomic_write(path, lambda f: torch.save(obj, f),
                 written=lambda tmp: hashing.append(_hash_pool().submit(_file_sum, open(tmp, "rb"))))
    return hashing[0]


def saved_sum(path: Path, rank: int, summed: bool = False) -> dict | None:
    """What sums_rank<R>.json recorded for `path` (None: a checkpoint from before the sums, or a
    missing `path`). `summed`: the checkpoint was saved with sums (meta.json's "checksummed"), so a
    sums file gone (a partial copy, deleted by hand) is said: it silently turned every check off.
    A warning, not a refusal: hand-made checkpoints (a model.pt replaced, its sums dropped) load."""
    sums_path = path.parent / f"sums_rank{rank}.json"
    if not path.is_file():
        return None
    if not sums_path.is_file():
        # path.is_file() again: a step renamed away between the two checks (--keep-last of a run saving
        # there) is no lost sums file; its read fails, and load_checkpoint reads again
        if summed and path.is_file():   # every rank its own files: not print0
            print(f"WARNING: {sums_path} is missing, though this checkpoint was saved with it: {path.name} is "
                  "loaded unverified (a damaged or partial copy would go unnoticed); copy the whole step "
                  "directory", file=sys.stderr)
        return None
    try:
        want = json.loads(sums_path.read_text())[path.name]
        # both fields, of their types: the checks below compare and format them
        if not (isinstance(want, dict) and type(want.get("bytes")) is int and isinstance(want.get("sha256"), str)):
            raise TypeError(f"{path.name}: {want!r}")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{sums_path}: corrupt or without {path.name} ({e}); {_use_another_step(path)}") from e
    return want


def model_digest(ckpt_dir, step: int) -> str | None:
    """The sha256 of a step's model.pt as recorded when it was saved (None: saved before the sums):
    which weights a later stage started from, without reading them (the copy a read takes:
    readable_step_dir; chat_start records it before its read restores a swapped-out step)."""
    return (saved_sum(readable_step_dir(ckpt_dir, step) / MODEL_NAME, 0) or {}).get("sha256")


# meta.json: the fields every save_checkpoint has written (schema 1), and the fields loads and resumes
# read where a recipe wrote them, with the JSON type each must have (null: the recipe had none)
_META_REQUIRED = {"step": int, "world_size": int, "has_optimizer": bool}
_META_OPTIONAL = {"model_config": dict, "train": dict, "config": dict, "source": dict, "tokenizer_fingerprint": str}
_JSON_TYPE = {int: "an integer", bool: "true or false", dict: "an object", str: "a string", float: "a number",
              list: "an array", type(None): "null"}


def check_meta(meta: dict, path: Path, step: int) -> None:
    """A meta.json's fields that loading and resuming rely on: present, of their JSON type, the step
    the directory's and a world size >= 1. A missing or wrong-typed field raised a bare TypeError
    deep in a resume (world_size null), or was taken as something else ("has_optimizer": "no" read
    as true): a CheckpointError naming the file, each field and what it holds."""
    wrong = [f"{key!r} is missing" for key in _META_REQUIRED if key not in meta]
    for key, kind in {**_META_REQUIRED, **_META_OPTIONAL}.items():
        value = meta.get(key)
        if key in meta and type(value) is not kind and not (value is None and key in _META_OPTIONAL):
            wrong.append(f"{key!r} is {_JSON_TYPE.get(type(value), type(value).__name__)} "
                         f"({json.dumps(value, default=str)[:40]}), not {_JSON_TYPE[kind]}")
    if not wrong and meta["world_size"] < 1:
        wrong.append(f"'world_size' is {meta['world_size']}, not >= 1")
    if not wrong and meta["step"] != step:   # a directory renamed or copied by hand: which step is it?
        wrong.append(f"'step' is {meta['step']} but the directory is {step_dirname(step)} (renamed by hand? name it "
                     f"{step_dirname(meta['step'])} again)")
    if wrong:
        raise CheckpointError(f"{path}: invalid metadata: {'; '.join(wrong)}; {_use_another_step(path)}")


def _use_another_step(path: Path) -> str:
    """What to do about a damaged or missing file of a step: the other steps on disk."""
    others = [s for s in list_steps(path.parent.parent) if step_dirname(s) != path.parent.name]
    return f"use another step ({others or 'none on disk'})"


def _damaged(path: Path, want: dict) -> CheckpointError:
    size = path.stat().st_size
    # which check failed: "N bytes, N when saved" alone reads as if the sizes differed
    how = (f"{size:,} bytes, {want['bytes']:,} when saved" if size != want["bytes"] else
           f"its sha256 is not the {want['sha256'][:16]}... recorded in sums_rank*.json")
    return CheckpointError(f"{path}: the file differs from the one saved ({how}): damaged on disk; "
                           f"{_use_another_step(path)}")


def start_check(path: Path, rank: int, summed: bool = False) -> tuple[dict, Future] | None:
    """Refuse a file whose size differs from its sums and start hashing it on a helper thread
    (None: a checkpoint from before the sums, or a missing file, which torch.load reports;
    `summed`: saved_sum's)."""
    want = saved_sum(path, rank, summed)
    if want is None:
        return None
    if path.stat().st_size != want.get("bytes"):
        raise _damaged(path, want)
    return want, _hash_pool().submit(_file_sum, open(path, "rb"))


def load_verified(path: Path, device, rank: int = 0, check: tuple[dict, Future] | None = None) -> Any:
    """torch.load(weights_only=True) of a file that must match its saved size and sha256. The hash
    runs on a helper thread while torch.load reads the same file (`check`: one started earlier,
    by start_check); what was loaded is returned only if the hash matches."""
    check = check or start_check(path, rank)
    if check is None:
        return _load(path, device)
    want, hashing = check
    try:
        obj = _load(path, device)
    except CheckpointError:
        if hashing.result()["sha256"] != want.get("sha256"):
            raise _damaged(path, want) from None   # the cause, not torch's view of its symptom
        raise
    if hashing.result()["sha256"] != want.get("sha256"):
        del obj
        raise _damaged(path, want)
    return obj


def _load(path: Path, device) -> Any:
    import torch

    try:
        return torch.load(path, map_location=device, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file missing from the checkpoint; {_use_another_step(path)}") from None
    except pickle.UnpicklingError as e:  # weights_only refused a pickled global (or a corrupt file)
        first = str(e).strip().splitlines()[-1][:200] if str(e).strip() else ""
        raise CheckpointError(f"{path}: cannot read with weights_only=True ({first})") from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read ({type(e).__name__}: {e})") from e
    except (KeyError, ValueError, TypeError, IndexError, AttributeError) as e:
        # a file that is no torch.save output (text, another format) failed inside the unpickler
        # with a bare KeyError: 101 that named no file
        raise CheckpointError(f"{path}: not a file torch.load can read ({type(e).__name__}: {e})") from e


# ------------------------------------------------------------------------------------ model states

def _strip_compile_prefix(state: dict) -> dict:
    # torch.compile wraps the module; its state_dict keys carry "_orig_mod." which must not leak
    # into checkpoints (the eval side loads into a plain module). Transformer Engine's layers
    # (--precision-backend te) add "<layer>._extra_state" (fp8 metadata that the current / block
    # scaling recipes built here do not carry across steps): every reader loads into the plain GPT.
    return {k.removeprefix("_orig_mod."): v for k, v in state.items() if not k.endswith("._extra_state")}


def _state_device(state: dict | None) -> torch.device | None:
    import torch

    return next((v.device for v in (state or {}).values() if isinstance(v, torch.Tensor)), None)


# ------------------------------------------------------------------------------------ sizes

def tensor_bytes(obj) -> int:
    """Bytes of the tensor storages in a nested state (dicts, lists, tuples), each storage once."""
    import torch

    seen, total, stack = set(), 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            key = (storage.data_ptr(), x.device)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def checkpoint_bytes(model, *, normuon: bool = False, world_size: int = 1, fsdp: bool = False) -> int:
    """Bytes of a training checkpoint of `model`: its state dict and the optimizer state summed over
    the run's `world_size` ranks (each writes its own optim_rank<R>.pt; `normuon`, `fsdp`:
    optim.optimizer_state_bytes'); loader and loop state are small. A meta-device model is enough
    (no memory)."""
    from nanochat.optim import optimizer_state_bytes

    return (sum(t.numel() * t.element_size() for t in model.state_dict().values())
            + optimizer_state_bytes(model, normuon=normuon, world_size=world_size, fsdp=fsdp))


def planned_saves(start_step: int, num_iterations: int, save_every: int) -> int:
    """How many checkpoints run_training_loop writes from start_step: every save_every steps after
    the start, and the final one (once, when it falls on the period)."""
    if save_every <= 0:
        return 1
    first = (start_step // save_every + 1) * save_every     # the first multiple after the start
    return len(range(first, num_iterations, save_every)) + 1


# ------------------------------------------------------------------------------------ re-saves
# A re-save of step N moves the old copy to step_N.old-PID, the new one in, then deletes the old.


def restore_swapped_out(ckpt_dir: Path, step: int, meta_name: str) -> None:
    """Killed between the two renames, a re-save leaves no step_N (latest.json may name it) and a
    complete old copy: it is renamed back (by whichever rank gets there first). Call it only when
    step_N is absent; the copies of a deletion cut short are swept while it exists (sweep_superseded)."""
    from nanochat.common import print0

    final = ckpt_dir / step_dirname(step)
    old = swapped_out_copy(ckpt_dir, step, meta_name)
    if old is not None:
        try:
            os.replace(old, final)
            print0(f"checkpoint: {final.name} was missing after an interrupted re-save; restored it from {old.name}")
        except FileNotFoundError:   # another rank restored it a moment ago
            pass


def swapped_out_copy(ckpt_dir: Path, step: int, meta_name: str = META_NAME) -> Path | None:
    """The step_N.old-* copy restore_swapped_out renames back as step_N (the first holding meta.json), or None."""
    return next((old for old in sorted(Path(ckpt_dir).glob(step_dirname(step) + ".old-*"))
                 if (old / meta_name).is_file()), None)


def readable_step_dir(ckpt_dir, step: int) -> Path:
    """The directory a read of step N takes: step_N, or while it is absent (a re-save killed between
    its two renames) the old copy the read renames back (restore_swapped_out). Checks made without a
    read (resume_point, model_digest) judged the absent step_N: the step "gone", its weights unknown."""
    final = Path(ckpt_dir) / step_dirname(step)
    return final if final.is_dir() else swapped_out_copy(Path(ckpt_dir), step) or final


def restore_or_wait(ckpt_dir: Path, step: int, meta_name: str, wait_s: float = 10.0) -> None:
    """step_N is missing: restore_swapped_out, by the tag's writer or when no run holds the tag
    (writer_lock.holder is None for both). A reader beside a live writer (chat_eval on a tag a run
    trains into) waits up to `wait_s` for the writer's swap to end instead: its rename of the old copy
    back between the writer's two renames made the writer's second one fail (Directory not empty)."""
    import time

    from nanochat.writer_lock import holder

    final = ckpt_dir / step_dirname(step)
    deadline = time.monotonic() + wait_s
    while holder(ckpt_dir) is not None and not final.is_dir() and time.monotonic() < deadline \
            and any(ckpt_dir.glob(step_dirname(step) + ".old-*")):
        time.sleep(0.01)
    if not final.is_dir() and holder(ckpt_dir) is None:
        restore_swapped_out(ckpt_dir, step, meta_name)


def sweep_superseded(ckpt_dir: Path, step: int | None = None) -> None:
    """Delete the step_N.old-* copies (of `step`, or of every step) whose step_N is in place: a
    re-save killed while deleting one leaves it, possibly partial (up to a whole checkpoint that
    nothing else frees). Call before step_N is removed or moved: restore_swapped_out would
    otherwise bring that superseded copy back as step N."""
    pattern = (step_dirname(step) if step is not None else "step_*") + ".old-*"
    for old in Path(ckpt_dir).glob(pattern):
        if (old.parent / old.name.split(".old-")[0]).is_dir():
            shutil.rmtree(old, ignore_errors=True)
