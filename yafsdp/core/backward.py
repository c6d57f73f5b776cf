"""The backward half of the step protocol, as methods of :class:`~yafsdp.core.runtime.Runtime` (a base
class of it): which backward uses hold a unit's weight buffer and when they end ([Note: releasing by
what autograd runs] in autograd.py), the pre-backward gather and its prefetch, the gate of each use
(its checks and parameter hooks; the gradients then take the path of grad_path.py), the end of each
autograd call and of the whole backward. The state they use is the runtime's (set by
``Runtime.__init__``)."""
from __future__ import annotations


import torch

from ..comm.progress import POSITION
from .orig_params import run_grad_hooks
from .shard_hooks import fire as fire_shard_hooks
from .unit import Phase, Unit, current_task


__all__ = ["BackwardSteps", "BackwardUse"]


class BackwardUse:
    """One grad-enabled forward use of a unit, as the backward calls that reach it see it. See
    [Note: releasing by what autograd runs] in autograd.py.

    ``ends`` are weak references to the use's end nodes (its gate, and the node on its inputs);
    ``task`` is the autograd graph task whose backward last began the use, ``pending`` how many of
    its end nodes that task still runs, ``held`` whether the use holds the unit's weight buffer.
    The use refers to no unit or runtime (see [Note: weak references from autograd nodes])."""

    __slots__ = ("ends", "pending", "task", "held")

    def __init__(self):
        self.ends: list = []
        self.pending = 0
        self.task: int | None = None
        self.held = False


