"""Labels for profilers and timelines, and the engine's own record of what ran when.

Every gather, reduce and unit compute is wrapped in an NVTX range (``nvtx`` package, when
importable) and a ``torch.profiler.record_function`` label, named ``yafsdp.<what> <unit>``, so a
trace reads by unit. A :class:`Recorder` attached to a model (``model.recorder = Recorder()``)
additionally collects, per unit, when each gather and reduce ran on the comm side and when each
forward and backward ran on the compute side:

- CUDA: a pair of timing events on the comm stream around each collective, and on the compute
  stream around each unit's forward/backward (recorded after the compute stream's wait on the
  unit's ready event, so a wait is not counted as compute); resolved by :meth:`Recorder.finish`.
- CPU (gloo): host timestamps; a collective's interval runs from its issue to the completion of
  its async work's future (the callback fires on gloo's thread when the data has landed).

The engine records nothing unless ``model.recorder`` is set. :func:`exposed` and the interval
helpers below turn two lanes of intervals into the exposed-communication figure.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

try:  # the nvtx package is optional at run time; ranges are no-ops without it
    import nvtx as _nvtx
except Exception:  # pragma: no cover - depends on the environment
    _nvtx = None

COMM_KINDS = ("gather", "reduce", "all_reduce")
COMPUTE_KINDS = ("forward", "backward")


# [Note: labels only for a listener]
# A ``record_function`` label costs a dispatcher call and a RecordFunction object (~5-10 us on the
# CPU machines) whether or not anyone reads it, and the engine opens a few per unit and step. So
# :func:`span` opens its labels only while something in the process can read them: a profiler
# (torch.profiler or the autograd profiler, Kineto or legacy: ``_profiler_enabled``) or a Python
# dispatch mode (the stream checker reads the labels from the dispatched ``profiler::`` ops).
# NVTX ranges are read from outside the process (Nsight), unseen from here, and cost ~0.4 us: when
# the nvtx package imports they are always opened. With neither, span is a shared no-op.
_profiler_enabled = torch._C._autograd._profiler_enabled
_NO_SPAN = contextlib.nullcontext()


def span(what: str, unit: str):
    """A label ``yafsdp.<what> <unit>`` around a block, for a listener (see [Note: labels only for a listener])."""
    if _profiler_enabled() or _get_current_dispatch_mode() is not None:
        return _span(what, unit, True)
    return _NO_SPAN if _nvtx is None else _span(what, unit, False)


@contextlib.contextmanager
def _span(what: str, unit: str, label_torch: bool):
    label = f"yafsdp.{what} {unit}"
    rng = _nvtx.start_range(message=label) if _nvtx is not None else None
    try:
        if label_torch:
            with torch.profiler.record_function(label):
                yield
        else:
            yield
    finally:
        if rng is not None:
            _nvtx.end_range(rng)


@dataclass
class Interval:
    kind: str  # "gather", "reduce" (comm lane) or "forward", "backward" (compute lane)
    unit: str
    start: float  # seconds, host clock (CPU) or filled in from CUDA events by finish()
    end: float | None = None
    events: tuple | None = None  # (start, end) torch.cuda.Event pair on CUDA

    @property
    def lane(self) -> str:
        return "comm" if self.kind in COMM_KINDS else "compute"

    @property
    def duration(self) -> float:
        return (self.end - self.start) if self.end is not None else 0.0


@dataclass
class Recorder:
    """Collects what ran when (see the module docstring). Set ``model.recorder = Recorder()``,
    run steps, then call :meth:`finish` (which synchronises on CUDA) and read ``intervals``."""

    intervals: list[Interval] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)
    steps: list[tuple[float, float]] = field(default_factory=list)  # (start, end) marked by step()

    def now(self) -> float:
        """Seconds on this recorder's clock (for ``comm(..., issued=)``)."""
        return time.perf_counter() - self.t0

    def comm(self, kind: str, unit: str, work, stream=None, issued: float | None = None):
        """A collective: on CUDA bracketed by events on ``stream``; on CPU from ``issued`` (taken
        just before the issuing call, which may itself move data) to ``work``'s completion."""
        iv = Interval(kind, unit, issued if issued is not None else self.now())
        self.intervals.append(iv)
        if stream is not None:  # CUDA: bracket the collective with events on the comm stream
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            iv.events = (start, None)
            return iv
        if work is None:
            iv.end = iv.start
            return iv
        try:
            fut = work.get_future()
        except (RuntimeError, AttributeError):  # gloo reduce-scatter and point-to-point handles have no future
            self._watch(iv, work)
            return iv

        def done(_f, iv=iv):
            iv.end = time.perf_counter() - self.t0

        fut.add_done_callback(done)
        return iv

    def _watch(self, iv: Interval, work):
        """Stamp ``iv.end`` when ``work`` completes: a helper thread blocks in ``work.wait()``
        (which releases the GIL). For collectives whose work has neither a future nor a working
        ``is_completed()`` (gloo's reduce-scatter in torch 2.13, yafsdp's point-to-point handles)."""
        import threading

        def wait():
            try:
                work.wait()
            finally:
                iv.end = time.perf_counter() - self.t0

        t = threading.Thread(target=wait, name="yafsdp-recorder", daemon=True)
        self.__dict__.setdefault("_waiters", []).append(t)
        t.start()

    def comm_end(self, iv: Interval, stream):
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        iv.events = (iv.events[0], end)

    @staticmethod
    def _cuda_live() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def compute_start(self, kind: str, unit: str):
        iv = Interval(kind, unit, time.perf_counter() - self.t0)
        if self._cuda_live():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            iv.events = (ev, None)
        self.intervals.append(iv)
        return iv

    def compute_end(self, iv: Interval):
        iv.end = time.perf_counter() - self.t0
        if iv.events is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            iv.events = (iv.events[0], ev)

    @contextlib.contextmanager
    def step(self):
        """Bracket one training step: ``with recorder.step(): ...`` (step bounds for per-step figures)."""
        ev = None
        if self._cuda_live():
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        start = time.perf_counter() - self.t0
        try:
            yield
        finally:
            if ev is not None:
                end_ev = torch.cuda.Event(enable_timing=True)
                end_ev.record()
                self._step_events = getattr(self, "_step_events", []) + [(len(self.steps), ev, end_ev)]
            self.steps.append((start, time.perf_counter() - self.t0))

    def finish(self) -> list[Interval]:
        """Resolve CUDA events into seconds relative to the first recorded event (host clock
        on CPU, where every interval is already resolved). Returns ``intervals``."""
        for t in self.__dict__.pop("_waiters", []):
            t.join(timeout=10.0)
        with_events = [iv for iv in self.intervals if iv.events and iv.events[1] is not None]
        step_events = getattr(self, "_step_events", [])
        if with_events or step_events:
            torch.cuda.synchronize()
            firsts = [iv.events[0] for iv in with_events] + [s for _, s, _ in step_events]
            hosts = [iv.start for iv in with_events] + [self.steps[i][0] for i, _, _ in step_events]
            base = firsts[min(range(len(firsts)), key=hosts.__getitem__)]
            for iv in with_events:
                iv.start = base.elapsed_time(iv.events[0]) / 1e3
                iv.end = base.elapsed_time(iv.events[1]) / 1e3
                iv.events = None
            for i, s, e in step_events:
                self.steps[i] = (base.elapsed_time(s) / 1e3, base.elapsed_time(e) / 1e3)
            self._step_events = []
        return self.intervals

    def summary(self, window: tuple[float, float] | None = None) -> dict:
        """Exposed communication from the engine's own lanes (see :func:`exposed`); ``window``
        restricts it to one step. Compute here is the units' forward/backward only."""
        ivs = [iv for iv in self.intervals if iv.end is not None]
        if window is not None:
            ivs = [iv for iv in ivs if iv.start >= window[0] and iv.end <= window[1]]
        comm = [(iv.start, iv.end) for iv in ivs if iv.lane == "comm"]
        compute = [(iv.start, iv.end) for iv in ivs if iv.lane == "compute"]
        return exposed(comm, compute)


# ---------------------------------------------------------------------------- interval algebra
def union(intervals) -> list[tuple[float, float]]:
    """Sorted, disjoint union of (start, end) pairs."""
    out: list[list[float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    return sum(e - s for s, e in union(intervals))


def subtract(a, b) -> list[tuple[float, float]]:
    """The parts of union(a) not covered by union(b)."""
    b = union(b)
    out = []
    for s, e in union(a):
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
            if cur >= e:
                break
        if cur < e:
            out.append((cur, e))
    return out


def exposed(comm, compute) -> dict:
    """How much of the communication time no compute hides: ``comm`` and ``compute`` are
    (start, end) pairs (seconds) of the two lanes. Returns seconds and the exposed fraction of
    the communication time."""
    c = length(comm)
    ex = subtract(comm, compute)
    e = sum(t1 - t0 for t0, t1 in ex)
    return dict(comm=c, compute=length(compute), exposed=e, exposed_fraction=(e / c) if c else 0.0,
                exposed_intervals=ex)
