"""A checker of the CUDA stream protocol that runs on the CPU.

    from yafsdp.streamcheck import StreamChecker

    with StreamChecker() as chk:               # engines built inside run the CUDA schedule
        model = yafsdp.YaFSDP(module, param_dtype=torch.bfloat16)
        opt = yafsdp.FusedAdamW(model.parameters())
        chk.watch(model)                       # the engine's shared tensors
        with chk.recording():
            ...                                # training steps, eval forwards, state dicts
    chk.assert_ordered()                       # raises with every race found

[Note: the stream-protocol checker]
The engine's CUDA schedule (``yafsdp.comm.StreamSchedule``) reaches streams and events only
through a ``StreamAPI``. :class:`StreamChecker` is one: its streams and events are plain objects,
and every kernel runs at once on the CPU in host order (so the numbers are those of a fully
serialised run), while the checker records what a GPU would be free to reorder:

- every kernel the process issues (a ``TorchDispatchMode`` sees each aten, yafsdp and c10d op,
  in forward, backward and the optimizer) is logged with the stream that was current when it was
  issued and the byte ranges it read and wrote of the *watched* tensors (the engine's master,
  grad and compute-copy shards and its weight and grad buffers: see ``YaFSDP.owned_tensors``);
- event records and waits (``Event.record``, ``Stream.wait_event``, ``Stream.wait_stream``)
  build a happens-before order between streams, kept as vector clocks: each stream counts its
  kernels; an event records its stream's clock vector; a wait joins it into the waiter's.

An access ``b`` on stream ``t`` happens before a later access ``a`` on stream ``s`` when ``s``
is ``t`` or ``s``'s clock vector at ``a`` has seen ``b`` (``vc_s[t] >= clock(b)``). Every pair of
overlapping accesses of a watched tensor from two streams, at least one a write, must be so
ordered; otherwise it is a race: a read that may see the bytes before a write on another stream
(stale or torn weights, an unfolded gradient) or a write that may clobber bytes another stream
still reads. A CUDA event never recorded orders nothing, as on the device.

Host tensors (offload: ``YaFSDP.placement()`` says "host"; see [Note: host and device tensors] in
alloc.py): a kernel issued on the compute stream whose watched tensors all live on the host is a
CPU op (the optimizer's step, the cast into the host staging, the host fold of a reduced grad): it
runs on the host's own timeline (a pseudo-stream "host"), ordered after everything the host has
waited for (event/stream ``synchronize``), and every kernel issued after it on any stream is
ordered after it. A device stream that reads a host tensor (an upload, a landing copy) must still
be ordered after the host's last write by the issue order, and the host's next write after that
read by a ``synchronize`` -- which is what the offload cases check.

[Note: a storage's memory coming and going]
A watched storage may hold memory only part of the time (a world-1 weight buffer: [Note: world-1
buffers in use only] in layout/sizing.py). On the device the caching allocator hands a block to the
stream current at the allocation, with every earlier use of it ordered before that point on that
stream only, and takes it back at the free for that stream's next allocations. So a ``resize_`` of a
watched storage while recording counts as a write of all of it on the current stream: another
stream's access after an allocation must be ordered after it (an event recorded there), and one
before a free must be ordered before it (the stream that frees has waited for it). The storage is
watched by its identity, not its address, which changes with each allocation.

What it cannot see: kernels issued from another thread than the one that runs the step, and
tensors it does not watch (activations and optimizer state live on the compute stream only).
Kernels are ordered on the host exactly as issued; the checker proves the schedule's edges are
sufficient, not that the host runs ahead.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .. import comm

__all__ = ["StreamChecker", "SimStream", "SimEvent", "Race", "StreamProtocolError"]


class StreamProtocolError(AssertionError):
    """Races found by :meth:`StreamChecker.assert_ordered`."""


class SimStream:
    """A simulated stream: a name, a priority and a clock vector."""

    def __init__(self, checker: "StreamChecker", index: int, name: str, priority: int = 0):
        self.checker = checker
        self.index = index
        self.name = name
        self.priority = priority
        self.vc: dict[int, int] = {index: 0}  # stream index -> kernels of that stream seen

    def wait_event(self, event: "SimEvent") -> None:
        self.checker._log_edge("wait_event", self, event)
        if event.vc is not None:  # never recorded: orders nothing, as on CUDA
            _join(self.vc, event.vc)

    def wait_stream(self, stream: "SimStream") -> None:
        ev = SimEvent(self.checker)
        ev.record(stream)
        self.wait_event(ev)

    def record_event(self, event: "SimEvent | None" = None) -> "SimEvent":
        event = event or SimEvent(self.checker)
        event.record(self)
        return event

    def synchronize(self) -> None:  # the host waits: later kernels of any stream come after
        _join(self.checker._host_vc, self.vc)

    def __repr__(self):
        return f"SimStream({self.name!r})"


class SimEvent:
    """A simulated event: the clock vector of its stream at the last record."""

    def __init__(self, checker: "StreamChecker", timing: bool = False):
        self.checker = checker
        self.vc: dict[int, int] | None = None
        self.stream: SimStream | None = None

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or self.checker.current_stream()
        self.vc = dict(stream.vc)
        self.stream = stream
        self.checker._log_edge("record", stream, self)

    def synchronize(self) -> None:
        if self.vc is not None:
            _join(self.checker._host_vc, self.vc)

    def query(self) -> bool:
        return True


def _join(into: dict[int, int], other: dict[int, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass
class _Access:
    stream: int
    clock: int
    write: bool
    lo: int  # byte range [lo, hi) of the watched tensor's storage
    hi: int
    op: int  # index into the checker's log


@dataclass
class Race:
    """Two accesses of one watched tensor from two streams that nothing orders."""

    tensor: str
    lo: int
    hi: int
    first: str  # the earlier access, described
    second: str

    def __str__(self):
        return (f"race on {self.tensor!r} bytes [{self.lo}, {self.hi}): {self.second} is not ordered after "
                f"{self.first}")


@dataclass
class _Watched:
    name: str
    nbytes: int
    history: list[_Access] = field(default_factory=list)
    host: bool = False  # lives on the host (offload): see the module note


# c10d ops write the tensors in these arguments (their schemas mark no mutation).
_C10D_WRITES = {"output_tensor", "output_tensors", "output", "outputs"}
_C10D_READ_WRITE_OPS = {"allreduce_", "broadcast_", "recv_", "recv_any_source_", "allreduce_coalesced_",
                        "barrier"}
_NO_DATA = {"set_", "detach", "alias", "lift_fresh", "_unsafe_view", "resize_", "empty", "empty_like",
            "empty_strided", "zeros_like", "zeros", "ones", "ones_like", "full", "scalar_tensor"}


class StreamChecker(comm.StreamAPI):
    """Simulated streams and events plus the happens-before check (see the module note).

    Used as a context manager it makes engines built inside it run the stream schedule over
    these streams (``yafsdp.comm.use_stream_api``)."""

    def __init__(self, max_races: int = 50):
        self.streams: list[SimStream] = []
        self.compute = self.new_stream(name="compute")  # the default stream
        self._host_vc: dict[int, int] = {}
        self._local = threading.local()
        self._watched: dict[int, _Watched] = {}  # storage (its StorageImpl) -> watched tensor
        self.log: list[tuple] = []  # ("kernel", stream, op, label, reads, writes) | ("record"|"wait_event", ...)
        self.races: list[Race] = []
        self.max_races = max_races
        self._labels: list[str] = []
        self._override = None
        self.kernels = 0  # kernels that touched a watched tensor
        self._host_stream: SimStream | None = None  # the host's timeline (offload's CPU ops)

    # ------------------------------------------------------------ StreamAPI
    def new_stream(self, priority: int = 0, name: str | None = None) -> SimStream:
        s = SimStream(self, len(self.streams), name or f"stream{len(self.streams)}", priority)
        self.streams.append(s)
        if len(self.streams) == 2 and name is None:
            s.name = "comm"  # the schedule's one side stream
        return s

    def new_event(self, timing: bool = False) -> SimEvent:
        return SimEvent(self, timing)

    def current_stream(self) -> SimStream:
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else self.compute

    @contextlib.contextmanager
    def use(self, stream: SimStream):
        stack = self._local.__dict__.setdefault("stack", [])
        stack.append(stream)
        try:
            yield stream
        finally:
            stack.pop()

    # ------------------------------------------------------------ set-up
    def __enter__(self):
        self._override = comm.use_stream_api(self)
        self._override.__enter__()
        return self

    def __exit__(self, *exc):
        self._override.__exit__(*exc)
        return False

    def watch(self, engine_or_tensors) -> None:
        """Watch the engine's shared tensors (``YaFSDP.owned_tensors()``) or a dict name -> tensor."""
        tensors = engine_or_tensors.owned_tensors() if hasattr(engine_or_tensors, "owned_tensors") else engine_or_tensors
        where = engine_or_tensors.placement() if hasattr(engine_or_tensors, "placement") else {}
        for name, t in tensors.items():
            st = t.untyped_storage()  # by the storage itself: a world-1 buffer's memory comes and goes
            self._watched.setdefault(st._cdata, _Watched(name, st.nbytes(), host=where.get(name) == "host"))
        if any(w.host for w in self._watched.values()) and self._host_stream is None:
            self._host_stream = SimStream(self, len(self.streams), "host")
            self.streams.append(self._host_stream)

    @contextlib.contextmanager
    def recording(self):
        """Log and check every kernel issued inside (the step loop)."""
        with _Mode(self), self._allocations():
            yield self

    @contextlib.contextmanager
    def _allocations(self):
        """A watched storage given memory or giving it back (``UntypedStorage.resize_``): a write of all
        of it on the current stream. See [Note: a storage's memory coming and going]."""
        cls, checker = torch.UntypedStorage, self
        before = vars(cls).get("resize_")
        orig = cls.resize_

        def resize_(st, nbytes):
            w = checker._watched.get(st._cdata)
            if w is not None:
                checker._access("allocator.resize_", [(w, True, 0, max(st.nbytes(), int(nbytes)))])
            return orig(st, nbytes)

        cls.resize_ = resize_
        try:
            yield
        finally:
            if before is None:
                del cls.resize_
            else:
                cls.resize_ = before

    # ------------------------------------------------------------ results
    def report(self) -> str:
        if not self.races:
            return f"stream protocol: {self.kernels} kernels on watched tensors, no race"
        lines = [f"stream protocol: {len(self.races)} race(s) among {self.kernels} kernels on watched tensors"]
        lines += [f"  {r}" for r in self.races]
        return "\n".join(lines)

    def assert_ordered(self) -> None:
        if self.races:
            raise StreamProtocolError(self.report())

    # ------------------------------------------------------------ internals
    def _log_edge(self, what: str, stream: SimStream, event: SimEvent) -> None:
        self.log.append((what, stream.name, id(event)))

    def _describe(self, acc: _Access) -> str:
        _, stream, op, label, *_ = self.log[acc.op]
        kind = "write" if acc.write else "read"
        where = f" in {label}" if label else ""
        return f"{kind} by {op} on stream {stream!r}{where} (kernel #{acc.op})"

    def _kernel(self, op: str, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> None:
        hits = []
        for write, tensors in ((False, reads), (True, writes)):
            for t in tensors:
                if t.numel() == 0 or t.device.type == "meta":
                    continue
                w = self._watched.get(t.untyped_storage()._cdata)
                if w is None:
                    continue
                lo = t.storage_offset() * t.element_size()
                span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
                hits.append((w, write, lo, lo + span * t.element_size()))
        if hits:
            self._access(op, hits)

    def _access(self, op: str, hits: list) -> None:
        """One kernel on the current stream touching ``hits`` ((watched, write, lo, hi)): logged, and
        checked against every earlier access of the same bytes from another stream."""
        s = self.current_stream()
        host_op = s is self.compute and self._host_stream is not None and all(w.host for w, *_ in hits)
        if host_op:  # a CPU op: on the host's timeline (see the module note)
            s = self._host_stream
        _join(s.vc, self._host_vc)
        s.vc[s.index] += 1
        if host_op:
            _join(self._host_vc, s.vc)  # done before the host issues anything else
        index = len(self.log)
        self.log.append(("kernel", s.name, op, self._labels[-1] if self._labels else "",
                         [(w.name, lo, hi) for w, wr, lo, hi in hits if not wr],
                         [(w.name, lo, hi) for w, wr, lo, hi in hits if wr]))
        self.kernels += 1
        for w, write, lo, hi in hits:
            acc = _Access(s.index, s.vc[s.index], write, lo, hi, index)
            for b in w.history:
                if b.stream == s.index or not (write or b.write) or b.hi <= lo or b.lo >= hi:
                    continue
                if s.vc.get(b.stream, 0) < b.clock and len(self.races) < self.max_races:
                    self.races.append(Race(w.name, max(lo, b.lo), min(hi, b.hi), self._describe(b),
                                           self._describe(acc)))
            w.history.append(acc)
            # Forget accesses every stream is already ordered after: no later access can race them.
            w.history = [b for b in w.history
                         if any(o.vc.get(b.stream, 0) < b.clock for o in self.streams if o.index != b.stream)]


class _Mode(TorchDispatchMode):
    def __init__(self, checker: StreamChecker):
        super().__init__()
        self.checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        name = func._schema.name.split("::")[-1]
        if ns == "profiler":  # record_function labels (yafsdp.trace.span): name the kernels inside
            if name == "_record_function_enter_new":
                self.checker._labels.append(str(args[0]))
            elif name == "_record_function_exit" and self.checker._labels:
                self.checker._labels.pop()
            return func(*args, **kwargs)
        if func.is_view or name in _NO_DATA:
            return func(*args, **kwargs)
        reads, writes = [], []
        bound = list(zip(func._schema.arguments, args)) + [
            (a, kwargs[a.name]) for a in func._schema.arguments if a.name in kwargs
        ]
        for arg, value in bound:
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            if not tensors:
                continue
            if ns == "c10d":
                write = arg.name in _C10D_WRITES or (name in _C10D_READ_WRITE_OPS and arg.name == "tensors")
            else:
                write = arg.alias_info is not None and arg.alias_info.is_write
            (writes if write else reads).extend(tensors)
        self.checker._kernel(f"{ns}.{name}", reads, writes)
        return func(*args, **kwargs)
