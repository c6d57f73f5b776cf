"""Where this rank is: the unit the engine works on and the collective it waits for, for the watchdog.

The engine writes two attributes of one module-level object at each unit's forward and backward and
around each host wait for a collective (cheap: attribute stores, no lock); ``yafsdp.tools.watchdog``
reads them from its thread to say what a stuck rank was doing and to tell progress from a hang. The
time spent in those waits is summed as well: the job's per-rank communication wait (stragglers).
"""
from __future__ import annotations

import time

__all__ = ["POSITION", "Position", "waiting"]


class Position:
    """What the engine of this process is doing now (one per process; read by the watchdog)."""

    __slots__ = ("unit", "wait", "comm_wait_s", "moves")

    def __init__(self):
        self.unit: str | None = None  # "forward model.layers.3" / "backward model.layers.3"
        self.wait: str | None = None  # "gather of unit 'model.layers.3'" while the host waits for it
        self.comm_wait_s = 0.0  # seconds the host spent waiting for collectives (gloo handles)
        self.moves = 0  # bumped at every change: the watchdog's evidence of progress

    def at(self, what: str, unit: str) -> None:
        self.unit = f"{what} {unit}"
        self.moves += 1


POSITION = Position()


def waiting(work, what: str, unit: str) -> None:
    """``work.wait()``, recorded: what is waited for while it lasts, and for how long in total."""
    p = POSITION
    p.wait = f"{what} of unit {unit!r}"
    p.moves += 1
    t = time.perf_counter()
    try:
        work.wait()
    finally:
        p.comm_wait_s += time.perf_counter() - t
        p.wait = None
        p.moves += 1
