"""Allocation of a runtime's tensors: every unit's shards (one master, one grad, one compute-copy,
one frozen and one NF4 tensor for all units), the public shard registrations, and the weight and grad buffers
the plan sizes. Called once, by ``Runtime.__init__``; ``self`` is that runtime.

[Note: host and device tensors]
Every tensor the engine allocates lives in one of two places: ``Runtime.device`` (the compute
device: weight and grad buffers, the compute copies, frozen and NF4 shards) or
``Runtime.host_device`` (where the optimizer runs: the fp32 master and grad shards). The runtime's
placement object decides (see [Note: placement] in placement.py); :func:`allocate` returns what it
allocated as one :class:`Storage`. Without
offload both are the same device. With ``offload="optimizer"`` the host is the CPU (pinned memory
when the device is CUDA) and the engine adds two host tensors:

- ``compute_host`` (param_dtype; the master itself in fp32): the optimizer's copy-out and the
  cast pass write here, on the host; the upload (``Schedule.upload``) moves it into the device
  compute copy, which stays the all-gather input (a separate device tensor even in fp32);
- ``grad_landing`` (reduce_dtype): the reduced grad shard goes device -> host into it
  (``Schedule.reduce``'s fold), and the host folds it into the fp32 grad shard
  (``kernels.cast_`` / ``accumulate_``, the same kernels and values as without offload).

With ``offload="all"`` the frozen and NF4 stores are host tensors too (pinned on CUDA), and each weight
buffer has a device *landing* their shards are copied into before their all-gathers: see [Note: the
frozen landing] in layout/sizing.py.

Collectives only ever see device tensors: code that hands a host tensor to a collective moves it
with ``Runtime.to_device`` first (``tests/multirank/test_offload.py`` checks that no collective touches a
host tensor's storage). ``Runtime.placement`` says where each role of ``owned_tensors`` lives;
the plan reports the same split (``MemoryPlan.placement``).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torch import nn

from . import shards
from ..comm.collectives import reduces_in_place
from .buffers import GradBuffer, ShardAlias, WeightBuffer
from ..layout.flat import alias
from ..layout.sizing import landing_layout, plan_buffers, plan_secondary, quant_plan, round16, secondary_pieces
from . import grad_quant
from .secondary import SecondaryShard
from .unit import FlatGroup

__all__ = ["allocate", "Storage", "STORAGE_FIELDS"]


@dataclass
class Storage:
    """Every tensor one engine allocates (:func:`allocate` fills it; ``Runtime`` reads it through
    attributes of the same names). Where each lives: [Note: host and device tensors]."""

    master: torch.Tensor | None = None  # 1-D fp32, every trainable shard end to end
    grad: torch.Tensor | None = None  # 1-D fp32, laid as master
    compute: torch.Tensor | None = None  # 1-D param_dtype all-gather inputs (the master itself in fp32)
    compute_host: torch.Tensor | None = None  # offload: the host side of the compute copy
    grad_landing: torch.Tensor | None = None  # offload: reduce_dtype host landing of the reduced shards
    gather_store: torch.Tensor | None = None  # 1-D uint8 records of the gather format (fp8, int8)
    secondary: torch.Tensor | None = None  # 1-D uint8: the units' secondary shards (engine/secondary.py)
    gather_host: torch.Tensor | None = None  # offload: the host side of the records
    frozen_store: torch.Tensor | None = None  # 1-D param_dtype frozen shards
    nf4_store: torch.Tensor | None = None  # 1-D uint8 NF4 records
    flat: nn.Module | None = None  # the master shards as registered parameters
    buffer_plan: object = None  # layout.sizing.BufferPlan
    weight_buffers: list = field(default_factory=list)
    alias_buffers: list = field(default_factory=list)  # world 1: units that alias their shards (ShardAlias)
    grad_buffers: list = field(default_factory=list)


STORAGE_FIELDS = tuple(f.name for f in fields(Storage))


def allocate(self, outsized_ratio: float) -> "Storage":
    """Local shards (one tensor each for all units), then the weight and grad buffers; ``self`` is
    the runtime being built (its units, placement and schedule). Returns what it allocated."""
    st = Storage()
    place = self.placement
    dev = self.device
    trainable = [g for u in self.all for g in u.groups if g.kind.reduced]
    total = sum(g.layout.shard_numel for g in trainable)
    # 1-D fp32: every unit's master shard end to end (one cast pass covers all of them). On the
    # host with offload: see [Note: host and device tensors].
    st.master = place.zeros(total, torch.float32)
    # Buffer sizes come from the plan, so yafsdp.plan can report them without allocating.
    # See [Note: one plan, one allocator] in yafsdp/plan/__init__.py.
    # See [Note: reduce-scatter in place] in comm/collectives.py.
    in_place = reduces_in_place(dist.get_backend(self.group), self.world_size)
    # grad_quant: see [Note: quantized gradient reduction] in comm/quant_reduce.py
    quant = quant_plan(self.config.grad_quant, self.config.grad_quant_node, self.world_size,
                       dist.get_world_size(self.replicate_group) if self.replicate_group is not None else 1, in_place)
    st.buffer_plan = plan = plan_buffers(
        [u.name for u in self.units], [u.shape for u in self.units],
        self.small.shape if self.small is not None else None,
        compute_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype,
        zero_stage=self.zero_stage, outsized_ratio=outsized_ratio, offload_frozen=place.host_frozen,
        accumulate_fp32=self.reduce_accum_dtype is not None,
        chunk_outsized=self.config.chunk_outsized_grads and place.chunks_outsized,
        grad_chunks=self.config.grad_chunks,
        reduce_in_place=in_place,
        alias_world1=self.world_size == 1 and place.aliases_world1,
        direct_grads=(self.reduce_dtype == torch.float32 and self.reduce_accum_dtype is None
                      and self.replicate_group is None),
        quant=quant,
        prefetch=self.config.prefetch,
    )
    # 1-D fp32: every unit's grad shard; each shard's .grad aliases its slice. Empty where each unit's
    # grad shard lives for a step: [Note: the grad shard's lifetime at world 1] in layout/sizing.py.
    st.grad = place.zeros(0 if plan.step_grads else total, torch.float32)
    # 1-D param_dtype: the compute copies (all-gather inputs) of the groups gathered in param_dtype,
    # laid as in the master when every group is; the master itself in fp32 (when the master is on the
    # device: with offload, the device copy is always its own tensor).
    # A unit gathered by casting its master at world 1 has none: [Note: the world-1 cast gather] in
    # layout/sizing.py.
    casts = {id(g) for u, c in zip(self.all, plan.cast_of) if c for g in u.groups}
    plain_total = sum(g.layout.shard_numel for g in trainable if not g.kind.format.compact and id(g) not in casts)
    st.compute = (
        st.master if place.compute_is_master(self.compute_dtype)
        else torch.zeros(plain_total, dtype=self.compute_dtype, device=dev)
    )
    # offload (the placement's host_sides; None each without): the host side of the compute copy (what
    # the copy-out and the cast pass write and the upload reads; the master itself in fp32), the host
    # landing of the reduced grads, and the host side of the compact records (the optimizer's copy-out
    # and the encode pass write there; the upload moves it into gather_store). compute_host spans every
    # trainable group, laid as the master; a compact group's slice of it is unused.
    gather_total = sum(u.shape.gather_record for u in self.all)
    st.compute_host, st.grad_landing, st.gather_host = place.host_sides(
        st.master, total, gather_total, self.compute_dtype, self.reduce_dtype)
    # 1-D uint8: the compute copies of the trainable groups gathered compact (gather_dtype="fp8",
    # "int8"): one record of the gather format each, end to end. See [Note: gather formats] in
    # formats/base.py.
    st.gather_store = torch.zeros(gather_total, dtype=torch.uint8, device=dev)
    # 1-D param_dtype: every frozen group's shard end to end, stored only in param_dtype (it is
    # its own all-gather input; no master, no grad, no optimizer state).
    frozen_total = sum(g.layout.shard_numel for u in self.all for g in u.groups
                       if not g.kind.reduced and not g.kind.format.stored)
    # With offload="all" on the host (pinned on CUDA): [Note: the frozen landing] in layout/sizing.py.
    frozen_host = place.host_frozen
    st.frozen_store = place.store_zeros(frozen_total, self.compute_dtype)
    # 1-D uint8: every NF4 group's shard (one byte record each: packed codes, then block scales)
    # end to end; the record is its own all-gather input. See [Note: NF4 frozen groups] in formats/nf4_codec.py.
    nf4_total = sum(u.shape.nf4_record for u in self.all)
    st.nf4_store = place.store_zeros(nf4_total, torch.uint8)
    st.flat = nn.Module()  # holds the flat master shards as registered parameters
    off = foff = qoff = coff = roff = 0
    for u in self.all:
        u.anchor = torch.empty(0, device=dev, requires_grad=True)
        attr = u.flat_attr
        for g in u.groups:
            n = g.layout.shard_numel
            if g.kind.reduced:
                g.shard = nn.Parameter(alias(st.master, off, (n,)))
                g.grad_shard = None if plan.step_grads else alias(st.grad, off, (n,))
                st.flat.register_parameter(attr, g.shard)
                if g.kind.format.compact:  # its compute copy is its format's record
                    rec = u.shape.gather_record
                    g.compute = st.gather_store[roff:roff + rec]
                    g.compute_host = _part(st.gather_host, roff, rec)
                    g.grad_landing = _part(st.grad_landing, off, n)
                    shards.set_copy_out(g.shard, place.optimizer_copy(g), _copy_written_cb(self, g),
                                        format=g.kind.format.name)
                    roff += rec
                elif st.compute is st.master:
                    g.compute = st.compute[off:off + n]
                elif id(g) in casts:  # its gathers cast the master: [Note: the world-1 cast gather]
                    g.compute, g.gathers_master = st.master[off:off + n], True
                else:
                    g.compute = st.compute[coff:coff + n]
                    coff += n
                    g.compute_host = _part(st.compute_host, off, n)
                    g.grad_landing = _part(st.grad_landing, off, n)
                    # The optimizer's copy-out goes where the optimizer runs: the host staging with
                    # offload (fp32 offload: the step writes the master itself, the cast pass uploads it).
                    if st.compute_host is not st.master:
                        shards.set_copy_out(g.shard, place.optimizer_copy(g), _copy_written_cb(self, g))
                name, off = f"flat.{attr}", off + n
            elif g.kind.format.stored:
                rec = u.shape.nf4_record
                g.shard = g.compute = alias(st.nf4_store, qoff, (rec,))
                name, qoff = f"nf4.{attr}", qoff + rec
            else:
                g.shard = g.compute = alias(st.frozen_store, foff, (n,))
                name, foff = f"frozen.{attr}", foff + n
            shards.register(shards.ShardInfo(
                name=name, unit=u.name, kind=g.kind.name, param_names=[p.fqn for p in g.params],
                param_shapes=[tuple(p.shape) for p in g.params], param_offsets=[p.offset for p in g.params],
                numel=g.layout.numel, padded_numel=g.layout.padded_numel, shard_start=g.layout.shard_start,
                shard_numel=n, param_ref=weakref.ref(g.shard),
                values_dtype=g.kind.compute_dtype if g.kind.format.stored else None,
                format=g.kind.format.name if g.kind.format.stored else None,
            ))

    rank = dist.get_rank(self.group) if in_place else None
    st.grad_buffers: list[GradBuffer] = [
        GradBuffer(s.name, s.capacity, s.shard_capacity, s.dtype, dev, self.schedule, s.accum_capacity,
                   in_place_rank=rank, quant_bytes=s.quant_bytes)
        for s in plan.grad
    ]
    grad_quant.connect(self, st.grad_buffers, quant)
    st.weight_buffers: list[WeightBuffer] = [
        WeightBuffer(s.name, s.capacity, s.dtype, dev, self.schedule, s.staging_bytes, s.landing_bytes,
                     in_use=s.in_use)
        for s in plan.weight
    ]
    st.alias_buffers = []
    for u, w, g in zip(self.all, plan.weight_of, plan.grad_of):
        if w < 0:  # See [Note: the world-1 alias] in layout/sizing.py
            stores = [st.compute if grp.kind.reduced else st.frozen_store for grp in u.groups]
            st.alias_buffers.append(ShardAlias(f"shard.{u.name}", stores))
            u.buffer = st.alias_buffers[-1]
        else:
            u.buffer = st.weight_buffers[w]
        u.grad_buffer = st.grad_buffers[g] if g >= 0 else None
    for u, big in zip(self.units, plan.outsized):
        u.outsized = big
    for u, width in zip(self.all, plan.grad_chunk):  # See [Note: chunked outsized gradients] in layout/sizing.py
        u.grad_chunk = width
        u.chunk_buffers = [st.grad_buffers[i] for i in plan.chunk_slots] if width else []
    # 1-D uint8, on the device: every unit's secondary shard end to end (empty when secondary_shard is
    # off). See [Note: the secondary shard] in secondary.py.
    size = self.secondary_size
    at = plan_secondary([u.shape for u in self.units], plan.weight_of[:len(self.units)],
                        [u.weight_free_bw for u in self.units], self.compute_dtype, size)
    st.secondary = torch.zeros(at[-1], dtype=torch.uint8, device=dev)
    for u, a in zip(self.units, at):
        if a < 0:
            continue
        pieces = []
        for g, n in zip(u.groups, secondary_pieces(u.shape, self.compute_dtype, size)):
            raw = st.secondary[a:a + n]
            pieces.append(raw if g.kind.format.compact else raw.view(self.compute_dtype))
            a += round16(n)
        u.secondary = SecondaryShard(pieces, self.secondary_group, dist.get_rank(self.secondary_group), size)
    for u in self.all:
        u.landing_at = landing_layout(u.shape, self.compute_dtype)[0]
        if isinstance(u.buffer, ShardAlias):  # at world 1 a group's shard is all of it (shard_start 0)
            u.aliases = [alias(u.group_of[id(p)].compute, p.offset, p.shape) for p in u.params]
        else:
            u.aliases = [alias(u.buffer.data, u.group_of[id(p)].buffer_offset + p.offset, p.shape) for p in u.params]
    for s in st.weight_buffers:  # after the aliases (set_ grows a storage to fit): [Note: world-1 buffers in use only]
        if s.in_use:
            s.give_back()
    return st

def _part(store: torch.Tensor | None, offset: int, numel: int) -> torch.Tensor | None:
    """``store[offset:offset + numel]``, or None where the placement allocates no such store."""
    return None if store is None else store[offset:offset + numel]


def _copy_written_cb(self, group: FlatGroup):
    me, g = weakref.ref(self), weakref.ref(group)  # the registry must not keep the engine alive

    def copy_written():  # the optimizer wrote the compute copy (offload: its host staging), on the compute side
        rt, grp = me(), g()
        if grp is not None:
            grp.mark_cast()
        if rt is not None:
            if grp is not None:  # offload: the upload (placement.py)
                rt.placement.copy_written(rt.schedule, grp)
            rt.copies_changed = True

    return copy_written
