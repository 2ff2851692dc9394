"""nanochat/triton_decode.py: the persistent batch-1 decode step against the model's own static
decode path (interpreter on CPU, phase by phase; the one-launch kernel with grid barriers on the
GPU), the Engine's graph_step="persistent", and the conditions under which it refuses to run."""

import pytest
import torch

from nanochat.attention import KVCache
from nanochat.engine import Engine
from nanochat.gpt import GPT, GPTConfig
from nanochat.triton_decode import PersistentDecodeStep, unsupported


# GQA (4 q heads on 2 kv heads), head_dim 16, value embeddings on layers 0 and 2, layer 0 a
# window of 8 (sequence 32 / 4): the 12 steps below cross it.
SMALL = dict(sequence_len=32, vocab_size=100, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL")


def _model(dtype=torch.float32, device="cpu", seed=0, **overrides):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**(SMALL | overrides)), compute_dtype=dtype).to(device)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:  # c_proj and ve_gate start at zero: make every path count
                p.normal_(0, 0.3)
    return model.to(dtype).eval()


def _cache(model, batch=1, dtype=None):
    cfg = model.config
    return KVCache(batch, cfg.n_kv_head, cfg.sequence_len, cfg.head_dim, cfg.n_layer,
                   model.wte.weight.device, dtype or model.wte.weight.dtype)


def _step_matches_static(model, positions: int, seed: int):
    """Decode `positions` random tokens with a PersistentDecodeStep (three programs, key blocks of
    4) beside the model's own static decode step, asserting the logits agree within 1e-4 of the
    largest at each position, and that the lm_head loop plain (head_stages 0) and pipelined (2)
    give the default's logits bit for bit. Returns (the step's cache, the model's cache)."""
    from nanochat.attention import StaticKV

    ref_cache, cache = _cache(model), _cache(model)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (positions,), generator=torch.Generator().manual_seed(seed))
    keys = torch.arange(model.config.sequence_len)
    with torch.no_grad(), model.inference_weights():
        step = PersistentDecodeStep(model, cache, programs=3, key_block=4)
        pos = torch.zeros(1, dtype=torch.long)
        for t in range(positions):
            pos.fill_(t)
            ids = tokens[t].view(1, 1)
            want = model(ids, kv_cache=StaticKV(ref_cache, pos, keys))[:, -1]
            got = step(ids, kv_cache=StaticKV(cache, pos, keys))[:, -1]
            assert got.shape == want.shape == (1, vocab), got.shape
            err = (got - want).abs().max().item()
            assert err < 1e-4 * want.abs().max().item(), (t, err)
        for hs in (0, 2):   # the same sums in the same order, bit for bit
            other = PersistentDecodeStep(model, cache, programs=3, key_block=4, head_stages=hs)
            assert torch.equal(other(ids, kv_cache=StaticKV(cache, pos, keys)), got.view(1, 1, -1)), hs
    return cache, ref_cache


STEP_SCRIPT = """
import torch
from tests.test_triton_decode import _model, _step_matches_static
cache, ref_cache = _step_matches_static(_model(), 12, seed=1)
for layer in range(3):
    for a, b in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        assert torch.allclose(a[layer][:, :, :12], b[layer][:, :, :12], atol=1e-5), layer
print("OK")
"""


def test_persistent_step_matches_static_decode_interpreted(interpreted):
    """fp32 under the interpreter (three programs, so every phase splits its rows and key chunks
    unevenly; key blocks of 4, so a chunk spans one block and then several): logits within 1e-4
    of the model's static decode step at every position, across the window edge, with GQA and
    value embeddings; the k/v it writes equal the model's."""
    assert interpreted["STEP_SCRIPT"] is None, interpreted["STEP_SCRIPT"]


INT8_SCRIPT = """
from nanochat.engine import Engine
from nanochat.quantize import quantize_model
from tests.test_triton_decode import _model, _step_matches_static
from nanochat.quantize import Int8Linear
model = quantize_model(_model(seed=5), "int8")
for m in model.modules():   # the reference products dequantise (same sums; interpreted, the int8
    if isinstance(m, Int8Linear):   # kernel would take most of the test: it has tests of its own)
        m.kernel = None
_step_matches_static(model, 5, seed=2)
prompt = [5, 17, 42]
want = Engine(model, decode="eager").generate_batch(prompt, max_tokens=4, temperature=0.0)[0]
engine = Engine(model, decode="static")   # graph_step auto picks the step for int8 weights too
assert engine.graph_step == "persistent", engine.graph_step_note
assert engine.generate_batch(prompt, max_tokens=4, temperature=0.0)[0] == want
print("OK")
"""


