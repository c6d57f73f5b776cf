"""The one seam between yafsdp and torch.distributed's collective API.

torch 2.13 deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` in favour of
``all_gather_single`` / ``reduce_scatter_single``; torch 2.11 (the GPU machines) has only the
former. Everything in yafsdp calls the two functions below and nothing else. They know nothing
of units, buffers or hooks.

[Note: gloo point-to-point collectives]
On gloo (CPU) both collectives are made of point-to-point messages, which gloo's transport
threads move straight between the callers' tensors. torch 2.13's gloo collectives are much
slower for the sizes of a unit (two ranks, one thread each, 32 MB unit):

    all-gather:      all_gather_single 42-45 ms   direct sends/receives 12-16 ms
    reduce-scatter:  list form 29-40 ms            direct exchange + local sum 12-19 ms
                     (tensor form 48 ms: it copies the input and all-reduces it)

- All-gather: each rank sends its shard to every peer and receives each peer's shard straight
  into that peer's slice of the output; its own slice is a local copy. No extra memory.
- Reduce-scatter, world 2: each rank sends the slice the peer owns and receives the peer's
  contribution to its own slice into ``shard_out``; ``wait()`` then adds the local slice. No
  extra memory. For worlds above 2 receiving every peer's slice at once would need
  (world - 1) shards of room, so the list-form gloo reduce-scatter is used there.

Messages carry a tag from a per-group counter; every rank issues the engine's collectives in the
same order (as NCCL requires too), so the tags agree and concurrent collectives cannot be
confused. The returned handle has ``wait()`` and ``is_completed()`` like a torch ``Work``;
``wait()`` may be called from several threads (the trace recorder watches handles from one).
"""
from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TAG_BASE = 1 << 24  # above the tags a user's own point-to-point traffic is likely to use
_TAG_SPAN = 1 << 24
_tags: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> next tag offset


def _is_gloo(group) -> bool:
    return str(dist.get_backend(group)).lower() == "gloo"  # a lookup in torch's group registry


def _next_tag(group) -> int:
    # Weakly keyed by the group: a group made anew (after destroy_process_group) starts at 0 on
    # every rank, as the ranks create groups collectively.
    n = _tags.get(group, 0)
    _tags[group] = (n + 1) % _TAG_SPAN
    return _TAG_BASE + n


class P2PWork:
    """Handle of a collective made of point-to-point messages (see the module note)."""

    def __init__(self, works, finish=None):
        self._works = works
        self._finish = finish  # run once, after every message has landed
        self._lock = threading.Lock()
        self._done = False

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)

    def wait(self, timeout=None) -> bool:
        # One thread waits on the messages: gloo's receive-wait consumes its completion, so a
        # second concurrent waiter on the same message would block forever.
        with self._lock:
            if not self._done:
                for w in self._works:
                    w.wait() if timeout is None else w.wait(timeout)
                if self._finish is not None:
                    self._finish()
                self._done = True
        return True


def _peers(group):
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    order = [(rank + k) % world for k in range(1, world)]  # staggered: not everyone sends to rank 0 first
    return world, rank, [(p, dist.get_global_rank(group, p) if group is not dist.group.WORLD else p) for p in order]


def _gloo_all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool):
    world, rank, peers = _peers(group)
    if output.numel() != world * shard.numel():
        raise ValueError(
            f"yafsdp all_gather: output has {output.numel()} elements, expected world ({world}) x shard "
            f"({shard.numel()})"
        )
    chunks = output.chunk(world)
    tag = _next_tag(group)
    works = []
    for p, gp in peers:
        works.append(dist.irecv(chunks[p], gp, group=group, tag=tag))
    for p, gp in peers:
        works.append(dist.isend(shard, gp, group=group, tag=tag))
    chunks[rank].copy_(shard)
    work = P2PWork(works)
    if not async_op:
        work.wait()
        return None
    return work


def _gloo_reduce_scatter_pair(shard_out: torch.Tensor, full: torch.Tensor, group, async_op: bool):
    _, rank, [(p, gp)] = _peers(group)
    chunks = full.chunk(2)
    if shard_out.numel() != chunks[rank].numel():
        raise ValueError(
            f"yafsdp reduce_scatter: shard_out has {shard_out.numel()} elements, expected {chunks[rank].numel()}"
        )
    tag = _next_tag(group)
    works = [dist.irecv(shard_out, gp, group=group, tag=tag), dist.isend(chunks[p], gp, group=group, tag=tag)]
    own = chunks[rank]
    work = P2PWork(works, finish=lambda: shard_out.add_(own))
    if not async_op:
        work.wait()
        return None
    return work


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True):
    """output (world * shard.numel(),) <- concatenation of every rank's ``shard``."""
    group = group if group is not None else dist.group.WORLD
    if _is_gloo(group) and dist.get_world_size(group) > 1:
        return _gloo_all_gather(output, shard, group, async_op)
    return _all_gather(output, shard, group=group, async_op=async_op)


def reduce_scatter(shard_out: torch.Tensor, full: torch.Tensor, group, async_op: bool = True):
    """shard_out <- this rank's slice of the elementwise SUM over ranks of ``full``.

    ``full`` is scratch: on gloo it must not be written until the handle's ``wait()`` returned."""
    group = group if group is not None else dist.group.WORLD
    if _is_gloo(group):
        world = dist.get_world_size(group)
        if world == 2:
            return _gloo_reduce_scatter_pair(shard_out, full, group, async_op)
        # torch 2.13's gloo tensor form copies the whole input and all-reduces it; the list form
        # (views of ``full``, no copy here) is a real reduce-scatter.
        chunks = list(full.chunk(world))
        return dist.reduce_scatter(shard_out, chunks, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return _reduce_scatter(shard_out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(tensor: torch.Tensor, group, async_op: bool = True):
    """tensor <- the elementwise SUM over ranks of ``tensor`` (HSDP: grad shards across replicas).

    gloo's own all-reduce is used as is: across replicas it runs over the few ranks that hold the
    same shard (one per replica), once per step, not per unit-sized collective of the step."""
    group = group if group is not None else dist.group.WORLD
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
