"""The preallocated weight and grad buffers and their protocol, as methods of the buffers.

[Note: buffer ownership]
A weight buffer holds one gathered unit at a time: its *owner*, gathered at the owner's
``version`` (its groups' cast versions; a buffer gathered at an older version is stale).
``busy`` counts the uses of the owner running on the compute side (a forward call, a backward
pass). A gather of another unit into the buffer may be issued only when ``busy == 0``; asked for
earlier (a prefetch), it is *deferred* and issued by the release that brings ``busy`` to 0. This
keeps the host-side order "release recorded" before "gather issued", which is what makes the
CUDA event wait on the comm stream refer to the right release.

A grad buffer receives one unit's gradients at a time; the next write waits until the reduce
of the previous unit (and its fold into the grad shard) has read it.

Only the methods below change a buffer's state. How a gather, a use and a release are ordered on
the device is the schedule's business (``yafsdp.comm``): each buffer carries the schedule's
ordering state in ``sync`` (CUDA: events; gloo: the pending work handle). See
[Note: streams and events] in comm/schedule.py.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

__all__ = ["WeightBuffer", "ShardAlias", "GradBuffer", "BufferInUse"]


class BufferInUse(RuntimeError):
    """Two units that share a weight buffer were needed at the same time."""


class WeightBuffer:
    """One weight buffer (1-D, ``param_dtype``, ``capacity`` elements) and its owner."""

    def __init__(self, name: str, capacity: int, dtype: torch.dtype, device: torch.device, schedule,
                 staging_bytes: int = 0, landing_bytes: int = 0, in_use: bool = False):
        self.name = name
        # Gathered weights of the owner unit: one tensor for the run, its storage allocated once
        # (``in_use``: it holds memory only from a gather to the release, [Note: world-1 buffers in
        # use only] in layout/sizing.py). The units' parameters during forward/backward alias it.
        self.data = (torch.empty if in_use else torch.zeros)(capacity, dtype=dtype, device=device)
        self.in_use = in_use  # the allocator gives the memory back once the units' aliases are made
        # Compact (NF4) gathers land here, then expand into data: see [Note: the compact staging
        # area] in layout/sizing.py. Empty when no unit of this buffer has a compact group.
        self.staging = torch.zeros(staging_bytes, dtype=torch.uint8, device=device)
        # offload="all": a unit's host frozen shard and NF4 record are copied here before their
        # gathers; see [Note: the frozen landing] in layout/sizing.py. Empty otherwise.
        self.landing = torch.zeros(landing_bytes, dtype=torch.uint8, device=device)
        self.schedule = schedule
        self.sync = schedule.weight_sync()  # the schedule's ordering state for this buffer
        self.owner = None  # the Unit whose gathered data is (or is being) in the buffer
        self.owner_version: tuple = ()  # the owner's version at gather time
        self.busy = 0  # uses of the owner running on the compute side
        self.deferred = None  # a Unit whose gather waits for this buffer's release

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def holds(self, unit) -> bool:
        return self.owner is unit and self.owner_version == unit.version

    def gather(self, unit) -> None:
        """Issue the gather of ``unit`` into this buffer (it must not be in use by another unit)."""
        if self.busy and self.owner is not unit:
            raise BufferInUse(
                f"yafsdp: unit {unit.name!r} needs buffer {self.name!r} while unit {self.owner.name!r} is still "
                "using it (two units that share a buffer are running nested); list them so that they do not "
                "alternate into the same buffer, or use zero_stage=2"
            )
        if self.deferred is not None and self.deferred is not unit:
            self.deferred = None
        if self.in_use and not self.allocated:  # the memory, taken on the compute side first
            self.data.untyped_storage().resize_(self.data.numel() * self.data.element_size())
            self.schedule.taken(self.sync)  # the gather's writes wait for this point (CUDA)
        self.owner, self.owner_version = unit, unit.version
        sec = unit.secondary  # See [Note: the secondary shard] in secondary.py
        within = sec is not None and sec.holds(unit)
        for i, g in enumerate(unit.groups):
            out = self.data[g.buffer_offset:g.buffer_offset + g.layout.padded_numel]
            if not g.kind.format.compact:
                target, then = out, None
            else:  # the records into the staging area, then the expand: [Note: expanding a compact gather]
                # (world 1: no staging area, the record expands where it lies: [Note: world-1 records in
                # place] in layout/sizing.py)
                target = (self.staging[g.staging_offset:g.staging_offset + g.staging_bytes]
                          if self.staging.numel() else g.compute)
                then = functools.partial(g.expand, out, target)
            if within:  # the pieces kept after the forward's gather, within the subgroup
                self.schedule.gather(self.sync, target, sec.pieces[i], unit.name, then, group=sec.group)
            else:
                stage = self._landing(unit, g)
                kw = {} if stage is None else {"stage": stage}
                keep = then if sec is None else sec.keeper(sec.pieces[i], target, then)
                self.schedule.gather(self.sync, target, g.compute, unit.name, keep, **kw)
            self.schedule.gathered[g.kind.name] += target.numel() * target.element_size()
        if sec is not None and not within:
            sec.version = unit.version

    def _landing(self, unit, g) -> torch.Tensor | None:
        """Where a host shard of ``g`` goes on the device before its gather (offload="all"), or None."""
        if g.kind.reduced or not self.landing.numel():
            return None
        n = g.compute.numel() * g.compute.element_size()
        at = unit.landing_at if g.kind.format.stored else 0
        return self.landing[at:at + n].view(g.compute.dtype)

    def prefetch(self, unit) -> None:
        """Gather ``unit`` ahead of its use: now if the buffer is free, else at its release."""
        if self.holds(unit):
            return
        if self.busy:
            self.deferred = unit
        else:
            self.gather(unit)

    def acquire(self, unit) -> None:
        """A use of ``unit`` begins: gather it unless held; the buffer is busy until released."""
        if not self.holds(unit):
            self.gather(unit)
        self.busy += 1

    def wait(self) -> None:
        """The compute side waits until the gathered data has landed."""
        self.schedule.wait_gathered(self.sync)

    def release(self) -> None:
        """A use ends; the last one lets the next gather in (a deferred prefetch is issued now)."""
        self.busy -= 1
        if self.busy > 0:
            return
        self.schedule.released(self.sync)
        nxt, self.deferred = self.deferred, None
        if nxt is not None and not self.holds(nxt):
            self.gather(nxt)
        elif self.in_use and nxt is None:  # nothing to hold until the next gather
            self.give_back()

    def give_back(self) -> None:
        """``in_use``: the memory goes back to the allocator; the buffer holds no unit."""
        self.data.untyped_storage().resize_(0)
        self.owner, self.owner_version = None, ()

    @property
    def allocated(self) -> bool:
        """The storage holds its memory (always, unless ``in_use`` between uses)."""
        return self.data.untyped_storage().nbytes() > 0

    def abandon(self) -> None:
        """After an exception inside forward or backward: no use is running any more (the
        compute side's kernels issued so far are the last readers), no prefetch pending."""
        if self.busy:
            self.busy = 0
            self.schedule.released(self.sync)
        self.deferred = None

    def drop_deferred(self) -> None:
        self.deferred = None

    def invalidate(self) -> None:
        """The data no longer matches any unit (its shards were loaded anew)."""
        self.owner, self.owner_version = None, ()


class ShardAlias:
    """The weight "buffer" of one unit at world 1 that has none: its parameters alias its own shards
    (see [Note: the world-1 alias] in layout/sizing.py). It keeps a weight buffer's protocol and
    ownership record -- a gather records the unit's version, so ``holds`` is False after a load
    until the next gather, as with a buffer -- but copies nothing and waits for nothing: the cast
    pass has written the compute copy on the compute side before any use. ``stores``: the 1-D
    tensors its shards live in (what autograd's boundary check treats as weight storage)."""

    def __init__(self, name: str, stores: list[torch.Tensor]):
        self.name = name
        self.stores = stores
        self.owner = None
        self.owner_version: tuple = ()
        self.busy = 0
        self.deferred = None

    capacity = 0

    def holds(self, unit) -> bool:
        return self.owner is unit and self.owner_version == unit.version

    def gather(self, unit) -> None:
        self.owner, self.owner_version = unit, unit.version

    def prefetch(self, unit) -> None:
        if not self.holds(unit):
            self.gather(unit)

    def acquire(self, unit) -> None:
        if not self.holds(unit):
            self.gather(unit)
        self.busy += 1

    def wait(self) -> None:
        pass

    def release(self) -> None:
        self.busy -= 1

    def abandon(self) -> None:
        self.busy = 0

    def drop_deferred(self) -> None:
        pass

    def invalidate(self) -> None:
        self.owner, self.owner_version = None, ()


class GradBuffer:
    """One grad buffer (1-D, ``reduce_dtype``) plus the shard-sized reduce-scatter output (none when
    the backend reduces in place; with fp32 accumulation: the all-to-all's landing and an fp32
    accumulator)."""

    def __init__(self, name: str, capacity: int, shard_capacity: int, dtype: torch.dtype, device: torch.device,
                 schedule, accum_capacity: int = 0, in_place_rank: int | None = None, quant_bytes: int = 0):
        self.name = name
        # Unit gradients, written by the unit's backward gate, read by the reduce-scatter.
        self.data = torch.zeros(capacity, dtype=dtype, device=device)
        # Reduce-scatter output, accumulated (scaled by 1/world) into the fp32 grad shard; empty
        # when the reduce runs in place (in_place_rank: this rank's index in the shard group; the
        # output is then its own slice of ``data``, see [Note: reduce-scatter in place] in
        # comm/collectives.py). With fp32 accumulation (accum_capacity > 0): the all-to-all's
        # landing, every rank's piece of this rank's shard (world x shard, rank order). See [Note:
        # narrow reduce, fp32 accumulation].
        self.staging = torch.zeros(shard_capacity, dtype=dtype, device=device)
        self.in_place_rank = in_place_rank  # (fp32 accumulation: unused, its pieces land in the staging)
        # 1-D fp32, one shard: the scaled fp32 sum of the pieces when it is added to a grad shard
        # (fp32 accumulation only; else empty).
        self.accum = torch.zeros(accum_capacity, dtype=torch.float32, device=device)
        self.pieces = accum_capacity > 0
        # grad_quant: the room of the quantized reduce (1-D uint8: its fp32 sum -- the reduced shard the
        # fold reads --, scratch, node-stage output and records), and the collective that uses it (a
        # comm.quant_reduce.QuantReduce bound to the room, set by engine/grad_quant.py; None: the plain reduce). See
        # [Note: quantized gradient reduction] in comm/quant_reduce.py.
        self.quant = torch.zeros(quant_bytes, dtype=torch.uint8, device=device)
        self.quant_reduce = None
        self.schedule = schedule
        self.sync = schedule.grad_sync()  # the schedule's ordering state for this buffer

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def begin_write(self, numel: int) -> torch.Tensor:
        """The first ``numel`` elements, once the previous reduce has read them."""
        self.schedule.wait_reduced(self.sync)
        return self.data[:numel]

    def reduce(self, unit: str, numel: int, shard_numel: int, arrive: Callable[[torch.Tensor], None]) -> None:
        """Reduce-scatter the first ``numel`` elements into this buffer's output for it; ``arrive(reduced
        shard)`` runs on the comm side behind it (see ``Schedule.reduce``). With fp32 accumulation
        ``arrive`` gets every rank's piece instead: (world, shard_numel), rank order."""
        if self.quant_reduce is not None:  # See [Note: quantized gradient reduction] in comm/quant_reduce.py
            full = self.data[:numel]
            total = self.quant_reduce.output(full)
            self.schedule.reduce(self.sync, total, full, unit, lambda: arrive(total), collective=self.quant_reduce)
            return
        if self.pieces:
            pieces = self.staging[:numel]
            self.schedule.reduce(self.sync, pieces, self.data[:numel], unit,
                                 lambda: arrive(pieces.view(-1, shard_numel)), pieces=True)
            return
        if self.in_place_rank is not None:
            r = self.in_place_rank
            out = self.data[r * shard_numel:(r + 1) * shard_numel]
        else:
            out = self.staging[:shard_numel]
        self.schedule.reduce(self.sync, out, self.data[:numel], unit, lambda: arrive(out))

    def finish(self) -> None:
        """The compute side waits until the last reduce from this buffer is folded."""
        self.schedule.wait_reduced(self.sync)

    @property
    def reduce_pending(self) -> bool:
        return self.schedule.reduce_pending(self.sync)
