"""Ctrl-C during rustbpe training: the merge loop runs with the GIL released, so the binding polls
Python's signal handlers from the calling thread and stops the loop through a cancel flag. A
SIGINT in the merge phase must end the call promptly with KeyboardInterrupt, keep the previous
model (no partial training returned as success) and leave the object usable.

The merge phase is made long on purpose, independent of machine speed within reason: 100 texts of
10,000 random letters and digits, split with `\\S+` so each text is one chunk. Every one of the 3,844
letter pairs occurs in every chunk, so each merge rescans all 1,000,000 ids (~2-3 ms per merge on a
2-core CPU) and the 20,000 merges asked would take about a minute; the interrupt comes 0.5 s after
the binding announces the merge phase (RUSTBPE_VERBOSE) and must be answered within 3 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import require_module

CHILD = textwrap.dedent(r"""
    import random, sys, rustbpe
    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(["abab cdcd abab"], 260)          # the model an interrupt must keep
    before = tok.get_merges()
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    texts = ["".join(rng.choices(alphabet, k=10_000)) for _ in range(100)]
    print("ready", flush=True)
    try:
        tok.train_from_iterator(texts, 256 + 20_000, pattern=r"\S+", threads=1)
    except KeyboardInterrupt:
        print("kept previous model:", tok.get_merges() == before, flush=True)
        tok.train_from_iterator(["xyxy zwzw"], 258)            # still usable afterwards
        print("retrained merges:", len(tok.get_merges()), flush=True)
        raise
    print("finished without interruption", flush=True)
""")


def test_sigint_during_merges_raises_keyboard_interrupt(tmp_path):
    require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")
    env = {**os.environ, "RUSTBPE_VERBOSE": "1"}
    env.pop("RAYON_NUM_THREADS", None)
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    try:
        # the binding prints this line (stderr) once counting is done and merging starts
        deadline = time.monotonic() + 30
        line = ""
        while "merging up to vocab_size" not in line:
            line = proc.stderr.readline()
            if not line:   # stderr closed: the child ended (or crashed) before merging
                pytest.fail(f"child ended before the merge phase: {proc.communicate(timeout=10)}")
            assert time.monotonic() < deadline, "the merge phase never started"
        time.sleep(0.5)                               # well inside the merge loop
        assert proc.poll() is None, "training finished before the interrupt: the test data is too small"
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
        answered = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "KeyboardInterrupt" in err, err
    assert "panicked" not in err and "finished without interruption" not in out, (out, err)
    assert "kept previous model: True" in out, out
    assert "retrained merges: 2" in out, out
    assert proc.returncode == -signal.SIGINT, proc.returncode   # Python's exit on an uncaught Ctrl-C
    assert answered < 3.0, f"the interrupt took {answered:.2f} s to end training"


@pytest.mark.parametrize("threads", [1, 2])
def test_uninterrupted_training_is_unchanged_by_the_polling(threads):
    """The poll loop (50 ms waits) returns the same merges as before and does not add latency to
    short trainings: a 2-merge training returns at once, not after a poll period."""
    rustbpe = require_module("rustbpe", "build it: uv pip install -p .venv/bin/python ./rustbpe")
    tok = rustbpe.Tokenizer()
    times = []
    for _ in range(20):
        t = time.perf_counter()
        tok.train_from_iterator(["abab cdcd abab"], 258, threads=threads)
        times.append(time.perf_counter() - t)
    assert tok.get_merges() == [(97, 98, 256), (99, 100, 257)]
    # the fastest call: a result that waited for a poll period would take >= 50 ms every time, while
    # a loaded CI machine only slows some calls
    assert min(times) < 0.04, f"{min(times) * 1000:.1f} ms for the fastest tiny training"
