"""The engine's runtime: the units' shards and buffers, and the step protocol over them.

:class:`Runtime` owns every tensor the engine allocates (alloc.py: one fp32 master, one fp32 grad,
one compute-copy and one frozen tensor for all units, then the weight and grad buffers the plan
sizes) and runs the protocol of a step: the cast pass, the gathers with their prefetch; in backward the
uses that hold a unit's weight buffer and when they end ([Note: releasing by what autograd runs] in
autograd.py), the re-gather and its prefetch, the gate of each use (its checks and parameter hooks; the
gradients then take the path of grad_path.py), and the end of each autograd call and of the whole
backward. It calls the buffers' methods (buffers.py) and the schedule (comm/schedule.py); the autograd
nodes and module hooks that drive it are in autograd.py.

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

[Note: prefetch depth]
While a unit computes, the gathers of the next ``prefetch`` units are issued (in backward: of the
units that ran before it in forward, nearest first); ZeRO-3's regular units take turns in
``prefetch + 1`` weight buffers (``plan_buffers``), so at depth 2 the gather of unit i+2 goes into
the buffer unit i-1 released, before unit i computes. Nothing else changes: each gather still
waits for its own buffer's release (CUDA: its ``released`` event; gloo: the previous gather into
that buffer), a gather asked for while its buffer is busy is deferred to the release
([Note: buffer ownership] in buffers.py), and the values are the same bit for bit -- only when
gathers are issued moves. The farther prefetches are issued only into a buffer that neither the
unit computing nor a nearer prefetch uses (a unit order that does not follow the rotation, a
tied or outsized unit sharing a buffer): a farther gather never displaces a nearer one. The price
is one more buffer of the largest regular unit; the gain is slack for a gather that is long
against one unit's compute but not two (an outsized head behind the last layer, a peer that lags
a little), never bandwidth: the one comm lane runs the same gathers in the same order.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Iterator

import torch
import torch.distributed as dist

from .. import formats
from .alloc import allocate
from ..comm.schedule import Schedule
from ..comm.progress import POSITION
from .orig_params import run_grad_hooks
from .placement import make_placement
from .replicas import NoReplicas, make_replicas
from .shard_hooks import fire as fire_shard_hooks
from ..layout.config import EngineConfig
from .grad_path import GradPath
from ..layout.sizing import check_secondary, unit_align, unit_shape
from ..comm.subgroups import consecutive_subgroups
from ..tools.trace import span
from .unit import FlatGroup, Phase, StoredShard, Unit, current_task, frozen_kind, in_backward, stored_kind, trainable_kind
from ..layout.units import UnitSpec, weight_free_backward

__all__ = ["Runtime", "BackwardUse", "in_backward", "current_task"]

_RUNTIMES: "weakref.WeakSet[Runtime]" = weakref.WeakSet()  # live runtimes (for the optimizer hooks)


def _stored(name: str) -> property:
    return property(lambda self: getattr(self.storage, name),
                    doc=f"``storage.{name}``: see ``Storage`` in alloc.py (allocated once, read-only here)")


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


class Runtime:
    """Shards, buffers and the step protocol of one wrapped model."""

    def __init__(self, specs: list[UnitSpec], small: list, config: EngineConfig, *, gather_exclude: tuple[str, ...],
                 schedule: Schedule, group, rank: int, device: torch.device, replicate_group=None):
        """``config``: the engine's validated options (yafsdp/layout/config.py); ``gather_exclude``: its
        ``gather_exclude`` resolved for this model; ``group`` / ``rank``: the shard group and this
        rank's index in it; ``replicate_group``: HSDP's, or None."""
        self.config = config
        self.schedule = schedule
        # Where each tensor lives (offload: the optimizer's on the host). See [Note: placement] in placement.py.
        self.placement = make_placement(device, config.offload)
        self.offload = config.offload
        self.host_device = self.placement.host
        # the shard group; with HSDP, replicate_group joins the replicas (the usage agreement of
        # unused.py runs over both)
        self.group = group
        self.replicate_group = replicate_group
        # a model with tensor-parallel (DTensor) parameters: the TP mesh's group, set by the wrapper; else None.
        # See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py
        self.tp_group = None
        self.world_size = world_size = dist.get_world_size(group)  # of the shard group (HSDP: one replica)
        self.device = device
        self.compute_dtype = compute_dtype = config.compute_dtype
        self.reduce_dtype = config.reduce_dtype
        # torch.float32: reduces move reduce_dtype pieces and sum them in fp32; None: they sum in
        # reduce_dtype. See [Note: narrow reduce, fp32 accumulation] in reduce_accum.py.
        self.reduce_accum_dtype = config.reduce_accum_dtype
        self.zero_stage = config.zero_stage
        self.prefetch = config.prefetch  # units gathered ahead: see [Note: prefetch depth]
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
        # the unit whose member's forward hook ran last in this forward, until the next unit's forward or the end
        # of the root forward: a read refused meanwhile gets a hint ([Note: the engine's hooks around the
        # user's] in autograd.py)
        self.closed_last: Unit | None = None
        # autograd graph task id -> the (unit, BackwardUse) holds taken in it, for each backward or
        # autograd.grad call that touched the engine and has not ended (see [Note: releasing by what
        # autograd runs] in autograd.py)
        self.tasks: dict[int, list] = {}
        # (weak reference, requires_grad, name) of every original parameter: changing requires_grad
        # after wrapping would have no effect, so it is refused (see check_frozen).
        self.originals: list[tuple[weakref.ref, bool, str]] = []
        # secondary_shard: the subgroup size (0: off) and this rank's subgroup of the shard group, made
        # once here (collective over the world). See [Note: the secondary shard] in secondary.py.
        self.secondary_size = check_secondary(config.secondary_shard, world_size)
        self.secondary_group = (consecutive_subgroups(group, self.secondary_size, what="secondary_shard")
                                if self.secondary_size else None)
        self.storage = allocate(self, outsized_ratio)  # every tensor the engine owns (alloc.Storage)
        # where each trainable shard's values live: ``p.data = new`` elsewhere is refused (check_frozen)
        self.shard_places = [(u, u.flat_param.data_ptr()) for u in self.all if u.flat_param is not None]
        # HSDP: the grad shards' all-reduce across replicas (see [Note: the cross-replica all-reduce]);
        # a flat engine's does nothing (NoReplicas).
        self.replica_sync = make_replicas(self, replicate_group, schedule)
        self.replicas = self.replica_sync.replicas
        self.grad_path = GradPath(self)  # a gradient from its unit's gate to its grad shard
        _RUNTIMES.add(self)

    # Every tensor the engine owns, as alloc.allocate made them (``Storage``), by name.
    master = _stored("master")
    grad = _stored("grad")
    compute = _stored("compute")
    compute_host = _stored("compute_host")
    grad_landing = _stored("grad_landing")
    gather_store = _stored("gather_store")
    secondary = _stored("secondary")
    gather_host = _stored("gather_host")
    frozen_store = _stored("frozen_store")
    nf4_store = _stored("nf4_store")
    flat = _stored("flat")
    buffer_plan = _stored("buffer_plan")
    weight_buffers = _stored("weight_buffers")
    alias_buffers = _stored("alias_buffers")
    grad_buffers = _stored("grad_buffers")

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
        if self.secondary.numel():  # See [Note: the secondary shard] in secondary.py
            out["secondary"] = self.secondary
        for s in self.weight_buffers:
            out[s.name] = s.data if s.allocated else s.data[:0]  # [Note: world-1 buffers in use only] in sizing.py
            if s.staging.numel():
                out[s.name + "_staging"] = s.staging
            if s.landing.numel():
                out[s.name + "_landing"] = s.landing
        for s in self.grad_buffers:
            out[s.name] = s.data
            out[s.name + "_staging"] = s.staging
            if s.accum.numel():
                out[s.name + "_accum"] = s.accum
            if s.quant.numel():  # grad_quant: see [Note: quantized gradient reduction] in comm/quant_reduce.py
                out[s.name + "_quant"] = s.quant
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
        for u in self.units:  # a load need not bump a version: [Note: the secondary shard] in secondary.py
            if u.secondary is not None:
                u.secondary.forget()
        # Every compute copy is rewritten from its master at the next step entry, whether or not the
        # loader's writes bumped the shards' version counters (a compact group's record is derived
        # from the master and never stored: [Note: gather formats] in formats/base.py).
        for u in self.all:
            for g in u.groups:
                g.cast_version = -1
        self.copies_changed = True

    def check_frozen(self) -> None:
        """requires_grad cannot change after wrapping: the trainable/frozen split is fixed then; nor can a
        trainable shard's storage (``p.data = new``)."""
        for u in self.all:
            if u.flat_param is not None and not u.flat_param.requires_grad:
                raise RuntimeError(
                    f"yafsdp: the shard of unit {u.name!r} has requires_grad=False: the split into trainable and "
                    "frozen parameters is made at wrap time. Set requires_grad on the module's parameters before "
                    "wrapping (or keep the shard out of the optimizer)"
                )
        for u, place in self.shard_places:
            if u.flat_param.data_ptr() != place:
                raise RuntimeError(
                    f"yafsdp: the shard of unit {u.name!r} was given new storage (p.data = ...; "
                    "torch.nn.utils.vector_to_parameters does this): the engine reads each shard where it allocated "
                    "it, so the new values would not be used. Write into the shard in place under torch.no_grad() "
                    "(p.copy_(new)), or use model.load_full_state_dict(...)")
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
        self.closed_last = None
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
        cast = [g for g in stale if g.kind.reduced and not g.kind.format.compact and not g.gathers_master]
        packed = [g for g in stale if g.kind.reduced and g.kind.format.compact]
        with torch.no_grad():
            n_trainable = sum(1 for g in groups if g.kind.reduced)
            # every trainable group, laid alike in master and compute (never with compact groups:
            # their compute copies are records in gather_store; nor with groups gathered from their
            # masters, which have none: [Note: the world-1 cast gather] in layout/sizing.py)
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
        """``unit`` joins this forward's trace; the ``prefetch`` units after it in the last forward's
        order are prefetched."""
        self.trace.append(unit)
        pos = len(self.trace)
        if self.order and pos < len(self.order) and self.order[pos - 1] is unit:
            self._prefetch_ahead(unit, self.order[pos:pos + self.prefetch])

    @staticmethod
    def _prefetch_ahead(unit: Unit, ahead: list[Unit]) -> None:
        """Prefetch the units ``ahead`` of ``unit`` (nearest first): the nearest always (deferred while
        its buffer is busy), a farther one only into a buffer none of the nearer ones nor ``unit`` uses.
        See [Note: prefetch depth]."""
        taken = [unit.buffer]
        for k, u in enumerate(ahead):
            if k and any(u.buffer is b for b in taken):
                return
            u.buffer.prefetch(u)
            taken.append(u.buffer)

    def unit_recompute(self, unit: Unit) -> None:
        """An activation-checkpoint recompute inside backward: the weights must be there. A unit no
        use holds in this backward (ZeRO-2, or a recompute outside the unit's backward) is held
        until the backward ends."""
        if not unit.bw_holds:
            self._hold(unit, BackwardUse())
        unit.buffer.wait()

    def previous_in_forward(self) -> list[Unit]:
        """The ``prefetch`` units before the current one in this forward, nearest first (its backward prefetches them)."""
        return [self.trace[-1 - k] for k in range(1, self.prefetch + 1) if len(self.trace) > k]

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

    def pre_backward(self, unit: Unit, use: "BackwardUse", prevs: list[Unit], ends: int) -> None:
        """Before a use's backward in this graph task (ZeRO-3): re-gather the unit, prefetch the units
        before it (``prevs``, nearest first: [Note: prefetch depth]). ``ends``: how many of the use's end
        nodes this task will run."""
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
        # after the acquire, before the wait: the next gathers go out first
        self._prefetch_ahead(unit, [p for p in prevs if not p.weight_free_bw])
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
        self._note_used(unit, pidx, grads)
        self.grad_path.unit_grads(unit, pidx, grads)  # write, reduce, land, fold, all-reduce: grad_path.py

    def _note_used(self, unit: Unit, pidx, grads) -> None:
        """Which trainable parameters this backward reached; see [Note: parameters no rank used]
        in unused.py. The record restarts where DDP's ``.grad`` would go from None to a tensor."""
        lay = unit.layout
        if unit.flat_param.grad is None or len(unit.used) != len(lay.params):
            unit.used = [0] * len(lay.params)
        for i, g in zip(pidx, grads):
            if g is not None:
                unit.used[lay.index[id(unit.params[i])]] = 1

    def lookup_fold(self, unit: Unit, every, every_grad, lo: int, rows: int, padding_idx) -> None:
        """The backward of a sharded lookup: every rank's output gradients (``every_grad``, for the
        token ids ``every``) folded into this rank's rows of the grad shard. See [Note: the sharded
        lookup of an embedding] in lookup.py."""
        self._check_unchanged(unit)
        self._note_used(unit, [0], [every_grad])
        self.grad_path.lookup_grads(unit, every, every_grad, lo, rows, padding_idx)

    def end_task(self, task: int) -> None:
        """The end of a backward or autograd.grad call (its graph task): the holds it took are
        dropped; when no other call is running, the end of backward (:meth:`finalize_backward`)."""
        for unit, use in self.tasks.pop(task, ()):
            self._drop(unit, use)
        if not self.tasks:
            self.finalize_backward()

    def complete_reduces(self) -> None:
        """Every reduce issued is completed and folded; see ``GradPath.complete``."""
        self.grad_path.complete()

    def finalize_backward(self) -> None:
        """End of backward: every reduce folded, every hold dropped."""
        self.complete_reduces()
        for s in self.weight_buffers:
            s.drop_deferred()
        self.phase = Phase.IDLE
        fire_shard_hooks(self)  # See [Note: hooks on the shards] in shard_hooks.py

    def adopt_replica_sync(self, sync) -> None:
        """The all-reduce across replicas is run by ``sync`` from now on (an object with ``ReplicaSync``'s
        interface: ``begin_backward``, ``repair``, ``folded``, ``finish_backward``, ``sync``, ``stats``):
        torchft's managed replica groups (yafsdp/integrations/torchft.py). The engine is a flat one
        underneath (its fold scale stays ``1 / shard_size``); it counts as replicated from here on, so
        every reader of the gradients completes them through ``sync`` first."""
        if type(self.replica_sync) is not NoReplicas:  # a flat engine's own, not another adopted one
            raise RuntimeError("yafsdp: this engine's gradients are already all-reduced across replicas "
                               f"({type(self.replica_sync).__name__}); one replica sync per engine")
        self.replica_sync = self.grad_path.replicas = sync
        self.replicas = 2  # "replicated": the readers that ask `replicas > 1` call sync_replicas()

    def sync_replicas(self) -> bool:
        """HSDP: the grad shards all-reduced across replicas, if a backward left local
        contributions (a no-op otherwise, and for a flat engine); True when it all-reduced."""
        self.recover()
        return self.replica_sync.sync()


def live_runtimes() -> list[Runtime]:
    """Every engine alive in this process."""
    return list(_RUNTIMES)
