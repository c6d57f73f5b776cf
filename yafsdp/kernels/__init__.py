"""Hot-path kernels of the engine and the optimizer, with their pure-PyTorch twins.

The engine and :class:`yafsdp.FusedAdamW` call only the functions below:

- :func:`cast_` — ``dst[:] = src * scale`` converted (fp32 master shard -> ``param_dtype``
  compute copy, the all-gather input; reduce output * 1/world -> a fresh fp32 grad shard),
- :func:`accumulate_` — ``dst += src * scale`` (reduce-scatter output -> fp32 grad shard),
- :func:`adamw_step_` — one fused AdamW step over a flat fp32 buffer, optionally writing the
  updated param's ``param_dtype`` copy in the same pass,
- :func:`nf4_expand_` — a gathered NF4 group (every rank's byte record of packed codes and block
  scales) -> its ``param_dtype`` values in the weight buffer (see [Note: NF4 frozen groups] in formats/nf4_codec.py),
- :func:`fp8_quantize_`, :func:`fp8_expand_`, :func:`adamw_step_fp8_` — the FP8 record of a trainable
  group gathered compact (fp32 master -> record; gathered records -> values; AdamW writing the
  record in its pass): see [Note: compact trainable gathers] in formats/fp8_codec.py.

Each dispatches to the compiled extension (``torch.ops.yafsdp.*``: ``yafsdp._C`` for the CPU,
``yafsdp._C_cuda`` for CUDA, built from ``csrc/``) when it is built for the tensor's device and
the arguments are flat (contiguous, same numel, float32/bfloat16/float16), and to its
pure-PyTorch twin otherwise. The twins (``*_reference``) are also the references in tests.

The choice is made once, at import:

- :func:`backend` says which kernels run on a device type (``"extension"`` or ``"torch"``);
  :func:`describe` says why, in one line (also logged at INFO by ``yafsdp.kernels``).
- ``YAFSDP_KERNELS=torch`` forces the twins; ``YAFSDP_KERNELS=extension`` makes a missing CPU
  extension an import error instead of a fallback.
- :func:`require_extension` raises, with the install command, when the extension is missing.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Optional, Union

import torch

__all__ = [
    "INSTALL_COMMAND",
    "ExtensionMissingError",
    "backend",
    "describe",
    "require_extension",
    "fallback_reason",
    "cast_",
    "accumulate_",
    "adamw_step_",
    "cast_reference",
    "accumulate_reference",
    "adamw_step_reference",
    "nf4_expand_",
    "nf4_expand_reference",
    "fp8_quantize_",
    "fp8_quantize_reference",
    "fp8_expand_",
    "fp8_expand_reference",
    "adamw_step_fp8_",
    "adamw_step_fp8_reference",
]

from .twins import (  # noqa: F401 - the pure-PyTorch twins (fallback; references in tests) and their constants
    NF4_BLOCK,
    nf4_record_bytes,
    FP8_BLOCK,
    FP8_MAX,
    fp8_record_bytes,
    cast_reference,
    accumulate_reference,
    adamw_step_reference,
    nf4_expand_reference,
    fp8_codes,
    fp8_values,
    fp8_quantize_reference,
    fp8_expand_reference,
    adamw_step_fp8_reference,
)

log = logging.getLogger(__name__)

INSTALL_COMMAND = "pip install --no-build-isolation -e .   (in the yafsdp checkout; see docs/kernels.md)"

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class ExtensionMissingError(RuntimeError):
    """The compiled kernels were asked for explicitly but are not available."""


def extension_spec(name: str):
    """The import spec of the compiled module ``yafsdp.<name>`` (``_C``, ``_C_cuda``), None when it is not
    built. The extensions sit in the top package, beside this subpackage: its own name is not theirs."""
    import importlib.util

    return importlib.util.find_spec(f"{__package__.rpartition('.')[0]}.{name}")


def _load():
    """Import the extensions once. Returns (cpu module, cuda module, reason or None, reason the
    CUDA module is missing or None)."""
    mode = os.environ.get("YAFSDP_KERNELS", "").strip().lower()
    if mode not in ("", "auto", "torch", "extension"):
        raise ValueError(f"YAFSDP_KERNELS={mode!r}: expected 'torch', 'extension' or unset")
    if mode == "torch":
        return None, None, "YAFSDP_KERNELS=torch", "YAFSDP_KERNELS=torch"
    try:
        if extension_spec("_C") is None:  # (else Python's message blames a "partially initialized" yafsdp)
            raise ImportError("no compiled module for this Python")
        from .. import _C  # registers torch.ops.yafsdp.* and their CPU kernels
    except ImportError as e:
        if mode == "extension":
            raise ExtensionMissingError(
                f"YAFSDP_KERNELS=extension but yafsdp._C cannot be imported ({e}). "
                f"Build it with: {INSTALL_COMMAND}"
            ) from e
        return None, None, f"yafsdp._C is not built ({e})", f"yafsdp._C is not built ({e})"
    if extension_spec("_C_cuda") is None:
        return _C, None, None, "yafsdp._C_cuda is not built"
    try:
        from .. import _C_cuda  # registers the CUDA kernels of the same ops
    except ImportError as e:  # built but broken (an ABI or CUDA runtime mismatch): say why
        return _C, None, None, f"yafsdp._C_cuda is built but cannot be imported ({e})"
    return _C, _C_cuda, None, None


_C, _C_CUDA, _WHY_NOT, _CUDA_WHY_NOT = _load()
_TWINS_CHOSEN = os.environ.get("YAFSDP_KERNELS", "").strip().lower() == "torch"
_EXT_DEVICES = frozenset(
    (["cpu"] if _C is not None else []) + (["cuda"] if _C_CUDA is not None else [])
)
_ops = torch.ops.yafsdp if _C is not None else None


def backend(device_type: Union[str, torch.device] = "cpu") -> str:
    """Which kernels run on tensors of ``device_type``: ``"extension"`` or ``"torch"`` (the twins)."""
    if isinstance(device_type, torch.device):
        device_type = device_type.type
    return "extension" if device_type in _EXT_DEVICES else "torch"


def describe() -> str:
    """One line: the kernels in use and why."""
    if _C is None:
        return f"yafsdp kernels: pure-PyTorch twins ({_WHY_NOT}); build with: {INSTALL_COMMAND}"
    cuda = "CUDA extension" if _C_CUDA is not None else "no CUDA extension (CUDA runs the twins)"
    return f"yafsdp kernels: CPU extension ({_C.cpu_isa()}), {cuda}"


def require_extension(device_type: Union[str, torch.device] = "cpu") -> None:
    """Raise :class:`ExtensionMissingError` unless the compiled kernels serve ``device_type``."""
    if backend(device_type) == "extension":
        return
    dt = device_type.type if isinstance(device_type, torch.device) else device_type
    if _C is None:
        why = _WHY_NOT
    elif dt == "cuda":
        why = (f"{_CUDA_WHY_NOT}: it is not built when torch has no CUDA, nvcc is missing or "
               "YAFSDP_NO_CUDA=1 was set")
    else:
        why = f"no yafsdp kernels exist for device type {dt!r}"
    raise ExtensionMissingError(f"yafsdp's compiled kernels are not available for {dt}: {why}. "
                                f"Build them with: {INSTALL_COMMAND}")


def fallback_reason(device_type: Union[str, torch.device]) -> Optional[str]:
    """Why tensors on ``device_type`` run the pure-PyTorch twins although nobody asked for them
    (``YAFSDP_KERNELS=torch``), or None when the compiled kernels serve them or the twins were
    chosen. A mis-built GPU machine shows up here: ``fallback_reason("cuda")``."""
    dt = device_type.type if isinstance(device_type, torch.device) else device_type
    if _TWINS_CHOSEN or dt in _EXT_DEVICES:
        return None
    if _C is None:
        return _WHY_NOT
    if dt == "cuda":
        return _CUDA_WHY_NOT or "yafsdp._C_cuda is not loaded"
    return f"no yafsdp kernels exist for device type {dt!r}"


log.info(describe())
if torch.cuda.is_available() and fallback_reason("cuda") is not None:  # a mis-built GPU machine: say so loudly
    warnings.warn(f"yafsdp: CUDA is available but its kernels are not: {fallback_reason('cuda')}. FusedAdamW and "
                  f"the engine's casts run the pure-PyTorch twins (slower). Build with: {INSTALL_COMMAND}",
                  RuntimeWarning, stacklevel=2)


def _flat(t: torch.Tensor, like: torch.Tensor) -> bool:
    return (
        t.is_contiguous()
        and t.numel() == like.numel()
        and t.device == like.device
        and t.dtype in _KERNEL_DTYPES
    )


# ---------------------------------------------------------------------------
# cast_: fp32 master -> param_dtype compute copy; reduce output -> fresh grad shard
# ---------------------------------------------------------------------------


def cast_(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``dst[:] = src * scale`` converted to ``dst.dtype``: the product in fp32, then one rounding.

    ``scale=1`` (the default) is a pure conversion: fp32 master -> ``param_dtype`` compute copy.
    With ``scale=1/world`` it folds a reduce-scatter output into a fresh fp32 grad shard.
    """
    if dst.device.type in _EXT_DEVICES and _flat(dst, dst) and _flat(src, dst):
        _ops.cast_.default(dst, src, float(scale))
        return dst
    return cast_reference(dst, src, scale)


