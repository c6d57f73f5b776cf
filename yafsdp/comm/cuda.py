"""The CUDA schedule: one comm stream ordered against the compute stream by events, reached only
through a :class:`~yafsdp.comm.schedule.StreamAPI` (real CUDA streams here, or the stream checker's
simulated ones on the CPU). The protocol and its Notes are in ``comm/schedule.py``."""
from __future__ import annotations

import contextlib
from collections import Counter

import torch

from .collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from ..tools.trace import span
from .schedule import Schedule, StreamAPI, _GradSync, _WeightSync

__all__ = ["CudaStreams", "StreamSchedule", "use_stream_api"]


class CudaStreams(StreamAPI):
    """torch.cuda's streams and events on one device."""

    def __init__(self, device: torch.device):
        self.device = device

    def new_stream(self, priority: int = 0):
        return torch.cuda.Stream(self.device, priority=priority)

    def new_event(self, timing: bool = False):
        return torch.cuda.Event(enable_timing=timing)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)


_STREAM_API_OVERRIDE: list[StreamAPI] = []


@contextlib.contextmanager
def use_stream_api(api: StreamAPI):
    """Engines built inside this context run the stream schedule over ``api`` whatever their
    device (``yafsdp.streamcheck`` uses it to run the CUDA schedule on the CPU)."""
    _STREAM_API_OVERRIDE.append(api)
    try:
        yield api
    finally:
        _STREAM_API_OVERRIDE.remove(api)


