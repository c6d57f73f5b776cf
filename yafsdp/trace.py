"""Labels for profilers and timelines.

Every gather, reduce and unit compute is wrapped in an NVTX range (``nvtx`` package, when
importable) and a ``torch.profiler.record_function`` label, named ``yafsdp.<what> <unit>``, so a
trace reads by unit. A :class:`Recorder` attached to a model (``model.recorder = Recorder()``)
additionally collects host timestamps and, on CUDA, event pairs for the overlap benchmark.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

try:  # the nvtx package is optional at run time; ranges are no-ops without it
    import nvtx as _nvtx
except Exception:  # pragma: no cover - depends on the environment
    _nvtx = None


@contextlib.contextmanager
def span(what: str, unit: str):
    label = f"yafsdp.{what} {unit}"
    rng = _nvtx.start_range(message=label) if _nvtx is not None else None
    try:
        with torch.profiler.record_function(label):
            yield
    finally:
        if rng is not None:
            _nvtx.end_range(rng)


@dataclass
class Interval:
    kind: str  # "gather", "reduce" (comm stream) or "forward", "backward" (compute stream)
    unit: str
    start: float  # seconds, host clock (CPU) or filled in from CUDA events by finish()
    end: float | None = None
    events: tuple | None = None  # (start, end) torch.cuda.Event pair on CUDA


@dataclass
class Recorder:
    """Collects what ran when. CPU: comm intervals end when the collective's future completes."""

    intervals: list[Interval] = field(default_factory=list)
    t0: float = field(default_factory=time.perf_counter)

    def comm(self, kind: str, unit: str, work, stream=None):
        iv = Interval(kind, unit, time.perf_counter() - self.t0)
        self.intervals.append(iv)
        if stream is not None:  # CUDA: bracket the collective with events on the comm stream
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            iv.events = (start, None)
            return iv
        fut = work.get_future() if work is not None else None
        if fut is None:
            iv.end = iv.start
        else:
            def done(_f, iv=iv):
                iv.end = time.perf_counter() - self.t0
            fut.add_done_callback(done)
        return iv

    def comm_end(self, iv: Interval, stream):
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        iv.events = (iv.events[0], end)

    def compute_start(self, kind: str, unit: str):
        iv = Interval(kind, unit, time.perf_counter() - self.t0)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
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

    def finish(self):
        """Resolve CUDA events into seconds relative to the first recorded event."""
        with_events = [iv for iv in self.intervals if iv.events and iv.events[1] is not None]
        if with_events:
            torch.cuda.synchronize()
            base = min(with_events, key=lambda iv: iv.start).events[0]
            for iv in with_events:
                iv.start = base.elapsed_time(iv.events[0]) / 1e3
                iv.end = base.elapsed_time(iv.events[1]) / 1e3
        return self.intervals
