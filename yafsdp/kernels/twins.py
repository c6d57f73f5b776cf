"""The pure-PyTorch twins of the hot-path kernels (``*_reference``): what runs when the extension is
not built for a device or the arguments are not flat, and the references the kernel tests compare
the extension against. Each computes what its kernel in ``yafsdp.kernels`` computes, in the same
order of roundings (the contracts are the dispatchers' docstrings there)."""
from __future__ import annotations

from typing import Optional, Union

import torch

# The NF4 and FP8 record layouts the compiled kernels hard-code ([Note: NF4 shard records], [Note: FP8
# gather records] in csrc/common.h); formats/nf4_codec.py and formats/fp8_codec.py take them from here,
# so the kernels import no module of the formats they serve.
NF4_BLOCK = 64
FP8_BLOCK = 128
FP8_MAX = 448.0


def _adamw_device_scalars(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, weight_decay, eps,
                          copy_out, exact):
    """The AdamW step with its scalars as tensors: no ``.item()``, no host synchronisation."""
    t = step if isinstance(step, torch.Tensor) else torch.tensor(float(step), device=param.device)
    t = t.to(device=param.device, dtype=torch.float32)
    g = grad if grad.dtype == param.dtype else grad.to(param.dtype)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)  # lr a float or a one-element tensor: no sync either way
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - torch.pow(beta1, t)
    bias_correction2_sqrt = (1 - torch.pow(beta2, t)).sqrt()
    root = exp_avg_sq.double().sqrt().float() if exact else exp_avg_sq.sqrt()
    denom = (root / bias_correction2_sqrt).add_(eps)
    # param -= lr / bias_correction1 * exp_avg / denom, with the step size folded into the divisor
    param.addcdiv_(exp_avg, denom.mul_(bias_correction1 / -lr))
    if copy_out is not None:
        copy_out.copy_(param.view_as(copy_out))


def nf4_record_bytes(shard_numel: int, dtype: torch.dtype) -> int:
    """Bytes of one rank's NF4 record: packed codes, then one ``dtype`` scale per block."""
    return shard_numel // 2 + (shard_numel // NF4_BLOCK) * torch.empty((), dtype=dtype, device="meta").element_size()


