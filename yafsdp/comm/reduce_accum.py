"""Reducing gradients in a narrow dtype while summing them in fp32 (``reduce_accum_dtype``).

[Note: narrow reduce, fp32 accumulation]
``reduce_dtype=torch.bfloat16`` halves the bytes of every reduce against fp32, but a
reduce-scatter in bf16 also *sums* in bf16: every partial sum is rounded to 8 significant bits.
Where the ranks' contributions cancel (a large ``+x`` on one rank, ``-x`` plus the signal on
another) the running sum is large while the result is small, and the signal is lost in the
roundings of the partial sums.

``reduce_accum_dtype=torch.float32`` keeps the bf16 bytes on the wire and does the sum in fp32:

- the grad buffer stays in ``reduce_dtype`` (each rank's contribution is rounded to bf16 once,
  when its backward writes it there);
- instead of a reduce-scatter, an all-to-all (``collectives.all_to_all``) moves every rank's
  piece of this rank's shard into the grad buffer's landing (``world x shard`` values in
  ``reduce_dtype``, in rank order); the bytes sent and received are those of a bf16
  reduce-scatter: ``(world - 1) / world`` of the grad buffer each way;
- the fold (:func:`fold_pieces_`) sums the pieces in fp32, in rank order, scales the sum by
  ``1 / world`` (HSDP: ``1 / (world x replicas)``) and writes (first micro-batch) or adds it into
  the fp32 grad shard. When it adds, the sum is formed in the grad buffer's fp32 accumulator and
  added by the fp32 reduce's own fold kernel (``kernels.accumulate_``, one fused multiply-add), so
  that given the same fp32 sum both folds give the same bits. (Where the contributions are exact in
  ``reduce_dtype`` -- the grads of a ``param_dtype=torch.bfloat16`` backward -- and the world is 2,
  the fp32 sums are the same too: such a run equals the fp32 reduce's bit for bit, tested.)

Error. Let ``g_r`` be rank ``r``'s contribution to one element and ``u = 2^-8`` the unit roundoff
of bf16 (``2^-11`` for fp16), ``e = 2^-24`` fp32's. The bf16 rounding gives
``b_r = g_r (1 + d_r)``, ``|d_r| <= u``; summing ``world`` values in fp32 in order adds at most
``(world - 1) e sum|b_r|`` (to first order); the scale one more ``e |result|``. The fp32 reduce
itself carries ``(world - 1) e sum|g_r|`` (in some order). So, per element,

    |accumulated - fp32 reduce| <= scale * sum_r |g_r| * (u + 2 world e) + 2 e |fp32 reduce|

and the first term dominates: one bf16 rounding per contribution, whatever the cancellation; where
the contributions are exact in bf16 (a bf16 backward's grads), the result is the fp32 sum. A bf16
running sum adds, besides those roundings, ``u |p_k|`` for every partial sum ``p_k``: with
cancellation (``+x`` on one rank, ``-x`` on another, the signal elsewhere) the partial sums are of
the size of ``x`` while the result is of the size of the signal, and the signal is rounded away
(tests/multirank/test_reduce_accum.py: errors of 1/4 on results of order 1 at world 4, where the fp32
accumulation is exact). Up to ``(world - 1) u sum|g_r|`` in all: the gap grows with the world.

Memory: the landing is a second grad buffer's worth of ``reduce_dtype`` values, the accumulator one
fp32 shard: a bf16 grad buffer pair with fp32 accumulation takes the bytes of an fp32 one (both sized
by :func:`yafsdp.layout.sizing.plan_buffers`). Offload is refused for now: its reduced shard goes to the
host in ``reduce_dtype`` (one value per element, not every rank's piece).

HSDP: the fold leaves fp32 values in the grad shard; the all-reduce across replicas runs on that
fp32 shard as always ([Note: the cross-replica all-reduce] in engine/replicas.py), so the replicas' sum is in
fp32 too (at fp32's bytes: that collective is 1/shard of the reduce's size).
"""
from __future__ import annotations

import torch

from .. import kernels