# ---------------------------------------------------------------------------
# accumulate_: reduce output -> fp32 grad shard
# ---------------------------------------------------------------------------


def accumulate_(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    """``dst += src * scale``, src in any float dtype, dst fp32 (reduce output -> grad shard)."""
    if (
        dst.device.type in _EXT_DEVICES
        and dst.dtype == torch.float32
        and dst.is_contiguous()
        and _flat(src, dst)
    ):
        _ops.accumulate_.default(dst, src, float(scale))
        return dst
    return accumulate_reference(dst, src, scale)


# ---------------------------------------------------------------------------
# adamw_step_: the fused optimizer step
# ---------------------------------------------------------------------------


def adamw_step_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: Union[float, torch.Tensor],
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    copy_out: Optional[torch.Tensor] = None,
) -> bool:
    """One AdamW step (``torch.optim.AdamW`` semantics) on fp32 ``param``, in place.

    ``step`` is this update's 1-based number (a one-element tensor the caller has already
    incremented); ``lr`` a float or a one-element tensor. On CUDA, tensors on the device are read
    by the kernel: no host synchronisation. ``copy_out``, when given, receives the updated param
    in its dtype in the same pass. Returns True when the compiled kernel ran, False for the twin.
    """
    if (
        param.device.type in _EXT_DEVICES
        and param.dtype == torch.float32
        and param.is_contiguous()
        and _flat(grad, param)
        and exp_avg.dtype == torch.float32
        and _flat(exp_avg, param)
        and exp_avg_sq.dtype == torch.float32
        and _flat(exp_avg_sq, param)
        and (copy_out is None or _flat(copy_out, param))
    ):
        lr_tensor = lr if isinstance(lr, torch.Tensor) else None
        _ops.adamw_step_.default(
            param, grad, exp_avg, exp_avg_sq, step,
            0.0 if lr_tensor is not None else float(lr),
            float(beta1), float(beta2), float(weight_decay), float(eps),
            lr_tensor, copy_out,
        )
        return True
    adamw_step_reference(
        param, grad, exp_avg, exp_avg_sq, step, lr=lr, beta1=beta1, beta2=beta2,
        weight_decay=weight_decay, eps=eps, copy_out=copy_out, exact=False,
    )
    return False


