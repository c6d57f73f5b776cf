"""NF4: the 4-bit storage of a frozen base (``YaFSDP(..., quantize_frozen="nf4")``).

[Note: NF4 frozen groups]
QLoRA's NormalFloat-4 (Dettmers et al. 2023), as torchao's ``to_nf4`` computes it, without the
double quantization of the scales: the values (already rounded to ``param_dtype``, as every frozen
value is) are cut into blocks of ``BLOCK`` = 64 elements; each block keeps its absmax as its
scale, in ``param_dtype`` (the absmax of ``param_dtype`` values is one of them: exact), and each
element the index of the level nearest to ``value / absmax`` (computed in ``param_dtype``, the
first level on a tie, as torchao's ``min(dim=-1).indices``). Dequantized, an element is
``codebook[index] * absmax`` in ``param_dtype``. A block of zeros (padding) keeps scale 0 and
index 7 (level 0.0): it expands to zeros. Equality with torchao, codebook and values bit for bit,
is tested (tests/unit/test_nf4.py).

Which parameters: frozen (``requires_grad=False`` at wrap time) weights of ``nn.Linear`` modules
(every module holding the tensor is an ``nn.Linear`` holding it as ``weight``, so a weight tied to
an embedding stays bf16), 2-D, with a numel that is a multiple of 64 (so blocks never straddle two
parameters and each weight's blocks are torchao's blocks of that weight). Every other frozen
parameter (norms, embeddings, biases, odd sizes) stays in the plain frozen group. (The rule is every
compact format's: ``Format.eligible`` and ``linear_weight`` in formats/base.py.)

Layout: a unit's NF4 parameters form a third flat group (kind ``"nf4"``), after the trainable and
the frozen one, padded so that every rank's shard is ``shard_align(dtype)`` elements times a whole
number (whole blocks; and a record of whole 16-byte lines, so every rank's record starts aligned
in the gathered staging area). A rank's shard is one byte *record*: the codes packed two per byte
(high nibble first), then the block scales ([Note: NF4 shard records] in csrc/common.h).
Quantization happens per shard: at wrap time (and on every load) each rank receives its slice of
the values, as for any group, and quantizes only that. The gather moves the records (~0.53 bytes
per parameter in bf16 instead of 2) into the weight buffer's *staging area*, and one kernel
(``kernels.nf4_expand_``) writes the values into the group's place in the weight buffer: the
modules see plain ``param_dtype`` views there, as for every other group. Where it runs:
[Note: expanding a compact gather] in comm/schedule.py.
"""
from __future__ import annotations

import torch

from .. import kernels
from ..kernels import NF4_BLOCK as BLOCK

__all__ = ["BLOCK", "LEVELS", "codebook", "record_bytes", "shard_align", "split_record",
           "quantize", "quantize_into", "dequantize_record"]

# QLoRA's NF4 levels as torchao writes them (4 decimals); cast to the values' dtype like torchao does.
LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
          0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
ZERO_INDEX = 7
_CHUNK = 1 << 16  # elements quantized at a time (the nearest-level search holds 16 x this)
_CODEBOOKS: dict[tuple, torch.Tensor] = {}


def codebook(dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """The 16 levels in ``dtype`` on ``device`` (cached)."""
    key = (dtype, str(torch.device(device)))
    t = _CODEBOOKS.get(key)
    if t is None:
        t = _CODEBOOKS[key] = torch.tensor(LEVELS, dtype=dtype, device=device)
    return t


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def shard_align(dtype: torch.dtype) -> int:
    """Elements a rank's NF4 shard is a multiple of: whole blocks, and a record of whole 16-byte lines."""
    return BLOCK * max(1, 16 // itemsize(dtype))


def record_bytes(shard_numel: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's record: packed codes, then one ``dtype`` scale per block."""
    return kernels.nf4_record_bytes(shard_numel, dtype)


def split_record(record: torch.Tensor, shard_numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a record (1-D uint8): the packed codes (uint8) and the scales (``dtype``)."""
    half = shard_numel // 2
    return record[:half], record[half:record_bytes(shard_numel, dtype)].view(dtype)


def _nearest(scaled: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level of every element, the first level on a tie (torchao's rule)."""
    return (scaled.unsqueeze(-1) - levels).abs().min(dim=-1).indices


# [Note: the NF4 code table]
# A 16-bit dtype (bf16, fp16) has 65,536 values, so the nearest-level search above can run once over
# every one of them: the table maps a scaled value's bits (as int16, + 32768) to its code, and the
# quantizer looks codes up instead of comparing each element with 16 levels (measured: the search
# was 99% of a QLoRA load's time, benchmarks/results/io_cpu_2026-11-26.md). The table is that search's
# output, so the codes are the same bit for bit (tests/unit/test_nf4.py compares both on every value).
_CODE_TABLES: dict[tuple, torch.Tensor] = {}


def _code_table(dtype: torch.dtype, device) -> torch.Tensor:
    """uint8[65536]: the code of the ``dtype`` value whose bits, read as int16, are ``i - 32768``."""
    key = (dtype, str(torch.device(device)))
    t = _CODE_TABLES.get(key)
    if t is None:
        every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
        t = _CODE_TABLES[key] = _nearest(every, codebook(dtype)).to(torch.uint8).to(device)
    return t


@torch.no_grad()
def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (1-D, a multiple of 64 elements, the values' dtype) -> (packed codes uint8, scales)."""
    if values.dim() != 1 or values.numel() % BLOCK:
        raise ValueError(f"yafsdp.formats.nf4_codec.quantize: expected 1-D values of a multiple of {BLOCK} elements, "
                         f"got shape {tuple(values.shape)}")
    n = values.numel()
    blocks = values.view(-1, BLOCK)
    scales = blocks.abs().amax(dim=1)
    levels = codebook(values.dtype, values.device)
    codes = torch.empty(n, dtype=torch.uint8, device=values.device)
    table = _code_table(values.dtype, values.device) if values.element_size() == 2 else None
    step = (_CHUNK if table is None else 16 * _CHUNK) // BLOCK
    for b0 in range(0, blocks.shape[0], step):
        blk, s = blocks[b0:b0 + step], scales[b0:b0 + step]
        scaled = (blk / s.unsqueeze(-1)).reshape(-1)  # in the values' dtype, as torchao
        if table is None:
            idx = _nearest(scaled, levels)
        else:  # See [Note: the NF4 code table]
            idx = table[scaled.view(torch.int16).to(torch.int32) + 32768]
        idx = idx.view(-1, BLOCK).masked_fill_((s == 0).unsqueeze(-1), ZERO_INDEX)
        codes[b0 * BLOCK:(b0 + blk.shape[0]) * BLOCK] = idx.reshape(-1).to(torch.uint8)
    return codes[0::2] << 4 | codes[1::2], scales


@torch.no_grad()
def quantize_into(record: torch.Tensor, values: torch.Tensor) -> None:
    """Quantize one shard's ``values`` (1-D, its shard_numel, the gather dtype) into ``record``."""
    data, scales = split_record(record, values.numel(), values.dtype)
    packed, s = quantize(values)
    data.copy_(packed)
    scales.copy_(s)


@torch.no_grad()
def dequantize_record(staging: torch.Tensor, shard_numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Records of ``world`` ranks end to end (1-D uint8) -> the values (1-D ``dtype``)."""
    world = staging.numel() // record_bytes(shard_numel, dtype)
    out = torch.empty(world * shard_numel, dtype=dtype, device=staging.device)
    kernels.nf4_expand_(out, staging, codebook(dtype, staging.device), shard_numel)
    return out
