"""Engine decode paths beyond eager: the static-cache step (eager and CUDA graphs, the compiled and
the persistent batch-1 step) against eager and full recomputation, bucket lengths, warm-ups, the
auto choice, and bench_inference's CPU smoke rows (split out of test_engine.py)."""

import pytest
import torch

from nanochat.engine import Engine
from tests.test_engine import random_model


# ------------------------------------------------------------------------------------ static / graphs decode

def greedy_full_recompute(model, prompt, n):
    """Greedy continuation without any cache (one full forward per token)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids], device=model.wte.weight.device))[0, -1]
            top2 = logits.topk(2).values
            assert top2[0] - top2[1] > 1e-4, "tie in greedy choice: the test model is not decisive"
            ids.append(int(logits.argmax()))
    return ids


def test_static_decode_matches_eager_and_full_recompute():
    # seq 128 -> window 32 on the S layer; GQA 2/1; bucket 16: decoding 19..78 crosses 4 buckets
    # and the window edge, with a batch of 3
    model = random_model("cpu")
    prompt = list(range(1, 20))
    kw = dict(num_samples=3, max_tokens=60, temperature=0.0, stop_tokens=())
    static = Engine(model, None, decode="static", decode_bucket=16)
    got = static.generate_batch(prompt, **kw)
    assert got == Engine(model, None, decode="eager").generate_batch(prompt, **kw)
    assert got[0][0] == greedy_full_recompute(model, prompt, 60)
    assert static.decoders[3].captures == 0 and not static.decoders[3].busy
    # the persistent cache is reused: a shorter prompt after a longer one sees no stale slots
    short = static.generate_batch(prompt[:5], **kw)
    assert short == Engine(model, None, decode="eager").generate_batch(prompt[:5], **kw)


def test_static_step_logits_match_cached_forward():
    from nanochat.attention import KVCache, StaticKV
    from nanochat.decode import StaticDecoder

    model = random_model("cpu", n_layer=3, n_head=4, n_kv_head=2, sequence_len=48)  # window 12
    seq = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1))
    new = lambda n: KVCache(2, 2, n, 16, 3, device="cpu", dtype=torch.float32)  # noqa: E731
    decoder = StaticDecoder(new(48), model, bucket=8)
    with torch.no_grad():
        ref_cache = new(48)
        model(seq[:, :5], kv_cache=ref_cache)
        model(seq[:, :5], kv_cache=decoder.cache)
        for t in range(5, 40):
            want = model(seq[:, t:t + 1], kv_cache=ref_cache)[:, -1]
            torch.testing.assert_close(decoder.step(seq[:, t].tolist(), t), want, atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="past the cache end"):
            decoder.step([1, 2], 48)
        with pytest.raises(ValueError, match="3 tokens for a batch of 2"):
            decoder.step([1, 2, 3], 3)
        with pytest.raises(ValueError, match="length"):
            StaticKV(decoder.cache, decoder.pos, torch.arange(49))
        with pytest.raises(ValueError, match="one token per row"):
            model(seq[:, :2], kv_cache=StaticKV(decoder.cache, decoder.pos, torch.arange(8)))


def test_bucket_length():
    from nanochat.decode import StaticDecoder, bucket_length

    assert [bucket_length(n, 600, 256) for n in (1, 256, 257, 512, 513, 600)] == [256, 256, 512, 512, 600, 600]
    cache = Engine(random_model("cpu"), None).new_cache(1, 100)
    assert StaticDecoder(cache, None, bucket=32).lengths() == [32, 64, 96, 100]


def test_static_decode_context_end_and_busy_fallback():
    model = random_model("cpu")
    engine = Engine(model, None, decode="static", decode_bucket=16)
    steps = list(engine.generate(list(range(1, 126)), max_tokens=50, temperature=0.0, stop_tokens=()))
    assert len(steps) == 3  # context 128: 125 prompt tokens leave room for 3
    # two live generations with one batch size: the second decodes eagerly with a private cache
    kw = dict(num_samples=2, max_tokens=20, temperature=0.0, stop_tokens=())
    a, b = engine.generate([1, 2, 3], **kw), engine.generate([4, 5, 6, 7], **kw)
    cols_a, cols_b = [], []
    for x, y in zip(a, b):
        cols_a.append(x[0])
        cols_b.append(y[0])
    ref = Engine(model, None, decode="eager")
    assert cols_a == [c for c, _ in ref.generate([1, 2, 3], **kw)]
    assert cols_b == [c for c, _ in ref.generate([4, 5, 6, 7], **kw)]
    assert not engine.decoders[2].busy
    for n in range(1, 7):  # at most MAX_DECODERS persistent caches
        engine.generate_batch([1, 2], num_samples=n, max_tokens=2)
    assert list(engine.decoders) == [3, 4, 5, 6]


def test_decode_mode_choice_and_validation():
    model = random_model("cpu")
    assert Engine(model, None, decode="auto").decode_mode == "eager"
    for kw, name in [({"decode": "graphs"}, "decode"), ({"decode": "fast"}, "decode"),
                     ({"graph_step": "jit"}, "graph_step"), ({"decode_bucket": 0}, "decode_bucket")]:
        with pytest.raises(ValueError, match=name):
            Engine(model, None, **kw)


def graph_decode_agrees(graph_step):
    model = random_model("cuda")  # fp32 compute: greedy tokens must match exactly
    prompt = list(range(1, 20))
    kw = dict(num_samples=3, max_tokens=60, temperature=0.0, stop_tokens=())
    engine = Engine(model, None, decode="graphs", decode_bucket=16, graph_step=graph_step)
    want = Engine(model, None, decode="eager").generate_batch(prompt, **kw)
    assert engine.generate_batch(prompt, **kw) == want
    decoder = engine.decoders[3]
    assert decoder.captures == 4  # buckets 32, 48, 64, 80
    frames = dict(torch._dynamo.utils.counters["frames"])
    assert engine.generate_batch(prompt, **kw) == want
    assert decoder.captures == 4 and dict(torch._dynamo.utils.counters["frames"]) == frames  # no re-capture/compile
    sampled = dict(kw, temperature=1.0, top_k=20, seed=5)
    assert engine.generate_batch(prompt, **sampled) == Engine(model, None, decode="eager").generate_batch(
        prompt, **sampled)


@pytest.mark.cuda
@pytest.mark.parametrize("graph_step", ["compiled", "eager"])
def test_graph_decode_matches_eager_cuda(graph_step):
    graph_decode_agrees(graph_step)


@pytest.mark.cuda
def test_persistent_graph_decode_matches_eager_cuda():
    """graph_step="persistent": batch 1 runs the persistent kernel inside the captured graphs (fp32
    model: greedy tokens equal eager's, across 4 buckets), batch 3 the compiled step."""
    from nanochat.triton_decode import PersistentDecodeStep

    model = random_model("cuda")
    prompt = list(range(1, 20))
    engine = Engine(model, None, decode="graphs", decode_bucket=16, graph_step="persistent")
    for n in (1, 3):
        kw = dict(num_samples=n, max_tokens=60, temperature=0.0, stop_tokens=())
        assert engine.generate_batch(prompt, **kw) == Engine(model, None, decode="eager").generate_batch(prompt, **kw)
    assert isinstance(engine.decoders[1].step_model, PersistentDecodeStep)
    assert not isinstance(engine.decoders[3].step_model, PersistentDecodeStep)


@pytest.mark.cuda
def test_graphs_warmup_runs_a_prefill_cuda():
    """warmup() in graphs mode ends with a real short request, so the first user request's
    eager prefill does not pay the one-time cuBLAS / attention initialisation."""
    model = random_model("cuda")
    engine = Engine(model, None, decode="graphs", decode_bucket=16)
    shapes = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(args[0].shape)),
                                             with_kwargs=True)
    try:
        engine.warmup(batch_sizes=(1, 2), all_buckets=False)
    finally:
        handle.remove()
    assert any(t == 4 for _, t in shapes), shapes   # the 4-token prompt's prefill
    assert engine.decoders[1].captures >= 1 and engine.decoders[2].captures >= 1


