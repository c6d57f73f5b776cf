"""The gloo schedule (CPU): collectives return asynchronous work handles and the compute side is
the host, so an ordering point is a ``wait()`` on a handle. The protocol and its Notes are in
``comm/schedule.py``."""
from __future__ import annotations

from collections import Counter

from .collectives import _info, all_gather, all_reduce, all_to_all, reduce_scatter
from ..tools.trace import span
from .schedule import Schedule, _GradSync, _WeightSync, _wait

__all__ = ["HandleSchedule"]


class HandleSchedule(Schedule):
    """gloo (CPU): asynchronous work handles; the host is the compute side."""

    def __init__(self, group, replicate_group=None):
        self.group = group
        self.gathered = Counter()
        self.replicate_group = replicate_group  # HSDP: the ranks holding the same shard, else None
        self.replicating: list = []  # (work, unit) of all-reduces across replicas not yet waited for
        self.counted = Counter()

    def weight_sync(self) -> _WeightSync:
        return _WeightSync()

    def grad_sync(self) -> _GradSync:
        return _GradSync()

    def gather(self, sync, out, shard, unit, expand=None, stage=None, group=None):
        self.wait_gathered(sync)  # a previous gather into this buffer must land (and expand) first
        if stage is not None:  # its input was this buffer's landing too: [Note: the frozen landing]
            stage.copy_(shard)
            shard = stage
        rec = self.recorder
        with span("gather", unit):
            t = rec.now() if rec else None  # before the issuing call, which may itself move data
            sync.work = all_gather(out, shard, self.group if group is None else group, async_op=True, local=True,
                                   cast=out.dtype != shard.dtype)  # See [Note: the world-1 cast gather]
            sync.unit = unit
            sync.expand = expand
            self._count("gather" if group is None else "secondary_gather", unit, out)
            if rec:
                rec.comm("gather", unit, sync.work, issued=t)

    def wait_gathered(self, sync):
        if sync.work is not None:
            work, sync.work = sync.work, None
            _wait(work, "gather", sync.unit)
            expand, sync.expand = sync.expand, None
            if expand is not None:  # See [Note: expanding a compact gather]
                with span("expand", sync.unit):
                    expand()

    def reduce(self, sync, out, full, unit, then, pieces=False, collective=None):
        rec = self.recorder
        with span("reduce", unit):
            t = rec.now() if rec else None
            if collective is not None:  # quantized: [Note: quantized gradient reduction] in quant_reduce.py
                work = collective(out, full, async_op=True)
                for kind, n in collective.counted(full):
                    self.counted[(kind, unit)] += n
            elif pieces:
                work = all_to_all(out, full, self.group, async_op=True)
            else:
                work = reduce_scatter(out, full, self.group, async_op=True, local=True)
            sync.pending = (work, then, unit)
            if collective is None:
                self._count("reduce", unit, full)
            if rec:
                rec.comm("reduce", unit, work, issued=t)

    def reduce_rows_ok(self) -> bool:
        """A gloo group of two ranks (not the fake group): :meth:`reduce_rows_into` may run."""
        info = _info(self.group)
        return info.gloo and info.world == 2

    def reduce_rows_into(self, target, full, unit):
        """``target`` <- this rank's slice of ``full`` (a unit's whole gradient) summed over the ranks,
        done when this returns: the reduce-scatter of :meth:`reduce` with the grad shard as its output,
        waited at once. See [Note: the direct exchange of an outsized gradient] in engine/grad_path.py."""
        self._now("reduce", "reduce-scatter", reduce_scatter, target, full, full, unit)

    def gather_rows_into(self, out, shard, unit):
        """``out`` <- every rank's ``shard`` end to end, done when this returns: the all-gather of
        :meth:`gather` into a tensor of the caller's, waited at once (the small exchanges of
        [Note: the sharded lookup of an embedding] in engine/lookup.py)."""
        self._now("gather", "gather", all_gather, out, shard, out, unit)

    def _now(self, kind, what, collective, out, inp, counted, unit):
        """``collective(out, inp)`` on the group, recorded and counted as ``kind``, waited at once."""
        rec = self.recorder
        with span(kind, unit):
            t = rec.now() if rec else None
            work = collective(out, inp, self.group, async_op=True)
            self._count(kind, unit, counted)
            if rec:
                rec.comm(kind, unit, work, issued=t)
            _wait(work, what, unit)

    def wait_reduced(self, sync):
        if sync.pending is not None:
            work, then, unit = sync.pending
            sync.pending = None
            _wait(work, "reduce-scatter", unit)
            then()  # the comm side's part of the gradient's path, here on the host

    def reduce_pending(self, sync) -> bool:
        return sync.pending is not None

    def on_host(self, unit, fn):
        fn()  # the comm side's work runs on the host at the reduce's wait: it has completed

    def all_reduce_behind(self, grad, unit):
        self.replicate(grad, unit)  # the fold ran on the host at the reduce's wait: issue it now

    def replicate(self, grad, unit):
        rec = self.recorder
        with span("all_reduce", unit):
            t = rec.now() if rec else None
            work = self._all_reduce_across(grad, unit, True, all_reduce)
            self.replicating.append((work, unit))
            if rec:
                rec.comm("all_reduce", unit, work, issued=t)

    def wait_replicated(self):
        pending, self.replicating = self.replicating, []
        for work, unit in pending:
            _wait(work, "all-reduce across replicas", unit)
