"""NF4 as a format: the 4-bit storage of frozen ``nn.Linear`` weights (``quantize_frozen="nf4"``).

The arithmetic and the record layout are ``formats/nf4_codec.py``'s ([Note: NF4 frozen groups] there);
this object is what the engine asks (see [Note: gather formats] in base.py). A *storage* format:
the record is the shard of record, encoded at wrap time and on every load from the values in
``param_dtype``; a checkpoint holds its codes and scales.
"""
from __future__ import annotations

import math

import torch

from .. import kernels
from .nf4_codec import BLOCK, ZERO_INDEX, codebook, split_record
from .nf4_codec import quantize_into
from .nf4_codec import record_bytes as nf4_record_bytes, shard_align as nf4_shard_align
from .base import Format

__all__ = ["NF4", "NF4_FORMAT"]


class NF4(Format):
    name = "nf4"
    compact = True
    stored = True
    block = BLOCK
    summary = "4-bit NormalFloat codes + a param_dtype absmax per 64 values (frozen nn.Linear weights)"

    def shard_align(self, align: int, dtype: torch.dtype) -> int:
        # whole blocks per rank, each rank's record whole 16-byte lines: see [Note: NF4 frozen groups]
        step = nf4_shard_align(dtype)
        return step * align // math.gcd(step, align)

    def record_bytes(self, shard_numel: int, dtype: torch.dtype) -> int:
        return nf4_record_bytes(shard_numel, dtype)

    def encode_(self, record: torch.Tensor, values: torch.Tensor, *, twin: bool = False) -> torch.Tensor:
        """``values``: the shard's values in the dtype they expand to (``param_dtype``)."""
        quantize_into(record, values)  # bumps the record's version
        return record

    def expand_(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        return kernels.nf4_expand_(out, staging, codebook(out.dtype, out.device), shard_numel)

    def expand_reference(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        return kernels.nf4_expand_reference(out, staging, codebook(out.dtype, out.device), shard_numel)

    def checkpoint_entries(self, info, record: torch.Tensor) -> dict[str, tuple[torch.Tensor, int, int]]:
        """The packed codes (``""``: numel/2 bytes) and the scales (``".scales"``: numel/64), both laid
        out alike for every world size (blocks start at the group's start)."""
        data, scales = split_record(record, info.shard_numel, info.values_dtype)
        valid = max(0, min(info.shard_numel, info.numel - info.shard_start))
        start = min(info.shard_start, info.numel)
        return {"": (data[:valid // 2], start // 2, info.numel // 2),
                ".scales": (scales[:valid // BLOCK], start // BLOCK, info.numel // BLOCK)}

    def checkpoint_loaded_(self, info, record: torch.Tensor, loaded: dict[str, int]) -> None:
        data, scales = split_record(record, info.shard_numel, info.values_dtype)
        data[loaded[""]:].fill_(ZERO_INDEX << 4 | ZERO_INDEX)
        scales[loaded[".scales"]:].zero_()


NF4_FORMAT = NF4()
