"""The start of a distributed launch, checked on its rendezvous store before the process group forms:
every rank must arrive within a bounded time, run the same code and command line, and a rank that
stops first has its reason heard by the others.

Without it, a rank that stopped before joining (a --data-dir missing on its node, no GPU driver
there, a node with fewer GPUs than --nproc) left the other ranks inside init_process_group without
a word: 30 minutes on gloo, and with NCCL as long as its bootstrap waits. Nodes running different
code or flags (a checkout one commit behind, --depth 20 on one node and 12 on the other, --device
auto finding no GPU on one node: gloo there, NCCL here) started together and failed later inside a
collective, or trained on.

* `dist_timeout_s`: NANOCHAT_DIST_TIMEOUT (seconds, default 600, NCCL's own default): how long a rank
  waits for the others: in this roll call, in the process group's collectives (init_runtime passes
  it to init_process_group: NCCL's watchdog; gloo's default was 30 minutes), and in
  distributed.py's timed barriers (compile warm-up, shared-directory check).
* `roll_call`: each rank posts what it runs (host, a hash per source file under nanochat/ and
  scripts/ (those git tracks, in a git checkout), git sha, torch version, process-group backend, compute dtype, command line) and waits
  for all; a rank missing after the timeout is named; any difference is a RequestError raised on
  every rank, naming the ranks, their hosts and what differs. NANOCHAT_ALLOW_DIFFERENT_FLAGS=1 (as
  rank 0 has it) lets command lines differ, for a path that differs per node on purpose.
* `post_start_failure`: under torchrun (its agent hosts the store, so it is there before any
  worker), a rank that stops before its roll call leaves its error on the store, and the others
  raise it at once instead of waiting out the timeout. init_runtime posts its own errors.

Every rank calls roll_call in the same order: the n-th calls pair up (each rank counts its calls on
the store, so a process that starts a group twice stays paired).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Mapping

from nanochat.errors import RequestError

TIMEOUT_ENV = "NANOCHAT_DIST_TIMEOUT"
ALLOW_FLAGS_ENV = "NANOCHAT_ALLOW_DIFFERENT_FLAGS"
DEFAULT_TIMEOUT_S = 600.0
POST_TIMEOUT_S = 10.0      # a failing rank's connection to the agent's store (up before any worker)
LINGER_S = 10.0            # rank 0 (the store's host outside torchrun) waits for the others to read a verdict
_REPO = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("nanochat", "scripts")   # the code every rank must share, relative to _REPO


def dist_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """NANOCHAT_DIST_TIMEOUT in seconds (600 when unset); anything else than seconds > 0 is a
    RequestError naming the variable."""
    raw = (os.environ if env is None else env).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise RequestError(f"{TIMEOUT_ENV}: got {raw!r}; accepted: seconds > 0 (default {DEFAULT_TIMEOUT_S:.0f}): how "
                           "long a rank waits for the others at the start, in a collective and at a barrier")
    return value


def _allow_different_flags(env: Mapping[str, str]) -> bool:
    raw = env.get(ALLOW_FLAGS_ENV, "").strip()
    if raw not in ("", "0", "1"):
        raise RequestError(f"{ALLOW_FLAGS_ENV}: got {raw!r}; accepted: 1 (command lines may differ between ranks) "
                           "or 0 / unset (they must not)")
    return raw == "1"


def _source_hashes() -> dict[str, str]:
    """A short sha256 per .py file under nanochat/ and scripts/, by path relative to the repo (the
    checkout may sit elsewhere on each node): every file there that Python could import as a
    module, so not an editor's lock or backup (emacs' ".#gpt.py", a dangling link; "gpt.orig.py"),
    which refused launches whose code was the same. One rule on every node, git checkout or not (an
    rsync without .git): hashing only what git tracks on some nodes made identical trees differ,
    and missed an untracked module that two checkouts import in different versions."""
    paths = sorted(p for sub in SOURCE_DIRS for p in (_REPO / sub).rglob("*.py") if p.stem.isidentifier())
    out = {}
    for path in paths:
        try:
            out[path.relative_to(_REPO).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        except OSError as e:   # e.g. a dangling link with a module's name, or a file removed meanwhile
            out[path.relative_to(_REPO).as_posix()] = f"unreadable ({e.strerror})"
    return out


def rank_facts(backend: str, dtype: str | None = None, env: Mapping[str, str] | None = None) -> dict:
    """What this rank posts at the roll call."""
    import torch

    from nanochat.report_env import git_sha
    env = os.environ if env is None else env
    argv = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv else []   # the script, not where it lives
    return {"host": socket.gethostname(), "pid": os.getpid(), "files": _source_hashes(), "git": git_sha(_REPO),
            "torch": torch.__version__, "backend": backend, "dtype": dtype or "n/a", "argv": argv,
            "allow_different_flags": _allow_different_flags(env)}


def _span(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


def _where(everyone: list[dict], ranks: list[int]) -> str:
    hosts = sorted({everyone[r]["host"] for r in ranks})
    return f"rank(s) {_span(ranks)} (host {', '.join(hosts)})"


def _differences(everyone: list[dict], files_of) -> list[str]:
    """What differs between the ranks' facts, one phrase each (empty: nothing). `files_of(rank)`:
    that rank's file hashes, fetched only for ranks whose code digest is not rank 0's."""
    problems = []
    changed: dict[tuple[str, ...], list[int]] = {}
    others = [r for r in range(1, len(everyone)) if everyone[r]["code"] != everyone[0]["code"]]
    first = files_of(0) if others else {}
    for r in others:
        theirs = files_of(r)
        paths = tuple(sorted(p for p in set(first) | set(theirs) if first.get(p) != theirs.get(p)))
        changed.setdefault(paths, []).append(r)
    for paths, ranks in changed.items():
        more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
        shas = sorted({str(everyone[r]["git"]) for r in ranks})
        problems.append(f"the code: {', '.join(paths[:5])}{more} differ between {_where(everyone, [0])}, git "
                        f"{everyone[0]['git']}, and {_where(everyone, ranks)}, git {', '.join(shas)}")
    labels = [("torch", "the torch version"), ("backend", "the process-group backend (--device: cuda -> nccl, "
               "cpu -> gloo; auto finds no GPU on a node whose driver or CUDA_VISIBLE_DEVICES hides it)"),
              ("dtype", "the compute dtype (--dtype / --precision, or NANOCHAT_DTYPE set on one node)")]
    if not everyone[0]["allow_different_flags"]:
        labels.append(("argv", f"the command line ({ALLOW_FLAGS_ENV}=1 lets it differ, e.g. a path that "
                               "differs per node on purpose)"))
    for key, label in labels:
        groups: dict[str, list[int]] = {}
        for r, facts in enumerate(everyone):
            groups.setdefault(json.dumps(facts[key]), []).append(r)
        if len(groups) > 1:
            values = [json.loads(v) for v in groups]
            shown = _argv_differences(values) if key == "argv" else [str(v) for v in values]
            said = "; ".join(f"{value!r} on {_where(everyone, ranks)}" for value, ranks in zip(shown, groups.values()))
            problems.append(f"{label}: {said}")
    return problems


def _argv_differences(argvs: list[list[str]]) -> list[str]:
    """The command lines cut to where they differ: the arguments all share at the start and at
    the end become "...", so a long base_train command shows the one flag that differs."""
    first, shortest = argvs[0], min(len(a) for a in argvs)
    head = min(next((i for i, (x, y) in enumerate(zip(first, a)) if x != y), min(len(first), len(a))) for a in argvs)
    tail = min(next((i for i, (x, y) in enumerate(zip(reversed(first), reversed(a))) if x != y),
                    min(len(first), len(a))) for a in argvs)
    tail = min(tail, shortest - head)
    return [("... " if head else "") + (shlex.join(a[head:len(a) - tail]) or "(nothing)") + (" ..." if tail else "")
            for a in argvs]


def _prefix(env: Mapping[str, str] | None = None) -> str:
    """The roll calls' keys, per torchrun attempt: its store outlives a worker restart (torchrun
    max_restarts), and a failure posted by the previous attempt failed every later one at once."""
    env = os.environ if env is None else env
    return f"nanochat/start/attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _leave(store, key: str, rank: int, linger_s: float | None = None) -> None:
    """Before a rank raises out of the roll call: mark it done reading; rank 0 (outside torchrun it
    hosts the store) waits, at most `linger_s`, until every rank that arrived has read, else they
    got "connection closed" from the store instead of the verdict."""
    store.add(f"{key}/read", 1)
    if rank != 0:
        return
    deadline = time.monotonic() + (LINGER_S if linger_s is None else linger_s)
    while time.monotonic() < deadline and store.add(f"{key}/read", 0) < store.add(f"{key}/count", 0):
        time.sleep(0.05)


def _said(message: str) -> RequestError:
    """The roll call's refusal, raised on every rank: not posted again for a later roll call."""
    error = RequestError(message)
    error.start_failure_posted = True   # flags._exit_with_error reads it
    return error


