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
The writer's groups have a timeout (``timeout=``; by default the default group's, which the jobs
set from their deadlines): a rank that stops or dies while the others write makes their collectives
fail after it instead of blocking the writer -- and every ``wait`` on it -- for good. Such a failure
leaves the writer's groups in an unknown state (a rank may still be inside the collective the others
gave up), so the saver refuses further saves, saying so; a storage error does not (its verdict was
agreed).
The thread is not a daemon: an interpreter that exits (the end of a script, an exception) waits
for the write to end. The staging buffers are kept for the next save (no reallocation); their
size is ``staging_bytes`` -- host memory on top of the engine's plan, the size of this rank's part
of the checkpoint.

[Note: asynchronous saves of HSDP]
As a synchronous save (see [Note: checkpoints of HSDP] in checkpoint/__init__.py), replica 0
writes and the other replicas wait for its verdict. ``save`` gathers the ``rank_state`` of this
rank's replicate group on the engine's replicate group (the training's, between steps, on the
calling thread: ``save`` is collective), and only replica 0 stages: the other replicas hold the
same shards, so they copy nothing (their ``staging_bytes`` is 0). The constructor makes two gloo
groups: the writers (replica 0's ranks: DCP, checksums, manifest, exactly the flat writer over
its shard group) and the verdict group (the world: global rank 0, shard 0 of replica 0, broadcasts
the writers' agreed outcome). Every rank's writer thread ends in that broadcast, so ``wait`` gives
every rank of every replica the same path or the same error, and the checkpoint is published
(and an older one rotated out) by replica 0 only once all of its writers' files are checksummed,
as in a flat save. The other replicas wait in the broadcast for the whole write: the timeout
must exceed the time of a save.

An engine with tensor-parallel parameters: every rank of the world stages its own boxes and writes them
(the world's gloo group is the writer group; see [Note: checkpoints with tensor parallelism] in
by_param.py), HSDP x TP included (replica 0's ranks stage the parameters, every rank its ``rank_state``).

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
from datetime import timedelta

import torch
import torch.distributed as dist

from ..comm.groups import broadcast_object, gather_object
from .by_param import collect, group_of, is_tp
from .contents import stage
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
    """Asynchronous checkpoints of ``model`` (a ``yafsdp.YaFSDP``, flat or HSDP) and ``optimizer``;
    see [Note: asynchronous saves] and [Note: asynchronous saves of HSDP]. Collective to construct
    (every rank of the default group, which a flat engine must shard over, or pass ``writer_group``:
    a gloo group of the engine's ranks; an HSDP engine covers the world and makes its own).
    ``timeout`` (seconds, or a timedelta): the deadline of each of the writer's collectives; by
    default the default process group's timeout. It must exceed the longest write of one rank's
    files (and, with HSDP, a whole save). Tensor parallel: the world writes, as a synchronous save."""

    def __init__(self, model, optimizer=None, *, writer_group=None, timeout: float | timedelta | None = None):
        timeout = _writer_timeout(timeout)
        self.verdicts = None  # HSDP: the world's gloo group on which replica 0 tells every rank the outcome
        self.tp = is_tp(model)  # every rank of the world writes its own boxes (see [Note: asynchronous saves])
        if self.tp:
            if writer_group is not None:
                raise CheckpointError(
                    "AsyncSaver: writer_group= is for a flat engine sharded over a subgroup; an engine with "
                    "tensor-parallel parameters is saved by the whole world, whose writer group is made here: drop "
                    "writer_group=")
            group_of(model, "AsyncSaver")
            writer_group = dist.new_group(backend="gloo", timeout=timeout)
        elif getattr(model, "replicate_group", None) is not None:
            if writer_group is not None:
                raise CheckpointError(
                    "AsyncSaver: writer_group= is for a flat engine sharded over a subgroup; an HSDP engine "
                    f"(mesh {tuple(model.mesh_shape)}) covers the world and its writer groups are made here: drop "
                    "writer_group=")
            writer_group, self.verdicts = _hsdp_groups(model, timeout)
        elif writer_group is None:
            if dist.get_world_size(model.process_group) != dist.get_world_size():
                raise CheckpointError(
                    "AsyncSaver: the engine shards over a subgroup of the world; pass writer_group= (a gloo group "
                    "of the engine's ranks, created with torch.distributed.new_group(ranks, backend='gloo', "
                    "timeout=...))")
            writer_group = dist.new_group(backend="gloo", timeout=timeout)  # the writer thread's own collectives
        self.model, self.optimizer, self.group = model, optimizer, writer_group
        self.timeout_s = timeout.total_seconds()
        self._buffers: dict = {}  # the staging copy's host tensors, reused by every save
        self.staging_bytes = 0
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._outcome: tuple | None = None  # (path, error, seconds) of the finished write
        self._reported = False
        self._broken: str | None = None  # a collective of the writer's groups failed: why (no save after it)

    # ----------------------------------------------------------------- the save
    def save(self, root: str, step: int, *, state: dict | None = None, rank_state=None, meta: dict | None = None,
             keep: int | None = None) -> Staged:
        """Collective. Wait for the previous save (raising its failure), stage this step's state
        and start writing it in the background; returns once the staging copy is taken (change the
        weights right after: the checkpoint holds the state of this call)."""
        t0 = time.perf_counter()
        self.wait()
        if self._broken is not None:
            raise CheckpointError(
                f"AsyncSaver: step {step} was not saved: an earlier background save failed in a collective of the "
                f"writer's groups ({self._broken}); a rank may still be inside it, so they cannot be used again. "
                "Make a new AsyncSaver (collective) or save with save_checkpoint")
        wait_for_root(root, "AsyncSaver.save", step)  # another saver's write into this root
        waited = time.perf_counter() - t0
        self.model.check_idle("AsyncSaver.save")
        t1 = time.perf_counter()
        if self.tp:  # the world writes (see [Note: checkpoints with tensor parallelism] in by_param.py)
            rank_states = {dist.get_rank(): rank_state}
            writes, world_record = True, dist.get_world_size()
        elif self.verdicts is None:
            rank_states = {dist.get_rank(self.model.process_group): rank_state}
            writes, world_record = True, None
        else:  # see [Note: asynchronous saves of HSDP]: replica 0 writes its replicate group's rank_states
            rank_states = dict(gather_object((dist.get_rank(), rank_state), self.model.replicate_group))
            writes, world_record = self.model.replica == 0, dist.get_world_size()
        staged_entries, nbytes = None, 0
        if writes:
            collected = collect(self.model, self.optimizer, state, rank_states)
            entries, nbytes = stage(collected[0], self._buffers)
            staged_entries = (entries, collected[1])
        self.staging_bytes = nbytes
        staged = time.perf_counter() - t1

        def write():
            t = time.perf_counter()
            path, error = None, None
            try:
                try:
                    if staged_entries is not None:
                        path = _save(root, step, self.model, self.optimizer, state, {}, meta, keep, world_record,
                                     group=self.group, collected=staged_entries)
                except BaseException as e:  # noqa: BLE001 - kept for the caller's thread
                    error = e
                broken = error is not None and not isinstance(error, CheckpointError)  # a collective failed
                if self.verdicts is not None:  # replica 0's outcome on every rank, its groups' state with it
                    try:
                        mine = None if error is None else (_describe(error), broken)
                        verdict = broadcast_object(mine, self.verdicts)
                        if verdict is not None and error is None:
                            error, broken = CheckpointError(verdict[0]), verdict[1]
                        path = None if error is not None else checkpoint_dir(root, step)
                    except BaseException as e:  # noqa: BLE001 - a rank stopped or died: the timeout
                        error, broken = (error if error is not None else e), True
                if broken:  # said once here, raised by wait() as every failure
                    self._broken = _describe(error)
                    stalled = CheckpointError(
                        f"a collective of the background writer failed on global rank {dist.get_rank()} "
                        f"({self._broken}): a rank stopped or died while the others wrote, or its write took longer "
                        f"than the writer's timeout ({self.timeout_s:g} s: AsyncSaver(timeout=...), the job's "
                        f"--save-timeout). Earlier checkpoints are untouched; step {step} counts only if "
                        f"latest_checkpoint({root!r}) names it (a partial save is removed by the next save)")
                    stalled.__cause__, error = error, stalled
            finally:
                self._outcome = (path, error, time.perf_counter() - t)
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
            raise CheckpointError(f"the background save of step {step} failed: {_describe(error)}") from error
        return path

    def close(self) -> str | None:
        """``wait()`` and drop the staging buffers."""
        try:
            return self.wait()
        finally:
            self._buffers = {}


def _describe(error: BaseException) -> str:
    """A failure's message as ``wait`` raises it (a CheckpointError's own; else type: message)."""
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}".strip()


def _writer_timeout(timeout) -> timedelta:
    """``timeout`` as a timedelta; None: the default group's timeout (the process group's deadline a
    launcher or the job set), else torch's default for gloo."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif timeout is not None:
        seconds = timeout
    else:
        return _default_group_timeout()
    if not (isinstance(seconds, (int, float)) and seconds == seconds and 0 < seconds < float("inf")):
        raise CheckpointError(f"AsyncSaver: timeout must be a finite number of seconds > 0, got {timeout!r}")
    return timedelta(seconds=seconds)


def _default_group_timeout() -> timedelta:
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no such backend on the group, or a torch without these names
            continue
    return dist.distributed_c10d._get_default_timeout("gloo")


def _hsdp_groups(model, timeout: timedelta):
    """Collective over the world: (the writers' gloo group, replica 0's ranks; the verdict's gloo
    group, the world). See [Note: asynchronous saves of HSDP]."""
    mine = (model.replica, dist.get_rank())
    writers = sorted(g for replica, g in gather_object(mine) if replica == 0)
    return (dist.new_group(writers, backend="gloo", timeout=timeout),
            dist.new_group(backend="gloo", timeout=timeout))
