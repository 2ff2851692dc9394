"""The whole batch-1 decode step as one persistent Triton kernel (Engine graph_step="persistent").

Why: a one-token decode step of a d20 model reads ~870 MB of weights, 0.26 ms at the H100's
3.35 TB/s, but through torch.compile + CUDA graphs it ran ~200 dependent kernels (GEMVs through
cuBLAS, fused elementwise kernels, attention) at ~5 us each, because every dependent 3-13 MB read
pays its launch, ramp-up and tail (H100 GEMV study, CHANGELOG_GB10.md): 0.98 ms, 25% of the
bandwidth roofline. Here one program per SM walks every layer and the phases meet at software
grid barriers, so there are no launches between phases.

Measured (H100, torch 2.11, Triton 3.6, d20 bf16 random weights, prompt 512 + 128 tokens, one
machine, bench_inference --graph-step persistent,compiled): model step 0.757 ms vs 0.984 ms for
the compiled CUDA graph, 1,067 vs 871 tok/s end to end (+22%), TTFT 25.9 vs 41.2 ms, 36% of the
HBM roofline by bytes read; logits 3x closer to a float32 model than the eager bf16 step's. Where
the time goes (bench_decode_kernel --trace, us per step summed over layers, each phase with its
closing barrier): qkv 153, attention 138, proj 76, fc 183, proj2 159, lm_head 40. A barrier
costs ~1.7 us (101 per d20 step) and each GEMV phase pays a DRAM round trip per row tile, which
is why it stays far from the roofline. Tried and slower (CHANGELOG_GB10.md has the numbers): L2
prefetch of coming phases' weights (per-thread prefetch.global.L2, before or two phases ahead),
two programs per SM, the next row tile loaded one step ahead, 8-row tiles, 32-key blocks.

Int8 weights (nanochat/quantize.py): the same phases read the int8 rows and scale each row's
sum. H200, d20: 0.612 ms per step vs 0.58 for bf16 (each program's first tile is in registers
before its barrier opens, so half the bytes buy little and widening costs an instruction per
value); d32: 1.66-1.78 vs 1.87 ms; end to end int8 runs 1,523-1,531 tok/s here vs 1,287-1,306 through
the compiled graph (CHANGELOG_GB10.md, session 45).

The kernel itself, its phases and its grid barrier: nanochat/triton_decode_kernels.py (its
attention phase: nanochat/triton_decode_attention.py).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import triton

from nanochat.platform import usable_sms
from nanochat.triton_aot import programs_per_sm
from nanochat.triton_decode_kernels import N_PTRS, PHASES, decode_step_kernel


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unsupported(model, cache, device_check: bool = True) -> str | None:
    """Why `PersistentDecodeStep(model, cache)` cannot run, or None. Needs: batch 1; the model's
    matrices as plain gpt.Linear weights (not precision.py's fp8/nvfp4 modules) stored in one
    dtype (bf16, fp16 or fp32) that the cache also uses, or all of them int8 (nanochat/quantize.py,
    the lookups, gates and cache in that one dtype); a power-of-two head_dim in 16..1024; a
    CUDA device of compute capability >= 8, or the Triton interpreter (`device_check=False`
    leaves the device out: nanochat/triton_aot builds the step on the CPU to compile it for
    another GPU, never to launch it)."""
    from nanochat.gpt import GPT, Linear

    if not isinstance(model, GPT):
        return f"{type(model).__name__} is not a nanochat GPT"
    if cache.batch_size != 1:
        return f"batch {cache.batch_size} (the persistent step decodes one row)"
    dtype = model.wte.weight.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"weights in {dtype}"
    linears = model.decode_matrices()
    quant = getattr(model, "quantization", "none")
    if quant not in ("none", "int8"):
        return f"the model's weights are {quant} (the step reads float or int8 matrices)"
    if quant == "int8":
        from nanochat.quantize import Int8Linear

        if any(type(m) is not Int8Linear for m in linears) or any(b.attn.qkv_quant is None for b in model.blocks):
            return "quantised int8 but not by nanochat/quantize.quantize_model (a matrix is not an Int8Linear)"
        tensors = [e.weight for e in model.value_embeds.values()]
    elif any(type(m) is not Linear for m in linears):
        return "precision.py swapped the Linear layers (fp8/nvfp4); the step reads plain weights"
    else:
        tensors = [m.weight for m in linears] + [e.weight for e in model.value_embeds.values()]
    tensors += [b.attn.ve_gate.weight for b in model.blocks if b.attn.ve_gate is not None]
    if any(t.dtype != dtype for t in tensors) or cache.k[0].dtype != dtype:
        return (f"weights and KV cache must share one dtype (wte {dtype}, cache {cache.k[0].dtype}); "
                "load the model in its compute dtype (inference keeps no fp32 master copy)")
    D = model.config.head_dim
    if D < 16 or D > 1024 or D & (D - 1):  # <= 1024: the softmax's fixed shift (triton_decode_attention)
        return f"head_dim {D} (needs a power of two in 16..1024)"
    device = cache.k[0].device
    if not device_check:
        return None
    if _interpreted():
        return None if device.type == "cpu" else "TRITON_INTERPRET=1 runs CPU tensors only"
    if device.type != "cuda":
        return f"needs a CUDA GPU (the cache is on {device.type})"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 8.0"
    return None


class PersistentDecodeStep:
    """step(ids (1, 1) long, kv_cache=StaticKV) -> logits (1, 1, vocab) float32 (its own buffer,
    overwritten by the next call): the model's one-token forward over `cache`, as one kernel.

    A drop-in `step_model` for nanochat/decode.py's StaticDecoder (batch 1). Build it inside
    `model.inference_weights()` (it reads the concatenated q/k/v copy made there); it holds the
    addresses of the weights, the cache and its scratch, so like a CUDA graph it must not outlive
    them, and weights must be updated in place. It reads only the visible keys (pos and the
    window), whatever the StaticKV's length bucket is. Tuning (defaults measured best on the H100
    with scripts/bench_decode_kernel.py; powers of two but `unroll`): `block_rows` x `block_k`
    (`block_k_mlp` for the K = 4C product) weight tile per GEMV step, `block_rows_qkv` and
    `block_rows_fc` for those two products (None: `block_rows`), `unroll` K chunks issued before
    the first is used, `num_warps` per program, `key_block` keys per attention step,
    `programs_per_sm`; `preload`, a bit mask over the GEMV phases (1 q/k/v, 2 attention proj,
    4 fc, 8 MLP proj) whose first weight tile is loaded while the barrier before the phase waits;
    `head_stages`, how the lm_head's tile loop overlaps loads (0 none, 1 the next tile's loads
    before this tile's sums, 2..4 tl.range software pipelining; 1 measured best).
    `trace=True` records when each barrier opened (`phase_times()`)."""

    def __init__(self, model, cache, *, programs: int | None = None, block_rows: int = 16, block_k: int = 256,
                 block_k_mlp: int = 512, num_warps: int = 8, key_block: int = 64, unroll: int = 5,
                 block_rows_qkv: int | None = 32, block_rows_fc: int | None = 64,
                 preload: int = 15, programs_per_sm: int = 1, head_stages: int = 1, trace: bool = False,
                 aot: bool = False):
        block_rows_qkv = block_rows if block_rows_qkv is None else block_rows_qkv
        block_rows_fc = block_rows if block_rows_fc is None else block_rows_fc
        for name, value in (("block_rows", block_rows), ("block_k", block_k), ("block_k_mlp", block_k_mlp),
                            ("num_warps", num_warps), ("key_block", key_block), ("block_rows_qkv", block_rows_qkv),
                            ("block_rows_fc", block_rows_fc)):
            if value < 1 or value & (value - 1):
                raise ValueError(f"persistent decode step {name}: got {value}; accepted: a power of two")
        if unroll < 1:
            raise ValueError(f"persistent decode step unroll: got {unroll}; accepted: an integer >= 1")
        if not 0 <= head_stages <= 4:
            raise ValueError(f"persistent decode step head_stages: got {head_stages}; accepted: 0 (plain), "
                             "1 (the next tile loaded first), 2..4 (software-pipelined)")
        if not 0 <= preload <= 15:
            raise ValueError(f"persistent decode step preload: got {preload}; accepted: a bit mask 0..15 "
                             "(1 q/k/v, 2 attention proj, 4 fc, 8 MLP proj)")
        reason = unsupported(model, cache, device_check=not aot)
        if reason is not None:
            raise ValueError(f"persistent decode step: {reason}")
        self.quant = getattr(model, "quantization", "none") == "int8"
        if not self.quant and any(b.attn.qkv_weight is None for b in model.blocks):
            raise ValueError("persistent decode step: build it inside model.inference_weights() "
                             "(it reads the fused q/k/v weights made there)")
        cfg, dev = model.config, cache.k[0].device
        self.model, self.cache, self.config = model, cache, cfg
        if programs is None:
            if aot:
                raise ValueError("persistent decode step: aot=True needs programs (the target's SM count)")
            sms = 4 if dev.type == "cpu" else torch.cuda.get_device_properties(dev).multi_processor_count
            programs = programs_per_sm * usable_sms(sms)  # all SMs, or the share MPS allows
        if programs < 1:
            raise ValueError(f"programs: got {programs}; accepted: an integer >= 1")
        self.programs = programs
        self._table = self._pointer_table(model, cache)
        self._windows = torch.tensor([w or 0 for w in model.windows], dtype=torch.int32, device=dev)
        self._alloc_scratch(cfg, dev)
        C, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        p2 = triton.next_power_of_2
        self._meta = dict(C=C, H=H, HKV=Hkv, D=D, GATE=min(32, C), HKV_P2=p2(Hkv), NCH=self._nch, BN=block_rows,
                          BN_Q=block_rows_qkv, BN_FC=block_rows_fc, BK_C=block_k, BK_F=block_k_mlp, BKEY=key_block,
                          P_P2=p2(programs), UNROLL=unroll, TRACE=trace, num_warps=num_warps, PRE=preload,
                          HS=head_stages, QUANT=self.quant)

    @staticmethod
    def _pointer_table(model, cache) -> torch.Tensor:
        """(n_layer, N_PTRS) int64 addresses: fused q/k/v, attention c_proj, c_fc, MLP c_proj, the
        layer's k and v cache (row 0), its value-embedding table and gate weight (0 if none), then
        the four matrices' row scales (int8 weights; else 0)."""
        rows = []
        for i, b in enumerate(model.blocks):
            ve = model.value_embeds[str(i)].weight if str(i) in model.value_embeds else None
            gate = b.attn.ve_gate.weight if b.attn.ve_gate is not None else None
            if b.attn.qkv_quant is not None:   # int8 (nanochat/quantize.py): weights and row scales
                mats = (b.attn.qkv_quant, b.attn.c_proj, b.mlp.c_fc, b.mlp.c_proj)
                weights, scales = tuple(m.qweight for m in mats), tuple(m.scale for m in mats)
            else:
                weights = (b.attn.qkv_weight, b.attn.c_proj.weight, b.mlp.c_fc.weight, b.mlp.c_proj.weight)
                scales = (None,) * 4
            tensors = weights + (cache.k[i][0], cache.v[i][0], ve, gate) + scales
            assert all(t is None or t.is_contiguous() for t in tensors), "persistent step needs contiguous tensors"
            rows.append([0 if t is None else t.data_ptr() for t in tensors])
            if any(a % 16 for a in rows[-1]):  # the kernel's loads assume it (_layer_ptr)
                raise ValueError(f"persistent decode step: layer {i} has a weight or cache tensor not aligned "
                                 "to 16 bytes (a view into another tensor?); give it its own storage")
        assert len(rows[0]) == N_PTRS.value
        return torch.tensor(rows, dtype=torch.int64, device=cache.k[0].device)

    def _alloc_scratch(self, cfg, dev) -> None:
        """The step's float32 working set (a few hundred KB at d20) and its barrier flags."""
        f32 = dict(dtype=torch.float32, device=dev)
        C, H, Hkv, D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self._nch = max(1, self.programs // H)  # key chunks per head in the attention phase
        self._resid = torch.zeros((2 * cfg.n_layer + 1) * C, **f32)
        self._qkv = torch.zeros((H + 2 * Hkv) * D, **f32)
        self._gate = torch.zeros(Hkv, **f32)
        f64 = dict(dtype=torch.float64, device=dev)  # exact sums of the attention's float32 partials
        self._ynum, self._yden = torch.zeros(H * D, **f64), torch.zeros(H, **f64)
        self._hidden = torch.zeros(4 * C, **f32)
        self._barrier = torch.zeros(self.programs, dtype=torch.int64, device=dev)  # grid-barrier flags
        self._trace = torch.zeros(5 * cfg.n_layer + 3, dtype=torch.int64, device=dev)  # trace=True
        self.logits = torch.zeros(cfg.vocab_size, **f32)
        self._resident_checked, self.registers = False, None

    def __call__(self, ids: torch.Tensor, kv_cache=None) -> torch.Tensor:
        if kv_cache is None or kv_cache.k is not self.cache.k:
            raise ValueError("persistent decode step: pass the StaticKV of the cache it was built for")
        if ids.shape != (1, 1):
            raise ValueError(f"persistent decode step: ids must be (1, 1), got {tuple(ids.shape)}")
        self.launch(ids, kv_cache.pos)
        return self.logits.view(1, 1, -1)

    def phase_times(self) -> dict:
        """Microseconds of each phase kind in the last launch (built with trace=True), summed over
        layers: from the barrier that opened it to the one that closed it, so a phase's time
        includes its closing barrier (program 0's clock, %globaltimer)."""
        assert self._meta["TRACE"], "phase_times needs PersistentDecodeStep(..., trace=True)"
        t = self._trace.tolist()
        d = [(b - a) / 1e3 for a, b in zip(t, t[1:])]
        L = self.config.n_layer
        names = ("qkv", "attention", "proj", "fc", "proj2")
        out = {"x0": d[0]} | {n: sum(d[1 + 5 * i + j] for i in range(L)) for j, n in enumerate(names)}
        return out | {"lm_head": d[-1], "total": (t[-1] - t[0]) / 1e3}

    def _check_resident(self, args, kwargs) -> None:
        """Compile the kernel and prove the whole grid fits on the GPU at once (the barriers wait
        for every program: a program left waiting for a free SM would hang the step)."""
        kernel = decode_step_kernel.warmup(*args, grid=(self.programs,), **kwargs)
        kernel._init_handles()
        props = torch.cuda.get_device_properties(self.cache.k[0].device)
        limits = SimpleNamespace(regs_per_sm=props.regs_per_multiprocessor,
                                 threads_per_sm=props.max_threads_per_multi_processor,
                                 smem_per_sm=props.shared_memory_per_multiprocessor,
                                 smem_per_block=getattr(props, "shared_memory_per_block_optin",
                                                        props.shared_memory_per_multiprocessor))
        warps = self._meta["num_warps"]
        fits = programs_per_sm(limits, kernel.n_regs, kernel.metadata.shared, warps)
        sms = usable_sms(props.multi_processor_count)  # fewer under an MPS thread percentage
        if fits * sms < self.programs:
            raise ValueError(f"persistent decode step: {self.programs} programs of {warps} warps "
                             f"({kernel.n_regs} registers/thread, {kernel.metadata.shared} B shared) "
                             f"do not fit at once on the {sms} usable SMs ({fits} per SM); "
                             "lower programs_per_sm or num_warps")
        self.registers = kernel.n_regs
        self._resident_checked = True

    def launch_args(self, ids: torch.Tensor, pos: torch.Tensor) -> tuple[tuple, tuple, dict]:
        """(grid, positional arguments, keyword arguments) of the one-launch kernel (PHASE -1), as
        launch() passes them (and nanochat/triton_aot compiles them for another GPU)."""
        m, cfg = self.model, self.config
        head = (m.lm_head.qweight, m.lm_head.scale) if self.quant else (m.lm_head.weight, m.lm_head.weight)
        args = (ids, pos, m.wte.weight, *head, m.cos, m.sin, m.resid_lambdas, m.x0_lambdas,
                self._table, self._windows, self._resid, self._qkv, self._gate, self._ynum, self._yden,
                self._hidden, self._barrier, self.logits, self._trace)
        kwargs = dict(layer_arg=0, L=cfg.n_layer, V=cfg.vocab_size, T_CACHE=self.cache.seq_len,
                      softcap=float(cfg.softcap), eps=torch.finfo(torch.float32).eps,
                      sm_scale=cfg.head_dim ** -0.5, PHASE=-1, **self._meta)
        return (self.programs,), args, kwargs

    def launch(self, ids: torch.Tensor, pos: torch.Tensor) -> None:
        grid, args, kwargs = self.launch_args(ids, pos)
        if not _interpreted():
            if not self._resident_checked:
                self._check_resident(args, kwargs)
            decode_step_kernel[grid](*args, **kwargs)
            return
        # Interpreter: programs run in turn, so each phase is its own launch (module docstring).
        decode_step_kernel[grid](*args, **(kwargs | dict(PHASE=0)))
        for layer in range(self.config.n_layer):
            for phase in range(1, PHASES - 1):  # qkv .. proj2 per layer
                decode_step_kernel[grid](*args, **(kwargs | dict(layer_arg=layer, PHASE=phase)))
        decode_step_kernel[grid](*args, **(kwargs | dict(PHASE=PHASES - 1)))