def fp8_record_bytes(shard_numel: int) -> int:
    """Bytes of one rank's FP8 record: one e4m3 code per element, then one float32 scale per block."""
    return shard_numel + (shard_numel // FP8_BLOCK) * 4


def cast_reference(dst: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Twin of :func:`cast_`: ``dst.copy_(src)``; with a scale, the product in fp32 first."""
    if scale == 1.0:
        return dst.copy_(src)
    product = src.to(torch.float32) * scale  # fp32 math even for a bf16 src (torch.mul would not)
    return dst.copy_(product)


def accumulate_reference(dst: torch.Tensor, src: torch.Tensor, scale: float) -> torch.Tensor:
    """Twin of :func:`accumulate_`: ``dst.add_(src.to(dst.dtype), alpha=scale)``."""
    return dst.add_(src.to(dst.dtype) if src.dtype != dst.dtype else src, alpha=scale)


def _value(x: Union[float, torch.Tensor]) -> float:
    return x.item() if isinstance(x, torch.Tensor) else float(x)


def adamw_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: Union[float, torch.Tensor],
    *,
    lr: Union[float, torch.Tensor],
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    copy_out: Optional[torch.Tensor] = None,
    exact: bool = True,
    host_scalars: Optional[bool] = None,
) -> None:
    """Twin of :func:`adamw_step_`, op for op as ``torch.optim.AdamW(foreach=False)``.

    ``exact=True`` takes the square root in float64, which rounds to the IEEE float32 sqrt the
    kernels compute (torch's CPU sqrt is not correctly rounded); on the CPU the kernels then match
    this twin bit for bit. The run-time fallback uses ``exact=False`` (no float64 temporary).

    ``host_scalars``: read ``step`` and ``lr`` on the host (``.item()``, as torch's for-loop
    AdamW does). ``None`` (default): only when neither lives on an accelerator; otherwise the
    bias corrections and the step size stay device tensors and the step never synchronises the
    host (the run-time fallback for CUDA parameters), rounding within a few ulp of the host path.
    """
    if host_scalars is None:
        host_scalars = all(not isinstance(x, torch.Tensor) or x.device.type == "cpu" for x in (step, lr))
    if not host_scalars:
        _adamw_device_scalars(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, weight_decay, eps,
                              copy_out, exact)
        return
    t = _value(step)
    lr = _value(lr)
    g = grad if grad.dtype == param.dtype else grad.to(param.dtype)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    root = exp_avg_sq.double().sqrt().float() if exact else exp_avg_sq.sqrt()
    denom = (root / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))
    if copy_out is not None:
        copy_out.copy_(param.view_as(copy_out))


def nf4_expand_reference(out: torch.Tensor, staging: torch.Tensor, codebook: torch.Tensor,
                         shard_numel: int) -> torch.Tensor:
    """Twin of :func:`nf4_expand_`: ``codebook[code] * scale`` in ``out.dtype``, record by record."""
    world = out.numel() // shard_numel
    rec = staging.view(world, nf4_record_bytes(shard_numel, out.dtype))
    half = shard_numel // 2
    data = rec[:, :half]
    scales = rec[:, half:].contiguous().view(out.dtype).view(world, shard_numel // NF4_BLOCK, 1)
    levels = torch.stack([codebook[(data >> 4).long()], codebook[(data & 15).long()]], dim=-1)
    with torch.no_grad():
        out.view(world, shard_numel // NF4_BLOCK, NF4_BLOCK).copy_(levels.view(world, -1, NF4_BLOCK) * scales)
    return out


@torch.no_grad()
def fp8_codes(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values (1-D, a multiple of 128) -> (codes as uint8, float32 scales): the twin's arithmetic,
    with torch's own ``float8_e4m3fn`` cast (round to nearest even)."""
    blocks = values.to(torch.float32).view(-1, FP8_BLOCK)
    amax = blocks.abs().amax(dim=1)
    scales = amax / amax.new_full((), FP8_MAX)  # a true division on CUDA too (see formats/int8.quantize)
    q = (blocks / scales.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX)
    q = q.masked_fill_((scales == 0).unsqueeze(1), 0.0)  # a zero block: scale 0, codes 0 (not 0/0)
    return q.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1), scales


def fp8_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(codes, scales) -> values in ``dtype``: the fp32 product, then one rounding."""
    v = codes.view(torch.float8_e4m3fn).to(torch.float32).view(-1, FP8_BLOCK) * scales.view(-1, 1)
    return v.reshape(-1).to(dtype)


def fp8_quantize_reference(record: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`fp8_quantize_`, with torch's own ``float8_e4m3fn`` cast."""
    n = src.numel()
    codes, scales = record[:n], record[n:fp8_record_bytes(n)].view(torch.float32)
    c, s = fp8_codes(src.detach().reshape(-1))
    with torch.no_grad():
        codes.copy_(c)
        scales.copy_(s)
    return record


def fp8_expand_reference(out: torch.Tensor, staging: torch.Tensor, shard_numel: int) -> torch.Tensor:
    """Twin of :func:`fp8_expand_`: ``float(code) * scale`` in fp32, rounded once to ``out.dtype``."""
    world = out.numel() // shard_numel
    rec = staging.view(world, fp8_record_bytes(shard_numel))
    codes = rec[:, :shard_numel].reshape(-1)
    scales = rec[:, shard_numel:].contiguous().view(torch.float32).reshape(-1)
    with torch.no_grad():
        out.copy_(fp8_values(codes, scales, out.dtype))
    return out


def adamw_step_fp8_reference(param, grad, exp_avg, exp_avg_sq, step, *, record: torch.Tensor, exact: bool = True,
                             **hyper) -> None:
    """Twin of :func:`adamw_step_fp8_`: the AdamW twin, then the quantizer twin on the updated param."""
    adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step, exact=exact, **hyper)
    fp8_quantize_reference(record, param.detach().view(-1))
