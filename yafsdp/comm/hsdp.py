"""HSDP: shard inside a group of ranks (a node), replicate across such groups.

Two pieces, both used only when the engine is given a 2-D mesh or a (shard, replicate) pair:

- :func:`resolve_groups` turns the ``mesh=`` / ``process_group=`` arguments of ``YaFSDP`` into the
  shard group (every gather and reduce-scatter runs there, exactly as a flat engine's single group)
  and the replicate group (this rank and the ranks holding the same shard in the other replicas),
  and refuses what is not supported, naming the value;
- :class:`ReplicaSync` brings the grad shards of the replicas together: one all-reduce across
  replicas per optimizer step, whatever the accumulation (a flat engine holds :class:`NoReplicas`,
  which does nothing, so the runtime never asks which it has). With offload the grad shards are
  host tensors, all-reduced through the device by the runtime's placement (placement.py).

[Note: the cross-replica all-reduce]
Each replica reduce-scatters its gradients inside its shard group as a flat engine does, folding
``sum / (shard_size * replicas)`` into the fp32 grad shard, so that a SUM all-reduce of the grad
shards across the replicas yields DDP's average over every rank of the world. That all-reduce must
run once per optimizer step: after the step's last backward and before anything reads the
gradients. The engine is never told how many backward calls a step has, so it works in two modes:

- deferred (always correct): the all-reduce of every grad shard with local contributions runs at
  the first reader of the gradients, ``ReplicaSync.sync``: the optimizer step pre-hook
  (yafsdp/core/optim_hooks.py), ``clip_grad_norm_`` and ``YaFSDP.sync_grads()``. Adjacent units'
  grad shards are contiguous in the engine's one grad tensor, so this is normally one collective
  over all of them. Exposed: nothing is left to hide it behind.
- overlapped with the last backward (predicted): a step that sees as many backward calls as the
  previous synced step had is taken to be at its last one; there each unit's grad shard is
  all-reduced right behind its fold (on CUDA on the comm stream, after the reduce-scatter and
  fold, before the grad buffer's ``done`` event; on gloo an asynchronous handle issued at the
  fold and waited at the end of backward), hidden behind the remaining backward compute like
  the reduce-scatters. The first step, and any step after a change of accumulation, falls back
  to the deferred mode for whatever is left.

A prediction that turns out wrong (one more backward after the "last") costs one extra
all-reduce, never correctness: after an all-reduce a grad shard holds the same value ``X`` on
every replica (state ``SYNCED``); the next fold into it first scales it by ``1 / replicas``, so
the next all-reduce yields ``X + sum of the new contributions``, as DDP would. The same rule
covers gradients kept across optimizer steps (``zero_grad`` not called). A fold into a shard
whose ``.grad`` is None overwrites it and needs no scaling.

When ``.grad`` is complete (the average over all replicas): after ``opt.step()``'s pre-hook,
``clip_grad_norm_`` or ``model.sync_grads()``; between the backward calls of a step it holds this
replica's part of the average (its local sum / (shard_size * replicas)).
"""
from __future__ import annotations

import enum
from collections import Counter

import torch
import torch.distributed as dist

from .groups import gather_object, raise_if_any

__all__ = ["resolve_groups", "check_layout", "ReplicaSync", "NoReplicas", "make_replicas", "HSDPError", "SYNCED", "LOCAL", "across_replicas",
           "broadcast_from_replica0", "sync_before_step"]


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