__all__ = ["check_reduce_accum", "fold_pieces_", "fold_pieces_reference", "error_bound", "unit_roundoff"]


def check_reduce_accum(reduce_accum_dtype, reduce_dtype: torch.dtype, offload: str | None = None):
    """The validated ``reduce_accum_dtype`` of YaFSDP and the plan: ``torch.float32`` when the reduce
    sums pieces in fp32, None when it sums in ``reduce_dtype`` (also for an fp32 ``reduce_dtype``,
    which already sums in fp32). Anything else is refused by name."""
    if reduce_accum_dtype is None:
        return None
    if reduce_accum_dtype is not torch.float32:
        raise ValueError(
            f"yafsdp.YaFSDP: reduce_accum_dtype={reduce_accum_dtype!r} is not supported; use torch.float32 (sum "
            "the reduce_dtype pieces in fp32) or None (sum in reduce_dtype)")
    if reduce_dtype == torch.float32:
        return None  # the reduce-scatter already sums in fp32
    if offload is not None:
        raise ValueError(
            f"yafsdp.YaFSDP: reduce_accum_dtype=torch.float32 with offload={offload!r} is not supported yet: the "
            "reduced grad shard goes to the host in reduce_dtype. Use reduce_dtype=torch.float32 with offload, or "
            "drop offload")
    return torch.float32


def unit_roundoff(dtype: torch.dtype) -> float:
    """eps / 2: the largest relative error of one rounding to ``dtype`` (2^-8 for bf16, 2^-24 for fp32)."""
    return torch.finfo(dtype).eps / 2


def error_bound(contributions: torch.Tensor, scale: float, reduce_dtype: torch.dtype = torch.bfloat16,
                reference: torch.Tensor | None = None) -> torch.Tensor:
    """Per element, the bound of [Note: narrow reduce, fp32 accumulation] on
    |fp32-accumulated reduce - fp32 reduce| for ``contributions`` (world x n, each rank's fp32
    values before any rounding) scaled by ``scale``; ``reference``: the fp32 reduce's result."""
    world = contributions.shape[0]
    u, e = unit_roundoff(reduce_dtype), unit_roundoff(torch.float32)
    bound = scale * contributions.abs().double().sum(0) * (u + 2 * world * e)
    if reference is not None:
        bound = bound + 2 * e * reference.abs().double()
    return bound


def fold_pieces_reference(dst: torch.Tensor, pieces: torch.Tensor, scale: float, accumulate: bool) -> torch.Tensor:
    """The twin: ``dst (=|+=) (sum over the rows of pieces, in fp32, in row order) * scale``."""
    total = pieces[0].float()
    for row in pieces[1:]:
        total = total + row.float()
    if accumulate:
        return kernels.accumulate_reference(dst, total, scale)
    return kernels.cast_reference(dst, total, scale)


def fold_pieces_(dst: torch.Tensor, pieces: torch.Tensor, scale: float, accumulate: bool,
                 accum: torch.Tensor) -> torch.Tensor:
    """``dst`` (1-D fp32, n) ``=`` (or ``+=`` with ``accumulate``) the fp32 sum of the rows of
    ``pieces`` (world x n, ``reduce_dtype``) in row order, times ``scale``; ``accum`` (1-D fp32, n):
    room for the sum when adding. Bit for bit :func:`fold_pieces_reference`, with no temporary: one
    pass per row, in place (a fused kernel would read each piece once; see docs/reduce.md)."""
    if pieces.dim() != 2 or pieces.shape[1] != dst.numel() or (accumulate and accum.numel() != dst.numel()):
        raise ValueError(f"yafsdp fold_pieces_: pieces {tuple(pieces.shape)}, dst {dst.numel()}, "
                         f"accum {accum.numel()}: expected world x n, n and n")
    out = accum if accumulate else dst
    out.copy_(pieces[0])
    for row in pieces[1:]:
        out.add_(row)
    if accumulate:
        return kernels.accumulate_(dst, accum, scale)  # dst += sum * scale, as the fp32 reduce's fold
    return out.mul_(scale)  # one rounding of the product, as kernels.cast_
