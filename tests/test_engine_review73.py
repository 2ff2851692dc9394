"""Engine / continuous batching review 73: tool-forced tokens feed the lookahead step (no re-run of
the whole batch's step per forced token), interpreter exit with a scheduler step in flight exits
cleanly, and an Engine on a GPU other than the thread's current one draws on its own GPU."""

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from nanochat.batching import BatchedEngine
from nanochat.decode import StaticDecoder
from nanochat.engine import Engine
from tests.test_engine import prompt_for, random_model, tiny_chat_model

REPO = Path(__file__).resolve().parents[1]


class ToolHappyModel(torch.nn.Module):
    """The tiny chat model with its logits nudged by the token fed last (a function of the row's own
    tokens, so a batched row sees what it sees alone): about one token in five opens a tool call,
    whose expression is "3" and then closes, so rows keep calling the calculator."""

    def __init__(self, model, tok):
        super().__init__()
        self.inner, self.config = model, model.config
        self.python_start = tok.encode_special("<|python_start|>")
        self.python_end = tok.encode_special("<|python_end|>")
        self.three = tok.encode("3")[0]

    def forward(self, idx, **kw):
        out = self.inner(idx, **kw).clone()
        last, logits = idx[:, -1], out[:, -1]
        logits[last % 5 == 0, self.python_start] += 50
        logits[last == self.python_start, self.three] += 80
        logits[last == self.three, self.python_end] += 80
        return out


@pytest.fixture(scope="module")
def tool_model(tiny_corpus):
    model, tok = tiny_chat_model(str(tiny_corpus))
    return ToolHappyModel(model, tok), tok


def _collect(gen):
    return [(list(c), list(m)) for c, m in gen]


@pytest.fixture
def reruns(monkeypatch):
    """Counts StaticDecoder.step calls: the host-fed step is the lookahead's re-run (a prefill
    hands over through the cache, samples through step_sampled / step_rows)."""
    calls = []
    real = StaticDecoder.step

    def counted(self, column, position):
        calls.append(list(column))
        return real(self, column, position)

    monkeypatch.setattr(StaticDecoder, "step", counted)
    return calls


def test_forced_tokens_feed_the_lookahead_step_without_a_rerun(tool_model, reruns):
    # a row's forced token is known a step ahead (its `forced` queue): it must be written over its
    # sample before the speculative step is queued. Re-running the step from the host tokens cost
    # one more step per forced token (tool-heavy rows: 152 model calls for 120 tokens, now 120)
    model, tok = tool_model
    prompt = prompt_for(tok, "Hi")
    kw = dict(num_samples=2, max_tokens=60, temperature=0.9, seed=3, stop_tokens=())
    want = _collect(Engine(model, tok, decode="eager").generate(prompt, **kw))
    got = _collect(Engine(model, tok, decode="static", decode_bucket=16).generate(prompt, **kw))
    assert got == want
    masks = [m for _, m in want]
    assert sum(m.count(0) for m in masks) > 10 and [0, 1] in masks and [1, 0] in masks  # one row forced, one sampled
    assert reruns == []


def test_batched_tool_calls_feed_the_lookahead_step_without_a_rerun(tool_model, reruns):
    # continuous batching: a re-run is a step of every live row, so each forced token of any row
    # cost the whole batch a step (8 tool-heavy requests: 253 model calls, now 140; 1.01 -> 0.60 s)
    model, tok = tool_model
    lone = Engine(model, tok, decode="eager")
    batched = BatchedEngine(Engine(model, tok, decode="static", decode_bucket=16), slots=4)
    reqs = [dict(tokens=prompt_for(tok, text), num_samples=n, max_tokens=40, temperature=t, seed=i, stop_tokens=())
            for i, (text, n, t) in enumerate([("Hi", 1, 0.0), ("Alas", 2, 0.9), ("What now", 1, 1.0)])]
    want = [_collect(lone.generate(**r)) for r in reqs]
    gens = [batched.generate(**r) for r in reqs]
    firsts = [next(g) for g in gens]   # all submitted before any is drained: they decode together
    got = [[(list(f[0]), list(f[1]))] + _collect(g) for f, g in zip(firsts, gens)]
    assert got == want
    assert sum(m.count(0) for w in want for _, m in w) > 20
    assert batched.rows_stepped / batched.steps > 2 and reruns == []
    batched.close()


