"""Subgroups of a process group: blocks of consecutive ranks (the ranks of one node, typically).

[Note: creating subgroups]
``torch.distributed.new_group`` is collective over the *whole world*: every process must call it
for every group that is created, in the same order, even for the groups it is not a member of
(NCCL and gloo number the groups by call order). A rank that knows only its own group (a shard
group of HSDP: each replica has its own) therefore cannot create the subgroups of its group alone.
:func:`consecutive_subgroups` first gathers every rank's group (its members' global ranks, in group
order), so that each process creates the subgroups of *every* distinct group, in one order all
agree on (the groups sorted by their members), and returns the one it belongs to. It is called once,
at wrap time; the groups live as long as the process group. :func:`strided_subgroups` is its
transpose: the ranks with the same index in every block (one per node), made the same way.

Within a subgroup the members keep the order they have in ``group``: the subgroup's rank ``j`` is
the group's rank ``i * size + j``. So an all-gather over the subgroup of pieces laid in group-rank
order lands them in the same order as over the group itself (the secondary shard of
engine/buffers.py relies on it; a group whose rank order is not its members' global order is
refused, since ``new_group`` orders a group's ranks by global rank).
"""
from __future__ import annotations

import torch.distributed as dist

from .groups import gather_object

__all__ = ["consecutive_subgroups", "strided_subgroups", "SubgroupError"]


class SubgroupError(ValueError):
    """A subgroup size that does not fit the group: the message names both sizes."""


def _checked(group, size: int, what: str):
    """``(group, its members' global ranks)`` after the checks both kinds of subgroups need."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if not isinstance(size, int) or size < 1 or world % size:
        raise SubgroupError(f"yafsdp: {what}={size!r} does not divide the shard group's {world} ranks; use a divisor "
                            f"of {world} (the ranks of one node, typically)")
    members = tuple(dist.get_process_group_ranks(group))
    if list(members) != sorted(members):
        raise SubgroupError(f"yafsdp: {what}={size} needs a group whose rank order is its global ranks' order; "
                            f"this group's ranks are {list(members)} (build it with init_device_mesh or "
                            "new_group(sorted ranks))")
    return group, members


def consecutive_subgroups(group, size: int, *, what: str = "size"):
    """Collective over the world (every process calls it with its own ``group`` and the same
    ``size``): ``group``'s ranks split into blocks of ``size`` consecutive group ranks, one process
    group each; returns the block this rank belongs to. ``size`` must divide the group's size.
    ``what`` names the caller's option in the refusal (``"secondary_shard"``). See [Note: creating
    subgroups]."""
    group, members = _checked(group, size, what)
    groups = sorted(set(gather_object(members)))  # every rank's group, in one order all processes agree on
    mine = None
    for g in groups:
        for i in range(0, len(g), size):
            block = list(g[i:i + size])
            pg = dist.new_group(block)  # every process, every block: [Note: creating subgroups]
            if dist.get_rank() in block:
                mine = pg
    assert mine is not None and dist.get_world_size(mine) == size, (members, size)
    return mine


def strided_subgroups(group, size: int, *, what: str = "size"):
    """Collective over the world, as :func:`consecutive_subgroups`: the ranks of ``group`` whose
    index within their block of ``size`` consecutive ranks equals this rank's (group ranks ``j``,
    ``j + size``, ``j + 2 * size``, ...: one rank per node); returns this rank's. None when
    ``size`` equals the group's size (a group of one)."""
    group, members = _checked(group, size, what)
    if size == len(members):
        return None
    mine = None
    for g in sorted(set(gather_object(members))):  # every rank's group, in one agreed order
        for j in range(size):
            block = list(g[j::size])
            pg = dist.new_group(block)  # every process, every block: [Note: creating subgroups]
            if dist.get_rank() in block:
                mine = pg
    assert mine is not None and dist.get_world_size(mine) == len(members) // size, (members, size)
    return mine
