"""Small distributed helpers shared by the engine, the checkpoints and the jobs.

- :func:`source_rank` — the global rank of a group's rank 0 (what ``src=`` arguments take).
- :func:`agree` / :func:`raise_together` — "decide on rank 0, tell every rank": rank 0's verdict
  (``None`` when all is well, else a message) is broadcast and every rank raises on it, so all of
  them raise together instead of one rank raising while the others wait in the next collective.
- :func:`raise_if_any` — every rank decides (each checked its own share); the first problem of
  any rank is raised on every rank.
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["source_rank", "agree", "raise_together", "raise_if_any", "broadcast_object"]


def source_rank(group=None) -> int:
    """Global rank of ``group``'s rank 0 (the default group: 0)."""
    if group is None or group is dist.group.WORLD:
        return 0
    return dist.get_global_rank(group, 0)


def broadcast_object(obj, group=None):
    """Collective: rank 0's ``obj`` (picklable) on every rank of ``group``."""
    box = [obj]
    dist.broadcast_object_list(box, src=source_rank(group), group=group)
    return box[0]


def agree(problem: str | None, group=None) -> str | None:
    """Collective: rank 0's ``problem`` (other ranks' argument is ignored) on every rank."""
    return broadcast_object(problem, group)


def raise_together(problem: str | None, group, error: type[Exception], prefix: str = "") -> None:
    """Collective: raise ``error(prefix + problem)`` on every rank when rank 0's ``problem`` is set."""
    verdict = agree(problem, group)
    if verdict:
        raise error(f"{prefix}{verdict}")


def raise_if_any(problem: str | None, group, error: type[Exception]) -> None:
    """Collective: raise ``error`` with the first (lowest-rank) problem on every rank, if any."""
    problems = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    first = next((p for p in problems if p), None)
    if first:
        raise error(first)
