"""The preallocated weight and grad buffers, their owners, and the ready/release ordering.

[Note: buffer ownership]
A weight slot holds one gathered flat unit at a time: its *owner*. ``busy`` counts the uses
(forward calls, backward passes) of the owner that are running on the compute side. A gather of
another unit into the slot may be issued only when ``busy == 0``; if it is asked for earlier (a
prefetch), it is *deferred* and issued at the release that brings ``busy`` to 0. This keeps the
host-side order of "release recorded" before "gather issued", which is what makes the CUDA event
wait on the comm stream refer to the right release.

CUDA: the comm stream waits on the slot's release event, gathers, and records ``ready``; the
compute stream waits on ``ready`` before use and records ``release`` after use.
CPU (gloo): ``ready`` is the collective's async work handle, waited on before use; the compute
side is synchronous, so a release needs no event.
"""
from __future__ import annotations

import torch


class WeightSlot:
    """One weight buffer (1-D, ``param_dtype``, ``capacity`` elements) and its owner."""

    def __init__(self, name: str, capacity: int, dtype: torch.dtype, device: torch.device):
        self.name = name
        # Gathered weights of the owner unit; allocated once, never resized. The units'
        # parameters during forward/backward alias this storage.
        self.data = torch.zeros(capacity, dtype=dtype, device=device)
        self.owner = None  # the Unit whose gathered data is (or is being) in the buffer
        self.owner_version = -1  # the owner's cast version at gather time
        self.busy = 0
        self.work = None  # CPU: the pending all-gather handle
        self.deferred = None  # a Unit whose gather waits for this slot's release
        if device.type == "cuda":
            # ready: recorded on the comm stream after a gather; the compute stream waits on it.
            self.ready = torch.cuda.Event()
            # release: recorded on the compute stream when the owner's use ends; gathers wait on it.
            self.release_event = torch.cuda.Event()
        else:
            self.ready = self.release_event = None

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def holds(self, unit) -> bool:
        return self.owner is unit and self.owner_version == unit.cast_version


class GradSlot:
    """One grad buffer (1-D, ``reduce_dtype``) plus the shard-sized reduce-scatter output."""

    def __init__(self, name: str, capacity: int, shard_capacity: int, dtype: torch.dtype, device: torch.device):
        self.name = name
        # Unit gradients, written by the unit's backward gate, read by the reduce-scatter.
        self.data = torch.zeros(capacity, dtype=dtype, device=device)
        # Reduce-scatter output, accumulated (scaled by 1/world) into the fp32 grad shard.
        self.staging = torch.zeros(shard_capacity, dtype=dtype, device=device)
        self.pending = None  # (unit, work, fresh) of a reduce not yet folded into the grad shard (CPU)
        if device.type == "cuda":
            # done: recorded on the comm stream once the reduce and its accumulate have finished
            # reading this buffer; the compute stream waits on it before writing new grads.
            self.done = torch.cuda.Event()
            # grads_ready: recorded on the compute stream after the grads are written; the comm
            # stream waits on it before the reduce-scatter.
            self.grads_ready = torch.cuda.Event()
        else:
            self.done = self.grads_ready = None

    @property
    def capacity(self) -> int:
        return self.data.numel()
