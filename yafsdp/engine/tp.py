"""Tensor-parallel parameters inside a unit's use, and the gradient norm over data parallel and TP.

See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py: the engine holds a TP
parameter's local tensor; here its gathered view is handed to the modules as a DTensor with the
parameter's TP layout, and the gradient norm counts each element of the global model once.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..comm import collectives

__all__ = ["specs_of", "as_dtensors", "is_dtensor", "refuse_recompute", "grad_norm"]


def is_dtensor(t) -> bool:
    """``t`` is a DTensor (no DTensor exists before torch.distributed.tensor is imported; not imported here)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def specs_of(params, pidx) -> list | None:
    """The TP layouts (``ParamInfo.tp``) of ``params[i]`` for ``i`` in ``pidx``; None when there is none."""
    specs = [params[i].tp for i in pidx]
    return specs if any(s is not None for s in specs) else None


def as_dtensors(specs: list, tensors: list) -> list:
    """Each of ``tensors`` (views of the weight buffer, gated or not) whose spec is not None as a
    DTensor with that layout; the others as they are. ``from_local`` is differentiable: its backward
    redistributes the weight's gradient to the parameter's placements (a ``Partial`` gradient of a
    ``Replicate`` parameter is summed over TP) and hands back the local tensor."""
    from torch.distributed.tensor import DTensor

    return [t if s is None else DTensor.from_local(t, s.mesh, s.placements, run_check=False, shape=s.shape,
                                                   stride=s.stride)
            for s, t in zip(specs, tensors)]


def refuse_recompute(unit_name: str) -> None:
    """A recompute in backward that runs the hooks of a unit with TP parameters (``torch.utils.checkpoint`` around
    the unit's call): refused (not supported yet). HF's activation checkpointing recomputes inside the unit's
    forward and reads the weights through ``orig_params._resolve_in_backward``, which hands them out as DTensors."""
    raise RuntimeError(
        f"yafsdp: unit {unit_name!r} holds tensor-parallel (DTensor) parameters and is recomputed in backward with "
        "its hooks (torch.utils.checkpoint around the unit's call): not supported yet with tensor parallelism; "
        "checkpoint inside the unit's forward instead (HF's model.gradient_checkpointing_enable() does)")


def _ranges(unit) -> tuple[list, list]:
    """(TP-sharded, replicated) element ranges of ``unit``'s local grad shard: [start, stop) pairs over the
    trainable group's shard (the padding in neither)."""
    lay = unit.layout
    lo, hi = lay.shard_start, lay.shard_start + lay.shard_numel
    sharded, replicated = [], []
    for p in lay.params:
        a, b = max(p.offset, lo), min(p.offset + p.numel, hi)
        if a < b:
            (sharded if p.tp is not None and p.tp.sharded else replicated).append((a - lo, b - lo))
    return sharded, replicated


@torch.no_grad()
def grad_norm(rt, units_and_grads: list, norm_type: float, dp_group, tp_group) -> torch.Tensor:
    """The total gradient norm of the global model from this rank's grad shards (``units_and_grads``:
    (unit, 1-D grad shard) pairs). A TP-sharded parameter's elements are spread over data parallel and TP;
    a replicated one's (a ``Replicate`` DTensor or a plain parameter) are the same on every TP rank and are
    counted over data parallel only. Collective over both groups."""
    parts = {True: [], False: []}
    for unit, g in units_and_grads:
        sharded, replicated = _ranges(unit)
        parts[True] += [g[a:b] for a, b in sharded]
        parts[False] += [g[a:b] for a, b in replicated]

    def local(pieces):
        if not pieces:
            return torch.zeros((), dtype=torch.float32, device=rt.host_device)
        norms = torch._foreach_norm(pieces, norm_type)
        if norm_type == float("inf"):
            return torch.stack(norms).max().float()
        return torch.stack([n.float() ** norm_type for n in norms]).sum()

    terms = rt.to_device(torch.stack([local(parts[True]), local(parts[False])]))
    if norm_type == float("inf"):
        collectives.all_reduce(terms, dp_group, op=dist.ReduceOp.MAX)
        collectives.all_reduce(terms, tp_group, op=dist.ReduceOp.MAX)
        return terms.max()
    collectives.all_reduce(terms, dp_group)  # every term summed over data parallel
    sharded = terms[:1].clone()
    collectives.all_reduce(sharded, tp_group)  # the sharded term over TP as well
    return (sharded[0] + terms[1]) ** (1.0 / norm_type)
