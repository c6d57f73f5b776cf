"""Host memory of an asynchronous save's staging copy, as the plan predicts it.

[Note: the staging copy in the plan]
``yafsdp.checkpoint.AsyncSaver`` copies this rank's part of the checkpoint into host buffers
before it returns (see [Note: asynchronous saves] in yafsdp/checkpoint/background.py) and keeps
them for the next save. What it copies is what a checkpoint holds, each flat group cut at its
unpadded length (``contents._flat_shard``): the fp32 master slice of every trainable group, the
optimizer state shaped like it, the frozen groups' slices in their stored dtype, the NF4 groups'
codes and block scales -- and, on rank 0 only, the module's persistent buffers. Those are the
bytes counted here; the per-parameter step counters (0-d tensors) and the tensors inside the
caller's ``state=`` / ``rank_state=`` (RNG states: a few KiB) come on top and are not planned.
The copy is host memory on top of the engine's allocations: ``MemoryPlan.engine_total`` leaves
it out (the plan == allocations checks stay about the engine), ``host_total`` and ``total``
count it.
"""
from __future__ import annotations

from ..layout.sizing import itemsize


def _valid(lay) -> int:
    """Elements of this rank's shard below the group's unpadded length."""
    return max(0, min(lay.shard_numel, lay.numel - lay.shard_start))


def persistent_buffer_bytes(module) -> int:
    """Bytes of ``module``'s persistent buffers, a buffer shared by several modules once."""
    seen, total = set(), 0
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is None or name in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            total += b.numel() * b.element_size()
    return total


def staging_bytes(shapes, *, rank: int, compute_dtype, optimizer_bytes: int, buffer_bytes: int) -> int:
    """Host bytes of one rank's staging copy (``shapes``: the ``UnitShape`` of every flat unit,
    the small group's included). See [Note: the staging copy in the plan]."""
    from ..formats import nf4_codec as nf4

    cbytes = itemsize(compute_dtype)
    total = buffer_bytes if rank == 0 else 0
    for shape in shapes:
        if shape.trainable is not None:
            total += _valid(shape.trainable) * (4 + optimizer_bytes)
        if shape.frozen is not None:
            total += _valid(shape.frozen) * cbytes
        if shape.nf4 is not None:
            valid = _valid(shape.nf4)
            total += valid // 2 + (valid // nf4.BLOCK) * cbytes
    return total
