"""FP8 as a format: trainable weights gathered as float8 e4m3 records (``gather_dtype="fp8"``).

The arithmetic and the record layout are ``yafsdp.formats.fp8_codec``'s and the kernels' ([Note: compact
trainable gathers] in formats/fp8_codec.py); this object is what the engine asks (see [Note: gather formats] in
base.py). A *gather* format: the record is derived from the fp32 master (the cast pass, or
``FusedAdamW``'s fused pass) and never saved.
"""
from __future__ import annotations

import torch

from .fp8_codec import BLOCK
from .fp8_codec import record_bytes as fp8_record_bytes
from .. import kernels
from .base import Format

__all__ = ["FP8", "FP8_FORMAT"]


class FP8(Format):
    name = "fp8"
    compact = True
    block = BLOCK
    aliases = ("e4m3", "float8_e4m3fn", torch.float8_e4m3fn)
    summary = "float8 e4m3 codes + a float32 scale per 128 values"
    label = "e4m3 codes + fp32 scale per 128"

    def record_bytes(self, shard_numel: int, dtype: torch.dtype) -> int:
        return fp8_record_bytes(shard_numel)

    def encode_(self, record: torch.Tensor, values: torch.Tensor, *, twin: bool = False) -> torch.Tensor:
        return (kernels.fp8_quantize_reference if twin else kernels.fp8_quantize_)(record, values)

    def adamw_step_(self, param, grad, exp_avg, exp_avg_sq, step, *, record: torch.Tensor, twin: bool,
                    **hyper) -> None:
        # one pass: AdamW, then each run quantized while in cache (kernels.adamw_step_fp8_)
        if twin:
            kernels.adamw_step_fp8_reference(param, grad, exp_avg, exp_avg_sq, step, record=record, exact=False,
                                             **hyper)
        else:
            kernels.adamw_step_fp8_(param, grad, exp_avg, exp_avg_sq, step, record=record, **hyper)

    def expand_(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        return kernels.fp8_expand_(out, staging, shard_numel)

    def expand_reference(self, out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
        return kernels.fp8_expand_reference(out, staging, shard_numel)


FP8_FORMAT = FP8()