def test_persistent_step_reads_int8_weights_interpreted(interpreted):
    """A model quantised by nanochat/quantize.py (int8 matrices, float32 row scales, fp32
    lookups and cache): the step's logits are within 1e-4 of the quantised model's own static
    decode at 5 positions, with every lm_head loop, and graph_step auto picks it and generates
    the quantised model's eager greedy tokens."""
    assert interpreted["INT8_SCRIPT"] is None, interpreted["INT8_SCRIPT"]


ENGINE_SCRIPT = """
import torch
from nanochat.engine import Engine
from tests.test_triton_decode import _model
model = _model(seed=3)
prompt = [5, 17, 42, 8, 99, 3]
want = Engine(model, decode="eager").generate_batch(prompt, max_tokens=6, temperature=0.0)[0]
engine = Engine(model, decode="static", graph_step="persistent")
got = engine.generate_batch(prompt, max_tokens=6, temperature=0.0)[0]
assert got == want, (got, want)
from nanochat.triton_decode import PersistentDecodeStep
assert isinstance(engine.decoders[1].step_model, PersistentDecodeStep)
print("OK")
"""


def test_engine_persistent_greedy_equals_eager_interpreted(interpreted):
    """Engine(decode="static", graph_step="persistent") generates the same greedy tokens as eager
    decoding (prefill hand-over, the one-step lookahead and the position feed all go through it)."""
    assert interpreted["ENGINE_SCRIPT"] is None, interpreted["ENGINE_SCRIPT"]


AUTO_SCRIPT = """
import torch
from nanochat.engine import Engine
from nanochat.triton_decode import PersistentDecodeStep
from tests.test_triton_decode import _model
model = _model(seed=4)
prompt = [7, 1, 30, 12]
want = Engine(model, decode="eager").generate_batch(prompt, max_tokens=4, temperature=0.0)[0]
engine = Engine(model, decode="static")  # graph_step auto
assert engine.graph_step == "persistent", engine.graph_step_note
assert engine.generate_batch(prompt, max_tokens=4, temperature=0.0)[0] == want
assert isinstance(engine.decoders[1].step_model, PersistentDecodeStep)
w = model.blocks[1].mlp.c_fc.weight  # a weight it cannot load: the constructor refuses, auto falls back
saved = w.data
buf = torch.empty(w.numel() + 1)
buf[1:].copy_(saved.flatten())
w.data = buf[1:].view(w.shape)
engine = Engine(model, decode="static")
assert engine.generate_batch(prompt, max_tokens=4, temperature=0.0)[0] == want
assert engine.graph_step == "eager" and "16 bytes" in engine.graph_step_note, engine.graph_step_note
w.data = saved
PersistentDecodeStep.launch = lambda self, ids, pos: self.logits.zero_()  # a kernel gone wrong
engine = Engine(model, decode="static")
assert engine.generate_batch(prompt, max_tokens=4, temperature=0.0)[0] == want
assert engine.graph_step == "eager" and "failed its probe" in engine.graph_step_note, engine.graph_step_note
assert not isinstance(engine.decoders[1].step_model, PersistentDecodeStep)
engine = Engine(model, decode="static", graph_fallback="eager")  # chat_cli's: the plain model's kernels
assert engine.generate_batch(prompt, max_tokens=4, temperature=0.0)[0] == want
assert engine.graph_step == "eager" and "failed its probe" in engine.graph_step_note, engine.graph_step_note
assert engine.decoders[1].step_model is model
print("OK")
"""


def test_engine_auto_graph_step_probes_then_falls_back_interpreted(interpreted):
    """graph_step auto (the default) picks the persistent step where it can run (here: the
    interpreter) and generates what eager does; a step that refuses the model, or whose logits do
    not match the model's at the start-up probe, is dropped for the other step (static decoding:
    the plain model), with the reason in graph_step_note."""
    assert interpreted["AUTO_SCRIPT"] is None, interpreted["AUTO_SCRIPT"]


