"""The glue between yafsdp's flat shards and torch.distributed.checkpoint (DCP).

A :class:`FlatShard` is this rank's piece of a 1-D tensor; the planners write it as a chunk of
its global tensor and read, into it, the overlapping parts of whatever chunks a checkpoint holds
(this is the resharding: see [Note: what a checkpoint holds] in ``yafsdp/checkpoint/__init__.py``).
A :class:`Chunks` is several pieces of one N-d tensor, each a box of it, written and read the same way
(the per-parameter form of a tensor-parallel engine: see [Note: checkpoints with tensor parallelism]
in by_param.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .files import CheckpointError

__all__ = ["FlatShard", "Chunks", "SavePlanner", "LoadPlanner"]


@dataclass
class FlatShard:
    """This rank's piece of a 1-D tensor of length ``numel``: ``local`` holds elements
    ``[offset, offset + local.numel())``. ``local`` may be empty (a rank holding only padding)."""

    local: torch.Tensor  # 1-D, a view into the master shard (or optimizer state)
    offset: int
    numel: int

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.local.numel()]))


@dataclass
class Chunks:
    """This rank's pieces of one tensor of global shape ``size``: each ``(offsets, local)``, ``local`` shaped like
    its box of the global tensor at ``offsets`` (a view into a shard or optimizer state, or a buffer a load copies
    out of). ``pieces`` may be empty (a rank writing or reading none of the tensor); boxes of one rank never
    overlap."""

    pieces: list  # [(offsets: tuple[int, ...], local: torch.Tensor)]
    size: tuple  # the global shape
    dtype: torch.dtype  # the tensor's dtype (the bytes of a save: see contents.needed_bytes)

    def nonempty(self) -> list:
        return [(o, t) for o, t in self.pieces if t.numel() > 0]


def _chunk_of(offsets, local: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(local.shape))


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, plus FlatShard and Chunks values written as chunks of their global tensor."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, (FlatShard, Chunks))}
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        for fqn, s in self.state_dict.items():
            if isinstance(s, FlatShard) and s.local.numel() > 0:
                items.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size([s.offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=s.chunk(),
                        properties=TensorProperties.create_from_tensor(s.local),
                        size=torch.Size([s.numel]),
                    ),
                ))
            elif isinstance(s, Chunks):
                for offsets, local in s.nonempty():
                    items.append(WriteItem(
                        index=MetadataIndex(fqn, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(chunk=_chunk_of(offsets, local),
                                                    properties=TensorProperties.create_from_tensor(local),
                                                    size=torch.Size(s.size)),
                    ))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):
            return next(local for offsets, local in obj.pieces if tuple(offsets) == tuple(index.offset))
        return obj.local if isinstance(obj, FlatShard) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, plus FlatShard destinations: each reads the overlapping parts of
    whatever chunks the checkpoint holds (this is the resharding)."""

    def __init__(self, reader=None):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.reader = reader  # a safe.SafeReader: names the file of a refused byte item

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # The default set-up walks the dict to materialise meta tensors and replaces any value of
        # a type it does not know (our FlatShard) with None; ours holds no meta tensors.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, (FlatShard, Chunks))}
        items = list(create_default_local_load_plan(plain, self.metadata, True).items)
        self._dest: dict[str, list] = {}  # fqn -> the non-empty pieces of a Chunks, by a read item's dest index
        for fqn, s in self.state_dict.items():
            if isinstance(s, Chunks):
                pieces = s.nonempty()
                if not pieces:
                    continue
                md = self.metadata.state_dict_metadata.get(fqn)
                if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(s.size):
                    got = f"a tensor of shape {tuple(md.size)}" if isinstance(md, TensorStorageMetadata) else (
                        "no such entry" if md is None else "no tensor")
                    raise CheckpointError(f"checkpoint entry {fqn!r} holds {got}, expected a tensor of shape "
                                          f"{tuple(s.size)}")
                self._dest[fqn] = [local for _, local in pieces]
                items += create_read_items_for_chunk_list(fqn, md, [_chunk_of(o, t) for o, t in pieces])
                continue
            if not isinstance(s, FlatShard) or s.local.numel() == 0:
                continue
            md = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (s.numel,):
                got = tuple(md.size) if isinstance(md, TensorStorageMetadata) else md
                raise CheckpointError(f"checkpoint entry {fqn!r} holds {got}, expected a 1-D tensor of {s.numel}")
            items += create_read_items_for_chunk_list(fqn, md, [s.chunk()])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Chunks):  # the dest index counts the pieces given to create_read_items_for_chunk_list
            return self._dest[index.fqn][index.index]
        return obj.local if isinstance(obj, FlatShard) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        # weights_only, unlike DCP's default: see [Note: loading runs no code from the checkpoint].
        from .safe import load_bytes

        file = self.reader.file_of(read_item.storage_index) if self.reader is not None else "?"
        self.state_dict[read_item.dest_index.fqn] = load_bytes(value, read_item.dest_index.fqn, file)
