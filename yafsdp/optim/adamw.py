"""FusedAdamW: torch.optim.AdamW in one memory pass, with the all-gather input written in it.

    opt = yafsdp.FusedAdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)

Same constructor, defaults, param-group options and ``state_dict()`` format as
``torch.optim.AdamW``: a checkpoint of one loads into the other. Each step is one kernel per
parameter (``yafsdp.kernels.adamw_step_``) reading param, grad, exp_avg, exp_avg_sq and writing
param, exp_avg, exp_avg_sq: 28 bytes per fp32 parameter.

With a YaFSDP model (``param_dtype`` other than fp32) each flat master shard ``p`` has a
registered copy-out (``yafsdp.shards.copy_out_of(p)``): the ``param_dtype`` all-gather input.
The kernel writes it in the same pass (30 bytes per parameter with bf16) and then tells the
engine, which skips its own cast pass for that unit. See [Note: copy-out contract].

[Note: copy-out contract]
For each parameter with a gradient: if ``yafsdp.shards.copy_out_of(p)`` is set (registered with
``yafsdp.shards.set_copy_out(p, copy, written)``), ``copy`` must be contiguous with ``p.numel()``
elements on ``p``'s device; the step writes ``p.to(copy.dtype)`` into it and then calls
``written()`` (no arguments). The engine records ``p._version`` at that call; any later in-place
change of ``p`` bumps the version and makes the engine cast again. A copy-out with
``format=`` a gather format's name ("fp8", "int8": ``yafsdp.formats``) is ``p``'s record in that
format (the all-gather input of a trainable group gathered compact): the step writes the record of
the freshly updated values (``Format.adamw_step_``: for FP8 in the same pass,
``kernels.adamw_step_fp8_``). Parameters without a registered copy-out get a plain AdamW step.

[Note: per-parameter steps]
DDP's AdamW keeps a step count per parameter, and a parameter no rank used in a step (an MoE
expert no token reached, a block LayerDrop skipped) has no gradient, so its count stays. A flat
shard holds many parameters; its ``state["step"]`` counts the shard's steps. For a YaFSDP shard
FusedAdamW also keeps ``state["param_step"]`` (float32, shape ``(1, parameters of the unit)``, in
layout order, the same on every rank: checkpoints save it once and it reshards) and advances it by
the engine's agreed usage bytes (``unused.step_usage``; see [Note: parameters no rank used]), on
the device, without a host sync. While every count equals ``step`` the shard is one kernel call,
as before. Once they differ the shard is stepped one parameter slice at a time, each with its own
count as the kernel's ``step`` -- the same kernel, so the values are those of DDP's per-parameter
AdamW to the bit the kernel gives (an FP8 copy-out is then quantized once over the shard after the
slices: the twin's order). A parameter no rank used is stepped too and then put back by the
engine's restore. Cost once counts differ: one call per run of adjacent parameters with equal
counts on the CPU (the counts are read there for free), one launch per parameter of that shard on
CUDA (reading the counts would synchronise the host). The host knows
the counts are equal when this rank used every parameter so far; on CUDA a shard that was ever
partly unused here stays on the per-parameter path (on the CPU the counts are compared each step).
A state without ``param_step`` (a torch AdamW checkpoint) starts every count at ``step``.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Optional

import torch

from .. import formats, kernels
from ..engine import shards
from . import unused

__all__ = ["FusedAdamW"]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) as one fused pass per parameter; see the module docstring.

    Arguments are those of ``torch.optim.AdamW``. Supported: ``lr`` as a float or a one-element
    tensor (on CUDA a device tensor needs no host synchronisation), ``betas``, ``eps``,
    ``weight_decay``. Not supported, and rejected with an error: ``amsgrad=True``,
    ``maximize=True``, ``differentiable=True``. ``foreach`` and ``capturable`` are accepted and kept
    in the param groups for checkpoint compatibility but change nothing: ``step`` always lives on
    the parameter's device, as with torch's ``capturable``/``fused`` modes. ``fused=None`` (the
    default) uses the compiled kernels where they are built and the pure-PyTorch twin elsewhere;
    ``fused=True`` requires the compiled kernels (an error with the install command otherwise);
    ``fused=False`` always uses the twin.

    Parameters must be contiguous float32 tensors of any shape; gradients float32, bfloat16 or
    float16 (a YaFSDP grad shard, or a parameter whose ``grad_dtype`` allows it).
    """

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
    ) -> None:
        if isinstance(lr, torch.Tensor):
            if lr.numel() != 1:
                raise ValueError(f"Tensor lr must be 1-element, got shape={tuple(lr.shape)}")
        elif not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        betas = tuple(float(b) for b in betas)
        if len(betas) != 2:
            raise ValueError(f"betas must be two values, got {betas}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=True,
        )
        super().__init__(params, defaults)

    # Same keys and defaults as torch.optim.AdamW, so either loads the other's state_dict.
    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("fused", None)
            group["decoupled_weight_decay"] = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.__dict__.pop("_counts_differ", None)  # per-parameter counts: compared again at the next step
        # torch.optim.AdamW keeps `step` on the CPU unless capturable/fused; ours lives on the
        # parameter's device (the kernel reads it there), as float32.
        for group in self.param_groups:
            self._check_group(group)
            for p in group["params"]:
                state = self.state.get(p)
                if state and "step" in state:
                    step = state["step"]
                    if not torch.is_tensor(step):
                        step = torch.tensor(float(step))
                    state["step"] = step.to(device=p.device, dtype=torch.float32)

    @staticmethod
    def _check_group(group: dict[str, Any]) -> None:
        for option, supported in (("amsgrad", False), ("maximize", False), ("differentiable", False)):
            if bool(group.get(option, supported)) != supported:
                raise ValueError(
                    f"FusedAdamW does not support {option}={group[option]!r}; "
                    f"use torch.optim.AdamW({option}={group[option]!r})"
                )
        if group.get("decoupled_weight_decay", True) is False:
            raise ValueError("FusedAdamW is AdamW: decoupled_weight_decay must be True")
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"Tensor lr must be 1-element, got shape={tuple(lr.shape)}")
        if group.get("fused"):
            for device_type in sorted({p.device.type for p in group["params"]}):
                kernels.require_extension(device_type)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._check_group(group)
            work = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                work.append((p, self._prepare(p), self._init_state(p)))
            if not work:
                continue
            segmented = {id(p): self._count_param_steps(p, state) for p, _, state in work}
            # Every parameter's step counter, in one op (on CUDA: one launch, no sync).
            torch._foreach_add_([state["step"] for _, _, state in work], 1.0)
            beta1, beta2 = group["betas"]
            use_twin = group.get("fused") is False
            if not use_twin:
                self._warn_fallback(work)
            for p, grad, state in work:
                out = shards.copy_out_of(p)
                fmt = _format_of(out)
                copy = out.copy if out is not None else None
                if copy is not None:
                    _check_copy(p, copy, fmt)
                args = dict(
                    lr=_lr_for(group["lr"], p),
                    beta1=float(beta1),
                    beta2=float(beta2),
                    weight_decay=float(group["weight_decay"]),
                    eps=float(group["eps"]),
                )
                if segmented[id(p)]:  # See [Note: per-parameter steps]
                    self._step_by_parameter(p, grad, state, copy, fmt, args, use_twin)
                    if out is not None:
                        out.written()
                    continue
                if fmt is not None:  # the copy is p's record: [Note: gather formats] in formats/base.py
                    fmt.adamw_step_(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], record=copy,
                                    twin=use_twin, **args)
                    out.written()
                    continue
                args["copy_out"] = copy
                if use_twin:
                    kernels.adamw_step_reference(
                        p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"],
                        exact=False, **args,
                    )
                else:
                    kernels.adamw_step_(p, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], **args)
                if out is not None:
                    out.written()
        return loss

    def _count_param_steps(self, p: torch.Tensor, state: dict) -> bool:
        """Advance ``param_step`` by the agreed usage (before ``step`` is incremented); True when
        the shard must be stepped parameter by parameter. See [Note: per-parameter steps]."""
        usage = unused.step_usage(self, p)
        info = shards.info_of(p)
        if usage is None or info is None or info.kind != "trainable":
            return False
        n = len(info.param_names)
        differ = self.__dict__.setdefault("_counts_differ", {})
        ps = state.get("param_step")
        if ps is None:  # a fresh state, or one from torch AdamW: every parameter at the shard's count
            ps = state["param_step"] = state["step"].detach().reshape(1, 1).expand(1, n).clone()
            differ[id(p)] = False
        elif tuple(ps.shape) != (1, n):
            raise ValueError(
                f"FusedAdamW: the state of shard {info.name!r} (unit {info.unit!r}, {n} parameters) holds "
                f"param_step of shape {tuple(ps.shape)}; it belongs to another model. Load a state saved for this one")
        ps.add_(usage.agreed.view(1, n))
        if not usage.used_here:
            differ[id(p)] = True  # some rank may have used what this one did not: unknown here
        known = differ.get(id(p))
        if known is None or (known and ps.device.type == "cpu"):  # after a load; on the CPU, every step
            known = differ[id(p)] = not bool((ps == state["step"] + 1).all())
        return known

    @staticmethod
    def _step_by_parameter(p, grad, state, copy, fmt, args, use_twin: bool) -> None:
        """One kernel call per parameter slice of shard ``p``, each with its own step count."""
        info = shards.info_of(p)
        # A parameter no rank has used yet has count 0 (a division by zero in the bias correction);
        # its slice is put back after the step anyway, so any count will do: 1.
        counts = state["param_step"][0].clamp(min=1.0)
        flat, m, v = p.detach().view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
        g = grad.view(-1)
        start, end = info.shard_start, info.shard_start + info.shard_numel
        runs: list[list[int]] = []  # [lo, hi, j]: parameter j's slice of the shard
        for j, (off, shape) in enumerate(zip(info.param_offsets, info.param_shapes)):
            lo, hi = max(off, start) - start, min(off + math.prod(shape), end) - start
            if hi > lo:  # else not on this rank (the padding after the last parameter stays zero)
                runs.append([lo, hi, j])
        if counts.device.type == "cpu" and runs:  # counts readable for free: adjacent equal counts, one call
            host, merged = counts.tolist(), [runs[0]]
            for lo, hi, j in runs[1:]:
                if merged[-1][1] == lo and host[merged[-1][2]] == host[j]:
                    merged[-1][1] = hi
                else:
                    merged.append([lo, hi, j])
            runs = merged
        for lo, hi, j in runs:
            seg = dict(args, copy_out=copy.view(-1)[lo:hi] if copy is not None and fmt is None else None)
            if use_twin:
                kernels.adamw_step_reference(flat[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], counts[j], exact=False, **seg)
            else:
                kernels.adamw_step_(flat[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], counts[j], **seg)
        if fmt is not None:  # the record of the whole updated shard, as the fused step writes it
            fmt.encode_(copy, flat, twin=use_twin)

    def _warn_fallback(self, work) -> None:
        """Once per device type: the compiled kernels were expected (``fused=None``) but the
        parameters there run the pure-PyTorch twin, e.g. a GPU machine whose CUDA extension did
        not build. Loud, because the twin moves ~3x the bytes of the fused kernel."""
        warned = self.__dict__.setdefault("_fallback_warned", set())
        for p, _, _ in work:
            dt = p.device.type
            if dt in warned:
                continue
            warned.add(dt)
            why = kernels.fallback_reason(dt)
            if why is not None:
                warnings.warn(
                    f"yafsdp.FusedAdamW: {dt} parameters run the pure-PyTorch fallback, not the fused kernel "
                    f"({why}). Build the kernels with: {kernels.INSTALL_COMMAND}; pass fused=False to choose "
                    "the fallback and silence this warning.",
                    RuntimeWarning, stacklevel=3,
                )

    @staticmethod
    def _prepare(p: torch.Tensor) -> torch.Tensor:
        """Check p and return its grad, ready for the kernel."""
        grad = p.grad
        if grad.is_sparse:
            raise RuntimeError("FusedAdamW does not support sparse gradients")
        if p.dtype != torch.float32:
            raise TypeError(
                f"FusedAdamW updates float32 parameters; got dtype={p.dtype} shape={tuple(p.shape)}. "
                "Keep fp32 master weights (YaFSDP does) or use torch.optim.AdamW"
            )
        if not p.is_contiguous():
            raise ValueError(
                f"FusedAdamW needs contiguous parameters; got shape={tuple(p.shape)} "
                f"strides={p.stride()}"
            )
        if grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"FusedAdamW takes float32/bfloat16/float16 gradients; got {grad.dtype}")
        if grad.shape != p.shape:
            raise ValueError(f"gradient shape={tuple(grad.shape)} != parameter shape={tuple(p.shape)}")
        return grad if grad.is_contiguous() else grad.contiguous()


