"""The comm interface: how gathers and reduces are ordered against the compute side.

One interface, two concurrency models; the engine's schedule calls only the methods of
:class:`Schedule` and never asks which model it runs on.

- :class:`StreamSchedule` (CUDA): one dedicated comm stream, ordered against the compute stream
  by CUDA events. It reaches streams and events only through a :class:`StreamAPI`, so the same
  code runs over :class:`CudaStreams` on a GPU and over ``yafsdp.streamcheck``'s simulated
  streams on the CPU, where every kernel's stream and buffer accesses are logged and the
  happens-before order is checked (see [Note: the stream-protocol checker] there).
- :class:`HandleSchedule` (gloo, CPU): collectives return asynchronous work handles; the compute
  side is the host itself, so an ordering point is a ``wait()`` on a handle.

The recorder (``yafsdp.trace.Recorder``), when set on the schedule, times each collective.

[Note: streams and events]
Which stream every kernel of the CUDA schedule runs on, and why:

- compute stream (the caller's current stream): the cast pass (fp32 master -> compute copy),
  the optimizer and its copy-out, forward and backward, the grad writes into a grad buffer,
  clipping, ``zero_grad``, and the collectives of ``full_state_dict`` and friends (called
  between steps, synchronous on the caller's stream).
- comm stream (``StreamSchedule.comm``, high priority so a collective is not queued behind the
  compute kernels): every gather and every reduce-scatter of the step and the fold of a reduced
  shard into the fp32 grad shard (it reads the reduce's output, so it belongs right behind it;
  it is the only non-collective kernel there, and it runs after the reduce, never in front of one);
  with ``reduce_accum_dtype`` the reduce is an all-to-all into the grad buffer's landing and the
  fold the fp32 sum of its pieces, through the grad buffer's accumulator (both touched by the comm
  stream only, in its order, like the reduce-scatter's staging: no new event; see [Note: narrow
  reduce, fp32 accumulation] in reduce_accum.py);
  HSDP: the all-reduce of grad shards across replicas, both kinds (see [Note: the cross-replica
  all-reduce] in hsdp.py): overlapped, right behind a unit's fold in the same comm-stream block
  and before the grad buffer's ``done`` (with, on a mispredicted step only, the ``1/replicas``
  scale of the shard before the fold); deferred, between ``grads_final`` and ``replicated``.
  Collectives are issued with ``async_op=False`` inside ``torch.cuda.stream(comm)``: since
  torch 2.8 ProcessGroupNCCL launches a synchronous collective on the *current* stream, so the
  NCCL kernel runs on the comm stream itself. (``async_op=True`` would launch it on the process
  group's internal normal-priority stream after a wait on the current stream and need
  ``work.wait()`` to order it back: two event hops per collective, off the high-priority stream.
  On torch < 2.8 a synchronous call still orders its internal stream before and after against
  the current one, so the schedule stays correct there, only with those hops.)

A compact (NF4) group's expand kernel (records in the staging area -> values in the weight
buffer) runs on the comm stream too, right behind its all-gather and before ``ready``: see
[Note: expanding a compact gather].

With ``offload="optimizer"`` (see [Note: host and device tensors] in alloc.py) two more kinds of work:

- upload stream (``StreamSchedule.h2d``, created at the first upload): the host -> device copies of
  the compute copies (pinned ``compute_host`` -> device ``compute``, ``non_blocking``), issued by the
  optimizer's copy-out callback right after each shard's CPU step (so they overlap the step's
  remaining shards) or by the cast pass. Each upload first waits for ``comm_mark``, recorded on the
  comm stream when the upload is issued: no gather issued earlier still reads the device copy it
  overwrites. ``uploaded`` is recorded after it. At the next step entry ``copies_written`` makes
  the upload stream wait for the compute stream and records ``copies_ready`` on the upload stream,
  so one event orders every later gather after both the compute side's writes and every upload.
  Before the host writes ``compute_host`` again (the next optimizer step, via the pre-step hook, or
  the cast pass) it waits for ``uploaded`` (``wait_uploads``: a host synchronisation on copies
  issued a whole forward and backward earlier, normally long done).
- device -> host copies of the reduced grad shards, on the comm stream right behind their
  reduce-scatter (into pinned ``grad_landing``, ``non_blocking``), each followed by its unit's
  ``landed`` event; the host folds them into the fp32 grad shards at the end of backward
  (``finish_host_folds``: the host waits for each ``landed``). That is a host synchronisation at
  the end of every backward, inherent to an optimizer step that runs on the CPU (it must read the
  grads); the reduce of the next unit is not delayed by it.

Events, each recorded at the point that defines it (never only "when some work happened"):

- ``copies_ready`` (one): recorded on the compute stream whenever the compute copies changed
  (the cast pass, or the optimizer writing them: ``Schedule.copies_written``); every gather waits
  on it, so no gather reads a compute copy being written.
- per weight buffer ``ready`` (comm, after its gather; compute waits before use) and
  ``released`` (compute, when the owner's last use ends; the next gather into it waits).
- per grad buffer ``grads_ready`` (compute, after the grads are written; the reduce waits) and
  ``done`` (comm, after the reduce and its fold read the buffer; the next grad write waits).
- HSDP, the deferred all-reduce (between steps): ``grads_final`` (compute, before it: the grad
  shards as the compute side left them, e.g. after ``zero_grad``; comm waits) and ``replicated``
  (comm, after it; the compute stream waits before clipping or the optimizer read the shards).
  The overlapped ones need no event of their own: they sit before ``done``.
- end of backward: the compute stream waits on every grad buffer's ``done``; the fold into
  the fp32 grad shards is the last kernel before each, so the optimizer reads folded shards.
  (No blanket wait on the comm stream: a gather still in flight there, prefetched for a unit
  that is used later, is waited on through its own ``ready``.)

[Note: expanding a compact gather]
A compact group (``nf4``) is gathered as bytes into its weight buffer's staging area; one kernel
then writes its values into the group's place in the buffer. The expand is part of the gather: it
runs after the gather's data has landed and before anything may read the buffer, so consumers
are unchanged (they wait for ``ready`` / the handle and find ``param_dtype`` values).

- CUDA: on the comm stream, right after the all-gather, before ``ready`` is recorded. So the
  staging area is touched by the comm stream only (the gather writes it, the expand reads it, in
  stream order; the next gather into the same buffer, hence the same staging, comes later on that
  stream), and the buffer's values are written by the comm stream only, after ``released`` as
  before: no new event, and the compute stream does not pay for the expand (it overlaps compute
  like the gather itself). The price: a collective queued behind it on the comm stream starts
  later by the expand's time (bandwidth-bound, ~2.5 bytes of traffic per parameter in bf16: about
  0.2 ms for a 200 M-parameter layer on an H100, small against that layer's gather). Expanding on
  the compute stream instead would put the same time on the critical path of every forward and
  backward use, and need a record of "already expanded" per gather, since a gathered unit is
  waited for by several uses.
- gloo: the expand runs where the gather is waited for (``wait_gathered``, on the host, like the
  fold of a reduce at its wait): after the handle's ``wait()``, before the compute side proceeds.
  A gather into a buffer first waits for (and expands) the previous one into it.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable

import torch

from .collectives import all_gather, all_reduce, all_to_all, reduce_scatter
from .dist import CollectiveError, check_collective, debug_sync
from .trace import span

__all__ = ["StreamAPI", "CudaStreams", "Schedule", "StreamSchedule", "HandleSchedule", "CheckedSchedule",
           "make_schedule", "use_stream_api"]


class StreamAPI:
    """What :class:`StreamSchedule` needs from a device's streams and events."""

    def new_stream(self, priority: int = 0):
        raise NotImplementedError

    def new_event(self, timing: bool = False):
        raise NotImplementedError

    def current_stream(self):
        raise NotImplementedError

    def use(self, stream):
        """Context manager: ``stream`` is the current stream inside it."""
        raise NotImplementedError


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


