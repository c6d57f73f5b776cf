"""Quantized gradient reduction (``grad_quant="int8"`` / ``"fp8"``): the reduce-scatter of a grad
buffer sent across nodes as 8-bit blocks, and HSDP's all-reduce across replicas likewise. The
collectives here know nothing of units or hooks; the engine hands them to the schedule
(``Schedule.reduce(..., collective=)``, ``Schedule.use_across``) and sizes their room in the plan.

[Note: quantized gradient reduction]
Across nodes the links are several times slower than inside one. With ``grad_quant`` the
reduce-scatter of a unit's gradient over the shard group (``W`` ranks) runs in two stages, with the
group cut into ``N = W / L`` node groups of ``L = grad_quant_node`` consecutive ranks (rank
``r = n L + l``: node ``n``, local index ``l``):

1. inside the node, in ``reduce_dtype``: for each node ``m`` the ranks of node ``n`` reduce-scatter
   the ``L`` shards of node ``m``'s ranks (``N`` reduce-scatters over the node group, each over a
   contiguous slice of the grad buffer); local rank ``l`` receives ``p_m``, node ``n``'s partial sum of
   the shard of rank ``m L + l``, for every ``m``. On NCCL each is reduced in place (the grad buffer's
   own slice), on gloo into the room's stage. With ``L = 1`` this stage is the buffer itself.
2. across nodes, compact: each ``p_m`` with ``m != n`` is quantized into one *record* of the gather
   format of the same name (``yafsdp.formats``: int8 or e4m3 codes, then one fp32 scale per block of
   128 values; the piece zero-padded to whole blocks), and one all-to-all over the *cross group* (the
   ranks with the same ``l`` in every node) delivers to rank ``m L + l`` the record of ``p_m`` from
   every node. The receiver dequantizes each record in fp32 and sums the ``N`` partials in node order
   in an fp32 accumulator -- its own node's ``p_n`` unquantized: it never crossed a link. The fp32 sum
   (the room's ``total``) is the reduced shard the fold scales into the grad shard. No partial sum is
   ever held in 8 bits: each value is quantized once, by its sender, and summed in fp32.

Bytes per rank and step for a unit of ``W S`` elements (``S`` a shard) in ``reduce_dtype`` of ``b``
bytes: inside the node ``(L - 1) / L x W S b`` (as a reduce-scatter over ``L`` ranks), across nodes
``(N - 1) x rec(S)`` with ``rec(S) ~ 1.03 S`` bytes, against ``(W - 1) S b`` for the plain
reduce-scatter of which ``(N - 1) L S b`` cross the node boundary (a ring or tree spreads them so):
in bf16 about 1/2, in fp32 about 1/4 of the cross-node bytes.

HSDP's all-reduce across the ``R`` replicas (every link of it crosses nodes) is, with ``grad_quant``,
a quantized reduce-scatter followed by an all-gather of the reduced pieces in compact form
(:class:`QuantAllReduce`): the fp32 grad shard, in segments of at most the room's size, is cut into
``R`` pieces; piece ``j`` of every other replica goes to replica ``j`` as a record (all-to-all), which
sums the ``R`` pieces in fp32 (its own unquantized), quantizes the sum once, and an all-gather of the
records gives every replica every reduced piece, dequantized -- the owner uses the dequantized value
too, so every replica holds the same bits (the replicas must stay identical).

Error (per element, against the fp32 reduce; [Note: the error of a quantized reduce] below).

Room: one preallocated byte tensor per grad buffer (``GradBuffer.quant``; the plan sizes it with
:func:`reduce_room_bytes`) holds the fp32 ``total`` (the output), an fp32 block-padded scratch piece,
the stage-1 output on gloo, and the send and receive records; one more for the replicas
(:func:`all_reduce_room_bytes`). The quantize and dequantize are the formats' ``encode_`` /
``expand_`` (the fp8 kernels of ``yafsdp.kernels``, or their pure-PyTorch twins), which make their
own temporaries of one piece, as the formats' twins do.

[Note: the error of a quantized reduce]
A record's block with scale ``s`` (``amax / 127`` for int8, ``amax / 448`` for e4m3) gives back each of
its values within half a quantization step: ``s / 2`` for int8 (a uniform grid of step ``s``), and
``16 s`` for e4m3 (codes up to 448 < 512 have a spacing of at most 32; half of it). So for one element
of the shard, with ``hs_m`` the half step of the block holding it in the record from node ``m``:

    |quantized reduce - fp32 reduce| <= sum over m != n of hs_m  +  4 W e sum_r |g_r|

where ``g_r`` are the ranks' contributions to that element and ``e = 2^-24``: the second term covers
the fp32 roundings (the division by the scale, the products, the sums in a different order than the
reference's). The bound holds whatever the ranks' values: ranks that cancel (``+x`` on one node,
``-x`` on another) quantize to exactly opposite records (the quantization is symmetric), so their sum
is exactly 0; an outlier in a block widens that block's step only; a block of zeros is exact. The
fold then scales by ``1 / (W R)`` (one more rounding). With a 16-bit ``reduce_dtype`` the stage-1 sums
carry that dtype's roundings besides, as the plain reduce-scatter's do. For the replica all-reduce,
piece ``j`` carries the half steps of the ``R - 1`` records it received plus one of its own record of
the sum (:func:`error_bound` with ``requantized=True``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import P2PWork, all_gather, all_to_all, reduce_scatter

__all__ = ["QuantReduce", "QuantAllReduce", "reduce_room_bytes", "all_reduce_room_bytes", "half_step",
           "error_bound", "HALF_STEP"]

# Half a quantization step, in units of the block's scale, per format name (see [Note: the error of a
# quantized reduce]).
HALF_STEP = {"int8": 0.5, "fp8": 16.0}
_ALIGN = 16  # bytes every part of a room starts at a multiple of


def _up(n: int, k: int) -> int:
    return -(-n // k) * k


def _padded(codec, n: int) -> int:
    """Values of one record for a piece of ``n``: whole blocks."""
    return _up(max(n, 1), codec.block)


def _record(codec, n: int) -> int:
    return codec.record_bytes(_padded(codec, n), torch.float32)


def reduce_room_bytes(codec, nodes: int, node: int, piece: int, reduce_dtype: torch.dtype, staged: bool) -> int:
    """Bytes of one grad buffer's room for :class:`QuantReduce` with pieces (shards) of up to ``piece``
    elements: the fp32 total, the fp32 scratch, the stage-1 output (``staged``: the backend does not
    reduce in place, and ``node > 1``), and the send and receive records."""
    isz = torch.empty((), dtype=reduce_dtype, device="meta").element_size()
    parts = [4 * piece, 4 * _padded(codec, piece), nodes * piece * isz if staged and node > 1 else 0,
             nodes * _record(codec, piece), nodes * _record(codec, piece)]
    return sum(_up(p, _ALIGN) for p in parts)


def all_reduce_room_bytes(codec, replicas: int, segment: int) -> int:
    """Bytes of the room of :class:`QuantAllReduce` over ``replicas`` for segments of up to ``segment``
    elements: two fp32 padded pieces and the send and receive records."""
    p = -(-segment // replicas)
    parts = [4 * _padded(codec, p), 4 * _padded(codec, p), replicas * _record(codec, p),
             replicas * _record(codec, p)]
    return sum(_up(x, _ALIGN) for x in parts)


def _carve(room: torch.Tensor, *parts: tuple[int, torch.dtype]) -> list[torch.Tensor]:
    """Consecutive views of ``room`` (1-D uint8): ``(elements, dtype)`` each, each part aligned."""
    out, at = [], 0
    for n, dtype in parts:
        isz = torch.empty((), dtype=dtype, device="meta").element_size()
        out.append(room[at:at + n * isz].view(dtype))
        at += _up(n * isz, _ALIGN)
    if at > room.numel():
        raise ValueError(f"yafsdp quantized reduce: the room has {room.numel()} bytes, {at} needed")
    return out


def _encode(codec, record: torch.Tensor, values: torch.Tensor, scratch: torch.Tensor) -> None:
    """``record`` <- the codec's record of ``values`` zero-padded to ``scratch``'s whole blocks (fp32)."""
    n = values.numel()
    scratch[:n].copy_(values)
    scratch[n:].zero_()
    codec.encode_(record, scratch)


def _decode(codec, record: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``scratch`` (fp32, whole blocks) <- the values of ``record``."""
    codec.expand_(scratch, record, scratch.numel())
    return scratch


