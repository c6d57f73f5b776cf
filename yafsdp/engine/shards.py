"""What the engine tells other code about its flat shards: one documented, public protocol.

- :class:`ShardInfo` — per flat shard (a parameter of ``YaFSDP.parameters()``): its unit, group
  kind, the original parameter names inside it, and this rank's slice of the flat layout. Read
  it with :func:`info_of` (or ``YaFSDP.shard_info()`` for all of them); checkpoints, init, the
  plan and the optimizer hooks use nothing else.
- the copy-out contract (see [Note: copy-out contract] in optim/adamw.py): :func:`set_copy_out` tells an
  optimizer that parameter ``p`` has a ``param_dtype`` copy to be written in its own pass, and
  whom to tell when it did; :func:`copy_out_of` reads it. The engine registers every trainable
  shard whose ``param_dtype`` is not fp32; any other engine or test can register its own.

Registrations are keyed by the parameter object and vanish with it.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

__all__ = ["ShardInfo", "CopyOut", "register", "info_of", "set_copy_out", "copy_out_of"]


@dataclass(frozen=True)
class ShardInfo:
    """One flat shard of a wrapped model (see the module docstring)."""

    name: str  # as named by YaFSDP.named_parameters(), e.g. "flat.model_layers_0"
    unit: str  # the unit's name (its module path, or "small_group")
    kind: str  # the flat group's kind: "trainable", "frozen" or "nf4"
    param_names: list[str]  # the original parameters inside, in layout order
    param_shapes: list[tuple[int, ...]]  # their shapes
    param_offsets: list[int]  # where each starts in the flat layout (elements)
    numel: int  # elements of the flat layout before padding (independent of the world size)
    padded_numel: int  # elements of the padded flat layout (a multiple of the world size)
    shard_start: int  # this rank's slice: [shard_start, shard_start + shard_numel)
    shard_numel: int
    param_ref: weakref.ref = field(repr=False)  # the shard itself, weakly (the registry keeps nothing alive)
    # Compact groups (kind "nf4"): the dtype of the values the shard encodes. Its ``param`` is then
    # not shard_numel values but this rank's byte record of them (formats.nf4_codec.split_record: packed
    # 4-bit codes, then one scale of this dtype per 64 elements). None for plain shards.
    values_dtype: torch.dtype | None = None
    # The name of the stored format of a compact group ("nf4"; yafsdp.formats.get(format) is the
    # object that reads and writes its record); None for plain shards.
    format: str | None = None

    @property
    def param(self) -> torch.Tensor:
        """The shard (trainable: the 1-D fp32 nn.Parameter; frozen: the param_dtype storage)."""
        p = self.param_ref()
        if p is None:
            raise RuntimeError(f"yafsdp: the shard of unit {self.unit!r} no longer exists (its model was freed)")
        return p

    @property
    def key(self) -> str:
        """A name unique among the model's shards: the unit's for its trainable group, ``<unit>.frozen``
        / ``<unit>.nf4`` for its frozen / NF4 group (checkpoint entries use it)."""
        return self.unit if self.kind == "trainable" else f"{self.unit}.{self.kind}"


@dataclass(frozen=True)
class CopyOut:
    """A parameter's ``param_dtype`` copy, written by the optimizer in its pass."""

    copy: torch.Tensor  # contiguous, p.numel() elements, on p's device (format None)
    written: Callable[[], None]  # called (no arguments) after the optimizer wrote ``copy``
    # None: ``copy`` holds p's values in its dtype. A gather format's name ("fp8", "int8"): ``copy``
    # is that format's record of p (1-D uint8, yafsdp.formats.get(format).record_bytes(p.numel())),
    # written with its ``encode_`` arithmetic. See [Note: gather formats] in formats/base.py.
    format: str | None = None


_INFO: dict[int, tuple[weakref.ref, ShardInfo]] = {}
_COPY: dict[int, tuple[weakref.ref, CopyOut]] = {}


def _put(table: dict, p: torch.Tensor, value) -> None:
    key = id(p)
    table[key] = (weakref.ref(p, lambda _r, key=key, table=table: table.pop(key, None)), value)


def _get(table: dict, p: torch.Tensor):
    entry = table.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def register(info: ShardInfo) -> None:
    _put(_INFO, info.param_ref(), info)


def info_of(p: torch.Tensor) -> ShardInfo | None:
    """The shard info of ``p``, or None when ``p`` is not a yafsdp shard."""
    return _get(_INFO, p)


def set_copy_out(p: torch.Tensor, copy: torch.Tensor, written: Callable[[], None], format: str | None = None) -> None:
    _put(_COPY, p, CopyOut(copy, written, format))


def copy_out_of(p: torch.Tensor) -> CopyOut | None:
    return _get(_COPY, p)