def check_layout(shard_group, replicate_group) -> None:
    """Collective over the world: the groups form a replicas x shard_size grid covering the world,
    each replicate group joins the ranks that hold the same shard, and global rank 0 is shard 0 of
    replica 0 (it writes what rank 0 writes: state dicts, exports, checkpoint manifests)."""
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
    if shard * replicas != world:
        raise HSDPError(
            f"yafsdp.YaFSDP: {replicas} replicas x {shard} shard ranks = {shard * replicas} ranks, but the world has "
            f"{world}; HSDP needs the replicate and shard groups to cover the world (use init_device_mesh)"
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


class GradState(enum.Enum):
    LOCAL = "local"  # holds this replica's contributions not yet all-reduced
    SYNCED = "synced"  # holds the same value on every replica (an all-reduce issued; on gloo maybe in flight)


LOCAL, SYNCED = GradState.LOCAL, GradState.SYNCED


class ReplicaSync:
    """The cross-replica all-reduce of one engine's grad shards. See [Note: the cross-replica all-reduce].

    The runtime calls :meth:`begin_backward`, :meth:`fold` (from inside each fold, on the comm side),
    :meth:`finish_backward`; readers of the gradients call :meth:`sync`."""

    def __init__(self, rt, group, schedule):
        self.rt = rt
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.replica = dist.get_rank(group)
        self.schedule = schedule
        self.state: dict[int, GradState] = {}  # unit index -> state; absent: nothing folded since init
        self.backwards = 0  # backward calls since the last sync
        self.expected: int | None = None  # backward calls of the last synced step (the prediction)
        self.overlap = False  # this backward is predicted to be the step's last
        self.uses: Counter = Counter()  # unit index -> forward uses in the last forward (folds to expect)
        self.folds: Counter = Counter()  # unit index -> folds in this backward
        # Counters (tests, benchmarks): all-reduces issued and elements all-reduced, overlapped or
        # deferred; syncs that found work; mispredictions repaired by a 1/replicas scale.
        self.stats = dict(all_reduces=0, elements=0, overlapped=0, deferred=0, syncs=0, rescaled=0)

    # ---------------------------------------------------------------- backward
    def begin_backward(self) -> None:
        self.backwards += 1
        # after a misprediction: deferred again; with offload always (see [Note: the all-reduce of
        # host grad shards] in placement.py)
        self.overlap = self.backwards == self.expected and self.rt.placement.can_overlap_replicas
        # A unit used twice in forward (a tied embedding and head) folds twice in backward: it is
        # all-reduced after its last expected fold only (a fold beyond that is repaired).
        self.uses = Counter(u.index for u in self.rt.order)
        self.folds = Counter()

    def fold(self, unit, target: torch.Tensor, fresh: bool, fold_local, first: bool = True, last: bool = True) -> None:
        """Runs where the fold runs (CUDA: the comm stream; gloo: at the reduce's wait):
        ``fold_local()`` adds this replica's contribution to ``target``; around it, the repair of
        a synced shard and, in an overlapped backward, the unit's all-reduce. A reduce in chunks
        (see [Note: chunked outsized gradients] in plan/sizing.py) folds in parts, in order: the
        repair before the ``first``, the count and the all-reduce after the ``last``."""
        if first and not fresh and self.state.get(unit.index) is SYNCED:
            self.schedule.wait_replicated()  # gloo: its all-reduce must have landed
            target.mul_(1.0 / self.replicas)  # See [Note: the cross-replica all-reduce]: X/R + new
            self.stats["rescaled"] += 1
        fold_local()
        self.state[unit.index] = LOCAL
        if not last:
            return
        self.folds[unit.index] += 1
        if self.overlap and self.folds[unit.index] >= self.uses.get(unit.index, 1):
            self.schedule.replicate_in_fold(target, unit.name)
            self.state[unit.index] = SYNCED
            self._count(target.numel(), "overlapped")

    def finish_backward(self) -> None:
        """End of backward: the overlapped all-reduces have landed (gloo); on CUDA they precede
        each grad buffer's ``done`` event, which the end of backward already waits for."""
        self.schedule.wait_replicated()
        self.overlap = False

    # ---------------------------------------------------------------- readers
    @torch.no_grad()
    def sync(self) -> bool:
        """Every grad shard with local contributions all-reduced across the replicas (one
        collective per run of adjacent shards); True when anything was all-reduced."""
        self.schedule.wait_replicated()
        if self.backwards:
            self.expected, self.backwards = self.backwards, 0
        pending = []
        for u in self.rt.all:
            p = u.flat_param
            if p is None or p.grad is None or self.state.get(u.index) is not LOCAL:
                continue
            pending.append((u, p.grad))
            self.state[u.index] = SYNCED
        if not pending:
            return False
        for t, label in _runs(pending, self.rt.grad, per_unit=not self.rt.placement.can_overlap_replicas):
            self.rt.placement.replicate(self.rt, t, label)  # host shards: staged through the device
            self._count(t.numel(), "deferred")
        self.schedule.wait_replicated()
        self.stats["syncs"] += 1
        return True

    def _count(self, n: int, how: str) -> None:
        self.stats["all_reduces"] += 1
        self.stats["elements"] += n
        self.stats[how] += 1


class NoReplicas:
    """The replica sync of a flat engine (no HSDP): one replica, nothing to all-reduce; every fold
    is the local one. Has :class:`ReplicaSync`'s interface, so the runtime never asks which it has."""

    replicas = 1
    replica = 0
    group = None

    def __init__(self):
        # ReplicaSync's counters, all zero: nothing crosses replicas (benchmarks and tests read them alike)
        self.stats = dict(all_reduces=0, elements=0, overlapped=0, deferred=0, syncs=0, rescaled=0)

    def begin_backward(self) -> None:
        pass

    def fold(self, unit, target, fresh, fold_local, first: bool = True, last: bool = True) -> None:
        fold_local()

    def finish_backward(self) -> None:
        pass

    def sync(self) -> bool:
        return False


def make_replicas(rt, replicate_group, schedule):
    """``ReplicaSync`` over ``replicate_group`` (HSDP), or :class:`NoReplicas`."""
    return ReplicaSync(rt, replicate_group, schedule) if replicate_group is not None else NoReplicas()


def _runs(pending, grad_store: torch.Tensor, per_unit: bool = False):
    """Maximal runs of adjacent grad shards inside the engine's one grad tensor, as views of it
    (a ``.grad`` the user replaced is its own run); ``per_unit``: every shard its own run."""
    if per_unit:
        return [(g, u.name) for u, g in pending]
    base = grad_store.untyped_storage().data_ptr()
    spans, odd = [], []
    for u, g in pending:
        if g.untyped_storage().data_ptr() == base and g.is_contiguous():
            spans.append((g.storage_offset(), g.storage_offset() + g.numel(), u.name))
        else:
            odd.append((g, u.name))
    spans.sort()
    runs = []
    for lo, hi, name in spans:
        if runs and runs[-1][1] == lo:
            runs[-1][1] = hi
            runs[-1][2].append(name)
        else:
            runs.append([lo, hi, [name]])
    store0 = grad_store.storage_offset()
    out = [(grad_store[lo - store0:hi - store0], names[0] if len(names) == 1 else f"{len(names)} units")
           for lo, hi, names in runs]
    return out + odd


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
    core/unit.py) -- and module buffers, over the ranks that hold the same shard. Shards adjacent in
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


def sync_before_step(optimizer, runtimes) -> None:
    """The optimizer step pre-hook's HSDP part (installed by yafsdp/core/optim_hooks.py): the gradients
    of every HSDP engine among ``runtimes`` whose shards ``optimizer`` steps are completed
    (all-reduced across replicas) before the step reads them. See [Note: the cross-replica all-reduce]."""
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for rt in runtimes:
        if rt.replicas > 1 and any(
                u.flat_param is not None and id(u.flat_param) in stepped for u in rt.all):
            rt.sync_replicas()
