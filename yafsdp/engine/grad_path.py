"""A gradient's path, from a unit's backward gate to its fp32 grad shard, in the order it runs:

1. **write** -- the gate's gradients into the unit's grad buffer (``reduce_dtype``), padding zeroed;
2. **reduce** -- the reduce-scatter of the buffer over the shard group (in place on NCCL, into the
   buffer's staging on gloo; an all-to-all of pieces with fp32 accumulation; with ``grad_quant`` the
   node stage and the 8-bit records across node groups, summed in fp32 into the buffer's room:
   [Note: quantized gradient reduction] in comm/quant_reduce.py), issued by the schedule;
3. **land** -- behind it on the comm side: the reduced shard where the grad shard lives (with offload
   a device -> host copy into the unit's landing, the rest then runs on the host; placement.py);
4. **fold** -- ``grad shard (+)= reduced / world`` (the one post-divide; a shard already all-reduced
   across replicas is first scaled by ``1 / replicas``: replicas.py);
5. **all-reduce across replicas** -- HSDP, right behind the fold when this backward is predicted to
   be the step's last (else deferred to the first reader of the gradients, replicas.py).

Steps 3-5 run where the fold runs: on CUDA on the comm stream, in order, before the grad buffer's
``done`` event; on gloo at the reduce's wait. The schedule (comm/) only issues and waits: it is
handed step 3-5 as one function (``Schedule.reduce(..., then)``). Two more shapes of the same path:
an outsized unit's gradient in column chunks through the grad pair ([Note: chunked outsized
gradients] in layout/sizing.py), and the sharded lookup's backward, which folds rows without a
reduce ([Note: the sharded lookup of an embedding] in lookup.py). The end of backward waits for
every reduce and host fold (:meth:`GradPath.complete`).
"""
from __future__ import annotations

import torch

from .. import kernels
from ..comm.reduce_accum import fold_pieces_
from ..tools.trace import span
from .lookup import fold_rows, lookup_rows
from .shard_grad import grad_view, plain
from .unit import Unit

__all__ = ["GradPath", "copy_columns"]