class BackwardSteps:
    """Mixed into :class:`~yafsdp.core.runtime.Runtime`; see the module docstring."""

    # ------------------------------------------------------------------ backward
    def enter_backward(self) -> None:
        """A backward (or autograd.grad) call touched the engine: the first time for its graph
        task, :meth:`end_task` is queued to run when that call ends."""
        task = current_task()
        if task in self.tasks:
            return
        self.tasks[task] = []
        torch.autograd.Variable._execution_engine.queue_callback(lambda: self.end_task(task))
        self.phase = Phase.BACKWARD

    def _hold(self, unit: Unit, use: "BackwardUse") -> None:
        """``use`` holds the unit's weight buffer until it ends or its graph task does."""
        self.enter_backward()
        unit.buffer.acquire(unit)
        unit.bw_holds += 1
        use.held = True
        self.tasks[current_task()].append((unit, use))

    def _drop(self, unit: Unit, use: "BackwardUse") -> None:
        if use.held:
            use.held = False
            unit.bw_holds -= 1
            unit.buffer.release()

    def _check_unchanged(self, unit: Unit) -> None:
        """A shard changed between the unit's forward and its backward: the gradients would be
        those of other weights (plain PyTorch raises "modified by an inplace operation")."""
        if unit.forward_versions is not None and unit.shard_versions() != unit.forward_versions:
            raise RuntimeError(
                f"yafsdp: the master shard of unit {unit.name!r} changed between its forward and its backward "
                "(an optimizer step, a state-dict or checkpoint load, or an in-place update of model.parameters() "
                "in between); its gradients would be computed for other weights. Call backward() before "
                "opt.step(), and run a new forward after changing the parameters"
            )

    def pre_backward(self, unit: Unit, use: "BackwardUse", prev: Unit | None, ends: int) -> None:
        """Before a use's backward in this graph task (ZeRO-3): re-gather the unit, prefetch the unit
        before it. ``ends``: how many of the use's end nodes this task will run."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"yafsdp: a backward with create_graph=True reached unit {unit.name!r} at zero_stage=3: the graph it "
                "creates reads the unit's weights later, after ZeRO-3 has released them, so second-order gradients "
                "(gradient penalties, double backward) would be computed from other weights. Use zero_stage=2, "
                "or compute the penalty without create_graph"
            )
        self._check_unchanged(unit)
        POSITION.at("backward", unit.name)
        task = current_task()
        if use.task == task:
            return
        use.task, use.pending = task, ends
        needs_weights = not unit.weight_free_bw  # See [Note: weight-free backward]
        if needs_weights:
            self._hold(unit, use)
        if prev is not None and not prev.weight_free_bw:
            prev.buffer.prefetch(prev)  # after the acquire, before the wait: the next gather goes out first
        if needs_weights:
            unit.buffer.wait()

    def use_done(self, unit: Unit, use: "BackwardUse") -> None:
        """One of a use's end nodes ran; after the last one this graph task runs, ZeRO-3 releases
        the weights. See [Note: releasing by what autograd runs] in autograd.py."""
        if use.task != current_task():  # its backward did not begin in this task: it holds nothing
            return
        use.pending -= 1
        if use.pending <= 0:
            # Release first, so a gather deferred on this buffer is issued ahead of this unit's
            # reduce and does not queue behind it.
            self._drop(unit, use)

    def post_backward(self, unit: Unit, pidx, grads, use: "BackwardUse") -> None:
        """The gate of a unit's use: its weight grads are in; grads into the grad buffer, reduce issued."""
        self._check_unchanged(unit)
        grads = run_grad_hooks(unit, pidx, grads)  # [Note: the module tree after wrapping] in orig_params.py
        if (self.zero_stage == 3 and unit is not self.small and not unit.weight_free_bw and unit.frozen is None
                and not unit.buffer.holds(unit)):
            raise RuntimeError(
                f"yafsdp: unit {unit.name!r} reached its backward without its weights gathered; its output "
                "escaped the engine's pre-backward hook (return tensors, tuples, lists or dicts from the unit)"
            )
        self.use_done(unit, use)
        self._note_used(unit, pidx, grads)
        self.grad_path.unit_grads(unit, pidx, grads)  # write, reduce, land, fold, all-reduce: grad_path.py

    def _note_used(self, unit: Unit, pidx, grads) -> None:
        """Which trainable parameters this backward reached; see [Note: parameters no rank used]
        in unused.py. The record restarts where DDP's ``.grad`` would go from None to a tensor."""
        lay = unit.layout
        if unit.flat_param.grad is None or len(unit.used) != len(lay.params):
            unit.used = [0] * len(lay.params)
        for i, g in zip(pidx, grads):
            if g is not None:
                unit.used[lay.index[id(unit.params[i])]] = 1

    def lookup_fold(self, unit: Unit, every, every_grad, lo: int, rows: int, padding_idx) -> None:
        """The backward of a sharded lookup: every rank's output gradients (``every_grad``, for the
        token ids ``every``) folded into this rank's rows of the grad shard. See [Note: the sharded
        lookup of an embedding] in lookup.py."""
        self._check_unchanged(unit)
        self._note_used(unit, [0], [every_grad])
        self.grad_path.lookup_grads(unit, every, every_grad, lo, rows, padding_idx)

    def end_task(self, task: int) -> None:
        """The end of a backward or autograd.grad call (its graph task): the holds it took are
        dropped; when no other call is running, the end of backward (:meth:`finalize_backward`)."""
        for unit, use in self.tasks.pop(task, ()):
            self._drop(unit, use)
        if not self.tasks:
            self.finalize_backward()

    def complete_reduces(self) -> None:
        """Every reduce issued is completed and folded; see ``GradPath.complete``."""
        self.grad_path.complete()

    def finalize_backward(self) -> None:
        """End of backward: every reduce folded, every hold dropped."""
        self.complete_reduces()
        for s in self.weight_buffers:
            s.drop_deferred()
        self.phase = Phase.IDLE
        fire_shard_hooks(self)  # See [Note: hooks on the shards] in shard_hooks.py

    def sync_replicas(self) -> bool:
        """HSDP: the grad shards all-reduced across replicas, if a backward left local
        contributions (a no-op otherwise, and for a flat engine); True when it all-reduced."""
        self.recover()
        return self.replica_sync.sync()

