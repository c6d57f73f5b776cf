"""HSDP's all-reduce of the grad shards across replicas, the engine's side of it: when it runs
(overlapped behind the last backward's folds, or deferred to the first reader of the gradients) and
the state of each unit's grad shard that makes a wrong prediction cost a collective, never a wrong
gradient. A flat engine holds :class:`NoReplicas`, which does nothing, so the gradient's path
(grad_path.py) never asks which it has. The groups themselves are resolved and checked in
yafsdp/comm/hsdp.py.

[Note: the cross-replica all-reduce]
Each replica reduce-scatters its gradients inside its shard group as a flat engine does, folding
``sum / (shard_size * replicas)`` into the fp32 grad shard, so that a SUM all-reduce of the grad
shards across the replicas yields DDP's average over every rank of the world. That all-reduce must
run once per optimizer step: after the step's last backward and before anything reads the
gradients. The engine is never told how many backward calls a step has, so it works in two modes:

- deferred (always correct): the all-reduce of every grad shard with local contributions runs at
  the first reader of the gradients, ``ReplicaSync.sync``: the optimizer step pre-hook
  (optim/hooks.py), ``clip_grad_norm_`` and ``YaFSDP.sync_grads()``. Adjacent units'
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

With ``grad_quant`` the all-reduce is the quantized one (``Schedule.use_across``: a reduce-scatter of
8-bit records summed in fp32, then an all-gather of the summed pieces as records; [Note: quantized
gradient reduction] in comm/quant_reduce.py). Every replica, the owner of a piece included, takes the
dequantized values, so a ``SYNCED`` shard holds the same bits on every replica as with the plain one.

When ``.grad`` is complete (the average over all replicas): after ``opt.step()``'s pre-hook,
``clip_grad_norm_`` or ``model.sync_grads()``; between the backward calls of a step it holds this
replica's part of the average (its local sum / (shard_size * replicas)).
"""
from __future__ import annotations

import enum
from collections import Counter

import torch
import torch.distributed as dist

__all__ = ["ReplicaSync", "NoReplicas", "make_replicas", "SYNCED", "LOCAL", "sync_before_step"]


class GradState(enum.Enum):
    LOCAL = "local"  # holds this replica's contributions not yet all-reduced
    SYNCED = "synced"  # holds the same value on every replica (an all-reduce issued; on gloo maybe in flight)


LOCAL, SYNCED = GradState.LOCAL, GradState.SYNCED


class ReplicaSync:
    """The cross-replica all-reduce of one engine's grad shards. See [Note: the cross-replica all-reduce].

    The gradient's path (grad_path.py) calls :meth:`begin_backward`, :meth:`repair` and
    :meth:`folded` around each fold (on the comm side), :meth:`finish_backward`; readers of the gradients call :meth:`sync`."""

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

    def repair(self, unit, target: torch.Tensor, fresh: bool) -> None:
        """Before a unit's first fold of a use: a shard already all-reduced (``SYNCED``: the same
        value on every replica) is scaled by ``1 / replicas``, so the next all-reduce gives its value
        plus the new contributions (a misprediction, or gradients kept across steps). Runs where the
        fold runs (CUDA: the comm stream; gloo: at the reduce's wait)."""
        if not fresh and self.state.get(unit.index) is SYNCED:
            self.schedule.wait_replicated()  # gloo: its all-reduce must have landed
            target.mul_(1.0 / self.replicas)  # See [Note: the cross-replica all-reduce]: X/R + new
            self.stats["rescaled"] += 1

    def folded(self, unit, target: torch.Tensor, last: bool = True) -> bool:
        """After a fold into ``target`` (``last``: the use's last part of a chunked reduce): True
        when the unit's all-reduce should run now, right behind the fold (an overlapped backward, at
        the unit's last expected fold; the caller issues it)."""
        self.state[unit.index] = LOCAL
        if not last:
            return False
        self.folds[unit.index] += 1
        if self.overlap and self.folds[unit.index] >= self.uses.get(unit.index, 1):
            self.state[unit.index] = SYNCED
            self._count(target.numel(), "overlapped")
            return True
        return False

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

    def repair(self, unit, target, fresh) -> None:
        pass

    def folded(self, unit, target, last: bool = True) -> bool:
        return False

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



def sync_before_step(optimizer, runtimes) -> None:
    """The optimizer step pre-hook's HSDP part (installed by yafsdp/optim/hooks.py): the gradients
    of every HSDP engine among ``runtimes`` whose shards ``optimizer`` steps are completed
    (all-reduced across replicas) before the step reads them. See [Note: the cross-replica all-reduce]."""
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for rt in runtimes:
        if rt.replicas > 1 and any(
                u.flat_param is not None and id(u.flat_param) in stepped for u in rt.all):
            rt.sync_replicas()
