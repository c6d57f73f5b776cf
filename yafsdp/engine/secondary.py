"""The secondary shard (``secondary_shard=N``): the backward gathers within groups of N ranks.

[Note: the secondary shard]
At ZeRO-3 a unit is gathered over the whole shard group twice per step: for its forward and again
for its backward (and for an activation-checkpoint recompute). Across nodes the second gather pays
the slow links again. With ``secondary_shard=N`` (DeepSpeed ZeRO++'s hpZ; FSDP2's integer
``reshard_after_forward``) each rank keeps, once the forward's gather has landed, its 1/N of the
gathered unit -- the bytes the all-gather delivered, so values in ``param_dtype`` for a plain group
and the compact records for an fp8 / int8 / NF4 group -- in preallocated storage of its own (the
*secondary shard*). A later gather of the unit at the same version (its backward, a recompute, a
second forward before the optimizer step) all-gathers those pieces within this rank's *subgroup*:
N consecutive ranks of the shard group (comm/subgroups.py), a node when N is the ranks per node.
The subgroup's rank j holds the slice j of the unit, so the pieces land in the same order and the
same bytes as the whole group's gather would write: the weights are bit for bit those of
``secondary_shard=0`` (an fp32 all-gather moves bytes, it computes nothing), and a compact gather
stays compact (its records expand into the buffer as after any gather).

- Which units keep one (``layout.sizing.plan_secondary``, the plan and the allocator alike): those
  whose backward reads their weights and whose weight buffer is shared with another such unit, since
  only then can the buffer hold other weights by their backward. Not: a weight-free embedding, a
  unit alone in its buffer (the small group; a lone outsized unit), nor any unit at ZeRO-2 (refused:
  it keeps every unit gathered until backward). A unit that keeps none is gathered over the whole
  group whenever it is gathered, as before.
- When: the piece is copied right behind the gather that filled the buffer from the shards, before
  the buffer counts as gathered (CUDA: on the comm stream, like a compact group's expand, so the
  secondary store is touched by the comm stream only, in its order, and needs no event; gloo: at the
  gather's wait, and every later gather into the same buffer first waits for it). The piece is
  current while the unit's version (its groups' cast versions) is the one it was kept at; a load of
  the shards forgets every piece (``Runtime.invalidate_buffers``), since a load need not bump a version.
- Cost: the store, 1/N of each such unit in gathered bytes on every rank (``secondary`` in
  ``allocated_bytes()`` and in the plan), allocated once; nothing per step. Offload: the pieces are
  device tensors, so a secondary gather needs no landing. HSDP: the subgroups are inside each replica's
  shard group; the replicas' all-reduce is unchanged.
"""
from __future__ import annotations

import torch

__all__ = ["SecondaryShard"]


class SecondaryShard:
    """One unit's secondary shard: this rank's piece of each of its gathered groups and the subgroup
    they are gathered over. See [Note: the secondary shard]."""

    __slots__ = ("pieces", "group", "index", "size", "version")

    def __init__(self, pieces: list[torch.Tensor], group, index: int, size: int):
        # per group of the unit, in group order: 1-D, its param_dtype values or its records' bytes
        # (uint8), 1/size of what its gather writes; views into the one secondary store (alloc.py)
        self.pieces = pieces
        self.group = group  # the subgroup: `size` consecutive ranks of the shard group
        self.index = index  # this rank's rank in it (= its shard-group rank mod size)
        self.size = size
        self.version: tuple | None = None  # the unit's version the pieces were kept at; None: nothing kept

    def holds(self, unit) -> bool:
        return self.version is not None and self.version == unit.version

    def keeper(self, piece: torch.Tensor, gathered: torch.Tensor, then=None):
        """What runs behind a whole-group gather into ``gathered``: keep this rank's slice of it in
        ``piece``, then ``then()`` (a compact group's expand, which reads the records kept here)."""
        n = piece.numel()
        part = gathered[self.index * n:(self.index + 1) * n]

        def keep():
            piece.copy_(part)
            if then is not None:
                then()

        return keep

    def forget(self) -> None:
        self.version = None
