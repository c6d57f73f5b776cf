"""The sharded lookup of an embedding: a plain untied ``nn.Embedding`` unit used in forward without
gathering its weight.

[Note: the sharded lookup of an embedding]
An untied token embedding can be the largest unit of a model (the CPU preset: 32,000 x 256 fp32,
31 MiB, against 3 MiB per decoder layer), and it is the first unit of the forward: its all-gather
has nothing to hide behind, and at the end of backward neither has its reduce-scatter. Yet a
forward reads only the rows of its tokens (2 x 128 per rank there), and a rank's shard of a
one-parameter unit without padding is a run of whole rows when the shard is a multiple of the row.
So on gloo at world 2 (the CPU schedule, where it was measured) such a unit is not gathered:

- forward: one exchange of every rank's token count, smallest and largest id and ids (so that an
  id out of range is refused on every rank alike, as the plain ``nn.Embedding`` refuses it, instead
  of a hang or rows of zeros), the ids padded to a room every rank agreed on at the unit's last
  call (a second exchange when a rank has more tokens than that; the room grows). Each rank looks
  up the tokens of every rank that fall in its rows (zeros elsewhere), and one reduce-scatter of
  (world x tokens x hidden) gives each rank its own tokens' rows. Exactly one rank contributes each
  row and the other adds zeros, so the output is the plain lookup, bit for bit;
- backward: one all-gather of the output gradients (tokens x hidden per rank); each rank adds into
  its grad shard the rows of every rank's tokens that fall in its rows: per rank in token order from
  zeros (what the dense embedding backward does on each rank before the reduce), then the ranks'
  sums added and scaled by 1/world (what the reduce-scatter and the fold do). At world 2 that is the
  gathered path's arithmetic, bit for bit (two summands commute); ``padding_idx`` gets no gradient,
  as in the dense backward.

The bytes per step fall from twice the unit (its gather and its reduce) to 3 x world x tokens x
hidden, and only the rows the tokens touch are read or written. No memory is added to the plan's
preallocated tensors: the exchanges' tensors are the size of an activation.

Three exchanges are three points where the ranks wait for each other, against the gathered path's
gather and reduce, so the lookup pays only where the unit is large: measured at world 2 on 2 cores
(benchmarks/results/bench_step_lookup_cpu_2026-11-27.md), a 31 MiB embedding beside 3 MiB decoder
layers takes 2-15 % off the step (median 6 %), a 2 MiB one adds -1 to +7 %. Hence the static conditions
(:func:`lookup_unit`): the option ``sharded_lookup`` (default on); an *outsized* unit (the plan's:
larger than ``outsized_ratio`` times the typical unit); gloo at world 2 with no replicas, ZeRO-3,
no offload, fp32 compute and fp32 reduce without fp32-accumulated pieces, no compact gather format;
one trainable parameter owned by one plain dense ``nn.Embedding`` (the conditions of [Note:
weight-free backward] in runtime.py: no tie, no subclass forward, not sparse, no hooks at wrap
time), without padding and split in whole rows.

The per-call conditions (:func:`lookup_now`), which every rank meets alike when the ranks run the
same code: no ``max_norm`` or ``scale_grad_by_freq`` set since wrapping, no forward hook on the
module and no gradient hook on the parameter added since (they may read the full weight or its full
local gradient, which this path never has). A call that misses one gathers the unit as before.
An activation-checkpoint recompute inside backward looks up as its forward did (the ranks recompute
at the same point of their backward): a non-reentrant checkpoint then finds the same saved tensors
(none: the node keeps the ids itself), and a reentrant one backpropagates through the recompute's
lookup, whose backward is the one above.
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from .. import kernels
from ..tools.trace import span
from .unit import Unit, refuse_captured

__all__ = ["lookup_unit", "lookup_now", "install_lookup", "LookupForward"]


def lookup_unit(rt, unit: Unit) -> bool:
    """The static conditions of [Note: the sharded lookup of an embedding]."""
    cfg = rt.config
    lay = unit.layout
    if not (cfg.sharded_lookup and unit.outsized and unit.weight_free_bw and lay is not None
            and len(unit.groups) == 1 and len(unit.members) == 1 and len(lay.params) == 1):
        return False
    p = lay.params[0]
    module = unit.members[0].module
    if p.tp is not None:  # a TP embedding's rows are split over TP: its module looks them up (layout/dtensor.py)
        return False
    return (
        rt.zero_stage == 3 and rt.replicas == 1 and rt.offload is None and rt.world_size == 2
        and rt.compute_dtype == torch.float32 and rt.reduce_dtype == torch.float32
        and rt.reduce_accum_dtype is None and rt.gather_dtype is None
        and len(p.owners) == 1 and p.owners[0] == (module, "weight") and len(p.shape) == 2
        and lay.numel == lay.padded_numel and lay.shard_numel % p.shape[1] == 0
        and rt.schedule.reduce_rows_ok()
    )


def lookup_now(unit: Unit, module: nn.Embedding) -> bool:
    """The per-call conditions (see the Note): this call of ``module`` takes the sharded lookup."""
    if unit.lookup_hooks is None:
        return False
    sp = unit.params[0].resting
    return (module.max_norm is None and not module.scale_grad_by_freq and not module.sparse
            and (len(module._forward_pre_hooks), len(module._forward_hooks)) == unit.lookup_hooks
            and not (sp is not None and sp._yafsdp_hooks))


class LookupForward:
    """The embedding module's ``forward`` while wrapped: the sharded lookup when the engine's
    pre-hook armed it for this call, else ``nn.Embedding.forward`` (over the weight the hooks handed
    the module). Holds the runtime and unit weakly ([Note: weak references from autograd nodes] in
    autograd.py)."""

    def __init__(self, rt, unit: Unit, module: nn.Embedding):
        self.rt_ref, self.unit_ref, self.module_ref = weakref.ref(rt), weakref.ref(unit), weakref.ref(module)

    def __call__(self, input):
        rt, unit, module = self.rt_ref(), self.unit_ref(), self.module_ref()
        if unit is not None and unit.lookup_armed:
            unit.lookup_armed = False
            shard = unit.flat_param
            hooked = bool(shard._backward_hooks or getattr(shard, "_post_accumulate_grad_hooks", None))
            anchor = unit.anchor if hooked else shard  # as the gate's: [Note: the backward gate] in autograd.py
            return _Lookup.apply(rt, unit, module.padding_idx, anchor, input)
        return nn.Embedding.forward(module, input)


def install_lookup(rt, unit: Unit) -> None:
    """After the engine's hooks are on the module: its forward becomes a :class:`LookupForward`."""
    module = unit.members[0].module
    module.forward = LookupForward(rt, unit, module)
    unit.lookup_hooks = (len(module._forward_pre_hooks), len(module._forward_hooks))


