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
- World 1, asked with ``local=True`` (the host schedule of comm.py): the all-gather and the
  reduce-scatter are a local copy (gloo's own run on a worker thread, ~0.5 ms a call for nothing);
  the handle is already complete. The stream schedule keeps gloo's call at world 1: the stream
  checker proves its ordering from the c10d ops it sees on the comm stream.
- All-to-all (the reduce with fp32 accumulation: [Note: narrow reduce, fp32 accumulation] in
  reduce_accum.py): each rank sends every peer that peer's slice of its input and receives each
  peer's slice of its own into that peer's row of the output (which has that room by design);
  its own row is a local copy. Any world size.

Messages carry a tag from a per-group counter; every rank issues the engine's collectives in the
same order (as NCCL requires too), so the tags agree and concurrent collectives cannot be
confused. The returned handle has ``wait()`` and ``is_completed()`` like a torch ``Work``;
``wait()`` may be called from several threads (the trace recorder watches handles from one).

[Note: gloo work and interpreter exit]
A gloo collective other than a point-to-point message (all-reduce, broadcast, scatter, the list
reduce-scatter) runs on one of the process group's worker threads, and that thread destroys the
work -- and its references to the caller's tensors -- a moment *after* ``wait()`` has returned.
If the caller has dropped its Python tensor by then, the worker holds the last reference, and
freeing the tensor's Python object needs the GIL. When the interpreter is already finalizing,
taking the GIL ends the thread (``pthread_exit``), and the forced unwind through the work's
destructor calls ``std::terminate``: "terminate called without an active exception", SIGABRT,
after all the work was done. Seen about once in 15 runs of a plain training script that exits
right after its last step; the core shows the worker thread in
``AsyncAllreduceWork::~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil ->
PyThread_exit_thread`` while the main thread is in ``Py_FinalizeEx``.

So every tensor the engine hands to such a collective goes through this module and is *retained*
(:func:`retain`) until gloo let go of it (its use count is back to the one reference of its own
Python object); and an ``atexit`` hook -- which runs before finalization starts, while threads may
still take the GIL -- waits for the retained tensors to be released (bounded) before the
interpreter goes on to finalize. A tensor a collective still holds after that wait (a collective
never waited for, a peer that died) is leaked on purpose: its Python object is never freed, so the
worker's late release needs no GIL. Point-to-point messages (the gloo all-gather and the world-2
reduce-scatter above) need none of this: their works are destroyed by whoever drops the handle.
The object collectives of comm/groups.py are built on these functions for the same reason. (The jobs
also destroy the process group before exit: see [Note: teardown before exit] in
examples/pretrain/ops.py.) Measured on the 2-core CI-like machine with a plain script (a tiny Llama,
two steps with clipping, world 2, no teardown): 3 aborted runs in 31 before, 0 in 40 after.
"""
from __future__ import annotations

import atexit
import ctypes
import threading
import time
import weakref

import torch
import torch.distributed as dist

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_TAG_BASE = 1 << 24  # above the tags a user's own point-to-point traffic is likely to use
_TAG_SPAN = 1 << 24
_tags: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> next tag offset


_RETAINED: list[torch.Tensor] = []  # tensors a gloo worker thread may still hold; see the Note
_RETAINED_LOCK = threading.Lock()
_RETAIN_LIMIT = 256  # older ones are long released: workers finish their works in order
EXIT_WAIT_S = 10.0  # how long the exit hook waits for gloo to release the retained tensors


def _held_elsewhere(t: torch.Tensor) -> bool:
    return t._use_count() > 1  # its Python object's own reference, and someone else's


def retain(*tensors: torch.Tensor) -> None:
    """Keep ``tensors`` (handed to a gloo collective that runs on a worker thread) alive until gloo
    released them. See [Note: gloo work and interpreter exit]."""
    with _RETAINED_LOCK:
        keep = [t for t in _RETAINED if _held_elsewhere(t)]
        keep.extend(tensors)
        _RETAINED[:] = keep[-_RETAIN_LIMIT:]


def _release_at_exit(timeout_s: float | None = None) -> int:
    """The exit hook: wait (bounded) until gloo released every retained tensor; leak the rest.
    Returns how many were leaked."""
    deadline = time.monotonic() + (EXIT_WAIT_S if timeout_s is None else timeout_s)
    while True:
        with _RETAINED_LOCK:
            _RETAINED[:] = [t for t in _RETAINED if _held_elsewhere(t)]
            if not _RETAINED or time.monotonic() >= deadline:
                leaked = list(_RETAINED)
                _RETAINED.clear()
                break
        time.sleep(0.002)
    for t in leaked:  # never freed: the worker's late release then needs no GIL
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))
    return len(leaked)


atexit.register(_release_at_exit)


def _worker_run(group) -> bool:
    """Collectives on ``group`` run on gloo's worker threads (see the Note)."""
    return _is_gloo(group if group is not None else dist.group.WORLD)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """tensor <- the elementwise ``op`` over ranks of ``tensor`` (the grad-norm and usage agreements;
    HSDP: grad shards across replicas). gloo's own all-reduce is used as is: across replicas it runs
    over the few ranks that hold the same shard, once per step. The tensor is retained on gloo (see
    [Note: gloo work and interpreter exit])."""
    group = group if group is not None else dist.group.WORLD
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if _worker_run(group):
        retain(tensor)
    return work