class GradPath:
    """One engine's gradient path; the runtime's backward calls :meth:`unit_grads` from each gate,
    :meth:`lookup_grads` from the sharded lookup's backward and :meth:`complete` at the end."""

    def __init__(self, rt):
        self.rt = rt
        self.schedule = rt.schedule
        self.placement = rt.placement
        self.replicas = rt.replica_sync  # HSDP's ReplicaSync, or NoReplicas (replicas.py)
        self.begun = False  # this backward reduced: the replicas were told (begin_backward)
        # The one post-divide: by every rank of the world (HSDP: shard size x replicas, so that the
        # SUM all-reduce across replicas gives DDP's average).
        self.scale = 1.0 / (rt.world_size * self.replicas.replicas)

    # ------------------------------------------------------------------ the path
    def unit_grads(self, unit: Unit, pidx, grads) -> None:
        """A gate's gradients (``grads`` of ``unit.params[i]`` for ``i`` in ``pidx``) to the grad shard."""
        if unit.grad_chunk:  # See [Note: chunked outsized gradients] in layout/sizing.py
            self._in_chunks(unit, pidx, grads)
            return
        if unit.grad_buffer is None:  # world 1: [Note: world-1 gradients] in layout/sizing.py
            self._fold_each(unit, pidx, grads)
            return
        lay = unit.layout
        # 1. write
        buf = unit.grad_buffer.begin_write(lay.padded_numel)  # once its previous reduce has read it
        with torch.no_grad(), span("grads", unit.name):
            if len(pidx) == len(lay.params):
                buf[lay.numel:].zero_()
            else:
                buf.zero_()
            for i, g in zip(pidx, grads):
                p = unit.params[i]
                dst = buf[p.offset:p.offset + p.numel]
                if g is None:
                    dst.zero_()
                else:
                    dst.view(p.shape).copy_(g)
        # 2. reduce, then (comm side) 3. land, 4. fold, 5. all-reduce across replicas
        target, fresh = self._target(unit)
        fold = self._fold(unit, target, fresh, unit.grad_buffer.accum)
        unit.grad_buffer.reduce(unit.name, lay.padded_numel, lay.shard_numel,
                                self.placement.arrival(self.schedule, unit, fold))

    def _fold(self, unit: Unit, target: torch.Tensor, fresh: bool, accum: torch.Tensor, lo: int = 0,
              hi: int | None = None, first: bool = True, last: bool = True):
        """``fold(reduced)``: steps 4 and 5 for elements [lo, hi) of the grad shard ``target``.
        ``first`` / ``last``: the unit's first / last fold of this use (a chunked reduce folds in parts)."""
        part = target if lo == 0 and hi is None else target[lo:hi]
        replicas = self._replicas()
        scale = self.scale

        def fold(reduced: torch.Tensor) -> None:
            with torch.no_grad():
                if first:
                    replicas.repair(unit, target, fresh)  # HSDP: a synced shard first x 1/replicas
                if reduced.dim() == 2:  # every rank's piece: [Note: narrow reduce, fp32 accumulation]
                    fold_pieces_(part, reduced, scale, not fresh, accum[:part.numel()])
                elif fresh:
                    kernels.cast_(part, reduced, scale)  # scaled in fp32, rounded once
                else:
                    kernels.accumulate_(part, reduced, scale)
                if replicas.folded(unit, target, last):
                    self.schedule.all_reduce_behind(target, unit.name)

        return fold

    def _target(self, unit: Unit, written: bool = False) -> tuple[torch.Tensor, bool]:
        """The unit's fp32 grad shard, and whether this backward's reduce is its first contribution.
        ``written``: a fresh shard's every element is written by the caller (at world 1 it may then be
        allocated uninitialised: [Note: the grad shard's lifetime at world 1] in layout/sizing.py)."""
        p = unit.flat_param
        fresh = p.grad is None
        if fresh:  # See [Note: shard gradients that know they are shards] in shard_grad.py
            p.grad = grad_view(unit, self.rt, written)
        return plain(p.grad), fresh

    def _replicas(self):
        """The replica sync, told once per backward that this backward reduces: a backward call counts for
        the cross-replica prediction when it reduces (a call that runs no gate, e.g. torch.autograd.grad of
        an input, does not)."""
        if not self.begun:
            self.begun = True
            self.replicas.begin_backward()
        return self.replicas

    def _fold_each(self, unit: Unit, pidx, grads) -> None:
        """World 1 (the unit has no grad buffer): write, reduce and land are the identity, and each
        parameter's gradient is folded into its own slice of the grad shard. What no gradient covers
        gets what the buffer's zeros gave it: zero in a fresh shard, ``+ 0`` otherwise. A fresh shard's
        every element is written here (the padding and parameters without a gradient as zeros, the
        rest by the fold's cast), so it may be allocated uninitialised."""
        lay = unit.layout
        target, fresh = self._target(unit, written=True)
        given = [(unit.params[i], g) for i, g in zip(pidx, grads) if g is not None]
        with torch.no_grad(), span("grads", unit.name):
            if len(given) < len(lay.params) or (fresh and lay.padded_numel > lay.numel):
                covered = {id(p) for p, _ in given}
                for p in lay.params:
                    if id(p) not in covered:
                        part = target[p.offset:p.offset + p.numel]
                        part.zero_() if fresh else part.add_(0.0)
                if fresh:
                    target[lay.numel:].zero_()
            for k, (p, g) in enumerate(given):
                fold = self._fold(unit, target, fresh, None, p.offset, p.offset + p.numel,
                                  first=k == 0, last=k == len(given) - 1)
                fold(g.reshape(-1))

    # ------------------------------------------------------------------ outsized units: in chunks
    def _in_chunks(self, unit: Unit, pidx, grads) -> None:
        """The unit's gradient reduced in column chunks through the grad pair: per chunk the same
        write, reduce and fold (no offload here: with offload outsized units have a grad buffer)."""
        lay = unit.layout
        if self._exchanges_directly(unit):  # See [Note: the direct exchange of an outsized gradient]
            target, fresh = self._target(unit)
            g = grads[0] if len(pidx) == 1 else None
            src = torch.zeros(lay.padded_numel, dtype=target.dtype, device=target.device) if g is None else g
            self.schedule.reduce_rows_into(target, src.contiguous().view(-1), unit.name)
            self._fold(unit, target, fresh, unit.chunk_buffers[0].accum)(target)
            return
        world, shard, width = lay.world_size, lay.shard_numel, unit.grad_chunk
        target, fresh = self._target(unit)
        # (flat offset, 1-D gradient); reshape is a view for the contiguous gradients autograd makes
        sources = [(unit.params[i].offset, g.reshape(-1)) for i, g in zip(pidx, grads) if g is not None]
        sources = [(off, src if src.stride(0) == 1 else src.contiguous()) for off, src in sources]
        covered = sum(src.numel() for _, src in sources) == lay.padded_numel
        starts = range(0, shard, width)
        pair = unit.chunk_buffers
        for k, lo in enumerate(starts):
            hi = min(lo + width, shard)
            gb = pair[k % len(pair)]
            last = k == len(starts) - 1
            if last and k:  # every earlier chunk folded before the last one's fold (HSDP)
                pair[(k - 1) % len(pair)].finish()
            buf = gb.begin_write(world * (hi - lo)).view(world, hi - lo)
            with torch.no_grad(), span("grads", unit.name):
                if not covered:  # padding, or parameters this backward gave no gradient
                    buf.zero_()
                for off, src in sources:
                    copy_columns(buf, src, off, shard, lo)
            gb.reduce(unit.name, buf.numel(), hi - lo,
                      self._fold(unit, target, fresh, gb.accum, lo, hi, first=k == 0, last=last))

    # [Note: the direct exchange of an outsized gradient]
    # On gloo at world 2 (the CPU schedule, no replicas), a chunked unit's first reduce of a step in fp32
    # that is one parameter without padding (an untied embedding or head) skips the chunks: its
    # autograd gradient, viewed as 2 x shard, is already the reduce-scatter's input, and the fresh fp32
    # grad shard can be its output. One reduce-scatter (``collectives.reduce_scatter``, at gloo world 2
    # one exchange) -- the peer's row sent straight from the gradient, the peer's contribution received
    # into the grad shard, the own row added, then the fold scales it in
    # place -- replaces ``ceil(shard / w)`` chunk copies and exchanges that each wait for the one two
    # back with no compute to hide behind (on 2 cores the chunks' sends were ~10 ms of a 450 ms step at the
    # CPU preset). The arithmetic is the chunks' (received + own, then x 1/world, in fp32), so the values
    # are bit for bit the same; no memory is added (the gradient is alive during the gate either way; the
    # exchange completes before the gate returns). The choice depends only on the unit, the options and
    # whether this is the step's first reduce, so every rank makes it alike; a rank whose backward gave
    # the parameter no gradient sends zeros. Accumulating reduces (gradient accumulation), bf16 gradients,
    # fp32 accumulation, HSDP and other worlds keep the chunks.
    def _exchanges_directly(self, unit: Unit) -> bool:
        lay, rt = unit.layout, self.rt
        return (lay.world_size == 2 and self.replicas.replicas == 1
                and len(lay.params) == 1 and lay.numel == lay.padded_numel
                and rt.compute_dtype == torch.float32 and rt.reduce_dtype == torch.float32
                and not unit.chunk_buffers[0].pieces and unit.chunk_buffers[0].quant_reduce is None
                and unit.flat_param.grad is None
                and self.schedule.reduce_rows_ok())

    # ------------------------------------------------------------------ the sharded lookup
    def lookup_grads(self, unit: Unit, every, every_grad, lo: int, rows: int, padding_idx) -> None:
        """The backward of a sharded lookup: every rank's output gradients (``every_grad``, for the
        token ids ``every``) folded into this rank's rows of the grad shard -- the fold of the path
        with the exchange of the lookup in place of write and reduce. See [Note: the sharded lookup
        of an embedding] in lookup.py."""
        touched, total = lookup_rows(every, every_grad, lo, rows, padding_idx)
        target, fresh = self._target(unit)
        replicas = self._replicas()
        with torch.no_grad():
            replicas.repair(unit, target, fresh)
            fold_rows(target.view(rows, -1), touched, total, self.scale, fresh)
            if replicas.folded(unit, target):
                self.schedule.all_reduce_behind(target, unit.name)

    # ------------------------------------------------------------------ the end of backward
    def complete(self) -> None:
        """Every reduce issued is completed and folded (the host folds too), and HSDP's all-reduce across
        replicas that this backward began is finished. The end of a backward, and the recovery from an
        aborted one (``Runtime.recover``)."""
        for gs in self.rt.grad_buffers:
            gs.finish()
        self.placement.finish_folds(self.schedule)
        if self.begun:
            self.replicas.finish_backward()
        self.begun = False


