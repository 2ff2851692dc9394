"""Low-precision copies of the fp32 master weights, cast once per optimizer step instead of once per
micro-batch (`step_weights`), and the two autograd functions that use them.

Why: the model keeps fp32 master weights and casts each one to the compute dtype where it is used
(gpt.Linear, the fused MLP and q/k/v ops, the token and value embeddings, the lm_head). With
gradient accumulation every micro-batch repeats those casts, although the weights only change at
the optimizer step: at d20 (16 micro-batches of 32 x 2048 per step) that is ~2 GB of reads per
micro-batch, and the value-embedding lookups gather float32 rows (335 MB per layer, forward and
again in backward) where bfloat16 rows would do. `step_weights(model, dtype)` casts every slot's
weight once at the start of the accumulation and empties the slots at its end, before the
optimizer step changes the masters, so a copy can never be stale (the copies' memory is kept for
the next step, which recasts into it).

Eager numbers do not change (tests/test_weight_cache.py: bit-identical losses and gradients): a
cast copy holds exactly `weight.to(dtype)`, a gather from it equals the cast of the float32
gather, and the gradients go back to the float32 masters as before: a Linear weight's gradient is
cast to float32 (what `.to()`'s backward does), and an embedding's rows are cast to float32
before they are summed into the table's gradient (the sum stays in float32). Compiled, they can
differ in the last bit: inductor may fuse a per-use cast into its consumer without rounding to
the compute dtype first (`torch._inductor.config.emulate_precision_casts` is off by default),
while a copy is rounded, as eager rounds.

Slots are non-persistent buffers named `weight_lowp` (None outside `step_weights`), registered by
`add_slot` on gpt.Linear and the model's nn.Embedding tables; torch.compile sees them as graph
inputs, so a compiled model uses them without retracing per step. Modules without a slot (e.g.
precision.py's fp8 and nvfp4 layers) keep casting their own weights.

Gradient sinks (`step_weights(..., sinks=True)`): with gradient accumulation every micro-batch's
weight gradient goes through autograd as a new tensor that AccumulateGrad adds into `.grad`. For
a Linear that is the bf16 GEMM output cast to float32 (one pass) and then added (another: reads
of both, a write); the profile of base_train's d20 step on an H100 put those two at ~5 ms per
micro-batch in ~340 small kernels. For an embedding table it is a zero-filled (V, C) float32
tensor per micro-batch that the rows are scattered into, then added (~0.7 GB per table and
micro-batch at d20, whose 11 tables are 168 MB each). With sinks every slot's weight gets one
float32 buffer, zeroed when the block opens, and the backward adds into it in place: a Linear's
gradient in one pass (`sink += grad`, the cast folded in), a table's rows scattered straight in.
On a normal exit each sink becomes (or is added into) its weight's `.grad`. Under torch.compile
the updates stay in place: inductor writes them into the buffer (the backward mutates a graph
input). The sums are the same terms added in another order, so gradients match to float32
rounding, not bit for bit; a weight whose slot was never used in the block gets a zero gradient
instead of none (weights that do not require grad get no sink).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

SLOT = "weight_lowp"
SINK = "grad_sink"


def add_slot(module: torch.nn.Module) -> None:
    """Give `module` (with a `weight` parameter) an empty cast-copy slot and gradient sink."""
    module.register_buffer(SLOT, None, persistent=False)
    module.register_buffer(SINK, None, persistent=False)


class _CastCopy(torch.autograd.Function):
    """Returns the step's cast copy of `master`; the gradient goes to the master in its dtype, or
    is added into the master's sink (module docstring)."""

    @staticmethod
    def forward(ctx, master, copy, sink):
        ctx.master_dtype = master.dtype
        ctx.save_for_backward(sink)
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad):
        (sink,) = ctx.saved_tensors
        if sink is None:
            return grad.to(ctx.master_dtype), None, None
        sink.add_(grad)
        return None, None, None


def _active_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    copy = getattr(module, SLOT, None)
    if copy is None or copy.dtype != dtype or not torch.is_grad_enabled():
        return None
    return copy


def _through_copy(module: torch.nn.Module, copy: torch.Tensor) -> torch.Tensor:
    """The cast copy, its gradient routed to module.weight (or into the module's sink)."""
    return _CastCopy.apply(module.weight, copy, getattr(module, SINK, None))