def _failures(store, key: str, world: int) -> str:
    said = []
    for r in range(world):
        if store.check([f"{key}/failure/rank{r}"]):
            post = json.loads(store.get(f"{key}/failure/rank{r}"))
            said.append(f"rank {r} (host {post['host']}) stopped before the process group formed: {post['message']}")
    return "; ".join(said) or "a rank stopped before the process group formed (see its node's log)"


def roll_call(store, rank: int, world: int, facts: dict, timeout_s: float, *, poll_s: float = 0.05) -> None:
    """Collective on the rendezvous `store` (before init_process_group): post `facts`, wait for every
    rank, and raise RequestError on every rank when one is missing after `timeout_s`, posted a
    failure (post_start_failure), or runs something else (_differences)."""
    # the n-th roll call of each rank pairs up: counted on the store, per rank
    key = f"{_prefix()}/{store.add(f'{_prefix()}/calls/rank{rank}', 1)}"
    files = json.dumps(facts["files"], sort_keys=True)   # read back only where the digests differ
    store.set(f"{key}/files{rank}", files)
    slim = {k: v for k, v in facts.items() if k != "files"}
    store.set(f"{key}/rank{rank}", json.dumps({**slim, "code": hashlib.sha256(files.encode()).hexdigest()}))
    store.add(f"{key}/count", 1)
    t0 = time.monotonic()
    while True:
        if store.add(f"{key}/failed", 0):
            said = _failures(store, key, world)
            _leave(store, key, rank)
            raise _said(said)
        if store.add(f"{key}/count", 0) >= world:
            break
        if time.monotonic() - t0 > timeout_s:
            missing = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
            _leave(store, key, rank, linger_s=1.0)
            raise _said(
                f"rank(s) {_span(missing)} of {world} did not reach the start within {timeout_s:g} s ({TIMEOUT_ENV}; "
                f"seen from rank {rank} on host {facts['host']}). A rank that stopped before it says why in its own "
                "node's log (a flag refused there, a --data-dir missing on that node, a traceback), or its node's "
                f"launch was never started (every node runs the same command, each with its own node rank)")
        time.sleep(poll_s)
    everyone = [json.loads(store.get(f"{key}/rank{r}")) for r in range(world)]
    problems = _differences(everyone, lambda r: json.loads(store.get(f"{key}/files{r}")))
    if problems:
        _leave(store, key, rank)
        raise _said("the ranks of this launch do not run the same thing: " + "; ".join(problems)
                           + ". Start every node from the same checkout (git pull, or rsync the repo), with the "
                           "same torch and the same command line")


def post_start_failure(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Under torchrun: leave `message` (why this rank stops before its roll call) on the launch's
    store, where the other ranks' roll call raises it at once. Returns whether it was posted: not
    outside torchrun (rank 0 hosts the store there, and may be the rank that stops), nor where the
    store cannot be reached (the error is raised on this rank regardless)."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except (KeyError, ValueError):
        return False
    from datetime import timedelta

    import torch.distributed as dist
    try:
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=POST_TIMEOUT_S)))
        key = f"{_prefix(env)}/{store.add(f'{_prefix(env)}/calls/rank{rank}', 0) + 1}"   # the roll call it misses
        store.set(f"{key}/failure/rank{rank}", json.dumps({"host": socket.gethostname(), "message": message}))
        store.add(f"{key}/failed", 1)
    except (RuntimeError, OSError, ValueError, KeyError):   # DistError is a RuntimeError: no store to reach
        return False
    return True