def broadcast(tensor: torch.Tensor, src: int, group) -> None:
    """In-place broadcast from global rank ``src``, waited for (retained on gloo)."""
    dist.broadcast(tensor, src, group=group)
    if _worker_run(group):
        retain(tensor)


def scatter(out: torch.Tensor, chunks: list | None, src: int, group) -> None:
    """``out`` <- global rank ``src``'s ``chunks[rank]``, waited for (retained on gloo)."""
    dist.scatter(out, chunks, src=src, group=group)
    if _worker_run(group):
        retain(out, *(chunks or ()))


def _is_gloo_backend(backend) -> bool:
    """A backend name (``dist.get_backend``) that takes the gloo paths of this module."""
    return str(backend).lower() == "gloo"


class _GroupInfo:
    """What the collectives ask of a group on every call, looked up once per group (torch's
    registry lookups cost more than the small collectives of a tiny unit): a group's backend, size
    and ranks never change."""

    def __init__(self, group):
        self.gloo = _is_gloo_backend(dist.get_backend(group))
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        order = [(self.rank + k) % self.world for k in range(1, self.world)]  # staggered: not all to rank 0 first
        self.peers = [(p, dist.get_global_rank(group, p) if group is not dist.group.WORLD else p) for p in order]


_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> _GroupInfo


def _info(group) -> _GroupInfo:
    info = _groups.get(group)
    if info is None:
        info = _groups[group] = _GroupInfo(group)
    return info


def _is_gloo(group) -> bool:
    return _info(group).gloo


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
    info = _info(group)
    return info.world, info.rank, info.peers


def _local(async_op: bool):
    """The handle of a collective over one rank, done by a local copy (see the module note)."""
    return P2PWork([]) if async_op else None


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


def all_gather(output: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True, local: bool = False,
               cast: bool = False):
    """output (world * shard.numel(),) <- concatenation of every rank's ``shard``. ``local``: at
    world 1 on gloo, a local copy (see the module note). ``cast``: at world 1 on any backend, a
    casting copy of ``shard`` into ``output`` of another dtype, in the caller's stream ([Note: the
    world-1 cast gather] in layout/sizing.py); refused at a larger world."""
    group = group if group is not None else dist.group.WORLD
    info = _info(group)
    if info.world == 1 and output.data_ptr() == shard.data_ptr() and output.numel() == shard.numel() \
            and output.dtype == shard.dtype:  # a record onto itself: [Note: world-1 records in place] in layout/sizing.py
        return _local(async_op)
    if cast:
        if info.world != 1 or output.numel() != shard.numel():
            raise ValueError(f"yafsdp all_gather(cast=True): output has {output.numel()} elements and the shard "
                             f"{shard.numel()} over {info.world} ranks; a casting gather is a copy at world 1 only")
        output.copy_(shard)
        return _local(async_op)
    if info.gloo:
        if info.world > 1:
            return _gloo_all_gather(output, shard, group, async_op)
        if not local:
            return _all_gather(output, shard, group=group, async_op=async_op)
        if output.numel() != shard.numel() or output.dtype != shard.dtype:
            raise ValueError(f"yafsdp all_gather: output has {output.numel()} elements of {output.dtype}, expected "
                             f"the shard's {shard.numel()} of {shard.dtype} (world 1)")
        output.copy_(shard)
        return _local(async_op)
    return _all_gather(output, shard, group=group, async_op=async_op)