class QuantReduce:
    """The hierarchical reduce-scatter of [Note: quantized gradient reduction] over one shard group:
    called as ``collective(room, total, full, async_op)`` by the schedule (through ``GradBuffer``)."""

    def __init__(self, codec, world: int, rank: int, node: int, node_group, cross_group, in_place: bool):
        self.codec = codec
        self.world, self.node, self.nodes = world, node, world // node
        self.here, self.local = divmod(rank, node)  # this rank's node n and local index l
        self.node_group = node_group  # the L ranks of this node (None when L == 1)
        self.cross_group = cross_group  # the ranks with this local index in every node
        self.in_place = in_place  # NCCL: stage 1 reduces into the grad buffer's own slices

    def on(self, room: torch.Tensor) -> "_OnRoom":
        """This reduce with ``room`` (a grad buffer's): what ``Schedule.reduce(collective=)`` takes."""
        return _OnRoom(self, room)

    def views(self, room: torch.Tensor, full: torch.Tensor, piece: int):
        """(total, scratch, stage, send, recv) for a grad buffer ``full`` of ``world x piece``."""
        codec, n_rec = self.codec, _record(self.codec, piece)
        staged = not self.in_place and self.node > 1
        total, scratch, stage, send, recv = _carve(
            room, (piece, torch.float32), (_padded(codec, piece), torch.float32),
            (self.nodes * piece if staged else 0, full.dtype), (self.nodes * n_rec, torch.uint8),
            (self.nodes * n_rec, torch.uint8))
        return total, scratch, stage.view(self.nodes, piece) if staged else None, \
            send.view(self.nodes, n_rec), recv.view(self.nodes, n_rec)

    def output(self, room: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """The fp32 reduced shard (the room's ``total``) the collective writes for ``full``."""
        return self.views(room, full, full.numel() // self.world)[0]

    def counted(self, full: torch.Tensor) -> list[tuple[str, int]]:
        """(kind, bytes this rank puts into the collectives) of one call: the node stage (``reduce``, the
        grad buffer, as a plain reduce counts) and the cross-node records (``reduce_quant``)."""
        piece = full.numel() // self.world
        out = [("reduce_quant", self.nodes * _record(self.codec, piece))]
        if self.node > 1:
            out.insert(0, ("reduce", full.numel() * full.element_size()))
        return out

    @torch.no_grad()
    def __call__(self, room: torch.Tensor, total: torch.Tensor, full: torch.Tensor, async_op: bool):
        W, L, N, n, l, codec = self.world, self.node, self.nodes, self.here, self.local, self.codec
        S = full.numel() // W
        total_, scratch, stage, send, recv = self.views(room, full, S)
        if total.data_ptr() != total_.data_ptr() or total.numel() != S:
            raise ValueError(f"yafsdp quantized reduce: the output is not the room's total of {S} elements")
        # 1. inside the node, in reduce_dtype: p_m (node n's partial of rank m L + l's shard) for every m
        if L == 1:
            pieces = full.view(N, S)
        elif self.in_place:
            for m in range(N):
                part = full[m * L * S:(m + 1) * L * S]
                reduce_scatter(part[l * S:(l + 1) * S], part, self.node_group, async_op=False)
            pieces = full.view(N, L, S)[:, l]
        else:
            works = [reduce_scatter(stage[m], full[m * L * S:(m + 1) * L * S], self.node_group, async_op=True)
                     for m in range(N)]
            for w in works:
                if w is not None:
                    w.wait()
            pieces = stage
        # 2. across nodes: every other node's partial as one record, one all-to-all
        for m in range(N):
            if m != n:
                _encode(codec, send[m], pieces[m], scratch)
        work = all_to_all(recv.view(-1), send.view(-1), self.cross_group, async_op=async_op)

        def finish() -> None:  # dequantized and summed in fp32, node order; our own partial exact
            for m in range(N):
                v = pieces[m] if m == n else _decode(codec, recv[m], scratch)[:S]
                total.copy_(v) if m == 0 else total.add_(v)

        if async_op:
            return P2PWork([work] if work is not None else [], finish)
        finish()
        return None


class _OnRoom:
    """A :class:`QuantReduce` bound to one grad buffer's room: ``(out, full, async_op)``."""

    def __init__(self, reduce: QuantReduce, room: torch.Tensor):
        self.reduce, self.room = reduce, room

    def output(self, full: torch.Tensor) -> torch.Tensor:
        return self.reduce.output(self.room, full)

    def counted(self, full: torch.Tensor) -> list[tuple[str, int]]:
        return self.reduce.counted(full)

    def __call__(self, out: torch.Tensor, full: torch.Tensor, async_op: bool):
        return self.reduce(self.room, out, full, async_op)


class QuantAllReduce:
    """HSDP's all-reduce across the replicas with ``grad_quant`` (see [Note: quantized gradient
    reduction]): ``across(grad, async_op)`` leaves in ``grad`` (1-D fp32) the same values on every
    replica, complete on return (gloo: a completed handle)."""

    def __init__(self, codec, group, room: torch.Tensor, segment: int):
        self.codec = codec
        self.group = group
        self.replicas = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.room = room  # see all_reduce_room_bytes
        self.segment = segment  # elements all-reduced per round

    def counted(self, grad: torch.Tensor) -> list[tuple[str, int]]:
        """(kind, bytes) of one call: the records of the all-to-all and the all-gather, per segment."""
        out = 0
        for lo in range(0, grad.numel(), self.segment):
            n = min(self.segment, grad.numel() - lo)
            out += 2 * self.replicas * _record(self.codec, -(-n // self.replicas))
        return [("all_reduce_quant", out)]

    @torch.no_grad()
    def __call__(self, grad: torch.Tensor, async_op: bool = False):
        for lo in range(0, grad.numel(), self.segment):
            self._segment(grad[lo:lo + self.segment])
        return P2PWork([]) if async_op else None

    def _segment(self, seg: torch.Tensor) -> None:
        R, me, codec = self.replicas, self.me, self.codec
        P = -(-seg.numel() // R)
        Pp, n_rec = _padded(codec, P), _record(codec, P)
        scratch, total, send, recv = _carve(self.room, (Pp, torch.float32), (Pp, torch.float32),
                                            (R * n_rec, torch.uint8), (R * n_rec, torch.uint8))
        send, recv = send.view(R, n_rec), recv.view(R, n_rec)
        parts = [seg[min(j * P, seg.numel()):min((j + 1) * P, seg.numel())] for j in range(R)]
        for j in range(R):  # reduce-scatter: every other replica's piece as a record
            if j != me:
                _encode(codec, send[j], parts[j], scratch)
        all_to_all(recv.view(-1), send.view(-1), self.group, async_op=False)
        for r in range(R):  # summed in fp32, replica order; our own piece exact
            if r == me:
                scratch[:parts[me].numel()].copy_(parts[me])
                scratch[parts[me].numel():].zero_()
                v = scratch
            else:
                v = _decode(codec, recv[r], scratch)
            total.copy_(v) if r == 0 else total.add_(v)
        codec.encode_(send[me], total)  # the sum quantized once; every replica (the owner too) uses its values
        all_gather(recv.view(-1), send[me], self.group, async_op=False)
        for j in range(R):
            if parts[j].numel():
                parts[j].copy_(_decode(codec, recv[j], scratch)[:parts[j].numel()])


# ---------------------------------------------------------------------------- bounds (tests)
def half_step(codec, values: torch.Tensor) -> torch.Tensor:
    """Per value of ``values`` (1-D fp32, one sender's piece), half a quantization step of the block
    that holds it in that sender's record (see [Note: the error of a quantized reduce])."""
    n = values.numel()
    padded = torch.zeros(_padded(codec, n), dtype=torch.float64)
    padded[:n] = values.double()
    qmax = 127.0 if codec.name == "int8" else 448.0
    scale = padded.view(-1, codec.block).abs().amax(dim=1) / qmax
    return (HALF_STEP[codec.name] * scale * (1 + 2 ** -16)).repeat_interleave(codec.block)[:n]


def error_bound(codec, partials: torch.Tensor, own: int | None, contributions: torch.Tensor,
                requantized: torch.Tensor | None = None) -> torch.Tensor:
    """Per element, the bound of [Note: the error of a quantized reduce] on |quantized sum - fp32 sum|:
    ``partials`` (senders x n, fp32): each sender's values as quantized (the node partials; for the
    replica all-reduce the replicas' pieces), ``own``: the sender whose values are not quantized (None:
    every one is); ``contributions`` (ranks x n): the ranks' values before any sum (the fp32 slack);
    ``requantized``: the reduced values quantized once more (the replica all-reduce's all-gather)."""
    e = 2.0 ** -24
    bound = 4 * contributions.shape[0] * e * contributions.double().abs().sum(0)
    for m in range(partials.shape[0]):
        if m != own:
            bound = bound + half_step(codec, partials[m])
    if requantized is not None:
        bound = bound + half_step(codec, requantized) + 4 * e * requantized.double().abs()
    return bound
