"""One unit's runtime state, and the flat groups it is made of.

[Note: unit groups]
A unit's parameters are grouped by what they need, each group one flat, padded, sharded tensor
with its own :class:`GroupKind`: how its shard is stored, in which dtype it is gathered, and
whether it is reduced (has a grad shard, a reduce-scatter and optimizer state). Today every
unit has up to two groups: ``trainable`` (fp32 master shard, gathered in ``param_dtype``, reduced)
and ``frozen`` (the parameters with ``requires_grad=False`` at wrap time: stored only in
``param_dtype`` — the shard is its own all-gather input — gathered for use, never reduced, no grad
shard, no optimizer state), laid one after the other in the unit's weight buffer. A third kind is
*compact*: ``nf4`` (``YaFSDP(quantize_frozen="nf4")``), frozen ``nn.Linear`` weights stored as 4-bit
codes + block scales (a byte record per rank), gathered compact into the weight buffer's staging
area and expanded by one kernel into the group's place in the buffer, after the other two
([Note: NF4 frozen groups] in formats/nf4_codec.py). A trainable group may itself be *gathered* compact
(``gather_dtype="fp8"`` or ``"int8"``): its master stays fp32 and its compute copy is a byte
record, gathered and expanded the same way ([Note: compact trainable gathers] in formats/fp8_codec.py). Each
kind holds its *format* (``GroupKind.format``, [Note: gather formats] in formats/base.py), the
object that sizes, writes and expands its records: the engine asks it (``format.compact``,
``format.stored``, ``format.encode_``, ``format.expand_``) instead of testing a name. Whatever the
kind, the modules see ``compute_dtype`` views of the weight buffer; what differs is only what the
gather moves and what runs after it (``FlatGroup.expand``). A new kind adds a group, not a
branch; a new format adds a module under formats/, not a branch.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .. import formats
from ..layout.flat import FlatLayout, ParamInfo
from ..formats import PLAIN, Format
from ..layout.units import Member

__all__ = ["GroupKind", "FlatGroup", "Unit", "Phase", "StoredShard", "trainable_kind", "frozen_kind", "stored_kind",
           "nf4_kind"]


@dataclass(frozen=True)
class GroupKind:
    """What a flat group needs (see [Note: unit groups])."""

    name: str
    storage_dtype: torch.dtype  # the shard as kept on this rank (the fp32 master for trainable groups)
    compute_dtype: torch.dtype  # the weight buffer's dtype: the values the modules see
    reduced: bool  # gradients are reduce-scattered into a grad shard and stepped by the optimizer
    # The format its compute copy (the all-gather input) is in: the plain format (param_dtype
    # values, gathered straight into the weight buffer) or a compact one (a byte record per rank,
    # gathered into the staging area and expanded: FlatGroup.expand). A *stored* format (nf4) is
    # also how the shard itself is kept. See [Note: gather formats] in formats/base.py.
    # Asked, not named: ``format.compact`` / ``format.stored`` (bools), ``format.name`` (a string; the
    # words: [Note: gather formats] in formats/base.py).
    format: Format = PLAIN


def trainable_kind(compute_dtype: torch.dtype, fmt: Format = PLAIN) -> GroupKind:
    """``fmt``: a gather format (fp8, int8) gathers the group as records of the fp32 master
    ([Note: compact trainable gathers] in formats/fp8_codec.py)."""
    return GroupKind("trainable", torch.float32, compute_dtype, reduced=True, format=formats.get(fmt))


def frozen_kind(compute_dtype: torch.dtype) -> GroupKind:
    return GroupKind("frozen", compute_dtype, compute_dtype, reduced=False)


def stored_kind(compute_dtype: torch.dtype, fmt: Format) -> GroupKind:
    """A frozen group stored as records of ``fmt`` (a stored format), named after it."""
    return GroupKind(fmt.name, torch.uint8, compute_dtype, reduced=False, format=fmt)


def nf4_kind(compute_dtype: torch.dtype) -> GroupKind:
    return stored_kind(compute_dtype, formats.get("nf4"))


class FlatGroup:
    """One flat group of a unit: its layout and this rank's tensors for it."""

    def __init__(self, kind: GroupKind, layout: FlatLayout, buffer_offset: int = 0):
        self.kind = kind
        self.layout = layout
        self.params: list[ParamInfo] = layout.params
        self.buffer_offset = buffer_offset  # where the gathered group starts in the unit's weight buffer
        # 1-D storage_dtype, shard_numel: an nn.Parameter (the fp32 master) for a trainable group,
        # a plain tensor for a frozen one
        self.shard: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None  # 1-D fp32, the shard's .grad storage (reduced groups)
        self.compute: torch.Tensor | None = None  # 1-D compute_dtype, the all-gather input (frozen: the shard)
        self.cast_version = -1  # shard._version when the compute copy was last written
        # world 1: ``compute`` is the fp32 master itself, cast into the weight buffer by each gather
        # (no compute copy to write). See [Note: the world-1 cast gather] in layout/sizing.py.
        self.gathers_master = False
        # offload="optimizer" (reduced groups): the host side of the compute copy, and the host
        # landing of the reduced grad shard. See [Note: host and device tensors] in alloc.py.
        self.compute_host: torch.Tensor | None = None
        self.grad_landing: torch.Tensor | None = None
        # compact groups: bytes of the gathered records (world x one rank's record)
        self.staging_bytes = 0
        self.staging_offset = 0  # where its records start in the staging area (trainable first, then stored)

    def expand(self, out: torch.Tensor, staging: torch.Tensor) -> None:
        """A compact group's gathered records (``staging``) -> its values in ``out`` (its place in
        the weight buffer). See [Note: expanding a compact gather] in comm/schedule.py."""
        self.kind.format.expand_(out, staging, self.layout.shard_numel)

    @property
    def stale(self) -> bool:
        """The master shard changed since its compute copy was written."""
        return self.shard._version != self.cast_version

    def mark_cast(self) -> None:
        self.cast_version = self.shard._version


