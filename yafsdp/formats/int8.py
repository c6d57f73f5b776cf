"""INT8 gathers: trainable weights gathered as int8 records (``gather_dtype="int8"``).

[Note: int8 gathers]
The same contract as FP8 gathers ([Note: compact trainable gathers] in yafsdp/formats/fp8_codec.py): the fp32
master, the gradients and the optimizer state stay exact; only the gathered compute copy of the
eligible units (the decoder layers' ``nn.Linear`` weights, the head left out by default) is
quantized, and the gradients are those of the dequantized weights the forward used.

- Record: one rank's ``n`` values (a multiple of ``BLOCK`` = 128) as ``n`` int8 codes, then one
  float32 scale per block of 128 consecutive values of the flat group (``n + n/32`` bytes: 1.03
  bytes per value, as FP8). A block never straddles two parameters (whole blocks per parameter,
  as for FP8), so the blocks are each weight's own row-major runs of 128 and an unsharded
  reference that quantizes each weight on its own (``fake_quantize``) sees exactly the values the
  sharded run computes with, whatever the world size.
- Arithmetic (symmetric absmax, in fp32): ``scale = amax(|x|) / 127``; ``code = round_half_even(
  clamp(x / scale, -127, 127))``; a block of zeros keeps scale 0 and codes 0 (not 0/0). The expand
  is ``float(code) * scale`` in fp32, rounded once to ``param_dtype``.
- Against FP8 (e4m3: 3 mantissa bits, relative error up to 2^-4 per value): int8 has a uniform
  grid of 255 levels per block: the absolute error is at most ``amax / 254`` per value, so large
  values are more precise and values much smaller than the block's absmax less.
- Kernels: pure PyTorch here (``expand_`` dispatches to a compiled ``torch.ops.yafsdp.int8_expand_``
  when one is registered, which none is today; the twin runs everywhere). ``FusedAdamW`` steps with
  its fused AdamW kernel and then writes the record of the updated shard with ``encode_``.
"""
from __future__ import annotations

import torch

from .. import kernels
from .base import Format

__all__ = ["INT8", "INT8_FORMAT", "BLOCK", "QMAX", "quantize", "dequantize", "fake_quantize"]

BLOCK = 128
QMAX = 127.0
# a compiled expand, when an extension registers one (none does today): chosen once, at import
_OP = getattr(kernels._ops, "int8_expand_", None) if kernels._ops is not None else None


@torch.no_grad()
def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values (1-D, a multiple of 128) -> (int8 codes, float32 scales), in fp32 arithmetic."""
    if values.dim() != 1 or values.numel() % BLOCK:
        raise ValueError(f"yafsdp.formats.int8.quantize: expected 1-D values of a multiple of {BLOCK} elements, "
                         f"got shape {tuple(values.shape)}")
    blocks = values.to(torch.float32).view(-1, BLOCK)
    amax = blocks.abs().amax(dim=1)
    # divided by a tensor on the device: CUDA turns a division by a Python number into a product with
    # its reciprocal (one rounding more), and the codes on a GPU would differ from the CPU's
    scales = amax / amax.new_full((), QMAX)
    q = (blocks / scales.unsqueeze(1)).clamp_(-QMAX, QMAX)
    q = q.masked_fill_((scales == 0).unsqueeze(1), 0.0)  # a zero block: scale 0, codes 0
    return q.round_().to(torch.int8).reshape(-1), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(int8 codes, float32 scales) -> values in ``dtype``: the fp32 product, then one rounding."""
    v = codes.view(torch.int8).to(torch.float32).view(-1, BLOCK) * scales.view(-1, 1)
    return v.reshape(-1).to(dtype)


@torch.no_grad()
def fake_quantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What an int8 gather gives the model for ``weight`` (a multiple of 128 elements): the
    quantize-dequantize of its row-major runs of 128, in ``dtype``, same shape (the parity reference)."""
    codes, scales = quantize(weight.detach().reshape(-1))
    return dequantize(codes, scales, dtype).view(weight.shape)


def split_record(record: torch.Tensor, shard_numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a record (1-D uint8): the codes (int8) and the scales (float32)."""
    return record[:shard_numel].view(torch.int8), record[shard_numel:INT8_FORMAT.record_bytes(shard_numel)].view(
        torch.float32)


class INT8(Format):
    name = "int8"
    compact = True
    block = BLOCK
    aliases = ("qint8", torch.int8)
    summary = "int8 codes + a float32 absmax/127 scale per 128 values"
    label = "int8 codes + fp32 scale per 128"

    def record_bytes(self, shard_numel: int, dtype: torch.dtype = torch.float32) -> int:
        return shard_numel + (shard_numel // BLOCK) * 4

    def encode_(self, record: torch.Tensor, values: torch.Tensor, *, twin: bool = False) -> torch.Tensor:
        codes, scales = split_record(record, values.numel())
        c, s = quantize(values.detach().reshape(-1))
        with torch.no_grad():
            codes.copy_(c)
            scales.copy_(s)
        return record

    def expand_(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        if (_OP is not None and out.device.type in kernels._EXT_DEVICES and out.is_contiguous()
                and staging.is_contiguous() and staging.device == out.device):
            _OP.default(out, staging, int(shard_numel))
            return out
        return self.expand_reference(out, staging, shard_numel)

    def expand_reference(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        world = out.numel() // shard_numel
        rec = staging.view(world, self.record_bytes(shard_numel))
        codes = rec[:, :shard_numel].reshape(-1)
        scales = rec[:, shard_numel:].contiguous().view(torch.float32).reshape(-1)
        with torch.no_grad():
            out.copy_(dequantize(codes, scales, out.dtype))
        return out


INT8_FORMAT = INT8()
