"""Where a rank's piece of each parameter lies in the parameter's global tensor, with tensor parallelism.

A rank's flat shard holds, of each parameter it overlaps, a range ``[a, b)`` of the flattened *local* tensor
(its TP slice; the whole tensor without TP). :func:`boxes` cuts such a range into boxes of the local tensor: a
partial first row, the whole rows, a partial last row (recursively inside a row for more than two dims), at most
``2 * ndim - 1`` of them, each contiguous in the shard. Adding the rank's TP offset along the parameter's ``Shard``
dim (:func:`tp_offset`) places them in the global tensor. The sharded checkpoints (checkpoint/by_param.py) write
and read such boxes, and ``yafsdp.init.init_shards_`` fills them with the values the parameter's global tensor
has (:func:`rows_of`, :func:`copy_out`: the whole rows the boxes touch, computed once, then the boxes copied out).
See [Note: checkpoints with tensor parallelism] in checkpoint/by_param.py.
"""
from __future__ import annotations

import torch

__all__ = ["tp_specs", "boxes", "tp_offset", "param_boxes", "rows_of", "copy_out"]


def tp_specs(model) -> dict:
    """Parameter name -> its TPSpec (layout/dtensor.py) for every tensor-parallel parameter of ``model`` (a
    ``yafsdp.YaFSDP``); {} without TP."""
    return {ref.fqn: ref.tp for _, kind, ref in model._keys.entries if kind == "param" and ref.tp is not None}


def boxes(shape: tuple, a: int, b: int) -> list[tuple[tuple, tuple, int]]:
    """Elements ``[a, b)`` of the row-major flattening of a tensor of ``shape`` as boxes ``(offsets, sizes,
    start)``: each box holds the elements ``[start, start + prod(sizes))`` of the flattening, in order."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,), (b - a,), a)] if shape else [((), (), 0)]
    inner = torch.Size(shape[1:]).numel()

    def row(r, lo, hi):  # a range inside row r
        return [((r, *o), (1, *s), r * inner + st) for o, s, st in boxes(shape[1:], lo, hi)]

    first, whole_end = a // inner, b // inner
    if first == (b - 1) // inner:
        return row(first, a - first * inner, b - first * inner)
    out = []
    if a % inner:
        out += row(first, a % inner, inner)
        first += 1
    if whole_end > first:
        out.append(((first, *[0] * (len(shape) - 1)), (whole_end - first, *shape[1:]), first * inner))
    if b % inner:
        out += row(whole_end, 0, b % inner)
    return out


def tp_offset(spec, local_shape: tuple, tp_rank: int, name: str) -> tuple[int, int] | None:
    """(dim, offset) of TP rank ``tp_rank``'s slice of a ``Shard(dim)`` parameter in its global shape (torch splits
    as ``torch.chunk``: ``ceil(n / T)`` per TP rank, the last ones fewer); None for a replicated or plain one.
    ValueError if the local shape is not that split of the global one."""
    if spec is None:
        return None
    glob = tuple(spec.shape)
    shard = next((p for p in spec.placements if p.is_shard()), None)
    if shard is None:
        want, where = glob, None
    else:
        dim = shard.dim % len(glob)
        n, tp = glob[dim], spec.mesh.size()
        size = -(-n // tp)
        start = min(tp_rank * size, n)
        want, where = tuple(min(size, n - start) if d == dim else s for d, s in enumerate(glob)), (dim, start)
    if tuple(local_shape) != want:
        raise ValueError(
            f"parameter {name!r}: its local tensor has shape {tuple(local_shape)} on TP rank {tp_rank}, not the "
            f"{want} of torch's split of its global shape {glob} ({spec.placements})")
    return where


def param_boxes(info, flat: torch.Tensor, specs: dict, tp_rank: int) -> list[tuple[str, tuple, list]]:
    """For every parameter of the flat group ``info`` (a ShardInfo of plain values): (name, global shape, boxes),
    the boxes ``(global offsets, view)`` of the part of it in this rank's shard, ``view`` a view of ``flat`` (the
    shard, or optimizer state shaped like it; 1-D, from the shard's start). A parameter outside the shard gets no
    boxes; the padding is in none."""
    lo, hi = info.shard_start, info.shard_start + min(info.shard_numel, max(0, info.numel - info.shard_start))
    out = []
    for name, shape, off in zip(info.param_names, info.param_shapes, info.param_offsets):
        spec = specs.get(name)
        where = tp_offset(spec, shape, tp_rank, name)
        numel = torch.Size(shape).numel()
        pieces = []
        for offsets, sizes, start in boxes(tuple(shape), max(lo, off) - off, min(hi, off + numel) - off):
            view = flat[off + start - lo:off + start - lo + torch.Size(sizes).numel()].view(sizes)
            if where is not None:
                offsets = tuple(o + where[1] if d == where[0] else o for d, o in enumerate(offsets))
            pieces.append((tuple(offsets), view))
        out.append((name, tuple(spec.shape) if spec is not None else tuple(shape), pieces))
    return out


def rows_of(shape: tuple, pieces: list) -> tuple[int, int, int]:
    """(first row, end row, elements per row) of the whole rows (dim 0 of the global ``shape``) that ``pieces``
    (non-empty, from :func:`param_boxes`) touch: elements ``[first * inner, end * inner)`` of the flattening."""
    if not shape:
        return 0, 1, 1
    return (min(o[0] for o, _ in pieces), max(o[0] + t.shape[0] for o, t in pieces),
            torch.Size(shape[1:]).numel())


@torch.no_grad()
def copy_out(rows: torch.Tensor, shape: tuple, pieces: list) -> None:
    """Each piece's view <- its box of ``rows`` (1-D: the global tensor's rows from :func:`rows_of`)."""
    first, end, _ = rows_of(shape, pieces)
    full = rows.view(end - first, *shape[1:]) if shape else rows.view(())
    for offsets, view in pieces:
        src = full
        for d, (o, n) in enumerate(zip(offsets, view.shape)):
            src = src.narrow(d, o - first if d == 0 else o, n)
        view.copy_(src)