# ---------------------------------------------------------------------------
# nf4_expand_: gathered NF4 records -> param_dtype values (see formats/nf4_codec.py)
# ---------------------------------------------------------------------------


def nf4_expand_(out: torch.Tensor, staging: torch.Tensor, codebook: torch.Tensor, shard_numel: int) -> torch.Tensor:
    """``out`` (1-D, ``world * shard_numel`` elements of float32/bfloat16/float16) <- the NF4 group
    of ``world`` byte records laid end to end in ``staging`` (1-D uint8); ``codebook``: the 16 levels
    in ``out.dtype`` on its device. See [Note: NF4 shard records] in csrc/common.h."""
    if (
        out.device.type in _EXT_DEVICES
        and out.is_contiguous() and out.dtype in _KERNEL_DTYPES
        and staging.is_contiguous() and staging.dtype == torch.uint8 and staging.device == out.device
        and codebook.dtype == out.dtype and codebook.device == out.device
    ):
        _ops.nf4_expand_.default(out, staging, codebook, int(shard_numel))
        return out
    return nf4_expand_reference(out, staging, codebook, shard_numel)


# ---------------------------------------------------------------------------
# FP8 gather records (see [Note: compact trainable gathers] in formats/fp8_codec.py and
# [Note: FP8 gather records] in csrc/common.h)
# ---------------------------------------------------------------------------


