"""The comm interface: how gathers and reduces are ordered against the compute side.

One interface, two concurrency models; the engine's schedule calls only the methods of
:class:`Schedule` and never asks which model it runs on.

- :class:`StreamSchedule` (CUDA, ``comm/cuda.py``): one dedicated comm stream, ordered against the compute stream
  by CUDA events. It reaches streams and events only through a :class:`StreamAPI`, so the same
  code runs over :class:`CudaStreams` on a GPU and over ``yafsdp.streamcheck``'s simulated
  streams on the CPU, where every kernel's stream and buffer accesses are logged and the
  happens-before order is checked (see [Note: the stream-protocol checker] there).
- :class:`HandleSchedule` (gloo, CPU, ``comm/gloo.py``): collectives return asynchronous work handles; the compute
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
  all-reduce] in engine/replicas.py): overlapped, right behind a unit's fold in the same comm-stream block
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

from collections import Counter
from typing import Callable

import torch

from .groups import CollectiveError
from .progress import waiting

__all__ = ["StreamAPI", "Schedule"]


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

    # grad_quant with HSDP: the quantized all-reduce across replicas (comm.quant_reduce.QuantAllReduce),
    # or None: torch's SUM all-reduce. Set once by the engine (use_across).
    across = None

    def use_across(self, across) -> None:
        """All-reduce across replicas with ``across(grad, async_op)`` from now on (grad_quant)."""
        self.across = across

    def _all_reduce_across(self, grad: torch.Tensor, unit: str, async_op: bool, plain: Callable):
        """The all-reduce of ``grad`` across the replicas, counted: ``plain`` (``collectives.all_reduce``,
        as the concrete schedule's module names it) or the quantized one."""
        if self.across is None:
            work = plain(grad, self.replicate_group, async_op=async_op)
            self._count("all_reduce", unit, grad)
            return work
        for kind, n in self.across.counted(grad):
            self.counted[(kind, unit)] += n
        return self.across(grad, async_op)

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
               expand: Callable[[], None] | None = None, stage: torch.Tensor | None = None, group=None) -> None:
        """Issue the all-gather of ``shard`` into ``out`` (a weight buffer's storage or staging
        area); ``expand()``, when given, runs after it has landed and before the buffer counts as
        gathered (see [Note: expanding a compact gather]; also where a secondary shard is kept).
        ``stage`` (offload="all"): a device tensor the host ``shard`` is first copied into, the
        collective's input then (see [Note: the frozen landing] in layout/sizing.py). ``group``: a
        subgroup of the shard group to gather over instead of the whole (``shard`` is then a secondary
        shard's piece, counted as kind "secondary_gather": [Note: the secondary shard] in engine/secondary.py)."""
        raise NotImplementedError

    def wait_gathered(self, sync: _WeightSync) -> None:
        """The compute side waits until the last gather into this buffer has landed."""
        raise NotImplementedError

    def released(self, sync: _WeightSync) -> None:
        """The compute side's use of this weight buffer ended (the next gather may overwrite it)."""

    def taken(self, sync: _WeightSync) -> None:
        """The weight buffer's memory was just taken from the allocator on the compute side: the next
        gather's writes wait for this point ([Note: world-1 buffers in use only] in layout/sizing.py)."""

    def reduce(self, sync: _GradSync, out: torch.Tensor, full: torch.Tensor, unit: str,
               then: Callable[[], None], pieces: bool = False, collective=None) -> None:
        """Issue the reduce-scatter of ``full`` (a grad buffer) into ``out``; ``then()`` runs on the
        comm side right behind it (CUDA: on the comm stream, before the buffer's ``done``; gloo: at the
        reduce's wait) -- the rest of the gradient's path, engine/grad_path.py. ``pieces``: an all-to-all
        instead, ``out`` (as large as ``full``) receives every rank's piece of this rank's shard (see
        [Note: narrow reduce, fp32 accumulation] in reduce_accum.py). ``collective``: the quantized
        reduce instead, ``collective(out, full, async_op)`` returning a handle (or None when done), with
        ``collective.counted(full)`` its bytes (see [Note: quantized gradient reduction] in
        quant_reduce.py)."""
        raise NotImplementedError

    def on_host(self, unit: str, fn: Callable[[], None]) -> None:
        """From the comm side (inside a reduce's ``then``): ``fn()`` runs on the host once the comm
        side's work so far has completed (offload: the reduced shard has landed in host memory), by
        :meth:`finish_host_folds` at the latest."""
        raise NotImplementedError

    def finish_host_folds(self) -> None:
        """The host runs every pending :meth:`on_host` function (waiting for its data first), in issue order."""

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

    def reduce_rows_ok(self) -> bool:
        """Whether ``reduce_rows_into(target, full, unit)`` (a reduce into the grad shard, complete on
        return) is offered: gloo at world 2 only. See [Note: the direct exchange of an outsized
        gradient] in engine/grad_path.py; with ``gather_rows_into(out, shard, unit)``, the small exchanges
        of [Note: the sharded lookup of an embedding] in engine/lookup.py."""
        return False

    # HSDP: the all-reduce of grad shards across replicas. See [Note: the cross-replica
    # all-reduce] in engine/replicas.py.
    def all_reduce_behind(self, grad: torch.Tensor, unit: str) -> None:
        """From the comm side (inside a reduce's ``then``): all-reduce ``grad`` (a folded grad shard)
        across the replicas, behind the fold (CUDA: on the comm stream, before ``done``; gloo: an
        asynchronous handle, waited by :meth:`wait_replicated`)."""
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


# ---------------------------------------------------------------------------- collective mismatches
# See [Note: collective mismatches] in comm/groups.py.
def _wait(work, what: str, unit: str) -> None:
    try:
        waiting(work, what, unit)  # the watchdog sees what is waited for (comm/progress.py)
    except RuntimeError as e:
        raise CollectiveError(
            f"yafsdp: the {what} of unit {unit!r} did not complete ({type(e).__name__}: {e}). The ranks are most "
            "likely not running the same collectives: one rank ran an extra forward or backward, skipped one, or "
            "called full_state_dict() / a checkpoint save or load alone. Set YAFSDP_DEBUG_SYNC=1 on every rank to "
            "have each collective checked across ranks and the first mismatch named (init_process_group(timeout=) "
            "bounds the wait)"
        ) from e