def _format_of(out) -> formats.Format | None:
    """The gather format a registered copy-out writes (None: values)."""
    if out is None or out.format is None:
        return None
    fmt = formats.get(out.format) if out.format in {f.name for f in formats.gather_formats()} else None
    if fmt is None:
        raise ValueError(f"the copy-out registered for p (yafsdp.shards.set_copy_out) has format={out.format!r}; "
                         "FusedAdamW writes format None (values) or one of "
                         f"{[f.name for f in formats.gather_formats()]} (a record of that gather format)")
    return fmt


def _check_copy(p: torch.Tensor, copy: torch.Tensor, fmt: formats.Format | None = None) -> None:
    if fmt is not None:
        fmt.check_copy(p, copy)
        return
    if not (
        isinstance(copy, torch.Tensor)
        and copy.is_contiguous()
        and copy.numel() == p.numel()
        and copy.device == p.device
        and copy.dtype in _GRAD_DTYPES
    ):
        raise ValueError(
            "the copy-out registered for p (yafsdp.shards.set_copy_out) must be a contiguous float32/bfloat16/float16 tensor with "
            f"p.numel()={p.numel()} elements on {p.device}; got "
            + (
                f"dtype={copy.dtype} numel={copy.numel()} device={copy.device} "
                f"contiguous={copy.is_contiguous()}"
                if isinstance(copy, torch.Tensor)
                else repr(type(copy))
            )
        )


def _lr_for(lr: float | torch.Tensor, p: torch.Tensor) -> float | torch.Tensor:
    """lr as the kernel takes it: a float, or a tensor on p's device or the CPU (never a sync)."""
    if not isinstance(lr, torch.Tensor):
        return float(lr)
    if lr.device.type == "cpu":
        return lr  # read on the host by the kernel's binding: no synchronisation
    if lr.device == p.device:
        return lr if lr.dtype == torch.float32 else lr.float()  # the kernel reads float32
    return lr.item()  # an accelerator lr for a parameter elsewhere: read it once