def fp8_quantize_(record: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``record`` (1-D uint8, ``fp8.record_bytes(n)``) <- the FP8 record of ``src`` (1-D fp32, n a
    multiple of 128): e4m3 codes, then one float32 scale per 128 values."""
    if (src.device.type in _EXT_DEVICES and src.dtype == torch.float32 and src.is_contiguous()
            and record.is_contiguous() and record.dtype == torch.uint8 and record.device == src.device):
        _ops.fp8_quantize_.default(record, src)
        return record
    return fp8_quantize_reference(record, src)


def fp8_expand_(out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
    """``out`` (1-D, ``world * shard_numel`` elements of float32/bfloat16/float16) <- the values of
    ``world`` FP8 records laid end to end in ``staging`` (1-D uint8)."""
    if (out.device.type in _EXT_DEVICES and out.is_contiguous() and out.dtype in _KERNEL_DTYPES
            and staging.is_contiguous() and staging.dtype == torch.uint8 and staging.device == out.device):
        _ops.fp8_expand_.default(out, staging, int(shard_numel))
        return out
    return fp8_expand_reference(out, staging, shard_numel)


def adamw_step_fp8_(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1: float, beta2: float, weight_decay: float,
                    eps: float, record: torch.Tensor) -> bool:
    """:func:`adamw_step_` whose copy-out is the FP8 record of the updated param, written in the same
    pass (``param.numel()`` a multiple of 128). Returns True when the compiled kernel ran."""
    if (
        param.device.type in _EXT_DEVICES
        and param.dtype == torch.float32
        and param.is_contiguous()
        and _flat(grad, param)
        and exp_avg.dtype == torch.float32 and _flat(exp_avg, param)
        and exp_avg_sq.dtype == torch.float32 and _flat(exp_avg_sq, param)
        and record.is_contiguous() and record.dtype == torch.uint8 and record.device == param.device
    ):
        lr_tensor = lr if isinstance(lr, torch.Tensor) else None
        _ops.adamw_step_fp8_.default(
            param, grad, exp_avg, exp_avg_sq, step,
            0.0 if lr_tensor is not None else float(lr),
            float(beta1), float(beta2), float(weight_decay), float(eps), lr_tensor, record,
        )
        return True
    adamw_step_fp8_reference(param, grad, exp_avg, exp_avg_sq, step, record=record, exact=False, lr=lr, beta1=beta1,
                             beta2=beta2, weight_decay=weight_decay, eps=eps)
    return False
