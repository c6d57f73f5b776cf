"""The watchdog: a stopped or stuck rank is named within a deadline, and one rank's error stops every rank.

[Note: the watchdog]
A rank that stops (SIGSTOP, a dead NFS mount, a data loader that never returns, a kernel that hangs)
leaves every other rank blocked in its next collective, silently, until the process group's timeout
(30 minutes by default), and a rank that raises alone leaves the others blocked the same way. Each
process runs one daemon thread that

- publishes a heartbeat under the rendezvous store (its own client connection, a prefix per
  torchrun attempt): the step, the phase (``data``, ``forward``, ``backward``, ``optimizer``,
  ``save``, ``export``, ``eval``, ``sample``, or the caller's), the unit the engine works on and the
  collective the host waits for (``yafsdp/comm/progress.py``), the default group's collective count;
- watches this rank's progress: any change of those counts as progress. After ``timeout`` seconds
  without it (``startup_timeout`` until the first ``step()``), it reads every rank's heartbeat,
  twice, ``poll`` seconds apart: a rank whose heartbeat stood still is *not responding* (stopped or
  dead); otherwise the ranks furthest behind (step, then collective count) are the stuck ones, and
  when every rank is at the same place it says so (a deadlock, or one very slow collective). It
  prints **one** line naming them and what every rank was doing, calls ``on_hang`` (the job writes
  its event and the flight recorder), publishes the verdict so that the other ranks stop with the
  same report, and ends the process with ``exit_code`` (``os._exit``: the main thread is blocked
  in a collective and cannot be unwound);
- watches the store's error key: ``fail()`` (the job calls it when an exception reaches it on
  one rank only) publishes the first error of the run with its rank, phase and step; every other
  rank's thread finds it within ``poll`` seconds and ends its process with the error's exit code,
  printing nothing (the raising rank printed it, once).

Under ``torchrun --max-restarts`` the failed worker group is restarted and resumes from its last
checkpoint; each attempt has its own key prefix, so a restarted group never reads the dead one's
verdict. The store is torchrun's agent store where there is one (it outlives any worker); without
torchrun, rank 0 hosts it, and a stopped rank 0 then also stops the store: the watchdog still
reports what it knows ("the store does not answer") within the deadline.

A saving rank that writes one large file for longer than ``timeout`` makes no progress either:
``phase(name, timeout=...)`` gives a phase a longer deadline (the job's saves and exports use
``--save-timeout``).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from ..comm.progress import POSITION

__all__ = ["Watchdog", "EXIT_HANG", "HangReport"]

EXIT_HANG = 4  # the exit status of a process stopped by the watchdog for a hang (docs/errors.md)


class HangReport(dict):
    """What the watchdog found at the deadline: ``line`` (the one line printed), ``stuck`` (ranks),
    ``ranks`` (each rank's heartbeat, or None where it could not be read), ``idle_s``."""

    @property
    def line(self) -> str:
        return self["line"]


def _seq() -> int:
    """The default group's collective count (gloo and NCCL both count), or -1."""
    try:
        return int(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - not initialised / a backend without it
        return -1


def _store_from_env(timeout_s: float):
    """A client connection of our own to the rendezvous store (torchrun's agent store, or rank 0's)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class Watchdog:
    """Name a stuck rank within a deadline; stop every rank when one fails. See [Note: the watchdog].

    ``timeout``: seconds without progress after the first ``step()``; ``startup_timeout`` before it.
    ``store``: a ``torch.distributed.Store`` shared by the ranks (default: a new client connection
    to ``MASTER_ADDR:MASTER_PORT``, else the default group's store). ``on_hang(report)`` and
    ``on_error(record)`` run on the watchdog thread before the process ends (keep them short: write
    an event, dump a trace). ``exit=False`` (tests): report and call the callbacks but do not end
    the process. Use it from your own loop::

        wd = yafsdp.Watchdog(timeout=300).start()
        for step in range(steps):
            with wd.phase("data"):
                batch = next(loader)
            loss = model(batch).loss          # the engine marks forward/backward per unit itself
            loss.backward()
            with wd.phase("optimizer"):
                opt.step(); opt.zero_grad()
            wd.step(step + 1)
        wd.stop()
    """

    def __init__(self, timeout: float = 120.0, *, startup_timeout: float = 600.0, poll: float | None = None,
                 store=None, rank: int | None = None, world: int | None = None, exit_code: int = EXIT_HANG,
                 on_hang: Callable[[HangReport], None] | None = None,
                 on_error: Callable[[dict], None] | None = None, exit: bool = True, name: str = "yafsdp"):
        for what, v in (("timeout", timeout), ("startup_timeout", startup_timeout)):
            if not (isinstance(v, (int, float)) and v == v and 0 < v < float("inf")):
                raise ValueError(f"yafsdp.Watchdog: {what} must be a finite number of seconds > 0, got {v!r}")
        self.timeout, self.startup_timeout = float(timeout), float(startup_timeout)
        self.poll = float(poll) if poll else max(0.2, min(2.0, self.timeout / 10))
        self.rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        self.world = world if world is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        self.exit_code, self.on_hang, self.on_error, self.exit, self.name = exit_code, on_hang, on_error, exit, name
        self._store_arg = store
        self.store = None
        self.current_step: int | None = None
        self.started_steps = False  # the first step() came: the training deadline applies
        self._phase = "startup"
        self._phase_timeout: float | None = None
        self._last_key = None
        self._last_progress = time.monotonic()
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beats_thread: threading.Thread | None = None
        self.report: HangReport | None = None  # set when a hang was declared (exit=False)
        self._claim = threading.Lock()  # one verdict per process: its own, or another rank's
        self._claimed = False
        self.error: dict | None = None  # the run's first error as published (fail() or another rank's)
        self.host = socket.gethostname()

    # ------------------------------------------------------------------------------ the caller's side
    def start(self) -> "Watchdog":
        if self._thread is not None:
            return self
        store = self._store_arg
        if store is None:
            try:
                store = _store_from_env(max(5.0, self.poll * 4))
            except Exception as e:  # noqa: BLE001 - the deadline still holds; only the ranks' exchange is lost
                _print(f"{self.name} watchdog (rank {self.rank}): no connection of its own to the rendezvous store "
                       f"({type(e).__name__}: {e}); using the process group's")
                store = None
        if store is None and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or "0"
        self.store = dist.PrefixStore(f"{self.name}_watchdog/attempt_{attempt}/", store) if store is not None else None
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the heartbeat thread tries again
            pass
        self._thread = threading.Thread(target=self._run, name="yafsdp-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watchdog's threads (joined: none is left behind)."""
        self._stop.set()
        for t in (self._thread, self._beats_thread):
            if t is not None and t is not threading.current_thread():
                t.join(timeout=self.poll * 4 + 15)
        self._thread = self._beats_thread = None

    def step(self, n: int) -> None:
        """Step ``n`` is done: progress, and from now on the training deadline applies."""
        self.current_step = n
        self.started_steps = True
        self._last_progress = time.monotonic()

    def set_phase(self, name: str, timeout: float | None = None) -> None:
        self._phase, self._phase_timeout = name, timeout
        POSITION.unit = None  # the engine names the unit again when it reaches one
        self._last_progress = time.monotonic()

    @property
    def current_phase(self) -> str:
        return self._phase

    @contextlib.contextmanager
    def phase(self, name: str, timeout: float | None = None):
        """``with wd.phase("save", timeout=900): ...``: this rank is in ``name`` (a longer deadline
        while it lasts where ``timeout`` is given); the previous phase is restored after it."""
        before = (self._phase, self._phase_timeout)
        self.set_phase(name, timeout)
        try:
            yield self
        finally:
            self._phase, self._phase_timeout = before
            self._last_progress = time.monotonic()

    def progress(self) -> None:
        """Mark progress by hand (e.g. after each file a long save writes)."""
        self._last_progress = time.monotonic()

    def fail(self, message: str, exit_code: int = 1) -> dict:
        """Publish this rank's error as the run's first one, unless another rank's came first.
        Returns the record that stands (``record["rank"] == self.rank``: this rank's; print it)."""
        record = dict(rank=self.rank, step=self.current_step, phase=self._phase, message=message,
                      exit_code=int(exit_code), host=self.host)
        stood = record
        if self.store is not None:
            try:
                got = self.store.compare_set("error", "", json.dumps(record))
                stood = json.loads(got.decode() if isinstance(got, bytes) else got)
            except Exception:  # noqa: BLE001 - the store is gone: this rank's own record stands
                stood = record
        self.error = stood
        return stood

    # -------------------------------------------------------------------------- the watchdog thread
    def _position(self) -> dict:
        return dict(step=self.current_step, phase=self._phase, unit=POSITION.unit, wait=POSITION.wait,
                    seq=_seq())

    def _publish(self) -> None:
        if self.store is None:
            return
        self._beat += 1
        rec = dict(self._position(), beat=self._beat, host=self.host, pid=os.getpid(),
                   idle_s=round(time.monotonic() - self._last_progress, 1))
        self.store.set(f"hb/{self.rank}", json.dumps(rec))

    def _deadline(self) -> float:
        base = self.timeout if self.started_steps else self.startup_timeout
        return max(base, self._phase_timeout) if self._phase_timeout else base

    def _run(self) -> None:
        """The deadline: never touches the store itself (a stopped store host must not silence it)."""
        self._beats_thread = threading.Thread(target=self._beats, name="yafsdp-watchdog-beats", daemon=True)
        self._beats_thread.start()
        while not self._stop.wait(self.poll):
            try:
                key = (self.current_step, self._phase, POSITION.moves, _seq())
                now = time.monotonic()
                if key != self._last_key:
                    self._last_key, self._last_progress = key, now
                idle = now - self._last_progress
                if idle > self._deadline() and self.error is None:
                    self._declare_hang(idle)
                    return
            except Exception as e:  # noqa: BLE001 - the watchdog must never take the job down by itself
                _print(f"{self.name} watchdog (rank {self.rank}): internal error {type(e).__name__}: {e}")
                return

    def _beats(self) -> None:
        """The heartbeat and the error key, on a thread of their own (store calls may block)."""
        while not self._stop.wait(self.poll):
            try:
                self._publish()
                err = self._read_error()
            except Exception:  # noqa: BLE001 - the store does not answer now; the deadline still holds
                continue
            if err is not None and self.report is None:
                self._on_remote_error(err)
                if not self.exit:
                    return

    def _read_error(self) -> dict | None:
        if self.store is None or not self.store.check(["error"]):
            return None
        raw = self.store.get("error")
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw) if raw else None

    def _take(self) -> bool:
        """Claim this process's one verdict (a hang it declares, or one it heard of)."""
        with self._claim:
            first, self._claimed = not self._claimed, True
            return first

    def _on_remote_error(self, err: dict) -> None:
        if err.get("rank") == self.rank and err.get("kind") != "hang":
            self.error = err
            return  # our own error: the main thread handles it
        if not self._take():
            return
        self.error = err
        if err.get("kind") == "hang":  # another rank declared the hang: the same report, one line here too
            self.report = HangReport(err["report"])
            _print(f"{self.name} watchdog (rank {self.rank}): {self.report.line}")
            if self.on_hang is not None:
                _safely(self.on_hang, self.report)
            self._end(self.exit_code)
            return
        if self.on_error is not None:
            _safely(self.on_error, err)
        self._end(int(err.get("exit_code", 1)))

    def _read_all(self) -> tuple[list, bool]:
        """Every rank's heartbeat (None where missing), and whether the store answered."""
        keys = [f"hb/{r}" for r in range(self.world)]
        try:
            present = [True] * len(keys) if self.store.check(keys) else [self.store.check([k]) for k in keys]
            vals = self.store.multi_get([k for k, p in zip(keys, present) if p]) if any(present) else []
        except Exception:  # noqa: BLE001 - see the Note: a stopped store host
            return [None] * self.world, False
        it = iter(vals)
        return [json.loads(next(it)) if p else None for p in present], True

    def _declare_hang(self, idle: float) -> None:
        if not self._take():
            return
        reader = _Reader(self)
        reader.start()
        reader.join(timeout=self.poll * 3 + 12)
        first, second, answered = reader.result if reader.result else ([None] * self.world, [None] * self.world, False)
        report = self._verdict(first, second, answered, idle)
        self.report = report
        _print(f"{self.name} watchdog (rank {self.rank}): {report.line}")
        if self.on_hang is not None:
            _safely(self.on_hang, report)
        if self.store is not None and answered:
            try:
                self.store.compare_set("error", "", json.dumps(dict(kind="hang", rank=self.rank, report=report,
                                                                     exit_code=self.exit_code)))
            except Exception:  # noqa: BLE001
                pass
            if self.exit:  # the others read the verdict (and say it) before a launcher tears them down
                time.sleep(self.poll + 0.5)
        self._end(self.exit_code)

    def _verdict(self, first: list, second: list, answered: bool, idle: float) -> HangReport:
        me = self._position()
        ranks = []
        for r in range(self.world):
            a, b = first[r], second[r]
            if r == self.rank:
                b = dict(me, beat=self._beat)
            alive = a is not None and b is not None and b.get("beat") != a.get("beat")
            ranks.append(dict(b or a or {}, rank=r, responding=alive if r != self.rank else True,
                              known=(b or a) is not None))
        silent = [d["rank"] for d in ranks if not d["responding"]]
        if not answered:
            stuck, why = [], "the rendezvous store does not answer (its host -- torchrun's agent, or rank 0 " \
                             "without torchrun -- may be stopped or dead)"
        elif silent:
            stuck, why = silent, "not responding (stopped or dead: no heartbeat for the last checks)"
        else:
            order = [((d.get("step") or 0), d.get("seq", -1)) for d in ranks]
            low = min(order)
            stuck = [d["rank"] for d, o in zip(ranks, order) if o == low]
            why = ("behind the others" if len(stuck) < len(ranks)
                   else "every rank is at the same place (a deadlock in the program, or one collective that "
                        "does not finish)")
        what = "; ".join(_describe(d) for d in ranks)
        names = ", ".join(str(r) for r in stuck) if stuck else "unknown"
        line = (f"no progress for {idle:.0f} s (deadline {self._deadline():.0f} s); stuck: rank {names} "
                f"({why}). Ranks: {what}")
        return HangReport(line=line, stuck=stuck, ranks=ranks, idle_s=round(idle, 1), rank=self.rank)

    def _end(self, code: int) -> None:
        if not self.exit:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Reader(threading.Thread):
    """Reads every heartbeat twice, ``poll`` apart, on a thread of its own: a store that does not
    answer must not keep the watchdog from reporting."""

    def __init__(self, wd: Watchdog):
        super().__init__(daemon=True, name="yafsdp-watchdog-reader")
        self.wd, self.result = wd, None

    def run(self):
        wd = self.wd
        if wd.store is None:
            self.result = ([None] * wd.world, [None] * wd.world, wd.world == 1)
            return
        first, ok1 = wd._read_all()
        time.sleep(max(wd.poll * 2, 1.0))
        try:
            wd._publish()
        except Exception:  # noqa: BLE001
            pass
        second, ok2 = wd._read_all()
        self.result = (first, second, ok1 and ok2)


def _describe(d: dict) -> str:
    if not d.get("known"):
        return f"rank {d['rank']}: no heartbeat"
    steps = d.get("step")
    parts = [f"rank {d['rank']}" + ("" if d.get("responding") else " (not responding; last heard)"),
             f"{steps if steps is not None else 0} steps done", d.get("phase") or "?"]
    if d.get("unit"):
        parts.append(d["unit"])
    if d.get("wait"):
        parts.append(f"waiting for the {d['wait']}")
    if d.get("seq", -1) >= 0:
        parts.append(f"collective #{d['seq']}")
    if d.get("host"):
        parts.append(f"{d['host']} pid {d.get('pid')}")
    return " ".join([parts[0] + ":", ", ".join(parts[1:])])


def _print(msg: str) -> None:
    """One write of the whole line: print()'s separate pieces interleave with other processes' output."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (msg + "\n").encode())
    except (OSError, ValueError):  # no file descriptor (a captured stderr)
        print(msg, file=sys.stderr, flush=True)


def _safely(fn, arg) -> None:
    try:
        fn(arg)
    except Exception as e:  # noqa: BLE001 - a callback's failure must not keep the process alive
        _print(f"yafsdp watchdog: callback {getattr(fn, '__name__', fn)!r} failed: {type(e).__name__}: {e}")