def copy_columns(dst: torch.Tensor, src: torch.Tensor, offset: int, shard: int, lo: int) -> None:
    """``dst`` (world x w) <- columns [lo, lo + w) of a flat unit viewed as (world x shard), where
    ``src`` (1-D) holds the unit's elements [offset, offset + src.numel()); columns outside ``src``
    are left alone. At most three copies: the rows ``src`` covers whole (one strided view), the
    partial first and last rows."""
    world, w = dst.shape
    end = offset + src.numel()
    r_first, r_last = max(0, offset // shard), min(world - 1, (end - 1) // shard)
    if r_first > r_last or src.numel() == 0:
        return
    full_lo = max(r_first, -(-(offset - lo) // shard))  # first row with offset <= r * shard + lo
    full_hi = min(r_last, (end - lo - w) // shard)  # last row with r * shard + lo + w <= end
    if full_lo <= full_hi:
        start = full_lo * shard + lo - offset
        dst[full_lo:full_hi + 1].copy_(
            src.as_strided((full_hi - full_lo + 1, w), (shard, 1), src.storage_offset() + start))
    for r in {r_first, r_last}:
        if full_lo <= r <= full_hi:
            continue
        a, b = max(offset, r * shard + lo), min(end, r * shard + lo + w)
        if a < b:
            dst[r, a - r * shard - lo:b - r * shard - lo].copy_(src[a - offset:b - offset])