def weight_as(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """module.weight in `dtype`: the step's cast copy while `step_weights` is active (and grad is
    enabled), else `weight.to(dtype)`. Gradients reach module.weight either way."""
    copy = _active_copy(module, dtype)
    if copy is None:
        return module.weight.to(dtype)
    return _through_copy(module, copy)


def weight_or_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The step's cast copy (through _CastCopy) when there is one, else the master itself: for ops
    that cast their weights themselves (a no-op on the copy)."""
    copy = _active_copy(module, dtype)
    return module.weight if copy is None else _through_copy(module, copy)


def table_and_copy(module: torch.nn.Module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                          torch.Tensor | None]:
    """(the float32 table, its cast copy or None, its gradient sink or None) for lookups that
    gather rows in `dtype`. A sink is only handed out with a copy (both live in step_weights)."""
    copy = _active_copy(module, dtype)
    return module.weight, copy, (getattr(module, SINK, None) if copy is not None else None)


def table_grad(sink: torch.Tensor | None, idx: torch.Tensor, rows: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """The backward of a lookup `table[idx]` given the rows' gradient `rows` (..., C) in the
    table's dtype: added into `sink` in place (returns None: autograd leaves .grad alone), or
    without a sink the (num_rows, C) gradient for autograd to accumulate."""
    if sink is None:
        return torch.ops.aten.embedding_dense_backward(rows, idx, num_rows, -1, False)
    sink.index_put_((idx.flatten(),), rows.reshape(-1, rows.shape[-1]), accumulate=True)
    return None


class _Lookup(torch.autograd.Function):
    """table[idx] in `copy`'s dtype, gathered from the cast copy; the table's gradient is summed
    in the table's dtype, as `F.embedding(idx, table).to(dtype)` does through autograd (into the
    sink when there is one)."""

    @staticmethod
    def forward(ctx, idx, table, copy, sink):
        ctx.save_for_backward(idx, sink)
        ctx.rows, ctx.table_dtype = table.shape[0], table.dtype
        return F.embedding(idx, copy)

    @staticmethod
    def backward(ctx, grad):
        idx, sink = ctx.saved_tensors
        return None, table_grad(sink, idx, grad.to(ctx.table_dtype), ctx.rows), None, None


def lookup(idx: torch.Tensor, module: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """`module(idx).to(dtype)` for an nn.Embedding, from the step's cast copy when there is one."""
    table, copy, sink = table_and_copy(module, dtype)
    if copy is None:
        return F.embedding(idx, table).to(dtype)
    return _Lookup.apply(idx, table, copy, sink)


def slots(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with a slot whose weight is a plain float32 tensor (not a sharded DTensor)."""
    found = []
    for module in model.modules():
        if SLOT not in getattr(module, "_buffers", {}):
            continue
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and type(w.data) is torch.Tensor and w.dtype == torch.float32:
            found.append(module)
    return found


def _store(module: torch.nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """The module's kept buffer `name` shaped as its weight in `dtype` (made when missing or when
    the weight changed shape, device or dtype)."""
    w, buf = module.weight, module.__dict__.get(name)
    if buf is None or buf.shape != w.shape or buf.device != w.device or buf.dtype != dtype:
        buf = module.__dict__[name] = torch.empty(w.shape, dtype=dtype, device=w.device)
    return buf


def _fresh_sink(module: torch.nn.Module) -> torch.Tensor:
    """The module's kept float32 sink, to be zeroed; a new one while the weight's `.grad` is still the
    old sink (zero_grad(set_to_none=False), or a caller summing over steps), so that stays intact."""
    grad = module.weight.grad
    kept = module.__dict__.get("_grad_sink_store")
    if grad is not None and kept is not None and grad.data_ptr() == kept.data_ptr():
        del module.__dict__["_grad_sink_store"]
    return _store(module, "_grad_sink_store", module.weight.dtype)


@contextlib.contextmanager
def step_weights(model: torch.nn.Module, dtype: torch.dtype, enabled: bool = True, sinks: bool = True):
    """Within the block every slot holds `weight.to(dtype)`, cast now; they are emptied on exit.
    Enter it around the micro-batches of one optimizer step (never across a weight update); a
    float32 `dtype` (no cast to save) or `enabled=False` leaves the slots empty. With `sinks`,
    the weights' gradients of the block's backward passes sum in their sinks, which become the
    weights' `.grad` on a normal exit (module docstring); on an error they are dropped.

    The copies and sinks are kept between steps (in each module's __dict__, outside its
    state_dict) and refreshed by one foreach copy and one foreach zero: allocating and casting
    ~140 tensors one by one left the GPU idle between the launches at every step's start (the
    d20 profile: ~250 gaps of 20-180 us per step). They sit in memory the step's peak holds anyway."""
    held = slots(model) if enabled and dtype != torch.float32 else []
    sunk = [m for m in held if SINK in m._buffers and m.weight.requires_grad] if sinks else []
    try:
        with torch.no_grad():
            copies = [_store(m, "_weight_lowp_store", dtype) for m in held]
            if held:
                torch._foreach_copy_(copies, [m.weight.detach() for m in held])
            zeros = [_fresh_sink(m) for m in sunk]
            if zeros:
                torch._foreach_zero_(zeros)
        for module, copy in zip(held, copies):
            setattr(module, SLOT, copy)
        for module, sink in zip(sunk, zeros):
            setattr(module, SINK, sink)
        yield len(held)
        for module, sink in zip(sunk, zeros):
            weight = module.weight
            if weight.grad is None:
                weight.grad = sink
            else:
                weight.grad.add_(sink)
    finally:
        for module in held:
            setattr(module, SLOT, None)
        for module in sunk:
            setattr(module, SINK, None)
