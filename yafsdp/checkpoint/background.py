"""Saving without stopping training: :class:`AsyncSaver`.

    saver = ckpt.AsyncSaver(model, optimizer)        # collective: creates the writer's gloo group
    saver.save(root, step, state=..., rank_state=..., keep=3)   # collective; returns after staging
    ...train on...
    saver.poll()                                      # the path once complete (rank-local, never raises)
    saver.wait()                                      # collective point: the path, or CheckpointError

[Note: asynchronous saves]
``save`` waits for the previous save (at most one in flight; the wait is returned, so a caller
can report it), copies every tensor of the checkpoint into host buffers -- the *staging copy*:
the master shards' unpadded slices, the optimizer state, the buffers, the encoded ``state`` and
``rank_state`` -- and returns. The training loop is blocked only for that copy. A writer thread
then runs the very same save as ``save_checkpoint`` (``_save``: DCP write, checksums, manifest,
rename, rotation) on the staged entries, so a checkpoint counts (manifest, rename) only once
every rank's write finished, and a failure or a kill at any moment leaves the previous
checkpoints as a synchronous save would.

The writer's collectives (DCP's planning and its "all ranks wrote" agreement, the checksum
gather, the verdicts) run on a gloo group of their own, created once in the constructor: the
training's collectives on the engine's group go on meanwhile from the main thread, and two
gloo groups do not share connections, so neither waits for nor mismatches with the other.

A failure of the background phase is kept and raised by the next ``save``, by ``wait`` and by
``close`` -- on every rank alike, since ``_save`` agrees on its verdict across the writer group.
The thread is not a daemon: an interpreter that exits (the end of a script, an exception) waits
for the write to end. The staging buffers are kept for the next save (no reallocation); their
size is ``staging_bytes`` -- host memory on top of the engine's plan, the size of this rank's part
of the checkpoint.

[Note: one save at a time per root]
A save removes the ``.tmp.*`` directories it finds under its root (killed saves), which would
include one being written in the background. So every write in flight is registered by its root
(``_IN_FLIGHT``, per process; every rank has its own writer); ``save_checkpoint`` and another
saver's ``save`` into that root first wait for it (``wait_for_root``) and report the wait with a
CheckpointWarning naming the step, the root and the seconds. They only join the writer thread:
its outcome (a failure included) stays with its saver, raised by that saver's next ``save``,
``wait`` or ``close``.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass

import torch.distributed as dist

from .contents import collect, stage
from .files import CheckpointError, CheckpointWarning, checkpoint_dir
from .write import _save

__all__ = ["AsyncSaver", "Staged", "wait_for_root"]

_IN_FLIGHT: dict = {}  # realpath(root) -> (thread, step) of the write in flight there (this process)
_LOCK = threading.Lock()


def _key(root: str) -> str:
    return os.path.realpath(root)


def wait_for_root(root: str, who: str, step: int) -> float:
    """Wait for a background save in flight into ``root`` (see [Note: one save at a time per
    root]); returns the seconds waited (0 when none was in flight). The wait is reported with a
    CheckpointWarning."""
    with _LOCK:
        thread, other = _IN_FLIGHT.get(_key(root), (None, None))
    if thread is None or thread is threading.current_thread() or not thread.is_alive():
        return 0.0
    t = time.perf_counter()
    thread.join()
    waited = time.perf_counter() - t
    warnings.warn(f"{who} of step {step} into {root!r} waited {waited:.1f} s for the background save of step {other} "
                  "into the same folder to finish (a save removes the unfinished saves it finds there, which would "
                  "have included that one); its outcome is reported by its AsyncSaver's next save(), wait() or "
                  "close()", CheckpointWarning, stacklevel=3)
    return waited


@dataclass
class Staged:
    """What ``AsyncSaver.save`` returns: the checkpoint it will write and the time it blocked."""

    step: int
    path: str  # the checkpoint directory, complete once poll()/wait() return it
    waited_s: float  # waiting for the previous save to finish
    staged_s: float  # the staging copy
    staging_bytes: int


class AsyncSaver:
    """Asynchronous checkpoints of ``model`` (a flat ``yafsdp.YaFSDP``) and ``optimizer``; see
    [Note: asynchronous saves]. Collective to construct (every rank of the default group, which
    the engine must shard over, or pass ``writer_group``: a gloo group of the engine's ranks)."""

    def __init__(self, model, optimizer=None, *, writer_group=None):
        if getattr(model, "replicate_group", None) is not None:
            raise CheckpointError("AsyncSaver: asynchronous saves of an HSDP engine (mesh=...) are not supported "
                                  "yet; use save_checkpoint (synchronous)")
        if writer_group is None:
            if dist.get_world_size(model.process_group) != dist.get_world_size():
                raise CheckpointError(
                    "AsyncSaver: the engine shards over a subgroup of the world; pass writer_group= (a gloo group "
                    "of the engine's ranks, created with torch.distributed.new_group(ranks, backend='gloo'))")
            writer_group = dist.new_group(backend="gloo")  # the writer thread's own collectives
        self.model, self.optimizer, self.group = model, optimizer, writer_group
        self._buffers: dict = {}  # the staging copy's host tensors, reused by every save
        self.staging_bytes = 0
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._outcome: tuple | None = None  # (path, error, seconds) of the finished write
        self._reported = False

    # ----------------------------------------------------------------- the save
    def save(self, root: str, step: int, *, state: dict | None = None, rank_state=None, meta: dict | None = None,
             keep: int | None = None) -> Staged:
        """Collective. Wait for the previous save (raising its failure), stage this step's state
        and start writing it in the background; returns once the staging copy is taken (change the
        weights right after: the checkpoint holds the state of this call)."""
        t0 = time.perf_counter()
        self.wait()
        wait_for_root(root, "AsyncSaver.save", step)  # another saver's write into this root
        waited = time.perf_counter() - t0
        self.model.check_idle("AsyncSaver.save")
        t1 = time.perf_counter()
        rank = dist.get_rank(self.model.process_group)
        collected = collect(self.model, self.optimizer, state, {rank: rank_state})
        entries, nbytes = stage(collected[0], self._buffers)
        self.staging_bytes = nbytes
        staged = time.perf_counter() - t1

        def write():
            t = time.perf_counter()
            try:
                path = _save(root, step, self.model, self.optimizer, state, {}, meta, keep, None,
                             group=self.group, collected=(entries, collected[1]))
                self._outcome = (path, None, time.perf_counter() - t)
            except BaseException as e:  # noqa: BLE001 - kept for the caller's thread
                self._outcome = (None, e, time.perf_counter() - t)
            finally:
                with _LOCK:
                    if _IN_FLIGHT.get(_key(root), (None,))[0] is threading.current_thread():
                        del _IN_FLIGHT[_key(root)]

        self._step, self._outcome, self._reported = step, None, False
        self._thread = threading.Thread(target=write, name=f"yafsdp-ckpt-step{step}", daemon=False)
        with _LOCK:
            _IN_FLIGHT[_key(root)] = (self._thread, step)
        self._thread.start()
        return Staged(step, checkpoint_dir(root, step), waited, staged, nbytes)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> tuple[str, float] | None:
        """(path, seconds the write took) once, when the background save has completed
        successfully; else None. Rank-local and never raises (failures are raised by wait())."""
        out = self._outcome
        if out is None or out[0] is None or self._reported or self.in_flight:
            return None
        self._reported = True
        return out[0], out[2]

    def wait(self) -> str | None:
        """Wait for the save in flight; its path (None if none was started), or CheckpointError
        when it failed (the previous checkpoints are kept). Every rank gets the same verdict."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        path, error, _ = self._outcome
        if error is not None:
            step, self._outcome = self._step, None
            msg = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
            raise CheckpointError(f"the background save of step {step} failed: {msg}") from error
        return path

    def close(self) -> str | None:
        """``wait()`` and drop the staging buffers."""
        try:
            return self.wait()
        finally:
            self._buffers = {}
