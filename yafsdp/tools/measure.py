"""Measuring a training step honestly on a shared machine: the memory it holds and the noise
around its timings. Used by the benchmarks (benchmarks/) and by the tests that check the memory
plan against what a step really allocates.

- :func:`measure_memory` with :class:`CpuAllocTracker` (exact torch CPU allocations, from the
  profiler's memory events) or :class:`HeapSampler` (the process heap, sampled), or CUDA's
  allocator counters;
- :func:`noise_report`: the spread of per-step ratios and of each competitor's own step times,
  and a warning when the machine is too busy for the ratios to mean much.
"""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch

__all__ = ["CpuAllocTracker", "HeapSampler", "measure_memory", "noise_report", "NOISY"]

# [Note: noise] A ratio of medians from one run on a shared machine moves with the load: the README's
# 0.98-1.08x DDP came from runs on a 2-core VM shared with other jobs (load average ~2 before the
# run), where a newcomer's run of the same command on a busier machine printed 1.35x. So the report
# gives, for every step-time goal, the spread of the per-step ratio (interleaved steps see the same
# load), and warns when the competitors' own step times are spread wide -- (max - min) / median over
# NOISY -- or the machine was already loaded (1-minute load average >= its cores) before the run.
NOISY = 0.20


class CpuAllocTracker:
    """Live bytes of the torch CPU allocator, from the profiler's memory events.

    Counts every block allocated on this (the main) thread after ``start()`` until it is freed;
    blocks allocated before ``start()`` are invisible (start it before building the engine).
    Collectives' internal buffers inside gloo are not torch allocations and are not counted.
    ``mark(label)`` drops a labelled point on the same clock as the memory events."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)

    def start(self):
        self._prof.__enter__()
        return self

    @staticmethod
    def mark(label: str):
        with torch.profiler.record_function(f"bench.mark {label}"):
            pass

    def stop(self):
        """Returns (timeline [(ns, live bytes)] in time order, {label: ns})."""
        self._prof.__exit__(None, None, None)
        evs, marks = [], {}
        for e in self._prof.profiler.kineto_results.events():
            name = e.name()
            if name == "[memory]" and str(e.device_type()).endswith("CPU"):
                evs.append((e.start_ns(), e.nbytes()))
            elif name.startswith("bench.mark "):
                marks[name[len("bench.mark "):]] = e.start_ns()
        evs.sort()
        timeline, live = [], 0
        for t, n in evs:
            live += n
            timeline.append((t, live))
        return timeline, marks


class HeapSampler:
    """Process-wide heap bytes in use (glibc ``mallinfo2``: arena chunks in use + mmapped chunks),
    sampled by a background thread every ``interval`` seconds, with the peak since the last
    ``take()``. Sees every thread (gloo's included) and everything malloc'd (torch CPU tensors and
    the little else a step allocates); misses peaks shorter than the interval."""

    def __init__(self, interval: float = 2e-4):
        import ctypes
        import threading

        class _MI2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

        self._libc = ctypes.CDLL("libc.so.6")
        self._libc.mallinfo2.restype = _MI2
        self.interval = interval
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def available() -> bool:
        try:
            import ctypes

            return hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
        except OSError:  # pragma: no cover - not glibc
            return False

    def now(self) -> int:
        m = self._libc.mallinfo2()
        return m.uordblks + m.hblkhd

    def _run(self):
        while not self._stop.is_set():
            v = self.now()
            if v > self._peak:
                self._peak = v
            time.sleep(self.interval)

    def start(self):
        self._old_switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval)  # let the sampler in while the step runs Python code
        self._peak = self.now()
        self._thread.start()
        return self

    def take(self) -> tuple[int, int]:
        """(bytes in use now, peak since the last take)."""
        now = self.now()
        peak, self._peak = max(self._peak, now), now
        return now, peak

    def stop(self):
        self._stop.set()
        self._thread.join()
        sys.setswitchinterval(self._old_switch)


def measure_memory(build, step, steps: int, device: torch.device, method: str = "auto") -> dict:
    """Build an engine (``build()``) and run ``steps`` steps (``step(engine, i)``), measuring the
    bytes this rank holds. ``method``: "cuda" (the caching allocator's counters), "torch" (a
    CpuAllocTracker: exact torch CPU allocations, but frees made on other threads are invisible,
    so use it only where there are none, e.g. with the fake process group) or "heap" (a
    HeapSampler, relative to the heap before ``build()``); "auto": cuda on GPU, else heap.

    Returns: ``built`` (held after construction), ``step_end`` (after each step), ``peak_first``
    (peak during step 1, when the optimizer state is created), ``peak_steady`` (peak over steps
    2..), ``growth_from_step2`` (held at the last step end minus at step 2's end), ``reserved``
    (CUDA) and ``how``."""
    if method == "auto":
        method = "cuda" if device.type == "cuda" else "heap"
    steady = 1 if steps >= 2 else 0
    if method == "cuda":
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        engine = build()
        torch.cuda.synchronize(device)
        built = torch.cuda.memory_allocated(device)
        ends, peaks = [], []
        for i in range(steps):
            torch.cuda.reset_peak_memory_stats(device)
            step(engine, i)
            torch.cuda.synchronize(device)
            ends.append(torch.cuda.memory_allocated(device))
            peaks.append(torch.cuda.max_memory_allocated(device))
        reserved = torch.cuda.max_memory_reserved(device)
        del engine
        _collect()
        return dict(built=built, step_end=ends, peak_first=peaks[0], peak_steady=max(peaks[steady:]),
                    growth_from_step2=ends[-1] - ends[steady] if steps >= 2 else None, reserved=reserved,
                    how="torch.cuda.max_memory_allocated / memory_allocated")
    if method == "heap":
        gc.collect()
        hs = HeapSampler().start()
        base = hs.now()
        engine = build()
        built, _ = hs.take()
        ends, peaks = [], []
        for i in range(steps):
            step(engine, i)
            now, peak = hs.take()
            ends.append(now - base)
            peaks.append(peak - base)
        hs.stop()
        del engine
        _collect()
        return dict(built=built - base, step_end=ends, peak_first=peaks[0], peak_steady=max(peaks[steady:]),
                    growth_from_step2=ends[-1] - ends[steady] if steps >= 2 else None, reserved=None,
                    how="process heap in use above the pre-build baseline (glibc mallinfo2, sampled every 0.2 ms)")
    tr = CpuAllocTracker().start()
    engine = build()
    tr.mark("built")
    for i in range(steps):
        step(engine, i)
        tr.mark(f"step{i}")
    del engine  # inside the trace, but after the last mark: not counted below
    _collect()
    timeline, marks = tr.stop()

    def live_at(t):
        v = 0
        for ts, live in timeline:
            if ts > t:
                break
            v = live
        return v

    def peak_between(a, b):
        return max([live for ts, live in timeline if a <= ts <= b] + [live_at(a)])

    t = [marks["built"]] + [marks[f"step{i}"] for i in range(steps)]
    ends = [live_at(x) for x in t[1:]]
    return dict(built=live_at(t[0]), step_end=ends, peak_first=peak_between(t[0], t[1]),
                peak_steady=peak_between(t[steady], t[-1]) if steps else 0,
                growth_from_step2=ends[-1] - ends[steady] if steps >= 2 else None, reserved=None,
                how="torch CPU allocator live bytes (profiler memory events)")


def noise_report(times: dict[str, list[float]], goals: list[dict], paired: bool, load_before: float | None,
                 cores: int, competitors=("ddp", "fsdp2", "fsdp1")) -> tuple[list[str], dict]:
    """Lines for the report and a JSON summary: per-goal ratio spread, competitors' own spread, and
    a warning when the machine looks busy. See [Note: noise]."""
    lines, ratios = [], {}
    for g in goals:
        if g.get("what") or not paired or len(times[g["engine"]]) != len(times[g["vs"]]):
            continue
        per_step = [x / y for x, y in zip(times[g["engine"]], times[g["vs"]])]
        lo, med, hi = min(per_step), statistics.median(per_step), max(per_step)
        ratios[f"{g['engine']}/{g['vs']}"] = dict(median=med, min=lo, max=hi, steps=len(per_step))
        lines.append(f"spread: {g['engine']} / {g['vs']} per interleaved step: median x{med:.3f}, "
                     f"range x{lo:.3f}-{hi:.3f} over {len(per_step)} steps")
    own = {n: (max(ts) - min(ts)) / statistics.median(ts) for n, ts in times.items() if len(ts) >= 2}
    wide = {n: v for n, v in own.items() if n in competitors and v > NOISY}
    loaded = load_before is not None and load_before >= cores
    if own:
        lines.append("own spread (max - min over median): " + ", ".join(f"{n} {100 * v:.0f}%" for n, v in own.items())
                     + (f"; load average before the run {load_before:.2f} on {cores} cores" if load_before is not None
                        else ""))
    if wide or loaded:
        why = []
        if wide:
            why.append("the competitors' own step times spread by " + ", ".join(f"{n} {100 * v:.0f}%"
                                                                              for n, v in wide.items())
                       + f" (> {100 * NOISY:.0f}%)")
        if loaded:
            why.append(f"the load average was {load_before:.2f} on {cores} cores before the run")
        lines.append(f"NOISE WARNING: the machine is busy ({'; '.join(why)}): the ratios above can be off by more "
                     "than the goals' margins. Rerun on an idle machine, with more --steps, and read the per-step "
                     "ranges; the README's figures are medians of quiet-ish runs (conditions in benchmarks/results/).")
    return lines, dict(ratios=ratios, own_spread=own, busy=bool(wide or loaded), load_before=load_before, cores=cores)


def _collect():
    """After the caller dropped its engine: free it now (and CUDA's cached blocks)."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