class StreamSchedule(Schedule):
    """CUDA: one high-priority comm stream, events between it and the compute stream.
    See [Note: streams and events]."""

    def __init__(self, streams: StreamAPI, group, replicate_group=None):
        self.streams = streams
        self.group = group
        self.replicate_group = replicate_group  # HSDP: the ranks holding the same shard, else None
        self.counted = Counter()
        # The comm stream: every gather, reduce-scatter and fold of the step runs here; high
        # priority so a collective is not queued behind compute kernels.
        self.comm = streams.new_stream(priority=-1)
        # Recorded on the compute stream each time the compute copies change; gathers wait on it.
        self.copies_ready = streams.new_event()
        self.gathered = Counter()
        if replicate_group is not None:
            # HSDP, the deferred all-reduce: recorded on compute before it (the grad shards as the
            # compute side left them), and on comm after it (compute waits before reading them).
            self.grads_final = streams.new_event()
            self.replicated = streams.new_event()
        # offload only (created at the first upload / host fold): see [Note: streams and events].
        self.h2d = None  # the upload stream
        self.comm_mark = self.compute_mark = self.uploaded = None
        self.landed: dict[str, object] = {}  # unit -> event after its grads' device -> host copy
        self.host_pending: list = []  # (landed event, host fold) in issue order

    def weight_sync(self) -> _WeightSync:
        return _WeightSync(ready=self.streams.new_event(), released=self.streams.new_event())

    def grad_sync(self) -> _GradSync:
        return _GradSync(grads_ready=self.streams.new_event(), done=self.streams.new_event())

    def copies_written(self) -> None:
        if self.h2d is None:
            self.copies_ready.record(self.streams.current_stream())
            return
        self.compute_mark.record(self.streams.current_stream())
        self.h2d.wait_event(self.compute_mark)
        self.copies_ready.record(self.h2d)  # after the compute side's writes and every upload

    def upload(self, dst, src):
        if self.h2d is None:
            self.h2d = self.streams.new_stream()
            self.comm_mark, self.compute_mark, self.uploaded = (self.streams.new_event() for _ in range(3))
        self.comm_mark.record(self.comm)
        with span("upload", ""), self.streams.use(self.h2d):
            self.h2d.wait_event(self.comm_mark)  # gathers issued so far have read the old copy
            dst.copy_(src, non_blocking=True)
            self.uploaded.record(self.h2d)

    def wait_uploads(self):
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def quiesce(self):
        self.comm.synchronize()
        if self.h2d is not None:
            self.h2d.synchronize()

    def finish_host_folds(self):
        pending, self.host_pending = self.host_pending, []
        for landed, host_fold in pending:
            landed.synchronize()
            host_fold()

    def _timed(self, kind: str, unit: str):
        rec = self.recorder
        if rec is None:
            return contextlib.nullcontext()
        return _StreamTiming(rec, kind, unit, self.comm)

    def gather(self, sync, out, shard, unit, expand=None, stage=None, group=None):
        with span("gather", unit), self.streams.use(self.comm):
            self.comm.wait_event(sync.released)
            self.comm.wait_event(self.copies_ready)
            if stage is not None:  # the host shard onto the device, in this stream's order: [Note: the frozen landing]
                stage.copy_(shard, non_blocking=True)
                shard = stage
            with self._timed("gather", unit):
                # on the comm stream (torch >= 2.8); `group`: a secondary shard's subgroup
                # at world 1 a shard of another dtype is cast in: [Note: the world-1 cast gather]
                all_gather(out, shard, self.group if group is None else group, async_op=False,
                           cast=out.dtype != shard.dtype)
            if expand is not None:  # See [Note: expanding a compact gather]; a secondary shard is kept here too
                with span("expand", unit):
                    expand()
            self._count("gather" if group is None else "secondary_gather", unit, out)
            sync.ready.record(self.comm)

    def wait_gathered(self, sync):
        self.streams.current_stream().wait_event(sync.ready)

    def released(self, sync):
        sync.released.record(self.streams.current_stream())

    def taken(self, sync):  # the gather waits on `released`: recorded here, it orders it after the allocation too
        sync.released.record(self.streams.current_stream())

    def reduce(self, sync, out, full, unit, then, pieces=False, collective=None):
        with span("reduce", unit):
            sync.grads_ready.record(self.streams.current_stream())
            with self.streams.use(self.comm):
                self.comm.wait_event(sync.grads_ready)
                with self._timed("reduce", unit):
                    if collective is not None:  # quantized: [Note: quantized gradient reduction] in quant_reduce.py
                        collective(out, full, async_op=False)  # every stage on the comm stream
                        for kind, n in collective.counted(full):
                            self.counted[(kind, unit)] += n
                    else:
                        (all_to_all if pieces else reduce_scatter)(out, full, self.group, async_op=False)
                        self._count("reduce", unit, full)
                then()  # on the comm stream too: fold, host landing, all-reduce across replicas
                sync.done.record(self.comm)

    def wait_reduced(self, sync):
        self.streams.current_stream().wait_event(sync.done)

    def on_host(self, unit, fn):
        # inside a reduce's `then`, on the comm stream: the host runs fn once this point has passed
        landed = self.landed.get(unit)
        if landed is None:
            landed = self.landed[unit] = self.streams.new_event()
        landed.record(self.comm)
        self.host_pending.append((landed, fn))

    def all_reduce_behind(self, grad, unit):
        # inside a reduce's `then`: the current stream is the comm stream, behind the fold
        with span("all_reduce", unit), self._timed("all_reduce", unit):
            self._all_reduce_across(grad, unit, False, all_reduce)

    def host_waits_compute(self):
        self.streams.current_stream().synchronize()

    def replicate(self, grad, unit):
        with span("all_reduce", unit):
            self.grads_final.record(self.streams.current_stream())
            with self.streams.use(self.comm):
                self.comm.wait_event(self.grads_final)
                with self._timed("all_reduce", unit):
                    self._all_reduce_across(grad, unit, False, all_reduce)
                self.replicated.record(self.comm)
            self.streams.current_stream().wait_event(self.replicated)


class _StreamTiming:
    def __init__(self, rec, kind, unit, stream):
        self.rec, self.kind, self.unit, self.stream = rec, kind, unit, stream

    def __enter__(self):
        self.iv = self.rec.comm(self.kind, self.unit, None, self.stream)

    def __exit__(self, *exc):
        self.rec.comm_end(self.iv, self.stream)
        return False
