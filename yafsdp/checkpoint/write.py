"""The body of a save, shared by ``save_checkpoint`` and the background writer (``AsyncSaver``):
the DCP write into ``root/.tmp.step_N``, checksums, the manifest, the atomic rename, rotation, and a
failure's verdict agreed across the writer group ([Note: atomic saves] in ``checkpoint/__init__.py``).
Its own module so that background.py needs nothing from the package it is part of (no import cycle).
A test that replaces one of its file operations (``crc32``, ``write_json_atomic``, ``publish_checkpoint``)
replaces it here, in ``yafsdp.checkpoint.write``, where the save looks it up."""
from __future__ import annotations

import os
import shutil
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..comm.groups import gather_object, raise_together
from .by_param import collect, manifest_layout
from .contents import _units, describe_buffers, needed_bytes, settings
from .dcp_glue import SavePlanner
from .space import free_bytes, is_out_of_space, space_problem
from .files import (
    FORMAT,
    MANIFEST,
    PREFIX,
    TMP_PREFIX,
    CheckpointError,
    CheckpointWarning,
    checkpoint_dir,
    crc32,
    describe_os_error,
    foreign_dirs,
    publish_checkpoint,
    remove_checkpoint,
    remove_trash,
    rotate_checkpoints,
    unfinished_saves,
    write_json_atomic,
)


def _group_info(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _save(root, step, model, optimizer, state, rank_states: dict, meta, keep, world_record,
          group=None, collected=None) -> str:
    """The save of one shard group; ``rank_states``: this rank's entries ``rank_state.<key>``;
    ``world_record``: the world size the manifest records (None: the group's). An asynchronous
    save (see background.py) runs this on its writer thread with its own ``group`` and the
    ``collected`` (entries, optimizer description) it staged; it then reads nothing of ``model``
    but its static layout."""
    group = group if group is not None else model.process_group
    rank, world = _group_info(group)
    if collected is None:
        model.check_idle("save_checkpoint")
        collected = collect(model, optimizer, state, rank_states)
    entries, opt_desc = collected
    needed = needed_bytes(model, entries)
    final = checkpoint_dir(root, step)
    tmp = os.path.join(root, f"{TMP_PREFIX}{PREFIX}{step:08d}")
    free = free_bytes(root)  # before this save writes (see [Note: a full disk])

    problem = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            for stale in unfinished_saves(root):  # killed saves: never complete, safe to drop
                remove_checkpoint(stale, root)
            remove_trash(root)  # a removal killed mid-way (a rotation's): a whole checkpoint's bytes
            for other in foreign_dirs(root):  # not ours: reported, never deleted
                if other == final:
                    problem = (f"cannot save step {step}: {final!r} already exists without a {MANIFEST} (not "
                               "written by a save: a copy in progress?); move it away or delete it, then save again")
                    break
                warnings.warn(f"{other!r} has no {MANIFEST}: not a complete checkpoint, skipped and left in place",
                              CheckpointWarning, stacklevel=2)
            free = free_bytes(root)  # after removing killed saves
            if problem is None and free is not None and free < needed:
                problem = f"step {step} was not saved: {space_problem(root, free, needed)}; nothing was written"
            if problem is None:
                os.makedirs(tmp)
        except OSError as e:
            problem = f"cannot prepare checkpoint directory {tmp!r}: {describe_os_error(e)}"
            if is_out_of_space(e, root):
                problem += f"; {space_problem(root, free, needed)}"
    raise_together(problem, group, CheckpointError)

    problem = None
    try:
        dcp.save(entries, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), planner=SavePlanner(),
                 process_group=group)
        # Checksums: each rank a share of the files (the directory is shared).
        files = sorted(f for f in os.listdir(tmp) if f != MANIFEST)
        mine = {f: dict(bytes=os.path.getsize(os.path.join(tmp, f)), crc32=crc32(os.path.join(tmp, f)))
                for f in files[rank::world]}
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        who = _failing_rank(e, rank, group)
        problem = f"saving checkpoint into {tmp!r} failed on rank {who}: {_root_cause(e)}"
        if is_out_of_space(e, tmp):  # checked before the partial save is removed
            problem = f"{space_problem(root, free, needed)} (saving into {tmp!r} failed on rank {who}: " \
                      f"{_root_cause(e)})"
        mine = {}
    # Every rank reaches this gather, failed or not (DCP raises on every rank together; a failed
    # checksum is one rank's): no rank is left waiting, and rank 0 removes the partial save only
    # once no rank writes into it any more.
    parts = gather_object((problem, mine), group)
    problems = [p for p, _ in parts if p]  # a rank that saw the disk full says more than one that did not
    problem = next((p for p in problems if p.startswith("out of disk space")), problems[0] if problems else None)
    if problem is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{problem}; the partial save was removed, earlier checkpoints are untouched")
    sums: dict[str, dict] = {}
    for _, part in parts:
        sums.update(part)

    problem = None
    if rank == 0:
        manifest = dict(
            format=FORMAT, step=int(step), world_size=world_record or world,
            mesh=list(getattr(model, "mesh_shape", (1, world))), saved_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
            torch=torch.__version__, units=_units(model), optimizer=opt_desc,
            buffers=describe_buffers(model), settings=settings(model, world_record or world),
            meta=meta or {}, files=sums, **manifest_layout(model),
        )
        try:
            write_json_atomic(os.path.join(tmp, MANIFEST), manifest)
            publish_checkpoint(tmp, final, root)  # see [Note: replacing a checkpoint]
            if keep is not None and keep > 0:
                rotate_checkpoints(root, step, keep)
        except OSError as e:
            problem = f"finishing checkpoint {final!r} failed: {describe_os_error(e)}"
            if is_out_of_space(e, tmp):
                problem = f"{space_problem(root, free, needed)} ({problem})"
            if os.path.isdir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                problem += "; the partial save was removed"
    raise_together(problem, group, CheckpointError)
    return final


def _failing_rank(e: BaseException, rank: int, group=None) -> int:
    """The global rank whose write failed (DCP raises every rank's failures on every rank, keyed by
    their rank in ``group``: a writer group's ranks are not the world's under HSDP or a subgroup)."""
    if isinstance(e, CheckpointException) and e.failures:
        rank = min(e.failures)
    if group is None:
        return rank
    try:
        return dist.get_global_rank(group, rank)
    except (ValueError, RuntimeError):  # not a registered group (a test's stand-in): its own numbering
        return rank


def _root_cause(e: BaseException) -> str:
    """The first OSError inside ``e`` (DCP wraps each rank's failure in a CheckpointException),
    as errno + path; else the exception's type and first line."""
    seen = []
    todo = [e]
    while todo:
        x = todo.pop(0)
        if x is None or any(x is y for y in seen):
            continue
        seen.append(x)
        if isinstance(x, CheckpointError):  # ours, raised inside DCP (a refused file): it names the file
            return str(x)
        if isinstance(x, OSError):
            return describe_os_error(x)
        if isinstance(x, CheckpointException):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in x.failures.values()]
        todo += [x.__cause__, x.__context__]
    first = str(e).strip().splitlines()
    if isinstance(e, CheckpointException):  # no OSError inside: the failing ranks' last lines
        last = [pair[0] for pair in e.failures.values() if isinstance(pair, tuple)]
        return "; ".join(f"{type(x).__name__}: {x}" for x in last) or (first[0] if first else type(e).__name__)
    return f"{type(e).__name__}: {first[0] if first else ''}"