def in_backward() -> bool:
    """True while autograd's engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def current_task() -> int:
    """The id of the autograd graph task running on this thread (-1 outside backward)."""
    return torch._C._current_graph_task_id()


def _captured(ctx) -> bool:
    """The running call is ``torch.autograd.grad`` with the gate's input (a flat shard) among its
    ``inputs``: the engine asks autograd about the shard's accumulation node, which autograd
    refuses for exactly that case."""
    acc = ctx.next_functions[0][0]
    if acc is None:
        return False
    try:
        torch._C._will_engine_execute_node(acc)
    except RuntimeError as e:
        if "autograd.grad" in str(e):
            return True
        raise
    return False


def refuse_captured(ctx, unit: "Unit") -> None:
    """Refuse ``torch.autograd.grad`` with respect to the unit's shard (the first tensor input of the
    node ``ctx`` belongs to: a gate, a sharded lookup): see :func:`_captured`."""
    if _captured(ctx):
        raise RuntimeError(
            f"yafsdp: torch.autograd.grad(..., inputs=...) with the flat shard of unit {unit.name!r} among the "
            "inputs is not supported: the model's parameters are this rank's shards, whose gradients the engine "
            "reduce-scatters into .grad. Call loss.backward() (or loss.backward(inputs=[...shards])) and read "
            ".grad; torch.autograd.grad with respect to input or activation tensors is supported"
        )


class Phase(enum.Enum):
    """Where the engine is in a step (one value for the whole engine)."""

    IDLE = "idle"  # between steps: state dicts, checkpoints and loads are allowed
    FORWARD = "forward"  # inside a root forward
    BACKWARD = "backward"  # a backward touched the engine; finalize is queued


class Unit:
    """Runtime state of one unit (or of the small group); every field declared here."""

    def __init__(self, name: str, index: int, groups: list[FlatGroup], members: list[Member],
                 params: list[ParamInfo]):
        self.name = name
        self.index = index
        self.groups = groups  # See [Note: unit groups]: trainable, frozen, nf4 (those the unit has), in that order
        self.members = members
        self.params = params  # every parameter, in the order the members' assignments index them
        self.group_of = {id(p): g for g in groups for p in g.params}
        self.buffer = None  # the WeightBuffer its gathered weights go to
        self.grad_buffer = None  # the GradBuffer its gradients go to
        # outsized units: columns per chunk when its gradient is reduced in chunks through the pair
        # (chunk_buffers), else 0. See [Note: chunked outsized gradients] in layout/sizing.py
        self.grad_chunk = 0
        self.chunk_buffers: list = []
        self.aliases: list[torch.Tensor] = []  # per parameter, over buffer.data: see [Note: buffer aliases]
        self.anchor: torch.Tensor | None = None  # 0-element leaf, input of the gate: makes its backward run
        # holds on its weight buffer taken by backward calls now running (a use's pre-backward, a
        # checkpoint recompute): see [Note: releasing by what autograd runs] in autograd.py
        self.bw_holds = 0
        self.outsized = False  # uses the outsized buffer (see the plan)
        self.weight_free_bw = False  # ZeRO-3 backward needs no re-gather: see [Note: weight-free backward]
        # per trainable parameter, 1 if a backward since the shard's .grad was None reached it
        # (see [Note: parameters no rank used] in unused.py)
        self.used: list[int] = []
        self.forward_versions: tuple | None = None  # its shards' versions at its last forward use
        self.landing_at = 0  # offload="all": byte offset of its NF4 record in its weight buffer's landing
        # secondary_shard: its SecondaryShard (engine/secondary.py), or None when it keeps none
        self.secondary = None
        self.fw_interval = None  # the recorder's open forward interval (yafsdp.trace), if recording
        self.bw_interval = None  # the recorder's open backward interval
        # param index -> the gated weight of this unit's latest grad-enabled use (a view of its buffer whose
        # grad_fn is that use's gate): a reentrant recompute's weight reads go through the gate
        self.last_gated: dict[int, torch.Tensor] = {}
        # (pre-hooks, hooks) on its embedding module once the engine's are on, when its forward is the
        # sharded lookup, else None; whether the pre-hook armed the lookup for the running call. See
        # [Note: the sharded lookup of an embedding] in lookup.py
        self.lookup_hooks: tuple[int, int] | None = None
        self.lookup_armed = False
        self.lookup_room = 0  # token ids per rank the lookup's first exchange has room for (agreed by every rank)

    @property
    def trainable(self) -> FlatGroup | None:
        """The trainable group (None when every parameter of the unit is frozen)."""
        return self.groups[0] if self.groups[0].kind.reduced else None

    @property
    def frozen(self) -> FlatGroup | None:
        return next((g for g in self.groups if not g.kind.reduced), None)

    # The trainable group's fields, under the names the schedule uses.
    @property
    def layout(self) -> FlatLayout | None:
        return self.trainable.layout if self.trainable is not None else None

    @property
    def flat_attr(self) -> str:
        """Its name as an attribute (dots as underscores): its shards are ``flat.<flat_attr>`` among the wrapper's
        parameters, ``frozen.<flat_attr>`` / ``nf4.<flat_attr>`` among its stored tensors."""
        return self.name.replace(".", "_")

    @property
    def flat_param(self) -> nn.Parameter | None:
        return self.trainable.shard if self.trainable is not None else None

    @property
    def grad_shard(self) -> torch.Tensor | None:
        return self.trainable.grad_shard if self.trainable is not None else None

    @property
    def compute(self) -> torch.Tensor | None:
        return self.trainable.compute if self.trainable is not None else None

    @property
    def version(self) -> tuple[int, ...]:
        """The cast versions of its groups: a buffer gathered at another version is stale."""
        return tuple(g.cast_version for g in self.groups)

    def shard_versions(self) -> tuple[int, ...]:
        """The master shards' version counters (any in-place change of a shard bumps its own)."""
        return tuple(g.shard._version for g in self.groups)

    @property
    def buffer_numel(self) -> int:
        """Elements of the weight buffer this unit's gathered groups occupy."""
        return max(g.buffer_offset + g.layout.padded_numel for g in self.groups)

    def __repr__(self):
        return f"Unit({self.name!r}, groups={[(g.kind.name, g.layout.numel) for g in self.groups]})"


class StoredShard(NamedTuple):
    """One flat group's state of record on this rank (``Runtime.stored_shards``). See [Note: stored shards]."""

    unit: Unit
    group: FlatGroup
    role: str  # the group kind's name: "trainable" (the fp32 master), "frozen", "nf4" (a byte record)
    tensor: torch.Tensor  # the group's shard, detached (1-D, storage_dtype; nf4: its byte record)


# [Note: stored shards]
# ``Runtime.stored_shards()`` (runtime.py) is the one enumeration of what a rank holds of the model: per unit
# and flat group (whatever its kind: trainable master, frozen, NF4 record, any kind added later),
# the shard that is the state of record. Everything else the engine holds is derived from these
# and rebuilt after they change (``invalidate_buffers``): compute copies, FP8 gather records
# ([Note: compact trainable gathers] in formats/fp8_codec.py), weight buffers. Every reader and writer of the
# model's shards iterates it -- the replica broadcast (hsdp.py), the wrap-time scatter, the full
# state dict and its load (state_dict.py), ``YaFSDP.shard_info()`` (and through it checkpoints and
# ``yafsdp.init``) -- so a new kind of group is carried by all of them or by none. HSDP + NF4 once
# lost its base on every replica but the first because the broadcast listed stores by hand.
