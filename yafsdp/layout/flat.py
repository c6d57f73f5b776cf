"""Layout of a unit's parameters in one flat, padded 1-D tensor, and the views back.

A flat unit holds its parameters end to end in registration order; its length is padded to a
multiple of ``world_size * align`` so every rank owns one contiguous shard of equal length.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ParamInfo:
    """One original parameter and every place the model refers to it."""

    fqn: str  # canonical name: the first name under which module.named_parameters() lists it
    shape: torch.Size
    dtype: torch.dtype  # original dtype (the master is fp32 whatever this is)
    owners: list[tuple[nn.Module, str]]  # (module, attribute) pairs that hold it (several if tied)
    offset: int = 0  # element offset inside the flat unit
    small: bool = False  # a 1-D parameter that lives in the small group
    frozen: bool = False  # requires_grad=False at wrap time: gathered, never reduced (a frozen group)
    # after wrapping: what the owners hold in its place (orig_params.ShardedParameter); see
    # [Note: the module tree after wrapping] in orig_params.py
    resting: object = field(default=None, compare=False, repr=False)
    # a tensor-parallel parameter's DTensor layout (layout/dtensor.TPSpec; its shape above is the local
    # one), else None. See [Note: tensor parallel inside the data-parallel shards] in layout/dtensor.py
    tp: object = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class FlatLayout:
    """Where each parameter sits in a flat unit and which slice a rank owns."""

    params: list[ParamInfo]
    numel: int  # sum of the parameters' numels, unpadded
    padded_numel: int  # multiple of world_size * align
    world_size: int
    rank: int
    index: dict[int, int] = field(default_factory=dict)  # id(ParamInfo) -> position

    @classmethod
    def build(cls, params: list[ParamInfo], world_size: int, rank: int, align: int) -> "FlatLayout":
        offset = 0
        for p in params:
            p.offset = offset
            offset += p.numel
        quantum = world_size * align
        padded = max(quantum, -(-offset // quantum) * quantum)
        return cls(params, offset, padded, world_size, rank, {id(p): i for i, p in enumerate(params)})

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Plain views of ``flat`` (1-D, >= numel) shaped like the parameters."""
        return [flat[p.offset:p.offset + p.numel].view(p.shape) for p in self.params]

    def flatten(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write ``tensors`` (one per parameter) into ``out`` (1-D, padded_numel); zero the padding."""
        for p, t in zip(self.params, tensors):
            out[p.offset:p.offset + p.numel].copy_(t.reshape(-1))
        out[self.numel:].zero_()
        return out


def alias(base: torch.Tensor, offset: int, shape) -> torch.Tensor:
    """A tensor over ``base``'s storage with its own version counter.

    Writing into ``base`` (a gather into a weight buffer) then never trips autograd's
    saved-tensor version check on tensors that alias it. See [Note: buffer aliases] in runtime.py.
    """
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    out = torch.empty(0, dtype=base.dtype, device=base.device)
    with torch.no_grad():
        out.set_(base.untyped_storage(), base.storage_offset() + offset, shape, stride)
    return out