# The four scripts above run in one interpreted subprocess (the `interpreted` fixture), in this
# order: AUTO_SCRIPT last, as it replaces PersistentDecodeStep.launch for good. STEP_SCRIPT's and
# ENGINE_SCRIPT's decode lengths are the fewest that still cross layer 0's window of 8 and span
# several key blocks of 4 per chunk; INT8_SCRIPT and AUTO_SCRIPT stay inside the window.
SCRIPTS = {"STEP_SCRIPT": STEP_SCRIPT, "INT8_SCRIPT": INT8_SCRIPT, "ENGINE_SCRIPT": ENGINE_SCRIPT,
           "AUTO_SCRIPT": AUTO_SCRIPT}


def test_engine_auto_graph_step_without_a_gpu_is_the_plain_model(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    engine = Engine(_model(), decode="static")   # static steps compile nothing: the plain model
    assert engine.graph_step == "eager" and "needs a CUDA GPU" in engine.graph_step_note
    assert Engine(_model()).graph_step_note == ""  # eager decoding: no step to choose
    model = _model()
    engine = Engine(model, decode="static", graph_fallback="eager")   # chat_cli's fallback
    assert engine.graph_step == "eager" and engine.graph_step_note.startswith("graph_step auto: eager")
    engine.generate_batch([3, 1, 4], max_tokens=2, temperature=0.0)
    assert engine.decoders[1].step_model is model   # not torch.compile's wrapper
    with pytest.raises(ValueError, match="graph_fallback"):
        Engine(model, decode="static", graph_fallback="persistent")


def test_persistent_step_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = _model()
    assert "batch 2" in unsupported(model, _cache(model, batch=2))
    assert "one dtype" in unsupported(model, _cache(model, dtype=torch.bfloat16))
    assert "CUDA" in unsupported(model, _cache(model))
    with torch.device("meta"):  # head_dim 2048: past the softmax's fixed shift (triton_decode_attention)
        wide = GPT(GPTConfig(**(SMALL | dict(n_embd=2048, n_head=1, n_kv_head=1))))
    assert "head_dim 2048 (needs a power of two in 16..1024)" == unsupported(wide, _cache(wide))
    with pytest.raises(ValueError, match="persistent decode step: needs a CUDA GPU"):
        with model.inference_weights():
            PersistentDecodeStep(model, _cache(model))
    with pytest.raises(ValueError, match="fused_qkv"):
        Engine(model, decode="static", graph_step="persistent", fused_qkv=False)
    with pytest.raises(ValueError, match="graph_step"):
        Engine(model, decode="static", graph_step="megakernel")


def test_persistent_step_needs_inference_weights(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _model()
    with pytest.raises(ValueError, match="inference_weights"):
        PersistentDecodeStep(model, _cache(model))


GPU_CFG = dict(sequence_len=256, vocab_size=1000, n_layer=4, n_head=4, n_kv_head=2, n_embd=256)


def _closer_than_eager_and_replayed_exactly(model, ref, positions: int = 40) -> None:
    """At each position the persistent step's logits are at least as close to `ref`'s (a float32
    model) as `model`'s own eager step's; then 50 CUDA-graph replays reproduce the direct launch
    exactly."""
    from nanochat.attention import StaticKV

    caches = [_cache(model), _cache(model), _cache(ref)]
    keys = torch.arange(GPU_CFG["sequence_len"], device="cuda")
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    tokens = torch.randint(0, GPU_CFG["vocab_size"], (positions,), device="cuda")
    with torch.no_grad(), model.inference_weights():
        step = PersistentDecodeStep(model, caches[1])
        for t in range(positions):
            pos.fill_(t)
            ids = tokens[t].view(1, 1)
            eager = model(ids, kv_cache=StaticKV(caches[0], pos, keys))[:, -1].float()
            got = step(ids, kv_cache=StaticKV(caches[1], pos, keys))[:, -1].clone()
            want = ref(ids, kv_cache=StaticKV(caches[2], pos, keys))[:, -1]
            assert (got - want).norm() <= (eager - want).norm(), t
        direct = got.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step.launch(ids, pos)
        for _ in range(50):  # and every replay: the attention's float64 atomic sums are exact
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(step.logits.view(1, -1), direct)


@pytest.mark.cuda
def test_persistent_step_on_gpu_beats_eager_bf16_accuracy():
    """bf16 weights and cache on the GPU, one launch with grid barriers, replayed in a CUDA
    graph: its logits are closer to a float32 model's than the eager bf16 step's (it keeps the
    residual stream and every accumulation in float32), at every one of 40 positions, and 50
    graph replays reproduce the direct launch exactly (run-to-run determinism)."""
    model = _model(torch.bfloat16, "cuda", **GPU_CFG)
    ref = _model(torch.float32, "cuda", **GPU_CFG)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    _closer_than_eager_and_replayed_exactly(model, ref)


@pytest.mark.cuda
def test_persistent_int8_step_on_gpu_beats_eager_int8_accuracy():
    """The same with int8 matrices (nanochat/quantize.py) and a bf16 cache: the reference is a
    float32 model holding the dequantised weights, so what is measured is the step's arithmetic,
    not the quantisation error; the eager step it must match or beat is the int8 Triton GEMV's."""
    from nanochat.quantize import quantize_model

    model = _model(torch.bfloat16, "cuda", **GPU_CFG)
    ref = _model(torch.float32, "cuda", **GPU_CFG)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    quantize_model(model, "int8")
    with torch.no_grad():
        for got, want in zip(model.decode_matrices(), ref.decode_matrices()):
            want.weight.copy_(got.dequantize(torch.float32))
    _closer_than_eager_and_replayed_exactly(model, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("conf", [dict(), dict(programs=4, unroll=2, block_rows_fc=16)])
def test_preload_moves_loads_not_results(conf):
    """`preload` only moves each phase's first weight-tile loads in front of the barrier's wait:
    masks 0, 5 and 15 give the same logits bit for bit, on the full grid and on a 4-program grid
    (several row tiles per program and K chunks past the preloaded ones), and they stay within
    bf16 noise of the eager step."""
    from nanochat.attention import StaticKV

    model = _model(torch.bfloat16, "cuda", sequence_len=256, vocab_size=1000, n_layer=4, n_head=4, n_kv_head=2,
                   n_embd=256)
    caches = [_cache(model) for _ in range(4)]
    pos = torch.full((1,), 0, dtype=torch.long, device="cuda")
    ids = torch.full((1, 1), 11, dtype=torch.long, device="cuda")
    keys = torch.arange(256, device="cuda")
    with torch.no_grad(), model.inference_weights():
        eager = model(ids, kv_cache=StaticKV(caches[0], pos, keys))[:, -1].float()
        got = [PersistentDecodeStep(model, c, preload=m, **conf)(ids, kv_cache=StaticKV(c, pos, keys)).clone()
               for m, c in zip((0, 5, 15), caches[1:])]
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])
    assert (got[0].view(-1) - eager.view(-1)).norm() <= 0.02 * eager.norm()


def test_persistent_step_refuses_misaligned_tensors_and_bad_tiles(monkeypatch):
    """The kernel's 16-byte loads assume 16-byte aligned weights (the addresses in its pointer
    table): a weight that is a view at an odd offset raises, naming the layer; tile sizes that
    are not powers of two, unroll < 1 and a preload mask outside 0..15 raise naming the argument."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _model()
    with model.inference_weights():
        for bad, name in ((dict(block_rows=12), "block_rows"), (dict(block_rows_qkv=24), "block_rows_qkv"),
                          (dict(key_block=48), "key_block"), (dict(unroll=0), "unroll"),
                          (dict(preload=16), "preload"), (dict(head_stages=-1), "head_stages")):
            with pytest.raises(ValueError, match=name):
                PersistentDecodeStep(model, _cache(model), **bad)
    w = model.blocks[1].mlp.c_fc.weight
    buf = torch.empty(w.numel() + 1)
    buf[1:].copy_(w.detach().flatten())
    w.data = buf[1:].view(w.shape)  # contiguous, 4 bytes past an aligned start
    with model.inference_weights(), pytest.raises(ValueError, match="layer 1 .*16 bytes"):
        PersistentDecodeStep(model, _cache(model))


def test_grid_is_sized_to_the_sms_mps_allows(monkeypatch):
    """Under CUDA MPS with a thread percentage the grid shrinks to the SMs the process may hold
    (nanochat.platform.usable_sms; the interpreter stands in for a 4-SM device), so the grid
    barrier can still open."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _model()
    with model.inference_weights():
        assert PersistentDecodeStep(model, _cache(model)).programs == 4
        monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")
        assert PersistentDecodeStep(model, _cache(model)).programs == 2


def test_phase_times_needs_trace(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = _model()
    with model.inference_weights():
        step = PersistentDecodeStep(model, _cache(model))
    with pytest.raises(AssertionError, match="trace=True"):
        step.phase_times()


@pytest.mark.cuda
def test_phase_trace_accounts_for_the_whole_step():
    """trace=True: every barrier's opening time is recorded (an unwritten slot would make a phase
    negative), the phases add up to the launch's total (program 0's %globaltimer), and the
    logits equal an untraced step's."""
    from nanochat.attention import StaticKV

    model = _model(torch.bfloat16, "cuda", sequence_len=256, vocab_size=1000, n_layer=4, n_head=4, n_kv_head=2,
                   n_embd=256)
    caches = [_cache(model), _cache(model)]
    pos = torch.full((1,), 7, dtype=torch.long, device="cuda")
    ids = torch.full((1, 1), 3, dtype=torch.long, device="cuda")
    keys = torch.arange(256, device="cuda")
    with torch.no_grad(), model.inference_weights():
        plain = PersistentDecodeStep(model, caches[0])(ids, kv_cache=StaticKV(caches[0], pos, keys)).clone()
        traced = PersistentDecodeStep(model, caches[1], trace=True)
        got = traced(ids, kv_cache=StaticKV(caches[1], pos, keys))
        torch.cuda.synchronize()
    assert torch.equal(got, plain)
    times = traced.phase_times()
    assert set(times) == {"x0", "qkv", "attention", "proj", "fc", "proj2", "lm_head", "total"}
    assert all(v >= 0 for v in times.values()) and times["total"] > 0, times
    parts = sum(v for k, v in times.items() if k != "total")
    assert abs(parts - times["total"]) < 1e-6 * max(1.0, times["total"]), times


def test_bench_decode_kernel_configs_parse_and_bad_ones_raise():
    from scripts.bench_decode_kernel import config_name, parse_args, parse_config

    conf = parse_config("16x512x1024w4u10k64q32f8p5")
    assert conf == dict(block_rows=16, block_k=512, block_k_mlp=1024, num_warps=4, unroll=10, key_block=64,
                        block_rows_qkv=32, block_rows_fc=8, preload=5)
    assert config_name(conf) == "16x512x1024w4u10k64q32f8p5"
    assert parse_config("8x256x256") == dict(block_rows=8, block_k=256, block_k_mlp=256)
    args = parse_args(["--configs", "16x512x512,32x256x256u5"])
    assert [config_name(c) for c in args.configs] == ["16x512x512", "32x256x256u5"]
    assert args.quantize == ["none"] and parse_args(["--quantize", "int8,none"]).quantize == ["none", "int8"]
    for argv, flag in ((["--configs", "16x512"], "--configs"), (["--configs", ","], "--configs"),
                       (["--prompt-len", "2048"], "--prompt-len"), (["--steps", "0"], "--steps"),
                       (["--quantize", "int4"], "--quantize"), (["--quantize", "int8,int8"], "--quantize")):
        with pytest.raises(ValueError, match=flag):
            parse_args(argv)


def test_bench_gemv_ring_bad_flags_raise_with_the_flag():
    pytest.importorskip("triton.experimental.gluon", reason="the probe's kernels are Gluon (Triton >= 3.6)")
    from scripts.bench_gemv_ring import parse_args

    args = parse_args(["--mode", "tma", "--depths", "2,10", "--x", "live,none", "--barriers", "on"])
    assert (args.depths, args.x, args.barriers, args.band_rows) == ([2, 10], ["live", "none"], [True], 8)
    for argv, flag in ((["--mode", "wgmma"], "--mode"), (["--depths", "0"], "--depths"),
                       (["--depths", "99"], "--depths"), (["--x", "live,foo"], "--x"),
                       (["--mode", "tma", "--band-rows", "2"], "--band-rows"),
                       (["--barriers", "maybe"], "--barriers"), (["--layers", "0"], "--layers")):
        with pytest.raises(ValueError, match=flag):
            parse_args(argv)


@pytest.mark.cuda
@pytest.mark.parametrize("argv", (["--mode", "cpasync", "--band-rows", "2", "--depths", "1,4"],
                                  ["--mode", "cpasync", "--depths", "3"], ["--mode", "tma", "--depths", "1,3"]))
def test_gemv_ring_chain_equals_the_float32_chain(argv):
    """The ring kernel of scripts/bench_gemv_ring.py computes the GEMV chain (its exit status is 1 if
    any barrier-synchronised live run differs from the float32 chain)."""
    if argv[1] == "tma" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability >= 9.0")
    from scripts.bench_gemv_ring import main

    assert main(argv + ["--layers", "2", "--x", "live", "--barriers", "on", "--repeats", "1"]) == 0


def test_bench_sync_under_stream_roles_and_bad_flags():
    pytest.importorskip("triton.experimental.gluon", reason="the probe's kernels are Gluon (Triton >= 3.6)")
    from scripts.bench_sync_under_stream import parse_args, roles

    assert roles(6, 2, "halves") == [0, 1, -1, -2, -3, -4]
    assert roles(6, 2, "parity") == [0, -1, 1, -2, -3, -4]
    assert roles(5, 4, "parity") == [0, 1, 2, -1, 3]  # past half: odd ids too (from the lowest)
    args = parse_args(["--streamers", "66,99", "--placement", "parity", "--x", "none"])
    assert (args.streamers, args.placement, args.x) == ([66, 99], ["parity"], ["none"])
    for argv, flag in ((["--streamers", "0"], "--streamers"), (["--placement", "random"], "--placement"),
                       (["--x", "const"], "--x"), (["--depth", "11"], "--depth"),
                       (["--stream-mb", "1"], "--stream-mb"), (["--iters", "0"], "--iters")):
        with pytest.raises(ValueError, match=flag):
            parse_args(argv)


@pytest.mark.cuda
def test_sync_under_stream_chain_is_exact_while_half_the_programs_stream():
    """scripts/bench_sync_under_stream.py: the syncers' barrier + live-load rounds reproduce the float64
    recurrence while the other programs stream (its exit status is 1 otherwise), and a small sweep runs."""
    from scripts.bench_sync_under_stream import main

    assert main(["--streamers", "66", "--placement", "halves,parity", "--x", "live,ll", "--stream-mb", "64",
                 "--iters", "5", "--repeats", "1", "--depth", "4"]) == 0


def test_bench_two_role_chain_bad_flags_and_shared_memory():
    pytest.importorskip("triton.experimental.gluon", reason="the probe shares bench_gemv_ring's helpers (Gluon)")
    from scripts.bench_two_role_chain import BAND_BYTES, parse_args, smem_bytes

    args = parse_args(["--cluster", "2,8", "--inflight", "1,3", "--group", "1,4", "--slots", "6"])
    assert (args.cluster, args.inflight, args.group, args.slots) == ([2, 8], [1, 3], [1, 4], 6)
    assert smem_bytes(9) <= 227 * 1024 and smem_bytes(9) - smem_bytes(8) == BAND_BYTES + 16
    for argv, flag in ((["--cluster", "1"], "--cluster"), (["--cluster", "16"], "--cluster"),
                       (["--inflight", "9"], "--inflight"), (["--slots", "4", "--inflight", "5"], "--inflight"),
                       (["--group", "3"], "--group"), (["--slots", "10"], "--slots"), (["--layers", "0"], "--layers")):
        with pytest.raises(ValueError, match=flag):
            parse_args(argv)


@pytest.mark.cuda
def test_two_role_chain_equals_the_float32_chain():
    """scripts/bench_two_role_chain.py (CUDA through NVRTC, clusters, distributed shared memory): the chain
    computed by syncers + streamers equals the float32 chain (exit status 1 otherwise) at every cluster size."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("clusters and bulk copies need compute capability >= 9.0")
    from scripts.bench_two_role_chain import main

    assert main(["--cluster", "2,4,8", "--inflight", "1,3", "--group", "1,2", "--layers", "2", "--repeats", "1"]) == 0
