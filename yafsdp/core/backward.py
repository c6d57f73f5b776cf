"""The backward half of the step protocol, as methods of :class:`~yafsdp.core.runtime.Runtime` (a base
class of it): which backward uses hold a unit's weight buffer and when they end ([Note: releasing by
what autograd runs] in autograd.py), the pre-backward gather and its prefetch, each unit's gradients
written, reduced and folded into its grad shard, the host folds of offload, the end of each
autograd call and of the whole backward, and HSDP's all-reduce across replicas. The state they use
is the runtime's (set by ``Runtime.__init__``)."""
from __future__ import annotations


import torch

from .. import kernels
from .lookup import fold_rows, lookup_rows
from .orig_params import run_grad_hooks
from ..comm.reduce_accum import fold_pieces_
from ..comm.progress import POSITION
from .shard_grad import grad_view, plain
from .shard_hooks import fire as fire_shard_hooks
from ..tools.trace import span
from .unit import Phase, Unit, current_task


__all__ = ["BackwardSteps", "BackwardUse", "copy_columns"]


class BackwardUse:
    """One grad-enabled forward use of a unit, as the backward calls that reach it see it. See
    [Note: releasing by what autograd runs] in autograd.py.

    ``ends`` are weak references to the use's end nodes (its gate, and the node on its inputs);
    ``task`` is the autograd graph task whose backward last began the use, ``pending`` how many of
    its end nodes that task still runs, ``held`` whether the use holds the unit's weight buffer.
    The use refers to no unit or runtime (see [Note: weak references from autograd nodes])."""

    __slots__ = ("ends", "pending", "task", "held")

    def __init__(self):
        self.ends: list = []
        self.pending = 0
        self.task: int | None = None
        self.held = False