EXIT_SCRIPT = """
import sys, time
import torch
from nanochat.batching import BatchedEngine
from nanochat.engine import Engine
from tests.test_engine import random_model

batched = BatchedEngine(Engine(random_model("cpu"), None, decode="static", decode_bucket=16), slots=2)
real = batched._step

def step_still_running():   # the scheduler is still inside a step as the caller's script ends
    real()
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        torch.ones(8) + 1
batched._step = step_still_running
print(len(list(batched.generate([1, 2, 3], max_tokens=3))))
"""


def test_exit_with_a_scheduler_step_in_flight_is_clean(tmp_path):
    # the scheduler is a daemon thread: at exit the interpreter killed it inside a tensor free,
    # and the process aborted ("terminate called without an active exception", -6) after a
    # successful run; ~1 script in 8 whose last request had just ended, every one here
    script = tmp_path / "exit_script.py"
    script.write_text(textwrap.dedent(EXIT_SCRIPT))
    env = {**os.environ, "PYTHONPATH": str(REPO), "NANOCHAT_BASE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout.strip()) == (0, "3"), done.stderr[-2000:]


@pytest.mark.cuda
def test_an_engine_on_the_second_gpu_runs_from_a_new_thread_cuda():
    """chat_web --num-gpus 2 --batch-slots 1: replica 1's Engine generates in a fresh thread, whose
    current device is cuda:0. Triton launches (the sampler, the decode attention of a static
    step) and the decoders' CUDA events follow the current device, not the tensors': they ran on
    cuda:0 over cuda:1's memory. Each step now runs with the engine's GPU current, and the
    consumer's own current device is left as it was between steps."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    model = random_model("cuda:1")
    prompt, kw = list(range(1, 14)), dict(num_samples=2, max_tokens=40, temperature=0.8, top_k=50, seed=7,
                                          stop_tokens=())

    def engine(decode):
        return Engine(model, None, decode=decode, decode_bucket=16, graph_step="compiled")

    with torch.cuda.device(1):   # the reference: cuda:1 current, as it is in no thread of chat_web's
        want = {decode: _collect(engine(decode).generate(prompt, **kw)) for decode in ("static", "graphs")}
    result = {}

    def run():
        try:
            for decode in ("static", "graphs"):
                eng = engine(decode)
                eng.warmup(batch_sizes=(2,), all_buckets=False)
                result[decode] = [(list(c), list(m), torch.cuda.current_device()) for c, m in eng.generate(prompt, **kw)]
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(600)
    if "error" in result:
        raise result["error"]
    for decode in ("static", "graphs"):
        assert [(c, m) for c, m, _ in result[decode]] == want[decode], decode
        assert {d for _, _, d in result[decode]} == {0}, decode   # the consumer's device, between steps


@pytest.mark.cuda
def test_interleaved_generations_of_two_batch_sizes_under_graphs_cuda():
    """Two open generations on one decode="graphs" Engine with different batch sizes run on two
    decoders whose graphs share the engine's memory pool: each yields with its next logits still
    in its graph's output, and the other's replay runs before they are read. A graph captured
    later may have its output in memory an earlier graph frees inside its capture (the pool's
    free blocks), which that graph's replay then overwrites. Not run on a GPU by its author (no
    device time): if it fails, give Engine._acquire_decoder's decoders a pool each
    (new_decoder's pool=torch.cuda.graph_pool_handle() when not per_row)."""
    model = random_model("cuda")
    engine = Engine(model, None, decode="graphs", decode_bucket=16, graph_step="compiled")
    engine.warmup(batch_sizes=(1, 2))
    kw = dict(max_tokens=40, temperature=0.0, stop_tokens=())
    one, two = list(range(1, 12)), list(range(20, 37))
    want = (_collect(engine.generate(one, **kw)), _collect(engine.generate(two, num_samples=2, **kw)))
    got = ([], [])
    for a, b in zip(engine.generate(one, **kw), engine.generate(two, num_samples=2, **kw)):
        got[0].append((list(a[0]), list(a[1])))
        got[1].append((list(b[0]), list(b[1])))
    assert got == want
