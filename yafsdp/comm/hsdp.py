"""HSDP: shard inside a group of ranks (a node), replicate across such groups -- the groups.

Used only when the engine is given a 2-D mesh or a (shard, replicate) pair:

- :func:`resolve_groups` turns the ``mesh=`` / ``process_group=`` arguments of ``YaFSDP`` into the
  shard group (every gather and reduce-scatter runs there, exactly as a flat engine's single group)
  and the replicate group (this rank and the ranks holding the same shard in the other replicas),
  and refuses what is not supported, naming the value; :func:`check_layout` checks them;
- :func:`across_replicas` and :func:`broadcast_from_replica0`: replica 0's verdict and shards for
  every replica.

The all-reduce of the grad shards across replicas is the engine's, next to the gradient's path:
yafsdp/engine/replicas.py ([Note: the cross-replica all-reduce]).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import gather_object, raise_if_any

__all__ = ["resolve_groups", "check_layout", "HSDPError", "across_replicas", "broadcast_from_replica0"]


class HSDPError(ValueError):
    """An unsupported mesh or group pair: the message names the value and what to pass instead."""


def resolve_groups(mesh, process_group):
    """``(shard_group, replicate_group or None)`` from ``YaFSDP``'s ``mesh=`` / ``process_group=``.

    ``mesh``: a 1-D DeviceMesh (full sharding over it) or a 2-D one with ``mesh_dim_names``
    ``("replicate", "shard")``. ``process_group``: a group, or a pair ``(shard_group,
    replicate_group)`` as FSDP's HYBRID_SHARD takes it."""
    if mesh is not None and process_group is not None:
        raise HSDPError("yafsdp.YaFSDP: pass either mesh= or process_group=, not both")
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            return mesh.get_group(), None
        if mesh.ndim != 2:
            raise HSDPError(
                f"yafsdp.YaFSDP: a {mesh.ndim}-D mesh (shape {tuple(mesh.shape)}, dims {names}) is not supported; "
                "pass a 1-D mesh (full sharding) or a 2-D mesh with mesh_dim_names=('replicate', 'shard') "
                "(HSDP); tensor or pipeline parallel dimensions are not handled by yafsdp"
            )
        if set(names) != {"replicate", "shard"}:
            raise HSDPError(
                f"yafsdp.YaFSDP: a 2-D mesh must name its dims 'replicate' and 'shard' (got mesh_dim_names={names}, "
                f"shape {tuple(mesh.shape)}); build it with init_device_mesh(device, (replicas, shard_size), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        return mesh.get_group("shard"), mesh.get_group("replicate")
    if isinstance(process_group, (tuple, list)):
        if len(process_group) != 2:
            raise HSDPError(
                f"yafsdp.YaFSDP: process_group as a sequence must be (shard_group, replicate_group), got "
                f"{len(process_group)} groups"
            )
        return process_group[0], process_group[1]
    return process_group, None


def check_layout(shard_group, replicate_group, tp: int = 1) -> None:
    """Collective over the world: the groups form a replicas x shard_size grid covering the world,
    each replicate group joins the ranks that hold the same shard, and global rank 0 is shard 0 of
    replica 0 (it writes what rank 0 writes: state dicts, exports, checkpoint manifests). ``tp``: the
    tensor-parallel degree of a model with DTensor parameters (the world is replicas x shard x tp ranks)."""
    me = (dist.get_rank(shard_group), dist.get_world_size(shard_group),
          dist.get_rank(replicate_group), dist.get_world_size(replicate_group))
    everyone = gather_object(me)  # the default group: every rank
    world = dist.get_world_size()
    sizes = {(s, r) for _, s, _, r in everyone}
    if len(sizes) != 1:
        raise HSDPError(
            "yafsdp.YaFSDP: the replicas are uneven: (shard group size, replicate group size) per rank is "
            f"{[(s, r) for _, s, _, r in everyone]}; every replica must shard over the same number of ranks"
        )
    (shard, replicas), = sizes
    if shard * replicas * tp != world:
        with_tp = f" x {tp} TP ranks" if tp > 1 else ""
        raise HSDPError(
            f"yafsdp.YaFSDP: {replicas} replicas x {shard} shard ranks{with_tp} = {shard * replicas * tp} ranks, but "
            f"the world has {world}; HSDP needs the replicate and shard groups to cover the world (use "
            "init_device_mesh)"
        )
    peers = gather_object(me[0], replicate_group)
    problem = None
    if any(p != me[0] for p in peers):
        problem = (f"yafsdp.YaFSDP: the replicate group of global rank {dist.get_rank()} joins ranks holding shards "
                   f"{peers}; it must join the ranks holding the same shard index in every replica (mesh dims in the "
                   "order ('replicate', 'shard'), or process_group=(shard_group, replicate_group))")
    elif dist.get_rank() == 0 and (me[0], me[2]) != (0, 0):
        problem = f"yafsdp.YaFSDP: global rank 0 is shard {me[0]} of replica {me[2]}; it must be shard 0 of replica 0"
    raise_if_any(problem, None, HSDPError)  # every rank raises together (one rank's problem would hang the others)


# ---------------------------------------------------------------------------- replica 0 -> all
def across_replicas(replicate_group, replica: int, error: type[Exception], fn):
    """Collective over the replicate group: run ``fn()`` on replica 0 (inside its shard group) and
    raise its error, if any, on every replica together (the others wait for the verdict instead
    of hanging in the next collective). Returns ``fn()``'s value on replica 0, None elsewhere."""
    from .groups import broadcast_object

    out, problem = None, None
    if replica == 0:
        try:
            out = fn()
        except error as e:
            problem = str(e)
            broadcast_object(problem, replicate_group)
            raise
    verdict = broadcast_object(problem, replicate_group)
    if verdict:
        raise error(verdict)
    return out


@torch.no_grad()
def broadcast_from_replica0(rt, module, replicate_group) -> None:
    """Every replica takes replica 0's shards -- every stored shard, whatever its group's kind
    (``Runtime.stored_shards``: trainable master, frozen, NF4 record; see [Note: stored shards] in
    engine/unit.py) -- and module buffers, over the ranks that hold the same shard. Shards adjacent in
    one store go as one broadcast."""
    from .groups import source_rank

    src = source_rank(replicate_group)
    tensors = _store_runs([s.tensor for s in rt.stored_shards()])
    for t in tensors:  # offload: host stores staged through the device (placement.py)
        if t.numel():
            rt.placement.broadcast(t, src, replicate_group)
    for t in [b for _, m in module.named_modules() for b in m._buffers.values() if b is not None and not b.is_meta]:
        if t.numel():
            dist.broadcast(t, src, group=replicate_group)
    for s in rt.stored_shards():  # changed in place behind the engine: their compute copies are stale
        torch.autograd.graph.increment_version(s.group.shard)
    rt.invalidate_buffers()


def _store_runs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Maximal runs of 1-D views that lie end to end in one storage, each as one view (a tensor of
    its own stays itself); storages in order of first appearance (the same on every rank), then by offset."""
    first: dict[int, int] = {}  # storage -> where it first appears: the same order on every rank
    for t in tensors:
        first.setdefault(t.untyped_storage().data_ptr(), len(first))
    runs: list[list] = []  # [tensor, storage ptr, end offset]
    for t in sorted(tensors, key=lambda t: (first[t.untyped_storage().data_ptr()], t.storage_offset())):
        ptr, off = t.untyped_storage().data_ptr(), t.storage_offset()
        last = runs[-1] if runs else None
        if (last is not None and t.dim() == 1 and last[0].dim() == 1 and t.is_contiguous() and last[1] == ptr
                and last[2] == off and t.dtype == last[0].dtype):
            base = last[0]
            last[0] = base.as_strided((base.numel() + t.numel(),), (1,), base.storage_offset())
            last[2] = off + t.numel()
        else:
            runs.append([t, ptr, off + t.numel()])
    return [r[0] for r in runs]
