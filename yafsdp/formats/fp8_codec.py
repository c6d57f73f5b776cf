"""Compact weight gathers for trainable weights (``YaFSDP(..., gather_dtype="fp8")``).

[Note: compact trainable gathers]
Past one node the weight all-gathers dominate a step's traffic; halving their bytes is what
fp8 all-gather (FSDP2 + torchao float8, YaFSDP 2, Megatron) and ZeRO++'s qwZ do. Here a unit's
trainable group may be gathered as an 8-bit *record* instead of ``param_dtype`` values:

- Format (``"fp8"``): float8 e4m3fn codes with one float32 scale per block of ``BLOCK`` = 128
  consecutive elements of the flat group: scale = amax / 448, code = e4m3(clamp(x / scale))
  ([Note: FP8 gather records] in csrc/common.h has the exact arithmetic). ~1.03 bytes per
  parameter instead of 2 (bf16): 0.516x the gathered bytes of those groups.
- What stays exact: the fp32 master, the gradients (reduce-scatter in ``reduce_dtype``), the
  optimizer state, and every parameter outside the compact groups. Gradients are those of the
  dequantized weights the forward used (straight-through, as FSDP2's float8 all-gather).
- Which groups: a unit's trainable group is gathered compact when every parameter in it is the
  ``weight`` of ``nn.Linear`` modules only (2-D; not tied to an embedding) with a numel that is
  a multiple of 128 -- the decoder layers of a transformer. An HF model's output head
  (``get_output_embeddings()``) is left out by default, as torchtitan's float8 recipes leave the
  output layer exact (``formats.default_exclude``); ``gather_exclude=[module names]`` replaces that list
  (``()``: include it). The rule is every compact format's (``formats.base.linear_weight``). Embeddings, norms and biases (the small group), and units holding
  anything else are gathered in ``param_dtype`` as before (a unit is compact as a whole; it has one
  trainable group). Because every compact parameter is a whole number of blocks and the flat
  layout lays parameters end to end, a block never straddles two parameters: the blocks are each
  weight's own row-major runs of 128 elements, so an unsharded reference that quantizes each
  weight on its own (``fake_quantize``) sees exactly the values the sharded run computes with,
  whatever the world size (tests/multirank/test_fp8.py).
- Where the record is written: it is the group's *compute copy* (the all-gather input): the cast
  pass writes it from the master with ``kernels.fp8_quantize_`` when the master changed (torch
  optimizers, loads, init); ``yafsdp.FusedAdamW`` writes it in its own pass
  (``kernels.adamw_step_fp8_``: AdamW, then each 1024-element run quantized while in cache on
  the CPU, a warp per 128-block on CUDA) through the copy-out registry
  (``shards.CopyOut.format == "fp8"``).
- How it is gathered: exactly like an NF4 frozen group: the records land in the weight buffer's
  staging area and ``kernels.fp8_expand_`` writes ``param_dtype`` values into the group's place
  in the buffer ([Note: expanding a compact gather] in comm/schedule.py). The modules see plain weights.
- Checkpoints hold the master as always (the record is derived); every load marks the shards
  changed, so the next step entry re-quantizes.
"""
from __future__ import annotations

import math

import torch

from .. import kernels
from ..kernels import FP8_BLOCK as BLOCK

__all__ = ["BLOCK", "record_bytes", "shard_align", "quantize", "dequantize", "fake_quantize"]


def shard_align(align: int = 1) -> int:
    """Elements a rank's compact shard is a multiple of: whole blocks (and ``align``)."""
    return BLOCK * align // math.gcd(BLOCK, align)


def record_bytes(shard_numel: int) -> int:
    """Bytes of one rank's record: one e4m3 code per element, then one float32 scale per block."""
    return kernels.fp8_record_bytes(shard_numel)


def split_record(record: torch.Tensor, shard_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a record (1-D uint8): the codes (uint8) and the scales (float32)."""
    return record[:shard_numel], record[shard_numel:record_bytes(shard_numel)].view(torch.float32)


@torch.no_grad()
def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (1-D, a multiple of 128) -> (codes as uint8, float32 scales): the twin's arithmetic,
    with torch's own ``float8_e4m3fn`` cast (round to nearest even)."""
    if values.dim() != 1 or values.numel() % BLOCK:
        raise ValueError(f"yafsdp.formats.fp8_codec.quantize: expected 1-D values of a multiple of {BLOCK} elements, "
                         f"got shape {tuple(values.shape)}")
    return kernels.fp8_codes(values)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(codes, scales) -> values in ``dtype``: the fp32 product, then one rounding."""
    return kernels.fp8_values(codes, scales, dtype)


@torch.no_grad()
def fake_quantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a compact gather gives the model for ``weight`` (any shape, a multiple of 128 elements):
    quantize-dequantize of its row-major runs of 128, in ``dtype``, same shape (the parity reference)."""
    codes, scales = quantize(weight.detach().reshape(-1))
    return dequantize(codes, scales, dtype).view(weight.shape)