def _gloo_all_to_all(output: torch.Tensor, full: torch.Tensor, group, async_op: bool):
    world, rank, peers = _peers(group)
    if output.numel() != full.numel() or full.numel() % world:
        raise ValueError(
            f"yafsdp all_to_all: output has {output.numel()} elements and input {full.numel()}; expected the same, "
            f"a multiple of world ({world})"
        )
    rows, pieces = output.chunk(world), full.chunk(world)
    tag = _next_tag(group)
    works = []
    for p, gp in peers:
        works.append(dist.irecv(rows[p], gp, group=group, tag=tag))
    for p, gp in peers:
        works.append(dist.isend(pieces[p], gp, group=group, tag=tag))
    rows[rank].copy_(pieces[rank])
    work = P2PWork(works)
    if not async_op:
        work.wait()
        return None
    return work


def all_to_all(output: torch.Tensor, full: torch.Tensor, group, async_op: bool = True):
    """output (world, n) rows <- row ``r``: rank ``r``'s ``full.chunk(world)[this rank]``: every rank's
    piece of this rank's shard, in rank order (``output`` and ``full`` have the same numel).

    ``full`` is scratch: on gloo it must not be written until the handle's ``wait()`` returned."""
    group = group if group is not None else dist.group.WORLD
    if _is_gloo(group):  # world 1 included: no peers, the local copy
        return _gloo_all_to_all(output, full, group, async_op)
    return dist.all_to_all_single(output, full, group=group, async_op=async_op)


# [Note: reduce-scatter in place]
# NCCL reduces in place when the output is the caller's own slice of the input (``recvbuff ==
# sendbuff + rank * recvcount``, NCCL's documented in-place form): a grad buffer then needs no
# shard-sized staging for the reduce's output (GradBuffer.reduce; the plan sizes the buffers by the
# same rule). On gloo the output must not alias the input: the world-2 exchange receives the peer's
# contribution into ``shard_out`` before it adds the local slice, and gloo's own list form gives no
# such promise. World 1 on gloo is a local copy (a copy onto itself is nothing) and so is in place.
# The fake process group (memory emulation) stands for NCCL.
def reduces_in_place(backend: str, world: int) -> bool:
    """Whether a reduce-scatter on ``backend`` may write this rank's slice of its own input."""
    return not _is_gloo_backend(backend) or world == 1


def reduce_scatter(shard_out: torch.Tensor, full: torch.Tensor, group, async_op: bool = True, local: bool = False):
    """shard_out <- this rank's slice of the elementwise SUM over ranks of ``full``. ``local``: at
    world 1 on gloo, a local copy (see the module note).

    ``full`` is scratch: on gloo it must not be written until the handle's ``wait()`` returned."""
    group = group if group is not None else dist.group.WORLD
    info = _info(group)
    if info.gloo:
        world = info.world
        if world == 1 and local:  # the sum over one rank is its input
            if shard_out.numel() != full.numel() or shard_out.dtype != full.dtype:
                raise ValueError(f"yafsdp reduce_scatter: shard_out has {shard_out.numel()} elements of "
                                 f"{shard_out.dtype}, expected {full.numel()} of {full.dtype} (world 1)")
            shard_out.copy_(full)
            return _local(async_op)
        if world == 2:
            return _gloo_reduce_scatter_pair(shard_out, full, group, async_op)
        # torch 2.13's gloo tensor form copies the whole input and all-reduces it; the list form
        # (views of ``full``, no copy here) is a real reduce-scatter.
        chunks = list(full.chunk(world))
        work = dist.reduce_scatter(shard_out, chunks, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
        retain(shard_out, *chunks)  # See [Note: gloo work and interpreter exit]
        return work
    return _reduce_scatter(shard_out, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