def test_eager_warmup_runs_short_requests():
    model = random_model("cpu")
    engine = Engine(model, None, decode="eager")
    shapes = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: shapes.append(tuple(args[0].shape)),
                                             with_kwargs=True)
    try:
        assert engine.warmup(batch_sizes=(1,)) > 0
    finally:
        handle.remove()
    assert shapes[0] == (1, 4) and len(shapes) >= 3   # the prefill, then decode steps


@pytest.mark.cuda
def test_auto_graph_step_on_the_gpu_cuda():
    """graph_step auto (the default): on an H100/H200 (cc 9.0) batch 1 takes the persistent step
    after its start-up probe and decodes what eager does; elsewhere it is the compiled step,
    and the note says why."""
    from nanochat.triton_decode import PersistentDecodeStep

    model = random_model("cuda")
    engine = Engine(model, None, decode="graphs", decode_bucket=16)
    kw = dict(num_samples=1, max_tokens=40, temperature=0.0, stop_tokens=())
    assert engine.generate_batch(list(range(1, 20)), **kw) == Engine(model, None, decode="eager").generate_batch(
        list(range(1, 20)), **kw)
    hopper = torch.cuda.get_device_capability() == (9, 0)
    assert engine.graph_step == ("persistent" if hopper else "compiled"), engine.graph_step_note
    assert isinstance(engine.decoders[1].step_model, PersistentDecodeStep) == hopper


