"""The buffer sizing the engine allocates by, and nothing else: pure functions of the units'
layouts. See [Note: one plan, one allocator] in ``yafsdp/plan/__init__.py``."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

import torch

from .. import formats
from .flat import FlatLayout
from ..formats import PLAIN, Format
from ..comm.quant_reduce import all_reduce_room_bytes, reduce_room_bytes

GiB = 1024**3

_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}

# Optimizer state bytes per shard element (fp32 master shards).
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "none": 0}


@dataclass(frozen=True)
class BufferSpec:
    """One preallocated buffer, as the runtime allocates it."""

    name: str  # the engine's slot name (also its key in ``allocated_bytes()``)
    kind: str  # "weight" | "grad"
    capacity: int  # elements: one gathered flat unit
    shard_capacity: int  # grad slots: elements of the reduce-scatter staging (0: reduced in place); weight slots: 0
    dtype: torch.dtype
    role: str  # "buffers" (the alternating pair; ZeRO-2: per unit) | "outsized" | "small"
    # weight slots: bytes of the staging area compact (NF4) gathers land in before their expand
    # (see [Note: the compact staging area]); 0 when no unit of the slot has a compact group
    staging_bytes: int = 0
    # weight slots with offload="all": bytes of the device landing a unit's host frozen shard and NF4
    # record are copied into before their all-gathers (see [Note: the frozen landing]); else 0
    landing_bytes: int = 0
    # grad slots with fp32 accumulation: fp32 elements of the accumulator (one shard); the staging
    # (shard_capacity) is then the all-to-all's landing, world x shard. See [Note: narrow reduce,
    # fp32 accumulation] in reduce_accum.py. Else 0.
    accum_capacity: int = 0
    # grad slots with grad_quant: bytes of the quantized reduce's room (its fp32 sum, scratch, stage and
    # records; the "replica" slot: HSDP's quantized all-reduce). See [Note: quantized gradient
    # reduction] in comm/quant_reduce.py. Else 0.
    quant_bytes: int = 0
    # weight slots at world 1 under ZeRO-3: the buffer's memory exists only while a unit is gathered into it
    # (from its gather to its release), not between steps. See [Note: world-1 buffers in use only].
    in_use: bool = False

    @property
    def nbytes(self) -> int:
        return ((self.capacity + self.shard_capacity) * itemsize(self.dtype) + self.staging_bytes + self.landing_bytes
                + 4 * self.accum_capacity + self.quant_bytes)


@dataclass(frozen=True)
class QuantPlan:
    """What ``grad_quant`` asks of the buffers (see [Note: quantized gradient reduction] in
    comm/quant_reduce.py): ``nodes`` node groups of ``node`` ranks in the shard group (``nodes`` 1: its
    reduce is not quantized), ``replicas`` (HSDP; above 1 their all-reduce is), ``staged``: the backend
    does not reduce in place (the node stage's output needs room)."""

    codec: Format
    nodes: int
    node: int
    replicas: int
    staged: bool

    def reduce_bytes(self, shard: int, reduce_dtype: torch.dtype) -> int:
        if self.nodes == 1:
            return 0
        return reduce_room_bytes(self.codec, self.nodes, self.node, shard, reduce_dtype, self.staged)


def quant_plan(grad_quant: str | None, grad_quant_node: int, world: int, replicas: int,
               reduce_in_place: bool) -> QuantPlan | None:
    """The :class:`QuantPlan` of the options for a shard group of ``world`` ranks, or None (nothing is
    quantized); refuses a ``grad_quant_node`` that does not divide ``world``, by value."""
    if grad_quant is None:
        return None
    if world % grad_quant_node:
        raise ValueError(
            f"yafsdp.YaFSDP: grad_quant_node={grad_quant_node} does not divide the shard group's {world} ranks; pass "
            f"the ranks of one node (consecutive ranks of the shard group), a divisor of {world}")
    nodes = world // grad_quant_node
    if nodes == 1 and replicas == 1:
        return None
    return QuantPlan(formats.get(grad_quant), nodes, grad_quant_node, replicas, not reduce_in_place)


@dataclass
class BufferPlan:
    weight: list[BufferSpec]  # in allocation order
    grad: list[BufferSpec]  # in allocation order
    weight_of: list[int]  # per flat unit (units in order, the small group last): index into weight
    grad_of: list[int]  # likewise into grad
    outsized: list[bool]  # per unit (small group excluded)
    # per flat unit (as weight_of): columns of the unit's (world x shard) gradient per reduce when
    # it is reduced in chunks through the grad pair (see [Note: chunked outsized gradients]); 0: whole
    grad_chunk: list[int] = None
    chunk_slots: list[int] = None  # the grad slots the chunks alternate over (the pair), else empty
    # world 1: every unit's fp32 grad shard is a tensor of its own, allocated at the unit's first fold
    # of a step and freed by zero_grad(set_to_none=True); the engine keeps no grad store. See [Note:
    # the grad shard's lifetime at world 1].
    step_grads: bool = False
    # per flat unit (as weight_of): world 1, its trainable group gathered by casting the fp32 master
    # into its weight buffer; it has no compute copy. See [Note: the world-1 cast gather].
    cast_of: list[bool] = None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def unit_align(compute_dtype: torch.dtype, reduce_dtype: torch.dtype, align_bytes: int) -> int:
    """Elements per rank a flat unit's length is padded to (``align_bytes`` of the narrower dtype)."""
    elem = min(torch.finfo(compute_dtype).bits, torch.finfo(reduce_dtype).bits) // 8
    return max(1, align_bytes // elem)


def repeated_blocks(names: list[str]) -> list[bool]:
    """Per unit: is it a member of a repeated block list? See [Note: outsized units]."""
    prefix = [(m.group(1) or "") if (m := re.fullmatch(r"(.*\.)?\d+", n)) else None for n in names]
    count: dict[str, int] = {}
    for p in prefix:
        if p is not None:
            count[p] = count.get(p, 0) + 1
    return [p is not None and count[p] >= 2 for p in prefix]


# [Note: outsized units]
# An outsized unit (a 128k-vocab embedding or head) gets its own buffer so that it does not set
# the size of the alternating pair. Repeated blocks are what the pair is for, so they are never
# outsized: a unit is outsized when it is not a block of a repeated block list and is larger than
# ``outsized_ratio`` x the largest such block. The blocks are recognised by their names (units are
# named by module path; a ModuleList's children end in ".<index>", e.g. "model.layers.7"), two or
# more under one prefix. A model without such a list (e.g. explicit units with other names) falls
# back to ``outsized_ratio`` x the median unit. (The median alone misfires on small models: with
# vocab 256, hidden 64 and 2 layers the embedding and head are half the units, so the median is
# the embedding and both decoder layers would be outsized.)
# [Note: chunked outsized gradients]
# An outsized unit's gradient needs no grad buffer of its own (``chunk_outsized``, the default
# ``chunk_outsized_grads=True``). Its flat gradient, viewed as ``world x shard`` (row r: what rank r
# receives), is reduced in column chunks of the pair's shard width: chunk k copies columns
# [k w, (k+1) w) of every row from the autograd gradients into one of the pair's grad buffers (a
# ``world x w`` block, as large as a regular unit's gradient), reduce-scatters (or, with fp32
# accumulation, all-to-alls) it, and folds the result into columns [k w, (k+1) w) of the grad shard.
# The chunks alternate over the pair, so chunk k + 2 waits for chunk k's reduce as a regular unit
# waits for the one two units back; the last chunk also waits for the one before it, so that every
# fold of the unit has run before its last (HSDP all-reduces a shard after its last fold). Every
# element is summed over the same ranks, in the same dtypes, and scaled and folded by the same kernels
# as by one reduce of the whole unit: the values are the same (bit for bit where the collective's
# per-element summation order does not depend on the tensor's length: gloo at world 2, the fake
# process group). What it saves: the outsized grad buffer (with Llama-3.2-1B's tied 128k embedding,
# 1.1 GiB per rank in fp32, at every world). What it costs: ``ceil(shard / w)`` collectives instead of
# one for the unit (about its size over a decoder layer's, 5 for Llama-3.2-1B), each as large as a
# layer's, and a strided copy instead of a contiguous one. With offload (the reduce goes through
# the host landing) the unit keeps its own buffer; so does a model with no regular unit. (On gloo at
# world 2 a fresh fp32 one-parameter unit skips the chunks: [Note: the direct exchange of an outsized
# gradient] in engine/grad_path.py.)
# ``grad_chunks=K`` (default 1) applies the same to the regular units: the pair is sized for 1/K
# of the largest of them (16-element aligned columns), and every unit larger than that is reduced
# in chunks through it. Its cost is overlap: a unit's first chunk waits for the previous unit's
# first chunk, one unit back instead of two.
@dataclass(frozen=True)
class UnitShape:
    """A unit's flat groups as laid out in its weight buffer: the trainable group first (it alone
    has a grad shard and fills the grad buffer), then the frozen one, then the NF4 one (expanded
    there from the staging area). See [Note: unit groups]."""

    trainable: FlatLayout | None
    frozen: FlatLayout | None
    nf4: FlatLayout | None = None
    nf4_record: int = 0  # bytes of one rank's NF4 record (nf4.record_bytes), 0 without an NF4 group
    # gather_dtype="fp8" / "int8": the trainable group is gathered as records of ``gather`` (a
    # gather format), gather_record bytes per rank; 0 when it is gathered in param_dtype. See
    # [Note: gather formats] in formats/base.py.
    gather_record: int = 0
    gather: Format = PLAIN

    @property
    def groups(self) -> tuple[FlatLayout, ...]:
        return tuple(lay for lay in (self.trainable, self.frozen, self.nf4) if lay is not None)

    @property
    def weight_numel(self) -> int:  # elements of the weight buffer the gathered unit fills
        return sum(lay.padded_numel for lay in self.groups)

    @property
    def numel(self) -> int:
        return sum(lay.numel for lay in self.groups)

    @property
    def gather_staging(self) -> int:
        """Bytes the gathered records of the trainable group take (every rank's record); first in
        the staging area."""
        return self.trainable.world_size * self.gather_record if self.gather_record else 0

    @property
    def staging_bytes(self) -> int:
        """Bytes the gathered compact records take in the staging area (every rank's record): the
        trainable group's (fp8, int8), then the NF4 group's."""
        return self.gather_staging + (self.nf4.world_size * self.nf4_record if self.nf4 is not None else 0)

    @property
    def compute_shard(self) -> int:
        """Elements of the param_dtype compute copy (the trainable shard unless gathered compact)."""
        return 0 if self.gather_record else self.trainable_shard

    @property
    def nf4_shard(self) -> int:  # elements of this rank's NF4 shard (stored as nf4_record bytes)
        return self.nf4.shard_numel if self.nf4 is not None else 0

    @property
    def trainable_shard(self) -> int:
        return self.trainable.shard_numel if self.trainable is not None else 0

    @property
    def frozen_shard(self) -> int:
        return self.frozen.shard_numel if self.frozen is not None else 0


def unit_shape(params, world_size: int, rank: int, align: int, quantize: torch.dtype | None = None,
               gather: Format | None = None, gather_exclude: tuple[str, ...] = (),
               stored: Format | None = None) -> UnitShape:
    """Split a unit's parameters (in order) into its trainable, frozen and (``quantize``: the
    dtype stored values expand to, when ``quantize_frozen`` is set; ``stored``: its format, NF4 by
    default) stored flat groups; ``gather`` (a gather format, or its name) gathers the trainable
    group compact when the unit qualifies (``gather.eligible_unit``)."""
    gather = formats.get(gather)
    stored = formats.get("nf4") if stored is None else stored
    trainable = [p for p in params if not p.frozen]
    compact = [p for p in params if quantize is not None and stored.eligible(p)]
    frozen = [p for p in params if p.frozen and not any(p is c for c in compact)]
    lay4 = None
    if compact:
        lay4 = FlatLayout.build(compact, world_size, rank, stored.shard_align(align, quantize))
    packed = gather.compact and gather.eligible_unit(params, gather_exclude)
    # whole blocks per rank: see [Note: compact trainable gathers] in formats/fp8_codec.py
    lay_t = (FlatLayout.build(trainable, world_size, rank, gather.shard_align(align, torch.float32) if packed else align)
             if trainable else None)
    return UnitShape(lay_t,
                     FlatLayout.build(frozen, world_size, rank, align) if frozen else None,
                     lay4, stored.record_bytes(lay4.shard_numel, quantize) if lay4 is not None else 0,
                     gather.record_bytes(lay_t.shard_numel, torch.float32) if packed else 0,
                     gather if packed else formats.PLAIN)


# [Note: the compact staging area]
# A compact (NF4) group is gathered as bytes (every rank's record end to end) and expanded into its
# place in the weight buffer by one kernel. The records land in a staging area that belongs to the
# weight buffer (``WeightBuffer.staging``, sized here: the largest ``staging_bytes`` of the units
# sharing the buffer; in bf16 ~0.27x the expanded group), not inside the buffer's data: the expand
# reads the records while writing the values, in parallel, so the two must not overlap. One
# staging area per weight buffer, not one shared by all: two buffers' gathers can be in flight at
# once (a prefetch into the other buffer while this one's gather has not landed; on gloo both are
# asynchronous handles), and the buffer's own ordering (its release before the next gather into
# it, the expand before its ``ready``) then protects its staging area with no new event.
def round16(n: int) -> int:
    return -(-n // 16) * 16


def landing_layout(shape: UnitShape, compute_dtype: torch.dtype) -> tuple[int, int]:
    """(byte offset of the NF4 record, bytes in all) of a unit's frozen shard and NF4 record in its
    weight buffer's landing: the frozen shard first, the record at the next 16-byte line."""
    at = round16(shape.frozen_shard * itemsize(compute_dtype))
    return at, at + shape.nf4_record


# [Note: the frozen landing]
# With offload="all" the frozen and NF4 shards live on the host (pinned on CUDA); the all-gather
# needs its input on the device. Each weight buffer has a device *landing* (sized here: the largest
# frozen shard + NF4 record of the units sharing the buffer, 16-byte aligned) that a unit's host
# shards are copied into right before their all-gathers, by the same stream (CUDA: the comm stream,
# after the gather's waits; gloo: after the previous gather into the buffer was waited for). The
# landing is then touched only in that stream's order (copy, gather, next copy), as the compact
# staging area is, so it needs no event. The cost: the host -> device copy (1/N of the unit) sits
# in front of the gather on the comm stream; the prefetch hides it behind the previous unit's
# compute as it hides the gather.
# [Note: the world-1 alias]'s switch, for the tests of the gather protocol at world 1
# (tests/multirank/test_streamcheck.py's fault runs): False gives every unit a weight buffer at
# every world size. The engine and the plan both read it when they size the buffers.
ALIAS_WORLD1 = True
# [Note: the grad shard's lifetime at world 1]'s switch, for the tests that compare it with the one grad
# store kept between steps: False keeps that store wherever [Note: world-1 gradients] applies.
GRAD_LIFETIME_WORLD1 = True
# [Note: the world-1 cast gather]'s switch, for the tests that compare it with the compute copy kept
# between steps: False lets those units alias their compute copies as before.
CAST_WORLD1 = True
# [Note: world-1 buffers in use only]'s switch, for the tests that compare it with buffers held for the
# whole run: False keeps every weight buffer allocated from the build on.
IN_USE_WORLD1 = True


def plan_buffers(
    names: list[str],
    layouts: list[UnitShape],
    small: UnitShape | None,
    *,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    zero_stage: int,
    outsized_ratio: float,
    offload_frozen: bool = False,
    accumulate_fp32: bool = False,
    chunk_outsized: bool = False,
    grad_chunks: int = 1,
    reduce_in_place: bool = False,
    alias_world1: bool = False,
    direct_grads: bool = False,
    quant: QuantPlan | None = None,
    prefetch: int = 1,
) -> BufferPlan:
    """The weight and grad buffers for units with ``layouts`` (and the small group): pure, no
    allocation. See [Note: one plan, one allocator]. ``reduce_in_place``: the backend reduce-scatters
    into the input's own slice, so grad slots have no staging ([Note: reduce-scatter in place] in
    comm/collectives.py; fp32 accumulation keeps its landing). ``alias_world1``: one rank holds every
    unit whole and nothing is offloaded, so a unit without a compact group gets no weight buffer
    (``weight_of`` -1): its parameters alias its own shards ([Note: the world-1 alias]).
    ``direct_grads``: moreover the gradients are reduced in fp32 with nothing to accumulate in pieces
    and no replicas, so no unit gets a grad buffer ([Note: world-1 gradients]) and each unit's grad
    shard lives for a step (``step_grads``: [Note: the grad shard's lifetime at world 1]). ``quant``
    (``grad_quant``): each grad slot gets the room of its quantized reduce, and with replicas one slot
    more, ``replica``, holds the room of their quantized all-reduce ([Note: quantized gradient
    reduction] in comm/quant_reduce.py). ``prefetch``: the units gathered ahead of the one computing;
    ZeRO-3's regular units take turns in ``prefetch + 1`` weight buffers ([Note: prefetch depth] in
    engine/runtime.py)."""
    staged = accumulate_fp32 or not reduce_in_place
    world1 = alias_world1 and ALIAS_WORLD1  # one rank holds every unit whole, nothing offloaded: the world-1 Notes
    sizes = [lay.weight_numel for lay in layouts]
    outsized = [False] * len(layouts)
    repeated = repeated_blocks(names)
    if any(repeated):  # See [Note: outsized units]
        largest_block = max(n for n, r in zip(sizes, repeated) if r)
        outsized = [not r and n > outsized_ratio * largest_block for n, r in zip(sizes, repeated)]
    elif len(sizes) >= 3:
        median = statistics.median_low(sizes)
        outsized = [n > outsized_ratio * median for n in sizes]
    regular = [i for i, o in enumerate(outsized) if not o]
    big = [i for i, o in enumerate(outsized) if o]
    n_all = len(layouts) + (1 if small is not None else 0)
    weight: list[BufferSpec] = []
    grad: list[BufferSpec] = []
    weight_of = [-1] * n_all
    grad_of = [-1] * n_all

    def lay(i: int) -> UnitShape:
        return small if i == len(layouts) else layouts[i]

    def grad_slot(name: str, members: list[int], role: str) -> int:
        capacity = max(lay(i).trainable.padded_numel for i in members)
        shard = max(lay(i).trainable.shard_numel for i in members)
        # fp32 accumulation (accumulate_fp32): the staging is the all-to-all's landing (every rank's
        # piece of the shard: as large as the buffer), plus one fp32 shard to sum into.
        grad.append(BufferSpec(name, "grad", capacity, (capacity if accumulate_fp32 else shard) if staged else 0,
                               reduce_dtype, role,
                               accum_capacity=shard if accumulate_fp32 else 0,
                               quant_bytes=quant.reduce_bytes(shard, reduce_dtype) if quant else 0))
        return len(grad) - 1

    # Grad buffers serve the units with a trainable group; a unit that is all frozen has none.
    regular_t = [i for i in regular if layouts[i].trainable is not None]
    big_t = [i for i in big if layouts[i].trainable is not None]
    grad_chunk = [0] * n_all
    chunk_slots: list[int] = []
    width = max((layouts[i].trainable.shard_numel for i in regular_t), default=0)  # the pair's shard
    if regular_t and grad_chunks > 1:  # See [Note: chunked outsized gradients]: the pair holds 1/grad_chunks
        width = -(-width // grad_chunks // 16) * 16  # of the largest unit; 16-element aligned columns
        world = layouts[regular_t[0]].trainable.world_size
        for k in range(min(2, len(regular_t))):
            grad.append(BufferSpec(f"grad{k}", "grad", world * width,
                                   (world * width if accumulate_fp32 else width) if staged else 0,
                                   reduce_dtype, "buffers", accum_capacity=width if accumulate_fp32 else 0,
                                   quant_bytes=quant.reduce_bytes(width, reduce_dtype) if quant else 0))
        pair = list(range(len(grad) - min(2, len(regular_t)), len(grad)))
        chunk_slots = pair
        for j, i in enumerate(regular_t):
            grad_of[i] = pair[j % len(pair)]
            if layouts[i].trainable.shard_numel > width:
                grad_of[i], grad_chunk[i] = pair[0], width
    elif regular_t:
        pair = [grad_slot(f"grad{k}", regular_t, "buffers") for k in range(min(2, len(regular_t)))]
        for j, i in enumerate(regular_t):
            grad_of[i] = pair[j % len(pair)]
    if big_t and chunk_outsized and regular_t:  # See [Note: chunked outsized gradients]
        chunk_slots = pair
        for i in big_t:
            grad_of[i], grad_chunk[i] = pair[0], width
    elif big_t:
        g = grad_slot("grad_outsized", big_t, "outsized")
        for i in big_t:
            grad_of[i] = g
    if small is not None and small.trainable is not None:
        grad_of[len(layouts)] = grad_slot("grad_small", [len(layouts)], "small")
    # [Note: world-1 gradients] At world 1 the reduce-scatter of a unit's grad buffer is the identity
    # and its fold (x 1/1 into the fp32 grad shard) a copy: with an fp32 reduce, no fp32 accumulation
    # of pieces and no replicas, the gate folds each parameter's gradient straight into its slice of
    # the grad shard instead (engine/grad_path.py: the same kernels on the same fp32 values, so bit for
    # bit the same grads), and no unit gets a grad buffer -- two of the largest unit's fp32 gradients
    # less. With the world-1 alias's switch off every unit keeps its buffers.
    # [Note: the grad shard's lifetime at world 1] Where the gate folds each gradient straight into
    # the grad shard (above), nothing but ``.grad`` needs the shard between steps. Plain PyTorch and
    # FSDP2 free their gradients at ``zero_grad(set_to_none=True)`` and allocate them again in the
    # next backward, parameter by parameter; a grad store kept between steps is there at the start of
    # backward, where the activations peak (at Llama-3.2-1B 4.6 GiB, the largest term of the world-1
    # gap). So here each unit's fp32 grad shard is a tensor of its own (``GradPath._target``): made at
    # the unit's first fold of a step (the gradients appear unit by unit during backward, as the
    # activations they are computed from are freed; one allocation for all units at the first fold
    # would be there at the peak again), held by ``.grad`` alone, so ``zero_grad(set_to_none=True)``
    # frees it and ``set_to_none=False`` keeps and zeroes it, as in plain PyTorch. Its values are the
    # store's: the same folds into the same fp32 elements (the fresh shard's every element is written,
    # padding and parameters without a gradient as zeros). What it gives up: the fixed layout (on the
    # CUDA caching allocator a freed shard's block can be split by the next forward's activations, as
    # with plain PyTorch's gradients) and one tensor for all grad shards (the optimizer and clipping run
    # per shard anyway). The plan counts the grad shards in the step's peak, not in the state between
    # steps (``engine_bytes()["grad"]`` 0): each block's backward frees its saved activations and adds its
    # grad shard, so with blocks alike the sum moves from one end of backward to the other, and the peak
    # is the larger end: the activations' peak (no grad shard yet) or every grad shard with the last
    # unit's gradients (``MemoryPlan.step_bytes``). Everywhere else (world > 1, where
    # the store is 1/N of the model; replicas, whose all-reduce runs over runs of the store; offload,
    # a narrow reduce or fp32 accumulation, whose grad buffers stay) the store is kept as it was.
    if world1 and direct_grads:
        grad, grad_of, grad_chunk, chunk_slots = [], [-1] * n_all, [0] * n_all, []
    if quant is not None and quant.replicas > 1 and grad:  # segments of the largest shard a slot reduces
        segment = max(s.capacity // layouts_world(layouts, small) for s in grad)
        grad.append(BufferSpec("replica", "grad", 0, 0, reduce_dtype, "replicas",
                               quant_bytes=all_reduce_room_bytes(quant.codec, quant.replicas, segment)))

    # [Note: the world-1 alias] At world 1 a unit's shard is the whole unit (shard_start 0, shard_numel
    # the padded numel), so "gathering" it into a weight buffer copies its compute shard (the master
    # in fp32, the compute copy, the frozen store) into a second tensor of the same size. A unit whose
    # groups are all gathered in param_dtype (no NF4, fp8 or int8 record to expand) gets no buffer:
    # its parameters alias its shards (engine/alloc.py) and its gathers record the version without
    # copying (engine/buffers.py ShardAlias). Offload keeps the buffers (the shards are on the host or
    # reach the device by an upload the gathers are ordered after).
    # [Note: the world-1 cast gather] With a param_dtype narrower than fp32 an aliased unit's
    # parameters are its compute copy, written by the optimizer (or the cast pass) after each step
    # and kept until the next: a param_dtype copy of the whole model held through the step, where
    # plain PyTorch under autocast holds only the casts of the weights its saved activations need
    # (never the embedding's) and FSDP2 casts each unit into a buffer of its own for a forward or a
    # backward and frees it. So under ZeRO-3 a unit whose groups are all its trainable group gathered
    # in param_dtype gets no compute copy: its "gather" casts the fp32 master into the unit's weight
    # buffer (comm/collectives.py all_gather(cast=True), on the comm stream as a gather) and the
    # buffers alternate as at any world size: two of the largest unit and the outsized slot instead of
    # the whole model. The values are the compute copy's (the same round-to-nearest cast of the same
    # fp32 master), so bit for bit the same steps. The price: the cast runs in forward and again in
    # backward (FSDP2's two casts a step; autocast casts once, the fused AdamW's copy-out wrote the
    # copy in its own pass), a memory-bound pass hidden behind the previous unit's compute as a
    # gather is. ZeRO-2 keeps every unit's gathered weights from forward to backward, so a buffer per
    # unit would hold as much as the compute copy: it keeps the alias. A unit with a frozen or NF4
    # group (LoRA, QLoRA: a base weight to gather beside small adapters) keeps the alias too: a
    # buffer would copy the base into a second tensor to save a compute copy of the adapters.
    cast = [world1 and CAST_WORLD1 and zero_stage == 3 and compute_dtype != torch.float32
            and lay(i).trainable is not None and lay(i).frozen is None and lay(i).nf4 is None
            and not lay(i).gather_record for i in range(n_all)]
    aliased = [world1 and not cast[i] and not lay(i).staging_bytes and not lay(i).gather_record
               and not lay(i).nf4_record for i in range(n_all)]
    regular = [i for i in regular if not aliased[i]]
    big = [i for i in big if not aliased[i]]

    # [Note: world-1 records in place] A unit with a compact group (NF4, fp8, int8) keeps its buffer at world 1:
    # its records expand into it. Their staging area is where every rank's record lands before the expand;
    # at world 1 that is a copy of the one record the store already holds, so there the buffers get none and
    # the expand reads the record where it lies (engine/buffers.py; the "gather" is then a copy of the
    # record onto itself, which moves nothing). Offload keeps it (the record comes from the host through
    # the landing; alias_world1 is off there).
    #
    # [Note: world-1 buffers in use only] Under ZeRO-3 a unit's gathered weights are needed from its
    # gather to its release, and again from its backward's re-gather; between those the buffer holds
    # nothing anyone reads (a saved tensor that views it is read only after the re-gather). At world > 1
    # the buffers are preallocated and alternate, so the collectives write into fixed memory. At world 1
    # a gather is a local copy, cast or expand, so there a weight slot's memory is taken at its gather
    # and given back at its release (``WeightBuffer``: the storage resized to its capacity and to 0; the
    # tensor, its views in the units' aliases and the saved tensors that view it stay the same
    # objects). Between steps, and at the loss, where the activations peak, no dequantized or cast
    # weight is held, as with plain PyTorch and torchao's NF4 (which dequantizes each weight for its
    # matmul) or FSDP2 (which frees each unit's gathered weights after use). A deferred prefetch into
    # the same slot keeps the memory (the release hands it over); the small group's slot, gathered once
    # per forward and used throughout, is held as before. On CUDA the memory is
    # taken on the compute stream and the comm stream's writes are ordered after that point
    # (``Schedule.taken`` records the buffer's release event there), so whatever the caching allocator's
    # block was used for before is finished; it is given back on the compute stream after the last use
    # there, which itself waited for the gather (yafsdp/tools/streamcheck.py checks both: [Note: a
    # storage's memory coming and going]). The price is a re-gather where a held buffer would still
    # hold its unit (the last layer and the head at the start of backward: one more cast or expand of
    # each a step). ZeRO-2 keeps a unit's weights from forward to backward: its slots stay allocated.
    def weight_slot(name: str, members: list[int], role: str) -> int:
        landing = max(landing_layout(lay(i), compute_dtype)[1] for i in members) if offload_frozen else 0
        staging = 0 if world1 else max(lay(i).staging_bytes for i in members)
        weight.append(BufferSpec(name, "weight", max(lay(i).weight_numel for i in members), 0, compute_dtype, role,
                                 staging_bytes=staging, landing_bytes=landing,
                                 in_use=world1 and IN_USE_WORLD1 and zero_stage == 3 and role != "small"))
        return len(weight) - 1

    if zero_stage == 3:
        if regular:
            turns = [weight_slot(f"weight{k}", regular, "buffers") for k in range(min(prefetch + 1, len(regular)))]
            for j, i in enumerate(regular):
                weight_of[i] = turns[j % len(turns)]
        if big:
            w = weight_slot("weight_outsized", big, "outsized")
            for i in big:
                weight_of[i] = w
    else:  # ZeRO-2: every unit keeps its gathered weights from forward to backward
        for i, name in enumerate(names):
            if not aliased[i]:
                weight_of[i] = weight_slot(f"weight_{name}", [i], "buffers")
    if small is not None and not aliased[len(layouts)]:
        weight_of[len(layouts)] = weight_slot("weight_small", [len(layouts)], "small")
    step_grads = world1 and direct_grads and GRAD_LIFETIME_WORLD1
    return BufferPlan(weight, grad, weight_of, grad_of, outsized, grad_chunk, chunk_slots, step_grads, cast)


def layouts_world(layouts: list[UnitShape], small: UnitShape | None) -> int:
    """The shard group's size the layouts were cut for."""
    for lay in [*layouts, small]:
        if lay is not None and lay.trainable is not None:
            return lay.trainable.world_size
    return 1


def dtype_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt))


def as_dtype(dt) -> torch.dtype | None:
    if dt is None or isinstance(dt, torch.dtype):
        return dt
    return _DTYPES[str(dt).lower()]


# ---------------------------------------------------------------------------- the secondary shard
# See [Note: the secondary shard] in engine/secondary.py.
def check_secondary(size: int, world: int) -> int:
    """``secondary_shard`` against the shard group's ``world`` ranks: the subgroup size in use (0:
    off). Refuses a size that does not divide the group or spans all of it, naming both."""
    if size <= 1:
        return 0
    if world % size or size == world:
        what = "does not divide" if world % size else "is all of"
        divisors = [d for d in range(2, world) if world % d == 0]
        raise ValueError(
            f"yafsdp: secondary_shard={size} {what} the shard group's {world} ranks; the backward gathers run within "
            f"groups of secondary_shard consecutive ranks, so it must be a divisor of {world} below it "
            f"({', '.join(map(str, divisors)) or 'none at this size'}), or 0 (off)")
    return size


def secondary_pieces(shape: UnitShape, compute_dtype: torch.dtype, size: int) -> list[int]:
    """Bytes of this rank's 1/``size`` of each of a unit's gathered groups, in group order: the
    param_dtype values of a group gathered in param_dtype, the records of a compact one (fp8, int8,
    NF4: the staging area's bytes)."""
    out = []
    for lay in shape.groups:
        if lay is shape.trainable and shape.gather_record:
            whole = shape.gather_staging
        elif lay is shape.nf4:
            whole = lay.world_size * shape.nf4_record
        else:
            whole = lay.padded_numel * itemsize(compute_dtype)
        assert whole % size == 0, (whole, size)
        out.append(whole // size)
    return out


def plan_secondary(layouts: list[UnitShape], weight_of: list[int], weight_free: list[bool],
                   compute_dtype: torch.dtype, size: int) -> list[int]:
    """Per unit (the small group excluded): the byte offset of its secondary shard in the one
    secondary store, or -1 when it keeps none; the store's size last. A unit keeps one when its
    backward reads its weights and its weight buffer is shared with another such unit (only then can
    its gathered weights be gone by its backward); each of its groups' pieces starts on a 16-byte line."""
    if size <= 1:
        return [-1] * len(layouts) + [0]
    needs = [i for i, lay in enumerate(layouts) if weight_of[i] >= 0 and not weight_free[i]]
    sharers = {}
    for i in needs:
        sharers.setdefault(weight_of[i], []).append(i)
    at, off = [-1] * len(layouts), 0
    for i in needs:
        if len(sharers[weight_of[i]]) >= 2:
            at[i] = off
            off += sum(round16(n) for n in secondary_pieces(layouts[i], compute_dtype, size))
    return at + [off]