class _WeightSync:
    """Ordering state of one weight buffer (see the concrete schedules)."""

    __slots__ = ("ready", "released", "work", "unit", "expand")

    def __init__(self, ready=None, released=None):
        self.ready = ready  # stream: event recorded on comm after the gather
        self.released = released  # stream: event recorded on compute when the owner's use ends
        self.work = None  # handles: the gather's pending work
        self.unit = ""  # handles: the unit of that gather (for error messages)
        self.expand = None  # handles: the compact gather's expand, run at the wait


class _GradSync:
    """Ordering state of one grad buffer (see the concrete schedules)."""

    __slots__ = ("grads_ready", "done", "pending")

    def __init__(self, grads_ready=None, done=None):
        self.grads_ready = grads_ready  # stream: recorded on compute after the grads are written
        self.done = done  # stream: recorded on comm after the reduce and its fold read the buffer
        self.pending = None  # handles: (work, fold, unit) of a reduce not yet folded


class Schedule:
    """The ordering interface the engine's schedule is written against.

    ``label`` arguments are ``(kind, unit name)`` pairs for profiler ranges and the recorder.
    """

    recorder = None  # a yafsdp.trace.Recorder, or None
    # Bytes each rank received from all-gathers of the step protocol, by flat-group kind
    # ("trainable", "frozen", "nf4"): the all-gather outputs' sizes (reset it to measure a window)
    gathered: Counter
    counted: Counter  # (kind, unit) -> bytes this rank put into collectives of that kind (see _count)

    def _count(self, kind: str, unit: str, t: torch.Tensor) -> None:
        """Bytes per collective kind and unit: a gather's gathered size, a reduce's full size, an
        all-reduce's size (benchmarks/model_scaling.py's byte model is checked against these)."""
        self.counted[(kind, unit)] += t.numel() * t.element_size()

    def weight_sync(self) -> _WeightSync:
        raise NotImplementedError

    def grad_sync(self) -> _GradSync:
        raise NotImplementedError

    def copies_written(self) -> None:
        """The compute copies (all-gather inputs) were just written on the compute side."""

    def gather(self, sync: _WeightSync, out: torch.Tensor, shard: torch.Tensor, unit: str,
               expand: Callable[[], None] | None = None, stage: torch.Tensor | None = None) -> None:
        """Issue the all-gather of ``shard`` into ``out`` (a weight buffer's storage or staging
        area); ``expand()``, when given, runs after it has landed and before the buffer counts as
        gathered (see [Note: expanding a compact gather]). ``stage`` (offload="all"): a device
        tensor the host ``shard`` is first copied into, the collective's input then (see
        [Note: the frozen landing] in plan/sizing.py)."""
        raise NotImplementedError

    def wait_gathered(self, sync: _WeightSync) -> None:
        """The compute side waits until the last gather into this buffer has landed."""
        raise NotImplementedError

    def released(self, sync: _WeightSync) -> None:
        """The compute side's use of this weight buffer ended (the next gather may overwrite it)."""

    def reduce(self, sync: _GradSync, out: torch.Tensor, full: torch.Tensor, unit: str,
               fold: Callable[[], None], host_fold: Callable[[], None] | None = None,
               pieces: bool = False) -> None:
        """Issue the reduce-scatter of ``full`` (a grad buffer) into ``out``, then ``fold()``;
        ``host_fold()``, when given, runs on the host once ``fold``'s work has completed (offload:
        after the grads landed on the host; by :meth:`finish_host_folds` at the latest).
        ``pieces``: an all-to-all instead, ``out`` (as large as ``full``) receives every rank's piece
        of this rank's shard and ``fold()`` sums them (see [Note: narrow reduce, fp32 accumulation]
        in reduce_accum.py)."""
        raise NotImplementedError

    def finish_host_folds(self) -> None:
        """The host runs every pending ``host_fold`` (waiting for its data first), in issue order."""

    def upload(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the host tensor ``src`` into the device compute copy ``dst`` (offload); later
        gathers (after the next ``copies_written``) read the new values."""
        dst.copy_(src)

    def wait_uploads(self) -> None:
        """The host waits until every upload issued so far has read its source."""

    def quiesce(self) -> None:
        """The host waits for every copy and collective issued so far (before it writes host
        shards those may read: loads between steps with offload)."""

    def wait_reduced(self, sync: _GradSync) -> None:
        """The compute side waits until the last reduce from this grad buffer is folded."""
        raise NotImplementedError

    def reduce_pending(self, sync: _GradSync) -> bool:
        """A reduce from this grad buffer has been issued and not yet waited for (host view)."""
        return False

    # HSDP: the all-reduce of grad shards across replicas. See [Note: the cross-replica
    # all-reduce] in hsdp.py.
    def replicate_in_fold(self, grad: torch.Tensor, unit: str) -> None:
        """From inside a reduce's fold: all-reduce ``grad`` (a folded grad shard) across the
        replicas, behind that fold on the comm side."""
        raise NotImplementedError

    def replicate(self, grad: torch.Tensor, unit: str) -> None:
        """From the compute side (between steps): all-reduce ``grad`` across the replicas; the
        compute side's later kernels see the result (after :meth:`wait_replicated` on gloo)."""
        raise NotImplementedError

    def host_waits_compute(self) -> None:
        """The host waits for the compute stream's work so far (offload: device -> host copies it
        issued). Without streams every op has run already."""

    def wait_replicated(self) -> None:
        """The host / compute side waits for every all-reduce across replicas issued so far."""


class StreamSchedule(Schedule):
    """CUDA: one high-priority comm stream, events between it and the compute stream.
    See [Note: streams and events]."""

    def __init__(self, streams: StreamAPI, group, replicate_group=None):
        self.streams = streams
        self.group = group
        self.replicate_group = replicate_group  # HSDP: the ranks holding the same shard, else None
        self.counted = Counter()
        self._after_fold: list = []  # HSDP: (grad shard, unit) a fold asked to all-reduce across replicas
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

    def gather(self, sync, out, shard, unit, expand=None, stage=None):
        with span("gather", unit), self.streams.use(self.comm):
            self.comm.wait_event(sync.released)
            self.comm.wait_event(self.copies_ready)
            if stage is not None:  # the host shard onto the device, in this stream's order: [Note: the frozen landing]
                stage.copy_(shard, non_blocking=True)
                shard = stage
            with self._timed("gather", unit):
                all_gather(out, shard, self.group, async_op=False)  # on the comm stream (torch >= 2.8)
            if expand is not None:  # See [Note: expanding a compact gather]
                with span("expand", unit):
                    expand()
            self._count("gather", unit, out)
            sync.ready.record(self.comm)

    def wait_gathered(self, sync):
        self.streams.current_stream().wait_event(sync.ready)

    def released(self, sync):
        sync.released.record(self.streams.current_stream())

    def reduce(self, sync, out, full, unit, fold, host_fold=None, pieces=False):
        collective = all_to_all if pieces else reduce_scatter
        with span("reduce", unit):
            sync.grads_ready.record(self.streams.current_stream())
            with self.streams.use(self.comm):
                self.comm.wait_event(sync.grads_ready)
                with self._timed("reduce", unit):
                    collective(out, full, self.group, async_op=False)  # on the comm stream
                    self._count("reduce", unit, full)
                    fold()
                for grad, name in self._after_fold:  # HSDP: behind the fold, before `done`
                    with span("all_reduce", name), self._timed("all_reduce", name):
                        all_reduce(grad, self.replicate_group, async_op=False)
                    self._count("all_reduce", name, grad)
                self._after_fold.clear()
                sync.done.record(self.comm)
                if host_fold is not None:  # offload: fold() copied the shard to the host
                    landed = self.landed.get(unit)
                    if landed is None:
                        landed = self.landed[unit] = self.streams.new_event()
                    landed.record(self.comm)
                    self.host_pending.append((landed, host_fold))

    def wait_reduced(self, sync):
        self.streams.current_stream().wait_event(sync.done)

    def replicate_in_fold(self, grad, unit):
        # Issued by reduce() right after the fold, on the comm stream and before the grad buffer's
        # `done` (outside the reduce's timing, so the recorder times each collective on its own).
        self._after_fold.append((grad, unit))

    def host_waits_compute(self):
        self.streams.current_stream().synchronize()

    def replicate(self, grad, unit):
        with span("all_reduce", unit):
            self.grads_final.record(self.streams.current_stream())
            with self.streams.use(self.comm):
                self.comm.wait_event(self.grads_final)
                with self._timed("all_reduce", unit):
                    all_reduce(grad, self.replicate_group, async_op=False)
                self._count("all_reduce", unit, grad)
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

    def gather(self, sync, out, shard, unit, expand=None, stage=None):
        self.wait_gathered(sync)  # a previous gather into this buffer must land (and expand) first
        if stage is not None:  # its input was this buffer's landing too: [Note: the frozen landing]
            stage.copy_(shard)
            shard = stage
        rec = self.recorder
        with span("gather", unit):
            t = rec.now() if rec else None  # before the issuing call, which may itself move data
            sync.work = all_gather(out, shard, self.group, async_op=True, local=True)
            sync.unit = unit
            sync.expand = expand
            self._count("gather", unit, out)
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

    def reduce(self, sync, out, full, unit, fold, host_fold=None, pieces=False):
        rec = self.recorder
        if host_fold is not None:  # the host is the compute side: both at the wait
            fold = _then(fold, host_fold)
        with span("reduce", unit):
            t = rec.now() if rec else None
            if pieces:
                work = all_to_all(out, full, self.group, async_op=True)
            else:
                work = reduce_scatter(out, full, self.group, async_op=True, local=True)
            sync.pending = (work, fold, unit)
            self._count("reduce", unit, full)
            if rec:
                rec.comm("reduce", unit, work, issued=t)

    def wait_reduced(self, sync):
        if sync.pending is not None:
            work, fold, unit = sync.pending
            sync.pending = None
            _wait(work, "reduce-scatter", unit)
            fold()

    def reduce_pending(self, sync) -> bool:
        return sync.pending is not None

    def replicate_in_fold(self, grad, unit):
        self.replicate(grad, unit)  # the fold runs on the host at the reduce's wait: issue it now

    def replicate(self, grad, unit):
        rec = self.recorder
        with span("all_reduce", unit):
            t = rec.now() if rec else None
            work = all_reduce(grad, self.replicate_group, async_op=True)
            self.replicating.append((work, unit))
            self._count("all_reduce", unit, grad)
            if rec:
                rec.comm("all_reduce", unit, work, issued=t)

    def wait_replicated(self):
        pending, self.replicating = self.replicating, []
        for work, unit in pending:
            _wait(work, "all-reduce across replicas", unit)


def _then(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def both():
        first()
        second()

    return both


# ---------------------------------------------------------------------------- collective mismatches
# See [Note: collective mismatches] in dist.py.
def _wait(work, what: str, unit: str) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(
            f"yafsdp: the {what} of unit {unit!r} did not complete ({type(e).__name__}: {e}). The ranks are most "
            "likely not running the same collectives: one rank ran an extra forward or backward, skipped one, or "
            "called full_state_dict() / a checkpoint save or load alone. Set YAFSDP_DEBUG_SYNC=1 on every rank to "
            "have each collective checked across ranks and the first mismatch named (init_process_group(timeout=) "
            "bounds the wait)"
        ) from e


class CheckedSchedule:
    """Debug mode: ``inner`` with every gather and reduce checked across ranks first; everything
    else (ordering methods, the comm stream, the recorder) is the inner schedule's."""

    def __init__(self, inner: Schedule, group):
        self.inner = inner
        self.group = group

    @property
    def recorder(self):  # a property, so that setting it reaches the inner schedule
        return self.inner.recorder

    @recorder.setter
    def recorder(self, rec):
        self.inner.recorder = rec

    def __getattr__(self, name):
        return getattr(self.__dict__["inner"], name)

    def gather(self, sync, out, shard, unit, expand=None, stage=None):
        check_collective(f"gather of unit {unit!r}", self.group)
        self.inner.gather(sync, out, shard, unit, expand, stage)

    def reduce(self, sync, out, full, unit, fold, host_fold=None, pieces=False):
        check_collective(f"{'all-to-all' if pieces else 'reduce-scatter'} of unit {unit!r}", self.group)
        self.inner.reduce(sync, out, full, unit, fold, host_fold, pieces)

    def replicate(self, grad, unit):
        check_collective(f"all-reduce across replicas of {unit!r}", self.inner.replicate_group)
        self.inner.replicate(grad, unit)


def make_schedule(device: torch.device, group, replicate_group=None) -> Schedule:
    """The schedule for an engine on ``device``: the stream schedule on CUDA (or over a
    :func:`use_stream_api` override), work handles elsewhere; checked across ranks in debug mode.
    ``replicate_group``: HSDP's group across replicas (see yafsdp/hsdp.py), or None."""
    if _STREAM_API_OVERRIDE:
        schedule = StreamSchedule(_STREAM_API_OVERRIDE[-1], group, replicate_group)
    elif device.type == "cuda":
        schedule = StreamSchedule(CudaStreams(device), group, replicate_group)
    else:
        schedule = HandleSchedule(group, replicate_group)
    return CheckedSchedule(schedule, group) if debug_sync() else schedule
