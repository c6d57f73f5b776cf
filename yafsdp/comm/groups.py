"""Small distributed helpers shared by the engine, the checkpoints and the jobs.

- :func:`source_rank` — the global rank of a group's rank 0 (what ``src=`` arguments take).
- :func:`raise_together` — "decide on rank 0, tell every rank": rank 0's verdict
  (``None`` when all is well, else a message) is broadcast and every rank raises on it, so all of
  them raise together instead of one rank raising while the others wait in the next collective.
- :func:`raise_if_any` — every rank decides (each checked its own share); the first problem of
  any rank is raised on every rank.
"""
from __future__ import annotations

import os
import pickle
import weakref

import torch
import torch.distributed as dist

from .collectives import all_gather, broadcast

__all__ = ["source_rank", "raise_together", "raise_if_any", "broadcast_object", "gather_object",
           "CollectiveError", "debug_sync", "check_collective"]


def source_rank(group=None) -> int:
    """Global rank of ``group``'s rank 0 (the default group: 0)."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


def _object_device(group) -> torch.device:
    if str(dist.get_backend(group)).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bytes(data: bytes, device) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


# The object collectives are built on collectives.py rather than torch's *_object functions, whose
# transient tensors a gloo worker thread may free during interpreter exit (see [Note: gloo work
# and interpreter exit] in collectives.py): every tensor here is retained or moved by messages.
def broadcast_object(obj, group=None):
    """Collective: rank 0's ``obj`` (picklable) on every rank of ``group``."""
    if dist.get_world_size(group) == 1:
        return obj
    dev, src = _object_device(group), source_rank(group)
    mine = dist.get_rank(group) == 0
    data = pickle.dumps(obj) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    broadcast(size, src, group)
    buf = _bytes(data, dev) if mine else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    broadcast(buf, src, group)
    return obj if mine else pickle.loads(buf.cpu().numpy().tobytes())


def gather_object(obj, group=None) -> list:
    """Collective: every rank's ``obj`` (picklable), in rank order, on every rank of ``group``."""
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    dev = _object_device(group)
    data = pickle.dumps(obj)
    sizes = torch.empty(world, dtype=torch.int64, device=dev)
    all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=dev), group, async_op=False)
    n = sizes.tolist()
    width = max(n)
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)
    buf[:len(data)] = _bytes(data, dev)
    out = torch.empty(world * width, dtype=torch.uint8, device=dev)
    all_gather(out, buf, group, async_op=False)
    raw = out.cpu().numpy().tobytes()
    return [pickle.loads(raw[r * width:r * width + n[r]]) for r in range(world)]


def raise_together(problem: str | None, group, error: type[Exception], prefix: str = "") -> None:
    """Collective: raise ``error(prefix + problem)`` on every rank when rank 0's ``problem`` is set
    (the other ranks' argument is ignored)."""
    verdict = broadcast_object(problem, group)
    if verdict:
        raise error(f"{prefix}{verdict}")


def raise_if_any(problem: str | None, group, error: type[Exception]) -> None:
    """Collective: raise ``error`` with the first (lowest-rank) problem on every rank, if any."""
    first = next((p for p in gather_object(problem, group) if p), None)
    if first:
        raise error(first)


# [Note: collective mismatches]
# Every rank must issue the engine's collectives in the same order (NCCL requires it, and the gloo
# point-to-point collectives match messages by a per-group counter). A rank that runs one more
# micro-step, skips a backward, or calls full_state_dict() / a checkpoint alone breaks that; without
# help the job then hangs until the process group's timeout and gloo says only "Timed out waiting
# for recv". Two aids:
# - always (gloo): a failed wait is re-raised naming the collective and the unit, with the likely
#   causes and how to find the first mismatch;
# - debug mode, YAFSDP_DEBUG_SYNC=1 (or torch's TORCH_DISTRIBUTED_DEBUG=DETAIL) on every rank: before
#   each collective the ranks exchange what they are about to run (a small all_gather_object: a host
#   sync, for debugging only) and the first disagreement raises on every rank, naming each rank's
#   operation and unit.

class CollectiveError(RuntimeError):
    """The ranks did not run the same collectives."""


def debug_sync() -> bool:
    """Debug mode on (see [Note: collective mismatches])."""
    return (os.environ.get("YAFSDP_DEBUG_SYNC", "").strip().lower() in ("1", "true", "yes", "on")
            or os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL")


_COUNTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # group -> collectives checked (debug mode)


def check_collective(what: str, group) -> None:
    """Debug mode only: every rank of ``group`` must be about to run ``what`` (as its n-th checked
    collective); otherwise CollectiveError on every rank, naming each rank's operation."""
    if not debug_sync():
        return
    key = group if group is not None else dist.group.WORLD
    n = _COUNTS.get(key, 0)
    _COUNTS[key] = n + 1
    mine = (n, what)
    everyone = gather_object(mine, key)
    if any(x != mine for x in everyone):
        ranks = "; ".join(f"rank {r}: #{c} {w}" for r, (c, w) in enumerate(everyone))
        raise CollectiveError(
            f"yafsdp: collective mismatch (YAFSDP_DEBUG_SYNC): the ranks are about to run different collectives "
            f"({ranks}); this rank ({dist.get_rank(key)}) is at #{n} {what}. Make every rank run the same "
            "forwards, backwards, state-dict and checkpoint calls in the same order"
        )
