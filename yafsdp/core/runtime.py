"""The engine's runtime: the units' shards and buffers, and the step protocol over them.

:class:`Runtime` owns every tensor the engine allocates (alloc.py: one fp32 master, one fp32 grad,
one compute-copy and one frozen tensor for all units, then the weight and grad buffers the plan
sizes) and runs the protocol of a step: the cast pass, the gathers with their prefetch, the
gradients' reduce and fold, and the end of backward. It calls the buffers' methods (buffers.py) and the schedule
(comm/schedule.py); the autograd nodes and module hooks that drive it are in autograd.py.

[Note: buffer aliases]
During forward and backward a unit's parameters are *aliases* of its weight buffer: tensors made
once at wrap time over the buffer's storage (``flat.alias``), each with its own version counter.
The gate returns views of them, which the modules use as their weights. A gather writes into the
buffer through the buffer tensor itself, which bumps only the buffer's version counter, so
autograd's saved-tensor check never fires when ZeRO-3 re-gathers a unit into the same place for
backward. The same holds for the fp32 master shards: each unit's ``nn.Parameter`` aliases one big
local tensor (one cast pass per step) but keeps its own version, which is how the engine tells
which shards changed since their compute copy was written.

[Note: weight-free backward]
Some units' backward reads none of their weights: a plain ``nn.Embedding`` computes its weight
gradient from the indices and the output gradient alone, and its integer input has no gradient
(``units.weight_free_backward`` says which units qualify: every module using the parameters is
a plain dense embedding, so not a tied head). ZeRO-3 does not re-gather such a unit for backward
and does not prefetch it there: for a Llama embedding that is one unit-sized all-gather less per
step, at the very end of backward where nothing is left to hide it behind. The views handed to
the embedding in forward are not saved by autograd (the embedding saves only its indices), so
the buffer may hold another unit's weights by then. Its grads are written and reduced as usual.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from .. import formats
from .alloc import STORAGE_FIELDS, allocate
from .backward import BackwardSteps, BackwardUse
from ..comm.schedule import Schedule
from ..comm.progress import POSITION
from .placement import make_placement
from .replicas import make_replicas
from .config import EngineConfig
from .grad_path import GradPath
from ..plan.sizing import unit_align, unit_shape
from ..tools.trace import span
from .unit import FlatGroup, Phase, StoredShard, Unit, current_task, frozen_kind, in_backward, stored_kind, trainable_kind
from .units import UnitSpec, weight_free_backward

__all__ = ["Runtime", "BackwardUse", "in_backward", "current_task"]

_RUNTIMES: "weakref.WeakSet[Runtime]" = weakref.WeakSet()  # live runtimes (for the optimizer hooks)


class Runtime(BackwardSteps):
    """Shards, buffers and the step protocol of one wrapped model."""

    def __init__(self, specs: list[UnitSpec], small: list, config: EngineConfig, *, gather_exclude: tuple[str, ...],
                 schedule: Schedule, group, rank: int, device: torch.device, replicate_group=None):
        """``config``: the engine's validated options (yafsdp/core/config.py); ``gather_exclude``: its
        ``gather_exclude`` resolved for this model; ``group`` / ``rank``: the shard group and this
        rank's index in it; ``replicate_group``: HSDP's, or None."""
        self.config = config
        self.schedule = schedule
        # Where each tensor lives (offload: the optimizer's on the host). See [Note: placement] in placement.py.
        self.placement = make_placement(device, config.offload_what)
        self.offload = config.offload_what
        self.host_device = self.placement.host
        # the shard group; with HSDP, replicate_group joins the replicas (the usage agreement of
        # unused.py runs over both)
        self.group = group
        self.replicate_group = replicate_group
        self.world_size = world_size = dist.get_world_size(group)  # of the shard group (HSDP: one replica)
        self.device = device
        self.compute_dtype = compute_dtype = config.compute_dtype
        self.reduce_dtype = config.reduce_dtype
        # torch.float32: reduces move reduce_dtype pieces and sum them in fp32; None: they sum in
        # reduce_dtype. See [Note: narrow reduce, fp32 accumulation] in reduce_accum.py.
        self.reduce_accum_dtype = config.reduce_accum_dtype
        self.zero_stage = config.zero_stage
        # "nf4" or None: see [Note: NF4 frozen groups] in formats/nf4_codec.py
        self.quantize_frozen = quantize_frozen = config.quantize_frozen
        # "fp8", "int8" or None: trainable groups gathered compact, see [Note: gather formats] in formats/base.py
        self.gather_dtype = gather_dtype = config.gather_dtype
        self.gather_format = formats.get(gather_dtype)  # the plain format for None
        align = unit_align(compute_dtype, config.reduce_dtype, config.align_bytes)
        outsized_ratio = config.outsized_ratio
        stored = formats.get(quantize_frozen) if quantize_frozen is not None else None
        quantize = compute_dtype if stored is not None else None

        def unit(name, index, params, members):
            # the same split the plan makes
            shape = unit_shape(params, world_size, rank, align, quantize, self.gather_format, gather_exclude, stored)
            kinds = (trainable_kind(compute_dtype, shape.gather), frozen_kind(compute_dtype),
                     stored_kind(compute_dtype, stored) if stored is not None else None)
            groups, offset, staged = [], 0, 0
            for kind, lay in zip(kinds, (shape.trainable, shape.frozen, shape.nf4)):
                if lay is not None:
                    groups.append(FlatGroup(kind, lay, buffer_offset=offset))
                    offset += lay.padded_numel
                    if kind.format.compact:  # records end to end in the staging area: the trainable group's first
                        groups[-1].staging_offset = staged
                        groups[-1].staging_bytes = lay.world_size * kind.format.record_bytes(lay.shard_numel,
                                                                                             compute_dtype)
                        staged += groups[-1].staging_bytes
            assert staged == shape.staging_bytes, (name, staged, shape.staging_bytes)
            u = Unit(name, index, groups, members, list(params))
            u.shape = shape
            return u

        self.units: list[Unit] = [unit(s.name, i, s.params, s.members) for i, s in enumerate(specs)]
        for u, s in zip(self.units, specs):
            u.weight_free_bw = weight_free_backward(s)
        self.small: Unit | None = unit("small_group", len(self.units), small, []) if small else None
        self.all: list[Unit] = self.units + ([self.small] if self.small else [])
        self.phase = Phase.IDLE
        self.order: list[Unit] = []  # units in the order of the last forward (the prefetch plan)
        self.trace: list[Unit] = []  # units used so far in the current forward
        # The compute copies changed since the schedule was last told (the optimizer wrote them):
        # the next step entry records the schedule's copies-ready point. See ensure_step_ready.
        self.copies_changed = True
        self.root_depth = 0  # nesting of root forwards (the wrapped module's own forward)
        # autograd graph task id -> the (unit, BackwardUse) holds taken in it, for each backward or
        # autograd.grad call that touched the engine and has not ended (see [Note: releasing by what
        # autograd runs] in autograd.py)
        self.tasks: dict[int, list] = {}
        # (weak reference, requires_grad, name) of every original parameter: changing requires_grad
        # after wrapping would have no effect, so it is refused (see check_frozen).
        self.originals: list[tuple[weakref.ref, bool, str]] = []
        self.storage = allocate(self, outsized_ratio)  # every tensor the engine owns (alloc.Storage)
        # HSDP: the grad shards' all-reduce across replicas (see [Note: the cross-replica all-reduce]);
        # a flat engine's does nothing (NoReplicas).
        self.replica_sync = make_replicas(self, replicate_group, schedule)
        self.replicas = self.replica_sync.replicas
        self.grad_path = GradPath(self)  # a gradient from its unit's gate to its grad shard
        _RUNTIMES.add(self)

    # ------------------------------------------------------------------ host and device
    # See [Note: placement] in placement.py.
    def host_zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.placement.zeros(numel, dtype)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the compute device, where the collectives run (with offload always a copy)."""
        return self.placement.to_device(t)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the optimizer's tensors live (``t`` itself when already there)."""
        return self.placement.to_host(t)

    def where(self, role: str) -> str:
        """Where a role of :meth:`owned_tensors` lives: "host" or "device"."""
        return self.placement.where(role)

    def quiesce(self) -> None:
        """offload: the host waits for every copy and collective in flight (before host shards they
        may read are written: loads between steps)."""
        self.placement.quiesce(self.schedule)

    def before_optimizer_step(self) -> None:
        """An optimizer step is about to write host tensors an upload may still read (offload)."""
        self.placement.before_step(self.schedule)

    def owned_tensors(self) -> dict[str, torch.Tensor]:
        out = {"master": self.master, "grad": self.grad}
        if self.compute is not self.master:
            out["compute_copy"] = self.compute
        if self.compute_host is not None and self.compute_host is not self.master:
            out["compute_host"] = self.compute_host
        if self.grad_landing is not None:
            out["grad_landing"] = self.grad_landing
        if self.frozen_store.numel():
            out["frozen"] = self.frozen_store
        if self.nf4_store.numel():
            out["nf4"] = self.nf4_store
        if self.gather_store.numel():  # named after its format ("fp8", "int8")
            out[self.gather_format.name] = self.gather_store
        if self.gather_host is not None:  # offload: its host side
            out[self.gather_format.name + "_host"] = self.gather_host
        for s in self.weight_buffers:
            out[s.name] = s.data
            if s.staging.numel():
                out[s.name + "_staging"] = s.staging
            if s.landing.numel():
                out[s.name + "_landing"] = s.landing
        for s in self.grad_buffers:
            out[s.name] = s.data
            out[s.name + "_staging"] = s.staging
            if s.accum.numel():
                out[s.name + "_accum"] = s.accum
        return out

    def stored_shards(self) -> Iterator[StoredShard]:
        """Every flat group's shard on this rank, unit by unit (the small group last), groups in
        their order. See [Note: stored shards] in unit.py."""
        for u in self.all:
            for g in u.groups:
                yield StoredShard(u, g, g.kind.name, g.shard.detach())

    def fp32_scratch(self, unit: Unit, group: FlatGroup) -> torch.Tensor:
        """fp32 room for one gathered group: the unit's grad buffer when that is fp32 and idle, else a temporary."""
        n = group.layout.padded_numel
        gs = unit.grad_buffer
        if gs is not None and gs.data.dtype == torch.float32 and gs.capacity >= n and not gs.reduce_pending:
            return gs.data[:n]
        return torch.empty(n, dtype=torch.float32, device=self.device)

    def invalidate_buffers(self) -> None:
        """The shards were loaded anew: no weight buffer holds a current unit, and the next gathers
        wait for the compute side's writes."""
        for s in (*self.weight_buffers, *self.alias_buffers):
            s.invalidate()
        # Every compute copy is rewritten from its master at the next step entry, whether or not the
        # loader's writes bumped the shards' version counters (a compact group's record is derived
        # from the master and never stored: [Note: gather formats] in formats/base.py).
        for u in self.all:
            for g in u.groups:
                g.cast_version = -1
        self.copies_changed = True

    def check_frozen(self) -> None:
        """requires_grad cannot change after wrapping: the trainable/frozen split is fixed then."""
        for u in self.all:
            if u.flat_param is not None and not u.flat_param.requires_grad:
                raise RuntimeError(
                    f"yafsdp: the shard of unit {u.name!r} has requires_grad=False: the split into trainable and "
                    "frozen parameters is made at wrap time. Set requires_grad on the module's parameters before "
                    "wrapping (or keep the shard out of the optimizer)"
                )
        for ref, was, name in self.originals:
            p = ref()
            if p is not None and p.requires_grad != was:
                raise RuntimeError(
                    f"yafsdp: requires_grad of parameter {name!r} changed after wrapping (was {was}); the engine "
                    "split trainable and frozen parameters at wrap time and this change would have no effect. "
                    "Set requires_grad before wrapping"
                )

    @property
    def idle(self) -> bool:
        self.recover()
        return self.phase is not Phase.BACKWARD and not any(s.busy for s in self.weight_buffers)

    def recover(self) -> bool:
        """Make the engine whole again after a backward that raised.

        autograd drops the end-of-backward callback when an exception leaves a backward, so the
        engine would stay "in backward": reduces never folded, buffers held. Every entry point
        (forward, clipping, state dicts, checkpoints, an optimizer step) calls this first; outside
        a running backward, a BACKWARD phase means the last one was aborted. The reduces it issued
        are completed and folded (the grad shards then hold the partial gradients of the aborted
        backward, as ``.grad`` does in plain PyTorch), every hold is dropped, and a warning says to
        call ``opt.zero_grad()`` before the next step. Returns True when it recovered."""
        if self.phase is not Phase.BACKWARD or in_backward():
            return False
        self.complete_reduces()
        for u in self.all:
            u.bw_holds = 0
        self.tasks.clear()
        for s in (*self.weight_buffers, *self.alias_buffers):
            s.abandon()
        self.phase = Phase.IDLE
        self.root_depth = 0
        warnings.warn(
            "yafsdp: the last backward raised before it finished; the engine completed its reduces and "
            "released its buffers. The gradients of that backward are partial: call opt.zero_grad() "
            "(set_to_none=True, the default) before the next step, as plain PyTorch requires.",
            RuntimeWarning, stacklevel=3,
        )
        return True

    # ------------------------------------------------------------------ forward
    def begin_forward(self) -> list:
        """A root forward starts: the cast pass, then the small group (returns its tensors)."""
        self.recover()
        self.check_frozen()
        self.trace = []
        self.phase = Phase.FORWARD if self.phase is Phase.IDLE else self.phase
        self.ensure_step_ready()
        small = self.small
        if small is None:
            return []
        if not small.buffer.holds(small):
            small.buffer.gather(small)
        if self.order:  # the first unit's gather goes out before the wait for the (tiny) small group
            # (the first one gathered: an embedding looked up from its shards is not, see lookup.py)
            first = next((u for u in self.order if u.lookup_hooks is None), None)
            if first is not None:
                first.buffer.prefetch(first)
        small.buffer.wait()
        small.forward_versions = small.shard_versions()
        return small.aliases

    def end_forward(self, ok: bool) -> None:
        if ok and self.trace:
            self.order = self.trace
        if not ok and not in_backward():  # an exception inside forward: drop every hold
            for s in (*self.weight_buffers, *self.alias_buffers):
                s.abandon()
        if self.phase is Phase.FORWARD:
            self.phase = Phase.IDLE

    def ensure_step_ready(self) -> None:
        """The cast pass: fp32 master -> compute copy for every shard changed since last written;
        then, if any compute copy changed (cast here, or written by the optimizer), the schedule's
        copies-ready point, which every later gather waits for."""
        groups = [g for u in self.all for g in u.groups]
        stale = [g for g in groups if g.stale]
        if not stale:
            if self.copies_changed:
                self.copies_changed = False
                self.schedule.copies_written()
            return
        # a frozen shard is its own compute copy; a compact trainable group's is its format's record
        cast = [g for g in stale if g.kind.reduced and not g.kind.format.compact]
        packed = [g for g in stale if g.kind.reduced and g.kind.format.compact]
        with torch.no_grad():
            n_trainable = sum(1 for g in groups if g.kind.reduced)
            # every trainable group, laid alike in master and compute (never with compact groups:
            # their compute copies are records in gather_store)
            everything = len(cast) == n_trainable
            if cast and (self.compute is not self.master or self.placement.optimizer_on_host):
                with span("cast", "all" if everything else f"{len(cast)} units"):
                    self.placement.cast(self, cast, everything)  # with offload: then the upload
            if packed:  # See [Note: gather formats] in formats/base.py
                with span("quantize", f"{len(packed)} units"):
                    self.placement.quantize(self, packed)  # with offload: on the host, then the upload
            for g in stale:
                g.mark_cast()
        self.copies_changed = False
        self.schedule.copies_written()

    def unit_forward(self, unit: Unit, gather: bool = True) -> None:
        """Before a unit's forward: its weights gathered (the next unit's gather issued first).
        ``gather=False``: a sharded lookup, which reads the shard itself (lookup.py)."""
        POSITION.at("forward", unit.name)
        self.recover()
        self.ensure_step_ready()
        if not gather:
            self._trace_and_prefetch(unit)
            unit.forward_versions = unit.shard_versions()
            return
        small = self.small
        if self.root_depth == 0 and small is not None and not small.buffer.holds(small):
            # A unit run on its own, outside any forward of the wrapped module: the norms and
            # biases it may use (the small group) must be current too.
            small.buffer.gather(small)
            small.buffer.wait()
        unit.buffer.acquire(unit)
        self._trace_and_prefetch(unit)
        unit.buffer.wait()
        unit.forward_versions = unit.shard_versions()

    def _trace_and_prefetch(self, unit: Unit) -> None:
        """``unit`` joins this forward's trace; the unit after it in the last forward's order is prefetched."""
        self.trace.append(unit)
        pos = len(self.trace)
        if self.order and pos < len(self.order) and self.order[pos - 1] is unit:
            nxt = self.order[pos]
            nxt.buffer.prefetch(nxt)

    def unit_recompute(self, unit: Unit) -> None:
        """An activation-checkpoint recompute inside backward: the weights must be there. A unit no
        use holds in this backward (ZeRO-2, or a recompute outside the unit's backward) is held
        until the backward ends."""
        if not unit.bw_holds:
            self._hold(unit, BackwardUse())
        unit.buffer.wait()

    def previous_in_forward(self) -> Unit | None:
        return self.trace[-2] if len(self.trace) >= 2 else None


def _stored(name: str) -> property:
    return property(lambda self: getattr(self.storage, name),
                    doc=f"``storage.{name}``: see ``Storage`` in alloc.py (allocated once, read-only here)")


for _name in STORAGE_FIELDS:  # rt.master, rt.grad, rt.weight_buffers, ...: what alloc.allocate returned
    setattr(Runtime, _name, _stored(_name))


def live_runtimes() -> list[Runtime]:
    """Every engine alive in this process."""
    return list(_RUNTIMES)