def test_bench_inference_cpu_smoke_with_fused_qkv_ab(capsys):
    """The inference benchmark end to end on a tiny CPU model, fused and unfused q/k/v: it prints
    one decode row per (mode, batch) and labels the unfused ones."""
    import json

    from scripts.bench_inference import main

    assert main(["--device", "cpu", "--depth", "2", "--prompt-len", "16", "--decode-tokens", "4",
                 "--batch-sizes", "1,2", "--vocab-size", "256", "--seq-len", "64", "--decode", "static",
                 "--fused-qkv", "on,off", "--repeats", "1", "--ttft-lengths", "7,30"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    decode = {(r["decode"], r["batch"]) for r in rows if r.get("bench") == "decode"}
    assert decode == {("static", 1), ("static", 2), ("static/unfused", 1), ("static/unfused", 2)}
    warm = [r for r in rows if r.get("bench") == "warmup"]
    assert len(warm) == 2 and all(r["first_ttft_s"] > 0 for r in warm)
    ttft = [(r["decode"], r["prompt_len"]) for r in rows if r.get("bench") == "ttft_length" and r["ttft_s"] > 0]
    assert ttft == [("static", 7), ("static", 30), ("static/unfused", 7), ("static/unfused", 30)]
    with pytest.raises(ValueError, match="--fused-qkv"):
        main(["--device", "cpu", "--fused-qkv", "maybe"])
    for bad in ("12,x", "0", "2047"):
        with pytest.raises(ValueError, match="--ttft-lengths"):
            main(["--device", "cpu", "--ttft-lengths", bad])
    with pytest.raises(ValueError, match="--graph-step.*persistent"):
        main(["--device", "cpu", "--graph-step", "compiled,megakernel"])


def test_bench_inference_decode_kernel_rows_and_reset(capsys):
    """--decode-kernel runs one engine per kernel for the static/graphs modes (labelled unless
    the default), leaves the module setting at its default afterwards, and refuses unknown names
    before building anything."""
    import json

    from nanochat import attention as A
    from scripts.bench_inference import main

    assert main(["--device", "cpu", "--depth", "2", "--prompt-len", "8", "--decode-tokens", "2",
                 "--batch-sizes", "1", "--vocab-size", "256", "--seq-len", "32", "--decode", "static,eager",
                 "--decode-kernel", "triton,sdpa", "--repeats", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {r["decode"] for r in rows if r.get("bench") == "decode"} == {"static/triton", "static/sdpa", "eager"}
    assert A.DECODE_KERNEL == A.DEFAULT_DECODE_KERNEL == "triton_fused"
    with pytest.raises(ValueError, match="--decode-kernel: got 'flash'; accepted: comma-separated triton"):
        main(["--device", "cpu", "--decode-kernel", "flash"])
    with pytest.raises(ValueError, match="decode kernel: got 'x'"):
        A.set_decode_kernel("x")
    A.set_decode_kernel("sdpa")
    try:
        assert not A._triton_decode_ok(torch.empty(1, 1, 1, 128, device="meta"))
    finally:
        A.set_decode_kernel(A.DEFAULT_DECODE_KERNEL)


def test_bench_inference_timeline_busy_and_idle_gaps():
    """bench_inference --profile's timeline: busy is the union of the events (a copy on another
    stream overlapping a kernel counts once), and each idle stretch is named by the event that
    ended last before it, not by its neighbour in start order."""
    from scripts.bench_inference import timeline

    events = [("step", 0.0, 100.0), ("copy", 10.0, 12.0), ("sample", 103.0, 110.0), ("step", 112.0, 200.0)]
    busy, gaps = timeline(events)
    assert busy == 100.0 + 7.0 + 88.0
    assert gaps == {"step -> sample": [1, 3.0], "sample -> step": [1, 2.0]}
    assert timeline([]) == (0.0, {})


def test_step_at_says_the_persistent_kernel_runs_batch_one_only(monkeypatch):
    """A persistent engine's batch-8 rows ran the fallback step but bench_inference labelled them
    persistent (JSON graph_step and the table's decode column). (Under the interpreter: on a plain
    CPU an explicit persistent request is refused when the engine is built.)"""
    from scripts.bench_inference import label

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = random_model("cpu")
    persistent = Engine(model, None, decode="static", graph_step="persistent")
    assert persistent.step_at(1) == "persistent" and persistent.step_at(8) == "eager"
    assert label(persistent) == "static/persistent" and label(persistent, 1) == "static/persistent"
    assert label(persistent, 8) == "static(not persistent)"
    monkeypatch.delenv("TRITON_INTERPRET")   # else auto takes the interpreted persistent step too
    plain = Engine(model, None, decode="static")
    assert plain.step_at(8) == "eager" and label(plain, 8) == "static"
    assert Engine(model, None, decode="eager").step_at(1) is None