def _rows(rt, unit: Unit) -> tuple[int, int, int]:
    """(first row, rows, hidden) of this rank's shard of the embedding."""
    lay = unit.layout
    hidden = lay.params[0].shape[1]
    rows = lay.shard_numel // hidden
    return lay.rank * rows, rows, hidden


class _Lookup(torch.autograd.Function):
    """See [Note: the sharded lookup of an embedding]. Input ``anchor``: the unit's shard (or its
    empty anchor when a hook is on the shard), so that autograd runs the backward and
    ``torch.autograd.grad`` with respect to the shard is refused as at the gate."""

    @staticmethod
    def forward(ctx, rt, unit, padding_idx, anchor, ids):
        ctx.rt_ref, ctx.unit_ref, ctx.padding_idx = weakref.ref(rt), weakref.ref(unit), padding_idx
        world, sched = rt.world_size, rt.schedule
        lo, rows, hidden = _rows(rt, unit)
        vocab = unit.layout.params[0].shape[0]
        integer = ids.dtype in (torch.int64, torch.int32)
        flat = ids.reshape(-1).to(torch.int64) if integer else ids.new_zeros(0, dtype=torch.int64)
        n = flat.numel()
        with torch.no_grad(), span("lookup", unit.name):
            # one exchange of (count, min, max, ids padded to the room every rank agreed on at the last call);
            # a count of -1: this rank's ids are not integers. Every rank raises alike, none waits alone.
            room = unit.lookup_room
            mine = torch.full((3 + room,), -1, dtype=torch.int64)
            mine[:3] = torch.tensor([n if integer else -1, int(flat.min()) if n else 0, int(flat.max()) if n else 0])
            if n <= room:
                mine[3:3 + n] = flat
            msgs = torch.empty(world, 3 + room, dtype=torch.int64)
            sched.gather_rows_into(msgs.view(-1), mine, unit.name)
            info = msgs[:, :3].tolist()
            for r, (cnt, mn, mx) in enumerate(info):
                if cnt < 0:
                    raise RuntimeError(
                        f"yafsdp: the embedding of unit {unit.name!r} got token ids that are not integers on rank {r}"
                        + (f" ({ids.dtype})" if r == unit.layout.rank else "") + "; every rank raises. Token ids must "
                        "be torch.long or torch.int, as nn.Embedding requires")
                if cnt and (mn < 0 or mx >= vocab):
                    bad = mn if mn < 0 else mx
                    raise IndexError(
                        f"yafsdp: token id {bad} on rank {r} is out of range for the embedding of unit {unit.name!r} "
                        f"({vocab} rows: ids must be in [0, {vocab})); every rank raises. Check the tokenizer's "
                        "vocabulary against the model's (resize the embeddings before wrapping)")
            most = max(c for c, _, _ in info)
            if most <= room:
                every = msgs[:, 3:3 + most]
            else:  # a rank had more tokens than the room: a second exchange of every rank's ids, the room grows
                every = torch.full((world, most), -1, dtype=torch.int64)
                sched.gather_rows_into(every.view(-1), torch.cat([flat, every.new_full((most - n,), -1)]), unit.name)
                unit.lookup_room = most
            table = unit.compute.view(rows, hidden)
            local = torch.zeros(world, most, hidden, dtype=table.dtype)
            here = (every >= lo) & (every < lo + rows)
            local[here] = table[every[here] - lo]
            # the output is a tensor of its own, not a view (a caller may modify it in place, as the plain
            # embedding's output): the exchange writes it straight when this rank has the most tokens
            out = torch.empty(*ids.shape, hidden, dtype=table.dtype) if n == most else torch.empty(most, hidden,
                                                                                                    dtype=table.dtype)
            sched.reduce_rows_into(out.view(-1), local.view(-1), unit.name)
            if n < most:
                out = out[:n].reshape(*ids.shape, hidden).clone()
        ctx.every, ctx.n = every, n
        return out

    @staticmethod
    def backward(ctx, grad):
        rt, unit = ctx.rt_ref(), ctx.unit_ref()
        if rt is None or unit is None:
            return None, None, None, None, None
        refuse_captured(ctx, unit)
        rt.enter_backward()
        lo, rows, hidden = _rows(rt, unit)
        most = ctx.every.shape[1]
        with torch.no_grad(), span("lookup", unit.name):
            mine = torch.zeros(most, hidden, dtype=torch.float32)
            if grad is not None:
                mine[:ctx.n] = grad.reshape(ctx.n, hidden)
            every_grad = torch.empty(rt.world_size, most, hidden, dtype=torch.float32)
            rt.schedule.gather_rows_into(every_grad.view(-1), mine.view(-1), unit.name)
            rt.lookup_fold(unit, ctx.every, every_grad, lo, rows, ctx.padding_idx)
        return None, None, None, None, None


