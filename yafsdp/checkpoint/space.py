"""A save that runs out of disk space says so.

[Note: a full disk]
Whatever writer fails -- DCP's data files (torch.save's zip writer loses the errno and reports
"[enforce fail at inline_container.cc] unexpected pos"), its ``.metadata``, the manifest -- a save
that ran out of space is reported as such: the checkpoint root, the bytes free there before the
save and the bytes the save needs (the estimate of ``contents.needed_bytes``). Two checks:

- before anything is written, rank 0 compares the free bytes of the root's filesystem
  (``os.statvfs``: blocks available to this user) with the estimate, and refuses the save when
  they do not suffice (nothing is written, the last checkpoint stays);
- when a write fails, the failure counts as "out of space" when an ENOSPC / EDQUOT is among its
  causes, or when the filesystem has less than :data:`FULL` bytes left at that moment (the
  writers that lose the errno fail on a full disk, which this sees before the partial save is
  removed).
"""
from __future__ import annotations

import errno
import os

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["free_bytes", "space_problem", "is_out_of_space", "FULL"]

FULL = 1 << 20  # fewer free bytes than this after a failed write: the disk is full


def free_bytes(path: str) -> int | None:
    """Bytes available to this user on the filesystem of ``path`` (or its nearest existing parent)."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _causes(e: BaseException):
    seen, todo = [], [e]
    while todo:
        x = todo.pop(0)
        if x is None or any(x is y for y in seen):
            continue
        seen.append(x)
        yield x
        if isinstance(x, CheckpointException):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in x.failures.values()]
        todo += [x.__cause__, x.__context__]


def is_out_of_space(e: BaseException, path: str) -> bool:
    if any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in _causes(e)):
        return True
    free = free_bytes(path)
    return free is not None and free < FULL


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def space_problem(root: str, free: int | None, needed: int) -> str:
    have = f"{free} bytes ({_mb(free)}) free there before this save" if free is not None else "free space unknown"
    return (f"out of disk space in {root!r}: {have}, the checkpoint needs about {needed} bytes ({_mb(needed)}). "
            "Free space there (or keep fewer checkpoints, or save to another folder) and save again")