class BackwardSteps:
    """Mixed into :class:`~yafsdp.core.runtime.Runtime`; see the module docstring."""

    # ------------------------------------------------------------------ backward
    def enter_backward(self) -> None:
        """A backward (or autograd.grad) call touched the engine: the first time for its graph
        task, :meth:`end_task` is queued to run when that call ends."""
        task = current_task()
        if task in self.tasks:
            return
        self.tasks[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.end_task(task))
        self.phase = Phase.BACKWARD

    def _hold(self, unit: Unit, use: "BackwardUse") -> None:
        """``use`` holds the unit's weight buffer until it ends or its graph task does."""
        self.enter_backward()
        unit.buffer.acquire(unit)
        unit.bw_holds += 1
        use.held = True
        self.tasks[current_task()].append((unit, use))

    def _drop(self, unit: Unit, use: "BackwardUse") -> None:
        if use.held:
            use.held = False
            unit.bw_holds -= 1
            unit.buffer.release()

    def _check_unchanged(self, unit: Unit) -> None:
        """A shard changed between the unit's forward and its backward: the gradients would be
        those of other weights (plain PyTorch raises "modified by an inplace operation")."""
        if unit.forward_versions is not None and unit.shard_versions() != unit.forward_versions:
            raise RuntimeError(
                f"yafsdp: the master shard of unit {unit.name!r} changed between its forward and its backward "
                "(an optimizer step, a state-dict or checkpoint load, or an in-place update of model.parameters() "
                "in between); its gradients would be computed for other weights. Call backward() before "
                "opt.step(), and run a new forward after changing the parameters"
            )

    def pre_backward(self, unit: Unit, use: "BackwardUse", prev: Unit | None, ends: int) -> None:
        """Before a use's backward in this graph task (ZeRO-3): re-gather the unit, prefetch the unit
        before it. ``ends``: how many of the use's end nodes this task will run."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"yafsdp: a backward with create_graph=True reached unit {unit.name!r} at zero_stage=3: the graph it "
                "creates reads the unit's weights later, after ZeRO-3 has released them, so second-order gradients "
                "(gradient penalties, double backward) would be computed from other weights. Use zero_stage=2, "
                "or compute the penalty without create_graph"
            )
        self._check_unchanged(unit)
        POSITION.at("backward", unit.name)
        task = current_task()
        if use.task == task:
            return
        use.task, use.pending = task, ends
        needs_weights = not unit.weight_free_bw  # See [Note: weight-free backward]
        if needs_weights:
            self._hold(unit, use)
        if prev is not None and not prev.weight_free_bw:
            prev.buffer.prefetch(prev)  # after the acquire, before the wait: the next gather goes out first
        if needs_weights:
            unit.buffer.wait()

    def use_done(self, unit: Unit, use: "BackwardUse") -> None:
        """One of a use's end nodes ran; after the last one this graph task runs, ZeRO-3 releases
        the weights. See [Note: releasing by what autograd runs] in autograd.py."""
        if use.task != current_task():  # its backward did not begin in this task: it holds nothing
            return
        use.pending -= 1
        if use.pending <= 0:
            # Release first, so a gather deferred on this buffer is issued ahead of this unit's
            # reduce and does not queue behind it.
            self._drop(unit, use)

    def post_backward(self, unit: Unit, pidx, grads, use: "BackwardUse") -> None:
        """The gate of a unit's use: its weight grads are in; grads into the grad buffer, reduce issued."""
        self._check_unchanged(unit)
        grads = run_grad_hooks(unit, pidx, grads)  # [Note: the module tree after wrapping] in orig_params.py
        if (self.zero_stage == 3 and unit is not self.small and not unit.weight_free_bw and unit.frozen is None
                and not unit.buffer.holds(unit)):
            raise RuntimeError(
                f"yafsdp: unit {unit.name!r} reached its backward without its weights gathered; its output "
                "escaped the engine's pre-backward hook (return tensors, tuples, lists or dicts from the unit)"
            )
        self.use_done(unit, use)
        lay = unit.layout
        self._note_used(unit, pidx, grads)
        if unit.grad_chunk:  # See [Note: chunked outsized gradients] in plan/sizing.py
            self._reduce_chunked(unit, pidx, grads)
            return
        buf = unit.grad_buffer.begin_write(lay.padded_numel)
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
        self._reduce(unit)

    def _note_used(self, unit: Unit, pidx, grads) -> None:
        """Which trainable parameters this backward reached; see [Note: parameters no rank used]
        in unused.py. The record restarts where DDP's ``.grad`` would go from None to a tensor."""
        lay = unit.layout
        if unit.flat_param.grad is None or len(unit.used) != len(lay.params):
            unit.used = [0] * len(lay.params)
        for i, g in zip(pidx, grads):
            if g is not None:
                unit.used[lay.index[id(unit.params[i])]] = 1

    def _reduce(self, unit: Unit) -> None:
        target, fresh = self._grad_target(unit)
        self.placement.reduce(self, unit, self._fold(unit, target, fresh, unit.grad_buffer.accum))

    def _reduce_chunked(self, unit: Unit, pidx, grads) -> None:
        """The unit's gradient reduced in column chunks through the grad pair. See [Note: chunked
        outsized gradients] in plan/sizing.py."""
        lay = unit.layout
        if self._exchanges_directly(unit):  # See [Note: the direct exchange of an outsized gradient]
            target, fresh = self._grad_target(unit)
            g = grads[0] if len(pidx) == 1 else None
            src = torch.zeros(lay.padded_numel, dtype=target.dtype, device=target.device) if g is None else g
            self.schedule.reduce_rows_into(target, src.contiguous().view(-1), unit.name)
            self._fold(unit, target, fresh, unit.chunk_buffers[0].accum)(target)
            return
        world, shard, width = lay.world_size, lay.shard_numel, unit.grad_chunk
        target, fresh = self._grad_target(unit)
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
        lay = unit.layout
        return (lay.world_size == 2 and self.replicas == 1
                and len(lay.params) == 1 and lay.numel == lay.padded_numel
                and self.compute_dtype == torch.float32 and self.reduce_dtype == torch.float32
                and not unit.chunk_buffers[0].pieces and unit.flat_param.grad is None
                and self.schedule.reduce_rows_ok())

    def lookup_fold(self, unit: Unit, every, every_grad, lo: int, rows: int, padding_idx) -> None:
        """The backward of a sharded lookup: every rank's output gradients (``every_grad``, for the
        token ids ``every``) folded into this rank's rows of the grad shard. See [Note: the sharded
        lookup of an embedding] in lookup.py."""
        self._check_unchanged(unit)
        self._note_used(unit, [0], [every_grad])
        touched, total = lookup_rows(every, every_grad, lo, rows, padding_idx)
        target, fresh = self._grad_target(unit)
        scale = 1.0 / (self.world_size * self.replicas)
        self._replicas_begun().fold(unit, target, fresh,
                                    lambda: fold_rows(target.view(rows, -1), touched, total, scale, fresh))

    def _grad_target(self, unit: Unit) -> tuple[torch.Tensor, bool]:
        """The unit's fp32 grad shard, and whether this backward's reduce is its first contribution."""
        p = unit.flat_param
        fresh = p.grad is None
        if fresh:  # See [Note: shard gradients that know they are shards] in shard_grad.py
            p.grad = grad_view(unit, self)
        return plain(p.grad), fresh

    def _fold(self, unit: Unit, target: torch.Tensor, fresh: bool, accum: torch.Tensor, lo: int = 0,
              hi: int | None = None, first: bool = True, last: bool = True):
        """``fold(reduced)``: elements [lo, hi) of the grad shard ``target`` (+)= the reduced sum / world.
        ``first`` / ``last``: the unit's first / last fold of this use (a chunked reduce folds in parts)."""
        # The one post-divide: by every rank of the world (HSDP: shard size x replicas, so that
        # the SUM all-reduce across replicas gives DDP's average).
        scale = 1.0 / (self.world_size * self.replicas)
        part = target if lo == 0 and hi is None else target[lo:hi]

        def fold_local(reduced: torch.Tensor) -> None:
            """grad shard (+)= reduced sum / world."""
            with torch.no_grad():
                if reduced.dim() == 2:  # every rank's piece: [Note: narrow reduce, fp32 accumulation]
                    fold_pieces_(part, reduced, scale, not fresh, accum[:part.numel()])
                elif fresh:
                    kernels.cast_(part, reduced, scale)  # scaled in fp32, rounded once
                else:
                    kernels.accumulate_(part, reduced, scale)

        sync = self._replicas_begun()

        def fold(reduced: torch.Tensor) -> None:  # HSDP: see [Note: the cross-replica all-reduce] in hsdp.py
            with torch.no_grad():
                sync.fold(unit, target, fresh, lambda: fold_local(reduced), first=first, last=last)

        return fold  # the placement's reduce runs it (offload: via the host landing, placement.py)

    def _replicas_begun(self):
        """The replica sync, told once per backward that this backward reduces: a backward call counts for
        the cross-replica prediction when it reduces (a call that runs no gate, e.g. torch.autograd.grad of
        an input, does not)."""
        if not self.replica_begun:
            self.replica_begun = True
            self.replica_sync.begin_backward()
        return self.replica_sync

    def finish_host_folds(self) -> None:
        """offload: every reduced grad shard that went to the host is folded there (host sync)."""
        self.placement.finish_folds(self.schedule)

    def end_task(self, task: int) -> None:
        """The end of a backward or autograd.grad call (its graph task): the holds it took are
        dropped; when no other call is running, the end of backward (:meth:`finalize_backward`)."""
        for unit, use in self.tasks.pop(task, ()):
            self._drop(unit, use)
        if not self.tasks:
            self.finalize_backward()

    def complete_reduces(self) -> None:
        """Every reduce issued is completed and folded (the host folds too), and HSDP's all-reduce across
        replicas that this backward began is finished. The end of a backward, and the recovery from an
        aborted one (``Runtime.recover``)."""
        for gs in self.grad_buffers:
            gs.finish()
        self.finish_host_folds()
        if self.replica_begun:
            self.replica_sync.finish_backward()
        self.replica_begun = False

    def finalize_backward(self) -> None:
        """End of backward: every reduce folded, every hold dropped."""
        self.complete_reduces()
        for s in self.weight_buffers:
            s.drop_deferred()
        self.phase = Phase.IDLE
        fire_shard_hooks(self)  # See [Note: hooks on the shards] in shard_hooks.py

    def sync_replicas(self) -> bool:
        """HSDP: the grad shards all-reduced across replicas, if a backward left local
        contributions (a no-op otherwise, and for a flat engine); True when it all-reduced."""
        self.recover()
        return self.replica_sync.sync()


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
