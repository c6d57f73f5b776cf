"""The buffer sizing the engine allocates by, and nothing else: pure functions of the units'
layouts. See [Note: one plan, one allocator] in ``yafsdp/plan/__init__.py``."""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

import torch

from ..flat import FlatLayout

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
    shard_capacity: int  # grad slots: elements of the reduce-scatter staging; weight slots: 0
    dtype: torch.dtype
    role: str  # "buffers" (the alternating pair; ZeRO-2: per unit) | "outsized" | "small"

    @property
    def nbytes(self) -> int:
        return (self.capacity + self.shard_capacity) * itemsize(self.dtype)


@dataclass
class BufferPlan:
    weight: list[BufferSpec]  # in allocation order
    grad: list[BufferSpec]  # in allocation order
    weight_of: list[int]  # per flat unit (units in order, the small group last): index into weight
    grad_of: list[int]  # likewise into grad
    outsized: list[bool]  # per unit (small group excluded)


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
@dataclass(frozen=True)
class UnitShape:
    """A unit's flat groups as laid out in its weight buffer: the trainable group first (it alone
    has a grad shard and fills the grad buffer), then the frozen one. See [Note: unit groups]."""

    trainable: FlatLayout | None
    frozen: FlatLayout | None

    @property
    def weight_numel(self) -> int:  # elements of the weight buffer the gathered unit fills
        return sum(lay.padded_numel for lay in (self.trainable, self.frozen) if lay is not None)

    @property
    def numel(self) -> int:
        return sum(lay.numel for lay in (self.trainable, self.frozen) if lay is not None)

    @property
    def trainable_shard(self) -> int:
        return self.trainable.shard_numel if self.trainable is not None else 0

    @property
    def frozen_shard(self) -> int:
        return self.frozen.shard_numel if self.frozen is not None else 0


def unit_shape(params, world_size: int, rank: int, align: int) -> UnitShape:
    """Split a unit's parameters (in order) into its trainable and frozen flat groups."""
    trainable = [p for p in params if not p.frozen]
    frozen = [p for p in params if p.frozen]
    return UnitShape(FlatLayout.build(trainable, world_size, rank, align) if trainable else None,
                     FlatLayout.build(frozen, world_size, rank, align) if frozen else None)


def plan_buffers(
    names: list[str],
    layouts: list[UnitShape],
    small: UnitShape | None,
    *,
    compute_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    zero_stage: int,
    outsized_ratio: float,
) -> BufferPlan:
    """The weight and grad buffers for units with ``layouts`` (and the small group): pure, no
    allocation. See [Note: one plan, one allocator]."""
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
        grad.append(BufferSpec(
            name, "grad", max(lay(i).trainable.padded_numel for i in members),
            max(lay(i).trainable.shard_numel for i in members), reduce_dtype, role,
        ))
        return len(grad) - 1

    # Grad buffers serve the units with a trainable group; a unit that is all frozen has none.
    regular_t = [i for i in regular if layouts[i].trainable is not None]
    big_t = [i for i in big if layouts[i].trainable is not None]
    if regular_t:
        pair = [grad_slot(f"grad{k}", regular_t, "buffers") for k in range(min(2, len(regular_t)))]
        for j, i in enumerate(regular_t):
            grad_of[i] = pair[j % len(pair)]
    if big_t:
        g = grad_slot("grad_outsized", big_t, "outsized")
        for i in big_t:
            grad_of[i] = g
    if small is not None and small.trainable is not None:
        grad_of[len(layouts)] = grad_slot("grad_small", [len(layouts)], "small")

    def weight_slot(name: str, capacity: int, role: str) -> int:
        weight.append(BufferSpec(name, "weight", capacity, 0, compute_dtype, role))
        return len(weight) - 1

    if zero_stage == 3:
        if regular:
            cap = max(layouts[i].weight_numel for i in regular)
            pair = [weight_slot(f"weight{k}", cap, "buffers") for k in range(min(2, len(regular)))]
            for j, i in enumerate(regular):
                weight_of[i] = pair[j % len(pair)]
        if big:
            w = weight_slot("weight_outsized", max(layouts[i].weight_numel for i in big), "outsized")
            for i in big:
                weight_of[i] = w
    else:  # ZeRO-2: every unit keeps its gathered weights from forward to backward
        for i, name in enumerate(names):
            weight_of[i] = weight_slot(f"weight_{name}", layouts[i].weight_numel, "buffers")
    if small is not None:
        weight_of[len(layouts)] = weight_slot("weight_small", small.weight_numel, "small")
    return BufferPlan(weight, grad, weight_of, grad_of, outsized)


def dtype_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt))


def as_dtype(dt) -> torch.dtype | None:
    if dt is None or isinstance(dt, torch.dtype):
        return dt
    return _DTYPES[str(dt).lower()]
