"""HSDP replicas under torchft: a replica group that dies does not stop the job.

    # each replica group is its own torchrun (its world = its shard group); one lighthouse for the run
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --bind [::]:29510 &
    TORCHFT_LIGHTHOUSE=http://host:29510 torchrun --nproc-per-node 8 --max-restarts 3 train.py --replica-group 0
    TORCHFT_LIGHTHOUSE=http://host:29510 torchrun --nproc-per-node 8 --max-restarts 3 train.py --replica-group 1

    model = yafsdp.YaFSDP(module)                      # flat: sharded over this replica group only
    opt = torch.optim.AdamW(model.parameters(), lr=...)
    ft = FaultTolerantReplicas(model, opt, replica_group=0)
    while ft.step_count < steps:
        ft.start_step()                                # quorum; a restarted group takes the live state here
        batch = data(ft.step_count)                    # the data position follows the committed step
        model(batch).loss.backward()
        model.clip_grad_norm_(1.0)                     # runs the managed all-reduce first
        if ft.step() and ft.step_count % 100 == 0 and ft.writes_checkpoints:   # commit, then optimizer step
            yafsdp.checkpoint.save_checkpoint(root, ft.step_count, model, opt, state={"torchft": ft.state_dict()})
        opt.zero_grad()

[Note: torchft replicas]
HSDP's replicate dimension is what torchft manages: each replica group shards the model over its
own ranks exactly as a flat engine does (its shard group is the default group of its own
torchrun, a plain process group), and the gradient shards are averaged across replica groups by
one all-reduce per step through torchft's ``Manager`` (a reconfigurable gloo process group whose
members are the current quorum). Rank ``r`` of one replica group holds the same shard as rank
``r`` of every other, so the per-shard all-reduce and the per-shard recovery pair those ranks.

A step:

- ``start_step``: the quorum (synchronous: every live group agrees on the members and the step).
  A group that is behind (restarted, or new) receives the state of a group at the quorum's step
  over torchft's checkpoint transport (HTTP), shard rank from shard rank: the stored shards, the
  optimizer's state, the committed step and the caller's extra state (the data position), and
  takes part in the same step;
- backward: as a flat engine, each grad shard holds the replica group's mean gradient;
- the managed all-reduce (:meth:`sync_grads`, also run by ``model.clip_grad_norm_``,
  ``model.sync_grads()`` and :meth:`step`): the grad shards summed over the quorum's groups and
  divided by their number;
- :meth:`step`: ``should_commit`` (every group, every rank agrees; False when an all-reduce failed,
  or fewer than ``min_replicas`` groups took part); the optimizer steps only on True, and the
  step count advances. A step that is not committed is run again with the same step number, so
  with the same data.

Checkpoints: after a committed step every live group holds the same state, so one group's save
is the run's: the first group of the quorum (:attr:`writes_checkpoints`) saves with
``yafsdp.checkpoint.save_checkpoint`` as a flat engine does, adding :meth:`state_dict` (torchft's
committed step) to its ``state``. To resume, every group (or only some: the others recover from
them) loads it and calls :meth:`load_state_dict` before its first step.

What a step averages: DDP's mean over the ranks of the groups in that step's quorum. With R
groups of S ranks each, a full quorum averages R*S micro-batch gradients; after a group is lost
the survivors average over their own (R-1)*S, with the same learning rate: each step still
takes one mean gradient, of fewer samples (the lost group's batches of those steps are never
seen; the data position of every group is the committed step). A group that returns takes part
from the step it rejoins at, with its own batch of that step.

The seam in the engine: the engine under torchft is a flat engine (``replicate_group`` None, so
its fold scale is ``1 / shard_size``). :class:`FaultTolerantReplicas` hands its runtime one object,
through ``Runtime.adopt_replica_sync``:

- a :class:`_ManagedSync` becomes the runtime's replica sync (which ``GradPath.replicas`` also holds),
  with :class:`yafsdp.engine.replicas.NoReplicas`' interface: the gradient path calls its
  ``begin_backward`` (it counts the backward calls: a read of the gradients before the step's last
  backward raises), and every reader of the gradients calls its ``sync()`` through
  ``Runtime.sync_replicas`` (``clip_grad_norm_``, ``sync_grads()``): the managed all-reduce;
- and the engine counts as replicated (``Runtime.replicas`` 2), so the readers that ask it first
  (``torch.nn.utils.clip_grad_norm_`` over the shards, hooks on the shards, the optimizer's step
  pre-hook) call ``sync_replicas`` too. :meth:`step` runs the all-reduce before ``should_commit``
  in any case.

Nothing else in the engine changes, and without this class nothing changes at all.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..engine.replicas import NoReplicas, _runs

__all__ = ["FaultTolerantReplicas", "TorchFTError"]


class TorchFTError(RuntimeError):
    """A misuse of the fault-tolerant replicas (the message says what to do instead)."""


def _require_torchft():
    try:
        import torchft  # noqa: F401
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as e:
        raise TorchFTError(
            f"yafsdp.integrations.torchft: torchft is not importable ({e}); install it with "
            "`pip install --no-deps torchft==0.2.0` and its OpenTelemetry requirements (see .ci/run)") from e
    return Manager, ProcessGroupGloo


class _ManagedSync(NoReplicas):
    """A flat engine's replica sync (nothing repaired or all-reduced behind a fold, as NoReplicas) whose
    ``sync()`` runs the managed all-reduce of the grad shards across the quorum. See [Note: torchft replicas]."""

    def __init__(self, owner: "FaultTolerantReplicas"):
        super().__init__()  # replicas = 1: the engine's own view, the fold scale stays 1 / shard_size
        self.owner = owner
        self.backwards = 0  # backward calls that reduced, since the engine was attached

    def begin_backward(self) -> None:
        self.backwards += 1

    def sync(self) -> bool:
        return self.owner.sync_grads()


class FaultTolerantReplicas:
    """One replica group's side of HSDP under torchft. See [Note: torchft replicas].

    ``model``: a flat ``YaFSDP`` over this replica group's ranks (its default group);
    ``optimizer``: the one that steps its ``parameters()``; ``replica_group``: this group's index
    (a stable name across restarts: ``replica_id`` is ``"yafsdp_<index>"``); ``lighthouse``:
    its address (default ``$TORCHFT_LIGHTHOUSE``); ``min_replicas``: the fewest groups a step may
    commit with; ``timeout``: the deadline of a cross-group collective and of the state transfer
    (a hung group is dropped after it); ``commit_timeout``: the deadline of ``should_commit``
    (default ``3 * timeout``: one rank of a group may reach it a collective deadline or two after
    another, when the all-reduce of the gradients and a later sum across groups timed out on that
    rank only); ``extra_state`` / ``load_extra_state``:
    the caller's state a restarted group must take from a live one (the data position), picklable."""

    def __init__(self, model, optimizer, *, replica_group: int, lighthouse: str | None = None,
                 min_replicas: int = 1, timeout: float = 60.0, quorum_timeout: float | None = None,
                 commit_timeout: float | None = None, extra_state=None, load_extra_state=None):
        Manager, ProcessGroupGloo = _require_torchft()
        rt = model._rt
        if getattr(model, "replicate_group", None) is not None:
            raise TorchFTError(
                f"yafsdp.integrations.torchft: the model is already HSDP over a replicate group of "
                f"{model.replicas} ranks; under torchft each replica group is a flat YaFSDP over its own ranks "
                "(build it without mesh= / a (shard, replicate) pair) and torchft joins the groups")
        if type(rt.replica_sync) is not NoReplicas:
            raise TorchFTError("yafsdp.integrations.torchft: this model already has fault-tolerant replicas "
                               "(one FaultTolerantReplicas per model)")
        if (extra_state is None) != (load_extra_state is None):
            raise TorchFTError("yafsdp.integrations.torchft: pass extra_state and load_extra_state together "
                               "(what a restarted group takes from a live one, and how it applies it)")
        lighthouse = lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise TorchFTError("yafsdp.integrations.torchft: no lighthouse address: pass lighthouse= or set "
                               "TORCHFT_LIGHTHOUSE (start one with `torchft_lighthouse --min_replicas 1 ...`)")
        self.model, self.optimizer = model, optimizer
        self.replica_group = int(replica_group)
        self._extra_state, self._load_extra_state = extra_state, load_extra_state
        self._synced_at: int | None = None  # backward calls counted when this step's all-reduce ran
        self._in_step = False
        self._commit_timeout = timedelta(seconds=commit_timeout if commit_timeout is not None else 3 * timeout)
        rank, world = dist.get_rank(), dist.get_world_size()
        store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        _clear_stale_manager_keys(store_addr, store_port, rank)
        t = timedelta(seconds=timeout)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=t), load_state_dict=self._load_state, state_dict=self._state,
            min_replica_size=min_replicas, use_async_quorum=False, timeout=t,
            quorum_timeout=timedelta(seconds=quorum_timeout if quorum_timeout is not None else 2 * timeout),
            connect_timeout=t, rank=rank, world_size=world, store_addr=store_addr, store_port=store_port,
            lighthouse_addr=lighthouse, replica_id=f"yafsdp_{self.replica_group}")
        self._sync = _ManagedSync(self)
        # The seam (see [Note: torchft replicas]): the engine's replica sync, which the runtime's readers
        # of the gradients call (Runtime.sync_replicas) and its gradient path tells of each backward.
        # The engine's readers of the gradients that first ask whether it is replicated (torch's
        # clip_grad_norm_ over the shards, hooks on the shards, the optimizer's step pre-hook) then complete
        # them through the managed all-reduce too. Its fold scale was fixed at build (1 / shard_size).
        rt.adopt_replica_sync(self._sync)

    # ---------------------------------------------------------------- the step
    @property
    def step_count(self) -> int:
        """Committed steps of the run (the same on every live group; a restarted group takes it)."""
        return self.manager.current_step()

    @property
    def participants(self) -> int:
        """Replica groups in this step's quorum."""
        return self.manager.num_participants()

    def start_step(self) -> None:
        """Before the step's first forward: the quorum; a group behind the quorum's step takes the
        live state here (see [Note: torchft replicas])."""
        self.manager.start_quorum()
        self._synced_at = None
        self._in_step = True

    @torch.no_grad()
    def sync_grads(self) -> bool:
        """The managed all-reduce: every grad shard averaged over the quorum's groups (once per step;
        True when it ran now). Collective over the quorum."""
        if not self._in_step:
            raise TorchFTError("yafsdp.integrations.torchft: the gradients are read outside a step; call "
                               "ft.start_step() before the step's first forward")
        if self._synced_at is not None:
            if self._sync.backwards != self._synced_at:
                raise TorchFTError(
                    "yafsdp.integrations.torchft: a backward ran after this step's all-reduce across replica "
                    "groups (model.clip_grad_norm_ / sync_grads / ft.sync_grads was called before the step's last "
                    "backward): its gradient would stay local to this group. Read the gradients only after the "
                    "step's last backward")
            return False
        rt = self.model._rt
        rt.recover()
        pending = [(u, u.flat_param.grad) for u in rt.all if u.flat_param is not None and u.flat_param.grad is not None]
        works = []
        for t, _ in _runs(pending, rt.grad):
            works.append(self.manager.allreduce(t))
            self._sync.stats["all_reduces"] += 1
            self._sync.stats["elements"] += t.numel()
            self._sync.stats["deferred"] += 1
        for w in works:
            w.wait()
        self._sync.stats["syncs"] += 1
        self._synced_at = self._sync.backwards
        return True

    @torch.no_grad()
    def sum_across_groups(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (floating point, the same shape on every group) summed over the quorum's groups, in
        place (a step's loss, its verdicts). Collective over the quorum; when it fails the values are
        not to be trusted, and the step does not commit (:meth:`step` returns False)."""
        if not self._in_step:
            raise TorchFTError("yafsdp.integrations.torchft: sum_across_groups outside a step; call ft.start_step() "
                               "first")
        from torch.distributed import ReduceOp

        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return t

    def step(self, update: bool = True) -> bool:
        """The end of a step: the managed all-reduce if not yet run, ``should_commit``, and the
        optimizer's step only when the quorum commits. Returns whether it committed.

        ``update`` False: a step every group decided to skip (a non-finite or spiking loss, judged
        alike on every group) is still committed -- the step count advances, as a skipped step
        advances a run -- but the optimizer does not step."""
        self.sync_grads()
        try:
            if not self.manager.should_commit(timeout=self._commit_timeout):
                return False
            if update:
                self.optimizer.step()  # its pre-hook finds the gradients complete
            return True
        finally:
            self._in_step = False

    # ---------------------------------------------------------------- checkpoints
    @property
    def writes_checkpoints(self) -> bool:
        """Whether this group writes the run's checkpoints: the first group of the current quorum (after
        a committed step every group holds the same state, so one group's save is the run's). Call after
        :meth:`start_step`; the same on every rank of the group."""
        return self.manager.participating_rank() == 0

    def state_dict(self) -> dict:
        """What a checkpoint must hold besides the model and optimizer: torchft's committed step
        (save it as ``save_checkpoint(..., state={"torchft": ft.state_dict(), ...})``)."""
        return {"manager": self.manager.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """After ``load_checkpoint`` and before the first :meth:`start_step`: the run resumes at the
        checkpoint's step (a group that loads nothing takes it from one that did, by recovery)."""
        if self._in_step:
            raise TorchFTError("yafsdp.integrations.torchft: load_state_dict inside a step; load the checkpoint "
                               "before ft.start_step()")
        self.manager.load_state_dict(state["manager"])

    def shutdown(self) -> None:
        """Stop this group's manager server and checkpoint transport."""
        self.manager.shutdown(wait=False)

    # ---------------------------------------------------------------- recovery
    def _state(self) -> dict:
        """What a restarted group takes from this one (this rank's shard of it)."""
        rt = self.model._rt
        return {"shards": [s.tensor.detach().clone() for s in rt.stored_shards()],
                "optim": self.optimizer.state_dict(),
                "extra": self._extra_state() if self._extra_state is not None else None}

    @torch.no_grad()
    def _load_state(self, state: dict) -> None:
        rt = self.model._rt
        mine = list(rt.stored_shards())
        if len(mine) != len(state["shards"]) or any(
                s.tensor.shape != t.shape for s, t in zip(mine, state["shards"])):
            raise TorchFTError(
                f"yafsdp.integrations.torchft: replica group {self.replica_group} received shards "
                f"{[tuple(t.shape) for t in state['shards']]} but holds {[tuple(s.tensor.shape) for s in mine]}; "
                "every replica group must wrap the same model with the same number of ranks")
        for s, t in zip(mine, state["shards"]):
            s.tensor.copy_(t)
            torch.autograd.graph.increment_version(s.group.shard)
        rt.invalidate_buffers()
        self.optimizer.load_state_dict(state["optim"])
        if self._load_extra_state is not None:
            self._load_extra_state(state["extra"])


def _clear_stale_manager_keys(addr: str, port: int, rank: int) -> None:
    """torchft's Manager publishes its server's address in the replica group's store; under
    ``torchrun --max-restarts`` that store (the agent's) outlives the workers, so a restarted
    rank could read the dead attempt's address. Rank 0 removes it before any rank builds its Manager."""
    if rank == 0:
        store = dist.TCPStore(addr, port, is_master=False, wait_for_workers=False)
        for key in ("manager_addr", "replica_id"):
            store.delete_key(key)
    dist.barrier()
