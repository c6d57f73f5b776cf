"""The preallocated weight and grad buffers, their owners, and the ready/release ordering.

[Note: buffer ownership]
A weight slot holds one gathered flat unit at a time: its *owner*. ``busy`` counts the uses
(forward calls, backward passes) of the owner that are running on the compute side. A gather of
another unit into the slot may be issued only when ``busy == 0``; if it is asked for earlier (a
prefetch), it is *deferred* and issued at the release that brings ``busy`` to 0. This keeps the
host-side order of "release recorded" before "gather issued", which is what makes the CUDA event
wait on the comm stream refer to the right release.

How a gather, a use and a release are ordered on the device is the schedule's business
(``yafsdp.comm``): each slot carries the schedule's ordering state in ``sync`` (CUDA: the
``ready``/``released`` events; gloo: the pending work handle). See [Note: streams and events].
"""
from __future__ import annotations

import torch


class WeightSlot:
    """One weight buffer (1-D, ``param_dtype``, ``capacity`` elements) and its owner."""

    def __init__(self, name: str, capacity: int, dtype: torch.dtype, device: torch.device, sync):
        self.name = name
        # Gathered weights of the owner unit; allocated once, never resized. The units'
        # parameters during forward/backward alias this storage.
        self.data = torch.zeros(capacity, dtype=dtype, device=device)
        self.owner = None  # the Unit whose gathered data is (or is being) in the buffer
        self.owner_version = -1  # the owner's cast version at gather time
        self.busy = 0
        self.deferred = None  # a Unit whose gather waits for this slot's release
        self.sync = sync  # the schedule's ordering state for this buffer (yafsdp.comm)

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def holds(self, unit) -> bool:
        return self.owner is unit and self.owner_version == unit.cast_version


class GradSlot:
    """One grad buffer (1-D, ``reduce_dtype``) plus the shard-sized reduce-scatter output."""

    def __init__(self, name: str, capacity: int, shard_capacity: int, dtype: torch.dtype, device: torch.device,
                 sync):
        self.name = name
        # Unit gradients, written by the unit's backward gate, read by the reduce-scatter.
        self.data = torch.zeros(capacity, dtype=dtype, device=device)
        # Reduce-scatter output, accumulated (scaled by 1/world) into the fp32 grad shard.
        self.staging = torch.zeros(shard_capacity, dtype=dtype, device=device)
        self.sync = sync  # the schedule's ordering state for this buffer (yafsdp.comm)

    @property
    def capacity(self) -> int:
        return self.data.numel()