def lookup_rows(every: torch.Tensor, every_grad: torch.Tensor, lo: int, rows: int, padding_idx):
    """(touched rows of this rank's shard, relative, sorted; their gradient summed over the ranks):
    per rank, that rank's tokens in this shard's rows added in token order from zeros, then the
    ranks' sums added in rank order. See [Note: the sharded lookup of an embedding]."""
    here = (every >= lo) & (every < lo + rows)
    if padding_idx is not None:
        here &= every != padding_idx
    touched, inverse = torch.unique(every[here] - lo, sorted=True, return_inverse=True)
    hidden = every_grad.shape[-1]
    total = None
    start = 0
    for r in range(every.shape[0]):
        sel = here[r]
        k = int(sel.sum())
        part = torch.zeros(touched.numel(), hidden, dtype=torch.float32)
        part.index_add_(0, inverse[start:start + k], every_grad[r][sel])
        start += k
        total = part if total is None else total + part
    return touched, total


def fold_rows(target: torch.Tensor, touched: torch.Tensor, total: torch.Tensor, scale: float, fresh: bool) -> None:
    """The grad shard (rows x hidden) (+)= the touched rows' sum x scale; the other rows are zeros
    (fresh) or left alone, as a dense fold of zeros would leave them."""
    if fresh:
        target.zero_()
    if not touched.numel():
        return
    if fresh:
        scaled = torch.empty_like(total)
        kernels.cast_(scaled, total, scale)
    else:
        scaled = target.index_select(0, touched)
        kernels.accumulate_(scaled, total, scale)
    target.index_copy_(0, touched, scaled)
